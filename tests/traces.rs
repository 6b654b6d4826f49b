//! Traces: W3C `traceparent` in, the gateway's own spans exported over OTLP/HTTP
//! (protobuf, decoded with opentelemetry-proto) to a receiver on loopback, and the attempt span sent upstream as the
//! engine's parent. Checks the spans' parentage, a retried request's two attempts,
//! an unsampled client trace, a trace the gateway starts itself, a split request's
//! prefill and decode legs (both protocols) and a workflow's nodes. Both I/O drivers.

mod common;

use common::*;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{any_value::Value as AnyValue, KeyValue};
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A minimal OTLP/HTTP receiver: every POSTed body, decoded from protobuf.
struct Collector {
    addr: SocketAddr,
    bodies: Arc<Mutex<Vec<Value>>>,
    /// The `Content-Type` of each POST.
    content_types: Arc<Mutex<Vec<String>>>,
}

impl Collector {
    fn start() -> Collector {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let bodies = Arc::new(Mutex::new(Vec::new()));
        let content_types = Arc::new(Mutex::new(Vec::new()));
        let (b, ct) = (bodies.clone(), content_types.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { return };
                let mut reader = BufReader::new(stream);
                let mut head = String::new();
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 {
                        break;
                    }
                    head.push_str(&line);
                    if line == "\r\n" {
                        break;
                    }
                }
                assert!(head.starts_with("POST /v1/traces HTTP/1.1\r\n"), "{head}");
                let header = |name: &str| {
                    head.lines()
                        .find_map(|l| l.strip_prefix(name))
                        .map(|v| v.trim().to_string())
                };
                let len: usize = header("Content-Length: ")
                    .and_then(|v| v.parse().ok())
                    .expect("Content-Length");
                let mut body = vec![0; len];
                reader.read_exact(&mut body).unwrap();
                let request = ExportTraceServiceRequest::decode(&body[..]).expect("OTLP protobuf");
                ct.lock()
                    .unwrap()
                    .push(header("Content-Type: ").unwrap_or_default());
                b.lock().unwrap().push(otlp_json(&request));
                let _ = reader.get_mut().write_all(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                );
            }
        });
        Collector {
            addr,
            bodies,
            content_types,
        }
    }

    /// Every exported span, flattened.
    fn spans(&self) -> Vec<Value> {
        let bodies = self.bodies.lock().unwrap();
        let types = self.content_types.lock().unwrap();
        assert!(
            types.iter().all(|t| t == "application/x-protobuf"),
            "{types:?}"
        );
        let mut out = Vec::new();
        for b in bodies.iter() {
            for rs in b["resourceSpans"].as_array().unwrap() {
                let service = &rs["resource"]["attributes"][0];
                assert_eq!(service["key"], "service.name");
                assert_eq!(service["value"]["stringValue"], "gw-under-test");
                for ss in rs["scopeSpans"].as_array().unwrap() {
                    assert_eq!(ss["scope"]["name"], "radixgate");
                    out.extend(ss["spans"].as_array().unwrap().iter().cloned());
                }
            }
        }
        out
    }
}

/// A decoded request in the shape of the OTLP/JSON mapping (ids in hex, 64-bit
/// integers as decimal strings, absent fields left out), which the checks read.
fn otlp_json(request: &ExportTraceServiceRequest) -> Value {
    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }
    fn attributes(kvs: &[KeyValue]) -> Value {
        kvs.iter()
            .map(|kv| {
                let value = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                    Some(AnyValue::StringValue(s)) => json!({ "stringValue": s }),
                    Some(AnyValue::IntValue(i)) => json!({ "intValue": i.to_string() }),
                    other => panic!("{}: unexpected value {other:?}", kv.key),
                };
                json!({ "key": kv.key, "value": value })
            })
            .collect()
    }
    let span = |s: &Span| {
        let mut v = json!({
            "traceId": hex(&s.trace_id),
            "spanId": hex(&s.span_id),
            "name": s.name,
            "kind": s.kind,
            "startTimeUnixNano": s.start_time_unix_nano.to_string(),
            "endTimeUnixNano": s.end_time_unix_nano.to_string(),
            "attributes": attributes(&s.attributes),
            "status": s.status.as_ref().map_or(json!({}), |st| json!({
                "code": st.code,
                "message": st.message,
            })),
        });
        assert_eq!((s.trace_id.len(), s.span_id.len()), (16, 8), "{s:?}");
        if !s.parent_span_id.is_empty() {
            assert_eq!(s.parent_span_id.len(), 8, "{s:?}");
            v["parentSpanId"] = hex(&s.parent_span_id).into();
        }
        v
    };
    let resource_spans: Vec<Value> = request
        .resource_spans
        .iter()
        .map(|rs| {
            let scope_spans: Vec<Value> = rs
                .scope_spans
                .iter()
                .map(|ss| {
                    json!({
                        "scope": { "name": ss.scope.as_ref().map(|s| s.name.clone()) },
                        "spans": ss.spans.iter().map(span).collect::<Vec<_>>(),
                    })
                })
                .collect();
            json!({
                "resource": {
                    "attributes": attributes(&rs.resource.as_ref().unwrap().attributes),
                },
                "scopeSpans": scope_spans,
            })
        })
        .collect();
    json!({ "resourceSpans": resource_spans })
}

