//! Streaming lifecycles against simulated engines: disconnects, aborted upstream
//! streams, concurrent traffic beside bad clients, and the routing policies seen
//! from outside. Both I/O drivers.

mod common;

use common::*;
use radixgate::engine_sim::EngineConfig;
use std::io::{BufRead, BufReader};
use std::time::Duration;

fn slow_engine(io: &str) -> radixgate::engine_sim::EngineHandle {
    let mut cfg = EngineConfig::instant("sim");
    cfg.decode_per_token = Duration::from_millis(20);
    start_engine(io, cfg)
}

fn stream_body(tokens: u32) -> String {
    format!(
        r#"{{"model":"sim","stream":true,"max_tokens":{tokens},"messages":[{{"role":"user","content":"tell me a long story"}}]}}"#
    )
}

fn client_disconnect_mid_stream_releases_everything(io: &str) {
    let engine = slow_engine(io);
    let gw = start_gateway(io, 1, "", &[("e0", engine.url(), "sim")]);
    let addr = gw.local_addr();
    let mut c = Client::connect(addr);
    c.send(&post_bytes("/v1/chat/completions", &stream_body(200), &[]));
    let (status, _) = c.read_head();
    assert_eq!(status, 200);
    // Read the first event, then vanish.
    let mut reader = BufReader::new(c.stream().try_clone().unwrap());
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    drop(reader);
    drop(c);

    let engine_addr = engine.addr();
    assert!(
        eventually(Duration::from_secs(5), || {
            let gw_metrics = Client::connect(addr).get("/metrics").text();
            let en_metrics = Client::connect(engine_addr).get("/metrics").text();
            metric(&gw_metrics, "radixgate_backend_in_flight{backend=\"e0\"}") == Some(0.0)
                && metric(&en_metrics, "vllm:num_requests_running") == Some(0.0)
        }),
        "in-flight or engine slot not released after the client left"
    );
    // Counted as the client's abort (499), not as a success.
    let m = Client::connect(addr).get("/metrics").text();
    assert_eq!(
        metric(&m, "radixgate_requests_total{backend=\"e0\",status=\"499\""),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        metric(&m, "radixgate_requests_total{backend=\"e0\",status=\"200\""),
        None,
        "{m}"
    );
    // The gateway still serves new streams.
    let r = Client::connect(addr).post("/v1/chat/completions", &stream_body(2), &[]);
    assert_eq!(r.status, 200);
    assert!(r.text().ends_with("data: [DONE]\n\n"));
}
both_drivers!(client_disconnect_mid_stream_releases_everything);

/// Issue 22: five non-streaming requests to a slow engine (1,000 tokens at 20 ms
/// each: 20 s of work) whose clients close 0.5 s after sending. The gateway watches
/// each client while it waits for the answer: the upstream requests are aborted
/// (their connections closed, and the engine, like vLLM, drops a request whose
/// connection closed), so the engine's running count is 0 within a second; the
/// in-flight and pending-prefill accounting is released; the requests count as 499;
/// and the breaker, here opened by a single failure, stays closed.
fn departed_non_streaming_clients_stop_the_engine(io: &str) {
    let engine = slow_engine(io);
    let gw = start_gateway(
        io,
        1,
        "[breaker]\nfailure_threshold = 1\nopen_ms = 60000",
        &[("e0", engine.url(), "sim")],
    );
    let addr = gw.local_addr();
    let engine_addr = engine.addr();
    let running = || {
        let m = Client::connect(engine_addr).get("/metrics").text();
        metric(&m, "vllm:num_requests_running")
    };
    let body = r#"{"model":"sim","stream":false,"max_tokens":1000,"messages":[{"role":"user","content":"write a long essay"}]}"#;
    let clients: Vec<Client> = (0..5)
        .map(|_| {
            let mut c = Client::connect(addr);
            c.send(&post_bytes("/v1/chat/completions", body, &[]));
            c
        })
        .collect();
    assert!(
        eventually(Duration::from_secs(5), || running() == Some(5.0)),
        "the five requests never all ran on the engine"
    );
    pause(Duration::from_millis(500));
    drop(clients);
    let left = std::time::Instant::now();
    assert!(
        eventually(Duration::from_secs(1), || running() == Some(0.0)),
        "the engine still runs {:?} requests 1 s after their clients left",
        running()
    );
    assert!(left.elapsed() < Duration::from_secs(1));
    let released = eventually(Duration::from_secs(1), || {
        let m = Client::connect(addr).get("/metrics").text();
        metric(&m, "radixgate_backend_in_flight{backend=\"e0\"}") == Some(0.0)
            && metric(
                &m,
                "radixgate_backend_pending_prefill_tokens{backend=\"e0\"}",
            ) == Some(0.0)
            && metric(&m, "radixgate_requests_total{backend=\"e0\",status=\"499\"") == Some(5.0)
    });
    let m = Client::connect(addr).get("/metrics").text();
    assert!(
        released,
        "accounting not released or 499s not counted:\n{m}"
    );
    assert_eq!(
        metric(&m, "radixgate_breaker_state{backend=\"e0\"}"),
        Some(0.0),
        "{m}"
    );
    // The backend still takes requests.
    let r = Client::connect(addr).post("/v1/chat/completions", &stream_body(2), &[]);
    assert_eq!(r.status, 200, "{}", r.text());
}
both_drivers!(departed_non_streaming_clients_stop_the_engine);

