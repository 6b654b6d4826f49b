//! Streams that survive their engine. With `retry.migrate_streams`, a streamed
//! answer whose engine dies mid-stream (its connection reset or closed between two
//! events, before `data: [DONE]` and before a `finish_reason`) is continued on
//! another engine, and the client reads one unbroken stream.
//!
//! While the first engine streams, [`StreamText`] watches the decoded SSE body as
//! it passes — only when the setting is on; otherwise the exchange holds `None` and
//! does no extra work. It scans each `data:` event for the delta's `"content":"`
//! (completions: `"text":"`), unescapes only that string, counts one token per
//! non-empty delta (engines stream a token per event), and notes a `finish_reason`,
//! `[DONE]` or a second choice (`n` > 1 is not continued).
//!
//! When the stream is cut, [`resume`] asks the same router again with the failed
//! backends excluded (as failover does), and re-sends the request with the text so
//! far appended — chat: an assistant message with
//! `"continue_final_message":true,"add_generation_prompt":false`, as vLLM continues
//! a message; completions: the prompt extended — and `max_tokens` /
//! `max_completion_tokens` less the tokens already streamed. The continuation is
//! spliced into the client's stream event by event ([`Splice`]): its role chunk is
//! dropped, `id`, `created` and `model` become the first engine's, and its `usage`
//! counts the original prompt (the continuation's prompt less the carried tokens)
//! and every completion token. The failed engine's breaker is told; each migration
//! is logged, counted (`radixgate_stream_migrations_total{outcome}`) and traced (an
//! attempt span with reason `stream_migration`). When no engine can take it, or
//! `retry.max_stream_migrations` is spent, the stream ends as it does without
//! migration: a last `data:` event with the error in OpenAI's shape.
//!
//! A stream that is late rather than cut (`retry.first_token_timeout_ms`: no token
//! by its deadline) is moved the same way, but only when another backend promises its
//! first token sooner than the stream has already waited ([`LateStream`]); otherwise
//! it waits on where it is.

use super::exchange::{end_stream_with, next_body_piece, BodyPiece, BodyTracker, Exchange};
use super::route::{roll_back, route, routing_facts, with_fleet, EndGuard, ProbeGuard};
use super::{write_upstream_head, Request};
use crate::error::{ErrorKind, GatewayError};
use crate::fleet::InFlightGuard;
use crate::http::response::Utf8Vec;
use crate::metrics::STREAM_MIGRATION_OUTCOMES;
use crate::observe::Usage;
use crate::openai::Endpoint;
use crate::otlp::SpanKind;
use crate::shard::Shard;
use crate::tls::Stream;
use crate::trace::TraceContext;
use memchr::memmem;
use monoio::io::AsyncWriteRentExt;
use monoio::time::Instant;
use radixgate_orchestrator::RoutingFacts;
use serde_json::Value;
use std::fmt::Write as _;
use std::rc::Rc;
use std::sync::Arc;

/// Migrations per stream are capped here whatever the config says.
const MAX_MIGRATIONS: u32 = 8;

// === impl StreamText ===

/// What a streamed answer has said so far, watched as its decoded body passes.
#[derive(Debug)]
pub(crate) struct StreamText {
    endpoint: Endpoint,
    /// The start of an event not yet ended by its blank line.
    partial: Vec<u8>,
    seen: Seen,
}

#[derive(Debug, Default)]
struct Seen {
    /// The generated text (choice 0).
    text: String,
    /// Events that carried text: the tokens generated.
    tokens: u64,
    /// A `finish_reason` or `[DONE]`: the answer is complete.
    finished: bool,
    /// A choice other than index 0 (`n` > 1): not continued.
    several: bool,
    /// The first event's data, whose `id`, `created` and `model` a continuation keeps.
    first: Option<Vec<u8>>,
}

impl StreamText {
    pub(crate) fn new(endpoint: Endpoint) -> Self {
        Self {
            endpoint,
            partial: Vec::new(),
            seen: Seen::default(),
        }
    }

    /// Watches a piece of the decoded body.
    pub(crate) fn feed(&mut self, piece: &[u8]) {
        self.feed_events(piece, |_| {});
    }

