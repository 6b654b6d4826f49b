//! Configuration: the TOML file as serde wire structs, validated into typed runtime
//! config.
//!
//! Wire structs deny unknown keys and carry a doc comment per field (the annotated
//! example in `deploy/radixgate.example.toml` mirrors them). [`Config::from_toml`]
//! reports every semantic error at once, each with its key path, so `radixgate
//! check-config` can list them all.

use crate::chat_template::ChatTemplate;
mod admission;
mod capacity;
mod cluster;
mod disagg;
mod discovery;
pub mod keys;
mod tls;
mod traces;
mod workflows;
pub use cluster::ClusterConfig;
pub use traces::TracesConfig;

pub use admission::{AdmissionConfig, TierConfig};
pub use capacity::CapacityConfig;
pub use disagg::{check_backend as check_backend_role, DisaggConfig, Protocol, Role, SplitModels};
pub use discovery::{DiscoveryConfig, Lookup as DiscoveryLookup};
use radixgate_orchestrator::PolicyName;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::num::{NonZeroU32, NonZeroUsize};
use std::sync::Arc;
use std::time::Duration;
pub use tls::{ServerTls, UpstreamTls};
pub use workflows::WorkflowsConfig;

// === wire format ===

#[derive(Debug, Deserialize, Serialize, Default)]
#[serde(deny_unknown_fields)]
struct ConfigFile {
    #[serde(default)]
    server: ServerWire,
    #[serde(default)]
    routing: RoutingWire,
    #[serde(default)]
    upstream: UpstreamWire,
    #[serde(default)]
    health: HealthWire,
    #[serde(default)]
    retry: RetryWire,
    #[serde(default)]
    breaker: BreakerWire,
    #[serde(default)]
    admin: AdminWire,
    #[serde(default)]
    log: LogWire,
    #[serde(default)]
    traces: traces::TracesWire,
    #[serde(default)]
    cluster: cluster::ClusterWire,
    #[serde(default)]
    auth: AuthWire,
    #[serde(default)]
    tenancy: TenancyWire,
    #[serde(default)]
    admission: admission::AdmissionWire,
    /// `[tiers.<name>]`: admission settings per tenant tier.
    #[serde(default)]
    tiers: std::collections::BTreeMap<String, admission::TierWire>,
    #[serde(default)]
    tenants: Vec<TenantWire>,
    #[serde(default)]
    workflows: workflows::WorkflowsWire,
    #[serde(default)]
    capacity: capacity::CapacityWire,
    #[serde(default)]
    backends: Vec<BackendWire>,
    /// `[[discovery]]`: backends found by resolving a DNS name.
    #[serde(default)]
    discovery: Vec<discovery::DiscoveryWire>,
    /// `[models.<name>]`: per-model settings (today: `disagg`, a split pool).
    #[serde(default)]
    models: std::collections::BTreeMap<String, disagg::ModelWire>,
}

