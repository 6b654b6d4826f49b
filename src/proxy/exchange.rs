//! One attempt against one backend: send the request over a pooled keep-alive
//! connection, read the response head (within the first-byte timeout), and stream
//! the body back to the client byte for byte, chunk framing included.
//!
//! The shard only tracks where the body ends, notes the first body byte (TTFT) and
//! lets the [`UsageScanner`] watch for the final `usage`. A connection goes back to
//! the pool only when its response was read to the end. If the upstream breaks off
//! an SSE stream at a chunk boundary, the client gets a final `data: {"error":...}`
//! event and a properly ended body instead of a cut connection.
//!
//! A client that leaves is noticed whatever the response: a failed write while
//! streaming, or, while the shard waits on the upstream (for the head of a
//! non-streaming answer, or between body pieces), its socket watched for a close
//! ([`read_watching`]). Either way the attempt ends as [`CLIENT_GONE`] at once: the
//! upstream connection is dropped (closed, so the engine aborts the request), the
//! in-flight and pending-prefill guards are released, the breaker is not told, and
//! the request is logged and counted as 499 (`client_closed`).

use super::migrate::{LateStream, StreamText};
use super::wire::Outgoing;
use crate::error::{ErrorKind, GatewayError, CLIENT_CLOSED};
use crate::http::chunked::ChunkedDecoder;
use crate::http::io::{peer_closed, read_append};
use crate::http::response::Utf8Vec;
use crate::http::response::{parse_response_head, ResponseHead};
use crate::http::BodyFraming;
use crate::learned::Sample;
use crate::metrics::RequestKey;
use crate::observe::UsageScanner;
use crate::openai::RequestFacts;
use crate::shard::Shard;
use crate::tls::Stream;
use monoio::io::AsyncWriteRentExt;
use monoio::time::Instant;
use radixgate_orchestrator::Decision;
use std::fmt::Write as _;
use std::rc::Rc;

pub(super) enum Failure {
    /// Nothing reached the client and another backend may take the request: a
    /// connect error, a reset or timeout before the first byte, a broken head, or a
    /// 5xx the caller chose to retry.
    Retryable(GatewayError),
    /// The response was under way, or the client left. `upstream_fault`: the backend
    /// broke (counts against its breaker); `keep_open`: the client's connection is
    /// still well framed (an SSE error event ended the stream).
    AfterResponse {
        upstream_fault: bool,
        keep_open: bool,
    },
    /// The backend broke off an SSE stream between two events, before its end, and
    /// the attempt watched its text ([`Exchange::collect`]): nothing was written to
    /// end the client's stream, so another backend may continue it
    /// ([`super::migrate`]). `keep_client`: the client's connection may stay open
    /// once the stream is ended. `stalled`: the backend did not break but sent no
    /// token by the first-token deadline ([`Exchange::first_token_deadline`]); the
    /// gateway dropped its connection (an engine aborts a request whose client left).
    StreamCut { keep_client: bool, stalled: bool },
}

impl Failure {
    /// A [`Failure::StreamCut`] as the stream break it is when nobody continues it
    /// (the client's stream is left unended: its connection closes).
    pub(super) fn cut_as_broken(self) -> Self {
        match self {
            Failure::StreamCut { .. } => UPSTREAM_BROKE,
            other => other,
        }
    }

    /// The span status and reason of an exchange that ended with `result`, where
    /// `status` is what the backend answered (0: nothing): the backend's own status
    /// when it answered (a retried 5xx), else the error's.
    pub(super) fn span_outcome(result: &Result<bool, Failure>, status: u16) -> (u16, &'static str) {
        match result {
            Err(Failure::Retryable(e)) if status != 0 => (status, e.code()),
            Err(Failure::Retryable(e)) => (e.status(), e.code()),
            Err(Failure::AfterResponse { upstream_fault, .. }) => (
                status,
                if *upstream_fault {
                    "upstream_broke"
                } else {
                    "client_gone"
                },
            ),
            Err(Failure::StreamCut { .. }) => (status, "stream_cut"),
            Ok(_) => (status, ""),
        }
    }
}

