//! A request to a split model (`[models.<name>.disagg]`): pick a prefill/decode pair
//! (or serve it whole, see [`pair`]), run the two legs in the model's protocol, and
//! recover from a failed leg.
//!
//! - **vLLM**: the prefill leg (one token, not streamed, `kv_transfer_params` asking
//!   for a remote decode) is read whole by the gateway; its `kv_transfer_params` go
//!   into the client's request, which the decode leg streams to the client as asked.
//! - **SGLang**: both legs at once with the prefill server's `bootstrap_host` and
//!   `bootstrap_port` and one random `bootstrap_room`; the client reads the decode
//!   leg, the prefill leg is polled beside it in the same task, drained and checked.
//!
//! Both legs carry the client's `X-Request-Id`. A prefill answer without
//! `kv_transfer_params` (connectors that find KV by prompt, such as vLLM's example
//! connector or LMCache) makes the decode leg the client's request as is.
//!
//! Failures: a prefill leg that fails (connect error, 5xx, timeout) moves to another
//! prefill server, at most `prefill_attempts` in all, then to local serving if
//! `local_fallback` allows. A decode leg that fails before its first byte (a 4xx too:
//! a refused KV hand-off) is retried with a fresh prefill (on another decode server
//! unless it was a refusal), at most `decode_attempts` in all. After its first byte
//! the stream ends with an SSE error event (as for whole requests), never with
//! replayed tokens. Each leg has its own timeout.
//!
//! A client that leaves ends both legs at once (the vLLM prefill leg watches its
//! socket; an SGLang prefill leg is abandoned when the decode leg sees the client
//! go): the upstream requests are dropped, so the engines stop, the pair's
//! accounting is released, no breaker is told, and the request is logged as 499
//! `client_closed`.

mod body;
mod pair;

use super::abandon::Abandon;
use super::exchange::{router_headers, Attempt, Exchange, Failure};
use super::route::{roll_back, ProbeGuard};
use super::{answer_error, attempt_all, log, log_answer, write_upstream_head, Request};
use crate::config::{DisaggConfig, Protocol};
use crate::error::{ErrorKind, GatewayError, CLIENT_CLOSED};
use crate::fleet::InFlightGuard;
use crate::http::io::peer_closed;
use crate::metrics::RequestKey;
use crate::observe::Usage;
use crate::otlp::SpanKind;
use crate::shard::Shard;
use crate::tls::Stream;
use crate::trace::{ChildSpan, TraceContext};
use monoio::io::AsyncWriteRentExt;
use monoio::time::Instant;
use radixgate_orchestrator::{Decision, LocalWhy, PairOutcome, Reason};
use std::future::Future;
use std::rc::Rc;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

/// How one split attempt ended.
enum Split {
    /// A response reached the client.
    Done(bool, Usage),
    /// The client left before its answer was complete; the leg it left was logged.
    ClientLeft(Usage),
    /// The prefill leg failed; nothing reached the client.
    PrefillFailed(GatewayError),
    /// The decode leg failed before its first byte; nothing reached the client.
    /// `refused`: it answered a 4xx (a refused hand-off), so the decode engine
    /// itself may take a retry with a fresh prefill.
    DecodeFailed { error: GatewayError, refused: bool },
    /// The prefill leg refused the request itself (a 4xx, which the decode side
    /// would give too): its answer goes to the client as is.
    Refused { status: u16, body: Vec<u8> },
}

