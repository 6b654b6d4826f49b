//! Pass-through behaviour over real sockets: bodies byte for byte in both
//! directions, header hygiene, keep-alive reuse on both sides, chunked request
//! bodies, pipelining, `Expect: 100-continue`, request ids. Every test runs on both
//! I/O drivers.

mod common;

use common::*;

fn chunk(data: &str) -> String {
    format!("{:x}\r\n{data}\r\n", data.len())
}

fn sse_pieces() -> Vec<String> {
    vec![
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\nConnection: keep-alive\r\nKeep-Alive: timeout=5\r\nX-Engine: scripted\r\n\r\n".into(),
        chunk("data: {\"choices\":[\"one\"]}\n\n"),
        chunk("data: {\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":2}}\n\n"),
        chunk("data: [DONE]\n\n") + "0\r\n\r\n",
    ]
}

fn sse_upstream() -> ScriptedUpstream {
    ScriptedUpstream::start(Script::Reply(
        sse_pieces().into_iter().map(String::into_bytes).collect(),
    ))
}

fn json_upstream(body: &str) -> ScriptedUpstream {
    let resp = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    ScriptedUpstream::start(Script::Reply(vec![resp.into_bytes()]))
}

fn streaming_passthrough_is_byte_exact(io: &str) {
    let up = sse_upstream();
    let gw = start_gateway(io, 1, "", &[("b0", up.url(), "sim")]);
    let mut c = Client::connect(gw.local_addr());
    let body = chat_body("hello", true);
    let r = c.post("/v1/chat/completions", &body, &[]);
    assert_eq!(r.status, 200);
    let expected_raw: String = sse_pieces()[1..].concat();
    assert_eq!(
        String::from_utf8_lossy(&r.raw_body),
        expected_raw,
        "chunk framing passed through"
    );
    assert_eq!(r.header("x-engine"), Some("scripted"));
    assert_eq!(r.header("x-router-backend"), Some("b0"));
    assert_eq!(r.header("x-router-reason"), Some("no-match"));
    assert_eq!(r.header("x-router-match-blocks"), Some("0"));
    assert!(r.header("keep-alive").is_none(), "hop-by-hop header leaked");
    // The request body went upstream untouched.
    let seen = up.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].body, body.as_bytes());
}
both_drivers!(streaming_passthrough_is_byte_exact);

fn non_streaming_passthrough_and_headers(io: &str) {
    let payload = r#"{"id":"x","choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":3,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":0}}}"#;
    let up = json_upstream(payload);
    let gw = start_gateway(io, 1, "", &[("b0", up.url(), "sim")]);
    let mut c = Client::connect(gw.local_addr());
    let body = chat_body("hello", false);
    let r = c.post(
        "/v1/chat/completions?api-version=1",
        &body,
        &[
            ("Connection", "keep-alive, X-Hop"),
            ("X-Hop", "secret"),
            ("TE", "trailers"),
            ("X-Request-Id", "req-123"),
            ("X-Custom", "kept"),
        ],
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.body, payload.as_bytes());
    assert_eq!(r.header("x-request-id"), Some("req-123"));
    let seen = &up.seen()[0];
    let head = seen.head.to_ascii_lowercase();
    assert!(
        head.starts_with("post /v1/chat/completions?api-version=1 http/1.1\r\n"),
        "{head}"
    );
    assert!(head.contains("x-request-id: req-123\r\n"), "{head}");
    assert!(head.contains("x-custom: kept\r\n"), "{head}");
    for leaked in ["x-hop", "te:", "connection:", "keep-alive"] {
        assert!(!head.contains(leaked), "{leaked} leaked upstream: {head}");
    }
    assert_eq!(seen.body, body.as_bytes());
}
both_drivers!(non_streaming_passthrough_and_headers);

fn generates_request_id_when_absent(io: &str) {
    let up = json_upstream("{}");
    let gw = start_gateway(io, 1, "", &[("b0", up.url(), "sim")]);
    let mut c = Client::connect(gw.local_addr());
    let r = c.post("/v1/chat/completions", &chat_body("x", false), &[]);
    let id = r.header("x-request-id").expect("id").to_string();
    assert_eq!(id.len(), 32);
    assert!(up.seen()[0]
        .head
        .contains(&format!("X-Request-Id: {id}\r\n")));
}
both_drivers!(generates_request_id_when_absent);