/// How long an upstream read with a client behind it runs before the client's socket
/// is watched as well: most reads finish sooner, and cost no more than before (one
/// timer); a longer wait adds one readiness watch on the client.
const WATCH_CLIENT_AFTER: std::time::Duration = std::time::Duration::from_millis(20);

/// How an upstream read watched by [`read_watching`] ended.
pub(super) enum Waited {
    Read(std::io::Result<usize>),
    TimedOut,
    ClientGone,
}

/// Reads more of the upstream's answer into `buf` by `deadline`; if `client` is
/// given and the read is still waiting [`WATCH_CLIENT_AFTER`] past `since`, the
/// client's socket is watched too ([`peer_closed`]), so a departed client ends the
/// wait at once. The read itself is never dropped half-done while it may still
/// complete, only when the wait ends for another reason (and the connection with it).
pub(super) async fn read_watching(
    upstream: &mut Stream,
    buf: &mut Vec<u8>,
    since: Instant,
    deadline: Instant,
    client: Option<&Stream>,
) -> Waited {
    let mut read = std::pin::pin!(read_append(upstream, buf, 16 << 10));
    let watch_at = since + WATCH_CLIENT_AFTER;
    let Some(client) = client.filter(|_| watch_at < deadline) else {
        return match monoio::time::timeout_at(deadline, read).await {
            Ok(r) => Waited::Read(r),
            Err(_) => Waited::TimedOut,
        };
    };
    if let Ok(r) = monoio::time::timeout_at(watch_at, &mut read).await {
        return Waited::Read(r);
    }
    monoio::select! {
        biased;
        r = &mut read => Waited::Read(r),
        _ = monoio::time::sleep_until(deadline) => Waited::TimedOut,
        _ = peer_closed(client.tcp()) => Waited::ClientGone,
    }
}

/// How the wait for the next piece of a response body ended ([`next_body_piece`]).
pub(super) enum BodyPiece {
    /// More bytes are in the buffer.
    Bytes,
    /// The upstream closed a body that runs until close: that is its end.
    Ended,
    ClientGone,
    /// The upstream closed early or failed the read.
    Broke,
    /// Nothing came for the idle timeout.
    Idle,
}

/// Reads the next piece of a response body into `buf` (cleared first), waiting at
/// most `idle_timeout` and watching `client` ([`read_watching`]).
pub(super) async fn next_body_piece(
    upstream: &mut Stream,
    buf: &mut Vec<u8>,
    idle_timeout: std::time::Duration,
    client: &Stream,
    tracker: &BodyTracker,
) -> BodyPiece {
    buf.clear();
    let now = Instant::now();
    match read_watching(upstream, buf, now, now + idle_timeout, Some(client)).await {
        Waited::Read(Ok(n)) if n > 0 => BodyPiece::Bytes,
        Waited::Read(Ok(_)) if matches!(tracker, BodyTracker::UntilClose) => BodyPiece::Ended,
        Waited::Read(_) => BodyPiece::Broke,
        Waited::ClientGone => BodyPiece::ClientGone,
        Waited::TimedOut => BodyPiece::Idle,
    }
}

/// The client left (a failed write, or a close seen while waiting). Built only by
/// [`Exchange::client_gone`], which also records the 499.
const CLIENT_GONE: Failure = Failure::AfterResponse {
    upstream_fault: false,
    keep_open: false,
};
const UPSTREAM_BROKE: Failure = Failure::AfterResponse {
    upstream_fault: true,
    keep_open: false,
};

