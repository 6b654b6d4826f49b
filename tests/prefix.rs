//! Prefix-aware routing end to end: replicas converging across shards, the
//! est-TTFT policy's reasons and headers, session affinity, rollback of a failed
//! attempt, and the closed loop against the engines' reported cached tokens.

mod common;

use common::*;
use radixgate::engine_sim::EngineConfig;
use std::collections::HashSet;
use std::time::Duration;

fn doc_question(doc: usize, q: usize) -> String {
    let text: String = (0..60).map(|i| format!("doc{doc}-sentence{i} ")).collect();
    format!(
        r#"{{"model":"sim","max_tokens":2,"messages":[{{"role":"system","content":"{text}"}},{{"role":"user","content":"question {q}"}}]}}"#
    )
}

/// `n` engines behind a prefix-aware gateway of `shards` shards. They prefill at
/// 20 µs a token (a GPU's order), so that a cached prefix is worth keeping: the
/// gateway learns an instant engine's prefill cost as loopback noise (about 4 µs a
/// token), prices the engines it has not learned the same, and then a document's
/// whole prefill elsewhere is cheaper than one request ahead on its holder.
fn fleet(
    io: &str,
    n: usize,
    shards: usize,
    extra: &str,
) -> (Vec<radixgate::engine_sim::EngineHandle>, radixgate::Gateway) {
    let engine = EngineConfig {
        prefill_per_token: Duration::from_micros(20),
        ..EngineConfig::instant("sim")
    };
    fleet_of(
        io,
        &engine,
        n,
        shards,
        &format!("[routing]\npolicy = \"prefix_aware\"\n{extra}"),
    )
}

fn replicas_converge_across_shards(io: &str) {
    let (_engines, gw) = fleet(io, 3, 2, "");
    let addr = gw.local_addr();
    // Seed one document on one shard (one connection = one shard).
    let first = Client::connect(addr).post("/v1/chat/completions", &doc_question(7, 0), &[]);
    let home = first.header("x-router-backend").unwrap().to_string();
    // Wait until every shard's replica has the blocks (lag 0).
    assert!(eventually(Duration::from_secs(5), || {
        let m = Client::connect(addr).get("/metrics").text();
        metric(&m, "radixgate_replica_lag_events{shard=\"0\"}") == Some(0.0)
            && metric(&m, "radixgate_replica_lag_events{shard=\"1\"}") == Some(0.0)
            && metric(&m, "radixgate_index_blocks{copy=\"shard-0\"}")
                == metric(&m, "radixgate_index_blocks{copy=\"shard-1\"}")
            && metric(&m, "radixgate_index_blocks{copy=\"shard-0\"}").unwrap_or(0.0) > 0.0
    }));
    // Many fresh connections spread over both shards; all follow the prefix home.
    let mut homes = HashSet::new();
    for q in 1..12 {
        let r = Client::connect(addr).post("/v1/chat/completions", &doc_question(7, q), &[]);
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-router-reason"), Some("longest-prefix"));
        assert!(
            r.header("x-router-match-blocks")
                .unwrap()
                .parse::<u32>()
                .unwrap()
                > 10
        );
        homes.insert(r.header("x-router-backend").unwrap().to_string());
        // The engine confirms: its cache had the document.
        assert!(
            r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap()
                > 100
        );
    }
    assert_eq!(homes, HashSet::from([home]));
    let m = Client::connect(addr).get("/metrics").text();
    assert!(
        metric(&m, "radixgate_replica_lag_seconds_count{shard=\"all\"}").unwrap() >= 1.0,
        "{m}"
    );
}
both_drivers!(replicas_converge_across_shards);

