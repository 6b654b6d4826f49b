//! The `radixgate` command: `serve`, `check-config`, `demo` and `engine-sim`.

use clap::{Parser, Subcommand};
use radixgate::config::{Config, IoMode, Protocol, Role};
use radixgate::engine_sim::{self, EngineConfig};
use radixgate::runtime::Driver;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "radixgate",
    version,
    about = "Cache-aware OpenAI-compatible LLM inference gateway"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway with a TOML config file.
    Serve {
        #[arg(long)]
        config: PathBuf,
    },
    /// Check a config file; print every error with its key path.
    CheckConfig { file: PathBuf },
    /// Three simulated engines and the gateway in one process, ready for curl.
    Demo {
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: SocketAddr,
        /// Routing policy (prefix_aware, round_robin, random, least_loaded, consistent_hash).
        #[arg(long, default_value = "prefix_aware")]
        policy: String,
        /// Two prefill and two decode engines with the gateway in split mode, speaking
        /// the given hand-off protocol (vllm or sglang).
        #[arg(long, value_name = "PROTOCOL", num_args = 0..=1, default_missing_value = "vllm")]
        disagg: Option<String>,
        /// N gateway replicas in cluster mode (on --listen's port and the next ones),
        /// sharing routing state over a Redis bus the demo starts.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=16))]
        replicas: u16,
        /// With --replicas: use this bus (redis://HOST:PORT) instead of starting one.
        #[arg(long)]
        bus: Option<String>,
        /// The engines tokenize prompts as vLLM does with this tokenizer.json (and
        /// the chat template beside it) and answer in its words, so a client's
        /// tokenizer counts what `usage` says.
        #[arg(long)]
        tokenizer: Option<String>,
        /// The chat template (Jinja file or tokenizer_config.json); default: the one
        /// beside --tokenizer.
        #[arg(long, requires = "tokenizer")]
        chat_template: Option<String>,
    },
    /// Run one simulated vLLM-compatible engine.
    EngineSim(Box<EngineArgs>),
    /// Print the SHA-256 hex digest of an API key, for `[[tenants]] keys`.
    HashKey {
        /// The key (or `-` to read it from stdin, keeping it out of shell history).
        key: String,
    },
}

#[derive(clap::Args)]
struct EngineArgs {
    #[arg(long, default_value = "127.0.0.1:9001")]
    listen: SocketAddr,
    #[arg(long, default_value = "sim")]
    model: String,
    /// Prefix-cache capacity in blocks.
    #[arg(long, default_value_t = 4096)]
    cache_blocks: usize,
    /// Tokens per cache block.
    #[arg(long, default_value_t = 16)]
    block_tokens: usize,
    /// Prefill cost per uncached prompt token, in microseconds.
    #[arg(long, default_value_t = 20)]
    prefill_us_per_token: u64,
    /// Decode cost per output token, in microseconds.
    #[arg(long, default_value_t = 2000)]
    decode_us_per_token: u64,
    /// Requests decoded at once.
    #[arg(long, default_value_t = 32)]
    max_batch: usize,
    /// Waiting requests beyond this get 503.
    #[arg(long, default_value_t = 1024)]
    max_waiting: usize,
    /// Output tokens when a request gives no max_tokens.
    #[arg(long, default_value_t = 16)]
    default_max_tokens: u64,
    /// Share of requests answered with 503.
    #[arg(long, default_value_t = 0.0)]
    fail_rate: f64,
    /// Share of requests delayed by --spike-ms before their first token.
    #[arg(long, default_value_t = 0.0)]
    spike_rate: f64,
    #[arg(long, default_value_t = 500)]
    spike_ms: u64,
    /// Share of streams cut off halfway.
    #[arg(long, default_value_t = 0.0)]
    abort_rate: f64,
    /// Send a stream's response head before its prefill, as vLLM does (default:
    /// with the first token).
    #[arg(long)]
    stream_head_first: bool,
    /// Share of connections closed right after accept.
    #[arg(long, default_value_t = 0.0)]
    refuse_rate: f64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Answer every completion at once with one small constant body, without parsing
    /// or simulating anything (proxy benchmarks).
    #[arg(long)]
    fixed_response: bool,
    /// With --fixed-response, wait this many microseconds before each answer.
    #[arg(long, default_value_t = 0)]
    fixed_delay_us: u64,
    /// Part in a split pool: both (whole requests), prefill or decode.
    #[arg(long, default_value = "both")]
    role: String,
    /// Hand-off protocol of a prefill or decode engine: vllm or sglang.
    #[arg(long, default_value = "vllm")]
    protocol: String,
    /// SGLang prefill engines: the bootstrap server's port.
    #[arg(long)]
    bootstrap_port: Option<u16>,
    /// I/O driver: auto, io_uring or epoll.
    #[arg(long, default_value = "auto")]
    io: String,
    /// Tokenize prompts as vLLM does with this tokenizer.json (and its chat
    /// template), so blocks match a precise-mode gateway's.
    #[arg(long)]
    tokenizer: Option<String>,
    /// The chat template (Jinja file or tokenizer_config.json); default: the one
    /// beside --tokenizer.
    #[arg(long, requires = "tokenizer")]
    chat_template: Option<String>,
    /// Publish KV-cache events as vLLM does to this ZeroMQ endpoint: bound for
    /// tcp://*:PORT and ipc://, connected for tcp://HOST:PORT.
    #[arg(long)]
    kv_events: Option<String>,
    /// vLLM's replay_endpoint: a ROUTER bound here answers replay requests.
    #[arg(long, requires = "kv_events")]
    kv_events_replay: Option<String>,
    /// The first frame of every KV-event message (vLLM's topic).
    #[arg(long, default_value = "", requires = "kv_events")]
    kv_events_topic: String,
    /// Batches kept for replay (vLLM's buffer_steps).
    #[arg(long, default_value_t = 10_000)]
    kv_events_buffer: usize,
    /// Tests: every Nth KV-event batch is buffered for replay but not sent.
    #[arg(long, default_value_t = 0)]
    kv_events_lose_every: u64,
    /// Serve NAME as a LoRA adapter of --model (repeatable): listed in /v1/models
    /// with `parent`, accepted as a request's model, cached apart from the model.
    #[arg(long = "lora", value_name = "NAME")]
    loras: Vec<String>,
}

