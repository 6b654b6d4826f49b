//! `radixgate-bench sim`: the orchestrator's own routing code against simulated
//! engines, with no network and no clock, deterministic by seed.
//!
//! A discrete-event loop keeps a closed window of requests in flight: it issues
//! requests until `window` are outstanding, and issues the next one whenever one
//! completes (a session's next turn only once its previous turn has completed). Each
//! request is routed exactly as the gateway routes it: its chat body is hashed by the
//! orchestrator's [`PromptHasher`] ([`crate::chat::ChatRequest::feed`] mirrors the
//! gateway's parser), and the gateway's own [`Router`] decides over the simulator's
//! [`Replica`] (its belief, with each backend's capacity set to its engine's) and a
//! [`FleetState`] holding each backend's in-flight count and those requests' prompt
//! blocks (issued, not yet completed; the engines report no KV usage, so the cost
//! model's cache-in-use term, which needs it, stays off);
//! the decision's ops are applied to the replica, as the gateway applies them. The request then runs on a simulated [`engine::Engine`], whose cache
//! is the truth every hit rate here is measured on.
//!
//! What the router sees, as in the gateway: `in_flight` (or, as an experiment, only
//! the requests still waiting for their first token, [`LoadSignal`]); `engine_waiting`
//! from a scrape of each engine's prefill queue every `scrape_ns` (the gateway scrapes
//! `vllm:num_requests_waiting` every second by default), stale in between;
//! `pending_prefill_tokens`, the uncached tokens the router predicted for each of the
//! backend's requests that has no first token yet (the gateway counts the same until
//! the first response byte); `prefill_ns_per_token` 0, so the policy uses its configured default (the gateway
//! learns it; the sim's engines charge exactly the default); and, for sessions that
//! carry an id, the backend the session's last turn went to (the gateway's session
//! table, without its expiry).
//!
//! Time is integer nanoseconds of simulated time; the index is given milliseconds, as
//! the gateway gives it. Events at equal times run in the order they were scheduled.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::num::NonZeroUsize;

use radixgate_orchestrator::policy::prefix_aware::PromptTail;
use radixgate_orchestrator::{
    ChunkIndex, FleetState, IndexConfig, IndexOp, MediaNeeds, PolicyConfig, PolicyName,
    PrefixIndex, PromptHasher, Reason, Replica, Router, RouterConfig, RoutingFacts, SessionTable,
};

use crate::chat::HashedPrompt;
use crate::workload::mix;

pub mod cli;
pub mod cluster;
pub mod disagg;
pub mod edge;
pub mod engine;
pub mod report;
pub mod scheduling;
pub mod workload;

use engine::{Engine, Job};
use report::RunResult;
use workload::{Session, WorkloadSpec};

/// The fleet, the cost model and the router's configuration.
#[derive(Clone, Debug)]
pub struct SimConfig {
    pub backends: usize,
    /// Engine KV cache per backend, in blocks (and the index's capacity for it).
    pub cache_blocks: usize,
    pub block_bytes: NonZeroUsize,
    /// Requests in flight at once (closed loop).
    pub window: usize,
    pub prefill_ns_per_token: u64,
    /// Prefills an engine runs at once (1: FIFO, one at a time; 0: unlimited).
    pub prefill_slots: usize,
    /// Time from first token to completion.
    pub decode_ns: u64,
    /// Mean pause between a turn's completion and the session's next turn (drawn
    /// exponentially per turn from the seed; 0: none). Desynchronises sessions.
    pub think_ns: u64,
    /// Send the sessions' ids to the router (session affinity), as `X-Session-ID` would.
    pub session_ids: bool,
    /// What the router is told as each candidate's `in_flight`.
    pub load_signal: LoadSignal,
    /// Tell the router each backend's pending prefill (the predicted uncached tokens
    /// of its requests without a first token), as the gateway does.
    pub pending_prefill: bool,
    /// Every this often the router learns each engine's waiting queue (requests not
    /// yet in prefill), passed as `engine_waiting` until the next scrape, as the
    /// gateway scrapes `vllm:num_requests_waiting`; 0: never (always 0).
    pub scrape_ns: u64,
    pub policy: PolicyConfig,
    /// Gateway replicas behind an L4 balancer that picks one at random per request,
    /// each with its own router and replica of the index.
    pub replicas: usize,
    /// How long one replica's routing ops take to reach the others (cluster mode's
    /// bus); `None`: replicas share nothing.
    pub replication_lag_ns: Option<u64>,
    /// The router's `routing.index_touch_ms`: how long a held prompt's recency may go
    /// unrefreshed (the gateway's default; 0 refreshes it at every request).
    pub index_touch_ms: u64,
    pub seed: u64,
}

