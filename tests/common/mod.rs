//! Shared helpers for the integration tests: start a gateway and upstreams in
//! process on ephemeral ports, and speak raw HTTP/1.1 to them over real sockets.

#![allow(dead_code)]
// Test threads are not shard threads: blocking waits are fine here.
#![allow(clippy::disallowed_methods)]

pub mod bus;

use radixgate::config::Config;
use radixgate::engine_sim::{self, EngineConfig, EngineHandle};
use radixgate::runtime::Driver;
use radixgate::Gateway;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Generates one test per I/O driver from `fn(driver: &str)`.
#[macro_export]
macro_rules! both_drivers {
    ($name:ident) => {
        mod $name {
            #[test]
            fn io_uring() {
                super::$name("io_uring");
            }
            #[test]
            fn epoll() {
                super::$name("epoll");
            }
        }
    };
}

pub fn driver(io: &str) -> Driver {
    match io {
        "io_uring" => Driver::IoUring,
        _ => Driver::Epoll,
    }
}

pub fn start_engine(io: &str, config: EngineConfig) -> EngineHandle {
    engine_sim::start(config, "127.0.0.1:0".parse().unwrap(), driver(io)).expect("engine starts")
}

/// Starts a gateway on an ephemeral port. `extra` is TOML appended after the
/// `[server]` section (so it may add keys to `[server]` first, then other tables);
/// `backends` are `(id, url, model)`.
pub fn start_gateway(
    io: &str,
    shards: usize,
    extra: &str,
    backends: &[(&str, String, &str)],
) -> Gateway {
    let toml = gateway_toml(io, shards, extra, backends);
    let config =
        Config::from_toml(&toml).unwrap_or_else(|e| panic!("bad test config: {e}\n{toml}"));
    Gateway::start(config).expect("gateway starts")
}

/// The config text [`start_gateway`] uses (listening on an ephemeral port).
pub fn gateway_toml(
    io: &str,
    shards: usize,
    extra: &str,
    backends: &[(&str, String, &str)],
) -> String {
    let mut toml =
        format!("[server]\nlisten = \"127.0.0.1:0\"\nshards = {shards}\nio = \"{io}\"\n{extra}\n");
    for (id, url, model) in backends {
        toml.push_str(&format!(
            "\n[[backends]]\nid = \"{id}\"\nurl = \"{url}\"\nmodels = [\"{model}\"]\n"
        ));
    }
    toml
}

/// A file in the temp directory, unique to this process and `name`.
pub fn temp_file(name: &str, contents: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("radixgate-{}-{name}", std::process::id()));
    std::fs::write(&path, contents).unwrap();
    path
}

/// The admin API token the tests configure ([`token_file`]).
#[allow(dead_code)] // not every test binary has an admin API
pub const TOKEN: &str = "test-admin-token-0123456789";

/// A file holding [`TOKEN`], for `admin.token_file`. Written once per process: tests
/// run in parallel, and a rewrite would let a reload read it half-written.
#[allow(dead_code)] // not every test binary has an admin API
pub fn token_file() -> String {
    static PATH: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    PATH.get_or_init(|| {
        temp_file("admin-token", &format!("{TOKEN}\n"))
            .display()
            .to_string()
    })
    .clone()
}

/// Starts a gateway from a config file (so it can reload it).
pub fn start_gateway_file(path: &std::path::Path) -> Gateway {
    let config = Config::load(path).unwrap_or_else(|e| panic!("bad test config: {e}"));
    Gateway::start(config).expect("gateway starts")
}

#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    /// The body as it came on the wire (chunk framing included).
    pub raw_body: Vec<u8>,
    /// The decoded body.
    pub body: Vec<u8>,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }

    /// `error.param` / `error.code` of an OpenAI-shaped error.
    pub fn error_param_code(&self) -> (Option<String>, String) {
        let v = self.json();
        let e = &v["error"];
        assert!(e["message"].is_string(), "no error.message in {v}");
        assert!(e["type"].is_string(), "no error.type in {v}");
        (
            e["param"].as_str().map(String::from),
            e["code"].as_str().unwrap_or_default().to_string(),
        )
    }
}

