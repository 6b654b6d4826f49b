//! Disaggregated prefill/decode serving end to end: a gateway in split mode in front
//! of simulated prefill and decode engines that check the hand-off (a decode engine
//! pulls its KV from the prefill engine the parameters name, and refuses unknown,
//! expired or foreign ones), in both protocols, streaming and not, and every failure
//! path: a failed or slow prefill leg, a refused or failed decode leg, a decode
//! stream cut midway, no prefill pool at all. Both I/O drivers.

mod common;

use common::*;
use radixgate::config::{Protocol, Role};
use radixgate::engine_sim::{EngineConfig, EngineHandle, SimDisagg};
use radixgate::Gateway;
use std::time::Duration;

fn engine(
    io: &str,
    role: Role,
    protocol: Protocol,
    tune: impl Fn(&mut EngineConfig),
) -> EngineHandle {
    let mut cfg = EngineConfig::instant("sim");
    cfg.disagg = Some(SimDisagg::new(role, protocol));
    if role == Role::Prefill && protocol == Protocol::Sglang {
        cfg.bootstrap_port = Some(0);
    }
    tune(&mut cfg);
    start_engine(io, cfg)
}

struct Pool {
    prefill: Vec<EngineHandle>,
    decode: Vec<EngineHandle>,
    gw: Gateway,
}

/// A gateway over `prefill` and `decode` engines for model `sim` with `disagg` keys
/// (after `protocol`) in `[models.sim.disagg]` and `extra` TOML before it.
fn pool(
    io: &str,
    protocol: Protocol,
    prefill: Vec<EngineHandle>,
    decode: Vec<EngineHandle>,
    disagg: &str,
    extra: &str,
) -> Pool {
    let mut toml = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nshards = 2\nio = \"{io}\"\n{extra}\n[models.sim.disagg]\nprotocol = \"{}\"\n{disagg}\n",
        protocol.as_str()
    );
    for (i, e) in prefill.iter().enumerate() {
        toml.push_str(&format!(
            "\n[[backends]]\nid = \"prefill-{i}\"\nurl = \"{}\"\nmodels = [\"sim\"]\nrole = \"prefill\"\n",
            e.url()
        ));
        if let Some(b) = e.bootstrap_addr() {
            toml.push_str(&format!("bootstrap_port = {}\n", b.port()));
        }
    }
    for (i, e) in decode.iter().enumerate() {
        toml.push_str(&format!(
            "\n[[backends]]\nid = \"decode-{i}\"\nurl = \"{}\"\nmodels = [\"sim\"]\nrole = \"decode\"\n",
            e.url()
        ));
    }
    let config = radixgate::config::Config::from_toml(&toml)
        .unwrap_or_else(|e| panic!("bad test config: {e}\n{toml}"));
    Pool {
        prefill,
        decode,
        gw: Gateway::start(config).expect("gateway starts"),
    }
}

fn healthy_pool(io: &str, protocol: Protocol, disagg: &str) -> Pool {
    let prefill = (0..2)
        .map(|_| engine(io, Role::Prefill, protocol, |_| {}))
        .collect();
    let decode = (0..2)
        .map(|_| engine(io, Role::Decode, protocol, |_| {}))
        .collect();
    pool(io, protocol, prefill, decode, disagg, "")
}

/// Successful requests an engine answered (its vLLM metric).
fn served(e: &EngineHandle) -> f64 {
    let m = Client::connect(e.addr()).get("/metrics").text();
    metric(&m, "vllm:request_success_total").unwrap_or(0.0)
}

fn long_prompt(tag: &str) -> String {
    format!("{tag} {}", "lorem ipsum dolor sit amet ".repeat(80))
}

/// SSE content events in a streamed answer.
fn content_events(text: &str) -> usize {
    text.lines()
        .filter(|l| {
            l.starts_with("data: {") && l.contains("\"content\":\"") && !l.contains("\"role\"")
        })
        .count()
}

