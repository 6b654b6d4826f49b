//! The upstream side of a model request: route it, try it, and fail over before the
//! client has seen a byte.
//!
//! [`forward`] parses the body, asks [`route::route`] for a backend and runs an
//! [`exchange::Exchange`] against it. If the attempt fails before anything reached the
//! client (connect error, reset, timeout before the first byte, a 5xx), it rolls back
//! the attempt's index belief, reports the failure to the breaker, and re-routes to
//! the policy's next-best candidate, bounded by `retry.max_attempts` and the shard's
//! retry budget. The request body goes upstream exactly as the client sent it.

pub mod abandon;
mod admit;
pub mod call;
mod disagg;
mod exchange;
mod migrate;
mod route;
mod wire;

use crate::access_log::{AccessRecord, InlineId};
use crate::backends::LiveConfig;
use crate::config::Hashing;
use crate::error::{ErrorKind, GatewayError, CLIENT_CLOSED};
use crate::fleet::InFlightGuard;
use crate::http::request::RequestHead;
use crate::http::response::Utf8Vec;
use crate::observe::Usage;
use crate::openai::{Endpoint, RequestFacts};
use crate::otlp::SpanKind;
use crate::shard::Shard;
use crate::tenants::{QuotaGrant, Tenant, Throttle};
use crate::tls::Stream;
use crate::trace::TraceContext;
use exchange::{router_headers, Attempt, Exchange, Failure};
use monoio::io::AsyncWriteRentExt;
use monoio::time::Instant;
use radixgate_orchestrator::Decision;
use radixgate_orchestrator::PolicyName;
use route::{policy_for, route_at, routing_facts, EndGuard, ProbeGuard};
use std::fmt::Write as _;
use std::rc::Rc;
use std::sync::Arc;
use xxhash_rust::xxh3::xxh3_64;

/// Attempts per request are capped here whatever the config says.
const MAX_ATTEMPTS: usize = 8;

/// What every attempt of one request shares.
struct Request<'a> {
    head: &'a RequestHead,
    request_id: &'a str,
    endpoint: Endpoint,
    facts: RequestFacts,
    policy: PolicyName,
    tenant: Option<usize>,
    started: Instant,
    /// The prompt's blocks, copied off the shard's scratch when the request had to
    /// wait in the edge queue (other requests reuse the scratch meanwhile).
    blocks: Option<Arc<[u64]>>,
    /// A RAG request's distinct chunk ids (empty otherwise).
    chunks: &'a [u64],
    /// Replaces the policy's reason (a split model's request served whole).
    reason: Option<radixgate_orchestrator::Reason>,
}

/// Forwards one model request, in steps: [`authenticate`], [`read_prompt`], the TTFT
/// budget, [`charge_quota`] (the tenant's quotas), [`admit_ttft`] (the budget,
/// shedding, the edge queue), [`salt_for_tenant`], then route and fail over ([`attempt_all`],
/// or [`disagg::forward`] for a split model), and [`reconcile_quota`] with the
/// engine's usage. `Err` means nothing was written to the client yet (the caller
/// renders the error); `Ok(keep_open)` means a response went out.
pub async fn forward(
    shard: &Rc<Shard>,
    client: &mut Stream,
    head: &RequestHead,
    client_body: &Rc<Vec<u8>>,
    endpoint: Endpoint,
    request_id: &str,
    started: Instant,
) -> Result<bool, GatewayError> {
    // The live settings and tenants as of this snapshot, for the whole request.
    let live = shard.fleet.borrow().live.clone();
    let tenant = authenticate(shard, &live, head)?;
    let prompt = read_prompt(shard, &live, endpoint, client_body, tenant)?;
    let policy = policy_for(shard, head)?;
    let tier = match tenant {
        Some(t) => live.tenants.get(t).admission,
        None => live.config.admission.anonymous,
    };
    let budget = admit::budget(head, &tier)?;
    let refused = Refused {
        head,
        request_id,
        tenant,
        started,
    };
    let grant = match charge_quota(shard, &live, tenant, &prompt) {
        Ok(grant) => grant,
        Err((t, throttle)) => return answer_throttle(shard, client, &refused, t, throttle).await,
    };
    let gate = admit::Admission {
        shard,
        tenant,
        facts: &prompt.facts,
        tier,
        budget,
        started,
    };
    let blocks = match admit_ttft(&gate).await {
        Ok(blocks) => blocks,
        Err((refusal, e)) => {
            if let Some(grant) = &grant {
                grant.refund(shard.shared.now_ms());
            }
            let mut extra = Vec::with_capacity(64);
            let _ = write!(
                Utf8Vec(&mut extra),
                "Retry-After: {}\r\n",
                refusal.retry_after_secs()
            );
            return answer_refusal(shard, client, &refused, &e, extra).await;
        }
    };
    let upstream_body = salt_for_tenant(shard, &live, tenant, &prompt.body);
    let request = Request {
        head,
        request_id,
        endpoint,
        facts: prompt.facts,
        policy,
        tenant,
        started,
        blocks,
        chunks: &prompt.chunks,
        reason: None,
    };
    let split = live.split(request.facts.model).cloned();
    let (keep_open, usage) = match split {
        Some(split) => disagg::forward(shard, client, &request, &upstream_body, &split).await?,
        None => attempt_all(shard, client, &request, &upstream_body).await?,
    };
    reconcile_quota(shard, grant.as_ref(), &usage);
    Ok(keep_open)
}

