//! LoRA-aware routing end to end: the gateway learns each engine-sim's adapters from
//! its `GET /v1/models`, sends an adapter's requests only to engines serving it,
//! refuses an adapter nobody serves as an unknown model, keeps an adapter's cached
//! blocks apart from the base model's, lists adapters in its own `/v1/models`, and
//! routes to an adapter that appears on an engine added later.

mod common;

use common::*;
use radixgate::engine_sim::{EngineConfig, EngineHandle};
use std::net::SocketAddr;
use std::time::Duration;

fn engine(io: &str, loras: &[&str]) -> EngineHandle {
    start_engine(
        io,
        EngineConfig {
            loras: loras.iter().map(|l| l.to_string()).collect(),
            ..EngineConfig::instant("sim")
        },
    )
}

/// A gateway over `engines` (ids e0, e1, ...), prefix-aware, with the admin API.
fn gateway(io: &str, engines: &[&EngineHandle]) -> radixgate::Gateway {
    // The shared token file: written once, so no gateway reads it half-written.
    let extra = format!(
        "[routing]\npolicy = \"prefix_aware\"\n[health]\ninterval_ms = 100\nunhealthy_threshold = 1\n[admin]\nlisten = \"127.0.0.1:0\"\ntoken_file = \"{}\"",
        token_file()
    );
    let ids: Vec<String> = (0..engines.len()).map(|i| format!("e{i}")).collect();
    let backends: Vec<_> = engines
        .iter()
        .zip(&ids)
        .map(|(e, id)| (id.as_str(), e.url(), "sim"))
        .collect();
    start_gateway(io, 1, &extra, &backends)
}

fn body(model: &str, doc: usize) -> String {
    let text: String = (0..60).map(|i| format!("doc{doc}-sentence{i} ")).collect();
    format!(
        r#"{{"model":"{model}","max_tokens":2,"messages":[{{"role":"system","content":"{text}"}},{{"role":"user","content":"go"}}]}}"#
    )
}

fn post(addr: SocketAddr, model: &str, doc: usize) -> Response {
    Client::connect(addr).post("/v1/chat/completions", &body(model, doc), &[])
}

/// The gateway's `/v1/models` entries as `(id, parent)`.
fn listed(addr: SocketAddr) -> Vec<(String, Option<String>)> {
    let r = Client::connect(addr).get("/v1/models");
    assert_eq!(r.status, 200);
    r.json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["id"].as_str().unwrap().to_string(),
                m["parent"].as_str().map(str::to_string),
            )
        })
        .collect()
}

fn wait_listed(addr: SocketAddr, adapter: &str) {
    let seen = eventually(Duration::from_secs(10), || {
        listed(addr).iter().any(|(id, _)| id == adapter)
    });
    assert!(
        seen,
        "the gateway never learned `{adapter}`: {:?}",
        listed(addr)
    );
}

fn matched(r: &Response) -> u32 {
    r.header("x-router-match-blocks").unwrap().parse().unwrap()
}

fn cached(r: &Response) -> u64 {
    r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0)
}

fn adapter_requests_go_only_to_engines_serving_it(io: &str) {
    let plain = engine(io, &[]);
    let with_a = engine(io, &["a"]);
    let gw = gateway(io, &[&plain, &with_a]);
    let addr = gw.local_addr();
    wait_listed(addr, "a");
    // Listed with its parent, as vLLM does; the base model has none.
    let models = listed(addr);
    assert!(
        models.contains(&("a".into(), Some("sim".into()))),
        "{models:?}"
    );
    assert!(models.contains(&("sim".into(), None)), "{models:?}");
    // Every request for `a`, whatever its prompt, goes to e1 (prefix-aware would
    // otherwise spread distinct documents over both).
    for doc in 0..12 {
        let r = post(addr, "a", doc);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("x-router-backend"), Some("e1"));
    }
    // The base model still goes to both. New documents on an idle fleet go to the
    // cache with the most free room: e0 first (e1 holds the adapter's twelve), then
    // both once they hold about as much.
    let mut homes = std::collections::HashSet::new();
    for doc in 100..140 {
        let r = post(addr, "sim", doc);
        assert_eq!(r.status, 200, "{}", r.text());
        homes.insert(r.header("x-router-backend").unwrap().to_string());
        if homes.len() == 2 {
            break;
        }
    }
    assert_eq!(homes.len(), 2, "{homes:?}");
    // The admin API says who serves what.
    let r = admin(gw.admin_addr().unwrap(), "GET", "/admin/backends", "");
    let backends = r.json();
    assert_eq!(backends[1]["adapters"], serde_json::json!(["a"]));
    assert_eq!(backends[0]["adapters"], serde_json::json!([]));
}
both_drivers!(adapter_requests_go_only_to_engines_serving_it);

