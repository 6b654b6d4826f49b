//! Streams that survive an engine's death (`retry.migrate_streams`): two simulated
//! engines run as processes of their own (`radixgate engine-sim`), a slow stream is
//! read through the gateway, and the engine serving it is killed (SIGKILL) midway.
//! With migration the client's text (chat and completions) is exactly what one
//! uninterrupted engine sends, with one `[DONE]`, the first engine's `id` and a
//! consistent `usage`, and the dead engine's breaker opens; without it the stream
//! ends with an error event, as before; past `retry.max_stream_migrations`, or with
//! no other engine, the stream ends with the error too.
//!
//! `retry.first_token_timeout_ms` uses the same continuation for an engine that is
//! alive but has sent no token: an engine with a 1 s-a-token prefill sends its
//! stream's head at once (`--stream-head-first`, as vLLM does) and then nothing, and
//! the client still reads the whole answer, from the other engine, without the slow
//! one's breaker being told; an engine that sends the head with its first token is
//! left before the client has anything (once the gateway has learned the other
//! engine's speed from an answered request); with no other engine the stream waits
//! for its own, and so it does where the other engine promises its first token no
//! sooner than the stream has already waited, or where the gateway has learned no
//! engine's speed and its price for the other is a guess.

mod common;

use common::*;
use radixgate::engine_sim::Words;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_radixgate");

/// Tokens a test stream asks for.
const TOKENS: usize = 40;

/// A simulated engine in a process of its own, killed when dropped.
struct Engine {
    child: Child,
    url: String,
}

impl Engine {
    fn start(io: &str) -> Engine {
        Engine::start_with(io, 0, &[])
    }

    /// An engine prefilling at `prefill_us` a token, with `extra` arguments.
    fn start_with(io: &str, prefill_us: u64, extra: &[&str]) -> Engine {
        let prefill_us = prefill_us.to_string();
        let mut child = Command::new(BIN)
            .args(["engine-sim", "--listen", "127.0.0.1:0", "--io", io])
            .args([
                "--decode-us-per-token",
                "30000",
                "--prefill-us-per-token",
                &prefill_us,
            ])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("engine-sim starts");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let url = line
            .split_whitespace()
            .find(|w| w.starts_with("http://"))
            .unwrap_or_else(|| panic!("no URL in {line:?}"))
            .to_string();
        Engine { child, url }
    }

    /// SIGKILL: the engine's sockets are closed by the kernel mid-stream.
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.kill();
    }
}

const IDS: [&str; 2] = ["e0", "e1"];

fn fleet(io: &str, retry: &str) -> (Vec<Engine>, radixgate::Gateway) {
    fleet_of(2, io, retry)
}

fn fleet_of(n: usize, io: &str, retry: &str) -> (Vec<Engine>, radixgate::Gateway) {
    fleet_from((0..n).map(|_| Engine::start(io)).collect(), io, retry)
}

fn fleet_from(engines: Vec<Engine>, io: &str, retry: &str) -> (Vec<Engine>, radixgate::Gateway) {
    let backends: Vec<_> = engines
        .iter()
        .zip(IDS)
        .map(|(e, id)| (id, e.url.clone(), "sim"))
        .collect();
    let extra = format!(
        "[routing]\npolicy = \"round_robin\"\n[breaker]\nfailure_threshold = 1\nopen_ms = 60000\n[retry]\n{retry}\n"
    );
    let gw = start_gateway(io, 1, &extra, &backends);
    (engines, gw)
}

/// The streaming endpoints.
#[derive(Clone, Copy)]
enum Api {
    Chat,
    Completions,
}

impl Api {
    fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Completions => "/v1/completions",
        }
    }

    fn request(self, stream: bool) -> String {
        let options = if stream {
            r#","stream":true,"stream_options":{"include_usage":true}"#
        } else {
            ""
        };
        match self {
            Api::Chat => format!(
                r#"{{"model":"sim","max_tokens":{TOKENS}{options},"messages":[{{"role":"user","content":"tell me a long story about engines that die"}}]}}"#
            ),
            Api::Completions => format!(
                r#"{{"model":"sim","max_tokens":{TOKENS}{options},"prompt":"Once upon a time there was an engine that died.\n"}}"#
            ),
        }
    }

    /// An event's text.
    fn text(self, v: &serde_json::Value) -> Option<&str> {
        match self {
            Api::Chat => v["choices"][0]["delta"]["content"].as_str(),
            Api::Completions => v["choices"][0]["text"].as_str(),
        }
    }
}

