//! Precise mode against simulated engines that publish KV events as vLLM does: real
//! ZeroMQ sockets, real HTTP, engines tokenizing through the same tokenizer and chat
//! template as the gateway. The gateway binds (`kv_events`, the engine connects) or
//! connects (`kv_events_connect`, the engine binds: any number of gateways), and
//! fills sequence gaps from the engine's replay socket (`kv_events_replay`).

mod common;

use common::bus::free_port;
use common::{eventually, metric, Client, Response};
use radixgate::config::Config;
use radixgate::engine_sim::{self, EngineConfig, EngineHandle, SimKvEvents, SimTokenizer};
use radixgate::runtime::Driver;
use radixgate::Gateway;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokenizers::models::wordlevel::WordLevel;
use tokenizers::pre_tokenizers::whitespace::Whitespace;
use tokenizers::Tokenizer;

const BLOCK: u64 = 4;

/// A word-level tokenizer and a small chat template in a fresh directory.
fn model_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("radixgate-kvev-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut vocab: HashMap<String, u32> = HashMap::new();
    vocab.insert("[UNK]".into(), 0);
    let words = [
        "<",
        "|",
        ">",
        "im_start",
        "im_end",
        "user",
        "assistant",
        "system",
    ];
    let extra: Vec<String> = (0..200).map(|i| format!("w{i}")).collect();
    for w in words
        .iter()
        .copied()
        .chain(extra.iter().map(String::as_str))
    {
        let next = vocab.len() as u32;
        vocab.entry(w.into()).or_insert(next);
    }
    let model = WordLevel::builder()
        .vocab(vocab.into_iter().collect())
        .unk_token("[UNK]".into())
        .build()
        .unwrap();
    let mut t = Tokenizer::new(model);
    t.with_pre_tokenizer(Some(Whitespace {}));
    t.save(dir.join("tokenizer.json"), false).unwrap();
    std::fs::write(
        dir.join("chat_template.jinja"),
        // Content first: each document's chain starts at its own first block, so a
        // batch lost before the subscription connected does not orphan later ones.
        "{% for m in messages %}{{ m['content'] }} <|{{ m['role'] }}|>\n{% endfor %}\
         {% if add_generation_prompt %}<|assistant|>\n{% endif %}",
    )
    .unwrap();
    dir
}

fn engine(dir: &Path, events: SimKvEvents) -> EngineHandle {
    let tokenizer = dir.join("tokenizer.json");
    let cfg = EngineConfig {
        block_tokens: BLOCK as usize,
        tokenizer: Some(SimTokenizer::load(tokenizer.to_str().unwrap(), None).unwrap()),
        kv_events: Some(events),
        ..EngineConfig::instant("m")
    };
    engine_sim::start(cfg, "127.0.0.1:0".parse().unwrap(), Driver::Epoll).expect("engine starts")
}

/// A precise-mode gateway; `backends` are `(id, engine, extra backend keys)`.
fn gateway(dir: &Path, backends: &[(&str, &EngineHandle, String)]) -> Gateway {
    let mut toml = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nshards = 2\nio = \"epoll\"\n\n[routing]\n\
         policy = \"prefix_aware\"\nhashing = \"precise\"\ntokenizer = \"{}\"\n\
         block_tokens = {BLOCK}\n",
        dir.join("tokenizer.json").display()
    );
    for (id, e, extra) in backends {
        toml.push_str(&format!(
            "\n[[backends]]\nid = \"{id}\"\nurl = \"{}\"\nmodels = [\"m\"]\n{extra}\n",
            e.url()
        ));
    }
    let config = Config::from_toml(&toml).unwrap_or_else(|e| panic!("bad config: {e}\n{toml}"));
    Gateway::start(config).expect("gateway starts")
}

/// A chat request over a document of `words` words (`w{seed}`, ...), then a question.
fn chat(seed: usize, words: usize, question: &str) -> String {
    let doc: Vec<String> = (0..words)
        .map(|i| format!("w{}", (seed + i * 7) % 200))
        .collect();
    format!(
        r#"{{"model":"m","max_tokens":2,"messages":[{{"role":"system","content":"{}"}},{{"role":"user","content":"{question}"}}]}}"#,
        doc.join(" ")
    )
}

fn cached_tokens(r: &Response) -> u64 {
    r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0)
}