fn an_adapter_nobody_serves_is_an_unknown_model(io: &str) {
    let with_a = engine(io, &["a"]);
    let gw = gateway(io, &[&with_a]);
    let addr = gw.local_addr();
    wait_listed(addr, "a");
    let r = post(addr, "b", 0);
    assert_eq!(r.status, 404, "{}", r.text());
    assert_eq!(
        r.error_param_code(),
        (Some("model".into()), "model_not_found".into())
    );
    assert!(r.text().contains("`b` does not exist"), "{}", r.text());
    // The engine stopping takes the adapter's only home away: the gateway answers
    // that it has no healthy backend (a 5xx), not that the adapter is unknown.
    with_a.stop();
    let down = eventually(Duration::from_secs(10), || {
        let r = post(addr, "a", 0);
        r.status >= 500 && r.error_param_code().1 != "model_not_found"
    });
    assert!(
        down,
        "requests for `a` did not fail over to a 5xx with its engine gone"
    );
}
both_drivers!(an_adapter_nobody_serves_is_an_unknown_model);

fn an_adapters_blocks_never_match_the_base_models(io: &str) {
    let e = engine(io, &["a", "b"]);
    let gw = gateway(io, &[&e]);
    let addr = gw.local_addr();
    wait_listed(addr, "b");
    // The base model caches the document; the same prompt for `a` matches nothing,
    // in the gateway's index and in the engine's cache.
    let first = post(addr, "sim", 1);
    assert_eq!(first.status, 200);
    wait_replicated(addr);
    let again = post(addr, "sim", 1);
    assert!(
        matched(&again) > 10,
        "the base model's own blocks did not match"
    );
    assert!(cached(&again) > 100);
    let a = post(addr, "a", 1);
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(matched(&a), 0, "an adapter matched the base model's blocks");
    assert_eq!(
        cached(&a),
        0,
        "the engine gave an adapter the base model's cache"
    );
    wait_replicated(addr);
    // Then `a` has its own blocks, which `b` does not match either.
    let a2 = post(addr, "a", 1);
    assert!(matched(&a2) > 10, "the adapter's own blocks did not match");
    assert!(cached(&a2) > 100);
    let b = post(addr, "b", 1);
    assert_eq!(matched(&b), 0, "one adapter matched another's blocks");
    assert_eq!(cached(&b), 0);
    // And a fresh base-model document never matches what an adapter cached.
    let a3 = post(addr, "a", 2);
    assert_eq!(a3.status, 200);
    wait_replicated(addr);
    let base = post(addr, "sim", 2);
    assert_eq!(
        matched(&base),
        0,
        "the base model matched an adapter's blocks"
    );
    assert_eq!(cached(&base), 0);
}
both_drivers!(an_adapters_blocks_never_match_the_base_models);

fn an_adapter_on_an_engine_added_later_becomes_routable(io: &str) {
    let plain = engine(io, &[]);
    let gw = gateway(io, &[&plain]);
    let addr = gw.local_addr();
    assert_eq!(post(addr, "late", 0).status, 404);
    let later = engine(io, &["late"]);
    let r = admin(
        gw.admin_addr().unwrap(),
        "POST",
        "/admin/backends",
        &format!(
            r#"{{"id":"e1","url":"{}","models":["sim"],"cache_blocks":512}}"#,
            later.url()
        ),
    );
    assert!(r.status < 300, "{} {}", r.status, r.text());
    wait_listed(addr, "late");
    for doc in 0..4 {
        let r = post(addr, "late", doc);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("x-router-backend"), Some("e1"));
    }
    // Removed again: unknown once more.
    let r = admin(gw.admin_addr().unwrap(), "DELETE", "/admin/backends/e1", "");
    assert!(r.status < 300, "{} {}", r.status, r.text());
    let gone = eventually(Duration::from_secs(5), || {
        post(addr, "late", 0).status == 404
    });
    assert!(
        gone,
        "the adapter stayed routable after its engine was removed"
    );
    assert!(!listed(addr).iter().any(|(id, _)| id == "late"));
}
both_drivers!(an_adapter_on_an_engine_added_later_becomes_routable);

fn admin(addr: SocketAddr, method: &str, path: &str, body: &str) -> Response {
    let mut c = Client::connect(addr);
    c.send(
        format!(
            "{method} {path} HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    );
    c.read_response()
}
