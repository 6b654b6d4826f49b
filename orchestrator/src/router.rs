//! The one routing decision. Every caller that needs to know where a request goes —
//! the gateway's shards, the routing and scheduling simulators, SLO admission's
//! estimate, workflows, the bench — asks a [`Router`]; nothing else composes one.
//!
//! A decision has four steps, all here:
//!
//! 1. **candidates**: the backends serving the request's model (and, for a LoRA
//!    adapter's request, serving that adapter) that are healthy,
//!    undrained, whose breaker lets a request through (a half-open one only while this
//!    router has a probe slot free), that accept the request's media, play the pool's
//!    [`Role`], and were not excluded by earlier failed attempts ([`FleetView`] says
//!    what each backend's state is);
//! 2. **estimate**: each candidate's matched blocks in the [`Replica`]'s prefix index,
//!    its load, pending prefill, free cache room and session flag — the inputs of the
//!    est-TTFT cost model ([`crate::policy::prefix_aware`]);
//! 3. **pick**: the request's policy, then RAG chunk affinity where the policy followed
//!    no cached prefix, or for a split model the prefill/decode pair
//!    ([`crate::disagg::decide`]);
//! 4. a [`Decision`] that carries everything to apply afterwards: the [`IndexOp`]s
//!    (the pick now holds the prompt and its chunks, the session's binding), the
//!    in-flight and pending-prefill accounting, and how to roll the insert back when
//!    the attempt fails before the engine could cache anything.
//!
//! The router reads the replica and never writes it: the caller applies the ops
//! ([`Replica::apply`]) and, in the gateway, publishes them to the other replicas.
//! An insert for a prompt the pick already holds, last touched less than
//! `index_touch_ms` ago, is left out (only its recency would change), and so is a
//! session binding that fresh: a hot prompt then costs one event per interval instead
//! of one per request.

use crate::admission::Estimate;
use crate::breaker::BreakerState;
use crate::disagg::{self, DecodeCandidate, DisaggPolicy, LocalWhy, PairDecision, PairInput};
use crate::media::{Capabilities, MediaNeeds};
use crate::policy::prefix_aware::{prompt_tail, Explained, PrefixAware, PromptTail};
use crate::policy::{
    build_policy, BackendIdx, Candidate, Pick, Policy, PolicyConfig, PolicyName, Reason,
    RouteInput, RoutingPolicy,
};
use crate::rag::with_chunk_affinity;
use crate::replica::{IndexOp, Replica};
use crate::PrefixMatch;
use std::sync::Arc;

/// Index into the gateway's model table.
pub type ModelIdx = usize;

/// Index into the gateway's table of LoRA adapters learned from the engines.
pub type AdapterIdx = usize;

/// A backend's part in a split pool (`backends[].role`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Role {
    /// Serves requests whole (the default).
    #[default]
    Both,
    /// Only computes prompts and hands their KV over.
    Prefill,
    /// Decodes from handed-over KV; may also serve whole requests locally.
    Decode,
}

