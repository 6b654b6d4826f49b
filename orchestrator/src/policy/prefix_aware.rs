//! Prefix aware: send a request where its prompt is already cached, unless waiting
//! there would cost more than recomputing the prompt somewhere idle.
//!
//! The gateway looks the prompt's block hashes up in its prefix-index replica and
//! passes, per candidate, the leading blocks that backend holds (`matched_blocks`), its
//! fleet-wide in-flight count, the engine's scraped waiting queue, the prefill work it
//! has sent there that has not produced a first token yet (`pending_prefill_tokens`),
//! its learned prefill cost (a fixed delay and a rate per token) and whether the
//! request's session is bound to it. Each candidate gets an estimated time to first
//! token:
//!
//! ```text
//! load        = max(in_flight, engine_waiting)
//! queued      = prefill_ns_per_token * pending_prefill_tokens
//! est_ttft_ns = queue_ns_per_request * load
//!             + queued - (prefill_progress_ns if it is below queued, else 0)
//!             + prefill_fixed_ns
//!             + prefill_ns_per_token * tokens_per_block * (prompt_blocks - matched_blocks)
//!             + prefill_ns_per_token * uncached_media_tokens
//! est_ttft_ns += max(est_ttft_ns * peers_busy, min(est_ttft_ns, peer_queue_ns))
//! ```
//!
//! Candidates are ranked by the estimate plus the cost of what the placement evicts
//! ([`PrefixAware::eviction_ns`]): a prompt's missing blocks beyond the backend's free
//! cache room (`cache_free_blocks`, from the index) push out as many blocks it holds
//! now, charged at `eviction_weight` (default [`EVICTION_WEIGHT`]) of their prefill.
//! That cost is ranking only, not part of the estimate that admission compares with a
//! TTFT budget. It is also what bounds the replication of a hot prefix: a spill into a
//! full cache has to promise a first token earlier by more than the eviction it causes,
//! so a prefix gains holders only while its load outweighs what copying it costs.
//!
//! The second term is the queue as the engine sees it: what the requests ahead still
//! have to prefill, so a backend whose queue holds cache hits is cheap and one whose
//! queue holds cold documents is not, at equal counts. The request at the head of that
//! queue is already part-way through its prefill: `prefill_progress_ns` (the time since
//! the later of the queue last becoming non-empty and the backend's last first byte) is
//! what the engine has done of the queued work since, and is credited. Under a FIFO
//! prefill it is exact; without the credit the estimate charged the head request its
//! whole prompt and SLO admission refused up to a fifth of the requests that would
//! have met their budget (`radixgate-bench sim --edge`). Progress that reaches the
//! queued work means the prefill cost is under-estimated for this engine (had it been
//! right, the queue would have answered by now): what is left is then unknown, and the
//! credit is dropped rather than trusted (the queue counts whole again, never as idle
//! while it still has not answered); progress beyond all the wait the estimate
//! expected means the backend is late, and its wait is then at least that progress
//! ([`PrefixAware::queue_ns`]). The first is what a request
//! ahead costs beyond its prefill (decode steps sharing the batch): the configured
//! `queue_ns_per_request`, or the backend's learned one when the gateway has learned
//! it (`Candidate::queue_ns_per_request`; on a CPU engine a request ahead costs
//! hundreds of milliseconds, not the default's 2.5 ms, and affinity must yield to a
//! queue accordingly). The router bounds the learned ones to within a factor of
//! [`QUEUE_COST_SPREAD`] of the candidates' median, and gives that median to a
//! backend not learned yet ([`bound_queue_costs`]); a backend with no learned prefill
//! cost likewise takes the median of the learned rates and fixed delays
//! ([`lend_learned_prefill_costs`]). `prefill_fixed_ns` is what every
//! request waits on that backend before its first token whatever its prompt (learned
//! by the gateway; on a CPU engine whose core neighbour has just worked, about a
//! second). The last,
//! `uncached_media_tokens`, is the estimated tokens of the request's images and audio,
//! charged to candidates whose match does not reach them ([`crate::media`]).
//!
//! The last line is for backends that share their compute with others (two engines
//! on one GPU, or on the same CPU cores: config `backends[].compute_group`).
//! `peers_busy` is how many of those others have requests in flight: each works on
//! until its requests have answered, decode included, so the request runs at
//! `1 / (1 + peers_busy)` of the hardware all along. `peer_queue_ns` is the queue of
//! those others, each priced by the same first terms (what counts when an engine's
//! own scrape shows more waiting than the gateway sent it); while both have work
//! each runs at half speed, so the request's first token comes later by as much of
//! the peers' work as overlaps its own ([`PrefixAware::sharing_ns`]). Priced by the
//! queue alone, an engine whose neighbour was decoding four answers looked as good as
//! idle: a cold 2,164-token prompt was estimated at 12.8 s there and took 25.5 s,
//! and two requests moved off their busy holders, estimated at 6.0–6.4 s there, took
//! 25.2 s (`radixgate-bench real`, multiturn, concurrency 8). Without the sharing
//! term at all, a burst of new prompts on three CPU engines, two of them on one
//! core, put five or six of eight on that core: each engine looked idle while its
//! neighbour was not, and those requests waited 3.9–5.9 s against 0.8–1.7 s on the
//! engine with a core of its own (`radixgate-bench real`, docs, concurrency 8, the
//! tail of the runs where prefix_aware lost to least_loaded).
//!
//! A backend is *saturated* when its load is at `saturation_inflight` or more and at
//! least [`SATURATION_OVER_MEAN`] times the candidates' mean load. The pick goes, in
//! order:
//!
//! 1. to the session's home backend if it is not saturated ([`Reason::SessionAffinity`]);
//! 2. when the prompt is a new prefix (its longest match is shorter than
//!    `min_match_blocks`, or every candidate holds that much of it, as with a system
//!    prompt all engines hold, and the prompt goes on at least `min_match_blocks`
//!    beyond it): among those whose wait (the first three terms above, and the
//!    sharing line over the wait and the prompt's prefill) is within
//!    `new_prefix_slack_requests` (default [`NEW_PREFIX_SLACK_REQUESTS`]) requests'
//!    cost of the shortest (each candidate's learned fixed delay forgiven up to the
//!    tie band's width of the best estimate, so that milliseconds between fixed delays
//!    do not decide), to the one given the fewest new prefixes lately
//!    ([`RecentPlacements`], counted over the backends sharing its compute:
//!    [`PrefixAware::placed_on_hardware`]; off with `spread_new_prefixes = false`),
//!    then the fewest on the backend itself (backends sharing their compute do not
//!    share their caches), then the most free cache room, then the shortest wait; a
//!    prompt that extends a placement kept (its conversation's first turn, placed
//!    as a new prefix) goes back to that placement's backend first, if it is among
//!    them ([`RecentPlacements::observe`] finds it). A backend whose recent
//!    new prefixes and this one, grown to the size prompts lately reached, would
//!    overflow its cache has the overflow added to its wait first
//!    ([`PrefixAware::crowding_ns`]; off with
//!    `price_footprint = false`). [`Reason::NoMatch`] when nothing matched,
//!    [`Reason::LongestPrefix`] when every candidate holds a useful match, else
//!    [`Reason::FallbackLeastLoaded`];
//! 3. otherwise to the unsaturated candidate with the longest match inside the tie band
//!    (estimates within `hysteresis` of the best, plus [`TIE_FLOOR_NS`]), then the least
//!    loaded, then the most free cache room, then a seeded random one. A candidate
//!    short of the longest match would take the prompt as a new prefix of its own,
//!    which grows there: its estimate carries the same overflow charge as in 2, and a
//!    pick of it counts as a new prefix placed there. [`Reason::LongestPrefix`] when
//!    it holds the longest match, [`Reason::SpilledFromSaturated`] when every holder
//!    of the longest match is saturated, [`Reason::FallbackLeastLoaded`] when load
//!    beat affinity;
//! 4. when every candidate is saturated, as in 3 among all of them: none has room,
//!    so the estimate alone decides.
//!
//! This is how a hot prefix replicates: the gateway inserts the prompt's blocks for
//! whichever backend it picks, so a spill target becomes a second holder, and later
//! ties between holders go to the least loaded of them.
//!
//! Free cache room (`cache_free_blocks`, none known counting as none) decides between
//! equally loaded backends because a prefix placed where the cache has room evicts
//! nothing, and one placed in a full cache evicts a prefix that may be asked for
//! again. On an idle fleet every queue is empty, and a random pick put five of eight
//! new conversations on one engine whose cache could hold three; they then evicted
//! each other at every turn (`radixgate-bench real`, multiturn, 64 blocks, concurrency 1).
//! A new prefix (step 2) goes by room even when the waits differ by up to one request
//! ([`NEW_PREFIX_SLACK_REQUESTS`] says why). Room counts the blocks a backend has not
//! used for `room_stale_after_ms` (default [`ROOM_STALE_AFTER_MS`]) as free: in steady
//! state every cache is full, and a full cache of what nobody asks for any more is as
//! good a place as an empty one (the router computes it, [`crate::PrefixIndex::room_blocks`]).
//!
//! "Least loaded" counts `load` throughout; ties among equals
//! are broken by the caller's seeded RNG (reservoir sampling, one pass, no scratch), so a
//! pick allocates nothing and replays exactly under the same seed and candidate order.