impl Default for SimConfig {
    fn default() -> Self {
        let backends = 3;
        SimConfig {
            backends,
            cache_blocks: 600,
            block_bytes: NonZeroUsize::new(64).expect("non-zero"),
            window: 48,
            prefill_ns_per_token: 20_000,
            prefill_slots: 1,
            decode_ns: 16 * 2_000_000,
            think_ns: 200_000_000,
            session_ids: true,
            load_signal: LoadSignal::InFlight,
            pending_prefill: true,
            scrape_ns: 1_000_000_000,
            policy: PolicyConfig {
                backend_ids: backend_ids(backends),
                ..PolicyConfig::default()
            },
            replicas: 1,
            replication_lag_ns: Some(0),
            index_touch_ms: RouterConfig::default().index_touch_ms,
            seed: 1,
        }
    }
}

/// The load count the router gets per backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadSignal {
    /// Requests issued to the backend and not completed: what the gateway passes today.
    InFlight,
    /// Only those still waiting for their first token (queued or in prefill): an
    /// experiment for a signal the gateway could count itself, since it sees each
    /// response's first byte.
    AwaitingFirstToken,
}

/// `b0`, `b1`, ...: the ids the hash ring is built from.
pub fn backend_ids(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("b{i}")).collect()
}

impl SimConfig {
    fn tokens_per_block(&self) -> u64 {
        self.block_bytes.get() as u64 / crate::chat::BYTES_PER_TOKEN
    }
}

/// One request of the run, in issue order.
struct Issued {
    session: usize,
    turn: usize,
    backend: usize,
    issued_ns: u64,
    /// Uncached prompt tokens the router predicted, counted in the backend's pending
    /// prefill until the first token.
    predicted_uncached: u32,
    /// The gateway replica that routed it, and what to tell its router when it
    /// completes ([`radixgate_orchestrator::Decision::prompt_tail`]).
    router: usize,
    tail: PromptTail,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    /// The engine's running prefill ended.
    PrefillDone { backend: usize, request: usize },
    /// The request's last token: it leaves the window.
    Complete { request: usize },
    /// A session's think time is over: its next turn may be issued.
    Ready { session: usize, turn: usize },
    /// The router scrapes the engines' waiting queues.
    Scrape,
    /// A replica's routing op (`shipped[op]`) reaches the other replicas.
    Replicate { op: usize },
}

/// A simulated request as the router sees it: a text prompt to the one model.
pub fn routing_facts(
    prompt: &HashedPrompt,
    policy: PolicyName,
    session: Option<u64>,
) -> RoutingFacts<'_> {
    RoutingFacts {
        model: 0,
        adapter: None,
        policy,
        blocks: &prompt.blocks,
        affinity_key: prompt.affinity_key,
        media: &MediaNeeds::TEXT_ONLY,
        session,
        chunks: &[],
        excluded: &[],
    }
}

/// Hashes every turn of every session once (the same for every policy).
pub fn hash_sessions(sessions: &[Session], block_bytes: NonZeroUsize) -> Vec<Vec<HashedPrompt>> {
    let mut hasher = PromptHasher::new(block_bytes);
    sessions
        .iter()
        .map(|s| s.turns.iter().map(|t| t.hash(&mut hasher)).collect())
        .collect()
}

