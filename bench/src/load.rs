//! The closed-loop load run: `concurrency` threads, each with one keep-alive
//! connection, each sending its next request as soon as the previous response has been
//! read, until the request count or the duration runs out.
//!
//! Requests are numbered from one shared counter, so the set of bodies sent is the same
//! for a given workload and seed whichever thread sends which. Plain threads and
//! blocking sockets are enough for the loopback concurrencies this drives, and keep
//! the generator's own overhead easy to reason about.

use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use crate::http::{Client, HttpError, Target};
use crate::report::Stats;
use crate::workload::Workload;

/// Most connection threads a run may start.
pub const MAX_CONCURRENCY: usize = 1024;

/// A thread stops after this many connect failures in a row, so a dead target ends a
/// duration-bound run with an error table instead of a busy loop.
const MAX_CONNECT_FAILURES_IN_A_ROW: u32 = 20;

#[derive(Clone, Debug)]
pub struct LoadConfig {
    pub target: Target,
    pub concurrency: usize,
    /// Stop after this many requests in all (`None`: no count limit).
    pub requests: Option<u64>,
    /// Stop starting requests after this long (`None`: no time limit).
    pub duration: Option<Duration>,
    /// Extra request headers, sent after the defaults.
    pub headers: Vec<(String, String)>,
    /// Connect, read and write timeout per socket operation.
    pub timeout: Duration,
}

pub struct RunResult {
    pub stats: Stats,
    pub elapsed: Duration,
}

pub fn run(cfg: &LoadConfig, workload: &Workload) -> std::io::Result<RunResult> {
    assert!(cfg.concurrency >= 1, "concurrency must be at least 1");
    let threads = cfg.concurrency.min(MAX_CONCURRENCY);
    let next = AtomicU64::new(0);
    let start = Instant::now();
    let deadline = cfg.duration.map(|d| start + d);
    let stats = thread::scope(|scope| {
        let mut handles = Vec::with_capacity(threads);
        for k in 0..threads {
            let next = &next;
            let handle = thread::Builder::new()
                .name(format!("radixgate-bench-conn-{k}"))
                .stack_size(256 * 1024)
                .spawn_scoped(scope, move || worker(cfg, workload, next, deadline))?;
            handles.push(handle);
        }
        let mut total = Stats::default();
        for h in handles {
            total.merge(&h.join().expect("a connection thread panicked"));
        }
        Ok::<_, std::io::Error>(total)
    })?;
    Ok(RunResult {
        stats,
        elapsed: start.elapsed(),
    })
}