/// A request's prompt, read: the body to send (a RAG request's normalised body, or
/// the client's), its RAG chunk ids, what routing needs of it, and its size in
/// tokens. The prompt's blocks are in the shard's scratch.
struct Prompt {
    body: Rc<Vec<u8>>,
    chunks: Vec<u64>,
    facts: RequestFacts,
    tokens: u64,
}

/// Parses the body once and hashes its prompt (salted per tenant under prefix
/// isolation). A RAG request (a chat body with the member `routing.rag_field`,
/// noticed by the one parse) becomes a plain chat body first (crate::rag), which is
/// parsed in turn.
fn read_prompt(
    shard: &Shard,
    live: &LiveConfig,
    endpoint: Endpoint,
    client_body: &Rc<Vec<u8>>,
    tenant: Option<usize>,
) -> Result<Prompt, GatewayError> {
    let isolated = shard.shared.config.tenant_prefix_isolation;
    let seed_mix = match (isolated, tenant) {
        (true, Some(t)) => live.tenants.get(t).seed,
        _ => 0,
    };
    let rag_field = &*live.config.routing.rag_field;
    let stop_at = (endpoint == Endpoint::ChatCompletions).then_some(rag_field);
    let parsed = parse_prompt_unless_member(shard, endpoint, client_body, seed_mix, stop_at)?;
    let (body, chunks, (facts, tokens)) = match parsed {
        Some(parsed) => (client_body.clone(), Vec::new(), parsed),
        None => match crate::rag::normalise(client_body, rag_field)? {
            Some(n) => {
                let parsed = parse_prompt(shard, endpoint, &n.body, seed_mix)?;
                (Rc::new(n.body), n.chunk_ids, parsed)
            }
            None => {
                let parsed = parse_prompt(shard, endpoint, client_body, seed_mix)?;
                (client_body.clone(), Vec::new(), parsed)
            }
        },
    };
    if isolated && tenant.is_some() && facts.has_cache_salt {
        return Err(GatewayError::invalid_param(
            "cache_salt",
            "`cache_salt` is set by the gateway under tenant prefix isolation",
        ));
    }
    Ok(Prompt {
        body,
        chunks,
        facts,
        tokens,
    })
}

/// Charges the tenant's quotas up front (the prompt's tokens, its media and the
/// completion it may ask for); `Err` is the tenant and the limit it hit.
fn charge_quota<'l>(
    shard: &Shard,
    live: &'l LiveConfig,
    tenant: Option<usize>,
    prompt: &Prompt,
) -> Result<Option<QuotaGrant<'l>>, (&'l Tenant, Throttle)> {
    let Some(t) = tenant.map(|t| &**live.tenants.get(t)) else {
        return Ok(None);
    };
    let facts = &prompt.facts;
    let estimate = prompt.tokens
        + u64::from(facts.media.tokens())
        + facts.max_tokens.unwrap_or(DEFAULT_COMPLETION_ESTIMATE);
    t.admit(estimate, shard.shared.now_ms())
        .map(Some)
        .map_err(|throttle| (t, throttle))
}