fn attr<'a>(span: &'a Value, key: &str) -> Option<&'a Value> {
    span["attributes"]
        .as_array()?
        .iter()
        .find(|a| a["key"] == key)
        .map(|a| &a["value"])
}

fn attr_str(span: &Value, key: &str) -> String {
    attr(span, key)
        .and_then(|v| v["stringValue"].as_str())
        .unwrap_or_default()
        .to_string()
}

fn attr_int(span: &Value, key: &str) -> i64 {
    attr(span, key)
        .and_then(|v| v["intValue"].as_str())
        .and_then(|v| v.parse().ok())
        .unwrap_or(-1)
}

fn nanos(span: &Value, key: &str) -> u64 {
    span[key].as_str().unwrap().parse().unwrap()
}

/// The `traceparent` an upstream received, split into (trace, parent, flags).
fn upstream_traceparent(head: &str) -> Option<(String, String, String)> {
    let v = head.lines().find_map(|l| {
        let (n, v) = l.split_once(':')?;
        n.eq_ignore_ascii_case("traceparent").then(|| v.trim())
    })?;
    let p: Vec<&str> = v.split('-').collect();
    assert_eq!(p.len(), 4, "{v}");
    assert_eq!(p[0], "00");
    Some((p[1].into(), p[2].into(), p[3].into()))
}

