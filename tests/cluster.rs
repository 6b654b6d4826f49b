//! Cluster mode with a real bus (`deploy/cluster/bus`, Redis) and gateways on real
//! sockets: what one replica routes, the others find; load is seen fleet-wide;
//! a replica that routes differently refuses to join; the bus going away costs no
//! request; bad bus messages are counted and dropped. TLS to the bus is in
//! `cluster/tls.rs`.

mod common;
#[path = "cluster/tls.rs"]
mod tls;

use common::bus::Bus;
use common::{chat_body, eventually, metric, start_engine, start_gateway, Client};
use radixgate::engine_sim::{EngineConfig, EngineHandle};
use radixgate::Gateway;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// A channel of its own per test, so tests sharing a bus never see each other.
fn channel(name: &str) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!(
        "t{}-{name}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

fn cluster_toml(bus: &Bus, channel: &str, extra: &str) -> String {
    format!(
        "[routing]\npolicy = \"prefix_aware\"\n{extra}\n[cluster]\nurl = \"{}\"\nchannel = \"{channel}\"\nreport_interval_ms = 50\npeer_timeout_ms = 500\n",
        bus.url
    )
}

fn engines(n: usize) -> Vec<EngineHandle> {
    (0..n)
        .map(|_| start_engine("epoll", EngineConfig::instant("sim")))
        .collect()
}

/// An engine whose answers (4 tokens) take four times `per_token`.
fn slow_engine(per_token: Duration) -> EngineHandle {
    start_engine(
        "epoll",
        EngineConfig {
            decode_per_token: per_token,
            ..EngineConfig::instant("sim")
        },
    )
}

fn replica(engines: &[EngineHandle], toml: &str) -> Gateway {
    let ids: Vec<String> = (0..engines.len()).map(|i| format!("e{i}")).collect();
    let backends: Vec<_> = engines
        .iter()
        .zip(&ids)
        .map(|(e, id)| (id.as_str(), e.url(), "sim"))
        .collect();
    start_gateway("epoll", 1, toml, &backends)
}

fn scrape(addr: SocketAddr) -> String {
    Client::connect(addr).get("/metrics").text()
}

/// A prompt of many blocks about document `doc`, ending in question `q`.
fn doc_prompt(doc: usize, q: usize) -> String {
    let text: String = (0..120)
        .map(|i| format!("Document {doc} sentence {i} says something. "))
        .collect();
    chat_body(&format!("{text}Question {q}?"), false)
}

fn ask(addr: SocketAddr, body: &str) -> (u16, String, String) {
    let r = Client::connect(addr).post("/v1/chat/completions", body, &[]);
    (
        r.status,
        r.header("x-router-backend").unwrap_or("").to_string(),
        r.header("x-router-reason").unwrap_or("").to_string(),
    )
}

/// Waits until `addr` hears from `peers` peers.
fn wait_peers(addr: SocketAddr, peers: usize) {
    assert!(
        eventually(Duration::from_secs(10), || metric(
            &scrape(addr),
            "radixgate_cluster_peers "
        ) == Some(peers as f64)),
        "replica at {addr} did not see {peers} peers:\n{}",
        scrape(addr)
    );
}

fn applied(addr: SocketAddr) -> f64 {
    metric(&scrape(addr), "radixgate_cluster_ops_applied_total").unwrap_or(0.0)
}

/// Sends `body` to `from` and waits until replica `to` has applied the routing ops
/// it published (in its coordinator and its shard) and has heard that the request
/// ended (a peer's request still counted in flight can rightly send the next one
/// elsewhere); returns the backend it chose.
fn route_and_share(from: SocketAddr, to: SocketAddr, body: &str) -> String {
    let before = applied(to);
    let (status, home, _) = ask(from, body);
    assert_eq!(status, 200);
    assert!(
        eventually(Duration::from_secs(5), || applied(to) > before),
        "replica {to} never applied what {from} routed"
    );
    common::wait_replicated(to);
    assert!(
        eventually(Duration::from_secs(5), || scrape(to)
            .lines()
            .filter(|l| l.starts_with("radixgate_cluster_peer_in_flight{"))
            .all(|l| l.ends_with(" 0"))),
        "replica {to} still counts {from}'s request in flight"
    );
    home
}

fn coordinator_blocks(addr: SocketAddr) -> f64 {
    metric(
        &scrape(addr),
        "radixgate_index_blocks{copy=\"coordinator\"}",
    )
    .unwrap_or(0.0)
}

#[test]
fn a_prefix_routed_by_one_replica_is_found_by_the_other() {
    let bus = Bus::start();
    let engines = engines(3);
    let toml = cluster_toml(&bus, &channel("prefix"), "");
    let (a, b) = (replica(&engines, &toml), replica(&engines, &toml));
    wait_peers(a.local_addr(), 1);
    wait_peers(b.local_addr(), 1);
    for doc in 0..4 {
        // Replica B learns the blocks over the bus, then routes the document home.
        let home = route_and_share(a.local_addr(), b.local_addr(), &doc_prompt(doc, 0));
        for q in 1..4 {
            let (status, backend, reason) = ask(b.local_addr(), &doc_prompt(doc, q));
            assert_eq!(status, 200);
            assert_eq!(
                (backend.as_str(), reason.as_str()),
                (home.as_str(), "longest-prefix"),
                "document {doc}, question {q}"
            );
        }
    }
    // And back: what B placed, A finds.
    let home = route_and_share(b.local_addr(), a.local_addr(), &doc_prompt(9, 0));
    let (_, backend, reason) = ask(a.local_addr(), &doc_prompt(9, 1));
    assert_eq!((backend, reason.as_str()), (home, "longest-prefix"));
    let m = scrape(b.local_addr());
    assert!(metric(&m, "radixgate_cluster_ops_applied_total").unwrap() > 0.0);
    assert_eq!(metric(&m, "radixgate_cluster_connected "), Some(1.0));
    // Every cluster family is in the metrics table (docs/operations.md).
    let documented = common::documented_metrics();
    for line in m
        .lines()
        .filter(|l| l.starts_with("# TYPE radixgate_cluster"))
    {
        let name = line.split(' ').nth(2).unwrap();
        assert!(
            documented.iter().any(|d| d == name),
            "{name} is not in the metrics table (docs/operations.md)"
        );
    }
    a.shutdown();
    b.shutdown();
}

#[test]
fn a_replica_that_cuts_prompts_differently_refuses_to_join() {
    let bus = Bus::start();
    let engines = engines(1);
    let ch = channel("fingerprint");
    let a = replica(&engines, &cluster_toml(&bus, &ch, ""));
    let toml = cluster_toml(&bus, &ch, "block_bytes = 128");
    let config = radixgate::config::Config::from_toml(&common::gateway_toml(
        "epoll",
        1,
        &toml,
        &[("e0", engines[0].url(), "sim")],
    ))
    .expect("a valid config");
    let err = match Gateway::start(config) {
        Ok(_) => panic!("a replica with another block size joined the fleet"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("refuses to join") && err.contains("routing.block_bytes"),
        "{err}"
    );
    // Another channel is another fleet: it starts.
    let other = replica(
        &engines,
        &cluster_toml(&bus, &channel("other"), "block_bytes = 128"),
    );
    other.shutdown();
    a.shutdown();
}

#[test]
fn peers_see_each_others_in_flight_requests() {
    let bus = Bus::start();
    // One slow engine: requests stay in flight while the peer looks.
    let slow = slow_engine(Duration::from_millis(400));
    let engines = vec![slow];
    let toml = cluster_toml(&bus, &channel("load"), "");
    let (a, b) = (replica(&engines, &toml), replica(&engines, &toml));
    wait_peers(b.local_addr(), 1);
    let addr = a.local_addr();
    let senders: Vec<_> = (0..3)
        .map(|q| std::thread::spawn(move || ask(addr, &doc_prompt(1, q)).0))
        .collect();
    // B's backend view counts A's three requests as the fleet's.
    assert!(
        eventually(Duration::from_secs(3), || {
            let m = scrape(b.local_addr());
            metric(&m, "radixgate_backend_in_flight{backend=\"e0\"}") == Some(0.0)
                && metric(&m, "radixgate_cluster_peer_in_flight{backend=\"e0\"}") == Some(3.0)
        }),
        "{}",
        scrape(b.local_addr())
    );
    for s in senders {
        assert_eq!(s.join().unwrap(), 200);
    }
    assert!(eventually(Duration::from_secs(3), || metric(
        &scrape(b.local_addr()),
        "radixgate_cluster_peer_in_flight{backend=\"e0\"}"
    ) == Some(0.0)));
    a.shutdown();
    b.shutdown();
}

#[test]
fn a_silent_peer_is_dropped_with_its_load() {
    let bus = Bus::start();
    let slow = slow_engine(Duration::from_millis(600));
    let engines = vec![slow];
    let toml = cluster_toml(&bus, &channel("silent"), "");
    let (a, b) = (replica(&engines, &toml), replica(&engines, &toml));
    wait_peers(b.local_addr(), 1);
    let addr = a.local_addr();
    let sender = std::thread::spawn(move || ask(addr, &doc_prompt(2, 0)).0);
    assert!(eventually(Duration::from_secs(2), || metric(
        &scrape(b.local_addr()),
        "radixgate_cluster_peer_in_flight{backend=\"e0\"}"
    ) == Some(1.0)));
    // A stops reporting (its threads end with the gateway; its request is cut):
    // B drops it within the peer timeout, and its load with it.
    a.shutdown();
    let _ = sender.join();
    assert!(eventually(Duration::from_secs(3), || {
        let m = scrape(b.local_addr());
        metric(&m, "radixgate_cluster_peers ") == Some(0.0)
            && metric(&m, "radixgate_cluster_peer_in_flight{backend=\"e0\"}") == Some(0.0)
    }));
    b.shutdown();
}

#[test]
fn the_bus_going_away_costs_no_request_and_sharing_resumes() {
    let mut bus = Bus::start();
    let engines = engines(3);
    let toml = cluster_toml(&bus, &channel("outage"), "");
    let (a, b) = (replica(&engines, &toml), replica(&engines, &toml));
    wait_peers(a.local_addr(), 1);
    bus.kill();
    // Both keep routing on local state: every request answered.
    for q in 0..20 {
        for gw in [&a, &b] {
            let (status, _, _) = ask(gw.local_addr(), &doc_prompt(q % 3, q));
            assert_eq!(status, 200, "request {q} failed while the bus was down");
        }
    }
    assert!(eventually(Duration::from_secs(3), || {
        let m = scrape(a.local_addr());
        metric(&m, "radixgate_cluster_connected ") == Some(0.0)
            && metric(&m, "radixgate_cluster_outages_total") == Some(1.0)
    }));
    // What A routes while the bus is down, B learns by the resync after it.
    let (_, outage_home, _) = ask(a.local_addr(), &doc_prompt(50, 0));
    let loaded = |gw: &Gateway| {
        metric(
            &scrape(gw.local_addr()),
            "radixgate_cluster_snapshots_loaded_total",
        )
        .unwrap()
    };
    let loaded_before = loaded(&b);
    // The bus comes back on its port: both rejoin, and sharing works again.
    let _bus = Bus::start_on(bus.port);
    for gw in [&a, &b] {
        assert!(
            eventually(Duration::from_secs(10), || metric(
                &scrape(gw.local_addr()),
                "radixgate_cluster_connected "
            ) == Some(1.0)),
            "a replica did not reconnect"
        );
    }
    wait_peers(a.local_addr(), 1);
    wait_peers(b.local_addr(), 1);
    assert!(
        eventually(Duration::from_secs(5), || loaded(&b) > loaded_before),
        "B did not resync from A's snapshot"
    );
    common::wait_replicated(b.local_addr());
    let (_, backend, reason) = ask(b.local_addr(), &doc_prompt(50, 1));
    assert_eq!((backend, reason.as_str()), (outage_home, "longest-prefix"));
    let home = route_and_share(a.local_addr(), b.local_addr(), &doc_prompt(7, 0));
    let (_, backend, reason) = ask(b.local_addr(), &doc_prompt(7, 1));
    assert_eq!((backend, reason.as_str()), (home, "longest-prefix"));
    // One outage, counted once.
    assert_eq!(
        metric(&scrape(a.local_addr()), "radixgate_cluster_outages_total"),
        Some(1.0)
    );
    a.shutdown();
    b.shutdown();
}

#[test]
fn bad_bus_messages_are_counted_and_dropped() {
    use radixgate::cluster::wire::{encode, BackendKey, Header, Op};
    let bus = Bus::start();
    let engines = engines(2);
    let ch = channel("garbage");
    let toml = common::gateway_toml(
        "epoll",
        1,
        &cluster_toml(&bus, &ch, ""),
        &[
            ("e0", engines[0].url(), "sim"),
            ("e1", engines[1].url(), "sim"),
        ],
    );
    let config = radixgate::config::Config::from_toml(&toml).expect("a valid config");
    let ours = radixgate::cluster::config_fingerprint(&config);
    let a = Gateway::start(config).expect("gateway starts");
    let addr = a.local_addr();
    assert!(eventually(Duration::from_secs(5), || metric(
        &scrape(addr),
        "radixgate_cluster_connected "
    ) == Some(1.0)));
    let topic = format!("{ch}:ops");
    let header = |fingerprint: u64, seq: u64| Header {
        fingerprint,
        node: 99,
        epoch: 1,
        seq,
        sent_us: 0,
    };
    let unknown = Op::Insert {
        backend: BackendKey(1),
        blocks: vec![1u64, 2, 3].into(),
        now_ms: 0,
    };
    bus.publish(&topic, b"hello, not ours");
    bus.publish(
        &topic,
        &encode(&header(ours ^ 1, 0), std::slice::from_ref(&unknown)),
    );
    let mut wrong_version = encode(&header(ours, 0), &[]);
    wrong_version[4] = 9;
    bus.publish(&topic, &wrong_version);
    let valid = encode(&header(ours, 0), &[unknown]);
    bus.publish(&topic, &valid[..valid.len() - 3]);
    let mut bad_tag = valid.clone();
    bad_tag[radixgate::cluster::wire::HEADER_LEN] = 0xEE;
    bus.publish(&topic, &bad_tag);
    // A well-formed batch naming a backend this replica lacks, then its duplicate.
    bus.publish(&topic, &valid);
    bus.publish(&topic, &valid);
    let expect = [
        ("foreign", 1.0),
        ("fingerprint", 1.0),
        ("version", 1.0),
        ("truncated", 1.0),
        ("malformed", 1.0),
        ("duplicate", 1.0),
    ];
    assert!(
        eventually(Duration::from_secs(5), || {
            let m = scrape(addr);
            metric(&m, "radixgate_cluster_ops_unknown_backend_total") == Some(1.0)
                && expect.iter().all(|(why, n)| {
                    metric(
                        &m,
                        &format!("radixgate_cluster_messages_dropped_total{{reason=\"{why}\"}}"),
                    ) == Some(*n)
                })
        }),
        "{}",
        scrape(addr)
    );
    // Nothing reached the index, and the gateway serves on.
    assert_eq!(coordinator_blocks(addr), 0.0);
    assert_eq!(ask(addr, &doc_prompt(0, 0)).0, 200);
    a.shutdown();
}

fn ready(addr: SocketAddr) -> u16 {
    Client::connect(addr).get("/ready").status
}

#[test]
fn a_replica_started_after_the_traffic_starts_warm() {
    let bus = Bus::start();
    let engines = engines(3);
    let toml = cluster_toml(&bus, &channel("warm"), "");
    let a = replica(&engines, &toml);
    // Alone on its channel, the first replica is ready once nobody answers.
    assert!(eventually(Duration::from_secs(5), || ready(a.local_addr()) == 200));
    let homes: Vec<String> = (0..6)
        .map(|doc| ask(a.local_addr(), &doc_prompt(doc, 0)).1)
        .collect();
    // RAG chunks sent through A: their holdings travel in the snapshot too.
    let rag = Client::connect(a.local_addr()).post(
        "/v1/chat/completions",
        &rag_body(&[1, 2, 3], "first"),
        &[],
    );
    assert_eq!(rag.status, 200, "{}", rag.text());
    common::wait_replicated(a.local_addr());
    // B starts after the traffic, and no request reaches A from now on.
    let b = replica(&engines, &toml);
    assert!(
        eventually(Duration::from_secs(5), || ready(b.local_addr()) == 200),
        "the new replica never became ready"
    );
    let m = scrape(b.local_addr());
    assert_eq!(
        metric(&m, "radixgate_cluster_snapshots_loaded_total"),
        Some(1.0),
        "{m}"
    );
    assert_eq!(metric(&m, "radixgate_cluster_warm "), Some(1.0));
    assert_eq!(
        metric(
            &scrape(a.local_addr()),
            "radixgate_cluster_snapshots_served_total"
        ),
        Some(1.0)
    );
    common::wait_replicated(b.local_addr());
    for (doc, home) in homes.iter().enumerate() {
        let (status, backend, reason) = ask(b.local_addr(), &doc_prompt(doc, 1));
        assert_eq!(status, 200);
        assert_eq!(
            (backend.as_str(), reason.as_str()),
            (home.as_str(), "longest-prefix"),
            "document {doc} on the new replica"
        );
    }
    // B knows which engine holds chunks 1-3 though it never sent them.
    let r = Client::connect(b.local_addr()).post(
        "/v1/chat/completions",
        &rag_body(&[1, 2, 3, 4], "second"),
        &[],
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-router-backend"), rag.header("x-router-backend"));
    assert_eq!(r.header("x-router-chunk-overlap"), Some("3"), "{r:?}");
    a.shutdown();
    b.shutdown();
}

fn rag_body(chunks: &[usize], query: &str) -> String {
    let chunks: Vec<String> = chunks
        .iter()
        .map(|&n| {
            let text: String = (0..30).map(|i| format!("chunk{n}-fact{i} ")).collect();
            format!("\"{text}\"")
        })
        .collect();
    format!(
        r#"{{"model":"sim","max_tokens":2,"rag":{{"system":"Answer from the context.","chunks":[{}],"query":"{query}"}}}}"#,
        chunks.join(",")
    )
}

#[test]
fn without_a_peer_to_answer_a_replica_is_ready_after_the_warm_timeout() {
    use radixgate::cluster::wire::{encode, Header};
    let bus = Bus::start();
    let engines = engines(1);
    let ch = channel("nowarm");
    let toml = common::gateway_toml(
        "epoll",
        1,
        &cluster_toml(&bus, &ch, "").replace("[cluster]\n", "[cluster]\nwarm_timeout_ms = 1000\n"),
        &[("e0", engines[0].url(), "sim")],
    );
    let config = radixgate::config::Config::from_toml(&toml).expect("a valid config");
    let fingerprint = radixgate::cluster::config_fingerprint(&config);
    // A peer that beats but never answers a roll call.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let beating = {
        let (stop, topic, port) = (stop.clone(), format!("{ch}:ops"), bus.port);
        std::thread::spawn(move || {
            let bus = Bus::attach(port);
            let mut seq = 0;
            while !stop.load(Ordering::Relaxed) {
                let header = Header {
                    fingerprint,
                    node: 77,
                    epoch: 1,
                    seq,
                    sent_us: 0,
                };
                bus.publish(&topic, &encode(&header, &[]));
                seq += 1;
                common::pause(Duration::from_millis(20));
            }
        })
    };
    let late = Gateway::start(config).expect("gateway starts");
    wait_peers(late.local_addr(), 1);
    assert_eq!(
        metric(&scrape(late.local_addr()), "radixgate_cluster_warm "),
        Some(0.0)
    );
    assert_eq!(ready(late.local_addr()), 503);
    assert!(eventually(Duration::from_secs(5), || ready(
        late.local_addr()
    ) == 200));
    assert_eq!(
        metric(
            &scrape(late.local_addr()),
            "radixgate_cluster_snapshots_loaded_total"
        ),
        Some(0.0)
    );
    stop.store(true, Ordering::Relaxed);
    beating.join().unwrap();
    late.shutdown();
}

#[test]
fn replicas_started_together_do_not_wait_on_each_other() {
    let bus = Bus::start();
    let engines = engines(1);
    let toml = cluster_toml(&bus, &channel("together"), "")
        .replace("[cluster]\n", "[cluster]\nwarm_timeout_ms = 60000\n");
    let fleet: Vec<Gateway> = (0..3).map(|_| replica(&engines, &toml)).collect();
    // The oldest answers the others' roll calls while cold; nobody waits a minute.
    for gw in &fleet {
        assert!(
            eventually(Duration::from_secs(10), || ready(gw.local_addr()) == 200),
            "a replica started with its peers is still warming"
        );
    }
    for gw in fleet {
        gw.shutdown();
    }
}

#[test]
fn a_backend_failing_on_one_replica_is_skipped_by_the_others() {
    let bus = Bus::start();
    let mut failing = EngineConfig::instant("sim");
    failing.fail_rate = 1.0;
    let bad = start_engine("epoll", failing);
    let good = start_engine("epoll", EngineConfig::instant("sim"));
    let toml = cluster_toml(&bus, &channel("breaker"), "")
        .replace("policy = \"prefix_aware\"", "policy = \"round_robin\"")
        + "[breaker]\nfailure_threshold = 3\nopen_ms = 30000\n[health]\ninterval_ms = 60000\n";
    let backends = [("bad", bad.url(), "sim"), ("good", good.url(), "sim")];
    let a = start_gateway("epoll", 1, &toml, &backends);
    let b = start_gateway("epoll", 1, &toml, &backends);
    wait_peers(b.local_addr(), 1);
    let breaker = |gw: &Gateway| {
        metric(
            &scrape(gw.local_addr()),
            "radixgate_breaker_state{backend=\"bad\"}",
        )
    };
    // A's requests meet the failing engine (and are retried on the good one)
    // until A's breaker opens.
    for q in 0..20 {
        assert_eq!(ask(a.local_addr(), &doc_prompt(q, 0)).0, 200);
    }
    assert_eq!(breaker(&a), Some(2.0));
    // B opens its breaker on A's word, before any of its requests went there.
    assert!(
        eventually(Duration::from_secs(5), || breaker(&b) == Some(2.0)),
        "B's breaker for the failing backend never opened"
    );
    for q in 0..10 {
        let (status, backend, _) = ask(b.local_addr(), &doc_prompt(q, 1));
        assert_eq!((status, backend.as_str()), (200, "good"));
    }
    let m = scrape(b.local_addr());
    assert_eq!(
        metric(&m, "radixgate_retries_total{backend=\"bad\"}").unwrap_or(0.0),
        0.0,
        "{m}"
    );
    assert!(metric(&m, "radixgate_cluster_peer_faults_total").unwrap() >= 1.0);
    a.shutdown();
    b.shutdown();
}

#[test]
fn a_tenants_limit_holds_across_the_fleet() {
    let bus = Bus::start();
    let engines = engines(2);
    let tenants = format!(
        "[[tenants]]\nname = \"acme\"\nkeys = [\"{}\"]\nrequests_per_sec = 20.0\n",
        radixgate::tenants::hash_key("sk-acme")
    );
    let toml = cluster_toml(&bus, &channel("quota"), "") + &tenants;
    let (a, b) = (replica(&engines, &toml), replica(&engines, &toml));
    wait_peers(a.local_addr(), 1);
    wait_peers(b.local_addr(), 1);
    let burst = |addr: SocketAddr, n: usize| {
        let mut c = Client::connect(addr);
        (0..n)
            .filter(|q| {
                let r = c.post(
                    "/v1/chat/completions",
                    &doc_prompt(*q, 0),
                    &[("Authorization", "Bearer sk-acme")],
                );
                assert!(matches!(r.status, 200 | 429), "{}", r.status);
                r.status == 200
            })
            .count()
    };
    // A spends the tenant's burst (20 a second, up to 20 at once).
    let on_a = burst(a.local_addr(), 40);
    assert!((20..=26).contains(&on_a), "{on_a} admitted on A");
    // Once A's report reaches B, B has only what refilled since: alone it would
    // admit another 20.
    assert!(eventually(Duration::from_secs(3), || metric(
        &scrape(b.local_addr()),
        "radixgate_cluster_tenant_charges_total"
    )
    .unwrap_or(0.0)
        >= 1.0));
    let on_b = burst(b.local_addr(), 40);
    assert!(on_b <= 12, "{on_b} admitted on B after A spent the burst");
    a.shutdown();
    b.shutdown();
}

/// A `radixgate serve` process, killed (SIGKILL) when dropped.
struct Process(std::process::Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `radixgate serve` on a free port with `toml` (a cluster replica).
fn serve(name: &str, toml: &str) -> (Process, SocketAddr) {
    let port = common::bus::free_port();
    let toml = toml.replace(
        "listen = \"127.0.0.1:0\"",
        &format!("listen = \"127.0.0.1:{port}\""),
    );
    let file = common::temp_file(&format!("cluster-{name}-{port}.toml"), &toml);
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_radixgate"))
        .args(["serve", "--config"])
        .arg(&file)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("radixgate serve starts");
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let process = Process(child);
    assert!(
        eventually(Duration::from_secs(20), || std::net::TcpStream::connect(
            addr
        )
        .is_ok()),
        "replica {name} never listened"
    );
    (process, addr)
}

#[test]
fn a_replica_killed_outright_loses_the_others_nothing() {
    let bus = Bus::start();
    // The slow engine alone serves model `slowsim`: A's requests stay in flight.
    let slow = start_engine(
        "epoll",
        EngineConfig {
            decode_per_token: Duration::from_millis(500),
            ..EngineConfig::instant("slowsim")
        },
    );
    let fast = engines(2);
    let toml = common::gateway_toml(
        "epoll",
        1,
        &cluster_toml(&bus, &channel("sigkill"), ""),
        &[
            ("slow", slow.url(), "slowsim"),
            ("e1", fast[0].url(), "sim"),
            ("e2", fast[1].url(), "sim"),
        ],
    );
    let (mut doomed, a) = serve("a", &toml);
    let (_survivor, b) = serve("b", &toml);
    wait_peers(b, 1);
    // A holds requests in flight when it is killed.
    let inflight: Vec<_> = (0..3)
        .map(|q| {
            std::thread::spawn(move || {
                let body = chat_body(&format!("question {q}"), false)
                    .replace("\"model\":\"sim\"", "\"model\":\"slowsim\"");
                Client::connect(a)
                    .post("/v1/chat/completions", &body, &[])
                    .status
            })
        })
        .collect();
    let peer_load = || {
        let m = scrape(b);
        ["slow", "e1", "e2"]
            .iter()
            .map(|id| {
                metric(
                    &m,
                    &format!("radixgate_cluster_peer_in_flight{{backend=\"{id}\"}}"),
                )
                .unwrap_or(0.0)
            })
            .sum::<f64>()
    };
    assert!(
        eventually(Duration::from_secs(2), || metric(
            &scrape(b),
            "radixgate_cluster_peer_in_flight{backend=\"slow\"}"
        ) == Some(3.0)),
        "B never saw A's requests in flight"
    );
    let _ = doomed.0.kill();
    let _ = doomed.0.wait();
    for t in inflight {
        let _ = t.join();
    }
    // B serves on without an error, and A's counts expire with A.
    for q in 0..20 {
        assert_eq!(ask(b, &doc_prompt(q, 0)).0, 200);
    }
    assert!(
        eventually(Duration::from_secs(3), || {
            metric(&scrape(b), "radixgate_cluster_peers ") == Some(0.0) && peer_load() == 0.0
        }),
        "a killed replica's load outlived it:\n{}",
        scrape(b)
    );
}

/// One request on a fresh connection (`Connection: close`): the status and body,
/// or the I/O error, with whether any response byte had arrived.
fn try_post(addr: SocketAddr, body: &str) -> Result<(u16, String), (std::io::Error, bool)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).map_err(|e| (e, false))?;
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).map_err(|e| (e, false))?;
    let mut out = Vec::new();
    if let Err(e) = s.read_to_end(&mut out) {
        let got_some = !out.is_empty();
        return Err((e, got_some));
    }
    let text = String::from_utf8_lossy(&out).to_string();
    let status = text
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| (std::io::Error::other("no status line"), !out.is_empty()))?;
    Ok((status, text))
}