/// Written with `extend_from_slice` and itoa rather than `write!`: `core::fmt` cost
/// ~2,600 instructions per request across the heads (perf/RESULTS.md).
pub(super) fn router_headers(shard: &Shard, out: &mut Vec<u8>, route: &Decision, request_id: &str) {
    let fleet = shard.fleet.borrow();
    out.extend_from_slice(b"X-Router-Backend: ");
    out.extend_from_slice(fleet.live.backends.id(route.pick.backend).as_bytes());
    out.extend_from_slice(b"\r\nX-Router-Reason: ");
    out.extend_from_slice(route.pick.reason.as_str().as_bytes());
    out.extend_from_slice(b"\r\nX-Router-Match-Blocks: ");
    out.extend_from_slice(itoa::Buffer::new().format(route.matched_blocks).as_bytes());
    if let Some(prefill) = route.prefill {
        out.extend_from_slice(b"\r\nX-Router-Prefill: ");
        out.extend_from_slice(fleet.live.backends.id(prefill).as_bytes());
        out.extend_from_slice(b"\r\nX-Router-Decode: ");
        out.extend_from_slice(fleet.live.backends.id(route.pick.backend).as_bytes());
    }
    out.extend_from_slice(b"\r\nX-Request-Id: ");
    out.extend_from_slice(request_id.as_bytes());
    out.extend_from_slice(b"\r\n");
    if let Some((overlap, total)) = route.chunk_overlap {
        let mut n = itoa::Buffer::new();
        out.extend_from_slice(b"X-Router-Chunk-Overlap: ");
        out.extend_from_slice(n.format(overlap).as_bytes());
        out.extend_from_slice(b"\r\nX-Router-Chunks: ");
        out.extend_from_slice(n.format(total).as_bytes());
        out.extend_from_slice(b"\r\n");
    }
}

/// Tracks where an upstream response body ends.
pub(super) enum BodyTracker {
    Remaining(u64),
    Chunked(ChunkedDecoder),
    UntilClose,
}

impl BodyTracker {
    pub(super) fn new(framing: BodyFraming) -> Self {
        match framing {
            BodyFraming::Empty => BodyTracker::Remaining(0),
            BodyFraming::Length(n) => BodyTracker::Remaining(n),
            BodyFraming::Chunked => BodyTracker::Chunked(ChunkedDecoder::new()),
            BodyFraming::UntilClose => BodyTracker::UntilClose,
        }
    }

    /// Whether the body stopped between two chunks (so an event can be appended).
    pub(super) fn at_chunk_boundary(&self) -> bool {
        matches!(self, BodyTracker::Chunked(d) if d.at_chunk_boundary())
    }

    pub(super) fn done(&self) -> bool {
        match self {
            BodyTracker::Remaining(n) => *n == 0,
            BodyTracker::Chunked(d) => d.is_done(),
            BodyTracker::UntilClose => false,
        }
    }

    /// How many bytes of `data` belong to the body; payload goes to `sink`.
    pub(super) fn advance(
        &mut self,
        data: &[u8],
        mut sink: impl FnMut(&[u8]),
    ) -> Result<usize, ()> {
        match self {
            BodyTracker::Remaining(n) => {
                let used = (*n).min(data.len() as u64) as usize;
                sink(&data[..used]);
                *n -= used as u64;
                Ok(used)
            }
            BodyTracker::Chunked(d) => d.feed(data, sink).map_err(|_| ()),
            BodyTracker::UntilClose => {
                sink(data);
                Ok(data.len())
            }
        }
    }
}

pub(super) struct Exchange<'s> {
    pub shard: &'s Rc<Shard>,
    pub backend: usize,
    pub started: Instant,
    pub first_byte: Option<Instant>,
    /// The backends sharing this one's compute that had requests in flight at the
    /// first byte (with [`Decision::peers_busy_before`], what the learned costs
    /// need to take out the share they took).
    pub peers_busy_at_first_byte: u32,
    /// The attempt's predicted prefill in the backend's pending-prefill count, released
    /// at the first response byte (or when the attempt ends without one).
    pub pending_prefill: Option<crate::pending_prefill::PendingGuard<'s>>,
    pub usage: UsageScanner,
    pub status: u16,
    /// With `may_retry`, statuses from this one up are retried (500; a decode leg
    /// also retries a 4xx, a failed KV hand-off, with a fresh prefill).
    pub retry_from_status: u16,
    /// Overrides `upstream.first_byte_timeout` (a split request's per-leg timeouts).
    pub first_byte_timeout: Option<std::time::Duration>,
    /// With `retry.migrate_streams` or `retry.first_token_timeout_ms`, a streamed
    /// answer's text as it passes, so that a stream cut off midway or stalled before
    /// its first token can be continued elsewhere; `None` (no watching at all)
    /// otherwise. Boxed: the attempt without it stays as small as before.
    pub collect: Option<Box<StreamText>>,
    /// A watched stream the backend breaks off is continued elsewhere
    /// (`retry.migrate_streams`).
    pub migrate_cut: bool,
    /// A watched stream whose backend has sent no body byte by then is moved to
    /// another backend (`retry.first_token_timeout_ms`, set only when a retry is
    /// possible): after the response head, as a [`Failure::StreamCut`] with `stalled`;
    /// before it, as a [`Failure::Retryable`] with [`Exchange::stalled`] set.
    pub first_token_deadline: Option<Instant>,
    /// With `first_token_deadline`: what decides, once it passes, whether the stream
    /// moves or waits on ([`LateStream::move_pays`]); without it, it moves.
    pub late: Option<&'s LateStream<'s>>,
    /// The attempt failed because its backend sent not even a response head by
    /// `first_token_deadline`: late, not broken.
    pub stalled: bool,
}

