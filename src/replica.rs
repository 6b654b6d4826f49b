//! Keeping every shard's prefix-index replica current, and session bindings and RAG
//! chunk holdings with it.
//!
//! A shard that routes a request applies the insert to its own replica at once and
//! sends an [`IndexEvent`] to the coordinator over crossbeam. The coordinator applies
//! it to the authoritative index, numbers it, and fans the same `Arc` out to every
//! other shard, which applies it between requests. Replicas are eventually
//! consistent; the lag (events sent but not yet applied, and the age of each event
//! when applied) is exported per shard.

use crate::backends::LiveConfig;
use crate::config::Config;
use radixgate_orchestrator::{ChunkIndex, IndexConfig, PrefixIndex, Replica};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

pub use radixgate_orchestrator::{IndexOp, SessionTable};

#[derive(Debug)]
pub struct IndexEvent {
    pub origin: Origin,
    pub created: Instant,
    pub op: IndexOp,
}

/// Who made an index event: where the coordinator must not send it back, and
/// whether the cluster shares it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// A shard's routing decision: already applied there; the cluster shares it.
    Shard(usize),
    /// This replica's own view of an engine (KV events, capacity, admin changes):
    /// every shard applies it; peers learn such facts themselves.
    Local,
    /// A peer replica's routing decision, from the cluster bus.
    Peer,
}

impl Origin {
    pub fn shard(self) -> Option<usize> {
        match self {
            Origin::Shard(k) => Some(k),
            Origin::Local | Origin::Peer => None,
        }
    }
}

/// Per shard, how many events the coordinator has sent it (written by the
/// coordinator only; read at scrape time to compute how far behind each shard is).
pub struct ReplicaSent {
    sent: Box<[AtomicU64]>,
}

impl ReplicaSent {
    pub fn new(shards: usize) -> Self {
        Self {
            sent: (0..shards).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    pub fn add(&self, shard: usize) {
        self.sent[shard].fetch_add(1, Ordering::Relaxed);
    }

    pub fn get(&self, shard: usize) -> u64 {
        self.sent[shard].load(Ordering::Relaxed)
    }
}

/// A replica with every live backend declared at its configured capacity.
pub fn new_replica(config: &Config, live: &LiveConfig) -> Replica {
    let mut index = PrefixIndex::new(IndexConfig {
        max_blocks: config.routing.index_max_blocks,
    });
    for (i, b) in live.backends.live() {
        index.set_capacity(i, b.cache_blocks);
    }
    Replica::new(
        index,
        SessionTable::new(
            config.routing.session_ttl.as_millis() as u64,
            config.routing.max_sessions,
        ),
        ChunkIndex::new(config.routing.rag_max_chunks),
    )
}