impl Role {
    pub fn parse(s: &str) -> Option<Role> {
        match s {
            "both" => Some(Role::Both),
            "prefill" => Some(Role::Prefill),
            "decode" => Some(Role::Decode),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Both => "both",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// Which of a model's backends a candidate list is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pool {
    /// Whole requests: every role but `prefill`.
    Whole,
    /// A split request's prefill leg.
    Prefill,
    /// A split request's decode leg.
    Decode,
}

impl Pool {
    pub fn admits(self, role: Role) -> bool {
        match self {
            Pool::Whole => role != Role::Prefill,
            Pool::Prefill => role == Role::Prefill,
            Pool::Decode => role == Role::Decode,
        }
    }
}

/// One backend as routing sees it at the instant of a decision.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BackendState {
    pub role: Role,
    pub capabilities: Capabilities,
    pub healthy: bool,
    pub breaker: BreakerState,
    /// Draining backends get no new requests.
    pub draining: bool,
    /// This router's half-open probes in flight to the backend.
    pub probes_in_flight: u32,
    /// Requests in flight to it, across every router that reports them.
    pub in_flight: u32,
    /// See [`Candidate::in_flight_blocks`].
    pub in_flight_blocks: u32,
    /// The engine's waiting and running requests and KV usage (0–1) as last scraped
    /// (0 when unknown).
    pub engine_waiting: u32,
    pub engine_running: u32,
    pub engine_kv_usage: f32,
    /// See [`Candidate::pending_prefill_tokens`].
    pub pending_prefill_tokens: u32,
    /// See [`Candidate::prefill_progress_ns`], as of the decision.
    pub prefill_progress_ns: u64,
    /// Learned prefill cost (0: the cost model's default).
    pub prefill_ns_per_token: u32,
    /// Learned fixed delay before a first token (see [`Candidate::prefill_fixed_ns`]).
    pub prefill_fixed_ns: u32,
    /// Learned delay per request ahead (0: the cost model's default).
    pub queue_ns_per_request: u32,
}

/// The fleet at the instant of a decision: which backends serve a model, and each
/// one's state. The gateway implements it over its fleet snapshot and cross-shard
/// counters, the simulators over their simulated engines.
pub trait FleetView {
    /// The backends serving `model`, in backend order (empty when it has none left).
    fn serving(&self, model: ModelIdx) -> &[BackendIdx];
    fn backend(&self, backend: BackendIdx) -> BackendState;
    /// The backend's breaker state alone (whether a pick is a half-open probe);
    /// a view that can read it without building the whole [`BackendState`] should.
    fn breaker(&self, backend: BackendIdx) -> BreakerState {
        self.backend(backend).breaker
    }
    /// Whether the backend has the LoRA adapter loaded (a view that knows of no
    /// adapters: none).
    fn serves_adapter(&self, backend: BackendIdx, adapter: AdapterIdx) -> bool {
        let _ = (backend, adapter);
        false
    }
    /// The other backends that share this one's compute (the same GPU, the same CPU
    /// cores: config `backends[].compute_group`), whose queued work slows its own
    /// ([`Candidate::peer_queue_ns`]); a view that knows of no sharing: none.
    fn compute_peers(&self, backend: BackendIdx) -> &[BackendIdx] {
        let _ = backend;
        &[]
    }
}

/// A fleet written out as values: every backend serves the one model (index 0).
/// What the simulators and tests hand the router; they update `states` as their
/// simulated engines change.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FleetState {
    pub serving: Vec<BackendIdx>,
    pub states: Vec<BackendState>,
    /// `(backend, adapter)`: the LoRA adapters each backend has loaded.
    pub adapters: Vec<(BackendIdx, AdapterIdx)>,
    /// `compute_peers[b]`: the backends sharing backend `b`'s compute (none when
    /// shorter than `b`).
    pub compute_peers: Vec<Vec<BackendIdx>>,
}

impl FleetState {
    /// `backends` healthy, idle backends serving whole requests.
    pub fn healthy(backends: usize) -> Self {
        Self {
            serving: (0..backends).collect(),
            states: vec![
                BackendState {
                    healthy: true,
                    ..BackendState::default()
                };
                backends
            ],
            adapters: Vec::new(),
            compute_peers: Vec::new(),
        }
    }
}

impl FleetView for FleetState {
    fn serving(&self, model: ModelIdx) -> &[BackendIdx] {
        if model == 0 {
            &self.serving
        } else {
            &[]
        }
    }

    fn backend(&self, backend: BackendIdx) -> BackendState {
        self.states[backend]
    }

    fn serves_adapter(&self, backend: BackendIdx, adapter: AdapterIdx) -> bool {
        self.adapters.contains(&(backend, adapter))
    }

    fn compute_peers(&self, backend: BackendIdx) -> &[BackendIdx] {
        self.compute_peers.get(backend).map_or(&[], Vec::as_slice)
    }
}

/// The request as routing sees it: everything a decision depends on besides the fleet
/// and the replica.
#[derive(Clone, Copy, Debug)]
pub struct RoutingFacts<'a> {
    /// The model, or a LoRA adapter's base model.
    pub model: ModelIdx,
    /// The LoRA adapter the request names: only backends serving it are candidates
    /// (its prompt's blocks are already hashed in the adapter's own namespace).
    pub adapter: Option<AdapterIdx>,
    pub policy: PolicyName,
    /// The prompt's chained block hashes.
    pub blocks: &'a [u64],
    /// [`crate::PromptHasher::affinity_key`].
    pub affinity_key: Option<u64>,
    pub media: &'a MediaNeeds,
    /// Hash of the request's session id (`X-Session-ID`, a workflow's sibling group).
    pub session: Option<u64>,
    /// A RAG request's chunk ids.
    pub chunks: &'a [u64],
    /// Backends earlier attempts of this request failed on.
    pub excluded: &'a [BackendIdx],
}

