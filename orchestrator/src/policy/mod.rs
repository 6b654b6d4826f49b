//! Backend selection: the narrow [`RoutingPolicy`] trait, its enum dispatch
//! ([`Policy`]) and the one factory ([`build_policy`]).
//!
//! A shard owns one [`Policy`] instance (so cursors are per shard and need no
//! synchronisation). For each request it passes the healthy candidates with their
//! fleet-wide in-flight counts (and, for `prefix_aware`, what the prefix index and the
//! engines' scraped metrics say about each), the prompt's affinity key and block count
//! and its seeded RNG, and gets back a [`Pick`] whose [`Reason`] the caller logs and
//! counts. Policies are pure and do
//! not allocate per call; an unknown policy name is an error ([`UnknownPolicy`]), never
//! a silent fallback.

use std::fmt;
use std::str::FromStr;

pub mod consistent_hash;
pub mod least_loaded;
pub mod prefix_aware;
pub mod random;
pub mod round_robin;

pub use prefix_aware::PrefixAwareConfig;

/// Index into the gateway's backend table, in config order.
pub type BackendIdx = usize;

/// One backend the request may go to, with what the gateway knows about it right now.
/// Policies that do not use a field ignore it; [`Candidate::new`] leaves the extras at
/// their "unknown" zeros.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Candidate {
    pub backend: BackendIdx,
    /// Requests in flight to this backend, counted across all shards.
    pub in_flight: u32,
    /// Leading prompt blocks this backend holds according to the prefix index (0 when
    /// not looked up).
    pub matched_blocks: u32,
    /// The engine's own waiting queue as last scraped (0 when unknown).
    pub engine_waiting: u32,
    /// Learned prefill cost on this backend (0: use the policy's configured default).
    pub prefill_ns_per_token: u32,
    /// Learned delay every request waits on this backend before its first token,
    /// whatever its prompt, in ns (0: none, or not learned).
    pub prefill_fixed_ns: u32,
    /// Learned delay each request ahead adds on this backend beyond the prefill
    /// queued there (0: use the policy's configured `queue_ns_per_request`).
    pub queue_ns_per_request: u32,
    /// Prompt tokens the gateway sent this backend that it expects the engine still has
    /// to prefill: for each request without a first token yet, the uncached tokens the
    /// prefix index predicted when it was routed (0 when not tracked). The prefill work
    /// queued ahead of a new request.
    pub pending_prefill_tokens: u32,
    /// How long the engine has been working through that pending prefill, in ns: the
    /// time since the later of the moment this backend's pending prefill last became
    /// non-empty and its last first response byte (0 when nothing is pending or not
    /// tracked). With a FIFO prefill queue this is exactly how far the request now
    /// being prefilled has got, so the estimate credits it against
    /// `pending_prefill_tokens` ([`prefix_aware`]).
    pub prefill_progress_ns: u64,
    /// The request's `X-Session-ID` is bound to this backend.
    pub session_home: bool,
    /// Prompt tokens of the request's images and audio this backend would still have
    /// to encode and prefill ([`crate::MediaNeeds::uncached_tokens`]; 0 for text).
    pub uncached_media_tokens: u32,
    /// Blocks this backend's cache can still take before it must evict, per the prefix
    /// index (`capacity - held`); `None` when unknown. A prompt's missing blocks beyond
    /// this evict what the backend holds now.
    pub cache_free_blocks: Option<u32>,
    /// This backend's cache capacity in blocks, per the prefix index (0: unknown).
    /// What a new prefix's growth is measured against
    /// ([`prefix_aware::PrefixAware::crowding_ns`]).
    pub cache_blocks: u32,
    /// The queued work of the backends that share this one's compute (config
    /// `backends[].compute_group`), in ns as the cost model prices a queue (0: none
    /// share it, or they are idle). While both have work each runs at a share of the
    /// hardware ([`prefix_aware::PrefixAware::sharing_ns`]).
    pub peer_queue_ns: u64,
    /// How many of the backends that share this one's compute have requests in
    /// flight (0: none share it, or they are idle): what a request routed here shares
    /// its hardware with from the start ([`crate::Decision::peers_busy_before`]).
    pub peers_busy: u32,
    /// The lowest backend index among this backend and those sharing its compute
    /// (`None`: it shares with none): candidates with the same group run on the same
    /// hardware, and new prefixes are spread over hardware, not over backends
    /// ([`prefix_aware::PrefixAware::placed_on_hardware`]).
    pub compute_group: Option<BackendIdx>,
    /// Prompt blocks of the requests in flight on this backend, from their decision
    /// to the end of their response (0 when not tracked): cache the engine keeps for
    /// them while they run, which it cannot evict to keep another prompt's prefix
    /// ([`prefix_aware::PrefixAware::kept_blocks`]).
    pub in_flight_blocks: u32,
    /// The blocks the engine reported its running requests hold (its KV usage times
    /// `cache_blocks`); `None` when unknown. Requests that share a prefix hold it
    /// once, which `in_flight_blocks` cannot tell.
    pub engine_used_blocks: Option<u32>,
}

