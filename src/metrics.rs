//! Gateway metrics: recorded shard-locally, merged and rendered at scrape time.
//!
//! Each shard owns a [`ShardMetrics`] (plain integers behind its `RefCell`, no atomics,
//! no locks). A `/metrics` scrape on any shard asks every shard for a copy over its
//! command channel, merges the copies and renders Prometheus text with
//! `prometheus-client` (see [`families`]).

mod families;

mod capacity;
mod disagg;
mod discovery;

pub use disagg::DisaggMetrics;

use crate::engine_metrics::EngineLoad;
use crate::learned::LearnedCost;
use families::{Families, Kind, Value};
use std::collections::HashMap;
use std::time::Duration;

/// Upper bounds of the latency buckets, in seconds.
const BUCKETS: [f64; 16] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

#[derive(Debug, Clone, Default)]
pub struct Histogram {
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum_seconds: f64,
}

impl Histogram {
    pub fn observe(&mut self, d: Duration) {
        let s = d.as_secs_f64();
        if let Some(i) = BUCKETS.iter().position(|b| s <= *b) {
            self.counts[i] += 1;
        }
        self.count += 1;
        self.sum_seconds += s;
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    pub fn sum_seconds(&self) -> f64 {
        self.sum_seconds
    }

    fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(other.counts.iter()) {
            *a += b;
        }
        self.count += other.count;
        self.sum_seconds += other.sum_seconds;
    }
}

/// Requests are counted by (backend, status, reason, model). `backend` and `model`
/// are `None` for requests the gateway answered itself (bad input, no backend,
/// quotas, local endpoints, a workflow as a whole): `model` is a configured model's
/// index, so the label's values stay bounded by the config.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RequestKey {
    pub backend: Option<usize>,
    pub status: u16,
    pub reason: &'static str,
    pub model: Option<usize>,
}

impl RequestKey {
    /// A request the gateway answered itself.
    pub fn gateway(status: u16, reason: &'static str) -> Self {
        Self {
            backend: None,
            status,
            reason,
            model: None,
        }
    }
}

/// A shard's counter map. Its keys are small and internal (indexes, statuses, static
/// names), and one is hashed on every request, so foldhash's fast hash instead of the
/// default SipHash (which cost ~1,000 instructions per request).
/// The `outcome` label of `radixgate_stream_migrations_total`, by index.
pub const STREAM_MIGRATION_OUTCOMES: [&str; 3] = ["resumed", "failed", "no_backend"];

pub type MetricMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