fn keep_alive_reused_on_both_sides(io: &str) {
    let up = json_upstream("{\"ok\":true}");
    let gw = start_gateway(io, 1, "", &[("b0", up.url(), "sim")]);
    let mut c = Client::connect(gw.local_addr());
    for i in 0..5 {
        let r = c.post("/v1/completions", r#"{"model":"sim","prompt":"p"}"#, &[]);
        assert_eq!(r.status, 200, "request {i}");
        assert!(r.header("connection").is_none());
    }
    assert_eq!(up.seen().len(), 5);
    assert_eq!(
        up.connections.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "one pooled upstream connection"
    );
}
both_drivers!(keep_alive_reused_on_both_sides);

fn chunked_request_body_is_dechunked_upstream(io: &str) {
    let up = json_upstream("{}");
    let gw = start_gateway(io, 1, "", &[("b0", up.url(), "sim")]);
    let mut c = Client::connect(gw.local_addr());
    let body = chat_body("chunky", false);
    let (a, b) = body.split_at(10);
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{a}\r\n{:x};ext=1\r\n{b}\r\n0\r\n\r\n",
        a.len(),
        b.len()
    );
    c.send(req.as_bytes());
    let r = c.read_response();
    assert_eq!(r.status, 200);
    let seen = &up.seen()[0];
    assert_eq!(seen.body, body.as_bytes());
    assert!(seen
        .head
        .contains(&format!("Content-Length: {}\r\n", body.len())));
    assert!(!seen.head.to_ascii_lowercase().contains("transfer-encoding"));
}
both_drivers!(chunked_request_body_is_dechunked_upstream);

fn pipelined_requests_answered_in_order(io: &str) {
    let engine = start_engine(io, radixgate::engine_sim::EngineConfig::instant("sim"));
    let gw = start_gateway(io, 1, "", &[("e0", engine.url(), "sim")]);
    let mut c = Client::connect(gw.local_addr());
    let mut all = Vec::new();
    for i in 0..3 {
        all.extend(post_bytes(
            "/v1/chat/completions",
            &chat_body(&format!("q{i}"), i == 1),
            &[("X-Request-Id", &format!("p{i}"))],
        ));
    }
    all.extend(b"GET /health HTTP/1.1\r\nHost: t\r\nX-Request-Id: p3\r\n\r\n");
    c.send(&all);
    for i in 0..4 {
        let r = c.read_response();
        assert_eq!(r.status, 200);
        assert_eq!(
            r.header("x-request-id"),
            Some(format!("p{i}").as_str()),
            "response {i} out of order"
        );
    }
}
both_drivers!(pipelined_requests_answered_in_order);

fn expect_continue(io: &str) {
    let up = json_upstream("{}");
    let gw = start_gateway(io, 1, "", &[("b0", up.url(), "sim")]);
    let mut c = Client::connect(gw.local_addr());
    let body = chat_body("x", false);
    c.send(format!("POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: {}\r\n\r\n", body.len()).as_bytes());
    let (status, _) = c.read_head();
    assert_eq!(status, 100);
    c.send(body.as_bytes());
    let r = c.read_response();
    assert_eq!(r.status, 200);
    assert!(!up.seen()[0].head.to_ascii_lowercase().contains("expect"));
}
both_drivers!(expect_continue);