// === impl Candidate ===

impl Candidate {
    pub fn new(backend: BackendIdx, in_flight: u32) -> Self {
        Self {
            backend,
            in_flight,
            ..Self::default()
        }
    }
}

#[derive(Clone, Copy, Debug, Default)]
pub struct RouteInput<'a> {
    pub candidates: &'a [Candidate],
    pub affinity_key: Option<u64>,
    /// Complete blocks in the prompt (the length `matched_blocks` is measured against).
    pub prompt_blocks: u32,
    /// The prompt's chained block hashes (empty when not known): what names a new
    /// prefix placed, and which later requests use it
    /// ([`prefix_aware::RecentPlacements`]).
    pub prompt: &'a [u64],
    /// The decision's time in ms, on the clock the prefix index uses.
    pub now_ms: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pick {
    pub backend: BackendIdx,
    pub reason: Reason,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    RoundRobin,
    Random,
    LeastLoaded,
    /// The key's home on the ring had room.
    HashRing,
    /// The key's home was at its bounded-load capacity (or off the ring); a later
    /// backend took it.
    HashRingSpill,
    /// Hash policy without an affinity key: least-loaded instead.
    HashNoKey,
    /// A backend holding the longest cached prefix, within the estimated-TTFT band.
    LongestPrefix,
    /// Every backend holding the longest prefix was saturated; another took it (and
    /// becomes a second holder).
    SpilledFromSaturated,
    /// Load beat affinity: the match was too short to matter, or a backend holding a
    /// shorter prefix (or none) promised a clearly earlier first token.
    FallbackLeastLoaded,
    /// No backend holds any of the prompt: least-loaded.
    NoMatch,
    /// The request's session is bound to this backend and it had room.
    SessionAffinity,
    /// A RAG request the policy would have routed by load went where most of its
    /// chunks were sent before ([`crate::rag::with_chunk_affinity`]).
    ChunkAffinity,
    /// A split model's request went to a prefill/decode pair ([`crate::disagg`]).
    DisaggSplit,
    /// A split model's request was served whole on one backend ([`crate::disagg`]).
    DisaggLocal,
}

impl Reason {
    pub const ALL: [Reason; 14] = [
        Reason::RoundRobin,
        Reason::Random,
        Reason::LeastLoaded,
        Reason::HashRing,
        Reason::HashRingSpill,
        Reason::HashNoKey,
        Reason::LongestPrefix,
        Reason::SpilledFromSaturated,
        Reason::FallbackLeastLoaded,
        Reason::NoMatch,
        Reason::SessionAffinity,
        Reason::ChunkAffinity,
        Reason::DisaggSplit,
        Reason::DisaggLocal,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Reason::RoundRobin => "round-robin",
            Reason::Random => "random",
            Reason::LeastLoaded => "least-loaded",
            Reason::HashRing => "hash-ring",
            Reason::HashRingSpill => "hash-ring-spill",
            Reason::HashNoKey => "hash-no-key",
            Reason::LongestPrefix => "longest-prefix",
            Reason::SpilledFromSaturated => "spilled-from-saturated",
            Reason::FallbackLeastLoaded => "fallback-least-loaded",
            Reason::NoMatch => "no-match",
            Reason::SessionAffinity => "session-affinity",
            Reason::ChunkAffinity => "chunk-affinity",
            Reason::DisaggSplit => "disagg-split",
            Reason::DisaggLocal => "disagg-local",
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PolicyName {
    RoundRobin,
    Random,
    LeastLoaded,
    ConsistentHash,
    PrefixAware,
}

impl PolicyName {
    pub const ALL: [PolicyName; 5] = [
        PolicyName::RoundRobin,
        PolicyName::Random,
        PolicyName::LeastLoaded,
        PolicyName::ConsistentHash,
        PolicyName::PrefixAware,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            PolicyName::RoundRobin => "round_robin",
            PolicyName::Random => "random",
            PolicyName::LeastLoaded => "least_loaded",
            PolicyName::ConsistentHash => "consistent_hash",
            PolicyName::PrefixAware => "prefix_aware",
        }
    }
}

impl fmt::Display for PolicyName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for PolicyName {
    type Err = UnknownPolicy;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        PolicyName::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| UnknownPolicy { name: s.to_owned() })
    }
}