#[derive(Debug, Clone, Default)]
pub struct ShardMetrics {
    /// Filled in when collected: which shard, its replica's size and learned costs.
    pub shard: usize,
    pub replica_blocks: u64,
    pub learned: Vec<LearnedCost>,
    pub requests: MetricMap<RequestKey, u64>,
    /// Per model index.
    pub ttft: Vec<Histogram>,
    /// Per model index.
    pub total: Vec<Histogram>,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub completion_tokens: u64,
    /// Index events from other shards applied to this shard's replica.
    pub replica_applied: u64,
    /// Index events this shard sent to the coordinator.
    pub index_events_published: u64,
    /// Routing inserts (and session re-bindings) skipped because the pick already
    /// held the whole prompt (was the session's home), used less than
    /// `routing.index_touch_ms` ago.
    pub index_touches_coalesced: u64,
    /// Age of each replicated event when this shard applied it.
    pub replica_age: Histogram,
    /// Per backend: cached prompt tokens the index predicted for the requests routed
    /// there, what the engine reported, and the absolute difference.
    pub predicted_cached: Vec<u64>,
    pub reported_cached: Vec<u64>,
    pub prediction_abs_error: Vec<u64>,
    /// Per backend: prompt blocks matched in the index for the requests routed there.
    pub matched_blocks: Vec<u64>,
    /// Decision time (parse + hash + match + pick), in the routing-decision histogram.
    pub decision: Histogram,
    /// Per backend: attempts that failed there and were retried elsewhere.
    pub retries: Vec<u64>,
    /// Per backend: streams moved elsewhere because it sent no token by
    /// `retry.first_token_timeout_ms`.
    pub first_token_timeouts: Vec<u64>,
    /// Per backend: streams past their first-token deadline there kept waiting,
    /// because no other backend promised a first token sooner.
    pub first_token_waits: Vec<u64>,
    /// Retries refused because the shard's retry budget was spent.
    pub retry_budget_exhausted: u64,
    /// Streams continued on another engine after theirs died, by outcome
    /// ([`STREAM_MIGRATION_OUTCOMES`]).
    pub stream_migrations: [u64; 3],
    /// Requests refused by a tenant quota: (tenant index, limit) → count.
    pub throttled: MetricMap<(usize, &'static str), u64>,
    /// Requests refused for a missing or wrong API key.
    pub auth_failures: u64,
    /// Admission decisions: (tenant index or `usize::MAX`, decision, reason) → count.
    pub admission: MetricMap<(usize, &'static str, &'static str), u64>,
    /// Time requests spent in the edge queue.
    pub queue_wait: Histogram,
    /// Filled in when collected: requests in this shard's edge queue.
    pub queue_depth: u64,
    /// Filled in when collected (for `GET /admin/shards`): client connections open
    /// on this shard and requests being answered.
    pub open_connections: u64,
    pub active_requests: u64,
    /// Split prefill/decode serving.
    pub disagg: DisaggMetrics,
    /// How late this shard's event loop woke for its stall-detection tick.
    pub loop_lag: Histogram,
    /// Times this shard gave freed memory back after a burst of connections.
    pub memory_reclaims: u64,
}

impl ShardMetrics {
    pub fn new(models: usize, backends: usize) -> Self {
        Self {
            ttft: vec![Histogram::default(); models],
            total: vec![Histogram::default(); models],
            predicted_cached: vec![0; backends],
            reported_cached: vec![0; backends],
            prediction_abs_error: vec![0; backends],
            matched_blocks: vec![0; backends],
            retries: vec![0; backends],
            first_token_timeouts: vec![0; backends],
            first_token_waits: vec![0; backends],
            ..Default::default()
        }
    }

    /// Grows the per-model and per-backend rows (backends and models are only ever
    /// added: see [`crate::backends`]).
    pub fn resize(&mut self, models: usize, backends: usize) {
        for h in [&mut self.ttft, &mut self.total] {
            if h.len() < models {
                h.resize(models, Histogram::default());
            }
        }
        for v in [
            &mut self.predicted_cached,
            &mut self.reported_cached,
            &mut self.prediction_abs_error,
            &mut self.matched_blocks,
            &mut self.retries,
            &mut self.first_token_timeouts,
            &mut self.first_token_waits,
        ] {
            if v.len() < backends {
                v.resize(backends, 0);
            }
        }
    }

    pub fn count_request(&mut self, key: RequestKey) {
        *self.requests.entry(key).or_insert(0) += 1;
    }