fn split_both_ways(io: &str, protocol: Protocol) {
    let p = healthy_pool(io, protocol, "mode = \"always\"");
    let addr = p.gw.local_addr();
    let mut c = Client::connect(addr);
    // Not streamed.
    let r = c.post(
        "/v1/chat/completions",
        &chat_body("hello split", false),
        &[("X-Request-Id", "req-split-1")],
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-router-reason"), Some("disagg-split"));
    assert!(r
        .header("x-router-prefill")
        .unwrap()
        .starts_with("prefill-"));
    let decode = r.header("x-router-decode").unwrap();
    assert!(decode.starts_with("decode-"));
    assert_eq!(r.header("x-router-backend"), Some(decode));
    assert_eq!(r.header("x-request-id"), Some("req-split-1"));
    let v = r.json();
    assert_eq!(v["usage"]["completion_tokens"], 4, "{v}");
    assert!(
        v.get("kv_transfer_params").is_none(),
        "the prefill answer never reaches the client"
    );
    // Streamed, with usage.
    let r = c.post(
        "/v1/chat/completions",
        &chat_body("hello stream", true),
        &[],
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-router-reason"), Some("disagg-split"));
    let text = r.text();
    assert_eq!(content_events(&text), 4, "{text}");
    assert!(text.contains("\"completion_tokens\":4"), "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    // Completions too.
    let r = c.post(
        "/v1/completions",
        r#"{"model":"sim","prompt":"once upon a time","max_tokens":3}"#,
        &[],
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["usage"]["completion_tokens"], 3);
    // Each request ran once on each side: one prefill answer, one decode answer.
    let prefilled: f64 = p.prefill.iter().map(served).sum();
    let decoded: f64 = p.decode.iter().map(served).sum();
    assert_eq!((prefilled, decoded), (3.0, 3.0));
    let m = c.get("/metrics").text();
    assert_eq!(
        metric(
            &m,
            "radixgate_disagg_requests_total{mode=\"split\",reason=\"split\"}"
        ),
        Some(3.0)
    );
    assert_eq!(
        metric(&m, "radixgate_disagg_leg_seconds_count{leg=\"prefill\"}"),
        Some(3.0)
    );
    assert_eq!(
        metric(&m, "radixgate_disagg_leg_seconds_count{leg=\"decode\"}"),
        Some(3.0)
    );
    assert_eq!(
        metric(&m, "radixgate_disagg_transfer_seconds_count"),
        Some(3.0)
    );
    // One routing decision (the pair) per request.
    assert_eq!(
        metric(
            &m,
            "radixgate_routing_decision_seconds_count{shard=\"all\"}"
        ),
        Some(3.0)
    );
    assert_eq!(
        metric(&m, "radixgate_disagg_leg_failures_total{leg=\"prefill\"}"),
        Some(0.0)
    );
}

fn vllm_split(io: &str) {
    split_both_ways(io, Protocol::Vllm);
}
both_drivers!(vllm_split);

fn sglang_split(io: &str) {
    split_both_ways(io, Protocol::Sglang);
}
both_drivers!(sglang_split);

/// Conditional disaggregation: a short prompt is served whole on a decode engine, a
/// long uncached one is split, and the same long prompt again (now cached on its
/// prefill engine) is served whole.
fn conditional_split(io: &str) {
    let p = healthy_pool(io, Protocol::Vllm, "min_uncached_tokens = 128");
    let mut c = Client::connect(p.gw.local_addr());
    let r = c.post("/v1/chat/completions", &chat_body("short", false), &[]);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-router-reason"), Some("disagg-local"));
    assert!(r.header("x-router-backend").unwrap().starts_with("decode-"));
    assert_eq!(r.header("x-router-prefill"), None);
    let long = chat_body(&long_prompt("doc"), false);
    let r = c.post("/v1/chat/completions", &long, &[]);
    assert_eq!(r.header("x-router-reason"), Some("disagg-split"));
    let r = c.post("/v1/chat/completions", &long, &[]);
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("x-router-reason"),
        Some("disagg-local"),
        "cached on the prefill side now"
    );
    let m = c.get("/metrics").text();
    assert_eq!(
        metric(
            &m,
            "radixgate_disagg_requests_total{mode=\"local\",reason=\"small_uncached\"}"
        ),
        Some(2.0)
    );
    assert_eq!(
        metric(
            &m,
            "radixgate_disagg_requests_total{mode=\"split\",reason=\"split\"}"
        ),
        Some(1.0)
    );
    assert_eq!(p.prefill.iter().map(served).sum::<f64>(), 1.0);
}
both_drivers!(conditional_split);

/// A prefill engine that fails (503) or is too slow (past the leg timeout): the
/// request moves to the other prefill engine and succeeds.
fn prefill_failure_moves_on(io: &str) {
    for broken in [
        (|c: &mut EngineConfig| c.fail_rate = 1.0) as fn(&mut EngineConfig),
        |c: &mut EngineConfig| {
            c.spike_rate = 1.0;
            c.spike = Duration::from_secs(3);
        },
    ] {
        let prefill = vec![
            engine(io, Role::Prefill, Protocol::Vllm, broken),
            engine(io, Role::Prefill, Protocol::Vllm, |_| {}),
        ];
        let decode = vec![engine(io, Role::Decode, Protocol::Vllm, |_| {})];
        let p = pool(
            io,
            Protocol::Vllm,
            prefill,
            decode,
            "mode = \"always\"\nprefill_timeout_ms = 300",
            "",
        );
        let mut c = Client::connect(p.gw.local_addr());
        for i in 0..4 {
            let r = c.post(
                "/v1/chat/completions",
                &chat_body(&format!("p{i}"), i % 2 == 1),
                &[],
            );
            assert_eq!(r.status, 200, "{}", r.text());
            assert_eq!(r.header("x-router-prefill"), Some("prefill-1"));
            assert_eq!(r.header("x-router-reason"), Some("disagg-split"));
        }
        let m = c.get("/metrics").text();
        assert!(metric(&m, "radixgate_disagg_leg_failures_total{leg=\"prefill\"}").unwrap() >= 1.0);
    }
}
both_drivers!(prefill_failure_moves_on);

/// Every prefill engine fails: served whole on a decode engine when allowed, an
/// OpenAI-shaped error otherwise.
fn no_prefill_succeeds(io: &str) {
    for fallback in [true, false] {
        let prefill = (0..2)
            .map(|_| engine(io, Role::Prefill, Protocol::Vllm, |c| c.fail_rate = 1.0))
            .collect();
        let decode = vec![engine(io, Role::Decode, Protocol::Vllm, |_| {})];
        let p = pool(
            io,
            Protocol::Vllm,
            prefill,
            decode,
            &format!("mode = \"always\"\nlocal_fallback = {fallback}"),
            "[breaker]\nfailure_threshold = 100",
        );
        let mut c = Client::connect(p.gw.local_addr());
        let r = c.post("/v1/chat/completions", &chat_body("doomed", true), &[]);
        if fallback {
            assert_eq!(r.status, 200, "{}", r.text());
            assert_eq!(r.header("x-router-reason"), Some("disagg-local"));
            assert_eq!(r.header("x-router-backend"), Some("decode-0"));
            let m = c.get("/metrics").text();
            assert_eq!(
                metric(
                    &m,
                    "radixgate_disagg_requests_total{mode=\"local\",reason=\"prefill_failed\"}"
                ),
                Some(1.0)
            );
            assert_eq!(
                metric(&m, "radixgate_disagg_leg_failures_total{leg=\"prefill\"}"),
                Some(2.0)
            );
        } else {
            assert_eq!(r.status, 502, "{}", r.text());
            let (_, code) = r.error_param_code();
            assert!(!code.is_empty());
            assert!(r.header("x-router-prefill").is_some());
        }
    }
}
both_drivers!(no_prefill_succeeds);

/// A decode engine that fails before its first byte: the request gets a fresh
/// prefill and another decode engine.
fn decode_failure_retries_with_fresh_prefill(io: &str) {
    let prefill = vec![engine(io, Role::Prefill, Protocol::Vllm, |_| {})];
    let decode = vec![
        engine(io, Role::Decode, Protocol::Vllm, |c| c.fail_rate = 1.0),
        engine(io, Role::Decode, Protocol::Vllm, |_| {}),
    ];
    let p = pool(io, Protocol::Vllm, prefill, decode, "mode = \"always\"", "");
    let mut c = Client::connect(p.gw.local_addr());
    for i in 0..4 {
        let r = c.post(
            "/v1/chat/completions",
            &chat_body(&format!("d{i}"), i % 2 == 0),
            &[],
        );
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("x-router-decode"), Some("decode-1"));
    }
    let m = c.get("/metrics").text();
    let failed = metric(&m, "radixgate_disagg_leg_failures_total{leg=\"decode\"}").unwrap();
    assert!(failed >= 1.0);
    // One fresh prefill per failed decode leg, plus one per request.
    assert_eq!(served(&p.prefill[0]), 4.0 + failed);
}
both_drivers!(decode_failure_retries_with_fresh_prefill);

/// A decode engine that sends nothing within the decode leg's first-byte timeout
/// (a stalled KV transfer): a fresh prefill and the other decode engine.
fn decode_timeout_moves_on(io: &str) {
    let prefill = vec![engine(io, Role::Prefill, Protocol::Vllm, |_| {})];
    let decode = vec![
        engine(io, Role::Decode, Protocol::Vllm, |c| {
            c.spike_rate = 1.0;
            c.spike = Duration::from_secs(3);
        }),
        engine(io, Role::Decode, Protocol::Vllm, |_| {}),
    ];
    let p = pool(
        io,
        Protocol::Vllm,
        prefill,
        decode,
        "mode = \"always\"\ndecode_first_byte_timeout_ms = 300",
        "",
    );
    let mut c = Client::connect(p.gw.local_addr());
    let r = c.post("/v1/chat/completions", &chat_body("stall", true), &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-router-decode"), Some("decode-1"));
    assert_eq!(served(&p.prefill[0]), 2.0, "a fresh prefill for the retry");
    let m = c.get("/metrics").text();
    assert_eq!(
        metric(&m, "radixgate_disagg_leg_failures_total{leg=\"decode\"}"),
        Some(1.0)
    );
}
both_drivers!(decode_timeout_moves_on);

/// Handed-off blocks that expired before the decode engine pulls them: the decode
/// engine refuses (400), the gateway retries with fresh prefills, and after the last
/// attempt the client gets the engine's refusal.
fn expired_handoff_is_refused(io: &str) {
    let prefill = vec![engine(io, Role::Prefill, Protocol::Vllm, |c| {
        if let Some(d) = &mut c.disagg {
            d.hold = Duration::ZERO;
        }
    })];
    let decode = vec![engine(io, Role::Decode, Protocol::Vllm, |_| {})];
    let p = pool(
        io,
        Protocol::Vllm,
        prefill,
        decode,
        "mode = \"always\"\ndecode_attempts = 3",
        "",
    );
    let mut c = Client::connect(p.gw.local_addr());
    let r = c.post("/v1/chat/completions", &chat_body("late", false), &[]);
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("KV transfer failed"), "{}", r.text());
    assert_eq!(served(&p.prefill[0]), 3.0, "a fresh prefill per attempt");
    let m = c.get("/metrics").text();
    assert_eq!(
        metric(&m, "radixgate_disagg_leg_failures_total{leg=\"decode\"}"),
        Some(2.0)
    );
}
both_drivers!(expired_handoff_is_refused);

/// A decode stream cut midway: the client gets the tokens so far once, then an SSE
/// error event and a properly ended body; nothing is replayed.
fn decode_breaks_mid_stream(io: &str) {
    for protocol in [Protocol::Vllm, Protocol::Sglang] {
        let prefill = vec![engine(io, Role::Prefill, protocol, |_| {})];
        let decode = vec![engine(io, Role::Decode, protocol, |c| c.abort_rate = 1.0)];
        let p = pool(io, protocol, prefill, decode, "mode = \"always\"", "");
        let mut c = Client::connect(p.gw.local_addr());
        let body = r#"{"model":"sim","stream":true,"max_tokens":8,"messages":[{"role":"user","content":"cut"}]}"#;
        let r = c.post("/v1/chat/completions", body, &[]);
        assert_eq!(r.status, 200);
        let text = r.text();
        assert_eq!(content_events(&text), 4, "{text}");
        assert!(text.contains("data: {\"error\""), "{text}");
        let m = Client::connect(p.gw.local_addr()).get("/metrics").text();
        assert_eq!(
            metric(&m, "radixgate_disagg_leg_failures_total{leg=\"decode\"}"),
            Some(1.0)
        );
    }
}
both_drivers!(decode_breaks_mid_stream);

/// SGLang: a decode engine whose prefill never comes (a room nobody fills) times out
/// and refuses; a prefill engine that fails makes the gateway try the other.
fn sglang_prefill_failure(io: &str) {
    let prefill = vec![
        engine(io, Role::Prefill, Protocol::Sglang, |c| c.fail_rate = 1.0),
        engine(io, Role::Prefill, Protocol::Sglang, |_| {}),
    ];
    let decode = vec![engine(io, Role::Decode, Protocol::Sglang, |c| {
        if let Some(d) = &mut c.disagg {
            d.hold = Duration::from_millis(300);
        }
    })];
    let p = pool(
        io,
        Protocol::Sglang,
        prefill,
        decode,
        "mode = \"always\"\nprefill_attempts = 2\ndecode_attempts = 2",
        "[breaker]\nfailure_threshold = 100",
    );
    let mut c = Client::connect(p.gw.local_addr());
    for i in 0..3 {
        let r = c.post(
            "/v1/chat/completions",
            &chat_body(&format!("s{i}"), true),
            &[],
        );
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("x-router-prefill"), Some("prefill-1"));
    }
}
both_drivers!(sglang_prefill_failure);