/// What the client read of one stream.
struct Read {
    api: Api,
    backend: String,
    /// Each `data:` event's payload, in order.
    data: Vec<String>,
}

impl Read {
    fn events(&self) -> Vec<serde_json::Value> {
        self.data
            .iter()
            .filter(|d| d.starts_with('{'))
            .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("{e}: {d}")))
            .collect()
    }

    fn texts(&self) -> Vec<String> {
        self.events()
            .iter()
            .filter_map(|v| self.api.text(v).filter(|t| !t.is_empty()).map(String::from))
            .collect()
    }

    fn dones(&self) -> usize {
        self.data.iter().filter(|d| *d == "[DONE]").count()
    }
}

/// Streams the test request, calling `at_event(n, backend)` after the `n`th event
/// with text (the backend the gateway named in its head).
fn stream(addr: std::net::SocketAddr, api: Api, at_event: impl FnMut(usize, &str)) -> Read {
    stream_body(addr, api, &api.request(true), at_event)
}

/// [`stream`] with a request body of the caller's.
fn stream_body(
    addr: std::net::SocketAddr,
    api: Api,
    body: &str,
    mut at_event: impl FnMut(usize, &str),
) -> Read {
    let mut c = Client::connect(addr);
    c.send(&post_bytes(api.path(), body, &[]));
    let (status, headers) = c.read_head();
    assert_eq!(status, 200);
    let backend = headers
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case("x-router-backend"))
        .map(|(_, v)| v.clone())
        .expect("the backend is named");
    let mut read = Read {
        api,
        backend,
        data: Vec::new(),
    };
    let mut texts = 0;
    let mut pending = String::new();
    loop {
        let chunk = c.read_chunk();
        if chunk.is_empty() {
            break;
        }
        pending.push_str(std::str::from_utf8(&chunk).unwrap());
        while let Some(end) = pending.find("\n\n") {
            let event: String = pending.drain(..end + 2).collect();
            let data = event.trim().strip_prefix("data: ").unwrap_or(event.trim());
            read.data.push(data.to_string());
            let v: serde_json::Value = serde_json::from_str(data).unwrap_or_default();
            if api.text(&v).is_some_and(|t| !t.is_empty()) {
                texts += 1;
                at_event(texts, &read.backend);
            }
        }
    }
    assert!(pending.is_empty(), "a partial event: {pending:?}");
    read
}

/// The text one uninterrupted engine sends for an answer that starts with `first`.
fn uninterrupted(first: &str) -> String {
    let w = Words::default();
    let f = (0..w.len())
        .find(|&f| w.piece(f, 0) == first)
        .unwrap_or_else(|| panic!("{first:?} is not a first word"));
    (0..TOKENS).map(|s| w.piece(f, s)).collect()
}

fn index_of(backend: &str) -> usize {
    IDS.iter().position(|id| *id == backend).unwrap()
}

fn metrics(addr: std::net::SocketAddr) -> String {
    Client::connect(addr).get("/metrics").text()
}

fn killed_engine_mid_stream_is_continued_on_the_other(io: &str) {
    continued_on_the_other(io, Api::Chat);
}
both_drivers!(killed_engine_mid_stream_is_continued_on_the_other);

fn killed_engine_mid_completion_is_continued_on_the_other(io: &str) {
    continued_on_the_other(io, Api::Completions);
}
both_drivers!(killed_engine_mid_completion_is_continued_on_the_other);

