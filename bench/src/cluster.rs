//! `radixgate-bench cluster`: cluster mode measured on one machine, with real
//! processes on loopback. For each workload and replica count it starts K
//! `radixgate engine-sim`s (fresh, so every cell starts with cold caches) and N
//! `radixgate serve` replicas from generated config files (policy prefix_aware),
//! either sharing one Redis bus (`[cluster]`, started once with `deploy/cluster/bus`
//! on a free port, a channel of their own per cell) or sharing nothing. It waits
//! until every replica is ready, sees every engine healthy and (shared) hears from
//! its N-1 peers, then [replays](crate::replay) the workload's trace behind an L4
//! spread ([`Spread`]): each request sent to a random replica, or every request on
//! a new connection through HAProxy in TCP mode ([`crate::haproxy`]).
//!
//! Per cell: requests, errors, the engines' hit rate (cached / prompt tokens from the
//! responses' `usage`, and from the engines' own `/metrics`), its ratio to one
//! replica's, TTFT p50/p99, the replicas' `radixgate_cluster_event_lag_seconds`
//! p99 (scraped every 200 ms during the replay: the worst and the median interval),
//! and, for the docs workload, how many engines each document ended up on and how
//! many requests were prefilled cold (less than half their prompt cached), and how
//! the requests fell on the replicas (each one's `radixgate_requests_total`).
//!
//! Every process is started by this module and stopped by PID when its guard drops
//! ([`Procs`]), also on error and on panic.

// A benchmark driver, not a shard: blocking waits are what it is for.
#![allow(clippy::disallowed_methods)]

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

pub use crate::haproxy::Spread;
use crate::http::Target;
use crate::replay::{self, ReplayConfig, ReplayResult};
use crate::report::Stats;
use crate::sim::workload::{self, DocsConfig, MultiturnConfig, WorkloadSpec};
use crate::trace::{self, TraceLine};

#[derive(Clone, Debug)]
pub struct ClusterConfig {
    /// The `radixgate` binary (replicas and engine-sims).
    pub gateway_bin: PathBuf,
    /// `deploy/cluster/bus`.
    pub bus_script: PathBuf,
    /// Replica counts, in table order.
    pub replicas: Vec<usize>,
    /// Modes for more than one replica: `true` = `[cluster]` (shared), `false` = none.
    pub shared: Vec<bool>,
    pub workloads: Vec<Workload>,
    pub engines: usize,
    /// Each engine's prefix-cache capacity (and the gateway's `cache_blocks`).
    pub cache_blocks: usize,
    /// Requests in flight (replay threads).
    pub concurrency: usize,
    /// Rounds; every cell once per round, interleaved.
    pub rounds: usize,
    pub seed: u64,
    /// `server.shards` of each replica.
    pub shards: usize,
    pub max_tokens: u32,
    /// Extra lines for each replica's `[cluster]` section (e.g. `batch_ms = 1`).
    pub cluster_extra: String,
    /// Keep the configs and logs (printed path) instead of removing them.
    pub keep: bool,
    /// Also measure a replica started after the traffic: see [`run_late`].
    pub late: bool,
    /// How requests reach the replicas.
    pub spread: Spread,
    /// `deploy/cluster/haproxy` (for [`Spread::Haproxy`]).
    pub haproxy_script: PathBuf,
}

#[derive(Clone, Debug)]
pub enum Workload {
    Docs(DocsConfig),
    Multiturn(MultiturnConfig),
}

impl Workload {
    pub fn name(&self) -> &'static str {
        match self {
            Workload::Docs(_) => "docs",
            Workload::Multiturn(_) => "multiturn",
        }
    }

    fn describe(&self) -> String {
        match self {
            Workload::Docs(c) => format!(
                "{} documents of {} B, {} requests",
                c.docs, c.doc_bytes, c.requests
            ),
            Workload::Multiturn(c) => format!(
                "{} sessions × {} turns, tool calls p={}",
                c.sessions, c.turns, c.tool_prob
            ),
        }
    }

    /// The trace: every line due at once (only the concurrency and turn order pace it).
    pub fn trace(&self, seed: u64, max_tokens: u32) -> Vec<TraceLine> {
        let spec = match self {
            Workload::Docs(c) => WorkloadSpec::Docs(c.clone()),
            Workload::Multiturn(c) => WorkloadSpec::Multiturn(c.clone()),
        };
        let sessions = workload::build(&spec, seed, "sim", max_tokens);
        trace::generate(&sessions, 0.0, seed)
    }
}