use std::cmp::Reverse;

use super::{BackendIdx, Candidate, Pick, Reason, RouteInput, RoutingPolicy};

/// Absolute width added to the relative tie band, so near-zero estimates (an idle
/// fleet and a fully cached prompt) still leave room for ties instead of letting a few
/// microseconds of difference decide. 1 ms is half the default per-request queue
/// cost, so one extra request ahead is never a tie on its own.
pub const TIE_FLOOR_NS: f64 = 1_000_000.0;

/// A full backend counts as saturated only while its load is at least this many times
/// the candidates' mean. A fixed cap alone degenerates when the whole fleet is busy:
/// with 192 requests in flight on 3 backends every backend hovers at the cap, the valve
/// then decides every pick and prefix_aware becomes least-loaded (`radixgate-bench sim
/// --sweep concurrency`: 44% hit rate at window 192, 94% with this rule). 1.25 still
/// let hot spots through (92%); 2 was no better than 1.5.
pub const SATURATION_OVER_MEAN: f64 = 1.5;

/// The share of a cold prefill charged for each block a placement evicts
/// ([`PrefixAware::eviction_ns`]): the blocks a full cache gives up are its least
/// recently used, so only some of them are asked for again. Without the charge a spill
/// into a full cache evicted the only copy of another document, whose next request
/// then spilled in turn (`radixgate-bench sim`, docs, seeds 1–5: hit rate 95.9–98.4%,
/// mean TTFT 2.5–9.6 ms). At 0.25: 98.1–98.4%, 2.7–3.6 ms, load CoV ≤ 0.10. At 0.5 and
/// 1 the hit rate is the same or slightly higher but load CoV reaches 0.12 and 0.18.
pub const EVICTION_WEIGHT: f64 = 0.25;

/// How many requests' wait a backend may be behind the soonest and still take a new
/// prefix for its free cache room ([`PrefixAwareConfig::new_prefix_slack_requests`]).
/// A new conversation grows at every turn where it is placed. By the shortest wait
/// alone (0), the engine that had always just answered took five of eight new
/// conversations and its cache churned (`radixgate-bench real`, multiturn, 64
/// blocks, concurrency 4: engine hit rate 0.73 of the ceiling); within one request,
/// 0.86. Two would let a placement wait a whole extra request for room.
pub const NEW_PREFIX_SLACK_REQUESTS: u32 = 1;

/// How long ago a backend must have last used a block for it to count as free cache
/// room ([`PrefixAwareConfig::room_stale_after_ms`]). A cache the index counts as full
/// of documents from minutes ago took no new conversations while an empty one took
/// six of eight, which then evicted each other (`radixgate-bench real`, multiturn
/// after docs, concurrency 1). A minute is far beyond one conversation's turns here
/// (seconds) and within what a user takes to read a reply.
pub const ROOM_STALE_AFTER_MS: u64 = 60_000;

/// The cost model and thresholds of `prefix_aware`.
///
/// Defaults, and why (the lead tunes them with the simulator; they stay config):
///
/// - `tokens_per_block = 16`: blocks are 64 bytes of canonical prompt, about 16 tokens
///   of English text at ~4 bytes per token.
/// - `default_prefill_ns_per_token = 20_000` (20 µs): what the simulated engine
///   charges; a block then costs 320 µs to prefill.
/// - `queue_ns_per_request = 2_500_000` (2.5 ms): the exchange rate between load and
///   affinity, on top of the queued prefill work, which is charged exactly: about 8
///   matched blocks (125 tokens) are worth one request ahead. Most in-flight requests
///   are decoding, not queued for prefill, so a request ahead costs far less than a
///   cold prefill. A 6 KB document is 96 blocks × 16 tok × 20 µs ≈ 31 ms of prefill
///   saved, so its holder keeps the document's requests while it has up to ~12 more in
///   flight than a cold backend; then it spills, and the spill target becomes a second
///   holder. Measured with `radixgate-bench sim` (docs and multiturn, seeds 1–4): 2 ms
///   let a hot document pile up (Zipf load CoV up to 0.22) and placed new sessions
///   5/3/4; 2.5 ms keeps load CoV ≤ 0.06 and sessions 4/4/4 in most seeds at 96–98%
///   hit rate; 3 ms lets ordinary load gaps swamp affinity (93% uniform).
/// - `min_match_blocks = 2`: a one-block match (a chat template's opening, shared
///   by every prompt) says nothing about where the rest lives; below two blocks the
///   policy is plain least-loaded.
/// - `saturation_inflight = 64`: a cap on top of the estimate. The estimate alone
///   would let a 32k-token document (≈ 640 ms of prefill) sit behind hundreds of
///   queued requests, and it trusts counts that lag during a burst; no backend at 64
///   outstanding (and [`SATURATION_OVER_MEAN`] times the fleet's mean) takes a new
///   request while another has room, which bounds any hot spot. Set it near the
///   engine's batch size times two. Edge admission makes requests wait while every
///   backend is at the cap.
/// - `hysteresis = 0.1`: estimates within 10% (+ [`TIE_FLOOR_NS`]) of the best are a
///   tie, and ties go to the longest match, so small load jitter does not flap a
///   prefix between backends (each flap costs a full prefill and a cache copy). The
///   band is relative, so it widens with the prompt's own cold prefill: for long
///   prompts a few queued requests count as noise next to hundreds of milliseconds of
///   recomputation.
#[derive(Clone, Debug, PartialEq)]
pub struct PrefixAwareConfig {
    /// Prompt tokens per block (64-byte blocks ≈ 16 tokens). Negative, NaN or
    /// infinite values count as 0 (prefill then costs nothing: load alone decides,
    /// ties to the longest match).
    pub tokens_per_block: f64,
    /// Prefill cost for candidates without a learned one, in ns per token.
    pub default_prefill_ns_per_token: u32,
    /// Expected delay each request ahead adds beyond its prefill, in ns.
    pub queue_ns_per_request: u64,
    /// A longest match below this many blocks routes as least-loaded (at least 1 is
    /// used: a match of nothing is never affinity).
    pub min_match_blocks: u32,
    /// A backend with a load (`max(in_flight, engine_waiting)`) at or above this is
    /// full, and saturated when also at [`SATURATION_OVER_MEAN`] times the mean: it
    /// then takes a request only when every candidate is (0 marks every backend full).
    pub saturation_inflight: u32,
    /// Relative estimated-TTFT band treated as a tie (0.1: within 10% of the best).
    /// Negative, NaN or infinite values count as 0.
    pub hysteresis: f64,
    /// Use each backend's learned delay per request ahead
    /// ([`Candidate::queue_ns_per_request`]) where it has one; off, every backend
    /// costs `queue_ns_per_request` (the ablation).
    pub learned_queue_cost: bool,
    /// Share of a cold prefill charged per block a placement evicts
    /// ([`PrefixAware::eviction_ns`]; default [`EVICTION_WEIGHT`]; 0 turns the term off,
    /// the ablation). Negative, NaN or infinite values count as 0.
    pub eviction_weight: f64,
    /// A prompt with no useful match goes to the most free cache room among the
    /// backends whose wait is within this many requests (at each one's cost per
    /// request) of the shortest; 0: the shortest wait first, room only among equals
    /// (the ablation). Default [`NEW_PREFIX_SLACK_REQUESTS`].
    pub new_prefix_slack_requests: u32,
    /// The gateway learns each backend's prefill cost as a fixed delay plus a rate per
    /// uncached token ([`Candidate::prefill_fixed_ns`]); off, as a rate alone (the
    /// ablation). The gateway reads this where it learns; the policy adds whatever
    /// fixed delay the candidates carry.
    pub learned_fixed_delay: bool,
    /// Blocks a backend last used this long ago (ms) count as free cache room
    /// (`cache_free_blocks`): every cache in steady state is full, and what decides
    /// where a new prefix fits is how much of it is still in use. 0: only truly free
    /// blocks count. Default [`ROOM_STALE_AFTER_MS`]. The router applies it.
    pub room_stale_after_ms: u64,
    /// A new prefix goes to the backend given the fewest new prefixes lately (of
    /// those within the slack), and only then by cache room; off, by room alone (the
    /// ablation). See [`RecentPlacements`].
    pub spread_new_prefixes: bool,
    /// A new prefix is expected to grow to the size of the large prompts seen lately
    /// ([`PromptSizes`]); a backend whose recent new prefixes, at that size, would
    /// overflow its cache is charged for the overflow ([`PrefixAware::crowding_ns`]);
    /// off, a new prefix is priced at its size now (the ablation).
    pub price_footprint: bool,
    /// A match counts only as far as it fits beside the cache the requests in
    /// flight on its backend hold ([`PrefixAware::kept_blocks`]); off, a match
    /// counts whole however busy its backend's cache (the ablation).
    pub price_cache_in_use: bool,
    /// A new prefix placed counts toward its backend's recent new prefixes only while
    /// prompts that extend it keep coming ([`RecentPlacements`]); off, until enough
    /// others are placed after it, however long ago it was last used (the ablation).
    pub forget_unused_placements: bool,
}