/// What the fleet's engines reported cached, over what they were asked.
#[derive(Default)]
struct Tally {
    prompt: u64,
    cached: u64,
    errors: Vec<String>,
    redispatched: u64,
}

impl Tally {
    fn hit_rate(&self) -> f64 {
        self.cached as f64 / self.prompt.max(1) as f64
    }
}

/// An L4 balancer as the client sees one: a random replica per request; a
/// connection refused, or closed before any response byte (the replica was
/// stopping), goes to the next one, as HAProxy's redispatch does.
fn balanced(replicas: &[SocketAddr], body: &str, tally: &std::sync::Mutex<Tally>) {
    let start = fastrand::usize(..replicas.len());
    for k in 0..replicas.len() * 2 {
        let addr = replicas[(start + k) % replicas.len()];
        match try_post(addr, body) {
            Ok((200, text)) => {
                let json_at = text.find("\r\n\r\n").map_or(0, |i| i + 4);
                let v: serde_json::Value =
                    serde_json::from_str(&text[json_at..]).unwrap_or_default();
                let mut t = tally.lock().unwrap();
                t.prompt += v["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
                t.cached += v["usage"]["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap_or(0);
                if k > 0 {
                    t.redispatched += 1;
                }
                return;
            }
            Ok((status, text)) => {
                tally
                    .lock()
                    .unwrap()
                    .errors
                    .push(format!("{status}: {text}"));
                return;
            }
            Err((_, true)) => {
                tally.lock().unwrap().errors.push("cut mid-response".into());
                return;
            }
            Err((_, false)) => continue,
        }
    }
    tally
        .lock()
        .unwrap()
        .errors
        .push("no replica answered".into());
}

#[test]
fn a_rolling_restart_under_load_costs_no_request_and_keeps_the_hit_rate() {
    let bus = Bus::start();
    let fleet = engines(3);
    let backends: Vec<(String, String)> = fleet
        .iter()
        .enumerate()
        .map(|(i, e)| (format!("e{i}"), e.url()))
        .collect();
    let refs: Vec<_> = backends
        .iter()
        .map(|(id, url)| (id.as_str(), url.clone(), "sim"))
        .collect();
    let toml = common::gateway_toml(
        "epoll",
        1,
        &format!(
            "shutdown_timeout_ms = 5000\n{}",
            cluster_toml(&bus, &channel("rolling"), "")
        ),
        &refs,
    );
    let mut replicas: Vec<(Process, SocketAddr)> =
        (0..3).map(|i| serve(&format!("r{i}"), &toml)).collect();
    let addrs: Vec<SocketAddr> = replicas.iter().map(|(_, a)| *a).collect();
    for a in &addrs {
        assert!(eventually(Duration::from_secs(10), || ready(*a) == 200));
    }
    let work = |tally: &std::sync::Mutex<Tally>, n: usize, stop: &std::sync::atomic::AtomicBool| {
        for i in 0.. {
            if (n > 0 && i >= n) || (n == 0 && stop.load(Ordering::Relaxed)) {
                break;
            }
            balanced(&addrs, &doc_prompt(i % 12, i / 12), tally);
        }
    };
    let never = std::sync::atomic::AtomicBool::new(false);
    // Steady state first: every document placed once, then asked about again.
    let steady = std::sync::Mutex::new(Tally::default());
    work(&steady, 12, &never);
    let steady = std::sync::Mutex::new(Tally::default());
    work(&steady, 96, &never);
    let steady = steady.into_inner().unwrap();
    assert!(steady.errors.is_empty(), "{:?}", steady.errors);
    // Then every replica in turn: SIGTERM (drain), exit, start again, ready.
    let during = std::sync::Mutex::new(Tally::default());
    let done = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        let load: Vec<_> = (0..2)
            .map(|_| s.spawn(|| work(&during, 0, &done)))
            .collect();
        for (i, replica) in replicas.iter_mut().enumerate() {
            // SAFETY: kill(2) on our own child's PID.
            unsafe {
                libc::kill(replica.0 .0.id() as libc::pid_t, libc::SIGTERM);
            }
            let status = replica.0 .0.wait().unwrap();
            assert!(
                status.success(),
                "replica {i} did not drain cleanly: {status}"
            );
            let port = replica.1.port();
            let toml = toml.replace(
                "listen = \"127.0.0.1:0\"",
                &format!("listen = \"127.0.0.1:{port}\""),
            );
            let file = common::temp_file(&format!("cluster-rolling-{i}-again.toml"), &toml);
            let child = std::process::Command::new(env!("CARGO_BIN_EXE_radixgate"))
                .args(["serve", "--config"])
                .arg(&file)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .expect("radixgate serve starts");
            replica.0 = Process(child);
            assert!(
                eventually(Duration::from_secs(10), || std::net::TcpStream::connect(
                    replica.1
                )
                .is_ok()
                    && ready(replica.1) == 200),
                "replica {i} did not come back"
            );
            common::pause(Duration::from_millis(300));
        }
        done.store(true, Ordering::Relaxed);
        for l in load {
            l.join().unwrap();
        }
    });
    let during = during.into_inner().unwrap();
    assert!(during.errors.is_empty(), "{:?}", during.errors);
    assert!(during.prompt > 0);
    let (h0, h1) = (steady.hit_rate(), during.hit_rate());
    eprintln!(
        "rolling restart: hit rate {h1:.3} against {h0:.3} steady ({} requests redispatched)",
        during.redispatched
    );
    assert!(
        h1 >= 0.9 * h0,
        "hit rate {h1:.3} during the restarts, {h0:.3} before"
    );
}