fn documents_spread_and_stick(io: &str) {
    let (_engines, gw) = fleet(io, 3, 1, "");
    let mut c = Client::connect(gw.local_addr());
    let mut home_of = std::collections::HashMap::new();
    for round in 0..3 {
        for doc in 0..6 {
            let r = c.post("/v1/chat/completions", &doc_question(doc, round), &[]);
            let b = r.header("x-router-backend").unwrap().to_string();
            if round == 0 {
                assert_eq!(r.header("x-router-reason"), Some("no-match"));
                home_of.insert(doc, b);
            } else {
                assert_eq!(r.header("x-router-reason"), Some("longest-prefix"));
                assert_eq!(home_of[&doc], b, "doc {doc} moved");
            }
        }
    }
    let used: HashSet<_> = home_of.values().collect();
    assert!(used.len() >= 2, "new documents spread by load: {home_of:?}");
    // Predicted cached tokens track what the engines reported.
    let m = c.get("/metrics").text();
    let predicted: f64 = ["e0", "e1", "e2"]
        .iter()
        .map(|b| {
            metric(
                &m,
                &format!("radixgate_cached_tokens_predicted_total{{backend=\"{b}\"}}"),
            )
            .unwrap()
        })
        .sum();
    let reported: f64 = ["e0", "e1", "e2"]
        .iter()
        .map(|b| {
            metric(
                &m,
                &format!("radixgate_cached_tokens_reported_total{{backend=\"{b}\"}}"),
            )
            .unwrap()
        })
        .sum();
    assert!(reported > 0.0 && predicted > 0.0);
    assert!(
        (predicted - reported).abs() / reported < 0.2,
        "predicted {predicted} vs reported {reported}"
    );
}
both_drivers!(documents_spread_and_stick);

fn session_affinity(io: &str) {
    // Re-binding a session to its home within `index_touch_ms` is not replicated.
    for (touch_ms, coalesced) in [(600_000, 4.0), (0, 0.0)] {
        session_affinity_with(io, touch_ms, coalesced);
    }
}

fn session_affinity_with(io: &str, touch_ms: u64, coalesced: f64) {
    let (_engines, gw) = fleet(io, 3, 2, &format!("index_touch_ms = {touch_ms}\n"));
    let addr = gw.local_addr();
    let mut homes = HashSet::new();
    for turn in 0..5 {
        // Different short prompts each turn: only the session ties them together.
        let body = format!(
            r#"{{"model":"sim","max_tokens":1,"messages":[{{"role":"user","content":"turn {turn}"}}]}}"#
        );
        let r = Client::connect(addr).post(
            "/v1/chat/completions",
            &body,
            &[("X-Session-ID", "conv-42")],
        );
        if turn > 0 {
            assert_eq!(r.header("x-router-reason"), Some("session-affinity"));
        }
        homes.insert(r.header("x-router-backend").unwrap().to_string());
        wait_replicated(addr);
    }
    assert_eq!(homes.len(), 1);
    // The prompts are shorter than a block: only session bindings were recorded.
    let m = Client::connect(addr).get("/metrics").text();
    assert_eq!(
        metric(&m, "radixgate_index_touches_coalesced_total"),
        Some(coalesced),
        "index_touch_ms = {touch_ms}: {m}"
    );
}
both_drivers!(session_affinity);

fn failed_attempt_is_rolled_back(io: &str) {
    let mut cfg = EngineConfig::instant("sim");
    cfg.refuse_rate = 1.0;
    let bad = start_engine(io, cfg);
    let gw = start_gateway(
        io,
        1,
        "[routing]\npolicy = \"prefix_aware\"\n[health]\ninterval_ms = 60000",
        &[("bad", bad.url(), "sim")],
    );
    let mut c = Client::connect(gw.local_addr());
    let r = c.post("/v1/chat/completions", &doc_question(1, 0), &[]);
    assert_eq!(r.status, 502);
    let m = c.get("/metrics").text();
    assert_eq!(
        metric(&m, "radixgate_index_blocks{copy=\"shard-0\"}"),
        Some(0.0),
        "{m}"
    );
    let r = Client::connect(gw.local_addr()).post("/v1/chat/completions", &doc_question(1, 1), &[]);
    assert_eq!(
        r.header("x-router-match-blocks"),
        Some("0"),
        "nothing believed cached after a failure"
    );
}
both_drivers!(failed_attempt_is_rolled_back);

fn engine_metrics_are_scraped(io: &str) {
    let mut cfg = EngineConfig::instant("sim");
    cfg.cache_blocks = 100;
    let engine = start_engine(io, cfg);
    let gw = start_gateway(
        io,
        1,
        "[health]\ninterval_ms = 50\nscrape_interval_ms = 50",
        &[("e0", engine.url(), "sim")],
    );
    let addr = gw.local_addr();
    // The engine's queue and KV usage reach the gateway's metrics, and the index
    // capacity follows the engine's advertised cache size.
    assert!(eventually(Duration::from_secs(5), || {
        let m = Client::connect(addr).get("/metrics").text();
        metric(&m, "radixgate_engine_queue{backend=\"e0\"}") == Some(0.0)
            && metric(&m, "radixgate_engine_kv_usage{backend=\"e0\"}") == Some(0.0)
    }));
    // Fill far beyond 100 blocks (40 documents of ~17 blocks): the replica stays within the engine's capacity.
    let mut c = Client::connect(addr);
    for doc in 0..40 {
        c.post("/v1/chat/completions", &doc_question(doc, 0), &[]);
    }
    let m = c.get("/metrics").text();
    let blocks = metric(&m, "radixgate_index_blocks{copy=\"shard-0\"}").unwrap();
    assert!(
        blocks > 0.0 && blocks <= 100.0,
        "replica holds {blocks} blocks"
    );
}
both_drivers!(engine_metrics_are_scraped);

