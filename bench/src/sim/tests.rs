//! The simulator end to end: determinism, the cost model by hand, and smoke runs of
//! each workload where prefix_aware must beat round_robin.

use super::workload::{Distribution, DocsConfig, MultiturnConfig};
use super::*;

fn small_docs(distribution: Distribution) -> WorkloadSpec {
    WorkloadSpec::Docs(DocsConfig {
        docs: 6,
        doc_bytes: 2048,
        requests: 300,
        distribution,
        ..DocsConfig::default()
    })
}

fn small_cfg() -> SimConfig {
    SimConfig {
        cache_blocks: 90,
        window: 12,
        ..SimConfig::default()
    }
}

#[test]
fn same_seed_same_results() {
    let cfg = small_cfg();
    for spec in [
        small_docs(Distribution::Zipf(1.0)),
        WorkloadSpec::Multiturn(MultiturnConfig::default()),
    ] {
        let a = run_policies(&cfg, &spec, &PolicyName::ALL);
        let b = run_policies(&cfg, &spec, &PolicyName::ALL);
        assert_eq!(a, b, "{}", spec.name());
        let other = run_policies(
            &SimConfig {
                seed: 2,
                ..cfg.clone()
            },
            &spec,
            &PolicyName::ALL,
        );
        assert_ne!(a, other, "{} ignores the seed", spec.name());
    }
}

fn result(runs: &[(PolicyName, RunResult)], p: PolicyName) -> &RunResult {
    &runs.iter().find(|(q, _)| *q == p).unwrap().1
}

#[test]
fn smoke_docs_prefix_aware_beats_round_robin() {
    for d in [Distribution::Uniform, Distribution::Zipf(1.0)] {
        let runs = run_policies(&small_cfg(), &small_docs(d), &PolicyName::ALL);
        for (p, r) in &runs {
            assert_eq!(r.requests, 300, "{p}");
            assert_eq!(r.ttft_ns.len(), 300, "{p}");
            assert_eq!(r.per_backend.iter().sum::<u64>(), 300, "{p}");
            assert!(r.hit_rate() <= r.ceiling_hit_rate() + 1e-9, "{p}");
        }
        let pa = result(&runs, PolicyName::PrefixAware);
        let rr = result(&runs, PolicyName::RoundRobin);
        assert!(
            pa.hit_rate() > rr.hit_rate(),
            "{d:?}: prefix_aware {} vs round_robin {}",
            pa.hit_rate(),
            rr.hit_rate()
        );
    }
}

#[test]
fn smoke_multiturn_prefix_aware_beats_round_robin() {
    let spec = WorkloadSpec::Multiturn(MultiturnConfig {
        sessions: 6,
        turns: 4,
        ..MultiturnConfig::default()
    });
    let runs = run_policies(&small_cfg(), &spec, &PolicyName::ALL);
    for (p, r) in &runs {
        assert_eq!(r.requests, 24, "{p}");
    }
    let pa = result(&runs, PolicyName::PrefixAware);
    let rr = result(&runs, PolicyName::RoundRobin);
    assert!(
        pa.hit_rate() > rr.hit_rate(),
        "{} vs {}",
        pa.hit_rate(),
        rr.hit_rate()
    );
}

#[test]
fn cost_model_by_hand() {
    // One backend, window 2, two prompts sharing their first block (the second block
    // holds each one's own question): the first is cold, the second waits for the
    // first's prefill and then hits the shared block.
    let spec = WorkloadSpec::Docs(DocsConfig {
        docs: 1,
        doc_bytes: 100,
        system_bytes: 0,
        question_bytes: 20,
        requests: 2,
        distribution: Distribution::Uniform,
    });
    let cfg = SimConfig {
        backends: 1,
        window: 2,
        ..SimConfig::default()
    };
    let sessions = workload::build(&spec, 1, "sim", 16);
    let prompts = hash_sessions(&sessions, cfg.block_bytes);
    let p = &prompts[0][0];
    // "system" 0x1F 0x1D + 100 + 0x1E "user" 0x1F 0x1D + 20 = 135 bytes: 2 blocks.
    assert_eq!((p.bytes, p.blocks.len(), p.tokens()), (135, 2, 34));
    let r = run(&cfg, PolicyName::RoundRobin, &sessions, &prompts);
    assert_eq!((r.prompt_tokens, r.cached_tokens), (68, 16));
    assert_eq!((r.prompt_blocks, r.cached_blocks), (4, 1));
    let first = 34 * 20_000;
    let second = first + (34 - 16) * 20_000;
    assert_eq!(r.ttft_ns, vec![first, second]);
    assert_eq!(r.makespan_ns, second + 32_000_000);
    assert_eq!(r.queue_ns_total, first);
}

