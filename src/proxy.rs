//! The upstream side of a model request: pick a backend, send the request over a
//! pooled keep-alive connection, and stream the response back as it arrives.
//!
//! The request body goes upstream exactly as the client sent it (de-chunked, with a
//! Content-Length). The response body is passed through byte for byte, including its
//! chunk framing: the shard only tracks where it ends, notes the first body byte
//! (TTFT) and lets the [`UsageScanner`] watch for the final `usage`. A connection
//! goes back to the pool only when its response was read to the end.

use crate::error::{ErrorKind, GatewayError};
use crate::fleet::InFlightGuard;
use crate::http::chunked::ChunkedDecoder;
use crate::http::io::read_append;
use crate::http::request::RequestHead;
use crate::http::response::{parse_response_head, ResponseHead};
use crate::http::BodyFraming;
use crate::metrics::RequestKey;
use crate::observe::UsageScanner;
use crate::openai::{Endpoint, RequestFacts};
use crate::replica::{IndexEvent, IndexOp};
use crate::server::Utf8Vec;
use crate::shard::Shard;
use monoio::io::AsyncWriteRentExt;
use monoio::net::TcpStream;
use monoio::time::Instant;
use radixgate_orchestrator::{Candidate, Pick, PolicyName, RouteInput, RoutingPolicy};
use std::fmt::Write as _;
use std::rc::Rc;
use std::sync::Arc;
use xxhash_rust::xxh3::xxh3_64;

/// Prefill cost is learned only from responses with at least this many uncached
/// prompt tokens (shorter ones are dominated by fixed overheads).
const MIN_LEARN_TOKENS: u64 = 64;

/// Exponentially weighted moving average with weight 1/5 on the new sample.
fn ewma(old: u32, sample: u32) -> u32 {
    ((old as u64 * 4 + sample as u64) / 5) as u32
}

/// Bodies up to this size are sent in the same write as the request head.
const COALESCE_BODY: usize = 64 << 10;

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
    let route = route(shard, &facts, policy, session)?;
    shard
        .metrics
        .borrow_mut()
        .decision
        .observe(started.elapsed());
    let pick = route.pick;
    let _in_flight = InFlightGuard::enter(&shared.in_flight, shard.id, pick.backend);

    let mut request = shard.take_buffer();
    write_upstream_head(
        shard,
        &mut request,
        head,
        body.len(),
        pick.backend,
        request_id,
    );
    let split_body = body.len() > COALESCE_BODY;
    if !split_body {
        request.extend_from_slice(body);
    }
    let mut exchange = Exchange {
        shard,
        backend: pick.backend,
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
        )
        .await;
    let keep_open = match result {
        Ok(keep) => keep,
        Err(Failure::BeforeResponse(e)) => {
            exchange.status = e.status();
            route.roll_back(shard);
            let mut extra = Vec::with_capacity(128);
            router_headers(shard, &mut extra, &route, request_id);
            let resp = e.to_response(&extra, head.keep_alive);
            let (r, _) = client.write_all(resp).await;
            r.is_ok() && head.keep_alive
        }
        Err(Failure::AfterResponse) => false,
    };
    exchange.record(&facts, &route);
    Ok(keep_open)
}

fn policy_for(shard: &Shard, head: &RequestHead) -> Result<PolicyName, GatewayError> {
    let routing = &shard.shared.config.routing;
    if routing.allow_policy_header && !head.policy_override.is_empty() {
        return head
            .policy_override
            .parse()
            .map_err(|e: radixgate_orchestrator::UnknownPolicy| {
                GatewayError::invalid_param("X-Router-Policy", e.to_string())
            });
    }
    Ok(routing.policy)
}

/// A routing decision and the index belief recorded for it.
struct Route {
    pick: Pick,
    /// Leading prompt blocks the chosen backend held, per this shard's replica.
    matched_blocks: u32,
    /// In-flight requests on the chosen backend before this one.
    in_flight_before: u32,
    /// The prompt's blocks, recorded in the index as now held by the pick.
    blocks: Option<Arc<[u64]>>,
}

impl Route {
    /// The attempt failed before the engine could cache anything: forget the blocks
    /// the pick did not already hold, here and (via the coordinator) everywhere.
    fn roll_back(&self, shard: &Shard) {
        let Some(blocks) = &self.blocks else { return };
        let from = self.matched_blocks as usize;
        if from >= blocks.len() {
            return;
        }
        shard
            .index
            .borrow_mut()
            .remove(self.pick.backend, blocks, from);
        publish(
            shard,
            IndexOp::Remove {
                backend: self.pick.backend,
                blocks: blocks.clone(),
                from,
            },
        );
    }
}

fn publish(shard: &Shard, op: IndexOp) {
    shard.metrics.borrow_mut().index_events_published += 1;
    let _ = shard.shared.index_events.send(IndexEvent {
        origin_shard: shard.id,
        created: std::time::Instant::now(),
        op,
    });
}

