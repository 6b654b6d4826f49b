//! `radixgate-bench sim --edge fairness|slo`: the gateway's edge decisions —
//! tenant quota buckets and TTFT-budget admission — in simulated time, running the
//! orchestrator's own code ([`Bucket`], [`Router::estimate`], [`decide`]).
//!
//! - **fairness**: a polite tenant sends at its quota, a greedy one at 10× its own
//!   (equal quotas, Poisson), for `SECONDS` simulated seconds. Per-tenant buckets (the
//!   gateway's) against one shared bucket holding both quotas: the share of the polite
//!   tenant's requests that get in, and what it gets with no greedy neighbour at all.
//!   Two polite tenants: one that keeps within its quota (evenly spaced, a little
//!   under it), and one that sends Poisson at its quota on average — its own bursts go
//!   over its one-second bucket, so it loses some requests alone just as beside the
//!   greedy one.
//! - **slo**: Poisson arrivals at a rising share of the fleet's prefill capacity, each
//!   with a prompt of 500–3000 tokens and a TTFT budget; each backend prefills one
//!   request at a time, FIFO (decode is not modelled: TTFT is queueing + prefill).
//!   Without admission every request is routed (least loaded); with it, a request
//!   whose best estimate is over budget is refused at once. Reported: the share of
//!   requests that meet their budget among those served, and goodput (met / offered).

use radixgate_orchestrator::admission::decide;
use radixgate_orchestrator::quota::Bucket;
use radixgate_orchestrator::{
    AdmissionInput, ChunkIndex, FleetState, IndexConfig, MediaNeeds, PolicyConfig, PolicyName,
    PrefixAwareConfig, PrefixIndex, Replica, Router, RouterConfig, RoutingFacts, SessionTable,
    Verdict,
};
use std::fmt::Write;
use std::path::Path;

const SECONDS: f64 = 60.0;

fn exp(rng: &mut fastrand::Rng, rate: f64) -> f64 {
    -(1.0 - rng.f64()).ln() / rate
}

/// How the polite tenant sends, at about `quota` requests a second.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Polite {
    /// Evenly spaced, gaps of 1–1.1 × 1/quota: never more than its quota in any window.
    Paced,
    /// Poisson: its bursts go over its quota now and then.
    Poisson,
}

/// The polite tenant's served share: (per-tenant buckets, one shared bucket, its
/// own bucket with the greedy tenant absent).
pub fn fairness(seed: u64, quota: f64, polite: Polite) -> (f64, f64, f64) {
    let mut rng = fastrand::Rng::with_seed(seed);
    // Arrivals of both tenants, merged in time order: (ms, polite?).
    let mut arrivals = Vec::new();
    for (is_polite, rate) in [(true, quota), (false, 10.0 * quota)] {
        let mut t = 0.0;
        loop {
            let ms = if is_polite && polite == Polite::Paced {
                // Gaps of 1 to 1.1 times 1/quota, on whole milliseconds rounded up:
                // never faster than its quota. (Exactly 1/quota would phase-lock with
                // a shared bucket's refills and decide that column by the seed.)
                t += (1.0 + 0.1 * rng.f64()) / rate;
                (t * 1000.0).ceil()
            } else {
                t += exp(&mut rng, rate);
                (t * 1000.0).floor()
            };
            if ms >= SECONDS * 1000.0 {
                break;
            }
            arrivals.push((ms as u64, is_polite));
        }
    }
    arrivals.sort_unstable();
    let polite_total = arrivals.iter().filter(|a| a.1).count() as f64;
    let share = |admit: &mut dyn FnMut(u64, bool) -> bool| {
        let served = arrivals.iter().filter(|(t, p)| admit(*t, *p) && *p).count();
        served as f64 / polite_total
    };
    let (polite, greedy) = (Bucket::new(quota, 0), Bucket::new(quota, 0));
    let separate = share(&mut |t, p| if p { &polite } else { &greedy }.take(1, t).is_ok());
    let shared_bucket = Bucket::new(2.0 * quota, 0);
    let shared = share(&mut |t, _| shared_bucket.take(1, t).is_ok());
    let alone_bucket = Bucket::new(quota, 0);
    let alone = share(&mut |t, p| p && alone_bucket.take(1, t).is_ok());
    (separate, shared, alone)
}

#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SloRow {
    pub load: f64,
    pub offered: usize,
    /// Without admission: met / served (everything is served).
    pub plain_attainment: f64,
    /// With admission: share admitted, met / admitted, met / offered.
    pub admitted: f64,
    pub attainment: f64,
    pub goodput: f64,
    pub plain_goodput: f64,
    /// Refused, though served at once it would have met its budget (ignoring what it
    /// would have delayed). 0 with the progress credit: before it, every such refusal
    /// was over-estimated by exactly the head request's prefill already done.
    pub wrongly_refused: f64,
}

