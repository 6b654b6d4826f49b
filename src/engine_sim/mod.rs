//! A simulated LLM engine that speaks vLLM's OpenAI API closely enough that a client
//! cannot tell: the test fleet, the demo fleet and the benchmark fleet.
//!
//! It models what matters to a cache-aware router: a prefix cache (LRU over prompt
//! blocks, sized with `cache_blocks`), a prefill cost per *uncached* prompt token, a
//! decode cost per output token, a bounded batch of running requests with a waiting
//! queue, and vLLM's `/metrics` names. Faults can be injected: 503s, latency spikes,
//! streams aborted midway, connections dropped on accept. One engine runs on its own
//! monoio thread; tests, `radixgate demo` and the bench start it in process.
//!
//! Besides vLLM's own endpoints it answers what the published routers probe: SGLang's
//! router asks `/server_info` and `/model_info` at start, vLLM's router with
//! `cache_aware` asks `/v1/chat/completions/render` (and `/v1/completions/render`) for
//! token ids before each request. `fixed_response` turns it into a zero-work backend
//! for proxy benchmarks (`perf/`).
//!
//! Token accounting: a prompt is the gateway's canonical byte stream (see the
//! orchestrator's `PromptHasher`) at 4 bytes per token, cut into blocks of
//! `block_tokens` tokens. With a tokenizer (`--tokenizer`) it is tokenized as vLLM
//! does instead: chat messages rendered through the chat template, then tokenized
//! (the same code a precise-mode gateway runs, `TokenHasher::hash_precise`), so its
//! blocks are a precise-mode gateway's blocks (under the engine's own hashes), and
//! `cached_tokens` follows vLLM's rule: whole cached blocks, at most the prompt's
//! length minus one token.
//!
//! Generated text: one word per token, [`Words`]; with a tokenizer, words of its
//! own vocabulary that re-tokenize to `completion_tokens` tokens.
//!
//! KV-cache events (`--kv-events`): published as vLLM publishes them, see
//! [`kv_publish`]. Stored blocks are the prompt's whole blocks the cache did not
//! hold; evictions are `BlockRemoved`. Blocks of generated tokens are not cached.

mod continuation;
mod disagg;
mod handler;
pub mod kv_publish;
mod sampling;
mod words;

pub use disagg::SimDisagg;
pub use kv_publish::SimKvEvents;
pub use words::Words;

use crate::runtime::{bind_reuseport, stop_listening, Driver, ShardRuntime};
use std::io;
use std::net::SocketAddr;
use std::thread::JoinHandle;
use std::time::Duration;

pub use radixgate_orchestrator::EngineCache;

/// Bytes of canonical prompt per simulated token.
pub const BYTES_PER_TOKEN: usize = 4;

#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub model: String,
    /// Prefix-cache capacity in blocks.
    pub cache_blocks: usize,
    /// Tokens per cache block (vLLM's GPU default is 16; its CPU build uses 128).
    pub block_tokens: usize,
    /// Simulated prefill time per uncached prompt token.
    pub prefill_per_token: Duration,
    /// Simulated time per generated token.
    pub decode_per_token: Duration,
    /// Requests decoded at once; more wait in the queue.
    pub max_batch: usize,
    /// Waiting requests beyond this are refused with 503.
    pub max_waiting: usize,
    /// Output tokens when the request gives no `max_tokens`.
    pub default_max_tokens: u64,
    /// Share of requests answered with 503.
    pub fail_rate: f64,
    /// Share of requests delayed by `spike` before their first token.
    pub spike_rate: f64,
    pub spike: Duration,
    /// Share of streaming requests whose connection is cut halfway through.
    pub abort_rate: f64,
    /// Send a stream's response head once the request is admitted, before its
    /// prefill, as vLLM does (default: with the first token).
    pub stream_head_first: bool,
    /// Share of connections closed right after accept, before any response.
    pub refuse_rate: f64,
    pub seed: u64,
    /// Answer every completion at once with one small constant JSON body, without
    /// parsing the request, modelling the cache or the batch (for proxy benchmarks,
    /// where the engine must cost as little as possible).
    pub fixed_response: bool,
    /// In `fixed_response` mode, how long each answer waits (0: none). With a delay
    /// the proxy in front always waits for the answer, as with a real engine, which
    /// makes per-request profiles of the proxy repeatable (perf/callgrind.sh).
    pub fixed_delay: Duration,
    /// Its part in a split prefill/decode pool (`None`: serves whole requests).
    pub disagg: Option<SimDisagg>,
    /// SGLang prefill engines: also serve the bootstrap endpoint on this port of the
    /// listen address (0: an ephemeral one).
    pub bootstrap_port: Option<u16>,
    /// Tokenize prompts as vLLM does (the model's tokenizer and chat template).
    pub tokenizer: Option<SimTokenizer>,
    /// Publish KV-cache events in vLLM's format.
    pub kv_events: Option<SimKvEvents>,
    /// LoRA adapters of `model` it serves (`--lora`): listed in its `/v1/models` with
    /// `parent`, accepted as a request's `model`, each cached in its own namespace
    /// (its prompts never hit the base model's blocks or another adapter's).
    pub loras: Vec<String>,
}

/// The served model's tokenizer and chat template (`--tokenizer`, `--chat-template`),
/// and the words of its vocabulary that answers are made of.
#[derive(Clone)]
pub struct SimTokenizer {
    pub tokenizer: std::sync::Arc<tokenizers::Tokenizer>,
    pub template: std::sync::Arc<crate::chat_template::ChatTemplate>,
    pub words: std::sync::Arc<Words>,
}