/// Looks the prompt up in this shard's index replica, asks the policy, and records
/// the belief that the pick now holds the prompt (applied here at once, replicated
/// through the coordinator).
fn route(
    shard: &Shard,
    facts: &RequestFacts,
    policy: PolicyName,
    session: Option<u64>,
) -> Result<Route, GatewayError> {
    let shared = &shard.shared;
    let now_ms = shared.now_ms();
    let hasher = shard.hasher.borrow();
    let blocks = hasher.blocks();
    let mut matches = shard.matches.borrow_mut();
    shard.index.borrow().match_prefix(blocks, &mut matches);
    let session_home = session.and_then(|s| shard.sessions.borrow().get(s, now_ms));
    let fleet = shard.fleet.borrow();
    let prefill_ns = shard.prefill_ns.borrow();
    let mut candidates = shard.candidates.borrow_mut();
    candidates.clear();
    for &b in &shared.model_backends[facts.model] {
        if fleet.healthy[b] {
            candidates.push(Candidate {
                backend: b,
                in_flight: shared.in_flight.total(b),
                matched_blocks: matches.matched.get(b).copied().unwrap_or(0),
                engine_waiting: fleet.engine_waiting(b),
                prefill_ns_per_token: prefill_ns[b],
                session_home: session_home == Some(b),
            });
        }
    }
    let no_backend = || {
        GatewayError::new(
            ErrorKind::NoHealthyBackend,
            format!(
                "no healthy backend serves model `{}`",
                shared.models.name(facts.model)
            ),
        )
    };
    if candidates.is_empty() {
        return Err(no_backend());
    }
    let input = RouteInput {
        candidates: &candidates,
        affinity_key: facts.affinity_key,
        prompt_blocks: blocks.len() as u32,
    };
    let pick = shard
        .policies
        .borrow_mut()
        .get(policy, &shared.policy_config)
        .pick(&input, &mut shard.rng.borrow_mut())
        .ok_or_else(no_backend)?;
    let chosen = candidates
        .iter()
        .find(|c| c.backend == pick.backend)
        .copied()
        .unwrap_or_default();
    let recorded = (!blocks.is_empty()).then(|| {
        shard
            .index
            .borrow_mut()
            .insert(pick.backend, blocks, now_ms);
        let blocks: Arc<[u64]> = blocks.into();
        publish(
            shard,
            IndexOp::Insert {
                backend: pick.backend,
                blocks: blocks.clone(),
                now_ms,
            },
        );
        blocks
    });
    if let Some(session) = session {
        shard
            .sessions
            .borrow_mut()
            .bind(session, pick.backend, now_ms);
        publish(
            shard,
            IndexOp::BindSession {
                session,
                backend: pick.backend,
                now_ms,
            },
        );
    }
    Ok(Route {
        pick,
        matched_blocks: chosen.matched_blocks,
        in_flight_before: chosen.in_flight,
        blocks: recorded,
    })
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

fn router_headers(shard: &Shard, out: &mut Vec<u8>, route: &Route, request_id: &str) {
    let _ = write!(
        Utf8Vec(out),
        "X-Router-Backend: {}\r\nX-Router-Reason: {}\r\nX-Router-Match-Blocks: {}\r\nX-Request-Id: {}\r\n",
        shard.shared.backend_ids[route.pick.backend],
        route.pick.reason.as_str(),
        route.matched_blocks,
        request_id
    );
}

enum Failure {
    /// Nothing reached the client: answer with this error.
    BeforeResponse(GatewayError),
    /// The response was under way (or the client left): close the connection.
    AfterResponse,
}

/// Tracks where an upstream response body ends.
enum BodyTracker {
    Remaining(u64),
    Chunked(ChunkedDecoder),
    UntilClose,
}

impl BodyTracker {
    fn new(framing: BodyFraming) -> Self {
        match framing {
            BodyFraming::Empty => BodyTracker::Remaining(0),
            BodyFraming::Length(n) => BodyTracker::Remaining(n),
            BodyFraming::Chunked => BodyTracker::Chunked(ChunkedDecoder::new()),
            BodyFraming::UntilClose => BodyTracker::UntilClose,
        }
    }

    fn done(&self) -> bool {
        match self {
            BodyTracker::Remaining(n) => *n == 0,
            BodyTracker::Chunked(d) => d.is_done(),
            BodyTracker::UntilClose => false,
        }
    }

    /// How many bytes of `data` belong to the body; payload goes to `usage`.
    fn advance(&mut self, data: &[u8], usage: &mut UsageScanner) -> Result<usize, ()> {
        match self {
            BodyTracker::Remaining(n) => {
                let used = (*n).min(data.len() as u64) as usize;
                usage.feed(&data[..used]);
                *n -= used as u64;
                Ok(used)
            }
            BodyTracker::Chunked(d) => d.feed(data, |p| usage.feed(p)).map_err(|_| ()),
            BodyTracker::UntilClose => {
                usage.feed(data);
                Ok(data.len())
            }
        }
    }
}

struct Exchange<'s> {
    shard: &'s Rc<Shard>,
    backend: usize,
    started: Instant,
    first_byte: Option<Instant>,
    usage: UsageScanner,
    status: u16,
}

