//! A small blocking HTTP/1.1 client for the load generator: one keep-alive connection,
//! one request at a time, over std `TcpStream`.
//!
//! It writes a POST with `Content-Length`, reads the response head by finding the
//! blank line and parsing status and headers by hand, then reads the whole body framed
//! by `Content-Length`, `Transfer-Encoding: chunked` (see [`crate::chunked`]) or
//! connection close. Per request it measures time to the first body byte (TTFT) and
//! the total time, keeps the `X-Router-Backend` header, and picks the `usage` token
//! counts out of the body.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use crate::chunked::ChunkedDecoder;
use crate::json;

const MAX_HEAD: usize = 64 * 1024;
const READ_SIZE: usize = 16 * 1024;

// === impl Target ===

/// Where requests go: parsed once from an `http://host:port/path` URL.
#[derive(Clone, Debug)]
pub struct Target {
    pub addr: SocketAddr,
    /// The `Host` header: the URL's authority as written.
    pub authority: String,
    pub path: String,
}

impl Target {
    pub fn parse(url: &str) -> Result<Target, String> {
        let rest = match url.strip_prefix("http://") {
            Some(rest) => rest,
            None if url.starts_with("https://") => {
                return Err(
                    "https is not supported: the load generator speaks plain HTTP/1.1".into(),
                )
            }
            None => return Err(format!("the url must start with http://: {url}")),
        };
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        if authority.is_empty() {
            return Err(format!("no host in url {url}"));
        }
        let (host, port) = split_host_port(authority)?;
        Ok(Target {
            addr: resolve(host, port)?,
            authority: authority.to_string(),
            path: path.to_string(),
        })
    }
}

fn split_host_port(authority: &str) -> Result<(&str, u16), String> {
    let parse_port = |p: &str| {
        p.parse::<u16>()
            .map_err(|_| format!("bad port in {authority}"))
    };
    if let Some(rest) = authority.strip_prefix('[') {
        let end = rest
            .find(']')
            .ok_or_else(|| format!("unclosed [ in {authority}"))?;
        let port = match &rest[end + 1..] {
            "" => 80,
            p => parse_port(
                p.strip_prefix(':')
                    .ok_or_else(|| format!("bad authority {authority}"))?,
            )?,
        };
        return Ok((&rest[..end], port));
    }
    match authority.rsplit_once(':') {
        Some((host, port)) => Ok((host, parse_port(port)?)),
        None => Ok((authority, 80)),
    }
}

// Name resolution happens once, before the run, on the main thread; the clippy ban
// on `to_socket_addrs` exists for the gateway's shard threads.
#[allow(
    clippy::disallowed_methods,
    reason = "one lookup at start-up, not on a shard"
)]
fn resolve(host: &str, port: u16) -> Result<SocketAddr, String> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, port));
    }
    use std::net::ToSocketAddrs;
    (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {host}: {e}"))?
        .next()
        .ok_or_else(|| format!("{host} resolves to no address"))
}

// === impl HttpError ===

#[derive(Debug)]
pub enum HttpError {
    Connect(io::Error),
    Timeout,
    Io(io::Error),
    Protocol(String),
}

impl HttpError {
    /// A short label for the error table.
    pub fn kind(&self) -> &'static str {
        match self {
            HttpError::Connect(_) => "connect",
            HttpError::Timeout => "timeout",
            HttpError::Io(_) => "io",
            HttpError::Protocol(_) => "protocol",
        }
    }

    fn from_io(e: io::Error) -> HttpError {
        match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => HttpError::Timeout,
            _ => HttpError::Io(e),
        }
    }
}

impl fmt::Display for HttpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HttpError::Connect(e) => write!(f, "connect: {e}"),
            HttpError::Timeout => write!(f, "timed out"),
            HttpError::Io(e) => write!(f, "io: {e}"),
            HttpError::Protocol(m) => write!(f, "protocol: {m}"),
        }
    }
}

impl std::error::Error for HttpError {}

// === impl Exchange ===