/// The simulated engines check the hand-off themselves.
fn sim_checks_the_handoff(io: &str) {
    let prefill = engine(io, Role::Prefill, Protocol::Vllm, |_| {});
    let decode = engine(io, Role::Decode, Protocol::Vllm, |_| {});
    let forged = format!(
        r#"{{"model":"sim","max_tokens":2,"prompt":"x","kv_transfer_params":{{"do_remote_prefill":true,"remote_engine_id":"nobody","remote_block_ids":[1],"remote_host":"127.0.0.1","remote_port":{}}}}}"#,
        prefill.addr().port()
    );
    let r =
        Client::connect(decode.addr()).post("/v1/completions", &forged, &[("X-Request-Id", "a")]);
    assert_eq!(r.status, 400);
    assert!(r.text().contains("KV transfer failed"));
    // A real hand-off, pulled under another request id, is refused too.
    let ask = r#"{"model":"sim","max_tokens":1,"prompt":"hello","kv_transfer_params":{"do_remote_decode":true}}"#;
    let r = Client::connect(prefill.addr()).post("/v1/completions", ask, &[("X-Request-Id", "a")]);
    assert_eq!(r.status, 200);
    let params = r.json()["kv_transfer_params"].clone();
    assert_eq!(params["remote_port"], prefill.addr().port());
    let pull = format!(
        r#"{{"model":"sim","max_tokens":2,"prompt":"hello","kv_transfer_params":{params}}}"#
    );
    let r = Client::connect(decode.addr()).post("/v1/completions", &pull, &[("X-Request-Id", "b")]);
    assert_eq!(r.status, 400, "{}", r.text());
    let r = Client::connect(decode.addr()).post("/v1/completions", &pull, &[("X-Request-Id", "a")]);
    assert_eq!(r.status, 200, "{}", r.text());
    // Blocks are handed over once.
    let r = Client::connect(decode.addr()).post("/v1/completions", &pull, &[("X-Request-Id", "a")]);
    assert_eq!(r.status, 400);
    // SGLang: the decode leg may arrive first and waits for its room.
    let prefill = engine(io, Role::Prefill, Protocol::Sglang, |_| {});
    let decode = engine(io, Role::Decode, Protocol::Sglang, |_| {});
    let b = prefill.bootstrap_addr().unwrap();
    let body = format!(
        r#"{{"model":"sim","max_tokens":2,"prompt":"hi","bootstrap_host":"127.0.0.1","bootstrap_port":{},"bootstrap_room":77}}"#,
        b.port()
    );
    let (d_addr, d_body) = (decode.addr(), body.clone());
    let waiting =
        std::thread::spawn(move || Client::connect(d_addr).post("/v1/completions", &d_body, &[]));
    pause(Duration::from_millis(100));
    let r = Client::connect(prefill.addr()).post("/v1/completions", &body, &[]);
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["usage"]["completion_tokens"], 1);
    let r = waiting.join().unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["usage"]["completion_tokens"], 2);
}
both_drivers!(sim_checks_the_handoff);

