//! Hostile input over raw TCP, on both drivers: oversized heads, too many headers,
//! long URIs, slowloris heads and bodies, idle keep-alive, the per-shard connection
//! cap, request smuggling, bad chunking and hostile JSON. Every case checks the
//! answer (OpenAI's error shape), whether the connection is closed, and that the
//! shard keeps serving other requests afterwards. Bounded: one shard, small limits,
//! sub-second timeouts.

mod common;

use common::*;
use std::io::Write;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

const LIMITS: &str = "max_head_bytes = 2048\nmax_uri_bytes = 512\nmax_body_bytes = 4096\nclient_idle_timeout_ms = 400\nhead_timeout_ms = 300\nbody_timeout_ms = 300\nmax_connections = 4\n";

fn gateway(io: &str) -> (Vec<radixgate::engine_sim::EngineHandle>, radixgate::Gateway) {
    instant_fleet(io, 1, 1, LIMITS)
}

/// A fresh connection is served normally.
fn still_serves(addr: SocketAddr) {
    let r = Client::connect(addr).post("/v1/chat/completions", &chat_body("ok", false), &[]);
    assert_eq!(r.status, 200, "{}", r.text());
}

/// Sends `bytes` on a fresh connection; returns the answer and whether the gateway
/// closed the connection after it.
fn send_raw(addr: SocketAddr, bytes: &[u8]) -> (Response, bool) {
    let mut c = Client::connect(addr);
    c.send(bytes);
    let r = c.read_response();
    let closed = c.is_closed();
    (r, closed)
}

fn expect_error(addr: SocketAddr, bytes: &[u8], status: u16, code: &str) {
    let (r, closed) = send_raw(addr, bytes);
    assert_eq!(r.status, status, "{}", r.text());
    assert_eq!(r.error_param_code().1, code, "{}", r.text());
    assert!(closed, "connection left open after {code}");
}

fn head_limits(io: &str) {
    let (_e, gw) = gateway(io);
    let addr = gw.local_addr();
    let big = format!(
        "GET /health HTTP/1.1\r\nHost: t\r\nX-Big: {}\r\n\r\n",
        "a".repeat(4000)
    );
    expect_error(addr, big.as_bytes(), 431, "headers_too_large");
    let mut many = String::from("GET /health HTTP/1.1\r\nHost: t\r\n");
    for i in 0..100 {
        many.push_str(&format!("X-{i}: v\r\n"));
    }
    many.push_str("\r\n");
    expect_error(addr, many.as_bytes(), 431, "headers_too_large");
    let long_uri = format!(
        "GET /health?{} HTTP/1.1\r\nHost: t\r\n\r\n",
        "q".repeat(600)
    );
    expect_error(addr, long_uri.as_bytes(), 414, "uri_too_long");
    expect_error(
        addr,
        b"\x16\x03\x01\x02\x00\x01\x00\r\n\r\n",
        400,
        "bad_request",
    );
    still_serves(addr);
}
both_drivers!(head_limits);

