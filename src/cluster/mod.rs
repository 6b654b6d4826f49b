//! Cluster mode (issue 18): replicas of one fleet sharing routing state over a bus
//! (Redis or Valkey; docs/cluster.md has the measurements behind the choice).
//!
//! Two threads per replica, off the shards, each with its own bus connection:
//!
//! - [`publish`] (`radixgate-cluster-pub`) takes the index ops of this replica's
//!   routing decisions from the coordinator (the ops a `Decision` carries, as the
//!   shards already send them), batches them, and publishes each batch as one
//!   [`wire`] message. Every `report_interval` it also publishes this replica's
//!   in-flight requests and pending prefill per backend: its load, and its
//!   heartbeat.
//! - [`subscribe`] (`radixgate-cluster-sub`) reads every peer's messages, fences them
//!   per publisher ([`peers`]: epochs and sequence numbers), and hands the index ops
//!   to the coordinator as [`IndexEvent`](crate::replica::IndexEvent)s from a peer,
//!   the way the KV-event thread hands it engine events; the coordinator applies
//!   them and fans them out to every shard, so a shard never waits on the bus. The
//!   peers' load goes into the peers' row of the in-flight and pending-prefill
//!   counters, which routing reads with the shards' own.
//!
//! Backends are named on the bus by [`backend_key`] (a hash of the URL), and each
//! message carries the fleet's routing [`fingerprint`]: a replica that cuts prompts
//! differently refuses to join (its first connection finds the fleet's fingerprint
//! key) and, should it publish anyway, its messages are dropped. No prompt text
//! ever leaves a replica: only block hashes, chunk and session hashes, and counts.

pub mod peers;
pub mod publish;
pub mod subscribe;
pub mod wire;

use crate::backends::LiveConfig;
use crate::config::{ClusterConfig, Config, Hashing};
use crate::shard::Shared;
use radixgate_orchestrator::policy::BackendIdx;
use radixgate_orchestrator::Held;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use wire::BackendKey;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Domain seeds, so a backend key can never equal a fingerprint of the same bytes.
const BACKEND_KEY_SEED: u64 = 0x7267_6b65_795f_7631; // "rgkey_v1"
const FINGERPRINT_SEED: u64 = 0x7267_6670_5f76_3100; // "rgfp_v1\0"

/// How long a connection attempt or one bus command may take.
pub const BUS_TIMEOUT: Duration = Duration::from_secs(1);
/// The wait between reconnection attempts while the bus is down.
pub const RECONNECT_EVERY: Duration = Duration::from_millis(100);

/// A backend's key on the bus: a hash of its URL with a trailing `/` dropped, so
/// every replica whose config lists the same URL names it alike, whatever its slot.
pub fn backend_key(url: &str) -> BackendKey {
    let url = url.strip_suffix('/').unwrap_or(url);
    BackendKey(xxh3_64_with_seed(url.as_bytes(), BACKEND_KEY_SEED))
}

/// The fleet's routing fingerprint: replicas publish it in every batch and drop
/// batches with another, so a replica that cuts or hashes prompts differently
/// (block size, hashing mode, model seeds) cannot pollute the shared index. The
/// seeds' order does not matter.
pub fn fingerprint(block_bytes: usize, hashing: &str, model_seeds: &[u64]) -> u64 {
    let mut seeds = model_seeds.to_vec();
    seeds.sort_unstable();
    seeds.dedup();
    let mut b = Vec::with_capacity(16 + hashing.len() + seeds.len() * 8);
    b.extend_from_slice(&(block_bytes as u64).to_le_bytes());
    b.extend_from_slice(&(hashing.len() as u64).to_le_bytes());
    b.extend_from_slice(hashing.as_bytes());
    for s in seeds {
        b.extend_from_slice(&s.to_le_bytes());
    }
    xxh3_64_with_seed(&b, FINGERPRINT_SEED)
}

