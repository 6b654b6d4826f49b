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
use crate::server::Utf8Vec;
use crate::shard::Shard;
use monoio::io::AsyncWriteRentExt;
use monoio::net::TcpStream;
use monoio::time::Instant;
use radixgate_orchestrator::{Pick, PolicyName, RouteInput, RoutingPolicy};
use std::fmt::Write as _;
use std::rc::Rc;

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
    let pick = pick_backend(shard, &facts, policy)?;
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
            &pick,
            head.keep_alive,
            request_id,
        )
        .await;
    let keep_open = match result {
        Ok(keep) => keep,
        Err(Failure::BeforeResponse(e)) => {
            exchange.status = e.status();
            let mut extra = Vec::with_capacity(128);
            router_headers(shard, &mut extra, &pick, request_id);
            let resp = e.to_response(&extra, head.keep_alive);
            let (r, _) = client.write_all(resp).await;
            r.is_ok() && head.keep_alive
        }
        Err(Failure::AfterResponse) => false,
    };
    exchange.record(&facts, &pick);
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

fn pick_backend(
    shard: &Shard,
    facts: &RequestFacts,
    policy: PolicyName,
) -> Result<Pick, GatewayError> {
    let shared = &shard.shared;
    let fleet = shard.fleet.borrow();
    let mut candidates = shard.candidates.borrow_mut();
    candidates.clear();
    for &b in &shared.model_backends[facts.model] {
        if fleet.healthy[b] {
            candidates.push(radixgate_orchestrator::Candidate {
                backend: b,
                in_flight: shared.in_flight.total(b),
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
    let mut policies = shard.policies.borrow_mut();
    let input = RouteInput {
        candidates: &candidates,
        affinity_key: facts.affinity_key,
    };
    policies
        .get(policy, &shared.policy_config)
        .pick(&input, &mut shard.rng.borrow_mut())
        .ok_or_else(no_backend)
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

fn router_headers(shard: &Shard, out: &mut Vec<u8>, pick: &Pick, request_id: &str) {
    let _ = write!(
        Utf8Vec(out),
        "X-Router-Backend: {}\r\nX-Router-Reason: {}\r\nX-Request-Id: {}\r\n",
        shard.shared.backend_ids[pick.backend],
        pick.reason.as_str(),
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
        pick: &Pick,
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
        router_headers(shard, &mut out, pick, request_id);
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

    fn record(&self, facts: &RequestFacts, pick: &Pick) {
        let mut m = self.shard.metrics.borrow_mut();
        m.count_request(RequestKey {
            backend: Some(pick.backend),
            status: self.status,
            reason: pick.reason.as_str(),
        });
        let now = Instant::now();
        if let Some(first) = self.first_byte {
            m.ttft[facts.model].observe(first.saturating_duration_since(self.started));
        }
        m.total[facts.model].observe(now.saturating_duration_since(self.started));
        let u = self.usage.usage;
        m.prompt_tokens += u.prompt_tokens.unwrap_or(0);
        m.cached_tokens += u.cached_tokens.unwrap_or(0);
        m.completion_tokens += u.completion_tokens.unwrap_or(0);
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
