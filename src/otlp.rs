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

/// Runs the exporter until every sender is gone or `stop` disconnects (the gateway
/// stops it once the shards have ended, so every span is queued by then), then
/// exports what is left.
pub fn run(
    spans: Receiver<SpanRecord>,
    config: TracesConfig,
    mut live: Arc<LiveConfig>,
    updates: Receiver<Arc<LiveConfig>>,
    tenants: Vec<String>,
    counters: Arc<SpanCounters>,
    stop: Receiver<()>,
) {
    let mut batch: Vec<SpanRecord> = Vec::with_capacity(MAX_BATCH);
    let mut deadline: Option<Instant> = None;
    let mut failing = false;
    let mut stopping = false;
    loop {
        let received = if stopping {
            // Whatever is queued, then the end.
            spans.try_recv().map_err(|_| RecvTimeoutError::Disconnected)
        } else {
            let timeout = deadline.map_or_else(crossbeam_channel::never, crossbeam_channel::at);
            crossbeam_channel::select! {
                recv(spans) -> r => r.map_err(|_| RecvTimeoutError::Disconnected),
                recv(stop) -> _ => {
                    stopping = true;
                    continue;
                }
                recv(timeout) -> _ => Err(RecvTimeoutError::Timeout),
            }
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
/// times and 64-bit integers as decimal strings, per the OTLP JSON mapping).
/// Written straight into bytes: building a `serde_json::Value` tree cost ~55k
/// instructions per span (callgrind), this a small fraction of that.
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
        wall_ns.saturating_sub(back)
    };
    let table = &live.backends;
    let mut out = Vec::with_capacity(256 + spans.len() * 640);
    out.extend_from_slice(br#"{"resourceSpans":[{"resource":{"attributes":["#);
    attr_str(&mut out, "service.name", service_name);
    out.extend_from_slice(br#"]},"scopeSpans":[{"scope":{"name":"radixgate","version":"#);
    json_str(&mut out, env!("CARGO_PKG_VERSION"));
    out.extend_from_slice(br#"},"spans":["#);
    for (i, s) in spans.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(br#"{"traceId":""#);
        crate::trace::push_hex(&mut out, s.trace_id, 32);
        out.extend_from_slice(br#"","spanId":""#);
        crate::trace::push_hex(&mut out, s.span_id as u128, 16);
        out.push(b'"');
        if s.parent_id != 0 {
            out.extend_from_slice(br#","parentSpanId":""#);
            crate::trace::push_hex(&mut out, s.parent_id as u128, 16);
            out.push(b'"');
        }
        out.extend_from_slice(br#","name":"#);
        json_str(&mut out, s.kind.name());
        out.extend_from_slice(br#","kind":"#);
        out.extend_from_slice(itoa::Buffer::new().format(s.kind.otlp()).as_bytes());
        out.extend_from_slice(br#","startTimeUnixNano":"#);
        int_str(&mut out, unix_ns(s.start));
        out.extend_from_slice(br#","endTimeUnixNano":"#);
        int_str(&mut out, unix_ns(s.end));
        out.extend_from_slice(br#","attributes":["#);
        attr_int(&mut out, "radixgate.shard", s.shard as u64);
        if let Some(b) = s.backend {
            attr_str(&mut out, "radixgate.backend", table.id(b));
        }
        if let Some(m) = s.model {
            attr_str(&mut out, "gen_ai.request.model", table.models().name(m));
        }
        if let Some(t) = s.tenant.and_then(|t| tenants.get(t)) {
            attr_str(&mut out, "radixgate.tenant", t);
        }
        if !s.policy.is_empty() {
            attr_str(&mut out, "radixgate.policy", s.policy);
        }
        if !s.reason.is_empty() {
            attr_str(&mut out, "radixgate.reason", s.reason);
        }
        if s.status != 0 {
            attr_int(&mut out, "http.response.status_code", s.status as u64);
        }
        match s.kind {
            SpanKind::Request => {
                attr_int(&mut out, "radixgate.retries", s.attempt as u64);
                attr_int(
                    &mut out,
                    "radixgate.matched_blocks",
                    s.matched_blocks as u64,
                );
                if let Some(id) = &s.id {
                    attr_str(&mut out, "radixgate.request_id", id.as_str());
                }
            }
            SpanKind::Route => {
                attr_int(&mut out, "radixgate.attempt", s.attempt as u64);
                attr_int(
                    &mut out,
                    "radixgate.matched_blocks",
                    s.matched_blocks as u64,
                );
            }
            SpanKind::Attempt => attr_int(&mut out, "radixgate.attempt", s.attempt as u64),
            SpanKind::PrefillLeg => attr_str(&mut out, "radixgate.role", "prefill"),
            SpanKind::DecodeLeg => attr_str(&mut out, "radixgate.role", "decode"),
            SpanKind::Node => {
                if let Some(id) = &s.id {
                    attr_str(&mut out, "radixgate.workflow.node", id.as_str());
                }
            }
        }
        out.extend_from_slice(b"],");
        // ERROR for 5xx answers (the gateway's or a backend's); else unset.
        if s.status >= 500 {
            out.extend_from_slice(br#""status":{"code":2,"message":"#);
            json_str(&mut out, s.reason);
            out.extend_from_slice(b"}}");
        } else {
            out.extend_from_slice(br#""status":{}}"#);
        }
    }
    out.extend_from_slice(b"]}]}]}");
    out
}

/// `s` as a JSON string (quoted and escaped by serde_json).
fn json_str(out: &mut Vec<u8>, s: &str) {
    // Writing into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, s);
}

/// A 64-bit integer as OTLP JSON writes it: a decimal string.
fn int_str(out: &mut Vec<u8>, v: u64) {
    out.push(b'"');
    out.extend_from_slice(itoa::Buffer::new().format(v).as_bytes());
    out.push(b'"');
}

/// Appends one attribute, after a comma unless it opens the list.
fn attr_key(out: &mut Vec<u8>, key: &str) {
    if out.last() != Some(&b'[') {
        out.push(b',');
    }
    out.extend_from_slice(br#"{"key":"#);
    json_str(out, key);
    out.extend_from_slice(br#","value":{"#);
}

fn attr_str(out: &mut Vec<u8>, key: &str, v: &str) {
    attr_key(out, key);
    out.extend_from_slice(br#""stringValue":"#);
    json_str(out, v);
    out.extend_from_slice(b"}}");
}

fn attr_int(out: &mut Vec<u8>, key: &str, v: u64) {
    attr_key(out, key);
    out.extend_from_slice(br#""intValue":"#);
    int_str(out, v);
    out.extend_from_slice(b"}}");
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::access_log::InlineId;

    #[test]
    fn encodes_otlp_json_with_escaping() {
        let config = crate::Config::from_toml(
            "[server]\nlisten = \"127.0.0.1:0\"\n[[backends]]\nid = \"b0\"\nurl = \"http://127.0.0.1:9\"\nmodels = [\"m\"]\n",
        )
        .unwrap();
        let live = LiveConfig::initial(&config);
        let now = Instant::now();
        let span = |kind, parent_id, status| SpanRecord {
            kind,
            trace_id: 0xabc,
            span_id: 0x12,
            parent_id,
            start: now,
            end: now,
            shard: 1,
            backend: Some(0),
            model: Some(0),
            tenant: Some(0),
            status,
            reason: "upstream_error",
            policy: "prefix_aware",
            attempt: 2,
            matched_blocks: 7,
            id: Some(InlineId::new("req-1")),
        };
        let node = SpanRecord {
            id: Some(InlineId::new("summarise")),
            ..span(SpanKind::Node, 0x34, 200)
        };
        let spans = [
            span(SpanKind::Request, 0, 502),
            span(SpanKind::Attempt, 0x34, 200),
            span(SpanKind::PrefillLeg, 0x34, 503),
            node,
        ];
        let body = encode(&spans, "svc", &live, &["a \"quoted\" tenant".into()]);
        let v: serde_json::Value = serde_json::from_slice(&body).expect("valid JSON");
        let rs = &v["resourceSpans"][0];
        assert_eq!(
            rs["resource"]["attributes"][0]["value"]["stringValue"],
            "svc"
        );
        let out = rs["scopeSpans"][0]["spans"].as_array().unwrap();
        assert_eq!(out.len(), 4);
        let (request, attempt) = (&out[0], &out[1]);
        assert_eq!(request["traceId"], "00000000000000000000000000000abc");
        assert_eq!(request["spanId"], "0000000000000012");
        assert!(request.get("parentSpanId").is_none());
        assert_eq!(attempt["parentSpanId"], "0000000000000034");
        assert_eq!(
            (request["kind"].as_u64(), attempt["kind"].as_u64()),
            (Some(2), Some(3))
        );
        assert_eq!(request["status"]["code"], 2);
        assert_eq!(attempt["status"], serde_json::json!({}));
        assert_eq!(request["startTimeUnixNano"], request["endTimeUnixNano"]);
        let attrs = request["attributes"].as_array().unwrap();
        let get = |k: &str| {
            attrs
                .iter()
                .find(|a| a["key"] == k)
                .map(|a| a["value"].clone())
                .unwrap_or_else(|| panic!("no {k}"))
        };
        assert_eq!(
            get("radixgate.tenant")["stringValue"],
            "a \"quoted\" tenant"
        );
        assert_eq!(get("radixgate.backend")["stringValue"], "b0");
        assert_eq!(get("gen_ai.request.model")["stringValue"], "m");
        assert_eq!(get("http.response.status_code")["intValue"], "502");
        assert_eq!(get("radixgate.request_id")["stringValue"], "req-1");
        assert_eq!(get("radixgate.retries")["intValue"], "2");
        let attr = |span: &serde_json::Value, k: &str| {
            span["attributes"]
                .as_array()
                .unwrap()
                .iter()
                .find(|a| a["key"] == k)
                .map(|a| a["value"]["stringValue"].clone())
        };
        let (leg, node) = (&out[2], &out[3]);
        assert_eq!(
            (&leg["name"], &leg["kind"]),
            (&"prefill leg".into(), &3.into())
        );
        assert_eq!(attr(leg, "radixgate.role"), Some("prefill".into()));
        assert_eq!(leg["status"]["code"], 2);
        assert_eq!(node["name"], "workflow node");
        assert_eq!(
            attr(node, "radixgate.workflow.node"),
            Some("summarise".into())
        );
        assert_eq!(attr(node, "radixgate.request_id"), None);
    }
}