/// TTFT admission (see [`admit`]): `Ok(blocks)` admitted, with the prompt's blocks
/// copied off the shard's scratch when it had to wait in the edge queue; `Err`
/// refused. Counted either way.
async fn admit_ttft(
    gate: &admit::Admission<'_>,
) -> Result<Option<Arc<[u64]>>, (admit::Refusal, GatewayError)> {
    if !gate.applies() {
        return Ok(None);
    }
    let shard = gate.shard;
    let first = gate.first(&shard.prompt_blocks());
    let (outcome, blocks) = match first {
        Ok(None) => (Ok(admit::Admitted::Direct), None),
        Ok(Some(deadline)) => {
            let copy: Arc<[u64]> = (*shard.prompt_blocks()).into();
            let r = gate.wait(&copy, deadline).await;
            (r.map(|()| admit::Admitted::AfterQueue), Some(copy))
        }
        Err(refusal) => (Err(refusal), None),
    };
    match outcome {
        Ok(how) => {
            let how = match how {
                admit::Admitted::AfterQueue => "after_queue",
                admit::Admitted::Direct => "direct",
            };
            count_admission(shard, gate.tenant, "admitted", how);
            Ok(blocks)
        }
        Err((refusal, e)) => {
            count_admission(shard, gate.tenant, "shed", refusal.as_str());
            Err((refusal, e))
        }
    }
}

/// Under tenant prefix isolation, the engine's cache is salted per tenant too (vLLM
/// `cache_salt`); otherwise the body goes as it is.
fn salt_for_tenant(
    shard: &Shard,
    live: &LiveConfig,
    tenant: Option<usize>,
    body: &Rc<Vec<u8>>,
) -> Rc<Vec<u8>> {
    match (shard.shared.config.tenant_prefix_isolation, tenant) {
        (true, Some(t)) => Rc::new(with_cache_salt(body, live.tenants.get(t).seed)),
        _ => body.clone(),
    }
}

/// Reconciles the tokens charged up front with what the engine reported.
fn reconcile_quota(shard: &Shard, grant: Option<&QuotaGrant<'_>>, usage: &Usage) {
    if let (Some(g), Some(prompt), Some(completion)) =
        (grant, usage.prompt_tokens, usage.completion_tokens)
    {
        if let Some(bucket) = &g.tenant.tokens {
            let actual = (prompt + completion) as i64;
            bucket.adjust(g.charged_tokens as i64 - actual, shard.shared.now_ms());
        }
    }
}

/// Parses the body and hashes its prompt into the shard's scratch (byte blocks, or
/// token blocks in token mode: [`Shard::prompt_blocks`]); returns the facts and the
/// prompt's size in tokens (estimated in bytes mode).
pub(crate) fn parse_prompt(
    shard: &Shard,
    endpoint: Endpoint,
    body: &[u8],
    seed_mix: u64,
) -> Result<(RequestFacts, u64), GatewayError> {
    let parsed = parse_prompt_unless_member(shard, endpoint, body, seed_mix, None)?;
    Ok(parsed.expect("no member to stop at"))
}

/// [`parse_prompt`], or `Ok(None)` for a body whose top-level object has the member
/// `stop_at` (nothing hashed: [`crate::openai::BodyParser::parse_unless_member`]).
fn parse_prompt_unless_member(
    shard: &Shard,
    endpoint: Endpoint,
    body: &[u8],
    seed_mix: u64,
    stop_at: Option<&str>,
) -> Result<Option<(RequestFacts, u64)>, GatewayError> {
    let shared = &shard.shared;
    let mut parser = shard.parser.borrow_mut();
    let mut hasher = shard.hasher.borrow_mut();
    let fleet = shard.fleet.borrow();
    let models = crate::adapters::WithAdapters {
        models: fleet.live.backends.models(),
        adapters: &fleet.adapters,
    };
    let parsed =
        parser.parse_unless_member(endpoint, body, &models, &mut hasher, seed_mix, stop_at)?;
    let Some(mut facts) = parsed else {
        return Ok(None);
    };
    match &shard.tokens {
        // Token mode: the token-id blocks replace the byte blocks (and the
        // affinity key); the prompt's size is known exactly.
        Some(tokens) => {
            let mut tokens = tokens.borrow_mut();
            let hashed = match &shared.config.routing.hashing {
                Hashing::Tokens {
                    template: Some(template),
                    ..
                } => tokens.hash_precise(&hasher, template, body),
                _ => tokens.hash(&hasher).map_err(|e| e.to_string()),
            };
            if let Err(e) = hashed {
                tracing::debug!(error = %e, "tokenizing the prompt failed; routing by load");
            }
            facts.affinity_key = tokens.affinity_key();
            // The media's block, counted in token blocks (an estimate from its bytes).
            let routing = &shared.config.routing;
            let before_media =
                f64::from(facts.media.first_block) * hasher.block_bytes().get() as f64;
            facts.media.first_block =
                (before_media / routing.bytes_per_token / routing.prefix_aware.tokens_per_block)
                    as u32;
            Ok(Some((facts, tokens.tokens() as u64)))
        }
        None => {
            let bytes = hasher.bytes_fed() as f64;
            Ok(Some((
                facts,
                (bytes / shared.config.routing.bytes_per_token) as u64,
            )))
        }
    }
}

