//! The `radixgate-otlp` thread: batches the shards' spans and exports them over
//! OTLP/HTTP with the JSON encoding.
//!
//! Lean on purpose: the OpenTelemetry SDK's OTLP exporters bring a tokio runtime and
//! an async HTTP client (reqwest or tonic/hyper) into a gateway that runs on monoio,
//! for one POST per batch. This thread writes that POST with std sockets instead, so
//! nothing of it runs on the shards. Spans wait at most `traces.export_interval_ms`
//! (or until [`MAX_BATCH`] are ready); a batch that cannot be delivered is dropped
//! and counted, never retried (tracing must not grow memory while a collector is
//! down). Backend, model and tenant names are resolved here from the backend table,
//! which the coordinator sends before any shard routes with it.

use crate::backends::LiveConfig;
use crate::config::TracesConfig;
use crate::trace::{SpanKind, SpanRecord};
use crossbeam_channel::{Receiver, RecvTimeoutError};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Spans per export request.
pub const MAX_BATCH: usize = 512;

/// Connect, write and read limit for one export.
const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// What happened to recorded spans (written by the shards and this thread, read by
/// `/metrics`; relaxed: independent counters).
#[derive(Debug, Default)]
pub struct SpanCounters {
    pub exported: AtomicU64,
    /// Spans in batches the collector did not accept (or could not be reached).
    pub failed: AtomicU64,
    /// Spans dropped on the shard because the exporter's channel was full.
    pub dropped: AtomicU64,
}

/// Runs the exporter until every sender is gone, then flushes what is left.
pub fn run(
    spans: Receiver<SpanRecord>,
    config: TracesConfig,
    mut live: Arc<LiveConfig>,
    updates: Receiver<Arc<LiveConfig>>,
    tenants: Vec<String>,
    counters: Arc<SpanCounters>,
) {
    let mut batch: Vec<SpanRecord> = Vec::with_capacity(MAX_BATCH);
    let mut deadline: Option<Instant> = None;
    let mut failing = false;
    loop {
        let received = match deadline {
            None => spans.recv().map_err(|_| RecvTimeoutError::Disconnected),
            Some(d) => spans.recv_timeout(d.saturating_duration_since(Instant::now())),
        };
        let done = match received {
            Ok(span) => {
                batch.push(span);
                if deadline.is_none() {
                    deadline = Some(Instant::now() + config.export_interval);
                }
                false
            }
            Err(RecvTimeoutError::Timeout) => false,
            Err(RecvTimeoutError::Disconnected) => true,
        };
        let due = deadline.is_some_and(|d| Instant::now() >= d);
        if !batch.is_empty() && (done || due || batch.len() >= MAX_BATCH) {
            while let Ok(newer) = updates.try_recv() {
                live = newer;
            }
            let body = encode(&batch, &config.service_name, &live, &tenants);
            let n = batch.len() as u64;
            match post(&config, &body) {
                Ok(()) => {
                    counters.exported.fetch_add(n, Ordering::Relaxed);
                    if failing {
                        tracing::info!("trace export to {} works again", config.authority);
                        failing = false;
                    }
                }
                Err(e) => {
                    counters.failed.fetch_add(n, Ordering::Relaxed);
                    if !failing {
                        tracing::warn!(error = %e, "trace export to {} failed; dropping spans until it works", config.authority);
                        failing = true;
                    }
                }
            }
            batch.clear();
            deadline = None;
        }
        if done {
            return;
        }
    }
}

