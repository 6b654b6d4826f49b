//! What shards know about the backends: an immutable [`FleetSnapshot`] published by
//! the coordinator on every change, and the cross-shard [`InFlight`] counters.
//!
//! Snapshots arrive whole (one `Arc` swap per change), so a shard never sees half an
//! update: the backend table and live settings ([`LiveConfig`]) travel inside them,
//! next to each slot's health, breaker, drain state and engine load, and the LoRA
//! adapters learned from the engines ([`AdapterTable`]). In-flight counts are the one piece of fleet state written on the request
//! path: per backend, the requests in flight and their prompts' blocks (what the
//! engine must keep in its cache for them while they run). Each shard writes only its
//! own padded slots (one writer per cache line, so plain relaxed load+store with no
//! locked instruction), and readers sum the rows.
//! Relaxed ordering is enough: the sum is a load estimate for balancing, nothing
//! synchronises through it, and a momentarily stale count only skews one pick.

use crate::adapters::AdapterTable;
use crate::backends::LiveConfig;
use crate::engine_metrics::EngineLoad;
use radixgate_orchestrator::BreakerState;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

/// Per backend slot (see [`crate::backends`]), retired slots included.
#[derive(Debug, Clone)]
pub struct FleetSnapshot {
    pub version: u64,
    /// The backend table and the settings in force; shared between snapshots until
    /// a backend or setting changes.
    pub live: Arc<LiveConfig>,
    pub healthy: Box<[bool]>,
    /// Each engine's own load as last scraped; `None` when unknown or stale.
    pub engine: Box<[Option<EngineLoad>]>,
    pub breaker: Box<[BreakerState]>,
    /// Draining backends get no new requests (admin API).
    pub draining: Box<[bool]>,
    /// The LoRA adapters the backends serve, as last polled; shared between
    /// snapshots until one changes.
    pub adapters: Arc<AdapterTable>,
}

impl FleetSnapshot {
    /// Every backend healthy, as at start-up.
    pub fn all_healthy(live: Arc<LiveConfig>) -> Self {
        let backends = live.backends.len();
        Self {
            version: 0,
            live,
            healthy: vec![true; backends].into_boxed_slice(),
            engine: vec![None; backends].into_boxed_slice(),
            breaker: vec![BreakerState::Closed; backends].into_boxed_slice(),
            draining: vec![false; backends].into_boxed_slice(),
            adapters: Arc::default(),
        }
    }

    /// The engine's waiting queue, 0 when unknown.
    pub fn engine_waiting(&self, backend: usize) -> u32 {
        self.engine[backend].map_or(0, |e| e.waiting)
    }

    pub fn any_healthy(&self) -> bool {
        self.live.backends.live().any(|(b, _)| self.healthy[b])
    }
}

/// One shard's counts for one backend, alone on its cache line.
#[repr(align(64))]
#[derive(Default)]
struct Slot {
    requests: AtomicU32,
    prompt_blocks: AtomicU32,
}

pub struct InFlight {
    /// `rows[shard][backend]`, then (in cluster mode) one row for the peers.
    rows: Box<[Box<[Slot]>]>,
    /// Rows written by this replica's shards (the rest is the peers' row).
    local_rows: usize,
}

impl InFlight {
    pub fn new(shards: usize, backends: usize) -> Self {
        Self::with_rows(shards, shards, backends)
    }

    /// With one more row, for what the cluster's peers report (written only by the
    /// cluster thread): [`total`](Self::total) then counts the whole fleet.
    pub fn with_peers(shards: usize, backends: usize) -> Self {
        Self::with_rows(shards + 1, shards, backends)
    }

    fn with_rows(rows: usize, local_rows: usize, backends: usize) -> Self {
        let rows = (0..rows)
            .map(|_| (0..backends).map(|_| Slot::default()).collect())
            .collect();
        Self { rows, local_rows }
    }

    /// Counts a request with `prompt_blocks` blocks. Called only by `shard` itself
    /// (single writer per slot).
    pub fn enter(&self, shard: usize, backend: usize, prompt_blocks: u32) {
        let slot = &self.rows[shard][backend];
        add(&slot.requests, 1);
        add(&slot.prompt_blocks, prompt_blocks);
    }

    /// Uncounts what [`Self::enter`] counted. Called only by `shard` itself.
    pub fn leave(&self, shard: usize, backend: usize, prompt_blocks: u32) {
        let slot = &self.rows[shard][backend];
        sub(&slot.requests, 1);
        sub(&slot.prompt_blocks, prompt_blocks);
    }

    /// The count of one shard for one backend.
    pub fn get(&self, shard: usize, backend: usize) -> u32 {
        self.rows[shard][backend].requests.load(Ordering::Relaxed)
    }

    /// The count for `backend` summed over all shards, and the peers in cluster mode.
    pub fn total(&self, backend: usize) -> u32 {
        self.counts(backend).0
    }

