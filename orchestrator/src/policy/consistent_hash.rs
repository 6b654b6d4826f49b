//! Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, 2018).
//!
//! Every backend id puts `virtual_nodes` points on a 64-bit ring (`xxh3("id#n")`), so a
//! prompt's affinity key has a stable home that survives reordering the config and
//! moves only when its own backend leaves. A request walks clockwise from its key,
//! skipping backends that are not candidates (unhealthy, drained), and takes the first
//! candidate whose in-flight count is below
//! `capacity = ceil(load_factor * (total in flight + 1) / candidates)`. The home gets
//! [`Reason::HashRing`]; when the home is full the request spills to a later backend
//! ([`Reason::HashRingSpill`]), so a hot prefix never loads any backend past capacity.
//! Without a key it falls back to least-loaded ([`Reason::HashNoKey`]).
//!
//! With `load_factor >= 1` some candidate is always under capacity, since the total
//! is below `candidates * capacity`. Only candidates off the ring (backends added
//! after the policy was built) can leave every ring member full; least-loaded over all
//! candidates then decides, reported as a spill.

use xxhash_rust::xxh3::xxh3_64;

use super::least_loaded::LeastLoaded;
use super::{BackendIdx, Candidate, Pick, Reason, RouteInput, RoutingPolicy};

#[derive(Clone, Debug)]
pub struct ConsistentHash {
    /// Virtual points sorted by position; ties broken by backend for determinism.
    ring: Vec<(u64, BackendIdx)>,
    backends: usize,
    load_factor: f64,
    /// Per-call scratch bitsets over backends on the ring, sized once so picks never
    /// allocate: candidates, and candidates below capacity.
    member: Vec<u64>,
    open: Vec<u64>,
    fallback: LeastLoaded,
}

// === impl ConsistentHash ===

impl ConsistentHash {
    /// Builds the ring for `backend_ids` (index = [`BackendIdx`]). `virtual_nodes` is
    /// raised to at least 1 and `load_factor` to at least 1 (NaN counts as 1); an
    /// infinite factor disables the load bound.
    pub fn new(backend_ids: &[String], virtual_nodes: u32, load_factor: f64) -> Self {
        let vnodes = virtual_nodes.max(1);
        let mut ring = Vec::with_capacity(backend_ids.len() * vnodes as usize);
        let mut label = String::new();
        for (backend, id) in backend_ids.iter().enumerate() {
            for n in 0..vnodes {
                label.clear();
                label.push_str(id);
                label.push('#');
                label.push_str(&n.to_string());
                ring.push((xxh3_64(label.as_bytes()), backend));
            }
        }
        ring.sort_unstable();
        let words = backend_ids.len().div_ceil(64);
        Self {
            ring,
            backends: backend_ids.len(),
            load_factor: if load_factor >= 1.0 { load_factor } else { 1.0 },
            member: vec![0; words],
            open: vec![0; words],
            fallback: LeastLoaded::new(),
        }
    }

    /// The bounded-load capacity for this candidate set: a candidate takes the request
    /// only while its in-flight count is below it.
    pub fn capacity(&self, candidates: &[Candidate]) -> u64 {
        let n = candidates.len().max(1) as u64;
        let total: u64 = candidates.iter().map(|c| u64::from(c.in_flight)).sum();
        let demand = total + 1;
        let scaled = (self.load_factor * demand as f64 / n as f64).ceil() as u64;
        // Never below the exact ceil(demand / n), whatever the float rounding did.
        scaled.max(demand.div_ceil(n))
    }

    fn walk(&mut self, key: u64, candidates: &[Candidate]) -> Option<Pick> {
        let capacity = self.capacity(candidates);
        self.member.fill(0);
        self.open.fill(0);
        for c in candidates.iter().filter(|c| c.backend < self.backends) {
            let (word, bit) = (c.backend / 64, 1u64 << (c.backend % 64));
            self.member[word] |= bit;
            if u64::from(c.in_flight) < capacity {
                self.open[word] |= bit;
            }
        }
        if self.open.iter().all(|&w| w == 0) {
            return None;
        }
        let start = self.ring.partition_point(|&(point, _)| point < key);
        let (wrapped, clockwise) = self.ring.split_at(start);
        let mut home_seen = false;
        for &(_, backend) in clockwise.iter().chain(wrapped) {
            let (word, bit) = (backend / 64, 1u64 << (backend % 64));
            if self.member[word] & bit == 0 {
                continue;
            }
            if self.open[word] & bit != 0 {
                let reason = if home_seen {
                    Reason::HashRingSpill
                } else {
                    Reason::HashRing
                };
                return Some(Pick { backend, reason });
            }
            home_seen = true;
        }
        None
    }
}

impl RoutingPolicy for ConsistentHash {
    fn pick(&mut self, input: &RouteInput<'_>, _rng: &mut fastrand::Rng) -> Option<Pick> {
        let candidates = input.candidates;
        if candidates.is_empty() {
            return None;
        }
        let reason = match input.affinity_key {
            Some(key) => match self.walk(key, candidates) {
                Some(pick) => return Some(pick),
                None => Reason::HashRingSpill,
            },
            None => Reason::HashNoKey,
        };
        self.fallback.select(candidates).map(|c| Pick {
            backend: c.backend,
            reason,
        })
    }
}

#[cfg(test)]
mod tests;