fn continued_on_the_other(io: &str, api: Api) {
    let (mut engines, gw) = fleet(io, "migrate_streams = true");
    let addr = gw.local_addr();
    // One answer first (round robin: on the engine that will continue the stream),
    // so the two engines number their answers differently and the rewritten `id`
    // shows.
    let warm = Client::connect(addr).post(api.path(), &api.request(false), &[]);
    assert_eq!(warm.status, 200, "{}", warm.text());
    let mut killed = None;
    let read = stream(addr, api, |n, backend| {
        if n == 10 {
            let i = index_of(backend);
            engines[i].kill();
            killed = Some(i);
        }
    });
    let dead = killed.expect("the engine was killed");
    let texts = read.texts();
    assert_eq!(
        texts.concat(),
        uninterrupted(&texts[0]),
        "the client's text is intact"
    );
    assert_eq!(texts.len(), TOKENS, "no token twice, none lost");
    assert_eq!(read.dones(), 1, "{:?}", read.data);
    assert_eq!(read.data.last().map(String::as_str), Some("[DONE]"));
    let events = read.events();
    for v in &events {
        assert!(v.get("error").is_none(), "{v}");
        for k in ["id", "created", "model"] {
            assert_eq!(v[k], events[0][k], "{k} is the first engine's: {v}");
        }
    }
    let usage = &events.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], TOKENS, "{usage}");
    // The survivor counts the original prompt as the uninterrupted answer does.
    let whole = Client::connect(addr).post(api.path(), &api.request(false), &[]);
    assert_eq!(whole.status, 200, "{}", whole.text());
    let expected = &whole.json()["usage"];
    assert_eq!(usage["prompt_tokens"], expected["prompt_tokens"], "{usage}");
    assert_eq!(
        usage["total_tokens"].as_u64(),
        Some(usage["prompt_tokens"].as_u64().unwrap() + TOKENS as u64)
    );
    let m = metrics(addr);
    assert_eq!(
        metric(&m, "radixgate_stream_migrations_total{outcome=\"resumed\"}"),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        metric(
            &m,
            &format!("radixgate_breaker_state{{backend=\"{}\"}}", IDS[dead])
        ),
        Some(2.0),
        "the dead engine's breaker opened:\n{m}"
    );
}

fn without_migration_the_stream_is_cut_as_before(io: &str) {
    let (mut engines, gw) = fleet(io, "migrate_streams = false");
    let addr = gw.local_addr();
    let read = stream(addr, Api::Chat, |n, backend| {
        if n == 10 {
            engines[index_of(backend)].kill();
        }
    });
    assert_eq!(read.texts().len(), 10, "{:?}", read.data);
    assert_eq!(read.dones(), 0);
    let last = read.events().pop().unwrap();
    assert_eq!(last["error"]["code"], "upstream_error", "{last}");
    let m = metrics(addr);
    assert_eq!(
        metric(&m, "radixgate_stream_migrations_total{outcome=\"resumed\"}"),
        Some(0.0),
        "{m}"
    );
}
both_drivers!(without_migration_the_stream_is_cut_as_before);

fn a_second_death_past_the_limit_ends_the_stream_with_the_error(io: &str) {
    let (mut engines, gw) = fleet(io, "migrate_streams = true\nmax_stream_migrations = 1");
    let addr = gw.local_addr();
    let mut first = None;
    let read = stream(addr, Api::Chat, |n, backend| {
        if n == 10 {
            let i = index_of(backend);
            engines[i].kill();
            first = Some(i);
        }
        if n == 20 {
            // The continuation runs on the other engine.
            engines[1 - first.unwrap()].kill();
        }
    });
    assert_eq!(read.texts().len(), 20, "{:?}", read.data);
    assert_eq!(read.dones(), 0);
    let last = read.events().pop().unwrap();
    assert_eq!(last["error"]["code"], "upstream_error", "{last}");
    let other = IDS[1 - first.unwrap()];
    assert!(
        last["error"]["message"].as_str().unwrap().contains(other),
        "{last}"
    );
    let m = metrics(addr);
    assert_eq!(
        metric(&m, "radixgate_stream_migrations_total{outcome=\"failed\"}"),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        metric(&m, "radixgate_stream_migrations_total{outcome=\"resumed\"}"),
        Some(0.0),
        "{m}"
    );
}
both_drivers!(a_second_death_past_the_limit_ends_the_stream_with_the_error);

fn with_no_other_engine_the_stream_ends_with_the_error(io: &str) {
    let (mut engines, gw) = fleet_of(1, io, "migrate_streams = true");
    let addr = gw.local_addr();
    let read = stream(addr, Api::Chat, |n, _| {
        if n == 10 {
            engines[0].kill();
        }
    });
    assert_eq!(read.texts().len(), 10, "{:?}", read.data);
    assert_eq!(read.dones(), 0);
    let last = read.events().pop().unwrap();
    assert_eq!(last["error"]["code"], "upstream_error", "{last}");
    assert!(
        last["error"]["message"].as_str().unwrap().contains("e0"),
        "{last}"
    );
    let m = metrics(addr);
    assert_eq!(
        metric(
            &m,
            "radixgate_stream_migrations_total{outcome=\"no_backend\"}"
        ),
        Some(1.0),
        "{m}"
    );
}
both_drivers!(with_no_other_engine_the_stream_ends_with_the_error);