fn parse_protocol(s: &str) -> Result<Protocol, String> {
    radixgate::config::parse_enum(s)
}

/// Logs go to stderr (buffered on the access-log thread: [`radixgate::log_writer`]);
/// `RUST_LOG` overrides the configured level.
fn init_logging(level: &str, json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        // Colours only on a terminal: a log file or a collector gets plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(radixgate::log_writer::Stderr);
    if json {
        builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .init();
    } else {
        builder.init();
    }
}

/// Blocks until SIGINT or SIGTERM. With `reload`, SIGHUP calls it and waits on;
/// without, SIGHUP (a closed terminal) stops too.
fn wait_for_signals(reload: Option<&dyn Fn()>) {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let mut signals = match signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP]) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("radixgate: cannot handle signals ({e}); stop the process with SIGKILL");
            loop {
                std::thread::park();
            }
        }
    };
    for signal in signals.forever() {
        match (signal, reload) {
            (SIGHUP, Some(reload)) => reload(),
            _ => return,
        }
    }
}

/// SIGHUP: reload the config file, logging what changed or why nothing did.
fn reload_on_sighup(gateway: &radixgate::Gateway) {
    match gateway.reload() {
        Ok(summary) => tracing::info!(
            keys = %radixgate::reload::describe(&summary),
            "SIGHUP: config reloaded"
        ),
        Err(e) => tracing::error!(error = %e.message, "SIGHUP: config reload refused"),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::HashKey { key } => {
            let key = if key == "-" {
                let mut line = String::new();
                let _ = std::io::stdin().read_line(&mut line);
                line.trim().to_string()
            } else {
                key
            };
            println!("{}", radixgate::tenants::hash_key(&key));
            ExitCode::SUCCESS
        }
        Command::CheckConfig { file } => match Config::load(&file) {
            Ok(c) => {
                println!(
                    "{}: ok ({} shards, {} backends, policy {})",
                    file.display(),
                    c.server.shards,
                    c.backends.len(),
                    c.routing.policy.as_str()
                );
                ExitCode::SUCCESS
            }
            Err(errors) => {
                for e in &errors.0 {
                    eprintln!("{}: {e}", file.display());
                }
                ExitCode::FAILURE
            }
        },
        Command::Serve { config } => {
            let config = match Config::load(&config) {
                Ok(c) => c,
                Err(errors) => {
                    for e in &errors.0 {
                        eprintln!("{}: {e}", config.display());
                    }
                    return ExitCode::FAILURE;
                }
            };
            init_logging(&config.log.level, config.log.json);
            let gateway = match radixgate::Gateway::start(config) {
                Ok(g) => g,
                Err(e) => {
                    eprintln!("radixgate: could not start: {e}");
                    return ExitCode::FAILURE;
                }
            };
            wait_for_signals(Some(&|| reload_on_sighup(&gateway)));
            gateway.shutdown();
            ExitCode::SUCCESS
        }
        Command::Demo {
            listen,
            policy,
            disagg,
            replicas,
            bus,
            tokenizer,
            chat_template,
        } => {
            init_logging("info", false);
            let tokenizer = match tokenizer
                .as_deref()
                .map(|path| engine_sim::SimTokenizer::load(path, chat_template.as_deref()))
            {
                None => None,
                Some(Ok(t)) => Some(t),
                Some(Err(e)) => {
                    eprintln!("--tokenizer: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let protocol = match disagg.as_deref().map(parse_protocol) {
                None => None,
                Some(Ok(p)) => Some(p),
                Some(Err(e)) => {
                    eprintln!("--disagg: {e}");
                    return ExitCode::FAILURE;
                }
            };
            if replicas > 1 && protocol.is_some() {
                eprintln!("--replicas: not with --disagg (one split gateway at a time)");
                return ExitCode::FAILURE;
            }
            let options = radixgate::demo::DemoOptions {
                policy,
                disagg: protocol,
                replicas: replicas.into(),
                bus,
                tokenizer,
            };
            let demo = match radixgate::demo::start(listen, &options) {
                Ok(d) => d,
                Err(e) => {
                    eprintln!("radixgate demo: could not start: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let addr = demo.gateway.local_addr();
            match protocol {
                None if !demo.replicas.is_empty() => {
                    println!("radixgate demo: {} gateway replicas in cluster mode in front of 3 simulated engines (model \"sim\"), bus {}", demo.replicas.len() + 1, options.bus.clone().or_else(|| demo.bus.as_ref().map(|b| b.url.clone())).unwrap_or_default());
                    println!("  replica http://{addr}");
                    for r in &demo.replicas {
                        println!("  replica http://{}", r.local_addr());
                    }
                }
                None => println!("radixgate demo: gateway on http://{addr} in front of 3 simulated engines (model \"sim\")"),
                Some(p) => println!("radixgate demo: gateway on http://{addr} in front of 2 prefill + 2 decode simulated engines ({} protocol, model \"sim\")", p.as_str()),
            }
            for e in &demo.engines {
                println!("  engine {}", e.url());
            }
            println!("Try:\n  curl -s http://{addr}/v1/chat/completions -H 'Content-Type: application/json' -d '{{\"model\":\"sim\",\"messages\":[{{\"role\":\"user\",\"content\":\"Hello!\"}}]}}'");
            if let Some(other) = demo.replicas.first() {
                println!("Send a long prompt to one replica, then a follow-up to another: X-Router-Reason says longest-prefix there too. Cluster view: curl http://{}/metrics | grep radixgate_cluster", other.local_addr());
            }
            println!("Streaming: add \"stream\":true. Metrics: curl http://{addr}/metrics. Ctrl-C stops.");
            wait_for_signals(None);
            demo.shutdown();
            ExitCode::SUCCESS
        }
        Command::EngineSim(a) => {
            let a = *a;
            init_logging("info", false);
            let io: IoMode = match radixgate::config::parse_enum(&a.io) {
                Ok(io) => io,
                Err(e) => {
                    eprintln!("--io: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let cfg = EngineConfig {
                model: a.model,
                cache_blocks: a.cache_blocks,
                block_tokens: a.block_tokens,
                prefill_per_token: Duration::from_micros(a.prefill_us_per_token),
                decode_per_token: Duration::from_micros(a.decode_us_per_token),
                max_batch: a.max_batch.max(1),
                max_waiting: a.max_waiting,
                default_max_tokens: a.default_max_tokens,
                fail_rate: a.fail_rate,
                spike_rate: a.spike_rate,
                spike: Duration::from_millis(a.spike_ms),
                abort_rate: a.abort_rate,
                stream_head_first: a.stream_head_first,
                refuse_rate: a.refuse_rate,
                seed: a.seed,
                fixed_response: a.fixed_response,
                fixed_delay: Duration::from_micros(a.fixed_delay_us),
                disagg: None,
                bootstrap_port: a.bootstrap_port,
                tokenizer: None,
                kv_events: a.kv_events.map(|endpoint| engine_sim::SimKvEvents {
                    endpoint,
                    replay: a.kv_events_replay,
                    topic: a.kv_events_topic,
                    buffer_steps: a.kv_events_buffer,
                    lose_every: a.kv_events_lose_every,
                }),
                loras: a.loras,
            };
            let mut cfg = cfg;
            if let Some(path) = &a.tokenizer {
                match engine_sim::SimTokenizer::load(path, a.chat_template.as_deref()) {
                    Ok(t) => cfg.tokenizer = Some(t),
                    Err(e) => {
                        eprintln!("--tokenizer: {e}");
                        return ExitCode::FAILURE;
                    }
                }
            }
            let role = match Role::parse(&a.role) {
                Some(r) => r,
                None => {
                    eprintln!(
                        "--role: unknown role `{}`; expected both, prefill or decode",
                        a.role
                    );
                    return ExitCode::FAILURE;
                }
            };

            if role != Role::Both {
                match parse_protocol(&a.protocol) {
                    Ok(p) => cfg.disagg = Some(engine_sim::SimDisagg::new(role, p)),
                    Err(e) => {
                        eprintln!("--protocol: {e}");
                        return ExitCode::FAILURE;
                    }
                }
            }
            match engine_sim::start(cfg, a.listen, Driver::resolve(io)) {
                Ok(engine) => {
                    println!("engine-sim listening on {}", engine.url());
                    if let Some(b) = engine.bootstrap_addr() {
                        println!("engine-sim bootstrap server on {b}");
                    }
                    wait_for_signals(None);
                    engine.stop();
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("engine-sim: could not start: {e}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}
