//! The `radixgate-otlp` thread: batches the shards' spans and exports them over
//! OTLP/HTTP with the protobuf encoding (`application/x-protobuf`, the default that
//! every collector accepts).
//!
//! The request is the official `opentelemetry-proto` crate's
//! `ExportTraceServiceRequest`, encoded by prost; the crate is used for its message
//! types only (no tonic). The OpenTelemetry SDK's OTLP exporters are not used: they
//! bring a tokio runtime and an async HTTP client (reqwest, or tonic and hyper) into
//! a gateway that runs on monoio, for one POST per batch. This thread writes that
//! POST with std sockets instead, so nothing of it runs on the shards. Spans wait at
//! most `traces.export_interval_ms` (or until [`MAX_BATCH`] are ready); a batch that
//! cannot be delivered is dropped and counted, never retried (tracing must not grow
//! memory while a collector is down). Backend, model and tenant names are resolved
//! here from the backend table, which the coordinator sends before any shard routes
//! with it.

use crate::access_log::InlineId;
use crate::backends::LiveConfig;
use crate::config::TracesConfig;
use crossbeam_channel::{Receiver, RecvTimeoutError};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{
    any_value::Value, AnyValue, InstrumentationScope, KeyValue,
};
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind as OtlpKind;
use opentelemetry_proto::tonic::trace::v1::status::StatusCode;
use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans, Span, Status};
use prost::Message;
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpanKind {
    /// The gateway's handling of one client request (OTLP SERVER).
    Request,
    /// One routing decision (OTLP INTERNAL).
    Route,
    /// One attempt against one backend (OTLP CLIENT).
    Attempt,
    /// A split request's prefill leg on a prefill backend (OTLP CLIENT).
    PrefillLeg,
    /// A split request's decode leg on a decode backend (OTLP CLIENT).
    DecodeLeg,
    /// One node of a workflow: its routing and upstream call (OTLP CLIENT).
    Node,
}

impl SpanKind {
    pub fn name(self) -> &'static str {
        match self {
            SpanKind::Request => "request",
            SpanKind::Route => "route",
            SpanKind::Attempt => "upstream attempt",
            SpanKind::PrefillLeg => "prefill leg",
            SpanKind::DecodeLeg => "decode leg",
            SpanKind::Node => "workflow node",
        }
    }
}

/// One finished span, as the shard saw it. Names are resolved on the exporter thread.
#[derive(Clone, Copy)]
pub struct SpanRecord {
    pub kind: SpanKind,
    pub trace_id: u128,
    pub span_id: u64,
    /// 0 for a root span.
    pub parent_id: u64,
    pub start: Instant,
    pub end: Instant,
    pub shard: usize,
    pub backend: Option<usize>,
    pub model: Option<usize>,
    pub tenant: Option<usize>,
    /// HTTP status (request, attempt); 0 when none.
    pub status: u16,
    /// Routing reason or error code.
    pub reason: &'static str,
    pub policy: &'static str,
    /// 1-based attempt number (route, attempt spans); retries (request span).
    pub attempt: u32,
    pub matched_blocks: u32,
    /// Request spans: the request id; workflow node spans: the node's id.
    pub id: Option<InlineId>,
}

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
            let tenants = live.tenants.names();
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

/// The OTLP/HTTP protobuf body (`ExportTraceServiceRequest`) for `spans`.
pub fn encode(
    spans: &[SpanRecord],
    service_name: &str,
    live: &LiveConfig,
    tenants: &[String],
) -> Vec<u8> {
    request(spans, service_name, live, tenants).encode_to_vec()
}