/// Serves a request to a split model; see the module docs.
pub(super) async fn forward(
    shard: &Rc<Shard>,
    client: &mut Stream,
    req: &Request<'_>,
    body: &Rc<Vec<u8>>,
    split: &DisaggConfig,
) -> Result<(bool, Usage), GatewayError> {
    let blocks: Arc<[u64]> = match &req.blocks {
        Some(b) => b.clone(),
        None => (*shard.prompt_blocks()).into(),
    };
    let mut excluded = Vec::new();
    let (mut prefill_failures, mut decode_failures) = (0, 0);
    // The failure that led to the current retry: the error, the pair's decode route
    // (its headers name both ends) and the failed leg.
    let mut last: Option<(GatewayError, Decision, Leg)> = None;
    loop {
        let route_span = crate::trace::start_child(&TraceContext::of(req.head));
        let (prefill, decode) = match pair::choose(shard, &blocks, &req.facts, split, &excluded) {
            Ok(PairOutcome::Split { prefill, decode }) => (prefill, decode),
            Ok(PairOutcome::Local(why)) => {
                let chosen = matches!(why, LocalWhy::SmallUncached | LocalWhy::PrefillBottleneck);
                if chosen || split.local_fallback {
                    let reason = match &last {
                        Some((_, _, Leg::Prefill)) => "prefill_failed",
                        Some((_, _, Leg::Decode)) => "decode_failed",
                        None => why.as_str(),
                    };
                    return local(shard, client, req, body, blocks, reason).await;
                }
                let error = GatewayError::new(
                    ErrorKind::NoHealthyBackend,
                    format!(
                        "no healthy {} backend for this split model",
                        match why {
                            LocalWhy::NoDecode => "decode",
                            _ => "prefill",
                        }
                    ),
                );
                let tries = prefill_failures + decode_failures;
                return give_up(shard, client, req, last, tries, error).await;
            }
            Err(error) => {
                let tries = prefill_failures + decode_failures;
                return give_up(shard, client, req, last, tries, error).await;
            }
        };
        if last.is_none() {
            shard
                .metrics
                .borrow_mut()
                .decision
                .observe(req.started.elapsed());
        }
        if let Some(mut span) = crate::trace::child(shard, SpanKind::Route, route_span) {
            span.backend = Some(decode.pick.backend);
            span.reason = decode.pick.reason.as_str();
            span.attempt = prefill_failures + decode_failures + 1;
            span.matched_blocks = prefill.matched_blocks;
            crate::trace::emit(shard, span);
        }
        let may_retry_decode = decode_failures + 1 < split.decode_attempts;
        let _probe = ProbeGuard::enter(shard, &prefill);
        let pair = Pair {
            split,
            prefill: &prefill,
            decode: &decode,
            may_retry_decode,
        };
        let outcome = match split.protocol {
            Protocol::Vllm => vllm(shard, client, req, body, &pair).await,
            Protocol::Sglang => sglang(shard, client, req, body, &pair).await,
        };
        match outcome {
            Split::Done(keep_open, usage) => {
                shard.metrics.borrow_mut().disagg.count("split", "split");
                return Ok((keep_open, usage));
            }
            Split::ClientLeft(usage) => return Ok((false, usage)),
            Split::PrefillFailed(e) if e.kind == ErrorKind::ClientClosed => {
                // Nothing reached the engines' caches for sure: forget the beliefs.
                roll_back(shard, &prefill);
                roll_back(shard, &decode);
                let tries = prefill_failures + decode_failures;
                left_during_prefill(shard, req, &decode, tries);
                return Ok((false, Usage::default()));
            }
            Split::Refused { status, body } => {
                shard.metrics.borrow_mut().disagg.count("split", "split");
                let retries = prefill_failures + decode_failures;
                let keep = relay(shard, client, req, &decode, (status, &body), retries).await;
                return Ok((keep, Usage::default()));
            }
            Split::PrefillFailed(e) => {
                shard.metrics.borrow_mut().disagg.fail("prefill");
                roll_back(shard, &prefill);
                roll_back(shard, &decode);
                prefill_failures += 1;
                excluded.push(prefill.pick.backend);
                tracing::debug!(backend = %shard.backend_id(prefill.pick.backend), error = %e, "prefill leg failed");
                if prefill_failures >= split.prefill_attempts {
                    if split.local_fallback {
                        return local(shard, client, req, body, blocks, "prefill_failed").await;
                    }
                    return answer(
                        shard,
                        client,
                        req,
                        &e,
                        &decode,
                        Leg::Prefill,
                        prefill_failures + decode_failures,
                    )
                    .await;
                }
                last = Some((e, decode, Leg::Prefill));
            }
            Split::DecodeFailed { error: e, refused } => {
                shard.metrics.borrow_mut().disagg.fail("decode");
                roll_back(shard, &prefill);
                roll_back(shard, &decode);
                decode_failures += 1;
                if !refused {
                    excluded.push(decode.pick.backend);
                }
                tracing::debug!(backend = %shard.backend_id(decode.pick.backend), error = %e, "decode leg failed; retrying with a fresh prefill");
                if decode_failures >= split.decode_attempts {
                    return answer(
                        shard,
                        client,
                        req,
                        &e,
                        &decode,
                        Leg::Decode,
                        prefill_failures + decode_failures,
                    )
                    .await;
                }
                last = Some((e, decode, Leg::Decode));
            }
        }
    }
}

