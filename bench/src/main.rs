//! `radixgate-bench`: the command line over the bench library: `load` (closed-loop
//! HTTP/1.1 load), `sim` (routing quality against simulated engines, no network),
//! `gen-trace` (a workload as a JSONL trace), `replay` (a trace fired at a live
//! gateway), `bus` (the cluster-bus candidates, NATS and Redis) and `cluster`
//! (gateway replicas with and without cluster mode, on one machine); see
//! `bench/README.md`.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use radixgate_bench::bus;
use radixgate_bench::http::Target;
use radixgate_bench::load::{self, LoadConfig, MAX_CONCURRENCY};
use radixgate_bench::replay::{self, ReplayConfig};
use radixgate_bench::report::Report;
use radixgate_bench::sim::cli::{SimArgs, WorkloadFlags};
use radixgate_bench::sim::workload::{self as sim_workload, Distribution, WorkloadSpec};
use radixgate_bench::trace;
use radixgate_bench::workload::{Kind, Workload, WorkloadConfig};

#[derive(Parser)]
#[command(
    name = "radixgate-bench",
    version,
    about = "radixgate's load generator and benchmarks"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Closed-loop HTTP/1.1 load: N keep-alive connections, each sending its next
    /// request as soon as the previous response is complete.
    Load(LoadArgs),
    /// Routing quality without a network: the orchestrator's own policies against
    /// simulated engines (LRU prefix caches, FIFO prefill), deterministic by seed.
    Sim(SimArgs),
    /// Write a workload (the simulator's docs or multiturn) as a JSONL trace on stdout.
    GenTrace(GenTraceArgs),
    /// Fire a JSONL trace at a live gateway, keeping each session's turns in order.
    Replay(ReplayArgs),
    /// Real vLLM (CPU) engines behind radixgate: TTFT, engine hit rate and cached
    /// share per workload, concurrency and policy (minutes; installs vLLM on first use).
    Real(RealArgs),
    /// The cluster bus candidates (NATS core and JetStream, Redis pub/sub and streams)
    /// through their Rust clients: publish rate, event lag, CPU per event, and a broker
    /// restart with --restart-after (starts the brokers with deploy/cluster/bus).
    Bus(BusArgs),
    /// The cluster wire format's encode and decode cost per op (the gateway's own
    /// src/cluster/wire.rs, optimised).
    Wire(WireArgs),
    /// Cluster mode on one machine: a Redis bus, engine-sims and N `radixgate serve`
    /// replicas (sharing over the bus, or not), the docs and multiturn traces replayed
    /// behind an L4 spread (a random replica per request, or HAProxy in TCP mode);
    /// hit rate, TTFT and event lag per replica count.
    Cluster(ClusterArgs),
}

