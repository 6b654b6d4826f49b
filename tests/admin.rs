//! The admin API over real sockets: token protection, backend and index views,
//! draining, adding and removing backends under load with zero errors, refused
//! changes, config reload through the endpoint (backends, policy, tenants and their
//! quotas, server limits) and `GET /admin/config`.

mod common;

use common::*;
use radixgate::engine_sim::EngineConfig;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

fn admin(addr: SocketAddr, method: &str, path: &str, token: Option<&str>) -> Response {
    admin_with_body(addr, method, path, token, "")
}

fn admin_with_body(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: &str,
) -> Response {
    let mut c = Client::connect(addr);
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    c.send(
        format!(
            "{method} {path} HTTP/1.1\r\nHost: a\r\n{auth}Content-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    );
    c.read_response()
}

fn admin_extra(policy: &str) -> String {
    format!(
        "[routing]\npolicy = \"{policy}\"\n[admin]\nlisten = \"127.0.0.1:0\"\ntoken_file = \"{}\"",
        token_file()
    )
}

fn gateway(io: &str, engines: &[&radixgate::engine_sim::EngineHandle]) -> radixgate::Gateway {
    let backends: Vec<_> = engines
        .iter()
        .enumerate()
        .map(|(i, e)| (["e0", "e1"][i], e.url(), "sim"))
        .collect();
    start_gateway(io, 2, &admin_extra("round_robin"), &backends)
}

fn admin_requires_the_token(io: &str) {
    let e0 = start_engine(io, EngineConfig::instant("sim"));
    let gw = gateway(io, &[&e0]);
    let addr = gw.admin_addr().expect("admin listens");
    for token in [None, Some("wrong-token-wrong-token")] {
        let r = admin(addr, "GET", "/admin/backends", token);
        assert_eq!(r.status, 401);
        assert_eq!(r.header("www-authenticate"), Some("Bearer"));
        assert_eq!(r.error_param_code().1, "invalid_api_key");
    }
    let r = admin(addr, "GET", "/admin/backends", Some(TOKEN));
    assert_eq!(r.status, 200);
    let b = &r.json()[0];
    for key in [
        "id",
        "url",
        "healthy",
        "breaker",
        "in_flight",
        "engine",
        "blocks_held",
        "draining",
        "drained",
    ] {
        assert!(b.get(key).is_some(), "missing {key} in {b}");
    }
    assert_eq!(b["breaker"], "closed");
    let r = admin(addr, "GET", "/admin/index", Some(TOKEN));
    assert_eq!(r.status, 200);
    assert!(r.json()["blocks"].is_u64());
    // Started from a string, not a file: nothing to reload.
    let r = admin(addr, "POST", "/admin/reload", Some(TOKEN));
    assert_eq!(
        (r.status, r.error_param_code().1.as_str()),
        (409, "conflict")
    );
    assert_eq!(admin(addr, "GET", "/admin/reload", Some(TOKEN)).status, 405);
    assert_eq!(
        admin(addr, "POST", "/admin/backends/nope/drain", Some(TOKEN)).status,
        404
    );
    assert_eq!(
        admin(addr, "GET", "/admin/nothing", Some(TOKEN)).status,
        404
    );
}
both_drivers!(admin_requires_the_token);

/// The first core this test process may run on (pinning there always works).
fn a_core_we_may_use() -> usize {
    core_affinity::get_core_ids()
        .and_then(|ids| ids.first().map(|c| c.id))
        .expect("the process may run on some core")
}

/// `GET /admin/shards` once every shard thread has recorded its placement (each
/// does as it starts).
fn shards_view(admin_addr: SocketAddr) -> serde_json::Value {
    let mut v = serde_json::Value::Null;
    assert!(eventually(Duration::from_secs(5), || {
        let r = admin(admin_addr, "GET", "/admin/shards", Some(TOKEN));
        assert_eq!(r.status, 200, "{}", r.text());
        v = r.json();
        v["shards"]
            .as_array()
            .is_some_and(|s| s.iter().all(|s| s["thread_id"].is_i64()))
    }));
    v
}

#[allow(clippy::disallowed_methods)] // procfs from the test thread, not a shard
fn shards_view_shows_placement_and_live_counters(io: &str) {
    let e0 = start_engine(io, EngineConfig::instant("sim"));
    let core = a_core_we_may_use();
    let extra = format!("cores = [{core}]\n{}", admin_extra("round_robin"));
    let gw = start_gateway(io, 2, &extra, &[("e0", e0.url(), "sim")]);
    let (addr, admin_addr) = (gw.local_addr(), gw.admin_addr().unwrap());
    // Five requests on one keep-alive connection: all on one shard.
    let mut c = Client::connect(addr);
    for i in 0..5 {
        let r = c.post(
            "/v1/chat/completions",
            &chat_body(&format!("q{i}"), false),
            &[],
        );
        assert_eq!(r.status, 200);
    }
    assert_eq!(admin(admin_addr, "GET", "/admin/shards", None).status, 401);
    assert_eq!(
        admin(admin_addr, "POST", "/admin/shards", Some(TOKEN)).status,
        405
    );
    let v = shards_view(admin_addr);
    let shards = v["shards"].as_array().expect("a list of shards");
    assert_eq!(shards.len(), 2, "{v}");
    let mut requests = Vec::new();
    for (k, s) in shards.iter().enumerate() {
        assert_eq!(s["shard"], k, "{s}");
        assert_eq!(s["thread"], format!("radixgate-shard-{k}"));
        assert_eq!(s["io"], gw.driver().as_str(), "{s}");
        assert_eq!(s["core"], core, "{s}");
        assert_eq!(s["pinned"], true, "{s}");
        // The kernel's view: pinned to exactly that core, and last ran there.
        assert_eq!(s["cpus_allowed"], core.to_string(), "{s}");
        assert_eq!(s["last_cpu"], core, "{s}");
        let tid = s["thread_id"].as_i64().expect("a thread id");
        let comm = std::fs::read_to_string(format!("/proc/self/task/{tid}/comm")).unwrap();
        // The kernel keeps 15 bytes of a thread's name.
        assert_eq!(comm.trim(), &format!("radixgate-shard-{k}")[..15]);
        assert!(s["cpu_seconds"].as_f64().is_some(), "{s}");
        let counters = &s["counters"];
        requests.push((
            counters["requests"].as_u64().expect("live counters"),
            counters["open_connections"].as_u64().unwrap(),
        ));
        assert_eq!(counters["active_requests"], 0, "{s}");
        assert_eq!(counters["in_flight_upstream"], 0, "{s}");
    }
    requests.sort();
    // One shard served all five and still holds the client's connection.
    assert_eq!(requests, vec![(0, 0), (5, 1)], "{v}");
    assert_eq!(v["coordinator_core"], serde_json::Value::Null);
    drop(c);
}
both_drivers!(shards_view_shows_placement_and_live_counters);

fn shards_view_without_pinning(io: &str) {
    let e0 = start_engine(io, EngineConfig::instant("sim"));
    let gw = gateway(io, &[&e0]);
    let v = shards_view(gw.admin_addr().unwrap());
    for s in v["shards"].as_array().unwrap() {
        assert_eq!(s["core"], serde_json::Value::Null, "{s}");
        assert_eq!(s["pinned"], false, "{s}");
        assert!(s["thread_id"].as_i64().unwrap() > 0, "{s}");
    }
}
both_drivers!(shards_view_without_pinning);

fn drain_under_load_loses_nothing(io: &str) {
    let mut cfg = EngineConfig::instant("sim");
    cfg.decode_per_token = Duration::from_millis(2);
    let e0 = start_engine(io, cfg.clone());
    let e1 = start_engine(io, cfg);
    let gw = gateway(io, &[&e0, &e1]);
    let (addr, admin_addr) = (gw.local_addr(), gw.admin_addr().unwrap());
    let drained = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..4)
        .map(|t| {
            let drained = drained.clone();
            std::thread::spawn(move || {
                let mut c = Client::connect(addr);
                let mut after_drain_on_e0 = 0;
                let mut statuses = Vec::new();
                for i in 0..60 {
                    let was_drained = drained.load(Ordering::SeqCst);
                    let r = c.post(
                        "/v1/chat/completions",
                        &chat_body(&format!("t{t} r{i}"), i % 2 == 0),
                        &[],
                    );
                    if was_drained && r.header("x-router-backend") == Some("e0") {
                        after_drain_on_e0 += 1;
                    }
                    statuses.push(r.status);
                }
                (statuses, after_drain_on_e0)
            })
        })
        .collect();
    pause(Duration::from_millis(100));
    let r = admin(admin_addr, "POST", "/admin/backends/e0/drain", Some(TOKEN));
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["draining"], true);
    // Give the snapshot a moment to reach every shard before counting.
    pause(Duration::from_millis(50));
    drained.store(true, Ordering::SeqCst);
    let mut all = Vec::new();
    for w in workers {
        let (statuses, late) = w.join().unwrap();
        assert_eq!(late, 0, "a drained backend got new requests");
        all.extend(statuses);
    }
    assert_eq!(all.len(), 240);
    assert!(all.iter().all(|s| *s == 200), "{all:?}");
    let reports_drained = eventually(Duration::from_secs(5), || {
        admin(admin_addr, "GET", "/admin/backends", Some(TOKEN)).json()[0]["drained"] == true
    });
    assert!(reports_drained);
    // Undrain: e0 takes traffic again.
    assert_eq!(
        admin(
            admin_addr,
            "POST",
            "/admin/backends/e0/undrain",
            Some(TOKEN)
        )
        .status,
        200
    );
    let back = eventually(Duration::from_secs(5), || {
        Client::connect(addr)
            .post("/v1/chat/completions", &chat_body("again", false), &[])
            .header("x-router-backend")
            == Some("e0")
    });
    assert!(back);
}
both_drivers!(drain_under_load_loses_nothing);

