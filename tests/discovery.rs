//! Backend discovery by DNS over real sockets: `localhost` through the system
//! resolver reaching a simulated engine; a small authoritative DNS server on a
//! loopback UDP port (its messages built by hickory-proto) serving A and SRV
//! records, changed under load (an address added, one removed: added, drained and
//! removed with no request lost); a vanished address with a request in flight is
//! drained until it finishes, or removed at `drain_timeout_ms` with the request
//! still finishing; a name that stops resolving (NXDOMAIN) keeps the last good set
//! and is counted; a reload leaves discovered backends be; and a bad name is a
//! config error naming the key.

mod common;

use common::*;
use hickory_proto::op::{Message, MessageType, ResponseCode};
use hickory_proto::rr::rdata::{A, SRV};
use hickory_proto::rr::{Name, RData, Record};
use radixgate::config::Config;
use radixgate::engine_sim::{self, EngineConfig, EngineHandle};
use std::collections::{BTreeSet, HashMap};
use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

// === a test DNS server ===

/// Records by lower-case absolute name; a name not held is NXDOMAIN.
type Zone = HashMap<String, Vec<Record>>;

/// An authoritative DNS server on 127.0.0.1 (UDP) answering from a zone the test
/// edits while it runs.
struct DnsServer {
    addr: SocketAddr,
    zone: Arc<Mutex<Zone>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

fn absolute(name: &str) -> String {
    let n = name.to_ascii_lowercase();
    if n.ends_with('.') {
        n
    } else {
        format!("{n}.")
    }
}

impl DnsServer {
    fn start() -> DnsServer {
        let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
        socket
            .set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        let addr = socket.local_addr().unwrap();
        let zone: Arc<Mutex<Zone>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (zone, stop) = (zone.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while !stop.load(Ordering::Relaxed) {
                    let Ok((n, from)) = socket.recv_from(&mut buf) else {
                        continue;
                    };
                    let Ok(query) = Message::from_vec(&buf[..n]) else {
                        continue;
                    };
                    let answer = answer(&query, &zone.lock().unwrap());
                    if let Ok(bytes) = answer.to_vec() {
                        let _ = socket.send_to(&bytes, from);
                    }
                }
            })
        };
        DnsServer {
            addr,
            zone,
            stop,
            thread: Some(thread),
        }
    }

    /// Replaces `name`'s records (none: the name no longer exists).
    fn set(&self, name: &str, records: Vec<RData>) {
        let owner = Name::from_ascii(absolute(name)).unwrap();
        let mut zone = self.zone.lock().unwrap();
        if records.is_empty() {
            zone.remove(&absolute(name));
        } else {
            let records = records
                .into_iter()
                .map(|data| Record::from_rdata(owner.clone(), 1, data))
                .collect();
            zone.insert(absolute(name), records);
        }
    }
}

impl Drop for DnsServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn answer(query: &Message, zone: &Zone) -> Message {
    let mut reply = Message::response(query.metadata.id, query.metadata.op_code);
    reply.metadata.message_type = MessageType::Response;
    reply.metadata.authoritative = true;
    reply.metadata.recursion_desired = query.metadata.recursion_desired;
    reply.metadata.recursion_available = true;
    reply.add_queries(query.queries.clone());
    for q in &query.queries {
        match zone.get(&absolute(&q.name().to_ascii())) {
            None => reply.metadata.response_code = ResponseCode::NXDomain,
            Some(records) => {
                for r in records.iter().filter(|r| r.record_type() == q.query_type()) {
                    reply.add_answer(r.clone());
                }
            }
        }
    }
    reply
}

fn a(ip: Ipv4Addr) -> RData {
    RData::A(A(ip))
}

fn srv(port: u16, target: &str) -> RData {
    RData::SRV(SRV::new(
        0,
        1,
        port,
        Name::from_ascii(absolute(target)).unwrap(),
    ))
}

// === the gateway side ===

/// A gateway with no `[[backends]]`, only this `[[discovery]]` entry (TOML body).
fn gateway(io: &str, discovery: &str) -> radixgate::Gateway {
    let toml = config_toml(io, discovery);
    let config = Config::from_toml(&toml).unwrap_or_else(|e| panic!("{e}\n{toml}"));
    radixgate::Gateway::start(config).expect("gateway starts")
}

fn config_toml(io: &str, discovery: &str) -> String {
    let extra = format!(
        "[routing]\npolicy = \"round_robin\"\n[health]\ninterval_ms = 100\n\
         [admin]\nlisten = \"127.0.0.1:0\"\ntoken_file = \"{}\"\n\
         [[discovery]]\nmodels = [\"sim\"]\ninterval_ms = 200\nmin_interval_ms = 50\n\
         {discovery}\n",
        token_file()
    );
    gateway_toml(io, 2, &extra, &[])
}

