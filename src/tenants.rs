//! API keys, tenants and their quotas, enforced at the edge before routing.
//!
//! Keys live in config only as SHA-256 hex digests (`radixgate hash-key` prints one).
//! A request's `Authorization: Bearer <key>` is hashed and looked up; the digest is
//! confirmed with a constant-time comparison. Each tenant has optional limits: a
//! requests/s bucket, a tokens/s bucket (prompt estimate + `max_tokens` charged up
//! front, reconciled with the actual `usage` afterwards) and a concurrency cap.
//!
//! Quotas are global, not per shard: each bucket is one packed `AtomicU64` (tokens in
//! thousandths, last refill in milliseconds) updated with a compare-and-swap, and the
//! concurrency count is one atomic. A request touches only its own tenant's atomics,
//! so shards contend only when the same tenant is served on several shards at once,
//! and the limit is exact across shards (no per-shard split to drift).

pub use radixgate_orchestrator::quota::Bucket;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};

pub struct Tenant {
    pub name: String,
    pub tier: String,
    /// The tier's admission settings (budget, priority, shedding).
    pub admission: crate::config::TierConfig,
    /// Seeds this tenant's prompt hash chains under `prefix_isolation = "tenant"`.
    pub seed: u64,
    pub requests: Option<Bucket>,
    pub tokens: Option<Bucket>,
    pub max_concurrency: Option<u32>,
    pub in_flight: AtomicU32,
}

/// Which limit refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Throttle {
    Requests { retry_after_ms: u64 },
    Tokens { retry_after_ms: u64 },
    Concurrency,
}

impl Throttle {
    pub fn as_str(self) -> &'static str {
        match self {
            Throttle::Requests { .. } => "requests",
            Throttle::Tokens { .. } => "tokens",
            Throttle::Concurrency => "concurrency",
        }
    }

    pub fn retry_after_secs(self) -> u64 {
        match self {
            Throttle::Requests { retry_after_ms } | Throttle::Tokens { retry_after_ms } => {
                retry_after_ms.div_ceil(1000).max(1)
            }
            Throttle::Concurrency => 1,
        }
    }
}

/// A request admitted under its tenant's limits; releases the concurrency slot on
/// drop.
pub struct Admission<'t> {
    pub tenant: &'t Tenant,
    /// Requests charged (1, or a workflow's nodes).
    pub charged_requests: u64,
    /// Tokens charged up front (to reconcile with the actual usage).
    pub charged_tokens: u64,
}

impl Admission<'_> {
    /// The request was not served after all (shed by admission): give its request
    /// and tokens back. The concurrency slot is released on drop as usual.
    pub fn refund(&self, now_ms: u64) {
        if let Some(b) = &self.tenant.requests {
            b.adjust(self.charged_requests as i64, now_ms);
        }
        if let (Some(b), n @ 1..) = (&self.tenant.tokens, self.charged_tokens) {
            b.adjust(n as i64, now_ms);
        }
    }
}