/// `threads` clients sending `per_thread` requests each (every other one streaming)
/// while `during` runs; returns every response's (status, backend) and the
/// backends that answered requests started after `during` returned.
fn under_load(
    addr: SocketAddr,
    threads: usize,
    per_thread: usize,
    during: impl FnOnce(),
) -> (Vec<(u16, String)>, Vec<String>) {
    let changed = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let changed = changed.clone();
            std::thread::spawn(move || {
                let mut c = Client::connect(addr);
                let mut all = Vec::new();
                let mut after = Vec::new();
                for i in 0..per_thread {
                    let was_changed = changed.load(Ordering::SeqCst);
                    let r = c.post(
                        "/v1/chat/completions",
                        &chat_body(&format!("t{t} r{i}"), i % 2 == 0),
                        &[],
                    );
                    let backend = r.header("x-router-backend").unwrap_or("").to_string();
                    if was_changed {
                        after.push(backend.clone());
                    }
                    all.push((r.status, backend));
                }
                (all, after)
            })
        })
        .collect();
    pause(Duration::from_millis(100));
    during();
    // Give the snapshot a moment to reach every shard before counting.
    pause(Duration::from_millis(50));
    changed.store(true, Ordering::SeqCst);
    let mut all = Vec::new();
    let mut after = Vec::new();
    for w in workers {
        let (a, b) = w.join().unwrap();
        all.extend(a);
        after.extend(b);
    }
    (all, after)
}