/// The settings a decision reads besides the policies' own.
#[derive(Clone, Debug, PartialEq)]
pub struct RouterConfig {
    pub policy: PolicyConfig,
    /// `routing.index_touch_ms`: how long a held prompt's recency may go unrefreshed.
    pub index_touch_ms: u64,
    /// `routing.rag_chunk_weight`: what one held chunk is worth against one request of
    /// load.
    pub rag_chunk_weight: u32,
    /// `breaker.half_open_probes`: probes one router lets through to a half-open
    /// backend at once.
    pub half_open_probes: u32,
    /// Decisions carry the cost model's estimate for their pick
    /// ([`Decision::est_ttft_ns`]); off, it is 0 and costs nothing (the gateway turns
    /// it on only for `retry.first_token_timeout_factor`).
    pub estimate_picks: bool,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            policy: PolicyConfig::default(),
            index_touch_ms: 100,
            rag_chunk_weight: 2,
            half_open_probes: 1,
            estimate_picks: false,
        }
    }
}

/// Why no decision could be made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouteError {
    /// The model has no backend left (its last was removed since it was first seen).
    ModelGone,
    /// No backend of the base model serves the request's LoRA adapter (any more).
    AdapterGone,
    /// The request carries media that no backend of its model accepts.
    UnsupportedMedia(Capabilities),
    /// Every backend of the model is unhealthy, open, draining or excluded.
    NoCandidate,
}

/// Up to three ops a decision implies, in the order to apply them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ops([Option<IndexOp>; 3]);

impl Ops {
    fn push(&mut self, op: IndexOp) {
        if let Some(slot) = self.0.iter_mut().find(|s| s.is_none()) {
            *slot = Some(op);
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = &IndexOp> {
        self.0.iter().flatten()
    }

    /// Takes the ops out, leaving none.
    pub fn take(&mut self) -> impl Iterator<Item = IndexOp> {
        std::mem::take(&mut self.0).into_iter().flatten()
    }
}

/// Where one request (or one leg of a split request) goes, and what to apply.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    pub pick: Pick,
    /// Leading prompt blocks the pick held, per the replica.
    pub matched_blocks: u32,
    /// The prompt's blocks: what to count in the pick's in-flight prompt blocks
    /// ([`Candidate::in_flight_blocks`]) while the request runs.
    pub prompt_blocks: u32,
    /// In-flight requests on the pick before this one (`u32::MAX` for a split leg,
    /// whose time is not a whole request's prefill and must not be learned from).
    pub in_flight_before: u32,
    /// Prompt tokens the pick expected to prefill for the requests ahead of this one
    /// ([`Candidate::pending_prefill_tokens`] at the decision).
    pub pending_prefill_before: u32,
    /// The backends sharing the pick's compute that had requests in flight
    /// ([`Candidate::peers_busy`] at the decision; 0 for split legs): with the count
    /// at the first token, whether the request had its compute to itself, or a known
    /// share of it, while it waited.
    pub peers_busy_before: u32,
    /// Prompt tokens the pick is expected to prefill (its unmatched blocks): what to
    /// count in its pending prefill until the first response byte (0 for split legs).
    pub uncached_tokens: u32,
    /// The pick is half-open: the attempt takes one of the router's probe slots.
    pub probe: bool,
    /// Other candidates a retry could go to.
    pub alternatives: usize,
    /// The cost model's estimated time to first token on the pick, in ns, whatever
    /// the policy, with [`RouterConfig::estimate_picks`] (else 0; 0 for split legs):
    /// what a first-token deadline scales with.
    pub est_ttft_ns: u64,
    /// RAG requests: `(chunks the pick held before, distinct chunks in the request)`.
    pub chunk_overlap: Option<(u32, u32)>,
    /// A split request's decode leg: the prefill backend of its pair.
    pub prefill: Option<BackendIdx>,
    /// What to apply to every replica.
    pub ops: Ops,
    /// Index touches and session bindings left out as fresh.
    pub coalesced: u32,
    /// The prompt's blocks when the decision inserts them for the pick (what
    /// [`Decision::roll_back`] undoes); `None` when nothing is inserted.
    pub inserted: Option<Arc<[u64]>>,
    /// What to tell [`Router::request_ended`] when the request ends: its prompt's
    /// tail under the `prefix_aware` policy, whose placements time their use from
    /// their requests' ends (`None` otherwise: nothing to tell).
    pub prompt_tail: PromptTail,
}

impl Decision {
    /// The op that forgets the blocks the pick did not already hold, for an attempt
    /// that failed before the engine could cache anything.
    pub fn roll_back(&self) -> Option<IndexOp> {
        let blocks = self.inserted.as_ref()?;
        let from = self.matched_blocks as usize;
        (from < blocks.len()).then(|| IndexOp::Remove {
            backend: self.pick.backend,
            blocks: blocks.clone(),
            from,
        })
    }
}

/// A split model's request: a pair, or served whole.
// Returned once per split request and taken apart at once: boxing would only add an
// allocation.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
pub enum PairOutcome {
    Split { prefill: Decision, decode: Decision },
    Local(LocalWhy),
}

/// One policy instance per name, built on first use (cursors live in them).
#[derive(Clone, Debug, Default)]
struct PolicySet([Option<Policy>; PolicyName::ALL.len()]);

impl PolicySet {
    /// The `prefix_aware` instance, once built.
    fn prefix_aware(&self) -> Option<&PrefixAware> {
        self.0.iter().flatten().find_map(|p| match p {
            Policy::PrefixAware(p) => Some(p),
            _ => None,
        })
    }

