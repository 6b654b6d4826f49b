//! The control plane's shared types: what the shards, the coordinator and the
//! control threads (admin API, reload, KV events, cluster, OTLP) hand each other.
//!
//! - [`Shared`]: the read-only state and channels every shard and control thread
//!   holds (config as started, cross-shard counters, senders to the coordinator
//!   and the log and span threads).
//! - [`ShardCommand`]: coordinator → shard (fleet snapshots, replicated index
//!   events, metric collection).
//! - [`Outcome`]: shard → coordinator (request outcomes, for the breakers).
//! - [`AdminRequest`] and [`ask`]: admin API, reload and cluster threads →
//!   coordinator, each with its reply channel.
//! - [`Share`] and [`Snapshot`]: coordinator ↔ cluster threads.
//!
//! They live here, below every thread that uses them, so that the data plane
//! (`shard`, `proxy`) and the control plane (`coordinator`, `admin`, `cluster`, ...)
//! depend on this module and never on each other.

use crate::backends::MAX_BACKEND_SLOTS;
use crate::config::{BackendConfig, Config};
use crate::error::{ErrorKind, GatewayError};
use crate::fleet::{FleetSnapshot, InFlight};
use crate::metrics::ShardMetrics;
use crate::pending_prefill::PendingPrefill;
use crate::replica::{IndexEvent, ReplicaSent};
use crossbeam_channel::{bounded, Sender};
use radixgate_orchestrator::policy::BackendIdx;
use radixgate_orchestrator::Held;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Read-only state shared by every shard.
pub struct Shared {
    /// The config as started. Keys that can change at run time (every key
    /// [`crate::config::keys::KEYS`] classifies live, and the tenants) are read from
    /// the fleet snapshot's [`LiveConfig`](crate::backends::LiveConfig) instead.
    pub config: Config,
    /// Per shard and backend slot, sized for [`MAX_BACKEND_SLOTS`].
    pub in_flight: InFlight,
    /// Predicted uncached prompt tokens of the requests in flight that have no first
    /// response byte yet, and the engine's progress on them: the prefill work queued
    /// at each engine on the gateway's account (`prefix_aware`'s and SLO admission's
    /// queue estimate). Same layout.
    pub pending_prefill: PendingPrefill,
    pub shard_commands: Vec<flume::Sender<ShardCommand>>,
    /// Shard → coordinator index events (crossbeam: lock-free send).
    pub index_events: crossbeam_channel::Sender<IndexEvent>,
    /// Shard → log thread, one record per request (`None` when access logs are off).
    pub access_log: Option<crossbeam_channel::Sender<crate::access_log::AccessRecord>>,
    /// Shard → OTLP exporter, finished spans (`None` when traces are off; set by
    /// the gateway at start).
    pub spans: Option<crossbeam_channel::Sender<crate::otlp::SpanRecord>>,
    pub span_counters: Arc<crate::otlp::SpanCounters>,
    /// Shard → coordinator request outcomes, for the circuit breakers.
    pub outcomes: crossbeam_channel::Sender<Outcome>,
    pub replica_sent: ReplicaSent,
    /// Index events the coordinator has received from shards and peer replicas
    /// (coordinator writes; this replica's own engine facts are not counted, so
    /// that the pending gauge compares like with like).
    pub coordinator_received: AtomicU64,
    /// Blocks in the coordinator's authoritative index (coordinator writes).
    pub index_blocks: AtomicU64,
    /// Zero of the index's logical clock (milliseconds since start).
    pub epoch: Instant,
    /// Where each shard thread runs (written once by each, read by the admin API).
    pub placements: crate::placement::Placements,
    /// Per backend, what its KV-event subscription applied (precise mode; the
    /// `radixgate-kv` thread writes, scrapes read).
    pub kv_events: Arc<[crate::kv_events::KvEventCounters]>,
    /// Cluster mode's state, as its threads report it (`None` outside a cluster;
    /// set by the gateway at start).
    pub cluster: Option<Arc<crate::status::ClusterStatus>>,
    /// The capacity signal's latest report (the capacity thread writes it).
    pub capacity: Arc<crate::status::capacity::CapacityStatus>,
    /// Per `[[discovery]]` name, what the discovery thread found (it writes them).
    pub discovery: Arc<crate::status::discovery::DiscoveryStatus>,
}

impl Shared {
    /// Asks every shard for a copy of its metrics; returns where the copies arrive and
    /// how many shards were asked (a shard that has stopped is not). `/metrics` and
    /// `GET /admin/shards` read them, each with its own wait.
    pub fn ask_shards_for_metrics(&self) -> (flume::Receiver<ShardMetrics>, usize) {
        let (tx, rx) = flume::bounded(self.shard_commands.len());
        let asked = self
            .shard_commands
            .iter()
            .filter(|cmd| cmd.send(ShardCommand::CollectMetrics(tx.clone())).is_ok())
            .count();
        (rx, asked)
    }