#[test]
fn peers_pending_prefill_is_reported_but_not_charged() {
    let bus = Bus::start();
    // Prefill takes a while here: A's requests stay pending (no first byte).
    let slow = start_engine(
        "epoll",
        EngineConfig {
            prefill_per_token: Duration::from_millis(3),
            ..EngineConfig::instant("sim")
        },
    );
    let engines = vec![slow];
    let toml = cluster_toml(&bus, &channel("pending"), "");
    let (a, b) = (replica(&engines, &toml), replica(&engines, &toml));
    wait_peers(b.local_addr(), 1);
    let addr = a.local_addr();
    let sender = std::thread::spawn(move || ask(addr, &doc_prompt(3, 0)).0);
    let metric_b = |name: &str| metric(&scrape(b.local_addr()), name).unwrap_or(0.0);
    assert!(
        eventually(Duration::from_secs(3), || metric_b(
            "radixgate_cluster_peer_pending_prefill_tokens{backend=\"e0\"}"
        ) > 0.0),
        "B never saw A's pending prefill:\n{}",
        scrape(b.local_addr())
    );
    // Shown, not charged: B's own pending-prefill gauge (what routing reads) is 0.
    assert_eq!(
        metric_b("radixgate_backend_pending_prefill_tokens{backend=\"e0\"}"),
        0.0
    );
    assert_eq!(sender.join().unwrap(), 200);
    a.shutdown();
    b.shutdown();
}
