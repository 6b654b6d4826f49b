//! API keys, tenant quotas and prefix isolation over real sockets, on both drivers.

mod common;

use common::*;
use radixgate::engine_sim::EngineConfig;
use radixgate::tenants::hash_key;
use std::time::{Duration, Instant};

fn tenants_toml(extra: &str) -> String {
    format!(
        "[auth]\nrequired = true\n{extra}\n[[tenants]]\nname = \"acme\"\nkeys = [\"{}\"]\nrequests_per_sec = 5\n[[tenants]]\nname = \"globex\"\nkeys = [\"{}\"]\nmax_concurrency = 1\n[[tenants]]\nname = \"initech\"\nkeys = [\"{}\"]\ntokens_per_sec = 1000\n",
        hash_key("sk-acme"),
        hash_key("sk-globex"),
        hash_key("sk-initech")
    )
}

fn bearer(key: &str) -> (&'static str, String) {
    ("Authorization", format!("Bearer {key}"))
}

fn post(addr: std::net::SocketAddr, key: Option<&str>, body: &str) -> Response {
    let auth = key.map(bearer);
    let headers: Vec<(&str, &str)> = auth.iter().map(|(n, v)| (*n, v.as_str())).collect();
    Client::connect(addr).post("/v1/chat/completions", body, &headers)
}

fn keys_are_checked_and_never_forwarded(io: &str) {
    std::env::set_var("RADIXGATE_TEST_UPSTREAM_KEY", "sk-backend-own");
    let up = ScriptedUpstream::start(Script::Reply(vec![
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
            .to_vec(),
    ]));
    let mut toml = tenants_toml("");
    toml.push_str(&format!(
        "\n[[backends]]\nid = \"b0\"\nurl = \"{}\"\nmodels = [\"sim\"]\napi_key_env = \"RADIXGATE_TEST_UPSTREAM_KEY\"\n",
        up.url()
    ));
    let gw = start_gateway(io, 1, &toml, &[]);
    let addr = gw.local_addr();
    for key in [None, Some("sk-wrong")] {
        let r = post(addr, key, &chat_body("x", false));
        assert_eq!(r.status, 401, "{key:?}");
        assert_eq!(r.header("www-authenticate"), Some("Bearer"));
        assert_eq!(r.error_param_code().1, "invalid_api_key");
    }
    let r = post(addr, Some("sk-acme"), &chat_body("x", false));
    assert_eq!(r.status, 200);
    let seen = up.seen();
    assert_eq!(seen.len(), 1, "refused requests never went upstream");
    assert!(
        !seen[0].head.contains("sk-acme"),
        "the client's key leaked upstream"
    );
    assert!(seen[0]
        .head
        .contains("Authorization: Bearer sk-backend-own\r\n"));
    let m = Client::connect(addr).get("/metrics").text();
    assert_eq!(metric(&m, "radixgate_auth_failures_total"), Some(2.0));
}
both_drivers!(keys_are_checked_and_never_forwarded);

fn request_rate_is_global_across_shards(io: &str) {
    let engine = start_engine(io, EngineConfig::instant("sim"));
    let gw = start_gateway(io, 2, &tenants_toml(""), &[("e0", engine.url(), "sim")]);
    let addr = gw.local_addr();
    // Fresh connections land on both shards; the 5/s bucket is shared. It starts
    // full and refills one request per 200 ms, so how many of eight pass depends on
    // how long this host takes to send them: the five it holds, plus at most one per
    // 200 ms elapsed (asserted from the clock, not assumed).
    let start = Instant::now();
    let mut statuses: Vec<u16> = (0..8)
        .map(|i| post(addr, Some("sk-acme"), &chat_body(&format!("q{i}"), false)).status)
        .collect();
    let refills = (start.elapsed().as_millis() / 200) as usize;
    let passed = statuses.iter().filter(|s| **s == 200).count();
    assert!((5..=5 + refills).contains(&passed), "{statuses:?}");
    // Once empty, refused (a send that finds a refill just made passes).
    let r = (0..20)
        .map(|i| {
            post(
                addr,
                Some("sk-acme"),
                &chat_body(&format!("again{i}"), false),
            )
        })
        .inspect(|r| statuses.push(r.status))
        .find(|r| r.status == 429)
        .unwrap_or_else(|| panic!("never refused: {statuses:?}"));
    assert_eq!(r.error_param_code().1, "rate_limit_exceeded");
    assert_eq!(r.json()["error"]["type"], "rate_limit_error");
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(r.header("x-ratelimit-limit-requests"), Some("5"));
    assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("0"));
    // Other tenants are unaffected.
    assert_eq!(
        post(addr, Some("sk-globex"), &chat_body("y", false)).status,
        200
    );
    // And the bucket refills.
    pause(Duration::from_millis(250));
    assert_eq!(
        post(addr, Some("sk-acme"), &chat_body("later", false)).status,
        200
    );
    let m = Client::connect(addr).get("/metrics").text();
    assert_eq!(
        metric(
            &m,
            "radixgate_tenant_throttled_total{tenant=\"acme\",limit=\"requests\"}"
        ),
        Some(statuses.iter().filter(|s| **s == 429).count() as f64),
        "{m}"
    );
}
both_drivers!(request_rate_is_global_across_shards);

