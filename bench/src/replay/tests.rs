//! Replay against a tiny std TCP server: turn order, timing, headers, records.

use super::*;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc;
use std::sync::Arc;

/// What the server saw, in order: ("req" or "resp", session, body).
type Log = Arc<Mutex<Vec<(&'static str, String, String)>>>;

/// Reads one request; returns its X-Session-ID and body, `None` at end of stream.
fn read_request(s: &mut TcpStream, buf: &mut Vec<u8>) -> Option<(String, Vec<u8>)> {
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_string();
            let header = |name: &str| {
                head.lines().find_map(|l| {
                    let (n, v) = l.split_once(':')?;
                    n.eq_ignore_ascii_case(name).then(|| v.trim().to_string())
                })
            };
            let len: usize = header("content-length").unwrap().parse().unwrap();
            if buf.len() >= end + 4 + len {
                let body = buf[end + 4..end + 4 + len].to_vec();
                buf.drain(..end + 4 + len);
                return Some((header("x-session-id").unwrap_or_default(), body));
            }
        }
        let n = s.read(&mut chunk).ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Answers every request with usage 100/40 and router headers; a body containing
/// "slow" is answered after 50 ms. Logs (event, session, body) as requests arrive
/// and as responses go out.
fn serve(mut s: TcpStream, log: Log) {
    let (_never, delay) = mpsc::channel::<()>();
    let mut buf = Vec::new();
    while let Some((session, body)) = read_request(&mut s, &mut buf) {
        let body = String::from_utf8(body).unwrap();
        log.lock()
            .unwrap()
            .push(("req", session.clone(), body.clone()));
        if body.contains("slow") {
            let _ = delay.recv_timeout(Duration::from_millis(50));
        }
        let json = r#"{"choices":[],"usage":{"prompt_tokens":100,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":40}}}"#;
        let resp = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Router-Backend: b1\r\nX-Router-Reason: session-affinity\r\nContent-Length: {}\r\n\r\n{json}",
            json.len()
        );
        log.lock().unwrap().push(("resp", session, body));
        s.write_all(resp.as_bytes()).unwrap();
    }
}

fn start_server() -> (Target, Log) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    let shared = log.clone();
    thread::spawn(move || {
        for conn in listener.incoming() {
            let log = shared.clone();
            thread::spawn(move || serve(conn.unwrap(), log));
        }
    });
    (
        Target::parse(&format!("http://{addr}/v1/chat/completions")).unwrap(),
        log,
    )
}

fn line(session: &str, turn: u64, at_ms: f64, tag: &str) -> TraceLine {
    TraceLine {
        session: session.into(),
        turn,
        at_ms,
        body: format!("{{\"model\":\"sim\",\"tag\":\"{tag}\"}}"),
    }
}

#[test]
fn replays_in_session_order_and_records() {
    let (target, log) = start_server();
    // Session a's first turn is slow; its second turn must wait for it, while session
    // b (listed after a's second turn) goes ahead. Session c's line is due at 60 ms
    // of trace time, 30 ms at speedup 2.
    let lines = vec![
        line("a", 0, 0.0, "a0 slow"),
        line("a", 1, 0.0, "a1"),
        line("b", 0, 0.0, "b0"),
        line("b", 1, 0.0, "b1"),
        line("c", 0, 60.0, "c0"),
    ];
    let cfg = ReplayConfig {
        targets: vec![target],
        spread_seed: 1,
        concurrency: 3,
        speedup: 2.0,
        headers: vec![("X-Tenant".into(), "t1".into())],
        timeout: Duration::from_secs(10),
    };
    let r = run(&cfg, &lines).unwrap();
    assert_eq!(r.stats.ok, 5);
    assert_eq!(r.stats.reasons.get("session-affinity"), Some(&5));
    assert_eq!(r.stats.backends.get("b1"), Some(&5));
    assert_eq!((r.stats.prompt_tokens, r.stats.cached_tokens), (500, 200));
    assert_eq!(r.records.len(), 5);
    assert_eq!(r.records[1].session, "a");
    assert_eq!(r.records[1].turn, 1);
    assert!(r.records.iter().all(|x| x.status == Some(200)
        && x.cached_tokens == Some(40)
        && x.reason.as_deref() == Some("session-affinity")));
    assert!(r.records[4].start_ms >= 30.0, "{:?}", r.records[4]);
    assert!(r.records[0].total_ms.unwrap() >= 50.0);

    let log = log.lock().unwrap();
    let at = |event: &str, tag: &str| {
        log.iter()
            .position(|(e, _, b)| *e == event && b.contains(&format!("\"tag\":\"{tag}")))
            .unwrap()
    };
    assert!(at("resp", "a0 slow") < at("req", "a1"), "{log:?}");
    assert!(at("resp", "b0") < at("req", "b1"), "{log:?}");
    assert!(at("req", "b1") < at("req", "a1"), "b waited for a: {log:?}");
    assert!(log
        .iter()
        .all(|(_, s, b)| b.contains(&format!("\"tag\":\"{s}"))));
    let md = crate::report::Report {
        url: "u",
        workload: "trace",
        concurrency: 3,
        stream: false,
        elapsed: r.elapsed,
        stats: &r.stats,
    }
    .to_markdown();
    assert!(
        md.contains("| session-affinity | 5 |") && md.contains("40.0%"),
        "{md}"
    );
    let js = r.records[0].to_json();
    assert!(
        js.starts_with("{\"session\":\"a\",\"turn\":0,\"target\":0,"),
        "{js}"
    );
    assert!(
        js.contains("\"reason\":\"session-affinity\",\"prompt_tokens\":100,\"cached_tokens\":40}"),
        "{js}"
    );
}