/// A chat body whose prompt is `n` distinct words (about 4 bytes of prompt each).
fn cold_prompt(tag: &str, n: usize, max_tokens: u32, stream: bool) -> String {
    let text: String = (0..n).map(|i| format!("{tag}{i} ")).collect();
    format!(
        r#"{{"model":"sim","stream":{stream},"max_tokens":{max_tokens},"messages":[{{"role":"user","content":"{text}"}}]}}"#
    )
}

fn pending_prefill(m: &str, backend: &str) -> f64 {
    metric(
        m,
        &format!("radixgate_backend_pending_prefill_tokens{{backend=\"{backend}\"}}"),
    )
    .unwrap_or(-1.0)
}

/// Sends a long cold prompt (about 1000 tokens: 1 s of prefill on an engine at 1 ms
/// a token) from another thread, and waits until the gateway counts its prefill as
/// pending on `backend`, where it must have gone.
fn start_long_prefill(
    addr: std::net::SocketAddr,
    backend: &str,
) -> std::thread::JoinHandle<Response> {
    let prefilling = std::thread::spawn(move || {
        Client::connect(addr).post(
            "/v1/chat/completions",
            &cold_prompt("long", 1000, 2, false),
            &[],
        )
    });
    assert!(
        eventually(Duration::from_secs(5), || {
            pending_prefill(&Client::connect(addr).get("/metrics").text(), backend) > 500.0
        }),
        "the long prompt's prefill is counted on {backend}"
    );
    prefilling
}

/// `prefix_aware` counts the prefill queued on each backend, not just its requests:
/// with one request in flight on each of two backends — one decoding a long answer,
/// one still prefilling a long cold prompt — new cold prompts go to the first. A
/// count alone calls the two equal and splits them by seed.
fn queued_prefill_work_steers_cold_prompts(io: &str) {
    let slow = |decode_ms| EngineConfig {
        prefill_per_token: Duration::from_millis(1),
        decode_per_token: Duration::from_millis(decode_ms),
        ..EngineConfig::new("sim")
    };
    let engines = [start_engine(io, slow(30)), start_engine(io, slow(30))];
    let urls: Vec<String> = engines.iter().map(|e| e.url()).collect();
    let gw = start_gateway(
        io,
        1,
        "[routing]\npolicy = \"prefix_aware\"",
        &[
            ("e0", urls[0].clone(), "sim"),
            ("e1", urls[1].clone(), "sim"),
        ],
    );
    let addr = gw.local_addr();

    // A short prompt with a long streamed answer: in flight for seconds, prefill done.
    let mut decoding = Client::connect(addr);
    decoding.send(&post_bytes(
        "/v1/chat/completions",
        &cold_prompt("d", 4, 150, true),
        &[],
    ));
    let (status, headers) = decoding.read_head();
    assert_eq!(status, 200);
    let decoder = headers
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case("x-router-backend"))
        .map(|(_, v)| v.clone())
        .unwrap();
    let other = if decoder == "e0" { "e1" } else { "e0" };
    assert!(eventually(Duration::from_secs(5), || {
        pending_prefill(&Client::connect(addr).get("/metrics").text(), &decoder) == 0.0
    }));

    // A long cold prompt (about 1000 tokens, 1 s of prefill) goes to the idle backend.
    let prefilling = start_long_prefill(addr, other);

    // One request in flight on each; new cold prompts all go where no prefill waits.
    for i in 0..8 {
        let r = Client::connect(addr).post(
            "/v1/chat/completions",
            &cold_prompt(&format!("q{i}x"), 6, 1, false),
            &[],
        );
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-router-reason"), Some("no-match"));
        assert_eq!(
            r.header("x-router-backend"),
            Some(decoder.as_str()),
            "request {i}"
        );
    }

    let long = prefilling.join().unwrap();
    assert_eq!(long.status, 200);
    assert_eq!(long.header("x-router-backend"), Some(other));
    drop(decoding);
    // Nothing is left pending once the first bytes have come back.
    let m = Client::connect(addr).get("/metrics").text();
    assert_eq!(pending_prefill(&m, "e0"), 0.0, "{m}");
    assert_eq!(pending_prefill(&m, "e1"), 0.0, "{m}");
}
both_drivers!(queued_prefill_work_steers_cold_prompts);