    fn prefix_aware_mut(&mut self) -> Option<&mut PrefixAware> {
        self.0.iter_mut().flatten().find_map(|p| match p {
            Policy::PrefixAware(p) => Some(p),
            _ => None,
        })
    }

    fn get(&mut self, name: PolicyName, config: &PolicyConfig) -> &mut Policy {
        let slot = PolicyName::ALL.iter().position(|n| *n == name).unwrap_or(0);
        self.0[slot].get_or_insert_with(|| build_policy(name, config))
    }
}

/// Makes routing decisions. Owns what must persist between them (policy cursors, the
/// RNG, scratch buffers) and nothing they are about.
#[derive(Clone, Debug)]
pub struct Router {
    config: RouterConfig,
    policies: PolicySet,
    /// The `prefix_aware` cost model, for SLO admission's estimate under any policy.
    cost_model: PrefixAware,
    rng: fastrand::Rng,
    matches: PrefixMatch,
    candidates: Vec<Candidate>,
    prefill: Vec<Candidate>,
    decode: Vec<DecodeCandidate>,
}

// === impl Router ===

impl Router {
    pub fn new(config: RouterConfig, seed: u64) -> Self {
        Self {
            cost_model: PrefixAware::new(&config.policy.prefix),
            config,
            policies: PolicySet::default(),
            rng: fastrand::Rng::with_seed(seed),
            matches: PrefixMatch::default(),
            candidates: Vec::new(),
            prefill: Vec::new(),
            decode: Vec::new(),
        }
    }

    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    /// The candidates of the last whole-request decision with what the cost model
    /// made of each ([`PrefixAware::explain`]), by the `prefix_aware` policy's own
    /// state (its counts of new prefixes) when it has decided before: what a debug
    /// log prints to explain a pick. `prompt_blocks` is that request's.
    pub fn explain_last(&self, prompt_blocks: u32) -> impl Iterator<Item = Explained> + '_ {
        let model = self.policies.prefix_aware().unwrap_or(&self.cost_model);
        self.candidates
            .iter()
            .map(move |c| model.explain(&self.candidates, c, prompt_blocks))
    }

    /// Index time before which a block a backend holds counts as free cache room
    /// (`routing.prefix_aware.room_stale_after_ms`; 0 when that is off).
    fn stale_before(&self, now_ms: u64) -> u64 {
        match self.config.policy.prefix.room_stale_after_ms {
            0 => 0,
            after => now_ms.saturating_sub(after),
        }
    }

    /// New settings: the policies and the cost model are rebuilt from them (policy
    /// cursors restart); the RNG carries on.
    pub fn reconfigure(&mut self, config: RouterConfig) {
        if config != self.config {
            self.cost_model = PrefixAware::new(&config.policy.prefix);
            self.policies = PolicySet::default();
            self.config = config;
        }
    }