/// `spans` as one resource (`service.name`) with one instrumentation scope
/// (`radixgate` and its version); names of backends, models and tenants resolved
/// from `live` and `tenants`.
fn request(
    spans: &[SpanRecord],
    service_name: &str,
    live: &LiveConfig,
    tenants: &[String],
) -> ExportTraceServiceRequest {
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
    let spans = spans
        .iter()
        .map(|s| {
            let mut attrs = Vec::with_capacity(8);
            attrs.push(int("radixgate.shard", s.shard as u64));
            if let Some(b) = s.backend {
                attrs.push(string("radixgate.backend", table.id(b)));
            }
            if let Some(m) = s.model {
                attrs.push(string("gen_ai.request.model", table.models().name(m)));
            }
            if let Some(t) = s.tenant.and_then(|t| tenants.get(t)) {
                attrs.push(string("radixgate.tenant", t));
            }
            if !s.policy.is_empty() {
                attrs.push(string("radixgate.policy", s.policy));
            }
            if !s.reason.is_empty() {
                attrs.push(string("radixgate.reason", s.reason));
            }
            if s.status != 0 {
                attrs.push(int("http.response.status_code", s.status as u64));
            }
            match s.kind {
                SpanKind::Request => {
                    attrs.push(int("radixgate.retries", s.attempt as u64));
                    attrs.push(int("radixgate.matched_blocks", s.matched_blocks as u64));
                    if let Some(id) = &s.id {
                        attrs.push(string("radixgate.request_id", id.as_str()));
                    }
                }
                SpanKind::Route => {
                    attrs.push(int("radixgate.attempt", s.attempt as u64));
                    attrs.push(int("radixgate.matched_blocks", s.matched_blocks as u64));
                }
                SpanKind::Attempt => attrs.push(int("radixgate.attempt", s.attempt as u64)),
                SpanKind::PrefillLeg => attrs.push(string("radixgate.role", "prefill")),
                SpanKind::DecodeLeg => attrs.push(string("radixgate.role", "decode")),
                SpanKind::Node => {
                    if let Some(id) = &s.id {
                        attrs.push(string("radixgate.workflow.node", id.as_str()));
                    }
                }
            }
            Span {
                trace_id: s.trace_id.to_be_bytes().to_vec(),
                span_id: s.span_id.to_be_bytes().to_vec(),
                // Empty for a root span.
                parent_span_id: if s.parent_id != 0 {
                    s.parent_id.to_be_bytes().to_vec()
                } else {
                    Vec::new()
                },
                name: s.kind.name().into(),
                kind: kind(s.kind) as i32,
                start_time_unix_nano: unix_ns(s.start),
                end_time_unix_nano: unix_ns(s.end),
                attributes: attrs,
                // ERROR for 5xx answers (the gateway's or a backend's); else unset.
                status: (s.status >= 500).then(|| Status {
                    code: StatusCode::Error as i32,
                    message: s.reason.into(),
                }),
                ..Span::default()
            }
        })
        .collect();
    ExportTraceServiceRequest {
        resource_spans: vec![ResourceSpans {
            resource: Some(Resource {
                attributes: vec![string("service.name", service_name)],
                ..Resource::default()
            }),
            scope_spans: vec![ScopeSpans {
                scope: Some(InstrumentationScope {
                    name: "radixgate".into(),
                    version: env!("CARGO_PKG_VERSION").into(),
                    ..InstrumentationScope::default()
                }),
                spans,
                schema_url: String::new(),
            }],
            schema_url: String::new(),
        }],
    }
}

/// The OTLP kind of each span: the request is the server side of the client's call,
/// a routing decision is internal, the rest are calls to engines.
fn kind(k: SpanKind) -> OtlpKind {
    match k {
        SpanKind::Request => OtlpKind::Server,
        SpanKind::Route => OtlpKind::Internal,
        SpanKind::Attempt | SpanKind::PrefillLeg | SpanKind::DecodeLeg | SpanKind::Node => {
            OtlpKind::Client
        }
    }
}

fn string(key: &str, v: &str) -> KeyValue {
    attr(key, Value::StringValue(v.into()))
}

fn int(key: &str, v: u64) -> KeyValue {
    attr(key, Value::IntValue(v as i64))
}