#[derive(Args)]
struct ClusterArgs {
    /// The radixgate binary (replicas and engine-sims); default: `radixgate` next to
    /// this one.
    #[arg(long)]
    radixgate: Option<PathBuf>,
    /// Replica counts, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    replicas: Vec<usize>,
    /// For more than one replica: shared (`[cluster]` over the bus), unshared
    /// (independent replicas), or both.
    #[arg(long, value_delimiter = ',', default_value = "yes,no")]
    shared: Vec<String>,
    /// Workloads, comma-separated: docs, multiturn.
    #[arg(long, value_delimiter = ',', default_value = "docs,multiturn")]
    workloads: Vec<TraceWorkload>,
    #[arg(long, default_value_t = 3)]
    engines: usize,
    /// Each engine-sim's prefix cache, in blocks (and the replicas' cache_blocks).
    #[arg(long, default_value_t = 600)]
    cache_blocks: usize,
    /// Requests in flight (clients).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=MAX_CONCURRENCY as i64))]
    concurrency: u32,
    /// Every cell once per round (interleaved).
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// `server.shards` per replica.
    #[arg(long, default_value_t = 1)]
    shards: usize,
    /// docs: documents, bytes each, requests.
    #[arg(long, default_value_t = 15)]
    docs: usize,
    #[arg(long, default_value_t = 6144)]
    doc_bytes: usize,
    #[arg(long, default_value_t = 900)]
    requests: usize,
    /// multiturn: sessions and turns.
    #[arg(long, default_value_t = 12)]
    sessions: usize,
    #[arg(long, default_value_t = 6)]
    turns: usize,
    #[arg(long, default_value_t = 16)]
    max_tokens: u32,
    /// Extra `[cluster]` lines for the shared replicas, `;`-separated
    /// (e.g. "batch_ms = 1; report_interval_ms = 100").
    #[arg(long, default_value = "")]
    cluster_extra: String,
    /// The bus script (PORT); default deploy/cluster/bus.
    #[arg(long, default_value = "deploy/cluster/bus")]
    bus_script: PathBuf,
    /// The L4 spread in front of the replicas: random (a random replica per
    /// request, keep-alive connections) or haproxy (HAProxy in TCP mode, round
    /// robin, a new connection per request).
    #[arg(long, default_value = "random")]
    spread: String,
    /// The HAProxy script (CONFIG) for --spread haproxy; installs haproxy if missing.
    #[arg(long, default_value = "deploy/cluster/haproxy")]
    haproxy_script: PathBuf,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Keep the generated configs and the processes' logs (the path is printed).
    #[arg(long)]
    keep: bool,
    /// Also, per workload and round: the trace's first half to one replica, then a
    /// second replica started (joining the cluster) serving the second half alone,
    /// against one replica serving both halves.
    #[arg(long)]
    late: bool,
    /// Also write the Markdown tables to this file.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Args)]
struct WireArgs {
    /// Milliseconds per round.
    #[arg(long, default_value_t = 300)]
    millis: u64,
    /// Rounds; the median is reported.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
}

#[derive(Args)]
struct BusArgs {
    /// Transports, comma-separated: nats-core, nats-jetstream, redis-pubsub,
    /// redis-streams, baseline (no bus: the bench's own channel, batching and
    /// encoding). Ratios are to the first one that is not the baseline.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "nats-core,redis-pubsub,nats-jetstream,redis-streams,baseline"
    )]
    transports: Vec<String>,
    /// Offered event rates, events per second, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "50000,500000")]
    rates: Vec<u64>,
    /// Rounds; transports and rates are interleaved within each round.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Measured seconds per cell (after the warm-up).
    #[arg(long, default_value_t = 2.0)]
    secs: f64,
    #[arg(long, default_value_t = 0.5)]
    warmup_secs: f64,
    /// A message is sent per this many events ...
    #[arg(long, default_value_t = 64)]
    batch_events: usize,
    /// ... or this many milliseconds after its first event, whichever comes first.
    #[arg(long, default_value_t = 1.0)]
    batch_ms: f64,
    #[arg(long, default_value_t = 14222)]
    nats_port: u16,
    #[arg(long, default_value_t = 16379)]
    redis_port: u16,
    /// The script that runs a broker (PORT KIND); default deploy/cluster/bus.
    #[arg(long, default_value = "deploy/cluster/bus")]
    bus_script: PathBuf,
    /// Fault run: SIGKILL the broker this many seconds into each cell (counted from
    /// the cell's start, warm-up included) and restart it on the same port.
    #[arg(long)]
    restart_after: Option<f64>,
    /// Fault run: how long the broker stays down.
    #[arg(long, default_value_t = 1.0)]
    down_secs: f64,
}