/// Serves the request whole on a `both` or `decode` backend, through the ordinary
/// routing and failover, with `X-Router-Reason: disagg-local`.
async fn local(
    shard: &Rc<Shard>,
    client: &mut Stream,
    req: &Request<'_>,
    body: &Rc<Vec<u8>>,
    blocks: Arc<[u64]>,
    reason: &'static str,
) -> Result<(bool, Usage), GatewayError> {
    shard.metrics.borrow_mut().disagg.count("local", reason);
    let whole = Request {
        blocks: Some(blocks),
        reason: Some(Reason::DisaggLocal),
        ..*req
    };
    attempt_all(shard, client, &whole, body).await
}

#[derive(Clone, Copy)]
enum Leg {
    Prefill,
    Decode,
}

/// No pair is left to try: the client gets the last leg failure if there was one
/// ([`answer`]), else `error`.
async fn give_up(
    shard: &Shard,
    client: &mut Stream,
    req: &Request<'_>,
    last: Option<(GatewayError, Decision, Leg)>,
    tries: u32,
    error: GatewayError,
) -> Result<(bool, Usage), GatewayError> {
    match last {
        Some((e, route, leg)) => answer(shard, client, req, &e, &route, leg, tries).await,
        None => Err(error),
    }
}

/// Answers the failure of the last attempt's `leg` (after `tries` failed tries in
/// all), with the headers of its pair's decode `route`, and logs it against the
/// failed leg's backend. A decode leg's exchange was counted already; a prefill
/// leg's is counted here, against the prefill backend.
async fn answer(
    shard: &Shard,
    client: &mut Stream,
    req: &Request<'_>,
    e: &GatewayError,
    route: &Decision,
    leg: Leg,
    tries: u32,
) -> Result<(bool, Usage), GatewayError> {
    let mut backend = route.pick.backend;
    if let (Leg::Prefill, Some(prefill)) = (leg, route.prefill) {
        backend = prefill;
        shard.metrics.borrow_mut().count_request(RequestKey {
            backend: Some(prefill),
            status: e.status(),
            reason: route.pick.reason.as_str(),
            model: Some(req.facts.model),
        });
    }
    log_answer(
        shard,
        req,
        route,
        (backend, e.status()),
        tries.saturating_sub(1),
    );
    let keep = answer_error(shard, client, e, route, req.head.keep_alive, req.request_id).await?;
    Ok((keep, Usage::default()))
}

/// A split request's two decisions, how the model is split, and whether a failed
/// decode leg may still be retried.
struct Pair<'a> {
    split: &'a DisaggConfig,
    prefill: &'a Decision,
    decode: &'a Decision,
    may_retry_decode: bool,
}