impl Default for PrefixAwareConfig {
    fn default() -> Self {
        Self {
            tokens_per_block: 16.0,
            default_prefill_ns_per_token: 20_000,
            queue_ns_per_request: 2_500_000,
            min_match_blocks: 2,
            saturation_inflight: 64,
            hysteresis: 0.1,
            learned_queue_cost: true,
            eviction_weight: EVICTION_WEIGHT,
            new_prefix_slack_requests: NEW_PREFIX_SLACK_REQUESTS,
            learned_fixed_delay: true,
            room_stale_after_ms: ROOM_STALE_AFTER_MS,
            spread_new_prefixes: true,
            price_footprint: true,
            price_cache_in_use: true,
            forget_unused_placements: true,
        }
    }
}

#[derive(Clone, Debug)]
pub struct PrefixAware {
    tokens_per_block: f64,
    default_prefill_ns_per_token: u32,
    queue_ns_per_request: f64,
    min_match_blocks: u32,
    saturation: u64,
    /// `1 + hysteresis`.
    band: f64,
    learned_queue_cost: bool,
    eviction_weight: f64,
    new_prefix_slack: f64,
    spread_new_prefixes: bool,
    price_footprint: bool,
    price_cache_in_use: bool,
    recent_new_prefixes: RecentPlacements,
    prompt_sizes: PromptSizes,
}

// === impl PrefixAware ===

impl PrefixAware {
    pub fn new(config: &PrefixAwareConfig) -> Self {
        let non_negative = |x: f64| if x.is_finite() && x > 0.0 { x } else { 0.0 };
        Self {
            tokens_per_block: non_negative(config.tokens_per_block),
            default_prefill_ns_per_token: config.default_prefill_ns_per_token,
            queue_ns_per_request: config.queue_ns_per_request as f64,
            min_match_blocks: config.min_match_blocks.max(1),
            saturation: u64::from(config.saturation_inflight),
            band: 1.0 + non_negative(config.hysteresis),
            learned_queue_cost: config.learned_queue_cost,
            eviction_weight: non_negative(config.eviction_weight),
            new_prefix_slack: f64::from(config.new_prefix_slack_requests),
            spread_new_prefixes: config.spread_new_prefixes,
            price_footprint: config.price_footprint,
            price_cache_in_use: config.price_cache_in_use,
            recent_new_prefixes: RecentPlacements {
                keep_unused: !config.forget_unused_placements,
                ..RecentPlacements::default()
            },
            prompt_sizes: PromptSizes::default(),
        }
    }

    /// [`Self::new`] with room reserved for `backends` backends' placement counts, so
    /// that picks do not allocate.
    pub fn for_backends(config: &PrefixAwareConfig, backends: usize) -> Self {
        let mut policy = Self::new(config);
        policy.recent_new_prefixes.reserve(backends);
        policy
    }

    /// The candidate's estimated time to first token for a prompt of `prompt_blocks`
    /// complete blocks, in ns (see the module docs for the formula).
    pub fn est_ttft_ns(&self, candidate: &Candidate, prompt_blocks: u32) -> f64 {
        let own = self.wait_ns(candidate) + self.prefill_ns(candidate, prompt_blocks);
        own + self.sharing_ns(candidate, own)
    }

    /// How long the prompt would wait on this backend before its own prefill, in
    /// ns: its wait ([`Self::wait_ns`]) and what sharing the compute adds to the
    /// whole of its work ([`Self::sharing_ns`]). [`Self::est_ttft_ns`] less the
    /// prompt's own prefill.
    pub fn shared_wait_ns(&self, candidate: &Candidate, prompt_blocks: u32) -> f64 {
        let wait = self.wait_ns(candidate);
        wait + self.sharing_ns(candidate, wait + self.prefill_ns(candidate, prompt_blocks))
    }

    /// The prompt's own prefill on this backend, in ns: its blocks the backend will
    /// not hold when the request's turn comes ([`Self::kept_blocks`]) and its
    /// uncached media.
    fn prefill_ns(&self, candidate: &Candidate, prompt_blocks: u32) -> f64 {
        let missing = prompt_blocks.saturating_sub(self.kept_blocks(candidate, prompt_blocks));
        if missing == 0 && candidate.uncached_media_tokens == 0 {
            // Also keeps an infinite per-block cost from turning into NaN.
            return 0.0;
        }
        self.prefill_ns_per_token(candidate)
            * (self.tokens_per_block * f64::from(missing)
                + f64::from(candidate.uncached_media_tokens))
    }