#[test]
fn dead_target_records_errors_and_keeps_going() {
    let addr = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let cfg = ReplayConfig {
        targets: vec![Target::parse(&format!("http://{addr}/")).unwrap()],
        spread_seed: 1,
        concurrency: 2,
        speedup: 1.0,
        headers: Vec::new(),
        timeout: Duration::from_secs(1),
    };
    let lines = vec![line("a", 0, 0.0, "x"), line("a", 1, 0.0, "y")];
    let r = run(&cfg, &lines).unwrap();
    assert_eq!(r.stats.errors.get("connect"), Some(&2));
    assert!(r
        .records
        .iter()
        .all(|x| x.error == Some("connect") && x.status.is_none()));
}

/// `replay --plots`: the TTFT distribution, load per backend and hit rate of the run.
#[test]
#[allow(
    clippy::disallowed_methods,
    reason = "a test reads the files written; no shard runs here"
)]
fn writes_plots_of_the_run() {
    let (target, _log) = start_server();
    let lines: Vec<TraceLine> = (0..6)
        .map(|i| line(&format!("s{i}"), 0, 0.0, "x"))
        .collect();
    let cfg = ReplayConfig {
        targets: vec![target],
        spread_seed: 1,
        concurrency: 2,
        speedup: 0.0,
        headers: Vec::new(),
        timeout: Duration::from_secs(10),
    };
    let r = run(&cfg, &lines).unwrap();
    assert_eq!(r.stats.ok, 6);
    let dir = std::env::temp_dir().join(format!("radixgate-replay-plots-{}", std::process::id()));
    let paths = crate::plots::write_run(&dir, "replay-t", "trace t", &r.stats).unwrap();
    let names: Vec<String> = paths
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        [
            "replay-t-ttft.svg",
            "replay-t-load.svg",
            "replay-t-hit-rate.svg"
        ]
    );
    let load = crate::plots::texts(&std::fs::read_to_string(&paths[1]).unwrap());
    assert!(load.iter().any(|t| t == "b1"), "{load:?}");
    assert!(std::fs::read_to_string(&paths[0])
        .unwrap()
        .contains("TTFT (ms)"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Several targets: every request goes to one of them, each gets about its share,
/// turn order still holds across targets, and the choice is the seed's.
#[test]
fn spreads_requests_over_several_targets_at_random() {
    let servers: Vec<(Target, Log)> = (0..3).map(|_| start_server()).collect();
    let lines: Vec<TraceLine> = (0..60)
        .map(|i| {
            line(
                &format!("s{}", i % 10),
                (i / 10) as u64,
                0.0,
                &format!("s{}", i % 10),
            )
        })
        .collect();
    let cfg = ReplayConfig {
        targets: servers.iter().map(|(t, _)| t.clone()).collect(),
        spread_seed: 7,
        concurrency: 4,
        speedup: 0.0,
        headers: Vec::new(),
        timeout: Duration::from_secs(10),
    };
    let r = run(&cfg, &lines).unwrap();
    assert_eq!(r.stats.ok, 60);
    let mut per_target = [0usize; 3];
    for rec in &r.records {
        per_target[rec.target] += 1;
    }
    for (k, (_, log)) in servers.iter().enumerate() {
        let served = log.lock().unwrap().iter().filter(|e| e.0 == "req").count();
        assert_eq!(served, per_target[k], "target {k}");
        assert!(served >= 8, "target {k} got {served} of 60: {per_target:?}");
    }
    // A session's turns still go one after another, whichever replica each lands on.
    for s in 0..10 {
        let starts: Vec<f64> = r
            .records
            .iter()
            .filter(|x| x.session == format!("s{s}"))
            .map(|x| x.start_ms)
            .collect();
        assert!(starts.windows(2).all(|w| w[0] <= w[1]), "{starts:?}");
    }
    // The split is the seed's alone: the same requests go to the same targets.
    let again = run(&cfg, &lines).unwrap();
    let targets = |r: &ReplayResult| r.records.iter().map(|x| x.target).collect::<Vec<_>>();
    assert_eq!(targets(&r), targets(&again));
    let draws = |seed| {
        let sp = Spread::new(4, seed);
        (0..32).map(|line| sp.pick(line)).collect::<Vec<_>>()
    };
    assert_eq!(draws(3), draws(3));
    assert_ne!(draws(3), draws(4));
    assert!(draws(3).iter().all(|&t| t < 4));
    assert!(Spread::new(1, 9).pick(5) == 0);
}