fn admin(gw: &radixgate::Gateway, method: &str, path: &str) -> Response {
    let mut c = Client::connect(gw.admin_addr().expect("admin listens"));
    c.send(
        format!(
            "{method} {path} HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: 0\r\n\r\n"
        )
        .as_bytes(),
    );
    c.read_response()
}

/// The ids of the backends in force (`GET /admin/backends`).
fn backends(gw: &radixgate::Gateway) -> BTreeSet<String> {
    admin(gw, "GET", "/admin/backends")
        .json()
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["id"].as_str().unwrap().to_string())
        .collect()
}

fn ids(name: &str, addrs: &[SocketAddr]) -> BTreeSet<String> {
    addrs.iter().map(|a| format!("{name}@{a}")).collect()
}

fn wait_for_backends(gw: &radixgate::Gateway, want: &BTreeSet<String>) {
    assert!(
        eventually(Duration::from_secs(10), || backends(gw) == *want),
        "backends {:?}, want {want:?}",
        backends(gw)
    );
}

fn scrape(gw: &radixgate::Gateway, family: &str, name: &str) -> f64 {
    let text = Client::connect(gw.local_addr()).get("/metrics").text();
    metric(&text, &format!("{family}{{name=\"{name}\"}}")).unwrap_or(-1.0)
}

fn chat(gw: &radixgate::Gateway) -> Response {
    Client::connect(gw.local_addr()).post("/v1/chat/completions", &chat_body("hello", false), &[])
}

/// Requests in a loop until stopped: (served, failed).
struct Load {
    stop: Arc<AtomicBool>,
    served: Arc<AtomicU64>,
    failed: Arc<Mutex<Vec<String>>>,
    thread: std::thread::JoinHandle<()>,
}

impl Load {
    fn start(addr: SocketAddr) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let served = Arc::new(AtomicU64::new(0));
        let failed: Arc<Mutex<Vec<String>>> = Arc::default();
        let thread = {
            let (stop, served, failed) = (stop.clone(), served.clone(), failed.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let r = Client::connect(addr).post(
                        "/v1/chat/completions",
                        &chat_body("under load", false),
                        &[],
                    );
                    if r.status == 200 {
                        served.fetch_add(1, Ordering::Relaxed);
                    } else {
                        failed
                            .lock()
                            .unwrap()
                            .push(format!("{}: {}", r.status, r.text()));
                    }
                }
            })
        };
        Load {
            stop,
            served,
            failed,
            thread,
        }
    }

    fn finish(self) -> (u64, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap();
        let failed = self.failed.lock().unwrap().clone();
        (self.served.load(Ordering::Relaxed), failed)
    }
}

/// An engine that answers every completion after `delay`.
fn engine_at_with(io: &str, addr: &str, delay: Duration) -> EngineHandle {
    let config = EngineConfig {
        fixed_response: true,
        fixed_delay: delay,
        ..EngineConfig::instant("sim")
    };
    engine_sim::start(config, addr.parse().unwrap(), driver(io)).expect("engine starts")
}

fn engine_at(io: &str, addr: &str) -> EngineHandle {
    engine_sim::start(
        EngineConfig::instant("sim"),
        addr.parse().unwrap(),
        driver(io),
    )
    .expect("engine starts")
}

// === the tests ===

fn localhost_through_the_system_resolver(io: &str) {
    let engine = start_engine(io, EngineConfig::instant("sim"));
    let port = engine.addr().port();
    let gw = gateway(io, &format!("name = \"localhost\"\nport = {port}"));
    let want = format!("localhost@127.0.0.1:{port}");
    assert!(
        eventually(Duration::from_secs(10), || backends(&gw).contains(&want)),
        "{:?}",
        backends(&gw)
    );
    for _ in 0..5 {
        let r = chat(&gw);
        assert_eq!(r.status, 200, "{}", r.text());
    }
    assert!(scrape(&gw, "radixgate_discovery_resolutions_total", "localhost") >= 1.0);
    assert_eq!(
        scrape(&gw, "radixgate_discovery_failures_total", "localhost"),
        0.0
    );
    drop(gw);
}
both_drivers!(localhost_through_the_system_resolver);

