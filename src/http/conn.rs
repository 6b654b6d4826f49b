//! The server side of one client connection: reads request after request (keep-alive
//! and pipelined) into buffers the connection owns and reuses.
//!
//! Shared by the gateway's shards and the simulated engine, so both parse HTTP the
//! same way: heads bounded by `max_head_bytes` (and `MAX_HEADERS` headers), request
//! targets by `max_uri_bytes`, bodies by `max_body_bytes` (checked before reading
//! when the length is declared; a chunked body's framing overhead is bounded too),
//! `Expect: 100-continue` answered only when the body has not already arrived,
//! chunked bodies decoded as they come.
//!
//! Three clocks, so a slow client cannot hold a connection by trickling bytes
//! (slowloris): `idle_timeout` between requests (waiting for a first byte),
//! `head_timeout` from a head's first byte to its end, `body_timeout` for the whole
//! body. Each is a deadline for the whole phase, not per read.
//!
//! Between requests, a connection idle for `park_after` returns
//! [`ReadOutcome::Idle`] so its owner can park it: give the buffers back, drop the
//! state of the request path, and wait for the next byte holding almost nothing
//! (see `server::serve_connection`).

use super::chunked::ChunkedDecoder;
use super::io::{consume_front, read_append, read_up_to};
use super::request::{parse_request_head, RequestHead};
use super::BodyFraming;
use crate::error::{ErrorKind, GatewayError};
use crate::tls::Stream;
use monoio::io::AsyncWriteRentExt;
use monoio::time::Instant;
use std::time::Duration;

#[derive(Debug, Clone, Copy)]
pub struct RequestLimits {
    pub max_head_bytes: usize,
    pub max_uri_bytes: usize,
    pub max_body_bytes: u64,
    pub idle_timeout: Duration,
    /// Between requests, how long to wait before [`ReadOutcome::Idle`]; `None`
    /// waits for the whole `idle_timeout`.
    pub park_after: Option<Duration>,
    pub head_timeout: Duration,
    pub body_timeout: Duration,
}

impl RequestLimits {
    /// Generous limits for peers the gateway trusts (the simulated engine).
    pub fn lenient(max_body_bytes: u64, idle_timeout: Duration) -> Self {
        Self {
            max_head_bytes: 64 << 10,
            max_uri_bytes: 64 << 10,
            max_body_bytes,
            idle_timeout,
            park_after: None,
            head_timeout: idle_timeout,
            body_timeout: idle_timeout.max(Duration::from_secs(60)),
        }
    }
}

/// Chunk-size lines, extensions and trailers a chunked body may add on top of its
/// payload (the wire bytes of the body less its payload); one byte more is refused
/// with 413, whatever `max_body_bytes` allows.
pub const MAX_CHUNKED_OVERHEAD: usize = 64 << 10;

pub struct ClientConn {
    pub stream: Stream,
    /// Bytes read but not yet consumed (the start of a pipelined next request).
    buf: Vec<u8>,
    pub head: RequestHead,
    pub body: Vec<u8>,
}

pub enum ReadOutcome {
    Request,
    /// The client closed (or idled out) between requests.
    Closed,
    /// Nothing arrived for `park_after` between requests; the connection stays open
    /// until `deadline` (its idle timeout).
    Idle {
        deadline: Instant,
    },
}

impl ClientConn {
    pub fn new(stream: Stream, buf: Vec<u8>) -> Self {
        Self {
            stream,
            buf,
            head: RequestHead::default(),
            body: Vec::new(),
        }
    }

    /// The socket and the read buffer (to reuse), the rest dropped.
    pub fn into_parts(self) -> (Stream, Vec<u8>) {
        (self.stream, self.buf)
    }

