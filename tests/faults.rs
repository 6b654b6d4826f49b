//! Fault injection with bounded load runs and exact counts: a backend killed under
//! load, a 503 storm that opens the breaker and recovers through half-open, a slow
//! backend that times out and is routed around. Both I/O drivers.

mod common;

use common::*;
use radixgate::engine_sim::{self, EngineConfig};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

fn body(i: usize) -> String {
    format!(
        r#"{{"model":"sim","max_tokens":4,"messages":[{{"role":"user","content":"request {i} {}"}}]}}"#,
        "x".repeat(100)
    )
}

/// `threads` clients each sending `per_thread` requests on one keep-alive
/// connection; returns how many got each status.
fn load(
    addr: SocketAddr,
    threads: usize,
    per_thread: usize,
) -> std::collections::BTreeMap<u16, usize> {
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            std::thread::spawn(move || {
                let mut c = Client::connect(addr);
                (0..per_thread)
                    .map(|i| {
                        c.post("/v1/chat/completions", &body(t * 1000 + i), &[])
                            .status
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let mut counts = std::collections::BTreeMap::new();
    for h in handles {
        for s in h.join().unwrap() {
            *counts.entry(s).or_insert(0) += 1;
        }
    }
    counts
}

fn paced_engine(io: &str) -> engine_sim::EngineHandle {
    let mut cfg = EngineConfig::instant("sim");
    cfg.decode_per_token = Duration::from_millis(3);
    start_engine(io, cfg)
}

fn backend_killed_under_load(io: &str) {
    let engines: Vec<_> = (0..3).map(|_| paced_engine(io)).collect();
    let backends: Vec<_> = engines
        .iter()
        .enumerate()
        .map(|(i, e)| (["e0", "e1", "e2"][i], e.url(), "sim"))
        .collect();
    let gw = start_gateway(io, 2, "[routing]\npolicy = \"round_robin\"", &backends);
    let addr = gw.local_addr();
    let mut engines = engines;
    let victim = engines.remove(1);
    // Killed once it has answered ten of its ~107 requests: under load however fast
    // or slow this host runs.
    let killer = std::thread::spawn(move || {
        let answered = || {
            let m = Client::connect(addr).get("/metrics").text();
            metric_sum(&m, "radixgate_requests_total{backend=\"e1\",status=\"200\"")
        };
        assert!(eventually(Duration::from_secs(10), || answered() >= 10.0));
        victim.stop();
    });
    let counts = load(addr, 8, 40);
    killer.join().unwrap();
    assert_eq!(
        counts.get(&200),
        Some(&320),
        "every request answered 200: {counts:?}"
    );
    let m = Client::connect(addr).get("/metrics").text();
    assert!(
        metric(&m, "radixgate_retries_total{backend=\"e1\"}").unwrap() >= 1.0,
        "the kill was retried around:\n{m}"
    );
}
both_drivers!(backend_killed_under_load);

fn storm_of_503_opens_breaker_then_recovers(io: &str) {
    let mut bad_cfg = EngineConfig::instant("sim");
    bad_cfg.fail_rate = 1.0;
    let bad = start_engine(io, bad_cfg);
    let bad_addr = bad.addr();
    let good = start_engine(io, EngineConfig::instant("sim"));
    let gw = start_gateway(
        io,
        1,
        // open_ms well past the 40 requests' time even on a loaded host: a breaker
        // that half-opened during them would let a probe fail there too.
        "[routing]\npolicy = \"round_robin\"\n[breaker]\nfailure_threshold = 3\nopen_ms = 3000\n[health]\ninterval_ms = 60000",
        &[("bad", bad.url(), "sim"), ("good", good.url(), "sim")],
    );
    let addr = gw.local_addr();
    let mut c = Client::connect(addr);
    for i in 0..40 {
        let r = c.post("/v1/chat/completions", &body(i), &[]);
        assert_eq!(r.status, 200, "request {i}: {}", r.text());
        assert_eq!(r.header("x-router-backend"), Some("good"));
    }
    let m = c.get("/metrics").text();
    assert_eq!(
        metric(&m, "radixgate_breaker_state{backend=\"bad\"}"),
        Some(2.0),
        "{m}"
    );
    // The threshold's 3 failures reached the bad backend, plus those routed while
    // the coordinator's "open" snapshot was on its way to the shard (a few on a
    // loaded host); once the shard has it, none.
    let failures = metric(&m, "radixgate_retries_total{backend=\"bad\"}").unwrap();
    assert!(
        (3.0..20.0).contains(&failures),
        "{failures} failures reached it:\n{m}"
    );
    for i in 40..80 {
        let r = c.post("/v1/chat/completions", &body(i), &[]);
        assert_eq!(r.status, 200, "request {i}: {}", r.text());
        assert_eq!(r.header("x-router-backend"), Some("good"));
    }
    let m = c.get("/metrics").text();
    assert_eq!(
        metric(&m, "radixgate_retries_total{backend=\"bad\"}"),
        Some(failures),
        "no request reached the open breaker's backend:\n{m}"
    );

    // The backend comes back (same address); after open_ms a probe closes the breaker.
    bad.stop();
    let _fixed = engine_sim::start(EngineConfig::instant("sim"), bad_addr, driver(io)).unwrap();
    let recovered = eventually(Duration::from_secs(10), || {
        let r = c.post("/v1/chat/completions", &body(99), &[]);
        assert_eq!(r.status, 200);
        r.header("x-router-backend") == Some("bad")
    });
    assert!(recovered, "traffic never returned to the recovered backend");
    let closed = eventually(Duration::from_secs(5), || {
        let m = Client::connect(addr).get("/metrics").text();
        metric(&m, "radixgate_breaker_state{backend=\"bad\"}") == Some(0.0)
    });
    assert!(closed, "the breaker never closed after a good probe");
}
both_drivers!(storm_of_503_opens_breaker_then_recovers);

fn half_open_admits_only_bounded_probes(io: &str) {
    // A backend that hangs: while half-open, only one probe per shard may be in flight.
    let hang = ScriptedUpstream::start(Script::Silent);
    let good = start_engine(io, EngineConfig::instant("sim"));
    let gw = start_gateway(
        io,
        1,
        "[routing]\npolicy = \"round_robin\"\n[breaker]\nfailure_threshold = 1\nopen_ms = 100\nhalf_open_probes = 1\n[upstream]\nfirst_byte_timeout_ms = 1500\n[health]\ninterval_ms = 60000\n[retry]\nmax_attempts = 1",
        &[("hang", hang.url(), "sim"), ("good", good.url(), "sim")],
    );
    let addr = gw.local_addr();
    // Open the breaker with one timeout.
    let r = Client::connect(addr).post("/v1/chat/completions", &body(0), &[]);
    let first = r.header("x-router-backend").unwrap().to_string();
    if first == "good" {
        let r = Client::connect(addr).post("/v1/chat/completions", &body(1), &[]);
        assert_eq!(r.status, 504);
    } else {
        assert_eq!(r.status, 504);
    }
    pause(Duration::from_millis(200)); // past open_ms: half-open
    let seen_before = hang.seen().len();
    let done = Arc::new(AtomicUsize::new(0));
    let handles: Vec<_> = (0..10)
        .map(|i| {
            let done = done.clone();
            std::thread::spawn(move || {
                let r = Client::connect(addr).post("/v1/chat/completions", &body(10 + i), &[]);
                done.fetch_add(1, Ordering::SeqCst);
                r.status
            })
        })
        .collect();
    let statuses: Vec<u16> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let probes = hang.seen().len() - seen_before;
    assert_eq!(probes, 1, "half-open let {probes} requests through");
    assert_eq!(
        statuses.iter().filter(|s| **s == 200).count(),
        9,
        "{statuses:?}"
    );
}
both_drivers!(half_open_admits_only_bounded_probes);

fn slow_backend_times_out_and_is_routed_around(io: &str) {
    let mut slow_cfg = EngineConfig::instant("sim");
    slow_cfg.spike_rate = 1.0;
    slow_cfg.spike = Duration::from_secs(3);
    let slow = start_engine(io, slow_cfg);
    let fast = start_engine(io, EngineConfig::instant("sim"));
    let gw = start_gateway(
        io,
        1,
        "[routing]\npolicy = \"round_robin\"\n[upstream]\nfirst_byte_timeout_ms = 200\n[health]\ninterval_ms = 60000",
        &[("slow", slow.url(), "sim"), ("fast", fast.url(), "sim")],
    );
    let mut c = Client::connect(gw.local_addr());
    for i in 0..6 {
        let r = c.post("/v1/chat/completions", &body(i), &[]);
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-router-backend"), Some("fast"));
    }
    let m = c.get("/metrics").text();
    assert!(metric(&m, "radixgate_retries_total{backend=\"slow\"}").unwrap() >= 1.0);
}
both_drivers!(slow_backend_times_out_and_is_routed_around);

fn retry_budget_bounds_retries(io: &str) {
    let mut bad_cfg = EngineConfig::instant("sim");
    bad_cfg.fail_rate = 1.0;
    let bad = start_engine(io, bad_cfg.clone());
    let bad2 = start_engine(io, bad_cfg);
    // Breaker effectively off; no floor; 10% budget.
    let gw = start_gateway(
        io,
        1,
        "[routing]\npolicy = \"round_robin\"\n[breaker]\nfailure_threshold = 1000000\n[retry]\nbudget_ratio = 0.1\nmin_retries_per_sec = 0\n[health]\ninterval_ms = 60000",
        &[("b0", bad.url(), "sim"), ("b1", bad2.url(), "sim")],
    );
    let mut c = Client::connect(gw.local_addr());
    for i in 0..100 {
        assert_eq!(c.post("/v1/chat/completions", &body(i), &[]).status, 503);
    }
    let m = c.get("/metrics").text();
    let retries = metric(&m, "radixgate_retries_total{backend=\"b0\"}").unwrap()
        + metric(&m, "radixgate_retries_total{backend=\"b1\"}").unwrap();
    // 10 initial tokens + 10% of 100 requests.
    assert!(retries <= 20.0, "{retries} retries for 100 requests");
    assert!(metric(&m, "radixgate_retry_budget_exhausted_total").unwrap() >= 80.0);
}
both_drivers!(retry_budget_bounds_retries);