#[test]
fn every_knob_keeps_the_books_balanced() {
    let variants = [
        SimConfig {
            prefill_slots: 0,
            ..small_cfg()
        },
        SimConfig {
            load_signal: LoadSignal::AwaitingFirstToken,
            scrape_ns: 0,
            ..small_cfg()
        },
        SimConfig {
            scrape_ns: 5_000_000,
            think_ns: 0,
            session_ids: false,
            ..small_cfg()
        },
    ];
    let spec = WorkloadSpec::Multiturn(MultiturnConfig {
        sessions: 6,
        turns: 3,
        ..MultiturnConfig::default()
    });
    for cfg in &variants {
        for spec in [&spec, &small_docs(Distribution::Uniform)] {
            for (p, r) in run_policies(cfg, spec, &PolicyName::ALL) {
                let n = r.requests;
                assert!(n == 18 || n == 300, "{p}");
                assert_eq!(r.ttft_ns.len() as u64, n, "{p}");
                assert_eq!(r.per_backend.iter().sum::<u64>(), n, "{p}");
                assert!(r.cached_blocks <= r.ceiling_blocks, "{p}");
            }
        }
    }
}

/// `sim` parsed from a command line, as `radixgate-bench sim ...` would be.
fn sim_args(line: &str) -> cli::SimArgs {
    use clap::Parser;
    #[derive(Parser)]
    struct Sim {
        #[command(flatten)]
        args: cli::SimArgs,
    }
    Sim::try_parse_from(line.split(' '))
        .unwrap_or_else(|e| panic!("{line}: {e}"))
        .args
}

/// A fresh directory for one test's plots.
fn plot_dir(name: &str) -> std::path::PathBuf {
    let dir =
        std::env::temp_dir().join(format!("radixgate-sim-plots-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[allow(
    clippy::disallowed_methods,
    reason = "a test reads the files written; no shard runs here"
)]
fn read(path: &std::path::Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn sweep_plots_hit_rate_against_the_parameter_per_policy() {
    let dir = plot_dir("sweep");
    let args = sim_args(&format!(
        "sim --sweep docs --distribution uniform --policy prefix_aware,round_robin --requests 120 --doc-bytes 1024 --plots {}",
        dir.display()
    ));
    let out = cli::run(&args);
    let path = dir.join("sweep-docs-uniform-hit-rate.svg");
    assert!(
        out.contains(&format!(
            "![sweep-docs-uniform-hit-rate]({})",
            path.display()
        )),
        "{out}"
    );
    let svg = read(&path);
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    for want in [
        "prefix_aware",
        "round_robin",
        "docs",
        "engine hit rate · sweep over docs",
    ] {
        assert!(svg.contains(want), "{want} not in the plot");
    }
    // A point per swept value and policy.
    assert_eq!(svg.matches("<circle").count(), 2 * cli::SWEEP_DOCS.len());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn edge_plots_slo_and_fairness() {
    let dir = plot_dir("edge");
    let out = cli::run(&sim_args(&format!(
        "sim --edge --backends 2 --plots {}",
        dir.display()
    )));
    for (name, wants) in [
        (
            "edge-fairness",
            &[
                "per tenant (radixgate)",
                "one shared bucket",
                "greedy tenant absent",
            ][..],
        ),
        (
            "edge-slo",
            &[
                "no admission: met / served",
                "admission: met / admitted",
                "no admission: goodput",
                "admission: goodput",
                "load (× prefill capacity)",
            ][..],
        ),
    ] {
        let path = dir.join(format!("{name}.svg"));
        assert!(
            out.contains(&format!("![{name}]({})", path.display())),
            "{out}"
        );
        let svg = read(&path);
        for want in wants {
            assert!(svg.contains(want), "{want} not in {name}");
        }
    }
    // Four lines of one point per load level.
    let slo = read(&dir.join("edge-slo.svg"));
    assert_eq!(slo.matches("<circle").count(), 4 * edge::LOADS.len());
    // Without --plots, the same tables and no links.
    let plain = cli::run(&sim_args("sim --edge --backends 2"));
    assert!(!plain.contains("!["));
    let _ = std::fs::remove_dir_all(&dir);
}
