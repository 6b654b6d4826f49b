//! `radixgate-bench sim --disagg`: co-located serving against split prefill/decode
//! pools (always split, and the gateway's conditional split) in simulated time,
//! deciding with the orchestrator's own [`radixgate_orchestrator::disagg::decide`].
//!
//! The trade-off Splitwise and DistServe report: on a co-located engine a prefill
//! stalls every running decode (vLLM without chunked prefill schedules a waiting
//! prefill ahead of the next decode step), so long prompts inflate everyone's
//! inter-token latency; splitting removes that interference but adds a KV transfer to
//! each request's time to first token and leaves half the engines to each phase.
//!
//! Model: every engine runs one iteration at a time. An iteration is either one
//! prefill (the oldest waiting request, `tokens × PREFILL_NS_PER_TOKEN`), taken
//! whenever one waits, or one decode step for every running request (`STEP_NS +
//! STEP_NS_PER_SEQ × batch`), each of which then emits a token. A co-located or
//! locally served request emits its first token when its prefill ends and joins that
//! engine's decode batch; a split request's KV moves to its decode engine
//! (`tokens × TRANSFER_NS_PER_TOKEN`, not blocking either engine) and its first token
//! comes with the decode engine's next step. Workload: Poisson arrivals, half of them
//! long prompts with short answers (RAG, summarising), half short prompts with long
//! answers (chat, code), no prefix reuse. Engine choice: co-located takes the engine
//! with the least pending prefill work plus decode batch; the split modes ask
//! the gateway's `Router::decide_pair` with each prefill engine's queue and each
//! decode engine's batch; a
//! conditional "local" request goes to the decode engine with the least work.

use radixgate_orchestrator::{
    ChunkIndex, DisaggPolicy, FleetState, IndexConfig, MediaNeeds, PairOutcome, PolicyConfig,
    PolicyName, PrefixAwareConfig, PrefixIndex, Replica, Role, Router, RouterConfig, RoutingFacts,
    SessionTable,
};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::fmt::Write;

const PREFILL_NS_PER_TOKEN: u64 = 20_000;
const STEP_NS: u64 = 8_000_000;
const STEP_NS_PER_SEQ: u64 = 100_000;
/// 128 KiB of KV per token over a 25 GB/s link.
const TRANSFER_NS_PER_TOKEN: u64 = 5_000;
const TOKENS_PER_BLOCK: u64 = 16;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Colocated,
    AlwaysSplit,
    Conditional,
}