fn slow_engine(io: &str) -> radixgate::engine_sim::EngineHandle {
    let mut cfg = EngineConfig::instant("sim");
    cfg.decode_per_token = Duration::from_millis(2);
    start_engine(io, cfg)
}

fn backend_json(id: &str, url: &str) -> String {
    format!(r#"{{"id":"{id}","url":"{url}","models":["sim"],"cache_blocks":512}}"#)
}

fn add_backend_under_load_takes_traffic(io: &str) {
    let e0 = slow_engine(io);
    let e1 = slow_engine(io);
    let gw = start_gateway(
        io,
        2,
        &admin_extra("round_robin"),
        &[("e0", e0.url(), "sim")],
    );
    let (addr, admin_addr) = (gw.local_addr(), gw.admin_addr().unwrap());
    let (all, after) = under_load(addr, 4, 60, || {
        let r = admin_with_body(
            admin_addr,
            "POST",
            "/admin/backends",
            Some(TOKEN),
            &backend_json("e1", &e1.url()),
        );
        assert_eq!(r.status, 201, "{}", r.text());
        assert_eq!(r.json()["id"], "e1");
        assert_eq!(r.json()["capacity_blocks"], 512);
    });
    assert_eq!(all.len(), 240);
    assert!(all.iter().all(|(s, _)| *s == 200), "{all:?}");
    let on_e1 = after.iter().filter(|b| *b == "e1").count();
    assert!(on_e1 > 0, "the new backend got no traffic: {after:?}");
    let listed = admin(admin_addr, "GET", "/admin/backends", Some(TOKEN)).json();
    let ids: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["e0", "e1"]);
    let m = Client::connect(addr).get("/metrics").text();
    assert!(metric(&m, "radixgate_requests_total{backend=\"e1\",status=\"200\"").is_some());
}
both_drivers!(add_backend_under_load_takes_traffic);

