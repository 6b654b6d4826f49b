//! `real`: the real-engine benchmark. Starts K vLLM (CPU) engines with
//! `deploy/vllm/fleet.sh` (install, offline model, loopback, prefix caching), puts the
//! radixgate binary in front of them, and for each workload × concurrency × policy runs
//! a closed-loop [`load`](crate::load) run with fresh content (its own seed, so no run
//! warms another's cache). Per run it reports TTFT (mean, p50/p95/p99), goodput (the
//! share of requests whose TTFT met `slo_ms`; failed and refused requests miss), the
//! engines' own prefix-cache hit rate from `/metrics` deltas
//! (`vllm:prefix_cache_hits_total` over `vllm:prefix_cache_queries_total`, summed over
//! engines), the [`ceiling`](crate::ceiling) an oracle with the fleet's KV capacity
//! would reach on the same requests, and the engine-reported `cached_tokens` share.
//!
//! The fleet can be made to look like production: `kv_blocks` caps every engine's
//! KV cache (`--num-gpu-blocks-override`) below the working set, `engine_args` go to
//! every engine, and `engine_cores` / `engine_args_for` make engines unequal (shared
//! cores, fewer sequences).
//!
//! Policies are switched per request with `X-Router-Policy` on one gateway per
//! hashing mode, so every policy runs against the same engines in the same process
//! state. Engines and gateway are stopped by PID when the run ends, also on error.

// A benchmark driver, not a shard: blocking waits are what it is for.
#![allow(clippy::disallowed_methods)]

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::http::Target;
use crate::load::{self, LoadConfig};
use crate::report::Stats;
use crate::workload::{Kind, Workload, WorkloadConfig};

#[derive(Clone, Debug)]
pub struct RealConfig {
    /// The repository root (where `deploy/vllm/fleet.sh` is).
    pub repo: PathBuf,
    /// The `radixgate` binary to put in front of the engines.
    pub gateway_bin: PathBuf,
    pub engines: usize,
    /// `tiny` or `small` (deploy/vllm/make_model.py).
    pub model: String,
    pub workloads: Vec<Kind>,
    pub concurrency: Vec<usize>,
    pub policies: Vec<String>,
    /// Requests per run.
    pub requests: u64,
    /// docs: documents, bytes each, questions each.
    pub docs: usize,
    pub doc_bytes: usize,
    pub questions: usize,
    /// multiturn: conversations side by side and turns before one starts over.
    pub conversations: usize,
    pub turns: usize,
    pub max_tokens: u32,
    /// The gateway's `routing.bytes_per_token` for this model's tokenizer.
    pub bytes_per_token: f64,
    /// First port of the engines (each engine also uses port + 100).
    pub base_port: u16,
    pub seed: u64,
    /// Every engine's KV cache in blocks (`--num-gpu-blocks-override`); `None`: as
    /// much as `VLLM_CPU_KVCACHE_SPACE` gives.
    pub kv_blocks: Option<u32>,
    /// More arguments for every engine.
    pub engine_args: Vec<String>,
    /// More arguments for one engine: (engine index, arguments).
    pub engine_args_for: Vec<(usize, String)>,
    /// Engine i is pinned to entry i (a core or a range such as `0-1`); empty: core
    /// i mod the host's CPUs.
    pub engine_cores: Vec<String>,
    /// The TTFT objective for goodput, in milliseconds.
    pub slo_ms: u64,
    /// The engines' KV block in tokens, for the ceiling (vLLM's CPU backend: 128).
    pub block_tokens: usize,
    /// The gateway's `retry.first_token_timeout_ms` for every policy (0: off).
    pub first_token_timeout_ms: u64,
    /// The gateway's `retry.first_token_timeout_factor` for every policy.
    pub first_token_timeout_factor: f64,
}

impl RealConfig {
    /// Engine i's cores: its entry of `engine_cores`, or core i mod the host's CPUs.
    fn engine_core(&self, i: usize) -> String {
        match self.engine_cores.len() {
            0 => {
                let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
                (i % cpus).to_string()
            }
            n => self.engine_cores[i % n].clone(),
        }
    }

    /// Every engine's cores, in engine order (what fleet.sh pins them to).
    fn cores(&self) -> Vec<String> {
        (0..self.engines).map(|i| self.engine_core(i)).collect()
    }
}