impl Mode {
    fn label(self) -> &'static str {
        match self {
            Mode::Colocated => "co-located (4 × both)",
            Mode::AlwaysSplit => "always split (2 prefill + 2 decode)",
            Mode::Conditional => "conditional split (2 + 2, min_uncached_tokens 1024)",
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Req {
    arrival: u64,
    prompt: u64,
    output: u64,
}

fn workload(seed: u64, requests: usize, rate_per_s: f64) -> Vec<Req> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut t = 0.0f64;
    (0..requests)
        .map(|_| {
            t += -(1.0 - rng.f64()).ln() / rate_per_s;
            let (prompt, output) = if rng.bool() {
                (rng.u64(2_000..=6_000), rng.u64(16..=64))
            } else {
                (rng.u64(100..=400), rng.u64(200..=600))
            };
            Req {
                arrival: (t * 1e9) as u64,
                prompt,
                output,
            }
        })
        .collect()
}

#[derive(Default)]
struct Engine {
    /// Waiting prefills: (request, split to this decode engine).
    prefill: VecDeque<(usize, Option<usize>)>,
    pending_tokens: u64,
    /// Running decodes.
    batch: Vec<usize>,
    busy: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Arrive(usize),
    /// The engine finished its current iteration.
    Done(usize),
    /// A split request's KV reached its decode engine.
    Landed(usize, usize),
}

/// Per-request latencies of one run.
pub struct Outcome {
    pub ttft_ns: Vec<u64>,
    pub itl_ns: Vec<u64>,
    pub split: usize,
}

pub fn run(mode: Mode, seed: u64, requests: usize, rate_per_s: f64) -> Outcome {
    let reqs = workload(seed, requests, rate_per_s);
    let n = 4;
    let prefill_pool: Vec<usize> = match mode {
        Mode::Colocated => Vec::new(),
        _ => vec![0, 1],
    };
    let mut engines: Vec<Engine> = (0..n).map(|_| Engine::default()).collect();
    // What each engine's current iteration is: a prefill of (request, split target)
    // or a decode step.
    let mut current: Vec<Option<(usize, Option<usize>)>> = vec![None; n];
    let mut left = vec![0u64; reqs.len()];
    let mut last_token = vec![0u64; reqs.len()];
    let mut out = Outcome {
        ttft_ns: Vec::with_capacity(reqs.len()),
        itl_ns: Vec::new(),
        split: 0,
    };
    let mut heap = BinaryHeap::new();
    for (i, r) in reqs.iter().enumerate() {
        heap.push(Reverse((r.arrival, Event::Arrive(i))));
    }
    let policy = DisaggPolicy {
        always: mode == Mode::AlwaysSplit,
        min_uncached_tokens: 1024,
        transfer_ns_per_token: TRANSFER_NS_PER_TOKEN as f64,
        ..DisaggPolicy::default()
    };
    let cost = PrefixAwareConfig {
        tokens_per_block: TOKENS_PER_BLOCK as f64,
        default_prefill_ns_per_token: PREFILL_NS_PER_TOKEN as u32,
        ..PrefixAwareConfig::default()
    };
    let mut router = Router::new(
        RouterConfig {
            policy: PolicyConfig {
                prefix: cost,
                ..PolicyConfig::default()
            },
            ..RouterConfig::default()
        },
        seed,
    );
    // No prefix reuse in this workload: the replica stays empty, and a prompt is
    // its block count of any value.
    let replica = Replica::new(
        PrefixIndex::new(IndexConfig { max_blocks: 1 }),
        SessionTable::new(0, 1),
        ChunkIndex::new(1),
    );
    let longest = reqs.iter().map(|r| r.prompt).max().unwrap_or(0);
    let prompt = vec![0u64; (longest / TOKENS_PER_BLOCK) as usize];
    let mut fleet = FleetState::healthy(n);
    for (e, state) in fleet.states.iter_mut().enumerate() {
        state.role = if prefill_pool.contains(&e) {
            Role::Prefill
        } else {
            Role::Decode
        };
    }
    let work =
        |e: &Engine| e.pending_tokens * PREFILL_NS_PER_TOKEN + e.batch.len() as u64 * STEP_NS;
    while let Some(Reverse((now, event))) = heap.pop() {
        let touched = match event {
            Event::Arrive(i) => {
                left[i] = reqs[i].output;
                let (target, to) = match mode {
                    Mode::Colocated => {
                        ((0..n).min_by_key(|&e| work(&engines[e])).unwrap_or(0), None)
                    }
                    _ => {
                        for (e, state) in fleet.states.iter_mut().enumerate() {
                            state.in_flight = if prefill_pool.contains(&e) {
                                engines[e].prefill.len() as u32
                            } else {
                                engines[e].batch.len() as u32 + engines[e].prefill.len() as u32
                            };
                        }
                        let facts = RoutingFacts {
                            model: 0,
                            adapter: None,
                            policy: PolicyName::PrefixAware,
                            blocks: &prompt[..(reqs[i].prompt / TOKENS_PER_BLOCK) as usize],
                            affinity_key: None,
                            media: &MediaNeeds::TEXT_ONLY,
                            session: None,
                            chunks: &[],
                            excluded: &[],
                        };
                        match router
                            .decide_pair(&replica, &fleet, &facts, &policy, now / 1_000_000)
                            .expect("a fleet")
                        {
                            PairOutcome::Split { prefill, decode } => {
                                out.split += 1;
                                (prefill.pick.backend, Some(decode.pick.backend))
                            }
                            PairOutcome::Local(_) => {
                                ((2..n).min_by_key(|&e| work(&engines[e])).unwrap_or(2), None)
                            }
                        }
                    }
                };
                engines[target].prefill.push_back((i, to));
                engines[target].pending_tokens += reqs[i].prompt;
                target
            }
            Event::Landed(i, e) => {
                engines[e].batch.push(i);
                e
            }
            Event::Done(e) => {
                engines[e].busy = false;
                match current[e].take() {
                    Some((i, None)) => {
                        // First token on the engine that prefilled it.
                        out.ttft_ns.push(now - reqs[i].arrival);
                        last_token[i] = now;
                        left[i] -= 1;
                        if left[i] > 0 {
                            engines[e].batch.push(i);
                        }
                    }
                    Some((i, Some(d))) => {
                        heap.push(Reverse((
                            now + reqs[i].prompt * TRANSFER_NS_PER_TOKEN,
                            Event::Landed(i, d),
                        )));
                    }
                    None => {
                        let batch = std::mem::take(&mut engines[e].batch);
                        for i in batch {
                            if last_token[i] == 0 {
                                out.ttft_ns.push(now - reqs[i].arrival);
                            } else {
                                out.itl_ns.push(now - last_token[i]);
                            }
                            last_token[i] = now;
                            left[i] -= 1;
                            if left[i] > 0 {
                                engines[e].batch.push(i);
                            }
                        }
                    }
                }
                e
            }
        };
        // Start the touched engine's next iteration if it is idle.
        let e = &mut engines[touched];
        if e.busy {
            continue;
        }
        if let Some((i, to)) = e.prefill.pop_front() {
            e.pending_tokens -= reqs[i].prompt;
            e.busy = true;
            current[touched] = Some((i, to));
            heap.push(Reverse((
                now + reqs[i].prompt * PREFILL_NS_PER_TOKEN,
                Event::Done(touched),
            )));
        } else if !e.batch.is_empty() {
            e.busy = true;
            let step = STEP_NS + STEP_NS_PER_SEQ * e.batch.len() as u64;
            heap.push(Reverse((now + step, Event::Done(touched))));
        }
    }
    out
}

fn percentile(v: &mut [u64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_unstable();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i] as f64 / 1e6
}

pub fn report(seed: u64) -> String {
    let requests = 2_000;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "## Disaggregated prefill/decode: 4 engines, {requests} requests (half 2000–6000-token prompts with 16–64 output tokens, half 100–400-token prompts with 200–600), Poisson, seed {seed}\n"
    );
    let _ = writeln!(
        out,
        "Prefill {} µs/token; decode step {} ms + {} µs per running request; prefills preempt decode steps on a co-located engine; KV transfer {} µs/token.\n",
        PREFILL_NS_PER_TOKEN / 1000,
        STEP_NS / 1_000_000,
        STEP_NS_PER_SEQ / 1000,
        TRANSFER_NS_PER_TOKEN / 1000
    );
    let _ = writeln!(
        out,
        "| rate (req/s) | mode | split | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) |\n|---:|---|---:|---:|---:|---:|---:|"
    );
    for rate in [10.0, 20.0, 30.0] {
        for mode in [Mode::Colocated, Mode::AlwaysSplit, Mode::Conditional] {
            let mut o = run(mode, seed, requests, rate);
            let _ = writeln!(
                out,
                "| {rate} | {} | {:.0}% | {:.0} | {:.0} | {:.1} | {:.1} |",
                mode.label(),
                o.split as f64 * 100.0 / requests as f64,
                percentile(&mut o.ttft_ns, 0.5),
                percentile(&mut o.ttft_ns, 0.99),
                percentile(&mut o.itl_ns, 0.5),
                percentile(&mut o.itl_ns, 0.99),
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_request_gets_all_its_tokens_once() {
        for mode in [Mode::Colocated, Mode::AlwaysSplit, Mode::Conditional] {
            let reqs = workload(3, 200, 5.0);
            let o = run(mode, 3, 200, 5.0);
            assert_eq!(o.ttft_ns.len(), 200, "{mode:?}");
            let gaps: u64 = reqs.iter().map(|r| r.output - 1).sum();
            assert_eq!(o.itl_ns.len() as u64, gaps, "{mode:?}");
        }
        assert_eq!(run(Mode::Colocated, 3, 200, 5.0).split, 0);
        assert_eq!(run(Mode::AlwaysSplit, 3, 200, 5.0).split, 200);
    }

    #[test]
    fn splitting_removes_prefill_interference_from_decode() {
        let mut co = run(Mode::Colocated, 1, 1000, 20.0);
        let mut split = run(Mode::AlwaysSplit, 1, 1000, 20.0);
        assert!(percentile(&mut split.itl_ns, 0.99) < percentile(&mut co.itl_ns, 0.99));
    }
}