#[derive(Debug, Deserialize, Serialize, Default)]
#[serde(deny_unknown_fields, default)]
struct AuthWire {
    /// Refuse model requests without a valid API key (401). When false, requests
    /// without a key are served as the anonymous tenant (no limits); a key that is
    /// given must still be valid.
    required: bool,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
struct TenancyWire {
    /// "global": tenants share cached prefixes. "tenant": each tenant's prompts hash
    /// into their own chains and carry vLLM's `cache_salt`, so no tenant can hit (or
    /// time) another's cache.
    prefix_isolation: String,
}

impl Default for TenancyWire {
    fn default() -> Self {
        Self {
            prefix_isolation: "global".into(),
        }
    }
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct TenantWire {
    /// Tenant name (logs, metrics).
    name: String,
    /// Tier name (e.g. "gold", "free"); must name a `[tiers.<name>]` table once any
    /// is configured.
    #[serde(default = "default_tier")]
    tier: String,
    /// SHA-256 hex digests of the tenant's API keys (`radixgate hash-key KEY`).
    keys: Vec<String>,
    /// Requests per second across all shards; unset = unlimited.
    requests_per_sec: Option<f64>,
    /// Tokens per second (prompt estimate + max_tokens, reconciled with usage).
    tokens_per_sec: Option<f64>,
    /// Requests in flight at once across all shards.
    max_concurrency: Option<u32>,
}

fn default_tier() -> String {
    "standard".into()
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
struct LogWire {
    /// "text" (readable) or "json" (one object per line).
    format: String,
    /// Default level filter (`RUST_LOG` overrides it), e.g. "info" or "radixgate=debug".
    level: String,
    /// One line per request (target `radixgate::access`), written off the shards.
    access: bool,
}

impl Default for LogWire {
    fn default() -> Self {
        Self {
            format: "text".into(),
            level: "info".into(),
            access: true,
        }
    }
}

#[derive(Debug, Deserialize, Serialize, Default)]
#[serde(deny_unknown_fields, default)]
struct AdminWire {
    /// Address of the admin API (keep it on loopback); unset = no admin API.
    listen: Option<String>,
    /// File holding the admin bearer token (first line).
    token_file: Option<String>,
    /// Environment variable holding the admin bearer token (used when no file).
    token_env: Option<String>,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
struct RetryWire {
    /// Attempts per request, the first included (1 = never retry). A retry happens
    /// only before anything reached the client: connect error, reset, timeout before
    /// the first byte, or a 5xx.
    max_attempts: u32,
    /// Retries may add at most this share of requests (a retry budget, per shard).
    budget_ratio: f64,
    /// Retries always allowed per second regardless of traffic (per shard).
    min_retries_per_sec: f64,
    /// Continue a stream on another engine when its engine dies mid-stream: the
    /// request is re-sent with the text generated so far appended (chat: an assistant
    /// message continued with `continue_final_message`; completions: the prompt) and
    /// the continuation spliced into the client's stream.
    migrate_streams: bool,
    /// Continuations one stream may take (with `migrate_streams`).
    max_stream_migrations: u32,
    /// Move a stream whose engine has sent no token this long after the request
    /// arrived to another engine, once, if another engine whose speed the gateway has
    /// learned promises a first token sooner than the wait so far (0: never). See
    /// docs/operations.md.
    first_token_timeout_ms: u64,
    /// With `first_token_timeout_ms`: the deadline is at least this many times the
    /// cost model's estimated TTFT on the chosen engine (0: the fixed timeout alone).
    first_token_timeout_factor: f64,
}

impl Default for RetryWire {
    fn default() -> Self {
        Self {
            max_attempts: 3,
            budget_ratio: 0.2,
            min_retries_per_sec: 10.0,
            migrate_streams: false,
            max_stream_migrations: 1,
            first_token_timeout_ms: 0,
            first_token_timeout_factor: 0.0,
        }
    }
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
struct BreakerWire {
    /// Consecutive failed requests (connect errors, timeouts, 5xx, broken streams)
    /// that open a backend's breaker.
    failure_threshold: u32,
    /// How long an open breaker stays open before letting probes through.
    open_ms: u64,
    /// Requests each shard may have in flight to a half-open backend (the probes).
    half_open_probes: u32,
}

impl Default for BreakerWire {
    fn default() -> Self {
        Self {
            failure_threshold: 5,
            open_ms: 5_000,
            half_open_probes: 1,
        }
    }
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
struct ServerWire {
    /// Address the shards listen on (each shard binds it with SO_REUSEPORT).
    listen: String,
    /// Number of shards (threads, one per core). Default: the number of cores.
    shards: Option<usize>,
    /// Cores to pin shard k to (`cores[k % len]`); empty = no pinning.
    cores: Vec<usize>,
    /// Core to pin the coordinator thread to; unset = no pinning.
    coordinator_core: Option<usize>,
    /// "auto" (io_uring, falling back to epoll), "io_uring" or "epoll".
    io: String,
    /// Largest accepted request body.
    max_body_bytes: u64,
    /// Largest accepted request head (request line plus headers; at most 96 headers).
    max_head_bytes: usize,
    /// Longest accepted request target (path and query); longer is 414.
    max_uri_bytes: usize,
    /// How long an idle client keep-alive connection is kept open.
    client_idle_timeout_ms: u64,
    /// After this long without a request, an idle keep-alive connection gives its
    /// buffers back and waits for its next byte holding almost no memory.
    client_park_after_ms: u64,
    /// From a request head's first byte to its end; slower is 408 and close.
    head_timeout_ms: u64,
    /// For a whole request body; slower is 408 and close.
    body_timeout_ms: u64,
    /// Client connections each shard keeps open at once; beyond it a new connection
    /// gets 503 `overloaded` and is closed.
    max_connections: usize,
    /// On SIGTERM/SIGINT: stop accepting, then wait this long for in-flight requests.
    shutdown_timeout_ms: u64,
    /// `[server.tls]`: serve HTTPS (ALPN http/1.1) with this certificate and key; a
    /// reload reads both files again.
    tls: Option<tls::ServerTlsWire>,
}

impl Default for ServerWire {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8080".into(),
            shards: None,
            cores: Vec::new(),
            coordinator_core: None,
            io: "auto".into(),
            max_body_bytes: 8 << 20,
            max_head_bytes: 16 << 10,
            max_uri_bytes: 8 << 10,
            client_idle_timeout_ms: 60_000,
            client_park_after_ms: 1_000,
            head_timeout_ms: 10_000,
            body_timeout_ms: 30_000,
            max_connections: 10_000,
            shutdown_timeout_ms: 30_000,
            tls: None,
        }
    }
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
struct RoutingWire {
    /// prefix_aware | round_robin | random | least_loaded | consistent_hash
    policy: String,
    /// Let the request header `X-Router-Policy` pick the policy (for benchmarks).
    allow_policy_header: bool,
    /// Bytes per prompt block for prefix hashing (bytes mode).
    block_bytes: usize,
    /// "bytes" (default, the fast path): blocks of `block_bytes` canonical prompt
    /// bytes. "tokens": tokenize the canonical prompt with `tokenizer` and hash blocks
    /// of `block_tokens` token ids; costs about 0.8 ms of shard CPU per 2 KB of prompt
    /// text the shard has not tokenized before (docs/routing.md, "Token mode").
    hashing: String,
    /// Path of a Hugging Face `tokenizer.json` (relative to the working directory);
    /// required in tokens mode, loaded and checked at config load, unused otherwise.
    tokenizer: Option<String>,
    /// Tokens per block in tokens mode; match the engine's KV block size (vLLM: 16 on
    /// GPU, 128 on CPU) for engine-sized blocks. In precise mode it must equal it.
    block_tokens: usize,
    /// Precise mode: the model's chat template (a `.jinja` file or a
    /// `tokenizer_config.json`); default: the one beside `tokenizer`.
    chat_template: Option<String>,
    /// consistent_hash: a backend takes at most this factor times the mean load.
    hash_load_factor: f64,
    /// consistent_hash: virtual nodes per backend on the ring.
    hash_virtual_nodes: u32,
    /// Prompt bytes per token, to turn blocks into token estimates.
    bytes_per_token: f64,
    /// Bound on the prefix index's size, in blocks, across all backends.
    index_max_blocks: usize,
    /// A prompt routed to a backend that already holds all of it refreshes its
    /// recency in the index (and is replicated) at most once per this many
    /// milliseconds, and so does a session binding to its home; 0 records every
    /// request.
    index_touch_ms: u64,
    /// How long a conversation stays bound to its backend after its last request
    /// (`X-Session-ID`).
    session_ttl_ms: u64,
    /// Bound on the number of session bindings kept.
    max_sessions: usize,
    /// Knobs of the `prefix_aware` policy.
    prefix_aware: PrefixAwareWire,
    /// Name of the structured RAG member of a chat body (`{"system", "chunks",
    /// "query"}`), normalised into messages before routing (docs/routing.md, "RAG requests").
    rag_field: String,
    /// Chunk affinity (RAG requests under `prefix_aware`): one of the request's chunks
    /// already sent to a backend is worth this many requests in flight there.
    rag_chunk_weight: u32,
    /// Bound on the chunk ids each shard's chunk index remembers.
    rag_max_chunks: usize,
}

impl Default for RoutingWire {
    fn default() -> Self {
        Self {
            policy: "prefix_aware".into(),
            allow_policy_header: false,
            block_bytes: 64,
            hashing: "bytes".into(),
            tokenizer: None,
            block_tokens: 16,
            chat_template: None,
            hash_load_factor: 1.25,
            hash_virtual_nodes: 160,
            bytes_per_token: 4.0,
            index_max_blocks: 1 << 20,
            index_touch_ms: 100,
            session_ttl_ms: 30 * 60 * 1000,
            max_sessions: 100_000,
            prefix_aware: PrefixAwareWire::default(),
            rag_field: "rag".into(),
            rag_chunk_weight: 2,
            rag_max_chunks: 1 << 18,
        }
    }
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
struct PrefixAwareWire {
    /// Below this many matched blocks the policy behaves as least-loaded.
    min_match_blocks: u32,
    /// A backend with this many requests in flight (plus its engine queue) is
    /// saturated: affinity yields and the prefix spills to a second holder.
    saturation_inflight: u32,
    /// Estimated TTFTs within this fraction of the best count as a tie.
    hysteresis: f64,
    /// Expected queueing delay each request ahead adds, in milliseconds.
    queue_ms_per_request: f64,
    /// Prefill cost per uncached prompt token until one is learned, in microseconds.
    prefill_us_per_token: f64,
    /// Use each backend's learned delay per request ahead instead of
    /// `queue_ms_per_request` once one is learned.
    learn_queue_cost: bool,
    /// Share of a cold prefill charged per cached block a placement would evict
    /// (0: eviction is free, the ablation).
    eviction_weight: f64,
    /// A prompt with no useful match goes to the most free cache room among backends
    /// whose wait is within this many requests of the shortest (0: shortest wait first).
    new_prefix_slack_requests: u32,
    /// Learn each backend's prefill cost as a fixed delay plus a cost per token
    /// (false: a cost per token alone, the ablation).
    learn_fixed_delay: bool,
    /// Blocks a backend last used this long ago count as free cache room (0: only
    /// truly free blocks).
    room_stale_after_ms: u64,
    /// A new prefix goes to the backend given the fewest new prefixes lately, then
    /// by cache room (false: by room alone, the ablation).
    spread_new_prefixes: bool,
    /// Price a new prefix at the size the large prompts lately reached, against each
    /// backend's cache capacity and its recent new prefixes (false: at its size now,
    /// the ablation).
    price_footprint: bool,
    /// Count a match only as far as it fits in the engine's cache beside the
    /// prompts of the requests in flight there (false: whole, the ablation).
    price_cache_in_use: bool,
    /// A new prefix counts toward its backend's recent ones only while prompts that
    /// extend it keep coming (false: until sixteen more are placed, the ablation).
    forget_unused_placements: bool,
}

impl Default for PrefixAwareWire {
    fn default() -> Self {
        let d = radixgate_orchestrator::PrefixAwareConfig::default();
        Self {
            min_match_blocks: d.min_match_blocks,
            saturation_inflight: d.saturation_inflight,
            hysteresis: d.hysteresis,
            queue_ms_per_request: d.queue_ns_per_request as f64 / 1e6,
            prefill_us_per_token: d.default_prefill_ns_per_token as f64 / 1e3,
            learn_queue_cost: d.learned_queue_cost,
            eviction_weight: d.eviction_weight,
            new_prefix_slack_requests: d.new_prefix_slack_requests,
            learn_fixed_delay: d.learned_fixed_delay,
            room_stale_after_ms: d.room_stale_after_ms,
            spread_new_prefixes: d.spread_new_prefixes,
            price_footprint: d.price_footprint,
            price_cache_in_use: d.price_cache_in_use,
            forget_unused_placements: d.forget_unused_placements,
        }
    }
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
struct UpstreamWire {
    /// TCP connect timeout to a backend.
    connect_timeout_ms: u64,
    /// Longest wait from sending a request to the first response byte.
    first_byte_timeout_ms: u64,
    /// Longest silence between two reads of a response body.
    idle_timeout_ms: u64,
    /// Idle keep-alive connections kept per shard and backend.
    pool_max_idle: usize,
    /// An idle pooled connection older than this is closed instead of reused.
    pool_idle_expiry_ms: u64,
    /// PEM CA bundle trusted for `https://` backends without a `tls_ca` of their own.
    tls_ca: Option<String>,
}

impl Default for UpstreamWire {
    fn default() -> Self {
        Self {
            connect_timeout_ms: 2_000,
            first_byte_timeout_ms: 120_000,
            idle_timeout_ms: 60_000,
            pool_max_idle: 64,
            pool_idle_expiry_ms: 30_000,
            tls_ca: None,
        }
    }
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
struct HealthWire {
    /// Interval between active `/health` checks of each backend.
    interval_ms: u64,
    /// Timeout of one health check.
    timeout_ms: u64,
    /// Consecutive failed checks that mark a backend unhealthy.
    unhealthy_threshold: u32,
    /// Consecutive passed checks that mark it healthy again.
    healthy_threshold: u32,
    /// Interval between scrapes of each backend's Prometheus `/metrics` (engine
    /// queue, running requests, KV usage and cache size); 0 turns scraping off.
    scrape_interval_ms: u64,
}

impl Default for HealthWire {
    fn default() -> Self {
        Self {
            interval_ms: 2_000,
            timeout_ms: 1_000,
            unhealthy_threshold: 2,
            healthy_threshold: 1,
            scrape_interval_ms: 1_000,
        }
    }
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct BackendWire {
    /// Unique name, shown in `X-Router-Backend` and metrics.
    id: String,
    /// `http://HOST:PORT` or `https://HOST:PORT` of the engine (an IP address or
    /// `localhost`).
    url: String,
    /// `https://` only: PEM CA bundle that signed the engine's certificate (default
    /// `upstream.tls_ca`).
    #[serde(default)]
    tls_ca: Option<String>,
    /// `https://` only: the name the engine's certificate must hold (default: the
    /// URL's host).
    #[serde(default)]
    tls_server_name: Option<String>,
    /// Model names this backend serves.
    models: Vec<String>,
    /// Environment variable holding this backend's own API key, sent upstream as
    /// `Authorization: Bearer` (the client's key never is).
    #[serde(default)]
    api_key_env: Option<String>,
    /// The engine's KV-cache capacity in prompt blocks (`routing.block_bytes` bytes
    /// each, or `routing.block_tokens` tokens in tokens mode): the prefix index
    /// forgets this backend's least recently used blocks beyond it.
    #[serde(default = "default_cache_blocks")]
    cache_blocks: usize,
    /// Precise mode: the ZeroMQ endpoint this engine publishes its KV-cache events to
    /// (vLLM `--kv-events-config` `endpoint`, e.g. `tcp://127.0.0.1:5557`). The
    /// gateway binds it (the engine connects) and rebuilds this backend's index
    /// entries from the events. One gateway process only: see `kv_events_connect`.
    #[serde(default)]
    kv_events: Option<String>,
    /// Precise mode, the other direction: the engine binds its PUB socket (vLLM does
    /// for `tcp://*:N` and `ipc://`) and the gateway connects to it here, so any
    /// number of gateway replicas can subscribe. Excludes `kv_events`.
    #[serde(default)]
    kv_events_connect: Option<String>,
    /// The engine's replay socket (vLLM `--kv-events-config` `replay_endpoint`, a
    /// ROUTER the gateway connects to): missed events are asked back from it on a
    /// sequence gap and at start. Needs `kv_events` or `kv_events_connect`.
    #[serde(default)]
    kv_events_replay: Option<String>,
    /// What the engine's model accepts: any of `text`, `image`, `audio`. Requests with
    /// image or audio content parts go only to backends that list them.
    #[serde(default = "default_capabilities")]
    capabilities: Vec<String>,
    /// "both" (default): serves whole requests. "prefill" / "decode": one side of the
    /// split pool of models with a `[models.<name>.disagg]` table.
    #[serde(default = "default_role")]
    role: String,
    /// SGLang prefill backends: the port of the engine's bootstrap server
    /// (`--disaggregation-bootstrap-port`), sent to decode servers as `bootstrap_port`.
    #[serde(default)]
    bootstrap_port: Option<u16>,
    /// Backends with the same label share their compute (engines on one GPU, or
    /// pinned to the same CPU cores): each one's queued work slows the others, and
    /// the cost model counts it (docs/routing.md).
    #[serde(default)]
    compute_group: Option<String>,
}

/// Chat body members radixgate reads itself: `routing.rag_field` may not shadow them.
const KNOWN_BODY_FIELDS: [&str; 10] = [
    "model",
    "messages",
    "prompt",
    "stream",
    "max_tokens",
    "max_completion_tokens",
    "user",
    "stream_options",
    "cache_salt",
    "tools",
];

fn default_capabilities() -> Vec<String> {
    vec!["text".into()]
}

fn default_role() -> String {
    "both".into()
}

fn default_cache_blocks() -> usize {
    16384
}

// === runtime config ===

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IoMode {
    Auto,
    IoUring,
    Epoll,
}

/// `log.format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
enum LogFormat {
    Text,
    Json,
}

/// `tenancy.prefix_isolation`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
enum PrefixIsolation {
    Global,
    Tenant,
}

/// `routing.hashing`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
enum HashingMode {
    Bytes,
    Tokens,
    Precise,
}

/// An enum's value from its string, by the enum's own serde names (the error lists
/// the accepted ones): config values and command-line flags alike.
pub fn parse_enum<T: serde::de::DeserializeOwned>(value: &str) -> Result<T, String> {
    use serde::de::IntoDeserializer;
    T::deserialize(value.into_deserializer()).map_err(|e: serde::de::value::Error| e.to_string())
}

/// [`parse_enum`] for a config key: an unknown value is reported under `key` and
/// `fallback` stands in, so that every error of a file is reported at once.
pub(crate) fn enum_value<T: serde::de::DeserializeOwned>(
    key: &str,
    value: &str,
    fallback: T,
    errors: &mut Vec<String>,
) -> T {
    parse_enum(value).unwrap_or_else(|e| {
        errors.push(format!("{key}: {e}"));
        fallback
    })
}

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub shards: NonZeroUsize,
    pub cores: Vec<usize>,
    pub coordinator_core: Option<usize>,
    pub io: IoMode,
    pub max_body_bytes: u64,
    pub max_head_bytes: usize,
    pub max_uri_bytes: usize,
    pub client_idle_timeout: Duration,
    pub client_park_after: Duration,
    pub head_timeout: Duration,
    pub body_timeout: Duration,
    pub max_connections: usize,
    pub shutdown_timeout: Duration,
    /// `[server.tls]`: the listener serves HTTPS.
    pub tls: Option<ServerTls>,
}

/// How prompts are cut into blocks for the prefix index (`routing.hashing`).
#[derive(Clone)]
pub enum Hashing {
    /// Blocks of `routing.block_bytes` canonical prompt bytes.
    Bytes,
    /// Blocks of `block_tokens` token ids (see [`crate::token_mode`]).
    Tokens {
        /// Loaded once here; every shard shares it.
        tokenizer: Arc<tokenizers::Tokenizer>,
        path: String,
        block_tokens: NonZeroUsize,
        /// Precise mode: prompts rendered through the engine's chat template, so
        /// that blocks are the engine's own KV blocks (and KV events can feed the
        /// index).
        template: Option<Arc<ChatTemplate>>,
    },
}

impl fmt::Debug for Hashing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Hashing::Bytes => f.write_str("Bytes"),
            Hashing::Tokens {
                path,
                block_tokens,
                template,
                ..
            } => f
                .debug_struct("Tokens")
                .field("tokenizer", path)
                .field("block_tokens", block_tokens)
                .field("template", template)
                .finish(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct RoutingConfig {
    pub policy: PolicyName,
    pub allow_policy_header: bool,
    pub block_bytes: NonZeroUsize,
    pub hashing: Hashing,
    pub hash_load_factor: f64,
    pub hash_virtual_nodes: u32,
    pub bytes_per_token: f64,
    pub index_max_blocks: usize,
    /// `routing.index_touch_ms` (see `PrefixIndex::touch_is_due`).
    pub index_touch_ms: u64,
    pub session_ttl: Duration,
    pub max_sessions: usize,
    pub prefix_aware: radixgate_orchestrator::PrefixAwareConfig,
    pub rag_field: String,
    pub rag_chunk_weight: u32,
    pub rag_max_chunks: usize,
}

#[derive(Debug, Clone)]
pub struct UpstreamConfig {
    pub connect_timeout: Duration,
    pub first_byte_timeout: Duration,
    pub idle_timeout: Duration,
    pub pool_max_idle: usize,
    pub pool_idle_expiry: Duration,
    /// `upstream.tls_ca` (each https backend holds the client config built from it).
    pub tls_ca: Option<String>,
}

#[derive(Debug, Clone)]
pub struct HealthConfig {
    pub interval: Duration,
    pub timeout: Duration,
    pub unhealthy_threshold: u32,
    pub healthy_threshold: u32,
    pub scrape_interval: Option<Duration>,
}

/// One backend's KV-event subscription (precise mode): `backends[].kv_events`
/// (bind), or `kv_events_connect` (connect), with `kv_events_replay`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEventsSource {
    /// The SUB socket's endpoint.
    pub endpoint: String,
    /// Connect to `endpoint` (the engine binds) rather than bind it.
    pub connect: bool,
    /// The engine's replay ROUTER, connected to.
    pub replay: Option<String>,
}

#[derive(Debug, Clone)]
pub struct BackendConfig {
    pub id: String,
    pub addr: SocketAddr,
    /// Value for the upstream `Host` header.
    pub host: String,
    /// `https://` backends: how to speak TLS to it.
    pub tls: Option<Arc<UpstreamTls>>,
    pub models: Vec<String>,
    pub cache_blocks: usize,
    /// `Authorization: Bearer ...` header line for upstream requests, if any.
    pub upstream_auth: Option<String>,
    /// Where its KV events come from (precise mode).
    pub kv_events: Option<KvEventsSource>,
    /// Modalities the backend's model accepts (`backends[].capabilities`).
    pub capabilities: radixgate_orchestrator::Capabilities,
    /// Its part in a split prefill/decode pool.
    pub role: Role,
    /// SGLang prefill backends: the bootstrap server's port.
    pub bootstrap_port: Option<u16>,
    /// `backends[].compute_group`: backends with the same label share compute.
    pub compute_group: Option<String>,
    /// This entry's keys as given (defaults filled in), for reload's diff and
    /// `GET /admin/config`; names `api_key_env`, never the key.
    pub file: serde_json::Value,
    /// The `[[discovery]]` name that found it; `None` for a configured or
    /// admin-added backend (a reload leaves discovered ones to discovery).
    pub discovered: Option<String>,
}

#[derive(Debug, Clone)]
pub struct Config {
    pub server: ServerConfig,
    pub routing: RoutingConfig,
    pub upstream: UpstreamConfig,
    pub health: HealthConfig,
    pub retry: RetryConfig,
    pub breaker: BreakerConfig,
    pub admin: Option<AdminConfig>,
    pub log: LogConfig,
    /// Span export (`None` when `traces.otlp_endpoint` is unset).
    pub traces: Option<TracesConfig>,
    /// Cluster mode (`None` when `cluster.url` is unset).
    pub cluster: Option<ClusterConfig>,
    pub auth_required: bool,
    pub tenant_prefix_isolation: bool,
    pub admission: AdmissionConfig,
    pub workflows: WorkflowsConfig,
    /// The capacity signal: TTFT SLO, engine slots, measurement window.
    pub capacity: CapacityConfig,
    pub tenants: Vec<TenantConfig>,
    pub backends: Vec<BackendConfig>,
    /// DNS names whose addresses become backends (the discovery thread's work).
    pub discovery: Vec<DiscoveryConfig>,
    /// Models served by split prefill/decode pools (`[models.<name>.disagg]`).
    pub split_models: SplitModels,
    /// The file this config was loaded from (what a reload re-reads); `None` when it
    /// came from a string.
    pub source: Option<std::path::PathBuf>,
    /// Every key of the file with the value it holds here (defaults filled in), as
    /// a JSON tree keyed as [`keys::keyed`] describes: what reload diffs and
    /// `GET /admin/config` shows. Holds no secret but key digests (redacted on show).
    pub file: serde_json::Value,
}

#[derive(Debug, Clone)]
pub struct TenantConfig {
    pub name: String,
    pub tier: String,
    /// The `[tiers.<tier>]` settings (defaults when no tiers are configured).
    pub tier_config: TierConfig,
    pub key_digests: Vec<[u8; 32]>,
    pub requests_per_sec: Option<f64>,
    pub tokens_per_sec: Option<f64>,
    pub max_concurrency: Option<u32>,
}

#[derive(Debug, Clone)]
pub struct LogConfig {
    pub json: bool,
    pub level: String,
    pub access: bool,
}

#[derive(Clone)]
pub struct AdminConfig {
    pub listen: SocketAddr,
    /// The bearer token; never logged (Debug prints it redacted).
    pub token: String,
}

impl fmt::Debug for AdminConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdminConfig")
            .field("listen", &self.listen)
            .field("token", &"<redacted>")
            .finish()
    }
}

#[derive(Debug, Clone)]
pub struct RetryConfig {
    pub max_attempts: NonZeroU32,
    pub budget_ratio: f64,
    pub min_retries_per_sec: f64,
    pub migrate_streams: bool,
    pub max_stream_migrations: u32,
    /// `None`: streams are never moved for a late first token.
    pub first_token_timeout: Option<Duration>,
    pub first_token_timeout_factor: f64,
}

#[derive(Debug, Clone)]
pub struct BreakerConfig {
    pub failure_threshold: u32,
    pub open: Duration,
    pub half_open_probes: u32,
}

/// Every problem found in a config file, each with its key path.
#[derive(Debug)]
pub struct ConfigErrors(pub Vec<String>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

impl Config {
    pub fn from_toml(text: &str) -> Result<Config, ConfigErrors> {
        let wire: ConfigFile =
            toml::from_str(text).map_err(|e| ConfigErrors(vec![e.to_string()]))?;
        Self::from_wire(wire)
    }

    /// A config from its file as a JSON tree in the wire shape (`[[backends]]` and
    /// `[[tenants]]` as arrays), validated as [`Config::from_toml`] does.
    pub fn from_json(tree: serde_json::Value) -> Result<Config, ConfigErrors> {
        let wire: ConfigFile =
            serde_json::from_value(tree).map_err(|e| ConfigErrors(vec![e.to_string()]))?;
        Self::from_wire(wire)
    }

    fn from_wire(wire: ConfigFile) -> Result<Config, ConfigErrors> {
        // Every key with its value in force (defaults filled in), before validation
        // consumes the wire structs.
        let tree = serde_json::to_value(&wire).map_err(|e| ConfigErrors(vec![e.to_string()]))?;
        let mut errors = Vec::new();
        let mut config = validate(wire, &mut errors);
        config.file = keys::keyed(tree);
        if errors.is_empty() {
            Ok(config)
        } else {
            Err(ConfigErrors(errors))
        }
    }

    /// Reads a config file (at start-up, on the main thread).
    #[allow(clippy::disallowed_methods)]
    pub fn load(path: &std::path::Path) -> Result<Config, ConfigErrors> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigErrors(vec![format!("{}: {e}", path.display())]))?;
        let mut config = Config::from_toml(&text)?;
        config.source = Some(path.to_path_buf());
        Ok(config)
    }

    /// The models served, in first-seen order over the backends.
    pub fn models(&self) -> Vec<String> {
        let mut models: Vec<String> = Vec::new();
        for b in &self.backends {
            for m in &b.models {
                if !models.contains(m) {
                    models.push(m.clone());
                }
            }
        }
        models
    }
}

/// One `[[backends]]` entry (also an admin API add); `at` is its key path, and
/// `default_ca` is `upstream.tls_ca` (read and checked) with whether it is set.
fn validate_backend(
    b: BackendWire,
    at: &str,
    default_ca: (Option<&tls::CaFile>, bool),
    errors: &mut Vec<String>,
) -> BackendConfig {
    if b.id.is_empty() || !b.id.bytes().all(|c| c.is_ascii_graphic()) {
        errors.push(format!(
            "{at}.id: must be non-empty printable ASCII without spaces"
        ));
    }
    if b.cache_blocks == 0 {
        errors.push(format!("{at}.cache_blocks: must be at least 1"));
    }
    if b.models.is_empty() {
        errors.push(format!("{at}.models: list at least one model"));
    }
    if b.compute_group
        .as_ref()
        .is_some_and(|g| g.is_empty() || !g.bytes().all(|c| c.is_ascii_graphic()))
    {
        errors.push(format!(
            "{at}.compute_group: must be non-empty printable ASCII without spaces"
        ));
    }
    let capabilities =
        radixgate_orchestrator::Capabilities::parse(b.capabilities.iter().map(String::as_str))
            .unwrap_or_else(|e| {
                errors.push(format!("{at}.capabilities: {e}"));
                Default::default()
            });
    if capabilities.is_empty() {
        errors.push(format!(
            "{at}.capabilities: list at least one of text, image, audio"
        ));
    }
    let (addr, host, https) = match parse_backend_url(&b.url) {
        Ok(v) => v,
        Err(e) => {
            errors.push(format!("{at}.url: {e}"));
            (SocketAddr::from(([127, 0, 0, 1], 0)), String::new(), false)
        }
    };
    let tls = if https {
        let keys = tls::BackendTlsKeys {
            host: &host,
            ca: b.tls_ca.as_deref(),
            server_name: b.tls_server_name.as_deref(),
        };
        tls::upstream(at, keys, default_ca.0, default_ca.1, errors)
    } else {
        for (key, set) in [
            ("tls_ca", b.tls_ca.is_some()),
            ("tls_server_name", b.tls_server_name.is_some()),
        ] {
            if set {
                errors.push(format!("{at}.{key}: only for https:// URLs"));
            }
        }
        None
    };
    let role = disagg::validate_role(&b.role, b.bootstrap_port, at, errors);
    let file = serde_json::to_value(&b).unwrap_or_default();
    let kv_events = kv_events_source(&b, at, errors);
    BackendConfig {
        file,
        role,
        bootstrap_port: b.bootstrap_port,
        compute_group: b.compute_group,
        id: b.id,
        addr,
        host,
        tls,
        models: b.models,
        cache_blocks: b.cache_blocks,
        kv_events,
        capabilities,
        discovered: None,
        upstream_auth: b.api_key_env.and_then(|var| match std::env::var(&var) {
            Ok(key) => Some(format!("Authorization: Bearer {}\r\n", key.trim())),
            Err(_) => {
                errors.push(format!("{at}.api_key_env: `{var}` is not set"));
                None
            }
        }),
    }
}

impl BackendConfig {
    /// A backend from the admin API: a JSON object with the keys of a `[[backends]]`
    /// entry, validated the same way (errors name `backend.<key>`).
    pub fn from_json(body: &[u8]) -> Result<BackendConfig, ConfigErrors> {
        let wire: BackendWire = serde_json::from_slice(body)
            .map_err(|e| ConfigErrors(vec![format!("backend: {e}")]))?;
        let mut errors = Vec::new();
        // `upstream.tls_ca` is the config file's: an https backend added here names
        // its own CA.
        let backend = validate_backend(wire, "backend", (None, false), &mut errors);
        if backend.kv_events.is_some() || wire_has_replay(body) {
            errors.push(
                "backend.kv_events: KV-event subscriptions (kv_events, kv_events_connect, \
                 kv_events_replay) are set up at start; add this backend to the config file \
                 and restart"
                    .into(),
            );
        }
        if errors.is_empty() {
            Ok(backend)
        } else {
            Err(ConfigErrors(errors))
        }
    }
}

/// Whether an admin-API backend body names `kv_events_replay` (alone it makes no
/// subscription, but it is refused with the others).
fn wire_has_replay(body: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Value>(body).is_ok_and(|v| {
        !v.get("kv_events_replay")
            .unwrap_or(&serde_json::Value::Null)
            .is_null()
    })
}

/// `kv_events` / `kv_events_connect` / `kv_events_replay` as one subscription, with
/// the checks that need no other section (precise mode is checked later).
fn kv_events_source(b: &BackendWire, at: &str, errors: &mut Vec<String>) -> Option<KvEventsSource> {
    let zmq_endpoint = |key: &str, endpoint: &str, errors: &mut Vec<String>| {
        if !(endpoint.starts_with("tcp://") || endpoint.starts_with("ipc://")) {
            errors.push(format!(
                "{at}.{key}: `{endpoint}` is not a tcp:// or ipc:// endpoint"
            ));
        }
    };
    let (endpoint, connect) = match (&b.kv_events, &b.kv_events_connect) {
        (Some(_), Some(_)) => {
            errors.push(format!(
                "{at}.kv_events_connect: excludes kv_events; kv_events is bound by the \
                 gateway (the engine connects to it, one gateway only), kv_events_connect \
                 is connected to (the engine binds it, any number of gateways): set one"
            ));
            return None;
        }
        (Some(e), None) => (e.clone(), false),
        (None, Some(e)) => (e.clone(), true),
        (None, None) => {
            if b.kv_events_replay.is_some() {
                errors.push(format!(
                    "{at}.kv_events_replay: needs kv_events or kv_events_connect (replay \
                     fills gaps in an event subscription)"
                ));
            }
            return None;
        }
    };
    let key = if connect {
        "kv_events_connect"
    } else {
        "kv_events"
    };
    zmq_endpoint(key, &endpoint, errors);
    if connect && endpoint.contains('*') {
        errors.push(format!(
            "{at}.kv_events_connect: `{endpoint}` is a wildcard; connect to the engine's \
             host (the engine binds tcp://*:PORT, the gateway connects to tcp://HOST:PORT)"
        ));
    }
    if let Some(replay) = &b.kv_events_replay {
        zmq_endpoint("kv_events_replay", replay, errors);
        if replay.contains('*') {
            errors.push(format!(
                "{at}.kv_events_replay: `{replay}` is a wildcard; the gateway connects to \
                 the engine's replay socket at tcp://HOST:PORT"
            ));
        }
    }
    Some(KvEventsSource {
        endpoint,
        connect,
        replay: b.kv_events_replay.clone(),
    })
}

/// Reports `key` unless `value` is a finite number ≥ 0.
fn check_non_negative(value: f64, key: &str, errors: &mut Vec<String>) {
    if !(value >= 0.0 && value.is_finite()) {
        errors.push(format!("{key}: must be a non-negative number"));
    }
}

fn millis(ms: u64, key: &str, errors: &mut Vec<String>) -> Duration {
    if ms == 0 {
        errors.push(format!("{key}: must be greater than 0"));
    }
    Duration::from_millis(ms)
}

/// The CPUs this host has (configured, online or not), whatever this process's
/// affinity: `sched_getaffinity` (`core_affinity::get_core_ids`) lists only the cores
/// the process may run on, so under `taskset -c 1` it holds one core, numbered 1, and
/// counting it as the host's size refused `cores = [1]` ("core 1 does not exist (this
/// host has 1)"). 0 when unknown (nothing is checked then).
fn host_core_count() -> usize {
    // SAFETY: sysconf takes a constant and reads no memory of ours.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_CONF) };
    usize::try_from(n).unwrap_or(0)
}

/// A core number past the host's CPUs is an error. One that exists but lies outside
/// this process's CPU affinity is not: the shard starts unpinned and says so
/// (see `gateway.rs`), since affinity can change between check and start.
fn check_cores(cores: &[usize], host_cores: usize, errors: &mut Vec<String>) {
    for (i, c) in cores.iter().enumerate() {
        if host_cores > 0 && *c >= host_cores {
            errors.push(format!(
                "server.cores[{i}]: core {c} does not exist (this host has {host_cores} cores, 0-{})",
                host_cores - 1
            ));
        }
    }
}

fn validate(wire: ConfigFile, errors: &mut Vec<String>) -> Config {
    let server = validate_server(wire.server, errors);
    let routing = validate_routing(wire.routing, errors);
    let upstream = validate_upstream(wire.upstream, errors);
    let default_ca = tls::default_ca(upstream.tls_ca.as_deref(), errors);

    let health = validate_health(wire.health, errors);
    let (backends, discovery, split_models) = validate_backends(
        wire.backends,
        wire.discovery,
        wire.models,
        (default_ca.as_ref(), upstream.tls_ca.is_some()),
        errors,
    );
    let retry = validate_retry(wire.retry, errors);
    let breaker = validate_breaker(wire.breaker, errors);
    let admin = validate_admin(wire.admin, errors);
    let json =
        enum_value("log.format", &wire.log.format, LogFormat::Text, errors) == LogFormat::Json;
    let log = LogConfig {
        json,
        level: wire.log.level,
        access: wire.log.access,
    };
    let isolation = &wire.tenancy.prefix_isolation;
    let tenant_prefix_isolation = enum_value(
        "tenancy.prefix_isolation",
        isolation,
        PrefixIsolation::Global,
        errors,
    ) == PrefixIsolation::Tenant;
    let (admission, tiers) = admission::validate(wire.admission, wire.tiers, errors);
    let workflows = workflows::validate(wire.workflows, errors);
    let tenants = validate_tenants(wire.tenants, &tiers, errors);
    if wire.auth.required && tenants.is_empty() {
        errors.push("auth.required: no [[tenants]] with keys are configured".into());
    }
    check_precise(&routing, tenant_prefix_isolation, &backends, errors);
    Config {
        server,
        routing,
        upstream,
        health,
        retry,
        breaker,
        admin,
        log,
        traces: traces::validate(wire.traces, errors),
        cluster: cluster::validate(wire.cluster, errors),
        auth_required: wire.auth.required,
        tenant_prefix_isolation,
        admission,
        workflows,
        capacity: capacity::validate(wire.capacity, errors),
        tenants,
        backends,
        discovery,
        split_models,
        source: None,
        file: serde_json::Value::Null,
    }
}

/// `[[backends]]`, `[[discovery]]` and `[[models]]` (split prefill/decode pools):
/// unique ids, and every backend and discovery template checked against the pools.
fn validate_backends(
    backends_wire: Vec<BackendWire>,
    discovery_wire: Vec<discovery::DiscoveryWire>,
    models_wire: std::collections::BTreeMap<String, disagg::ModelWire>,
    default_ca: (Option<&tls::CaFile>, bool),
    errors: &mut Vec<String>,
) -> (Vec<BackendConfig>, Vec<DiscoveryConfig>, SplitModels) {
    if backends_wire.is_empty() && discovery_wire.is_empty() {
        errors
            .push("backends: at least one [[backends]] or [[discovery]] entry is required".into());
    }
    let discovery = discovery::validate(discovery_wire, errors);
    let mut backends = Vec::with_capacity(backends_wire.len());
    for (i, b) in backends_wire.into_iter().enumerate() {
        if backends.iter().any(|prev: &BackendConfig| prev.id == b.id) {
            errors.push(format!("backends[{i}].id: duplicate id `{}`", b.id));
        }
        backends.push(validate_backend(
            b,
            &format!("backends[{i}]"),
            default_ca,
            errors,
        ));
    }
    let split_models = disagg::validate_models(models_wire, errors);
    for (i, b) in backends.iter().enumerate() {
        disagg::check_backend(b, &split_models, &format!("backends[{i}]"), errors);
    }
    for (i, d) in discovery.iter().enumerate() {
        disagg::check_backend(
            &d.template,
            &split_models,
            &format!("discovery[{i}]"),
            errors,
        );
    }
    if !backends.is_empty() || !discovery.is_empty() {
        // Discovered backends count as their entry's template.
        let all: Vec<BackendConfig> = backends
            .iter()
            .cloned()
            .chain(discovery.iter().map(|d| d.template.clone()))
            .collect();
        disagg::check_pools(&split_models, &all, errors);
    }
    (backends, discovery, split_models)
}

/// `[server]`.
fn validate_server(s: ServerWire, errors: &mut Vec<String>) -> ServerConfig {
    let listen = s.listen.parse().unwrap_or_else(|_| {
        errors.push(format!(
            "server.listen: `{}` is not an IP:port socket address",
            s.listen
        ));
        SocketAddr::from(([127, 0, 0, 1], 0))
    });
    let default_shards = std::thread::available_parallelism().map_or(1, |n| n.get());
    let shards = match s.shards {
        Some(0) => {
            errors.push("server.shards: must be at least 1".into());
            NonZeroUsize::MIN
        }
        Some(n) => NonZeroUsize::new(n).unwrap_or(NonZeroUsize::MIN),
        None => NonZeroUsize::new(default_shards).unwrap_or(NonZeroUsize::MIN),
    };
    let io = enum_value("server.io", &s.io, IoMode::Auto, errors);
    check_cores(&s.cores, host_core_count(), errors);
    if s.max_body_bytes == 0 {
        errors.push("server.max_body_bytes: must be greater than 0".into());
    }
    if s.max_head_bytes < 256 {
        errors.push("server.max_head_bytes: must be at least 256".into());
    }
    if s.max_uri_bytes < 16 {
        errors.push("server.max_uri_bytes: must be at least 16".into());
    }
    if s.max_connections == 0 {
        errors.push("server.max_connections: must be at least 1".into());
    }
    ServerConfig {
        listen,
        shards,
        cores: s.cores,
        coordinator_core: s.coordinator_core,
        io,
        max_body_bytes: s.max_body_bytes,
        max_head_bytes: s.max_head_bytes,
        max_uri_bytes: s.max_uri_bytes,
        client_idle_timeout: millis(
            s.client_idle_timeout_ms,
            "server.client_idle_timeout_ms",
            errors,
        ),
        client_park_after: millis(
            s.client_park_after_ms,
            "server.client_park_after_ms",
            errors,
        ),
        head_timeout: millis(s.head_timeout_ms, "server.head_timeout_ms", errors),
        body_timeout: millis(s.body_timeout_ms, "server.body_timeout_ms", errors),
        max_connections: s.max_connections,
        shutdown_timeout: Duration::from_millis(s.shutdown_timeout_ms),
        tls: tls::server(s.tls, errors),
    }
}

/// `[routing]` and `[routing.prefix_aware]`.
fn validate_routing(r: RoutingWire, errors: &mut Vec<String>) -> RoutingConfig {
    let policy = r.policy.parse().unwrap_or_else(|e| {
        errors.push(format!("routing.policy: {e}"));
        PolicyName::RoundRobin
    });
    let block_bytes = NonZeroUsize::new(r.block_bytes).unwrap_or_else(|| {
        errors.push("routing.block_bytes: must be greater than 0".into());
        NonZeroUsize::MIN
    });
    if !(r.hash_load_factor > 1.0 && r.hash_load_factor.is_finite()) {
        errors.push("routing.hash_load_factor: must be a number greater than 1".into());
    }
    if r.hash_virtual_nodes == 0 {
        errors.push("routing.hash_virtual_nodes: must be at least 1".into());
    }
    if !(r.bytes_per_token > 0.0 && r.bytes_per_token.is_finite()) {
        errors.push("routing.bytes_per_token: must be a positive number".into());
    }
    if r.index_max_blocks == 0 {
        errors.push("routing.index_max_blocks: must be at least 1".into());
    }
    if r.max_sessions == 0 {
        errors.push("routing.max_sessions: must be at least 1".into());
    }
    let p = r.prefix_aware;
    for (value, key) in [
        (p.hysteresis, "routing.prefix_aware.hysteresis"),
        (p.eviction_weight, "routing.prefix_aware.eviction_weight"),
        (
            p.queue_ms_per_request,
            "routing.prefix_aware.queue_ms_per_request",
        ),
        (
            p.prefill_us_per_token,
            "routing.prefix_aware.prefill_us_per_token",
        ),
    ] {
        check_non_negative(value, key, errors);
    }
    if p.saturation_inflight == 0 {
        errors.push("routing.prefix_aware.saturation_inflight: must be at least 1".into());
    }
    let hashing = validate_hashing(
        &r.hashing,
        r.tokenizer,
        r.chat_template,
        r.block_tokens,
        errors,
    );
    let tokens_per_block = match &hashing {
        Hashing::Bytes => block_bytes.get() as f64 / r.bytes_per_token,
        Hashing::Tokens { block_tokens, .. } => block_tokens.get() as f64,
    };
    let prefix_aware = radixgate_orchestrator::PrefixAwareConfig {
        tokens_per_block,
        default_prefill_ns_per_token: (p.prefill_us_per_token * 1e3) as u32,
        queue_ns_per_request: (p.queue_ms_per_request * 1e6) as u64,
        min_match_blocks: p.min_match_blocks,
        saturation_inflight: p.saturation_inflight,
        hysteresis: p.hysteresis,
        learned_queue_cost: p.learn_queue_cost,
        eviction_weight: p.eviction_weight,
        new_prefix_slack_requests: p.new_prefix_slack_requests,
        learned_fixed_delay: p.learn_fixed_delay,
        room_stale_after_ms: p.room_stale_after_ms,
        spread_new_prefixes: p.spread_new_prefixes,
        price_footprint: p.price_footprint,
        price_cache_in_use: p.price_cache_in_use,
        forget_unused_placements: p.forget_unused_placements,
    };
    if r.rag_field.is_empty()
        || !r
            .rag_field
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'_')
        || KNOWN_BODY_FIELDS.contains(&r.rag_field.as_str())
    {
        errors.push(format!(
            "routing.rag_field: `{}` must be a name of letters, digits and `_` that OpenAI \
             bodies do not use",
            r.rag_field
        ));
    }
    if r.rag_max_chunks == 0 {
        errors.push("routing.rag_max_chunks: must be at least 1".into());
    }
    RoutingConfig {
        policy,
        allow_policy_header: r.allow_policy_header,
        block_bytes,
        hashing,
        hash_load_factor: r.hash_load_factor,
        hash_virtual_nodes: r.hash_virtual_nodes,
        bytes_per_token: r.bytes_per_token,
        index_max_blocks: r.index_max_blocks,
        index_touch_ms: r.index_touch_ms,
        session_ttl: millis(r.session_ttl_ms, "routing.session_ttl_ms", errors),
        max_sessions: r.max_sessions,
        prefix_aware,
        rag_field: r.rag_field,
        rag_chunk_weight: r.rag_chunk_weight,
        rag_max_chunks: r.rag_max_chunks,
    }
}

/// `[upstream]`.
fn validate_upstream(u: UpstreamWire, errors: &mut Vec<String>) -> UpstreamConfig {
    UpstreamConfig {
        connect_timeout: millis(u.connect_timeout_ms, "upstream.connect_timeout_ms", errors),
        first_byte_timeout: millis(
            u.first_byte_timeout_ms,
            "upstream.first_byte_timeout_ms",
            errors,
        ),
        idle_timeout: millis(u.idle_timeout_ms, "upstream.idle_timeout_ms", errors),
        pool_max_idle: u.pool_max_idle,
        pool_idle_expiry: millis(
            u.pool_idle_expiry_ms,
            "upstream.pool_idle_expiry_ms",
            errors,
        ),
        tls_ca: u.tls_ca,
    }
}

/// `[health]`.
fn validate_health(h: HealthWire, errors: &mut Vec<String>) -> HealthConfig {
    if h.unhealthy_threshold == 0 {
        errors.push("health.unhealthy_threshold: must be at least 1".into());
    }
    if h.healthy_threshold == 0 {
        errors.push("health.healthy_threshold: must be at least 1".into());
    }
    HealthConfig {
        interval: millis(h.interval_ms, "health.interval_ms", errors),
        timeout: millis(h.timeout_ms, "health.timeout_ms", errors),
        unhealthy_threshold: h.unhealthy_threshold,
        healthy_threshold: h.healthy_threshold,
        scrape_interval: (h.scrape_interval_ms > 0)
            .then(|| Duration::from_millis(h.scrape_interval_ms)),
    }
}

/// `[retry]`.
fn validate_retry(rw: RetryWire, errors: &mut Vec<String>) -> RetryConfig {
    let max_attempts = NonZeroU32::new(rw.max_attempts).unwrap_or_else(|| {
        errors.push("retry.max_attempts: must be at least 1".into());
        NonZeroU32::MIN
    });
    check_non_negative(rw.budget_ratio, "retry.budget_ratio", errors);
    check_non_negative(rw.min_retries_per_sec, "retry.min_retries_per_sec", errors);
    check_non_negative(
        rw.first_token_timeout_factor,
        "retry.first_token_timeout_factor",
        errors,
    );
    RetryConfig {
        max_attempts,
        budget_ratio: rw.budget_ratio,
        min_retries_per_sec: rw.min_retries_per_sec,
        migrate_streams: rw.migrate_streams,
        max_stream_migrations: rw.max_stream_migrations,
        first_token_timeout: (rw.first_token_timeout_ms > 0)
            .then(|| Duration::from_millis(rw.first_token_timeout_ms)),
        first_token_timeout_factor: rw.first_token_timeout_factor,
    }
}

/// `[breaker]`.
fn validate_breaker(bw: BreakerWire, errors: &mut Vec<String>) -> BreakerConfig {
    if bw.failure_threshold == 0 {
        errors.push("breaker.failure_threshold: must be at least 1".into());
    }
    if bw.half_open_probes == 0 {
        errors.push("breaker.half_open_probes: must be at least 1".into());
    }
    BreakerConfig {
        failure_threshold: bw.failure_threshold,
        open: millis(bw.open_ms, "breaker.open_ms", errors),
        half_open_probes: bw.half_open_probes,
    }
}

/// `[[tenants]]`: unique names, key digests used once, positive rates, known tiers.
fn validate_tenants(
    wire: Vec<TenantWire>,
    tiers: &std::collections::BTreeMap<String, admission::TierConfig>,
    errors: &mut Vec<String>,
) -> Vec<TenantConfig> {
    let mut tenants = Vec::with_capacity(wire.len());
    let mut seen_keys = std::collections::HashSet::new();
    for (i, t) in wire.into_iter().enumerate() {
        if t.name.is_empty() || tenants.iter().any(|p: &TenantConfig| p.name == t.name) {
            errors.push(format!("tenants[{i}].name: must be non-empty and unique"));
        }
        let mut key_digests = Vec::with_capacity(t.keys.len());
        for (k, hex) in t.keys.iter().enumerate() {
            match parse_digest(&hex.to_ascii_lowercase()) {
                Some(d) if seen_keys.insert(d) => key_digests.push(d),
                Some(_) => errors.push(format!(
                    "tenants[{i}].keys[{k}]: key used by another tenant"
                )),
                None => errors.push(format!(
                    "tenants[{i}].keys[{k}]: not a SHA-256 hex digest (use `radixgate hash-key`)"
                )),
            }
        }
        for (key, v) in [
            ("requests_per_sec", t.requests_per_sec),
            ("tokens_per_sec", t.tokens_per_sec),
        ] {
            if v.is_some_and(|v| !(v > 0.0 && v.is_finite())) {
                errors.push(format!("tenants[{i}].{key}: must be a positive number"));
            }
        }
        if t.max_concurrency == Some(0) {
            errors.push(format!("tenants[{i}].max_concurrency: must be at least 1"));
        }
        let tier_config =
            admission::resolve_tier(tiers, &t.tier, &format!("tenants[{i}].tier"), errors);
        tenants.push(TenantConfig {
            name: t.name,
            tier: t.tier,
            tier_config,
            key_digests,
            requests_per_sec: t.requests_per_sec,
            tokens_per_sec: t.tokens_per_sec,
            max_concurrency: t.max_concurrency,
        });
    }
    tenants
}

/// Precise mode's constraints across sections: no per-tenant salt, and KV-event
/// sources only with precise hashing.
fn check_precise(
    routing: &RoutingConfig,
    tenant_prefix_isolation: bool,
    backends: &[BackendConfig],
    errors: &mut Vec<String>,
) {
    let precise = matches!(
        &routing.hashing,
        Hashing::Tokens {
            template: Some(_),
            ..
        }
    );
    if precise && tenant_prefix_isolation {
        errors.push(
            "routing.hashing: precise mode needs tenancy.prefix_isolation = \"global\" \
             (engine KV events carry no tenant, so salted prefixes cannot be rebuilt)"
                .into(),
        );
    }
    for (i, b) in backends.iter().enumerate() {
        let Some(source) = &b.kv_events else {
            continue;
        };
        let key = if source.connect {
            "kv_events_connect"
        } else {
            "kv_events"
        };
        if !precise {
            errors.push(format!(
                "backends[{i}].{key}: needs routing.hashing = \"precise\" (events are \
                 matched by the engine's own token blocks)"
            ));
        }
    }
}

/// `routing.hashing`, and in tokens mode the tokenizer, loaded here once (at start-up
/// or `check-config`, off the shards).
fn validate_hashing(
    mode: &str,
    tokenizer: Option<String>,
    chat_template: Option<String>,
    block_tokens: usize,
    errors: &mut Vec<String>,
) -> Hashing {
    let block_tokens = NonZeroUsize::new(block_tokens).unwrap_or_else(|| {
        errors.push("routing.block_tokens: must be at least 1".into());
        NonZeroUsize::MIN
    });
    let mode = enum_value("routing.hashing", mode, HashingMode::Bytes, errors);
    match mode {
        HashingMode::Bytes => Hashing::Bytes,
        HashingMode::Tokens | HashingMode::Precise => {
            let Some(path) = tokenizer else {
                let name = if mode == HashingMode::Precise {
                    "precise"
                } else {
                    "tokens"
                };
                errors.push(format!(
                    "routing.tokenizer: required when routing.hashing = \"{name}\" \
                     (the path of a tokenizer.json)"
                ));
                return Hashing::Bytes;
            };
            let template = if mode == HashingMode::Precise {
                let Some(t) = chat_template.or_else(|| ChatTemplate::find_beside(&path)) else {
                    errors.push(format!(
                        "routing.chat_template: required in precise mode (no \
                         chat_template.jinja or tokenizer_config.json beside `{path}`)"
                    ));
                    return Hashing::Bytes;
                };
                match ChatTemplate::load(&t) {
                    Ok(t) => Some(Arc::new(t)),
                    Err(e) => {
                        errors.push(format!("routing.chat_template: {e}"));
                        return Hashing::Bytes;
                    }
                }
            } else {
                None
            };
            match tokenizers::Tokenizer::from_file(&path) {
                Ok(t) => Hashing::Tokens {
                    tokenizer: Arc::new(t),
                    path,
                    block_tokens,
                    template,
                },
                Err(e) => {
                    errors.push(format!(
                        "routing.tokenizer: `{path}` does not load as a tokenizer.json: {e}"
                    ));
                    Hashing::Bytes
                }
            }
        }
    }
}

#[allow(clippy::disallowed_methods)] // read once at start-up or reload, off the shards
fn validate_admin(a: AdminWire, errors: &mut Vec<String>) -> Option<AdminConfig> {
    let listen = a.listen?;
    let addr = listen.parse().map_err(|_| {
        errors.push(format!(
            "admin.listen: `{listen}` is not an IP:port socket address"
        ));
    });
    let token = match (&a.token_file, &a.token_env) {
        (Some(path), _) => std::fs::read_to_string(path)
            .map(|t| t.lines().next().unwrap_or("").trim().to_string())
            .map_err(|e| errors.push(format!("admin.token_file: {path}: {e}"))),
        (None, Some(var)) => std::env::var(var)
            .map(|t| t.trim().to_string())
            .map_err(|_| errors.push(format!("admin.token_env: `{var}` is not set"))),
        (None, None) => {
            errors
                .push("admin: set token_file or token_env (the admin API requires a token)".into());
            Err(())
        }
    };
    if let Ok(t) = &token {
        if t.len() < 16 {
            errors.push("admin: the token must be at least 16 characters".into());
        }
    }
    Some(AdminConfig {
        listen: addr.ok()?,
        token: token.ok()?,
    })
}

/// Parses `http://HOST:PORT[/]` where HOST is an IP literal or `localhost`. Names are
/// not resolved: shards never make blocking DNS calls.
pub fn parse_http_url(url: &str) -> Result<(SocketAddr, String), String> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| format!("`{url}` must start with http://"))?;
    parse_authority(url, rest)
}

/// A backend's URL, `http://` or `https://` (then `true`), as [`parse_http_url`].
fn parse_backend_url(url: &str) -> Result<(SocketAddr, String, bool), String> {
    if let Some(rest) = url.strip_prefix("https://") {
        return parse_authority(url, rest).map(|(a, h)| (a, h, true));
    }
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| format!("`{url}` must start with http:// or https://"))?;
    parse_authority(url, rest).map(|(a, h)| (a, h, false))
}

fn parse_authority(url: &str, rest: &str) -> Result<(SocketAddr, String), String> {
    let authority = rest.trim_end_matches('/');
    if authority.contains('/') {
        return Err(format!("`{url}` must not have a path"));
    }
    let (host, port) = authority
        .rsplit_once(':')
        .ok_or_else(|| format!("`{url}` must give a port"))?;
    let port: u16 = port
        .parse()
        .map_err(|_| format!("`{url}` has an invalid port"))?;
    let ip: IpAddr = if host == "localhost" {
        IpAddr::from([127, 0, 0, 1])
    } else {
        host.trim_start_matches('[')
            .trim_end_matches(']')
            .parse()
            .map_err(|_| format!("`{url}`: host must be an IP address or localhost"))?
    };
    Ok((SocketAddr::new(ip, port), authority.to_string()))
}

/// Parses a 64-hex-digit SHA-256 digest.
pub fn parse_digest(hex: &str) -> Option<[u8; 32]> {
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(i * 2..i * 2 + 2)?, 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cores_are_checked_against_the_host_not_the_affinity_mask() {
        let mut errors = Vec::new();
        check_cores(&[0, 1, 3], 4, &mut errors);
        assert!(errors.is_empty(), "{errors:?}");
        check_cores(&[1, 4], 4, &mut errors);
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].starts_with("server.cores[1]: core 4 does not exist"));
        // Unknown host size: nothing to check against.
        let mut none = Vec::new();
        check_cores(&[99], 0, &mut none);
        assert!(none.is_empty());
    }

    /// The case `taskset -c 1` hit: the process may run on one core only, and a config
    /// naming the last core of the host must still load.
    #[test]
    fn config_loads_under_a_narrow_affinity_mask() {
        let host = host_core_count();
        let last = host.saturating_sub(1);
        let toml = format!(
            r#"
            [server]
            listen = "127.0.0.1:8080"
            cores = [{last}]
            [routing]
            policy = "round_robin"
            [[backends]]
            id = "b0"
            url = "http://127.0.0.1:9001"
            models = ["sim"]
            "#
        );
        // On a thread allowed only core 0, as `taskset -c 0` would leave it.
        let result = std::thread::spawn(move || {
            if let Some(first) = core_affinity::get_core_ids().and_then(|c| c.first().copied()) {
                core_affinity::set_for_current(first);
            }
            Config::from_toml(&toml).map(|c| c.server.cores)
        })
        .join()
        .unwrap();
        assert_eq!(result.unwrap(), vec![last]);
    }

    #[test]
    fn minimal_config() {
        let c = Config::from_toml(
            r#"
            [server]
            listen = "127.0.0.1:8080"
            shards = 2
            io = "auto"
            [routing]
            policy = "round_robin"
            [[backends]]
            id = "b0"
            url = "http://127.0.0.1:9001"
            models = ["sim"]
            "#,
        )
        .unwrap();
        assert_eq!(c.server.shards.get(), 2);
        assert_eq!(c.backends[0].addr, "127.0.0.1:9001".parse().unwrap());
        assert_eq!(c.models(), vec!["sim".to_string()]);
    }

    #[test]
    fn reports_all_errors_with_paths() {
        let err = Config::from_toml(
            r#"
            [server]
            listen = "nowhere"
            io = "kqueue"
            [routing]
            policy = "smart"
            [[backends]]
            id = "b0"
            url = "https://x:1"
            models = []
            [[backends]]
            id = "b0"
            url = "http://127.0.0.1:9"
            models = ["m"]
            "#,
        )
        .unwrap_err();
        let text = err.to_string();
        for needle in [
            "server.listen",
            "server.io",
            "routing.policy",
            "backends[0].url",
            "backends[0].models",
            "backends[1].id: duplicate",
        ] {
            assert!(text.contains(needle), "missing {needle} in:\n{text}");
        }
    }

    #[test]
    fn compute_group_is_read_and_checked() {
        let backend = |group: &str| {
            Config::from_toml(&format!(
                "[[backends]]\nid = \"b0\"\nurl = \"http://127.0.0.1:9\"\nmodels = [\"m\"]\n{group}"
            ))
        };
        assert_eq!(backend("").unwrap().backends[0].compute_group, None);
        let grouped = backend("compute_group = \"gpu0\"").unwrap();
        assert_eq!(grouped.backends[0].compute_group.as_deref(), Some("gpu0"));
        for bad in ["\"\"", "\"gpu 0\""] {
            let err = backend(&format!("compute_group = {bad}")).unwrap_err();
            assert!(
                err.to_string()
                    .contains("backends[0].compute_group: must be non-empty printable ASCII"),
                "{err}"
            );
        }
    }

    fn routing(extra: &str) -> Result<Config, ConfigErrors> {
        Config::from_toml(&format!(
            "[routing]\n{extra}\n[[backends]]\nid = \"b0\"\nurl = \"http://127.0.0.1:9\"\nmodels = [\"m\"]\n"
        ))
    }

    #[test]
    fn prefix_aware_switches_are_on_by_default_and_read() {
        type Switch = fn(&radixgate_orchestrator::PrefixAwareConfig) -> bool;
        let switches: [(&str, Switch); 4] = [
            ("spread_new_prefixes", |p| p.spread_new_prefixes),
            ("price_footprint", |p| p.price_footprint),
            ("forget_unused_placements", |p| p.forget_unused_placements),
            ("price_cache_in_use", |p| p.price_cache_in_use),
        ];
        let default = routing("").unwrap();
        for (key, get) in switches {
            assert!(get(&default.routing.prefix_aware), "{key} defaults to true");
            let off = routing(&format!("[routing.prefix_aware]\n{key} = false")).unwrap();
            assert!(!get(&off.routing.prefix_aware), "{key} = false is read");
        }
    }

    #[test]
    fn room_stale_after_is_read() {
        let c = routing("[routing.prefix_aware]\nroom_stale_after_ms = 0").unwrap();
        assert_eq!(c.routing.prefix_aware.room_stale_after_ms, 0);
        assert_eq!(
            routing("")
                .unwrap()
                .routing
                .prefix_aware
                .room_stale_after_ms,
            radixgate_orchestrator::policy::prefix_aware::ROOM_STALE_AFTER_MS
        );
    }

    #[test]
    fn learn_fixed_delay_is_read() {
        assert!(
            routing("")
                .unwrap()
                .routing
                .prefix_aware
                .learned_fixed_delay
        );
        let off = routing("[routing.prefix_aware]\nlearn_fixed_delay = false").unwrap();
        assert!(!off.routing.prefix_aware.learned_fixed_delay);
        let err = routing("[routing.prefix_aware]\nlearn_fixed_delay = 1")
            .unwrap_err()
            .to_string();
        assert!(err.contains("learn_fixed_delay"), "{err}");
    }

    #[test]
    fn new_prefix_slack_is_read() {
        let c = routing("[routing.prefix_aware]\nnew_prefix_slack_requests = 0").unwrap();
        assert_eq!(c.routing.prefix_aware.new_prefix_slack_requests, 0);
        let default = routing("").unwrap();
        assert_eq!(
            default.routing.prefix_aware.new_prefix_slack_requests,
            radixgate_orchestrator::policy::prefix_aware::NEW_PREFIX_SLACK_REQUESTS
        );
        let err = routing("[routing.prefix_aware]\nnew_prefix_slack_requests = -1")
            .unwrap_err()
            .to_string();
        assert!(err.contains("new_prefix_slack_requests"), "{err}");
    }

    #[test]
    fn eviction_weight_is_read_and_checked() {
        let c = routing("[routing.prefix_aware]\neviction_weight = 0.0").unwrap();
        assert_eq!(c.routing.prefix_aware.eviction_weight, 0.0);
        let default = routing("").unwrap();
        assert_eq!(
            default.routing.prefix_aware.eviction_weight,
            radixgate_orchestrator::policy::prefix_aware::EVICTION_WEIGHT
        );
        for bad in ["-0.5", "nan", "inf"] {
            let err = routing(&format!("[routing.prefix_aware]\neviction_weight = {bad}"))
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("routing.prefix_aware.eviction_weight: must be a non-negative number"),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn capabilities_and_rag_keys_are_checked() {
        let c = routing("").unwrap();
        assert_eq!(
            c.backends[0].capabilities,
            radixgate_orchestrator::Capabilities::TEXT
        );
        assert_eq!(c.routing.rag_field, "rag");
        let err = Config::from_toml(
            "[routing]\nrag_field = \"messages\"\nrag_max_chunks = 0\n[[backends]]\nid = \"b0\"\n\
             url = \"http://127.0.0.1:9\"\nmodels = [\"m\"]\ncapabilities = [\"text\", \"smell\"]\n\
             [[backends]]\nid = \"b1\"\nurl = \"http://127.0.0.1:9\"\nmodels = [\"m\"]\n\
             capabilities = []\n",
        )
        .unwrap_err()
        .to_string();
        for needle in [
            "routing.rag_field: `messages`",
            "routing.rag_max_chunks",
            "backends[0].capabilities: unknown capability `smell`",
            "backends[1].capabilities: list at least one",
        ] {
            assert!(err.contains(needle), "missing {needle} in:\n{err}");
        }
    }

    #[test]
    fn token_mode_needs_a_loadable_tokenizer() {
        let bytes = routing("").unwrap();
        assert!(matches!(bytes.routing.hashing, Hashing::Bytes));
        assert_eq!(bytes.routing.prefix_aware.tokens_per_block, 16.0);
        let err = routing("hashing = \"tokens\"").unwrap_err().to_string();
        assert!(err.starts_with("routing.tokenizer: required"), "{err}");
        let err = routing("hashing = \"tokens\"\ntokenizer = \"/nonexistent/tokenizer.json\"")
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("routing.tokenizer: `/nonexistent/tokenizer.json`"),
            "{err}"
        );
        let err = routing("hashing = \"words\"\nblock_tokens = 0")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("routing.hashing: unknown variant `words`, expected one of `bytes`, `tokens`, `precise`"),
            "{err}"
        );
        assert!(
            err.contains("routing.block_tokens: must be at least 1"),
            "{err}"
        );

        let file = std::env::temp_dir().join(format!("radixgate-cfg-{}.json", std::process::id()));
        crate::token_mode::tests::word_tokenizer(&["hello"])
            .save(&file, false)
            .unwrap();
        let c = routing(&format!(
            "hashing = \"tokens\"\ntokenizer = \"{}\"\nblock_tokens = 128",
            file.display()
        ))
        .unwrap();
        std::fs::remove_file(&file).ok();
        assert!(matches!(
            c.routing.hashing,
            Hashing::Tokens { block_tokens, .. } if block_tokens.get() == 128
        ));
        assert_eq!(c.routing.prefix_aware.tokens_per_block, 128.0);
    }

    #[test]
    fn precise_mode_needs_a_template_global_isolation_and_owns_kv_events() {
        let dir = std::env::temp_dir().join(format!("radixgate-precise-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let tokenizer = dir.join("tokenizer.json");
        crate::token_mode::tests::word_tokenizer(&["hello"])
            .save(&tokenizer, false)
            .unwrap();
        let precise = format!(
            "hashing = \"precise\"\ntokenizer = \"{}\"",
            tokenizer.display()
        );
        // No template beside the tokenizer and none configured.
        let err = routing(&precise).unwrap_err().to_string();
        assert!(err.contains("routing.chat_template: required"), "{err}");
        // One beside it is found.
        std::fs::write(
            dir.join("chat_template.jinja"),
            "{{ messages[0]['content'] }}",
        )
        .unwrap();
        let c = routing(&precise).unwrap();
        assert!(matches!(
            c.routing.hashing,
            Hashing::Tokens {
                template: Some(_),
                ..
            }
        ));
        // kv_events needs precise mode and a ZeroMQ endpoint.
        let with_events = |routing_extra: &str, endpoint: &str, tenancy: &str| {
            Config::from_toml(&format!(
                "[routing]\n{routing_extra}\n{tenancy}\n[[backends]]\nid = \"b0\"\n\
                 url = \"http://127.0.0.1:9\"\nmodels = [\"m\"]\nkv_events = \"{endpoint}\"\n"
            ))
        };
        assert!(with_events(&precise, "tcp://127.0.0.1:5557", "").is_ok());
        let err = with_events("", "tcp://127.0.0.1:5557", "")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("backends[0].kv_events: needs routing.hashing"),
            "{err}"
        );
        let err = with_events(&precise, "http://x", "")
            .unwrap_err()
            .to_string();
        assert!(err.contains("is not a tcp:// or ipc:// endpoint"), "{err}");
        let err = with_events(
            &precise,
            "tcp://127.0.0.1:5557",
            "[tenancy]\nprefix_isolation = \"tenant\"",
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("precise mode needs tenancy.prefix_isolation"),
            "{err}"
        );
        // kv_events_connect: the gateway connects (the engine binds); one of the two.
        let with_keys = |keys: &str| {
            Config::from_toml(&format!(
                "[routing]\n{precise}\n[[backends]]\nid = \"b0\"\n\
                 url = \"http://127.0.0.1:9\"\nmodels = [\"m\"]\n{keys}\n"
            ))
        };
        let c = with_keys(
            "kv_events_connect = \"tcp://10.0.0.5:5557\"\nkv_events_replay = \"tcp://10.0.0.5:5558\"",
        )
        .unwrap();
        assert_eq!(
            c.backends[0].kv_events,
            Some(KvEventsSource {
                endpoint: "tcp://10.0.0.5:5557".into(),
                connect: true,
                replay: Some("tcp://10.0.0.5:5558".into()),
            })
        );
        let c = with_keys("kv_events = \"tcp://127.0.0.1:5557\"").unwrap();
        assert!(!c.backends[0].kv_events.as_ref().unwrap().connect);
        for (keys, expected) in [
            (
                "kv_events = \"tcp://127.0.0.1:1\"\nkv_events_connect = \"tcp://127.0.0.1:1\"",
                "backends[0].kv_events_connect: excludes kv_events",
            ),
            (
                "kv_events_replay = \"tcp://127.0.0.1:1\"",
                "backends[0].kv_events_replay: needs kv_events or kv_events_connect",
            ),
            (
                "kv_events_connect = \"tcp://*:5557\"",
                "backends[0].kv_events_connect: `tcp://*:5557` is a wildcard",
            ),
            (
                "kv_events_connect = \"http://x\"",
                "backends[0].kv_events_connect: `http://x` is not a tcp:// or ipc://",
            ),
            (
                "kv_events_connect = \"ipc:///tmp/e\"\nkv_events_replay = \"udp://x\"",
                "backends[0].kv_events_replay: `udp://x` is not a tcp:// or ipc://",
            ),
        ] {
            let err = with_keys(keys).unwrap_err().to_string();
            assert!(err.contains(expected), "{keys}: {err}");
        }
        let err = Config::from_toml(
            "[[backends]]\nid = \"b0\"\nurl = \"http://127.0.0.1:9\"\nmodels = [\"m\"]\n\
             kv_events_connect = \"tcp://127.0.0.1:1\"\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("backends[0].kv_events_connect: needs routing.hashing"),
            "{err}"
        );
        // The admin API cannot add a subscription at run time.
        let err = BackendConfig::from_json(
            br#"{"id":"x","url":"http://127.0.0.1:9","models":["m"],"kv_events":"tcp://127.0.0.1:1"}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("backend.kv_events"), "{err}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn tiers_and_admission() {
        let c = routing("\n[admission]\nqueue_capacity = 8\nanonymous_tier = \"free\"\n[tiers.free]\nttft_budget_ms = 900\nshed_pressure = 1.0\n[tiers.gold]\npriority = 5\n").unwrap();
        assert_eq!(c.admission.queue_capacity, 8);
        assert_eq!(
            c.admission.anonymous.ttft_budget,
            Some(Duration::from_millis(900))
        );
        assert_eq!(c.admission.anonymous.shed_pressure, Some(1.0));
        let err = Config::from_toml(
            "[admission]\npressure_kv = 2.0\nanonymous_tier = \"none\"\n[tiers.free]\nttft_budget_ms = 0\nshed_pressure = -1.0\n[[tenants]]\nname = \"a\"\ntier = \"gold\"\nkeys = []\n[tiers.free.extra]\n",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("extra"), "{err}");
        let err = Config::from_toml(
            "[admission]\npressure_kv = 2.0\nanonymous_tier = \"none\"\n[tiers.free]\nttft_budget_ms = 0\nshed_pressure = -1.0\n[[tenants]]\nname = \"a\"\ntier = \"gold\"\nkeys = []\n",
        )
        .unwrap_err()
        .to_string();
        for needle in [
            "admission.pressure_kv",
            "admission.anonymous_tier: unknown tier `none`",
            "tiers.free.ttft_budget_ms",
            "tiers.free.shed_pressure",
            "tenants[0].tier: unknown tier `gold`",
        ] {
            assert!(err.contains(needle), "missing {needle} in:\n{err}");
        }
    }

    #[test]
    fn unknown_keys_are_errors() {
        let err = Config::from_toml("[server]\nlisten_addr = \"x\"\n").unwrap_err();
        assert!(err.to_string().contains("listen_addr"), "{err}");
    }
}
