//! The load run: `concurrency` threads, each with one keep-alive connection. Closed
//! loop by default: each sends its next request as soon as the previous response has
//! been read, until the request count or the duration runs out. With a `rate`, open
//! loop: requests start at Poisson arrival times of that rate (seeded exponential
//! gaps), each on whichever thread is free, so the arrivals do not wait for answers
//! as long as `concurrency` exceeds the requests in flight (the run reports how late
//! the latest start was when it does not: see [`RunResult::max_late`]).
//!
//! Requests are numbered by one shared [`Schedule`], so the set of bodies sent is the
//! same for a given workload and seed whichever thread sends which; a conversation's
//! next turn waits for the previous turn's answer. Plain threads and
//! blocking sockets are enough for the loopback concurrencies this drives, and keep
//! the generator's own overhead easy to reason about.

// Bench threads, not shard threads: an open-loop arrival sleeps until its time.
#![allow(clippy::disallowed_methods)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use crate::http::{Client, HttpError, Target};
use crate::report::Stats;
use crate::schedule::{Next, Schedule};
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
    /// Open loop: Poisson arrivals at this many requests per second.
    pub rate: Option<f64>,
    /// Seeds the arrival gaps.
    pub seed: u64,
    /// Keep one [`Trace`] per request in [`RunResult::traces`].
    pub trace: bool,
}

/// One request as the client saw it, for finding where a tail comes from.
#[derive(Clone, Debug, PartialEq)]
pub struct Trace {
    /// The request's number in the workload.
    pub request: u64,
    /// When it was sent, from the start of the run.
    pub sent: Duration,
    /// HTTP status, 0 for a transport error.
    pub status: u16,
    pub backend: Option<String>,
    pub reason: Option<String>,
    pub ttft: Duration,
    /// Sent to the last response byte.
    pub total: Duration,
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
}

pub struct RunResult {
    pub stats: Stats,
    pub elapsed: Duration,
    /// Open loop: the most a request started after its arrival time (every thread
    /// was busy); zero when closed loop.
    pub max_late: Duration,
    /// With [`LoadConfig::trace`]: every request, in the order they were sent.
    pub traces: Vec<Trace>,
}

/// Poisson arrival times, handed out in order to whichever thread asks.
struct Arrivals {
    rate: f64,
    next: Mutex<(Instant, fastrand::Rng)>,
    /// Microseconds, the most a start was late.
    max_late_us: AtomicU64,
}

impl Arrivals {
    fn new(rate: f64, start: Instant, seed: u64) -> Self {
        Arrivals {
            rate,
            next: Mutex::new((start, fastrand::Rng::with_seed(seed))),
            max_late_us: AtomicU64::new(0),
        }
    }

    /// The next arrival time: the last one plus an exponential gap of mean 1/rate.
    fn take(&self) -> Instant {
        let mut next = self.next.lock().unwrap_or_else(|e| e.into_inner());
        let (at, rng) = &mut *next;
        let gap = -(1.0 - rng.f64()).ln() / self.rate;
        *at += Duration::from_secs_f64(gap);
        *at
    }

    /// Waits until `at`; notes how late the start is when `at` has passed.
    fn wait_until(&self, at: Instant) {
        let now = Instant::now();
        if at > now {
            thread::sleep(at - now);
        } else {
            let late = (now - at).as_micros() as u64;
            self.max_late_us.fetch_max(late, Ordering::Relaxed);
        }
    }
}

pub fn run(cfg: &LoadConfig, workload: &Workload) -> std::io::Result<RunResult> {
    assert!(cfg.concurrency >= 1, "concurrency must be at least 1");
    let threads = cfg.concurrency.min(MAX_CONCURRENCY);
    let schedule = Schedule::new(workload, cfg.requests);
    let start = Instant::now();
    let deadline = cfg.duration.map(|d| start + d);
    let arrivals = cfg
        .rate
        .filter(|r| *r > 0.0 && r.is_finite())
        .map(|r| Arrivals::new(r, start, cfg.seed));
    let stats = thread::scope(|scope| {
        let mut handles = Vec::with_capacity(threads);
        for k in 0..threads {
            let (schedule, arrivals) = (&schedule, arrivals.as_ref());
            let handle = thread::Builder::new()
                .name(format!("radixgate-bench-conn-{k}"))
                .stack_size(256 * 1024)
                .spawn_scoped(scope, move || {
                    worker(cfg, workload, schedule, (start, deadline), arrivals)
                })?;
            handles.push(handle);
        }
        let mut total = Stats::default();
        let mut traces = Vec::new();
        for h in handles {
            let (stats, mut t) = h.join().expect("a connection thread panicked");
            total.merge(&stats);
            traces.append(&mut t);
        }
        traces.sort_by_key(|t: &Trace| t.sent);
        Ok::<_, std::io::Error>((total, traces))
    })?;
    let (stats, traces) = stats;
    Ok(RunResult {
        traces,
        stats,
        elapsed: start.elapsed(),
        max_late: Duration::from_micros(
            arrivals.map_or(0, |a| a.max_late_us.load(Ordering::Relaxed)),
        ),
    })
}