impl std::fmt::Debug for SimTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimTokenizer")
            .field("template", &self.template)
            .field("words", &self.words.len())
            .finish()
    }
}

impl SimTokenizer {
    /// Loads a `tokenizer.json` and a chat template (by default the one beside it,
    /// found as a precise-mode gateway finds it), and picks the words of its
    /// vocabulary that round-trip ([`Words::from_tokenizer`]).
    #[allow(clippy::disallowed_methods)] // at start, off any shard
    pub fn load(tokenizer: &str, template: Option<&str>) -> Result<Self, String> {
        let t = tokenizers::Tokenizer::from_file(tokenizer)
            .map_err(|e| format!("cannot load tokenizer `{tokenizer}`: {e}"))?;
        let path = template
            .map(str::to_string)
            .or_else(|| crate::chat_template::ChatTemplate::find_beside(tokenizer))
            .ok_or_else(|| {
                format!("no chat template beside `{tokenizer}`: give --chat-template")
            })?;
        let template = crate::chat_template::ChatTemplate::load(&path)?;
        let words = Words::from_tokenizer(&t).map_err(|e| format!("`{tokenizer}`: {e}"))?;
        Ok(Self {
            tokenizer: std::sync::Arc::new(t),
            template: std::sync::Arc::new(template),
            words: std::sync::Arc::new(words),
        })
    }
}

impl EngineConfig {
    pub fn new(model: impl Into<String>) -> Self {
        Self {
            model: model.into(),
            cache_blocks: 4096,
            block_tokens: 16,
            prefill_per_token: Duration::from_micros(20),
            decode_per_token: Duration::from_millis(2),
            max_batch: 32,
            max_waiting: 1024,
            default_max_tokens: 16,
            fail_rate: 0.0,
            spike_rate: 0.0,
            spike: Duration::from_millis(500),
            abort_rate: 0.0,
            stream_head_first: false,
            refuse_rate: 0.0,
            seed: 1,
            fixed_response: false,
            fixed_delay: Duration::ZERO,
            disagg: None,
            bootstrap_port: None,
            tokenizer: None,
            kv_events: None,
            loras: Vec::new(),
        }
    }

    /// An engine that answers as fast as it can (for functional tests).
    pub fn instant(model: impl Into<String>) -> Self {
        Self {
            prefill_per_token: Duration::ZERO,
            decode_per_token: Duration::ZERO,
            ..Self::new(model)
        }
    }
}

/// A running simulated engine; stops when dropped.
pub struct EngineHandle {
    addr: SocketAddr,
    bootstrap: Option<SocketAddr>,
    stop: Option<flume::Sender<()>>,
    thread: Option<JoinHandle<()>>,
    /// The KV-event publisher's thread and its stop signal.
    kv_thread: Option<(JoinHandle<()>, flume::Sender<()>)>,
}

impl EngineHandle {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The bootstrap port's address (engines started with `bootstrap`).
    pub fn bootstrap_addr(&self) -> Option<SocketAddr> {
        self.bootstrap
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        if let Some((t, stop)) = self.kv_thread.take() {
            drop(stop);
            let _ = t.join();
        }
    }
}

impl Drop for EngineHandle {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Binds `listen` (port 0 for an ephemeral port) and serves on a new thread.
pub fn start(config: EngineConfig, listen: SocketAddr, driver: Driver) -> io::Result<EngineHandle> {
    let listener = bind_reuseport(listen, driver)?;
    let addr = listener.local_addr()?;
    let bootstrap_listener = match config.bootstrap_port {
        Some(port) => Some(bind_reuseport(SocketAddr::new(listen.ip(), port), driver)?),
        None => None,
    };
    let bootstrap = match &bootstrap_listener {
        Some(l) => Some(l.local_addr()?),
        None => None,
    };
    let (publisher, kv_thread) = match &config.kv_events {
        Some(k) => {
            let (p, t, stop) = kv_publish::start(k)?;
            (Some(p), Some((t, stop)))
        }
        None => (None, None),
    };
    let (stop_tx, stop_rx) = flume::bounded::<()>(1);
    let thread = std::thread::Builder::new()
        .name(format!("radixgate-engine-{}", addr.port()))
        .spawn(move || {
            let mut runtime = match ShardRuntime::build(driver) {
                Ok(rt) => rt,
                Err(e) => {
                    tracing::error!(error = %e, "could not build the engine runtime");
                    return;
                }
            };
            runtime.block_on(async move {
                let Ok(listener) = monoio::net::TcpListener::from_std(listener) else {
                    return;
                };
                let engine = handler::Engine::new(config, addr, publisher);
                let conns = engine.conns.clone();
                let boot =
                    bootstrap_listener.and_then(|l| monoio::net::TcpListener::from_std(l).ok());
                let serve_boot = {
                    let engine = engine.clone();
                    let boot = boot.as_ref();
                    async move {
                        match boot {
                            Some(l) => engine.serve(l).await,
                            None => std::future::pending().await,
                        }
                    }
                };
                monoio::select! {
                    _ = engine.serve(&listener) => {}
                    _ = serve_boot => {}
                    _ = stop_rx.recv_async() => {}
                }
                stop_listening(&listener);
                if let Some(l) = &boot {
                    stop_listening(l);
                }
                conns.shutdown_all();
            });
        })?;
    Ok(EngineHandle {
        addr,
        bootstrap,
        stop: Some(stop_tx),
        thread: Some(thread),
        kv_thread,
    })
}