fn exports_spans_with_parentage(io: &str) {
    let collector = Collector::start();
    let ok = ScriptedUpstream::start(Script::Reply(vec![
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
            .to_vec(),
    ]));
    let failing = ScriptedUpstream::start(Script::Reply(vec![
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n".to_vec(),
    ]));
    let extra = format!(
        "[routing]\npolicy = \"round_robin\"\n[breaker]\nfailure_threshold = 1000000\n[retry]\nbudget_ratio = 1.0\nmin_retries_per_sec = 100\n[health]\ninterval_ms = 60000\n[traces]\notlp_endpoint = \"http://{}/v1/traces\"\nservice_name = \"gw-under-test\"\nexport_interval_ms = 50",
        collector.addr
    );
    let gw = start_gateway(
        io,
        1,
        &extra,
        &[("ok", ok.url(), "sim"), ("failing", failing.url(), "sim")],
    );
    let mut c = Client::connect(gw.local_addr());
    // Four sampled client traces: round robin sends two of them to `failing` first.
    let client_span = "00f067aa0ba902b7";
    let traces: Vec<String> = (0..4)
        .map(|i| format!("4bf92f3577b34da6a3ce929d0e0e47{i:02x}"))
        .collect();
    for t in &traces {
        let tp = format!("00-{t}-{client_span}-01");
        let r = c.post(
            "/v1/chat/completions",
            &chat_body("hello", false),
            &[("traceparent", &tp)],
        );
        assert_eq!(r.status, 200, "{}", r.text());
    }
    // No traceparent: the gateway starts a trace of its own.
    let r = c.post("/v1/chat/completions", &chat_body("fresh", false), &[]);
    assert_eq!(r.status, 200);
    // Not sampled by the client: nothing recorded, its context passes through.
    let unsampled = "0af7651916cd43dd8448eb211c80319c";
    let tp = format!("00-{unsampled}-b7ad6b7169203331-00");
    let r = c.post(
        "/v1/chat/completions",
        &chat_body("unsampled", false),
        &[("traceparent", &tp)],
    );
    assert_eq!(r.status, 200);
    // Refused by the gateway (unknown model): a request span alone, status 404.
    let refused = "11111111111111111111111111111111";
    let tp = format!("00-{refused}-{client_span}-01");
    let r = c.post(
        "/v1/chat/completions",
        r#"{"model":"nope","messages":[{"role":"user","content":"x"}]}"#,
        &[("traceparent", &tp)],
    );
    assert_eq!(r.status, 404, "{}", r.text());

    // One shard: spans reach the exporter in the order requests finish, and batches
    // go out in order, so once the last request's span is here, all are.
    let complete = eventually(Duration::from_secs(10), || {
        collector.spans().iter().any(|s| s["traceId"] == refused)
    });
    let spans = collector.spans();
    assert!(complete, "{} spans: {spans:#?}", spans.len());

    let by_id: HashMap<String, &Value> = spans
        .iter()
        .map(|s| (s["spanId"].as_str().unwrap().to_string(), s))
        .collect();
    assert_eq!(by_id.len(), spans.len(), "span ids are unique");
    let seen = [ok.seen(), failing.seen()].concat();
    let mut retried = 0;
    for t in &traces {
        let of_trace: Vec<&Value> = spans.iter().filter(|s| s["traceId"] == *t).collect();
        let request: Vec<_> = of_trace.iter().filter(|s| s["name"] == "request").collect();
        assert_eq!(request.len(), 1, "{of_trace:#?}");
        let request = request[0];
        assert_eq!(request["kind"], 2);
        assert_eq!(request["parentSpanId"], client_span);
        assert_eq!(request["status"], json!({}));
        assert_eq!(attr_int(request, "radixgate.shard"), 0);
        assert_eq!(attr_str(request, "radixgate.policy"), "round_robin");
        assert_eq!(attr_int(request, "http.response.status_code"), 200);
        assert_eq!(attr_str(request, "radixgate.backend"), "ok");
        assert_eq!(attr_str(request, "gen_ai.request.model"), "sim");
        let request_id = request["spanId"].as_str().unwrap();
        let attempts: Vec<_> = of_trace
            .iter()
            .filter(|s| s["name"] == "upstream attempt")
            .collect();
        let routes: Vec<_> = of_trace.iter().filter(|s| s["name"] == "route").collect();
        assert_eq!(attempts.len(), routes.len());
        assert_eq!(
            attr_int(request, "radixgate.retries"),
            attempts.len() as i64 - 1
        );
        for s in attempts.iter().chain(routes.iter()) {
            assert_eq!(s["parentSpanId"], request_id, "{s:#}");
            assert!(nanos(s, "startTimeUnixNano") >= nanos(request, "startTimeUnixNano"));
            assert!(nanos(s, "endTimeUnixNano") <= nanos(request, "endTimeUnixNano"));
            assert!(nanos(s, "startTimeUnixNano") <= nanos(s, "endTimeUnixNano"));
        }
        for r in &routes {
            assert_eq!(r["kind"], 1, "a routing decision is INTERNAL");
        }
        for a in &attempts {
            assert_eq!(a["kind"], 3);
            // The engine saw exactly this attempt as its parent.
            let sent: Vec<_> = seen
                .iter()
                .filter_map(|s| upstream_traceparent(&s.head))
                .filter(|(trace, parent, _)| trace == t && parent == a["spanId"].as_str().unwrap())
                .collect();
            assert_eq!(sent.len(), 1, "attempt {a:#} not seen upstream");
            assert_eq!(sent[0].2, "01");
            let backend = attr_str(a, "radixgate.backend");
            let status = attr_int(a, "http.response.status_code");
            match backend.as_str() {
                "failing" => {
                    assert_eq!(status, 503);
                    assert_eq!(a["status"]["code"], 2, "a 503 attempt is an error");
                    assert_eq!(a["status"]["message"], attr_str(a, "radixgate.reason"));
                }
                "ok" => {
                    assert_eq!(status, 200);
                    assert_eq!(a["status"], json!({}));
                }
                other => panic!("attempt on {other}"),
            }
        }
        if attempts.len() == 2 {
            retried += 1;
            let first = attempts
                .iter()
                .find(|a| attr_int(a, "radixgate.attempt") == 1);
            assert_eq!(attr_str(first.unwrap(), "radixgate.backend"), "failing");
        }
    }
    assert!(
        retried >= 1,
        "round robin sends some requests to `failing` first"
    );

    // The gateway's own trace: a root request span, and the same trace id upstream.
    let own: Vec<&Value> = spans
        .iter()
        .filter(|s| s["name"] == "request" && s.get("parentSpanId").is_none())
        .collect();
    assert_eq!(own.len(), 1, "{own:#?}");
    let own_trace = own[0]["traceId"].as_str().unwrap();
    assert!(!traces.iter().any(|t| t == own_trace));
    assert!(seen
        .iter()
        .filter_map(|s| upstream_traceparent(&s.head))
        .any(|(trace, _, flags)| trace == own_trace && flags == "01"));

    // Unsampled: no spans; the upstream got the client's context unchanged.
    assert!(!spans.iter().any(|s| s["traceId"] == unsampled));
    assert!(seen
        .iter()
        .filter_map(|s| upstream_traceparent(&s.head))
        .any(|(trace, parent, flags)| trace == unsampled
            && parent == "b7ad6b7169203331"
            && flags == "00"));

    // Refused: one request span with the error's status, no children.
    let of_refused: Vec<&Value> = spans.iter().filter(|s| s["traceId"] == refused).collect();
    assert_eq!(of_refused.len(), 1, "{of_refused:#?}");
    assert_eq!(attr_int(of_refused[0], "http.response.status_code"), 404);
    assert_eq!(
        attr_str(of_refused[0], "radixgate.reason"),
        "model_not_found"
    );

    // Routed traces: a request span and a route and attempt span per attempt.
    let attempts = spans
        .iter()
        .filter(|s| s["name"] == "upstream attempt")
        .count();
    let routes = spans.iter().filter(|s| s["name"] == "route").count();
    let requests = spans.iter().filter(|s| s["name"] == "request").count();
    assert_eq!((requests, routes), (6, attempts));
    // The gateway's own trace may have been retried too.
    assert!(attempts >= 5 + retried, "{attempts} attempts");
    let exported = spans.len() as f64;
    assert!(eventually(Duration::from_secs(5), || {
        let m = Client::connect(gw.local_addr()).get("/metrics").text();
        metric(&m, "radixgate_trace_spans_total{outcome=\"exported\"}") == Some(exported)
    }));
}
both_drivers!(exports_spans_with_parentage);