/// One measured cell.
pub struct Cell {
    pub workload: &'static str,
    pub round: usize,
    pub replicas: usize,
    /// `None`: one replica (nothing to share).
    pub shared: Option<bool>,
    pub stats: Stats,
    pub elapsed: Duration,
    /// Engines' own prefix-cache hit rate (`vllm:prefix_cache_hits_total` over
    /// `..._queries_total`, summed; the engines start fresh per cell).
    pub engine_metrics_hit_rate: Option<f64>,
    /// `radixgate_cluster_event_lag_seconds{quantile="0.99"}` over the replay's
    /// scrapes (non-zero samples, every replica), in ms: (max, median).
    pub lag_p99_ms: Option<(f64, f64)>,
    /// docs: engines each document was served by (mean, max), and requests with less
    /// than half their prompt cached.
    pub copies: Option<(f64, usize)>,
    pub cold: usize,
    /// Of those, among the first tenth of the requests (by start time): the
    /// cold-start placements, against what came later (evictions, spills).
    pub cold_early: usize,
    /// Replica starts that failed and were retried (the last log line of each).
    pub start_retries: Vec<String>,
    /// Shared cells: means over the replay's scrapes of what a replica saw, summed
    /// over backends: its own in-flight requests, the peers', its own pending
    /// prefill tokens, the peers'.
    pub seen_load: Option<[f64; 4]>,
    /// Sums over the replicas of their cluster counters at the end.
    pub counters: ClusterCounters,
    /// Requests each replica answered (its `radixgate_requests_total`), in order.
    pub per_replica: Vec<f64>,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct ClusterCounters {
    pub ops_published: f64,
    pub ops_applied: f64,
    pub ops_unsent: f64,
    pub gaps: f64,
    pub dropped: f64,
}

/// Runs every cell; `progress` gets a line per step. Returns the cells and the load
/// average before and after.
pub fn run(
    cfg: &ClusterConfig,
    mut progress: impl FnMut(&str),
) -> Result<(Vec<Cell>, Vec<LateCell>, String, String), String> {
    let load_before = crate::bus::loadavg();
    let state =
        std::env::temp_dir().join(format!("radixgate-bench-cluster.{}", std::process::id()));
    std::fs::create_dir_all(&state).map_err(|e| format!("{}: {e}", state.display()))?;
    let _state_guard = StateDir {
        path: state.clone(),
        keep: cfg.keep,
    };
    let mut bus_procs = Procs::default();
    let needs_bus = cfg.late || (cfg.shared.contains(&true) && cfg.replicas.iter().any(|&n| n > 1));
    let bus_url = if needs_bus {
        let url = start_bus(cfg, &mut bus_procs)?;
        progress(&format!("bus {url} (pid {})", bus_procs.pids()[0]));
        Some(url)
    } else {
        None
    };
    let mut cells = Vec::new();
    let mut late_cells = Vec::new();
    let mut cell_no = 0usize;
    for round in 1..=cfg.rounds.max(1) {
        for w in &cfg.workloads {
            let lines = w.trace(cfg.seed, cfg.max_tokens);
            for &n in &cfg.replicas {
                let modes: Vec<Option<bool>> = if n <= 1 {
                    vec![None]
                } else {
                    cfg.shared.iter().map(|&s| Some(s)).collect()
                };
                for shared in modes {
                    cell_no += 1;
                    let cell = run_cell(
                        cfg,
                        &state,
                        bus_url.as_deref(),
                        w,
                        &lines,
                        CellSpec {
                            no: cell_no,
                            round,
                            replicas: n.max(1),
                            shared,
                        },
                    )?;
                    progress(&cell_line(&cell));
                    cells.push(cell);
                }
            }
            if let (true, Some(url)) = (cfg.late, bus_url.as_deref()) {
                cell_no += 2;
                let late = run_late(cfg, &state, url, w, &lines, round, cell_no)?;
                progress(&format!(
                    "{} round {round}: late replica {} against {} alone",
                    late.workload,
                    pct(late.late),
                    pct(late.alone)
                ));
                late_cells.push(late);
            }
        }
    }
    drop(bus_procs);
    Ok((cells, late_cells, load_before, crate::bus::loadavg()))
}

struct CellSpec {
    no: usize,
    round: usize,
    replicas: usize,
    shared: Option<bool>,
}

fn run_cell(
    cfg: &ClusterConfig,
    state: &Path,
    bus_url: Option<&str>,
    w: &Workload,
    lines: &[TraceLine],
    spec: CellSpec,
) -> Result<Cell, String> {
    let mut procs = Procs::default();
    let engines = start_engines(cfg, state, spec.no, &mut procs)?;
    let shared = spec.shared == Some(true);
    let channel = format!("rgbench-{}-cell{}", std::process::id(), spec.no);
    let mut start_retries = Vec::new();
    let mut replicas = Vec::with_capacity(spec.replicas);
    for i in 0..spec.replicas {
        let cluster = match (shared, bus_url) {
            (true, Some(url)) => Some((url, channel.as_str())),
            (true, None) => return Err("shared cell without a bus".into()),
            _ => None,
        };
        replicas.push(start_replica(
            cfg,
            CellDir {
                state,
                cell: spec.no,
            },
            i,
            &engines,
            cluster,
            &mut procs,
            &mut start_retries,
        )?);
    }
    if shared {
        wait_peers(&replicas, spec.replicas - 1)?;
    }
    let addrs: Vec<SocketAddr> = replicas.iter().map(|(a, _)| *a).collect();
    let (fronts, headers) = match cfg.spread {
        Spread::Random => (addrs.clone(), Vec::new()),
        Spread::Haproxy => {
            let dir = state.join(format!("cell{}", spec.no));
            let front = crate::haproxy::start(&cfg.haproxy_script, &dir, &addrs, &mut procs)?;
            // HAProxy spreads connections: one per request (module docs).
            (vec![front], vec![("Connection".into(), "close".into())])
        }
    };
    let targets = fronts
        .iter()
        .map(|a| Target::parse(&format!("http://{a}/v1/chat/completions")))
        .collect::<Result<Vec<_>, _>>()?;
    let lags = LagScraper::start(addrs.clone(), shared);
    let replay_cfg = ReplayConfig {
        targets,
        spread_seed: cfg.seed.wrapping_mul(1000) + spec.no as u64,
        concurrency: cfg.concurrency,
        speedup: 0.0,
        headers,
        timeout: Duration::from_secs(60),
    };
    let result = replay::run(&replay_cfg, lines).map_err(|e| e.to_string());
    let lag_samples = lags.stop();
    let result = result?;
    let mut counters = ClusterCounters::default();
    if shared {
        for &a in &addrs {
            let m = http_get(a, "/metrics").unwrap_or_default();
            let v = |name| sample(&m, name).unwrap_or(0.0);
            counters.ops_published += v("radixgate_cluster_ops_published_total");
            counters.ops_applied += v("radixgate_cluster_ops_applied_total");
            counters.ops_unsent += v("radixgate_cluster_ops_unsent_total");
            counters.gaps += v("radixgate_cluster_gaps_total");
            counters.dropped += sum(&m, "radixgate_cluster_messages_dropped_total").unwrap_or(0.0);
        }
    }
    let per_replica = addrs
        .iter()
        .map(|&a| {
            let m = http_get(a, "/metrics").unwrap_or_default();
            sum(&m, "radixgate_requests_total").unwrap_or(0.0)
        })
        .collect();
    let engine_metrics_hit_rate = engine_hit_rate(&engines);
    let (copies, cold) = doc_spread(lines, &result);
    let cold_early = cold_in_first(&result, result.records.len().div_ceil(10));
    drop(procs);
    Ok(Cell {
        workload: w.name(),
        round: spec.round,
        replicas: spec.replicas,
        shared: spec.shared,
        stats: result.stats,
        elapsed: result.elapsed,
        engine_metrics_hit_rate,
        lag_p99_ms: lag_summary(&lag_samples.lag_p99),
        seen_load: shared.then(|| {
            [
                mean(&lag_samples.local_in_flight),
                mean(&lag_samples.peer_in_flight),
                mean(&lag_samples.local_pending),
                mean(&lag_samples.peer_pending),
            ]
        }),
        copies: matches!(w, Workload::Docs(_)).then_some(copies).flatten(),
        cold,
        cold_early,
        counters,
        start_retries,
        per_replica,
    })
}

/// K fresh engine-sims (cold caches), answering.
fn start_engines(
    cfg: &ClusterConfig,
    state: &Path,
    cell: usize,
    procs: &mut Procs,
) -> Result<Vec<SocketAddr>, String> {
    let mut engines = Vec::with_capacity(cfg.engines);
    for i in 0..cfg.engines {
        let addr = free_addr()?;
        let log = state.join(format!("cell{cell}-engine{i}.log"));
        let child = Command::new(&cfg.gateway_bin)
            .arg("engine-sim")
            .args(["--listen", &addr.to_string()])
            .args(["--cache-blocks", &cfg.cache_blocks.to_string()])
            .args(["--seed", &(i + 1).to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file(&log)?)
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", cfg.gateway_bin.display()))?;
        procs.push(child, format!("engine-sim {addr}"));
        engines.push(addr);
    }
    for &addr in &engines {
        wait_until(Duration::from_secs(20), || {
            http_get(addr, "/v1/models").is_ok()
        })
        .map_err(|_| format!("engine-sim {addr} did not answer within 20 s"))?;
    }
    Ok(engines)
}

/// Where a cell's files go: the state directory and the cell's number.
#[derive(Clone, Copy)]
struct CellDir<'a> {
    state: &'a Path,
    cell: usize,
}

/// Starts replica `i` (with `[cluster]` on `(bus url, channel)` when given) and
/// waits until it is ready with every engine healthy; returns its address and log.
fn start_replica(
    cfg: &ClusterConfig,
    dir: CellDir<'_>,
    i: usize,
    engines: &[SocketAddr],
    cluster: Option<(&str, &str)>,
    procs: &mut Procs,
    start_retries: &mut Vec<String>,
) -> Result<(SocketAddr, PathBuf), String> {
    let addr = free_addr()?;
    let node = format!("r{i}");
    let toml = replica_toml(
        addr,
        cfg.shards,
        engines,
        cfg.cache_blocks,
        cluster.map(|(u, c)| (u, c, node.as_str(), cfg.cluster_extra.as_str())),
    );
    let (state, cell) = (dir.state, dir.cell);
    let config = state.join(format!("cell{cell}-replica{i}.toml"));
    std::fs::write(&config, toml).map_err(|e| format!("{}: {e}", config.display()))?;
    let log = state.join(format!("cell{cell}-replica{i}.log"));
    let child = spawn_replica(&cfg.gateway_bin, &config, &log, 0)?;
    let slot = procs.push(child, format!("replica {addr}"));
    let mut attempt = 0;
    let ok = loop {
        let ok = wait_until(Duration::from_secs(30), || {
            procs.exited(slot)
                || (http_get(addr, "/ready").is_ok()
                    && http_get(addr, "/metrics").is_ok_and(|m| {
                        sum(&m, "radixgate_backend_healthy") == Some(cfg.engines as f64)
                    }))
        });
        // A replica that exited at start is started again, at most twice, and
        // reported.
        if procs.exited(slot) && attempt < 2 {
            attempt += 1;
            let why = tail(&log).lines().last().unwrap_or("").to_string();
            start_retries.push(why);
            let child = spawn_replica(&cfg.gateway_bin, &config, &log, attempt)?;
            procs.replace(slot, child);
            continue;
        }
        break ok.is_ok() && !procs.exited(slot);
    };
    if !ok {
        return Err(format!(
            "replica {addr} not ready with {} healthy engines within 30 s; log:\n{}",
            cfg.engines,
            tail(&log)
        ));
    }
    Ok((addr, log))
}

/// Waits until every replica hears `peers` peers.
fn wait_peers(replicas: &[(SocketAddr, PathBuf)], peers: usize) -> Result<(), String> {
    for (addr, log) in replicas {
        let ok = wait_until(Duration::from_secs(30), || {
            http_get(*addr, "/metrics")
                .is_ok_and(|m| sample(&m, "radixgate_cluster_peers") == Some(peers as f64))
        });
        if ok.is_err() {
            return Err(format!(
                "replica {addr} did not see {peers} peers within 30 s; log:\n{}",
                tail(log)
            ));
        }
    }
    Ok(())
}

/// One round of the late-replica measurement.
#[derive(Clone, Debug)]
pub struct LateCell {
    pub workload: &'static str,
    pub round: usize,
    /// The second half's hit rate on one replica that served the whole trace.
    pub alone: Option<f64>,
    /// The second half's hit rate on a replica started after the first half (the
    /// first half went to another replica), serving the second half alone.
    pub late: Option<f64>,
    pub errors: u64,
    /// The late replica's snapshot: ops loaded, and ms from joining to loaded.
    pub snapshot_ops: f64,
}

/// A replica started after the traffic: replica r0 serves the first half of the
/// trace; then r1 starts (shared, loading r0's index as it joins) and serves the
/// second half alone. Against it, one replica serves both halves. Fresh engines
/// for each.
pub fn run_late(
    cfg: &ClusterConfig,
    state: &Path,
    bus_url: &str,
    w: &Workload,
    lines: &[TraceLine],
    round: usize,
    cell: usize,
) -> Result<LateCell, String> {
    let half = lines.len() / 2;
    let (first, second) = (&lines[..half], &lines[half..]);
    let replay_to = |addr: SocketAddr, part: &[TraceLine], seed: u64| {
        let cfg = ReplayConfig {
            targets: vec![Target::parse(&format!(
                "http://{addr}/v1/chat/completions"
            ))?],
            spread_seed: seed,
            concurrency: cfg.concurrency,
            speedup: 0.0,
            headers: Vec::new(),
            timeout: Duration::from_secs(60),
        };
        replay::run(&cfg, part).map_err(|e| e.to_string())
    };
    let mut retries = Vec::new();
    // One replica all along.
    let alone = {
        let mut procs = Procs::default();
        let engines = start_engines(cfg, state, cell, &mut procs)?;
        let (r0, _) = start_replica(
            cfg,
            CellDir { state, cell },
            0,
            &engines,
            None,
            &mut procs,
            &mut retries,
        )?;
        replay_to(r0, first, 1)?;
        replay_to(r0, second, 2)?
    };
    // The second half on a replica that joined after the first.
    let channel = format!("rgbench-{}-late{cell}", std::process::id());
    let mut procs = Procs::default();
    let engines = start_engines(cfg, state, cell + 1, &mut procs)?;
    let cluster = Some((bus_url, channel.as_str()));
    let late_dir = CellDir {
        state,
        cell: cell + 1,
    };
    let (r0, _) = start_replica(
        cfg,
        late_dir,
        0,
        &engines,
        cluster,
        &mut procs,
        &mut retries,
    )?;
    replay_to(r0, first, 1)?;
    let (r1, _) = start_replica(
        cfg,
        late_dir,
        1,
        &engines,
        cluster,
        &mut procs,
        &mut retries,
    )?;
    let late = replay_to(r1, second, 2)?;
    let m = http_get(r1, "/metrics").unwrap_or_default();
    Ok(LateCell {
        workload: w.name(),
        round,
        alone: alone.stats.cached_share(),
        late: late.stats.cached_share(),
        errors: alone
            .stats
            .errors
            .values()
            .chain(late.stats.errors.values())
            .sum(),
        snapshot_ops: sample(&m, "radixgate_cluster_snapshots_loaded_total").unwrap_or(0.0),
    })
}

/// Starts one replica; its log is appended to (a retried start keeps the failure).
fn spawn_replica(bin: &Path, config: &Path, log: &Path, attempt: usize) -> Result<Child, String> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(attempt > 0)
        .write(true)
        .truncate(attempt == 0)
        .open(log)
        .map_err(|e| format!("{}: {e}", log.display()))?;
    Command::new(bin)
        .arg("serve")
        .arg("--config")
        .arg(config)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(file)
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", bin.display()))
}