/// Where cold prompts go while backend `e0` prefills a long prompt, on three engines
/// of which `e0` and `e1` share compute when `grouped` (`compute_group`); the
/// backends the cold prompts went to.
fn cold_prompts_beside_a_long_prefill(io: &str, grouped: bool) -> Vec<String> {
    let slow = |cache_blocks| EngineConfig {
        prefill_per_token: Duration::from_millis(1),
        cache_blocks,
        ..EngineConfig::new("sim")
    };
    // e0's cache is the largest, so the first new prompt goes there (most room).
    let engines = [
        start_engine(io, slow(4096)),
        start_engine(io, slow(2048)),
        start_engine(io, slow(2048)),
    ];
    // The shortest wait alone decides a new prefix (no slack for cache room).
    let mut toml = gateway_toml(
        io,
        1,
        "[routing]\npolicy = \"prefix_aware\"\n[routing.prefix_aware]\nnew_prefix_slack_requests = 0",
        &[],
    );
    for (i, (e, blocks)) in engines.iter().zip([4096, 2048, 2048]).enumerate() {
        toml.push_str(&format!(
            "\n[[backends]]\nid = \"e{i}\"\nurl = \"{}\"\nmodels = [\"sim\"]\ncache_blocks = {blocks}\n",
            e.url()
        ));
        if grouped && i < 2 {
            toml.push_str("compute_group = \"gpu0\"\n");
        }
    }
    let gw = radixgate::Gateway::start(radixgate::config::Config::from_toml(&toml).unwrap())
        .expect("gateway starts");
    let addr = gw.local_addr();

    // A long cold prompt (about 1000 tokens, 1 s of prefill) goes to e0.
    let prefilling = start_long_prefill(addr, "e0");
    // Cold prompts of a few blocks each, one at a time, while e0 prefills.
    let mut went = Vec::new();
    for i in 0..4 {
        let r = Client::connect(addr).post(
            "/v1/chat/completions",
            &cold_prompt(&format!("q{i}x"), 40, 1, false),
            &[],
        );
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-router-reason"), Some("no-match"));
        went.push(r.header("x-router-backend").unwrap().to_string());
    }
    let long = prefilling.join().unwrap();
    assert_eq!(long.header("x-router-backend"), Some("e0"));
    went
}

/// `compute_group`: an idle engine whose neighbour on the same hardware is busy
/// prefilling is not idle. Told that e0 and e1 share compute, the gateway sends
/// every cold prompt to e2 while e0 prefills; not told, e1 and e2 look the same
/// and take turns (new prefixes spread over the engines given the fewest lately).
fn an_engine_whose_neighbour_prefills_is_not_idle(io: &str) {
    let grouped = cold_prompts_beside_a_long_prefill(io, true);
    assert!(grouped.iter().all(|b| b == "e2"), "{grouped:?}");
    let alone = cold_prompts_beside_a_long_prefill(io, false);
    assert!(alone.iter().any(|b| b == "e1"), "{alone:?}");
}
both_drivers!(an_engine_whose_neighbour_prefills_is_not_idle);

/// A streamed chat body for `model` whose prompt is `n` cold words tagged `tag`,
/// with usage (what learning reads) in its last event.
fn model_prompt(model: &str, tag: &str, n: usize, max_tokens: u32) -> String {
    let text: String = (0..n).map(|i| format!("{tag}{i} ")).collect();
    format!(
        r#"{{"model":"{model}","stream":true,"stream_options":{{"include_usage":true}},"max_tokens":{max_tokens},"messages":[{{"role":"user","content":"{text}"}}]}}"#
    )
}