/// The spans of trace `trace`, once `expected` of them have arrived.
fn spans_of(collector: &Collector, trace: &str, expected: usize) -> Vec<Value> {
    let of = |c: &Collector| -> Vec<Value> {
        c.spans()
            .into_iter()
            .filter(|s| s["traceId"] == trace)
            .collect()
    };
    let complete = eventually(Duration::from_secs(10), || of(collector).len() >= expected);
    let spans = of(collector);
    assert!(complete, "{} of {expected} spans: {spans:#?}", spans.len());
    assert_eq!(spans.len(), expected, "{spans:#?}");
    spans
}

/// The one span named `name` in `spans`.
fn one<'a>(spans: &'a [Value], name: &str) -> &'a Value {
    let found: Vec<&Value> = spans.iter().filter(|s| s["name"] == name).collect();
    assert_eq!(found.len(), 1, "{name}: {spans:#?}");
    found[0]
}

/// `child` is a client span of `request`, within its time.
fn is_child_of(child: &Value, request: &Value) {
    assert_eq!(child["parentSpanId"], request["spanId"], "{child:#}");
    assert_eq!(child["kind"], 3, "{child:#}");
    assert!(nanos(child, "startTimeUnixNano") >= nanos(request, "startTimeUnixNano"));
    assert!(nanos(child, "startTimeUnixNano") <= nanos(child, "endTimeUnixNano"));
}

/// The parent span ids an upstream received in trace `trace`.
fn parents_seen(upstream: &ScriptedUpstream, trace: &str) -> Vec<String> {
    upstream
        .seen()
        .iter()
        .filter_map(|s| upstream_traceparent(&s.head))
        .filter(|(t, _, flags)| t == trace && flags == "01")
        .map(|(_, parent, _)| parent)
        .collect()
}

const OK_JSON: &[u8] =
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}";