    /// The request decided as `tail` ([`Decision::prompt_tail`]) ended at `now_ms`
    /// (however it ended): the `prefix_aware` policy's placements it used wait for
    /// their next use from now ([`crate::policy::prefix_aware::RecentPlacements`]).
    pub fn request_ended(&mut self, tail: PromptTail, now_ms: u64) {
        if let Some(p) = self.policies.prefix_aware_mut() {
            p.request_ended(tail, now_ms);
        }
    }

    /// Where a whole request goes (see the module docs).
    pub fn decide(
        &mut self,
        replica: &Replica,
        fleet: &impl FleetView,
        facts: &RoutingFacts<'_>,
        now_ms: u64,
    ) -> Result<Decision, RouteError> {
        let session_home = facts.session.and_then(|s| replica.sessions.get(s, now_ms));
        self.match_prompt(replica, facts.blocks);
        let filter = Filter {
            facts,
            session_home,
            pool: Pool::Whole,
            probe_limit: self.config.half_open_probes,
            stale_before: self.stale_before(now_ms),
            cost_model: &self.cost_model,
        };
        let candidates = &mut self.candidates;
        filter.fill(candidates, &self.matches, replica, fleet)?;
        if candidates.is_empty() {
            return Err(RouteError::NoCandidate);
        }
        let input = RouteInput {
            candidates,
            affinity_key: facts.affinity_key,
            prompt_blocks: facts.blocks.len() as u32,
            prompt: facts.blocks,
            now_ms,
        };
        let mut pick = self
            .policies
            .get(facts.policy, &self.config.policy)
            .pick(&input, &mut self.rng)
            .ok_or(RouteError::NoCandidate)?;
        // Chunk affinity: a RAG request under the cache-aware policy that found no
        // cached prefix to follow goes where most of its chunks were sent, unless load
        // outweighs them.
        if facts.policy == PolicyName::PrefixAware && !facts.chunks.is_empty() {
            let chunk_pick =
                replica
                    .chunks
                    .pick(candidates, facts.chunks, self.config.rag_chunk_weight);
            pick = with_chunk_affinity(pick, chunk_pick);
        }
        let chosen = candidates
            .iter()
            .find(|c| c.backend == pick.backend)
            .copied()
            .unwrap_or_default();
        let alternatives = candidates.len() - 1;
        let mut decision = Decision {
            pick,
            matched_blocks: chosen.matched_blocks,
            prompt_blocks: facts.blocks.len() as u32,
            in_flight_before: chosen.in_flight,
            pending_prefill_before: chosen.pending_prefill_tokens,
            peers_busy_before: chosen.peers_busy,
            uncached_tokens: uncached_tokens(
                &self.config,
                facts.blocks.len(),
                self.cost_model
                    .kept_blocks(&chosen, facts.blocks.len() as u32),
            ),
            probe: fleet.breaker(pick.backend) == BreakerState::HalfOpen,
            alternatives,
            // Saturating: an infinite estimate is the longest deadline.
            est_ttft_ns: if self.config.estimate_picks {
                self.cost_model
                    .est_ttft_ns(&chosen, facts.blocks.len() as u32) as u64
            } else {
                0
            },
            chunk_overlap: None,
            prefill: None,
            ops: Ops::default(),
            coalesced: 0,
            inserted: None,
            prompt_tail: if facts.policy == PolicyName::PrefixAware {
                prompt_tail(facts.blocks)
            } else {
                None
            },
        };
        self.record_insert(replica, &mut decision, facts.blocks, now_ms);
        if !facts.chunks.is_empty() {
            let overlap = replica.chunks.overlap(pick.backend, facts.chunks);
            decision.chunk_overlap = Some((overlap, facts.chunks.len() as u32));
            decision.ops.push(IndexOp::HoldChunks {
                backend: pick.backend,
                chunks: facts.chunks.into(),
                now_ms,
            });
        }
        if let Some(session) = facts.session {
            // Like a prompt already held: a session already bound here, seen less than
            // `index_touch_ms` ago, would only have its time-to-live refreshed.
            let fresh = replica.sessions.binding(session).is_some_and(|(b, seen)| {
                b == pick.backend && now_ms.saturating_sub(seen) < self.config.index_touch_ms
            });
            if fresh {
                decision.coalesced += 1;
            } else {
                decision.ops.push(IndexOp::BindSession {
                    session,
                    backend: pick.backend,
                    now_ms,
                });
            }
        }
        Ok(decision)
    }