    /// Watches a piece of the decoded body and hands `each` every event it
    /// completes (its lines and the blank line that ends it).
    fn feed_events(&mut self, piece: &[u8], mut each: impl FnMut(&[u8])) {
        self.partial.extend_from_slice(piece);
        let mut start = 0;
        while let Some(end) = memmem::find(&self.partial[start..], b"\n\n") {
            let event = &self.partial[start..start + end + 2];
            self.seen.observe(event, self.endpoint);
            each(event);
            start += end + 2;
        }
        self.partial.drain(..start);
    }

    /// Whether a cut here can be continued elsewhere: the answer is not complete,
    /// has one choice, and the client has whole events only.
    pub(crate) fn can_continue(&self) -> bool {
        !self.seen.finished && !self.seen.several && self.partial.is_empty()
    }

    pub(crate) fn text(&self) -> &str {
        &self.seen.text
    }

    pub(crate) fn tokens(&self) -> u64 {
        self.seen.tokens
    }
}

impl Seen {
    fn observe(&mut self, event: &[u8], endpoint: Endpoint) {
        for line in event.split(|&b| b == b'\n') {
            let Some(data) = line.strip_prefix(b"data:") else {
                continue;
            };
            let data = data.strip_prefix(b" ").unwrap_or(data);
            if data.starts_with(b"[DONE]") {
                self.finished = true;
                continue;
            }
            if self.first.is_none() {
                self.first = Some(data.to_vec());
            }
            if memmem::find(data, b"\"finish_reason\":\"").is_some() {
                self.finished = true;
            }
            self.several |= other_index(data);
            let key: &[u8] = match endpoint {
                Endpoint::ChatCompletions => b"\"content\":\"",
                Endpoint::Completions => b"\"text\":\"",
            };
            if let Some(at) = memmem::find(data, key) {
                let before = self.text.len();
                unescape_into(&data[at + key.len()..], &mut self.text);
                if self.text.len() > before {
                    self.tokens += 1;
                }
            }
        }
    }
}

/// Whether the event's data names a choice `"index"` other than 0. (An escaped
/// string cannot hold `"index":` unescaped, so only members match.)
fn other_index(data: &[u8]) -> bool {
    memmem::find_iter(data, b"\"index\":").any(|at| {
        let rest = &data[at + 8..];
        rest.first() != Some(&b'0') || rest.get(1).is_some_and(u8::is_ascii_digit)
    })
}

/// Appends the JSON string that starts at `s` (just after its opening quote),
/// unescaped, to `out`; stops at its closing quote or the end of `s`.
fn unescape_into(s: &[u8], out: &mut String) {
    let mut i = 0;
    while i < s.len() {
        let run = s[i..]
            .iter()
            .position(|&b| b == b'"' || b == b'\\')
            .unwrap_or(s.len() - i);
        out.push_str(&String::from_utf8_lossy(&s[i..i + run]));
        i += run;
        if i >= s.len() || s[i] == b'"' {
            return;
        }
        // An escape.
        let Some(&e) = s.get(i + 1) else { return };
        i += 2;
        let c = match e {
            b'n' => '\n',
            b't' => '\t',
            b'r' => '\r',
            b'b' => '\u{8}',
            b'f' => '\u{c}',
            b'u' => {
                let Some(hi) = hex4(&s[i..]) else { return };
                i += 4;
                if (0xd800..0xdc00).contains(&hi) && s[i..].starts_with(b"\\u") {
                    match hex4(&s[i + 2..]) {
                        Some(lo) if (0xdc00..0xe000).contains(&lo) => {
                            i += 6;
                            char::from_u32(0x10000 + ((hi - 0xd800) << 10) + (lo - 0xdc00))
                                .unwrap_or('\u{fffd}')
                        }
                        _ => '\u{fffd}',
                    }
                } else {
                    char::from_u32(hi).unwrap_or('\u{fffd}')
                }
            }
            other => other as char, // `"`, `\`, `/`
        };
        out.push(c);
    }
}

fn hex4(s: &[u8]) -> Option<u32> {
    let digits = std::str::from_utf8(s.get(..4)?).ok()?;
    u32::from_str_radix(digits, 16).ok()
}

// === a late first token ===