/// The policy name that selects the precise-mode gateway.
pub const PRECISE: &str = "prefix_aware_precise";
/// The policy name that selects prefix_aware on a gateway that does not use learned
/// queue costs (`routing.prefix_aware.learn_queue_cost = false`): an ablation.
pub const FIXED_QUEUE: &str = "prefix_aware_fixed_queue";
/// The policy name that selects prefix_aware on a gateway that does not price
/// eviction (`routing.prefix_aware.eviction_weight = 0`): an ablation.
pub const NO_EVICTION: &str = "prefix_aware_no_eviction";
/// The policy name that selects prefix_aware on a gateway that places a new prefix on
/// the shortest wait, not the most free room within a request of it
/// (`routing.prefix_aware.new_prefix_slack_requests = 0`): an ablation.
pub const WAIT_FIRST: &str = "prefix_aware_wait_first";
/// The policy name that selects prefix_aware on a gateway that learns each backend's
/// prefill cost as a rate per token alone, with no fixed delay
/// (`routing.prefix_aware.learn_fixed_delay = false`): an ablation.
pub const NO_FIXED_DELAY: &str = "prefix_aware_no_fixed_delay";
/// The policy name that selects prefix_aware on a gateway that counts only truly free
/// blocks as cache room, not blocks unused for a minute
/// (`routing.prefix_aware.room_stale_after_ms = 0`): an ablation.
pub const FREE_ROOM_ONLY: &str = "prefix_aware_free_room_only";
/// The policy name that selects prefix_aware on a gateway that places a new prefix by
/// cache room alone, not first on the backend given the fewest new prefixes lately
/// (`routing.prefix_aware.spread_new_prefixes = false`): an ablation.
pub const ROOM_FIRST: &str = "prefix_aware_room_first";
/// The policy name that selects prefix_aware on a gateway that prices a new prefix
/// at its size now, not at the size the large prompts lately reached
/// (`routing.prefix_aware.price_footprint = false`): an ablation.
pub const NO_FOOTPRINT: &str = "prefix_aware_no_footprint";
/// The policy name that selects prefix_aware on a gateway that is not told which
/// engines share a core (no `backends[].compute_group`): an ablation.
pub const NO_SHARED_COMPUTE: &str = "prefix_aware_no_shared_compute";
/// The policy name that selects prefix_aware on a gateway that counts a match whole
/// however much of the engine's cache the requests in flight hold
/// (`routing.prefix_aware.price_cache_in_use = false`): an ablation.
pub const NO_CACHE_IN_USE: &str = "prefix_aware_no_cache_in_use";
/// The policy name that selects prefix_aware on a gateway that counts a new prefix
/// placed lately whether or not prompts still use it
/// (`routing.prefix_aware.forget_unused_placements = false`): an ablation.
pub const KEEP_UNUSED_PLACEMENTS: &str = "prefix_aware_keep_unused_placements";

/// How a gateway in front of the fleet is configured.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Variant {
    Bytes,
    /// Precise mode: the model's tokenizer and chat template, 128-token blocks, the
    /// engines' KV events.
    Precise,
    /// Bytes mode with the fixed per-request queue cost.
    FixedQueue,
    /// Bytes mode with eviction free.
    NoEviction,
    /// Bytes mode with new prefixes placed on the shortest wait.
    WaitFirst,
    /// Bytes mode with the prefill cost learned as a rate alone.
    NoFixedDelay,
    /// Bytes mode with only truly free blocks as cache room.
    FreeRoomOnly,
    /// Bytes mode with new prefixes placed by room alone.
    RoomFirst,
    /// Bytes mode with a new prefix priced at its size now.
    NoFootprint,
    /// Bytes mode without the engines' compute groups.
    NoSharedCompute,
    /// Bytes mode with a match counted whole however busy its engine's cache.
    NoCacheInUse,
    KeepUnusedPlacements,
}

impl Variant {
    /// The gateway a policy name runs on, and the `X-Router-Policy` it sends.
    fn of(policy: &str) -> (Variant, &str) {
        match policy {
            PRECISE => (Variant::Precise, "prefix_aware"),
            FIXED_QUEUE => (Variant::FixedQueue, "prefix_aware"),
            NO_EVICTION => (Variant::NoEviction, "prefix_aware"),
            WAIT_FIRST => (Variant::WaitFirst, "prefix_aware"),
            NO_FIXED_DELAY => (Variant::NoFixedDelay, "prefix_aware"),
            FREE_ROOM_ONLY => (Variant::FreeRoomOnly, "prefix_aware"),
            ROOM_FIRST => (Variant::RoomFirst, "prefix_aware"),
            NO_FOOTPRINT => (Variant::NoFootprint, "prefix_aware"),
            NO_SHARED_COMPUTE => (Variant::NoSharedCompute, "prefix_aware"),
            NO_CACHE_IN_USE => (Variant::NoCacheInUse, "prefix_aware"),
            KEEP_UNUSED_PLACEMENTS => (Variant::KeepUnusedPlacements, "prefix_aware"),
            other => (Variant::Bytes, other),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Variant::Bytes => "bytes",
            Variant::Precise => "precise",
            Variant::FixedQueue => "fixed-queue",
            Variant::NoEviction => "no-eviction",
            Variant::WaitFirst => "wait-first",
            Variant::NoFixedDelay => "no-fixed-delay",
            Variant::FreeRoomOnly => "free-room-only",
            Variant::RoomFirst => "room-first",
            Variant::NoFootprint => "no-footprint",
            Variant::NoSharedCompute => "no-shared-compute",
            Variant::NoCacheInUse => "no-cache-in-use",
            Variant::KeepUnusedPlacements => "keep-unused-placements",
        }
    }
}

