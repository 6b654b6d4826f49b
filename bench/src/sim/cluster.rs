//! `radixgate-bench sim --cluster`: what cluster mode buys and where its design stops
//! holding. Several gateway replicas sit behind an L4 balancer that sends each
//! request to one of them at random; each replica runs its own [`Router`] over its
//! own replica of the index (the simulator's [`run`] with `replicas > 1`). They
//! either share nothing, or every routing op one of them makes (inserts, session
//! bindings) reaches the others after a fixed lag, as cluster mode's bus carries it.
//! Load is seen fleet-wide without lag in both cases (it is the index that diverges).
//!
//! Reported per replica count and lag: the engines' hit rate, its ratio to one
//! replica's, the load CoV and the mean TTFT. The workload and fleet are the `sim`
//! flags (`--backends`, `--cache-blocks`, `--docs`, `--requests`, `--window`, ...), so
//! the same command runs three engines or a thousand.
//!
//! [`Router`]: radixgate_orchestrator::Router

use super::report::RunResult;
use super::workload::{DocsConfig, WorkloadSpec};
use super::{hash_sessions, run, workload, SimConfig};
use radixgate_orchestrator::PolicyName;
use std::fmt::Write as _;

/// Replica counts in the table.
pub const REPLICAS: [usize; 5] = [1, 2, 4, 8, 16];
/// Lags in the table, in ms; `None` = the replicas share nothing.
pub const LAGS_MS: [Option<f64>; 6] = [
    None,
    Some(0.0),
    Some(1.0),
    Some(10.0),
    Some(50.0),
    Some(100.0),
];

/// One cell of the table.
pub struct Cell {
    pub replicas: usize,
    pub lag_ms: Option<f64>,
    pub result: RunResult,
}

/// Runs every replica count at every lag (one replica once: lag does not apply).
pub fn cells(base: &SimConfig, docs: &DocsConfig) -> Vec<Cell> {
    let spec = WorkloadSpec::Docs(docs.clone());
    let sessions = workload::build(&spec, base.seed, "sim", 16);
    let prompts = hash_sessions(&sessions, base.block_bytes);
    let mut out = Vec::new();
    for replicas in REPLICAS {
        let lags: &[Option<f64>] = if replicas == 1 {
            &[Some(0.0)]
        } else {
            &LAGS_MS
        };
        for &lag_ms in lags {
            let cfg = SimConfig {
                replicas,
                replication_lag_ns: lag_ms.map(|ms| (ms * 1e6) as u64),
                ..base.clone()
            };
            let result = run(&cfg, PolicyName::PrefixAware, &sessions, &prompts);
            out.push(Cell {
                replicas,
                lag_ms: if replicas == 1 { None } else { lag_ms },
                result,
            });
        }
    }
    out
}

pub fn report(base: &SimConfig, docs: &DocsConfig) -> String {
    let cells = cells(base, docs);
    let one = cells
        .iter()
        .find(|c| c.replicas == 1)
        .map_or(1.0, |c| c.result.hit_rate());
    let mut out = String::new();
    let _ = writeln!(
        out,
        "### cluster · docs · uniform ({} docs of {} B, {} requests; {} backends × {} blocks of {} B, window {}, seed {}; prefix_aware)\n",
        docs.docs,
        docs.doc_bytes,
        docs.requests,
        base.backends,
        base.cache_blocks,
        base.block_bytes,
        base.window,
        base.seed
    );
    out.push_str("| replicas | routing ops shared | hit rate | vs 1 replica | load CoV | mean TTFT ms | p99 TTFT ms |\n");
    out.push_str("|---|---|---|---|---|---|---|\n");
    for c in &cells {
        let shared = match (c.replicas, c.lag_ms) {
            (1, _) => "—".to_string(),
            (_, None) => "no".to_string(),
            (_, Some(ms)) => format!("after {ms} ms"),
        };
        let hit = c.result.hit_rate();
        let _ = writeln!(
            out,
            "| {} | {} | {:.1}% | {:.3}× | {:.3} | {:.2} | {:.2} |",
            c.replicas,
            shared,
            hit * 100.0,
            hit / one.max(f64::MIN_POSITIVE),
            c.result.load_cov(),
            c.result.ttft_mean_ms(),
            c.result.ttft_quantile_ms(0.99)
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Small enough for a unit test: sharing the routing ops restores what splitting
    /// the traffic over replicas loses, and a long lag loses some of it again.
    #[test]
    fn sharing_the_routing_ops_restores_one_replicas_hit_rate() {
        let base = SimConfig::default();
        let docs = DocsConfig {
            requests: 600,
            ..DocsConfig::default()
        };
        let spec = WorkloadSpec::Docs(docs);
        let sessions = workload::build(&spec, 1, "sim", 16);
        let prompts = hash_sessions(&sessions, base.block_bytes);
        let hit = |replicas, lag: Option<u64>| {
            let cfg = SimConfig {
                replicas,
                replication_lag_ns: lag,
                ..base.clone()
            };
            run(&cfg, PolicyName::PrefixAware, &sessions, &prompts).hit_rate()
        };
        let one = hit(1, Some(0));
        let unshared = hit(4, None);
        let shared = hit(4, Some(0));
        assert!(unshared < 0.95 * one, "unshared {unshared} vs one {one}");
        assert!(shared >= 0.99 * one, "shared {shared} vs one {one}");
    }
}