/// A replica's config: prefix_aware over `engines`, with `[cluster]` when given
/// `(url, channel, node, extra lines)`.
pub fn replica_toml(
    listen: SocketAddr,
    shards: usize,
    engines: &[SocketAddr],
    cache_blocks: usize,
    cluster: Option<(&str, &str, &str, &str)>,
) -> String {
    let mut toml = format!(
        "[server]\nlisten = \"{listen}\"\nshards = {shards}\n\n[routing]\npolicy = \"prefix_aware\"\n\n\
         [health]\nscrape_interval_ms = 500\n\n[log]\naccess = false\n"
    );
    if let Some((url, channel, node, extra)) = cluster {
        let _ = write!(
            toml,
            "\n[cluster]\nurl = \"{url}\"\nchannel = \"{channel}\"\nnode = \"{node}\"\n"
        );
        for line in extra.split(';').map(str::trim).filter(|l| !l.is_empty()) {
            let _ = writeln!(toml, "{line}");
        }
    }
    for (i, e) in engines.iter().enumerate() {
        let _ = write!(
            toml,
            "\n[[backends]]\nid = \"e{i}\"\nurl = \"http://{e}\"\nmodels = [\"sim\"]\ncache_blocks = {cache_blocks}\n"
        );
    }
    toml
}

