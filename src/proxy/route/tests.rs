//! One decision path, proved: a generated trace is replayed through the routing
//! simulator's side (its hashed prompts, its request facts, a [`FleetState`]) and
//! through the gateway's side (the request body parsed by the shard's parser, its
//! routing facts, the [`ShardFleet`] view over a real fleet snapshot and the
//! cross-shard counters), on identical fleet states drawn at random per request, each
//! side with its own router and replica. Every decision must be identical, and so
//! must the replicas they leave behind.

use super::*;
use crate::backends::LiveConfig;
use crate::config::Config;
use crate::learned::LearnedCost;
use crate::openai::{BodyParser, Endpoint};
use crate::replica::new_replica;
use radixgate_bench::sim::workload::{build, DocsConfig, MultiturnConfig, WorkloadSpec};
use radixgate_bench::sim::{hash_sessions, routing_facts as sim_facts};
use radixgate_orchestrator::{BreakerState, FleetState, PromptHasher, Replica, Router};
use std::num::NonZeroUsize;

const BACKENDS: usize = 4;

fn config() -> Config {
    let mut toml = String::from("[routing]\nblock_bytes = 64\n");
    for b in 0..BACKENDS {
        toml.push_str(&format!(
            "[[backends]]\nid = \"b{b}\"\nurl = \"http://127.0.0.1:{}\"\nmodels = [\"sim\"]\ncache_blocks = 300\n",
            9000 + b
        ));
    }
    Config::from_toml(&toml).expect("a valid config")
}

/// One random fleet state, written into both sides' views.
struct Draw {
    healthy: [bool; BACKENDS],
    breaker: [BreakerState; BACKENDS],
    draining: [bool; BACKENDS],
    in_flight: [u32; BACKENDS],
    /// Prompt blocks of each request in flight.
    in_flight_prompt: [u32; BACKENDS],
    waiting: [u32; BACKENDS],
    pending: [u32; BACKENDS],
    learned: [LearnedCost; BACKENDS],
}

fn draw(rng: &mut fastrand::Rng) -> Draw {
    let mut d = Draw {
        healthy: [true; BACKENDS],
        breaker: [BreakerState::Closed; BACKENDS],
        draining: [false; BACKENDS],
        in_flight: [0; BACKENDS],
        in_flight_prompt: [0; BACKENDS],
        waiting: [0; BACKENDS],
        pending: [0; BACKENDS],
        learned: [LearnedCost::default(); BACKENDS],
    };
    for b in 0..BACKENDS {
        d.healthy[b] = rng.u8(..10) != 0;
        d.breaker[b] = match rng.u8(..20) {
            0 => BreakerState::Open,
            1 => BreakerState::HalfOpen,
            _ => BreakerState::Closed,
        };
        d.draining[b] = rng.u8(..25) == 0;
        d.in_flight[b] = rng.u32(..12);
        d.in_flight_prompt[b] = rng.u32(..40);
        d.waiting[b] = rng.u32(..4);
        d.pending[b] = if rng.bool() { rng.u32(..4000) } else { 0 };
        d.learned[b].prefill_ns_per_token = if rng.bool() {
            rng.u32(5_000..40_000)
        } else {
            0
        };
        d.learned[b].queue_ns_per_request = if rng.bool() {
            rng.u32(1_000_000..400_000_000)
        } else {
            0
        };
    }
    d
}