/// Output tokens charged up front when a request gives no `max_tokens`.
pub(crate) const DEFAULT_COMPLETION_ESTIMATE: u64 = 256;

/// The tenant of the request's API key. `Ok(None)`: anonymous (allowed only when
/// `auth.required` is off and no key was sent).
pub(crate) fn authenticate(
    shard: &Shard,
    live: &LiveConfig,
    head: &RequestHead,
) -> Result<Option<usize>, GatewayError> {
    let unauthorized = |message: &str| {
        shard.metrics.borrow_mut().auth_failures += 1;
        GatewayError::new(ErrorKind::Unauthorized, message)
    };
    if head.authorization.is_empty() {
        return if live.config.auth_required {
            Err(unauthorized(
                "You didn't provide an API key. Send `Authorization: Bearer <key>`.",
            ))
        } else {
            Ok(None)
        };
    }
    let key = crate::http::request::bearer(head.authorization.as_bytes())
        .ok_or_else(|| unauthorized("Malformed Authorization header; expected `Bearer <key>`."))?;
    match live.tenants.lookup(key) {
        Some(t) => Ok(Some(t)),
        None if live.tenants.is_empty() && !live.config.auth_required => Ok(None),
        None => Err(unauthorized("Incorrect API key provided.")),
    }
}

/// A request the gateway answers itself before routing it (a quota's 429, an
/// admission refusal): what the answer, the access log and the trace need of it.
pub(crate) struct Refused<'a> {
    pub head: &'a RequestHead,
    pub request_id: &'a str,
    pub tenant: Option<usize>,
    pub started: Instant,
}

/// 429 with `Retry-After` and the tenant's `X-RateLimit-*` headers.
pub(crate) async fn answer_throttle(
    shard: &Shard,
    client: &mut Stream,
    refused: &Refused<'_>,
    tenant: &crate::tenants::Tenant,
    throttle: Throttle,
) -> Result<bool, GatewayError> {
    let tenant_idx = refused.tenant;
    let now = shard.shared.now_ms();
    let limit = throttle.as_str();
    *shard
        .metrics
        .borrow_mut()
        .throttled
        .entry((tenant_idx.unwrap_or(usize::MAX), limit))
        .or_insert(0) += 1;
    let e = GatewayError::new(
        ErrorKind::RateLimited,
        format!(
            "Rate limit reached for tenant `{}` on {limit}; retry after {} s.",
            tenant.name,
            throttle.retry_after_secs()
        ),
    );
    let mut extra = Vec::with_capacity(256);
    let _ = write!(
        Utf8Vec(&mut extra),
        "Retry-After: {}\r\n",
        throttle.retry_after_secs()
    );
    tenant.rate_limit_headers(now, &mut extra);
    answer_refusal(shard, client, refused, &e, extra).await
}

/// Counts one admission decision for the metrics.
pub(super) fn count_admission(
    shard: &Shard,
    tenant: Option<usize>,
    decision: &'static str,
    reason: &'static str,
) {
    *shard
        .metrics
        .borrow_mut()
        .admission
        .entry((tenant.unwrap_or(usize::MAX), decision, reason))
        .or_insert(0) += 1;
}

/// Answers a request the gateway refused before routing (quota, admission), with
/// `extra` header lines; logs and counts it.
async fn answer_refusal(
    shard: &Shard,
    client: &mut Stream,
    refused: &Refused<'_>,
    e: &GatewayError,
    mut extra: Vec<u8>,
) -> Result<bool, GatewayError> {
    let &Refused {
        head,
        request_id,
        tenant,
        started,
    } = refused;
    let _ = write!(Utf8Vec(&mut extra), "X-Request-Id: {request_id}\r\n");
    let total_us = started.elapsed().as_micros() as u64;
    let record = AccessRecord::refused(shard.id, request_id, head.trace_id, tenant, e, total_us);
    crate::trace::finish_request(shard, head, started.into_std(), &record);
    shard.log_access(record);
    shard
        .metrics
        .borrow_mut()
        .count_request(crate::metrics::RequestKey::gateway(e.status(), e.code()));
    let (r, _) = client
        .write_all(e.to_response(&extra, head.keep_alive))
        .await;
    Ok(r.is_ok() && head.keep_alive)
}

