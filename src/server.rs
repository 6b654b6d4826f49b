//! The client side of a shard: accept, read requests off keep-alive (and
//! pipelined) connections, answer the gateway's own endpoints, hand model requests
//! to the proxy, and turn every error into its response.
//!
//! A connection reads one request at a time and answers it before parsing the
//! next, so pipelined requests are answered in order. A bad request gets its error
//! response (and the connection is closed if its framing can no longer be trusted);
//! nothing a client sends can panic the shard or touch another connection.

use crate::access_log::AccessRecord;
use crate::error::{ErrorKind, GatewayError};
use crate::http::conn::{ClientConn, ReadOutcome, RequestLimits};
use crate::http::request::Method;
use crate::http::response::Utf8Vec;
use crate::metrics::{self, RequestKey};
use crate::openai::Endpoint;
use crate::proxy;
use crate::shard::Shard;
use crate::tls::Stream;
use monoio::io::AsyncWriteRentExt;
use monoio::net::{TcpListener, TcpStream};
use monoio::time::Instant;
use std::fmt::Write as _;
use std::rc::Rc;
use std::time::Duration;

pub async fn accept_loop(shard: Rc<Shard>, listener: &TcpListener) {
    loop {
        match listener.accept().await {
            Ok((stream, _peer)) => {
                let _ = stream.set_nodelay(true);
                // The shard's own fleet snapshot: the certificate in force now (a
                // reload swaps it for new handshakes only).
                let (max, tls) = {
                    let fleet = shard.fleet.borrow();
                    let server = &fleet.live.config.server;
                    let tls = server.tls.as_ref().map(|t| t.config.clone());
                    (server.max_connections, tls)
                };
                let refuse = shard.conns.len() >= max;
                match tls {
                    None if refuse => {
                        monoio::spawn(refuse_connection(shard.clone(), stream.into()));
                    }
                    None => {
                        monoio::spawn(serve_connection(shard.clone(), stream.into()));
                    }
                    Some(config) => {
                        monoio::spawn(serve_tls(shard.clone(), stream, config, refuse));
                    }
                }
            }
            Err(e) => {
                // EMFILE and friends: back off briefly instead of spinning.
                tracing::warn!(shard = shard.id, error = %e, "accept failed");
                monoio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

/// A connection to the HTTPS listener: the handshake (within `server.head_timeout_ms`),
/// then the connection served (or refused) as a plain one would be.
async fn serve_tls(
    shard: Rc<Shard>,
    stream: TcpStream,
    config: std::sync::Arc<rustls::ServerConfig>,
    refuse: bool,
) {
    let timeout = shard.fleet.borrow().live.config.server.head_timeout;
    let handshake = crate::tls::TlsStream::accept(stream, config);
    let tls = match monoio::time::timeout(timeout, handshake).await {
        Ok(Ok(tls)) => Stream::Tls(Box::new(tls)),
        Ok(Err(e)) => {
            tracing::debug!(shard = shard.id, error = %e, "TLS handshake failed");
            return;
        }
        Err(_) => {
            tracing::debug!(shard = shard.id, "TLS handshake timed out");
            return;
        }
    };
    if refuse {
        refuse_connection(shard, tls).await;
    } else {
        serve_connection(shard, tls).await;
    }
}

/// Over `server.max_connections` on this shard: 503 `overloaded` without reading the
/// request, then close.
async fn refuse_connection(shard: Rc<Shard>, mut stream: Stream) {
    let e = GatewayError::new(
        ErrorKind::Overloaded,
        "too many connections to this gateway shard; retry later",
    );
    let _ = monoio::time::timeout(
        Duration::from_secs(1),
        respond_error(
            &shard,
            &mut stream,
            &e,
            "",
            false,
            Some(b"Retry-After: 1\r\n"),
        ),
    )
    .await;
    // Half-close and drain briefly, so unread request bytes do not turn the close
    // into a reset that discards the answer before the client reads it.
    let _ = monoio::io::AsyncWriteRent::shutdown(&mut stream).await;
    let mut scratch = Vec::with_capacity(4096);
    let _ = monoio::time::timeout(Duration::from_millis(500), async {
        for _ in 0..16 {
            scratch.clear();
            match crate::http::io::read_append(&mut stream, &mut scratch, 4096).await {
                Ok(n) if n > 0 => {}
                _ => break,
            }
        }
    })
    .await;
}

/// The `[server]` limits in force (reloadable: each request reads them anew).
fn request_limits(shard: &Shard) -> RequestLimits {
    let fleet = shard.fleet.borrow();
    let server = &fleet.live.config.server;
    RequestLimits {
        max_head_bytes: server.max_head_bytes,
        max_uri_bytes: server.max_uri_bytes,
        max_body_bytes: server.max_body_bytes,
        idle_timeout: server.client_idle_timeout,
        park_after: Some(server.client_park_after),
        head_timeout: server.head_timeout,
        body_timeout: server.body_timeout,
    }
}

/// Serves one client connection for its life, in two states. Busy: requests are
/// read and answered with the connection's buffers, in a future of its own
/// ([`serve_requests`]), boxed so that its size (the whole request path's) is
/// allocated only while the connection is busy. Parked, after
/// `server.client_park_after_ms` without a request: the buffers are back in the
/// shard's pool, the busy future is freed, and the connection waits for readability
/// holding its socket and little else, until its idle timeout.
pub async fn serve_connection(shard: Rc<Shard>, stream: Stream) {
    let registered = shard.conns.register(stream.tcp());
    let mut stream = stream;
    loop {
        let (back, next) = Box::pin(serve_requests(&shard, stream)).await;
        stream = back;
        let Some(idle_deadline) = next else { break };
        match monoio::time::timeout_at(idle_deadline, stream.readable()).await {
            Ok(Ok(())) => {}
            _ => break,
        }
    }
    // Unregistered before the socket closes (see `OpenConnections::register`).
    drop(registered);
    drop(stream);
}

/// Reads and answers requests until the connection is done (`None`) or idle past
/// `park_after` (`Some` of its idle deadline); gives the socket back either way.
async fn serve_requests(shard: &Rc<Shard>, stream: Stream) -> (Stream, Option<Instant>) {
    let mut conn = ClientConn::new(stream, shard.take_buffer());
    let next = loop {
        let limits = request_limits(shard);
        match conn.read_request(&limits).await {
            Ok(ReadOutcome::Request) => {}
            Ok(ReadOutcome::Closed) => break None,
            Ok(ReadOutcome::Idle { deadline }) => break Some(deadline),
            Err(e) => {
                let _ = respond_error(shard, &mut conn.stream, &e, "", false, None).await;
                break None;
            }
        }
        // While draining, answer this request and close the connection after it.
        if shard.draining.get() {
            conn.head.keep_alive = false;
        }
        shard.active_requests.set(shard.active_requests.get() + 1);
        let keep_open = handle_request(shard, &mut conn).await;
        shard.active_requests.set(shard.active_requests.get() - 1);
        if !keep_open || !conn.head.keep_alive {
            break None;
        }
    };
    let (stream, buffer) = conn.into_parts();
    shard.give_buffer(buffer);
    (stream, next)
}

/// Graceful stop: no new connections (the caller dropped the listener), then wait
/// up to `timeout` for requests in flight, then close whatever is left open.
pub async fn drain(shard: &Shard, timeout: Duration) {
    shard.draining.set(true);
    let deadline = Instant::now() + timeout;
    while shard.active_requests.get() > 0 && Instant::now() < deadline {
        monoio::time::sleep(Duration::from_millis(5)).await;
    }
    if shard.active_requests.get() > 0 {
        tracing::warn!(
            shard = shard.id,
            requests = shard.active_requests.get(),
            "shutdown timeout: closing requests still in flight"
        );
    }
    shard.conns.shutdown_all();
}

/// Answers one parsed request. Returns whether the connection may stay open.
async fn handle_request(shard: &Rc<Shard>, conn: &mut ClientConn) -> bool {
    let started = Instant::now();
    let mut request_id = std::mem::take(&mut conn.head.request_id);
    if request_id.is_empty() {
        let n = shard.rng.borrow_mut().u128(..);
        push_hex_u128(&mut request_id, n);
    }
    crate::trace::begin(shard, &mut conn.head);
    let keep_alive = conn.head.keep_alive;
    let method = conn.head.method();
    let result = match (conn.head.route_path(), method) {
        ("/v1/chat/completions", Method::Post) => {
            forward(shard, conn, Endpoint::ChatCompletions, &request_id, started).await
        }
        ("/v1/completions", Method::Post) => {
            forward(shard, conn, Endpoint::Completions, &request_id, started).await
        }
        ("/v1/workflows", Method::Post) => {
            crate::workflow::serve(shard, &mut conn.stream, &conn.head, &conn.body, &request_id)
                .await
        }
        ("/v1/chat/completions" | "/v1/completions" | "/v1/workflows", _) => {
            Err(method_not_allowed("POST"))
        }
        ("/v1/models", Method::Get) => {
            local(
                shard,
                &mut conn.stream,
                200,
                models_json(shard),
                keep_alive,
                &request_id,
            )
            .await
        }
        ("/health", Method::Get) => {
            local(
                shard,
                &mut conn.stream,
                200,
                b"{\"status\":\"ok\"}".to_vec(),
                keep_alive,
                &request_id,
            )
            .await
        }
        ("/ready", Method::Get) => {
            let warm = shard
                .shared
                .cluster
                .as_ref()
                .is_none_or(|c| c.warm.load(std::sync::atomic::Ordering::Relaxed));
            let (status, body) = if !warm {
                (503, &b"{\"status\":\"warming\"}"[..])
            } else if shard.fleet.borrow().any_healthy() {
                (200, &b"{\"status\":\"ready\"}"[..])
            } else {
                (503, &b"{\"status\":\"no healthy backend\"}"[..])
            };
            local(
                shard,
                &mut conn.stream,
                status,
                body.to_vec(),
                keep_alive,
                &request_id,
            )
            .await
        }
        ("/metrics", Method::Get) => {
            let text = scrape(shard).await;
            let resp = plain_response(
                200,
                "text/plain; version=0.0.4",
                text.as_bytes(),
                keep_alive,
                &request_id,
            );
            write_local(shard, &mut conn.stream, resp, 200).await
        }
        ("/v1/models" | "/health" | "/ready" | "/metrics", _) => Err(method_not_allowed("GET")),
        _ => Err(GatewayError::new(
            ErrorKind::PathNotFound,
            format!("no such endpoint: {}", conn.head.route_path()),
        )),
    };
    let outcome = match result {
        Ok(keep) => keep,
        Err(e) => {
            let allow: &[u8] = match (e.kind, conn.head.route_path()) {
                (
                    ErrorKind::MethodNotAllowed,
                    "/v1/chat/completions" | "/v1/completions" | "/v1/workflows",
                ) => b"Allow: POST\r\n",
                (ErrorKind::MethodNotAllowed, _) => b"Allow: GET\r\n",
                _ => b"",
            };
            let record = AccessRecord::refused(
                shard.id,
                &request_id,
                conn.head.trace_id,
                None,
                &e,
                started.elapsed().as_micros() as u64,
            );
            crate::trace::finish_request(shard, &conn.head, started.into_std(), &record);
            shard.log_access(record);
            respond_error(
                shard,
                &mut conn.stream,
                &e,
                &request_id,
                keep_alive,
                Some(allow),
            )
            .await
            .is_ok()
        }
    };
    conn.head.request_id = request_id;
    outcome
}

/// Forwards a model request. The body buffer is lent to the proxy as an `Rc` for the
/// request's life, so that it goes upstream without a copy (`proxy::wire`), and then
/// comes back to the connection for the next request.
async fn forward(
    shard: &Rc<Shard>,
    conn: &mut ClientConn,
    endpoint: Endpoint,
    request_id: &str,
    started: Instant,
) -> Result<bool, GatewayError> {
    let body = Rc::new(std::mem::take(&mut conn.body));
    let result = proxy::forward(
        shard,
        &mut conn.stream,
        &conn.head,
        &body,
        endpoint,
        request_id,
        started,
    )
    .await;
    conn.body = Rc::try_unwrap(body).unwrap_or_default();
    result
}

fn method_not_allowed(allowed: &str) -> GatewayError {
    GatewayError::new(
        ErrorKind::MethodNotAllowed,
        format!("method not allowed here; use {allowed}"),
    )
}

async fn respond_error(
    shard: &Shard,
    stream: &mut Stream,
    e: &GatewayError,
    request_id: &str,
    keep_alive: bool,
    extra: Option<&[u8]>,
) -> std::io::Result<()> {
    let mut headers = Vec::with_capacity(96);
    headers.extend_from_slice(extra.unwrap_or(b""));
    if !request_id.is_empty() {
        let _ = write!(Utf8Vec(&mut headers), "X-Request-Id: {request_id}\r\n");
    }
    let resp = e.to_response(&headers, keep_alive);
    let (r, _) = stream.write_all(resp).await;
    let status = e.status();
    let mut m = shard.metrics.borrow_mut();
    m.count_request(RequestKey::gateway(status, e.code()));
    r.map(|_| ())
}

/// Appends `n` as 32 lowercase hex digits (what `{n:032x}` writes, without `core::fmt`).
fn push_hex_u128(out: &mut String, n: u128) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut digits = [0u8; 32];
    for (i, d) in digits.iter_mut().enumerate() {
        *d = HEX[((n >> (124 - 4 * i)) & 0xf) as usize];
    }
    // Every byte is an ASCII hex digit.
    out.push_str(std::str::from_utf8(&digits).unwrap_or_default());
}

fn plain_response(
    status: u16,
    content_type: &str,
    body: &[u8],
    keep_alive: bool,
    request_id: &str,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(160 + body.len());
    let _ = write!(
        Utf8Vec(&mut out),
        "HTTP/1.1 {status} {}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nX-Request-Id: {request_id}\r\n{}\r\n",
        crate::error::reason_phrase(status),
        body.len(),
        if keep_alive { "" } else { "Connection: close\r\n" },
    );
    out.extend_from_slice(body);
    out
}

async fn local(
    shard: &Shard,
    stream: &mut Stream,
    status: u16,
    body: Vec<u8>,
    keep_alive: bool,
    request_id: &str,
) -> Result<bool, GatewayError> {
    let resp = plain_response(status, "application/json", &body, keep_alive, request_id);
    write_local(shard, stream, resp, status).await
}

async fn write_local(
    shard: &Shard,
    stream: &mut Stream,
    resp: Vec<u8>,
    status: u16,
) -> Result<bool, GatewayError> {
    let (r, _) = stream.write_all(resp).await;
    shard
        .metrics
        .borrow_mut()
        .count_request(RequestKey::gateway(status, "local"));
    Ok(r.is_ok())
}

/// `GET /v1/models`: the union of the backends' models, in OpenAI's list shape, then
/// the LoRA adapters some backend serves, each with its base model as `parent` (and
/// the engine's `root`), as vLLM lists them.
fn models_json(shard: &Shard) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(b"{\"object\":\"list\",\"data\":[");
    let fleet = shard.fleet.borrow().clone();
    let table = &fleet.live.backends;
    let served = table
        .models()
        .names()
        .iter()
        .enumerate()
        .filter(|(m, _)| !table.serving(*m).is_empty());
    let mut first = true;
    for (_, name) in served {
        if !std::mem::take(&mut first) {
            out.push(b',');
        }
        out.extend_from_slice(b"{\"id\":");
        crate::error::write_json_string(&mut out, name);
        out.extend_from_slice(
            b",\"object\":\"model\",\"created\":0,\"owned_by\":\"radixgate\",\"parent\":null}",
        );
    }
    for (name, parent, root) in fleet.adapters.served() {
        if !std::mem::take(&mut first) {
            out.push(b',');
        }
        out.extend_from_slice(b"{\"id\":");
        crate::error::write_json_string(&mut out, name);
        out.extend_from_slice(
            b",\"object\":\"model\",\"created\":0,\"owned_by\":\"radixgate\",\"root\":",
        );
        crate::error::write_json_string(&mut out, root.unwrap_or(name));
        out.extend_from_slice(b",\"parent\":");
        crate::error::write_json_string(&mut out, table.models().name(parent));
        out.push(b'}');
    }
    out.extend_from_slice(b"]}");
    out
}

/// Collects every shard's metrics over their command channels and renders them.
async fn scrape(shard: &Shard) -> String {
    let shared = &shard.shared;
    let (rx, asked) = shared.ask_shards_for_metrics();
    let mut copies = Vec::with_capacity(asked);
    for _ in 0..asked {
        match monoio::time::timeout(Duration::from_secs(2), rx.recv_async()).await {
            Ok(Ok(m)) => copies.push(m),
            _ => break,
        }
    }
    copies.sort_by_key(|m| m.shard);
    let fleet = shard.fleet.borrow().clone();
    let tenants = fleet.live.tenants.names();
    let table = &fleet.live.backends;
    let backend_ids = table.ids();
    let live: Vec<bool> = (0..table.len()).map(|b| table.is_live(b)).collect();
    let in_flight: Vec<u32> = (0..table.len())
        .map(|b| shared.in_flight.local_total(b))
        .collect();
    let pending_prefill_tokens: Vec<u32> = (0..table.len())
        .map(|b| shared.pending_prefill.tokens(b))
        .collect();
    let peer_in_flight: Vec<u32> = (0..table.len())
        .map(|b| shared.in_flight.peers(b))
        .collect();
    let peer_pending_prefill_tokens: Vec<u32> = (0..table.len())
        .map(|b| {
            shared
                .cluster
                .as_ref()
                .map_or(0, |c| c.peer_pending_tokens(b))
        })
        .collect();
    let tenant_tiers = fleet.live.tenants.tiers();
    // Read before the sent counts (see `Coordinator::replicate`).
    let coordinator_received = shared
        .coordinator_received
        .load(std::sync::atomic::Ordering::Acquire);
    let replica_sent: Vec<u64> = (0..shared.shard_commands.len())
        .map(|k| shared.replica_sent.get(k))
        .collect();
    let kv_events: Vec<_> = shared
        .config
        .backends
        .iter()
        .zip(shared.kv_events.iter())
        .map(|(b, c)| b.kv_events.as_ref().map(|_| c))
        .collect();
    let capacity = shared.capacity.get();
    metrics::render(
        &copies,
        &metrics::Gauges {
            backend_ids: &backend_ids,
            live: &live,
            models: table.models().names(),
            in_flight: &in_flight,
            pending_prefill_tokens: &pending_prefill_tokens,
            replica_sent: &replica_sent,
            index_blocks: shared
                .index_blocks
                .load(std::sync::atomic::Ordering::Relaxed),
            tenants: &tenants,
            tenant_tiers: &tenant_tiers,
            anonymous_tier: fleet
                .live
                .config
                .admission
                .anonymous_tier
                .as_deref()
                .unwrap_or("anonymous"),
            coordinator_received,
            engine: &fleet.engine,
            breaker: &fleet.breaker,
            healthy: &fleet.healthy,
            kv_events: &kv_events,
            spans: shared.spans.is_some().then_some(&*shared.span_counters),
            cluster: shared.cluster.as_deref(),
            peer_in_flight: &peer_in_flight,
            peer_pending_prefill_tokens: &peer_pending_prefill_tokens,
            capacity: capacity.as_deref(),
            discovery: &shared.discovery.names,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_are_32_hex_digits() {
        for n in [
            0u128,
            1,
            0xabc,
            u128::MAX,
            0x0123_4567_89ab_cdef_fedc_ba98_7654_3210,
        ] {
            let mut s = String::new();
            push_hex_u128(&mut s, n);
            assert_eq!(s, format!("{n:032x}"));
        }
    }
}
