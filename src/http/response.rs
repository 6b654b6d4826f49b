//! Upstream response heads: status, framing, keep-alive, and the header lines the
//! gateway passes on to the client.
//!
//! Chunked framing is passed through byte for byte (the shard tracks it with
//! [`super::chunked::ChunkedDecoder`]), so `Transfer-Encoding` is kept; every other
//! hop-by-hop header is dropped.

use super::{header_has_token, is_hop_by_hop, parse_content_length, BodyFraming};
use std::mem::MaybeUninit;

const MAX_HEADERS: usize = 64;

#[derive(Debug, Default)]
pub struct ResponseHead {
    pub status: u16,
    pub framing: Option<BodyFraming>,
    pub keep_alive: bool,
    pub event_stream: bool,
    /// The reason phrase, then the `Name: value\r\n` lines to pass to the client: one
    /// buffer, which the caller may lend ([`ResponseHead::with_buffer`]) so that a
    /// parse allocates nothing (two fresh allocations per response cost ~230
    /// instructions).
    text: Vec<u8>,
    reason_len: usize,
}

impl ResponseHead {
    /// A head that parses into `buf` (cleared), e.g. one of the shard's buffers.
    pub fn with_buffer(mut buf: Vec<u8>) -> Self {
        buf.clear();
        Self {
            text: buf,
            ..Self::default()
        }
    }

    /// Takes the head's buffer back (its reason and header lines go with it).
    pub fn take_buffer(&mut self) -> Vec<u8> {
        self.reason_len = 0;
        std::mem::take(&mut self.text)
    }

    pub fn framing(&self) -> BodyFraming {
        self.framing.unwrap_or(BodyFraming::UntilClose)
    }

    pub fn reason(&self) -> &[u8] {
        &self.text[..self.reason_len]
    }

    /// `Name: value\r\n` lines to pass to the client.
    pub fn forward_headers(&self) -> &[u8] {
        &self.text[self.reason_len..]
    }
}

#[derive(Debug)]
pub struct BadResponse(pub String);

/// Parses a response head at the start of `buf`; `None` if more bytes are needed.
/// `head_request` marks a response to HEAD (no body whatever the headers say).
pub fn parse_response_head(
    buf: &[u8],
    head: &mut ResponseHead,
    head_request: bool,
) -> Result<Option<usize>, BadResponse> {
    // Left uninitialised: httparse writes only the headers it finds.
    let mut headers = [const { MaybeUninit::<httparse::Header>::uninit() }; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut []);
    let len = match httparse::ParserConfig::default().parse_response_with_uninit_headers(
        &mut resp,
        buf,
        &mut headers,
    ) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => {
            return Err(BadResponse(format!(
                "malformed upstream response head: {e}"
            )))
        }
    };
    let status = resp.code.unwrap_or(0);
    head.status = status;
    head.keep_alive = resp.version == Some(1);
    head.event_stream = false;
    head.text.clear();
    // Room for the reason and every header line at once: the lines passed on are a
    // subset of the head (a fresh head would otherwise grow line by line, five
    // reallocations for an engine's usual head).
    head.text.reserve(len);
    let reason = resp.reason.unwrap_or("").as_bytes();
    head.text.extend_from_slice(reason);
    head.reason_len = reason.len();
    let mut content_length = None;
    let mut chunked = false;
    let mut connection_tokens: Option<&[u8]> = None;
    for h in resp.headers.iter() {
        if h.name.eq_ignore_ascii_case("content-length") {
            content_length = Some(parse_content_length(h.value).ok_or_else(|| {
                BadResponse("invalid Content-Length in upstream response".into())
            })?);
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            chunked = header_has_token(h.value, "chunked");
        } else if h.name.eq_ignore_ascii_case("connection") {
            if header_has_token(h.value, "close") {
                head.keep_alive = false;
            } else if header_has_token(h.value, "keep-alive") {
                head.keep_alive = true;
            }
            connection_tokens = Some(h.value);
        } else if h.name.eq_ignore_ascii_case("content-type") {
            head.event_stream = h.value.starts_with(b"text/event-stream");
        }
    }
    let no_body = head_request || status < 200 || status == 204 || status == 304;
    head.framing = Some(if no_body {
        BodyFraming::Empty
    } else if chunked {
        BodyFraming::Chunked
    } else {
        match content_length {
            Some(0) => BodyFraming::Empty,
            Some(n) => BodyFraming::Length(n),
            None => {
                head.keep_alive = false;
                BodyFraming::UntilClose
            }
        }
    });
    for h in resp.headers.iter() {
        let keep_framing = h.name.eq_ignore_ascii_case("transfer-encoding") && chunked;
        if (!keep_framing && is_hop_by_hop(h.name))
            || h.name.eq_ignore_ascii_case("x-request-id")
            || connection_tokens.is_some_and(|c| header_has_token(c, h.name))
        {
            continue;
        }
        if keep_framing {
            head.text
                .extend_from_slice(b"Transfer-Encoding: chunked\r\n");
            continue;
        }
        head.text.extend_from_slice(h.name.as_bytes());
        head.text.extend_from_slice(b": ");
        head.text.extend_from_slice(h.value);
        head.text.extend_from_slice(b"\r\n");
    }
    Ok(Some(len))
}