    /// The prompt blocks of the requests in flight to `backend` (see [`Self::counts`]).
    #[cfg(test)]
    pub fn prompt_blocks(&self, backend: usize) -> u32 {
        self.counts(backend).1
    }

    /// In one pass over the rows, for `backend`: the requests in flight ([`Self::total`])
    /// and their prompt blocks — this replica's, summed over its shards, and in
    /// cluster mode the peers' requests (which report a count, not their prompts) at
    /// the mean prompt of this replica's own.
    pub fn counts(&self, backend: usize) -> (u32, u32) {
        let (requests, blocks) = self.local(backend);
        let peers = self.peers(backend);
        let theirs = match (peers, requests) {
            (0, _) | (_, 0) => 0,
            _ => u64::from(blocks) * u64::from(peers) / u64::from(requests),
        };
        (
            requests.saturating_add(peers),
            blocks.saturating_add(u32::try_from(theirs).unwrap_or(u32::MAX)),
        )
    }

    /// The count for `backend` over this replica's shards only (what it reports to
    /// its peers).
    pub fn local_total(&self, backend: usize) -> u32 {
        self.local(backend).0
    }

    /// `(requests, prompt blocks)` of this replica's shards for `backend`.
    fn local(&self, backend: usize) -> (u32, u32) {
        self.rows[..self.local_rows]
            .iter()
            .map(|row| &row[backend])
            .fold((0u32, 0u32), |(requests, blocks), slot| {
                (
                    requests.saturating_add(slot.requests.load(Ordering::Relaxed)),
                    blocks.saturating_add(slot.prompt_blocks.load(Ordering::Relaxed)),
                )
            })
    }

    /// The peers' count for `backend` (0 without the peers' row).
    pub fn peers(&self, backend: usize) -> u32 {
        self.rows
            .get(self.local_rows)
            .map_or(0, |row| row[backend].requests.load(Ordering::Relaxed))
    }

    /// Sets the peers' count for `backend` (cluster thread only; no-op without the
    /// peers' row).
    pub fn set_peers(&self, backend: usize, n: u32) {
        if let Some(row) = self.rows.get(self.local_rows) {
            row[backend].requests.store(n, Ordering::Relaxed);
        }
    }
}

/// Uncounts a request in flight when it ends, however it ends (including a client
/// that disconnects and drops the request's future).
pub struct InFlightGuard<'a> {
    counters: &'a InFlight,
    shard: usize,
    backend: usize,
    prompt_blocks: u32,
}

impl<'a> InFlightGuard<'a> {
    /// Counts one request to `backend` with `prompt_blocks` blocks of prompt
    /// ([`radixgate_orchestrator::Decision::prompt_blocks`]) until dropped.
    pub fn enter(counters: &'a InFlight, shard: usize, backend: usize, prompt_blocks: u32) -> Self {
        counters.enter(shard, backend, prompt_blocks);
        Self {
            counters,
            shard,
            backend,
            prompt_blocks,
        }
    }
}

impl Drop for InFlightGuard<'_> {
    fn drop(&mut self) {
        self.counters
            .leave(self.shard, self.backend, self.prompt_blocks);
    }
}

/// Single-writer add: a relaxed load and store, no locked instruction.
fn add(counter: &AtomicU32, n: u32) {
    counter.store(
        counter.load(Ordering::Relaxed).saturating_add(n),
        Ordering::Relaxed,
    );
}

fn sub(counter: &AtomicU32, n: u32) {
    counter.store(
        counter.load(Ordering::Relaxed).saturating_sub(n),
        Ordering::Relaxed,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_rows_and_guard_releases() {
        let f = InFlight::new(2, 3);
        {
            let _a = InFlightGuard::enter(&f, 0, 1, 300);
            let _b = InFlightGuard::enter(&f, 1, 1, 45);
            assert_eq!(f.total(1), 2);
            assert_eq!(f.prompt_blocks(1), 345);
            assert_eq!((f.total(0), f.prompt_blocks(0)), (0, 0));
        }
        assert_eq!((f.total(1), f.prompt_blocks(1)), (0, 0));
    }

    #[test]
    fn the_peers_row_counts_in_the_total_not_in_the_local_total() {
        let f = InFlight::with_peers(2, 3);
        let _a = InFlightGuard::enter(&f, 1, 2, 7);
        f.set_peers(2, 5);
        assert_eq!((f.total(2), f.local_total(2), f.peers(2)), (6, 1, 5));
        // The peers' five requests count at this replica's mean prompt (7 blocks).
        assert_eq!(f.prompt_blocks(2), 42);
        f.set_peers(2, 0);
        assert_eq!(f.total(2), 1);
        // Without the row, setting the peers' count does nothing.
        let g = InFlight::new(1, 3);
        g.set_peers(2, 5);
        assert_eq!(g.total(2), 0);
    }
}
