//! Status that a control-plane thread writes and scrapes read: what the cluster
//! threads report ([`ClusterStatus`]), read by `/metrics` and `/admin/cluster`.
//!
//! [`capacity`] holds the capacity signal's latest report (the capacity thread
//! writes it; `/metrics` and `/admin/capacity` read it). [`discovery`] holds the
//! DNS discovery thread's counters per name (`/metrics` reads them).
//!
//! It sits below both its writers (`crate::cluster`) and its readers
//! (`crate::metrics`, the admin API), so neither reaches into the other.

pub mod capacity;
pub mod discovery;

use crate::config::ClusterConfig;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

/// Why a bus message was dropped, each counted apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dropped {
    Foreign,
    Version,
    Fingerprint,
    Truncated,
    Malformed,
    /// A batch the subscriber had already applied (same publisher, epoch and seq).
    Duplicate,
    /// From an older epoch of a publisher that has restarted since.
    Stale,
}

impl Dropped {
    pub const ALL: [Dropped; 7] = [
        Dropped::Foreign,
        Dropped::Version,
        Dropped::Fingerprint,
        Dropped::Truncated,
        Dropped::Malformed,
        Dropped::Duplicate,
        Dropped::Stale,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Dropped::Foreign => "foreign",
            Dropped::Version => "version",
            Dropped::Fingerprint => "fingerprint",
            Dropped::Truncated => "truncated",
            Dropped::Malformed => "malformed",
            Dropped::Duplicate => "duplicate",
            Dropped::Stale => "stale",
        }
    }
}

/// A peer as the subscriber last saw it (for `/admin/cluster`).
#[derive(Clone, Debug, serde::Serialize)]
pub struct PeerView {
    pub node: String,
    pub epoch: u64,
    pub seq: u64,
    pub last_seen_ms_ago: u64,
    /// Its in-flight requests and pending prefill tokens, all backends together.
    pub in_flight: u64,
    pub pending_prefill_tokens: u64,
}

/// What the cluster threads report, read by `/metrics` and `/admin/cluster`.
pub struct ClusterStatus {
    pub node: String,
    pub node_id: u64,
    pub epoch: u64,
    pub fingerprint: u64,
    pub channel: String,
    /// The subscriber holds a live connection.
    pub connected: AtomicBool,
    /// Times the bus was lost (counted once per outage, by the subscriber).
    pub outages: AtomicU64,
    /// While disconnected, why the bus was lost or refused the connection (a TLS
    /// certificate it does not trust, say); empty while connected.
    pub last_error: Mutex<String>,
    pub batches_published: AtomicU64,
    pub ops_published: AtomicU64,
    /// Ops that could not be published (bus down, or the publish failed).
    pub ops_unsent: AtomicU64,
    pub batches_received: AtomicU64,
    /// Index ops from peers handed to the coordinator.
    pub ops_applied: AtomicU64,
    /// Ops naming a backend this replica does not have.
    pub ops_unknown_backend: AtomicU64,
    /// Batches missing between two a peer sent (lost in an outage).
    pub gaps: AtomicU64,
    dropped: [AtomicU64; Dropped::ALL.len()],
    /// Event lag (publish to receipt, in microseconds of wall clock) of the last
    /// second's batches: p50 and p99.
    pub lag_p50_us: AtomicU64,
    pub lag_p99_us: AtomicU64,
    /// Written by the subscriber about once per report interval.
    pub peers: Mutex<Vec<PeerView>>,
    /// The bus refused this replica: another routing fingerprint holds the fleet.
    pub refused: AtomicBool,
    /// Loaded its peers' index (or found none, or gave up waiting): `/ready` says
    /// ready from then on.
    pub warm: AtomicBool,
    /// Snapshots this replica loaded, and the ops they held.
    pub snapshots_loaded: AtomicU64,
    pub snapshot_ops: AtomicU64,
    /// How long the last warm start took, from joining to loaded (ms).
    pub warm_ms: AtomicU64,
    /// Snapshots this replica stored for a joining peer.
    pub snapshots_served: AtomicU64,
    /// Peers' reports of a failing backend (each opens this replica's breaker).
    pub peer_faults: AtomicU64,
    /// Peers' tenant-use reports charged to this replica's buckets.
    pub tenant_charges: AtomicU64,
    /// Per backend slot, the pending prefill tokens the peers last reported: shown,
    /// not charged in routing (docs/cluster.md, "What is shared").
    peer_pending: Box<[std::sync::atomic::AtomicU32]>,
}

