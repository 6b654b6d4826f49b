//! The admin API over real sockets: token protection, backend and index views, and
//! draining a backend under load with zero errors.

mod common;

use common::*;
use radixgate::engine_sim::EngineConfig;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

const TOKEN: &str = "test-admin-token-0123456789";

fn token_file() -> String {
    let path = std::env::temp_dir().join(format!("radixgate-admin-token-{}", std::process::id()));
    std::fs::write(&path, format!("{TOKEN}\n")).unwrap();
    path.display().to_string()
}

fn admin(addr: SocketAddr, method: &str, path: &str, token: Option<&str>) -> Response {
    let mut c = Client::connect(addr);
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    c.send(
        format!("{method} {path} HTTP/1.1\r\nHost: a\r\n{auth}Content-Length: 0\r\n\r\n")
            .as_bytes(),
    );
    c.read_response()
}

fn gateway(io: &str, engines: &[&radixgate::engine_sim::EngineHandle]) -> radixgate::Gateway {
    let backends: Vec<_> = engines
        .iter()
        .enumerate()
        .map(|(i, e)| (["e0", "e1"][i], e.url(), "sim"))
        .collect();
    start_gateway(
        io,
        2,
        &format!("[routing]\npolicy = \"round_robin\"\n[admin]\nlisten = \"127.0.0.1:0\"\ntoken_file = \"{}\"", token_file()),
        &backends,
    )
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
    assert_eq!(
        admin(addr, "POST", "/admin/reload", Some(TOKEN)).status,
        501
    );
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