/// One measured run.
pub struct Row {
    pub workload: &'static str,
    pub concurrency: usize,
    pub policy: String,
    pub stats: Stats,
    /// Engine prefix-cache hit rate over the run, from `/metrics` deltas.
    pub engine_hit_rate: Option<f64>,
    /// Requests the engines preempted during the run (`vllm:num_preemptions_total`
    /// deltas): a running request lost its KV blocks to another and is recomputed,
    /// the sign of more prompts on one engine than its KV cache holds at once.
    pub preemptions: Option<u64>,
    /// The engines' own mean TTFT over the run (`vllm:time_to_first_token_seconds`
    /// deltas, from the request's arrival at the engine), in ms: the client's mean
    /// less this is what the gateway, the engine's HTTP front end and loopback add.
    pub engine_ttft_ms: Option<f64>,
    /// The oracle's hit rate on the same requests with the fleet's capacity.
    pub ceiling_hit_rate: f64,
    /// Share of the requests sent whose TTFT met the SLO (failures miss).
    pub goodput: f64,
    pub elapsed: Duration,
    /// Every request of the run, in the order sent.
    pub traces: Vec<crate::load::Trace>,
}

impl Row {
    /// Share of `sent` requests answered with a first byte within `slo_ms`.
    fn goodput_of(stats: &Stats, slo_ms: u64) -> f64 {
        let sent = stats.ok + stats.failed();
        match sent {
            0 => 0.0,
            n => stats.ttft.count_between(0, slo_ms * 1000) as f64 / n as f64,
        }
    }
}

/// Writes each run's per-request traces into `dir` as
/// `<stem>-<workload>-c<conc>-<policy>.csv` ([`crate::tail::to_csv`]).
pub fn write_traces(rows: &[Row], dir: &std::path::Path, stem: &str) -> std::io::Result<()> {
    for r in rows {
        let name = crate::plots::slug(&format!(
            "{stem} {} c{} {}",
            r.workload, r.concurrency, r.policy
        ));
        std::fs::write(
            dir.join(format!("{name}.csv")),
            crate::tail::to_csv(&r.traces),
        )?;
    }
    Ok(())
}

/// Writes the plots of each (workload, concurrency) group into `dir` as
/// `<stem>-<workload>-c<conc>-{hit-rate,ttft,load}.svg`; returns Markdown links.
pub fn write_plots(rows: &[Row], dir: &std::path::Path, stem: &str) -> std::io::Result<String> {
    let mut groups: Vec<(&str, usize)> = rows.iter().map(|r| (r.workload, r.concurrency)).collect();
    groups.dedup();
    let mut out = String::new();
    for (w, c) in groups {
        let series: Vec<crate::plots::Series> = rows
            .iter()
            .filter(|r| r.workload == w && r.concurrency == c)
            .map(|r| crate::plots::Series::from_stats(&r.policy, &r.stats, r.engine_hit_rate))
            .collect();
        let paths = crate::plots::write(
            dir,
            &crate::plots::slug(&format!("{stem} {w} c{c}")),
            &format!("{w}, concurrency {c}"),
            &series,
            &crate::plots::Plot::ALL,
        )?;
        out.push_str(&crate::plots::links(&paths));
    }
    Ok(out)
}