fn upstream_abort_mid_stream_ends_with_sse_error(io: &str) {
    let mut cfg = EngineConfig::instant("sim");
    cfg.abort_rate = 1.0;
    let engine = start_engine(io, cfg);
    let gw = start_gateway(io, 1, "", &[("e0", engine.url(), "sim")]);
    let mut c = Client::connect(gw.local_addr());
    let r = c.post("/v1/chat/completions", &stream_body(10), &[]);
    assert_eq!(r.status, 200);
    // The engine cut the stream after 5 of 10 tokens, between two events: the client
    // gets the tokens it was sent, once each, then an error event, and a properly
    // ended body.
    let text = r.text();
    assert_eq!(text.matches("\"delta\":{\"content\"").count(), 5, "{text}");
    assert!(!text.contains("[DONE]"), "{text}");
    let last = text.trim_end().rsplit("\n\n").next().unwrap();
    assert!(last.starts_with("data: {\"error\":"), "{last}");
    assert!(last.contains("\"code\":\"upstream_error\""), "{last}");
    // The connection is still well framed and usable.
    assert_eq!(c.get("/health").status, 200);
    let m = c.get("/metrics").text();
    assert_eq!(
        metric(&m, "radixgate_requests_total{backend=\"e0\",status=\"200\""),
        Some(1.0)
    );
}
both_drivers!(upstream_abort_mid_stream_ends_with_sse_error);