#[derive(Args)]
struct RealArgs {
    /// Engines to start.
    #[arg(long, default_value_t = 3)]
    engines: usize,
    /// The test model: tiny or small (deploy/vllm/make_model.py).
    #[arg(long, default_value = "small")]
    model: String,
    /// Workloads to run, comma-separated: docs, multiturn.
    #[arg(long, value_delimiter = ',', default_value = "docs,multiturn")]
    workloads: Vec<WorkloadArg>,
    /// Concurrencies, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,4,8")]
    concurrency: Vec<usize>,
    /// Policies (X-Router-Policy values), comma-separated; `prefix_aware_precise` is
    /// prefix_aware on a second gateway in precise mode (tokenizer, chat template and
    /// the engines' KV events); `prefix_aware_fixed_queue` is prefix_aware on a gateway
    /// that does not learn the delay per request ahead, `prefix_aware_no_eviction` one
    /// that does not price eviction, `prefix_aware_wait_first` one that places a new
    /// prefix on the shortest wait rather than by free cache room,
    /// `prefix_aware_no_fixed_delay` one that learns the prefill cost as a rate per
    /// token alone, `prefix_aware_free_room_only` one that counts only truly free
    /// blocks as cache room, `prefix_aware_room_first` one that places a new prefix
    /// by cache room alone, `prefix_aware_no_footprint` one that prices a new prefix
    /// at its size now, not at what prompts lately grew to,
    /// `prefix_aware_no_shared_compute` one not told which engines share a core (no
    /// `compute_group`; the others are), `prefix_aware_no_cache_in_use` one that
    /// counts a cached prefix whole however much of its engine's cache the requests
    /// in flight there hold, `prefix_aware_keep_unused_placements` one that counts a
    /// new prefix placed lately whether or not prompts still use it (the ablations).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "round_robin,least_loaded,prefix_aware,prefix_aware_precise"
    )]
    policies: Vec<String>,
    /// Requests per run. 96: at 48 a p95 is the 3rd-slowest request, and one engine
    /// stall of several seconds decided a cell.
    #[arg(long, default_value_t = 96)]
    requests: u64,
    /// docs: documents (each about 1500 tokens at the default --doc-bytes).
    #[arg(long, default_value_t = 6)]
    docs: usize,
    #[arg(long, default_value_t = 2000)]
    doc_bytes: usize,
    #[arg(long, default_value_t = 8)]
    questions: usize,
    /// multiturn: conversations and turns.
    #[arg(long, default_value_t = 8)]
    conversations: usize,
    #[arg(long, default_value_t = 6)]
    turns: usize,
    #[arg(long, default_value_t = 8)]
    max_tokens: u32,
    /// The gateway's routing.bytes_per_token (the test tokenizer: ~1.4 on this text).
    #[arg(long, default_value_t = 1.4)]
    bytes_per_token: f64,
    /// First engine port (engine i listens on port+i and publishes KV events to port+100+i).
    #[arg(long, default_value_t = 18200)]
    base_port: u16,
    /// The radixgate binary; default: `radixgate` next to this one.
    #[arg(long)]
    gateway_bin: Option<PathBuf>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Every engine's KV cache in blocks (vLLM's --num-gpu-blocks-override), to make
    /// it smaller than the working set as in production.
    #[arg(long)]
    kv_blocks: Option<u32>,
    /// The gateway's retry.first_token_timeout_ms under every policy: a stream whose
    /// engine has sent no token this long after it arrived moves to another engine
    /// (0: off).
    #[arg(long, default_value_t = 0)]
    first_token_timeout_ms: u64,
    /// The gateway's retry.first_token_timeout_factor under every policy: the
    /// deadline is at least this many times the request's estimated TTFT.
    #[arg(long, default_value_t = 0.0)]
    first_token_timeout_factor: f64,
    /// More vLLM arguments for every engine, as one string (split on whitespace).
    #[arg(long, allow_hyphen_values = true, default_value = "")]
    engine_args: String,
    /// More vLLM arguments for one engine: `I=ARGS` (repeatable), e.g.
    /// `--engine-args-for '0=--max-num-seqs 1'` for a heterogeneous fleet.
    #[arg(long, allow_hyphen_values = true, value_parser = parse_engine_args_for)]
    engine_args_for: Vec<(usize, String)>,
    /// Engine i is pinned to the i-th entry, comma-separated (a core or a range such
    /// as 0-1); e.g. `0,0,1`: two engines share core 0 and are slower than the third.
    /// Default: core i mod the host's CPUs.
    #[arg(long, value_delimiter = ',')]
    engine_cores: Vec<String>,
    /// The TTFT objective for goodput, in milliseconds.
    #[arg(long, default_value_t = 1000)]
    slo_ms: u64,
    /// The engines' KV block in tokens (vLLM's CPU backend: 128), for the ceiling.
    #[arg(long, default_value_t = 128)]
    block_tokens: usize,
    /// Also write the Markdown tables to this file, and next to it SVG plots (hit
    /// rate, TTFT CDF, load per backend per workload and concurrency) and each run's
    /// per-request traces as CSV.
    #[arg(long)]
    out: Option<PathBuf>,
}

fn parse_engine_args_for(s: &str) -> Result<(usize, String), String> {
    let (i, args) = s
        .split_once('=')
        .ok_or_else(|| format!("expected I=ARGS, got {s:?}"))?;
    let i = i
        .trim()
        .parse()
        .map_err(|_| format!("expected an engine index before '=', got {i:?}"))?;
    Ok((i, args.to_string()))
}

#[derive(Clone, Copy, ValueEnum)]
enum TraceWorkload {
    Docs,
    Multiturn,
}

#[derive(Clone, Copy, ValueEnum)]
enum TraceDistribution {
    Uniform,
    Zipf,
}