fn remove_backend_under_load_loses_nothing(io: &str) {
    let e0 = slow_engine(io);
    let e1 = slow_engine(io);
    let gw = gateway(io, &[&e0, &e1]);
    let (addr, admin_addr) = (gw.local_addr(), gw.admin_addr().unwrap());
    let (all, after) = under_load(addr, 4, 60, || {
        let r = admin(admin_addr, "DELETE", "/admin/backends/e0", Some(TOKEN));
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()["removed"], true);
    });
    assert_eq!(all.len(), 240);
    assert!(all.iter().all(|(s, _)| *s == 200), "{all:?}");
    assert!(all.iter().any(|(_, b)| b == "e0"), "e0 had traffic before");
    assert!(
        after.iter().all(|b| b == "e1"),
        "a removed backend got new requests: {after:?}"
    );
    let listed = admin(admin_addr, "GET", "/admin/backends", Some(TOKEN)).json();
    assert_eq!(listed.as_array().unwrap().len(), 1);
    assert_eq!(listed[0]["id"], "e1");
    // Its index entries are gone, and it is gone from the per-backend gauges.
    let index = admin(admin_addr, "GET", "/admin/index", Some(TOKEN)).json();
    assert!(index["blocks_per_backend"].get("e0").is_none(), "{index}");
    let m = Client::connect(addr).get("/metrics").text();
    assert!(metric(&m, "radixgate_backend_in_flight{backend=\"e0\"}").is_none());
    // The same id can come back (in a new slot) and takes traffic again.
    let r = admin_with_body(
        admin_addr,
        "POST",
        "/admin/backends",
        Some(TOKEN),
        &backend_json("e0", &e0.url()),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    let back = eventually(Duration::from_secs(5), || {
        Client::connect(addr)
            .post("/v1/chat/completions", &chat_body("again", false), &[])
            .header("x-router-backend")
            == Some("e0")
    });
    assert!(back);
}
both_drivers!(remove_backend_under_load_loses_nothing);

fn bad_backend_changes_are_refused(io: &str) {
    let e0 = start_engine(io, EngineConfig::instant("sim"));
    let gw = gateway(io, &[&e0]);
    let admin_addr = gw.admin_addr().unwrap();
    let add =
        |body: &str| admin_with_body(admin_addr, "POST", "/admin/backends", Some(TOKEN), body);
    let r = add(&backend_json("e0", &e0.url()));
    assert_eq!(
        (r.status, r.error_param_code().1.as_str()),
        (409, "conflict")
    );
    assert!(r.text().contains("`e0` already exists"), "{}", r.text());
    for (body, needle) in [
        (backend_json("e9", "127.0.0.1:9"), "backend.url"),
        (backend_json("e9", "http://example.com:80"), "IP address"),
        (backend_json("e9", "http://127.0.0.1:99999"), "invalid port"),
        (backend_json("", "http://127.0.0.1:9"), "backend.id"),
        (
            r#"{"id":"e9","url":"http://127.0.0.1:9","models":[]}"#.into(),
            "backend.models",
        ),
        (
            r#"{"id":"e9","url":"http://127.0.0.1:9","models":["sim"],"weight":2}"#.into(),
            "unknown field `weight`",
        ),
        ("not json".into(), "backend:"),
    ] {
        let r = add(&body);
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        assert_eq!(r.error_param_code().1, "invalid_config");
        assert!(r.text().contains(needle), "{needle} not in {}", r.text());
    }
    let r = admin(admin_addr, "DELETE", "/admin/backends/nope", Some(TOKEN));
    assert_eq!(
        (r.status, r.error_param_code().1.as_str()),
        (404, "not_found")
    );
    let r = admin(admin_addr, "DELETE", "/admin/backends/e0", Some(TOKEN));
    assert_eq!(
        (r.status, r.error_param_code().1.as_str()),
        (409, "conflict")
    );
    assert_eq!(
        admin(admin_addr, "DELETE", "/admin/backends/e0", None).status,
        401
    );
    // Nothing changed.
    let listed = admin(admin_addr, "GET", "/admin/backends", Some(TOKEN)).json();
    assert_eq!(listed.as_array().unwrap().len(), 1);
}
both_drivers!(bad_backend_changes_are_refused);

