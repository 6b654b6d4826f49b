//! The subscriber's table of peers: fencing by epoch and sequence number, and each
//! peer's last reported load, with a staleness bound.
//!
//! Every publisher numbers its batches per (node, epoch) from 0. A batch from an
//! older epoch of a node that has restarted since is stale, and one whose number
//! was already seen is a duplicate: both are dropped, so a late or repeated message
//! cannot undo a newer one (an eviction stays evicted). A jump in the numbers is a
//! gap: the batches in between were lost (a bus outage) and are counted. A new
//! epoch replaces the node's old state, so a restarted replica's old in-flight
//! counts are dropped at once; a peer that stops reporting is dropped after the
//! timeout, with its load.

use super::wire::Header;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// What to do with a batch.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Apply it; `gap` batches of this publisher went missing before it.
    Apply { gap: u64 },
    /// Already applied.
    Duplicate,
    /// From an older epoch of a publisher that has restarted.
    Stale,
}

struct Peer {
    epoch: u64,
    seq: u64,
    last_seen: Instant,
    /// Backend slot → (in-flight requests, pending prefill tokens), as last reported.
    load: HashMap<usize, (u32, u32)>,
}

pub struct Peers {
    peers: HashMap<u64, Peer>,
    timeout: Duration,
}

impl Peers {
    pub fn new(timeout: Duration) -> Self {
        Self {
            peers: HashMap::new(),
            timeout,
        }
    }

    /// Fences one batch's header at `now` and records it as seen.
    pub fn admit(&mut self, h: &Header, now: Instant) -> Verdict {
        let fresh = || Peer {
            epoch: h.epoch,
            seq: h.seq,
            last_seen: now,
            load: HashMap::new(),
        };
        let Some(p) = self.peers.get_mut(&h.node) else {
            self.peers.insert(h.node, fresh());
            return Verdict::Apply { gap: 0 };
        };
        if h.epoch < p.epoch {
            return Verdict::Stale;
        }
        if h.epoch > p.epoch {
            *p = fresh();
            return Verdict::Apply { gap: 0 };
        }
        if h.seq <= p.seq {
            return Verdict::Duplicate;
        }
        let gap = h.seq - p.seq - 1;
        p.seq = h.seq;
        p.last_seen = now;
        Verdict::Apply { gap }
    }

    /// Records `node`'s load on a backend (after [`admit`](Self::admit) applied its
    /// batch).
    pub fn set_load(&mut self, node: u64, slot: usize, in_flight: u32, pending_tokens: u32) {
        if let Some(p) = self.peers.get_mut(&node) {
            if in_flight == 0 && pending_tokens == 0 {
                p.load.remove(&slot);
            } else {
                p.load.insert(slot, (in_flight, pending_tokens));
            }
        }
    }

    /// Drops the peers silent for longer than the timeout; how many.
    pub fn expire(&mut self, now: Instant) -> usize {
        let before = self.peers.len();
        let timeout = self.timeout;
        self.peers
            .retain(|_, p| now.saturating_duration_since(p.last_seen) <= timeout);
        before - self.peers.len()
    }

    /// The live peers' load per backend slot, summed: `(in_flight, tokens)` for
    /// slots `0..slots`.
    pub fn totals(&self, slots: usize) -> (Vec<u32>, Vec<u32>) {
        let (mut in_flight, mut tokens) = (vec![0u32; slots], vec![0u32; slots]);
        for p in self.peers.values() {
            for (&slot, &(n, t)) in &p.load {
                if slot < slots {
                    in_flight[slot] = in_flight[slot].saturating_add(n);
                    tokens[slot] = tokens[slot].saturating_add(t);
                }
            }
        }
        (in_flight, tokens)
    }

    /// The oldest peer heard, as `(epoch, node)`.
    pub fn oldest(&self) -> Option<(u64, u64)> {
        self.peers.iter().map(|(&node, p)| (p.epoch, node)).min()
    }

    pub fn len(&self) -> usize {
        self.peers.len()
    }

    /// Whether any peer has been heard at or after `since` (a peer remembered from
    /// before a bus outage may not be back on the bus yet).
    pub fn heard_since(&self, since: Instant) -> bool {
        self.peers.values().any(|p| p.last_seen >= since)
    }

    pub fn is_empty(&self) -> bool {
        self.peers.is_empty()
    }