/// One finished request/response.
#[derive(Clone, Debug)]
pub struct Exchange {
    pub status: u16,
    /// The `X-Router-Backend` response header, if any.
    pub backend: Option<String>,
    /// The `X-Router-Reason` response header, if any.
    pub reason: Option<String>,
    /// Request start to the first body byte (to the end of the head for empty bodies).
    pub ttft: Duration,
    pub total: Duration,
    pub body_bytes: usize,
    /// Present when the body reported `"cached_tokens":N`.
    pub usage: Option<Usage>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
}

impl Usage {
    /// From the last `cached_tokens` and `prompt_tokens` numbers in a JSON body or an
    /// SSE stream (whose final usage event comes last).
    pub fn scan(body: &[u8]) -> Option<Usage> {
        let cached_tokens = json::last_uint_field(body, "cached_tokens")?;
        Some(Usage {
            prompt_tokens: json::last_uint_field(body, "prompt_tokens").unwrap_or(0),
            cached_tokens,
        })
    }
}

// === impl Client ===

/// One keep-alive connection to the target, reopened on demand.
pub struct Client {
    target: Target,
    timeout: Duration,
    /// Request line and fixed headers, up to (not including) `Content-Length`.
    head_prefix: Vec<u8>,
    stream: Option<TcpStream>,
    recv: RecvBuf,
    request: Vec<u8>,
    body: Vec<u8>,
}

enum Failure {
    /// A reused connection turned out closed before any response byte came back:
    /// the server timed it out while idle. Worth one retry on a fresh connection.
    Stale,
    Failed(HttpError),
}

impl Client {
    /// `headers` are sent after the defaults and replace a default of the same name.
    pub fn new(
        target: Target,
        headers: &[(String, String)],
        sse: bool,
        timeout: Duration,
    ) -> Client {
        let accept = if sse {
            "text/event-stream"
        } else {
            "application/json"
        };
        let mut all: Vec<(String, String)> = vec![
            ("Host".into(), target.authority.clone()),
            ("User-Agent".into(), "radixgate-bench".into()),
            ("Content-Type".into(), "application/json".into()),
            ("Accept".into(), accept.into()),
        ];
        for (name, value) in headers {
            all.retain(|(n, _)| !n.eq_ignore_ascii_case(name));
            all.push((name.clone(), value.clone()));
        }
        let mut head_prefix = format!("POST {} HTTP/1.1\r\n", target.path).into_bytes();
        for (name, value) in &all {
            head_prefix.extend_from_slice(format!("{name}: {value}\r\n").as_bytes());
        }
        Client {
            target,
            timeout,
            head_prefix,
            stream: None,
            recv: RecvBuf::default(),
            request: Vec::new(),
            body: Vec::new(),
        }
    }

    /// Sends one POST with `body` and reads the whole response. Timing starts before
    /// a connect when the connection has to be (re)opened.
    pub fn send(&mut self, body: &[u8]) -> Result<Exchange, HttpError> {
        self.send_with(body, &[])
    }

    /// [`Self::send`] with extra headers for this request only (after the fixed ones;
    /// the caller keeps CR and LF out of them).
    pub fn send_with(
        &mut self,
        body: &[u8],
        headers: &[(&str, &str)],
    ) -> Result<Exchange, HttpError> {
        self.request.clear();
        self.request.extend_from_slice(&self.head_prefix);
        for (name, value) in headers {
            self.request
                .extend_from_slice(format!("{name}: {value}\r\n").as_bytes());
        }
        self.request
            .extend_from_slice(format!("Content-Length: {}\r\n\r\n", body.len()).as_bytes());
        self.request.extend_from_slice(body);
        let reused = self.stream.is_some();
        let result = match self.attempt(reused) {
            Err(Failure::Stale) => self.attempt(false),
            other => other,
        };
        result.map_err(|f| match f {
            Failure::Stale => HttpError::Protocol("connection closed before the response".into()),
            Failure::Failed(e) => e,
        })
    }