fn worker(
    cfg: &LoadConfig,
    workload: &Workload,
    next: &AtomicU64,
    deadline: Option<Instant>,
) -> Stats {
    let mut client = Client::new(
        cfg.target.clone(),
        &cfg.headers,
        workload.config().stream,
        cfg.timeout,
    );
    let mut stats = Stats::default();
    let mut connect_failures = 0;
    loop {
        if deadline.is_some_and(|d| Instant::now() >= d) {
            break;
        }
        // Relaxed: the counter only hands out distinct numbers; nothing else is ordered by it.
        let i = next.fetch_add(1, Ordering::Relaxed);
        if cfg.requests.is_some_and(|n| i >= n) {
            break;
        }
        let body = workload.body(i);
        match client.send(&body) {
            Ok(exchange) => {
                connect_failures = 0;
                stats.record(&exchange);
            }
            Err(e) => {
                stats.record_error(e.kind());
                if matches!(e, HttpError::Connect(_)) {
                    connect_failures += 1;
                    if connect_failures >= MAX_CONNECT_FAILURES_IN_A_ROW {
                        stats.workers_gave_up += 1;
                        break;
                    }
                } else {
                    connect_failures = 0;
                }
            }
        }
    }
    stats
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{Kind, WorkloadConfig};
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::sync::Arc;

    /// Reads one request (head + Content-Length body); `None` at end of stream.
    fn read_request(s: &mut TcpStream, buf: &mut Vec<u8>) -> Option<Vec<u8>> {
        let mut chunk = [0u8; 4096];
        loop {
            if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .map(|v| v.trim().parse().unwrap())
                    .unwrap_or(0);
                if buf.len() >= end + 4 + len {
                    let body = buf[end + 4..end + 4 + len].to_vec();
                    buf.drain(..end + 4 + len);
                    return Some(body);
                }
            }
            let n = s.read(&mut chunk).ok()?;
            if n == 0 {
                return None;
            }
            buf.extend_from_slice(&chunk[..n]);
        }
    }

    /// Answers in a fixed rotation by global request number: two Content-Length JSON
    /// responses from backend "a", one chunked SSE stream from "b" written in pieces
    /// (splitting a chunk-size line), and one 503 that closes the connection.
    fn serve(mut s: TcpStream, served: Arc<AtomicU64>) {
        s.set_nodelay(true).unwrap();
        let mut buf = Vec::new();
        while let Some(body) = read_request(&mut s, &mut buf) {
            assert!(body.starts_with(b"{\"model\":\"sim\""));
            let n = served.fetch_add(1, Ordering::Relaxed);
            match n % 4 {
                0 | 1 => {
                    let json = r#"{"choices":[],"usage":{"prompt_tokens":100,"completion_tokens":4,"prompt_tokens_details":{"cached_tokens":40}}}"#;
                    let resp = format!(
                        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Router-Backend: a\r\nContent-Length: {}\r\n\r\n{json}",
                        json.len()
                    );
                    s.write_all(resp.as_bytes()).unwrap();
                }
                2 => {
                    let events = [
                        "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\n",
                        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":50,\"prompt_tokens_details\":{\"cached_tokens\":10}}}\n\n",
                        "data: [DONE]\n\n",
                    ];
                    s.write_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nX-Router-Backend: b\r\nTransfer-Encoding: chunked\r\n\r\n").unwrap();
                    for e in events {
                        let framed = format!("{:x}\r\n{e}\r\n", e.len());
                        let (x, y) = framed.split_at(1);
                        s.write_all(x.as_bytes()).unwrap();
                        s.write_all(y.as_bytes()).unwrap();
                    }
                    s.write_all(b"0\r\n\r\n").unwrap();
                }
                _ => {
                    let json = r#"{"error":{"message":"overloaded","type":"unavailable","param":null,"code":null}}"#;
                    let resp = format!(
                        "HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{json}",
                        json.len()
                    );
                    s.write_all(resp.as_bytes()).unwrap();
                    return;
                }
            }
        }
    }

    fn start_server() -> (Target, Arc<AtomicU64>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let served = Arc::new(AtomicU64::new(0));
        let counter = served.clone();
        thread::spawn(move || {
            for conn in listener.incoming() {
                let counter = counter.clone();
                thread::spawn(move || serve(conn.unwrap(), counter));
            }
        });
        (
            Target::parse(&format!("http://{addr}/v1/chat/completions")).unwrap(),
            served,
        )
    }

    #[test]
    fn end_to_end_counts() {
        let (target, served) = start_server();
        let cfg = LoadConfig {
            target,
            concurrency: 3,
            requests: Some(40),
            duration: None,
            headers: vec![("X-Router-Policy".into(), "round_robin".into())],
            timeout: Duration::from_secs(10),
        };
        let workload = Workload::new(WorkloadConfig {
            kind: Kind::Docs,
            stream: true,
            ..WorkloadConfig::default()
        });
        let r = run(&cfg, &workload).unwrap();
        let s = &r.stats;
        assert_eq!(served.load(Ordering::Relaxed), 40);
        assert_eq!(s.ok, 30);
        assert_eq!(s.errors.len(), 1);
        assert_eq!(s.errors.get("503"), Some(&10));
        assert_eq!(s.backends.get("a"), Some(&20));
        assert_eq!(s.backends.get("b"), Some(&10));
        assert_eq!(s.usage_reports, 30);
        assert_eq!(s.prompt_tokens, 20 * 100 + 10 * 50);
        assert_eq!(s.cached_tokens, 20 * 40 + 10 * 10);
        assert_eq!(s.latency.len(), 30);
        assert_eq!(s.ttft.len(), 30);
        assert!(s.ttft.max() <= s.latency.max());
    }

    /// `load --plots`: TTFT distribution and load per backend always when the target
    /// names backends, the hit rate when responses report cached tokens.
    #[test]
    #[allow(
        clippy::disallowed_methods,
        reason = "a test reads the files written; no shard runs here"
    )]
    fn writes_plots_of_the_run() {
        let (target, _) = start_server();
        let cfg = LoadConfig {
            target,
            concurrency: 2,
            requests: Some(12),
            duration: None,
            headers: Vec::new(),
            timeout: Duration::from_secs(10),
        };
        let r = run(&cfg, &Workload::new(WorkloadConfig::default())).unwrap();
        assert_eq!(r.stats.ok, 9);
        let dir = std::env::temp_dir().join(format!("radixgate-load-plots-{}", std::process::id()));
        let paths =
            crate::plots::write_run(&dir, "load-fixed-c2", "fixed, concurrency 2", &r.stats)
                .unwrap();
        assert_eq!(paths.len(), 3, "{paths:?}");
        let svg = |i: usize| std::fs::read_to_string(&paths[i]).unwrap();
        assert!(svg(0).contains("TTFT distribution · fixed, concurrency 2"));
        let load = crate::plots::texts(&svg(1));
        for want in ["load per backend · fixed, concurrency 2", "a", "b"] {
            assert!(load.iter().any(|t| t == want), "{want} not in {load:?}");
        }
        assert!(svg(2).contains("engine hit rate"));
        // A target that names no backends and reports no usage: the TTFT plot alone.
        let mut bare = r.stats.clone();
        bare.backends.clear();
        bare.usage_reports = 0;
        let paths = crate::plots::write_run(&dir, "bare", "bare", &bare).unwrap();
        assert_eq!(paths, [dir.join("bare-ttft.svg")]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn dead_target_gives_up() {
        // Bind then drop: the port is very likely closed for the test's duration.
        let addr = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let cfg = LoadConfig {
            target: Target::parse(&format!("http://{addr}/")).unwrap(),
            concurrency: 2,
            requests: None,
            duration: Some(Duration::from_secs(30)),
            headers: Vec::new(),
            timeout: Duration::from_secs(1),
        };
        let r = run(&cfg, &Workload::new(WorkloadConfig::default())).unwrap();
        assert_eq!(r.stats.workers_gave_up, 2);
        assert_eq!(r.stats.ok, 0);
        assert_eq!(
            r.stats.errors.get("connect"),
            Some(&(2 * u64::from(MAX_CONNECT_FAILURES_IN_A_ROW)))
        );
    }
}