/// Runs every combination and returns the rows in order; `progress` gets a line
/// per finished run.
pub fn run(cfg: &RealConfig, mut progress: impl FnMut(&str)) -> Result<Vec<Row>, String> {
    let fleet = Fleet::start(cfg)?;
    progress(&format!(
        "{} engines ready: {}",
        fleet.engines.len(),
        fleet
            .engines
            .iter()
            .map(|(id, a, _)| format!("{id}={a}"))
            .collect::<Vec<_>>()
            .join(" ")
    ));
    let capacity = fleet.capacity_blocks();
    progress(&format!(
        "fleet KV capacity: {}",
        capacity.map_or(
            "unknown (the ceiling assumes no bound)".into(),
            |c| format!("{c} blocks of {} tokens", cfg.block_tokens)
        )
    ));
    if cfg.first_token_timeout_ms > 0 {
        progress(&format!(
            "every policy's gateway moves a stream with no token after {} ms, or {} times its estimated TTFT when longer (retry.first_token_timeout_ms, _factor)",
            cfg.first_token_timeout_ms, cfg.first_token_timeout_factor
        ));
    }
    let block_bytes = (cfg.block_tokens as f64 * cfg.bytes_per_token).round() as usize;
    // One gateway per variant the policies need, each over the same engines.
    let mut gateways: Vec<(Variant, Gateway, Target)> = Vec::new();
    for policy in &cfg.policies {
        let (variant, _) = Variant::of(policy);
        if gateways.iter().all(|(v, _, _)| *v != variant) {
            let gateway = Gateway::start(cfg, &fleet, variant)?;
            let target = Target::parse(&format!("http://{}/v1/chat/completions", gateway.addr))?;
            gateways.push((variant, gateway, target));
        }
    }
    let mut rows = Vec::new();
    let mut run_seed = cfg.seed.wrapping_mul(1000);
    for &kind in &cfg.workloads {
        for &concurrency in &cfg.concurrency {
            for policy in &cfg.policies {
                run_seed += 1;
                let workload = Workload::new(WorkloadConfig {
                    kind,
                    model: cfg.model.clone(),
                    max_tokens: cfg.max_tokens,
                    stream: true,
                    ignore_eos: true,
                    seed: run_seed,
                    body_bytes: 0,
                    docs: cfg.docs,
                    doc_bytes: cfg.doc_bytes,
                    questions: cfg.questions,
                    conversations: cfg.conversations,
                    turns: cfg.turns,
                });
                let (variant, header) = Variant::of(policy);
                let (gateway, target) = gateways
                    .iter()
                    .find(|(v, _, _)| *v == variant)
                    .map(|(_, g, t)| (g.addr, t.clone()))
                    .expect("a gateway per variant");
                if header == "prefix_aware" {
                    if let Some(line) = learned_costs(gateway) {
                        progress(&format!("  learned before the run: {line}"));
                    }
                }
                let load_cfg = LoadConfig {
                    target,
                    concurrency,
                    requests: Some(cfg.requests),
                    duration: None,
                    headers: vec![("X-Router-Policy".into(), header.to_string())],
                    timeout: Duration::from_secs(300),
                    rate: None,
                    seed: 1,
                    trace: true,
                };
                let before = fleet.counters();
                let result = load::run(&load_cfg, &workload).map_err(|e| e.to_string())?;
                let after = fleet.counters();
                let engine_hit_rate = match (before, after) {
                    (Some(b), Some(a)) if a.queries > b.queries => {
                        Some((a.hits - b.hits) / (a.queries - b.queries))
                    }
                    _ => None,
                };
                let preemptions = match (before, after) {
                    (Some(b), Some(a)) => Some((a.preemptions - b.preemptions).max(0.0) as u64),
                    _ => None,
                };
                let engine_ttft_ms = match (before, after) {
                    (Some(b), Some(a)) if a.ttft_count > b.ttft_count => {
                        Some(1e3 * (a.ttft_sum - b.ttft_sum) / (a.ttft_count - b.ttft_count))
                    }
                    _ => None,
                };
                let ceiling_hit_rate =
                    crate::ceiling::hit_rate(&workload, cfg.requests, block_bytes, capacity);
                let row = Row {
                    workload: kind.name(),
                    concurrency,
                    policy: policy.clone(),
                    goodput: Row::goodput_of(&result.stats, cfg.slo_ms),
                    stats: result.stats,
                    engine_hit_rate,
                    preemptions,
                    engine_ttft_ms,
                    ceiling_hit_rate,
                    elapsed: result.elapsed,
                    traces: result.traces,
                };
                progress(&row_line(&row));
                progress(&format!("  {}", crate::tail::summary(&row.traces)));
                rows.push(row);
            }
        }
    }
    Ok(rows)
}