#[derive(Args)]
struct GenTraceArgs {
    #[arg(long, value_enum)]
    workload: TraceWorkload,
    /// docs: how documents are chosen.
    #[arg(long, value_enum, default_value_t = TraceDistribution::Uniform)]
    distribution: TraceDistribution,
    /// docs: the Zipf exponent.
    #[arg(long, default_value_t = 1.0)]
    alpha: f64,
    #[command(flatten)]
    shape: WorkloadFlags,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Mean arrival rate, requests per second (Poisson); 0: every `at_ms` is 0.
    #[arg(long, default_value_t = 0.0)]
    rate: f64,
    /// The "model" field of every request.
    #[arg(long, default_value = "sim")]
    model: String,
    /// The "max_tokens" field of every request.
    #[arg(long, default_value_t = 16)]
    max_tokens: u32,
}

#[derive(Args)]
struct ReplayArgs {
    /// The JSONL trace (see `gen-trace`).
    trace: PathBuf,
    /// The gateway; a URL without a path gets /v1/chat/completions. Several
    /// (comma-separated or repeated): replicas, each request sent to one at random.
    #[arg(long, value_delimiter = ',', default_value = "http://127.0.0.1:8080")]
    url: Vec<String>,
    /// Seeds the random choice among several --url targets.
    #[arg(long, default_value_t = 1)]
    spread_seed: u64,
    /// Requests in flight at most (one connection each).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=MAX_CONCURRENCY as i64))]
    concurrency: u32,
    /// Divide every `at_ms` by this; 0 ignores the timing (turn order still holds).
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
    /// Extra request header, "Name: value"; repeatable.
    #[arg(long = "header", value_name = "NAME: VALUE", value_parser = parse_header)]
    headers: Vec<(String, String)>,
    /// Per-socket-operation timeout in seconds.
    #[arg(long, default_value_t = 60)]
    timeout_secs: u64,
    /// Also write one JSON line per request (trace order) to this file.
    #[arg(long)]
    records: Option<PathBuf>,
    /// Print one JSON object instead of Markdown tables.
    #[arg(long)]
    json: bool,
    /// Write SVG plots (TTFT distribution, load per backend, hit rate) into this
    /// directory as `replay-<trace>-*.svg`, linked under the tables.
    #[arg(long)]
    plots: Option<PathBuf>,
}

#[derive(Clone, Copy, ValueEnum)]
enum WorkloadArg {
    /// One chat body padded to --body-bytes.
    Fixed,
    /// --docs shared documents, each asked --questions different questions.
    Docs,
    /// --conversations conversations growing a turn per request, up to --turns.
    Multiturn,
}

#[derive(Args)]
struct LoadArgs {
    /// Target URL (plain http).
    #[arg(long, default_value = "http://127.0.0.1:8080/v1/chat/completions")]
    url: String,
    /// Connections, one thread each.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=MAX_CONCURRENCY as i64))]
    concurrency: u32,
    /// Requests in all; 0 for no count limit (then --duration-secs is required).
    #[arg(long, default_value_t = 2000)]
    requests: u64,
    /// Stop starting requests after this many seconds (whichever limit comes first).
    #[arg(long)]
    duration_secs: Option<u64>,
    /// The "model" field of every request.
    #[arg(long, default_value = "sim")]
    model: String,
    #[arg(long, value_enum, default_value_t = WorkloadArg::Fixed)]
    workload: WorkloadArg,
    /// fixed: total body size in bytes.
    #[arg(long, default_value_t = 2048)]
    body_bytes: usize,
    /// docs: number of shared documents.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..))]
    docs: u32,
    /// docs: bytes per document.
    #[arg(long, default_value_t = 4000)]
    doc_bytes: usize,
    /// docs: distinct questions per document.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..))]
    questions: u32,
    /// multiturn: conversations in flight.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    conversations: u32,
    /// multiturn: turns before a conversation starts over.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..))]
    turns: u32,
    /// The "max_tokens" field of every request.
    #[arg(long, default_value_t = 16)]
    max_tokens: u32,
    /// Ask for SSE streaming responses (with usage in the last event).
    #[arg(long)]
    stream: bool,
    /// Add `"ignore_eos":true` (vLLM: every answer has exactly max_tokens tokens).
    #[arg(long)]
    ignore_eos: bool,
    /// Seed for the workload's pseudo-random content.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Extra request header, "Name: value"; repeatable.
    #[arg(long = "header", value_name = "NAME: VALUE", value_parser = parse_header)]
    headers: Vec<(String, String)>,
    /// Per-socket-operation timeout (connect, read, write) in seconds.
    #[arg(long, default_value_t = 60)]
    timeout_secs: u64,
    /// Open loop: start requests at Poisson arrival times of this many per second
    /// (seeded by --seed) instead of back to back; --concurrency bounds the requests
    /// in flight, so give it more than the rate times the longest answer.
    #[arg(long)]
    rate: Option<f64>,
    /// Print one JSON object instead of Markdown tables.
    #[arg(long)]
    json: bool,
    /// Write SVG plots (TTFT distribution, load per backend, hit rate) into this
    /// directory as `load-<workload>-c<concurrency>-*.svg`, linked under the tables.
    #[arg(long)]
    plots: Option<PathBuf>,
}