fn concurrency_cap(io: &str) {
    let mut cfg = EngineConfig::instant("sim");
    cfg.decode_per_token = Duration::from_millis(10);
    let engine = start_engine(io, cfg);
    let gw = start_gateway(io, 2, &tenants_toml(""), &[("e0", engine.url(), "sim")]);
    let addr = gw.local_addr();
    let mut long = Client::connect(addr);
    let auth = bearer("sk-globex");
    long.send(&post_bytes(
        "/v1/chat/completions",
        r#"{"model":"sim","stream":true,"max_tokens":50,"messages":[{"role":"user","content":"long"}]}"#,
        &[(auth.0, auth.1.as_str())],
    ));
    assert_eq!(long.read_head().0, 200);
    let r = post(addr, Some("sk-globex"), &chat_body("second", false));
    assert_eq!(r.status, 429);
    assert!(r.text().contains("concurrency"));
    drop(long);
}
both_drivers!(concurrency_cap);

fn token_charges_are_reconciled_with_usage(io: &str) {
    // The engine reports 90 tokens used although 900 were charged up front. The
    // bucket (1000 tokens, 1000/s) then holds 910, enough for a second 900 only with
    // the refund, and 820 after it: a request that needs the whole bucket is refused
    // unless 180 ms pass in between (a margin for a loaded host; with 10 tokens
    // reported it was 20 ms).
    let up = ScriptedUpstream::start(Script::Reply(vec![
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 53\r\n\r\n{\"usage\":{\"prompt_tokens\":45,\"completion_tokens\":45}}".to_vec(),
    ]));
    let gw = start_gateway(io, 1, &tenants_toml(""), &[("b0", up.url(), "sim")]);
    let addr = gw.local_addr();
    let big = r#"{"model":"sim","max_tokens":900,"messages":[{"role":"user","content":"x"}]}"#;
    assert_eq!(post(addr, Some("sk-initech"), big).status, 200);
    // Without the refund the bucket (1000 tokens) could not cover another 900 now.
    assert_eq!(post(addr, Some("sk-initech"), big).status, 200);
    let r = post(
        addr,
        Some("sk-initech"),
        r#"{"model":"sim","max_tokens":5000,"messages":[{"role":"user","content":"x"}]}"#,
    );
    assert_eq!(r.status, 429);
    assert_eq!(r.header("x-ratelimit-limit-tokens"), Some("1000"));
}
both_drivers!(token_charges_are_reconciled_with_usage);

fn tenants_never_share_prefixes_when_isolated(io: &str) {
    let engine = start_engine(io, EngineConfig::instant("sim"));
    let toml = tenants_toml("[tenancy]\nprefix_isolation = \"tenant\"");
    let gw = start_gateway(io, 1, &toml, &[("e0", engine.url(), "sim")]);
    let addr = gw.local_addr();
    let doc = "shared document text ".repeat(40);
    let body = |q: &str| {
        format!(
            r#"{{"model":"sim","max_tokens":1,"messages":[{{"role":"system","content":"{doc}"}},{{"role":"user","content":"{q}"}}]}}"#
        )
    };
    assert_eq!(
        post(addr, Some("sk-globex"), &body("a1")).header("x-router-match-blocks"),
        Some("0")
    );
    // Tenant A's own follow-up matches...
    let again = post(addr, Some("sk-globex"), &body("a2"));
    assert!(
        again
            .header("x-router-match-blocks")
            .unwrap()
            .parse::<u32>()
            .unwrap()
            > 5
    );
    // ...tenant B's identical prompt does not, in the index or in the engine's cache.
    let other = post(addr, Some("sk-acme"), &body("b1"));
    assert_eq!(other.header("x-router-match-blocks"), Some("0"));
    assert_eq!(
        other.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
        0
    );
}
both_drivers!(tenants_never_share_prefixes_when_isolated);

fn cache_salt_goes_upstream(io: &str) {
    let up = ScriptedUpstream::start(Script::Reply(vec![
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
            .to_vec(),
    ]));
    let toml = tenants_toml("[tenancy]\nprefix_isolation = \"tenant\"");
    let gw = start_gateway(io, 1, &toml, &[("b0", up.url(), "sim")]);
    let addr = gw.local_addr();
    post(addr, Some("sk-acme"), &chat_body("x", false));
    post(addr, Some("sk-globex"), &chat_body("x", false));
    let seen = up.seen();
    let salts: Vec<String> = seen
        .iter()
        .map(|s| {
            let v: serde_json::Value =
                serde_json::from_slice(&s.body).expect("upstream body is valid JSON");
            assert_eq!(v["model"], "sim");
            v["cache_salt"].as_str().expect("cache_salt").to_string()
        })
        .collect();
    assert_ne!(salts[0], salts[1]);
}
both_drivers!(cache_salt_goes_upstream);

/// A tenant that keeps within its quota is served in full while a neighbour floods
/// the gateway at many times its own (`radixgate-bench sim --edge` in simulated time).
fn a_greedy_neighbour_takes_nothing_from_a_polite_tenant(io: &str) {
    let engine = start_engine(io, EngineConfig::instant("sim"));
    let toml = format!(
        "[auth]\nrequired = true\n[[tenants]]\nname = \"polite\"\nkeys = [\"{}\"]\nrequests_per_sec = 10\n[[tenants]]\nname = \"greedy\"\nkeys = [\"{}\"]\nrequests_per_sec = 10\n",
        hash_key("sk-polite"),
        hash_key("sk-greedy")
    );
    let gw = start_gateway(io, 2, &toml, &[("e0", engine.url(), "sim")]);
    let addr = gw.local_addr();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flood = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let (mut sent, mut throttled) = (0u32, 0u32);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let r = post(
                    addr,
                    Some("sk-greedy"),
                    &chat_body(&format!("g{sent}"), false),
                );
                sent += 1;
                throttled += u32::from(r.status == 429);
            }
            (sent, throttled)
        })
    };
    // Ten requests a second for 1.5 s, on a fixed schedule: never more than its
    // quota allows, however late a send runs.
    let start = std::time::Instant::now();
    let statuses: Vec<u16> = (0..15u32)
        .map(|k| {
            pause(
                (start + Duration::from_millis(100) * k)
                    .saturating_duration_since(std::time::Instant::now()),
            );
            post(addr, Some("sk-polite"), &chat_body(&format!("p{k}"), false)).status
        })
        .collect();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (sent, throttled) = flood.join().unwrap();
    assert!(statuses.iter().all(|&s| s == 200), "{statuses:?}");
    assert!(
        throttled > 0 && sent > 30,
        "the neighbour was over its quota: {sent} sent, {throttled} throttled"
    );
    let m = Client::connect(addr).get("/metrics").text();
    assert_eq!(
        metric(
            &m,
            "radixgate_tenant_throttled_total{tenant=\"polite\",limit=\"requests\"}"
        ),
        None,
        "{m}"
    );
    assert_eq!(
        metric(
            &m,
            "radixgate_tenant_throttled_total{tenant=\"greedy\",limit=\"requests\"}"
        ),
        Some(f64::from(throttled)),
        "{m}"
    );
}
both_drivers!(a_greedy_neighbour_takes_nothing_from_a_polite_tenant);