fn row_line(r: &Row) -> String {
    format!(
        "{} c={} {}: {} ok, {} failed, TTFT mean {:.0} ms (engine {}) p95 {:.0} ms p99 {:.0} ms, goodput {:.1}%, engine hit {} of ceiling {:.1}%, cached {}, preemptions {} ({:.1} s)",
        r.workload,
        r.concurrency,
        r.policy,
        r.stats.ok,
        r.stats.failed(),
        r.stats.ttft.mean() / 1e3,
        ms(r.engine_ttft_ms),
        r.stats.ttft.value_at_quantile(0.95) as f64 / 1e3,
        r.stats.ttft.value_at_quantile(0.99) as f64 / 1e3,
        100.0 * r.goodput,
        pct(r.engine_hit_rate),
        100.0 * r.ceiling_hit_rate,
        pct(r.stats.cached_share()),
        count(r.preemptions),
        r.elapsed.as_secs_f64()
    )
}

fn count(v: Option<u64>) -> String {
    v.map_or("n/a".into(), |n| n.to_string())
}

fn ms(v: Option<f64>) -> String {
    v.map_or("n/a".into(), |x| format!("{x:.0} ms"))
}

fn pct(v: Option<f64>) -> String {
    v.map_or("n/a".into(), |x| format!("{:.1}%", 100.0 * x))
}

/// The results as Markdown: one table per workload, with mean TTFT against
/// round_robin at the same concurrency, goodput at `slo_ms`, and the engine hit rate
/// beside the ceiling.
pub fn to_markdown(rows: &[Row], slo_ms: u64) -> String {
    let mut out = String::new();
    let mut workloads: Vec<&str> = rows.iter().map(|r| r.workload).collect();
    workloads.dedup();
    for w in workloads {
        let _ = writeln!(out, "\n### {w}\n");
        let _ = writeln!(
            out,
            "| conc | policy | ok | failed | TTFT mean ms | vs round_robin | engine's own TTFT mean ms | p50 | p95 | p99 | goodput (TTFT ≤ {slo_ms} ms) | engine hit rate | ceiling | cached_tokens share | preemptions |"
        );
        out.push_str(
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        );
        for r in rows.iter().filter(|r| r.workload == w) {
            let baseline = rows.iter().find(|b| {
                b.workload == w && b.concurrency == r.concurrency && b.policy == "round_robin"
            });
            let mean = r.stats.ttft.mean() / 1e3;
            let vs = baseline
                .map(|b| b.stats.ttft.mean() / 1e3)
                .filter(|&b| b > 0.0)
                .map_or("".into(), |b| format!("{:+.0}%", 100.0 * (mean / b - 1.0)));
            let q = |p: f64| r.stats.ttft.value_at_quantile(p) as f64 / 1e3;
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {:.0} | {} | {} | {:.0} | {:.0} | {:.0} | {:.1}% | {} | {:.1}% | {} | {} |",
                r.concurrency,
                r.policy,
                r.stats.ok,
                r.stats.failed(),
                mean,
                vs,
                r.engine_ttft_ms.map_or("n/a".into(), |x| format!("{x:.0}")),
                q(0.50),
                q(0.95),
                q(0.99),
                100.0 * r.goodput,
                pct(r.engine_hit_rate),
                100.0 * r.ceiling_hit_rate,
                pct(r.stats.cached_share()),
                count(r.preemptions),
            );
        }
    }
    out
}

/// Prefix-cache and preemption counters, as vLLM exports them.
#[derive(Clone, Copy, Default)]
struct EngineCounters {
    hits: f64,
    queries: f64,
    preemptions: f64,
    /// `vllm:time_to_first_token_seconds` histogram's sum (s) and count.
    ttft_sum: f64,
    ttft_count: f64,
}

/// The engines, stopped by `fleet.sh stop` (SIGTERM by PID) on drop.
struct Fleet {
    script: PathBuf,
    state: PathBuf,
    /// `(id, address, KV-event endpoint)` per engine.
    engines: Vec<(String, SocketAddr, String)>,
}