/// `compute_group`, learning: `e0` and `e1` share compute (each serves its own
/// model, so every request's engine is known), and `e0` prefills at 4 ms a token.
/// A prompt prefilled while `e1` worked all along is learned at half its time (it
/// had half the hardware); one during which `e1` began work teaches nothing (its
/// share is unknown); one alone is learned as it came.
fn what_a_neighbour_took_is_not_learned(io: &str) {
    let engine = |model| EngineConfig {
        prefill_per_token: Duration::from_millis(4),
        decode_per_token: Duration::from_millis(50),
        ..EngineConfig::new(model)
    };
    let engines = [start_engine(io, engine("a")), start_engine(io, engine("b"))];
    let mut toml = gateway_toml(io, 1, "", &[]);
    for (i, (e, model)) in engines.iter().zip(["a", "b"]).enumerate() {
        toml.push_str(&format!(
            "\n[[backends]]\nid = \"e{i}\"\nurl = \"{}\"\nmodels = [\"{model}\"]\ncompute_group = \"gpu0\"\n",
            e.url()
        ));
    }
    let gw = radixgate::Gateway::start(radixgate::config::Config::from_toml(&toml).unwrap())
        .expect("gateway starts");
    let addr = gw.local_addr();
    let metrics = move || Client::connect(addr).get("/metrics").text();
    let e0_rate_ms = move || {
        metric(
            &metrics(),
            "radixgate_backend_prefill_ns_per_token{backend=\"e0\"}",
        )
        .unwrap()
            / 1e6
    };
    // About 180 uncached tokens: 0.7 s of prefill on e0.
    let ask_e0 = move |tag: &str| {
        let r = Client::connect(addr).post(
            "/v1/chat/completions",
            &model_prompt("a", tag, 120, 1),
            &[],
        );
        assert_eq!((r.status, r.header("x-router-backend")), (200, Some("e0")));
    };
    // A long answer on e1 (40 tokens at 50 ms each), `after` a pause.
    let neighbour_works = move |after: Duration| {
        #[allow(clippy::disallowed_methods)] // a client thread, not a shard
        std::thread::spawn(move || {
            std::thread::sleep(after);
            let r = Client::connect(addr).post(
                "/v1/chat/completions",
                &model_prompt("b", "n", 20, 40),
                &[],
            );
            assert_eq!((r.status, r.header("x-router-backend")), (200, Some("e1")));
        })
    };
    let e1_busy = move || {
        eventually(Duration::from_secs(5), || {
            metric(&metrics(), "radixgate_backend_in_flight{backend=\"e1\"}") == Some(1.0)
        })
    };

    // e1 works from before e0's request is routed until after its first token.
    let busy = neighbour_works(Duration::ZERO);
    assert!(e1_busy(), "e1 takes its request");
    ask_e0("busy");
    let shared = e0_rate_ms();
    assert!((1.8..2.6).contains(&shared), "learned {shared} ms a token");
    busy.join().unwrap();

    // e1 idle when e0's request is routed, working by its first token.
    let joining = neighbour_works(Duration::from_millis(100));
    ask_e0("joined");
    assert!(e1_busy(), "e1 took its request while e0 prefilled");
    assert_eq!(e0_rate_ms(), shared, "a share unknown teaches nothing");
    joining.join().unwrap();

    // Alone: 4 ms a token; the rate is the median of the two samples, 3.
    ask_e0("alone");
    let both = e0_rate_ms();
    assert!((2.8..3.6).contains(&both), "learned {both} ms a token");
}
both_drivers!(what_a_neighbour_took_is_not_learned);

/// A chat body for `model` whose prompt is `n` words of six bytes (about 10 per
/// 64-byte block) tagged `tag`: a longer one with the same tag continues a shorter.
fn words_prompt(model: &str, tag: char, n: usize, max_tokens: u32, stream: bool) -> String {
    let text: String = (0..n).map(|i| format!("{tag}{i:04} ")).collect();
    format!(
        r#"{{"model":"{model}","stream":{stream},"max_tokens":{max_tokens},"messages":[{{"role":"user","content":"{text}"}}]}}"#
    )
}