/// `fmt::Write` into a byte vector.
pub struct Utf8Vec<'a>(pub &'a mut Vec<u8>);

impl std::fmt::Write for Utf8Vec<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.0.extend_from_slice(s.as_bytes());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunked_sse_head() {
        let raw = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\nTransfer-Encoding: chunked\r\nConnection: keep-alive\r\nX-Request-Id: up\r\n\r\n";
        let mut head = ResponseHead::default();
        let n = parse_response_head(raw, &mut head, false).unwrap().unwrap();
        assert_eq!(n, raw.len());
        assert_eq!(head.framing(), BodyFraming::Chunked);
        assert!(head.event_stream && head.keep_alive);
        assert_eq!(head.reason(), b"OK");
        assert_eq!(
            head.forward_headers(),
            b"Content-Type: text/event-stream; charset=utf-8\r\nTransfer-Encoding: chunked\r\n"
        );
    }

    #[test]
    fn close_delimited() {
        let mut head = ResponseHead::default();
        parse_response_head(b"HTTP/1.1 200 OK\r\n\r\n", &mut head, false).unwrap();
        assert_eq!(head.framing(), BodyFraming::UntilClose);
        assert!(!head.keep_alive);
    }

    #[test]
    fn partial_and_header_count_limit() {
        let mut head = ResponseHead::default();
        assert!(
            parse_response_head(b"HTTP/1.1 200 OK\r\nContent-Le", &mut head, false)
                .unwrap()
                .is_none()
        );
        let head_with = |n: usize| {
            let mut raw = b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\n".to_vec();
            for i in 1..n {
                raw.extend_from_slice(format!("X-H{i}: v\r\n").as_bytes());
            }
            raw.extend_from_slice(b"\r\n");
            raw
        };
        let raw = head_with(MAX_HEADERS);
        let n = parse_response_head(&raw, &mut head, false)
            .unwrap()
            .unwrap();
        assert_eq!(n, raw.len());
        assert_eq!(head.framing(), BodyFraming::Length(7));
        assert!(head.forward_headers().ends_with(b"X-H63: v\r\n"));
        assert!(parse_response_head(&head_with(MAX_HEADERS + 1), &mut head, false).is_err());
    }

    /// A head parsed into a lent buffer holding old bytes, then again (after an
    /// interim 1xx) into the same one: each parse starts clean.
    #[test]
    fn reparse_into_a_lent_buffer() {
        let mut head = ResponseHead::with_buffer(b"stale bytes".to_vec());
        let raw = b"HTTP/1.1 100 Continue\r\nX-A: 1\r\n\r\n";
        assert_eq!(
            parse_response_head(raw, &mut head, false).unwrap(),
            Some(raw.len())
        );
        assert_eq!((head.status, head.reason()), (100, &b"Continue"[..]));
        assert_eq!(head.forward_headers(), b"X-A: 1\r\n");
        let raw = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 2\r\n\r\n{}";
        parse_response_head(raw, &mut head, false).unwrap();
        assert_eq!(head.reason(), b"Service Unavailable");
        assert_eq!(head.forward_headers(), b"Content-Length: 2\r\n");
        assert_eq!(head.framing(), BodyFraming::Length(2));
        let buf = head.take_buffer();
        assert!(buf.starts_with(b"Service Unavailable"));
        assert!(head.reason().is_empty() && head.forward_headers().is_empty());
    }
}