/// Runs `sessions` (hashed by [`hash_sessions`]) through `policy` on a fresh fleet.
pub fn run(
    cfg: &SimConfig,
    policy_name: PolicyName,
    sessions: &[Session],
    prompts: &[Vec<HashedPrompt>],
) -> RunResult {
    assert!(cfg.backends >= 1 && cfg.window >= 1);
    let mut policy_cfg = cfg.policy.clone();
    if policy_cfg.backend_ids.len() != cfg.backends {
        policy_cfg.backend_ids = backend_ids(cfg.backends);
    }
    let replicas = cfg.replicas.max(1);
    let mut routers: Vec<Router> = (0..replicas)
        .map(|r| {
            let config = RouterConfig {
                policy: policy_cfg.clone(),
                index_touch_ms: cfg.index_touch_ms,
                ..RouterConfig::default()
            };
            let seed = mix(&[cfg.seed, policy_name as u64]);
            // One replica routes exactly as the single-gateway simulator always has.
            Router::new(config, if r == 0 { seed } else { mix(&[seed, r as u64]) })
        })
        .collect();
    let mut spread = fastrand::Rng::with_seed(mix(&[cfg.seed, 0x14]));
    let mut index = PrefixIndex::new(IndexConfig {
        max_blocks: 1 << 20,
    });
    let mut engines: Vec<Engine> = (0..cfg.backends)
        .map(|b| {
            index.set_capacity(b, cfg.cache_blocks);
            Engine::new(cfg.cache_blocks, cfg.prefill_slots)
        })
        .collect();
    // Sessions never expire within a run.
    let mut beliefs: Vec<Replica> = vec![
        Replica::new(
            index,
            SessionTable::new(u64::MAX, usize::MAX),
            ChunkIndex::new(1),
        );
        replicas
    ];
    // Ops on their way to the other replicas: (origin, op).
    let mut shipped: Vec<(usize, IndexOp)> = Vec::new();
    let mut fleet = FleetState::healthy(cfg.backends);
    let mut in_flight = vec![0u32; cfg.backends];
    let mut in_flight_blocks = vec![0u32; cfg.backends];
    let mut awaiting = vec![0u32; cfg.backends];
    let mut pending_prefill = vec![0u32; cfg.backends];
    let tokens_per_block = cfg.tokens_per_block();

    let mut result = RunResult::new(cfg.backends);
    let mut issued: Vec<Issued> = Vec::new();
    let mut ready: VecDeque<(usize, usize)> = (0..sessions.len())
        .filter(|&s| !sessions[s].turns.is_empty())
        .map(|s| (s, 0))
        .collect();
    let mut events: BinaryHeap<Reverse<(u64, u64, Event)>> = BinaryHeap::new();
    let mut seq = 0u64;
    let mut schedule = |events: &mut BinaryHeap<_>, at: u64, e: Event| {
        events.push(Reverse((at, seq, e)));
        seq += 1;
    };
    let mut outstanding = 0usize;
    let mut now = 0u64;
    let mut last_completion = 0u64;
    let mut scraped_waiting = vec![0u32; cfg.backends];
    if cfg.scrape_ns > 0 {
        schedule(&mut events, cfg.scrape_ns, Event::Scrape);
    }

    // The ceiling: what one engine with an unbounded cache would have hit, in issue
    // order (only cold first occurrences miss).
    let mut seen = engine::EngineCache::new(usize::MAX);

    loop {
        // Fill the window.
        while outstanding < cfg.window {
            let Some((s, t)) = ready.pop_front() else {
                break;
            };
            let prompt = &prompts[s][t];
            let session = (cfg.session_ids && sessions[s].has_session_id).then_some(s as u64);
            let load = match cfg.load_signal {
                LoadSignal::InFlight => &in_flight,
                LoadSignal::AwaitingFirstToken => &awaiting,
            };
            for (b, state) in fleet.states.iter_mut().enumerate() {
                state.in_flight = load[b];
                state.in_flight_blocks = in_flight_blocks[b];
                state.engine_waiting = scraped_waiting[b];
                state.pending_prefill_tokens = if cfg.pending_prefill {
                    pending_prefill[b]
                } else {
                    0
                };
            }
            let facts = routing_facts(prompt, policy_name, session);
            let at = if replicas > 1 {
                spread.usize(..replicas)
            } else {
                0
            };
            let mut routed = routers[at]
                .decide(&beliefs[at], &fleet, &facts, now / 1_000_000)
                .expect("the fleet is never empty");
            for op in routed.ops.take() {
                beliefs[at].apply(&op);
                match cfg.replication_lag_ns {
                    _ if replicas == 1 => {}
                    None => {}
                    Some(0) => {
                        for (r, belief) in beliefs.iter_mut().enumerate() {
                            if r != at {
                                belief.apply(&op);
                            }
                        }
                    }
                    Some(lag) => {
                        schedule(
                            &mut events,
                            now + lag,
                            Event::Replicate { op: shipped.len() },
                        );
                        shipped.push((at, op));
                    }
                }
            }
            let b = routed.pick.backend;
            let predicted_uncached = routed.uncached_tokens;
            in_flight[b] += 1;
            in_flight_blocks[b] += routed.prompt_blocks;
            awaiting[b] += 1;
            pending_prefill[b] += predicted_uncached;
            outstanding += 1;
            result.record_route(b, routed.pick.reason, routed.matched_blocks);
            let ceiling = seen.matched(&prompt.blocks);
            seen.touch(&prompt.blocks);
            result.record_ceiling(prompt, ceiling as u64, tokens_per_block);

            let id = issued.len();
            issued.push(Issued {
                session: s,
                turn: t,
                backend: b,
                issued_ns: now,
                predicted_uncached,
                router: at,
                tail: routed.prompt_tail,
            });
            let job = Job {
                request: id,
                arrived_ns: now,
            };
            if let Some(job) = engines[b].arrive(job) {
                let done = start_prefill(
                    cfg,
                    &mut engines[b],
                    &issued,
                    prompts,
                    job,
                    now,
                    &mut result,
                );
                schedule(
                    &mut events,
                    done,
                    Event::PrefillDone {
                        backend: b,
                        request: id,
                    },
                );
            }
        }

        let Some(Reverse((at, _, event))) = events.pop() else {
            break;
        };
        now = at;
        match event {
            Event::PrefillDone { backend, request } => {
                awaiting[backend] -= 1;
                pending_prefill[backend] -= issued[request].predicted_uncached;
                result.record_ttft(now - issued[request].issued_ns);
                schedule(
                    &mut events,
                    now + cfg.decode_ns,
                    Event::Complete { request },
                );
                if let Some(job) = engines[backend].prefill_done() {
                    let done = start_prefill(
                        cfg,
                        &mut engines[backend],
                        &issued,
                        prompts,
                        job,
                        now,
                        &mut result,
                    );
                    schedule(
                        &mut events,
                        done,
                        Event::PrefillDone {
                            backend,
                            request: job.request,
                        },
                    );
                }
            }
            Event::Complete { request } => {
                let r = &issued[request];
                routers[r.router].request_ended(r.tail, now / 1_000_000);
                last_completion = now;
                in_flight[r.backend] -= 1;
                in_flight_blocks[r.backend] -= prompts[r.session][r.turn].blocks.len() as u32;
                outstanding -= 1;
                let (session, turn) = (r.session, r.turn + 1);
                if turn < sessions[session].turns.len() {
                    let think = think_time(cfg, session, turn);
                    if think == 0 {
                        ready.push_back((session, turn));
                    } else {
                        schedule(&mut events, now + think, Event::Ready { session, turn });
                    }
                }
            }
            Event::Ready { session, turn } => ready.push_back((session, turn)),
            Event::Replicate { op } => {
                let (origin, op) = &shipped[op];
                for (r, belief) in beliefs.iter_mut().enumerate() {
                    if r != *origin {
                        belief.apply(op);
                    }
                }
            }
            Event::Scrape => {
                for (w, e) in scraped_waiting.iter_mut().zip(&engines) {
                    *w = e.waiting() as u32;
                }
                // Keep scraping while anything else is still to happen.
                if !events.is_empty() || !ready.is_empty() {
                    schedule(&mut events, now + cfg.scrape_ns, Event::Scrape);
                }
            }
        }
    }
    debug_assert!(in_flight.iter().all(|&n| n == 0));
    result.finish(last_completion);
    result
}