/// docs: per document, the engines that served it (mean, max over documents), and
/// the requests that found less than half their prompt cached.
pub fn doc_spread(lines: &[TraceLine], result: &ReplayResult) -> (Option<(f64, usize)>, usize) {
    let mut by_doc: BTreeMap<usize, BTreeSet<&str>> = BTreeMap::new();
    let mut cold = 0;
    for (line, rec) in lines.iter().zip(&result.records) {
        if let (Some(p), Some(c)) = (rec.prompt_tokens, rec.cached_tokens) {
            if 2 * c < p {
                cold += 1;
            }
        }
        if let (Some(d), Some(b)) = (doc_of(&line.body), rec.backend.as_deref()) {
            by_doc.entry(d).or_default().insert(b);
        }
    }
    if by_doc.is_empty() {
        return (None, cold);
    }
    let total: usize = by_doc.values().map(BTreeSet::len).sum();
    let max = by_doc.values().map(BTreeSet::len).max().unwrap_or(0);
    (Some((total as f64 / by_doc.len() as f64, max)), cold)
}

/// Requests with less than half their prompt cached among the first `n` to start.
pub fn cold_in_first(result: &ReplayResult, n: usize) -> usize {
    let mut by_start: Vec<&replay::Record> = result.records.iter().collect();
    by_start.sort_by(|a, b| a.start_ms.total_cmp(&b.start_ms));
    by_start
        .iter()
        .take(n)
        .filter(|r| matches!((r.prompt_tokens, r.cached_tokens), (Some(p), Some(c)) if 2 * c < p))
        .count()
}