/// `body` (a JSON object) with `"cache_salt":"<hex>"` as its first member.
fn with_cache_salt(body: &[u8], salt: u64) -> Vec<u8> {
    let open = body.iter().position(|b| *b == b'{').unwrap_or(0);
    let empty = body[open + 1..]
        .iter()
        .find(|b| !b.is_ascii_whitespace())
        .is_some_and(|b| *b == b'}');
    let mut out = Vec::with_capacity(body.len() + 48);
    out.extend_from_slice(&body[..=open]);
    let _ = write!(Utf8Vec(&mut out), "\"cache_salt\":\"{salt:016x}\"");
    if !empty {
        out.push(b',');
    }
    out.extend_from_slice(&body[open + 1..]);
    out
}

/// Routes and tries the request, failing over before the first byte: on a connect
/// error, reset, timeout before the first byte, or a 5xx it rolls back the attempt's
/// index belief, reports the failure to the breaker, and re-routes to the policy's
/// next-best candidate, within `retry.max_attempts` and the retry budget. Returns
/// whether the connection stays open, and the final attempt's usage.
async fn attempt_all(
    shard: &Rc<Shard>,
    client: &mut Stream,
    req: &Request<'_>,
    body: &Rc<Vec<u8>>,
) -> Result<(bool, Usage), GatewayError> {
    let shared = &shard.shared;
    let (head, request_id, facts, policy) = (req.head, req.request_id, &req.facts, req.policy);
    let started = req.started;
    let session = (!head.session_id.is_empty()).then(|| xxh3_64(head.session_id.as_bytes()));
    let (max_attempts, migrate_streams, first_token_timeout) = {
        let retry = &shard.fleet.borrow().live.config.retry;
        let max_attempts = (retry.max_attempts.get() as usize).min(MAX_ATTEMPTS);
        let migrate = retry.migrate_streams && retry.max_stream_migrations > 0 && facts.stream;
        let first_token = retry
            .first_token_timeout
            .filter(|_| facts.stream)
            .map(|timeout| (timeout, retry.first_token_timeout_factor));
        (max_attempts, migrate, first_token)
    };
    // The stream's text is watched when it may be continued elsewhere.
    let watch_stream = migrate_streams || first_token_timeout.is_some();
    let mut excluded = [usize::MAX; MAX_ATTEMPTS];
    // One clock reading for the retry budget's deposit and the first route; a retry
    // reads the clock again.
    let now = std::time::Instant::now();
    shard.retry_budget.borrow_mut().deposit(shared.ms_at(now));
    let mut clock = Some(now);
    let mut attempt = 0;
    // The failure that led to the current retry, answered if no backend is left.
    let mut previous: Option<(GatewayError, Decision)> = None;
    // The prompt's blocks once the shard's scratch can no longer be trusted (after
    // an await, another request on this shard may have reused it).
    let mut carried = req.blocks.clone();
    // A stream is moved for a late first token at most once.
    let mut moved = false;
    loop {
        attempt += 1;
        let excluded_now = &excluded[..attempt - 1];
        let route_span = crate::trace::start_child(&TraceContext::of(head));
        let now = clock.take().unwrap_or_else(std::time::Instant::now);
        let routed = match &carried {
            Some(b) => route_at(
                shard,
                &routing_facts(facts, policy, b, session, req.chunks, excluded_now),
                now,
            ),
            None => route_at(
                shard,
                &routing_facts(
                    facts,
                    policy,
                    &shard.prompt_blocks(),
                    session,
                    req.chunks,
                    excluded_now,
                ),
                now,
            ),
        };
        let mut route = match routed {
            Ok(r) => r,
            Err(e) => match previous {
                Some((error, route)) => {
                    let keep =
                        answer_error(shard, client, &error, &route, head.keep_alive, request_id)
                            .await?;
                    return Ok((keep, Usage::default()));
                }
                None => return Err(e),
            },
        };
        if let Some(reason) = req.reason {
            route.pick.reason = reason;
        }
        // One clock reading for the decision's latency and the attempt's entry into
        // the backend's pending prefill.
        let decided = Instant::now();
        if attempt == 1 {
            shard
                .metrics
                .borrow_mut()
                .decision
                .observe(decided.saturating_duration_since(started));
        }
        let backend = route.pick.backend;
        if let Some(mut span) = crate::trace::child(shard, SpanKind::Route, route_span) {
            span.backend = Some(backend);
            span.reason = route.pick.reason.as_str();
            span.policy = policy.as_str();
            span.attempt = attempt as u32;
            span.matched_blocks = route.matched_blocks;
            crate::trace::emit(shard, span);
        }
        let probe = ProbeGuard::enter(shard, &route);
        let ended = EndGuard::enter(shard, &route);
        let in_flight =
            InFlightGuard::enter(&shared.in_flight, shard.id, backend, route.prompt_blocks);
        let retry_possible = attempt < max_attempts && route.alternatives > 0;
        // A retry routes the same prompt: keep its blocks before the attempt's awaits
        // let other requests reuse the shard's scratch (routing copied them only if it
        // inserted them).
        if (retry_possible || watch_stream) && carried.is_none() {
            carried = Some(match &route.inserted {
                Some(b) => b.clone(),
                None => (*shard.prompt_blocks()).into(),
            });
        }
        let may_retry = retry_possible
            && shard
                .retry_budget
                .borrow_mut()
                .can_retry(shared.ms_at(decided.into_std()));

        let attempt_span = crate::trace::start_child(&TraceContext::of(head));
        let mut request = shard.take_buffer();
        write_upstream_head(
            shard,
            &mut request,
            head,
            body.len(),
            backend,
            request_id,
            crate::trace::id_of(attempt_span),
        );
        // Moving a stalled stream needs somewhere to move it, and pays only where
        // another backend promises a first token sooner.
        let first_token = first_token_timeout.filter(|_| retry_possible && !moved);
        let mut skipped = excluded;
        skipped[attempt - 1] = backend;
        let late = first_token.map(|(_, factor)| migrate::LateStream {
            facts: routing_facts(
                facts,
                policy,
                carried.as_deref().expect("kept for a watched stream"),
                session,
                req.chunks,
                &skipped[..attempt],
            ),
            factor: factor.max(1.0),
        });
        let mut exchange = Exchange {
            pending_prefill: Some(shared.pending_prefill.enter(
                shard.id,
                backend,
                route.uncached_tokens,
                decided.into_std(),
            )),
            collect: watch_stream.then(|| Box::new(migrate::StreamText::new(req.endpoint))),
            migrate_cut: migrate_streams,
            first_token_deadline: first_token.map(|(timeout, factor)| {
                started + first_token_wait(timeout, factor, route.est_ttft_ns)
            }),
            late: late.as_ref(),
            ..Exchange::new(shard, backend, started)
        };
        let result = exchange
            .run(
                client,
                Attempt {
                    request,
                    body: Some(body),
                    route: &route,
                    client_keep_alive: head.keep_alive,
                    request_id,
                    may_retry,
                },
            )
            .await;
        if let Some(mut span) = crate::trace::child(shard, SpanKind::Attempt, attempt_span) {
            span.backend = Some(backend);
            span.attempt = attempt as u32;
            (span.status, span.reason) = Failure::span_outcome(&result, exchange.status);
            crate::trace::emit(shard, span);
        }
        match result {
            Ok(keep_open) => {
                log(shard, req, &route, &exchange, attempt);
                let failed = exchange.status >= 500;
                if failed && retry_possible && !may_retry {
                    shard.metrics.borrow_mut().retry_budget_exhausted += 1;
                }
                shard.report_outcome(backend, !failed);
                exchange.record(facts, &route);
                return Ok((keep_open, exchange.usage.usage));
            }
            Err(Failure::Retryable(e)) if exchange.stalled => {
                // Not even a head by the first-token deadline: moved, once, outside
                // the retry budget.
                forget_stalled(shard, &route);
                exchange.status = e.status();
                exchange.record(facts, &route);
                excluded[attempt - 1] = backend;
                moved = true;
                tracing::debug!(backend = %shard.backend_id(backend), "no token by the first-token deadline; moving the stream");
                previous = Some((e, route));
                continue;
            }
            Err(Failure::Retryable(e)) => {
                route::roll_back(shard, &route);
                shard.report_outcome(backend, false);
                exchange.status = e.status();
                exchange.record(facts, &route);
                if may_retry && shard.retry_budget.borrow_mut().withdraw(shared.now_ms()) {
                    shard.metrics.borrow_mut().retries[backend] += 1;
                    excluded[attempt - 1] = backend;
                    tracing::debug!(backend = %shard.backend_id(backend), error = %e, "retrying on another backend");
                    previous = Some((e, route));
                    continue;
                }
                if retry_possible {
                    shard.metrics.borrow_mut().retry_budget_exhausted += 1;
                }
                log(shard, req, &route, &exchange, attempt);
                let keep =
                    answer_error(shard, client, &e, &route, head.keep_alive, request_id).await?;
                return Ok((keep, Usage::default()));
            }
            Err(Failure::AfterResponse {
                upstream_fault,
                keep_open,
            }) => {
                if upstream_fault {
                    shard.report_outcome(backend, false);
                }
                exchange.record(facts, &route);
                log(shard, req, &route, &exchange, attempt);
                return Ok((keep_open, exchange.usage.usage));
            }
            Err(Failure::StreamCut {
                keep_client,
                stalled,
            }) => {
                // The cut backend holds nothing of this request any more.
                drop((probe, ended, in_flight));
                if stalled {
                    forget_stalled(shard, &route);
                } else {
                    shard.report_outcome(backend, false);
                }
                exchange.record(facts, &route);
                let mut excluded = excluded[..attempt - 1].to_vec();
                excluded.push(backend);
                let cut = migrate::Cut {
                    text: *exchange.collect.take().expect("a cut stream was watched"),
                    failed: backend,
                    excluded,
                    blocks: carried.clone().expect("kept for a migration"),
                    session,
                    keep_client,
                    attempts: attempt,
                    stalled,
                };
                // Boxed: the rare continuation's state stays out of every request's
                // future.
                let resumed = Box::pin(migrate::resume(shard, client, req, body, cut)).await;
                log(shard, req, &route, &exchange, attempt);
                return Ok(resumed);
            }
        }
    }
}