    fn attempt(&mut self, reused: bool) -> Result<Exchange, Failure> {
        let t0 = Instant::now();
        let result = self.exchange(t0, reused);
        if result.is_err() {
            self.stream = None;
            self.recv.clear();
        }
        result
    }

    fn exchange(&mut self, t0: Instant, reused: bool) -> Result<Exchange, Failure> {
        if self.stream.is_none() {
            self.stream = Some(self.connect().map_err(Failure::Failed)?);
            self.recv.clear();
        }
        let Some(stream) = self.stream.as_mut() else {
            unreachable!("connected above")
        };
        let early = |e: io::Error| {
            let closed = matches!(
                e.kind(),
                io::ErrorKind::BrokenPipe
                    | io::ErrorKind::ConnectionReset
                    | io::ErrorKind::ConnectionAborted
                    | io::ErrorKind::UnexpectedEof
            );
            if reused && closed {
                Failure::Stale
            } else {
                Failure::Failed(HttpError::from_io(e))
            }
        };
        stream.write_all(&self.request).map_err(early)?;

        // The head; 1xx interim responses are skipped.
        let mut received = false;
        let head = loop {
            if let Some(head) = parse_head(self.recv.avail()).map_err(Failure::Failed)? {
                self.recv.consume(head.len);
                if (100..200).contains(&head.status) {
                    continue;
                }
                break head;
            }
            if self.recv.avail().len() > MAX_HEAD {
                return Err(Failure::Failed(HttpError::Protocol(
                    "response head too large".into(),
                )));
            }
            let n = match self.recv.fill(stream) {
                Ok(n) => n,
                Err(e) if received => return Err(Failure::Failed(HttpError::from_io(e))),
                Err(e) => return Err(early(e)),
            };
            if n == 0 {
                return Err(if reused && !received {
                    Failure::Stale
                } else {
                    Failure::Failed(HttpError::Protocol(
                        "connection closed in the response head".into(),
                    ))
                });
            }
            received = true;
        };

        // The body.
        let fail = |e: HttpError| Failure::Failed(e);
        let closed_mid_body =
            || Failure::Failed(HttpError::Protocol("connection closed mid-body".into()));
        self.body.clear();
        let mut first_byte: Option<Instant> = None;
        let mut keep_alive = head.keep_alive;
        match head.framing {
            Framing::Empty | Framing::Length(0) => first_byte = Some(Instant::now()),
            Framing::Length(len) => {
                let mut left = len;
                loop {
                    let avail = self.recv.avail();
                    if !avail.is_empty() {
                        first_byte.get_or_insert_with(Instant::now);
                        let take = avail.len().min(usize::try_from(left).unwrap_or(usize::MAX));
                        self.body.extend_from_slice(&avail[..take]);
                        self.recv.consume(take);
                        left -= take as u64;
                    }
                    if left == 0 {
                        break;
                    }
                    if self
                        .recv
                        .fill(stream)
                        .map_err(|e| fail(HttpError::from_io(e)))?
                        == 0
                    {
                        return Err(closed_mid_body());
                    }
                }
            }
            Framing::Chunked => {
                let mut decoder = ChunkedDecoder::default();
                loop {
                    let before = self.body.len();
                    let body = &mut self.body;
                    let used = decoder
                        .feed(self.recv.avail(), |d| body.extend_from_slice(d))
                        .map_err(|e| fail(HttpError::Protocol(format!("chunked body: {e}"))))?;
                    self.recv.consume(used);
                    if self.body.len() > before {
                        first_byte.get_or_insert_with(Instant::now);
                    }
                    if decoder.is_done() {
                        break;
                    }
                    if self
                        .recv
                        .fill(stream)
                        .map_err(|e| fail(HttpError::from_io(e)))?
                        == 0
                    {
                        return Err(closed_mid_body());
                    }
                }
            }
            Framing::UntilClose => {
                keep_alive = false;
                loop {
                    let avail = self.recv.avail();
                    if !avail.is_empty() {
                        first_byte.get_or_insert_with(Instant::now);
                        self.body.extend_from_slice(avail);
                        let n = avail.len();
                        self.recv.consume(n);
                    }
                    if self
                        .recv
                        .fill(stream)
                        .map_err(|e| fail(HttpError::from_io(e)))?
                        == 0
                    {
                        break;
                    }
                }
            }
        }
        let end = Instant::now();
        // Bytes past the response mean we lost the framing: do not reuse the connection.
        if !keep_alive || !self.recv.avail().is_empty() {
            self.stream = None;
            self.recv.clear();
        }
        Ok(Exchange {
            status: head.status,
            backend: head.backend,
            reason: head.reason,
            ttft: first_byte.unwrap_or(end).duration_since(t0),
            total: end.duration_since(t0),
            body_bytes: self.body.len(),
            usage: Usage::scan(&self.body),
        })
    }

