//! The coordinator thread: the fleet's source of truth, off the request path.
//!
//! It owns the authoritative prefix index and session table, numbers and fans out
//! the index events shards send it (see [`crate::replica`]), and turns health-check
//! results, breaker changes and admin changes into immutable [`FleetSnapshot`]s
//! published to every shard on change. The backend table and live settings are
//! part of the snapshot; adding and removing backends and applying a reloaded
//! config live in [`changes`]. The health checks run on their own thread
//! ([`run_health_checks`]) so a slow backend never delays replication; with each
//! passing check they also read the engine's `GET /v1/models`, whose LoRA adapters
//! become the snapshot's [`AdapterTable`] ([`crate::adapters`]).

mod changes;

use crate::adapters::{self, AdapterTable, EngineAdapter};
use crate::backends::LiveConfig;
use crate::config::{BackendConfig, Config};
use crate::control::{AdminRequest, Outcome, ShardCommand, Share, Shared, Snapshot};
use crate::engine_metrics::{self, EngineLoad};
use crate::fleet::FleetSnapshot;
use crate::replica::{new_replica, IndexEvent, IndexOp, Origin};
use crossbeam_channel::{select, Receiver, Sender};
use radixgate_orchestrator::{Breaker, BreakerConfig, Replica};
use serde_json::json;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One probe of one backend: its health check, and (when due) its metrics scrape.
pub struct HealthReport {
    pub backend: usize,
    pub ok: Option<bool>,
    /// `Some(None)`: scraped, nothing usable (stale from now on).
    pub engine: Option<Option<EngineLoad>>,
    /// The LoRA adapters its `GET /v1/models` lists; `None` when not asked (a failed
    /// check) or not answered with a model list (the last answer stands).
    pub adapters: Option<Vec<EngineAdapter>>,
}

/// Per backend slot (retired slots keep theirs): breaker, health, drain, engine load
/// and index capacity.
pub struct Coordinator {
    shared: Arc<Shared>,
    /// The backend table and settings in force, as last published.
    live: Arc<LiveConfig>,
    /// Threads that follow the live config besides the shards (health checks, the
    /// access log); each new one goes to them before it reaches any shard.
    followers: Vec<Sender<Arc<LiveConfig>>>,
    breakers: Vec<Breaker>,
    breaker_config: BreakerConfig,
    healthy: Vec<bool>,
    passes: Vec<u32>,
    failures: Vec<u32>,
    version: u64,
    draining: Vec<bool>,
    engine: Vec<Option<EngineLoad>>,
    capacity: Vec<usize>,
    /// The authoritative replica.
    replica: Replica,
    /// Restart-only keys the last reload found changed (not in force).
    restart_pending: Vec<String>,
    /// Cluster mode: this replica's routing ops and health changes, to the
    /// publisher thread.
    cluster: Option<Sender<Share>>,
    /// Each slot's adapters as its engine last listed them.
    learned: Vec<Vec<EngineAdapter>>,
    /// What the shards route adapters with, derived from `learned` and `adapters_of`.
    adapters: Arc<AdapterTable>,
    /// The live config `adapters` was derived for.
    adapters_of: Arc<LiveConfig>,
}

impl Coordinator {
    pub fn new(
        shared: Arc<Shared>,
        live: Arc<LiveConfig>,
        followers: Vec<Sender<Arc<LiveConfig>>>,
    ) -> Self {
        let n = live.backends.len();
        let replica = new_replica(&shared.config, &live);
        let capacity = (0..n)
            .map(|b| live.backends.config(b).cache_blocks)
            .collect();
        Self {
            breakers: vec![Breaker::default(); n],
            breaker_config: breaker_config(&live.config),
            capacity,
            shared,
            adapters_of: live.clone(),
            live,
            followers,
            healthy: vec![true; n],
            passes: vec![0; n],
            failures: vec![0; n],
            version: 0,
            draining: vec![false; n],
            engine: vec![None; n],
            replica,
            restart_pending: Vec::new(),
            cluster: None,
            learned: Vec::new(),
            adapters: Arc::default(),
        }
    }

    /// Shares this replica's routing ops with the cluster (the publisher thread).
    pub fn with_cluster(mut self, ops: Sender<Share>) -> Self {
        self.cluster = Some(ops);
        self
    }

