//! HTTP/1.1 on the shard, in both directions, parsed with httparse.
//!
//! `request` parses client request heads (framing, keep-alive, the headers that go
//! upstream), `response` parses upstream response heads, `chunked` tracks chunked
//! framing, and `io` holds the rent-style read helpers shared by the server side, the
//! upstream client and the simulated engine.

pub mod chunked;
pub mod conn;
pub mod io;
pub mod request;
pub mod response;

/// How a message body is delimited on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyFraming {
    /// No body at all.
    Empty,
    Length(u64),
    Chunked,
    /// Read until the peer closes (responses only).
    UntilClose,
}

/// Headers that describe one connection hop, never forwarded (RFC 9110 §7.6.1).
pub fn is_hop_by_hop(name: &str) -> bool {
    const HOP: [&str; 9] = [
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "proxy-authorization",
        "proxy-authenticate",
    ];
    HOP.iter().any(|h| h.eq_ignore_ascii_case(name))
}

/// Whether a comma-separated header value (e.g. `Connection: keep-alive, Foo`)
/// contains `token`, ignoring case.
pub fn header_has_token(value: &[u8], token: &str) -> bool {
    value
        .split(|&b| b == b',')
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(token.as_bytes()))
}

/// Parses a decimal Content-Length value strictly (digits only, no sign, no overflow).
pub fn parse_content_length(value: &[u8]) -> Option<u64> {
    let v = value.trim_ascii();
    if v.is_empty() || v.len() > 19 || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(v).ok()?.parse().ok()
}