/// `e0` prefills at once, `e1` at `slow_us` a token; both send a stream's head as
/// `engine_args` say (`--stream-head-first`: before the prefill, as vLLM does). One
/// request answered by e0 first (round robin's first pick) teaches the gateway e0's
/// prefill cost: a late stream moves only to an engine whose cost the gateway has
/// learned, never on a cold gateway's guess.
fn fast_then_slow_fleet(
    io: &str,
    slow_us: u64,
    engine_args: &[&str],
    retry: &str,
) -> (Vec<Engine>, radixgate::Gateway) {
    let engines = vec![
        Engine::start_with(io, 0, engine_args),
        Engine::start_with(io, slow_us, engine_args),
    ];
    let (engines, gw) = fleet_from(engines, io, retry);
    answered_unstreamed(gw.local_addr(), 0, "e0");
    (engines, gw)
}

fn a_stream_stalled_before_its_first_token_moves_to_the_other_engine(io: &str) {
    // e1 would take ~10 s (ten prompt tokens at 1 s each) to its first token.
    let (engines, gw) = fast_then_slow_fleet(
        io,
        1_000_000,
        &["--stream-head-first"],
        "first_token_timeout_ms = 300",
    );
    let addr = gw.local_addr();
    // Round robin sends the first stream to e1 (the continuation on e0 then takes a
    // turn too, so the second may go to e1 as well).
    let reads = [
        stream(addr, Api::Chat, |_, _| {}),
        stream(addr, Api::Chat, |_, _| {}),
    ];
    let stalled = reads
        .iter()
        .find(|r| r.backend == "e1")
        .expect("one went to e1");
    let moved = reads.iter().filter(|r| r.backend == "e1").count() as f64;
    for read in &reads {
        let texts = read.texts();
        assert_eq!(texts.concat(), uninterrupted(&texts[0]), "{:?}", read.data);
        assert_eq!(texts.len(), TOKENS, "{:?}", read.data);
        assert_eq!(read.dones(), 1, "{:?}", read.data);
        for v in read.events() {
            assert!(v.get("error").is_none(), "{v}");
        }
    }
    // The moved stream counts its own prompt once, as the one that was not moved.
    let usage = |r: &Read| r.events().last().unwrap()["usage"].clone();
    // What the fast engine itself counts for the prompt.
    let e0: std::net::SocketAddr = engines[0]
        .url
        .trim_start_matches("http://")
        .parse()
        .unwrap();
    let whole = Client::connect(e0).post(Api::Chat.path(), &Api::Chat.request(false), &[]);
    assert_eq!(
        usage(stalled)["prompt_tokens"],
        whole.json()["usage"]["prompt_tokens"]
    );
    assert_eq!(usage(stalled)["completion_tokens"], TOKENS);
    let m = metrics(addr);
    for (backend, moved) in [("e1", moved), ("e0", 0.0)] {
        assert_eq!(
            metric(
                &m,
                &format!("radixgate_first_token_timeouts_total{{backend=\"{backend}\"}}")
            ),
            Some(moved),
            "{m}"
        );
    }
    assert_eq!(
        metric(&m, "radixgate_stream_migrations_total{outcome=\"resumed\"}"),
        Some(moved),
        "{m}"
    );
    // Late is not broken: the slow engine's breaker stays closed.
    assert_eq!(
        metric(&m, "radixgate_breaker_state{backend=\"e1\"}"),
        Some(0.0),
        "{m}"
    );
}
both_drivers!(a_stream_stalled_before_its_first_token_moves_to_the_other_engine);

fn a_late_stream_with_nowhere_to_go_waits_for_its_engine(io: &str) {
    // One engine, 30 ms a prompt token (~300 ms to the first token), deadline 50 ms.
    let engine = Engine::start_with(io, 30_000, &["--stream-head-first"]);
    let (_engines, gw) = fleet_from(vec![engine], io, "first_token_timeout_ms = 50");
    let addr = gw.local_addr();
    let read = stream(addr, Api::Chat, |_, _| {});
    assert_answered_by_e0_unmoved(&read, &metrics(addr));
}
both_drivers!(a_late_stream_with_nowhere_to_go_waits_for_its_engine);