    pub fn merge(&mut self, other: &ShardMetrics) {
        for (k, v) in &other.requests {
            *self.requests.entry(*k).or_insert(0) += v;
        }
        for (a, b) in self.ttft.iter_mut().zip(&other.ttft) {
            a.merge(b);
        }
        for (a, b) in self.total.iter_mut().zip(&other.total) {
            a.merge(b);
        }
        self.prompt_tokens += other.prompt_tokens;
        self.cached_tokens += other.cached_tokens;
        self.completion_tokens += other.completion_tokens;
        self.replica_applied += other.replica_applied;
        self.index_events_published += other.index_events_published;
        self.index_touches_coalesced += other.index_touches_coalesced;
        self.replica_age.merge(&other.replica_age);
        self.decision.merge(&other.decision);
        self.retry_budget_exhausted += other.retry_budget_exhausted;
        for (m, o) in self
            .stream_migrations
            .iter_mut()
            .zip(other.stream_migrations)
        {
            *m += o;
        }
        self.auth_failures += other.auth_failures;
        for (k, v) in &other.throttled {
            *self.throttled.entry(*k).or_insert(0) += v;
        }
        for (k, v) in &other.admission {
            *self.admission.entry(*k).or_insert(0) += v;
        }
        self.queue_wait.merge(&other.queue_wait);
        self.disagg.merge(&other.disagg);
        for (a, b) in [
            (&mut self.predicted_cached, &other.predicted_cached),
            (&mut self.reported_cached, &other.reported_cached),
            (&mut self.prediction_abs_error, &other.prediction_abs_error),
            (&mut self.matched_blocks, &other.matched_blocks),
            (&mut self.retries, &other.retries),
            (&mut self.first_token_timeouts, &other.first_token_timeouts),
            (&mut self.first_token_waits, &other.first_token_waits),
        ] {
            for (x, y) in a.iter_mut().zip(b) {
                *x += y;
            }
        }
    }
}

/// Gateway-wide values read at scrape time.
pub struct Gauges<'a> {
    /// Every backend slot's id (labels); per-backend rows skip retired slots.
    pub backend_ids: &'a [String],
    /// Per slot: false once the backend was removed.
    pub live: &'a [bool],
    pub models: &'a [String],
    /// Current in-flight count per backend.
    pub in_flight: &'a [u32],
    /// Predicted uncached prompt tokens of in-flight requests without a first byte.
    pub pending_prefill_tokens: &'a [u32],
    /// Index events the coordinator has sent each shard.
    pub replica_sent: &'a [u64],
    /// Blocks in the coordinator's authoritative index.
    pub index_blocks: u64,
    /// Index events the coordinator has received from shards.
    pub coordinator_received: u64,
    pub tenants: &'a [String],
    /// Each tenant's tier name, and the keyless requests' tier label.
    pub tenant_tiers: &'a [String],
    pub anonymous_tier: &'a str,
    /// Each engine's load as last scraped.
    pub engine: &'a [Option<EngineLoad>],
    pub breaker: &'a [radixgate_orchestrator::BreakerState],
    pub healthy: &'a [bool],
    /// Per backend, its KV-event subscription's counters (precise mode), if it has
    /// one.
    pub kv_events: &'a [Option<&'a crate::kv_events::KvEventCounters>],
    /// What became of recorded spans, when trace export is on.
    pub spans: Option<&'a crate::otlp::SpanCounters>,
    /// Cluster mode's threads' state, in a cluster.
    pub cluster: Option<&'a crate::status::ClusterStatus>,
    /// Per backend slot, the peers' in-flight requests and pending prefill tokens
    /// as they last reported them (zeros outside a cluster).
    pub peer_in_flight: &'a [u32],
    pub peer_pending_prefill_tokens: &'a [u32],
    /// The capacity signal's last report, once there is one.
    pub capacity: Option<&'a crate::status::capacity::CapacityReport>,
    /// Per `[[discovery]]` name, the discovery thread's counters.
    pub discovery: &'a [crate::status::discovery::NameStatus],
}

impl Gauges<'_> {
    /// `(slot, id)` of every backend not removed.
    fn live_ids(&self) -> impl Iterator<Item = (usize, &String)> {
        self.backend_ids
            .iter()
            .enumerate()
            .filter(|(i, _)| self.live.get(*i).copied().unwrap_or(true))
    }
}

fn backend(id: &str) -> Vec<(&'static str, String)> {
    vec![("backend", id.to_string())]
}

fn shard_label(shard: usize) -> Vec<(&'static str, String)> {
    vec![("shard", shard.to_string())]
}

/// Admission decisions by tier (tenants of one tier summed), the edge queue's depth
/// per shard and the time spent in it.
fn render_admission(
    out: &mut Families,
    merged: &ShardMetrics,
    shards: &[ShardMetrics],
    g: &Gauges<'_>,
) {
    let f = out.family(
        "radixgate_admission_total",
        Kind::Counter,
        "Admission decisions by tier: admitted (direct, after_queue), queued (saturated), shed (slo_unattainable, pressure, queue_full, queue_timeout).",
    );
    let mut rows = std::collections::BTreeMap::new();
    for ((t, decision, reason), v) in &merged.admission {
        let tier = g
            .tenant_tiers
            .get(*t)
            .map_or(g.anonymous_tier, |s| s.as_str());
        *rows.entry((tier, *decision, *reason)).or_insert(0) += v;
    }
    for ((tier, decision, reason), v) in rows {
        let labels = vec![
            ("tier", tier.to_string()),
            ("decision", decision.to_string()),
            ("reason", reason.to_string()),
        ];
        f.row(labels, Value::Int(v));
    }
    let f = out.family(
        "radixgate_admission_queue_depth",
        Kind::Gauge,
        "Requests waiting in each shard's edge queue.",
    );
    for s in shards {
        f.row(shard_label(s.shard), Value::Int(s.queue_depth));
    }
    out.family(
        "radixgate_admission_queue_wait_seconds",
        Kind::Histogram,
        "Time requests spent in the edge queue.",
    )
    .row(
        vec![("scope", "edge".into())],
        Value::Hist(merged.queue_wait.clone()),
    );
}