/// What a stream's first-token deadline weighs before moving it
/// (`retry.first_token_timeout_ms`): a stream is moved only when another backend
/// promises its first token sooner than the late one has already kept it waiting,
/// even if that backend is as late against its estimate as the deadline let this one
/// be. When every other backend is as busy (an overloaded fleet, where a move throws
/// away the late engine's queue position and prefills the prompt again behind another
/// queue), the stream stays, and is weighed again when its wait has doubled.
pub(super) struct LateStream<'a> {
    /// The request's routing facts with the late backend excluded.
    pub facts: RoutingFacts<'a>,
    /// How late against its estimate the other backend may turn out to be:
    /// `retry.first_token_timeout_factor`, at least 1.
    pub factor: f64,
}

impl LateStream<'_> {
    /// Whether a move pays after `waited`: the cost model's soonest first token
    /// among the other candidates it can trust
    /// ([`radixgate_orchestrator::Router::soonest_first_token_ns`], whatever the
    /// routing policy), times `factor`, is below it.
    pub fn move_pays(&self, shard: &Shard, waited: std::time::Duration) -> bool {
        let soonest = with_fleet(shard, std::time::Instant::now(), |fleet| {
            shard.router.borrow_mut().soonest_first_token_ns(
                &shard.replica.borrow(),
                fleet,
                &self.facts,
            )
        });
        soonest.is_some_and(|ns| ns * self.factor < waited.as_nanos() as f64)
    }
}

// === the continuation ===

/// The request to continue a stream: `body` with the text so far appended (see the
/// module header) and the token limits reduced by `tokens`; `Err` says why it
/// cannot be continued.
pub(crate) fn continuation_body(
    body: &[u8],
    endpoint: Endpoint,
    text: &str,
    tokens: u64,
) -> Result<Vec<u8>, &'static str> {
    if tokens == 0 && text.is_empty() {
        // Nothing generated yet (a stream stalled before its first token): the
        // request itself, as the client sent it.
        return Ok(body.to_vec());
    }
    let mut v: Value = serde_json::from_slice(body).map_err(|_| "the body is not JSON")?;
    let obj = v.as_object_mut().ok_or("the body is not an object")?;
    for key in ["max_tokens", "max_completion_tokens"] {
        if let Some(max) = obj.get(key).and_then(Value::as_u64) {
            if max <= tokens {
                return Err("the answer has used its token limit");
            }
            obj.insert(key.into(), (max - tokens).into());
        }
    }
    match endpoint {
        Endpoint::ChatCompletions => {
            let messages = obj
                .get_mut("messages")
                .and_then(Value::as_array_mut)
                .ok_or("the request has no messages")?;
            messages.push(serde_json::json!({"role": "assistant", "content": text}));
            obj.insert("continue_final_message".into(), true.into());
            obj.insert("add_generation_prompt".into(), false.into());
        }
        Endpoint::Completions => {
            let prompt = match obj.get_mut("prompt") {
                Some(Value::String(p)) => p,
                Some(Value::Array(a)) if a.len() == 1 => match &mut a[0] {
                    Value::String(p) => p,
                    _ => return Err("the prompt is not text"),
                },
                _ => return Err("the prompt is not one text"),
            };
            prompt.push_str(text);
            // The client has the echo already.
            if obj.contains_key("echo") {
                obj.insert("echo".into(), false.into());
            }
        }
    }
    serde_json::to_vec(&v).map_err(|_| "the body could not be written")
}

/// Rewrites a continuation's events into the client's stream.
pub(crate) struct Splice {
    /// The first engine's `id`, `created` and `model`.
    ident: [Option<Value>; 3],
    /// The client has had an event already (so not the continuation's role chunk).
    client_has_events: bool,
    /// Completion tokens streamed before this continuation.
    carried: u64,
}

const IDENT: [&str; 3] = ["id", "created", "model"];

impl Splice {
    /// A splice after `carried` tokens, keeping the identity of the first event
    /// the stream carried (`first`, its data).
    pub(crate) fn new(first: Option<&[u8]>, carried: u64) -> Self {
        let client_has_events = first.is_some();
        let first: Option<Value> = first.and_then(|d| serde_json::from_slice(d).ok());
        Self {
            ident: IDENT.map(|k| first.as_ref().and_then(|v| v.get(k)).cloned()),
            client_has_events,
            carried,
        }
    }