fn srv_records_changed_under_load(io: &str) {
    let engines: Vec<EngineHandle> = (0..3)
        .map(|_| start_engine(io, EngineConfig::instant("sim")))
        .collect();
    let addrs: Vec<SocketAddr> = engines.iter().map(|e| e.addr()).collect();
    let dns = DnsServer::start();
    let name = "_http._tcp.engines.test";
    for (i, _) in addrs.iter().enumerate() {
        dns.set(&format!("e{i}.engines.test"), vec![a(Ipv4Addr::LOCALHOST)]);
    }
    let records = |which: &[usize]| {
        which
            .iter()
            .map(|&i| srv(addrs[i].port(), &format!("e{i}.engines.test")))
            .collect()
    };
    dns.set(name, records(&[0, 1]));
    let gw = gateway(
        io,
        &format!("name = \"{name}\"\nsrv = true\nresolver = \"{}\"", dns.addr),
    );
    wait_for_backends(&gw, &ids(name, &addrs[..2]));
    let load = Load::start(gw.local_addr());
    // One address added, one removed: e2 takes traffic, e0 drains and goes.
    dns.set(name, records(&[1, 2]));
    wait_for_backends(&gw, &ids(name, &addrs[1..]));
    let new_id = format!("{name}@{}", addrs[2]);
    assert!(
        eventually(Duration::from_secs(10), || {
            chat(&gw).header("x-router-backend") == Some(new_id.as_str())
        }),
        "the added backend takes no traffic"
    );
    // The records are the truth: a discovered backend removed through the admin
    // API is added again at the next resolution.
    let gone = format!("{name}@{}", addrs[1]);
    assert_eq!(
        admin(&gw, "DELETE", &format!("/admin/backends/{gone}")).status,
        200
    );
    assert!(
        eventually(Duration::from_secs(10), || backends(&gw).contains(&gone)),
        "{:?}",
        backends(&gw)
    );
    let (served, failed) = load.finish();
    assert!(failed.is_empty(), "requests failed: {failed:?}");
    assert!(served > 0);
    assert_eq!(scrape(&gw, "radixgate_discovery_addresses", name), 2.0);
    assert_eq!(scrape(&gw, "radixgate_discovery_draining", name), 0.0);
    assert_eq!(scrape(&gw, "radixgate_discovery_failures_total", name), 0.0);
    drop(gw);
}
both_drivers!(srv_records_changed_under_load);

/// A records with a configured port: engines on 127.0.0.2 and 127.0.0.3 (both
/// loopback) share one port. The name does not exist at start, then does, then
/// vanishes (NXDOMAIN) and the last good set stands.
fn a_records_from_nothing_to_nxdomain(io: &str) {
    let e2 = engine_at(io, "127.0.0.2:0");
    let port = e2.addr().port();
    let e3 = engine_at(io, &format!("127.0.0.3:{port}"));
    let dns = DnsServer::start();
    let name = "pool.engines.test";
    let file = temp_file(
        &format!("discovery-a-{io}.toml"),
        &config_toml(
            io,
            &format!(
                "name = \"{name}\"\nport = {port}\nresolver = \"{}\"",
                dns.addr
            ),
        ),
    );
    let gw = start_gateway_file(&file);
    // Never resolved: the gateway runs with no backend for it and keeps trying.
    assert!(eventually(Duration::from_secs(10), || {
        scrape(&gw, "radixgate_discovery_failures_total", name) >= 2.0
    }));
    assert!(backends(&gw).is_empty());
    let r = chat(&gw);
    assert_eq!(r.status, 404, "{}", r.text());
    assert_eq!(r.error_param_code().1, "model_not_found");
    assert_eq!(Client::connect(gw.local_addr()).get("/ready").status, 503);
    dns.set(name, vec![a(Ipv4Addr::new(127, 0, 0, 2))]);
    wait_for_backends(&gw, &ids(name, &[e2.addr()]));
    assert_eq!(chat(&gw).status, 200);
    assert_eq!(Client::connect(gw.local_addr()).get("/ready").status, 200);
    dns.set(
        name,
        vec![
            a(Ipv4Addr::new(127, 0, 0, 2)),
            a(Ipv4Addr::new(127, 0, 0, 3)),
        ],
    );
    let both = ids(name, &[e2.addr(), e3.addr()]);
    wait_for_backends(&gw, &both);
    // A reload of the file (which lists no [[backends]]) leaves them be.
    let reloaded = admin(&gw, "POST", "/admin/reload");
    assert_eq!(reloaded.status, 200, "{}", reloaded.text());
    assert_eq!(
        reloaded.json()["backends"]["removed"],
        serde_json::json!([])
    );
    assert_eq!(backends(&gw), both);
    // NXDOMAIN: counted, and the last good set stands.
    let before = scrape(&gw, "radixgate_discovery_failures_total", name);
    let load = Load::start(gw.local_addr());
    dns.set(name, vec![]);
    assert!(eventually(Duration::from_secs(10), || {
        scrape(&gw, "radixgate_discovery_failures_total", name) >= before + 3.0
    }));
    assert_eq!(backends(&gw), both);
    assert_eq!(scrape(&gw, "radixgate_discovery_addresses", name), 2.0);
    let (served, failed) = load.finish();
    assert!(failed.is_empty(), "requests failed: {failed:?}");
    assert!(served > 0);
    drop(gw);
    std::fs::remove_file(&file).ok();
    e2.stop();
    e3.stop();
}
both_drivers!(a_records_from_nothing_to_nxdomain);