async fn vllm(
    shard: &Rc<Shard>,
    client: &mut Stream,
    req: &Request<'_>,
    body: &[u8],
    pair: &Pair<'_>,
) -> Split {
    let &Pair {
        split,
        prefill,
        decode,
        may_retry_decode,
    } = pair;
    let p = prefill.pick.backend;
    let leg_body = match body::vllm_prefill(body) {
        Ok(b) => b,
        Err(e) => return Split::PrefillFailed(e),
    };
    let span = crate::trace::start_child(&TraceContext::of(req.head));
    let request = prefill_request(shard, req, p, &leg_body, span);
    let leave = peer_closed(client.tcp());
    let params = match prefill_leg(
        shard,
        prefill,
        request,
        (split.prefill_timeout, leave),
        span,
    )
    .await
    {
        // Connectors that find KV by prompt (vLLM's example connector, LMCache)
        // return no parameters: the decode leg is then the client's request as is.
        Ok((200, answer)) => body::transfer_params(&answer),
        // The request itself was refused: the decode side would refuse it too.
        Ok((status, answer)) if status < 500 => {
            return Split::Refused {
                status,
                body: answer,
            }
        }
        Ok((status, _)) => {
            return Split::PrefillFailed(GatewayError::new(
                ErrorKind::UpstreamProtocol,
                format!(
                    "prefill backend `{}` answered {status}",
                    shard.backend_id(p)
                ),
            ))
        }
        Err(e) => return Split::PrefillFailed(e),
    };
    let decode_body = match params {
        Some(params) => body::vllm_decode(body, params),
        None => Ok(body.to_vec()),
    };
    match decode_body {
        Ok(b) => decode_leg(shard, client, req, decode, &b, split, may_retry_decode).await,
        Err(e) => Split::PrefillFailed(e),
    }
}

async fn sglang(
    shard: &Rc<Shard>,
    client: &mut Stream,
    req: &Request<'_>,
    body: &[u8],
    pair: &Pair<'_>,
) -> Split {
    let &Pair {
        split,
        prefill,
        decode,
        may_retry_decode,
    } = pair;
    let p = prefill.pick.backend;
    let backend = shard.backend(p);
    let Some(port) = backend.bootstrap_port else {
        return Split::PrefillFailed(GatewayError::new(
            ErrorKind::InvalidConfig,
            format!("prefill backend `{}` has no bootstrap_port", backend.id),
        ));
    };
    // SGLang's rooms are u63.
    let room = shard.rng.borrow_mut().u64(..) >> 1;
    let leg_body = match body::sglang(body, backend.addr.ip(), port, room) {
        Ok(b) => b,
        Err(e) => return Split::PrefillFailed(e),
    };
    let span = crate::trace::start_child(&TraceContext::of(req.head));
    let request = prefill_request(shard, req, p, &leg_body, span);
    // Both legs at once, in this task: the prefill leg is polled beside the decode
    // leg until that ends, then awaited; abandoned if the client left meanwhile.
    let abandon = Abandon::default();
    let timeout = (split.prefill_timeout, abandon.watch());
    let mut prefill_leg = std::pin::pin!(prefill_leg(shard, prefill, request, timeout, span));
    let mut prefilled = None;
    let outcome = {
        let decode_leg = decode_leg(
            shard,
            client,
            req,
            decode,
            &leg_body,
            split,
            may_retry_decode,
        );
        let mut decode_leg = std::pin::pin!(decode_leg);
        std::future::poll_fn(|cx| {
            if prefilled.is_none() {
                if let Poll::Ready(r) = prefill_leg.as_mut().poll(cx) {
                    prefilled = Some(r);
                }
            }
            decode_leg.as_mut().poll(cx)
        })
        .await
    };
    if matches!(outcome, Split::ClientLeft(_)) {
        abandon.now();
    }
    let prefilled = match prefilled {
        Some(r) => r,
        None => prefill_leg.await,
    };
    let checked = match prefilled {
        Ok((200, _)) => Ok(()),
        Ok((status, _)) => Err(GatewayError::new(
            ErrorKind::UpstreamProtocol,
            format!("prefill backend `{}` answered {status}", backend.id),
        )),
        Err(e) => Err(e),
    };
    match (outcome, checked) {
        (outcome @ Split::ClientLeft(_), _) => outcome,
        (Split::Done(keep, usage), Err(e)) => {
            // The client got its answer; the prefill side still misbehaved.
            tracing::debug!(backend = %backend.id, error = %e, "prefill leg failed after the decode leg answered");
            shard.metrics.borrow_mut().disagg.fail("prefill");
            Split::Done(keep, usage)
        }
        // The decode leg failed because its prefill did.
        (Split::DecodeFailed { .. }, Err(e)) => Split::PrefillFailed(e),
        (outcome, _) => outcome,
    }
}

