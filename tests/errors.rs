//! Every error the gateway can answer, in OpenAI's shape with the right status and
//! `param`, over real sockets on both drivers, and proof that a bad request never
//! disturbs another one.

mod common;

use common::*;
use radixgate::engine_sim::EngineConfig;
use std::time::Duration;

fn client_errors(io: &str) {
    let engine = start_engine(io, EngineConfig::instant("sim"));
    let gw = start_gateway(
        io,
        1,
        "max_body_bytes = 4096\nmax_head_bytes = 1024",
        &[("e0", engine.url(), "sim")],
    );
    let addr = gw.local_addr();
    let cases: [(&str, u16, Option<&str>, &str); 8] = [
        ("{\"model\":", 400, None, "invalid_json"),
        ("[]", 400, None, "invalid_json"),
        (
            r#"{"messages":[{"role":"user","content":"x"}]}"#,
            400,
            Some("model"),
            "invalid_value",
        ),
        (
            r#"{"model":["sim"],"messages":[]}"#,
            400,
            Some("model"),
            "invalid_value",
        ),
        (
            r#"{"model":"sim","messages":"hi"}"#,
            400,
            Some("messages"),
            "invalid_value",
        ),
        (
            r#"{"model":"sim","messages":[{"role":1,"content":"x"}]}"#,
            400,
            Some("messages[0].role"),
            "invalid_value",
        ),
        (
            r#"{"model":"sim","stream":1,"messages":[{"role":"user","content":"x"}]}"#,
            400,
            Some("stream"),
            "invalid_value",
        ),
        (
            r#"{"model":"gpt-5","messages":[{"role":"user","content":"x"}]}"#,
            404,
            Some("model"),
            "model_not_found",
        ),
    ];
    // All on one keep-alive connection: a bad request leaves the connection usable.
    let mut c = Client::connect(addr);
    for (body, status, param, code) in cases {
        let r = c.post("/v1/chat/completions", body, &[]);
        assert_eq!(r.status, status, "{body}: {}", r.text());
        let (p, cd) = r.error_param_code();
        assert_eq!(p.as_deref(), param, "{body}");
        assert_eq!(cd, code, "{body}");
        assert!(r.header("x-request-id").is_some());
    }
    let r = c.post("/v1/completions", r#"{"model":"sim"}"#, &[]);
    assert_eq!(
        (r.status, r.error_param_code().0.as_deref()),
        (400, Some("prompt"))
    );
    let r = c.post("/v1/chat/completions", &chat_body("fine", false), &[]);
    assert_eq!(r.status, 200, "the connection still works after errors");

    // Unknown path and wrong method.
    let r = c.get("/v1/nope");
    assert_eq!(
        (r.status, r.error_param_code().1.as_str()),
        (404, "not_found")
    );
    let r = c.get("/v1/chat/completions");
    assert_eq!(r.status, 405);
    assert_eq!(r.header("allow"), Some("POST"));
    let r = c.post("/v1/models", "{}", &[]);
    assert_eq!(r.status, 405);
    assert_eq!(r.header("allow"), Some("GET"));

    // Body over the limit: refused from the declared length, connection closed.
    let mut c = Client::connect(addr);
    c.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 100000\r\n\r\n");
    let r = c.read_response();
    assert_eq!(
        (r.status, r.error_param_code().1.as_str()),
        (413, "request_too_large")
    );
    assert!(c.is_closed());

    // Chunked body over the limit.
    let mut c = Client::connect(addr);
    let chunk = "a".repeat(3000);
    c.send(format!("POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nbb8\r\n{chunk}\r\nbb8\r\n{chunk}\r\n0\r\n\r\n").as_bytes());
    assert_eq!(c.read_response().status, 413);

    // Head over the limit.
    let mut c = Client::connect(addr);
    let big = "h".repeat(2000);
    c.send(format!("GET /health HTTP/1.1\r\nX-Big: {big}\r\n\r\n").as_bytes());
    let r = c.read_response();
    assert_eq!(
        (r.status, r.error_param_code().1.as_str()),
        (431, "headers_too_large")
    );

    // Broken framing.
    let mut c = Client::connect(addr);
    c.send(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n");
    assert_eq!(c.read_response().status, 400);
    let mut c = Client::connect(addr);
    c.send(b"NOT HTTP AT ALL\r\n\r\n");
    assert_eq!(c.read_response().status, 400);
    let mut c = Client::connect(addr);
    c.send(b"POST /v1/chat/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n");
    assert_eq!(c.read_response().status, 400);

    // And the gateway still serves.
    let mut c = Client::connect(addr);
    assert_eq!(
        c.post("/v1/chat/completions", &chat_body("ok", true), &[])
            .status,
        200
    );
}
both_drivers!(client_errors);

fn policy_header(io: &str) {
    let engine = start_engine(io, EngineConfig::instant("sim"));
    let gw = start_gateway(
        io,
        1,
        "[routing]\nallow_policy_header = true",
        &[("e0", engine.url(), "sim")],
    );
    let mut c = Client::connect(gw.local_addr());
    let r = c.post(
        "/v1/chat/completions",
        &chat_body("x", false),
        &[("X-Router-Policy", "least_loaded")],
    );
    assert_eq!(r.header("x-router-reason"), Some("least-loaded"));
    let r = c.post(
        "/v1/chat/completions",
        &chat_body("x", false),
        &[("X-Router-Policy", "psychic")],
    );
    assert_eq!(r.status, 400);
    assert_eq!(r.error_param_code().0.as_deref(), Some("X-Router-Policy"));

    // Without allow_policy_header the header is ignored.
    let gw2 = start_gateway(io, 1, "", &[("e0", engine.url(), "sim")]);
    let mut c = Client::connect(gw2.local_addr());
    let r = c.post(
        "/v1/chat/completions",
        &chat_body("x", false),
        &[("X-Router-Policy", "least_loaded")],
    );
    // The default policy is prefix_aware; a fresh prompt on one backend is a no-match.
    assert_eq!(r.header("x-router-reason"), Some("no-match"));
}
both_drivers!(policy_header);

fn upstream_refused_is_502(io: &str) {
    // A port with nothing listening; health checks are slow enough that the
    // backend still counts as healthy when the request comes.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", dead.local_addr().unwrap());
    drop(dead);
    let gw = start_gateway(
        io,
        1,
        "[health]\ninterval_ms = 60000\nunhealthy_threshold = 5",
        &[("b0", url, "sim")],
    );
    let mut c = Client::connect(gw.local_addr());
    let r = c.post("/v1/chat/completions", &chat_body("x", false), &[]);
    assert_eq!(r.status, 502, "{}", r.text());
    assert_eq!(r.error_param_code().1, "upstream_unavailable");
    assert_eq!(r.header("x-router-backend"), Some("b0"));
}
both_drivers!(upstream_refused_is_502);

fn upstream_timeout_is_504(io: &str) {
    let up = ScriptedUpstream::start(Script::Silent);
    let gw = start_gateway(
        io,
        1,
        "[upstream]\nfirst_byte_timeout_ms = 200",
        &[("b0", up.url(), "sim")],
    );
    let mut c = Client::connect(gw.local_addr());
    let r = c.post("/v1/chat/completions", &chat_body("x", false), &[]);
    assert_eq!(r.status, 504);
    assert_eq!(r.error_param_code().1, "upstream_timeout");
}
both_drivers!(upstream_timeout_is_504);

fn upstream_garbage_is_502(io: &str) {
    let up = ScriptedUpstream::start(Script::Reply(vec![b"SMTP READY\r\n\r\n".to_vec()]));
    let gw = start_gateway(io, 1, "", &[("b0", up.url(), "sim")]);
    let mut c = Client::connect(gw.local_addr());
    let r = c.post("/v1/chat/completions", &chat_body("x", false), &[]);
    assert_eq!(r.status, 502);
    assert_eq!(r.error_param_code().1, "upstream_error");
}
both_drivers!(upstream_garbage_is_502);

fn no_healthy_backend_is_503(io: &str) {
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", dead.local_addr().unwrap());
    drop(dead);
    let gw = start_gateway(
        io,
        2,
        "[health]\ninterval_ms = 20\ntimeout_ms = 100\nunhealthy_threshold = 1",
        &[("b0", url, "sim")],
    );
    let addr = gw.local_addr();
    assert!(
        eventually(Duration::from_secs(5), || Client::connect(addr)
            .get("/ready")
            .status
            == 503),
        "/ready never reported the dead backend"
    );
    let mut c = Client::connect(addr);
    let r = c.post("/v1/chat/completions", &chat_body("x", false), &[]);
    assert_eq!(r.status, 503);
    assert_eq!(r.error_param_code().1, "no_healthy_backend");
    assert_eq!(c.get("/health").status, 200, "alive even when not ready");
}
both_drivers!(no_healthy_backend_is_503);

fn engine_errors_pass_through(io: &str) {
    let mut cfg = EngineConfig::instant("sim");
    cfg.fail_rate = 1.0;
    let engine = start_engine(io, cfg);
    let gw = start_gateway(io, 1, "", &[("e0", engine.url(), "sim")]);
    let mut c = Client::connect(gw.local_addr());
    let r = c.post("/v1/chat/completions", &chat_body("x", false), &[]);
    assert_eq!(r.status, 503);
    assert!(r.text().contains("simulated engine failure"));
    assert_eq!(r.header("x-router-backend"), Some("e0"));
    // Still keep-alive afterwards.
    assert_eq!(c.get("/health").status, 200);
}
both_drivers!(engine_errors_pass_through);
