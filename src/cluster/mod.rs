//! Cluster mode: replicas of one fleet sharing routing state over a bus
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
pub mod tls;
pub mod wire;

use crate::backends::LiveConfig;
use crate::config::{ClusterConfig, Config, Hashing};
use crate::control::Shared;
use crate::status::{ClusterStatus, Dropped};
use std::sync::Arc;
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
/// (block size, block hash function, hashing mode, model seeds) cannot pollute the
/// shared index. The seeds' order does not matter.
pub fn fingerprint(block_bytes: usize, hashing: &str, model_seeds: &[u64]) -> u64 {
    let mut seeds = model_seeds.to_vec();
    seeds.sort_unstable();
    seeds.dedup();
    let block_hash = radixgate_orchestrator::prompt::BLOCK_HASH;
    let mut b = Vec::with_capacity(24 + block_hash.len() + hashing.len() + seeds.len() * 8);
    b.extend_from_slice(&(block_hash.len() as u64).to_le_bytes());
    b.extend_from_slice(block_hash.as_bytes());
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

/// What both cluster threads start from.
pub struct Start {
    pub config: ClusterConfig,
    pub status: Arc<ClusterStatus>,
    pub shared: Arc<Shared>,
    /// The live config at start (the threads follow its successors).
    pub live: Arc<LiveConfig>,
}

/// This replica's status, with its node id and epoch (its start).
pub fn new_status(config: &ClusterConfig, fingerprint: u64) -> ClusterStatus {
    ClusterStatus::new(config, node_id(&config.node), unix_ms(), fingerprint)
}

/// Why `e` dropped a bus message.
pub fn dropped_of(e: &wire::WireError) -> Dropped {
    match e {
        wire::WireError::Foreign => Dropped::Foreign,
        wire::WireError::Version { .. } => Dropped::Version,
        wire::WireError::Fingerprint { .. } => Dropped::Fingerprint,
        wire::WireError::Truncated => Dropped::Truncated,
        wire::WireError::Malformed(_) => Dropped::Malformed,
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
/// URL; TLS for `rediss://`), bounded by [`BUS_TIMEOUT`].
pub fn connect(config: &ClusterConfig) -> redis::RedisResult<redis::Connection> {
    let client = tls::client(config)?;
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
    let mut conn = match connect(config) {
        Ok(conn) => conn,
        Err(e) => {
            let error = e.to_string();
            match tls::hint(config, &error) {
                Some(hint) => {
                    tracing::error!(url = %config.url, error, hint, "cluster bus refused at start; routing on local state, and retrying")
                }
                None => {
                    tracing::warn!(url = %config.url, error, "cluster bus unreachable at start; routing on local state until it answers")
                }
            }
            return Ok(());
        }
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