fn replay(spec: WorkloadSpec, policy: PolicyName, session_ids: bool) -> usize {
    let config = config();
    let live = LiveConfig::initial(&config);
    let mut snapshot = FleetSnapshot::all_healthy(live.clone());
    let model = live.backends.models().get("sim").expect("the model");
    assert_eq!(model, 0, "the simulator's one model is model 0");
    let mut gateway = Router::new(live.router.clone(), 11);
    let mut simulator = Router::new(live.router.clone(), 11);
    let mut gateway_replica = new_replica(&config, &live);
    let mut sim_replica: Replica = gateway_replica.clone();
    let mut sim_fleet = FleetState::healthy(BACKENDS);

    let sessions = build(&spec, 5, "sim", 16);
    let block_bytes = NonZeroUsize::new(64).unwrap();
    let hashed = hash_sessions(&sessions, block_bytes);
    let mut parser = BodyParser::default();
    let mut hasher = PromptHasher::new(block_bytes);
    let mut rng = fastrand::Rng::with_seed(3);
    let epoch = Instant::now();
    let (mut decisions, mut t) = (0, 0);
    // Round-robin over sessions, turn by turn, as concurrent clients would.
    let turns = sessions.iter().map(|s| s.turns.len()).max().unwrap_or(0);
    for turn in 0..turns {
        for (s, session) in sessions.iter().enumerate() {
            let Some(request) = session.turns.get(turn) else {
                continue;
            };
            t += 1;
            let now_ms = t * 7;
            let d = draw(&mut rng);
            // The gateway's view: snapshot, counters, the shard's learned rates.
            let in_flight = InFlight::new(1, BACKENDS);
            let pending = PendingPrefill::new(1, BACKENDS, epoch);
            let now = Instant::now();
            let mut guards = Vec::new();
            for b in 0..BACKENDS {
                snapshot.healthy[b] = d.healthy[b];
                snapshot.breaker[b] = d.breaker[b];
                snapshot.draining[b] = d.draining[b];
                snapshot.engine[b] = Some(crate::engine_metrics::EngineLoad {
                    waiting: d.waiting[b],
                    ..Default::default()
                });
                for _ in 0..d.in_flight[b] {
                    in_flight.enter(0, b, d.in_flight_prompt[b]);
                }
                if d.pending[b] > 0 {
                    guards.push(pending.enter(0, b, d.pending[b], now));
                }
            }
            let per_backend = d.learned.map(|learned| PerBackend {
                learned,
                ..PerBackend::default()
            });
            let view = ShardFleet {
                snapshot: &snapshot,
                in_flight: &in_flight,
                pending_prefill: &pending,
                per_backend: &per_backend,
                now,
            };
            // The simulator's view of the same fleet.
            for (b, state) in sim_fleet.states.iter_mut().enumerate() {
                state.healthy = d.healthy[b];
                state.breaker = d.breaker[b];
                state.draining = d.draining[b];
                state.in_flight = d.in_flight[b];
                state.in_flight_blocks = d.in_flight[b] * d.in_flight_prompt[b];
                state.engine_waiting = d.waiting[b];
                state.pending_prefill_tokens = d.pending[b];
                state.prefill_progress_ns = pending.progress_ns(b, now);
                state.prefill_ns_per_token = d.learned[b].prefill_ns_per_token;
                state.queue_ns_per_request = d.learned[b].queue_ns_per_request;
                assert_eq!(view.backend(b), *state, "backend {b}'s state");
            }

            let body = request.to_json();
            let facts = parser
                .parse(
                    Endpoint::ChatCompletions,
                    body.as_bytes(),
                    live.backends.models(),
                    &mut hasher,
                    0,
                )
                .expect("the simulator's body parses");
            let session_key = (session_ids && session.has_session_id).then_some(s as u64);
            let gateway_facts =
                routing_facts(&facts, policy, hasher.blocks(), session_key, &[], &[]);
            let prompt = &hashed[s].get(turn).expect("hashed like the session");
            let simulated = sim_facts(prompt, policy, session_key);
            assert_eq!(
                gateway_facts.blocks, simulated.blocks,
                "session {s} turn {turn}"
            );
            assert_eq!(gateway_facts.affinity_key, simulated.affinity_key);

            let g = gateway.decide(&gateway_replica, &view, &gateway_facts, now_ms);
            let m = simulator.decide(&sim_replica, &sim_fleet, &simulated, now_ms);
            assert_eq!(g, m, "session {s} turn {turn}");
            drop(guards);
            // The request ends before the next decision (its end is a decision
            // input too: the placements it used wait for their next use from it).
            if let (Ok(g), Ok(m)) = (&g, &m) {
                gateway.request_ended(g.prompt_tail, now_ms + 3);
                simulator.request_ended(m.prompt_tail, now_ms + 3);
            }
            if let (Ok(mut g), Ok(mut m)) = (g, m) {
                for op in g.ops.take() {
                    gateway_replica.apply(&op);
                }
                for op in m.ops.take() {
                    sim_replica.apply(&op);
                }
                decisions += 1;
            }
        }
    }
    for b in 0..BACKENDS {
        assert_eq!(
            gateway_replica.index.held_blocks(b),
            sim_replica.index.held_blocks(b)
        );
    }
    decisions
}

#[test]
fn the_gateway_and_the_simulator_make_the_same_decisions() {
    let docs = WorkloadSpec::Docs(DocsConfig::default());
    let multiturn = WorkloadSpec::Multiturn(MultiturnConfig::default());
    for policy in PolicyName::ALL {
        let n = replay(docs.clone(), policy, true);
        assert!(n > 100, "{policy}: only {n} decisions");
        let n = replay(multiturn.clone(), policy, true);
        assert!(n > 50, "{policy}: only {n} decisions");
    }
}