/// A policy name in config that names no policy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownPolicy {
    pub name: String,
}

impl fmt::Display for UnknownPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unknown routing policy `{}`; expected one of: ",
            self.name
        )?;
        for (i, p) in PolicyName::ALL.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            f.write_str(p.as_str())?;
        }
        Ok(())
    }
}

impl std::error::Error for UnknownPolicy {}

pub trait RoutingPolicy {
    /// Chooses one of `input.candidates`; `None` only when there are none.
    fn pick(&mut self, input: &RouteInput<'_>, rng: &mut fastrand::Rng) -> Option<Pick>;
}

#[derive(Clone, Debug)]
pub enum Policy {
    RoundRobin(round_robin::RoundRobin),
    Random(random::Random),
    LeastLoaded(least_loaded::LeastLoaded),
    ConsistentHash(consistent_hash::ConsistentHash),
    PrefixAware(prefix_aware::PrefixAware),
}

// === impl Policy ===

impl Policy {
    pub fn name(&self) -> PolicyName {
        match self {
            Policy::RoundRobin(_) => PolicyName::RoundRobin,
            Policy::Random(_) => PolicyName::Random,
            Policy::LeastLoaded(_) => PolicyName::LeastLoaded,
            Policy::ConsistentHash(_) => PolicyName::ConsistentHash,
            Policy::PrefixAware(_) => PolicyName::PrefixAware,
        }
    }
}

impl RoutingPolicy for Policy {
    fn pick(&mut self, input: &RouteInput<'_>, rng: &mut fastrand::Rng) -> Option<Pick> {
        match self {
            Policy::RoundRobin(p) => p.pick(input, rng),
            Policy::Random(p) => p.pick(input, rng),
            Policy::LeastLoaded(p) => p.pick(input, rng),
            Policy::ConsistentHash(p) => p.pick(input, rng),
            Policy::PrefixAware(p) => p.pick(input, rng),
        }
    }
}

/// What the factory needs beyond the policy's name.
#[derive(Clone, Debug, PartialEq)]
pub struct PolicyConfig {
    /// Backend ids in config order; position `i` is `BackendIdx` `i`. The hash ring is
    /// built from the ids, so it survives reordering and restarts.
    pub backend_ids: Vec<String>,
    /// Bounded-load factor `c` for `consistent_hash`: no backend takes a request while
    /// at `ceil(c * (total in flight + 1) / candidates)` or more. Values below 1 (or
    /// NaN) are treated as 1.
    pub hash_load_factor: f64,
    /// Virtual points per backend on the hash ring (at least 1 is used).
    pub hash_virtual_nodes: u32,
    /// Cost model and thresholds for `prefix_aware`.
    pub prefix: PrefixAwareConfig,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        Self {
            backend_ids: Vec::new(),
            hash_load_factor: 1.25,
            hash_virtual_nodes: 160,
            prefix: PrefixAwareConfig::default(),
        }
    }
}

/// The one factory: every policy the gateway or the simulator runs is built here.
pub fn build_policy(name: PolicyName, config: &PolicyConfig) -> Policy {
    match name {
        PolicyName::RoundRobin => Policy::RoundRobin(round_robin::RoundRobin::new()),
        PolicyName::Random => Policy::Random(random::Random::new()),
        PolicyName::LeastLoaded => Policy::LeastLoaded(least_loaded::LeastLoaded::new()),
        PolicyName::ConsistentHash => Policy::ConsistentHash(consistent_hash::ConsistentHash::new(
            &config.backend_ids,
            config.hash_virtual_nodes,
            config.hash_load_factor,
        )),
        PolicyName::PrefixAware => Policy::PrefixAware(prefix_aware::PrefixAware::for_backends(
            &config.prefix,
            config.backend_ids.len(),
        )),
    }
}

#[cfg(test)]
mod tests;