/// Sends the request's access record to the log thread.
fn log(
    shard: &Shard,
    req: &Request<'_>,
    route: &Decision,
    exchange: &Exchange<'_>,
    attempt: usize,
) {
    if shard.shared.access_log.is_none() && req.head.span_id == 0 {
        return;
    }
    let usage = exchange.usage.usage;
    let record = AccessRecord {
        cached_tokens: usage.cached_tokens,
        prompt_tokens: usage.prompt_tokens,
        status: exchange.status,
        outcome: exchange.outcome(),
        ttft_us: exchange
            .first_byte
            .map(|f| f.saturating_duration_since(exchange.started).as_micros() as u64),
        total_us: exchange.started.elapsed().as_micros() as u64,
        retries: attempt as u32 - 1,
        ..routed_record(shard, req, route)
    };
    crate::trace::finish_request(shard, req.head, req.started.into_std(), &record);
    shard.log_access(record);
}

/// Sends the access record of a routed request the gateway answered itself with
/// `status` (a split request's failed or refused leg on `backend`, or 499 when its
/// client left during a leg) after `retries` failed tries, and ends its request span.
fn log_answer(
    shard: &Shard,
    req: &Request<'_>,
    route: &Decision,
    (backend, status): (usize, u16),
    retries: u32,
) {
    if shard.shared.access_log.is_none() && req.head.span_id == 0 {
        return;
    }
    let record = AccessRecord {
        backend: Some(backend),
        status,
        outcome: if status == CLIENT_CLOSED {
            "client_closed"
        } else {
            "refused"
        },
        retries,
        ..routed_record(shard, req, route)
    };
    crate::trace::finish_request(shard, req.head, req.started.into_std(), &record);
    shard.log_access(record);
}