fn slowloris_head_and_body(io: &str) {
    let (_e, gw) = gateway(io);
    let addr = gw.local_addr();
    // A head trickled a byte at a time, each well within the idle timeout: cut off
    // by the head deadline.
    let mut c = Client::connect(addr);
    let started = Instant::now();
    let head = b"GET /health HTTP/1.1\r\nHost: t\r\nX-Slow: ";
    c.send(head);
    // Trickle until the gateway answers (it must, within ~300 ms) or 1.5 s pass.
    let mut answered = false;
    while started.elapsed() < Duration::from_millis(1500) {
        pause(Duration::from_millis(60));
        c.stream().set_nonblocking(true).unwrap();
        let mut byte = [0u8; 1];
        answered = matches!(c.stream().peek(&mut byte), Ok(n) if n > 0);
        c.stream().set_nonblocking(false).unwrap();
        if answered || c.stream().write_all(b"a").is_err() {
            break;
        }
    }
    assert!(answered, "no answer to a trickled head");
    assert!(started.elapsed() < Duration::from_millis(1000));
    let r = c.read_response();
    assert_eq!(r.status, 408);
    assert_eq!(r.error_param_code().1, "request_timeout");
    assert!(c.is_closed());
    // Meanwhile (and after) other clients are served.
    still_serves(addr);
    // A body that stalls.
    let mut c = Client::connect(addr);
    c.send(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{\"model\"",
    );
    let r = c.read_response();
    assert_eq!(r.status, 408);
    assert!(c.is_closed());
    // A chunked body that stalls between chunks.
    let mut c = Client::connect(addr);
    c.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n");
    let r = c.read_response();
    assert_eq!(r.status, 408);
    still_serves(addr);
}
both_drivers!(slowloris_head_and_body);

/// The body clock runs for the whole body, however its bytes are spread: a body
/// trickled a byte at a time, each read well within the timeout, is cut off by the
/// deadline set when the gateway first had to wait for it, for a plain and a chunked
/// body, and for one whose client waited for `100 Continue`.
fn trickled_body(io: &str) {
    let (_e, gw) = gateway(io);
    let addr = gw.local_addr();
    let heads: [&[u8]; 3] = [
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n64\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\nExpect: 100-continue\r\n\r\n",
    ];
    for head in heads {
        let mut c = Client::connect(addr);
        let started = Instant::now();
        c.send(head);
        if head.ends_with(b"100-continue\r\n\r\n") {
            assert_eq!(c.read_head().0, 100);
        }
        let mut cut_off = false;
        while started.elapsed() < Duration::from_millis(1500) {
            pause(Duration::from_millis(50));
            if c.stream().write_all(b" ").is_err() {
                cut_off = true;
                break;
            }
            c.stream().set_nonblocking(true).unwrap();
            let mut byte = [0u8; 1];
            cut_off = matches!(c.stream().peek(&mut byte), Ok(n) if n > 0);
            c.stream().set_nonblocking(false).unwrap();
            if cut_off {
                break;
            }
        }
        assert!(cut_off, "a trickled body was never cut off");
        assert!(started.elapsed() < Duration::from_millis(1000));
        let r = c.read_response();
        assert_eq!(r.status, 408, "{}", r.text());
        assert_eq!(r.error_param_code().1, "request_timeout");
        assert!(c.is_closed());
    }
    still_serves(addr);
}
both_drivers!(trickled_body);

fn idle_keep_alive_is_closed(io: &str) {
    let (_e, gw) = gateway(io);
    let addr = gw.local_addr();
    let mut c = Client::connect(addr);
    assert_eq!(c.get("/health").status, 200);
    closed_at_the_idle_timeout(&mut c);
    still_serves(addr);
}
both_drivers!(idle_keep_alive_is_closed);

/// `c`, just answered, is closed by the gateway at the idle timeout (400 ms).
fn closed_at_the_idle_timeout(c: &mut Client) {
    let idle = Instant::now();
    assert!(c.is_closed(), "idle connection not closed");
    let waited = idle.elapsed();
    assert!(
        waited >= Duration::from_millis(300) && waited < Duration::from_secs(5),
        "{waited:?}"
    );
}

fn connection_cap_per_shard(io: &str) {
    let (_e, gw) = gateway(io);
    let addr = gw.local_addr();
    // Four open (idle) connections fill the shard's cap of 4.
    let mut held: Vec<Client> = (0..4)
        .map(|_| {
            let mut c = Client::connect(addr);
            assert_eq!(c.get("/health").status, 200);
            c
        })
        .collect();
    let (r, closed) = send_raw(addr, b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n");
    assert_eq!(r.status, 503);
    assert_eq!(r.error_param_code().1, "overloaded");
    assert_eq!(r.header("retry-after"), Some("1"));
    assert!(closed);
    // The held connections still work; one closing frees a place.
    assert_eq!(held[0].get("/health").status, 200);
    drop(held.pop());
    assert!(eventually(Duration::from_secs(2), || {
        let mut c = Client::connect(addr);
        c.send(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n");
        c.read_response().status == 200
    }));
}
both_drivers!(connection_cap_per_shard);

fn request_smuggling_and_bad_chunks(io: &str) {
    let (_e, gw) = gateway(io);
    let addr = gw.local_addr();
    let body = chat_body("s", false);
    let cases = [
        format!("POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", body.len()),
        format!("POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: {0}\r\nContent-Length: {0}\r\n\r\n{body}", body.len()),
        format!("POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\nContent-Length: 5\r\n\r\n{body}", body.len()),
        "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n".to_string(),
        "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n".to_string(),
        "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: -1\r\n\r\n".to_string(),
        "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n".to_string(),
        "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nfffffffffffffffffff\r\n".to_string(),
        "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}XX0\r\n\r\n".to_string(),
    ];
    for case in &cases {
        expect_error(addr, case.as_bytes(), 400, "bad_request");
    }
    // A chunked body whose framing overhead runs far past its payload limit.
    let mut c = Client::connect(addr);
    c.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n");
    let ext = format!("1;{}\r\nx\r\n", "e".repeat(1000));
    for _ in 0..200 {
        if c.stream().write_all(ext.as_bytes()).is_err() {
            break;
        }
    }
    assert_eq!(c.read_response().status, 413);
    // Oversized declared body.
    expect_error(
        addr,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 999999\r\n\r\n",
        413,
        "request_too_large",
    );
    still_serves(addr);
}
both_drivers!(request_smuggling_and_bad_chunks);

fn hostile_json(io: &str) {
    let (_e, gw) = gateway(io);
    let addr = gw.local_addr();
    let deep = format!(
        r#"{{"model":"sim","messages":[{{"role":"user","content":"x","x":{}{}}}]}}"#,
        "[".repeat(1500),
        "]".repeat(1500)
    );
    let bodies: Vec<(Vec<u8>, &str)> = vec![
        (
            b"{\"model\":\"sim\",\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\"}]}"
                .to_vec(),
            "invalid_json",
        ),
        (deep.into_bytes(), "invalid_json"),
        ("[".repeat(4000).into_bytes(), "invalid_json"),
        (
            br#"{"model":"sim","max_tokens":1e999,"messages":[{"role":"user","content":"x"}]}"#
                .to_vec(),
            "invalid_json",
        ),
        (
            format!(
                r#"{{"model":"sim","max_tokens":{},"messages":[{{"role":"user","content":"x"}}]}}"#,
                "9".repeat(300)
            )
            .into_bytes(),
            "invalid_value",
        ),
        (
            br#"{"model":"sim","max_tokens":-3,"messages":[{"role":"user","content":"x"}]}"#
                .to_vec(),
            "invalid_value",
        ),
        (br#"{"model":7,"messages":[]}"#.to_vec(), "invalid_value"),
        (
            br#"{"model":"sim","messages":{"role":"user"}}"#.to_vec(),
            "invalid_value",
        ),
        (
            br#"{"model":"sim","stream":"yes","messages":[{"role":"user","content":"x"}]}"#
                .to_vec(),
            "invalid_value",
        ),
        (
            br#"{"model":"sim","messages":[{"role":"user","content":"x"}]"#.to_vec(),
            "invalid_json",
        ),
        (b"null".to_vec(), "invalid_json"),
    ];
    // One keep-alive connection: each bad body is answered and the next request on
    // the same connection is still read correctly.
    let mut c = Client::connect(addr);
    for (body, code) in &bodies {
        let mut req = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n",
            body.len()
        )
        .into_bytes();
        req.extend_from_slice(body);
        c.send(&req);
        let r = c.read_response();
        assert_eq!(r.status, 400, "{}", r.text());
        assert_eq!(r.error_param_code().1, *code, "{}", r.text());
    }
    let r = c.post("/v1/chat/completions", &chat_body("after", false), &[]);
    assert_eq!(r.status, 200);
    still_serves(addr);
}
both_drivers!(hostile_json);

/// A key twice in one object is refused, whatever the object and however the key is
/// spelled (compared after unescaping): the gateway would read the first occurrence
/// and the engine (Python's `json`) the last, so routing, quotas and `stream` could
/// be sidestepped. 400 `invalid_json` naming the key's path; the connection stays
/// usable, as for any JSON error; the same key in two different objects is fine.
fn duplicate_json_keys(io: &str) {
    let (_e, gw) = gateway(io);
    let addr = gw.local_addr();
    let user = r#"{"role":"user","content":"x"}"#;
    let cases = [
        (
            format!(r#"{{"model":"nope","model":"sim","messages":[{user}]}}"#),
            "model",
        ),
        (
            format!(r#"{{"model":"nope","mod\u0065l":"sim","messages":[{user}]}}"#),
            "model",
        ),
        (
            format!(r#"{{"model":"sim","max_tokens":1,"max_tokens":3000,"messages":[{user}]}}"#),
            "max_tokens",
        ),
        (
            format!(
                r#"{{"model":"sim","messages":[{user},{{"role":"user","content":"a","con\u0074ent":"b"}}]}}"#
            ),
            "messages[1].content",
        ),
        (
            format!(
                r#"{{"model":"sim","stream":false,"stream_options":{{"include_usage":true,"include_usage":false}},"messages":[{user}]}}"#
            ),
            "stream_options.include_usage",
        ),
    ];
    let mut c = Client::connect(addr);
    for (body, param) in &cases {
        let r = c.post("/v1/chat/completions", body, &[]);
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        assert_eq!(
            r.error_param_code(),
            (Some(param.to_string()), "invalid_json".to_string()),
            "{body}: {}",
            r.text()
        );
        let key = param.rsplit('.').next().unwrap();
        let message = r.json()["error"]["message"].as_str().unwrap().to_string();
        assert!(message.contains(&format!("`{key}`")), "{message}");
    }
    // The same key in different objects (and as a value) is not a duplicate.
    let fine = r#"{"model":"sim","max_tokens":4,"messages":[{"role":"system","content":"model"},{"role":"user","content":"x"}],"stream_options":{"model":"x"}}"#;
    let r = c.post("/v1/chat/completions", fine, &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    still_serves(addr);
}
both_drivers!(duplicate_json_keys);

/// Chunk-size lines, extensions and trailers may add at most 64 KiB to a chunked
/// body's payload, whatever `max_body_bytes` allows (issue 22 found a 70,000-byte
/// extension and 3,000 trailers accepted): exactly 64 KiB of framing is served, one
/// byte more is 413 and the connection closed; for a chunk extension and for
/// trailers.
fn chunked_framing_overhead_limit(io: &str) {
    let (_e, gw) = gateway(io);
    let addr = gw.local_addr();
    const LIMIT: usize = 64 << 10;
    let payload = chat_body("x", false);
    let head =
        "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n";
    let chunk = format!("{:x}\r\n{payload}\r\n", payload.len());
    let chunk_overhead = chunk.len() - payload.len();
    // The last chunk's extension carries the rest of `overhead`.
    let with_extension = |overhead: usize| {
        let ext = overhead - chunk_overhead - "0;\r\n\r\n".len();
        format!("{head}{chunk}0;{}\r\n\r\n", "e".repeat(ext))
    };
    // Trailer lines of up to 100 bytes (`X-T: vvv\r\n`) carry the rest.
    let with_trailers = |overhead: usize| {
        let mut left = overhead - chunk_overhead - "0\r\n\r\n".len();
        let mut trailers = String::new();
        while left > 0 {
            let line = if left >= 107 { 100 } else { left };
            trailers.push_str(&format!("X-T: {}\r\n", "v".repeat(line - 7)));
            left -= line;
        }
        format!("{head}{chunk}0\r\n{trailers}\r\n")
    };
    for (what, request) in [
        ("extension", &with_extension as &dyn Fn(usize) -> String),
        ("trailers", &with_trailers),
    ] {
        let at_limit = request(LIMIT);
        assert_eq!(at_limit.len() - head.len() - payload.len(), LIMIT);
        let mut c = Client::connect(addr);
        c.send(at_limit.as_bytes());
        let r = c.read_response();
        assert_eq!(r.status, 200, "{what} at the limit: {}", r.text());
        assert_eq!(
            c.get("/health").status,
            200,
            "{what}: the connection stays usable"
        );
        let over = request(LIMIT + 1);
        let mut c = Client::connect(addr);
        let _ = c.stream().write_all(over.as_bytes());
        let r = c.read_response();
        assert_eq!(r.status, 413, "{what} past the limit: {}", r.text());
        assert_eq!(r.error_param_code().1, "request_too_large");
        assert!(c.is_closed(), "{what} past the limit");
    }
    still_serves(addr);
}
both_drivers!(chunked_framing_overhead_limit);

/// Request targets per RFC 9112 §3.2: absolute-form (`POST http://host/v1/...`),
/// which a server must accept, is served by its path and query (and the upstream
/// gets origin-form); a target that is neither a path nor an absolute URI with an
/// authority is 400 `bad_request` and closed (it was a 404 on an open connection).
fn absolute_form_targets(io: &str) {
    let up = ScriptedUpstream::start(Script::Reply(vec![
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
            .to_vec(),
    ]));
    let gw = start_gateway(io, 1, LIMITS, &[("b0", up.url(), "sim")]);
    let addr = gw.local_addr();
    let body = chat_body("abs", false);
    let mut c = Client::connect(addr);
    for target in [
        "http://gw.example/v1/chat/completions",
        "HTTP://gw.example:8080/v1/chat/completions?x=1",
        "https://user@gw.example/v1/chat/completions",
    ] {
        let r = c.post(target, &body, &[]);
        assert_eq!(r.status, 200, "{target}: {}", r.text());
    }
    assert_eq!(c.get("http://gw.example/health").status, 200);
    let r = c.get("http://gw.example");
    assert_eq!(r.status, 404, "{}", r.text());
    // Still the same, open connection.
    assert_eq!(c.get("/health").status, 200);
    let seen = up.seen.lock().unwrap();
    let lines: Vec<&str> = seen
        .iter()
        .map(|s| s.head.lines().next().unwrap_or_default())
        .collect();
    assert_eq!(
        lines,
        [
            "POST /v1/chat/completions HTTP/1.1",
            "POST /v1/chat/completions?x=1 HTTP/1.1",
            "POST /v1/chat/completions HTTP/1.1",
        ]
    );
    drop(seen);
    for target in [
        "v1/chat/completions",
        "http:///v1/chat/completions",
        "gw.example:80",
        "ftp://h/v1/x",
    ] {
        let req = format!("GET {target} HTTP/1.1\r\nHost: t\r\n\r\n");
        expect_error(addr, req.as_bytes(), 400, "bad_request");
    }
    still_serves(addr);
}
both_drivers!(absolute_form_targets);

/// A keep-alive connection idle past `client_park_after_ms` is parked (its buffers
/// given back) and serves its next request as before, whole or in pieces; the
/// idle timeout still counts from its last request.
fn parked_connections_serve_and_expire(io: &str) {
    let limits = format!("{LIMITS}client_park_after_ms = 30\n");
    let (_e, gw) = instant_fleet(io, 1, 1, &limits);
    let addr = gw.local_addr();
    let mut c = Client::connect(addr);
    assert_eq!(c.get("/health").status, 200);
    pause(Duration::from_millis(120));
    let r = c.post(
        "/v1/chat/completions",
        &chat_body("after a park", false),
        &[],
    );
    assert_eq!(r.status, 200, "{}", r.text());
    pause(Duration::from_millis(120));
    // Woken by the first piece of a request; the rest follows within the head and
    // body timeouts.
    let request = post_bytes("/v1/chat/completions", &chat_body("in pieces", false), &[]);
    let (head, body) = request.split_at(request.len() - 10);
    c.send(&head[..20]);
    pause(Duration::from_millis(60));
    c.send(&head[20..]);
    pause(Duration::from_millis(60));
    c.send(body);
    let r = c.read_response();
    assert_eq!(r.status, 200, "{}", r.text());
    // Parked again, then closed at the idle timeout, not at the park.
    closed_at_the_idle_timeout(&mut c);
    still_serves(addr);
}
both_drivers!(parked_connections_serve_and_expire);

/// After a burst of connections closes, the shard gives its free memory back (and
/// counts it); a burst still open does not trigger it.
fn memory_is_reclaimed_after_a_burst(io: &str) {
    let (_e, gw) = instant_fleet(io, 1, 1, "");
    let addr = gw.local_addr();
    let reclaims = || {
        let m = Client::connect(addr).get("/metrics").text();
        metric(&m, "radixgate_shard_memory_reclaims_total{shard=\"0\"}").unwrap_or(-1.0)
    };
    assert_eq!(reclaims(), 0.0);
    let burst: Vec<Client> = (0..400)
        .map(|_| {
            let mut c = Client::connect(addr);
            assert_eq!(c.get("/health").status, 200);
            c
        })
        .collect();
    // Open, the burst is not reclaimed (a tick passes meanwhile).
    pause(Duration::from_millis(1200));
    assert_eq!(reclaims(), 0.0);
    drop(burst);
    assert!(
        eventually(Duration::from_secs(4), || reclaims() >= 1.0),
        "no reclaim after 400 connections closed"
    );
    still_serves(addr);
}
both_drivers!(memory_is_reclaimed_after_a_burst);