    /// Appends `event` as the client gets it to `out`, or nothing when it carries
    /// no token (the continuation's role chunk) and the client has had events.
    pub(crate) fn rewrite(&self, event: &[u8], out: &mut Vec<u8>) {
        let start = out.len();
        for line in event.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
            let Some(data) = line.strip_prefix(b"data:") else {
                out.extend_from_slice(line);
                out.push(b'\n');
                continue;
            };
            let data = data.strip_prefix(b" ").unwrap_or(data);
            let Ok(mut v) = serde_json::from_slice::<Value>(data) else {
                out.extend_from_slice(line);
                out.push(b'\n');
                continue;
            };
            if self.client_has_events && carries_nothing(&v) {
                continue;
            }
            if let Some(obj) = v.as_object_mut() {
                for (k, value) in IDENT.iter().zip(&self.ident) {
                    if let (Some(value), true) = (value, obj.contains_key(*k)) {
                        obj.insert((*k).into(), value.clone());
                    }
                }
                if let Some(u) = obj.get_mut("usage").and_then(Value::as_object_mut) {
                    let get = |k: &str| u.get(k).and_then(Value::as_u64).unwrap_or(0);
                    let prompt = get("prompt_tokens").saturating_sub(self.carried);
                    let completion = get("completion_tokens") + self.carried;
                    u.insert("prompt_tokens".into(), prompt.into());
                    u.insert("completion_tokens".into(), completion.into());
                    u.insert("total_tokens".into(), (prompt + completion).into());
                }
            }
            out.extend_from_slice(b"data: ");
            let _ = serde_json::to_writer(&mut *out, &v);
            out.push(b'\n');
        }
        if out.len() > start {
            out.push(b'\n');
        }
    }
}

/// A chunk whose choices carry no text, no tool call and no finish: a role chunk.
fn carries_nothing(v: &Value) -> bool {
    let Some(choices) = v.get("choices").and_then(Value::as_array) else {
        return false;
    };
    let empty = |c: &Value| {
        let blank = |x: Option<&Value>| x.is_none_or(|x| x.is_null() || x == "");
        blank(c.get("finish_reason"))
            && blank(c.get("text"))
            && c.get("delta").is_none_or(|d| {
                blank(d.get("content")) && d.get("tool_calls").is_none_or(Value::is_null)
            })
    };
    !choices.is_empty() && choices.iter().all(empty)
}

/// Where a stream was cut: what [`resume`] needs besides the request.
pub(super) struct Cut {
    pub text: StreamText,
    /// The backend that broke off.
    pub failed: usize,
    /// Backends not to try again (failed attempts, the one that broke off).
    pub excluded: Vec<usize>,
    pub blocks: Arc<[u64]>,
    pub session: Option<u64>,
    /// The client's connection may stay open once its stream is ended.
    pub keep_client: bool,
    /// Attempts the request made before the cut (for the spans' attempt number).
    pub attempts: usize,
    /// The backend did not break: it sent no token by the first-token deadline.
    pub stalled: bool,
}

/// How one continuation ended.
enum Continued {
    /// The stream was ended (the continuation's `[DONE]` and the body's end).
    Done(Usage),
    /// The client left.
    ClientGone,
    /// It could not start (`bool`: the backend's fault, for its breaker).
    Failed(GatewayError, bool),
    /// It broke off too, after the client had some of it.
    Cut,
}