fn adding_a_dead_backend_loses_nothing(io: &str) {
    let e0 = start_engine(io, EngineConfig::instant("sim"));
    let gw = start_gateway(
        io,
        2,
        &format!(
            "{}\n[health]\ninterval_ms = 100\nunhealthy_threshold = 1",
            admin_extra("round_robin")
        ),
        &[("e0", e0.url(), "sim")],
    );
    let (addr, admin_addr) = (gw.local_addr(), gw.admin_addr().unwrap());
    // A port nothing listens on.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_url = format!("http://{}", dead.local_addr().unwrap());
    drop(dead);
    let (all, _) = under_load(addr, 2, 40, || {
        let r = admin_with_body(
            admin_addr,
            "POST",
            "/admin/backends",
            Some(TOKEN),
            &backend_json("dead", &dead_url),
        );
        assert_eq!(r.status, 201, "{}", r.text());
    });
    // Attempts on it fail over before the first byte: no client sees an error.
    assert!(all.iter().all(|(s, b)| *s == 200 && b == "e0"), "{all:?}");
    let out = eventually(Duration::from_secs(5), || {
        admin(admin_addr, "GET", "/admin/backends", Some(TOKEN)).json()[1]["healthy"] == false
    });
    assert!(out, "the health check did not take the dead backend out");
}
both_drivers!(adding_a_dead_backend_loses_nothing);

fn reload_config(io: &str, policy: &str, backends: &[(&str, String, &str)], extra: &str) -> String {
    gateway_toml(
        io,
        2,
        &format!("{extra}\n{}", admin_extra(policy)),
        backends,
    )
}

fn reload_applies_backends_and_policy(io: &str) {
    let e0 = start_engine(io, EngineConfig::instant("sim"));
    let e1 = start_engine(io, EngineConfig::instant("sim"));
    let file = temp_file(
        &format!("reload-{io}.toml"),
        &reload_config(io, "round_robin", &[("e0", e0.url(), "sim")], ""),
    );
    let gw = start_gateway_file(&file);
    let (addr, admin_addr) = (gw.local_addr(), gw.admin_addr().unwrap());
    let r = Client::connect(addr).post("/v1/chat/completions", &chat_body("a", false), &[]);
    assert_eq!(r.header("x-router-reason"), Some("round-robin"));
    // Reloading the same file changes nothing.
    let r = admin(admin_addr, "POST", "/admin/reload", Some(TOKEN));
    assert_eq!(r.status, 200, "{}", r.text());
    let s = r.json();
    assert_eq!(s["changed"], serde_json::json!([]));
    assert_eq!(s["backends"]["added"], serde_json::json!([]));

    // e0 out, e1 in, another policy, a retry setting, and a restart-only key.
    let edited = reload_config(
        io,
        "least_loaded",
        &[("e1", e1.url(), "sim")],
        "[retry]\nmax_attempts = 2",
    )
    .replace("shards = 2", "shards = 3");
    std::fs::write(&file, edited).unwrap();
    let r = admin(admin_addr, "POST", "/admin/reload", Some(TOKEN));
    assert_eq!(r.status, 200, "{}", r.text());
    let s = r.json();
    assert_eq!(s["backends"]["added"], serde_json::json!(["e1"]));
    assert_eq!(s["backends"]["removed"], serde_json::json!(["e0"]));
    assert_eq!(
        s["changed"],
        serde_json::json!([
            "backends.e0",
            "backends.e1",
            "retry.max_attempts",
            "routing.policy"
        ])
    );
    assert_eq!(s["restart_required"], serde_json::json!(["server.shards"]));
    assert_eq!(
        s["keys"][4],
        serde_json::json!({"key": "server.shards", "status": "restart required"})
    );
    let moved = eventually(Duration::from_secs(5), || {
        let r = Client::connect(addr).post("/v1/chat/completions", &chat_body("b", false), &[]);
        r.header("x-router-backend") == Some("e1")
            && r.header("x-router-reason") == Some("least-loaded")
    });
    assert!(moved);
    for i in 0..20 {
        let r = Client::connect(addr).post(
            "/v1/chat/completions",
            &chat_body(&format!("c{i}"), i % 2 == 0),
            &[],
        );
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-router-backend"), Some("e1"));
    }
    // A backend whose url changes is replaced (new slot, its old index entries gone).
    let e2 = start_engine(io, EngineConfig::instant("sim"));
    std::fs::write(
        &file,
        reload_config(
            io,
            "least_loaded",
            &[("e1", e2.url(), "sim")],
            "[retry]\nmax_attempts = 2",
        )
        .replace("shards = 2", "shards = 3"),
    )
    .unwrap();
    let s = admin(admin_addr, "POST", "/admin/reload", Some(TOKEN)).json();
    assert_eq!(s["backends"]["replaced"], serde_json::json!(["e1"]));
    let listed = admin(admin_addr, "GET", "/admin/backends", Some(TOKEN)).json();
    assert_eq!(listed[0]["url"], format!("http://{}", e2.addr()));
    std::fs::remove_file(&file).ok();
}
both_drivers!(reload_applies_backends_and_policy);