/// Shard event-loop lag per shard, and the span exporter's counters.
fn render_operations(out: &mut Families, shards: &[ShardMetrics], g: &Gauges<'_>) {
    let f = out.family(
        "radixgate_shard_event_loop_lag_seconds",
        Kind::Histogram,
        "How late each shard's event loop woke for a 10 ms timer: a stall delays every connection on the shard.",
    );
    for s in shards {
        f.row(shard_label(s.shard), Value::Hist(s.loop_lag.clone()));
    }
    let f = out.family(
        "radixgate_shard_memory_reclaims_total",
        Kind::Counter,
        "Times each shard gave its free memory back to the system after a burst of connections closed.",
    );
    for s in shards {
        f.row(shard_label(s.shard), Value::Int(s.memory_reclaims));
    }
    if let Some(c) = g.spans {
        let f = out.family(
            "radixgate_trace_spans_total",
            Kind::Counter,
            "Recorded spans: exported (collector answered 2xx), failed (batch not delivered), dropped (exporter behind).",
        );
        let load = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
        for (outcome, v) in [
            ("exported", load(&c.exported)),
            ("failed", load(&c.failed)),
            ("dropped", load(&c.dropped)),
        ] {
            f.row(vec![("outcome", outcome.into())], Value::Int(v));
        }
    }
}

/// Cluster mode: the bus connection, peers, what was shared and what was dropped.
fn render_cluster(out: &mut Families, c: &crate::status::ClusterStatus, g: &Gauges<'_>) {
    use std::sync::atomic::Ordering::Relaxed;
    let peers = c.peers.lock().map_or(0, |p| p.len());
    for (name, help, v) in [
        (
            "radixgate_cluster_connected",
            "1 while the cluster bus is connected (the subscriber's connection).",
            u64::from(c.connected.load(Relaxed)),
        ),
        (
            "radixgate_cluster_peers",
            "Peer replicas heard from within cluster.peer_timeout_ms.",
            peers as u64,
        ),
        (
            "radixgate_cluster_warm",
            "1 once this replica has loaded its peers' index (or found no peer, or stopped waiting): /ready says ready.",
            u64::from(c.warm.load(Relaxed)),
        ),
    ] {
        out.family(name, Kind::Gauge, help)
            .row(vec![], Value::Int(v));
    }
    for (name, help, v) in [
        ("radixgate_cluster_outages_total", "Times the cluster bus was lost (routing went on from local state).", c.outages.load(Relaxed)),
        ("radixgate_cluster_batches_published_total", "Bus messages this replica published (routing ops, load reports).", c.batches_published.load(Relaxed)),
        ("radixgate_cluster_ops_published_total", "Routing ops and load reports this replica published.", c.ops_published.load(Relaxed)),
        ("radixgate_cluster_ops_unsent_total", "Ops that could not be published (bus down, publish failed, or the queue to the publisher full).", c.ops_unsent.load(Relaxed)),
        ("radixgate_cluster_batches_received_total", "Bus messages received, this replica's own included.", c.batches_received.load(Relaxed)),
        ("radixgate_cluster_ops_applied_total", "Peers' index ops handed to the coordinator (applied to every shard's index).", c.ops_applied.load(Relaxed)),
        ("radixgate_cluster_ops_unknown_backend_total", "Peers' ops naming a backend this replica does not have.", c.ops_unknown_backend.load(Relaxed)),
        ("radixgate_cluster_gaps_total", "Peers' batches that never arrived (lost while the bus was down).", c.gaps.load(Relaxed)),
        ("radixgate_cluster_snapshots_loaded_total", "Peers' snapshots of the index this replica loaded (at start, and after each outage).", c.snapshots_loaded.load(Relaxed)),
        ("radixgate_cluster_snapshots_served_total", "Snapshots of the index this replica stored for a joining peer.", c.snapshots_served.load(Relaxed)),
        ("radixgate_cluster_peer_faults_total", "Peers' reports of a failing backend (unhealthy, or breaker open); each opens this replica's breaker.", c.peer_faults.load(Relaxed)),
        ("radixgate_cluster_tenant_charges_total", "Peers' reports of a tenant's use charged to this replica's quota buckets.", c.tenant_charges.load(Relaxed)),
    ] {
        out.family(name, Kind::Counter, help).row(vec![], Value::Int(v));
    }
    let f = out.family(
        "radixgate_cluster_messages_dropped_total",
        Kind::Counter,
        "Bus messages dropped, by reason: foreign, version, fingerprint, truncated, malformed, duplicate, stale.",
    );
    for d in crate::status::Dropped::ALL {
        f.row(
            vec![("reason", d.as_str().into())],
            Value::Int(c.dropped(d)),
        );
    }
    for (name, help, values) in [
        ("radixgate_cluster_peer_in_flight", "Requests the peer replicas have in flight to each backend, as last reported (routing counts them with this replica's).", g.peer_in_flight),
        ("radixgate_cluster_peer_pending_prefill_tokens", "Pending prefill tokens the peer replicas report on each backend.", g.peer_pending_prefill_tokens),
    ] {
        let f = out.family(name, Kind::Gauge, help);
        for (i, id) in g.live_ids() {
            f.row(backend(id), Value::Int(u64::from(values.get(i).copied().unwrap_or(0))));
        }
    }
    let f = out.family(
        "radixgate_cluster_event_lag_seconds",
        Kind::Gauge,
        "Wall-clock time from a peer's publish to receipt, over the last report interval.",
    );
    for (q, v) in [("0.5", &c.lag_p50_us), ("0.99", &c.lag_p99_us)] {
        f.row(
            vec![("quantile", q.into())],
            Value::Float(v.load(Relaxed) as f64 / 1e6),
        );
    }
}