    fn connect(&self) -> Result<TcpStream, HttpError> {
        let stream = TcpStream::connect_timeout(&self.target.addr, self.timeout)
            .map_err(HttpError::Connect)?;
        stream.set_nodelay(true).map_err(HttpError::Connect)?;
        stream
            .set_read_timeout(Some(self.timeout))
            .map_err(HttpError::Connect)?;
        stream
            .set_write_timeout(Some(self.timeout))
            .map_err(HttpError::Connect)?;
        Ok(stream)
    }
}

// === impl RecvBuf ===

/// Bytes read from the socket and not yet consumed.
#[derive(Default)]
struct RecvBuf {
    data: Vec<u8>,
    start: usize,
}

impl RecvBuf {
    fn avail(&self) -> &[u8] {
        &self.data[self.start..]
    }

    fn consume(&mut self, n: usize) {
        self.start += n;
        if self.start == self.data.len() {
            self.clear();
        }
    }

    fn clear(&mut self) {
        self.data.clear();
        self.start = 0;
    }

    /// One `read` into the tail; `Ok(0)` at end of stream.
    fn fill(&mut self, stream: &mut TcpStream) -> io::Result<usize> {
        if self.start > 0 {
            self.data.drain(..self.start);
            self.start = 0;
        }
        let old = self.data.len();
        self.data.resize(old + READ_SIZE, 0);
        let result = loop {
            match stream.read(&mut self.data[old..]) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                other => break other,
            }
        };
        self.data.truncate(old + *result.as_ref().unwrap_or(&0));
        result
    }
}

// === response head ===

#[derive(Debug, PartialEq, Eq)]
enum Framing {
    /// 204, 304 and 1xx carry no body.
    Empty,
    Length(u64),
    Chunked,
    UntilClose,
}

#[derive(Debug)]
struct Head {
    /// Bytes of the head including the blank line.
    len: usize,
    status: u16,
    framing: Framing,
    keep_alive: bool,
    backend: Option<String>,
    reason: Option<String>,
}