/// A gateway in split mode (`mode = "always"` and `disagg` keys) over one prefill
/// and one decode upstream answering `prefill_reply` and `{}`, exporting to a
/// collector.
struct Split {
    collector: Collector,
    prefill: ScriptedUpstream,
    decode: ScriptedUpstream,
    gw: radixgate::Gateway,
}

fn split_gateway(io: &str, protocol: &str, prefill_reply: &[u8], disagg: &str) -> Split {
    let collector = Collector::start();
    let prefill = ScriptedUpstream::start(Script::Reply(vec![prefill_reply.to_vec()]));
    let decode = ScriptedUpstream::start(Script::Reply(vec![OK_JSON.to_vec()]));
    // The SGLang prefill server's bootstrap port only goes into the legs' bodies.
    let bootstrap = if protocol == "sglang" {
        "bootstrap_port = 1\n"
    } else {
        ""
    };
    let toml = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nshards = 1\nio = \"{io}\"\n[health]\ninterval_ms = 60000\n[breaker]\nfailure_threshold = 1000000\n[traces]\notlp_endpoint = \"http://{}/v1/traces\"\nservice_name = \"gw-under-test\"\nexport_interval_ms = 20\n[models.sim.disagg]\nprotocol = \"{protocol}\"\nmode = \"always\"\n{disagg}\n\n[[backends]]\nid = \"prefill-0\"\nurl = \"{}\"\nmodels = [\"sim\"]\nrole = \"prefill\"\n{bootstrap}\n[[backends]]\nid = \"decode-0\"\nurl = \"{}\"\nmodels = [\"sim\"]\nrole = \"decode\"\n",
        collector.addr,
        prefill.url(),
        decode.url()
    );
    let config = radixgate::Config::from_toml(&toml).unwrap_or_else(|e| panic!("{e}\n{toml}"));
    Split {
        collector,
        prefill,
        decode,
        gw: radixgate::Gateway::start(config).unwrap(),
    }
}

