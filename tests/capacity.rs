//! The capacity signal over real sockets: a gateway in front of simulated engines
//! under a light and then a heavy closed-loop load shows, in `GET /admin/capacity`
//! and on `/metrics`, a recommendation that follows the model (recomputed here from
//! the reported inputs) and rises with the load, and falls back to zero once the
//! load is gone; the endpoint keeps the admin API's auth and method rules.

mod common;

use common::*;
use radixgate::engine_sim::EngineConfig;
use radixgate_orchestrator::capacity::{recommend, CapacityInput};
use serde_json::Value;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

fn admin(addr: SocketAddr, method: &str, path: &str, token: Option<&str>) -> Response {
    let mut c = Client::connect(addr);
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    c.send(
        format!("{method} {path} HTTP/1.1\r\nHost: a\r\n{auth}Content-Length: 0\r\n\r\n")
            .as_bytes(),
    );
    c.read_response()
}

/// `clients` closed-loop clients, each sending one chat request after another
/// until `stop` is set; `done` counts answers.
fn load(
    addr: SocketAddr,
    clients: usize,
    stop: &Arc<AtomicBool>,
    done: &Arc<AtomicU64>,
) -> Vec<JoinHandle<()>> {
    (0..clients)
        .map(|i| {
            let (stop, done) = (stop.clone(), done.clone());
            std::thread::spawn(move || {
                let mut c = Client::connect(addr);
                let body = chat_body(&format!("client {i} asks"), false);
                while !stop.load(Ordering::Relaxed) {
                    let r = c.post("/v1/chat/completions", &body, &[]);
                    assert_eq!(r.status, 200, "{}", r.text());
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect()
}

fn pool(report: &Value) -> Option<Value> {
    report["pools"]
        .as_array()?
        .iter()
        .find(|p| p["pool"] == "sim")
        .cloned()
}

/// The report's answer is the orchestrator's for the report's own inputs, and keeps
/// utilisation below 1.
fn check_model(report: &Value, p: &Value) {
    let i = &p["inputs"];
    let expected = recommend(&CapacityInput {
        arrival_rate: i["arrival_rate"].as_f64().unwrap(),
        service_seconds: i["service_seconds"].as_f64().unwrap(),
        wait_budget_seconds: i["wait_budget_seconds"].as_f64().unwrap(),
        slots: report["engine_slots"].as_u64().unwrap() as u32,
        quantile: report["quantile"].as_f64().unwrap(),
    });
    assert_eq!(
        p["recommended_engines"].as_u64(),
        Some(u64::from(expected.engines)),
        "{p}"
    );
    assert!(p["model"]["utilisation"].as_f64().unwrap() < 1.0, "{p}");
}

fn recommendation_follows_load(io: &str) {
    // 40 ms per request (4 tokens × 10 ms), no engine queueing (64 slots each).
    let engine = || {
        start_engine(
            io,
            EngineConfig {
                decode_per_token: Duration::from_millis(10),
                prefill_per_token: Duration::from_micros(20),
                max_batch: 64,
                ..EngineConfig::new("sim")
            },
        )
    };
    let engines = [engine(), engine()];
    // The model sizes engines of 2 slots: 8 clients (≈ 8 Erlangs) need at least 5.
    let extra = format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\ntoken_file = \"{}\"\n\
         [health]\nscrape_interval_ms = 100\n\
         [capacity]\nengine_slots = 2\ninterval_ms = 100\nwindow_ms = 1000\nttft_slo_ms = 2000\n",
        token_file()
    );
    let backends: Vec<_> = engines
        .iter()
        .enumerate()
        .map(|(i, e)| (["e0", "e1"][i], e.url(), "sim"))
        .collect();
    let gw = start_gateway(io, 2, &extra, &backends);
    let (addr, admin_addr) = (gw.local_addr(), gw.admin_addr().unwrap());
    let report = || admin(admin_addr, "GET", "/admin/capacity", Some(TOKEN)).json();

    // The endpoint is the admin API's: token and method rules.
    assert_eq!(
        admin(admin_addr, "GET", "/admin/capacity", None).status,
        401
    );
    let post = admin(admin_addr, "POST", "/admin/capacity", Some(TOKEN));
    assert_eq!(post.status, 405);
    assert!(post.json()["error"]["message"].is_string());

    // Light load: one client.
    let (stop, done) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicU64::new(0)),
    );
    let clients = load(addr, 1, &stop, &done);
    let mut light = Value::Null;
    assert!(
        eventually(Duration::from_secs(20), || {
            let r = report();
            match pool(&r) {
                // A whole window of the light load.
                Some(p)
                    if p["inputs"]["requests"].as_u64() >= Some(10)
                        && r["window_seconds"].as_f64() >= Some(0.9) =>
                {
                    check_model(&r, &p);
                    light = p;
                    true
                }
                _ => false,
            }
        }),
        "no light-load report: {}",
        report()
    );
    stop.store(true, Ordering::Relaxed);
    clients.into_iter().for_each(|c| c.join().unwrap());
    let light_erlangs = light["model"]["offered_erlangs"].as_f64().unwrap();
    let light_engines = light["recommended_engines"].as_u64().unwrap();
    assert!(light_engines >= 1, "{light}");
    // Little's law: one closed-loop client keeps at most one request in service
    // (the window's edges may hold part of one more).
    assert!(
        light_erlangs <= 1.2,
        "one client offers about 1 Erlang at most: {light}"
    );

    // Heavy load: eight clients. The window then holds only heavy traffic once its
    // rate is past what one client could offer.
    let (stop, done) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicU64::new(0)),
    );
    let clients = load(addr, 8, &stop, &done);
    let mut heavy = Value::Null;
    let rose = eventually(Duration::from_secs(20), || {
        let r = report();
        match pool(&r) {
            Some(p)
                if p["model"]["offered_erlangs"].as_f64() > Some(2.0 * light_erlangs.max(0.5)) =>
            {
                check_model(&r, &p);
                heavy = p;
                true
            }
            _ => false,
        }
    });
    // /metrics shows the same figure as the admin API (both read one report).
    let same = eventually(Duration::from_secs(10), || {
        let before = pool(&report()).unwrap()["recommended_engines"].as_f64();
        let m = Client::connect(addr).get("/metrics").text();
        let shown = metric(&m, "radixgate_capacity_recommended_engines{pool=\"sim\"}");
        let after = pool(&report()).unwrap()["recommended_engines"].as_f64();
        shown.is_some() && shown == before && shown == after
    });
    let busy = eventually(Duration::from_secs(10), || {
        pool(&report()).unwrap()["observed"]["busy_engines"].as_u64() >= Some(1)
    });
    stop.store(true, Ordering::Relaxed);
    clients.into_iter().for_each(|c| c.join().unwrap());
    assert!(
        rose,
        "the offered load never rose: light {light}, now {}",
        report()
    );
    assert!(same, "/metrics and /admin/capacity disagree");
    assert!(
        busy,
        "the engines' own busy count never showed: {}",
        report()
    );
    let heavy_engines = heavy["recommended_engines"].as_u64().unwrap();
    // More than twice the Erlangs on 2-slot engines: strictly more engines.
    assert!(
        heavy_engines > light_engines,
        "light {light}\nheavy {heavy}"
    );
    assert_eq!(heavy["observed"]["engines"], 2);
    let m = Client::connect(addr).get("/metrics").text();
    for family in [
        "radixgate_capacity_arrival_rate{pool=\"sim\"}",
        "radixgate_capacity_service_seconds{pool=\"sim\"}",
        "radixgate_capacity_busy_engines{pool=\"sim\"}",
        "radixgate_capacity_ttft_slo_seconds",
    ] {
        assert!(metric(&m, family).is_some(), "{family} missing");
    }
    assert_eq!(metric(&m, "radixgate_capacity_ttft_slo_seconds"), Some(2.0));
    // Every capacity family is in the metrics table (docs/operations.md).
    let documented = documented_metrics();
    let families: Vec<&str> = m
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE radixgate_capacity_"))
        .collect();
    assert_eq!(families.len(), 10, "{m}");
    for f in families {
        let name = format!("radixgate_capacity_{}", f.split(' ').next().unwrap());
        assert!(documented.contains(&name), "{name} is not documented");
    }

    // No load: once the window has no request left, no engine is needed.
    assert!(
        eventually(Duration::from_secs(10), || {
            pool(&report()).unwrap()["recommended_engines"].as_u64() == Some(0)
        }),
        "the recommendation did not fall back: {}",
        report()
    );
    drop(gw);
}
both_drivers!(recommendation_follows_load);