/// Continues the cut stream on other backends, up to `retry.max_stream_migrations`
/// times, or ends it with the error. Returns whether the client's connection stays
/// open, and the usage the client was told.
pub(super) async fn resume(
    shard: &Rc<Shard>,
    client: &mut Stream,
    req: &Request<'_>,
    body: &Rc<Vec<u8>>,
    mut cut: Cut,
) -> (bool, Usage) {
    let limit = {
        let fleet = shard.fleet.borrow();
        let retry = &fleet.live.config.retry;
        let migrations = if retry.migrate_streams {
            retry.max_stream_migrations
        } else {
            0
        };
        // A stalled stream is moved once even where broken ones are not continued.
        migrations.max(u32::from(cut.stalled)).min(MAX_MIGRATIONS)
    };
    let mut error = if cut.stalled {
        GatewayError::new(
            ErrorKind::UpstreamTimeout,
            format!(
                "backend `{}` sent no token within retry.first_token_timeout_ms, and no other backend could take the request",
                shard.backend_id(cut.failed)
            ),
        )
    } else {
        broke_off(shard, cut.failed)
    };
    for migration in 1..=limit {
        let from = cut.failed;
        let routed = route(
            shard,
            &routing_facts(
                &req.facts,
                req.policy,
                &cut.blocks,
                cut.session,
                req.chunks,
                &cut.excluded,
            ),
        );
        let mut decision = match routed {
            Ok(d) => d,
            Err(e) => {
                count(shard, 2);
                tracing::info!(from = %shard.backend_id(from), error = %e, "stream cut off; no backend can continue it");
                break;
            }
        };
        // A continuation's first byte is its response head, not a first token: its
        // time says nothing about the engine's prefill, so it is not learned from
        // (as a split leg is not). Learned, a moved stream's 3 ms read as 0.003 ms a
        // token on a 1,000-token prompt (`radixgate-bench real`, concurrency 8).
        decision.in_flight_before = u32::MAX;
        let backend = decision.pick.backend;
        let continuation =
            continuation_body(body, req.endpoint, cut.text.text(), cut.text.tokens());
        let continuation = match continuation {
            Ok(c) => c,
            Err(why) => {
                roll_back(shard, &decision);
                count(shard, 1);
                tracing::info!(from = %shard.backend_id(from), why, "stream cut off; it cannot be continued");
                break;
            }
        };
        tracing::info!(
            from = %shard.backend_id(from),
            to = %shard.backend_id(backend),
            tokens = cut.text.tokens(),
            migration,
            stalled = cut.stalled && migration == 1,
            "stream migrated"
        );
        let span = crate::trace::start_child(&TraceContext::of(req.head));
        let _probe = ProbeGuard::enter(shard, &decision);
        let _ended = EndGuard::enter(shard, &decision);
        let _in_flight = InFlightGuard::enter(
            &shard.shared.in_flight,
            shard.id,
            backend,
            decision.prompt_blocks,
        );
        let mut exchange = Exchange {
            pending_prefill: Some(shard.shared.pending_prefill.enter(
                shard.id,
                backend,
                decision.uncached_tokens,
                std::time::Instant::now(),
            )),
            ..Exchange::new(shard, backend, Instant::now())
        };
        let mut request = shard.take_buffer();
        write_upstream_head(
            shard,
            &mut request,
            req.head,
            continuation.len(),
            backend,
            req.request_id,
            crate::trace::id_of(span),
        );
        let splice = Splice::new(cut.text.seen.first.as_deref(), cut.text.tokens());
        let continued = continue_on(
            &mut exchange,
            client,
            (request, Rc::new(continuation)),
            &mut cut.text,
            &splice,
        )
        .await;
        let outcome = match &continued {
            Continued::Done(_) => "stream_migration",
            Continued::ClientGone => "client_gone",
            Continued::Failed(..) | Continued::Cut => "stream_migration_failed",
        };
        if let Some(mut s) = crate::trace::child(shard, SpanKind::Attempt, span) {
            s.backend = Some(backend);
            s.attempt = (cut.attempts as u32) + migration;
            s.status = exchange.status;
            s.reason = outcome;
            crate::trace::emit(shard, s);
        }
        match continued {
            Continued::Done(usage) => {
                count(shard, 0);
                shard.report_outcome(backend, true);
                exchange.record(&req.facts, &decision);
                return (cut.keep_client, usage);
            }
            Continued::ClientGone => {
                exchange.record(&req.facts, &decision);
                return (false, Usage::default());
            }
            Continued::Failed(e, fault) => {
                if exchange.first_byte.is_none() {
                    roll_back(shard, &decision);
                }
                if fault {
                    shard.report_outcome(backend, false);
                }
                exchange.status = exchange.status.max(e.status());
                exchange.record(&req.facts, &decision);
                tracing::info!(backend = %shard.backend_id(backend), error = %e, "stream continuation failed");
                error = e;
            }
            Continued::Cut => {
                shard.report_outcome(backend, false);
                exchange.record(&req.facts, &decision);
                error = broke_off(shard, backend);
            }
        }
        count(shard, 1);
        cut.excluded.push(backend);
        cut.failed = backend;
        if !cut.text.can_continue() {
            break;
        }
    }
    let ended = end_stream_with(shard, client, &error, shard.take_buffer()).await;
    (ended && cut.keep_client, Usage::default())
}