    /// How much of the candidate's match (`matched_blocks`) the engine will still
    /// hold when the request's turn comes: what fits in its cache (`cache_blocks`)
    /// beside the prompt itself and the cache the requests in flight there hold
    /// ([`Self::busy_blocks`]). An engine cannot evict a running request's blocks; a
    /// cached prefix waiting in its queue is only free blocks, and the requests ahead
    /// of it evict it when they need the room (vLLM frees a prompt's blocks tail
    /// first, so its tail goes first). The index, which saw this prompt last, keeps it
    /// and evicts older blocks instead, so without this a match counted whole on an
    /// engine whose cache the work ahead fills: on three CPU engines with 64 blocks
    /// each, the requests whose in-flight neighbours and own prompt needed more than
    /// the cache found 0.15–0.53 of their prompt cached against 0.52–0.73 otherwise,
    /// and 16 of 79 found nothing, in either hashing mode; requests sent to a holder
    /// that had nothing left waited 2.3–6.7 s for a whole prefill behind the others
    /// (`radixgate-bench real`, multiturn, all of them at concurrency 8).
    /// The whole match when the term is off (`price_cache_in_use = false`), or the
    /// capacity or the engine's KV usage is unknown.
    #[inline]
    pub fn kept_blocks(&self, candidate: &Candidate, prompt_blocks: u32) -> u32 {
        let matched = candidate.matched_blocks;
        // The common case first, in integers: even every prompt in flight fits.
        let fits =
            candidate.in_flight_blocks.saturating_add(prompt_blocks) <= candidate.cache_blocks;
        if fits || !self.price_cache_in_use || candidate.cache_blocks == 0 || matched == 0 {
            return matched;
        }
        let Some(busy) = self.busy_blocks(candidate) else {
            return matched;
        };
        let needed = busy.saturating_add(prompt_blocks);
        matched - needed.saturating_sub(candidate.cache_blocks).min(matched)
    }

    /// The cache the requests in flight on this backend hold while they run, in
    /// blocks: their prompts (`in_flight_blocks`), bounded by what the engine last
    /// reported its running requests hold (`engine_used_blocks`) plus what the
    /// requests without a first token still have to fill (their pending prefill).
    /// Requests that share a prefix hold it once, which only the engine's count
    /// knows: by their prompts alone, a hot document's requests in flight counted as
    /// many copies of it, its holders looked as if they had lost it, and the hit
    /// rate of the simulator's docs workload (600 requests, one gateway) fell from
    /// 0.96 to 0.45. `None` when the engine does not report its usage (or reports
    /// 0: idle at its last scrape).
    pub fn busy_blocks(&self, candidate: &Candidate) -> Option<u32> {
        let used = candidate.engine_used_blocks?;
        let pending = if self.tokens_per_block > 0.0 {
            (f64::from(candidate.pending_prefill_tokens) / self.tokens_per_block).ceil() as u32
        } else {
            0
        };
        Some(candidate.in_flight_blocks.min(used.saturating_add(pending)))
    }

    /// What the backends sharing this one's compute add to `own_ns` of work on it,
    /// in ns. A peer with requests in flight (`peers_busy`) works on until they have
    /// answered, decode included, which outlasts the prefill queued there: the
    /// work runs at `1 / (1 + peers_busy)` of the hardware throughout (the share the
    /// learned costs take out, `crate::Decision::peers_busy_before`). Where the peers'
    /// queued work (`peer_queue_ns`, which counts what other clients queue there too)
    /// says more, the work finishes later by as much of it as overlaps: the smaller
    /// of the two.
    pub fn sharing_ns(&self, candidate: &Candidate, own_ns: f64) -> f64 {
        let busy = own_ns * f64::from(candidate.peers_busy);
        busy.max(own_ns.min(candidate.peer_queue_ns as f64))
    }

    /// What placing the prompt on this backend costs later, in ns: its missing blocks
    /// beyond the cache's free room evict as many blocks it holds now, which some later
    /// request will have to prefill again, charged at `eviction_weight` of a cold
    /// prefill each. Not part of the TTFT estimate (the request itself does not wait
    /// for it): it only ranks candidates, so a spill into a full cache has to promise
    /// a clearly earlier first token than staying where the prompt is cached.
    pub fn eviction_ns(&self, candidate: &Candidate, prompt_blocks: u32) -> f64 {
        let Some(free) = candidate.cache_free_blocks else {
            return 0.0;
        };
        let evicted = prompt_blocks
            .saturating_sub(candidate.matched_blocks)
            .saturating_sub(free);
        if evicted == 0 {
            return 0.0;
        }
        self.eviction_weight
            * self.prefill_ns_per_token(candidate)
            * self.tokens_per_block
            * f64::from(evicted)
    }

    /// What a new prefix placed on this backend is expected to cost its cache later,
    /// in ns: the backend's recent new prefixes ([`RecentPlacements`]) and this one,
    /// each grown to `footprint_blocks` (the size of the large prompts seen lately,
    /// [`PromptSizes`]), beyond the backend's cache capacity (`cache_blocks`), at a
    /// cold prefill per block. A conversation is a few blocks at its first turn and
    /// grows at every turn where it was placed; blocks its growth pushes out are
    /// ones a live conversation asks for at its next turn, so each is charged a whole
    /// prefill, not the `eviction_weight` share of a least-recently-used block. 0
    /// when the capacity is unknown or the footprint is not priced.
    ///
    /// `counted` is the weight the prompt's own conversation already has among the
    /// backend's placements (its [`Home`]'s, on that backend; else 0), which this one
    /// replaces: counted as a placement there and again as a new one, a second turn
    /// was charged 6.6 s on its first turn's engine, which then no longer looked
    /// close to the soonest, and it left for an engine whose wait was 3.7 s longer
    /// (precise mode, where a second turn holds one block, too short a match to
    /// count; `radixgate-bench real`, multiturn, concurrency 4; the decision log).
    pub fn crowding_ns(&self, candidate: &Candidate, footprint_blocks: u32, counted: f32) -> f64 {
        if !self.price_footprint || candidate.cache_blocks == 0 {
            return 0.0;
        }
        let recent = self.recent_new_prefixes.recent(candidate.backend);
        let live = f64::from((recent - counted).max(0.0)) + 1.0;
        let overflow = live * f64::from(footprint_blocks) - f64::from(candidate.cache_blocks);
        if overflow <= 0.0 {
            return 0.0;
        }
        self.prefill_ns_per_token(candidate) * self.tokens_per_block * overflow
    }

    /// The new prefixes placed lately ([`RecentPlacements`]) on the hardware `c` runs
    /// on, rounded to a whole count: its own, and where it shares its compute
    /// (`compute_group`), those of every candidate in its group too. Two engines on
    /// one core serve together what one engine alone on a core serves; counted each
    /// as one, the core shared by two of three engines took five or six of eight new
    /// conversations, whose turns then queued behind each other there
    /// (`radixgate-bench real`, multiturn, all of them at concurrency 8).
    pub fn placed_on_hardware(&self, candidates: &[Candidate], c: &Candidate) -> u32 {
        let recent = &self.recent_new_prefixes;
        match c.compute_group {
            None => recent.placed(c.backend),
            Some(group) => recent.placed_on(
                candidates
                    .iter()
                    .filter(|d| d.compute_group == Some(group))
                    .map(|d| d.backend),
            ),
        }
    }

    /// What the cost model makes of candidate `c` among `candidates` for a prompt
    /// of `prompt_blocks` blocks: the terms a decision weighed, for a log line that
    /// explains it. Counts of new prefixes are as the policy last counted them: a
    /// decision that weighed them counted them, its own placement included.
    pub fn explain(
        &self,
        candidates: &[Candidate],
        c: &Candidate,
        prompt_blocks: u32,
    ) -> Explained {
        let shared = candidates
            .iter()
            .map(|d| d.matched_blocks)
            .min()
            .unwrap_or(0);
        Explained {
            backend: c.backend,
            matched_blocks: c.matched_blocks,
            kept_blocks: self.kept_blocks(c, prompt_blocks),
            busy_blocks: self.busy_blocks(c),
            in_flight: c.in_flight,
            est_ttft_ns: self.est_ttft_ns(c, prompt_blocks),
            shared_wait_ns: self.shared_wait_ns(c, prompt_blocks),
            eviction_ns: self.eviction_ns(c, prompt_blocks),
            crowding_ns: self.crowding_ns(c, self.footprint_blocks(shared), 0.0),
            placed_on_hardware: self.placed_on_hardware(candidates, c),
            free_room: free_room(c),
        }
    }