    /// Where a split model's request goes: a prefill/decode pair, or served whole
    /// ([`disagg::decide`]). Both legs' decisions insert the prompt for their backend.
    pub fn decide_pair(
        &mut self,
        replica: &Replica,
        fleet: &impl FleetView,
        facts: &RoutingFacts<'_>,
        split: &DisaggPolicy,
        now_ms: u64,
    ) -> Result<PairOutcome, RouteError> {
        self.match_prompt(replica, facts.blocks);
        let stale_before = self.stale_before(now_ms);
        let filter = |pool| Filter {
            facts,
            session_home: None,
            pool,
            probe_limit: self.config.half_open_probes,
            stale_before,
            cost_model: &self.cost_model,
        };
        filter(Pool::Prefill).fill(&mut self.prefill, &self.matches, replica, fleet)?;
        filter(Pool::Decode).fill(&mut self.candidates, &self.matches, replica, fleet)?;
        self.decode.clear();
        self.decode.extend(self.candidates.iter().map(|c| {
            let state = fleet.backend(c.backend);
            DecodeCandidate {
                backend: c.backend,
                in_flight: c.in_flight,
                running: state.engine_running,
                kv_usage: state.engine_kv_usage,
                matched_blocks: c.matched_blocks,
            }
        }));
        let decode = &self.decode;
        let input = PairInput {
            prefill: &self.prefill,
            decode,
            prompt_blocks: facts.blocks.len() as u32,
        };
        let (p, d, prefill_matched) =
            match disagg::decide(split, &self.config.policy.prefix, &input) {
                PairDecision::Local(why) => return Ok(PairOutcome::Local(why)),
                PairDecision::Split {
                    prefill,
                    decode,
                    prefill_matched,
                } => (prefill, decode, prefill_matched),
            };
        let decode_matched = decode
            .iter()
            .find(|c| c.backend == d)
            .map_or(0, |c| c.matched_blocks);
        let shared: Option<Arc<[u64]>> = (!facts.blocks.is_empty()).then(|| facts.blocks.into());
        let leg = |backend: BackendIdx, matched: u32, alternatives: usize, prefill| {
            let mut ops = Ops::default();
            if let Some(blocks) = &shared {
                ops.push(IndexOp::Insert {
                    backend,
                    blocks: blocks.clone(),
                    now_ms,
                });
            }
            Decision {
                pick: Pick {
                    backend,
                    reason: Reason::DisaggSplit,
                },
                matched_blocks: matched,
                prompt_blocks: facts.blocks.len() as u32,
                in_flight_before: u32::MAX,
                pending_prefill_before: 0,
                peers_busy_before: 0,
                uncached_tokens: 0,
                probe: fleet.breaker(backend) == BreakerState::HalfOpen,
                alternatives,
                est_ttft_ns: 0,
                chunk_overlap: None,
                prefill,
                ops,
                coalesced: 0,
                inserted: shared.clone(),
                prompt_tail: None,
            }
        };
        Ok(PairOutcome::Split {
            prefill: leg(p, prefill_matched, self.prefill.len() - 1, None),
            decode: leg(d, decode_matched, decode.len() - 1, Some(p)),
        })
    }

    /// SLO admission's question: the earliest first token the fleet can give this
    /// request, by the `prefix_aware` cost model over the same candidates a decision
    /// would consider (whatever the routing policy). `None` when there are no
    /// candidates: routing answers that itself.
    pub fn estimate(
        &mut self,
        replica: &Replica,
        fleet: &impl FleetView,
        facts: &RoutingFacts<'_>,
    ) -> Option<Estimate> {
        if !self.fill_for_estimate(replica, fleet, facts) {
            return None;
        }
        Some(self.cost_model.best_estimate(&RouteInput {
            candidates: &self.candidates,
            affinity_key: None,
            prompt_blocks: facts.blocks.len() as u32,
            ..RouteInput::default()
        }))
    }