/// The fingerprint of a config: block size, hashing mode (in token modes the block
/// size in tokens, the tokenizer file's contents and whether prompts go through
/// the chat template) and whether tenants' prefixes are isolated.
#[allow(clippy::disallowed_methods)] // read once at start-up, off the shards
pub fn config_fingerprint(config: &Config) -> u64 {
    let hashing = match &config.routing.hashing {
        Hashing::Bytes => "bytes".to_string(),
        Hashing::Tokens {
            path,
            block_tokens,
            template,
            ..
        } => {
            let tokenizer = std::fs::read(path).map_or(0, |b| xxh3_64(&b));
            let mode = if template.is_some() {
                "precise"
            } else {
                "tokens"
            };
            format!("{mode}/{block_tokens}/{tokenizer:016x}")
        }
    };
    let isolation = u64::from(config.tenant_prefix_isolation);
    fingerprint(config.routing.block_bytes.get(), &hashing, &[isolation])
}

/// What the coordinator hands the publisher to share.
#[derive(Debug)]
pub enum Share {
    /// An index op of this replica's routing decisions.
    Index(crate::replica::IndexOp),
    /// This replica's own health check or breaker changed a backend's state.
    Health {
        backend: BackendIdx,
        healthy: bool,
        breaker: radixgate_orchestrator::BreakerState,
    },
}

/// What both cluster threads start from.
pub struct Start {
    pub config: ClusterConfig,
    pub status: Arc<ClusterStatus>,
    pub shared: Arc<Shared>,
    /// The live config at start (the threads follow its successors).
    pub live: Arc<LiveConfig>,
}