    /// What a new prefix is expected to add to a cache once grown, in blocks: the
    /// size of the large prompts seen lately ([`PromptSizes::large`]) less the
    /// `shared` blocks every candidate holds already.
    fn footprint_blocks(&self, shared: u32) -> u32 {
        self.prompt_sizes.large().saturating_sub(shared)
    }

    /// The ranking cost: [`Self::est_ttft_ns`] plus [`Self::eviction_ns`].
    fn cost_ns(&self, candidate: &Candidate, prompt_blocks: u32) -> f64 {
        self.est_ttft_ns(candidate, prompt_blocks) + self.eviction_ns(candidate, prompt_blocks)
    }

    /// How long a new request would wait on this backend before its own prefill, in
    /// ns: its queue ([`Self::queue_ns`]) and the backend's learned fixed delay
    /// (`prefill_fixed_ns`). This is what "least loaded" compares when the prompt's
    /// match is too short to matter.
    pub fn wait_ns(&self, candidate: &Candidate) -> f64 {
        self.queue_ns(candidate) + f64::from(candidate.prefill_fixed_ns)
    }

    /// The queue ahead of a new request on this backend, in ns: the first two terms of
    /// the estimate, or, when the backend is late, how long it has been working on its
    /// pending prefill.
    ///
    /// A backend is *late* when the time it has spent on its pending prefill
    /// (`prefill_progress_ns`) exceeds all the wait the estimate expected (the requests
    /// ahead and the whole queued prefill): it is stalled, or far slower than its
    /// learned costs. Its wait is then taken to be at least the time already spent, so
    /// it grows for as long as the backend does not answer, and new requests go
    /// elsewhere until it does (its next first byte resets the clock). On three CPU
    /// engines sharing two cores, an engine stopped answering for 10–14 s while its
    /// core neighbour ran; the estimate, which had dropped the credit but charged only
    /// the queued work, kept sending requests there, and those made the tail
    /// (`radixgate-bench real`, multiturn, all of them at concurrency 8).
    pub fn queue_ns(&self, candidate: &Candidate) -> f64 {
        let ahead = self.per_request_ns(candidate) * load(candidate) as f64;
        let progress = candidate.prefill_progress_ns as f64;
        match candidate.pending_prefill_tokens {
            0 => ahead,
            tokens => {
                let expected = ahead
                    + f64::from(candidate.prefill_fixed_ns)
                    + self.prefill_ns_per_token(candidate) * f64::from(tokens);
                if progress > expected {
                    progress
                } else {
                    ahead + self.pending_prefill_ns(candidate)
                }
            }
        }
    }

    /// What each request ahead on this backend adds to the wait, in ns: its learned
    /// cost where it has one (and learning is on), else `queue_ns_per_request`.
    fn per_request_ns(&self, candidate: &Candidate) -> f64 {
        match candidate.queue_ns_per_request {
            learned if learned > 0 && self.learned_queue_cost => f64::from(learned),
            _ => self.queue_ns_per_request,
        }
    }

    /// The prefill still to do on this backend before a new request's, in ns: the
    /// pending tokens at its prefill cost, less the progress made on them while that
    /// progress is short of them (the module docs say why it is dropped beyond).
    pub fn pending_prefill_ns(&self, candidate: &Candidate) -> f64 {
        if candidate.pending_prefill_tokens == 0 {
            // Also keeps an infinite per-token cost from turning into NaN.
            return 0.0;
        }
        let queued =
            self.prefill_ns_per_token(candidate) * f64::from(candidate.pending_prefill_tokens);
        let progress = candidate.prefill_progress_ns as f64;
        if progress < queued {
            queued - progress
        } else {
            queued
        }
    }

    fn prefill_ns_per_token(&self, candidate: &Candidate) -> f64 {
        f64::from(match candidate.prefill_ns_per_token {
            0 => self.default_prefill_ns_per_token,
            learned => learned,
        })
    }

    /// The backend holds `saturation_inflight` or more requests: the engine is full.
    /// Edge admission waits while every candidate is full.
    pub fn is_full(&self, candidate: &Candidate) -> bool {
        load(candidate) >= self.saturation
    }

    /// The backend is full ([`Self::is_full`]) and also carries at least
    /// [`SATURATION_OVER_MEAN`] times the candidates' mean load (`mean_load`, from
    /// [`mean_load`]): it takes a request only when every candidate is saturated.
    pub fn is_saturated(&self, candidate: &Candidate, mean_load: f64) -> bool {
        saturated(candidate, self.saturation, mean_load)
    }

    /// A request this policy placed, whose prompt ends in `tail`, ended at `now_ms`
    /// ([`RecentPlacements::ended`]).
    pub fn request_ended(&mut self, tail: PromptTail, now_ms: u64) {
        self.recent_new_prefixes.ended(tail, now_ms);
    }
}