fn invalid_reload_keeps_the_running_config(io: &str) {
    let e0 = start_engine(io, EngineConfig::instant("sim"));
    let file = temp_file(
        &format!("bad-reload-{io}.toml"),
        &reload_config(io, "round_robin", &[("e0", e0.url(), "sim")], ""),
    );
    let gw = start_gateway_file(&file);
    let (addr, admin_addr) = (gw.local_addr(), gw.admin_addr().unwrap());
    let invalid = reload_config(io, "smartest", &[("e0", "ftp://x".into(), "sim")], "");
    for (text, needles) in [
        (invalid.as_str(), &["routing.policy", "backends[0].url"][..]),
        ("[server\nlisten = ", &["TOML parse error"][..]),
        ("[routing]\nbogus = 1\n", &["bogus"][..]),
    ] {
        std::fs::write(&file, text).unwrap();
        let r = admin(admin_addr, "POST", "/admin/reload", Some(TOKEN));
        assert_eq!(r.status, 400, "{}", r.text());
        assert_eq!(r.error_param_code().1, "invalid_config");
        for n in needles {
            assert!(r.text().contains(n), "{n} not in {}", r.text());
        }
        assert!(r.text().contains("the running config stays"));
    }
    // Still serving with the old config.
    let r = Client::connect(addr).post("/v1/chat/completions", &chat_body("a", false), &[]);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-router-backend"), Some("e0"));
    assert_eq!(r.header("x-router-reason"), Some("round-robin"));
    // A missing file is refused the same way.
    std::fs::remove_file(&file).unwrap();
    let r = admin(admin_addr, "POST", "/admin/reload", Some(TOKEN));
    assert_eq!(r.status, 400, "{}", r.text());
}
both_drivers!(invalid_reload_keeps_the_running_config);