fn attr(key: &str, value: Value) -> KeyValue {
    KeyValue {
        key: key.into(),
        value: Some(AnyValue { value: Some(value) }),
        ..KeyValue::default()
    }
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
        "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/x-protobuf\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
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
    use std::time::SystemTime;

    fn live() -> Arc<LiveConfig> {
        let config = crate::Config::from_toml(
            "[server]\nlisten = \"127.0.0.1:0\"\n[[backends]]\nid = \"b0\"\nurl = \"http://127.0.0.1:9\"\nmodels = [\"m\"]\n",
        )
        .unwrap();
        LiveConfig::initial(&config)
    }

    fn span(kind: SpanKind, parent_id: u64, status: u16) -> SpanRecord {
        let now = Instant::now();
        SpanRecord {
            kind,
            trace_id: 0x4bf9_2f35_77b3_4da6_a3ce_929d_0e0e_4736,
            span_id: 0x00f0_67aa_0ba9_02b7,
            parent_id,
            start: now - Duration::from_millis(3),
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
        }
    }

    /// The attribute `key` of `span`, if present.
    fn attr<'a>(span: &'a Span, key: &str) -> Option<&'a Value> {
        span.attributes
            .iter()
            .find(|a| a.key == key)
            .and_then(|a| a.value.as_ref()?.value.as_ref())
    }

    fn decode(body: &[u8]) -> (Vec<KeyValue>, InstrumentationScope, Vec<Span>) {
        let mut req = ExportTraceServiceRequest::decode(body).expect("valid protobuf");
        assert_eq!(req.resource_spans.len(), 1);
        let mut rs = req.resource_spans.remove(0);
        assert_eq!(rs.scope_spans.len(), 1);
        let ss = rs.scope_spans.remove(0);
        (rs.resource.unwrap().attributes, ss.scope.unwrap(), ss.spans)
    }

    #[test]
    fn encodes_ids_times_kinds_status_and_attributes_as_protobuf() {
        let node = SpanRecord {
            id: Some(InlineId::new("summarise")),
            ..span(SpanKind::Node, 0x34, 200)
        };
        let records = [
            span(SpanKind::Request, 0, 502),
            span(SpanKind::Route, 0x34, 0),
            span(SpanKind::Attempt, 0x34, 200),
            span(SpanKind::PrefillLeg, 0x34, 503),
            span(SpanKind::DecodeLeg, 0x34, 200),
            node,
        ];
        let before = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
        let body = encode(&records, "svc", &live(), &["tenant \"a\"".into()]);
        let after = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
        let (resource, scope, spans) = decode(&body);
        assert_eq!(resource, vec![string("service.name", "svc")]);
        assert_eq!(
            (scope.name.as_str(), scope.version.as_str()),
            ("radixgate", env!("CARGO_PKG_VERSION"))
        );
        assert_eq!(spans.len(), records.len());

        // Ids: big-endian bytes of the W3C hex ids; a root has no parent.
        let request = &spans[0];
        assert_eq!(
            request.trace_id,
            [
                0x4b, 0xf9, 0x2f, 0x35, 0x77, 0xb3, 0x4d, 0xa6, 0xa3, 0xce, 0x92, 0x9d, 0x0e, 0x0e,
                0x47, 0x36
            ]
        );
        assert_eq!(
            request.span_id,
            [0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7]
        );
        assert!(request.parent_span_id.is_empty());
        assert_eq!(spans[2].parent_span_id, 0x34u64.to_be_bytes());

        // Times: the monotonic instants on the wall clock, 3 ms apart.
        for s in &spans {
            let (start, end) = (s.start_time_unix_nano, s.end_time_unix_nano);
            assert_eq!(end - start, 3_000_000, "{s:?}");
            assert!(start >= before.as_nanos() as u64 - 3_000_000 - 1_000_000_000);
            assert!(end <= after.as_nanos() as u64);
        }

        // Names and kinds.
        let named: Vec<(&str, OtlpKind)> =
            spans.iter().map(|s| (s.name.as_str(), s.kind())).collect();
        assert_eq!(
            named,
            [
                ("request", OtlpKind::Server),
                ("route", OtlpKind::Internal),
                ("upstream attempt", OtlpKind::Client),
                ("prefill leg", OtlpKind::Client),
                ("decode leg", OtlpKind::Client),
                ("workflow node", OtlpKind::Client),
            ]
        );

        // Status: ERROR with the reason for 5xx, else unset.
        let error = Some(Status {
            code: StatusCode::Error as i32,
            message: "upstream_error".into(),
        });
        let statuses: Vec<_> = spans.iter().map(|s| s.status.clone()).collect();
        assert_eq!(statuses, [error.clone(), None, None, error, None, None]);

        // Attributes, typed: names resolved, numbers as integers.
        let s = |v: &str| Some(Value::StringValue(v.into()));
        let i = |v: i64| Some(Value::IntValue(v));
        let get = |span: &Span, k: &str| attr(span, k).cloned();
        assert_eq!(get(request, "radixgate.backend"), s("b0"));
        assert_eq!(get(request, "gen_ai.request.model"), s("m"));
        assert_eq!(get(request, "radixgate.tenant"), s("tenant \"a\""));
        assert_eq!(get(request, "radixgate.policy"), s("prefix_aware"));
        assert_eq!(get(request, "radixgate.reason"), s("upstream_error"));
        assert_eq!(get(request, "radixgate.shard"), i(1));
        assert_eq!(get(request, "http.response.status_code"), i(502));
        assert_eq!(get(request, "radixgate.retries"), i(2));
        assert_eq!(get(request, "radixgate.matched_blocks"), i(7));
        assert_eq!(get(request, "radixgate.request_id"), s("req-1"));
        let route = &spans[1];
        assert_eq!(get(route, "radixgate.attempt"), i(2));
        assert_eq!(get(route, "radixgate.matched_blocks"), i(7));
        assert_eq!(get(route, "http.response.status_code"), None);
        assert_eq!(get(&spans[2], "radixgate.attempt"), i(2));
        assert_eq!(get(&spans[2], "radixgate.request_id"), None);
        assert_eq!(get(&spans[3], "radixgate.role"), s("prefill"));
        assert_eq!(get(&spans[4], "radixgate.role"), s("decode"));
        assert_eq!(get(&spans[5], "radixgate.workflow.node"), s("summarise"));
        assert_eq!(get(&spans[5], "radixgate.request_id"), None);
    }

    #[test]
    fn leaves_out_what_a_span_does_not_have() {
        let bare = SpanRecord {
            backend: None,
            model: None,
            // Out of the tenant table (it is never, but must not panic).
            tenant: Some(5),
            status: 0,
            reason: "",
            policy: "",
            id: None,
            ..span(SpanKind::Request, 0, 0)
        };
        let (_, _, spans) = decode(&encode(&[bare], "svc", &live(), &[]));
        let keys: Vec<&str> = spans[0].attributes.iter().map(|a| a.key.as_str()).collect();
        assert_eq!(
            keys,
            [
                "radixgate.shard",
                "radixgate.retries",
                "radixgate.matched_blocks"
            ]
        );
        assert_eq!(spans[0].status, None);
    }
}