    /// A late stream's question (`retry.first_token_timeout_ms`): the earliest first
    /// token another candidate can be trusted to give this request, in ns, by the
    /// cost model over the candidates [`Self::estimate`] weighs (the late backend
    /// among `facts.excluded`). A candidate whose prefill cost is the configured
    /// default (nothing learned of its own, nothing learned elsewhere to lend it) is
    /// left out, busy or idle: its price is a guess, not evidence. A gateway started
    /// cold into a burst priced three CPU engines' queues at tens of milliseconds and
    /// moved six late streams at once onto the one engine that had answered first,
    /// where they waited 28–45 s (`radixgate-bench real`, docs, concurrency 8); one
    /// started cold at concurrency 1 moved each of its first five requests (~9 s of
    /// prefill) at the deadline onto an idle engine priced at 31 ms, prefilled them
    /// again there, and, a moved stream teaching nothing, stayed cold through all
    /// five. `None` when no candidate is left: a cold gateway moves nothing.
    pub fn soonest_first_token_ns(
        &mut self,
        replica: &Replica,
        fleet: &impl FleetView,
        facts: &RoutingFacts<'_>,
    ) -> Option<f64> {
        if !self.fill_for_estimate(replica, fleet, facts) {
            return None;
        }
        let prompt_blocks = facts.blocks.len() as u32;
        self.candidates
            .iter()
            .filter(|c| c.prefill_ns_per_token > 0)
            .map(|c| self.cost_model.est_ttft_ns(c, prompt_blocks))
            .min_by(f64::total_cmp)
    }

    /// Fills the candidates an estimate weighs: those a decision would consider,
    /// free room alone counting as room (eviction is not part of an estimate). False
    /// when there are none.
    fn fill_for_estimate(
        &mut self,
        replica: &Replica,
        fleet: &impl FleetView,
        facts: &RoutingFacts<'_>,
    ) -> bool {
        self.match_prompt(replica, facts.blocks);
        let filter = Filter {
            facts,
            session_home: None,
            pool: Pool::Whole,
            probe_limit: self.config.half_open_probes,
            stale_before: 0,
            cost_model: &self.cost_model,
        };
        let filled = filter.fill(&mut self.candidates, &self.matches, replica, fleet);
        filled.is_ok() && !self.candidates.is_empty()
    }

    fn match_prompt(&mut self, replica: &Replica, blocks: &[u64]) {
        replica.index.match_prefix(blocks, &mut self.matches);
    }

    /// The insert that records the pick as holding the prompt, unless it already holds
    /// all of it and used it less than `index_touch_ms` ago (then only its recency
    /// would change: the insert is left out). `self.matches` holds the prompt's match.
    fn record_insert(
        &self,
        replica: &Replica,
        decision: &mut Decision,
        blocks: &[u64],
        now_ms: u64,
    ) {
        if blocks.is_empty() {
            return;
        }
        let backend = decision.pick.backend;
        if decision.matched_blocks as usize == blocks.len()
            && !replica.index.touch_is_due_matched(
                &self.matches,
                backend,
                now_ms,
                self.config.index_touch_ms,
            )
        {
            decision.coalesced += 1;
            return;
        }
        let blocks: Arc<[u64]> = blocks.into();
        decision.ops.push(IndexOp::Insert {
            backend,
            blocks: blocks.clone(),
            now_ms,
        });
        decision.inserted = Some(blocks);
    }
}

/// Prompt tokens left to prefill on a backend that holds `matched` of `blocks`.
fn uncached_tokens(config: &RouterConfig, blocks: usize, matched: u32) -> u32 {
    let tokens_per_block = config.policy.prefix.tokens_per_block.max(0.0);
    let uncached = blocks.saturating_sub(matched as usize);
    (uncached as f64 * tokens_per_block).min(u32::MAX as f64) as u32
}

/// Which candidates a step wants (step 1 of the module docs).
struct Filter<'f> {
    facts: &'f RoutingFacts<'f>,
    session_home: Option<BackendIdx>,
    pool: Pool,
    probe_limit: u32,
    /// Blocks last used before this (index time, ms) count as free cache room.
    stale_before: u64,
    /// Prices the queues of backends that share a candidate's compute.
    cost_model: &'f PrefixAware,
}