impl RoutingPolicy for PrefixAware {
    fn pick(&mut self, input: &RouteInput<'_>, rng: &mut fastrand::Rng) -> Option<Pick> {
        let candidates = input.candidates;
        let prompt_blocks = input.prompt_blocks;
        self.prompt_sizes.record(prompt_blocks);
        let conversation_home = self.recent_new_prefixes.observe(input.prompt, input.now_ms);
        let home_backend = conversation_home.map(|h| h.backend);
        // What the prompt's own conversation already counts on candidate `c`.
        let counted = |c: &Candidate| match conversation_home {
            Some(home) if home.backend == c.backend => home.weight,
            _ => 0.0,
        };
        let pick = |c: Candidate, reason| {
            Some(Pick {
                backend: c.backend,
                reason,
            })
        };

        let mean_load = mean_load(candidates);
        let saturation = self.saturation;
        let is_saturated = |c: &Candidate| saturated(c, saturation, mean_load);
        // 1. The session's home, unless saturated.
        let home = choose(candidates, rng, |c| {
            (c.session_home && !is_saturated(c)).then(|| load(c))
        });
        if let Some(c) = home {
            return pick(c, Reason::SessionAffinity);
        }

        // When every candidate is saturated, none has room and all compete as equals:
        // the estimate still decides, so affinity survives a fleet-wide overload
        // instead of degenerating into least-loaded.
        let all_saturated = candidates.iter().all(is_saturated);
        let has_room = |c: &Candidate| all_saturated || !is_saturated(c);

        // The longest match, whether a backend with room holds it, and the best
        // estimate among backends with room.
        let mut best = 0;
        let mut best_open = false;
        let mut shared = u32::MAX;
        let mut min_est = f64::INFINITY;
        for c in candidates {
            let open = has_room(c);
            shared = shared.min(c.matched_blocks);
            if c.matched_blocks > best {
                best = c.matched_blocks;
                best_open = open;
            } else if c.matched_blocks == best {
                best_open |= open;
            }
            if open {
                min_est = min_est.min(self.cost_ns(c, prompt_blocks));
            }
        }

        // What every candidate holds (none when there are no candidates).
        let shared = shared.min(best);

        // 2. A new prefix: the match is too short to matter, or every candidate
        // holds as much of it (a system prompt all engines hold) and the prompt goes
        // on beyond it.
        let only_shared = best - shared < self.min_match_blocks
            && prompt_blocks.saturating_sub(best) >= self.min_match_blocks;
        if best < self.min_match_blocks || only_shared {
            let reason = match best {
                0 => Reason::NoMatch,
                held if held >= self.min_match_blocks => Reason::LongestPrefix,
                _ => Reason::FallbackLeastLoaded,
            };
            // A new prefix goes, among the backends that could start it within
            // `new_prefix_slack_requests` requests' wait of the soonest (forgiving
            // each its learned fixed delay up to the tie band's width of the
            // request's best cost, so that a few milliseconds between fixed delays do
            // not decide, while a backend without one waits exactly what it did), to
            // the one given the fewest new prefixes lately (on its hardware, then on
            // itself: backends sharing a core share its compute, not their caches),
            // then the most cache room. Before all that, a prompt that extends a
            // placement kept (its conversation's earlier turn, too short for its
            // match to count) stays on that placement's backend: it was spread when
            // placed, and the count of new prefixes there includes its own, which
            // would otherwise push it off.
            let footprint = self.footprint_blocks(shared);
            self.recent_new_prefixes.count(input.now_ms);
            let later = |c: &Candidate| {
                self.shared_wait_ns(c, prompt_blocks) + self.crowding_ns(c, footprint, counted(c))
            };
            let soonest = candidates.iter().map(later).fold(f64::INFINITY, f64::min);
            let tolerance = (self.band - 1.0) * min_est + TIE_FLOOR_NS;
            let chosen = choose(candidates, rng, |c| {
                let wait = later(c);
                let forgiven = tolerance.min(f64::from(c.prefill_fixed_ns));
                let close =
                    wait <= soonest + forgiven + self.new_prefix_slack * self.per_request_ns(c);
                let (placed, placed_here) = if self.spread_new_prefixes {
                    (
                        self.placed_on_hardware(candidates, c),
                        self.recent_new_prefixes.placed(c.backend),
                    )
                } else {
                    (0, 0)
                };
                close.then(|| {
                    (
                        home_backend != Some(c.backend),
                        placed,
                        placed_here,
                        Reverse(free_room(c)),
                        wait as u64,
                    )
                })
            })?;
            if self.spread_new_prefixes || self.price_footprint {
                self.recent_new_prefixes
                    .record(chosen.backend, input.prompt, best, input.now_ms);
            }
            return pick(chosen, reason);
        }

        // 3. The tie band: longest match first, then least loaded, then the RNG. A
        // backend short of the longest match would take the prompt as a new prefix
        // of its own, which grows there at every later turn: it is charged for the
        // overflow as a new prefix is (a conversation leaving its holder for an
        // engine a fixed delay faster had filled that engine's cache).
        let moves_priced = self.price_footprint
            && candidates
                .iter()
                .any(|c| c.matched_blocks < best && c.cache_blocks > 0);
        let footprint = if moves_priced {
            self.recent_new_prefixes.count(input.now_ms);
            self.footprint_blocks(shared)
        } else {
            0
        };
        let cost = |c: &Candidate| {
            let own = self.cost_ns(c, prompt_blocks);
            if c.matched_blocks < best {
                own + self.crowding_ns(c, footprint, counted(c))
            } else {
                own
            }
        };
        if moves_priced {
            min_est = candidates
                .iter()
                .filter(|c| has_room(c))
                .map(cost)
                .fold(f64::INFINITY, f64::min);
        }
        let threshold = min_est * self.band + TIE_FLOOR_NS;
        let chosen = choose(candidates, rng, |c| {
            (has_room(c) && cost(c) <= threshold).then(|| {
                (
                    Reverse(self.kept_blocks(c, prompt_blocks)),
                    load(c),
                    Reverse(free_room(c)),
                )
            })
        })?;
        if moves_priced && chosen.matched_blocks < best {
            self.recent_new_prefixes
                .record(chosen.backend, input.prompt, best, input.now_ms);
        }
        let reason = if all_saturated && chosen.matched_blocks < best {
            Reason::SpilledFromSaturated
        } else if chosen.matched_blocks == best {
            Reason::LongestPrefix
        } else if !best_open {
            Reason::SpilledFromSaturated
        } else {
            Reason::FallbackLeastLoaded
        };
        pick(chosen, reason)
    }
}

/// One candidate of a decision as the cost model saw it ([`PrefixAware::explain`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Explained {
    pub backend: BackendIdx,
    pub matched_blocks: u32,
    /// [`PrefixAware::kept_blocks`].
    pub kept_blocks: u32,
    /// [`PrefixAware::busy_blocks`].
    pub busy_blocks: Option<u32>,
    pub in_flight: u32,
    pub est_ttft_ns: f64,
    /// [`PrefixAware::shared_wait_ns`]: what step 2 compares for a new prefix,
    /// with `crowding_ns`.
    pub shared_wait_ns: f64,
    pub eviction_ns: f64,
    /// [`PrefixAware::crowding_ns`] at the footprint of the large prompts lately.
    pub crowding_ns: f64,
    pub placed_on_hardware: u32,
    pub free_room: u32,
}

/// How many new prefixes each backend was given lately and still serves: a count per
/// backend that decays by [`NEW_PREFIX_MEMORY`] at every new prefix placed anywhere,
/// so it counts roughly the last that many placements, less those whose prefix has
/// gone unused ([`IN_USE_GAPS`] times the time between its uses). Step 2 compares it
/// rounded to whole prefixes, so backends within half a prefix of each other are
/// equal and their cache room decides.
///
/// A new conversation is a few blocks at its first turn and grows at every turn
/// where it is placed. By room alone, the backend with the most room took every new
/// conversation until its room was down to the others', sized at their first turns:
/// eight of eight, which then evicted each other as they grew (`radixgate-bench
/// real`, multiturn after docs, concurrency 1: engine hit rate 0.2–0.5 of the
/// ceiling). Counted, eight spread 3/3/2 and room settles the rest.
///
/// A placement is named by the prompt's chained block hash at its last block (its
/// `depth`), which every later turn of the same conversation repeats: each such
/// request *uses* it. Named at the first block no backend held instead, a chat
/// template's first block, shared by every conversation and cached nowhere yet,
/// named many, which every request then used and every new one moved. Counted
/// only by placements, conversations that had ended weighed on their engine until
/// sixteen more were placed: after the documents of a docs run, and at the turn
/// where a multiturn run's conversations start over, the engine alone on its core
/// was charged 1.6–2.0 s of crowding for them and took two of eight new
/// conversations while it idled (`radixgate-bench real`, multiturn, concurrency 8;
/// the decision log). A placement that was never used again (no name, a prompt
/// asked once, a document asked other questions after it) is in use for as long
/// after it was placed: what a document adds to its cache does not grow.
///
/// The gateway also says when each request ends ([`Self::ended`]). Once the request
/// that last used a placement has ended, the time until the next use is the
/// client's own (reading, typing, a tool call), not the engine's: the placement then
/// counts for [`IN_USE_GAPS`] times that "think" time (its own last one, or the
/// moving mean of all, whichever is longer, at least [`THINK_FLOOR_MS`]) after the
/// end. Timed from its uses alone, a conversation that had ended counted for three
/// of its turn-to-turn gaps, queueing included: on the engine alone on its core,
/// the ended conversations counted for up to 5 s after their last turns began
/// (1.4–1.9 s of crowding while it had one request in flight or none), and six of
/// eight new conversations went to the shared core (`radixgate-bench real`,
/// multiturn, concurrency 8, seed 2; the decision log).
/// While that request is in flight, or when ends are not reported, the time
/// between uses decides as above.
#[derive(Clone, Debug, Default)]
pub struct RecentPlacements {
    /// The new prefixes placed lately, at most [`NEW_PREFIXES_KEPT`]: when full, the
    /// one placed longest ago goes.
    placed: Vec<Placed>,
    /// Per backend, the weights of its placements still in use as of the last
    /// [`Self::observe`] or [`Self::record`]; grows when a backend first gets one.
    live: Vec<f32>,
    /// The mean time between two uses of a placed prefix, in ms (moving average; 0:
    /// none seen yet, and then every placement counts as in use).
    gap_ms: f32,
    /// The mean time from a request's end to the next use of the placement it used,
    /// in ms (moving average; 0: none seen yet).
    think_ms: f32,
    /// Count every placement kept, used lately or not (`forget_unused_placements =
    /// false`, the ablation).
    keep_unused: bool,
}