    /// Reads the next request's head and body. An `Err` leaves the connection's
    /// framing untrustworthy: answer it and close.
    pub async fn read_request(
        &mut self,
        limits: &RequestLimits,
    ) -> Result<ReadOutcome, GatewayError> {
        // Set once the head's first byte is here and more is needed (a head that came
        // whole needs no deadline, and no clock reading).
        let mut head_deadline = None;
        let head_len = loop {
            if !self.buf.is_empty() {
                let window = self.buf.len().min(limits.max_head_bytes);
                match parse_request_head(&self.buf[..window], &mut self.head)? {
                    Some(n) => break n,
                    None if window >= limits.max_head_bytes => {
                        return Err(GatewayError::new(
                            ErrorKind::HeadTooLarge,
                            format!(
                                "request head exceeds {} bytes (server.max_head_bytes)",
                                limits.max_head_bytes
                            ),
                        ))
                    }
                    None => {
                        deadline_from_now(&mut head_deadline, limits.head_timeout);
                    }
                }
            }
            let between_requests = self.buf.is_empty();
            // Between requests: wake at the idle deadline, or earlier to park.
            let (deadline, idle_deadline) = match head_deadline {
                Some(d) => (d, None),
                None => {
                    let now = Instant::now();
                    let idle = now + limits.idle_timeout;
                    let park = limits.park_after.map_or(idle, |p| (now + p).min(idle));
                    (park, Some(idle))
                }
            };
            let read = monoio::time::timeout_at(
                deadline,
                read_append(&mut self.stream, &mut self.buf, 4096),
            )
            .await;
            match read {
                Ok(Ok(n)) if n > 0 => {}
                Ok(_) if !between_requests => {
                    return Err(GatewayError::new(
                        ErrorKind::BadHttp,
                        "connection closed mid-request",
                    ))
                }
                Err(_) if !between_requests => {
                    return Err(GatewayError::new(
                        ErrorKind::RequestTimeout,
                        format!(
                            "request head not received within {} ms (server.head_timeout_ms)",
                            limits.head_timeout.as_millis()
                        ),
                    ))
                }
                Err(_) => {
                    return Ok(match idle_deadline {
                        Some(idle) if deadline < idle => ReadOutcome::Idle { deadline: idle },
                        _ => ReadOutcome::Closed,
                    })
                }
                Ok(_) => return Ok(ReadOutcome::Closed),
            }
        };
        if self.head.path.len() > limits.max_uri_bytes {
            return Err(GatewayError::new(
                ErrorKind::UriTooLong,
                format!(
                    "request target exceeds {} bytes (server.max_uri_bytes)",
                    limits.max_uri_bytes
                ),
            ));
        }
        // Set when the body first has to be waited for (or before a 100 Continue): a
        // body that came with its head needs no clock reading.
        let mut body_deadline = None;

        self.body.clear();
        let framing = self.head.framing();
        if let BodyFraming::Length(n) = framing {
            if n > limits.max_body_bytes {
                return Err(body_too_large(limits.max_body_bytes));
            }
        }
        if self.head.expect_continue && framing != BodyFraming::Empty && self.buf.len() == head_len
        {
            deadline_from_now(&mut body_deadline, limits.body_timeout);
            let (r, _) = self
                .stream
                .write_all(&b"HTTP/1.1 100 Continue\r\n\r\n"[..])
                .await;
            r.map_err(|_| GatewayError::new(ErrorKind::BadHttp, "client went away"))?;
        }
        match framing {
            BodyFraming::Empty | BodyFraming::UntilClose => consume_front(&mut self.buf, head_len),
            BodyFraming::Length(n) => {
                // The body's bytes that came with the head are copied from behind it
                // (the head is dropped with them, not moved first); the rest is read
                // straight into `body`, sized once for the declared length, so a long
                // prompt is copied once in user space and `buf` stays small.
                let n = n as usize;
                let have = (self.buf.len() - head_len).min(n);
                self.body
                    .extend_from_slice(&self.buf[head_len..head_len + have]);
                consume_front(&mut self.buf, head_len + have);
                while self.body.len() < n {
                    let deadline = deadline_from_now(&mut body_deadline, limits.body_timeout);
                    let read = read_up_to(&mut self.stream, &mut self.body, n);
                    body_read(limits, monoio::time::timeout_at(deadline, read).await)?;
                }
            }
            BodyFraming::Chunked => {
                consume_front(&mut self.buf, head_len);
                let mut decoder = ChunkedDecoder::new();
                let max = limits.max_body_bytes as usize;
                let mut wire_bytes = 0usize;
                loop {
                    let mut over = false;
                    let body = &mut self.body;
                    let used = decoder
                        .feed(&self.buf, |data| {
                            if body.len() + data.len() > max {
                                over = true;
                            } else {
                                body.extend_from_slice(data);
                            }
                        })
                        .map_err(|e| GatewayError::new(ErrorKind::BadHttp, e.to_string()))?;
                    wire_bytes += used;
                    if over {
                        return Err(body_too_large(limits.max_body_bytes));
                    }
                    // What the framing added so far; it only grows as the body comes.
                    if wire_bytes - self.body.len() > MAX_CHUNKED_OVERHEAD {
                        return Err(GatewayError::new(
                            ErrorKind::BodyTooLarge,
                            format!(
                                "the chunked framing (size lines, extensions, trailers) exceeds {MAX_CHUNKED_OVERHEAD} bytes"
                            ),
                        ));
                    }
                    consume_front(&mut self.buf, used);
                    if decoder.is_done() {
                        break;
                    }
                    let deadline = deadline_from_now(&mut body_deadline, limits.body_timeout);
                    self.fill(limits, deadline, 4096).await?;
                }
            }
        }
        Ok(ReadOutcome::Request)
    }

    async fn fill(
        &mut self,
        limits: &RequestLimits,
        deadline: Instant,
        want: usize,
    ) -> Result<(), GatewayError> {
        let read = monoio::time::timeout_at(
            deadline,
            read_append(&mut self.stream, &mut self.buf, want.clamp(4096, 64 << 10)),
        )
        .await;
        body_read(limits, read)
    }
}

/// The deadline in `slot`, set to `timeout` from now the first time it is asked for.
fn deadline_from_now(slot: &mut Option<Instant>, timeout: Duration) -> Instant {
    *slot.get_or_insert_with(|| Instant::now() + timeout)
}

/// The outcome of one timed read of body bytes.
fn body_read<E>(
    limits: &RequestLimits,
    read: Result<std::io::Result<usize>, E>,
) -> Result<(), GatewayError> {
    match read {
        Ok(Ok(n)) if n > 0 => Ok(()),
        Ok(_) => Err(GatewayError::new(
            ErrorKind::BadHttp,
            "connection closed mid-body",
        )),
        Err(_) => Err(GatewayError::new(
            ErrorKind::RequestTimeout,
            format!(
                "request body not received within {} ms (server.body_timeout_ms)",
                limits.body_timeout.as_millis()
            ),
        )),
    }
}

fn body_too_large(limit: u64) -> GatewayError {
    GatewayError::new(
        ErrorKind::BodyTooLarge,
        format!("request body exceeds {limit} bytes (server.max_body_bytes)"),
    )
}