impl Exchange<'_> {
    async fn run(
        &mut self,
        client: &mut TcpStream,
        request: Vec<u8>,
        separate_body: Option<&[u8]>,
        route: &Route,
        client_keep_alive: bool,
        request_id: &str,
    ) -> Result<bool, Failure> {
        let shard = self.shard;
        let upstream_cfg = &shard.shared.config.upstream;
        let (mut upstream, mut buf, head_len, resp) = self
            .send(request, separate_body)
            .await
            .map_err(Failure::BeforeResponse)?;
        self.status = resp.status;

        // Response head to the client, with the first body bytes if they came along.
        let mut tracker = BodyTracker::new(resp.framing());
        let keep_client = client_keep_alive && resp.framing() != BodyFraming::UntilClose;
        let mut out = shard.take_buffer();
        let _ = write!(
            Utf8Vec(&mut out),
            "HTTP/1.1 {} {}\r\n",
            resp.status,
            resp.reason
        );
        out.extend_from_slice(&resp.forward_headers);
        router_headers(shard, &mut out, route, request_id);
        if !keep_client {
            out.extend_from_slice(b"Connection: close\r\n");
        }
        out.extend_from_slice(b"\r\n");
        let leftover = &buf[head_len..];
        let used = tracker
            .advance(leftover, &mut self.usage)
            .map_err(|_| Failure::AfterResponse)?;
        let mut reusable = used == leftover.len();
        if used > 0 || tracker.done() {
            self.first_byte = Some(Instant::now());
        }
        out.extend_from_slice(&leftover[..used]);
        let (r, out) = client.write_all(out).await;
        shard.give_buffer(out);
        if r.is_err() {
            shard.give_buffer(buf);
            return Err(Failure::AfterResponse);
        }

        // The rest of the body, piece by piece as it arrives.
        while !tracker.done() {
            buf.clear();
            let read = monoio::time::timeout(
                upstream_cfg.idle_timeout,
                read_append(&mut upstream, &mut buf, 16 << 10),
            )
            .await;
            let n = match read {
                Ok(Ok(n)) => n,
                _ => return Err(Failure::AfterResponse),
            };
            if n == 0 {
                if matches!(tracker, BodyTracker::UntilClose) {
                    shard.give_buffer(buf);
                    return Ok(false);
                }
                return Err(Failure::AfterResponse);
            }
            if self.first_byte.is_none() {
                self.first_byte = Some(Instant::now());
            }
            let used = tracker
                .advance(&buf, &mut self.usage)
                .map_err(|_| Failure::AfterResponse)?;
            if used < buf.len() {
                // Bytes after the end of the response: the upstream broke framing.
                reusable = false;
                buf.truncate(used);
            }
            let (r, b) = client.write_all(buf).await;
            buf = b;
            if r.is_err() {
                return Err(Failure::AfterResponse);
            }
        }
        shard.give_buffer(buf);
        if reusable && resp.keep_alive {
            shard.pool.borrow_mut().put(self.backend, upstream);
        }
        Ok(keep_client)
    }

    /// Sends the request and reads the response head. A pooled connection that
    /// turns out to be dead before answering anything is replaced by a fresh one.
    async fn send(
        &mut self,
        mut request: Vec<u8>,
        separate_body: Option<&[u8]>,
    ) -> Result<(TcpStream, Vec<u8>, usize, ResponseHead), GatewayError> {
        let shard = self.shard;
        let cfg = &shard.shared.config;
        let backend = &cfg.backends[self.backend];
        let deadline = Instant::now() + cfg.upstream.first_byte_timeout;
        let mut buf = shard.take_buffer();
        let mut resp = ResponseHead::default();
        loop {
            let pooled = shard.pool.borrow_mut().take(self.backend);
            let reused = pooled.is_some();
            let mut stream = match pooled {
                Some(s) => s,
                None => connect(backend.addr, &backend.id, cfg.upstream.connect_timeout).await?,
            };
            let (r, req) = stream.write_all(request).await;
            request = req;
            let mut sent = r.is_ok();
            if let (true, Some(body)) = (sent, separate_body) {
                let (r, _) = stream.write_all(body.to_vec()).await;
                sent = r.is_ok();
            }
            if !sent {
                if reused {
                    continue;
                }
                return Err(GatewayError::new(
                    ErrorKind::UpstreamRefused,
                    format!("could not send the request to backend `{}`", backend.id),
                ));
            }
            buf.clear();
            loop {
                let remaining = deadline.saturating_duration_since(Instant::now());
                let read =
                    monoio::time::timeout(remaining, read_append(&mut stream, &mut buf, 16 << 10))
                        .await;
                match read {
                    Err(_) => {
                        return Err(GatewayError::new(
                            ErrorKind::UpstreamTimeout,
                            format!(
                                "backend `{}` sent no response within {:?}",
                                backend.id, cfg.upstream.first_byte_timeout
                            ),
                        ))
                    }
                    Ok(Ok(0)) | Ok(Err(_)) if buf.is_empty() && reused => break,
                    Ok(Ok(0)) | Ok(Err(_)) => {
                        return Err(GatewayError::new(
                            ErrorKind::UpstreamProtocol,
                            format!(
                                "backend `{}` closed the connection before answering",
                                backend.id
                            ),
                        ))
                    }
                    Ok(Ok(_)) => {}
                }
                match parse_response_head(&buf, &mut resp, false) {
                    Ok(Some(n)) if (100..200).contains(&resp.status) && resp.status != 101 => {
                        buf.drain(..n);
                    }
                    Ok(Some(n)) => {
                        shard.give_buffer(request);
                        return Ok((stream, buf, n, resp));
                    }
                    Ok(None) if buf.len() > 64 << 10 => {
                        return Err(GatewayError::new(
                            ErrorKind::UpstreamProtocol,
                            "upstream response head too large",
                        ))
                    }
                    Ok(None) => {}
                    Err(e) => return Err(GatewayError::new(ErrorKind::UpstreamProtocol, e.0)),
                }
            }
            // A reused connection died before answering: retry once on a fresh one.
        }
    }

    /// Metrics, and the closed loop: the index's prediction against the engine's
    /// reported cached tokens, and the backend's prefill cost learned from TTFT.
    fn record(&self, facts: &RequestFacts, route: &Route) {
        let shard = self.shard;
        let backend = route.pick.backend;
        let mut m = shard.metrics.borrow_mut();
        m.count_request(RequestKey {
            backend: Some(backend),
            status: self.status,
            reason: route.pick.reason.as_str(),
        });
        let now = Instant::now();
        let ttft = self
            .first_byte
            .map(|f| f.saturating_duration_since(self.started));
        if let Some(ttft) = ttft {
            m.ttft[facts.model].observe(ttft);
        }
        m.total[facts.model].observe(now.saturating_duration_since(self.started));
        let u = self.usage.usage;
        m.prompt_tokens += u.prompt_tokens.unwrap_or(0);
        m.cached_tokens += u.cached_tokens.unwrap_or(0);
        m.completion_tokens += u.completion_tokens.unwrap_or(0);
        m.matched_blocks[backend] += route.matched_blocks as u64;
        let Some(reported) = u.cached_tokens else {
            return;
        };
        let tokens_per_block = shard.shared.config.routing.prefix_aware.tokens_per_block;
        let mut predicted = (route.matched_blocks as f64 * tokens_per_block) as u64;
        if let Some(prompt) = u.prompt_tokens {
            predicted = predicted.min(prompt);
        }
        m.predicted_cached[backend] += predicted;
        m.reported_cached[backend] += reported;
        m.prediction_abs_error[backend] += predicted.abs_diff(reported);
        drop(m);
        // Learn prefill cost only from requests that did not queue behind others.
        if let (Some(ttft), Some(prompt), 0) = (ttft, u.prompt_tokens, route.in_flight_before) {
            let uncached = prompt.saturating_sub(reported);
            if uncached >= MIN_LEARN_TOKENS && self.status == 200 {
                let sample = (ttft.as_nanos() as u64 / uncached).min(u32::MAX as u64) as u32;
                let mut learned = shard.prefill_ns.borrow_mut();
                let old = learned[backend];
                learned[backend] = if old == 0 { sample } else { ewma(old, sample) };
            }
        }
    }
}

async fn connect(
    addr: std::net::SocketAddr,
    id: &str,
    timeout: std::time::Duration,
) -> Result<TcpStream, GatewayError> {
    match monoio::time::timeout(timeout, TcpStream::connect_addr(addr)).await {
        Ok(Ok(s)) => {
            let _ = s.set_nodelay(true);
            Ok(s)
        }
        Ok(Err(e)) => Err(GatewayError::new(
            ErrorKind::UpstreamRefused,
            format!("backend `{id}` is unreachable: {e}"),
        )),
        Err(_) => Err(GatewayError::new(
            ErrorKind::UpstreamTimeout,
            format!("connecting to backend `{id}` timed out after {timeout:?}"),
        )),
    }
}