/// One new prefix placed ([`RecentPlacements`]).
#[derive(Clone, Copy, Debug)]
struct Placed {
    backend: BackendIdx,
    /// The prompt's chained hash at `depth`, its last block: every prompt that
    /// extends this one has it there. `None` when backends held all of it.
    name: Option<(usize, u64)>,
    weight: f32,
    /// When it was placed or last used, in ms.
    used_ms: u64,
    /// The time between its last two uses, in ms (0: used once).
    gap_ms: f32,
    /// The request that used it last, by its prompt's tail ([`PromptTail`]).
    user: PromptTail,
    /// When that request ended, in ms (`None` while it is in flight, or when the
    /// gateway does not report ends).
    ended_ms: Option<u64>,
    /// The time from the end of a request to its next use, last seen (0: none).
    think_ms: f32,
}

/// The placement a prompt extends ([`RecentPlacements::observe`]): its
/// conversation's earlier turn, placed as a new prefix.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Home {
    pub backend: BackendIdx,
    /// Its weight among the backend's counts once counted (used now, so in use).
    pub weight: f32,
}

/// A request's prompt by its last block: the depth and chained hash there (`None`
/// for an empty prompt). What [`RecentPlacements::ended`] is told, so that the
/// gateway need not keep a whole prompt until its request ends.
pub type PromptTail = Option<(usize, u64)>;

/// The tail of `prompt` (its chained block hashes).
pub fn prompt_tail(prompt: &[u64]) -> PromptTail {
    prompt.len().checked_sub(1).map(|last| (last, prompt[last]))
}

/// The decay of [`RecentPlacements`] per new prefix placed: `1 - 1/16`, a memory of
/// about sixteen placements (twice the conversations the benchmark opens at once).
pub const NEW_PREFIX_MEMORY: f32 = 15.0 / 16.0;

/// How many placements [`RecentPlacements`] keeps: the oldest of 32 weighs 0.13.
pub const NEW_PREFIXES_KEPT: usize = 32;

/// A placed prefix stops counting once it has gone unused for this many times the
/// time between its uses (its own last gap, or the mean of all, whichever is
/// longer): a conversation whose next turn is three gaps late has ended, or gone
/// quiet for long enough that its blocks are the least recently used.
pub const IN_USE_GAPS: f32 = 3.0;

/// The least "think" time [`RecentPlacements`] counts with, in ms: a benchmark's
/// client sends the next turn within milliseconds of the last one's end, and a
/// turn a few milliseconds later than that is not a conversation that ended.
pub const THINK_FLOOR_MS: f32 = 250.0;

/// The weight of a new gap in [`RecentPlacements`]'s mean gap.
const GAP_SMOOTHING: f32 = 1.0 / 8.0;

impl RecentPlacements {
    /// Room for `backends` backends' counts and every kept placement, so that picks
    /// do not allocate.
    pub fn reserve(&mut self, backends: usize) {
        self.placed.reserve(NEW_PREFIXES_KEPT);
        self.live.reserve(backends);
    }

    /// The backend's recent new prefixes in use, rounded to a whole count.
    pub fn placed(&self, backend: BackendIdx) -> u32 {
        self.placed_on(std::iter::once(backend))
    }

    /// The recent new prefixes in use of `backends` together, rounded to a whole
    /// count.
    pub fn placed_on(&self, backends: impl Iterator<Item = BackendIdx>) -> u32 {
        backends.map(|b| self.recent(b)).sum::<f32>().round() as u32
    }

    /// The backend's recent new prefixes in use, unrounded.
    pub fn recent(&self, backend: BackendIdx) -> f32 {
        self.live.get(backend).copied().unwrap_or(0.0)
    }

    /// A request for `prompt` (its chained block hashes) at `now_ms`: the placements
    /// it extends are used now. The counts change at the next [`Self::count`].
    /// Returns the prompt's home: the first placement it extends (an earlier turn of
    /// its conversation, placed as a new prefix), if any.
    pub fn observe(&mut self, prompt: &[u64], now_ms: u64) -> Option<Home> {
        let user = prompt_tail(prompt);
        let mut home = None;
        for p in &mut self.placed {
            if !names(p, prompt) {
                continue;
            }
            home = home.or(Some(Home {
                backend: p.backend,
                weight: p.weight,
            }));
            let gap = now_ms.saturating_sub(p.used_ms) as f32;
            if gap > 0.0 {
                p.gap_ms = gap;
                self.gap_ms = smooth(self.gap_ms, gap);
            }
            if let Some(ended) = p.ended_ms.take() {
                let think = now_ms.saturating_sub(ended) as f32;
                p.think_ms = think;
                self.think_ms = smooth(self.think_ms, think);
            }
            p.used_ms = now_ms;
            p.user = user;
        }
        home
    }

    /// The request whose prompt ends in `tail` ([`prompt_tail`]) ended at `now_ms`:
    /// the placements it used last wait for their next use from now.
    pub fn ended(&mut self, tail: PromptTail, now_ms: u64) {
        if tail.is_none() {
            return;
        }
        for p in &mut self.placed {
            if p.user == tail {
                p.ended_ms = Some(now_ms);
            }
        }
    }

    /// One more new prefix on `backend`: `prompt` (its chained block hashes, empty
    /// when unknown), of which no backend held more than `held` blocks. A prompt that
    /// extends a placement kept (a conversation leaving its backend) moves it.
    pub fn record(&mut self, backend: BackendIdx, prompt: &[u64], held: u32, now_ms: u64) {
        for p in &mut self.placed {
            p.weight *= NEW_PREFIX_MEMORY;
        }
        let moved = self.placed.iter_mut().find(|p| names(p, prompt));
        match moved {
            Some(p) => {
                p.backend = backend;
                p.weight = 1.0;
                p.used_ms = now_ms;
            }
            None => {
                let user = prompt_tail(prompt);
                let placed = Placed {
                    backend,
                    name: user.filter(|&(last, _)| last >= held as usize),
                    weight: 1.0,
                    used_ms: now_ms,
                    gap_ms: 0.0,
                    user,
                    ended_ms: None,
                    think_ms: 0.0,
                };
                if self.placed.len() < NEW_PREFIXES_KEPT {
                    self.placed.push(placed);
                } else if let Some(oldest) = self
                    .placed
                    .iter_mut()
                    .min_by(|a, b| a.weight.total_cmp(&b.weight))
                {
                    *oldest = placed;
                }
            }
        }
        self.count(now_ms);
    }

    /// Sums the weights of the placements in use at `now_ms` per backend: what the
    /// counts read until the next call (a pick calls it only where they matter).
    pub fn count(&mut self, now_ms: u64) {
        self.live.fill(0.0);
        for p in &self.placed {
            if !self.keep_unused && !self.in_use(p, now_ms) {
                continue;
            }
            if self.live.len() <= p.backend {
                self.live.resize(p.backend + 1, 0.0);
            }
            self.live[p.backend] += p.weight;
        }
    }

    /// Whether `p` is still in use at `now_ms` (the type's docs say how it is told).
    fn in_use(&self, p: &Placed, now_ms: u64) -> bool {
        match p.ended_ms {
            Some(ended) => {
                let think = p.think_ms.max(self.think_ms).max(THINK_FLOOR_MS);
                now_ms.saturating_sub(ended) as f32 <= IN_USE_GAPS * think
            }
            None => {
                let gap = p.gap_ms.max(self.gap_ms);
                gap == 0.0 || now_ms.saturating_sub(p.used_ms) as f32 <= IN_USE_GAPS * gap
            }
        }
    }
}

/// `mean` moved towards `sample` by [`GAP_SMOOTHING`] (the sample itself when no
/// mean yet).
fn smooth(mean: f32, sample: f32) -> f32 {
    if mean > 0.0 {
        mean + GAP_SMOOTHING * (sample - mean)
    } else {
        sample
    }
}

/// Whether `prompt` extends the prompt `placed` was named after.
fn names(placed: &Placed, prompt: &[u64]) -> bool {
    placed
        .name
        .is_some_and(|(depth, hash)| prompt.get(depth) == Some(&hash))
}