/// `Ok(None)` until the blank line that ends the head has arrived.
fn parse_head(buf: &[u8]) -> Result<Option<Head>, HttpError> {
    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        return Ok(None);
    };
    let bad = |m: &str| HttpError::Protocol(m.to_string());
    let text = std::str::from_utf8(&buf[..end]).map_err(|_| bad("response head is not UTF-8"))?;
    let mut lines = text.split("\r\n");
    let status_line = lines.next().unwrap_or("");
    let mut parts = status_line.splitn(3, ' ');
    let version = parts.next().unwrap_or("");
    let http10 = match version {
        "HTTP/1.1" => false,
        "HTTP/1.0" => true,
        _ => return Err(bad("bad status line")),
    };
    let status: u16 = parts
        .next()
        .filter(|s| s.len() == 3)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad("bad status code"))?;

    let mut length: Option<u64> = None;
    let mut chunked = false;
    let mut keep_alive = !http10;
    let mut backend = None;
    let mut reason = None;
    for line in lines {
        let (name, value) = line
            .split_once(':')
            .ok_or_else(|| bad("header without a colon"))?;
        let (name, value) = (name.trim(), value.trim());
        if name.eq_ignore_ascii_case("content-length") {
            let n: u64 = value.parse().map_err(|_| bad("bad content-length"))?;
            if length.is_some_and(|l| l != n) {
                return Err(bad("conflicting content-length headers"));
            }
            length = Some(n);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            chunked = value
                .rsplit(',')
                .next()
                .is_some_and(|last| last.trim().eq_ignore_ascii_case("chunked"));
        } else if name.eq_ignore_ascii_case("connection") {
            for token in value.split(',').map(str::trim) {
                if token.eq_ignore_ascii_case("close") {
                    keep_alive = false;
                } else if token.eq_ignore_ascii_case("keep-alive") {
                    keep_alive = true;
                }
            }
        } else if name.eq_ignore_ascii_case("x-router-backend") {
            backend = Some(value.to_string());
        } else if name.eq_ignore_ascii_case("x-router-reason") {
            reason = Some(value.to_string());
        }
    }
    let framing = if (100..200).contains(&status) || status == 204 || status == 304 {
        Framing::Empty
    } else if chunked {
        Framing::Chunked
    } else if let Some(n) = length {
        Framing::Length(n)
    } else {
        Framing::UntilClose
    };
    Ok(Some(Head {
        len: end + 4,
        status,
        framing,
        keep_alive,
        backend,
        reason,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_framing_and_headers() {
        let raw = b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\nX-Router-Backend:  b1 \r\nX-Router-Reason: longest-prefix\r\n\r\nrest";
        let h = parse_head(raw).unwrap().unwrap();
        assert_eq!(h.reason.as_deref(), Some("longest-prefix"));
        assert_eq!(
            (h.status, h.keep_alive, h.backend.as_deref()),
            (200, true, Some("b1"))
        );
        assert_eq!(h.framing, Framing::Length(12));
        assert_eq!(&raw[h.len..], b"rest");
        let h = parse_head(b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\nContent-Length: 3\r\nConnection: close\r\n\r\n")
            .unwrap()
            .unwrap();
        assert_eq!((h.framing, h.keep_alive), (Framing::Chunked, false));
        let h = parse_head(b"HTTP/1.0 200 OK\r\n\r\n").unwrap().unwrap();
        assert_eq!((h.framing, h.keep_alive), (Framing::UntilClose, false));
        let h = parse_head(b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n")
            .unwrap()
            .unwrap();
        assert_eq!(h.framing, Framing::Empty);
        assert!(parse_head(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n")
            .unwrap()
            .is_none());
        assert!(parse_head(b"SPDY 200\r\n\r\n").is_err());
    }

    #[test]
    fn usage_from_json_and_sse() {
        let json = br#"{"usage":{"prompt_tokens":120,"completion_tokens":16,"prompt_tokens_details":{"cached_tokens":96}}}"#;
        assert_eq!(
            Usage::scan(json),
            Some(Usage {
                prompt_tokens: 120,
                cached_tokens: 96
            })
        );
        assert_eq!(Usage::scan(br#"{"usage":{"prompt_tokens":120}}"#), None);
    }

    #[test]
    fn parses_urls() {
        let t = Target::parse("http://127.0.0.1:8080/v1/chat/completions").unwrap();
        assert_eq!(t.addr, "127.0.0.1:8080".parse().unwrap());
        assert_eq!(
            (t.authority.as_str(), t.path.as_str()),
            ("127.0.0.1:8080", "/v1/chat/completions")
        );
        let t = Target::parse("http://[::1]:9000").unwrap();
        assert_eq!(
            (t.addr, t.path.as_str()),
            ("[::1]:9000".parse().unwrap(), "/")
        );
        assert_eq!(Target::parse("http://10.0.0.1/x").unwrap().addr.port(), 80);
        assert!(Target::parse("https://127.0.0.1/").is_err());
        assert!(Target::parse("127.0.0.1:80").is_err());
        assert!(Target::parse("http://127.0.0.1:99999/").is_err());
    }
}