impl Filter<'_> {
    /// Fills `out` with the candidates, with what step 2 needs of each. `Err` when the
    /// model has no backend at all, or none that accepts the request's media; an
    /// empty `out` when all of them are filtered out.
    fn fill(
        &self,
        out: &mut Vec<Candidate>,
        matches: &PrefixMatch,
        replica: &Replica,
        fleet: &impl FleetView,
    ) -> Result<(), RouteError> {
        out.clear();
        let facts = self.facts;
        let serving = fleet.serving(facts.model);
        if serving.is_empty() {
            return Err(RouteError::ModelGone);
        }
        let needs = facts.media.kinds;
        let mut any_capable = needs.is_empty();
        let mut any_adapter = facts.adapter.is_none();
        for &b in serving {
            if let Some(adapter) = facts.adapter {
                if !fleet.serves_adapter(b, adapter) {
                    continue;
                }
                any_adapter = true;
            }
            let state = fleet.backend(b);
            let capable = state.capabilities.covers(needs);
            any_capable |= capable;
            let breaker_allows = match state.breaker {
                BreakerState::Closed => true,
                BreakerState::Open => false,
                BreakerState::HalfOpen => state.probes_in_flight < self.probe_limit,
            };
            if capable
                && state.healthy
                && breaker_allows
                && !state.draining
                && !facts.excluded.contains(&b)
                && self.pool.admits(state.role)
            {
                let matched_blocks = matches.matched.get(b).copied().unwrap_or(0);
                let cache_blocks = u32::try_from(replica.index.capacity(b)).unwrap_or(u32::MAX);
                out.push(Candidate {
                    matched_blocks,
                    session_home: self.session_home == Some(b),
                    uncached_media_tokens: facts.media.uncached_tokens(matched_blocks),
                    cache_free_blocks: free_blocks(&replica.index, b, self.stale_before),
                    cache_blocks,
                    engine_used_blocks: (state.engine_kv_usage > 0.0).then(|| {
                        (f64::from(state.engine_kv_usage) * f64::from(cache_blocks)) as u32
                    }),
                    ..queue_of(b, &state)
                });
            }
        }
        crate::policy::prefix_aware::bound_queue_costs(out);
        crate::policy::prefix_aware::lend_learned_prefill_costs(out);
        self.price_peers(out, fleet);
        if !any_adapter {
            return Err(RouteError::AdapterGone);
        }
        if !any_capable {
            return Err(RouteError::UnsupportedMedia(needs));
        }
        Ok(())
    }

    /// Sets each candidate's [`Candidate::compute_group`],
    /// [`Candidate::peer_queue_ns`] (the queues of the backends that share its
    /// compute, priced as the cost model prices a queue: [`PrefixAware::queue_ns`]; a
    /// peer that is a candidate too with its bounded costs, any other as its state
    /// says) and [`Candidate::peers_busy`].
    fn price_peers(&self, out: &mut [Candidate], fleet: &impl FleetView) {
        for i in 0..out.len() {
            let peers = fleet.compute_peers(out[i].backend);
            if peers.is_empty() {
                continue;
            }
            let mut queued = 0.0;
            let mut busy = 0;
            for &p in peers {
                let peer = out
                    .iter()
                    .find(|c| c.backend == p)
                    .copied()
                    .unwrap_or_else(|| queue_of(p, &fleet.backend(p)));
                queued += self.cost_model.queue_ns(&peer);
                busy += u32::from(peer.in_flight > 0);
            }
            // Saturating: an infinite queue is the longest.
            out[i].peer_queue_ns = queued as u64;
            out[i].peers_busy = busy;
            out[i].compute_group = peers.iter().copied().min().map(|p| p.min(out[i].backend));
        }
    }
}

/// A candidate with what `state` says of backend `b`'s queue and costs, and nothing of
/// the prompt.
fn queue_of(b: BackendIdx, state: &BackendState) -> Candidate {
    Candidate {
        backend: b,
        in_flight: state.in_flight,
        in_flight_blocks: state.in_flight_blocks,
        engine_waiting: state.engine_waiting,
        pending_prefill_tokens: state.pending_prefill_tokens,
        prefill_progress_ns: state.prefill_progress_ns,
        prefill_ns_per_token: state.prefill_ns_per_token,
        prefill_fixed_ns: state.prefill_fixed_ns,
        queue_ns_per_request: state.queue_ns_per_request,
        ..Candidate::default()
    }
}

/// [`Candidate::cache_free_blocks`] from the index: the backend's free room plus the
/// blocks it last used before `stale_before` ([`crate::PrefixIndex::room_blocks`]),
/// saturated to `u32::MAX`.
pub fn free_blocks(
    index: &crate::PrefixIndex,
    backend: BackendIdx,
    stale_before: u64,
) -> Option<u32> {
    index
        .room_blocks(backend, stale_before)
        .map(|free| u32::try_from(free).unwrap_or(u32::MAX))
}

#[cfg(test)]
mod tests;