fn a_models_last_backend_removed_makes_it_unknown(io: &str) {
    let e0 = start_engine(io, EngineConfig::instant("sim"));
    let e1 = start_engine(io, EngineConfig::instant("other"));
    let gw = gateway(io, &[&e0]);
    let (addr, admin_addr) = (gw.local_addr(), gw.admin_addr().unwrap());
    let body = r#"{"model":"other","messages":[{"role":"user","content":"hi"}]}"#;
    let r = admin_with_body(
        admin_addr,
        "POST",
        "/admin/backends",
        Some(TOKEN),
        &format!(r#"{{"id":"o1","url":"{}","models":["other"]}}"#, e1.url()),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    let r = Client::connect(addr).post("/v1/chat/completions", body, &[]);
    assert_eq!((r.status, r.header("x-router-backend")), (200, Some("o1")));
    let models = Client::connect(addr).get("/v1/models").json();
    assert_eq!(models["data"].as_array().unwrap().len(), 2);
    assert_eq!(
        admin(admin_addr, "DELETE", "/admin/backends/o1", Some(TOKEN)).status,
        200
    );
    let gone = eventually(Duration::from_secs(5), || {
        Client::connect(addr)
            .post("/v1/chat/completions", body, &[])
            .status
            == 404
    });
    assert!(gone);
    let r = Client::connect(addr).post("/v1/chat/completions", body, &[]);
    assert_eq!(r.error_param_code().1, "model_not_found");
    let models = Client::connect(addr).get("/v1/models").json();
    assert_eq!(models["data"][0]["id"], "sim");
    assert_eq!(models["data"].as_array().unwrap().len(), 1);
}
both_drivers!(a_models_last_backend_removed_makes_it_unknown);

/// Waits until every shard has installed the snapshot a reload just published: the
/// shards answer `GET /admin/shards` over the same FIFO command channel.
fn installed(admin_addr: SocketAddr) {
    let r = admin(admin_addr, "GET", "/admin/shards", Some(TOKEN));
    assert_eq!(r.status, 200, "{}", r.text());
}

fn tenant_toml(name: &str, key: &str, requests_per_sec: u32) -> String {
    format!(
        "[[tenants]]\nname = \"{name}\"\nkeys = [\"{}\"]\nrequests_per_sec = {requests_per_sec}\n",
        radixgate::tenants::hash_key(key)
    )
}

fn as_tenant(addr: SocketAddr, key: &str, content: &str) -> Response {
    let auth = format!("Bearer {key}");
    Client::connect(addr).post(
        "/v1/chat/completions",
        &chat_body(content, false),
        &[("Authorization", &auth)],
    )
}

fn reload_changes_tenant_quotas_keys_and_limits(io: &str) {
    let e0 = start_engine(io, EngineConfig::instant("sim"));
    let config = |server: &str, tenants: &str| {
        gateway_toml(
            io,
            2,
            &format!(
                "{server}\n[auth]\nrequired = true\n{tenants}\n{}",
                admin_extra("round_robin")
            ),
            &[("e0", e0.url(), "sim")],
        )
    };
    let file = temp_file(
        &format!("reload-tenants-{io}.toml"),
        &config("", &tenant_toml("acme", "sk-acme", 1)),
    );
    let gw = start_gateway_file(&file);
    let (addr, admin_addr) = (gw.local_addr(), gw.admin_addr().unwrap());
    // 1 request/s: the second in a row is refused.
    assert_eq!(as_tenant(addr, "sk-acme", "a").status, 200);
    let r = as_tenant(addr, "sk-acme", "b");
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(as_tenant(addr, "sk-bob", "c").status, 401);
    let long_uri = format!("/v1/models?{}", "q".repeat(100));
    assert_eq!(Client::connect(addr).get(&long_uri).status, 200);

    // A higher limit, a new tenant and a tighter URI limit, without a restart.
    std::fs::write(
        &file,
        config(
            "max_uri_bytes = 64",
            &format!(
                "{}{}",
                tenant_toml("acme", "sk-acme", 1000),
                tenant_toml("bob", "sk-bob", 1000)
            ),
        ),
    )
    .unwrap();
    let r = admin(admin_addr, "POST", "/admin/reload", Some(TOKEN));
    assert_eq!(r.status, 200, "{}", r.text());
    let s = r.json();
    assert_eq!(
        s["keys"],
        serde_json::json!([
            {"key": "server.max_uri_bytes", "status": "applied"},
            {"key": "tenants.acme.requests_per_sec", "status": "applied"},
            {"key": "tenants.bob", "status": "applied"},
        ])
    );
    installed(admin_addr);
    // Far more than 1/s now passes, on every shard.
    for i in 0..20 {
        let r = as_tenant(addr, "sk-acme", &format!("d{i}"));
        assert_eq!(r.status, 200, "request {i} after the reload: {}", r.text());
    }
    assert_eq!(as_tenant(addr, "sk-bob", "e").status, 200);
    let r = Client::connect(addr).get(&long_uri);
    assert_eq!(r.status, 414, "{}", r.text());

    // acme removed: its key stops working at once; bob's still works.
    std::fs::write(&file, config("", &tenant_toml("bob", "sk-bob", 1000))).unwrap();
    let s = admin(admin_addr, "POST", "/admin/reload", Some(TOKEN)).json();
    assert_eq!(
        s["changed"],
        serde_json::json!(["server.max_uri_bytes", "tenants.acme"])
    );
    installed(admin_addr);
    assert_eq!(as_tenant(addr, "sk-acme", "f").status, 401);
    assert_eq!(as_tenant(addr, "sk-bob", "g").status, 200);
    // The removed tenant's slot still labels the 429 it got.
    let m = Client::connect(addr).get("/metrics").text();
    assert!(m.contains("tenant=\"acme\""), "{m}");
    std::fs::remove_file(&file).ok();
}
both_drivers!(reload_changes_tenant_quotas_keys_and_limits);

fn admin_config_shows_what_is_in_force(io: &str) {
    let e0 = start_engine(io, EngineConfig::instant("sim"));
    let e1 = start_engine(io, EngineConfig::instant("sim"));
    let digest = radixgate::tenants::hash_key("sk-acme");
    let file = temp_file(
        &format!("admin-config-{io}.toml"),
        &reload_config(
            io,
            "round_robin",
            &[("e0", e0.url(), "sim")],
            &tenant_toml("acme", "sk-acme", 5),
        ),
    );
    let gw = start_gateway_file(&file);
    let admin_addr = gw.admin_addr().unwrap();
    assert_eq!(admin(admin_addr, "GET", "/admin/config", None).status, 401);
    assert_eq!(
        admin(
            admin_addr,
            "GET",
            "/admin/config",
            Some("wrong-token-0123456789")
        )
        .status,
        401
    );
    assert_eq!(
        admin(admin_addr, "POST", "/admin/config", Some(TOKEN)).status,
        405
    );
    let r = admin(admin_addr, "GET", "/admin/config", Some(TOKEN));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("content-type"), Some("application/json"));
    let text = r.text();
    assert!(!text.contains(&digest), "a key digest is shown: {text}");
    assert!(!text.contains(TOKEN), "the admin token is shown: {text}");
    let shown = r.json();
    let c = &shown["config"];
    assert_eq!(shown["source"], file.display().to_string());
    assert_eq!(c["routing"]["policy"], "round_robin");
    assert_eq!(c["routing"]["index_touch_ms"], 100, "defaults are shown");
    assert_eq!(c["server"]["shards"], 2);
    assert_eq!(c["backends"]["e0"]["url"], e0.url());
    assert_eq!(
        c["tenants"]["acme"]["keys"],
        serde_json::json!(["<redacted>"])
    );
    assert_eq!(c["tenants"]["acme"]["requests_per_sec"], 5.0);

    // A reload: live keys show their new values, a restart-only one its old value.
    std::fs::write(
        &file,
        reload_config(
            io,
            "least_loaded",
            &[("e0", e0.url(), "sim")],
            &format!(
                "[admission]\nqueue_timeout_ms = 777\n{}",
                tenant_toml("acme", "sk-acme", 9)
            ),
        )
        .replace("shards = 2", "shards = 3"),
    )
    .unwrap();
    let r = admin(admin_addr, "POST", "/admin/reload", Some(TOKEN));
    assert_eq!(r.status, 200, "{}", r.text());
    // A backend added through the admin API is in force too.
    let added = admin_with_body(
        admin_addr,
        "POST",
        "/admin/backends",
        Some(TOKEN),
        &backend_json("e1", &e1.url()),
    );
    assert_eq!(added.status, 201, "{}", added.text());
    let r = admin(admin_addr, "GET", "/admin/config", Some(TOKEN));
    assert!(!r.text().contains(&digest));
    let shown = r.json();
    let c = &shown["config"];
    assert_eq!(c["routing"]["policy"], "least_loaded");
    assert_eq!(c["admission"]["queue_timeout_ms"], 777);
    assert_eq!(c["tenants"]["acme"]["requests_per_sec"], 9.0);
    assert_eq!(c["server"]["shards"], 2, "restart-only: as running");
    assert_eq!(
        shown["restart_pending"],
        serde_json::json!(["server.shards"])
    );
    assert_eq!(c["backends"]["e1"]["url"], e1.url());
    std::fs::remove_file(&file).ok();
}
both_drivers!(admin_config_shows_what_is_in_force);

/// Admission's TTFT estimate follows reloaded `[routing.prefix_aware]` knobs (the
/// shards' cost model used to be built once at start).
fn reload_changes_what_admission_estimates(io: &str) {
    let e0 = start_engine(io, EngineConfig::instant("sim"));
    let config = |prefill_us: u32| {
        reload_config(
            io,
            "round_robin",
            &[("e0", e0.url(), "sim")],
            &format!("[routing.prefix_aware]\nprefill_us_per_token = {prefill_us}"),
        )
    };
    let file = temp_file(&format!("reload-admission-{io}.toml"), &config(1_000_000));
    let gw = start_gateway_file(&file);
    let (addr, admin_addr) = (gw.local_addr(), gw.admin_addr().unwrap());
    let prompt = "a long enough prompt to fill several blocks ".repeat(8);
    let ask = || {
        Client::connect(addr).post(
            "/v1/chat/completions",
            &chat_body(&prompt, false),
            &[("X-SLO-TTFT-Ms", "1000")],
        )
    };
    // One second per uncached token: no budget of a second can be met.
    let r = ask();
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.error_param_code().1, "slo_unattainable");
    std::fs::write(&file, config(1)).unwrap();
    let s = admin(admin_addr, "POST", "/admin/reload", Some(TOKEN)).json();
    assert_eq!(
        s["changed"],
        serde_json::json!(["routing.prefix_aware.prefill_us_per_token"])
    );
    installed(admin_addr);
    let r = ask();
    assert_eq!(r.status, 200, "{}", r.text());
    std::fs::remove_file(&file).ok();
}
both_drivers!(reload_changes_what_admission_estimates);