fn parse_header(s: &str) -> Result<(String, String), String> {
    let (name, value) = s.split_once(':').ok_or("expected \"Name: value\"")?;
    let name = name.trim();
    let value = value.trim();
    let token = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
    if name.is_empty() || !name.chars().all(token) {
        return Err(format!("bad header name {name:?}"));
    }
    if value.contains(['\r', '\n']) {
        return Err("header values cannot contain CR or LF".into());
    }
    if name.eq_ignore_ascii_case("content-length") || name.eq_ignore_ascii_case("transfer-encoding")
    {
        return Err(format!("{name} is set by the load generator"));
    }
    Ok((name.to_string(), value.to_string()))
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Load(args) => load_command(args),
        Command::Sim(args) => {
            print!("{}", radixgate_bench::sim::cli::run(&args));
            ExitCode::SUCCESS
        }
        Command::GenTrace(args) => gen_trace_command(args),
        Command::Replay(args) => replay_command(args),
        Command::Real(args) => real_command(args),
        Command::Bus(args) => bus_command(args),
        Command::Cluster(args) => cluster_command(args),
        Command::Wire(args) => {
            println!(
                "{}",
                radixgate_bench::wire_cost::run(args.millis, args.rounds.max(1))
            );
            ExitCode::SUCCESS
        }
    }
}