/// A raw HTTP/1.1 client connection.
pub struct Client {
    reader: BufReader<TcpStream>,
}

impl Client {
    pub fn connect(addr: SocketAddr) -> Client {
        let stream = TcpStream::connect(addr).expect("connect");
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        stream.set_nodelay(true).unwrap();
        Client {
            reader: BufReader::new(stream),
        }
    }

    pub fn stream(&mut self) -> &mut TcpStream {
        self.reader.get_mut()
    }

    pub fn send(&mut self, bytes: &[u8]) {
        self.reader.get_mut().write_all(bytes).expect("write");
    }

    pub fn post(&mut self, path: &str, body: &str, headers: &[(&str, &str)]) -> Response {
        self.send(&post_bytes(path, body, headers));
        self.read_response()
    }

    pub fn get(&mut self, path: &str) -> Response {
        self.send(format!("GET {path} HTTP/1.1\r\nHost: t\r\n\r\n").as_bytes());
        self.read_response()
    }

    pub fn read_head(&mut self) -> (u16, Vec<(String, String)>) {
        let mut line = String::new();
        self.reader.read_line(&mut line).expect("status line");
        assert!(line.starts_with("HTTP/1.1 "), "bad status line {line:?}");
        let status: u16 = line[9..12].parse().unwrap();
        let mut headers = Vec::new();
        loop {
            let mut h = String::new();
            self.reader.read_line(&mut h).expect("header line");
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            let (n, v) = h.split_once(':').expect("header colon");
            headers.push((n.trim().to_string(), v.trim().to_string()));
        }
        (status, headers)
    }

    pub fn read_response(&mut self) -> Response {
        let (status, headers) = self.read_head();
        let get = |name: &str| {
            headers
                .iter()
                .find(|(n, _)| n.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.clone())
        };
        let mut raw_body = Vec::new();
        let mut body = Vec::new();
        if get("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
            loop {
                let mut size_line = String::new();
                self.reader.read_line(&mut size_line).expect("chunk size");
                raw_body.extend_from_slice(size_line.as_bytes());
                let size = usize::from_str_radix(size_line.trim().split(';').next().unwrap(), 16)
                    .expect("hex chunk size");
                let mut data = vec![0; size + 2];
                self.reader.read_exact(&mut data).expect("chunk data");
                raw_body.extend_from_slice(&data);
                body.extend_from_slice(&data[..size]);
                if size == 0 {
                    break;
                }
            }
        } else if let Some(len) = get("content-length") {
            let mut data = vec![0; len.parse().unwrap()];
            self.reader.read_exact(&mut data).expect("body");
            raw_body = data.clone();
            body = data;
        } else if status != 100 {
            self.reader.read_to_end(&mut body).expect("body to close");
            raw_body = body.clone();
        }
        Response {
            status,
            headers,
            raw_body,
            body,
        }
    }

    /// The next chunk of a chunked body whose head [`Client::read_head`] read: its
    /// data, empty for the last chunk.
    pub fn read_chunk(&mut self) -> Vec<u8> {
        let mut size_line = String::new();
        self.reader.read_line(&mut size_line).expect("chunk size");
        let size = usize::from_str_radix(size_line.trim().split(';').next().unwrap(), 16)
            .unwrap_or_else(|_| panic!("hex chunk size in {size_line:?}"));
        let mut data = vec![0; size + 2];
        self.reader.read_exact(&mut data).expect("chunk data");
        data.truncate(size);
        data
    }

