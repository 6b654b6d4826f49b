//! What shards know about the backends: an immutable [`FleetSnapshot`] published by
//! the coordinator on every change, and the cross-shard [`InFlight`] counters.
//!
//! Snapshots arrive whole (one `Arc` swap per change), so a shard never sees half an
//! update: the backend table and live settings ([`LiveConfig`]) travel inside them,
//! next to each slot's health, breaker, drain state and engine load, and the LoRA
//! adapters learned from the engines ([`AdapterTable`]). In-flight counts are the one piece of fleet state written on the request
//! path; each shard writes only its own padded slots (one writer per cache line, so
//! plain relaxed load+store with no locked instruction), and readers sum the rows.
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

#[repr(align(64))]
#[derive(Default)]
struct PaddedCounter(AtomicU32);

pub struct InFlight {
    /// `rows[shard][backend]`, then (in cluster mode) one row for the peers.
    rows: Box<[Box<[PaddedCounter]>]>,
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
            .map(|_| (0..backends).map(|_| PaddedCounter::default()).collect())
            .collect();
        Self { rows, local_rows }
    }

    /// Called only by `shard` itself (single writer per slot).
    pub fn increment(&self, shard: usize, backend: usize) {
        self.add(shard, backend, 1);
    }

    /// Called only by `shard` itself (single writer per slot).
    pub fn decrement(&self, shard: usize, backend: usize) {
        self.sub(shard, backend, 1);
    }

    /// Called only by `shard` itself (single writer per slot).
    pub fn add(&self, shard: usize, backend: usize, n: u32) {
        let c = &self.rows[shard][backend].0;
        c.store(
            c.load(Ordering::Relaxed).saturating_add(n),
            Ordering::Relaxed,
        );
    }

    /// Called only by `shard` itself (single writer per slot).
    pub fn sub(&self, shard: usize, backend: usize, n: u32) {
        let c = &self.rows[shard][backend].0;
        c.store(
            c.load(Ordering::Relaxed).saturating_sub(n),
            Ordering::Relaxed,
        );
    }

    /// The count of one shard for one backend.
    pub fn get(&self, shard: usize, backend: usize) -> u32 {
        self.rows[shard][backend].0.load(Ordering::Relaxed)
    }

    /// The count for `backend` summed over all shards, and the peers in cluster mode.
    pub fn total(&self, backend: usize) -> u32 {
        self.rows
            .iter()
            .map(|row| row[backend].0.load(Ordering::Relaxed))
            .sum()
    }

    /// The count for `backend` over this replica's shards only (what it reports to
    /// its peers).
    pub fn local_total(&self, backend: usize) -> u32 {
        self.rows[..self.local_rows]
            .iter()
            .map(|row| row[backend].0.load(Ordering::Relaxed))
            .sum()
    }

    /// The peers' count for `backend` (0 without the peers' row).
    pub fn peers(&self, backend: usize) -> u32 {
        self.rows
            .get(self.local_rows)
            .map_or(0, |row| row[backend].0.load(Ordering::Relaxed))
    }

    /// Sets the peers' count for `backend` (cluster thread only; no-op without the
    /// peers' row).
    pub fn set_peers(&self, backend: usize, n: u32) {
        if let Some(row) = self.rows.get(self.local_rows) {
            row[backend].0.store(n, Ordering::Relaxed);
        }
    }
}

/// Decrements the in-flight slot when the request ends, however it ends (including
/// a client that disconnects and drops the request's future).
pub struct InFlightGuard<'a> {
    counters: &'a InFlight,
    shard: usize,
    backend: usize,
    amount: u32,
}

impl<'a> InFlightGuard<'a> {
    /// Counts one request.
    pub fn enter(counters: &'a InFlight, shard: usize, backend: usize) -> Self {
        Self::add(counters, shard, backend, 1)
    }

    /// Counts `amount` (a request's predicted uncached prompt tokens, for the pending
    /// prefill counters) until dropped.
    pub fn add(counters: &'a InFlight, shard: usize, backend: usize, amount: u32) -> Self {
        counters.add(shard, backend, amount);
        Self {
            counters,
            shard,
            backend,
            amount,
        }
    }
}

impl Drop for InFlightGuard<'_> {
    fn drop(&mut self) {
        self.counters.sub(self.shard, self.backend, self.amount);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_rows_and_guard_releases() {
        let f = InFlight::new(2, 3);
        {
            let _a = InFlightGuard::enter(&f, 0, 1);
            let _b = InFlightGuard::enter(&f, 1, 1);
            assert_eq!(f.total(1), 2);
            assert_eq!(f.total(0), 0);
        }
        assert_eq!(f.total(1), 0);
        {
            let _a = InFlightGuard::add(&f, 0, 2, 300);
            let _b = InFlightGuard::add(&f, 1, 2, 45);
            assert_eq!(f.total(2), 345);
        }
        assert_eq!(f.total(2), 0);
    }

    #[test]
    fn the_peers_row_counts_in_the_total_not_in_the_local_total() {
        let f = InFlight::with_peers(2, 3);
        let _a = InFlightGuard::enter(&f, 1, 2);
        f.set_peers(2, 5);
        assert_eq!((f.total(2), f.local_total(2), f.peers(2)), (6, 1, 5));
        f.set_peers(2, 0);
        assert_eq!(f.total(2), 1);
        // Without the row, setting the peers' count does nothing.
        let g = InFlight::new(1, 3);
        g.set_peers(2, 5);
        assert_eq!(g.total(2), 0);
    }
}