/// A split request: the request span has a prefill leg span and a decode leg span as
/// children, and each engine received a `traceparent` naming its own leg's span.
fn split_legs_are_spans(io: &str, protocol: &str) {
    let Split {
        collector,
        prefill,
        decode,
        gw,
    } = split_gateway(io, protocol, OK_JSON, "");
    let trace = "5bf92f3577b34da6a3ce929d0e0e4736";
    let r = Client::connect(gw.local_addr()).post(
        "/v1/chat/completions",
        &chat_body("split me", false),
        &[("traceparent", &format!("00-{trace}-00f067aa0ba902b7-01"))],
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-router-reason"), Some("disagg-split"));

    // The request, the pair's routing decision and the two legs.
    let spans = spans_of(&collector, trace, 4);
    let request = one(&spans, "request");
    assert_eq!(request["parentSpanId"], "00f067aa0ba902b7");
    assert_eq!(attr_int(request, "http.response.status_code"), 200);
    let route = one(&spans, "route");
    assert_eq!(route["parentSpanId"], request["spanId"]);
    assert_eq!(attr_str(route, "radixgate.reason"), "disagg-split");
    assert_eq!(attr_str(route, "radixgate.backend"), "decode-0");
    let legs = [
        ("prefill leg", "prefill", "prefill-0", &prefill),
        ("decode leg", "decode", "decode-0", &decode),
    ];
    for (name, role, backend, engine) in legs {
        let leg = one(&spans, name);
        is_child_of(leg, request);
        // An SGLang prefill leg runs beside the decode leg and may end after the
        // request span does (the client has its answer); the others end within it.
        if role == "decode" || protocol == "vllm" {
            assert!(nanos(leg, "endTimeUnixNano") <= nanos(request, "endTimeUnixNano"));
        }
        assert_eq!(attr_str(leg, "radixgate.role"), role);
        assert_eq!(attr_str(leg, "radixgate.backend"), backend);
        assert_eq!(attr_int(leg, "http.response.status_code"), 200);
        assert_eq!(leg["status"], json!({}));
        // The engine saw exactly its own leg's span as parent.
        assert_eq!(
            parents_seen(engine, trace),
            vec![leg["spanId"].as_str().unwrap().to_string()],
            "{name}"
        );
    }
}

fn split_legs_are_spans_vllm(io: &str) {
    split_legs_are_spans(io, "vllm");
}
both_drivers!(split_legs_are_spans_vllm);

fn split_legs_are_spans_sglang(io: &str) {
    split_legs_are_spans(io, "sglang");
}
both_drivers!(split_legs_are_spans_sglang);

/// A split request whose prefill leg fails (503, one attempt, no local fallback):
/// the request span carries the gateway's error and the failed leg's backend, the
/// prefill leg span is an error, and no decode leg ran.
fn failed_split_is_an_error_span(io: &str) {
    let Split {
        collector,
        decode,
        gw,
        ..
    } = split_gateway(
        io,
        "vllm",
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n",
        "prefill_attempts = 1\nlocal_fallback = false",
    );
    let trace = "7bf92f3577b34da6a3ce929d0e0e4736";
    let r = Client::connect(gw.local_addr()).post(
        "/v1/chat/completions",
        &chat_body("split me", false),
        &[("traceparent", &format!("00-{trace}-00f067aa0ba902b7-01"))],
    );
    assert_eq!(r.status, 502, "{}", r.text());
    let spans = spans_of(&collector, trace, 3);
    let request = one(&spans, "request");
    assert_eq!(attr_int(request, "http.response.status_code"), 502);
    assert_eq!(request["status"]["code"], 2);
    assert_eq!(attr_str(request, "radixgate.backend"), "prefill-0");
    assert_eq!(attr_str(request, "radixgate.reason"), "disagg-split");
    let leg = one(&spans, "prefill leg");
    is_child_of(leg, request);
    assert_eq!(attr_int(leg, "http.response.status_code"), 503);
    assert_eq!(leg["status"]["code"], 2);
    one(&spans, "route");
    assert!(decode.seen().is_empty());
}
both_drivers!(failed_split_is_an_error_span);

/// A workflow: one request span, one span per node that ran, each the parent the
/// node's upstream request names; a node that fails is an error span, its
/// descendant (never run) has none.
fn workflow_nodes_are_spans(io: &str) {
    let collector = Collector::start();
    let content = r#"{"choices":[{"index":0,"text":"done"}]}"#;
    let reply = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{content}",
        content.len()
    );
    let up = ScriptedUpstream::start(Script::Reply(vec![reply.into_bytes()]));
    let extra = format!(
        "[health]\ninterval_ms = 60000\n[traces]\notlp_endpoint = \"http://{}/v1/traces\"\nservice_name = \"gw-under-test\"\nexport_interval_ms = 20",
        collector.addr
    );
    let gw = start_gateway(io, 1, &extra, &[("up", up.url(), "sim")]);
    let trace = "6bf92f3577b34da6a3ce929d0e0e4736";
    let body = r#"{"nodes":[
        {"id":"a","model":"sim","prompt":"first"},
        {"id":"b","model":"sim","parents":["a"],"prompt":"after {{a}}"},
        {"id":"c","model":"sim","parents":["a"],"prompt":"beside {{a}}"},
        {"id":"bad","model":"no-such-model","prompt":"x"},
        {"id":"never","model":"sim","parents":["bad"],"prompt":"y"}]}"#;
    let r = Client::connect(gw.local_addr()).post(
        "/v1/workflows",
        body,
        &[("traceparent", &format!("00-{trace}-00f067aa0ba902b7-01"))],
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["status"], "partial", "{}", r.text());

    // The request span and four node spans ("never" did not run).
    let spans = spans_of(&collector, trace, 5);
    let request = one(&spans, "request");
    assert_eq!(request["parentSpanId"], "00f067aa0ba902b7");
    assert_eq!(attr_str(request, "radixgate.reason"), "workflow");
    assert_eq!(attr_int(request, "http.response.status_code"), 200);
    let nodes: Vec<&Value> = spans
        .iter()
        .filter(|s| s["name"] == "workflow node")
        .collect();
    let mut ids: Vec<String> = nodes
        .iter()
        .map(|n| attr_str(n, "radixgate.workflow.node"))
        .collect();
    ids.sort();
    assert_eq!(ids, ["a", "b", "bad", "c"]);
    for n in &nodes {
        is_child_of(n, request);
        assert!(nanos(n, "endTimeUnixNano") <= nanos(request, "endTimeUnixNano"));
        if attr_str(n, "radixgate.workflow.node") == "bad" {
            assert_eq!(attr_int(n, "http.response.status_code"), 404);
            assert_eq!(attr_str(n, "radixgate.reason"), "model_not_found");
            assert!(attr(n, "radixgate.backend").is_none());
        } else {
            assert_eq!(attr_int(n, "http.response.status_code"), 200);
            assert_eq!(attr_str(n, "radixgate.backend"), "up");
        }
    }
    // Each node that reached the engine named its own span as parent.
    let mut seen = parents_seen(&up, trace);
    seen.sort();
    let mut expected: Vec<String> = nodes
        .iter()
        .filter(|n| attr_str(n, "radixgate.workflow.node") != "bad")
        .map(|n| n["spanId"].as_str().unwrap().to_string())
        .collect();
    expected.sort();
    assert_eq!(seen, expected);
}
both_drivers!(workflow_nodes_are_spans);