impl<'s> Exchange<'s> {
    /// An attempt on `backend` timed from `started`, before anything happened: not
    /// in the pending prefill, retried from 500, the configured first-byte timeout,
    /// the stream not watched. Callers set what differs with struct update syntax.
    pub fn new(shard: &'s Rc<Shard>, backend: usize, started: Instant) -> Self {
        Exchange {
            shard,
            backend,
            started,
            first_byte: None,
            peers_busy_at_first_byte: 0,
            pending_prefill: None,
            usage: UsageScanner::default(),
            status: 0,
            retry_from_status: 500,
            first_byte_timeout: None,
            collect: None,
            migrate_cut: false,
            first_token_deadline: None,
            late: None,
            stalled: false,
        }
    }
}

impl Exchange<'_> {
    /// The client left: the attempt is logged and counted as 499 (not the upstream's
    /// status), and ends as [`CLIENT_GONE`] (not the backend's fault).
    fn client_gone(&mut self) -> Failure {
        self.status = CLIENT_CLOSED;
        CLIENT_GONE
    }

    /// How the attempt ended, for the access log: `client_closed` when the client
    /// left before the answer was complete, else `completed`.
    pub fn outcome(&self) -> &'static str {
        if self.status == CLIENT_CLOSED {
            "client_closed"
        } else {
            "completed"
        }
    }

    /// The engine has answered: its prefill for this request is done.
    pub(super) fn got_first_byte(&mut self) {
        let now = Instant::now();
        self.first_byte = Some(now);
        let shared = &self.shard.shared;
        self.peers_busy_at_first_byte = (self.shard.fleet.borrow().live.backends)
            .compute_peers(self.backend)
            .iter()
            .map(|&p| u32::from(shared.in_flight.total(p) > 0))
            .sum();
        if let Some(pending) = self.pending_prefill.take() {
            pending.release(now.into_std());
        }
    }

    /// Runs the attempt. With `may_retry`, a 5xx is not passed on but returned as
    /// [`Failure::Retryable`] (nothing has reached the client yet).
    pub async fn run(
        &mut self,
        client: &mut Stream,
        attempt: Attempt<'_>,
    ) -> Result<bool, Failure> {
        let Attempt {
            request,
            body,
            route,
            client_keep_alive,
            request_id,
            may_retry,
        } = attempt;
        let shard = self.shard;
        let idle_timeout = shard.fleet.borrow().live.config.upstream.idle_timeout;
        let (mut upstream, mut buf, head_len, mut resp) =
            match self.send(request, body, Some(&*client)).await {
                Ok(sent) => sent,
                Err(e) if e.kind == ErrorKind::ClientClosed => return Err(self.client_gone()),
                Err(e) => return Err(Failure::Retryable(e)),
            };
        self.status = resp.status;
        if may_retry && resp.status >= self.retry_from_status {
            shard.give_buffer(buf);
            let e = GatewayError::new(
                ErrorKind::UpstreamProtocol,
                format!(
                    "backend `{}` answered {} {}",
                    shard.backend_id(self.backend),
                    resp.status,
                    String::from_utf8_lossy(resp.reason())
                ),
            );
            shard.give_buffer(resp.take_buffer());
            return Err(Failure::Retryable(e));
        }

        // Response head to the client, with the first body bytes if they came along.
        let mut tracker = BodyTracker::new(resp.framing());
        let keep_client = client_keep_alive && resp.framing() != BodyFraming::UntilClose;
        let mut out = shard.take_buffer();
        out.extend_from_slice(b"HTTP/1.1 ");
        out.extend_from_slice(itoa::Buffer::new().format(resp.status).as_bytes());
        out.push(b' ');
        out.extend_from_slice(resp.reason());
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(resp.forward_headers());
        shard.give_buffer(resp.take_buffer());
        router_headers(shard, &mut out, route, request_id);
        if !keep_client {
            out.extend_from_slice(b"Connection: close\r\n");
        }
        out.extend_from_slice(b"\r\n");
        let leftover = &buf[head_len..];
        // Two closures, so that the path without a watched stream is the one it was.
        let used = match &mut self.collect {
            None => tracker.advance(leftover, |p| self.usage.feed(p)),
            Some(c) => tracker.advance(leftover, |p| {
                self.usage.feed(p);
                c.feed(p);
            }),
        }
        .map_err(|_| UPSTREAM_BROKE)?;
        let mut reusable = used == leftover.len();
        if used > 0 || tracker.done() {
            self.got_first_byte();
        }
        out.extend_from_slice(&leftover[..used]);
        let (r, out) = client.write_all(out).await;
        shard.give_buffer(out);
        if r.is_err() {
            shard.give_buffer(buf);
            return Err(self.client_gone());
        }

        // The rest of the body, piece by piece as it arrives.
        while !tracker.done() {
            let wait = self.body_wait(idle_timeout);
            match next_body_piece(&mut upstream, &mut buf, wait, client, &tracker).await {
                BodyPiece::Bytes => {}
                BodyPiece::Ended => {
                    shard.give_buffer(buf);
                    return Ok(false);
                }
                BodyPiece::ClientGone => {
                    shard.give_buffer(buf);
                    return Err(self.client_gone());
                }
                BodyPiece::Broke if self.migrate_cut && self.can_move(&resp, &tracker) => {
                    shard.give_buffer(buf);
                    return Err(Failure::StreamCut {
                        keep_client,
                        stalled: false,
                    });
                }
                BodyPiece::Idle
                    if self.past_first_token_deadline() && self.can_move(&resp, &tracker) =>
                {
                    if self.late_stream_moves() {
                        shard.give_buffer(buf);
                        return Err(Failure::StreamCut {
                            keep_client,
                            stalled: true,
                        });
                    }
                    continue;
                }
                BodyPiece::Broke | BodyPiece::Idle => {
                    let ended_cleanly = resp.event_stream
                        && tracker.at_chunk_boundary()
                        && self.end_stream_with_error(client, buf).await;
                    return Err(Failure::AfterResponse {
                        upstream_fault: true,
                        keep_open: ended_cleanly && keep_client,
                    });
                }
            }
            if self.first_byte.is_none() {
                self.got_first_byte();
            }
            let used = match &mut self.collect {
                None => tracker.advance(&buf, |p| self.usage.feed(p)),
                Some(c) => tracker.advance(&buf, |p| {
                    self.usage.feed(p);
                    c.feed(p);
                }),
            }
            .map_err(|_| UPSTREAM_BROKE)?;
            if used < buf.len() {
                // Bytes after the end of the response: the upstream broke framing.
                reusable = false;
                buf.truncate(used);
            }
            let (r, b) = client.write_all(buf).await;
            buf = b;
            if r.is_err() {
                shard.give_buffer(buf);
                return Err(self.client_gone());
            }
        }
        shard.give_buffer(buf);
        // A backend removed meanwhile keeps no pooled connection.
        let live = shard.fleet.borrow().live.backends.is_live(self.backend);
        if reusable && resp.keep_alive && live {
            shard.pool.borrow_mut().put(self.backend, upstream);
        }
        Ok(keep_client)
    }

    /// How long to wait for the next body piece: the idle timeout, or less while the
    /// first token is due before it.
    fn body_wait(&self, idle_timeout: std::time::Duration) -> std::time::Duration {
        match self.first_token_deadline {
            Some(deadline) if self.first_byte.is_none() => {
                idle_timeout.min(deadline.saturating_duration_since(Instant::now()))
            }
            _ => idle_timeout,
        }
    }

    /// No body byte yet, and the first-token deadline has passed.
    fn past_first_token_deadline(&self) -> bool {
        self.first_byte.is_none()
            && self
                .first_token_deadline
                .is_some_and(|deadline| Instant::now() >= deadline)
    }

    /// Past the first-token deadline: whether the stream moves now. When no other
    /// backend promises its first token sooner ([`LateStream`]), it waits on: the
    /// deadline moves to when the wait will have doubled, and the wait is counted
    /// (`radixgate_first_token_waits_total`).
    fn late_stream_moves(&mut self) -> bool {
        let Some(late) = self.late else {
            return true;
        };
        let now = Instant::now();
        let waited = now.saturating_duration_since(self.started);
        if late.move_pays(self.shard, waited) {
            return true;
        }
        self.first_token_deadline = Some(now + waited);
        self.shard.metrics.borrow_mut().first_token_waits[self.backend] += 1;
        tracing::debug!(
            backend = %self.shard.backend_id(self.backend),
            waited_ms = waited.as_millis() as u64,
            "no token by the first-token deadline, and no other backend promises one sooner; waiting on"
        );
        false
    }

    /// The stream may be continued elsewhere from here: an SSE stream between two
    /// chunks whose text was watched and is not finished.
    fn can_move(&self, resp: &ResponseHead, tracker: &BodyTracker) -> bool {
        resp.event_stream
            && tracker.at_chunk_boundary()
            && self
                .collect
                .as_deref()
                .is_some_and(StreamText::can_continue)
    }

    /// The upstream broke off an SSE stream between two chunks: tell the client in
    /// the stream itself and end the body properly. True when that reached it.
    async fn end_stream_with_error(&self, client: &mut Stream, buf: Vec<u8>) -> bool {
        let id = self.shard.backend_id(self.backend);
        let e = GatewayError::new(
            ErrorKind::UpstreamProtocol,
            format!("backend `{id}` broke off the stream"),
        );
        end_stream_with(self.shard, client, &e, buf).await
    }

    /// Runs the attempt for a caller that wants the response whole (a workflow node, a
    /// split request's prefill leg): returns the decoded body (chunk framing removed,
    /// at most `max_bytes`), watched for `usage` like a streamed one; the status is in
    /// `self.status`. Within the first-byte timeout for the head, then `idle_timeout`
    /// between reads. The connection goes back to the pool when it was read to the end.
    ///
    /// `leave` resolves when the client the call serves has left (its socket closed,
    /// see [`peer_closed`], or the owner abandoned the call, see
    /// [`super::abandon::Abandon`]): the call then ends at once with
    /// [`ErrorKind::ClientClosed`] and its upstream connection is dropped, so the
    /// engine stops working on it.
    pub async fn fetch(
        &mut self,
        request: Vec<u8>,
        max_bytes: usize,
        leave: impl std::future::Future<Output = ()>,
    ) -> Result<Vec<u8>, GatewayError> {
        let fetched = monoio::select! {
            fetched = self.fetch_whole(request, max_bytes) => Some(fetched),
            () = leave => None,
        };
        fetched.unwrap_or_else(|| {
            self.status = CLIENT_CLOSED;
            Err(GatewayError::new(
                ErrorKind::ClientClosed,
                format!(
                    "the client left while backend `{}` was working on the request",
                    self.shard.backend_id(self.backend)
                ),
            ))
        })
    }

    async fn fetch_whole(
        &mut self,
        request: Vec<u8>,
        max_bytes: usize,
    ) -> Result<Vec<u8>, GatewayError> {
        let shard = self.shard;
        let idle_timeout = shard.fleet.borrow().live.config.upstream.idle_timeout;
        let (mut upstream, mut buf, head_len, mut resp) = self.send(request, None, None).await?;
        self.status = resp.status;
        shard.give_buffer(resp.take_buffer());
        self.got_first_byte();
        let broke = |what: &str| {
            GatewayError::new(
                ErrorKind::UpstreamProtocol,
                format!("backend `{}` {what}", shard.backend_id(self.backend)),
            )
        };
        let mut tracker = BodyTracker::new(resp.framing());
        let mut body = Vec::new();
        let mut start = head_len;
        let mut reusable = true;
        loop {
            let data = &buf[start..];
            let used = tracker
                .advance(data, |p| {
                    self.usage.feed(p);
                    body.extend_from_slice(p);
                })
                .map_err(|_| broke("broke the response framing"))?;
            if used < data.len() {
                reusable = false;
            }
            if body.len() > max_bytes {
                return Err(broke("sent a response larger than the workflow node limit"));
            }
            if tracker.done() {
                break;
            }
            buf.clear();
            start = 0;
            match monoio::time::timeout(
                idle_timeout,
                read_append(&mut upstream, &mut buf, 16 << 10),
            )
            .await
            {
                Ok(Ok(0)) | Ok(Err(_)) if matches!(tracker, BodyTracker::UntilClose) => {
                    reusable = false;
                    break;
                }
                Ok(Ok(0)) | Ok(Err(_)) => return Err(broke("broke off the response")),
                Ok(Ok(_)) => {}
                Err(_) => return Err(broke("stalled in the middle of the response")),
            }
        }
        shard.give_buffer(buf);
        let live = shard.fleet.borrow().live.backends.is_live(self.backend);
        if reusable && resp.keep_alive && live {
            shard.pool.borrow_mut().put(self.backend, upstream);
        }
        Ok(body)
    }

    /// Sends the request and reads the response head. A pooled connection that
    /// turns out to be dead before answering anything is replaced by a fresh one.
    /// With `client`, a client that leaves meanwhile ends the wait with
    /// [`ErrorKind::ClientClosed`] (the upstream connection is dropped, not pooled).
    pub(super) async fn send(
        &mut self,
        request: Vec<u8>,
        body: Option<&Rc<Vec<u8>>>,
        client: Option<&Stream>,
    ) -> Result<(Stream, Vec<u8>, usize, ResponseHead), GatewayError> {
        let shard = self.shard;
        let upstream = shard.fleet.borrow().live.config.upstream.clone();
        let backend = shard.backend(self.backend);
        let first_byte_timeout = self
            .first_byte_timeout
            .unwrap_or(upstream.first_byte_timeout);
        let start = Instant::now();
        // A stream's first-token deadline bounds the wait for its head too.
        let mut deadline = match self.first_token_deadline {
            Some(first_token) => first_token.min(start + first_byte_timeout),
            None => start + first_byte_timeout,
        };
        // The first pool lookup shares the deadline's clock reading; one after a
        // reconnect reads the clock again.
        let mut first = Some(start);
        let mut buf = shard.take_buffer();
        let mut resp = ResponseHead::with_buffer(shard.take_buffer());
        let mut request = Outgoing::new(request, body.cloned());
        loop {
            let at = first.take().unwrap_or_else(Instant::now);
            let pooled = shard.pool.borrow_mut().take(self.backend, at);
            let reused = pooled.is_some();
            let mut stream = match pooled {
                Some(s) => s,
                None => connect(&backend, upstream.connect_timeout).await?,
            };
            request.rewind();
            let (sent, req) = request.write_to(&mut stream).await;
            request = req;
            if sent.is_err() {
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
                let read = read_watching(&mut stream, &mut buf, start, deadline, client).await;
                let read = match read {
                    Waited::Read(r) => Ok(r),
                    Waited::TimedOut => Err(()),
                    Waited::ClientGone => {
                        return Err(GatewayError::new(
                            ErrorKind::ClientClosed,
                            format!(
                                "the client left while backend `{}` was working on the request",
                                backend.id
                            ),
                        ))
                    }
                };
                match read {
                    Err(()) if self.past_first_token_deadline() && !self.late_stream_moves() => {
                        // Waiting on: until the moved deadline, within the head's own.
                        if let Some(first_token) = self.first_token_deadline {
                            deadline = first_token.min(start + first_byte_timeout);
                        }
                        continue;
                    }
                    Err(()) if self.past_first_token_deadline() => {
                        self.stalled = true;
                        return Err(GatewayError::new(
                            ErrorKind::UpstreamTimeout,
                            format!(
                                "backend `{}` sent no token within retry.first_token_timeout_ms",
                                backend.id
                            ),
                        ));
                    }
                    Err(()) => {
                        return Err(GatewayError::new(
                            ErrorKind::UpstreamTimeout,
                            format!(
                                "backend `{}` sent no response within {:?}",
                                backend.id, first_byte_timeout
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
                        shard.give_buffer(request.into_head());
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
    pub fn record(&self, facts: &RequestFacts, route: &Decision) {
        let shard = self.shard;
        let backend = route.pick.backend;
        let mut m = shard.metrics.borrow_mut();
        m.count_request(RequestKey {
            backend: Some(backend),
            status: self.status,
            reason: route.pick.reason.as_str(),
            model: Some(facts.model),
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
            predicted = match &shard.shared.config.routing.hashing {
                // Engine blocks: vLLM always computes the last prompt token, so a hit
                // is the whole blocks within `prompt - 1` tokens.
                crate::config::Hashing::Tokens { block_tokens, .. } => {
                    let bt = block_tokens.get() as u64;
                    predicted.min(prompt.saturating_sub(1) / bt * bt)
                }
                _ => predicted.min(prompt),
            };
        }
        m.predicted_cached[backend] += predicted;
        m.reported_cached[backend] += reported;
        m.prediction_abs_error[backend] += predicted.abs_diff(reported);
        drop(m);
        if let (Some(ttft), Some(prompt), 200) = (ttft, u.prompt_tokens, self.status) {
            let fixed_delay = shard
                .fleet
                .borrow()
                .live
                .config
                .routing
                .prefix_aware
                .learned_fixed_delay;
            shard.per_backend.borrow_mut()[backend].learned.learn(
                Sample {
                    ttft_ns: ttft.as_nanos().min(u64::MAX as u128) as u64,
                    uncached_tokens: prompt.saturating_sub(reported),
                    in_flight_before: route.in_flight_before,
                    pending_prefill_before: route.pending_prefill_before,
                    peers_busy_before: route.peers_busy_before,
                    peers_busy_at_first_token: self.peers_busy_at_first_byte,
                },
                fixed_delay,
            );
        }
    }
}

/// Ends a chunked SSE body the client is reading, at an event boundary, with the
/// error `e` as a last `data:` event in OpenAI's error shape. True when that reached
/// the client.
pub(super) async fn end_stream_with(
    shard: &Shard,
    client: &mut Stream,
    e: &GatewayError,
    mut buf: Vec<u8>,
) -> bool {
    let mut event = b"data: ".to_vec();
    event.extend_from_slice(&e.body());
    event.extend_from_slice(b"\n\n");
    buf.clear();
    let _ = write!(Utf8Vec(&mut buf), "{:x}\r\n", event.len());
    buf.extend_from_slice(&event);
    buf.extend_from_slice(b"\r\n0\r\n\r\n");
    let (r, buf) = client.write_all(buf).await;
    shard.give_buffer(buf);
    r.is_ok()
}

/// One attempt's inputs: the upstream request (its head, and the body unless `body`
/// carries it), the decision it carries out, and what the client asked for.
pub struct Attempt<'a> {
    pub request: Vec<u8>,
    pub body: Option<&'a Rc<Vec<u8>>>,
    pub route: &'a Decision,
    pub client_keep_alive: bool,
    pub request_id: &'a str,
    /// A 5xx is not passed on but returned as [`Failure::Retryable`].
    pub may_retry: bool,
}

/// A new connection to `backend`, its TLS handshake included for an `https://`
/// one, all within `timeout`.
async fn connect(
    backend: &crate::config::BackendConfig,
    timeout: std::time::Duration,
) -> Result<Stream, GatewayError> {
    let id = &backend.id;
    let open = async {
        let s = monoio::net::TcpStream::connect_addr(backend.addr).await?;
        let _ = s.set_nodelay(true);
        let stream = match &backend.tls {
            None => Stream::Plain(s),
            Some(tls) => {
                let config = tls.config.clone();
                let name = tls.server_name.clone();
                Stream::Tls(Box::new(
                    crate::tls::TlsStream::connect(s, config, name).await?,
                ))
            }
        };
        Ok::<_, std::io::Error>(stream)
    };
    match monoio::time::timeout(timeout, open).await {
        Ok(Ok(s)) => Ok(s),
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
