//! One upstream call the gateway makes on its own behalf (a workflow node), with the
//! response read whole instead of streamed to a client.
//!
//! It goes through the very steps a client request does — [`super::parse_prompt`],
//! [`super::route::route`] (prefix index, policy, index insert and replication), the
//! in-flight and probe guards, a pooled connection, the breaker report and the
//! metrics — so a node is placed cache-aware and counted like any request. It does
//! not fail over: a failed node is reported to the workflow, which fails its
//! descendants. A call whose client has left (its `leave` future resolves) ends at
//! once with `client_closed`, its upstream connection dropped; that is not the
//! backend's fault, so its breaker is not told.

use super::exchange::Exchange;
use super::route::{route, routing_facts, EndGuard, ProbeGuard};
use super::{parse_prompt, with_cache_salt, write_upstream_head_for, UpstreamHead};
use crate::error::{ErrorKind, GatewayError};
use crate::fleet::InFlightGuard;
use crate::observe::Usage;
use crate::openai::Endpoint;
use crate::shard::Shard;
use crate::trace::TraceContext;
use monoio::time::Instant;
use radixgate_orchestrator::Reason;
use std::rc::Rc;
use std::sync::Arc;

/// What one call did.
#[derive(Debug)]
pub struct Called {
    pub backend: usize,
    pub reason: Reason,
    /// Leading prompt blocks the backend held per the index, before the call.
    pub matched_blocks: u32,
    pub status: u16,
    /// The decoded response body.
    pub body: Vec<u8>,
    pub usage: Usage,
}

/// Where a failed call got to: the error, and the backend if one was picked.
#[derive(Debug)]
pub struct CallFailed {
    pub error: GatewayError,
    pub backend: Option<usize>,
}

/// A call the gateway makes on its own account (a workflow node).
pub struct Call<'a> {
    pub endpoint: Endpoint,
    /// A complete OpenAI request for `endpoint`.
    pub body: &'a [u8],
    pub request_id: &'a str,
    /// The most response bytes read.
    pub max_bytes: usize,
    /// Under tenant prefix isolation, the tenant's seed, which salts the hash chain
    /// and the engine's cache (`cache_salt`) as for the tenant's own requests.
    pub tenant_seed: Option<u64>,
    /// A session key, as `X-Session-ID` gives one, that keeps calls sharing it on one
    /// backend while that backend has room.
    pub group: Option<u64>,
    /// The client request's trace context and the span the upstream `traceparent`
    /// names as parent (the node's; 0 passes the client's through).
    pub trace: (TraceContext, u64),
}

/// Routes the call's body and runs it, reading the response (at most `max_bytes`)
/// whole, unless `leave` resolves first.
pub async fn call(
    shard: &Rc<Shard>,
    what: Call<'_>,
    leave: impl std::future::Future<Output = ()>,
) -> Result<Called, CallFailed> {
    let Call {
        endpoint,
        body,
        request_id,
        max_bytes,
        tenant_seed,
        group,
        trace,
    } = what;
    let failed = |error| CallFailed {
        error,
        backend: None,
    };
    let started = Instant::now();
    let (facts, _) =
        parse_prompt(shard, endpoint, body, tenant_seed.unwrap_or(0)).map_err(failed)?;
    let salted;
    let body = match tenant_seed {
        Some(seed) => {
            salted = with_cache_salt(body, seed);
            &salted[..]
        }
        None => body,
    };
    let blocks: Arc<[u64]> = (*shard.prompt_blocks()).into();
    let policy = shard.fleet.borrow().live.config.routing.policy;
    let route = route(
        shard,
        &routing_facts(&facts, policy, &blocks, group, &[], &[]),
    )
    .map_err(failed)?;
    shard
        .metrics
        .borrow_mut()
        .decision
        .observe(started.elapsed());
    let backend = route.pick.backend;
    let _probe = ProbeGuard::enter(shard, &route);
    let _ended = EndGuard::enter(shard, &route);
    let _in_flight = InFlightGuard::enter(
        &shard.shared.in_flight,
        shard.id,
        backend,
        route.prompt_blocks,
    );
    let path = match endpoint {
        Endpoint::ChatCompletions => "/v1/chat/completions",
        Endpoint::Completions => "/v1/completions",
    };
    let mut request = shard.take_buffer();
    write_upstream_head_for(
        shard,
        &mut request,
        &UpstreamHead {
            path,
            forward_headers: b"Content-Type: application/json\r\n",
            body_len: body.len(),
            backend,
            request_id,
        },
        (&trace.0, trace.1),
    );
    request.extend_from_slice(body);
    let mut exchange = Exchange {
        pending_prefill: Some(shard.shared.pending_prefill.enter(
            shard.id,
            backend,
            route.uncached_tokens,
            std::time::Instant::now(),
        )),
        ..Exchange::new(shard, backend, started)
    };
    match exchange.fetch(request, max_bytes, leave).await {
        Ok(body) => {
            shard.report_outcome(backend, exchange.status < 500);
            exchange.record(&facts, &route);
            Ok(Called {
                backend,
                reason: route.pick.reason,
                matched_blocks: route.matched_blocks,
                status: exchange.status,
                body,
                usage: exchange.usage.usage,
            })
        }
        Err(error) => {
            if exchange.status == 0 {
                // Nothing was cached upstream: forget the belief.
                super::route::roll_back(shard, &route);
            }
            if error.kind != ErrorKind::ClientClosed {
                shard.report_outcome(backend, false);
            }
            exchange.status = error.status();
            exchange.record(&facts, &route);
            Err(CallFailed {
                error,
                backend: Some(backend),
            })
        }
    }
}