/// `radixgate demo --disagg` (both protocols): split requests through the demo fleet.
#[test]
fn demo_disagg_both_protocols() {
    for protocol in [Protocol::Vllm, Protocol::Sglang] {
        let demo = radixgate::demo::start(
            "127.0.0.1:0".parse().unwrap(),
            &radixgate::demo::DemoOptions {
                policy: "prefix_aware".into(),
                disagg: Some(protocol),
                replicas: 1,
                bus: None,
                tokenizer: None,
            },
        )
        .expect("demo starts");
        assert_eq!(demo.engines.len(), 4);
        let mut c = Client::connect(demo.gateway.local_addr());
        for stream in [false, true] {
            let r = c.post("/v1/chat/completions", &chat_body("Hello!", stream), &[]);
            assert_eq!(r.status, 200, "{}", r.text());
            assert_eq!(r.header("x-router-reason"), Some("disagg-split"));
        }
        demo.shutdown();
    }
}

/// The admin API refuses a prefill backend for a model without a split pool, and
/// takes one for the split model.
#[test]
fn admin_checks_roles() {
    let io = "epoll";
    let token = "disagg-admin-token-123";
    let file = temp_file("disagg-admin-token", &format!("{token}\n"));
    let p = healthy_pool_with(
        io,
        &format!(
            "[admin]\nlisten = \"127.0.0.1:0\"\ntoken_file = \"{}\"",
            file.display()
        ),
    );
    let admin = p.gw.admin_addr().expect("admin listens");
    let auth = format!("Bearer {token}");
    let extra = engine(io, Role::Prefill, Protocol::Vllm, |_| {});
    let bad = format!(
        r#"{{"id":"p9","url":"{}","models":["other"],"role":"prefill"}}"#,
        extra.url()
    );
    let r = Client::connect(admin).post("/admin/backends", &bad, &[("Authorization", &auth)]);
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(
        r.text().contains("has no [models.other.disagg] table"),
        "{}",
        r.text()
    );
    let good = format!(
        r#"{{"id":"p9","url":"{}","models":["sim"],"role":"prefill"}}"#,
        extra.url()
    );
    let r = Client::connect(admin).post("/admin/backends", &good, &[("Authorization", &auth)]);
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.json()["role"], "prefill");
}