/// The coordinator's index and session bindings at `now_ms` (its index clock), for a
/// joining peer.
pub struct Snapshot {
    pub now_ms: u64,
    pub index: Vec<Held>,
    /// `(session, backend, last bound)`.
    pub sessions: Vec<(u64, BackendIdx, u64)>,
}

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

    pub fn of(e: &wire::WireError) -> Dropped {
        match e {
            wire::WireError::Foreign => Dropped::Foreign,
            wire::WireError::Version { .. } => Dropped::Version,
            wire::WireError::Fingerprint { .. } => Dropped::Fingerprint,
            wire::WireError::Truncated => Dropped::Truncated,
            wire::WireError::Malformed(_) => Dropped::Malformed,
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
    pub fn new(config: &ClusterConfig, fingerprint: u64) -> ClusterStatus {
        ClusterStatus {
            node: config.node.clone(),
            node_id: node_id(&config.node),
            epoch: unix_ms(),
            fingerprint,
            channel: config.channel.clone(),
            connected: AtomicBool::new(false),
            outages: AtomicU64::new(0),
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

/// A node's id on the wire: a hash of its name.
pub fn node_id(node: &str) -> u64 {
    xxh3_64(node.as_bytes())
}

/// Wall-clock milliseconds: epochs order a node's restarts, and lags compare
/// replicas' clocks (NTP-synced hosts, or one host).
pub fn unix_ms() -> u64 {
    unix_us() / 1_000
}

pub fn unix_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// The pub/sub channel a fleet shares.
pub fn channel(config: &ClusterConfig) -> String {
    format!("{}:ops", config.channel)
}

/// The key a peer stores its snapshot under for the request `nonce`.
pub fn snapshot_key(config: &ClusterConfig, nonce: u64) -> String {
    format!("{}:snapshot:{nonce:016x}", config.channel)
}

/// The key holding the fleet's routing fingerprint.
pub fn fingerprint_key(config: &ClusterConfig) -> String {
    format!("{}:fingerprint", config.channel)
}

/// Opens one bus connection (password from the environment or a file, never the
/// URL), bounded by [`BUS_TIMEOUT`].
pub fn connect(config: &ClusterConfig) -> redis::RedisResult<redis::Connection> {
    use redis::IntoConnectionInfo;
    let mut info = config.url.as_str().into_connection_info()?;
    let mut settings = info.redis_settings().clone();
    if let Some(user) = &config.username {
        settings = settings.set_username(user);
    }
    if let Some(password) = &config.password {
        settings = settings.set_password(password);
    }
    info = info.set_redis_settings(settings);
    let client = redis::Client::open(info)?;
    let conn = client.get_connection_with_timeout(BUS_TIMEOUT)?;
    conn.set_read_timeout(Some(BUS_TIMEOUT))?;
    conn.set_write_timeout(Some(BUS_TIMEOUT))?;
    Ok(conn)
}

/// Claims the fleet for this fingerprint, or finds it already held by the same one:
/// `Ok(false)` when another fingerprint holds it (this replica must not join). The
/// key lives as long as some replica keeps renewing it ([`renew_fingerprint`]).
pub fn claim_fingerprint(
    conn: &mut redis::Connection,
    config: &ClusterConfig,
    fingerprint: u64,
) -> redis::RedisResult<bool> {
    let key = fingerprint_key(config);
    let ours = format!("{fingerprint:016x}");
    let ttl = config.peer_timeout.as_millis() as u64;
    let _: Option<String> = redis::cmd("SET")
        .arg(&key)
        .arg(&ours)
        .arg("NX")
        .arg("PX")
        .arg(ttl)
        .query(conn)?;
    let held: Option<String> = redis::cmd("GET").arg(&key).query(conn)?;
    Ok(held.is_none_or(|h| h == ours))
}

/// Keeps the fingerprint key alive while this replica is in the fleet.
pub fn renew_fingerprint(
    conn: &mut redis::Connection,
    config: &ClusterConfig,
    fingerprint: u64,
) -> redis::RedisResult<()> {
    let ttl = config.peer_timeout.as_millis() as u64;
    redis::cmd("SET")
        .arg(fingerprint_key(config))
        .arg(format!("{fingerprint:016x}"))
        .arg("PX")
        .arg(ttl)
        .query(conn)
}

/// At start: when the bus answers and another routing fingerprint holds the
/// fleet, the error to refuse start-up with. A bus that does not answer is no
/// error (the replica starts on local state and joins when the bus is back).
pub fn check_join(config: &ClusterConfig, fingerprint: u64) -> Result<(), String> {
    let Ok(mut conn) = connect(config) else {
        tracing::warn!(url = %config.url, "cluster bus unreachable at start; routing on local state until it answers");
        return Ok(());
    };
    match claim_fingerprint(&mut conn, config, fingerprint) {
        Ok(true) => Ok(()),
        Ok(false) => {
            let held: Option<String> = redis::cmd("GET")
                .arg(fingerprint_key(config))
                .query(&mut conn)
                .ok()
                .flatten();
            Err(format!(
                "cluster: the fleet on channel `{}` routes with fingerprint {}, this replica with \
                 {fingerprint:016x}: its routing config (routing.block_bytes, routing.hashing, \
                 the tokenizer, tenancy.prefix_isolation) differs, so it refuses to join; give \
                 it the fleet's settings or another cluster.channel",
                config.channel,
                held.unwrap_or_else(|| "?".into())
            ))
        }
        // A bus that answered and then failed (an interrupted call, a restart) is
        // no reason to refuse start-up either: the cluster threads check the
        // fingerprint again when they connect.
        Err(e) => {
            tracing::warn!(url = %config.url, error = %e, "cluster bus check failed at start; the cluster threads retry");
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_key_ignores_a_trailing_slash_only() {
        assert_eq!(
            backend_key("http://10.0.0.1:8000"),
            backend_key("http://10.0.0.1:8000/")
        );
        assert_ne!(
            backend_key("http://10.0.0.1:8000"),
            backend_key("http://10.0.0.2:8000")
        );
    }

    #[test]
    fn fingerprint_covers_every_routing_input() {
        let base = fingerprint(64, "bytes", &[1, 2]);
        assert_eq!(base, fingerprint(64, "bytes", &[2, 1]));
        assert_ne!(base, fingerprint(128, "bytes", &[1, 2]));
        assert_ne!(base, fingerprint(64, "tokens", &[1, 2]));
        assert_ne!(base, fingerprint(64, "bytes", &[1, 3]));
        assert_ne!(base, fingerprint(64, "bytes", &[]));
    }
}