/// The document a docs-workload body asks about ("Document N. " opens its text).
pub fn doc_of(body: &str) -> Option<usize> {
    let at = body.find("Document ")? + "Document ".len();
    let digits: String = body[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

fn lag_summary(samples: &[f64]) -> Option<(f64, f64)> {
    if samples.is_empty() {
        return None;
    }
    let mut s = samples.to_vec();
    s.sort_by(f64::total_cmp);
    Some((s[s.len() - 1] * 1e3, s[s.len() / 2] * 1e3))
}

/// What the replicas' `/metrics` showed during the replay, one entry per scrape of
/// one replica: the event-lag p99 (non-zero samples only), and the load routing
/// sees, summed over backends: this replica's in-flight requests and pending prefill
/// tokens, and the peers' as last reported.
#[derive(Default)]
struct Scrapes {
    lag_p99: Vec<f64>,
    local_in_flight: Vec<f64>,
    peer_in_flight: Vec<f64>,
    local_pending: Vec<f64>,
    peer_pending: Vec<f64>,
}

/// Polls the replicas' `/metrics` every 200 ms while the replay runs.
struct LagScraper {
    stop: Arc<AtomicBool>,
    handle: Option<thread::JoinHandle<Scrapes>>,
}

impl LagScraper {
    fn start(addrs: Vec<SocketAddr>, enabled: bool) -> LagScraper {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let handle = enabled.then(|| {
            thread::spawn(move || {
                let mut out = Scrapes::default();
                while !flag.load(Ordering::Relaxed) {
                    for &a in &addrs {
                        let Ok(m) = http_get(a, "/metrics") else {
                            continue;
                        };
                        if let Some(v) =
                            sample(&m, "radixgate_cluster_event_lag_seconds{quantile=\"0.99\"}")
                        {
                            if v > 0.0 {
                                out.lag_p99.push(v);
                            }
                        }
                        let s = |name| sum(&m, name).unwrap_or(0.0);
                        out.local_in_flight.push(s("radixgate_backend_in_flight"));
                        out.peer_in_flight
                            .push(s("radixgate_cluster_peer_in_flight"));
                        out.local_pending
                            .push(s("radixgate_backend_pending_prefill_tokens"));
                        out.peer_pending
                            .push(s("radixgate_cluster_peer_pending_prefill_tokens"));
                    }
                    thread::sleep(Duration::from_millis(200));
                }
                out
            })
        });
        LagScraper { stop, handle }
    }

    fn stop(mut self) -> Scrapes {
        self.stop.store(true, Ordering::Relaxed);
        self.handle
            .take()
            .and_then(|h| h.join().ok())
            .unwrap_or_default()
    }
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

fn engine_hit_rate(engines: &[SocketAddr]) -> Option<f64> {
    let (mut hits, mut queries) = (0.0, 0.0);
    for &e in engines {
        let m = http_get(e, "/metrics").ok()?;
        hits += sum(&m, "vllm:prefix_cache_hits_total")?;
        queries += sum(&m, "vllm:prefix_cache_queries_total")?;
    }
    (queries > 0.0).then(|| hits / queries)
}

fn start_bus(cfg: &ClusterConfig, procs: &mut Procs) -> Result<String, String> {
    let port = free_addr()?.port();
    let mut child = Command::new(&cfg.bus_script)
        .arg(port.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("{}: {e}", cfg.bus_script.display()))?;
    let stdout = child.stdout.take().expect("piped stdout");
    procs.push(child, format!("bus on {port}"));
    let mut lines = BufReader::new(stdout);
    let mut url = String::new();
    lines
        .read_line(&mut url)
        .map_err(|e| format!("bus: reading its url: {e}"))?;
    // Keep draining the server's stdout (Redis logs there) so it never blocks.
    thread::spawn(move || {
        let mut sink = String::new();
        while lines.read_line(&mut sink).map(|n| n > 0).unwrap_or(false) {
            sink.clear();
        }
    });
    let url = url.trim().to_string();
    if url.is_empty() {
        return Err("the bus did not print its url".into());
    }
    wait_until(Duration::from_secs(120), || {
        TcpStream::connect(("127.0.0.1", port)).is_ok()
    })
    .map_err(|_| format!("the bus is not listening on {port}"))?;
    Ok(url)
}

/// Processes this bench started, stopped by PID when dropped: SIGTERM, then SIGKILL
/// after 3 s, and reaped.
#[derive(Default)]
pub struct Procs {
    children: Vec<(Child, String)>,
}

impl Procs {
    /// Returns the child's slot.
    pub fn push(&mut self, child: Child, what: String) -> usize {
        self.children.push((child, what));
        self.children.len() - 1
    }

    /// Whether the child in `slot` has exited (reaping it).
    pub fn exited(&mut self, slot: usize) -> bool {
        !matches!(self.children[slot].0.try_wait(), Ok(None))
    }

    /// Puts a new child in the slot of one that has exited.
    pub fn replace(&mut self, slot: usize, child: Child) {
        self.children[slot].0 = child;
    }

    pub fn pids(&self) -> Vec<u32> {
        self.children.iter().map(|(c, _)| c.id()).collect()
    }
}

impl Drop for Procs {
    fn drop(&mut self) {
        for (child, _) in self.children.iter_mut().rev() {
            if let Ok(None) = child.try_wait() {
                // SAFETY: kill(2) on the PID of our own unreaped child.
                unsafe {
                    libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
                }
            }
        }
        let deadline = Instant::now() + Duration::from_secs(3);
        for (child, what) in self.children.iter_mut().rev() {
            loop {
                match child.try_wait() {
                    Ok(Some(_)) | Err(_) => break,
                    Ok(None) if Instant::now() >= deadline => {
                        eprintln!("cluster bench: {what} ignored SIGTERM; killing it");
                        let _ = child.kill();
                        let _ = child.wait();
                        break;
                    }
                    Ok(None) => thread::sleep(Duration::from_millis(10)),
                }
            }
        }
    }
}

/// The run's temp directory (configs, logs), removed on drop unless kept.
struct StateDir {
    path: PathBuf,
    keep: bool,
}

impl Drop for StateDir {
    fn drop(&mut self) {
        if self.keep {
            eprintln!(
                "cluster bench: configs and logs kept in {}",
                self.path.display()
            );
        } else {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

pub(crate) fn log_file(path: &Path) -> Result<std::fs::File, String> {
    std::fs::File::create(path).map_err(|e| format!("{}: {e}", path.display()))
}

pub(crate) fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

pub(crate) fn wait_until(limit: Duration, mut ok: impl FnMut() -> bool) -> Result<(), ()> {
    let deadline = Instant::now() + limit;
    loop {
        if ok() {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(());
        }
        thread::sleep(Duration::from_millis(50));
    }
}

pub(crate) fn free_addr() -> Result<SocketAddr, String> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    l.local_addr().map_err(|e| e.to_string())
}

/// A one-shot `GET` (Connection: close); the body if the status is 200.
fn http_get(addr: SocketAddr, path: &str) -> Result<String, String> {
    let mut s =
        TcpStream::connect_timeout(&addr, Duration::from_secs(2)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(5)))
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

/// The value of one sample, named exactly (with its labels, if any).
pub fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

/// The sum of a family's samples over all label sets.
pub fn sum(text: &str, name: &str) -> Option<f64> {
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

fn pct(v: Option<f64>) -> String {
    v.map_or("n/a".into(), |x| format!("{:.1}%", 100.0 * x))
}

fn mode(c: &Cell) -> &'static str {
    match c.shared {
        None => "—",
        Some(true) => "yes",
        Some(false) => "no",
    }
}

fn cell_line(c: &Cell) -> String {
    format!(
        "{} round {} replicas {} shared {}: {} ok, {} failed, hit {} (engines {}), TTFT p50 {:.1} ms p99 {:.1} ms, lag p99 {}, copies {}, cold {} (first tenth {}) ({:.1} s)",
        c.workload,
        c.round,
        c.replicas,
        mode(c),
        c.stats.ok,
        c.stats.failed(),
        pct(c.stats.cached_share()),
        pct(c.engine_metrics_hit_rate),
        c.stats.ttft.value_at_quantile(0.5) as f64 / 1e3,
        c.stats.ttft.value_at_quantile(0.99) as f64 / 1e3,
        c.lag_p99_ms
            .map_or("-".into(), |(m, med)| format!("{m:.2}/{med:.2} ms")),
        c.copies
            .map_or("-".into(), |(mean, max)| format!("{mean:.2}/{max}")),
        c.cold,
        c.cold_early,
        c.elapsed.as_secs_f64()
    )
}

/// The cells as Markdown: one table per workload.
/// The late-replica table (empty without `--late`).
pub fn late_markdown(late: &[LateCell]) -> String {
    if late.is_empty() {
        return String::new();
    }
    let mut out = String::from("\n### cluster · a replica started after the traffic (the trace's second half, served alone)\n\n| workload | round | one replica all along | the late replica | late / alone | errors | snapshots loaded |\n|---|---:|---:|---:|---:|---:|---:|\n");
    for c in late {
        let ratio = match (c.late, c.alone) {
            (Some(l), Some(a)) if a > 0.0 => format!("{:.3}×", l / a),
            _ => String::new(),
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {ratio} | {} | {} |",
            c.workload,
            c.round,
            pct(c.alone),
            pct(c.late),
            c.errors,
            c.snapshot_ops
        );
    }
    out
}

/// The fewest and most requests a replica answered, `min–max`.
fn spread_range(per_replica: &[f64]) -> String {
    let min = per_replica.iter().copied().fold(f64::INFINITY, f64::min);
    let max = per_replica.iter().copied().fold(0.0, f64::max);
    match per_replica.len() {
        0 => "—".into(),
        _ => format!("{min:.0}–{max:.0}"),
    }
}

pub fn to_markdown(cfg: &ClusterConfig, cells: &[Cell]) -> String {
    let mut out = String::new();
    for w in &cfg.workloads {
        let name = w.name();
        let _ = writeln!(
            out,
            "\n### cluster · {name} ({}; {} engine-sims × {} blocks; prefix_aware, {} shard per replica, concurrency {}, seed {}; spread: {})\n",
            w.describe(),
            cfg.engines,
            cfg.cache_blocks,
            cfg.shards,
            cfg.concurrency,
            cfg.seed,
            cfg.spread.describe()
        );
        out.push_str("| round | replicas | shared | requests | errors | hit rate | vs 1 replica | engines' /metrics | TTFT p50 ms | TTFT p99 ms | event lag p99 ms (worst / median) | engines per document (mean / max) | cold prefills (in the first tenth) | requests per replica (min–max) | reasons |\n");
        out.push_str(
            "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n",
        );
        for c in cells.iter().filter(|c| c.workload == name) {
            let one = cells
                .iter()
                .find(|b| b.workload == name && b.round == c.round && b.replicas == 1)
                .and_then(|b| b.stats.cached_share());
            let vs = match (c.stats.cached_share(), one) {
                (Some(h), Some(o)) if o > 0.0 => format!("{:.3}×", h / o),
                _ => "".into(),
            };
            let mut reasons: Vec<(&String, &u64)> = c.stats.reasons.iter().collect();
            reasons.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
            let reasons = reasons
                .iter()
                .map(|(r, n)| format!("{r} {n}"))
                .collect::<Vec<_>>()
                .join(", ");
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {:.1} | {:.1} | {} | {} | {} ({}) | {} | {} |",
                c.round,
                c.replicas,
                mode(c),
                c.stats.ok + c.stats.failed(),
                c.stats.failed(),
                pct(c.stats.cached_share()),
                vs,
                pct(c.engine_metrics_hit_rate),
                c.stats.ttft.value_at_quantile(0.5) as f64 / 1e3,
                c.stats.ttft.value_at_quantile(0.99) as f64 / 1e3,
                c.lag_p99_ms
                    .map_or("—".into(), |(m, med)| format!("{m:.2} / {med:.2}")),
                c.copies
                    .map_or("—".into(), |(mean, max)| format!("{mean:.2} / {max}")),
                c.cold,
                c.cold_early,
                spread_range(&c.per_replica),
                reasons
            );
        }
        let shared: Vec<&Cell> = cells
            .iter()
            .filter(|c| c.workload == name && c.shared == Some(true))
            .collect();
        if !shared.is_empty() {
            out.push_str("\nBus counters, summed over the replicas of each shared cell (ops published / applied by peers / unsent; batches lost (gaps); messages dropped), and the load routing saw:\n\n");
            for c in shared {
                let k = &c.counters;
                let _ = write!(
                    out,
                    "- round {}, {} replicas: {:.0} / {:.0} / {:.0}; {:.0}; {:.0}",
                    c.round,
                    c.replicas,
                    k.ops_published,
                    k.ops_applied,
                    k.ops_unsent,
                    k.gaps,
                    k.dropped
                );
                if let Some([li, pi, lp, pp]) = c.seen_load {
                    let _ = write!(
                        out,
                        ". Load a replica saw (mean of its scrapes, all backends): in flight {li:.1} own + {pi:.1} peers' (the fleet has at most {} in flight), pending prefill tokens {lp:.0} own + {pp:.0} peers'",
                        cfg.concurrency
                    );
                }
                out.push('\n');
            }
        }
        for c in cells
            .iter()
            .filter(|c| c.workload == name && !c.start_retries.is_empty())
        {
            let _ = writeln!(
                out,
                "\nRound {}, {} replicas ({}): {} replica start(s) failed and were retried: {}",
                c.round,
                c.replicas,
                mode(c),
                c.start_retries.len(),
                c.start_retries.join(" | ")
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replica_config_parses_and_carries_the_cluster_section() {
        let engines: Vec<SocketAddr> = ["127.0.0.1:9001", "127.0.0.1:9002"]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect();
        let listen: SocketAddr = "127.0.0.1:8081".parse().unwrap();
        let plain = replica_toml(listen, 1, &engines, 600, None);
        assert!(!plain.contains("[cluster]"), "{plain}");
        let shared = replica_toml(
            listen,
            2,
            &engines,
            600,
            Some((
                "redis://127.0.0.1:6390",
                "chan-1",
                "r0",
                "batch_ms = 2; batch_ops = 32",
            )),
        );
        for want in [
            "listen = \"127.0.0.1:8081\"",
            "shards = 2",
            "policy = \"prefix_aware\"",
            "[cluster]\nurl = \"redis://127.0.0.1:6390\"\nchannel = \"chan-1\"\nnode = \"r0\"\nbatch_ms = 2\nbatch_ops = 32\n",
            "id = \"e1\"\nurl = \"http://127.0.0.1:9002\"\nmodels = [\"sim\"]\ncache_blocks = 600\n",
        ] {
            assert!(shared.contains(want), "missing {want:?} in\n{shared}");
        }
        // Well-formed TOML of the gateway's shape (the run itself is the gateway's
        // parser's test).
        for (text, cluster) in [(&plain, false), (&shared, true)] {
            let t: toml::Table = text.parse().unwrap_or_else(|e| panic!("{e}\n{text}"));
            assert_eq!(t["backends"].as_array().unwrap().len(), 2);
            assert_eq!(t["routing"]["policy"].as_str(), Some("prefix_aware"));
            assert_eq!(t.contains_key("cluster"), cluster);
        }
        let t: toml::Table = shared.parse().unwrap();
        assert_eq!(t["cluster"]["batch_ops"].as_integer(), Some(32));
    }

    #[test]
    fn finds_documents_and_counts_their_engines() {
        let w = Workload::Docs(DocsConfig {
            docs: 3,
            requests: 12,
            ..DocsConfig::default()
        });
        let lines = w.trace(1, 16);
        assert_eq!(lines.len(), 12);
        let docs: Vec<usize> = lines.iter().map(|l| doc_of(&l.body).unwrap()).collect();
        assert!(docs.iter().all(|&d| d < 3), "{docs:?}");
        assert_eq!(doc_of("{\"x\":\"no document here\"}"), None);
        let records = lines
            .iter()
            .enumerate()
            .map(|(i, l)| replay::Record {
                session: l.session.clone(),
                turn: 0,
                target: 0,
                start_ms: 0.0,
                status: Some(200),
                error: None,
                ttft_ms: Some(1.0),
                total_ms: Some(1.0),
                // Document 0 lands on two engines, the others on one.
                backend: Some(
                    if docs[i] == 0 && i % 2 == 0 {
                        "e1"
                    } else {
                        "e0"
                    }
                    .into(),
                ),
                reason: None,
                prompt_tokens: Some(100),
                cached_tokens: Some(if i < 3 { 0 } else { 90 }),
            })
            .collect();
        let result = ReplayResult {
            stats: Stats::default(),
            elapsed: Duration::ZERO,
            records,
        };
        let (copies, cold) = doc_spread(&lines, &result);
        let (mean, max) = copies.unwrap();
        let d0_twice = docs.iter().enumerate().any(|(i, &d)| d == 0 && i % 2 == 0)
            && docs.iter().enumerate().any(|(i, &d)| d == 0 && i % 2 == 1);
        assert_eq!(max, if d0_twice { 2 } else { 1 });
        assert!((1.0..=2.0).contains(&mean));
        assert_eq!(cold, 3);
    }

    #[test]
    fn reads_prometheus_samples() {
        let text = "# HELP radixgate_cluster_peers x\nradixgate_cluster_peers 3\n\
                    radixgate_cluster_event_lag_seconds{quantile=\"0.5\"} 0.0001\n\
                    radixgate_cluster_event_lag_seconds{quantile=\"0.99\"} 0.0042\n\
                    radixgate_backend_healthy{backend=\"e0\"} 1\nradixgate_backend_healthy{backend=\"e1\"} 1\n";
        assert_eq!(sample(text, "radixgate_cluster_peers"), Some(3.0));
        assert_eq!(
            sample(
                text,
                "radixgate_cluster_event_lag_seconds{quantile=\"0.99\"}"
            ),
            Some(0.0042)
        );
        assert_eq!(sum(text, "radixgate_backend_healthy"), Some(2.0));
        assert_eq!(sample(text, "radixgate_cluster_peer"), None);
        assert_eq!(lag_summary(&[0.001, 0.003, 0.002]), Some((3.0, 2.0)));
    }

    #[test]
    fn procs_stop_their_children_on_drop() {
        let child = Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id() as libc::pid_t;
        {
            let mut p = Procs::default();
            p.push(child, "sleep".into());
            assert_eq!(p.pids(), [pid as u32]);
        }
        // Reaped: the PID no longer names our child.
        // SAFETY: signal 0 only checks for existence.
        let alive = unsafe { libc::kill(pid, 0) } == 0;
        assert!(!alive, "sleep {pid} still running");
    }
}