fn match_blocks(r: &Response) -> u64 {
    r.header("x-router-match-blocks")
        .expect("X-Router-Match-Blocks")
        .parse()
        .unwrap()
}

/// The gateway's matched blocks in tokens, as the engine counts a hit: vLLM always
/// computes a prompt's last token, so a fully cached prompt of whole blocks reports
/// one block less (`(prompt_tokens - 1) / block` whole blocks at most).
fn predicted(r: &Response) -> u64 {
    let prompt = r.json()["usage"]["prompt_tokens"].as_u64().unwrap();
    match_blocks(r).min((prompt - 1) / BLOCK) * BLOCK
}

fn kv_metric(gw: &Gateway, name: &str, backend: &str) -> f64 {
    let text = Client::connect(gw.local_addr()).get("/metrics").text();
    metric(
        &text,
        &format!("radixgate_kv_events_{name}_total{{backend=\"{backend}\"}}"),
    )
    .unwrap_or(0.0)
}

/// Sends a fresh document until its KV events reach `gws` (a SUB socket that has
/// just connected can miss the first messages), and returns (seed, backend).
fn learned(gws: &[&Gateway], first: &Gateway) -> (usize, String) {
    for attempt in 0..5 {
        let seed = 11 + attempt * 31;
        let r = Client::connect(first.local_addr()).post(
            "/v1/chat/completions",
            &chat(seed, 40, "w1 w2"),
            &[],
        );
        assert_eq!(r.status, 200, "{}", r.text());
        let backend = r.header("x-router-backend").unwrap().to_string();
        let seen = eventually(Duration::from_secs(5), || {
            gws.iter()
                .all(|g| kv_metric(g, "stored_blocks", &backend) > 0.0)
        });
        if seen {
            return (seed, backend);
        }
    }
    let text = Client::connect(gws[0].local_addr()).get("/metrics").text();
    let kv: Vec<&str> = text.lines().filter(|l| l.contains("kv_events")).collect();
    panic!("no KV events reached the gateways in five tries: {kv:#?}");
}