fn worker(
    cfg: &LoadConfig,
    workload: &Workload,
    schedule: &Schedule<'_>,
    (start, deadline): (Instant, Option<Instant>),
    arrivals: Option<&Arrivals>,
) -> (Stats, Vec<Trace>) {
    let mut client = Client::new(
        cfg.target.clone(),
        &cfg.headers,
        workload.config().stream,
        cfg.timeout,
    );
    let mut stats = Stats::default();
    let mut traces = Vec::new();
    let mut connect_failures = 0;
    loop {
        if deadline.is_some_and(|d| Instant::now() >= d) {
            break;
        }
        let Next::Send(i) = schedule.take(deadline) else {
            break;
        };
        if let Some(arrivals) = arrivals {
            let at = arrivals.take();
            if deadline.is_some_and(|d| at >= d) {
                schedule.finish(i);
                break;
            }
            arrivals.wait_until(at);
        }
        let body = workload.body(i);
        let sent = start.elapsed();
        let sent_result = client.send(&body);
        schedule.finish(i);
        match sent_result {
            Ok(exchange) => {
                connect_failures = 0;
                stats.record(&exchange);
                if cfg.trace {
                    traces.push(Trace {
                        request: i,
                        sent,
                        status: exchange.status,
                        backend: exchange.backend,
                        reason: exchange.reason,
                        ttft: exchange.ttft,
                        total: exchange.total,
                        prompt_tokens: exchange.usage.map(|u| u.prompt_tokens),
                        cached_tokens: exchange.usage.map(|u| u.cached_tokens),
                    });
                }
            }
            Err(e) => {
                if cfg.trace {
                    traces.push(Trace {
                        request: i,
                        sent,
                        status: 0,
                        backend: None,
                        reason: None,
                        ttft: start.elapsed() - sent,
                        total: start.elapsed() - sent,
                        prompt_tokens: None,
                        cached_tokens: None,
                    });
                }
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
    (stats, traces)
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
            rate: None,
            seed: 1,
            trace: false,
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
            rate: None,
            seed: 1,
            trace: false,
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
            rate: None,
            seed: 1,
            trace: false,
        };
        let r = run(&cfg, &Workload::new(WorkloadConfig::default())).unwrap();
        assert_eq!(r.stats.workers_gave_up, 2);
        assert_eq!(r.stats.ok, 0);
        assert_eq!(
            r.stats.errors.get("connect"),
            Some(&(2 * u64::from(MAX_CONNECT_FAILURES_IN_A_ROW)))
        );
    }

    #[test]
    fn open_loop_arrivals_are_poisson_and_repeatable() {
        let start = Instant::now();
        let gaps = |seed| {
            let a = Arrivals::new(50.0, start, seed);
            let mut last = start;
            (0..20_000)
                .map(|_| {
                    let at = a.take();
                    let gap = (at - last).as_secs_f64();
                    last = at;
                    gap
                })
                .collect::<Vec<f64>>()
        };
        let (g, again) = (gaps(7), gaps(7));
        assert_eq!(g, again);
        assert_ne!(g, gaps(8));
        // Exponential gaps of mean 1/50 s: mean and standard deviation both 20 ms
        // (the seeded draw is fixed, so these bounds cannot flake).
        let mean = g.iter().sum::<f64>() / g.len() as f64;
        let var = g.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / g.len() as f64;
        assert!((mean - 0.02).abs() < 0.001, "{mean}");
        assert!((var.sqrt() - 0.02).abs() < 0.001, "{}", var.sqrt());
    }

    #[test]
    fn open_loop_serves_every_request() {
        let (target, served) = start_server();
        let cfg = LoadConfig {
            target,
            concurrency: 4,
            requests: Some(30),
            duration: None,
            headers: Vec::new(),
            timeout: Duration::from_secs(10),
            rate: Some(500.0),
            seed: 3,
            trace: false,
        };
        let r = run(&cfg, &Workload::new(WorkloadConfig::default())).unwrap();
        assert_eq!(r.stats.ok + r.stats.failed(), 30);
        assert!(served.load(std::sync::atomic::Ordering::Relaxed) >= r.stats.ok);
    }
}