    pub fn new(
        config: Config,
        shard_commands: Vec<flume::Sender<ShardCommand>>,
        index_events: crossbeam_channel::Sender<IndexEvent>,
        outcomes: crossbeam_channel::Sender<Outcome>,
        access_log: Option<crossbeam_channel::Sender<crate::access_log::AccessRecord>>,
    ) -> Shared {
        let epoch = Instant::now();
        let shards = config.server.shards.get();
        Shared {
            kv_events: (0..config.backends.len())
                .map(|_| Default::default())
                .collect(),
            index_events,
            outcomes,
            access_log,
            spans: None,
            cluster: None,
            capacity: Arc::default(),
            discovery: Arc::new(crate::status::discovery::DiscoveryStatus::new(
                config.discovery.iter().map(|d| d.name.as_str()),
            )),
            span_counters: Default::default(),
            replica_sent: ReplicaSent::new(shard_commands.len()),
            coordinator_received: AtomicU64::new(0),
            index_blocks: AtomicU64::new(0),
            epoch,
            placements: crate::placement::Placements::new(config.server.shards.get()),
            in_flight: match config.cluster {
                Some(_) => InFlight::with_peers(shards, MAX_BACKEND_SLOTS),
                None => InFlight::new(shards, MAX_BACKEND_SLOTS),
            },
            pending_prefill: PendingPrefill::new(shards, MAX_BACKEND_SLOTS, epoch),
            shard_commands,
            config,
        }
    }

    /// The index's logical clock.
    pub fn now_ms(&self) -> u64 {
        self.ms_at(Instant::now())
    }

    /// The index's logical clock at `at`, a clock reading the caller already has.
    pub fn ms_at(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.epoch).as_millis() as u64
    }
}

pub enum ShardCommand {
    /// A new fleet snapshot, installed between requests.
    Fleet(Arc<FleetSnapshot>),
    /// An index event another shard originated, to apply to this replica.
    Replicate(Arc<IndexEvent>),
    CollectMetrics(flume::Sender<ShardMetrics>),
}

/// A request's outcome on one backend, as a shard saw it (for the breakers).
pub struct Outcome {
    pub backend: usize,
    pub ok: bool,
}

/// A reply to an admin change: the answer's JSON, or the error to send.
type Reply = Sender<Result<serde_json::Value, GatewayError>>;

/// What the admin thread asks the coordinator; each carries its reply channel.
pub enum AdminRequest {
    /// JSON array describing every backend.
    Backends(Sender<serde_json::Value>),
    /// Drain (`on = true`) or undrain a backend by id; `Err` for an unknown id.
    Drain {
        id: String,
        on: bool,
        reply: Sender<Result<serde_json::Value, String>>,
    },
    /// JSON summary of the prefix index.
    Index(Sender<serde_json::Value>),
    /// The configuration in force as JSON, secrets redacted.
    Config(Sender<serde_json::Value>),
    /// The fleet as last published (the capacity thread's view of the engines).
    Fleet(Sender<Arc<FleetSnapshot>>),
    /// Add a validated backend (409 for a duplicate id).
    AddBackend {
        backend: Box<BackendConfig>,
        reply: Reply,
    },
    /// Remove the backend with this id (404 unknown, 409 the last one).
    RemoveBackend { id: String, reply: Reply },
    /// Apply a reloaded, validated config; the reply summarises what changed.
    Reload { config: Box<Config>, reply: Reply },
    /// The authoritative index and session bindings, for a joining cluster peer
    /// (asked by the cluster subscriber, not the admin API).
    Snapshot(Sender<Snapshot>),
    /// A peer replica saw this backend slot fail (from the cluster subscriber).
    PeerFault { backend: usize },
    /// A peer's snapshot, as index ops: applied (and fanned out to every shard)
    /// before the reply, so a replica is ready only once its index holds it.
    LoadPeerOps {
        ops: Vec<crate::replica::IndexOp>,
        reply: Sender<()>,
    },
}

/// Sends `make(reply)` to the coordinator and waits for its answer.
pub fn ask<T>(
    coordinator: &Sender<AdminRequest>,
    make: impl FnOnce(Sender<T>) -> AdminRequest,
) -> Result<T, GatewayError> {
    let (tx, rx) = bounded(1);
    let unavailable = || {
        GatewayError::new(
            ErrorKind::NoHealthyBackend,
            "the coordinator is not answering",
        )
    };
    coordinator.send(make(tx)).map_err(|_| unavailable())?;
    rx.recv_timeout(Duration::from_secs(5))
        .map_err(|_| unavailable())
}

/// What the coordinator hands the publisher to share.
#[derive(Debug)]
pub enum Share {
    /// An index op of this replica's routing decisions.
    Index(crate::replica::IndexOp),
    /// This replica's own health check or breaker changed a backend's state.
    Health {
        backend: BackendIdx,
        healthy: bool,
        breaker: radixgate_orchestrator::BreakerState,
    },
}

/// The coordinator's index, session bindings and RAG chunk holdings at `now_ms` (its
/// index clock), for a joining peer.
pub struct Snapshot {
    pub now_ms: u64,
    pub index: Vec<Held>,
    /// `(session, backend, last bound)`.
    pub sessions: Vec<(u64, BackendIdx, u64)>,
    /// `(backend, sent at, chunks)`.
    pub chunks: Vec<(BackendIdx, u64, Vec<u64>)>,
}