impl Fleet {
    fn start(cfg: &RealConfig) -> Result<Fleet, String> {
        let script = cfg.repo.join("deploy/vllm/fleet.sh");
        let state =
            std::env::temp_dir().join(format!("radixgate-bench-real-{}", std::process::id()));
        let mut fleet = Fleet {
            script,
            state,
            engines: Vec::new(),
        };
        let mut command = Command::new(&fleet.script);
        command
            .arg("start")
            .arg(&fleet.state)
            .args([
                cfg.engines.to_string(),
                cfg.base_port.to_string(),
                cfg.model.clone(),
                "--".into(),
            ])
            .args(engine_args(cfg))
            .env("RADIXGATE_VLLM_CORES", cfg.cores().join(" "));
        for (i, args) in &cfg.engine_args_for {
            command.env(format!("RADIXGATE_VLLM_ENGINE_ARGS_{i}"), args);
        }
        let out = command
            .stderr(Stdio::inherit())
            .output()
            .map_err(|e| format!("cannot run {}: {e}", fleet.script.display()))?;
        if !out.status.success() {
            return Err("deploy/vllm/fleet.sh start failed (see above)".into());
        }
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let mut parts = line.split_whitespace();
            if let (Some(id), Some(addr), Some(events)) = (parts.next(), parts.next(), parts.next())
            {
                let addr = addr
                    .parse()
                    .map_err(|e| format!("bad engine address {addr}: {e}"))?;
                fleet
                    .engines
                    .push((id.to_string(), addr, events.to_string()));
            }
        }
        if fleet.engines.len() != cfg.engines {
            return Err(format!(
                "fleet.sh started {} engines, not {}",
                fleet.engines.len(),
                cfg.engines
            ));
        }
        Ok(fleet)
    }

    /// The engines' KV blocks summed, from `vllm:cache_config_info`'s
    /// `num_gpu_blocks` label (what the engine settled on, override included).
    fn capacity_blocks(&self) -> Option<usize> {
        let mut sum = 0;
        for (_, addr, _) in &self.engines {
            let text = http_get(*addr, "/metrics").ok()?;
            sum += label_value(&text, "vllm:cache_config_info", "num_gpu_blocks")?
                .parse::<usize>()
                .ok()?;
        }
        Some(sum)
    }

    /// Sum over engines of (prefix-cache hits, queries), in tokens.
    /// The engines' counters summed over the fleet (`None` when one cannot be read).
    fn counters(&self) -> Option<EngineCounters> {
        let mut sum = EngineCounters::default();
        for (_, addr, _) in &self.engines {
            let text = http_get(*addr, "/metrics").ok()?;
            sum.hits += counter(&text, "vllm:prefix_cache_hits_total")?;
            sum.queries += counter(&text, "vllm:prefix_cache_queries_total")?;
            sum.preemptions += counter(&text, "vllm:num_preemptions_total")?;
            // Without the histogram the column reads n/a; the hit rate stays.
            sum.ttft_sum += counter(&text, "vllm:time_to_first_token_seconds_sum").unwrap_or(0.0);
            sum.ttft_count +=
                counter(&text, "vllm:time_to_first_token_seconds_count").unwrap_or(0.0);
        }
        Some(sum)
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        let _ = Command::new(&self.script)
            .arg("stop")
            .arg(&self.state)
            .status();
        let _ = std::fs::remove_dir_all(&self.state);
    }
}

/// The radixgate binary in front of the fleet, killed by PID on drop.
struct Gateway {
    child: Child,
    addr: SocketAddr,
    config: PathBuf,
}