/// The OTLP/JSON `ExportTraceServiceRequest` for `spans` (ids as lowercase hex,
/// times as decimal strings, per the OTLP JSON mapping).
pub fn encode(
    spans: &[SpanRecord],
    service_name: &str,
    live: &LiveConfig,
    tenants: &[String],
) -> Vec<u8> {
    // Spans carry monotonic instants; map them onto the wall clock once per batch.
    let (now_mono, now_wall) = (Instant::now(), SystemTime::now());
    let wall_ns = now_wall
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let unix_ns = |t: Instant| {
        let back = now_mono.saturating_duration_since(t).as_nanos() as u64;
        wall_ns.saturating_sub(back).to_string()
    };
    let table = &live.backends;
    let out: Vec<Value> = spans
        .iter()
        .map(|s| {
            let mut attrs = vec![attr_int("radixgate.shard", s.shard as i64)];
            if let Some(b) = s.backend {
                attrs.push(attr_str("radixgate.backend", table.id(b)));
            }
            if let Some(m) = s.model {
                attrs.push(attr_str("gen_ai.request.model", table.models().name(m)));
            }
            if let Some(t) = s.tenant.and_then(|t| tenants.get(t)) {
                attrs.push(attr_str("radixgate.tenant", t));
            }
            if !s.policy.is_empty() {
                attrs.push(attr_str("radixgate.policy", s.policy));
            }
            if !s.reason.is_empty() {
                attrs.push(attr_str("radixgate.reason", s.reason));
            }
            if s.status != 0 {
                attrs.push(attr_int("http.response.status_code", s.status as i64));
            }
            match s.kind {
                SpanKind::Request => {
                    attrs.push(attr_int("radixgate.retries", s.attempt as i64));
                    attrs.push(attr_int(
                        "radixgate.matched_blocks",
                        s.matched_blocks as i64,
                    ));
                    if let Some(id) = &s.request_id {
                        attrs.push(attr_str("radixgate.request_id", id.as_str()));
                    }
                }
                SpanKind::Route => {
                    attrs.push(attr_int("radixgate.attempt", s.attempt as i64));
                    attrs.push(attr_int(
                        "radixgate.matched_blocks",
                        s.matched_blocks as i64,
                    ));
                }
                SpanKind::Attempt => {
                    attrs.push(attr_int("radixgate.attempt", s.attempt as i64));
                }
            }
            // ERROR for 5xx answers (the gateway's or a backend's); else unset.
            let status = if s.status >= 500 {
                json!({"code": 2, "message": s.reason})
            } else {
                json!({})
            };
            let mut span = json!({
                "traceId": format!("{:032x}", s.trace_id),
                "spanId": format!("{:016x}", s.span_id),
                "name": s.kind.name(),
                "kind": s.kind.otlp(),
                "startTimeUnixNano": unix_ns(s.start),
                "endTimeUnixNano": unix_ns(s.end),
                "attributes": attrs,
                "status": status,
            });
            if s.parent_id != 0 {
                span["parentSpanId"] = json!(format!("{:016x}", s.parent_id));
            }
            span
        })
        .collect();
    let request = json!({
        "resourceSpans": [{
            "resource": {"attributes": [attr_str("service.name", service_name)]},
            "scopeSpans": [{
                "scope": {"name": "radixgate", "version": env!("CARGO_PKG_VERSION")},
                "spans": out,
            }],
        }],
    });
    serde_json::to_vec(&request).unwrap_or_default()
}

fn attr_str(key: &str, v: &str) -> Value {
    json!({"key": key, "value": {"stringValue": v}})
}

/// OTLP JSON writes 64-bit integers as strings.
fn attr_int(key: &str, v: i64) -> Value {
    json!({"key": key, "value": {"intValue": v.to_string()}})
}

/// One `POST` of `body`; `Ok` on a 2xx answer.
#[allow(
    clippy::disallowed_methods,
    reason = "the exporter thread may block on DNS; it never runs on a shard"
)]
fn post(config: &TracesConfig, body: &[u8]) -> Result<(), String> {
    let addr = config
        .authority
        .to_socket_addrs()
        .map_err(|e| format!("resolving {}: {e}", config.authority))?
        .next()
        .ok_or_else(|| format!("{} resolves to no address", config.authority))?;
    let mut stream = TcpStream::connect_timeout(&addr, IO_TIMEOUT).map_err(|e| e.to_string())?;
    stream
        .set_read_timeout(Some(IO_TIMEOUT))
        .and_then(|()| stream.set_write_timeout(Some(IO_TIMEOUT)))
        .map_err(|e| e.to_string())?;
    let head = format!(
        "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        config.path,
        config.authority,
        body.len()
    );
    stream
        .write_all(head.as_bytes())
        .and_then(|()| stream.write_all(body))
        .map_err(|e| e.to_string())?;
    // The status line is all we need; the collector closes after answering.
    let mut status = [0u8; 12];
    stream.read_exact(&mut status).map_err(|e| e.to_string())?;
    match &status[..] {
        [b'H', b'T', b'T', b'P', b'/', _, b'.', _, b' ', b'2', _, _] => Ok(()),
        other => Err(format!(
            "collector answered `{}`",
            String::from_utf8_lossy(other)
        )),
    }
}
