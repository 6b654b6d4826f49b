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
//!
//! The tenants in force are a [`TenantTable`] inside the fleet snapshot, so a
//! reload changes keys, tiers and limits at once on every shard; see
//! [`TenantTable::reloaded`] for what a tenant keeps across one.

use crate::config::TenantConfig;
pub use radixgate_orchestrator::quota::Bucket;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

pub struct Tenant {
    pub name: String,
    pub tier: String,
    /// The tier's admission settings (budget, priority, shedding).
    pub admission: crate::config::TierConfig,
    /// Seeds this tenant's prompt hash chains under `prefix_isolation = "tenant"`.
    pub seed: u64,
    /// Shared with the tenant's next version while its limit stays the same.
    pub requests: Option<Arc<Bucket>>,
    pub tokens: Option<Arc<Bucket>>,
    pub max_concurrency: Option<u32>,
    /// Shared by every version of the tenant (requests in flight stay counted).
    pub in_flight: Arc<AtomicU32>,
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

/// A request's grant under its tenant's quotas (what it was charged); releases the
/// concurrency slot on drop. (TTFT admission is `proxy::admit::Admission`.)
pub struct QuotaGrant<'t> {
    pub tenant: &'t Tenant,
    /// Requests charged (1, or a workflow's nodes).
    pub charged_requests: u64,
    /// Tokens charged up front (to reconcile with the actual usage).
    pub charged_tokens: u64,
}

impl QuotaGrant<'_> {
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