/// The sizes of the last [`PROMPT_SIZES_KEPT`] prompts routed, in blocks: what a
/// new prefix is expected to grow to ([`PrefixAware::crowding_ns`]).
///
/// A new conversation's first turn says nothing of its size at its last; the prompts
/// the gateway sees say what conversations here grow to. The estimate is a large one
/// of those ([`Self::large`]), not the mean: conversations placed together grow
/// together, and what must fit is their size at its largest.
#[derive(Clone, Debug, Default)]
pub struct PromptSizes {
    sizes: [u32; PROMPT_SIZES_KEPT],
    /// Where the next size goes.
    next: usize,
    /// How many of `sizes` are recorded ones.
    kept: usize,
}

/// How many recent prompt sizes [`PromptSizes`] keeps.
pub const PROMPT_SIZES_KEPT: usize = 32;

impl PromptSizes {
    pub fn record(&mut self, blocks: u32) {
        self.sizes[self.next] = blocks;
        self.next = (self.next + 1) % PROMPT_SIZES_KEPT;
        self.kept = (self.kept + 1).min(PROMPT_SIZES_KEPT);
    }

    /// The 90th percentile of the sizes kept (the fourth largest of 32), in blocks; 0
    /// before any prompt. A few outsized prompts do not set it.
    pub fn large(&self) -> u32 {
        let kept = self.kept;
        if kept == 0 {
            return 0;
        }
        let mut sizes = self.sizes;
        let sizes = &mut sizes[..kept];
        let rank = (kept * 9 / 10).min(kept - 1);
        *sizes.select_nth_unstable(rank).1
    }
}

/// How far one backend's learned queue cost may stray from the candidates' median:
/// [`bound_queue_costs`] keeps it within a factor of this either way. With 2, the
/// trace in its docs still placed eight new conversations 2/4/2 over three equal
/// engines (a unit test); with 1.5, 3/3/2, as least-loaded does.
pub const QUEUE_COST_SPREAD: f64 = 1.5;

/// The candidates whose learned costs [`bound_queue_costs`] and
/// [`lend_learned_prefill_costs`] take the median of (the first ones in backend
/// order, when there are more).
const LEARNED_MEDIAN_OF: usize = 16;

/// Makes the candidates' learned queue costs comparable before a decision: each is
/// bounded to within [`QUEUE_COST_SPREAD`] of the median of those learned, and a
/// candidate not learned yet takes the median (not the configured default, which is a
/// simulated engine's). Nothing changes while none is learned.
///
/// A backend's learned cost is the median of its own last few samples, and on equal
/// engines it still strays: the samples are what a request waited beyond the prefill
/// at the learned rate, so a prefill rate learned slightly high reads the wait as
/// free, and a core neighbour's burst reads as seconds a request. Three equal CPU
/// engines once held 966, 0 and 1,707 ms a request; the "free" one then drew four of
/// eight new conversations at once (`radixgate-bench real`, multiturn, concurrency
/// 8). Engines of unequal speed differ mostly in their prefill rate, which stays
/// per backend and unbounded.
pub fn bound_queue_costs(candidates: &mut [Candidate]) {
    let learned = |c: &Candidate| c.queue_ns_per_request > 0;
    let Some(median) = median_learned(candidates, learned, |c| c.queue_ns_per_request) else {
        return;
    };
    let low = ((f64::from(median) / QUEUE_COST_SPREAD) as u32).max(1);
    let high = (f64::from(median) * QUEUE_COST_SPREAD).min(f64::from(u32::MAX)) as u32;
    for c in candidates {
        c.queue_ns_per_request = match c.queue_ns_per_request {
            0 => median,
            learned => learned.clamp(low, high),
        };
    }
}

/// Gives each candidate that has learned no prefill cost yet the median of the
/// learned ones' rate and fixed delay (of the first [`LEARNED_MEDIAN_OF`] in
/// backend order), instead of the configured default, which is a simulated engine's.
/// Learned costs stay as they are (engines of unequal speed differ in them), and
/// nothing changes while none is learned.
///
/// A backend the gateway has not learned yet is most likely as fast as its peers;
/// priced at the default it looked free. On a gateway started cold over three CPU
/// engines, two learned 5.9 ms a token from their first answers while the third,
/// priced at the default, showed 10 ms for a prompt the others needed 3 s for: it
/// drew every request least-loaded could give it, each was cut at the 3 s
/// first-token deadline and moved (5–8 s to first token), and as a cut attempt
/// teaches nothing, it stayed "free" (`radixgate-bench real`, multiturn,
/// concurrency 1, precise mode's own gateway).
pub fn lend_learned_prefill_costs(candidates: &mut [Candidate]) {
    let learned = |c: &Candidate| c.prefill_ns_per_token > 0;
    if candidates.iter().all(learned) {
        return;
    }
    let Some(rate) = median_learned(candidates, learned, |c| c.prefill_ns_per_token) else {
        return;
    };
    let fixed = median_learned(candidates, learned, |c| c.prefill_fixed_ns).unwrap_or(0);
    for c in candidates.iter_mut().filter(|c| !learned(c)) {
        c.prefill_ns_per_token = rate;
        c.prefill_fixed_ns = fixed;
    }
}

/// The median of `value` over the first [`LEARNED_MEDIAN_OF`] candidates (in
/// backend order) that have `learned` it (the higher of the middle two for an even
/// count); `None` when none has.
fn median_learned(
    candidates: &[Candidate],
    learned: impl Fn(&Candidate) -> bool,
    value: impl Fn(&Candidate) -> u32,
) -> Option<u32> {
    let mut values = [0u32; LEARNED_MEDIAN_OF];
    let mut n = 0;
    for c in candidates.iter().filter(|c| learned(c)).take(values.len()) {
        values[n] = value(c);
        n += 1;
    }
    (n > 0).then(|| *values[..n].select_nth_unstable(n / 2).1)
}

/// The mean of [`load`] over `candidates` (0 for none).
pub fn mean_load(candidates: &[Candidate]) -> f64 {
    candidates.iter().map(load).sum::<u64>() as f64 / candidates.len().max(1) as f64
}

/// Requests ahead of a new one on this backend, as far as the gateway knows: its
/// in-flight count, or the engine's scraped waiting queue when that is larger (other
/// clients share the engine). Not their sum: when the gateway is the engine's only
/// client, every waiting request is one of its own in-flight ones.
/// [`PrefixAware::is_saturated`] at `saturation` requests.
fn saturated(c: &Candidate, saturation: u64, mean_load: f64) -> bool {
    load(c) >= saturation && load(c) as f64 >= mean_load * SATURATION_OVER_MEAN
}

fn load(c: &Candidate) -> u64 {
    u64::from(c.in_flight.max(c.engine_waiting))
}

/// The backend's free cache room in blocks, as far as the index knows (0 when it
/// does not).
fn free_room(c: &Candidate) -> u32 {
    c.cache_free_blocks.unwrap_or(0)
}

/// The candidate with the smallest key (`None` excludes it); equal keys are broken
/// uniformly by `rng` in one pass (reservoir sampling), which draws only on ties.
fn choose<K: Ord>(
    candidates: &[Candidate],
    rng: &mut fastrand::Rng,
    mut key: impl FnMut(&Candidate) -> Option<K>,
) -> Option<Candidate> {
    let mut best: Option<(K, Candidate)> = None;
    let mut ties = 0u32;
    for c in candidates {
        let Some(k) = key(c) else { continue };
        match &best {
            Some((b, _)) if k > *b => {}
            Some((b, _)) if k == *b => {
                ties += 1;
                if rng.u32(..ties) == 0 {
                    best = Some((k, *c));
                }
            }
            _ => {
                best = Some((k, *c));
                ties = 1;
            }
        }
    }
    best.map(|(_, c)| c)
}

#[cfg(test)]
mod tests;