/// A routed request's access record, without an answer yet.
fn routed_record(shard: &Shard, req: &Request<'_>, route: &Decision) -> AccessRecord {
    AccessRecord {
        shard: shard.id,
        request_id: InlineId::new(req.request_id),
        trace_id: req.head.trace_id,
        tenant: req.tenant,
        model: Some(req.facts.model),
        policy: req.policy.as_str(),
        backend: Some(route.pick.backend),
        reason: route.pick.reason.as_str(),
        matched_blocks: route.matched_blocks,
        cached_tokens: None,
        prompt_tokens: None,
        status: 0,
        outcome: "completed",
        ttft_us: None,
        total_us: req.started.elapsed().as_micros() as u64,
        retries: 0,
    }
}

/// Answers a failed attempt's error, with the router headers of that attempt.
async fn answer_error(
    shard: &Shard,
    client: &mut Stream,
    error: &GatewayError,
    route: &Decision,
    keep_alive: bool,
    request_id: &str,
) -> Result<bool, GatewayError> {
    let mut extra = Vec::with_capacity(128);
    router_headers(shard, &mut extra, route, request_id);
    let resp = error.to_response(&extra, keep_alive);
    let (r, _) = client.write_all(resp).await;
    Ok(r.is_ok() && keep_alive)
}