/// Where a follow-up goes whose prefix its holder `e0` has cached (23 of its 56
/// blocks) while two long answers of 26-block prompts stream from `e0` (80-block
/// cache; it reports 51 in use): together they need 107 blocks. `e1` (64 blocks) is
/// idle. Both engines prefill at 0.5 ms a token; the gateway learns e0's cost from
/// its answers and prices e1, which has answered nothing, the same. Eviction is not
/// priced (the term under test alone).
fn follow_up_beside_a_busy_cache(io: &str, priced: bool) -> Response {
    // Only e0 serves the adapter `filler`, which the streams use to go there.
    let engine = |cache_blocks, loras: &[&str]| EngineConfig {
        prefill_per_token: Duration::from_micros(500),
        decode_per_token: Duration::from_millis(20),
        cache_blocks,
        loras: loras.iter().map(|l| l.to_string()).collect(),
        ..EngineConfig::new("sim")
    };
    let engines = [
        start_engine(io, engine(80, &["filler"])),
        start_engine(io, engine(64, &[])),
    ];
    let mut toml = gateway_toml(
        io,
        1,
        &format!(
            "[routing]\npolicy = \"prefix_aware\"\n[routing.prefix_aware]\n\
             prefill_us_per_token = 500\neviction_weight = 0.0\nprice_cache_in_use = {priced}\n\
             [health]\nscrape_interval_ms = 100"
        ),
        &[],
    );
    for (i, (e, blocks)) in engines.iter().zip([80, 64]).enumerate() {
        toml.push_str(&format!(
            "\n[[backends]]\nid = \"e{i}\"\nurl = \"{}\"\nmodels = [\"sim\"]\ncache_blocks = {blocks}\n",
            e.url()
        ));
    }
    let gw = radixgate::Gateway::start(radixgate::config::Config::from_toml(&toml).unwrap())
        .expect("gateway starts");
    let addr = gw.local_addr();
    assert!(
        eventually(Duration::from_secs(10), || {
            Client::connect(addr)
                .get("/v1/models")
                .text()
                .contains("\"filler\"")
        }),
        "the gateway learns e0's adapter"
    );

    // The conversation's first turn: a new prefix, placed on e0 (most room).
    let first = Client::connect(addr).post(
        "/v1/chat/completions",
        &words_prompt("sim", 'p', 250, 1, false),
        &[],
    );
    assert_eq!(first.status, 200);
    assert_eq!(first.header("x-router-backend"), Some("e0"));

    // Two long answers from e0 (only it has `filler`), their prefills done.
    let mut streams = Vec::new();
    for tag in ['f', 'g'] {
        let mut c = Client::connect(addr);
        c.send(&post_bytes(
            "/v1/chat/completions",
            &words_prompt("filler", tag, 280, 100, true),
            &[],
        ));
        let (status, headers) = c.read_head();
        assert_eq!(status, 200);
        assert!(headers
            .iter()
            .any(|(n, v)| n.eq_ignore_ascii_case("x-router-backend") && v == "e0"));
        streams.push(c);
    }
    // Both prefills done, and the engine's KV usage, as scraped, shows both streams
    // (53 of its 80 blocks): the bound on what is in flight is then the prompts'.
    assert!(eventually(Duration::from_secs(5), || {
        let m = Client::connect(addr).get("/metrics").text();
        pending_prefill(&m, "e0") == 0.0
            && metric(&m, "radixgate_engine_kv_usage{backend=\"e0\"}").unwrap_or(0.0) > 0.6
    }));

    let follow_up = Client::connect(addr).post(
        "/v1/chat/completions",
        &words_prompt("sim", 'p', 600, 1, false),
        &[],
    );
    assert_eq!(follow_up.status, 200);
    drop(streams);
    follow_up
}

/// `price_cache_in_use`: an engine cannot evict the blocks of the requests it runs,
/// so a cached prefix that does not fit beside them and its own prompt is evicted
/// before its turn. Counted whole, the match keeps the follow-up on its holder
/// behind the two streams; priced, the holder would prefill the whole prompt as the
/// idle engine would, behind two requests, and the idle engine is sooner.
fn a_prefix_the_work_in_flight_would_evict_is_not_waited_for(io: &str) {
    let whole = follow_up_beside_a_busy_cache(io, false);
    assert_eq!(
        whole.header("x-router-backend"),
        Some("e0"),
        "{:?}",
        whole.headers
    );
    assert_eq!(whole.header("x-router-reason"), Some("longest-prefix"));
    let matched: u32 = whole
        .header("x-router-match-blocks")
        .unwrap()
        .parse()
        .unwrap();
    assert!((20..=24).contains(&matched), "{matched}");
    let priced = follow_up_beside_a_busy_cache(io, true);
    assert_eq!(
        priced.header("x-router-backend"),
        Some("e1"),
        "{:?}",
        priced.headers
    );
    assert_eq!(
        priced.header("x-router-reason"),
        Some("fallback-least-loaded")
    );
}
both_drivers!(a_prefix_the_work_in_flight_would_evict_is_not_waited_for);

