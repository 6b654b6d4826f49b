//! Cluster mode (issue 18): replicas of one fleet sharing routing state over a bus
//! (Redis or Valkey; docs/cluster.md has the measurements behind the choice).
//!
//! So far only the groundwork: the bus message format ([`wire`]) and the two names
//! every replica must agree on, a backend's [`BackendKey`](wire::BackendKey) and the
//! fleet's routing [`fingerprint`]. The cluster thread (its own thread off the shards,
//! feeding the coordinator as the KV-event thread does) comes next.

pub mod wire;

use wire::BackendKey;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Domain seeds, so a backend key can never equal a fingerprint of the same bytes.
const BACKEND_KEY_SEED: u64 = 0x7267_6b65_795f_7631; // "rgkey_v1"
const FINGERPRINT_SEED: u64 = 0x7267_6670_5f76_3100; // "rgfp_v1\0"

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