fn http10_client_gets_close(io: &str) {
    let up = json_upstream("{}");
    let gw = start_gateway(io, 1, "", &[("b0", up.url(), "sim")]);
    let mut c = Client::connect(gw.local_addr());
    let body = chat_body("x", false);
    c.send(
        format!(
            "POST /v1/chat/completions HTTP/1.0\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    );
    let r = c.read_response();
    assert_eq!(r.status, 200);
    assert_eq!(r.header("connection"), Some("close"));
    assert!(c.is_closed());
}
both_drivers!(http10_client_gets_close);

fn local_endpoints(io: &str) {
    let engine = start_engine(io, radixgate::engine_sim::EngineConfig::instant("sim"));
    let other = start_engine(io, radixgate::engine_sim::EngineConfig::instant("other"));
    let gw = start_gateway(
        io,
        2,
        "",
        &[("e0", engine.url(), "sim"), ("e1", other.url(), "other")],
    );
    let mut c = Client::connect(gw.local_addr());
    assert_eq!(c.get("/health").status, 200);
    assert_eq!(c.get("/ready").status, 200);
    let models = c.get("/v1/models").json();
    assert_eq!(models["object"], "list");
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["sim", "other"]);
    // The request's model picks the candidate set.
    let r = c.post(
        "/v1/completions",
        r#"{"model":"other","prompt":"x","max_tokens":1}"#,
        &[],
    );
    assert_eq!(r.header("x-router-backend"), Some("e1"));
    let r = c.post(
        "/v1/completions",
        r#"{"model":"sim","prompt":"x","max_tokens":1}"#,
        &[],
    );
    assert_eq!(r.header("x-router-backend"), Some("e0"));
    let m = c.get("/metrics");
    assert_eq!(m.status, 200);
    let text = m.text();
    assert_eq!(
        metric(
            &text,
            "radixgate_requests_total{backend=\"e1\",status=\"200\""
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        metric(&text, "radixgate_ttft_seconds_count{model=\"other\"}"),
        Some(1.0),
        "{text}"
    );
    assert!(text.contains("radixgate_backend_in_flight{backend=\"e0\"} 0"));
    assert_eq!(
        metric(&text, "radixgate_completion_tokens_total"),
        Some(2.0),
        "usage observed: {text}"
    );
}
both_drivers!(local_endpoints);

fn large_bodies_stream_through(io: &str) {
    // A 1 MiB response; a 200 KiB and a 600 KiB request (each sent with its head in one
    // vectored write, from the buffer it was read into).
    let payload = format!("{{\"text\":\"{}\"}}", "y".repeat(1 << 20));
    let up = json_upstream(&payload);
    let gw = start_gateway(io, 1, "", &[("b0", up.url(), "sim")]);
    let mut c = Client::connect(gw.local_addr());
    for (i, size) in [200usize << 10, 600 << 10].into_iter().enumerate() {
        let big: String = (0..size).map(|j| (b'a' + (j % 26) as u8) as char).collect();
        let body = chat_body(&big, false);
        let r = c.post("/v1/chat/completions", &body, &[]);
        assert_eq!(r.status, 200);
        assert_eq!(r.body.len(), payload.len());
        assert!(
            up.seen()[i].body == body.as_bytes(),
            "body {i} changed on the way"
        );
    }
}
both_drivers!(large_bodies_stream_through);

/// Long bodies back to back in one write, then a small request: each body is read up
/// to its declared length and no further, so the next request starts where it should.
fn pipelined_long_bodies(io: &str) {
    let up = json_upstream("{}");
    let gw = start_gateway(io, 1, "", &[("b0", up.url(), "sim")]);
    let mut c = Client::connect(gw.local_addr());
    let bodies: Vec<String> = (0..2)
        .map(|i| {
            let text: String = (0..(150usize << 10) + i * 777)
                .map(|j| (b'a' + ((j + i) % 26) as u8) as char)
                .collect();
            chat_body(&text, false)
        })
        .collect();
    let mut all = Vec::new();
    for (i, body) in bodies.iter().enumerate() {
        all.extend(post_bytes(
            "/v1/chat/completions",
            body,
            &[("X-Request-Id", &format!("long{i}"))],
        ));
    }
    all.extend(b"GET /health HTTP/1.1\r\nHost: t\r\nX-Request-Id: long2\r\n\r\n");
    c.send(&all);
    for i in 0..3 {
        let r = c.read_response();
        assert_eq!(r.status, 200, "response {i}");
        assert_eq!(r.header("x-request-id"), Some(format!("long{i}").as_str()));
    }
    let seen = up.seen();
    assert_eq!(seen.len(), 2);
    for (s, body) in seen.iter().zip(&bodies) {
        assert!(
            s.body == body.as_bytes(),
            "a pipelined body changed on the way"
        );
    }
}
both_drivers!(pipelined_long_bodies);

/// A long body survives a failed attempt: it is sent from the buffer it was read into,
/// and the backend tried next receives it byte for byte, as did the one that failed.
fn long_body_survives_a_retry(io: &str) {
    let bad = ScriptedUpstream::start(Script::Reply(vec![
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n".to_vec(),
    ]));
    let good = json_upstream("{}");
    let gw = start_gateway(
        io,
        1,
        "[routing]\npolicy = \"round_robin\"\n[breaker]\nfailure_threshold = 1000000\n[health]\ninterval_ms = 60000",
        &[("bad", bad.url(), "sim"), ("good", good.url(), "sim")],
    );
    let mut c = Client::connect(gw.local_addr());
    let bodies: Vec<String> = (0..4)
        .map(|i| {
            let text: String = (0..(150usize << 10) + i * 333)
                .map(|j| (b'a' + ((j + i) % 26) as u8) as char)
                .collect();
            chat_body(&text, false)
        })
        .collect();
    for (i, body) in bodies.iter().enumerate() {
        let r = c.post("/v1/chat/completions", body, &[]);
        assert_eq!(r.status, 200, "request {i}: {}", r.text());
        assert_eq!(r.header("x-router-backend"), Some("good"));
    }
    let seen = good.seen();
    assert_eq!(seen.len(), bodies.len());
    for (s, body) in seen.iter().zip(&bodies) {
        assert!(s.body == body.as_bytes(), "a body changed on the way");
    }
    let failed = bad.seen();
    assert!(
        !failed.is_empty(),
        "round robin never tried the failing backend"
    );
    for s in &failed {
        assert!(
            bodies.iter().any(|b| s.body == b.as_bytes()),
            "the failed attempt got a different body"
        );
    }
}
both_drivers!(long_body_survives_a_retry);