    /// Runs until `stop` is dropped or fires.
    pub fn run(
        mut self,
        stop: Receiver<()>,
        events: Receiver<IndexEvent>,
        health: Receiver<HealthReport>,
        outcomes: Receiver<Outcome>,
        admin: Receiver<AdminRequest>,
    ) {
        loop {
            let now = self.shared.now_ms();
            let next = self
                .breakers
                .iter()
                .filter_map(|b| b.next_tick_ms(&self.breaker_config))
                .min()
                .map_or(Duration::from_secs(3600), |t| {
                    Duration::from_millis(t.saturating_sub(now))
                });
            select! {
                recv(admin) -> request => {
                    if let Ok(request) = request {
                        self.on_admin(request);
                    }
                }
                recv(outcomes) -> o => {
                    if let Ok(o) = o {
                        self.on_outcome(o);
                    }
                }
                default(next) => {
                    let now = self.shared.now_ms();
                    let mut changed = false;
                    for i in 0..self.breakers.len() {
                        if self.breakers[i].tick(now, &self.breaker_config) {
                            self.log_breaker(i);
                            changed = true;
                        }
                    }
                    if changed {
                        self.publish_fleet();
                    }
                }
                recv(stop) -> _ => return,
                recv(events) -> ev => match ev {
                    Ok(ev) => self.replicate(ev),
                    Err(_) => return,
                },
                recv(health) -> report => {
                    if let Ok(r) = report {
                        self.on_health(r);
                    }
                }
            }
        }
    }

    fn on_outcome(&mut self, o: Outcome) {
        if !self.live.backends.is_live(o.backend) {
            return; // a request that finished on a removed backend
        }
        let now = self.shared.now_ms();
        if self.breakers[o.backend].on_outcome(o.ok, now, &self.breaker_config) {
            self.log_breaker(o.backend);
            self.share_health(o.backend);
            self.publish_fleet();
        }
    }