impl Drop for QuotaGrant<'_> {
    fn drop(&mut self) {
        if self.tenant.max_concurrency.is_some() {
            self.tenant.in_flight.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Tenant {
    /// Checks concurrency, then requests, then tokens (`cost_tokens` up front).
    pub fn admit(&self, cost_tokens: u64, now_ms: u64) -> Result<QuotaGrant<'_>, Throttle> {
        self.admit_many(1, cost_tokens, now_ms)
    }

    /// [`Self::admit`] for `requests` requests at once that share one concurrency
    /// slot (a workflow's nodes).
    pub fn admit_many(
        &self,
        requests: u64,
        cost_tokens: u64,
        now_ms: u64,
    ) -> Result<QuotaGrant<'_>, Throttle> {
        if let Some(cap) = self.max_concurrency {
            if self.in_flight.fetch_add(1, Ordering::Relaxed) >= cap {
                self.in_flight.fetch_sub(1, Ordering::Relaxed);
                return Err(Throttle::Concurrency);
            }
        }
        let admission = QuotaGrant {
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

impl Tenant {
    /// The tenant as configured, its buckets full (counting this process's use when
    /// `track_use`: cluster mode shares it with the peers).
    fn new(c: &TenantConfig, now_ms: u64, track_use: bool) -> Tenant {
        let bucket = |per_sec: f64| {
            let b = Bucket::new(per_sec, now_ms);
            Arc::new(if track_use { b.tracking_use() } else { b })
        };
        Tenant {
            name: c.name.clone(),
            tier: c.tier.clone(),
            admission: c.tier_config,
            // Derived from the tenant's key digests (secret to other tenants), so no
            // one can compute another tenant's cache salt.
            seed: xxhash_rust::xxh3::xxh3_64(&c.key_digests.concat())
                ^ xxhash_rust::xxh3::xxh3_64(c.name.as_bytes()),
            requests: c.requests_per_sec.map(bucket),
            tokens: c.tokens_per_sec.map(bucket),
            max_concurrency: c.max_concurrency,
            in_flight: Default::default(),
        }
    }

    /// This tenant's next version under `c` (same name): see [`TenantTable::reloaded`].
    fn follow(&self, c: &TenantConfig, now_ms: u64, track_use: bool) -> Tenant {
        let bucket = |old: &Option<Arc<Bucket>>, limit: Option<f64>| match (old, limit) {
            (Some(b), Some(l)) if b.limit_per_sec == l => Some(b.clone()),
            (Some(b), Some(l)) => Some(Arc::new(b.rescaled(l, now_ms))),
            (None, Some(l)) => {
                let b = Bucket::new(l, now_ms);
                Some(Arc::new(if track_use { b.tracking_use() } else { b }))
            }
            (_, None) => None,
        };
        Tenant {
            name: c.name.clone(),
            tier: c.tier.clone(),
            admission: c.tier_config,
            seed: self.seed,
            requests: bucket(&self.requests, c.requests_per_sec),
            tokens: bucket(&self.tokens, c.tokens_per_sec),
            max_concurrency: c.max_concurrency,
            in_flight: self.in_flight.clone(),
        }
    }
}

/// The tenants in force, by stable slot: a slot is the tenant index in requests,
/// metrics and logs, and never moves or is reused (a removed tenant's slot is
/// retired: no key leads to it, and its name still labels what it did).
#[derive(Default)]
pub struct TenantTable {
    slots: Vec<Arc<Tenant>>,
    live: Vec<bool>,
    keys: KeyTable,
    /// The buckets count this process's use (cluster mode).
    track_use: bool,
}

impl TenantTable {
    /// The configured tenants, their buckets full; `track_use` in cluster mode, so
    /// the buckets count this process's use for its peers
    /// ([`Bucket::tracking_use`]).
    pub fn new(tenants: &[TenantConfig], now_ms: u64, track_use: bool) -> TenantTable {
        TenantTable {
            track_use,
            ..TenantTable::default()
        }
        .reloaded(tenants, now_ms)
    }

    /// The table after a reload to `tenants`, matched to this one by name:
    ///
    /// - a new name gets a new slot, its buckets full;
    /// - a name no longer configured is retired: its keys stop working at once,
    ///   and requests in flight finish;
    /// - a kept tenant takes its new keys, tier and limits, and keeps its cache
    ///   salt (so rotating its keys keeps its cached prefixes) and its count of
    ///   requests in flight (`max_concurrency` counts them against the new cap);
    /// - a bucket whose limit is unchanged is kept as it is; one whose limit
    ///   changed starts with the new capacity less what the old one had used
    ///   (`Bucket::rescaled`), so a raised limit admits its extra room at once and a
    ///   lowered one grants no fresh burst. Requests admitted before the reload
    ///   settle their token usage with the bucket they were charged to.
    pub fn reloaded(&self, tenants: &[TenantConfig], now_ms: u64) -> TenantTable {
        let mut slots = self.slots.clone();
        let mut keys = KeyTable::default();
        let mut live = vec![false; slots.len()];
        for c in tenants {
            let slot = match slots.iter().position(|t| t.name == c.name) {
                Some(i) => {
                    slots[i] = Arc::new(slots[i].follow(c, now_ms, self.track_use));
                    i
                }
                None => {
                    slots.push(Arc::new(Tenant::new(c, now_ms, self.track_use)));
                    live.push(false);
                    slots.len() - 1
                }
            };
            live[slot] = true;
            for d in &c.key_digests {
                keys.insert(*d, slot);
            }
        }
        TenantTable {
            slots,
            live,
            keys,
            track_use: self.track_use,
        }
    }

    /// The live tenant named `name`.
    pub fn by_name(&self, name: &str) -> Option<&Arc<Tenant>> {
        self.slots
            .iter()
            .zip(&self.live)
            .find(|(t, live)| **live && t.name == name)
            .map(|(t, _)| t)
    }

    /// Every live tenant.
    pub fn live(&self) -> impl Iterator<Item = &Arc<Tenant>> {
        self.slots
            .iter()
            .zip(&self.live)
            .filter(|(_, live)| **live)
            .map(|(t, _)| t)
    }

    /// The tenant in `slot` (also a retired one, whose requests may still run).
    pub fn get(&self, slot: usize) -> &Arc<Tenant> {
        &self.slots[slot]
    }

    /// The live tenant owning API key `key`.
    pub fn lookup(&self, key: &[u8]) -> Option<usize> {
        self.keys.lookup(key)
    }

    /// No tenant is configured.
    pub fn is_empty(&self) -> bool {
        !self.live.contains(&true)
    }

    /// Slots, retired ones included.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn name(&self, slot: usize) -> &str {
        self.slots.get(slot).map_or("", |t| t.name.as_str())
    }

    /// Every slot's name, retired ones included (metrics and log labels).
    pub fn names(&self) -> Vec<String> {
        self.slots.iter().map(|t| t.name.clone()).collect()
    }

    /// Every slot's tier, retired ones included.
    pub fn tiers(&self) -> Vec<String> {
        self.slots.iter().map(|t| t.tier.clone()).collect()
    }
}

impl std::fmt::Debug for TenantTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TenantTable")
            .field("names", &self.names())
            .field("live", &self.live)
            .finish()
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse_digest;

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
            in_flight: Default::default(),
        };
        let a = t.admit(0, 0).unwrap();
        assert_eq!(t.admit(0, 0).err(), Some(Throttle::Concurrency));
        drop(a);
        assert!(t.admit(0, 0).is_ok());
    }

    fn tenant(name: &str, key: &str, rps: Option<f64>, cap: Option<u32>) -> TenantConfig {
        TenantConfig {
            name: name.into(),
            tier: "standard".into(),
            tier_config: Default::default(),
            key_digests: vec![parse_digest(&hash_key(key)).unwrap()],
            requests_per_sec: rps,
            tokens_per_sec: None,
            max_concurrency: cap,
        }
    }

    #[test]
    fn a_reload_keeps_slots_state_and_salt_by_name() {
        let t0 = TenantTable::new(
            &[
                tenant("a", "ka", Some(4.0), Some(1)),
                tenant("b", "kb", Some(2.0), None),
            ],
            0,
            false,
        );
        let a = t0.get(0).clone();
        for _ in 0..4 {
            a.admit(0, 0).map(drop).unwrap();
        }
        let held = a.admit(0, 0);
        assert_eq!(
            held.err(),
            Some(Throttle::Requests {
                retry_after_ms: 250
            })
        );
        let in_flight = t0
            .get(0)
            .admit_many(0, 0, 0)
            .unwrap_or_else(|e| panic!("{e:?}"));
        // a: limit raised and its key rotated; b: removed; c: new.
        let t1 = t0.reloaded(
            &[
                tenant("c", "kc", None, None),
                tenant("a", "ka2", Some(10.0), Some(2)),
            ],
            0,
        );
        assert_eq!(t1.names(), ["a", "b", "c"]);
        assert_eq!((t1.lookup(b"ka"), t1.lookup(b"ka2")), (None, Some(0)));
        assert_eq!((t1.lookup(b"kb"), t1.lookup(b"kc")), (None, Some(2)));
        assert_eq!(t1.get(0).seed, a.seed, "the cache salt stays");
        // 4 of 4 used: 6 of the new 10 are left, now.
        let a1 = t1.get(0);
        assert_eq!(a1.requests.as_ref().unwrap().remaining(0), 6);
        // The request in flight still counts against the new cap of 2.
        let second = a1.admit(0, 0).unwrap();
        assert_eq!(a1.admit(0, 0).err(), Some(Throttle::Concurrency));
        drop((in_flight, second));
        // Lowered to 1/s: nothing left until it refills.
        let t2 = t1.reloaded(&[tenant("a", "ka2", Some(1.0), None)], 0);
        assert!(t2.get(0).admit(0, 0).is_err());
        assert!(t2.get(0).admit(0, 1000).is_ok());
        assert!(!t2.is_empty() && t2.reloaded(&[], 0).is_empty());
        // An unchanged limit keeps its bucket as it is.
        let t3 = t2.reloaded(&[tenant("a", "ka2", Some(1.0), Some(3))], 0);
        assert!(Arc::ptr_eq(
            t3.get(0).requests.as_ref().unwrap(),
            t2.get(0).requests.as_ref().unwrap()
        ));
    }
}