/// One load level: `load` × the fleet's prefill capacity, `budget_ms` per request.
pub fn slo(seed: u64, backends: usize, load: f64, budget_ms: f64) -> SloRow {
    const NS_PER_TOKEN: f64 = 20_000.0;
    let mean_prefill_ns = 1750.0 * NS_PER_TOKEN;
    let rate = load * backends as f64 * 1e9 / mean_prefill_ns;
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut jobs = Vec::new();
    let mut t = 0.0;
    loop {
        t += exp(&mut rng, rate);
        if t >= SECONDS {
            break;
        }
        jobs.push(((t * 1e9) as u64, rng.u64(500..=3000)));
    }
    let cost = PrefixAwareConfig {
        tokens_per_block: 1.0,
        default_prefill_ns_per_token: NS_PER_TOKEN as u32,
        // Decode is not modelled: a request ahead costs only its prefill, which the
        // pending prefill tokens carry.
        queue_ns_per_request: 0,
        ..PrefixAwareConfig::default()
    };
    // Nobody holds any prompt: the prompt is `tokens` one-token blocks of any value.
    let prompt = vec![0u64; 3000];
    let replica = Replica::new(
        PrefixIndex::new(IndexConfig { max_blocks: 1 }),
        SessionTable::new(0, 1),
        ChunkIndex::new(1),
    );
    let run = |admission: bool| {
        // Per backend, FIFO: (first-token time, prompt tokens) of the requests it
        // holds that have no first token yet, as the gateway counts them.
        let mut queues: Vec<std::collections::VecDeque<(u64, u64)>> =
            vec![Default::default(); backends];
        // Per backend, as the gateway's pending-prefill clock keeps it: when its queue
        // last became non-empty, and its last first token.
        let (mut since, mut last_first) = (vec![0u64; backends], vec![0u64; backends]);
        let (mut admitted, mut met, mut wrongly_refused) = (0usize, 0usize, 0usize);
        let mut router = Router::new(
            RouterConfig {
                policy: PolicyConfig {
                    prefix: cost.clone(),
                    ..PolicyConfig::default()
                },
                ..RouterConfig::default()
            },
            seed,
        );
        let mut fleet = FleetState::healthy(backends);
        for &(now, tokens) in &jobs {
            for (b, q) in queues.iter_mut().enumerate() {
                while let Some(&(done, _)) = q.front().filter(|&&(done, _)| done <= now) {
                    last_first[b] = last_first[b].max(done);
                    q.pop_front();
                }
                let progress = if q.is_empty() {
                    0
                } else {
                    now.saturating_sub(since[b].max(last_first[b]))
                };
                let state = &mut fleet.states[b];
                state.in_flight = q.len() as u32;
                state.pending_prefill_tokens = q.iter().map(|&(_, t)| t as u32).sum();
                state.prefill_progress_ns = progress;
            }
            let facts = RoutingFacts {
                model: 0,
                adapter: None,
                policy: PolicyName::PrefixAware,
                blocks: &prompt[..tokens as usize],
                affinity_key: None,
                media: &MediaNeeds::TEXT_ONLY,
                session: None,
                chunks: &[],
                excluded: &[],
            };
            // Where prefix_aware sends a prompt nobody holds (the simulated engines
            // cache nothing, so the decision's index ops are not applied).
            let b = router
                .decide(&replica, &fleet, &facts, now / 1_000_000)
                .expect("a fleet")
                .pick
                .backend;
            let start = queues[b].back().map_or(now, |&(done, _)| done).max(now);
            let first_token = start + (tokens as f64 * NS_PER_TOKEN) as u64;
            let meets = (first_token - now) as f64 <= budget_ms * 1e6;
            if admission {
                let verdict = decide(&AdmissionInput {
                    budget_ns: Some(budget_ms * 1e6),
                    estimate: router.estimate(&replica, &fleet, &facts).expect("a fleet"),
                    pressure: 0.0,
                    shed_pressure: None,
                    may_wait: false,
                });
                if verdict != Verdict::Admit {
                    wrongly_refused += usize::from(meets);
                    continue;
                }
            }
            if queues[b].is_empty() {
                since[b] = now;
            }
            queues[b].push_back((first_token, tokens));
            admitted += 1;
            met += usize::from(meets);
        }
        (admitted, met, wrongly_refused)
    };
    let offered = jobs.len().max(1);
    let (all, plain_met, _) = run(false);
    let (admitted, met, wrongly_refused) = run(true);
    SloRow {
        load,
        offered,
        plain_attainment: plain_met as f64 / all.max(1) as f64,
        plain_goodput: plain_met as f64 / offered as f64,
        admitted: admitted as f64 / offered as f64,
        attainment: met as f64 / admitted.max(1) as f64,
        goodput: met as f64 / offered as f64,
        wrongly_refused: wrongly_refused as f64 / offered as f64,
    }
}

/// Load levels of the SLO table, × the fleet's prefill capacity.
pub const LOADS: [f64; 7] = [0.5, 0.8, 0.9, 1.0, 1.2, 1.5, 2.0];

