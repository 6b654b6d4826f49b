//! The `sim` subcommand's flags and what it prints: a table per workload and
//! distribution (or per sweep), or with `--json` one array of row objects.

use std::fmt::Write as _;
use std::num::NonZeroUsize;

use clap::{Args, ValueEnum};
use radixgate_orchestrator::{PolicyConfig, PolicyName, PrefixAwareConfig, RouterConfig};

use super::report::{self, Row, RunResult};
use super::workload::{Distribution, DocsConfig, MultiturnConfig, WorkloadSpec};
use super::{backend_ids, run_policies, LoadSignal, SimConfig};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum WorkloadChoice {
    All,
    Docs,
    Multiturn,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DistributionChoice {
    /// uniform and zipf(--alpha), one table each.
    Both,
    Uniform,
    Zipf,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LoadSignalArg {
    InFlight,
    AwaitingFirstToken,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Sweep {
    /// docs over 5, 10, 15, 20, 30, 50 documents.
    Docs,
    /// docs under Zipf α = 0, 0.5, 1, 1.5, 2.
    Alpha,
    /// docs with a window of 12, 24, 48, 96, 192 requests in flight.
    Concurrency,
}

pub const SWEEP_DOCS: [usize; 6] = [5, 10, 15, 20, 30, 50];
pub const SWEEP_ALPHA: [f64; 5] = [0.0, 0.5, 1.0, 1.5, 2.0];
pub const SWEEP_WINDOW: [usize; 5] = [12, 24, 48, 96, 192];

/// The sizes of the docs and multiturn workloads (shared by `sim` and `gen-trace`).
#[derive(Args, Debug, Clone)]
pub struct WorkloadFlags {
    /// docs: number of documents.
    #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u32).range(1..))]
    pub docs: u32,
    /// docs: bytes per document.
    #[arg(long, default_value_t = 6144)]
    pub doc_bytes: usize,
    /// docs: bytes of the shared system prompt ahead of the document.
    #[arg(long, default_value_t = 128)]
    pub system_bytes: usize,
    /// docs: bytes of each (unique) question.
    #[arg(long, default_value_t = 48)]
    pub question_bytes: usize,
    /// docs: requests in all.
    #[arg(long, default_value_t = 3000)]
    pub requests: usize,

    /// multiturn: conversations.
    #[arg(long, default_value_t = 12)]
    pub sessions: usize,
    /// multiturn: turns per conversation.
    #[arg(long, default_value_t = 6)]
    pub turns: usize,
    /// multiturn: bytes of the shared system prompt.
    #[arg(long, default_value_t = 768)]
    pub mt_system_bytes: usize,
    /// multiturn: bytes of the code context some sessions share.
    #[arg(long, default_value_t = 1536)]
    pub code_bytes: usize,
    /// multiturn: share of sessions that open with the code context.
    #[arg(long, default_value_t = 0.4)]
    pub code_share: f64,
    /// multiturn: probability of a tool call and result after a turn.
    #[arg(long, default_value_t = 0.3)]
    pub tool_prob: f64,
}

impl WorkloadFlags {
    pub fn docs_config(&self, distribution: Distribution) -> DocsConfig {
        DocsConfig {
            docs: self.docs as usize,
            doc_bytes: self.doc_bytes,
            system_bytes: self.system_bytes,
            question_bytes: self.question_bytes,
            requests: self.requests,
            distribution,
        }
    }

    pub fn multiturn_config(&self) -> MultiturnConfig {
        MultiturnConfig {
            sessions: self.sessions,
            turns: self.turns,
            system_bytes: self.mt_system_bytes,
            code_bytes: self.code_bytes,
            code_share: self.code_share,
            tool_prob: self.tool_prob,
        }
    }
}

#[derive(Args, Debug, Clone)]
pub struct SimArgs {
    #[arg(long, value_enum, default_value_t = WorkloadChoice::All)]
    pub workload: WorkloadChoice,
    /// docs: how documents are chosen.
    #[arg(long, value_enum, default_value_t = DistributionChoice::Both)]
    pub distribution: DistributionChoice,
    /// docs: the Zipf exponent.
    #[arg(long, default_value_t = 1.0)]
    pub alpha: f64,
    /// Policies to run (comma-separated); default all five.
    #[arg(long, value_delimiter = ',', value_parser = parse_policy)]
    pub policy: Vec<PolicyName>,
    /// Run a sweep over the docs workload instead of the workload tables.
    #[arg(long, value_enum)]
    pub sweep: Option<Sweep>,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Print a JSON array of row objects instead of Markdown tables.
    #[arg(long)]
    pub json: bool,
    /// Run the edge experiments instead (tenant fairness and SLO attainment with and
    /// without admission; see `sim::edge`). Uses `--seed` and `--backends`.
    #[arg(long)]
    pub edge: bool,
    /// Run the workload-aware scheduling experiments instead (RAG chunk affinity and
    /// map-reduce DAG placement against round-robin; see `sim::scheduling`). Uses
    /// `--seed`.
    #[arg(long)]
    pub scheduling: bool,
    /// Run the disaggregation experiment instead (co-located vs always-split vs
    /// conditional split; TTFT and inter-token latency, see `sim::disagg`). Uses `--seed`.
    #[arg(long)]
    pub disagg: bool,
    /// Run the cluster experiment instead: `prefix_aware` with 1, 2, 4, 8 and 16
    /// gateway replicas behind a random L4 spread, sharing nothing or sharing their
    /// routing ops with a lag of 0 to 100 ms (see `sim::cluster`). Uses the docs
    /// workload, the fleet flags and `--seed`.
    #[arg(long)]
    pub cluster: bool,
    /// Gateway replicas behind a random L4 spread, each with its own router.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub replicas: u32,
    /// Milliseconds for one replica's routing ops to reach the others; `none`: the
    /// replicas share nothing.
    #[arg(long, default_value = "0")]
    pub replication_lag_ms: String,
    /// Write SVG plots of each policy table (hit rate, TTFT CDF, load per backend),
    /// of each sweep (hit rate against the parameter) or of the edge experiments (SLO
    /// attainment and goodput against load, fairness) into this directory, linked
    /// under the table.
    #[arg(long)]
    pub plots: Option<std::path::PathBuf>,

    /// Backends (engines).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub backends: u32,
    /// KV cache per engine, in blocks (the router's index gets the same capacities).
    #[arg(long, default_value_t = 600)]
    pub cache_blocks: usize,
    /// Canonical prompt bytes per block (16 tokens at 4 bytes per token by default).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(4..))]
    pub block_bytes: u32,
    /// Requests in flight (closed loop).
    #[arg(long, default_value_t = 48, value_parser = clap::value_parser!(u32).range(1..))]
    pub window: u32,
    /// Engine prefill cost per uncached prompt token, µs.
    #[arg(long, default_value_t = 20.0)]
    pub prefill_us_per_token: f64,
    /// Prefills an engine runs at once: 1 is a FIFO queue (queueing shows up in TTFT);
    /// 0 is unlimited, like the gateway's `engine-sim` below its batch limit.
    #[arg(long, default_value_t = 1)]
    pub prefill_slots: usize,
    /// Tokens decoded after the first one...
    #[arg(long, default_value_t = 16)]
    pub decode_tokens: u64,
    /// ...at this many ms each (overlapped across requests).
    #[arg(long, default_value_t = 2.0)]
    pub decode_ms_per_token: f64,
    /// The load count the router sees per backend: `in-flight` (what the gateway
    /// passes today) or `awaiting-first-token` (an experiment: only requests still
    /// queued or in prefill).
    #[arg(long, value_enum, default_value_t = LoadSignalArg::InFlight)]
    pub load_signal: LoadSignalArg,
    /// Do not tell the router each backend's pending prefill tokens (the predicted
    /// uncached tokens of requests without a first token), which the gateway tracks:
    /// the baseline for measuring what that signal is worth.
    #[arg(long)]
    pub no_pending_prefill: bool,
    /// How often the router scrapes each engine's waiting queue (passed to the policy
    /// as `engine_waiting`), ms; 0: never. The gateway's default is 1000.
    #[arg(long, default_value_t = 1000)]
    pub scrape_ms: u64,
    /// multiturn: mean think time between a turn's completion and the next turn, ms
    /// (exponential, from the seed). Without it the sessions run in lockstep and
    /// round-robin or least-loaded can send a session back to the same backend by
    /// accident.
    #[arg(long, default_value_t = 200.0)]
    pub think_ms: f64,
    /// multiturn: do not tell the router the session ids (no session affinity).
    #[arg(long)]
    pub no_session_id: bool,

    #[command(flatten)]
    pub shape: WorkloadFlags,

    /// prefix_aware: PrefixAwareConfig::min_match_blocks (default: the crate's).
    #[arg(long)]
    pub min_match_blocks: Option<u32>,
    /// prefix_aware: PrefixAwareConfig::saturation_inflight.
    #[arg(long)]
    pub saturation_inflight: Option<u32>,
    /// prefix_aware: PrefixAwareConfig::hysteresis.
    #[arg(long)]
    pub hysteresis: Option<f64>,
    /// prefix_aware: PrefixAwareConfig::queue_ns_per_request, in ms.
    #[arg(long)]
    pub queue_ms_per_request: Option<f64>,
    /// prefix_aware: PrefixAwareConfig::tokens_per_block.
    #[arg(long)]
    pub tokens_per_block: Option<f64>,
    /// prefix_aware: price a new prefix at its size now, not at the size prompts
    /// lately reached (PrefixAwareConfig::price_footprint = false, the ablation).
    #[arg(long)]
    pub no_price_footprint: bool,
    /// prefix_aware: count a match whole however much of the engine's cache the
    /// requests in flight hold (PrefixAwareConfig::price_cache_in_use = false, the
    /// ablation).
    #[arg(long)]
    pub no_price_cache_in_use: bool,
    /// prefix_aware: count a new prefix placed lately whether or not prompts still
    /// use it (PrefixAwareConfig::forget_unused_placements = false, the ablation).
    #[arg(long)]
    pub keep_unused_placements: bool,
    /// The router's `routing.index_touch_ms` (the gateway's default): a prompt the
    /// chosen backend holds whole, last used less than this long ago, is not
    /// re-inserted, so its recency in the index lags by up to this much; 0 refreshes
    /// it at every request.
    #[arg(long, default_value_t = RouterConfig::default().index_touch_ms)]
    pub index_touch_ms: u64,
    /// consistent_hash: bounded-load factor (a huge value: plain consistent hashing).
    #[arg(long)]
    pub hash_load_factor: Option<f64>,
}

fn parse_policy(s: &str) -> Result<PolicyName, String> {
    s.parse()
        .map_err(|e: radixgate_orchestrator::UnknownPolicy| e.to_string())
}

impl SimArgs {
    pub fn sim_config(&self) -> SimConfig {
        let backends = self.backends as usize;
        let mut prefix = PrefixAwareConfig::default();
        if let Some(x) = self.min_match_blocks {
            prefix.min_match_blocks = x;
        }
        if let Some(x) = self.saturation_inflight {
            prefix.saturation_inflight = x;
        }
        if let Some(x) = self.hysteresis {
            prefix.hysteresis = x;
        }
        if let Some(x) = self.queue_ms_per_request {
            prefix.queue_ns_per_request = (x * 1e6).round().max(0.0) as u64;
        }
        if let Some(x) = self.tokens_per_block {
            prefix.tokens_per_block = x;
        }
        prefix.price_footprint = !self.no_price_footprint;
        prefix.price_cache_in_use = !self.no_price_cache_in_use;
        prefix.forget_unused_placements = !self.keep_unused_placements;
        prefix.default_prefill_ns_per_token = (self.prefill_us_per_token * 1e3).round() as u32;
        let mut policy = PolicyConfig {
            backend_ids: backend_ids(backends),
            prefix,
            ..PolicyConfig::default()
        };
        if let Some(x) = self.hash_load_factor {
            policy.hash_load_factor = x;
        }
        SimConfig {
            backends,
            cache_blocks: self.cache_blocks,
            block_bytes: NonZeroUsize::new(self.block_bytes as usize).expect("at least 4"),
            window: self.window as usize,
            prefill_ns_per_token: (self.prefill_us_per_token * 1e3).round().max(0.0) as u64,
            prefill_slots: self.prefill_slots,
            decode_ns: (self.decode_tokens as f64 * self.decode_ms_per_token * 1e6)
                .round()
                .max(0.0) as u64,
            scrape_ns: self.scrape_ms.saturating_mul(1_000_000),
            think_ns: (self.think_ms * 1e6).round().max(0.0) as u64,
            session_ids: !self.no_session_id,
            load_signal: match self.load_signal {
                LoadSignalArg::InFlight => LoadSignal::InFlight,
                LoadSignalArg::AwaitingFirstToken => LoadSignal::AwaitingFirstToken,
            },
            pending_prefill: !self.no_pending_prefill,
            policy,
            replicas: self.replicas as usize,
            replication_lag_ns: match self.replication_lag_ms.as_str() {
                "none" => None,
                ms => Some(
                    (ms.parse::<f64>().unwrap_or_else(|_| {
                        panic!(
                            "--replication-lag-ms: a number of milliseconds or `none`, not `{ms}`"
                        )
                    }) * 1e6)
                        .round()
                        .max(0.0) as u64,
                ),
            },
            index_touch_ms: self.index_touch_ms,
            seed: self.seed,
        }
    }

    fn distributions(&self) -> Vec<Distribution> {
        match self.distribution {
            DistributionChoice::Both => vec![Distribution::Uniform, Distribution::Zipf(self.alpha)],
            DistributionChoice::Uniform => vec![Distribution::Uniform],
            DistributionChoice::Zipf => vec![Distribution::Zipf(self.alpha)],
        }
    }

    fn policies(&self) -> Vec<PolicyName> {
        if self.policy.is_empty() {
            PolicyName::ALL.to_vec()
        } else {
            self.policy.clone()
        }
    }
}

/// One labelled batch of runs (a table, or one sweep point).
struct Batch {
    workload: &'static str,
    distribution: String,
    sweep: Option<(&'static str, f64)>,
    title: String,
    runs: Vec<(PolicyName, RunResult)>,
}

/// Plots one policy table; returns the Markdown image links (or the error, so the
/// table still prints).
fn plot_batch(dir: &std::path::Path, b: &Batch, backends: &[String]) -> String {
    let series: Vec<crate::plots::Series> = b
        .runs
        .iter()
        .map(|(p, r)| crate::plots::Series {
            policy: p.as_str().to_string(),
            hit_rate: r.hit_rate(),
            ttft_ms: r.ttft_ns.iter().map(|n| *n as f64 / 1e6).collect(),
            per_backend: backends
                .iter()
                .cloned()
                .zip(r.per_backend.iter().copied())
                .collect(),
        })
        .collect();
    let stem = crate::plots::slug(&format!("{} {}", b.workload, b.distribution));
    let written = crate::plots::write(dir, &stem, &b.title, &series, &crate::plots::Plot::ALL);
    crate::plots::linked(written, &b.title)
}

/// Plots one sweep table: engine hit rate against the swept parameter, a line per
/// policy, as `sweep-<param>-<distribution>-hit-rate.svg`.
fn plot_sweep(
    dir: &std::path::Path,
    title: &str,
    param: &str,
    label: &str,
    policies: &[PolicyName],
    rows: &[Row<'_>],
) -> String {
    let lines: Vec<crate::plots::Line> = policies
        .iter()
        .map(|p| crate::plots::Line {
            label: p.as_str().to_string(),
            points: rows
                .iter()
                .filter(|r| r.policy == *p)
                .filter_map(|r| Some((r.sweep?.1, r.result.hit_rate())))
                .collect(),
        })
        .collect();
    let path = dir.join(format!(
        "{}-hit-rate.svg",
        crate::plots::slug(&format!("sweep {param} {label}"))
    ));
    let written = crate::plots::lines(
        &path,
        &format!("engine hit rate · {title}"),
        param,
        "cached / prompt tokens",
        &lines,
    )
    .map(|()| vec![path]);
    crate::plots::linked(written, title)
}

/// Runs what the flags ask for and renders it (Markdown or JSON).
pub fn run(args: &SimArgs) -> String {
    if args.edge {
        return super::edge::report(args.seed, args.backends as usize, args.plots.as_deref());
    }
    if args.scheduling {
        return super::scheduling::report(args.seed);
    }
    if args.disagg {
        return super::disagg::report(args.seed);
    }
    if args.cluster {
        return super::cluster::report(
            &args.sim_config(),
            &args.shape.docs_config(Distribution::Uniform),
        );
    }
    let base = args.sim_config();
    let policies = args.policies();
    let window = match args.sweep {
        Some(Sweep::Concurrency) => String::new(),
        _ => format!(", window {}", base.window),
    };
    let fleet = format!(
        "{} backends × {} blocks of {} B{window}, seed {}",
        base.backends, base.cache_blocks, base.block_bytes, base.seed
    );
    let mut batches: Vec<Batch> = Vec::new();
    let mut docs_batch = |cfg: &SimConfig, d: Distribution, docs: usize, sweep, title: String| {
        let spec = WorkloadSpec::Docs(DocsConfig {
            docs,
            ..args.shape.docs_config(d)
        });
        batches.push(Batch {
            workload: "docs",
            distribution: spec.distribution_label(),
            sweep,
            title,
            runs: run_policies(cfg, &spec, &policies),
        });
    };
    match args.sweep {
        None => {
            if args.workload != WorkloadChoice::Multiturn {
                for d in args.distributions() {
                    let title = format!(
                        "docs · {} ({} docs of {} B, {} requests; {fleet})",
                        d.label(),
                        args.shape.docs,
                        args.shape.doc_bytes,
                        args.shape.requests
                    );
                    docs_batch(&base, d, args.shape.docs as usize, None, title);
                }
            }
            if args.workload != WorkloadChoice::Docs {
                let spec = WorkloadSpec::Multiturn(args.shape.multiturn_config());
                batches.push(Batch {
                    workload: "multiturn",
                    distribution: spec.distribution_label(),
                    sweep: None,
                    title: format!(
                        "multiturn ({} sessions × {} turns, tool calls p={}; {fleet})",
                        args.shape.sessions, args.shape.turns, args.shape.tool_prob
                    ),
                    runs: run_policies(&base, &spec, &policies),
                });
            }
        }
        Some(Sweep::Docs) => {
            for d in args.distributions() {
                for n in SWEEP_DOCS {
                    docs_batch(&base, d, n, Some(("docs", n as f64)), String::new());
                }
            }
        }
        Some(Sweep::Alpha) => {
            for a in SWEEP_ALPHA {
                let d = Distribution::Zipf(a);
                docs_batch(
                    &base,
                    d,
                    args.shape.docs as usize,
                    Some(("alpha", a)),
                    String::new(),
                );
            }
        }
        Some(Sweep::Concurrency) => {
            for d in args.distributions() {
                for w in SWEEP_WINDOW {
                    let cfg = SimConfig {
                        window: w,
                        ..base.clone()
                    };
                    docs_batch(
                        &cfg,
                        d,
                        args.shape.docs as usize,
                        Some(("window", w as f64)),
                        String::new(),
                    );
                }
            }
        }
    }

    fn rows_of(b: &Batch) -> Vec<Row<'_>> {
        b.runs
            .iter()
            .map(|(p, r)| Row {
                workload: b.workload,
                distribution: b.distribution.clone(),
                sweep: b.sweep,
                policy: *p,
                result: r,
            })
            .collect()
    }
    if args.json {
        let rows: Vec<Row<'_>> = batches.iter().flat_map(rows_of).collect();
        return report::json_array(&rows);
    }
    let mut out = String::new();
    match args.sweep {
        None => {
            for b in &batches {
                out.push_str(&report::policy_table(&b.title, &rows_of(b)));
                if let Some(dir) = &args.plots {
                    out.push_str(&plot_batch(dir, b, &backend_ids(base.backends)));
                }
                out.push('\n');
            }
        }
        Some(sweep) => {
            let param = match sweep {
                Sweep::Docs => "docs",
                Sweep::Alpha => "alpha",
                Sweep::Concurrency => "window",
            };
            // One table per distribution, in first-seen order.
            let mut labels: Vec<String> = Vec::new();
            for b in &batches {
                let label = if sweep == Sweep::Alpha {
                    "zipf(α)".to_string()
                } else {
                    b.distribution.clone()
                };
                if !labels.contains(&label) {
                    labels.push(label);
                }
            }
            for label in labels {
                let rows: Vec<Row<'_>> = batches
                    .iter()
                    .filter(|b| sweep == Sweep::Alpha || b.distribution == label)
                    .flat_map(rows_of)
                    .collect();
                let mut title = String::new();
                let _ = write!(title, "sweep over {param} · docs · {label} ({fleet})");
                out.push_str(&report::sweep_table(&title, param, &policies, &rows));
                if let Some(dir) = &args.plots {
                    out.push_str(&plot_sweep(dir, &title, param, &label, &policies, &rows));
                }
                out.push('\n');
            }
        }
    }
    out
}