impl Gateway {
    /// The radixgate binary over the fleet, configured as `variant` says.
    fn start(cfg: &RealConfig, fleet: &Fleet, variant: Variant) -> Result<Gateway, String> {
        let precise = variant == Variant::Precise;
        let addr = free_addr()?;
        let mut toml = format!(
            "[server]\nlisten = \"{addr}\"\nshards = 1\n\n[routing]\npolicy = \"prefix_aware\"\n\
             allow_policy_header = true\nbytes_per_token = {}\n",
            cfg.bytes_per_token
        );
        if precise {
            let cache = std::env::var("RADIXGATE_CACHE").unwrap_or_else(|_| {
                format!(
                    "{}/.cache/radixgate",
                    std::env::var("HOME").unwrap_or_default()
                )
            });
            let _ = write!(
                toml,
                "hashing = \"precise\"\ntokenizer = \"{cache}/models/{}/tokenizer.json\"\n\
                 block_tokens = 128\n",
                cfg.model
            );
        }
        match variant {
            Variant::FixedQueue => {
                toml.push_str("\n[routing.prefix_aware]\nlearn_queue_cost = false\n")
            }
            Variant::NoEviction => {
                toml.push_str("\n[routing.prefix_aware]\neviction_weight = 0.0\n")
            }
            Variant::WaitFirst => {
                toml.push_str("\n[routing.prefix_aware]\nnew_prefix_slack_requests = 0\n")
            }
            Variant::NoFixedDelay => {
                toml.push_str("\n[routing.prefix_aware]\nlearn_fixed_delay = false\n")
            }
            Variant::FreeRoomOnly => {
                toml.push_str("\n[routing.prefix_aware]\nroom_stale_after_ms = 0\n")
            }
            Variant::RoomFirst => {
                toml.push_str("\n[routing.prefix_aware]\nspread_new_prefixes = false\n")
            }
            Variant::NoFootprint => {
                toml.push_str("\n[routing.prefix_aware]\nprice_footprint = false\n")
            }
            Variant::NoCacheInUse => {
                toml.push_str("\n[routing.prefix_aware]\nprice_cache_in_use = false\n")
            }
            Variant::KeepUnusedPlacements => {
                toml.push_str("\n[routing.prefix_aware]\nforget_unused_placements = false\n")
            }
            Variant::Bytes | Variant::Precise | Variant::NoSharedCompute => {}
        }
        toml.push_str(
            "\n[upstream]\nfirst_byte_timeout_ms = 300000\n\n[health]\nscrape_interval_ms = 500\n\n[log]\naccess = false\n",
        );
        let _ = write!(
            toml,
            "\n[retry]\nfirst_token_timeout_ms = {}\nfirst_token_timeout_factor = {:?}\n",
            cfg.first_token_timeout_ms, cfg.first_token_timeout_factor
        );
        for (i, (id, engine, events)) in fleet.engines.iter().enumerate() {
            let _ = write!(
                toml,
                "\n[[backends]]\nid = \"{id}\"\nurl = \"http://{engine}\"\nmodels = [\"{}\"]\n",
                cfg.model
            );
            // Engines pinned to the same cores slow each other down: say so.
            if variant != Variant::NoSharedCompute {
                let _ = writeln!(toml, "compute_group = \"cores-{}\"", cfg.engine_core(i));
            }
            if precise {
                let _ = writeln!(toml, "kv_events = \"{events}\"");
            }
        }
        let config = std::env::temp_dir().join(format!(
            "radixgate-bench-real-{}-{}.toml",
            std::process::id(),
            variant.name()
        ));
        std::fs::write(&config, toml)
            .map_err(|e| format!("cannot write {}: {e}", config.display()))?;
        let child = Command::new(&cfg.gateway_bin)
            .arg("serve")
            .arg("--config")
            .arg(&config)
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", cfg.gateway_bin.display()))?;
        let gateway = Gateway {
            child,
            addr,
            config,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while http_get(addr, "/v1/models").is_err() {
            if Instant::now() > deadline {
                return Err("the gateway did not answer /v1/models within 20 s".into());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(gateway)
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.config);
    }
}

fn free_addr() -> Result<SocketAddr, String> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    l.local_addr().map_err(|e| e.to_string())
}

/// A one-shot `GET` (Connection: close); the body if the status is 200.
fn http_get(addr: SocketAddr, path: &str) -> Result<String, String> {
    let mut s =
        TcpStream::connect_timeout(&addr, Duration::from_secs(2)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|e| e.to_string())?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| e.to_string())?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&buf);
    let (head, body) = text.split_once("\r\n\r\n").ok_or("no response head")?;
    if !head.starts_with("HTTP/1.1 200") {
        return Err(head.lines().next().unwrap_or("").to_string());
    }
    Ok(body.to_string())
}

/// Every engine's arguments: `--num-gpu-blocks-override` for `kv_blocks`, then
/// `engine_args`.
fn engine_args(cfg: &RealConfig) -> Vec<String> {
    let mut args = Vec::new();
    if let Some(n) = cfg.kv_blocks {
        args.extend(["--num-gpu-blocks-override".to_string(), n.to_string()]);
    }
    args.extend(cfg.engine_args.iter().cloned());
    args
}

/// The costs a gateway has learned per backend (`radixgate_backend_prefill_fixed_ns`,
/// `_prefill_ns_per_token` and `_queue_ns_per_request`), as `id fixed ms + prefill
/// ms/token, queue ms/request` per backend: what steers the first placements of the
/// next run. `None` when the metrics cannot be read.
fn learned_costs(gateway: SocketAddr) -> Option<String> {
    learned_costs_in(&http_get(gateway, "/metrics").ok()?)
}