fn bad_clients_do_not_disturb_a_stream(io: &str) {
    let engine = slow_engine(io);
    let gw = start_gateway(io, 1, "", &[("e0", engine.url(), "sim")]);
    let addr = gw.local_addr();
    let mut good = Client::connect(addr);
    good.send(&post_bytes("/v1/chat/completions", &stream_body(15), &[]));
    // Meanwhile, on the same shard: garbage, a truncated body, a half-open head.
    let mut g1 = Client::connect(addr);
    g1.send(b"\x00\x01\x02garbage\r\n\r\n");
    assert_eq!(g1.read_response().status, 400);
    let mut g2 = Client::connect(addr);
    g2.send(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 50\r\n\r\n{\"mod");
    drop(g2);
    let mut g3 = Client::connect(addr);
    g3.send(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Le");
    let r = good.read_response();
    assert_eq!(r.status, 200);
    let text = r.text();
    assert_eq!(text.matches("\"delta\":{\"content\"").count(), 15, "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"));
    drop(g3);
}
both_drivers!(bad_clients_do_not_disturb_a_stream);

fn round_robin_spreads_and_consistent_hash_sticks(io: &str) {
    let (_engines, gw) = instant_fleet(
        io,
        3,
        1,
        "[routing]\npolicy = \"round_robin\"\nallow_policy_header = true",
    );
    let mut c = Client::connect(gw.local_addr());
    let mut seen = std::collections::HashSet::new();
    for i in 0..6 {
        let r = c.post(
            "/v1/chat/completions",
            &chat_body(&format!("q{i}"), false),
            &[],
        );
        seen.insert(r.header("x-router-backend").unwrap().to_string());
    }
    assert_eq!(seen.len(), 3, "round robin used every backend");

    // Same long prefix, different questions: one backend.
    let doc = "d".repeat(300);
    let mut homes = std::collections::HashSet::new();
    for q in 0..6 {
        let body = format!(
            r#"{{"model":"sim","messages":[{{"role":"system","content":"{doc}"}},{{"role":"user","content":"question {q}"}}]}}"#
        );
        let r = c.post(
            "/v1/chat/completions",
            &body,
            &[("X-Router-Policy", "consistent_hash")],
        );
        assert_eq!(r.header("x-router-reason"), Some("hash-ring"));
        homes.insert(r.header("x-router-backend").unwrap().to_string());
    }
    assert_eq!(homes.len(), 1, "one prefix, one home: {homes:?}");
    // The engine saw the shared prefix as cached after the first request.
    let r = c.post(
        "/v1/chat/completions",
        &format!(r#"{{"model":"sim","messages":[{{"role":"system","content":"{doc}"}},{{"role":"user","content":"again"}}]}}"#),
        &[("X-Router-Policy", "consistent_hash")],
    );
    assert!(
        r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );
}
both_drivers!(round_robin_spreads_and_consistent_hash_sticks);

fn least_loaded_avoids_the_busy_backend(io: &str) {
    // Both slow, so the long stream keeps its backend busy wherever it lands.
    let busy = slow_engine(io);
    let idle = slow_engine(io);
    let gw = start_gateway(
        io,
        2,
        "[routing]\npolicy = \"least_loaded\"",
        &[("busy", busy.url(), "sim"), ("idle", idle.url(), "sim")],
    );
    let addr = gw.local_addr();
    // Pin a long stream to whichever backend least_loaded picks first...
    let mut long = Client::connect(addr);
    long.send(&post_bytes("/v1/chat/completions", &stream_body(100), &[]));
    let (_, headers) = long.read_head();
    let first = headers
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case("x-router-backend"))
        .unwrap()
        .1
        .clone();
    // ...then every short request, on any shard, goes to the other one.
    let other = if first == "busy" { "idle" } else { "busy" };
    for _ in 0..6 {
        // The previous short request's slot is released just after its response went
        // out; wait for that, so only the long stream counts.
        let settled = eventually(Duration::from_secs(5), || {
            let m = Client::connect(addr).get("/metrics").text();
            metric(
                &m,
                &format!("radixgate_backend_in_flight{{backend=\"{other}\"}}"),
            ) == Some(0.0)
        });
        assert!(settled);
        let r = Client::connect(addr).post("/v1/chat/completions", &chat_body("short", false), &[]);
        assert_ne!(
            r.header("x-router-backend").unwrap(),
            first,
            "in-flight is counted across shards"
        );
        assert_eq!(r.header("x-router-reason"), Some("least-loaded"));
    }
}
both_drivers!(least_loaded_avoids_the_busy_backend);

fn graceful_shutdown_finishes_streams_in_flight(io: &str) {
    let engine = slow_engine(io);
    let gw = start_gateway(
        io,
        2,
        "shutdown_timeout_ms = 10000",
        &[("e0", engine.url(), "sim")],
    );
    let addr = gw.local_addr();
    let mut c = Client::connect(addr);
    c.send(&post_bytes("/v1/chat/completions", &stream_body(40), &[]));
    // Wait for the stream to start (its shard has it in flight to the engine), then
    // stop the gateway while it runs. (A request still in the listen backlog when the
    // listeners close is the kernel's to refuse, not a stream in flight.)
    let started = eventually(Duration::from_secs(5), || {
        let m = Client::connect(addr).get("/metrics").text();
        metric(&m, "radixgate_backend_in_flight{backend=\"e0\"}") == Some(1.0)
    });
    assert!(started, "the stream never started");
    let mut idle = Client::connect(addr);
    assert_eq!(idle.get("/health").status, 200);
    let stopper = std::thread::spawn(move || gw.shutdown());
    let r = c.read_response();
    assert_eq!(r.status, 200);
    let text = r.text();
    assert_eq!(text.matches("\"delta\":{\"content\"").count(), 40);
    assert!(
        text.ends_with("data: [DONE]\n\n"),
        "the stream in flight finished"
    );
    stopper.join().unwrap();
    // Stopped: no listener, and the idle keep-alive connection was closed.
    assert!(std::net::TcpStream::connect(addr).is_err());
    assert!(idle.is_closed());
}
both_drivers!(graceful_shutdown_finishes_streams_in_flight);