/// `drain_timeout_ms`, and whether the request in flight outlives it.
fn vanished_address_drains(io: &str, drain_timeout_ms: u64) {
    let slow = engine_at_with(io, "127.0.0.1:0", Duration::from_millis(1500));
    let fast = start_engine(io, EngineConfig::instant("sim"));
    let dns = DnsServer::start();
    let name = "_http._tcp.drain.test";
    dns.set("slow.drain.test", vec![a(Ipv4Addr::LOCALHOST)]);
    dns.set("fast.drain.test", vec![a(Ipv4Addr::LOCALHOST)]);
    dns.set(name, vec![srv(slow.addr().port(), "slow.drain.test")]);
    let gw = gateway(
        io,
        &format!(
            "name = \"{name}\"\nsrv = true\nresolver = \"{}\"\ndrain_timeout_ms = {drain_timeout_ms}",
            dns.addr
        ),
    );
    let slow_id = format!("{name}@{}", slow.addr());
    wait_for_backends(&gw, &ids(name, &[slow.addr()]));
    // A request in flight on the slow engine when its record vanishes.
    let addr = gw.local_addr();
    let running = std::thread::spawn(move || {
        Client::connect(addr).post("/v1/chat/completions", &chat_body("slow", false), &[])
    });
    let backend = |id: &str| {
        admin(&gw, "GET", "/admin/backends")
            .json()
            .as_array()
            .unwrap()
            .iter()
            .find(|b| b["id"] == id)
            .cloned()
    };
    assert!(eventually(Duration::from_secs(5), || {
        backend(&slow_id).is_some_and(|b| b["in_flight"] == 1)
    }));
    dns.set(name, vec![srv(fast.addr().port(), "fast.drain.test")]);
    let fast_id = format!("{name}@{}", fast.addr());
    assert!(eventually(Duration::from_secs(5), || backend(&fast_id).is_some()));
    if drain_timeout_ms > 1500 {
        // Drained, not removed, while its request runs; new requests go elsewhere.
        let b = backend(&slow_id).expect("still there while its request runs");
        assert_eq!(b["draining"], true, "{b}");
        assert_eq!(scrape(&gw, "radixgate_discovery_draining", name), 1.0);
        let r = chat(&gw);
        assert_eq!(r.header("x-router-backend"), Some(fast_id.as_str()));
    } else {
        // Past the drain timeout it is removed with the request still running.
        assert!(eventually(Duration::from_secs(5), || backend(&slow_id).is_none()));
        assert!(!running.is_finished());
    }
    // Either way the request in flight finishes, and the backend goes.
    let r = running.join().unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-router-backend"), Some(slow_id.as_str()));
    wait_for_backends(&gw, &ids(name, &[fast.addr()]));
    assert_eq!(scrape(&gw, "radixgate_discovery_draining", name), 0.0);
    drop(gw);
}

fn vanished_address_drains_then_goes(io: &str) {
    vanished_address_drains(io, 30_000);
}
both_drivers!(vanished_address_drains_then_goes);

fn drain_timeout_removes_with_requests_running(io: &str) {
    vanished_address_drains(io, 200);
}
both_drivers!(drain_timeout_removes_with_requests_running);

#[test]
fn bad_discovery_entries_are_config_errors_naming_the_key() {
    let load = |entry: &str| {
        Config::from_toml(&format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n[[discovery]]\nmodels = [\"sim\"]\n{entry}\n"
        ))
        .map(|_| ())
        .map_err(|e| e.to_string())
    };
    let err = load("name = \"engines!.bad name\"\nport = 8000").unwrap_err();
    assert!(err.contains("discovery[0].name"), "{err}");
    assert!(err.contains("is not a DNS name"), "{err}");
    let err = load("name = \"engines.test\"").unwrap_err();
    assert!(err.contains("discovery[0].port"), "{err}");
    let err = load("name = \"engines.test\"\nsrv = true\nport = 80").unwrap_err();
    assert!(err.contains("discovery[0].port: excludes srv"), "{err}");
    let err = load("name = \"engines.test\"\nport = 80\nresolver = \"dns.local\"").unwrap_err();
    assert!(err.contains("discovery[0].resolver"), "{err}");
    assert!(load("name = \"engines.test\"\nport = 80").is_ok());
    // Without [[backends]] or [[discovery]] there is nothing to route to.
    let err = Config::from_toml("[server]\nlisten = \"127.0.0.1:0\"\n").unwrap_err();
    assert!(err.to_string().contains("[[discovery]]"), "{err}");
}