/// A prefill leg's request to backend `p`: the client's head with `leg_body`, its
/// `traceparent` naming the leg's `span`.
fn prefill_request(
    shard: &Shard,
    req: &Request<'_>,
    p: usize,
    leg_body: &[u8],
    span: Option<ChildSpan>,
) -> Vec<u8> {
    let mut request = shard.take_buffer();
    write_upstream_head(
        shard,
        &mut request,
        req.head,
        leg_body.len(),
        p,
        req.request_id,
        crate::trace::id_of(span),
    );
    request.extend_from_slice(leg_body);
    request
}

/// The most a prefill leg's answer (one token and its `kv_transfer_params`) may be.
const PREFILL_RESPONSE_LIMIT: usize = 1 << 20;

/// Runs a prefill leg on `backend` and reads its answer whole, within `timeout`
/// unless `leave` resolves first (the client left: it ends with `client_closed`,
/// which is not the backend's fault); ends the leg's `span`.
async fn prefill_leg(
    shard: &Rc<Shard>,
    leg: &Decision,
    request: Vec<u8>,
    (timeout, leave): (Duration, impl Future<Output = ()>),
    span: Option<ChildSpan>,
) -> Result<(u16, Vec<u8>), GatewayError> {
    let backend = leg.pick.backend;
    let _in_flight = InFlightGuard::enter(
        &shard.shared.in_flight,
        shard.id,
        backend,
        leg.prompt_blocks,
    );
    let started = Instant::now();
    // Split requests are not counted in the pending prefill yet.
    let mut exchange = Exchange {
        first_byte_timeout: Some(timeout),
        ..Exchange::new(shard, backend, started)
    };
    let fetch = exchange.fetch(request, PREFILL_RESPONSE_LIMIT, leave);
    let fetched = monoio::time::timeout(timeout, fetch).await;
    let result = match fetched {
        Ok(r) => r.map(|body| (exchange.status, body)),
        Err(_) => Err(GatewayError::new(
            ErrorKind::UpstreamTimeout,
            format!(
                "prefill leg on backend `{}` took longer than {timeout:?}",
                shard.backend_id(backend)
            ),
        )),
    };
    if !matches!(&result, Err(e) if e.kind == ErrorKind::ClientClosed) {
        shard.report_outcome(backend, matches!(&result, Ok((s, _)) if *s < 500));
    }
    if let Some(mut span) = crate::trace::child(shard, SpanKind::PrefillLeg, span) {
        span.backend = Some(backend);
        (span.status, span.reason) = match &result {
            Ok((status, _)) => (*status, ""),
            Err(e) => (e.status(), e.code()),
        };
        crate::trace::emit(shard, span);
    }
    shard
        .metrics
        .borrow_mut()
        .disagg
        .prefill_leg
        .observe(started.elapsed());
    result
}

