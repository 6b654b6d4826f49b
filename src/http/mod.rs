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
/// At most 19 digits, so the value always fits (one digit loop: `str::parse` after
/// the checks cost ~200 instructions per head).
pub fn parse_content_length(value: &[u8]) -> Option<u64> {
    let v = value.trim_ascii();
    if v.is_empty() || v.len() > 19 {
        return None;
    }
    let mut n: u64 = 0;
    for &b in v {
        if !b.is_ascii_digit() {
            return None;
        }
        n = n * 10 + u64::from(b - b'0');
    }
    Some(n)
}

#[cfg(test)]
mod tests {
    use super::parse_content_length;

    #[test]
    fn content_length_is_strict_decimal() {
        assert_eq!(parse_content_length(b"0"), Some(0));
        assert_eq!(parse_content_length(b" 2048 "), Some(2048));
        assert_eq!(
            parse_content_length(b"9999999999999999999"),
            Some(9_999_999_999_999_999_999)
        );
        for bad in [
            &b""[..],
            b"  ",
            b"+5",
            b"-5",
            b"1 2",
            b"12a",
            b"0x10",
            b"10000000000000000000",
        ] {
            assert_eq!(parse_content_length(bad), None, "{bad:?}");
        }
    }
}