/// [`learned_costs`] from a gateway's `/metrics` text.
fn learned_costs_in(text: &str) -> Option<String> {
    let per_backend = |metric: &str| -> Vec<(String, f64)> {
        text.lines()
            .filter(|l| l.strip_prefix(metric).is_some_and(|r| r.starts_with('{')))
            .filter_map(|l| {
                let id = label_value(l, metric, "backend")?.to_string();
                let value = l.rsplit(' ').next()?.parse().ok()?;
                Some((id, value))
            })
            .collect()
    };
    let prefill = per_backend("radixgate_backend_prefill_ns_per_token");
    let fixed = per_backend("radixgate_backend_prefill_fixed_ns");
    let queue = per_backend("radixgate_backend_queue_ns_per_request");
    let of = |values: &[(String, f64)], id: &str| {
        values
            .iter()
            .find(|(i, _)| i == id)
            .map_or(0.0, |(_, v)| *v)
    };
    let parts: Vec<String> = prefill
        .iter()
        .map(|(id, p)| {
            let (f, q) = (of(&fixed, id), of(&queue, id));
            format!(
                "{id} {:.0} ms + {:.3} ms/token, {:.0} ms/request",
                f / 1e6,
                p / 1e6,
                q / 1e6
            )
        })
        .collect();
    (!parts.is_empty()).then(|| parts.join("; "))
}

/// The value of label `label` on the first sample of `metric`.
fn label_value<'a>(text: &'a str, metric: &str, label: &str) -> Option<&'a str> {
    let line = text
        .lines()
        .find(|l| l.strip_prefix(metric).is_some_and(|r| r.starts_with('{')))?;
    let needle = format!("{label}=\"");
    let start = line.find(&needle)? + needle.len();
    let len = line[start..].find('"')?;
    Some(&line[start..start + len])
}

/// The sum of a Prometheus counter's samples (all label sets).
fn counter(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix(name) {
            if rest.starts_with('{') || rest.starts_with(' ') {
                let value = rest.rsplit(' ').next()?.parse::<f64>().ok()?;
                *found.get_or_insert(0.0) += value;
            }
        }
    }
    found
}

/// The repository root: `RADIXGATE_REPO`, else the nearest ancestor of the current
/// directory with `deploy/vllm/fleet.sh`.
pub fn find_repo() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("RADIXGATE_REPO") {
        return Some(PathBuf::from(p));
    }
    let cwd = std::env::current_dir().ok()?;
    cwd.ancestors()
        .find(|p| p.join("deploy/vllm/fleet.sh").is_file())
        .map(Path::to_path_buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn learned_costs_join_each_backends_gauges() {
        let text = "# TYPE radixgate_backend_prefill_ns_per_token gauge\n\
            radixgate_backend_prefill_ns_per_token{backend=\"vllm-0\"} 450000\n\
            radixgate_backend_prefill_ns_per_token{backend=\"vllm-1\"} 0\n\
            radixgate_backend_queue_ns_per_request{backend=\"vllm-1\"} 210000000\n\
            radixgate_backend_queue_ns_per_request{backend=\"vllm-0\"} 90000000\n\
            radixgate_backend_prefill_fixed_ns{backend=\"vllm-0\"} 1000000000\n";
        assert_eq!(
            learned_costs_in(text).as_deref(),
            Some(
                "vllm-0 1000 ms + 0.450 ms/token, 90 ms/request; \
                 vllm-1 0 ms + 0.000 ms/token, 210 ms/request"
            )
        );
        assert_eq!(learned_costs_in("radixgate_up 1\n"), None);
    }

    #[test]
    fn counter_sums_label_sets_and_skips_lookalikes() {
        let text = "# HELP x\nvllm:prefix_cache_hits_total{engine=\"0\"} 10.0\n\
                    vllm:prefix_cache_hits_total{engine=\"1\"} 5.5\n\
                    vllm:prefix_cache_hits_created{engine=\"0\"} 1.7e9\n";
        assert_eq!(counter(text, "vllm:prefix_cache_hits_total"), Some(15.5));
        assert_eq!(counter(text, "vllm:prefix_cache_queries_total"), None);
    }

    #[test]
    fn label_value_reads_the_engines_block_count() {
        let text = "# HELP vllm:cache_config_info x\n\
                    vllm:cache_config_info{block_size=\"128\",num_gpu_blocks=\"100\",prefix=\"x\"} 1.0\n";
        assert_eq!(
            label_value(text, "vllm:cache_config_info", "num_gpu_blocks"),
            Some("100")
        );
        assert_eq!(label_value(text, "vllm:cache_config_info", "nope"), None);
        assert_eq!(label_value(text, "vllm:other", "num_gpu_blocks"), None);
    }

    #[test]
    fn goodput_counts_failures_as_misses() {
        let mut stats = Stats::default();
        for ms in [100u64, 200, 900, 2000] {
            stats.ttft.record(ms * 1000).unwrap();
            stats.ok += 1;
        }
        stats.errors.insert("503".into(), 1);
        // 3 of 5 sent met 1000 ms.
        assert!((Row::goodput_of(&stats, 1000) - 0.6).abs() < 1e-9);
    }
}