impl ClusterStatus {
    /// `node_id` is the node's id on the wire and `epoch` its start (wall-clock ms).
    pub fn new(
        config: &ClusterConfig,
        node_id: u64,
        epoch: u64,
        fingerprint: u64,
    ) -> ClusterStatus {
        ClusterStatus {
            node: config.node.clone(),
            node_id,
            epoch,
            fingerprint,
            channel: config.channel.clone(),
            connected: AtomicBool::new(false),
            outages: AtomicU64::new(0),
            last_error: Mutex::new(String::new()),
            batches_published: AtomicU64::new(0),
            ops_published: AtomicU64::new(0),
            ops_unsent: AtomicU64::new(0),
            batches_received: AtomicU64::new(0),
            ops_applied: AtomicU64::new(0),
            ops_unknown_backend: AtomicU64::new(0),
            gaps: AtomicU64::new(0),
            dropped: Default::default(),
            lag_p50_us: AtomicU64::new(0),
            lag_p99_us: AtomicU64::new(0),
            peers: Mutex::new(Vec::new()),
            refused: AtomicBool::new(false),
            warm: AtomicBool::new(false),
            snapshots_loaded: AtomicU64::new(0),
            snapshot_ops: AtomicU64::new(0),
            warm_ms: AtomicU64::new(0),
            snapshots_served: AtomicU64::new(0),
            peer_faults: AtomicU64::new(0),
            tenant_charges: AtomicU64::new(0),
            peer_pending: (0..crate::backends::MAX_BACKEND_SLOTS)
                .map(|_| Default::default())
                .collect(),
        }
    }

    /// The peers' pending prefill tokens on backend `slot`, as last reported.
    pub fn peer_pending_tokens(&self, slot: usize) -> u32 {
        self.peer_pending
            .get(slot)
            .map_or(0, |t| t.load(Ordering::Relaxed))
    }

    /// Written by the subscriber only.
    pub fn set_peer_pending_tokens(&self, slot: usize, tokens: u32) {
        if let Some(t) = self.peer_pending.get(slot) {
            t.store(tokens, Ordering::Relaxed);
        }
    }

    pub fn count_dropped(&self, why: Dropped) {
        self.dropped[why as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn dropped(&self, why: Dropped) -> u64 {
        self.dropped[why as usize].load(Ordering::Relaxed)
    }

    /// `GET /admin/cluster`.
    pub fn to_json(&self) -> serde_json::Value {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let dropped: serde_json::Map<String, serde_json::Value> = Dropped::ALL
            .iter()
            .map(|d| (d.as_str().to_string(), self.dropped(*d).into()))
            .collect();
        let peers = self.peers.lock().map(|p| p.clone()).unwrap_or_default();
        serde_json::json!({
            "node": self.node,
            "epoch": self.epoch,
            "channel": self.channel,
            "fingerprint": format!("{:016x}", self.fingerprint),
            "connected": self.connected.load(Ordering::Relaxed),
            "refused": self.refused.load(Ordering::Relaxed),
            "warm": self.warm.load(Ordering::Relaxed),
            "warm_start": {
                "snapshots_loaded": get(&self.snapshots_loaded),
                "snapshot_ops": get(&self.snapshot_ops),
                "last_warm_ms": get(&self.warm_ms),
                "snapshots_served": get(&self.snapshots_served),
            },
            "outages": get(&self.outages),
            "last_error": self.last_error.lock().map(|e| e.clone()).unwrap_or_default(),
            "peers": peers,
            "published": {
                "batches": get(&self.batches_published),
                "ops": get(&self.ops_published),
                "unsent_ops": get(&self.ops_unsent),
            },
            "received": {
                "batches": get(&self.batches_received),
                "ops_applied": get(&self.ops_applied),
                "ops_unknown_backend": get(&self.ops_unknown_backend),
                "gaps": get(&self.gaps),
                "peer_faults": get(&self.peer_faults),
                "tenant_charges": get(&self.tenant_charges),
                "dropped": dropped,
                "lag_p50_us": get(&self.lag_p50_us),
                "lag_p99_us": get(&self.lag_p99_us),
            },
        })
    }
}