/// What an upstream request head says, for `backend`: the request line's path, the
/// forwarded header lines (complete lines), the body's length and the request id.
struct UpstreamHead<'a> {
    path: &'a str,
    forward_headers: &'a [u8],
    body_len: usize,
    backend: usize,
    request_id: &'a str,
}

/// The upstream request head for a client's request: its path and forwarded
/// headers, the `traceparent` naming `span` (the attempt's or leg's) as the parent
/// (0: the client's own span, passed through; nothing when the request is not
/// traced), and the blank line.
fn write_upstream_head(
    shard: &Shard,
    out: &mut Vec<u8>,
    head: &RequestHead,
    body_len: usize,
    backend: usize,
    request_id: &str,
    span: u64,
) {
    let upstream = UpstreamHead {
        path: &head.path,
        forward_headers: &head.forward_headers,
        body_len,
        backend,
        request_id,
    };
    write_upstream_head_for(shard, out, &upstream, (&TraceContext::of(head), span));
}

/// The upstream request head `upstream`, with the `traceparent` of the client
/// request's context `cx` naming `span` as parent, and the blank line.
fn write_upstream_head_for(
    shard: &Shard,
    out: &mut Vec<u8>,
    upstream: &UpstreamHead<'_>,
    (cx, span): (&TraceContext, u64),
) {
    write_head_lines(shard, out, upstream);
    crate::trace::write_traceparent(out, cx, span);
    out.extend_from_slice(b"\r\n");
}

/// The request line and header lines, without the blank line that ends the head.
fn write_head_lines(shard: &Shard, out: &mut Vec<u8>, upstream: &UpstreamHead<'_>) {
    let &UpstreamHead {
        path,
        forward_headers,
        body_len,
        backend,
        request_id,
    } = upstream;
    let fleet = shard.fleet.borrow();
    let b = fleet.live.backends.config(backend);
    out.extend_from_slice(b"POST ");
    out.extend_from_slice(path.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\nHost: ");
    out.extend_from_slice(b.host.as_bytes());
    out.extend_from_slice(b"\r\nContent-Length: ");
    out.extend_from_slice(itoa::Buffer::new().format(body_len).as_bytes());
    out.extend_from_slice(b"\r\nX-Request-Id: ");
    out.extend_from_slice(request_id.as_bytes());
    out.extend_from_slice(b"\r\n");
    if let Some(auth) = &b.upstream_auth {
        out.extend_from_slice(auth.as_bytes());
    }
    out.extend_from_slice(forward_headers);
}

/// A stream leaves the backend that sent it no token by its first-token deadline:
/// the index forgets the prompt there (it computed nothing the gateway knows of, as
/// after a failed attempt) and the move is counted. Late, not broken: the breaker is
/// not told.
fn forget_stalled(shard: &Shard, route: &Decision) {
    route::roll_back(shard, route);
    shard.metrics.borrow_mut().first_token_timeouts[route.pick.backend] += 1;
}

/// How long a stream may go without a token before it is moved
/// (`retry.first_token_timeout_ms`): the timeout, or `factor` times the decision's
/// estimated TTFT when that is longer, so a request expected to wait behind a queue
/// is not moved for waiting as expected.
fn first_token_wait(
    timeout: std::time::Duration,
    factor: f64,
    est_ttft_ns: u64,
) -> std::time::Duration {
    let scaled = factor * est_ttft_ns as f64;
    // `as` saturates; an hour is longer than any stream is worth waiting for.
    let scaled = std::time::Duration::from_nanos(scaled.min(3.6e12) as u64);
    timeout.max(scaled)
}

#[cfg(test)]
mod first_token_tests {
    use super::first_token_wait;
    use std::time::Duration;

    #[test]
    fn the_deadline_scales_with_the_estimate_above_the_timeout() {
        let timeout = Duration::from_millis(1500);
        // Off, or a short estimate: the timeout.
        assert_eq!(first_token_wait(timeout, 0.0, 9_000_000_000), timeout);
        assert_eq!(first_token_wait(timeout, 3.0, 300_000_000), timeout);
        // A request expected to wait 2 s behind a queue may take 6.
        assert_eq!(
            first_token_wait(timeout, 3.0, 2_000_000_000),
            Duration::from_secs(6)
        );
        // An unbounded estimate waits an hour at most.
        assert_eq!(
            first_token_wait(timeout, 3.0, u64::MAX),
            Duration::from_secs(3600)
        );
    }
}