/// Runs the decode leg, streaming its answer to the client.
async fn decode_leg(
    shard: &Rc<Shard>,
    client: &mut Stream,
    req: &Request<'_>,
    route: &Decision,
    body: &[u8],
    split: &DisaggConfig,
    may_retry: bool,
) -> Split {
    let backend = route.pick.backend;
    let _probe = ProbeGuard::enter(shard, route);
    let _in_flight = InFlightGuard::enter(
        &shard.shared.in_flight,
        shard.id,
        backend,
        route.prompt_blocks,
    );
    let span = crate::trace::start_child(&TraceContext::of(req.head));
    let mut request = shard.take_buffer();
    write_upstream_head(
        shard,
        &mut request,
        req.head,
        body.len(),
        backend,
        req.request_id,
        crate::trace::id_of(span),
    );
    request.extend_from_slice(body);
    let leg_started = Instant::now();
    // TTFT and total time are the client's, from the request's start.
    let mut exchange = Exchange {
        retry_from_status: 400,
        first_byte_timeout: Some(split.decode_first_byte_timeout),
        ..Exchange::new(shard, backend, req.started)
    };
    let result = exchange
        .run(
            client,
            Attempt {
                request,
                body: None,
                route,
                client_keep_alive: req.head.keep_alive,
                request_id: req.request_id,
                may_retry,
            },
        )
        .await
        .map_err(Failure::cut_as_broken);
    {
        let mut m = shard.metrics.borrow_mut();
        if let Some(first) = exchange.first_byte {
            m.disagg
                .handoff
                .observe(first.saturating_duration_since(leg_started));
        }
        m.disagg.decode_leg.observe(leg_started.elapsed());
    }
    if let Some(mut span) = crate::trace::child(shard, SpanKind::DecodeLeg, span) {
        span.backend = Some(backend);
        (span.status, span.reason) = Failure::span_outcome(&result, exchange.status);
        crate::trace::emit(shard, span);
    }
    match result {
        Ok(keep_open) => {
            shard.report_outcome(backend, exchange.status < 500);
            exchange.record(&req.facts, route);
            log(shard, req, route, &exchange, 1);
            Split::Done(keep_open, exchange.usage.usage)
        }
        Err(Failure::Retryable(e)) => {
            // A refused hand-off (4xx) is not the decode engine's fault.
            if exchange.status == 0 || exchange.status >= 500 {
                shard.report_outcome(backend, false);
            }
            let refused = (400..500).contains(&exchange.status);
            exchange.status = e.status();
            exchange.record(&req.facts, route);
            Split::DecodeFailed { error: e, refused }
        }
        Err(Failure::StreamCut { .. }) => unreachable!("mapped by `cut_as_broken` above"),
        Err(Failure::AfterResponse {
            upstream_fault,
            keep_open,
        }) => {
            if upstream_fault {
                shard.report_outcome(backend, false);
                shard.metrics.borrow_mut().disagg.fail("decode");
            }
            exchange.record(&req.facts, route);
            log(shard, req, route, &exchange, 1);
            if exchange.status == CLIENT_CLOSED {
                Split::ClientLeft(exchange.usage.usage)
            } else {
                Split::Done(keep_open, exchange.usage.usage)
            }
        }
    }
}

/// The client left while a (vLLM) prefill leg ran: logged as 499 `client_closed`
/// against the prefill backend, with the pair's decode `route`'s headers, after
/// `tries` failed tries; nothing is written.
fn left_during_prefill(shard: &Shard, req: &Request<'_>, route: &Decision, tries: u32) {
    let prefill = route.prefill.unwrap_or(route.pick.backend);
    shard.metrics.borrow_mut().count_request(RequestKey {
        backend: Some(prefill),
        status: CLIENT_CLOSED,
        reason: route.pick.reason.as_str(),
        model: Some(req.facts.model),
    });
    log_answer(shard, req, route, (prefill, CLIENT_CLOSED), tries);
}

/// Passes a prefill leg's refusal (a 4xx: the request itself is bad) to the client,
/// with the headers of the pair's decode `route`, counted and logged against the
/// prefill backend (after `retries` failed tries).
async fn relay(
    shard: &Shard,
    client: &mut Stream,
    req: &Request<'_>,
    route: &Decision,
    (status, body): (u16, &[u8]),
    retries: u32,
) -> bool {
    let prefill = route.prefill.unwrap_or(route.pick.backend);
    shard.metrics.borrow_mut().count_request(RequestKey {
        backend: Some(prefill),
        status,
        reason: route.pick.reason.as_str(),
        model: Some(req.facts.model),
    });
    log_answer(shard, req, route, (prefill, status), retries);
    let mut out = Vec::with_capacity(256 + body.len());
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(itoa::Buffer::new().format(status).as_bytes());
    out.push(b' ');
    out.extend_from_slice(crate::error::reason_phrase(status).as_bytes());
    out.extend_from_slice(b"\r\ncontent-type: application/json\r\ncontent-length: ");
    out.extend_from_slice(itoa::Buffer::new().format(body.len()).as_bytes());
    out.extend_from_slice(b"\r\n");
    router_headers(shard, &mut out, route, req.request_id);
    if !req.head.keep_alive {
        out.extend_from_slice(b"Connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(body);
    let (r, _) = client.write_all(out).await;
    r.is_ok() && req.head.keep_alive
}