    /// Hands something to the cluster publisher, if in a cluster. Never waits: a
    /// full queue means the bus is not keeping up (counted as unsent).
    fn share(&self, what: Share) {
        if let Some(cluster) = &self.cluster {
            if cluster.try_send(what).is_err() {
                if let Some(status) = &self.shared.cluster {
                    status.ops_unsent.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// Shares this replica's own view of a backend after its checks or requests
    /// changed it.
    fn share_health(&self, backend: usize) {
        self.share(Share::Health {
            backend,
            healthy: self.healthy[backend],
            breaker: self.breakers[backend].state(),
        });
    }

    /// A peer replica saw `backend` fail (its breaker opened, or its health checks
    /// failed): open this replica's breaker too, so the whole fleet skips it within
    /// the bus's lag. It half-opens after `breaker.open_ms` and real requests
    /// decide from there, so a peer that was wrong costs at most that.
    fn on_peer_fault(&mut self, backend: usize) {
        if !self.live.backends.is_live(backend) {
            return;
        }
        if self.breakers[backend].trip(self.shared.now_ms()) {
            let id = self.live.backends.id(backend);
            tracing::warn!(backend = %id, "circuit breaker opened: a peer replica saw the backend fail");
            self.publish_fleet();
        }
    }

    fn replicate(&mut self, event: IndexEvent) {
        let counted = event.origin != Origin::Local;
        self.apply_and_fan_out(event);
        // Counted once fanned out (Release): a scrape that reads this count first
        // and the per-shard sent counts after sees this event as sent, so
        // "nothing pending, no shard lagging" means every shard has it.
        if counted {
            self.shared
                .coordinator_received
                .fetch_add(1, Ordering::Release);
        }
    }

    fn apply_and_fan_out(&mut self, event: IndexEvent) {
        self.replica.apply(&event.op);
        if let Origin::Shard(_) = event.origin {
            self.share(Share::Index(event.op.clone()));
        }
        self.shared
            .index_blocks
            .store(self.replica.index.total_blocks() as u64, Ordering::Relaxed);
        let event = Arc::new(event);
        for (k, shard) in self.shared.shard_commands.iter().enumerate() {
            if Some(k) != event.origin.shard()
                && shard.send(ShardCommand::Replicate(event.clone())).is_ok()
            {
                self.shared.replica_sent.add(k);
            }
        }
    }

    fn on_health(&mut self, r: HealthReport) {
        let i = r.backend;
        if !self.live.backends.is_live(i) {
            return; // removed since the probe started
        }
        let mut changed = false;
        if let Some(ok) = r.ok {
            if self.on_check(i, ok) {
                self.share_health(i);
                changed = true;
            }
        }
        if let Some(load) = r.engine {
            if load != self.engine[i] {
                self.engine[i] = load;
                changed = true;
            }
            if let Some(tokens) = load.and_then(|l| l.cache_tokens) {
                self.follow_cache_size(i, tokens);
            }
        }
        if let Some(listed) = r.adapters {
            if self.learned.len() <= i {
                self.learned.resize(i + 1, Vec::new());
            }
            if self.learned[i] != listed {
                self.learned[i] = listed;
                changed |= self.derive_adapters();
            }
        }
        if changed {
            self.publish_fleet();
        }
    }

    fn on_admin(&mut self, request: AdminRequest) {
        match request {
            AdminRequest::Backends(reply) => {
                let all = self
                    .live
                    .backends
                    .live()
                    .map(|(b, _)| self.backend_json(b))
                    .collect();
                let _ = reply.send(serde_json::Value::Array(all));
            }
            AdminRequest::Index(reply) => {
                let shared = &self.shared;
                let per_backend: serde_json::Map<String, serde_json::Value> = self
                    .live
                    .backends
                    .live()
                    .map(|(i, b)| (b.id.clone(), json!(self.replica.index.held_blocks(i))))
                    .collect();
                let sent: Vec<u64> = (0..shared.shard_commands.len())
                    .map(|k| shared.replica_sent.get(k))
                    .collect();
                let _ = reply.send(json!({
                    "blocks": self.replica.index.total_blocks(),
                    "nodes": self.replica.index.node_count(),
                    "max_blocks": shared.config.routing.index_max_blocks,
                    "blocks_per_backend": per_backend,
                    "events_received": shared.coordinator_received.load(Ordering::Relaxed),
                    "events_sent_per_shard": sent,
                    "replica_lag": "see radixgate_replica_lag_events and radixgate_replica_lag_seconds on /metrics",
                }));
            }
            AdminRequest::Config(reply) => {
                let _ = reply.send(json!({
                    "source": self.live.config.source.as_ref().map(|p| p.display().to_string()),
                    "config": crate::config::keys::redacted(self.live.tree()),
                    "restart_pending": self.restart_pending,
                }));
            }
            AdminRequest::Drain { id, on, reply } => {
                let result = match self.live.backends.find(&id) {
                    Some(b) => {
                        if self.draining[b] != on {
                            self.draining[b] = on;
                            tracing::info!(backend = %id, draining = on, "admin: drain state changed");
                            self.publish_fleet();
                        }
                        Ok(self.backend_json(b))
                    }
                    None => Err(format!("no backend with id `{id}`")),
                };
                let _ = reply.send(result);
            }
            AdminRequest::AddBackend { backend, reply } => {
                let _ = reply.send(self.on_add(*backend));
            }
            AdminRequest::RemoveBackend { id, reply } => {
                let _ = reply.send(self.on_remove(&id));
            }
            AdminRequest::Reload { config, reply } => {
                let _ = reply.send(self.on_reload(*config));
            }
            AdminRequest::Fleet(reply) => {
                let _ = reply.send(self.snapshot());
            }
            AdminRequest::PeerFault { backend } => self.on_peer_fault(backend),
            AdminRequest::LoadPeerOps { ops, reply } => {
                let created = std::time::Instant::now();
                for op in ops {
                    self.apply_and_fan_out(IndexEvent {
                        origin: Origin::Peer,
                        created,
                        op,
                    });
                }
                let _ = reply.send(());
            }
            AdminRequest::Snapshot(reply) => {
                let _ = reply.send(Snapshot {
                    now_ms: self.shared.now_ms(),
                    index: self.replica.index.export(),
                    sessions: self.replica.sessions.export(),
                    chunks: self.replica.chunks.export(),
                });
            }
        }
    }

    fn backend_json(&self, b: usize) -> serde_json::Value {
        let cfg = self.live.backends.config(b);
        let in_flight = self.shared.in_flight.local_total(b);
        let fleet_in_flight = self.shared.in_flight.total(b);
        json!({
            "id": cfg.id,
            "url": format!("http://{}", cfg.host),
            "models": cfg.models,
            "capabilities": cfg.capabilities.names().collect::<Vec<_>>(),
            "role": cfg.role.as_str(),
            "bootstrap_port": cfg.bootstrap_port,
            "discovered": cfg.discovered,
            "healthy": self.healthy[b],
            "breaker": self.breakers[b].state().as_str(),
            "in_flight": in_flight,
            "fleet_in_flight": fleet_in_flight,
            "engine": self.engine[b].map(|e| json!({
                "waiting": e.waiting,
                "running": e.running,
                "kv_usage": e.kv_usage,
                "cache_tokens": e.cache_tokens,
            })),
            "adapters": self.adapters.served().filter(|(name, _, _)| {
                self.adapters.get(name).is_some_and(|a| self.adapters.serves(b, a))
            }).map(|(name, _, _)| name).collect::<Vec<_>>(),
            "blocks_held": self.replica.index.held_blocks(b),
            "capacity_blocks": self.capacity[b],
            "draining": self.draining[b],
            "drained": self.draining[b] && in_flight == 0,
        })
    }

    fn log_breaker(&self, backend: usize) {
        let state = self.breakers[backend].state();
        let id = self.live.backends.id(backend);
        tracing::warn!(backend = %id, state = state.as_str(), "circuit breaker changed state");
    }

    /// Derives the adapter table from what the engines listed and the backend table
    /// in force; true when routing would change.
    fn derive_adapters(&mut self) -> bool {
        let (table, ignored) =
            AdapterTable::derive(&self.adapters, &self.learned, &self.live.backends);
        if ignored > 0 {
            tracing::warn!(
                ignored,
                max = adapters::MAX_ADAPTERS,
                "LoRA adapters beyond the gateway's limit are not routed"
            );
        }
        self.adapters_of = self.live.clone();
        if table.same_as(&self.adapters) {
            return false;
        }
        for (name, _, _) in table.served() {
            if self
                .adapters
                .get(name)
                .is_none_or(|a| self.adapters.serving(a).is_empty())
            {
                tracing::info!(adapter = %name, "a LoRA adapter became routable");
            }
        }
        self.adapters = Arc::new(table);
        true
    }

    /// Sends every shard one new immutable snapshot of the whole fleet.
    fn publish_fleet(&mut self) {
        if !Arc::ptr_eq(&self.adapters_of, &self.live) {
            // Backends or their models changed: which adapters count may too.
            self.derive_adapters();
        }
        self.version += 1;
        let snapshot = self.snapshot();
        for s in &self.shared.shard_commands {
            let _ = s.send(ShardCommand::Fleet(snapshot.clone()));
        }
    }

    /// The fleet as it stands, numbered with the current version.
    fn snapshot(&self) -> Arc<FleetSnapshot> {
        Arc::new(FleetSnapshot {
            version: self.version,
            live: self.live.clone(),
            healthy: self.healthy.clone().into_boxed_slice(),
            engine: self.engine.clone().into_boxed_slice(),
            breaker: self.breakers.iter().map(Breaker::state).collect(),
            draining: self.draining.clone().into_boxed_slice(),
            adapters: self.adapters.clone(),
        })
    }

    /// Applies one health-check result; true when the backend changed state.
    fn on_check(&mut self, i: usize, ok: bool) -> bool {
        let thresholds = &self.live.config.health;
        let id = self.live.backends.id(i);
        let flip = if ok {
            self.passes[i] += 1;
            self.failures[i] = 0;
            !self.healthy[i] && self.passes[i] >= thresholds.healthy_threshold
        } else {
            self.failures[i] += 1;
            self.passes[i] = 0;
            self.healthy[i] && self.failures[i] >= thresholds.unhealthy_threshold
        };
        if flip {
            self.healthy[i] = ok;
            if ok {
                tracing::info!(backend = %id, "backend is healthy again");
            } else {
                tracing::warn!(backend = %id, "backend failed its health checks");
            }
        }
        flip
    }

    /// The engine told us its KV-cache size: the index follows it.
    fn follow_cache_size(&mut self, backend: usize, cache_tokens: u64) {
        let tokens_per_block = self.shared.config.routing.prefix_aware.tokens_per_block;
        let blocks = ((cache_tokens as f64 / tokens_per_block) as usize).max(1);
        if blocks != self.capacity[backend] {
            self.capacity[backend] = blocks;
            tracing::info!(backend = %self.live.backends.id(backend), blocks, "index capacity follows the engine's cache size");
            self.apply_and_fan_out(IndexEvent {
                origin: Origin::Local,
                created: std::time::Instant::now(),
                op: IndexOp::SetCapacity { backend, blocks },
            });
        }
    }
}

fn breaker_config(config: &Config) -> BreakerConfig {
    BreakerConfig {
        failure_threshold: config.breaker.failure_threshold,
        open_ms: config.breaker.open.as_millis() as u64,
    }
}

/// The probe thread: health-checks every live backend each `health.interval` and
/// scrapes its `/metrics` each `health.scrape_interval`, reporting to the coordinator.
/// A new live config (`updates`: backends added or removed, new health settings)
/// takes effect at once, with an immediate round so a new backend is checked
/// without waiting an interval. Ends when `stop` is dropped or fires.
pub fn run_health_checks(
    mut live: Arc<LiveConfig>,
    updates: Receiver<Arc<LiveConfig>>,
    reports: Sender<HealthReport>,
    stop: Receiver<()>,
) {
    let start = Instant::now();
    let mut next_check = start;
    let mut next_scrape = start;
    loop {
        let health = live.config.health.clone();
        let now = Instant::now();
        let check = now >= next_check;
        let scrape = health.scrape_interval.is_some() && now >= next_scrape;
        if check {
            next_check = now + health.interval;
        }
        if let Some(every) = health.scrape_interval.filter(|_| scrape) {
            next_scrape = now + every;
        }
        for (i, b) in live.backends.live() {
            let ok = check.then(|| probe_health(b, health.timeout));
            let report = HealthReport {
                backend: i,
                ok,
                adapters: (ok == Some(true))
                    .then(|| http_get(b, "/v1/models", health.timeout))
                    .flatten()
                    .filter(|(status, _)| *status == 200)
                    .and_then(|(_, body)| adapters::parse_model_list(&body)),
                engine: scrape.then(|| {
                    http_get(b, "/metrics", health.timeout)
                        .filter(|(status, _)| *status == 200)
                        .and_then(|(_, body)| {
                            engine_metrics::parse(&String::from_utf8_lossy(&body))
                        })
                }),
            };
            if (check || scrape) && reports.send(report).is_err() {
                return;
            }
        }
        let mut wake = next_check;
        if health.scrape_interval.is_some() {
            wake = wake.min(next_scrape);
        }
        select! {
            recv(stop) -> _ => return,
            recv(updates) -> update => match update {
                Ok(newer) => {
                    live = newer;
                    next_check = Instant::now();
                    next_scrape = next_check;
                }
                Err(_) => return,
            },
            default(wake.saturating_duration_since(Instant::now())) => {}
        }
    }
}

/// One `GET /health`; true on a 2xx status within `timeout`.
fn probe_health(backend: &BackendConfig, timeout: Duration) -> bool {
    http_get(backend, "/health", timeout).is_some_and(|(status, _)| (200..300).contains(&status))
}

/// A blocking `GET` with `Connection: close` (over TLS to an `https://` backend),
/// bounded by `timeout` per step and by 4 MiB of body. Returns the status and the
/// body.
fn http_get(backend: &BackendConfig, path: &str, timeout: Duration) -> Option<(u16, Vec<u8>)> {
    let s = TcpStream::connect_timeout(&backend.addr, timeout).ok()?;
    s.set_read_timeout(Some(timeout)).ok()?;
    s.set_write_timeout(Some(timeout)).ok()?;
    let req = format!(
        "GET {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
        backend.host
    );
    let raw = match &backend.tls {
        None => exchange(s, &req, timeout)?,
        Some(tls) => {
            let conn =
                rustls::ClientConnection::new(tls.config.clone(), tls.server_name.clone()).ok()?;
            exchange(rustls::StreamOwned::new(conn, s), &req, timeout)?
        }
    };
    parse_get_response(raw)
}

/// Writes `req` and reads the answer until the peer closes.
fn exchange(mut s: impl Read + Write, req: &str, timeout: Duration) -> Option<Vec<u8>> {
    s.write_all(req.as_bytes()).ok()?;
    let mut raw = Vec::with_capacity(4096);
    let deadline = Instant::now() + timeout * 2;
    let mut buf = [0u8; 8192];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
            Err(_) => break,
        }
        if raw.len() > 4 << 20 || Instant::now() > deadline {
            break;
        }
    }
    Some(raw)
}

fn parse_get_response(mut raw: Vec<u8>) -> Option<(u16, Vec<u8>)> {
    let mut head = crate::http::response::ResponseHead::default();
    let head_len = crate::http::response::parse_response_head(&raw, &mut head, false).ok()??;
    let mut body = raw.split_off(head_len);
    if head.framing() == crate::http::BodyFraming::Chunked {
        let mut decoded = Vec::with_capacity(body.len());
        let mut decoder = crate::http::chunked::ChunkedDecoder::new();
        decoder.feed(&body, |d| decoded.extend_from_slice(d)).ok()?;
        body = decoded;
    }
    Some((head.status, body))
}