fn healthy_pool_with(io: &str, extra: &str) -> Pool {
    let prefill = (0..2)
        .map(|_| engine(io, Role::Prefill, Protocol::Vllm, |_| {}))
        .collect();
    let decode = (0..2)
        .map(|_| engine(io, Role::Decode, Protocol::Vllm, |_| {}))
        .collect();
    pool(io, Protocol::Vllm, prefill, decode, "", extra)
}

/// A prefill engine that refuses the request itself (a 4xx): the client gets that
/// answer, with the pair in the headers, and no decode leg runs.
fn prefill_refusal_is_relayed(io: &str) {
    let body =
        r#"{"error":{"message":"bad prompt","type":"BadRequestError","param":null,"code":400}}"#;
    let refusing = ScriptedUpstream::start(Script::Reply(vec![format!(
        "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()]));
    let decode = engine(io, Role::Decode, Protocol::Vllm, |_| {});
    let toml = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nshards = 1\nio = \"{io}\"\n[models.sim.disagg]\nprotocol = \"vllm\"\nmode = \"always\"\n\
         [[backends]]\nid = \"prefill-0\"\nurl = \"{}\"\nmodels = [\"sim\"]\nrole = \"prefill\"\n\
         [[backends]]\nid = \"decode-0\"\nurl = \"{}\"\nmodels = [\"sim\"]\nrole = \"decode\"\n",
        refusing.url(),
        decode.url()
    );
    let gw = Gateway::start(radixgate::config::Config::from_toml(&toml).unwrap()).unwrap();
    let r =
        Client::connect(gw.local_addr()).post("/v1/chat/completions", &chat_body("x", true), &[]);
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.text(), body);
    assert_eq!(r.header("x-router-prefill"), Some("prefill-0"));
    assert_eq!(refusing.seen().len(), 1);
    let sent: serde_json::Value = serde_json::from_slice(&refusing.seen()[0].body).unwrap();
    assert_eq!(sent["max_tokens"], 1);
    assert_eq!(sent["stream"], false);
    assert_eq!(served(&decode), 0.0);
}
both_drivers!(prefill_refusal_is_relayed);

/// Every decode engine fails before its first byte: with `local_fallback` the
/// request is served whole on a `both` backend.
fn decode_failure_falls_back_local(io: &str) {
    let both = start_engine(io, EngineConfig::instant("sim"));
    let prefill = vec![engine(io, Role::Prefill, Protocol::Vllm, |_| {})];
    let decode = vec![engine(io, Role::Decode, Protocol::Vllm, |c| {
        c.fail_rate = 1.0
    })];
    let extra = format!(
        "[[backends]]\nid = \"both-0\"\nurl = \"{}\"\nmodels = [\"sim\"]\n",
        both.url()
    );
    let p = pool(
        io,
        Protocol::Vllm,
        prefill,
        decode,
        "mode = \"always\"",
        &extra,
    );
    let mut c = Client::connect(p.gw.local_addr());
    let r = c.post("/v1/chat/completions", &chat_body("fallback", false), &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-router-reason"), Some("disagg-local"));
    assert_eq!(served(&both), 1.0);
    let m = c.get("/metrics").text();
    assert_eq!(
        metric(
            &m,
            "radixgate_disagg_requests_total{mode=\"local\",reason=\"decode_failed\"}"
        ),
        Some(1.0)
    );
}
both_drivers!(decode_failure_falls_back_local);

/// A client that leaves while its split request's prefill runs ends both legs: the
/// engines stop (their running counts drop to 0 within a second, as each drops a
/// request whose connection closed, like vLLM and SGLang), the pair's in-flight
/// accounting is released, the request counts as 499 against the leg it left, and
/// no breaker opens, although here a single failure would open one.
fn departed_client_stops_the_split(io: &str, protocol: Protocol) {
    let slow = |c: &mut EngineConfig| c.prefill_per_token = Duration::from_millis(10);
    let p = pool(
        io,
        protocol,
        vec![engine(io, Role::Prefill, protocol, slow)],
        vec![engine(io, Role::Decode, protocol, |_| {})],
        "mode = \"always\"",
        "[breaker]\nfailure_threshold = 1\nopen_ms = 60000",
    );
    let running = |e: &EngineHandle| {
        let m = Client::connect(e.addr()).get("/metrics").text();
        metric(&m, "vllm:num_requests_running")
    };
    let body = format!(
        r#"{{"model":"sim","stream":false,"max_tokens":5,"messages":[{{"role":"user","content":"{}"}}]}}"#,
        long_prompt("leave")
    );
    let mut c = Client::connect(p.gw.local_addr());
    c.send(&post_bytes("/v1/chat/completions", &body, &[]));
    assert!(
        eventually(Duration::from_secs(5), || running(&p.prefill[0])
            == Some(1.0)),
        "the prefill never ran"
    );
    drop(c);
    assert!(
        eventually(Duration::from_secs(1), || {
            running(&p.prefill[0]) == Some(0.0) && running(&p.decode[0]) == Some(0.0)
        }),
        "the engines still run {:?} / {:?} requests 1 s after the client left",
        running(&p.prefill[0]),
        running(&p.decode[0])
    );
    // The 499 is the leg's the client left: vLLM's prefill leg runs first, alone;
    // SGLang's decode leg is the one that watches the client.
    let left = match protocol {
        Protocol::Vllm => "prefill-0",
        Protocol::Sglang => "decode-0",
    };
    let counted = format!("radixgate_requests_total{{backend=\"{left}\",status=\"499\"");
    assert_departure_released(p.gw.local_addr(), &["prefill-0", "decode-0"], &counted);
}

fn vllm_departed_client_stops_the_split(io: &str) {
    departed_client_stops_the_split(io, Protocol::Vllm);
}
both_drivers!(vllm_departed_client_stops_the_split);

fn sglang_departed_client_stops_the_split(io: &str) {
    departed_client_stops_the_split(io, Protocol::Sglang);
}
both_drivers!(sglang_departed_client_stops_the_split);
