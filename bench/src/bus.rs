//! `radixgate-bench bus`: the cluster bus candidates measured with the client crates
//! the product would use (the results are in docs/cluster.md).
//!
//! Each cell runs one transport at one offered event rate, inside this process:
//!
//! - a generator thread (standing in for the shards and the coordinator) makes events
//!   at the offered rate, every ~100 us a chunk stamped with its creation time, and
//!   hands them to the publisher thread over a channel;
//! - the publisher thread batches them as the cluster thread would (one message per
//!   `--batch-events` events or per `--batch-ms`, whichever comes first), stamps each
//!   message with its send time and publishes it on its own connection;
//! - the subscriber thread, on another connection, decodes each message and records
//!   per event the transport lag (message send stamp to receipt) and the event lag
//!   (event creation to receipt, so including the batching wait) in hdrhistograms.
//!
//! Both clients' CPU is their own thread's (`CLOCK_THREAD_CPUTIME_ID`; each NATS
//! client runs on its own current-thread tokio runtime, so the connection task runs
//! on that thread too), the broker's is `utime + stime` from `/proc/PID/stat`; all
//! three are divided by the events delivered. Transports: NATS core publish and
//! subscribe, NATS JetStream (publish with acks in a window, ordered push consumer),
//! Redis PUBLISH/SUBSCRIBE and Redis streams (XADD with MAXLEN ~, XREAD BLOCK), the
//! Redis side on the sync `redis` client (no async runtime).
//!
//! `--restart` runs the fault instead: a steady rate, the broker killed with SIGKILL
//! mid-run and restarted on the same port (same state directory) a second later; it
//! reports whether the client library reconnected by itself, how long until events
//! flowed again, and how many were lost. The brokers are started through
//! `deploy/cluster/bus` and stopped by PID.
//!
//! The payload is synthetic but shaped like the wire format's Insert op (a backend
//! key, a timestamp and four block hashes: 48 bytes per event, a 24-byte header per
//! message); encode and decode cost of the real format is measured separately.

// No shards here: the bench's own threads sleep and read /proc by design.
#![allow(clippy::disallowed_methods)]

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::hint::black_box;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

/// Bytes of one event in a message: backend key, creation time, four block hashes.
const EVENT_BYTES: usize = 48;
/// Message header: magic, event count, sequence number, send time.
const HEADER_BYTES: usize = 24;
const MAGIC: u32 = u32::from_le_bytes(*b"RGbb");
/// Highest recordable lag, microseconds (one minute); longer values saturate.
const MAX_US: u64 = 60_000_000;

const NATS_SUBJECT: &str = "radixgate.bench";
const JS_SUBJECT: &str = "radixgate.bench.js";
const JS_STREAM: &str = "RADIXGATE_BENCH";
const REDIS_CHANNEL: &str = "radixgate.bench";
const REDIS_STREAM: &str = "radixgate.bench.stream";
/// Redis stream and JetStream stream bound (messages), as the product would cap them.
const STREAM_MAX_MSGS: i64 = 100_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    NatsCore,
    NatsJetStream,
    RedisPubSub,
    RedisStreams,
    /// No bus: the generator, the channel, batching and encoding only, to show how
    /// much of the publisher's CPU is the bench's own plumbing.
    Baseline,
}

impl Transport {
    pub fn name(self) -> &'static str {
        match self {
            Transport::NatsCore => "nats core",
            Transport::NatsJetStream => "nats jetstream",
            Transport::RedisPubSub => "redis pub/sub",
            Transport::RedisStreams => "redis streams",
            Transport::Baseline => "no bus (baseline)",
        }
    }

    fn bus(self) -> Option<BusKind> {
        match self {
            Transport::NatsCore | Transport::NatsJetStream => Some(BusKind::Nats),
            Transport::RedisPubSub | Transport::RedisStreams => Some(BusKind::Redis),
            Transport::Baseline => None,
        }
    }

    pub fn parse(s: &str) -> Result<Transport, String> {
        Ok(match s {
            "nats" | "nats-core" => Transport::NatsCore,
            "jetstream" | "nats-jetstream" => Transport::NatsJetStream,
            "redis" | "redis-pubsub" => Transport::RedisPubSub,
            "redis-streams" => Transport::RedisStreams,
            "baseline" | "none" => Transport::Baseline,
            _ => {
                return Err(format!(
                    "unknown transport {s:?} (nats-core, nats-jetstream, redis-pubsub, redis-streams, baseline)"
                ))
            }
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BusKind {
    Nats,
    Redis,
}

impl BusKind {
    fn arg(self) -> &'static str {
        match self {
            BusKind::Nats => "nats",
            BusKind::Redis => "redis",
        }
    }
}

/// What to run.
#[derive(Clone, Debug)]
pub struct BusConfig {
    pub transports: Vec<Transport>,
    pub rates: Vec<u64>,
    pub rounds: usize,
    pub secs: f64,
    pub warmup_secs: f64,
    pub batch_events: usize,
    pub batch_ms: f64,
    pub nats_port: u16,
    pub redis_port: u16,
    pub bus_script: PathBuf,
    /// Fault run: kill the broker after this many seconds (None: throughput cells).
    pub restart_after_secs: Option<f64>,
    /// How long the broker stays down in a fault run.
    pub down_secs: f64,
}

/// One cell's measurements.
#[derive(Clone, Debug)]
pub struct CellResult {
    pub transport: Transport,
    pub offered: u64,
    pub round: usize,
    pub secs: f64,
    /// Events the generator made in the measured window.
    pub generated: u64,
    /// Events the publisher handed to the client library in the window.
    pub published: u64,
    /// Events the subscriber decoded whose message was sent in the window.
    pub delivered: u64,
    pub messages: u64,
    pub pub_errors: u64,
    pub transport_lag: Histogram<u64>,
    pub event_lag: Histogram<u64>,
    pub pub_cpu_ns: u64,
    pub sub_cpu_ns: u64,
    pub broker_cpu_ns: u64,
    pub restart: Option<RestartResult>,
}

#[derive(Clone, Debug, Default)]
pub struct RestartResult {
    /// Gap in delivery around the outage: last receipt before the kill to first after.
    pub delivery_gap_ms: f64,
    /// Restart (broker listening again) to the first message received.
    pub resume_after_restart_ms: Option<f64>,
    /// Events generated but never delivered.
    pub lost: u64,
    /// Of those, events sent between the kill and the restart.
    pub generated_while_down: u64,
    /// The client library reconnected on its own (NATS), or the bench's own loop did
    /// (Redis: the sync client reports the error and must be reconnected).
    pub library_reconnects: bool,
    pub app_reconnects: u64,
    /// Events received more than once (redelivery after reconnect).
    pub duplicates: u64,
}

fn now_ns(base: Instant) -> u64 {
    base.elapsed().as_nanos() as u64
}

fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a valid pointer.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return 0;
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// A process's user + system CPU time from /proc/PID/stat, in nanoseconds.
fn proc_cpu_ns(pid: u32) -> u64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0;
    };
    // Fields after the parenthesised command name; utime and stime are fields 14, 15.
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
        return 0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    // `rest` starts at field 3 (state), so field n is f[n - 3].
    let total = ticks(11) + ticks(12);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    total * 1_000_000_000 / hz
}

pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

// === the broker ===

/// A broker started through deploy/cluster/bus, stopped by PID on drop.
pub struct Broker {
    kind: BusKind,
    port: u16,
    script: PathBuf,
    state_dir: Option<PathBuf>,
    child: Child,
    pub url: String,
}

impl Broker {
    fn start(
        kind: BusKind,
        port: u16,
        script: &Path,
        state_dir: Option<&Path>,
    ) -> Result<Broker, String> {
        let (child, url) = spawn_bus(kind, port, script, state_dir)?;
        Ok(Broker {
            kind,
            port,
            script: script.to_path_buf(),
            state_dir: state_dir.map(Path::to_path_buf),
            child,
            url,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL, as a crash would.
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn restart(&mut self) -> Result<(), String> {
        self.kill();
        let (child, url) = spawn_bus(
            self.kind,
            self.port,
            &self.script,
            self.state_dir.as_deref(),
        )?;
        self.child = child;
        self.url = url;
        Ok(())
    }
}

/// Runs deploy/cluster/bus, reads the url it prints first, waits until it listens.
fn spawn_bus(
    kind: BusKind,
    port: u16,
    script: &Path,
    state_dir: Option<&Path>,
) -> Result<(Child, String), String> {
    let mut cmd = Command::new(script);
    cmd.arg(port.to_string())
        .arg(kind.arg())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    if let Some(dir) = state_dir {
        cmd.env("BUS_STATE_DIR", dir);
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("{}: {e}", script.display()))?;
    let stdout = child.stdout.take().expect("piped stdout");
    let mut lines = BufReader::new(stdout);
    let mut url = String::new();
    lines
        .read_line(&mut url)
        .map_err(|e| format!("bus: reading its url: {e}"))?;
    let url = url.trim().to_string();
    // Keep draining the server's stdout (Redis logs there) so it never blocks.
    thread::spawn(move || {
        let mut sink = String::new();
        while lines.read_line(&mut sink).map(|n| n > 0).unwrap_or(false) {
            sink.clear();
        }
    });
    let fail = |mut child: Child, msg: String| {
        let _ = child.kill();
        let _ = child.wait();
        Err(msg)
    };
    if url.is_empty() {
        return fail(child, format!("bus {} did not print its url", kind.arg()));
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            return fail(child, format!("bus {} not listening on {port}", kind.arg()));
        }
        thread::sleep(Duration::from_millis(2));
    }
    Ok((child, url))
}

impl Drop for Broker {
    fn drop(&mut self) {
        // SIGTERM so the server exits cleanly; then reap it.
        // SAFETY: kill(2) on our own child's PID.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// === events and messages ===

#[derive(Clone, Copy)]
struct Event {
    created_ns: u64,
    key: u64,
}

fn encode(seq: u64, sent_ns: u64, events: &[Event], out: &mut Vec<u8>) {
    out.clear();
    out.reserve(HEADER_BYTES + events.len() * EVENT_BYTES);
    out.extend_from_slice(&MAGIC.to_le_bytes());
    out.extend_from_slice(&(events.len() as u32).to_le_bytes());
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&sent_ns.to_le_bytes());
    for e in events {
        out.extend_from_slice(&e.key.to_le_bytes());
        out.extend_from_slice(&e.created_ns.to_le_bytes());
        for i in 0..4u64 {
            out.extend_from_slice(
                &(e.key ^ (i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)).to_le_bytes(),
            );
        }
    }
}

fn rd(b: &[u8], at: usize) -> u64 {
    b.get(at..at + 8)
        .map(|s| u64::from_le_bytes(s.try_into().expect("8 bytes")))
        .unwrap_or(0)
}

/// What the subscriber keeps.
struct SubStats {
    transport_lag: Histogram<u64>,
    event_lag: Histogram<u64>,
    delivered: u64,
    messages: u64,
    /// Distinct sequence numbers seen, for loss and duplicates in fault runs.
    seen: Vec<bool>,
    duplicates: u64,
    /// Receipt times (ns since base) of every message, for fault runs' gaps.
    receipts: Vec<u64>,
    cpu_start: Option<u64>,
    cpu_end: u64,
    last_seq_events: Vec<u32>,
}

impl SubStats {
    fn new() -> SubStats {
        let h = || Histogram::new_with_bounds(1, MAX_US, 3).expect("static bounds");
        SubStats {
            transport_lag: h(),
            event_lag: h(),
            delivered: 0,
            messages: 0,
            seen: Vec::new(),
            duplicates: 0,
            receipts: Vec::new(),
            cpu_start: None,
            cpu_end: 0,
            last_seq_events: Vec::new(),
        }
    }

    /// One received message; `window` is [start, end) in ns since base.
    fn record(&mut self, payload: &[u8], base: Instant, window: (u64, u64)) {
        let now = now_ns(base);
        if payload.len() < HEADER_BYTES || rd(payload, 0) as u32 != MAGIC {
            return;
        }
        let count = rd(payload, 4) as u32 as usize;
        let seq = rd(payload, 8) as usize;
        let sent = rd(payload, 16);
        if payload.len() < HEADER_BYTES + count * EVENT_BYTES {
            return;
        }
        if self.seen.len() <= seq {
            self.seen.resize(seq + 1, false);
            self.last_seq_events.resize(seq + 1, 0);
        }
        if self.seen[seq] {
            self.duplicates += count as u64;
            return;
        }
        self.seen[seq] = true;
        self.last_seq_events[seq] = count as u32;
        self.receipts.push(now);
        if sent < window.0 || sent >= window.1 {
            return;
        }
        if self.cpu_start.is_none() {
            self.cpu_start = Some(thread_cpu_ns());
        }
        self.messages += 1;
        self.delivered += count as u64;
        let tl = (now.saturating_sub(sent) / 1000).max(1);
        let _ = self.transport_lag.record_n(tl.min(MAX_US), count as u64);
        for i in 0..count {
            let created = rd(payload, HEADER_BYTES + i * EVENT_BYTES + 8);
            let el = (now.saturating_sub(created) / 1000).max(1);
            let _ = self.event_lag.record(el.min(MAX_US));
        }
    }
}

/// Shared between the threads of one cell.
struct Ctl {
    base: Instant,
    window: (u64, u64),
    /// Events the generator made inside the window.
    generated: AtomicU64,
    /// Events the publisher handed to the client inside the window.
    published: AtomicU64,
    pub_errors: AtomicU64,
    /// Total messages the publisher sent (all times), and events in them.
    sent_msgs: AtomicU64,
    sent_events: AtomicU64,
    /// The publisher has sent everything and flushed.
    pub_done: AtomicBool,
    app_reconnects: AtomicU64,
    /// Fault runs: kill and restart times, ns since base (0: not yet).
    killed_at: AtomicU64,
    restarted_at: AtomicU64,
    generated_while_down: AtomicU64,
    generated_total: AtomicU64,
}

type GenTx = tokio::sync::mpsc::UnboundedSender<Vec<Event>>;

fn generator(ctl: Arc<Ctl>, rate: u64, tx: GenTx) {
    let start = Instant::now();
    let mut made: u64 = 0;
    let mut key: u64 = 0x1234_5678;
    loop {
        thread::sleep(Duration::from_micros(100));
        if now_ns(ctl.base) >= ctl.window.1 {
            break;
        }
        let el = start.elapsed().as_secs_f64();
        let due = (rate as f64 * el) as u64;
        if due <= made {
            continue;
        }
        let n = (due - made) as usize;
        made = due;
        let now = now_ns(ctl.base);
        let chunk: Vec<Event> = (0..n)
            .map(|_| {
                key = key
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                Event {
                    created_ns: now,
                    key,
                }
            })
            .collect();
        if now >= ctl.window.0 && now < ctl.window.1 {
            ctl.generated.fetch_add(n as u64, Ordering::Relaxed);
        }
        ctl.generated_total.fetch_add(n as u64, Ordering::Relaxed);
        let k = ctl.killed_at.load(Ordering::Relaxed);
        let r = ctl.restarted_at.load(Ordering::Relaxed);
        if k != 0 && (r == 0 || now < r) && now >= k {
            ctl.generated_while_down
                .fetch_add(n as u64, Ordering::Relaxed);
        }
        if tx.send(chunk).is_err() {
            break;
        }
    }
}

/// Batching, as the cluster thread would do it: returns the messages to send now.
struct Batcher {
    pending: Vec<Event>,
    first_at: Option<Instant>,
    max_events: usize,
    max_wait: Duration,
}

impl Batcher {
    fn push(&mut self, chunk: Vec<Event>, mut emit: impl FnMut(&[Event])) {
        if self.pending.is_empty() {
            self.first_at = Some(Instant::now());
        }
        self.pending.extend(chunk);
        while self.pending.len() >= self.max_events {
            emit(&self.pending[..self.max_events]);
            self.pending.drain(..self.max_events);
            self.first_at = (!self.pending.is_empty()).then(Instant::now);
        }
    }

    fn deadline(&self) -> Option<Instant> {
        self.first_at.map(|t| t + self.max_wait)
    }

    fn flush(&mut self, mut emit: impl FnMut(&[Event])) {
        if !self.pending.is_empty() {
            emit(&self.pending);
            self.pending.clear();
        }
        self.first_at = None;
    }
}

// === NATS ===

fn nats_connect(
    rt: &tokio::runtime::Runtime,
    url: &str,
    name: &str,
) -> Result<async_nats::Client, String> {
    rt.block_on(
        async_nats::ConnectOptions::new()
            .name(name)
            // Retry fast while the broker is down in fault runs (the default backs
            // off exponentially to 4 s).
            .reconnect_delay_callback(|n| Duration::from_millis((n as u64 * 10).min(100)))
            .connect(url),
    )
    .map_err(|e| format!("nats connect {url}: {e}"))
}

fn current_thread_rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
}

fn nats_publisher(
    ctl: Arc<Ctl>,
    url: String,
    js: bool,
    cfg: BusConfig,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Vec<Event>>,
    ready: Arc<Barrier>,
) -> Result<u64, String> {
    let rt = current_thread_rt();
    let _in_rt = rt.enter();
    let client = nats_connect(&rt, &url, "radixgate-bench-pub");
    ready.wait();
    let client = client?;
    let cpu0 = thread_cpu_ns();
    let mut context = async_nats::jetstream::new(client.clone());
    context.set_timeout(Duration::from_secs(1));
    let mut batcher = Batcher {
        pending: Vec::new(),
        first_at: None,
        max_events: cfg.batch_events,
        max_wait: Duration::from_secs_f64(cfg.batch_ms / 1000.0),
    };
    rt.block_on(async {
        let mut seq: u64 = 0;
        let mut buf = Vec::new();
        let mut acks: VecDeque<(async_nats::jetstream::context::PublishAckFuture, u64, bool)> =
            VecDeque::new();
        let mut ready_msgs: Vec<(Vec<u8>, u64, bool)> = Vec::new();
        let mut cpu_start = None;
        loop {
            let chunk = match batcher.deadline() {
                Some(d) => {
                    match tokio::time::timeout_at(tokio::time::Instant::from_std(d), rx.recv())
                        .await
                    {
                        Ok(c) => c,
                        Err(_) => {
                            let now = now_ns(ctl.base);
                            batcher.flush(|evs| {
                                encode(seq, now, evs, &mut buf);
                                seq += 1;
                                let inw = now >= ctl.window.0 && now < ctl.window.1;
                                ready_msgs.push((buf.clone(), evs.len() as u64, inw));
                            });
                            Some(Vec::new())
                        }
                    }
                }
                None => rx.recv().await,
            };
            let done = chunk.is_none();
            if let Some(chunk) = chunk {
                if !chunk.is_empty() {
                    let now = now_ns(ctl.base);
                    batcher.push(chunk, |evs| {
                        encode(seq, now, evs, &mut buf);
                        seq += 1;
                        let inw = now >= ctl.window.0 && now < ctl.window.1;
                        ready_msgs.push((buf.clone(), evs.len() as u64, inw));
                    });
                }
            } else {
                let now = now_ns(ctl.base);
                batcher.flush(|evs| {
                    encode(seq, now, evs, &mut buf);
                    seq += 1;
                    ready_msgs.push((buf.clone(), evs.len() as u64, false));
                });
            }
            for (msg, n, inw) in ready_msgs.drain(..) {
                if inw && cpu_start.is_none() {
                    cpu_start = Some(thread_cpu_ns());
                }
                let ok = if js {
                    match context.publish(JS_SUBJECT, msg.into()).await {
                        Ok(ack) => {
                            acks.push_back((ack, n, inw));
                            true
                        }
                        Err(e) => {
                            if ctl.pub_errors.load(Ordering::Relaxed) == 0 {
                                eprintln!("bus: jetstream publish: {e}");
                            }
                            false
                        }
                    }
                } else {
                    client.publish(NATS_SUBJECT, msg.into()).await.is_ok()
                };
                if ok {
                    ctl.sent_msgs.fetch_add(1, Ordering::Relaxed);
                    ctl.sent_events.fetch_add(n, Ordering::Relaxed);
                    if inw {
                        ctl.published.fetch_add(n, Ordering::Relaxed);
                    }
                } else {
                    ctl.pub_errors.fetch_add(n, Ordering::Relaxed);
                }
                // A window of acks in flight; the oldest is awaited when it is full.
                while acks.len() > 256 {
                    let (ack, n, _) = acks.pop_front().expect("non-empty");
                    if ack.await.is_err() {
                        ctl.pub_errors.fetch_add(n, Ordering::Relaxed);
                    }
                }
            }
            if done {
                break;
            }
        }
        for (ack, n, _) in acks.drain(..) {
            if ack.await.is_err() {
                ctl.pub_errors.fetch_add(n, Ordering::Relaxed);
            }
        }
        let _ = client.flush().await;
        ctl.pub_done.store(true, Ordering::Release);
        Ok(thread_cpu_ns() - cpu_start.unwrap_or(cpu0))
    })
}

fn nats_subscriber(
    ctl: Arc<Ctl>,
    url: String,
    js: bool,
    ready: Arc<Barrier>,
) -> Result<SubStats, String> {
    use async_nats::jetstream::{consumer, stream};
    use futures_util::StreamExt;

    let rt = current_thread_rt();
    let _in_rt = rt.enter();
    let setup = || -> Result<_, String> {
        let client = nats_connect(&rt, &url, "radixgate-bench-sub")?;
        rt.block_on(async {
            if js {
                let context = async_nats::jetstream::new(client.clone());
                let _ = context.delete_stream(JS_STREAM).await;
                let st = context
                    .get_or_create_stream(stream::Config {
                        name: JS_STREAM.into(),
                        subjects: vec![JS_SUBJECT.into()],
                        max_messages: STREAM_MAX_MSGS,
                        storage: stream::StorageType::File,
                        ..Default::default()
                    })
                    .await
                    .map_err(|e| format!("jetstream stream: {e}"))?;
                let c = st
                    .create_consumer(consumer::push::OrderedConfig {
                        deliver_subject: client.new_inbox(),
                        filter_subject: JS_SUBJECT.into(),
                        deliver_policy: consumer::DeliverPolicy::New,
                        ..Default::default()
                    })
                    .await
                    .map_err(|e| format!("jetstream consumer: {e}"))?;
                let msgs = c
                    .messages()
                    .await
                    .map_err(|e| format!("jetstream messages: {e}"))?;
                Ok::<_, String>((client, None, Some(msgs)))
            } else {
                let sub = client
                    .subscribe(NATS_SUBJECT)
                    .await
                    .map_err(|e| format!("subscribe: {e}"))?;
                client.flush().await.map_err(|e| format!("flush: {e}"))?;
                Ok((client, Some(sub), None))
            }
        })
    };
    let setup = setup();
    ready.wait();
    let (_client, mut sub, mut ordered) = setup?;
    let mut stats = SubStats::new();
    rt.block_on(async {
        loop {
            let next = tokio::time::timeout(Duration::from_millis(100), async {
                if let Some(s) = sub.as_mut() {
                    s.next().await.map(|m| Ok(m.payload))
                } else if let Some(o) = ordered.as_mut() {
                    o.next()
                        .await
                        .map(|r| r.map(|m| m.payload.clone()).map_err(|_| ()))
                } else {
                    None
                }
            })
            .await;
            match next {
                Ok(Some(Ok(payload))) => stats.record(&payload, ctl.base, ctl.window),
                Ok(Some(Err(()))) => {}
                Ok(None) => break,
                Err(_) => {}
            }
            if sub_should_stop(&ctl, &stats) {
                break;
            }
        }
    });
    stats.cpu_end = thread_cpu_ns();
    Ok(stats)
}

/// Stop when the publisher is done and everything it sent has arrived, or a grace
/// period after it finished.
fn sub_should_stop(ctl: &Ctl, stats: &SubStats) -> bool {
    static GRACE_START: AtomicU64 = AtomicU64::new(0);
    if !ctl.pub_done.load(Ordering::Acquire) {
        GRACE_START.store(0, Ordering::Relaxed);
        return false;
    }
    let received: u64 = stats.last_seq_events.iter().map(|&n| n as u64).sum();
    if received >= ctl.sent_events.load(Ordering::Relaxed) {
        return true;
    }
    let now = now_ns(ctl.base);
    let g = GRACE_START.load(Ordering::Relaxed);
    if g == 0 {
        GRACE_START.store(now, Ordering::Relaxed);
        false
    } else {
        now - g > 3_000_000_000
    }
}

// === Redis ===

fn redis_connect(url: &str) -> Result<redis::Connection, String> {
    let client = redis::Client::open(url).map_err(|e| format!("redis {url}: {e}"))?;
    let con = client
        .get_connection_with_timeout(Duration::from_millis(500))
        .map_err(|e| format!("redis connect {url}: {e}"))?;
    Ok(con)
}

/// What the sync publisher does with a batch: Redis PUBLISH, XADD, or nothing.
#[derive(Clone, Copy, PartialEq, Eq)]
enum SyncMode {
    PubSub,
    Streams,
    Baseline,
}

fn redis_publisher(
    ctl: Arc<Ctl>,
    url: String,
    mode: SyncMode,
    cfg: BusConfig,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Vec<Event>>,
    ready: Arc<Barrier>,
) -> Result<u64, String> {
    let streams = mode == SyncMode::Streams;
    let baseline = mode == SyncMode::Baseline;
    let con = if baseline {
        Ok(None)
    } else {
        redis_connect(&url).map(Some)
    };
    // The generator channel is the same tokio channel as on the NATS side (so the
    // plumbing costs the same); the Redis client itself is sync.
    let rt = current_thread_rt();
    ready.wait();
    let mut con = con?;
    let cpu0 = thread_cpu_ns();
    let mut cpu_start = None;
    let mut batcher = Batcher {
        pending: Vec::new(),
        first_at: None,
        max_events: cfg.batch_events,
        max_wait: Duration::from_secs_f64(cfg.batch_ms / 1000.0),
    };
    let mut seq: u64 = 0;
    let mut buf = Vec::new();
    let mut out: Vec<(Vec<u8>, u64, bool)> = Vec::new();
    let mut next_try = Instant::now();
    loop {
        let chunk = match batcher.deadline() {
            Some(d) => rt
                .block_on(async {
                    tokio::time::timeout_at(tokio::time::Instant::from_std(d), rx.recv()).await
                })
                .unwrap_or(Some(Vec::new())),
            None => rt.block_on(rx.recv()),
        };
        let done = chunk.is_none();
        let now = now_ns(ctl.base);
        let inw = now >= ctl.window.0 && now < ctl.window.1;
        let mut emit = |evs: &[Event]| {
            encode(seq, now, evs, &mut buf);
            seq += 1;
            out.push((buf.clone(), evs.len() as u64, inw));
        };
        match chunk {
            Some(c) if !c.is_empty() => batcher.push(c, &mut emit),
            _ => {
                if done || batcher.deadline().is_some_and(|d| d <= Instant::now()) {
                    batcher.flush(&mut emit)
                }
            }
        }
        if !out.is_empty() {
            if inw && cpu_start.is_none() {
                cpu_start = Some(thread_cpu_ns());
            }
            if !baseline && con.is_none() && Instant::now() >= next_try {
                match redis_connect(&url) {
                    Ok(c) => {
                        con = Some(c);
                        ctl.app_reconnects.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(_) => next_try = Instant::now() + Duration::from_millis(50),
                }
            }
            let n: u64 = out.iter().map(|m| m.1).sum();
            let n_inw: u64 = out.iter().filter(|m| m.2).map(|m| m.1).sum();
            let ok = if baseline {
                black_box(&out);
                true
            } else if let Some(c) = con.as_mut() {
                let mut p = redis::pipe();
                for (msg, _, _) in &out {
                    if streams {
                        p.cmd("XADD")
                            .arg(REDIS_STREAM)
                            .arg("MAXLEN")
                            .arg("~")
                            .arg(STREAM_MAX_MSGS)
                            .arg("*")
                            .arg("d")
                            .arg(msg.as_slice())
                            .ignore();
                    } else {
                        p.cmd("PUBLISH")
                            .arg(REDIS_CHANNEL)
                            .arg(msg.as_slice())
                            .ignore();
                    }
                }
                match p.query::<()>(c) {
                    Ok(()) => true,
                    Err(_) => {
                        con = None;
                        next_try = Instant::now() + Duration::from_millis(50);
                        false
                    }
                }
            } else {
                false
            };
            if ok {
                ctl.sent_msgs.fetch_add(out.len() as u64, Ordering::Relaxed);
                ctl.sent_events.fetch_add(n, Ordering::Relaxed);
                ctl.published.fetch_add(n_inw, Ordering::Relaxed);
            } else {
                ctl.pub_errors.fetch_add(n, Ordering::Relaxed);
            }
            out.clear();
        }
        if done {
            break;
        }
    }
    ctl.pub_done.store(true, Ordering::Release);
    Ok(thread_cpu_ns() - cpu_start.unwrap_or(cpu0))
}

fn redis_subscriber(
    ctl: Arc<Ctl>,
    url: String,
    streams: bool,
    ready: Arc<Barrier>,
) -> Result<SubStats, String> {
    let mut stats = SubStats::new();
    let mut first = true;
    let mut last_id = String::from("$");
    if streams {
        if let Ok(mut c) = redis_connect(&url) {
            let _ = redis::cmd("DEL").arg(REDIS_STREAM).query::<()>(&mut c);
        }
    }
    loop {
        let con = redis_connect(&url);
        if first {
            ready.wait();
        }
        let mut con = match con {
            Ok(c) => c,
            Err(e) if first => return Err(e),
            Err(_) => {
                if sub_should_stop(&ctl, &stats) {
                    break;
                }
                thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        if !first {
            ctl.app_reconnects.fetch_add(1, Ordering::Relaxed);
        }
        first = false;
        let mut fatal = false;
        if streams {
            // XREAD BLOCK wants a socket read timeout above its own block time.
            let _ = con.set_read_timeout(Some(Duration::from_millis(1000)));
            while !sub_should_stop(&ctl, &stats) {
                let r: redis::RedisResult<Option<redis::streams::StreamReadReply>> =
                    redis::cmd("XREAD")
                        .arg("COUNT")
                        .arg(512)
                        .arg("BLOCK")
                        .arg(100)
                        .arg("STREAMS")
                        .arg(REDIS_STREAM)
                        .arg(&last_id)
                        .query(&mut con);
                match r {
                    Ok(Some(reply)) => {
                        for k in reply.keys {
                            for id in k.ids {
                                if let Some(redis::Value::BulkString(b)) = id.map.get("d") {
                                    stats.record(b, ctl.base, ctl.window);
                                }
                                last_id = id.id;
                            }
                        }
                    }
                    Ok(None) => {}
                    Err(_) => {
                        fatal = true;
                        break;
                    }
                }
            }
        } else {
            let mut ps = con.as_pubsub();
            if ps.subscribe(REDIS_CHANNEL).is_err() {
                fatal = true;
            }
            let _ = ps.set_read_timeout(Some(Duration::from_millis(100)));
            while !fatal && !sub_should_stop(&ctl, &stats) {
                match ps.get_message() {
                    Ok(msg) => stats.record(msg.get_payload_bytes(), ctl.base, ctl.window),
                    Err(e) if e.is_timeout() => {}
                    Err(_) => fatal = true,
                }
            }
        }
        if !fatal {
            break;
        }
    }
    stats.cpu_end = thread_cpu_ns();
    Ok(stats)
}

// === one cell ===

fn run_cell(
    cfg: &BusConfig,
    transport: Transport,
    rate: u64,
    round: usize,
    mut broker: Option<&mut Broker>,
) -> Result<CellResult, String> {
    let base = Instant::now();
    let window = (
        (cfg.warmup_secs * 1e9) as u64,
        ((cfg.warmup_secs + cfg.secs) * 1e9) as u64,
    );
    let ctl = Arc::new(Ctl {
        base,
        window,
        generated: AtomicU64::new(0),
        published: AtomicU64::new(0),
        pub_errors: AtomicU64::new(0),
        sent_msgs: AtomicU64::new(0),
        sent_events: AtomicU64::new(0),
        pub_done: AtomicBool::new(false),
        app_reconnects: AtomicU64::new(0),
        killed_at: AtomicU64::new(0),
        restarted_at: AtomicU64::new(0),
        generated_while_down: AtomicU64::new(0),
        generated_total: AtomicU64::new(0),
    });
    // Publisher, subscriber and this thread meet once both clients are connected.
    let ready = Arc::new(Barrier::new(3));
    let url = broker.as_ref().map(|b| b.url.clone()).unwrap_or_default();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let publisher = {
        let (c, u, r, cf) = (ctl.clone(), url.clone(), ready.clone(), cfg.clone());
        match transport {
            Transport::NatsCore | Transport::NatsJetStream => {
                let js = transport == Transport::NatsJetStream;
                thread::spawn(move || nats_publisher(c, u, js, cf, rx, r))
            }
            Transport::RedisPubSub => {
                thread::spawn(move || redis_publisher(c, u, SyncMode::PubSub, cf, rx, r))
            }
            Transport::RedisStreams => {
                thread::spawn(move || redis_publisher(c, u, SyncMode::Streams, cf, rx, r))
            }
            Transport::Baseline => {
                thread::spawn(move || redis_publisher(c, u, SyncMode::Baseline, cf, rx, r))
            }
        }
    };
    let subscriber = {
        let (c, u, r) = (ctl.clone(), url.clone(), ready.clone());
        match transport {
            Transport::NatsCore => thread::spawn(move || nats_subscriber(c, u, false, r)),
            Transport::NatsJetStream => thread::spawn(move || nats_subscriber(c, u, true, r)),
            Transport::RedisPubSub => thread::spawn(move || redis_subscriber(c, u, false, r)),
            Transport::RedisStreams => thread::spawn(move || redis_subscriber(c, u, true, r)),
            Transport::Baseline => thread::spawn(move || {
                r.wait();
                Ok(SubStats::new())
            }),
        }
    };
    ready.wait();
    let generator = {
        let c = ctl.clone();
        thread::spawn(move || generator(c, rate, tx))
    };
    // Broker CPU over the window.
    let window_start = base + Duration::from_nanos(window.0);
    sleep_until(window_start);
    let broker_cpu = |b: &Option<&mut Broker>| b.as_ref().map_or(0, |b| proc_cpu_ns(b.pid()));
    let broker_cpu0 = broker_cpu(&broker);
    let mut restart = None;
    if let (Some(after), Some(broker)) = (cfg.restart_after_secs, broker.as_deref_mut()) {
        sleep_until(base + Duration::from_secs_f64(after));
        ctl.killed_at.store(now_ns(base), Ordering::Relaxed);
        broker.kill();
        thread::sleep(Duration::from_secs_f64(cfg.down_secs));
        broker.restart()?;
        ctl.restarted_at.store(now_ns(base), Ordering::Relaxed);
        restart = Some(());
    }
    sleep_until(base + Duration::from_nanos(window.1));
    let broker_cpu1 = broker_cpu(&broker);
    let _ = generator.join();
    let pub_cpu = publisher
        .join()
        .map_err(|_| "publisher panicked".to_string())??;
    let sub = subscriber
        .join()
        .map_err(|_| "subscriber panicked".to_string())??;
    let broker_cpu = if restart.is_some() {
        0
    } else {
        broker_cpu1.saturating_sub(broker_cpu0)
    };
    let restart = restart.map(|()| {
        let k = ctl.killed_at.load(Ordering::Relaxed);
        let r = ctl.restarted_at.load(Ordering::Relaxed);
        let before = sub.receipts.iter().copied().filter(|&t| t < k).max();
        let after = sub.receipts.iter().copied().filter(|&t| t > r).min();
        let received: u64 = sub.last_seq_events.iter().map(|&n| n as u64).sum();
        RestartResult {
            delivery_gap_ms: match (before, after) {
                (Some(b), Some(a)) => (a - b) as f64 / 1e6,
                _ => f64::NAN,
            },
            resume_after_restart_ms: after.map(|a| (a - r) as f64 / 1e6),
            lost: ctl
                .generated_total
                .load(Ordering::Relaxed)
                .saturating_sub(received),
            generated_while_down: ctl.generated_while_down.load(Ordering::Relaxed),
            library_reconnects: transport.bus() == Some(BusKind::Nats),
            app_reconnects: ctl.app_reconnects.load(Ordering::Relaxed),
            duplicates: sub.duplicates,
        }
    });
    let published = ctl.published.load(Ordering::Relaxed);
    Ok(CellResult {
        transport,
        offered: rate,
        round,
        secs: cfg.secs,
        generated: ctl.generated.load(Ordering::Relaxed),
        published,
        // The baseline has no subscriber: what it would have sent counts as delivered.
        delivered: if transport == Transport::Baseline {
            published
        } else {
            sub.delivered
        },
        messages: if transport == Transport::Baseline {
            ctl.sent_msgs.load(Ordering::Relaxed)
        } else {
            sub.messages
        },
        pub_errors: ctl.pub_errors.load(Ordering::Relaxed),
        transport_lag: sub.transport_lag,
        event_lag: sub.event_lag,
        pub_cpu_ns: pub_cpu,
        sub_cpu_ns: sub
            .cpu_end
            .saturating_sub(sub.cpu_start.unwrap_or(sub.cpu_end)),
        broker_cpu_ns: broker_cpu,
        restart,
    })
}

fn sleep_until(t: Instant) {
    let now = Instant::now();
    if t > now {
        thread::sleep(t - now);
    }
}

// === the whole run ===

/// Runs every cell, `rounds` times, transports and rates interleaved, with both
/// brokers up for the whole run; returns the results and the load averages seen
/// before and after.
pub fn run(cfg: &BusConfig) -> Result<(Vec<CellResult>, String, String), String> {
    let load_before = loadavg();
    let needs = |k: BusKind| cfg.transports.iter().any(|t| t.bus() == Some(k));
    let state = std::env::temp_dir().join(format!("radixgate-bench-bus.{}", std::process::id()));
    let mut nats = None;
    let mut redis = None;
    if needs(BusKind::Nats) {
        let dir = state.join("nats");
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        // Fault runs keep the broker's state across its restart (BUS_STATE_DIR).
        let dir = cfg.restart_after_secs.is_some().then_some(dir.as_path());
        nats = Some(Broker::start(
            BusKind::Nats,
            cfg.nats_port,
            &cfg.bus_script,
            dir,
        )?);
    }
    if needs(BusKind::Redis) {
        let dir = state.join("redis");
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        // Fault runs keep the broker's state across its restart (BUS_STATE_DIR).
        let dir = cfg.restart_after_secs.is_some().then_some(dir.as_path());
        redis = Some(Broker::start(
            BusKind::Redis,
            cfg.redis_port,
            &cfg.bus_script,
            dir,
        )?);
    }
    // The brokers' own CPU while idle (JetStream and the Go runtime have background
    // work), over one cell's length, so per-event figures can be read against it.
    let cpu_of = |b: &Option<Broker>| b.as_ref().map_or(0, |b| proc_cpu_ns(b.pid()));
    thread::sleep(Duration::from_millis(500));
    let (n0, r0) = (cpu_of(&nats), cpu_of(&redis));
    thread::sleep(Duration::from_secs_f64(cfg.secs));
    let idle = format!(
        "idle broker CPU over {:.1} s: nats-server {:.1} ms, redis-server {:.1} ms",
        cfg.secs,
        cpu_of(&nats).saturating_sub(n0) as f64 / 1e6,
        cpu_of(&redis).saturating_sub(r0) as f64 / 1e6
    );
    eprintln!("bus: {idle}");
    let mut results = Vec::new();
    let mut err = None;
    'outer: for round in 1..=cfg.rounds {
        for &rate in &cfg.rates {
            for &t in &cfg.transports {
                let broker = match t.bus() {
                    Some(BusKind::Nats) => nats.as_mut(),
                    Some(BusKind::Redis) => redis.as_mut(),
                    None => None,
                };
                eprintln!(
                    "bus: round {round} {} at {rate} events/s (load {})",
                    t.name(),
                    loadavg()
                );
                match run_cell(cfg, t, rate, round, broker) {
                    Ok(r) => results.push(r),
                    Err(e) => {
                        err = Some(e);
                        break 'outer;
                    }
                }
            }
        }
    }
    drop(nats);
    drop(redis);
    let _ = std::fs::remove_dir_all(&state);
    if let Some(e) = err {
        return Err(e);
    }
    Ok((results, format!("{load_before}; {idle}"), loadavg()))
}

fn us(h: &Histogram<u64>, q: f64) -> u64 {
    if h.is_empty() {
        0
    } else {
        h.value_at_quantile(q)
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.retain(|x| x.is_finite());
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn per_event(ns: u64, events: u64) -> f64 {
    if events == 0 {
        f64::NAN
    } else {
        ns as f64 / events as f64
    }
}

/// Markdown: every cell's row, then the medians per transport and rate with each
/// transport's ratio to the first one listed.
pub fn report(cfg: &BusConfig, results: &[CellResult]) -> String {
    let mut s = String::new();
    if cfg.restart_after_secs.is_some() {
        let _ = writeln!(
            s,
            "| transport | round | offered ev/s | reconnect | delivery gap ms | first msg after restart ms | generated while down | lost events | duplicates | publish errors (events) |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|");
        for r in results {
            let Some(x) = &r.restart else { continue };
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {:.0} | {} | {} | {} | {} | {} |",
                r.transport.name(),
                r.round,
                r.offered,
                if x.library_reconnects {
                    "by the library".to_string()
                } else {
                    format!("by app code ({}x)", x.app_reconnects)
                },
                x.delivery_gap_ms,
                x.resume_after_restart_ms
                    .map(|v| format!("{v:.0}"))
                    .unwrap_or_else(|| "never".into()),
                x.generated_while_down,
                x.lost,
                x.duplicates,
                r.pub_errors,
            );
        }
        return s;
    }
    let _ = writeln!(
        s,
        "| transport | round | offered ev/s | published ev/s | delivered ev/s | msgs/s | lag p50 us | lag p99 us | event lag p50 us | event lag p99 us | pub CPU ns/ev | sub CPU ns/ev | broker CPU ns/ev | lost | publish errors |"
    );
    let _ = writeln!(
        s,
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for r in results {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.0} | {:.0} | {:.0} | {} | {} | {} | {} | {:.0} | {:.0} | {:.0} | {} | {} |",
            r.transport.name(),
            r.round,
            r.offered,
            r.published as f64 / r.secs,
            r.delivered as f64 / r.secs,
            r.messages as f64 / r.secs,
            us(&r.transport_lag, 0.5),
            us(&r.transport_lag, 0.99),
            us(&r.event_lag, 0.5),
            us(&r.event_lag, 0.99),
            per_event(r.pub_cpu_ns, r.delivered),
            per_event(r.sub_cpu_ns, r.delivered),
            per_event(r.broker_cpu_ns, r.delivered),
            r.published.saturating_sub(r.delivered),
            r.pub_errors,
        );
    }
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "Medians over {} rounds (ratio to {} at the same rate in brackets):",
        cfg.rounds,
        cfg.transports
            .iter()
            .find(|t| **t != Transport::Baseline)
            .map(|t| t.name())
            .unwrap_or("-")
    );
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "| transport | offered ev/s | delivered ev/s | lag p50 us | lag p99 us | event lag p99 us | pub CPU ns/ev | sub CPU ns/ev | broker CPU ns/ev | client+broker CPU ns/ev | same, less the baseline's plumbing |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|");
    for &rate in &cfg.rates {
        let mut reference: Option<(Transport, [f64; 9])> = None;
        // The baseline's publisher CPU (channel, batching, encoding) at this rate.
        let base_pub = median(
            results
                .iter()
                .filter(|r| r.transport == Transport::Baseline && r.offered == rate)
                .map(|c| per_event(c.pub_cpu_ns, c.delivered))
                .collect(),
        );
        let base_pub = if base_pub.is_finite() { base_pub } else { 0.0 };
        for &t in &cfg.transports {
            let cells: Vec<&CellResult> = results
                .iter()
                .filter(|r| r.transport == t && r.offered == rate)
                .collect();
            if cells.is_empty() {
                continue;
            }
            let m = |f: &dyn Fn(&CellResult) -> f64| median(cells.iter().map(|c| f(c)).collect());
            let vals = [
                m(&|c| c.delivered as f64 / c.secs),
                m(&|c| us(&c.transport_lag, 0.5) as f64),
                m(&|c| us(&c.transport_lag, 0.99) as f64),
                m(&|c| us(&c.event_lag, 0.99) as f64),
                m(&|c| per_event(c.pub_cpu_ns, c.delivered)),
                m(&|c| per_event(c.sub_cpu_ns, c.delivered)),
                m(&|c| per_event(c.broker_cpu_ns, c.delivered)),
                m(&|c| per_event(c.pub_cpu_ns + c.sub_cpu_ns + c.broker_cpu_ns, c.delivered)),
                m(&|c| {
                    per_event(c.pub_cpu_ns + c.sub_cpu_ns + c.broker_cpu_ns, c.delivered) - base_pub
                }),
            ];
            let (ref_t, reference) = if t == Transport::Baseline {
                (t, vals)
            } else {
                *reference.get_or_insert((t, vals))
            };
            let cell = |i: usize| {
                let v = vals[i];
                let base = reference[i];
                if t == ref_t || !base.is_finite() || base == 0.0 {
                    format!("{v:.0}")
                } else {
                    format!("{v:.0} ({:.2}x)", v / base)
                }
            };
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                t.name(),
                rate,
                cell(0),
                cell(1),
                cell(2),
                cell(3),
                cell(4),
                cell(5),
                cell(6),
                cell(7),
                if t == Transport::Baseline {
                    "-".to_string()
                } else {
                    cell(8)
                },
            );
        }
    }
    s
}