/// Merges every shard's copy and renders Prometheus text.
pub fn render(shards: &[ShardMetrics], g: &Gauges<'_>) -> String {
    let mut merged = ShardMetrics::new(g.models.len(), g.backend_ids.len());
    for s in shards {
        merged.merge(s);
    }
    let mut out = Families::default();
    let f = out.family(
        "radixgate_requests_total",
        Kind::Counter,
        "Requests answered, by backend, HTTP status, routing reason (or error code) and model (empty when the gateway answered before routing).",
    );
    let mut rows: Vec<_> = merged.requests.iter().collect();
    rows.sort_by_key(|(k, _)| (k.backend, k.status, k.reason, k.model));
    for (k, v) in rows {
        let backend = k.backend.map_or("none", |b| g.backend_ids[b].as_str());
        let model = k
            .model
            .and_then(|m| g.models.get(m))
            .map_or("", |m| m.as_str());
        let labels = vec![
            ("backend", backend.to_string()),
            ("status", k.status.to_string()),
            ("reason", k.reason.to_string()),
            ("model", model.to_string()),
        ];
        f.row(labels, Value::Int(*v));
    }
    let per_model: [(&'static str, &'static str, &Vec<Histogram>); 2] = [
        (
            "radixgate_ttft_seconds",
            "Time from receiving a request to the first response body byte.",
            &merged.ttft,
        ),
        (
            "radixgate_request_duration_seconds",
            "Time from receiving a request to the end of its response.",
            &merged.total,
        ),
    ];
    for (name, help, hists) in per_model {
        let f = out.family(name, Kind::Histogram, help);
        for (i, h) in hists.iter().enumerate() {
            f.row(vec![("model", g.models[i].clone())], Value::Hist(h.clone()));
        }
    }
    out.family(
        "radixgate_routing_decision_seconds",
        Kind::Histogram,
        "Time to parse, hash, match and pick, per request.",
    )
    .row(
        vec![("shard", "all".into())],
        Value::Hist(merged.decision.clone()),
    );
    let f = out.family(
        "radixgate_backend_in_flight",
        Kind::Gauge,
        "Requests currently in flight to each backend, across shards.",
    );
    for (i, id) in g.live_ids() {
        f.row(backend(id), Value::Int(g.in_flight[i] as u64));
    }
    let f = out.family(
        "radixgate_backend_pending_prefill_tokens",
        Kind::Gauge,
        "Predicted uncached prompt tokens of the requests in flight to each backend that have no first byte yet: the prefill queued there on the gateway's account.",
    );
    for (i, id) in g.live_ids() {
        f.row(
            backend(id),
            Value::Int(u64::from(g.pending_prefill_tokens[i])),
        );
    }
    let per_backend: [(&'static str, &'static str, &Vec<u64>); 7] = [
        (
            "radixgate_retries_total",
            "Attempts that failed on this backend before any byte reached the client and were retried elsewhere.",
            &merged.retries,
        ),
        (
            "radixgate_first_token_timeouts_total",
            "Streams moved to another backend because this one sent no token within retry.first_token_timeout_ms.",
            &merged.first_token_timeouts,
        ),
        (
            "radixgate_first_token_waits_total",
            "Streams past their first-token deadline on this backend kept waiting there, because no other backend promised a first token sooner.",
            &merged.first_token_waits,
        ),
        (
            "radixgate_matched_blocks_total",
            "Prompt blocks the prefix index matched on the chosen backend.",
            &merged.matched_blocks,
        ),
        (
            "radixgate_cached_tokens_predicted_total",
            "Cached prompt tokens the prefix index predicted on the chosen backend.",
            &merged.predicted_cached,
        ),
        (
            "radixgate_cached_tokens_reported_total",
            "Cached prompt tokens the engine reported (usage.prompt_tokens_details.cached_tokens).",
            &merged.reported_cached,
        ),
        (
            "radixgate_cached_tokens_prediction_error_total",
            "Sum of |predicted - reported| cached tokens, for responses that reported them.",
            &merged.prediction_abs_error,
        ),
    ];
    for (name, help, values) in per_backend {
        let f = out.family(name, Kind::Counter, help);
        for (i, id) in g.live_ids() {
            f.row(backend(id), Value::Int(values.get(i).copied().unwrap_or(0)));
        }
    }
    type Learned = fn(&LearnedCost) -> u32;
    let learned_gauges: [(&'static str, &'static str, Learned); 3] = [
        (
            "radixgate_backend_prefill_ns_per_token",
            "Learned prefill cost per uncached prompt token (mean over shards that learned one; 0 = none yet).",
            |l| l.prefill_cost(true).0,
        ),
        (
            "radixgate_backend_prefill_fixed_ns",
            "Learned delay before every first token whatever the prompt (mean over shards that learned one; 0 = none or not yet).",
            |l| l.prefill_cost(true).1,
        ),
        (
            "radixgate_backend_queue_ns_per_request",
            "Learned delay each request ahead adds beyond the queued prefill (mean over shards that learned one; 0 = none yet).",
            |l| l.queue_ns_per_request,
        ),
    ];
    for (name, help, read) in learned_gauges {
        let f = out.family(name, Kind::Gauge, help);
        for (i, id) in g.live_ids() {
            let learned: Vec<u64> = shards
                .iter()
                .filter_map(|s| s.learned.get(i).map(read))
                .filter(|v| *v > 0)
                .map(u64::from)
                .collect();
            let mean = match learned.len() {
                0 => 0,
                n => learned.iter().sum::<u64>() / n as u64,
            };
            f.row(backend(id), Value::Int(mean));
        }
    }
    type Read = fn(&EngineLoad) -> f64;
    let engine_gauges: [(&'static str, &'static str, Read); 3] = [
        (
            "radixgate_engine_queue",
            "The engine's waiting queue as last scraped from its /metrics.",
            |e| e.waiting as f64,
        ),
        (
            "radixgate_engine_running",
            "The engine's running requests as last scraped.",
            |e| e.running as f64,
        ),
        (
            "radixgate_engine_kv_usage",
            "The engine's KV-cache usage (0-1) as last scraped.",
            |e| e.kv_usage as f64,
        ),
    ];
    for (name, help, get) in engine_gauges {
        let f = out.family(name, Kind::Gauge, help);
        for (i, id) in g.live_ids() {
            if let Some(e) = g.engine.get(i).copied().flatten() {
                f.row(backend(id), Value::Float(get(&e)));
            }
        }
    }
    let f = out.family(
        "radixgate_tenant_throttled_total",
        Kind::Counter,
        "Requests refused with 429 by a tenant quota, by tenant and limit.",
    );
    let mut throttled: Vec<_> = merged.throttled.iter().collect();
    throttled.sort();
    for ((t, limit), v) in throttled {
        let tenant = g.tenants.get(*t).map_or("anonymous", |s| s.as_str());
        let labels = vec![("tenant", tenant.to_string()), ("limit", limit.to_string())];
        f.row(labels, Value::Int(*v));
    }
    render_admission(&mut out, &merged, shards, g);
    merged.disagg.render(&mut out);
    for (name, help, v) in [
        (
            "radixgate_auth_failures_total",
            "Requests refused with 401.",
            merged.auth_failures,
        ),
        (
            "radixgate_retry_budget_exhausted_total",
            "Retries refused because the retry budget was spent.",
            merged.retry_budget_exhausted,
        ),
    ] {
        out.family(name, Kind::Counter, help)
            .row(vec![], Value::Int(v));
    }
    let f = out.family(
        "radixgate_stream_migrations_total",
        Kind::Counter,
        "Streams continued on another engine after theirs died mid-stream, by outcome: resumed (the continuation ended the stream), failed (it could not start, or broke too), no_backend (no other engine could take it).",
    );
    for (outcome, v) in STREAM_MIGRATION_OUTCOMES
        .iter()
        .zip(merged.stream_migrations)
    {
        f.row(vec![("outcome", outcome.to_string())], Value::Int(v));
    }
    let f = out.family(
        "radixgate_breaker_state",
        Kind::Gauge,
        "Circuit breaker per backend: 0 closed, 1 half-open, 2 open.",
    );
    for (i, id) in g.live_ids() {
        let level = g.breaker.get(i).map_or(0, |b| b.level());
        f.row(backend(id), Value::Int(level as u64));
    }
    let f = out.family(
        "radixgate_backend_healthy",
        Kind::Gauge,
        "1 when the backend passes its active health checks.",
    );
    for (i, id) in g.live_ids() {
        let up = g.healthy.get(i).copied().unwrap_or(false) as u64;
        f.row(backend(id), Value::Int(up));
    }
    type KvRead = fn(&crate::kv_events::KvEventCounters) -> &std::sync::atomic::AtomicU64;
    let kv_counters: [(&'static str, &'static str, KvRead); 6] = [
        (
            "radixgate_kv_events_stored_blocks_total",
            "Blocks the engine reported stored (precise mode KV events).",
            |c| &c.stored_blocks,
        ),
        (
            "radixgate_kv_events_removed_blocks_total",
            "Blocks the engine reported evicted.",
            |c| &c.removed_blocks,
        ),
        (
            "radixgate_kv_events_cleared_total",
            "AllBlocksCleared events.",
            |c| &c.cleared,
        ),
        (
            "radixgate_kv_events_gaps_total",
            "Sequence gaps: events lost, the backend's entries dropped and rebuilt.",
            |c| &c.gaps,
        ),
        (
            "radixgate_kv_events_replayed_total",
            "Event batches got back from the engine's replay socket (gaps filled, history at start).",
            |c| &c.replayed,
        ),
        (
            "radixgate_kv_events_rejected_total",
            "Messages or events that did not decode, or blocks with an unknown parent.",
            |c| &c.rejected,
        ),
    ];
    if g.kv_events.iter().any(Option::is_some) {
        for (name, help, get) in kv_counters {
            let f = out.family(name, Kind::Counter, help);
            for (id, c) in g.backend_ids.iter().zip(g.kv_events) {
                if let Some(c) = c {
                    let v = get(c).load(std::sync::atomic::Ordering::Relaxed);
                    f.row(backend(id), Value::Int(v));
                }
            }
        }
    }
    let f = out.family(
        "radixgate_index_blocks",
        Kind::Gauge,
        "Blocks in the prefix index: the coordinator's authoritative copy and each shard's replica.",
    );
    f.row(
        vec![("copy", "coordinator".into())],
        Value::Int(g.index_blocks),
    );
    for s in shards {
        f.row(
            vec![("copy", format!("shard-{}", s.shard))],
            Value::Int(s.replica_blocks),
        );
    }
    let f = out.family(
        "radixgate_replica_lag_events",
        Kind::Gauge,
        "Index events the coordinator has sent a shard that the shard has not applied yet.",
    );
    for s in shards {
        let sent = g.replica_sent.get(s.shard).copied().unwrap_or(0);
        f.row(
            shard_label(s.shard),
            Value::Int(sent.saturating_sub(s.replica_applied)),
        );
    }
    out.family(
        "radixgate_index_touches_coalesced_total",
        Kind::Counter,
        "Routing inserts and session re-bindings not recorded or replicated: the pick already held the whole prompt (was the session's home), used less than routing.index_touch_ms ago.",
    )
    .row(vec![], Value::Int(merged.index_touches_coalesced));
    // Peers' ops count too: they reach the coordinator on the same channel, and a
    // replica has caught up with its peers only once the coordinator has them.
    let from_peers = g.cluster.map_or(0, |c| {
        c.ops_applied.load(std::sync::atomic::Ordering::Relaxed)
    });
    let pending =
        (merged.index_events_published + from_peers).saturating_sub(g.coordinator_received);
    out.family(
        "radixgate_replica_pending_events",
        Kind::Gauge,
        "Index events shards and peer replicas have sent that the coordinator has not received yet.",
    )
    .row(vec![], Value::Int(pending));
    out.family(
        "radixgate_replica_lag_seconds",
        Kind::Histogram,
        "Age of index events (origin shard to this replica) when applied.",
    )
    .row(
        vec![("shard", "all".into())],
        Value::Hist(merged.replica_age.clone()),
    );
    render_operations(&mut out, shards, g);
    if let Some(report) = g.capacity {
        capacity::render(&mut out, report);
    }
    discovery::render(&mut out, g.discovery);
    if let Some(c) = g.cluster {
        render_cluster(&mut out, c, g);
    }
    for (name, help, v) in [
        ("radixgate_prompt_tokens_total", "Prompt tokens reported in upstream usage.", merged.prompt_tokens),
        ("radixgate_cached_tokens_total", "Cached prompt tokens reported in upstream usage (prompt_tokens_details.cached_tokens).", merged.cached_tokens),
        ("radixgate_completion_tokens_total", "Completion tokens reported in upstream usage.", merged.completion_tokens),
    ] {
        out.family(name, Kind::Counter, help).row(vec![], Value::Int(v));
    }
    out.encode()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_and_renders() {
        let mut a = ShardMetrics::new(1, 1);
        let mut b = ShardMetrics::new(1, 1);
        let key = RequestKey {
            backend: Some(0),
            status: 200,
            reason: "round-robin",
            model: Some(0),
        };
        a.count_request(key);
        b.count_request(key);
        a.count_request(RequestKey::gateway(404, "model_not_found"));
        a.ttft[0].observe(Duration::from_millis(3));
        b.ttft[0].observe(Duration::from_millis(300));
        let text = render(
            &[a, b],
            &Gauges {
                backend_ids: &["b0".into()],
                live: &[true],
                models: &["sim".into()],
                in_flight: &[4],
                pending_prefill_tokens: &[96],
                replica_sent: &[0, 0],
                index_blocks: 0,
                coordinator_received: 0,
                tenants: &[],
                tenant_tiers: &[],
                anonymous_tier: "anonymous",
                engine: &[None],
                breaker: &[radixgate_orchestrator::BreakerState::Closed],
                healthy: &[true],
                kv_events: &[None],
                spans: None,
                cluster: None,
                peer_in_flight: &[],
                peer_pending_prefill_tokens: &[],
                capacity: None,
                discovery: &[],
            },
        );
        assert!(text.contains(
            "radixgate_requests_total{backend=\"b0\",status=\"200\",reason=\"round-robin\",model=\"sim\"} 2"
        ));
        assert!(text.contains(
            "radixgate_requests_total{backend=\"none\",status=\"404\",reason=\"model_not_found\",model=\"\"} 1"
        ));
        assert!(text.contains("radixgate_ttft_seconds_bucket{model=\"sim\",le=\"0.005\"} 1"));
        assert!(text.contains("radixgate_ttft_seconds_count{model=\"sim\"} 2"));
        assert!(text.contains("radixgate_backend_in_flight{backend=\"b0\"} 4"));
        assert!(text.contains("radixgate_backend_pending_prefill_tokens{backend=\"b0\"} 96"));
    }
}