/// The second request on a learned document: the gateway's predicted blocks times
/// the block size equal the engine's `cached_tokens`, and it routed to the engine
/// that holds them.
fn predicts_exactly(gw: &Gateway, seed: usize, backend: &str) -> u64 {
    common::wait_replicated(gw.local_addr());
    let r = Client::connect(gw.local_addr()).post(
        "/v1/chat/completions",
        &chat(seed, 40, "w3 w4 w5"),
        &[],
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-router-backend"), Some(backend));
    let cached = cached_tokens(&r);
    assert!(cached > 0, "the engine had the document cached");
    assert_eq!(
        predicted(&r),
        cached,
        "precise mode predicts the engine's hit to the token"
    );
    // The gateway's own accounting agrees (it counts a hit as vLLM does).
    let name =
        |kind: &str| format!("radixgate_cached_tokens_{kind}_total{{backend=\"{backend}\"}}");
    let agree = eventually(Duration::from_secs(2), || {
        let text = Client::connect(gw.local_addr()).get("/metrics").text();
        let p = metric(&text, &name("predicted"));
        p.is_some() && p == metric(&text, &name("reported"))
    });
    assert!(agree, "predicted_total equals reported_total");
    cached
}

#[test]
fn bind_mode_predicts_cached_tokens_exactly() {
    let dir = model_dir("bind");
    // The gateway binds; the engines connect (vLLM's rule for a concrete host).
    let ports = [free_port(), free_port()];
    let engines: Vec<_> = ports
        .iter()
        .map(|p| engine(&dir, SimKvEvents::new(format!("tcp://127.0.0.1:{p}"))))
        .collect();
    let gw = gateway(
        &dir,
        &[
            (
                "e0",
                &engines[0],
                format!("kv_events = \"tcp://127.0.0.1:{}\"", ports[0]),
            ),
            (
                "e1",
                &engines[1],
                format!("kv_events = \"tcp://127.0.0.1:{}\"", ports[1]),
            ),
        ],
    );
    let (seed, backend) = learned(&[&gw], &gw);
    predicts_exactly(&gw, seed, &backend);
    for id in ["e0", "e1"] {
        assert_eq!(kv_metric(&gw, "gaps", id), 0.0);
    }
    gw.shutdown();
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn two_replicas_connect_to_the_same_engines_and_both_learn() {
    let dir = model_dir("connect");
    // The engines bind (ipc://, as vLLM does: same host, no network port), with a
    // replay socket each; both gateways connect to both.
    let engines: Vec<_> = (0..2)
        .map(|i| {
            let mut ev = SimKvEvents::new(format!("ipc://{}/e{i}.sock", dir.display()));
            ev.replay = Some(format!("tcp://127.0.0.1:{}", free_port()));
            (engine(&dir, ev.clone()), ev)
        })
        .collect();
    let keys = |i: usize| {
        let ev = &engines[i].1;
        format!(
            "kv_events_connect = \"{}\"\nkv_events_replay = \"{}\"",
            ev.endpoint,
            ev.replay.as_deref().unwrap()
        )
    };
    let backends = [
        ("e0", &engines[0].0, keys(0)),
        ("e1", &engines[1].0, keys(1)),
    ];
    let a = gateway(&dir, &backends);
    let b = gateway(&dir, &backends);
    // A request through `a`: the engine's events reach both replicas.
    let (seed, backend) = learned(&[&a, &b], &a);
    let via_b = predicts_exactly(&b, seed, &backend);
    // `b`'s request cached its question's blocks too; `a` learns those from the
    // engine's events alone (it never saw that request) and predicts them as well.
    let same = |x: &Gateway, y: &Gateway| {
        eventually(Duration::from_secs(5), || {
            kv_metric(x, "stored_blocks", &backend) == kv_metric(y, "stored_blocks", &backend)
        })
    };
    assert!(same(&a, &b), "both replicas see every stored block");
    let via_a = predicts_exactly(&a, seed, &backend);
    assert!(via_a > via_b, "a: {via_a}, b: {via_b}");
    // A replica started later learns what the engine already holds from the replay
    // socket (its buffer), not only from what it sees live.
    let c = gateway(&dir, &backends);
    assert!(
        eventually(Duration::from_secs(5), || kv_metric(
            &c, "replayed", &backend
        ) > 0.0),
        "a late replica replays the engine's history"
    );
    assert!(
        same(&c, &a),
        "the replay brought every block the engine stored"
    );
    predicts_exactly(&c, seed, &backend);
    for g in [&a, &b, &c] {
        assert_eq!(kv_metric(g, "gaps", &backend), 0.0);
        assert_eq!(kv_metric(g, "rejected", &backend), 0.0);
    }
    for g in [a, b, c] {
        g.shutdown();
    }
    drop(engines);
    std::fs::remove_dir_all(&dir).ok();
}

/// One engine losing every second batch on the wire; one gateway connected to it,
/// with or without the replay socket.
fn lossy(name: &str, replay: bool) -> (PathBuf, EngineHandle, Gateway) {
    let dir = model_dir(name);
    let mut ev = SimKvEvents::new(format!("ipc://{}/e0.sock", dir.display()));
    ev.lose_every = 2;
    ev.replay = Some(format!("tcp://127.0.0.1:{}", free_port()));
    let e = engine(&dir, ev.clone());
    let mut keys = format!("kv_events_connect = \"{}\"", ev.endpoint);
    if replay {
        keys.push_str(&format!("\nkv_events_replay = \"{}\"", ev.replay.unwrap()));
    }
    let gw = gateway(&dir, &[("e0", &e, keys)]);
    (dir, e, gw)
}

/// Three documents; the second's batch is lost on the wire (seq 1 of 0, 1, 2 with a
/// slow joiner's first batch perhaps lost too).
fn three_documents(gw: &Gateway) {
    learned(&[gw], gw);
    for seed in [100, 150] {
        let r = Client::connect(gw.local_addr()).post(
            "/v1/chat/completions",
            &chat(seed, 40, "w1 w2"),
            &[],
        );
        assert_eq!(r.status, 200);
    }
}

#[test]
fn a_sequence_gap_is_filled_from_the_replay_socket() {
    let (dir, e, gw) = lossy("replay", true);
    three_documents(&gw);
    assert!(
        eventually(Duration::from_secs(5), || kv_metric(&gw, "replayed", "e0")
            > 0.0),
        "lost batches came back from the replay socket"
    );
    // Until the replay and the live messages it held are all applied.
    let mut last = -1.0;
    assert!(eventually(Duration::from_secs(5), || {
        common::pause(Duration::from_millis(100));
        let now = kv_metric(&gw, "stored_blocks", "e0");
        std::mem::replace(&mut last, now) == now
    }));
    assert_eq!(kv_metric(&gw, "gaps", "e0"), 0.0, "every gap was filled");
    // Both documents sent after the first are known, whichever batch was lost.
    for seed in [100, 150] {
        common::wait_replicated(gw.local_addr());
        let r = Client::connect(gw.local_addr()).post(
            "/v1/chat/completions",
            &chat(seed, 40, "w3 w4 w5"),
            &[],
        );
        assert_eq!(r.status, 200);
        assert!(cached_tokens(&r) > 0);
        assert_eq!(predicted(&r), cached_tokens(&r), "seed {seed}");
    }
    gw.shutdown();
    drop(e);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn without_replay_a_gap_still_clears_the_backend() {
    let (dir, e, gw) = lossy("noreplay", false);
    three_documents(&gw);
    assert!(
        eventually(Duration::from_secs(5), || kv_metric(&gw, "gaps", "e0")
            > 0.0),
        "a lost batch is a gap"
    );
    assert_eq!(kv_metric(&gw, "replayed", "e0"), 0.0);
    gw.shutdown();
    drop(e);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn garbage_on_the_socket_is_counted_never_fatal() {
    let dir = model_dir("garbage");
    let port = free_port();
    let e = engine(
        &dir,
        SimKvEvents::new(format!("tcp://127.0.0.1:{}", free_port())),
    );
    let gw = gateway(
        &dir,
        &[("e0", &e, format!("kv_events = \"tcp://127.0.0.1:{port}\""))],
    );
    let ctx = zmq::Context::new();
    let publisher = ctx.socket(zmq::PUB).unwrap();
    publisher
        .connect(&format!("tcp://127.0.0.1:{port}"))
        .unwrap();
    let rejected = eventually(Duration::from_secs(5), || {
        let _ = publisher.send_multipart([&b"kv"[..], &[1, 2, 3], &[0xc1]], 0);
        let _ = publisher.send(&b"one frame"[..], 0);
        kv_metric(&gw, "rejected", "e0") >= 2.0
    });
    assert!(rejected, "garbage is counted");
    // The gateway still serves, and its metrics still answer.
    let r = Client::connect(gw.local_addr()).post("/v1/chat/completions", &chat(1, 8, "w1"), &[]);
    assert_eq!(r.status, 200);
    gw.shutdown();
    drop(e);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn evictions_reach_the_gateway_as_block_removed() {
    let dir = model_dir("evict");
    let port = free_port();
    let tokenizer = dir.join("tokenizer.json");
    // A cache of 16 blocks: a second 40-word document evicts most of the first.
    let cfg = EngineConfig {
        block_tokens: BLOCK as usize,
        cache_blocks: 16,
        tokenizer: Some(SimTokenizer::load(tokenizer.to_str().unwrap(), None).unwrap()),
        kv_events: Some(SimKvEvents::new(format!("tcp://127.0.0.1:{port}"))),
        ..EngineConfig::instant("m")
    };
    let e = engine_sim::start(cfg, "127.0.0.1:0".parse().unwrap(), Driver::Epoll).unwrap();
    let gw = gateway(
        &dir,
        &[("e0", &e, format!("kv_events = \"tcp://127.0.0.1:{port}\""))],
    );
    let (seed, _) = learned(&[&gw], &gw);
    let before = kv_metric(&gw, "stored_blocks", "e0");
    let r = Client::connect(gw.local_addr()).post(
        "/v1/chat/completions",
        &chat(seed + 100, 40, "w1 w2"),
        &[],
    );
    assert_eq!(r.status, 200);
    assert!(
        eventually(Duration::from_secs(5), || {
            kv_metric(&gw, "removed_blocks", "e0") > 0.0
                && kv_metric(&gw, "stored_blocks", "e0") > before
        }),
        "the engine's evictions arrive as BlockRemoved"
    );
    // What is left of the first document is predicted to the token, no more.
    common::wait_replicated(gw.local_addr());
    let r = Client::connect(gw.local_addr()).post(
        "/v1/chat/completions",
        &chat(seed, 40, "w3 w4 w5"),
        &[],
    );
    assert_eq!(r.status, 200);
    let full = 12 * BLOCK; // the first document's whole blocks, had nothing gone
    assert!(
        cached_tokens(&r) < full,
        "part of the first document was evicted"
    );
    assert_eq!(predicted(&r), cached_tokens(&r));
    gw.shutdown();
    drop(e);
    std::fs::remove_dir_all(&dir).ok();
}