/// `routing.index_touch_ms`: a prompt the pick already holds in full, seen again within
/// the interval, is neither recorded nor replicated, on whichever shard it arrives once
/// that shard's replica has it; the requests still follow the prefix. With 0, every
/// request is recorded.
fn repeated_prompts_touch_the_index_once_per_interval(io: &str) {
    for (touch_ms, coalesced) in [(600_000, 5.0), (0, 0.0)] {
        let (_engines, gw) = fleet(io, 3, 2, &format!("index_touch_ms = {touch_ms}\n"));
        let addr = gw.local_addr();
        let first = Client::connect(addr).post("/v1/chat/completions", &doc_question(3, 0), &[]);
        let home = first.header("x-router-backend").unwrap().to_string();
        wait_replicated(addr);
        // Fresh connections: spread over both shards.
        for _ in 0..5 {
            let r = Client::connect(addr).post("/v1/chat/completions", &doc_question(3, 0), &[]);
            assert_eq!(r.status, 200);
            assert_eq!(r.header("x-router-backend"), Some(home.as_str()));
            assert_eq!(r.header("x-router-reason"), Some("longest-prefix"));
        }
        wait_replicated(addr);
        let m = Client::connect(addr).get("/metrics").text();
        assert_eq!(
            metric(&m, "radixgate_index_touches_coalesced_total"),
            Some(coalesced),
            "index_touch_ms = {touch_ms}: {m}"
        );
        // Every copy of the index still agrees.
        let blocks = metric(&m, "radixgate_index_blocks{copy=\"coordinator\"}");
        assert!(blocks.unwrap_or(0.0) > 0.0, "{m}");
        for shard in 0..2 {
            let copy = format!("radixgate_index_blocks{{copy=\"shard-{shard}\"}}");
            assert_eq!(metric(&m, &copy), blocks, "{m}");
        }
    }
}
both_drivers!(repeated_prompts_touch_the_index_once_per_interval);

/// A prompt its pick already holds in full, seen again within `index_touch_ms` (the
/// touch coalesced: routing recorded and copied nothing), still goes whole to the next
/// backend when that attempt fails: the retry records the prompt there, so the next
/// request finds it cached on the new backend.
fn retry_after_a_coalesced_touch_carries_the_prompt(io: &str) {
    let (mut engines, gw) = fleet(
        io,
        2,
        1,
        "index_touch_ms = 600000\n[breaker]\nfailure_threshold = 1\nopen_ms = 60000\n[health]\ninterval_ms = 60000\n",
    );
    let addr = gw.local_addr();
    let prompt = doc_question(5, 0);
    let first = Client::connect(addr).post("/v1/chat/completions", &prompt, &[]);
    let home = first.header("x-router-backend").unwrap().to_string();
    let again = Client::connect(addr).post("/v1/chat/completions", &prompt, &[]);
    assert_eq!(again.header("x-router-backend"), Some(home.as_str()));
    let held = again.header("x-router-match-blocks").unwrap().to_string();
    assert!(held.parse::<u32>().unwrap() > 10, "{held}");
    let m = Client::connect(addr).get("/metrics").text();
    assert_eq!(
        metric(&m, "radixgate_index_touches_coalesced_total"),
        Some(1.0)
    );
    // The home engine dies; the prompt's next request fails there and is retried.
    let other = if home == "e0" { "e1" } else { "e0" };
    engines.remove(if home == "e0" { 0 } else { 1 }).stop();
    let retried = Client::connect(addr).post("/v1/chat/completions", &prompt, &[]);
    assert_eq!(retried.status, 200, "{}", retried.text());
    assert_eq!(retried.header("x-router-backend"), Some(other));
    let m = Client::connect(addr).get("/metrics").text();
    let retries = format!("radixgate_retries_total{{backend=\"{home}\"}}");
    assert_eq!(metric(&m, &retries), Some(1.0), "{m}");
    // The retry recorded the whole prompt on the other backend.
    let next = Client::connect(addr).post("/v1/chat/completions", &prompt, &[]);
    assert_eq!(next.header("x-router-backend"), Some(other));
    assert_eq!(
        next.header("x-router-match-blocks"),
        Some(held.as_str()),
        "the retry carried the prompt's blocks"
    );
}
both_drivers!(retry_after_a_coalesced_touch_carries_the_prompt);