    /// True once the server has closed the connection: an end of stream, or a reset
    /// (a server that closes with our unread bytes in its buffer sends RST, and which
    /// of the two the client sees depends on timing).
    pub fn is_closed(&mut self) -> bool {
        let mut byte = [0u8; 1];
        match self.reader.read(&mut byte) {
            Ok(0) => true,
            Err(e) => matches!(
                e.kind(),
                std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::ConnectionAborted
            ),
            Ok(_) => false,
        }
    }
}

pub fn post_bytes(path: &str, body: &str, headers: &[(&str, &str)]) -> Vec<u8> {
    let mut req = format!("POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {}\r\n", body.len());
    for (n, v) in headers {
        req.push_str(&format!("{n}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    req.into_bytes()
}

pub fn chat_body(content: &str, stream: bool) -> String {
    format!(
        r#"{{"model":"sim","stream":{stream},"max_tokens":4,"stream_options":{{"include_usage":{stream}}},"messages":[{{"role":"user","content":"{content}"}}]}}"#
    )
}

/// Polls `f` until it returns true or `limit` passes.
pub fn eventually(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    f()
}

/// The value of a metric line starting with `prefix` (name plus labels).
pub fn metric(text: &str, prefix: &str) -> Option<f64> {
    metric_values(text, prefix).next()
}

/// The sum over every metric line starting with `prefix` (a labelled prefix of a
/// series split by further labels).
pub fn metric_sum(text: &str, prefix: &str) -> f64 {
    metric_values(text, prefix).sum()
}

fn metric_values<'a>(text: &'a str, prefix: &'a str) -> impl Iterator<Item = f64> + 'a {
    text.lines()
        .filter(move |l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
}

// === a scripted upstream ===

/// What a [`ScriptedUpstream`] received: request head and body.
#[derive(Debug, Clone)]
pub struct Seen {
    pub head: String,
    pub body: Vec<u8>,
}

#[derive(Clone)]
pub enum Script {
    /// Answer every request with these raw bytes (written in the given pieces,
    /// flushing each).
    Reply(Vec<Vec<u8>>),
    /// Read the request and never answer.
    Silent,
}

/// A hand-written HTTP/1.1 upstream on a std thread: records what it receives and
/// answers with scripted bytes. Answers the coordinator's `GET /health` with 200 and
/// any other GET (its `/metrics` scrape) with 404, recording neither.
pub struct ScriptedUpstream {
    pub addr: SocketAddr,
    pub seen: Arc<Mutex<Vec<Seen>>>,
    pub connections: Arc<AtomicUsize>,
}

impl ScriptedUpstream {
    pub fn start(script: Script) -> ScriptedUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let connections = Arc::new(AtomicUsize::new(0));
        let (s, c) = (seen.clone(), connections.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { return };
                let (s, c, script) = (s.clone(), c.clone(), script.clone());
                std::thread::spawn(move || serve_scripted(stream, script, s, c));
            }
        });
        ScriptedUpstream {
            addr,
            seen,
            connections,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

fn serve_scripted(
    stream: TcpStream,
    script: Script,
    seen: Arc<Mutex<Vec<Seen>>>,
    conns: Arc<AtomicUsize>,
) {
    let mut reader = BufReader::new(stream);
    let mut counted = false;
    loop {
        let mut head = String::new();
        loop {
            let mut line = String::new();
            match reader.read_line(&mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            head.push_str(&line);
            if line == "\r\n" {
                break;
            }
        }
        // The coordinator's probes: health is fine, metrics are not offered.
        if head.starts_with("GET ") {
            let status = if head.starts_with("GET /health") {
                "200 OK"
            } else {
                "404 Not Found"
            };
            let resp =
                format!("HTTP/1.1 {status}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
            let _ = reader.get_mut().write_all(resp.as_bytes());
            return;
        }
        if !counted {
            conns.fetch_add(1, Ordering::SeqCst);
            counted = true;
        }
        let len = head
            .lines()
            .find_map(|l| {
                let (n, v) = l.split_once(':')?;
                n.eq_ignore_ascii_case("content-length")
                    .then(|| v.trim().parse::<usize>().ok())?
            })
            .unwrap_or(0);
        let mut body = vec![0; len];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        seen.lock().unwrap().push(Seen { head, body });
        match &script {
            Script::Silent => {
                let mut sink = [0u8; 64];
                let _ = reader.read(&mut sink);
                return;
            }
            Script::Reply(pieces) => {
                for p in pieces {
                    if reader.get_mut().write_all(p).is_err() {
                        return;
                    }
                    reader.get_mut().flush().ok();
                    std::thread::sleep(Duration::from_millis(2));
                }
            }
        }
    }
}

/// Waits until every shard's replica has applied every index event sent to it.
pub fn wait_replicated(addr: SocketAddr) {
    let caught_up = eventually(Duration::from_secs(5), || {
        let m = Client::connect(addr).get("/metrics").text();
        metric(&m, "radixgate_replica_pending_events") == Some(0.0)
            && m.lines()
                .filter(|l| l.starts_with("radixgate_replica_lag_events{"))
                .all(|l| l.ends_with(" 0"))
    });
    assert!(caught_up, "replicas did not catch up");
}

/// Metric names documented in docs/operations.md's metrics table (a row's first cell may list
/// several: `a`, `b`, `c`).
pub fn documented_metrics() -> Vec<String> {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operations.md"))
            .unwrap();
    readme
        .lines()
        .filter(|l| l.starts_with("| `radixgate_"))
        .filter_map(|l| l.split(" | ").next())
        .flat_map(|cell| cell.split('`').skip(1).step_by(2).map(String::from))
        .collect()
}

/// Sleeps the test thread (for fault timing: a kill mid-run, a breaker's open time).
pub fn pause(d: Duration) {
    std::thread::sleep(d);
}

/// `n` simulated engines that answer at once (ids `e0`, `e1`, ...) behind a gateway
/// with `shards` shards; `extra` as in [`start_gateway`].
pub fn instant_fleet(
    io: &str,
    n: usize,
    shards: usize,
    extra: &str,
) -> (Vec<EngineHandle>, Gateway) {
    fleet_of(io, &EngineConfig::instant("sim"), n, shards, extra)
}

/// [`instant_fleet`] of `n` engines configured as `engine`.
pub fn fleet_of(
    io: &str,
    engine: &EngineConfig,
    n: usize,
    shards: usize,
    extra: &str,
) -> (Vec<EngineHandle>, Gateway) {
    let engines: Vec<_> = (0..n).map(|_| start_engine(io, engine.clone())).collect();
    let ids: Vec<String> = (0..n).map(|i| format!("e{i}")).collect();
    let backends: Vec<_> = engines
        .iter()
        .zip(&ids)
        .map(|(e, id)| (id.as_str(), e.url(), "sim"))
        .collect();
    let gw = start_gateway(io, shards, extra, &backends);
    (engines, gw)
}

/// After a client left: waits (up to 1 s) until none of `backends` has a request in
/// flight and the gateway's `radixgate_requests_total` series starting with
/// `counted_499` (its labels up to the 499 status) reads 1, then checks that no
/// backend's breaker opened.
pub fn assert_departure_released(addr: SocketAddr, backends: &[&str], counted_499: &str) {
    let released = eventually(Duration::from_secs(1), || {
        let m = Client::connect(addr).get("/metrics").text();
        backends.iter().all(|b| {
            let in_flight = format!("radixgate_backend_in_flight{{backend=\"{b}\"}}");
            metric(&m, &in_flight) == Some(0.0)
        }) && metric(&m, counted_499) == Some(1.0)
    });
    let m = Client::connect(addr).get("/metrics").text();
    assert!(
        released,
        "accounting not released or the 499 not counted:\n{m}"
    );
    for b in backends {
        let state = format!("radixgate_breaker_state{{backend=\"{b}\"}}");
        assert_eq!(metric(&m, &state), Some(0.0), "{b}:\n{m}");
    }
}