fn bus_command(args: BusArgs) -> ExitCode {
    let transports = match args
        .transports
        .iter()
        .map(|t| bus::Transport::parse(t))
        .collect::<Result<Vec<_>, _>>()
    {
        Ok(t) if !t.is_empty() => t,
        Ok(_) => {
            eprintln!("error: no transports");
            return ExitCode::from(2);
        }
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    if args.batch_events == 0 || args.rates.contains(&0) || args.secs <= 0.0 {
        eprintln!("error: --batch-events, --rates and --secs must be positive");
        return ExitCode::from(2);
    }
    let cfg = bus::BusConfig {
        transports,
        rates: args.rates,
        rounds: args.rounds.max(1),
        secs: args.secs,
        warmup_secs: args.warmup_secs,
        batch_events: args.batch_events,
        batch_ms: args.batch_ms,
        nats_port: args.nats_port,
        redis_port: args.redis_port,
        bus_script: args.bus_script,
        restart_after_secs: args.restart_after,
        down_secs: args.down_secs,
    };
    match bus::run(&cfg) {
        Ok((results, load_before, load_after)) => {
            println!("{}", bus::report(&cfg, &results));
            println!("load average (1, 5, 15 min): before {load_before}, after {load_after}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn cluster_command(args: ClusterArgs) -> ExitCode {
    use radixgate_bench::cluster::{self, ClusterConfig, Workload};
    use radixgate_bench::sim::workload::{DocsConfig, MultiturnConfig};
    let mut shared = Vec::new();
    for s in &args.shared {
        match s.as_str() {
            "yes" | "shared" => shared.push(true),
            "no" | "unshared" => shared.push(false),
            "both" => shared.extend([true, false]),
            other => {
                eprintln!("error: --shared takes yes, no or both, not {other:?}");
                return ExitCode::from(2);
            }
        }
    }
    let spread = match cluster::Spread::parse(&args.spread) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    if args.replicas.is_empty() || args.replicas.contains(&0) || args.engines == 0 {
        eprintln!("error: --replicas and --engines must be positive");
        return ExitCode::from(2);
    }
    let workloads = args
        .workloads
        .iter()
        .map(|w| match w {
            TraceWorkload::Docs => Workload::Docs(DocsConfig {
                docs: args.docs.max(1),
                doc_bytes: args.doc_bytes,
                requests: args.requests,
                ..DocsConfig::default()
            }),
            TraceWorkload::Multiturn => Workload::Multiturn(MultiturnConfig {
                sessions: args.sessions.max(1),
                turns: args.turns.max(1),
                ..MultiturnConfig::default()
            }),
        })
        .collect();
    let gateway_bin = args.radixgate.unwrap_or_else(|| {
        let me = std::env::current_exe().unwrap_or_default();
        me.with_file_name("radixgate")
    });
    let cfg = ClusterConfig {
        gateway_bin,
        bus_script: args.bus_script,
        replicas: args.replicas,
        shared,
        workloads,
        engines: args.engines,
        cache_blocks: args.cache_blocks,
        concurrency: args.concurrency as usize,
        rounds: args.rounds.max(1),
        seed: args.seed,
        shards: args.shards.max(1),
        max_tokens: args.max_tokens,
        cluster_extra: args.cluster_extra,
        keep: args.keep,
        late: args.late,
        spread,
        haproxy_script: args.haproxy_script,
    };
    match cluster::run(&cfg, |line| eprintln!("{line}")) {
        Ok((cells, late, before, after)) => {
            let mut text = cluster::to_markdown(&cfg, &cells);
            text.push_str(&cluster::late_markdown(&late));
            let _ = std::fmt::Write::write_fmt(
                &mut text,
                format_args!("\nload average (1, 5, 15 min): before {before}, after {after}\n"),
            );
            print!("{text}");
            if let Some(path) = args.out {
                if let Err(e) = std::fs::write(&path, &text) {
                    eprintln!("error: cannot write {}: {e}", path.display());
                    return ExitCode::FAILURE;
                }
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn real_command(args: RealArgs) -> ExitCode {
    use radixgate_bench::real::{self, RealConfig};
    let Some(repo) = real::find_repo() else {
        eprintln!("error: run from the radixgate checkout (or set RADIXGATE_REPO)");
        return ExitCode::from(2);
    };
    let gateway_bin = args.gateway_bin.unwrap_or_else(|| {
        let me = std::env::current_exe().unwrap_or_default();
        me.with_file_name("radixgate")
    });
    let workloads = args
        .workloads
        .iter()
        .map(|w| match w {
            WorkloadArg::Docs => Kind::Docs,
            WorkloadArg::Multiturn => Kind::Multiturn,
            WorkloadArg::Fixed => Kind::Fixed,
        })
        .collect();
    let cfg = RealConfig {
        repo,
        gateway_bin,
        engines: args.engines,
        model: args.model,
        workloads,
        concurrency: args.concurrency,
        policies: args.policies,
        requests: args.requests,
        docs: args.docs,
        doc_bytes: args.doc_bytes,
        questions: args.questions,
        conversations: args.conversations,
        turns: args.turns,
        max_tokens: args.max_tokens,
        bytes_per_token: args.bytes_per_token,
        base_port: args.base_port,
        seed: args.seed,
        kv_blocks: args.kv_blocks,
        engine_args: args
            .engine_args
            .split_whitespace()
            .map(str::to_string)
            .collect(),
        engine_args_for: args.engine_args_for,
        engine_cores: args.engine_cores,
        first_token_timeout_ms: args.first_token_timeout_ms,
        first_token_timeout_factor: args.first_token_timeout_factor,
        slo_ms: args.slo_ms,
        block_tokens: args.block_tokens,
    };
    // vLLM refuses to start with a cache that cannot hold one request of the
    // model's length (fleet.sh serves 4096 tokens).
    let sets_length = cfg
        .engine_args
        .iter()
        .any(|a| a.starts_with("--max-model-len"));
    if let Some(n) = cfg
        .kv_blocks
        .filter(|&n| !sets_length && (n as usize) * cfg.block_tokens < 4096)
    {
        eprintln!(
            "error: --kv-blocks {n} holds {} tokens, less than one 4096-token request; use at least {} or add --max-model-len to --engine-args",
            n as usize * cfg.block_tokens,
            4096usize.div_ceil(cfg.block_tokens)
        );
        return ExitCode::from(2);
    }
    if let Some(&(i, _)) = cfg.engine_args_for.iter().find(|(i, _)| *i >= cfg.engines) {
        eprintln!(
            "error: --engine-args-for names engine {i}, but there are {} engines",
            cfg.engines
        );
        return ExitCode::from(2);
    }
    let rows = match real::run(&cfg, |line| eprintln!("{line}")) {
        Ok(rows) => rows,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut table = real::to_markdown(&rows, cfg.slo_ms);
    if let Some(path) = &args.out {
        // Plots go next to the table file, linked under it.
        let dir = path.parent().unwrap_or(std::path::Path::new("."));
        let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("real");
        if let Err(e) = real::write_traces(&rows, dir, stem) {
            eprintln!("error: cannot write traces: {e}");
            return ExitCode::FAILURE;
        }
        match real::write_plots(&rows, dir, stem) {
            Ok(links) => table.push_str(&links),
            Err(e) => {
                eprintln!("error: cannot write plots: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    print!("{table}");
    if let Some(path) = args.out {
        if let Err(e) = std::fs::write(&path, &table) {
            eprintln!("error: cannot write {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}

fn gen_trace_command(args: GenTraceArgs) -> ExitCode {
    let spec = match args.workload {
        TraceWorkload::Docs => {
            WorkloadSpec::Docs(args.shape.docs_config(match args.distribution {
                TraceDistribution::Uniform => Distribution::Uniform,
                TraceDistribution::Zipf => Distribution::Zipf(args.alpha),
            }))
        }
        TraceWorkload::Multiturn => WorkloadSpec::Multiturn(args.shape.multiturn_config()),
    };
    let sessions = sim_workload::build(&spec, args.seed, &args.model, args.max_tokens);
    let lines = trace::generate(&sessions, args.rate.max(0.0), args.seed);
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    for line in &lines {
        if writeln!(out, "{}", line.to_json()).is_err() {
            return ExitCode::FAILURE;
        }
    }
    if out.flush().is_err() {
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

fn replay_command(args: ReplayArgs) -> ExitCode {
    let mut targets = Vec::with_capacity(args.url.len());
    for url in &args.url {
        let mut target = match Target::parse(url) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::from(2);
            }
        };
        if target.path == "/" {
            target.path = "/v1/chat/completions".into();
        }
        targets.push(target);
    }
    let mut text = String::new();
    if let Err(e) = std::fs::File::open(&args.trace).and_then(|mut f| f.read_to_string(&mut text)) {
        eprintln!("error: cannot read {}: {e}", args.trace.display());
        return ExitCode::from(2);
    }
    let lines = match trace::parse(&text) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("error: {}: {e}", args.trace.display());
            return ExitCode::from(2);
        }
    };
    let cfg = ReplayConfig {
        targets,
        spread_seed: args.spread_seed,
        concurrency: args.concurrency as usize,
        speedup: args.speedup,
        headers: args.headers,
        timeout: Duration::from_secs(args.timeout_secs.max(1)),
    };
    let result = match replay::run(&cfg, &lines) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start replay threads: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(path) = &args.records {
        let mut text = String::new();
        for r in &result.records {
            text.push_str(&r.to_json());
            text.push('\n');
        }
        if let Err(e) = std::fs::write(path, text) {
            eprintln!("error: cannot write {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
    }
    let workload = format!("trace {} ({} requests)", args.trace.display(), lines.len());
    let urls = args.url.join(", ");
    let report = Report {
        url: &urls,
        workload: &workload,
        concurrency: cfg.concurrency,
        stream: false,
        elapsed: result.elapsed,
        stats: &result.stats,
    };
    let trace_name = args
        .trace
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("trace");
    print_report(
        &report,
        args.json,
        args.plots.as_deref(),
        &format!("replay {trace_name}"),
    );
    if result.stats.ok == 0 && result.stats.failed() > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// Prints a load or replay report (Markdown or JSON) and, with `plots`, writes its
/// plots there as `<slug of name>-*.svg`: linked under the Markdown, or their paths
/// on stderr next to JSON.
fn print_report(report: &Report<'_>, json: bool, plots: Option<&std::path::Path>, name: &str) {
    let links = plots.map(|dir| {
        let title = format!("{}, concurrency {}", report.workload, report.concurrency);
        let stem = radixgate_bench::plots::slug(name);
        radixgate_bench::plots::write_run(dir, &stem, &title, report.stats)
    });
    if json {
        println!("{}", report.to_json());
        match links {
            Some(Ok(paths)) => paths
                .iter()
                .for_each(|p| eprintln!("plot: {}", p.display())),
            Some(Err(e)) => eprintln!("error: plots not written: {e}"),
            None => {}
        }
    } else {
        print!("{}", report.to_markdown());
        if let Some(written) = links {
            print!("{}", radixgate_bench::plots::linked(written, name));
        }
    }
}

fn load_command(args: LoadArgs) -> ExitCode {
    if args.requests == 0 && args.duration_secs.is_none() {
        eprintln!("error: --requests 0 needs --duration-secs");
        return ExitCode::from(2);
    }
    let target = match Target::parse(&args.url) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let kind = match args.workload {
        WorkloadArg::Fixed => Kind::Fixed,
        WorkloadArg::Docs => Kind::Docs,
        WorkloadArg::Multiturn => Kind::Multiturn,
    };
    let workload = Workload::new(WorkloadConfig {
        kind,
        model: args.model,
        max_tokens: args.max_tokens,
        stream: args.stream,
        ignore_eos: args.ignore_eos,
        seed: args.seed,
        body_bytes: args.body_bytes,
        docs: args.docs as usize,
        doc_bytes: args.doc_bytes,
        questions: args.questions as usize,
        conversations: args.conversations as usize,
        turns: args.turns as usize,
    });
    let cfg = LoadConfig {
        target,
        concurrency: args.concurrency as usize,
        requests: (args.requests > 0).then_some(args.requests),
        duration: args.duration_secs.map(Duration::from_secs),
        headers: args.headers,
        timeout: Duration::from_secs(args.timeout_secs.max(1)),
        rate: args.rate,
        seed: args.seed,
        trace: false,
    };
    if args.rate.is_some_and(|r| !(r > 0.0 && r.is_finite())) {
        eprintln!("error: --rate must be a positive number of requests per second");
        return ExitCode::FAILURE;
    }
    let result = match load::run(&cfg, &workload) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start connection threads: {e}");
            return ExitCode::FAILURE;
        }
    };
    if result.max_late > Duration::from_millis(10) {
        eprintln!(
            "warning: open loop fell behind: a request started {:?} after its arrival time (every connection was busy; raise --concurrency)",
            result.max_late
        );
    }
    let report = Report {
        url: &args.url,
        workload: kind.name(),
        concurrency: cfg.concurrency,
        stream: args.stream,
        elapsed: result.elapsed,
        stats: &result.stats,
    };
    print_report(
        &report,
        args.json,
        args.plots.as_deref(),
        &format!("load {} c{}", kind.name(), cfg.concurrency),
    );
    if result.stats.ok == 0 && result.stats.failed() > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn parses_the_documented_command_line() {
        let cli = Cli::try_parse_from([
            "radixgate-bench",
            "load",
            "--url",
            "http://127.0.0.1:8080/v1/chat/completions",
            "--concurrency",
            "8",
            "--requests",
            "2000",
            "--model",
            "sim",
            "--workload",
            "docs",
            "--body-bytes",
            "2048",
            "--max-tokens",
            "16",
            "--stream",
            "--seed",
            "1",
            "--header",
            "X-Router-Policy: round_robin",
            "--header",
            "X-Tenant: t1",
            "--json",
        ])
        .unwrap();
        let Command::Load(a) = cli.command else {
            panic!("parsed as load")
        };
        assert_eq!(
            a.headers,
            vec![
                ("X-Router-Policy".to_string(), "round_robin".to_string()),
                ("X-Tenant".to_string(), "t1".to_string()),
            ]
        );
        assert!(a.stream && a.json);
        assert!(Cli::try_parse_from(["radixgate-bench", "load", "--concurrency", "0"]).is_err());
        for line in [
            "radixgate-bench sim",
            "radixgate-bench sim --workload docs --distribution zipf --alpha 1.0 --json",
            "radixgate-bench sim --sweep alpha --policy prefix_aware,round_robin",
            "radixgate-bench sim --min-match-blocks 4 --saturation-inflight 64 --hysteresis 0.2 --queue-ms-per-request 2",
            "radixgate-bench gen-trace --workload multiturn --seed 3 --rate 20",
            "radixgate-bench gen-trace --workload docs --distribution zipf --docs 5 --requests 10",
            "radixgate-bench replay --url http://127.0.0.1:8080 trace.jsonl --concurrency 8 --speedup 2 --header X-Tenant:t --json",
            "radixgate-bench replay trace.jsonl --plots /tmp/plots",
            "radixgate-bench load --workload docs --plots /tmp/plots",
            "radixgate-bench sim --sweep docs --plots /tmp/plots",
            "radixgate-bench sim --edge --plots /tmp/plots",
            "radixgate-bench replay trace.jsonl --url http://127.0.0.1:8081,http://127.0.0.1:8082 --spread-seed 3",
            "radixgate-bench cluster --radixgate target/release/radixgate --replicas 1,2,4 --shared yes,no --workloads docs,multiturn --rounds 2",
        ] {
            if let Err(e) = Cli::try_parse_from(line.split(' ')) {
                panic!("{line}: {e}");
            }
        }
        assert!(Cli::try_parse_from(["radixgate-bench", "sim", "--policy", "nope"]).is_err());
        assert!(Cli::try_parse_from(["radixgate-bench", "replay"]).is_err());
        assert!(parse_header("Content-Length: 3").is_err());
        assert!(parse_header("Bad Name: x").is_err());
    }
}
