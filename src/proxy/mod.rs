//! The upstream side of a model request: route it, try it, and fail over before the
//! client has seen a byte.
//!
//! [`forward`] parses the body, asks [`route::route`] for a backend and runs an
//! [`exchange::Exchange`] against it. If the attempt fails before anything reached the
//! client (connect error, reset, timeout before the first byte, a 5xx), it rolls back
//! the attempt's index belief, reports the failure to the breaker, and re-routes to
//! the policy's next-best candidate, bounded by `retry.max_attempts` and the shard's
//! retry budget. The request body goes upstream exactly as the client sent it.

mod exchange;
mod route;

use crate::access_log::{AccessRecord, InlineId};
use crate::error::GatewayError;
use crate::fleet::InFlightGuard;
use crate::http::request::RequestHead;
use crate::observe::UsageScanner;
use crate::openai::{Endpoint, RequestFacts};
use crate::server::Utf8Vec;
use crate::shard::Shard;
use exchange::{router_headers, Exchange, Failure};
use monoio::io::AsyncWriteRentExt;
use monoio::net::TcpStream;
use monoio::time::Instant;
use radixgate_orchestrator::PolicyName;
use route::{policy_for, route, ProbeGuard};
use std::fmt::Write as _;
use std::rc::Rc;
use xxhash_rust::xxh3::xxh3_64;

/// Bodies up to this size are sent in the same write as the request head.
const COALESCE_BODY: usize = 64 << 10;

/// Attempts per request are capped here whatever the config says.
const MAX_ATTEMPTS: usize = 8;

/// Forwards one model request. `Err` means nothing was written to the client yet
/// (the caller renders the error); `Ok(keep_open)` means a response went out.
pub async fn forward(
    shard: &Rc<Shard>,
    client: &mut TcpStream,
    head: &RequestHead,
    body: &[u8],
    endpoint: Endpoint,
    request_id: &str,
    started: Instant,
) -> Result<bool, GatewayError> {
    let shared = &shard.shared;
    let facts = {
        let mut parser = shard.parser.borrow_mut();
        let mut hasher = shard.hasher.borrow_mut();
        parser.parse(endpoint, body, &shared.models, &mut hasher)?
    };
    let policy = policy_for(shard, head)?;
    let session = (!head.session_id.is_empty()).then(|| xxh3_64(head.session_id.as_bytes()));
    let max_attempts = (shared.config.retry.max_attempts.get() as usize).min(MAX_ATTEMPTS);
    let mut excluded = [usize::MAX; MAX_ATTEMPTS];
    shard.retry_budget.borrow_mut().deposit(shared.now_ms());
    let mut attempt = 0;
    // The failure that led to the current retry, answered if no backend is left.
    let mut previous: Option<(GatewayError, route::Route)> = None;
    loop {
        attempt += 1;
        let route = match route(shard, &facts, policy, session, &excluded[..attempt - 1]) {
            Ok(r) => r,
            Err(e) => match previous {
                Some((error, route)) => {
                    return answer_error(shard, client, &error, &route, head.keep_alive, request_id)
                        .await
                }
                None => return Err(e),
            },
        };
        if attempt == 1 {
            shard
                .metrics
                .borrow_mut()
                .decision
                .observe(started.elapsed());
        }
        let backend = route.pick.backend;
        let _probe = ProbeGuard::enter(shard, &route);
        let _in_flight = InFlightGuard::enter(&shared.in_flight, shard.id, backend);
        let retry_possible = attempt < max_attempts && route.alternatives > 0;
        let may_retry =
            retry_possible && shard.retry_budget.borrow_mut().can_retry(shared.now_ms());

        let mut request = shard.take_buffer();
        write_upstream_head(shard, &mut request, head, body.len(), backend, request_id);
        let split_body = body.len() > COALESCE_BODY;
        if !split_body {
            request.extend_from_slice(body);
        }
        let mut exchange = Exchange {
            shard,
            backend,
            started,
            first_byte: None,
            usage: UsageScanner::default(),
            status: 0,
        };
        let result = exchange
            .run(
                client,
                request,
                split_body.then_some(body),
                &route,
                head.keep_alive,
                request_id,
                may_retry,
            )
            .await;
        match result {
            Ok(keep_open) => {
                log(
                    shard, head, request_id, &facts, policy, &route, &exchange, attempt,
                );
                let failed = exchange.status >= 500;
                if failed && retry_possible && !may_retry {
                    shard.metrics.borrow_mut().retry_budget_exhausted += 1;
                }
                shard.report_outcome(backend, !failed);
                exchange.record(&facts, &route);
                return Ok(keep_open);
            }
            Err(Failure::Retryable(e)) => {
                route.roll_back(shard);
                shard.report_outcome(backend, false);
                exchange.status = e.status();
                exchange.record(&facts, &route);
                if may_retry && shard.retry_budget.borrow_mut().withdraw(shared.now_ms()) {
                    shard.metrics.borrow_mut().retries[backend] += 1;
                    excluded[attempt - 1] = backend;
                    tracing::debug!(backend = %shared.backend_ids[backend], error = %e, "retrying on another backend");
                    previous = Some((e, route));
                    continue;
                }
                if retry_possible {
                    shard.metrics.borrow_mut().retry_budget_exhausted += 1;
                }
                log(
                    shard, head, request_id, &facts, policy, &route, &exchange, attempt,
                );
                return answer_error(shard, client, &e, &route, head.keep_alive, request_id).await;
            }
            Err(Failure::AfterResponse {
                upstream_fault,
                keep_open,
            }) => {
                if upstream_fault {
                    shard.report_outcome(backend, false);
                }
                exchange.record(&facts, &route);
                log(
                    shard, head, request_id, &facts, policy, &route, &exchange, attempt,
                );
                return Ok(keep_open);
            }
        }
    }
}

