//! Keeping every shard's prefix-index replica current, and session bindings and RAG
//! chunk holdings with it.
//!
//! A shard that routes a request applies the insert to its own replica at once and
//! sends an [`IndexEvent`] to the coordinator over crossbeam. The coordinator applies
//! it to the authoritative index, numbers it, and fans the same `Arc` out to every
//! other shard, which applies it between requests. Replicas are eventually
//! consistent; the lag (events sent but not yet applied, and the age of each event
//! when applied) is exported per shard.

use radixgate_orchestrator::{BackendIdx, ChunkIndex, PrefixIndex};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

#[derive(Debug)]
pub enum IndexOp {
    /// `backend` now holds this whole chain of blocks.
    Insert {
        backend: BackendIdx,
        blocks: Arc<[u64]>,
        now_ms: u64,
    },
    /// `backend` no longer holds `blocks[from..]` (a failed attempt rolled back, or an
    /// engine eviction).
    Remove {
        backend: BackendIdx,
        blocks: Arc<[u64]>,
        from: usize,
    },
    /// The backend's capacity in the index: configured (which declares a new
    /// backend) or reported by the engine.
    SetCapacity { backend: BackendIdx, blocks: usize },
    /// The engine's cache was cleared, or its KV events had a gap: the backend
    /// holds nothing now (its capacity stays).
    Clear { backend: BackendIdx },
    /// The backend was removed: drop every block it held and undeclare it.
    RemoveBackend { backend: BackendIdx },
    /// `backend` was sent these RAG chunks (ids).
    HoldChunks {
        backend: BackendIdx,
        chunks: Arc<[u64]>,
        now_ms: u64,
    },
    /// The conversation `session` (hash of its `X-Session-ID`) lives on `backend`.
    BindSession {
        session: u64,
        backend: BackendIdx,
        now_ms: u64,
    },
}

#[derive(Debug)]
pub struct IndexEvent {
    pub origin_shard: usize,
    pub created: Instant,
    pub op: IndexOp,
}

impl IndexEvent {
    pub fn apply(
        &self,
        index: &mut PrefixIndex,
        sessions: &mut SessionTable,
        chunks: &mut ChunkIndex,
    ) {
        match &self.op {
            IndexOp::Insert {
                backend,
                blocks,
                now_ms,
            } => index.insert(*backend, blocks, *now_ms),
            IndexOp::Remove {
                backend,
                blocks,
                from,
            } => index.remove(*backend, blocks, *from),
            IndexOp::SetCapacity { backend, blocks } => index.set_capacity(*backend, *blocks),
            IndexOp::Clear { backend } => {
                let capacity = index.capacity(*backend);
                index.remove_backend(*backend);
                index.set_capacity(*backend, capacity);
                chunks.remove_backend(*backend);
            }
            IndexOp::RemoveBackend { backend } => {
                index.remove_backend(*backend);
                chunks.remove_backend(*backend);
            }
            IndexOp::HoldChunks {
                backend,
                chunks: ids,
                now_ms,
            } => chunks.insert(*backend, ids, *now_ms),
            IndexOp::BindSession {
                session,
                backend,
                now_ms,
            } => sessions.bind(*session, *backend, *now_ms),
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

/// Session → backend bindings with a time-to-live and a size bound.
pub struct SessionTable {
    bindings: HashMap<u64, (BackendIdx, u64)>,
    ttl_ms: u64,
    max: usize,
}

impl SessionTable {
    pub fn new(ttl_ms: u64, max: usize) -> Self {
        Self {
            bindings: HashMap::new(),
            ttl_ms,
            max,
        }
    }

    pub fn get(&self, session: u64, now_ms: u64) -> Option<BackendIdx> {
        self.bindings
            .get(&session)
            .filter(|(_, seen)| now_ms.saturating_sub(*seen) <= self.ttl_ms)
            .map(|(b, _)| *b)
    }

    /// The session's backend and when it was last bound, expired or not.
    pub fn binding(&self, session: u64) -> Option<(BackendIdx, u64)> {
        self.bindings.get(&session).copied()
    }

    pub fn bind(&mut self, session: u64, backend: BackendIdx, now_ms: u64) {
        if self.bindings.len() >= self.max && !self.bindings.contains_key(&session) {
            // Drop expired bindings; if none expired, the oldest half.
            let ttl = self.ttl_ms;
            self.bindings
                .retain(|_, (_, seen)| now_ms.saturating_sub(*seen) <= ttl);
            if self.bindings.len() >= self.max {
                let mut ages: Vec<u64> = self.bindings.values().map(|(_, s)| *s).collect();
                ages.sort_unstable();
                let cutoff = ages[ages.len() / 2];
                self.bindings.retain(|_, (_, seen)| *seen > cutoff);
            }
        }
        let entry = self.bindings.entry(session).or_insert((backend, now_ms));
        entry.0 = backend;
        entry.1 = entry.1.max(now_ms);
    }

    pub fn len(&self) -> usize {
        self.bindings.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bindings.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_expire_and_stay_bounded() {
        let mut t = SessionTable::new(100, 4);
        t.bind(1, 0, 0);
        assert_eq!(t.get(1, 50), Some(0));
        assert_eq!(t.get(1, 500), None);
        for s in 2..20 {
            t.bind(s, 1, s * 10);
        }
        assert!(t.len() <= 4);
        assert_eq!(t.get(19, 190), Some(1));
    }
}