/// Spans still batched when the gateway stops are exported before `shutdown`
/// returns (here the export interval would hold them for a minute).
fn spans_are_exported_at_shutdown(io: &str) {
    let collector = Collector::start();
    let ok = ScriptedUpstream::start(Script::Reply(vec![OK_JSON.to_vec()]));
    let extra = format!(
        "[traces]\notlp_endpoint = \"http://{}/v1/traces\"\nservice_name = \"gw-under-test\"\nexport_interval_ms = 60000",
        collector.addr
    );
    let gw = start_gateway(io, 1, &extra, &[("ok", ok.url(), "sim")]);
    let r = Client::connect(gw.local_addr()).post(
        "/v1/chat/completions",
        &chat_body("last", false),
        &[],
    );
    assert_eq!(r.status, 200);
    assert!(collector.spans().is_empty());
    gw.shutdown();
    // The collector thread may still be parsing the last POST.
    assert!(eventually(Duration::from_secs(2), || collector
        .spans()
        .len()
        == 3));
}
both_drivers!(spans_are_exported_at_shutdown);

/// A collector that is down costs the requests nothing; its spans are counted failed.
fn collector_down_is_counted(io: &str) {
    // A port nothing listens on: bind, note it, close.
    let dead = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let ok = ScriptedUpstream::start(Script::Reply(vec![
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
            .to_vec(),
    ]));
    let extra =
        format!("[traces]\notlp_endpoint = \"http://{dead}/v1/traces\"\nexport_interval_ms = 20");
    let gw = start_gateway(io, 1, &extra, &[("ok", ok.url(), "sim")]);
    let mut c = Client::connect(gw.local_addr());
    for _ in 0..3 {
        let r = c.post("/v1/chat/completions", &chat_body("hi", false), &[]);
        assert_eq!(r.status, 200);
    }
    // Each request: request, route and attempt spans.
    let counted = eventually(Duration::from_secs(10), || {
        let m = Client::connect(gw.local_addr()).get("/metrics").text();
        metric(&m, "radixgate_trace_spans_total{outcome=\"failed\"}") == Some(9.0)
    });
    assert!(counted);
    // Every upstream request still carried a context.
    assert!(ok
        .seen()
        .iter()
        .all(|s| upstream_traceparent(&s.head).is_some()));
}
both_drivers!(collector_down_is_counted);

#[test]
fn bad_endpoints_are_refused_by_config() {
    for (endpoint, expect) in [
        ("https://collector:4318/v1/traces", "not an http:// URL"),
        ("http://:4318/v1/traces", "no host or port"),
    ] {
        let toml = format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n[traces]\notlp_endpoint = \"{endpoint}\"\n[[backends]]\nid = \"b\"\nurl = \"http://127.0.0.1:1\"\nmodels = [\"m\"]\n"
        );
        let err = radixgate::Config::from_toml(&toml).unwrap_err().to_string();
        assert!(err.contains(expect), "{err}");
    }
    let toml = "[server]\nlisten = \"127.0.0.1:0\"\n[traces]\notlp_endpoint = \"http://127.0.0.1:4318\"\nsample_ratio = 2.0\n[[backends]]\nid = \"b\"\nurl = \"http://127.0.0.1:1\"\nmodels = [\"m\"]\n";
    let err = radixgate::Config::from_toml(toml).unwrap_err().to_string();
    assert!(err.contains("traces.sample_ratio"), "{err}");
}