/// Sends the request's access record to the log thread.
#[allow(clippy::too_many_arguments)]
fn log(
    shard: &Shard,
    head: &RequestHead,
    request_id: &str,
    facts: &RequestFacts,
    policy: PolicyName,
    route: &route::Route,
    exchange: &Exchange<'_>,
    attempt: usize,
) {
    if shard.shared.access_log.is_none() {
        return;
    }
    let usage = exchange.usage.usage;
    shard.log_access(AccessRecord {
        shard: shard.id,
        request_id: InlineId::new(request_id),
        trace_id: head.trace_id,
        model: Some(facts.model),
        policy: policy.as_str(),
        backend: Some(route.pick.backend),
        reason: route.pick.reason.as_str(),
        matched_blocks: route.matched_blocks,
        cached_tokens: usage.cached_tokens,
        prompt_tokens: usage.prompt_tokens,
        status: exchange.status,
        ttft_us: exchange
            .first_byte
            .map(|f| f.saturating_duration_since(exchange.started).as_micros() as u64),
        total_us: exchange.started.elapsed().as_micros() as u64,
        retries: attempt as u32 - 1,
    });
}

/// Answers a failed attempt's error, with the router headers of that attempt.
async fn answer_error(
    shard: &Shard,
    client: &mut TcpStream,
    error: &GatewayError,
    route: &route::Route,
    keep_alive: bool,
    request_id: &str,
) -> Result<bool, GatewayError> {
    let mut extra = Vec::with_capacity(128);
    router_headers(shard, &mut extra, route, request_id);
    let resp = error.to_response(&extra, keep_alive);
    let (r, _) = client.write_all(resp).await;
    Ok(r.is_ok() && keep_alive)
}

fn write_upstream_head(
    shard: &Shard,
    out: &mut Vec<u8>,
    head: &RequestHead,
    body_len: usize,
    backend: usize,
    request_id: &str,
) {
    let b = &shard.shared.config.backends[backend];
    let _ = write!(
        Utf8Vec(out),
        "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Length: {}\r\nX-Request-Id: {}\r\n",
        head.path,
        b.host,
        body_len,
        request_id
    );
    out.extend_from_slice(&head.forward_headers);
    out.extend_from_slice(b"\r\n");
}