/// The pause before `turn` of `session`: exponential with mean `cfg.think_ns`.
fn think_time(cfg: &SimConfig, session: usize, turn: usize) -> u64 {
    if cfg.think_ns == 0 {
        return 0;
    }
    let mut rng = fastrand::Rng::with_seed(mix(&[cfg.seed, 0x7417, session as u64, turn as u64]));
    let u = 1.0 - rng.f64(); // (0, 1]
    (-u.ln() * cfg.think_ns as f64).round() as u64
}

/// Starts `job`'s prefill on `engine` at `now`: measures its cached prefix, touches its
/// blocks and returns when the prefill ends.
fn start_prefill(
    cfg: &SimConfig,
    engine: &mut Engine,
    issued: &[Issued],
    prompts: &[Vec<HashedPrompt>],
    job: Job,
    now: u64,
    result: &mut RunResult,
) -> u64 {
    let r = &issued[job.request];
    let prompt = &prompts[r.session][r.turn];
    let cached_blocks = engine.cache.matched(&prompt.blocks);
    engine.cache.touch(&prompt.blocks);
    let cached_tokens = cached_tokens(prompt, cached_blocks as u64, cfg.tokens_per_block());
    result.record_served(
        prompt,
        cached_blocks as u64,
        cached_tokens,
        now - job.arrived_ns,
    );
    now + (prompt.tokens() - cached_tokens) * cfg.prefill_ns_per_token
}

/// As the gateway's simulated engine (and vLLM) report it: whole cached blocks, but
/// never the prompt's last token, which is always recomputed.
pub fn cached_tokens(prompt: &HashedPrompt, cached_blocks: u64, tokens_per_block: u64) -> u64 {
    (cached_blocks * tokens_per_block).min(prompt.tokens() - 1)
}

/// One table row's worth of runs: `spec` built once, then every policy in `policies`.
pub fn run_policies(
    cfg: &SimConfig,
    spec: &WorkloadSpec,
    policies: &[PolicyName],
) -> Vec<(PolicyName, RunResult)> {
    let sessions = workload::build(spec, cfg.seed, "sim", 16);
    let prompts = hash_sessions(&sessions, cfg.block_bytes);
    policies
        .iter()
        .map(|&p| (p, run(cfg, p, &sessions, &prompts)))
        .collect()
}

/// Reasons in [`Reason::ALL`] order, for stable reports.
pub fn reason_index(r: Reason) -> usize {
    Reason::ALL
        .iter()
        .position(|&x| x == r)
        .expect("every reason is in ALL")
}

#[cfg(test)]
mod tests;