impl Drop for Admission<'_> {
    fn drop(&mut self) {
        if self.tenant.max_concurrency.is_some() {
            self.tenant.in_flight.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Tenant {
    /// Checks concurrency, then requests, then tokens (`cost_tokens` up front).
    pub fn admit(&self, cost_tokens: u64, now_ms: u64) -> Result<Admission<'_>, Throttle> {
        self.admit_many(1, cost_tokens, now_ms)
    }

    /// [`Self::admit`] for `requests` requests at once that share one concurrency
    /// slot (a workflow's nodes).
    pub fn admit_many(
        &self,
        requests: u64,
        cost_tokens: u64,
        now_ms: u64,
    ) -> Result<Admission<'_>, Throttle> {
        if let Some(cap) = self.max_concurrency {
            if self.in_flight.fetch_add(1, Ordering::Relaxed) >= cap {
                self.in_flight.fetch_sub(1, Ordering::Relaxed);
                return Err(Throttle::Concurrency);
            }
        }
        let admission = Admission {
            tenant: self,
            charged_requests: requests,
            charged_tokens: 0,
        };
        if let Some(b) = &self.requests {
            b.take(requests, now_ms)
                .map_err(|ms| Throttle::Requests { retry_after_ms: ms })?;
        }
        let mut admission = admission;
        if let Some(b) = &self.tokens {
            if let Err(ms) = b.take(cost_tokens, now_ms) {
                // Give the request tokens back: this request is not served.
                if let Some(r) = &self.requests {
                    r.adjust(requests as i64, now_ms);
                }
                return Err(Throttle::Tokens { retry_after_ms: ms });
            }
            admission.charged_tokens = cost_tokens;
        }
        Ok(admission)
    }

    /// `X-RateLimit-*` header lines.
    pub fn rate_limit_headers(&self, now_ms: u64, out: &mut Vec<u8>) {
        use std::io::Write;
        if let Some(b) = &self.requests {
            let _ = write!(
                out,
                "X-RateLimit-Limit-Requests: {}\r\nX-RateLimit-Remaining-Requests: {}\r\n",
                b.limit_per_sec,
                b.remaining(now_ms)
            );
        }
        if let Some(b) = &self.tokens {
            let _ = write!(
                out,
                "X-RateLimit-Limit-Tokens: {}\r\nX-RateLimit-Remaining-Tokens: {}\r\n",
                b.limit_per_sec,
                b.remaining(now_ms)
            );
        }
    }
}

/// Hex SHA-256 of an API key, as stored in config.
pub fn hash_key(key: &str) -> String {
    let digest = Sha256::digest(key.as_bytes());
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// Key digests → tenants.
#[derive(Default)]
pub struct KeyTable {
    /// First 8 digest bytes → (full digest, tenant) candidates.
    by_prefix: HashMap<u64, Vec<([u8; 32], usize)>>,
}

impl KeyTable {
    pub fn insert(&mut self, digest: [u8; 32], tenant: usize) {
        let prefix = u64::from_le_bytes(digest[..8].try_into().unwrap_or_default());
        self.by_prefix
            .entry(prefix)
            .or_default()
            .push((digest, tenant));
    }

    /// The tenant owning `key`, comparing digests in constant time.
    pub fn lookup(&self, key: &[u8]) -> Option<usize> {
        let digest: [u8; 32] = Sha256::digest(key).into();
        let prefix = u64::from_le_bytes(digest[..8].try_into().unwrap_or_default());
        let candidates = self.by_prefix.get(&prefix)?;
        candidates
            .iter()
            .find(|(d, _)| constant_time_eq::constant_time_eq(d, &digest))
            .map(|(_, t)| *t)
    }
}

/// Parses a 64-hex-digit SHA-256 digest.
pub fn parse_digest(hex: &str) -> Option<[u8; 32]> {
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(i * 2..i * 2 + 2)?, 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_digests() {
        let hex = hash_key("sk-test");
        assert_eq!(hex.len(), 64);
        let mut table = KeyTable::default();
        table.insert(parse_digest(&hex).unwrap(), 3);
        assert_eq!(table.lookup(b"sk-test"), Some(3));
        assert_eq!(table.lookup(b"sk-other"), None);
        assert_eq!(parse_digest("zz"), None);
    }

    #[test]
    fn concurrency_cap_is_released() {
        let t = Tenant {
            name: "t".into(),
            tier: "free".into(),
            admission: Default::default(),
            seed: 1,
            requests: None,
            tokens: None,
            max_concurrency: Some(1),
            in_flight: AtomicU32::new(0),
        };
        let a = t.admit(0, 0).unwrap();
        assert_eq!(t.admit(0, 0).err(), Some(Throttle::Concurrency));
        drop(a);
        assert!(t.admit(0, 0).is_ok());
    }
}