/// Both experiments as Markdown, each table followed by links to its plots in
/// `plots` when given (`edge-fairness.svg`, `edge-slo.svg`).
pub fn report(seed: u64, backends: usize, plots: Option<&Path>) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "## Fairness: polite tenant at its quota (20/s), greedy tenant at 10× its quota (200/s, Poisson), {SECONDS} s, seed {seed}\n"
    );
    let _ = writeln!(
        out,
        "| polite tenant sends | served: per-tenant buckets (radixgate) | served: one shared bucket (40/s) | served: per tenant, greedy tenant absent |\n|---|---|---|---|"
    );
    let mut bars = Vec::new();
    for (shape, name, short) in [
        (
            Polite::Paced,
            "evenly, within its quota (gaps 50–55 ms)",
            "paced",
        ),
        (
            Polite::Poisson,
            "Poisson (bursts over its quota)",
            "Poisson",
        ),
    ] {
        let (separate, shared, alone) = fairness(seed, 20.0, shape);
        let _ = writeln!(
            out,
            "| {name} | {:.1}% | {:.1}% | {:.1}% |",
            separate * 100.0,
            shared * 100.0,
            alone * 100.0
        );
        bars.extend([
            (format!("{short}: per tenant (radixgate)"), separate),
            (format!("{short}: one shared bucket"), shared),
            (format!("{short}: greedy tenant absent"), alone),
        ]);
    }
    if let Some(dir) = plots {
        let path = dir.join("edge-fairness.svg");
        let written = crate::plots::bars(
            &path,
            &format!("fairness · polite tenant at its quota, greedy at 10×, seed {seed}"),
            "polite tenant's requests served",
            &bars,
        );
        out.push_str(&crate::plots::linked(
            written.map(|()| vec![path]),
            "fairness",
        ));
    }
    out.push('\n');
    let budget = 200.0;
    let _ = writeln!(
        out,
        "## SLO attainment: {backends} backends, FIFO prefill at 20 µs/token, prompts 500–3000 tokens, TTFT budget {budget} ms, {SECONDS} s, seed {seed}\n"
    );
    let _ = writeln!(
        out,
        "| load (× capacity) | offered | no admission: met / served | no admission: goodput | admission: admitted | admission: met / admitted | admission: goodput | refused that would have met |\n|---|---|---|---|---|---|---|---|"
    );
    let rows: Vec<SloRow> = LOADS
        .iter()
        .map(|&load| slo(seed, backends, load, budget))
        .collect();
    for r in &rows {
        let _ = writeln!(
            out,
            "| {:.1} | {} | {:.1}% | {:.1}% | {:.1}% | {:.1}% | {:.1}% | {:.2}% |",
            r.load,
            r.offered,
            r.plain_attainment * 100.0,
            r.plain_goodput * 100.0,
            r.admitted * 100.0,
            r.attainment * 100.0,
            r.goodput * 100.0,
            r.wrongly_refused * 100.0
        );
    }
    if let Some(dir) = plots {
        let path = dir.join("edge-slo.svg");
        let line = |label: &str, y: fn(&SloRow) -> f64| crate::plots::Line {
            label: label.to_string(),
            points: rows.iter().map(|r| (r.load, y(r))).collect(),
        };
        let lines = [
            line("no admission: met / served", |r| r.plain_attainment),
            line("admission: met / admitted", |r| r.attainment),
            line("no admission: goodput", |r| r.plain_goodput),
            line("admission: goodput", |r| r.goodput),
        ];
        let written = crate::plots::lines(
            &path,
            &format!("SLO attainment and goodput · {backends} backends, TTFT budget {budget} ms, seed {seed}"),
            "load (× prefill capacity)",
            "share of requests",
            &lines,
        );
        out.push_str(&crate::plots::linked(
            written.map(|()| vec![path]),
            "SLO attainment",
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_tenant_buckets_protect_the_polite_tenant() {
        // Within its quota, it is served in full beside the greedy tenant.
        for seed in 1..=4 {
            let (separate, shared, alone) = fairness(seed, 20.0, Polite::Paced);
            assert_eq!((separate, alone), (1.0, 1.0), "seed {seed}");
            assert!(shared < 0.3, "{shared}");
        }
        // Sending Poisson at its quota on average, its own bursts overflow its bucket:
        // it loses exactly what it loses alone, nothing to the greedy tenant.
        let (separate, shared, alone) = fairness(1, 20.0, Polite::Poisson);
        assert_eq!(separate, alone, "the greedy tenant takes nothing from it");
        assert!(separate > 0.9 && separate < 1.0, "{separate}");
        assert!(shared < 0.3, "{shared}");
    }

    #[test]
    fn admission_keeps_attainment_under_overload() {
        let r = slo(1, 3, 1.5, 200.0);
        assert!(r.plain_attainment < 0.5, "{r:?}");
        // The estimate charges the queued prefill less the head request's progress,
        // which under FIFO prefill is exact: what it admits meets its budget, and it
        // refuses nothing that would have met it (14% of the offered at 1.5× when the
        // head request was charged its whole prompt).
        for load in [1.0, 1.5, 2.0] {
            let r = slo(1, 3, load, 200.0);
            assert!(r.attainment >= 0.99, "{r:?}");
            assert_eq!(r.wrongly_refused, 0.0, "{r:?}");
        }
        assert!(r.goodput >= r.plain_goodput, "{r:?}");
        let calm = slo(1, 3, 0.5, 200.0);
        assert!(calm.admitted > 0.99, "{calm:?}");
    }
}