fn broke_off(shard: &Shard, backend: usize) -> GatewayError {
    GatewayError::new(
        ErrorKind::UpstreamProtocol,
        format!(
            "backend `{}` broke off the stream",
            shard.backend_id(backend)
        ),
    )
}

/// Counts a migration under [`STREAM_MIGRATION_OUTCOMES`]`[outcome]`.
fn count(shard: &Shard, outcome: usize) {
    debug_assert!(outcome < STREAM_MIGRATION_OUTCOMES.len());
    shard.metrics.borrow_mut().stream_migrations[outcome] += 1;
}

/// Sends the continuation (`request`: its head and body) and splices its events
/// into the client's stream.
async fn continue_on(
    exchange: &mut Exchange<'_>,
    client: &mut Stream,
    (request, body): (Vec<u8>, Rc<Vec<u8>>),
    text: &mut StreamText,
    splice: &Splice,
) -> Continued {
    let shard = exchange.shard;
    let idle_timeout = shard.fleet.borrow().live.config.upstream.idle_timeout;
    let (mut upstream, mut buf, head_len, mut resp) =
        match exchange.send(request, Some(&body), Some(&*client)).await {
            Ok(sent) => sent,
            Err(e) if e.kind == ErrorKind::ClientClosed => return Continued::ClientGone,
            Err(e) => return Continued::Failed(e, true),
        };
    exchange.status = resp.status;
    if resp.status != 200 || !resp.event_stream {
        shard.give_buffer(buf);
        shard.give_buffer(resp.take_buffer());
        let e = GatewayError::new(
            ErrorKind::UpstreamProtocol,
            format!(
                "backend `{}` answered the stream's continuation with {}",
                shard.backend_id(exchange.backend),
                resp.status
            ),
        );
        return Continued::Failed(e, resp.status >= 500);
    }
    shard.give_buffer(resp.take_buffer());
    exchange.got_first_byte();
    let mut tracker = BodyTracker::new(resp.framing());
    let mut payload = Vec::new();
    let mut events = Vec::new();
    let mut framed = shard.take_buffer();
    let mut start = head_len;
    let mut reusable = true;
    loop {
        payload.clear();
        let data = &buf[start..];
        let Ok(used) = tracker.advance(data, |p| payload.extend_from_slice(p)) else {
            shard.give_buffer(buf);
            shard.give_buffer(framed);
            return Continued::Cut;
        };
        reusable &= used == data.len();
        events.clear();
        text.feed_events(&payload, |event| splice.rewrite(event, &mut events));
        if !events.is_empty() {
            exchange.usage.feed(&events);
            framed.clear();
            let _ = write!(Utf8Vec(&mut framed), "{:x}\r\n", events.len());
            framed.extend_from_slice(&events);
            framed.extend_from_slice(b"\r\n");
            let (r, b) = client.write_all(framed).await;
            framed = b;
            if r.is_err() {
                shard.give_buffer(buf);
                shard.give_buffer(framed);
                return Continued::ClientGone;
            }
        }
        if tracker.done() {
            break;
        }
        start = 0;
        match next_body_piece(&mut upstream, &mut buf, idle_timeout, client, &tracker).await {
            BodyPiece::Bytes => {}
            BodyPiece::Ended => {
                reusable = false;
                break;
            }
            BodyPiece::ClientGone => {
                shard.give_buffer(buf);
                shard.give_buffer(framed);
                return Continued::ClientGone;
            }
            BodyPiece::Broke | BodyPiece::Idle => {
                shard.give_buffer(buf);
                shard.give_buffer(framed);
                return Continued::Cut;
            }
        }
    }
    shard.give_buffer(buf);
    framed.clear();
    framed.extend_from_slice(b"0\r\n\r\n");
    let (r, framed) = client.write_all(framed).await;
    shard.give_buffer(framed);
    if r.is_err() {
        return Continued::ClientGone;
    }
    let live = shard.fleet.borrow().live.backends.is_live(exchange.backend);
    if reusable && resp.keep_alive && live {
        shard.pool.borrow_mut().put(exchange.backend, upstream);
    }
    Continued::Done(exchange.usage.usage)
}

#[cfg(test)]
mod tests;