    /// For `/admin/cluster`.
    pub fn views(&self, now: Instant) -> Vec<crate::status::PeerView> {
        let mut v: Vec<_> = self
            .peers
            .iter()
            .map(|(node, p)| crate::status::PeerView {
                node: format!("{node:016x}"),
                epoch: p.epoch,
                seq: p.seq,
                last_seen_ms_ago: now.saturating_duration_since(p.last_seen).as_millis() as u64,
                in_flight: p.load.values().map(|l| u64::from(l.0)).sum(),
                pending_prefill_tokens: p.load.values().map(|l| u64::from(l.1)).sum(),
            })
            .collect();
        v.sort_by(|a, b| a.node.cmp(&b.node));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(node: u64, epoch: u64, seq: u64) -> Header {
        Header {
            fingerprint: 0,
            node,
            epoch,
            seq,
            sent_us: 0,
        }
    }

    #[test]
    fn duplicates_and_older_epochs_are_dropped_and_gaps_counted() {
        let t = Instant::now();
        let mut p = Peers::new(Duration::from_secs(3));
        assert_eq!(p.admit(&h(1, 10, 0), t), Verdict::Apply { gap: 0 });
        assert_eq!(p.admit(&h(1, 10, 1), t), Verdict::Apply { gap: 0 });
        assert_eq!(p.admit(&h(1, 10, 1), t), Verdict::Duplicate);
        assert_eq!(p.admit(&h(1, 10, 0), t), Verdict::Duplicate);
        assert_eq!(p.admit(&h(1, 10, 5), t), Verdict::Apply { gap: 3 });
        // Restarted: a new epoch starts its numbers again; the old epoch is stale.
        assert_eq!(p.admit(&h(1, 11, 0), t), Verdict::Apply { gap: 0 });
        assert_eq!(p.admit(&h(1, 10, 6), t), Verdict::Stale);
        // Another node is fenced on its own.
        assert_eq!(p.admit(&h(2, 1, 7), t), Verdict::Apply { gap: 0 });
        assert_eq!(p.len(), 2);
    }

    #[test]
    fn a_peer_remembered_from_before_is_not_heard_since() {
        let t = Instant::now();
        let mut p = Peers::new(Duration::from_secs(3));
        p.admit(&h(1, 10, 0), t);
        let rejoined = t + Duration::from_millis(10);
        assert!(!p.is_empty());
        assert!(!p.heard_since(rejoined));
        p.admit(&h(1, 10, 1), rejoined);
        assert!(p.heard_since(rejoined));
    }

    #[test]
    fn a_restart_drops_the_old_load_and_silence_drops_the_peer() {
        let t = Instant::now();
        let mut p = Peers::new(Duration::from_secs(3));
        p.admit(&h(1, 10, 0), t);
        p.set_load(1, 2, 4, 900);
        p.admit(&h(2, 10, 0), t);
        p.set_load(2, 2, 1, 100);
        assert_eq!(p.totals(3), (vec![0, 0, 5], vec![0, 0, 1000]));
        // Node 1 restarts: its old counts go at once.
        p.admit(&h(1, 11, 0), t);
        assert_eq!(p.totals(3), (vec![0, 0, 1], vec![0, 0, 100]));
        // Node 2 keeps reporting; node 1 falls silent.
        let later = t + Duration::from_secs(2);
        p.admit(&h(2, 10, 1), later);
        assert_eq!(p.expire(t + Duration::from_millis(3_500)), 1);
        assert_eq!(p.totals(3), (vec![0, 0, 1], vec![0, 0, 100]));
        assert_eq!(p.expire(t + Duration::from_secs(6)), 1);
        assert!(p.is_empty());
        assert_eq!(p.totals(3), (vec![0; 3], vec![0; 3]));
    }

    #[test]
    fn a_zero_report_clears_the_backend() {
        let t = Instant::now();
        let mut p = Peers::new(Duration::from_secs(3));
        p.admit(&h(1, 1, 0), t);
        p.set_load(1, 0, 3, 30);
        p.set_load(1, 0, 0, 0);
        assert_eq!(p.totals(1), (vec![0], vec![0]));
        // Load of a node never admitted is ignored.
        p.set_load(9, 0, 3, 30);
        assert_eq!(p.totals(1), (vec![0], vec![0]));
    }
}