/// A streamed chat request whose prompt is about 120 tokens (seven blocks), the
/// `n`th of its kind (prompts of different `n` share no block).
fn long_story_request(n: usize) -> String {
    let story = "tell me a long story about engines that are late but not dead ".repeat(7);
    let story = format!("story {n}: {story}");
    format!(
        r#"{{"model":"sim","max_tokens":{TOKENS},"stream":true,"messages":[{{"role":"user","content":"{story}"}}]}}"#
    )
}

/// [`long_story_request`], not streamed.
fn unstreamed(n: usize) -> String {
    long_story_request(n).replace(r#""stream":true,"#, "")
}

/// Sends [`unstreamed`]`(n)` (no first-token deadline applies), which `backend`
/// answers: the gateway learns that engine's prefill cost from it.
fn answered_unstreamed(addr: std::net::SocketAddr, n: usize, backend: &str) {
    let answered = Client::connect(addr).post(Api::Chat.path(), &unstreamed(n), &[]);
    assert_eq!(answered.status, 200, "{}", answered.text());
    assert_eq!(answered.header("x-router-backend"), Some(backend));
}

/// The late stream on e0 was weighed at its deadline at least once and kept there.
fn assert_e0_waited(m: &str) {
    let waits = metric(m, "radixgate_first_token_waits_total{backend=\"e0\"}");
    assert!(waits.is_some_and(|n| n >= 1.0), "{m}");
}

/// The whole answer came from e0, and no stream was moved off it.
fn assert_answered_by_e0_unmoved(read: &Read, m: &str) {
    assert_eq!(read.backend, "e0");
    let texts = read.texts();
    assert_eq!(texts.len(), TOKENS, "{:?}", read.data);
    assert_eq!(texts.concat(), uninterrupted(&texts[0]), "{:?}", read.data);
    assert_eq!(read.dones(), 1, "{:?}", read.data);
    assert_eq!(
        metric(m, "radixgate_first_token_timeouts_total{backend=\"e0\"}"),
        Some(0.0),
        "{m}"
    );
}

/// e0 prefills at 5 ms a token: about 0.6 s to the first token of a prompt of about
/// 120 tokens, past the 200 ms deadline. e1 prefills at 20 ms a token, and the
/// gateway has learned that from a request e1 answered before: idle but without the
/// prompt cached, it promises its first token in about 2.4 s, nowhere sooner. The
/// stream waits on e0 (weighed again at 400 ms), and is not moved, whether e0 sent
/// its head first or sends nothing until its first token.
fn late_stream_with_nowhere_sooner(io: &str, engine_args: &[&str]) {
    let engines = vec![
        Engine::start_with(io, 5_000, engine_args),
        Engine::start_with(io, 20_000, engine_args),
    ];
    let (_engines, gw) = fleet_from(engines, io, "first_token_timeout_ms = 200");
    let addr = gw.local_addr();
    // Round robin: the first two, not streamed (no deadline), to e0 and e1 (their
    // costs learned); the third, a prompt neither holds, to e0.
    answered_unstreamed(addr, 1, "e0");
    answered_unstreamed(addr, 2, "e1");
    let read = stream_body(addr, Api::Chat, &long_story_request(3), |_, _| {});
    let m = metrics(addr);
    assert_answered_by_e0_unmoved(&read, &m);
    // Weighed at 200 ms, and again at 400 ms when the first token had not come.
    assert_e0_waited(&m);
}

fn a_late_stream_stays_where_no_other_engine_promises_a_token_sooner(io: &str) {
    late_stream_with_nowhere_sooner(io, &["--stream-head-first"]);
}
both_drivers!(a_late_stream_stays_where_no_other_engine_promises_a_token_sooner);

fn a_late_head_is_waited_for_where_no_other_engine_promises_a_token_sooner(io: &str) {
    late_stream_with_nowhere_sooner(io, &[]);
}
both_drivers!(a_late_head_is_waited_for_where_no_other_engine_promises_a_token_sooner);

fn late_streams_are_not_moved_onto_a_busy_engine_priced_by_guess(io: &str) {
    // Both engines take about 0.6 s to a first token, past the 200 ms deadline, and
    // the gateway has learned neither's speed: each stream's alternative is busy with
    // the other stream, and its price for that queue (the configured default, tens of
    // microseconds) is a guess. Neither stream moves.
    let engines = vec![
        Engine::start_with(io, 5_000, &["--stream-head-first"]),
        Engine::start_with(io, 5_000, &["--stream-head-first"]),
    ];
    let (_engines, gw) = fleet_from(engines, io, "first_token_timeout_ms = 200");
    let addr = gw.local_addr();
    let body = long_story_request(0);
    let reads: Vec<Read> = std::thread::scope(|s| {
        let streams: Vec<_> = (0..2)
            .map(|_| s.spawn(|| stream_body(addr, Api::Chat, &body, |_, _| {})))
            .collect();
        streams.into_iter().map(|t| t.join().unwrap()).collect()
    });
    let mut backends: Vec<&str> = reads.iter().map(|r| r.backend.as_str()).collect();
    backends.sort();
    assert_eq!(backends, ["e0", "e1"], "round robin gave each engine one");
    for read in &reads {
        let texts = read.texts();
        assert_eq!(texts.len(), TOKENS, "{:?}", read.data);
        assert_eq!(texts.concat(), uninterrupted(&texts[0]), "{:?}", read.data);
        assert_eq!(read.dones(), 1, "{:?}", read.data);
    }
    let m = metrics(addr);
    let mut waits = 0.0;
    for backend in IDS {
        assert_eq!(
            metric(
                &m,
                &format!("radixgate_first_token_timeouts_total{{backend=\"{backend}\"}}")
            ),
            Some(0.0),
            "{m}"
        );
        waits += metric(
            &m,
            &format!("radixgate_first_token_waits_total{{backend=\"{backend}\"}}"),
        )
        .unwrap_or(0.0);
    }
    assert!(waits >= 2.0, "{m}");
}
both_drivers!(late_streams_are_not_moved_onto_a_busy_engine_priced_by_guess);

fn a_cold_gateway_moves_no_late_stream(io: &str) {
    // e0 takes about 0.6 s to its first token, past the 200 ms deadline; e1 is idle
    // and fast, but the gateway has learned no engine's speed yet: its price for e1
    // (the configured default, about 2 ms for the prompt) is a guess, and a stream is
    // not moved on a guess.
    let engines = vec![
        Engine::start_with(io, 5_000, &["--stream-head-first"]),
        Engine::start_with(io, 0, &["--stream-head-first"]),
    ];
    let (_engines, gw) = fleet_from(engines, io, "first_token_timeout_ms = 200");
    let addr = gw.local_addr();
    let read = stream_body(addr, Api::Chat, &long_story_request(0), |_, _| {});
    let m = metrics(addr);
    assert_answered_by_e0_unmoved(&read, &m);
    assert_e0_waited(&m);
}
both_drivers!(a_cold_gateway_moves_no_late_stream);

fn a_stream_with_no_head_by_the_deadline_is_retried_on_the_other_engine(io: &str) {
    // Engines that send a stream's head with its first token: e1's never comes
    // within the deadline, so the gateway retries before the client has anything.
    let (_engines, gw) = fast_then_slow_fleet(io, 1_000_000, &[], "first_token_timeout_ms = 300");
    let addr = gw.local_addr();
    let reads = [
        stream(addr, Api::Chat, |_, _| {}),
        stream(addr, Api::Chat, |_, _| {}),
    ];
    for read in &reads {
        assert_eq!(
            read.backend, "e0",
            "the head came from the engine that answered"
        );
        assert_eq!(read.texts().len(), TOKENS, "{:?}", read.data);
        assert_eq!(read.dones(), 1, "{:?}", read.data);
    }
    let m = metrics(addr);
    let moved = metric(&m, "radixgate_first_token_timeouts_total{backend=\"e1\"}");
    assert!(moved.is_some_and(|n| n >= 1.0), "{m}");
    // Late is neither a failed attempt nor a broken backend.
    assert_eq!(
        metric(&m, "radixgate_retries_total{backend=\"e1\"}"),
        Some(0.0),
        "{m}"
    );
    assert_eq!(
        metric(&m, "radixgate_breaker_state{backend=\"e1\"}"),
        Some(0.0),
        "{m}"
    );
}
both_drivers!(a_stream_with_no_head_by_the_deadline_is_retried_on_the_other_engine);
