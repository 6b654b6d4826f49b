//! The gateway's one error type and the one place errors become HTTP responses.
//!
//! Every failure a request can meet — bad input, unknown model, no backend, an
//! upstream that refuses or stalls — is a [`GatewayError`] that knows its kind, who is
//! at fault, and whether retrying elsewhere is safe. [`GatewayError::to_response`]
//! renders it in OpenAI's error shape: `{"error":{"message","type","param","code"}}`.

use std::fmt;
use std::io::Write;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The body is not valid JSON (or not a JSON object).
    MalformedJson,
    /// A field is missing or has the wrong type or value; `param` names it.
    InvalidParam,
    ModelNotFound,
    BodyTooLarge,
    HeadTooLarge,
    /// The HTTP framing itself is broken (bad head, bad chunking, conflicting lengths).
    BadHttp,
    PathNotFound,
    MethodNotAllowed,
    NoHealthyBackend,
    UpstreamRefused,
    UpstreamTimeout,
    /// The upstream answered with something that is not HTTP, or broke off.
    UpstreamProtocol,
    /// Missing or wrong credentials.
    Unauthorized,
    /// An endpoint radixgate does not offer yet.
    NotImplemented,
    /// A tenant quota (requests, tokens or concurrency) refused the request.
    RateLimited,
    /// An admin change that clashes with the current state (a duplicate backend id).
    Conflict,
    /// A config (file or admin API backend) that fails validation; the message lists
    /// every error with its key path.
    InvalidConfig,
    /// The request target is longer than `server.max_uri_bytes`.
    UriTooLong,
    /// The client did not send its head or body in time (slowloris guard).
    RequestTimeout,
    /// Admission: the best backend's estimated TTFT exceeds the request's budget.
    SloUnattainable,
    /// Admission or the connection cap: the gateway sheds load (fleet pressure, a
    /// full or timed-out edge queue, too many connections on the shard).
    Overloaded,
    /// The request carries images or audio and no backend of its model takes them.
    UnsupportedMedia,
    /// The client closed its connection before the answer was complete (nginx's
    /// 499): never sent, only logged and counted. The upstream request is aborted
    /// and the backend is not blamed.
    ClientClosed,
}

/// The status logged and counted for a request whose client left first (nginx's 499
/// "client closed request"; never sent, the connection is gone).
pub const CLIENT_CLOSED: u16 = 499;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    Client,
    Upstream,
    Gateway,
}

#[derive(Debug, Clone)]
pub struct GatewayError {
    pub kind: ErrorKind,
    pub message: String,
    pub param: Option<String>,
}

impl GatewayError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            param: None,
        }
    }

    pub fn invalid_param(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            kind: ErrorKind::InvalidParam,
            message: message.into(),
            param: Some(param.into()),
        }
    }

    pub fn status(&self) -> u16 {
        match self.kind {
            ErrorKind::MalformedJson
            | ErrorKind::InvalidParam
            | ErrorKind::BadHttp
            | ErrorKind::InvalidConfig => 400,
            ErrorKind::Conflict => 409,
            ErrorKind::ModelNotFound | ErrorKind::PathNotFound => 404,
            ErrorKind::MethodNotAllowed => 405,
            ErrorKind::BodyTooLarge => 413,
            ErrorKind::HeadTooLarge => 431,
            ErrorKind::NoHealthyBackend => 503,
            ErrorKind::UpstreamRefused | ErrorKind::UpstreamProtocol => 502,
            ErrorKind::UpstreamTimeout => 504,
            ErrorKind::Unauthorized => 401,
            ErrorKind::NotImplemented => 501,
            ErrorKind::RateLimited | ErrorKind::SloUnattainable => 429,
            ErrorKind::Overloaded => 503,
            ErrorKind::UriTooLong => 414,
            ErrorKind::RequestTimeout => 408,
            ErrorKind::UnsupportedMedia => 415,
            ErrorKind::ClientClosed => CLIENT_CLOSED,
        }
    }

    pub fn fault(&self) -> Fault {
        match self.kind {
            ErrorKind::MalformedJson
            | ErrorKind::InvalidParam
            | ErrorKind::ModelNotFound
            | ErrorKind::BodyTooLarge
            | ErrorKind::HeadTooLarge
            | ErrorKind::BadHttp
            | ErrorKind::PathNotFound
            | ErrorKind::MethodNotAllowed
            | ErrorKind::Unauthorized
            | ErrorKind::RateLimited
            | ErrorKind::Conflict
            | ErrorKind::InvalidConfig
            | ErrorKind::SloUnattainable
            | ErrorKind::UriTooLong
            | ErrorKind::RequestTimeout
            | ErrorKind::UnsupportedMedia
            | ErrorKind::ClientClosed => Fault::Client,
            ErrorKind::UpstreamRefused
            | ErrorKind::UpstreamTimeout
            | ErrorKind::UpstreamProtocol => Fault::Upstream,
            ErrorKind::NoHealthyBackend | ErrorKind::NotImplemented | ErrorKind::Overloaded => {
                Fault::Gateway
            }
        }
    }

    /// Whether the same request may be sent to another backend: only when the
    /// upstream failed before it could have produced anything the client saw.
    pub fn retry_safe(&self) -> bool {
        matches!(
            self.kind,
            ErrorKind::UpstreamRefused | ErrorKind::UpstreamTimeout | ErrorKind::UpstreamProtocol
        )
    }

    /// OpenAI's `error.type`.
    pub fn error_type(&self) -> &'static str {
        if matches!(
            self.kind,
            ErrorKind::RateLimited | ErrorKind::SloUnattainable
        ) {
            return "rate_limit_error";
        }
        match self.fault() {
            Fault::Client => "invalid_request_error",
            Fault::Upstream | Fault::Gateway => "server_error",
        }
    }

    /// OpenAI's `error.code`.
    pub fn code(&self) -> &'static str {
        match self.kind {
            ErrorKind::MalformedJson => "invalid_json",
            ErrorKind::InvalidParam => "invalid_value",
            ErrorKind::ModelNotFound => "model_not_found",
            ErrorKind::BodyTooLarge => "request_too_large",
            ErrorKind::HeadTooLarge => "headers_too_large",
            ErrorKind::BadHttp => "bad_request",
            ErrorKind::PathNotFound => "not_found",
            ErrorKind::MethodNotAllowed => "method_not_allowed",
            ErrorKind::NoHealthyBackend => "no_healthy_backend",
            ErrorKind::UpstreamRefused => "upstream_unavailable",
            ErrorKind::UpstreamTimeout => "upstream_timeout",
            ErrorKind::UpstreamProtocol => "upstream_error",
            ErrorKind::Unauthorized => "invalid_api_key",
            ErrorKind::NotImplemented => "not_implemented",
            ErrorKind::RateLimited => "rate_limit_exceeded",
            ErrorKind::Conflict => "conflict",
            ErrorKind::InvalidConfig => "invalid_config",
            ErrorKind::SloUnattainable => "slo_unattainable",
            ErrorKind::Overloaded => "overloaded",
            ErrorKind::UriTooLong => "uri_too_long",
            ErrorKind::RequestTimeout => "request_timeout",
            ErrorKind::UnsupportedMedia => "unsupported_media",
            ErrorKind::ClientClosed => "client_closed",
        }
    }

    /// The JSON body in OpenAI's error shape.
    pub fn body(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(128 + self.message.len());
        out.extend_from_slice(b"{\"error\":{\"message\":");
        write_json_string(&mut out, &self.message);
        out.extend_from_slice(b",\"type\":\"");
        out.extend_from_slice(self.error_type().as_bytes());
        out.extend_from_slice(b"\",\"param\":");
        match &self.param {
            Some(p) => write_json_string(&mut out, p),
            None => out.extend_from_slice(b"null"),
        }
        out.extend_from_slice(b",\"code\":\"");
        out.extend_from_slice(self.code().as_bytes());
        out.extend_from_slice(b"\"}}");
        out
    }

    /// The whole HTTP response: status line, headers, JSON body. `extra_headers` are
    /// complete `Name: value\r\n` lines (for `Allow`, `X-Request-Id`, ...).
    pub fn to_response(&self, extra_headers: &[u8], keep_alive: bool) -> Vec<u8> {
        let body = self.body();
        let mut out = Vec::with_capacity(256 + body.len());
        let status = self.status();
        let _ = write!(
            out,
            "HTTP/1.1 {} {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
            status,
            reason_phrase(status),
            body.len()
        );
        if self.kind == ErrorKind::Unauthorized {
            out.extend_from_slice(b"WWW-Authenticate: Bearer\r\n");
        }
        if self.kind == ErrorKind::MethodNotAllowed && !contains_header(extra_headers, b"allow:") {
            out.extend_from_slice(b"Allow: GET, POST\r\n");
        }
        out.extend_from_slice(extra_headers);
        if !keep_alive {
            out.extend_from_slice(b"Connection: close\r\n");
        }
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(&body);
        out
    }
}

fn contains_header(block: &[u8], lower_name: &[u8]) -> bool {
    block.split(|&b| b == b'\n').any(|line| {
        line.len() >= lower_name.len() && line[..lower_name.len()].eq_ignore_ascii_case(lower_name)
    })
}

impl fmt::Display for GatewayError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.message, self.code())
    }
}

impl std::error::Error for GatewayError {}

pub fn reason_phrase(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "OK",
        201 => "Created",
        400 => "Bad Request",
        401 => "Unauthorized",
        501 => "Not Implemented",
        404 => "Not Found",
        405 => "Method Not Allowed",
        409 => "Conflict",
        408 => "Request Timeout",
        414 => "URI Too Long",
        415 => "Unsupported Media Type",
        413 => "Payload Too Large",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        499 => "Client Closed Request",
        500 => "Internal Server Error",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Unknown",
    }
}

/// Appends `s` as a JSON string literal.
pub fn write_json_string(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    for &b in s.as_bytes() {
        match b {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\r' => out.extend_from_slice(b"\\r"),
            b'\t' => out.extend_from_slice(b"\\t"),
            0..=0x1f => {
                let _ = write!(out, "\\u{:04x}", b);
            }
            _ => out.push(b),
        }
    }
    out.push(b'"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_openai_shape() {
        let e = GatewayError::invalid_param("messages[0].role", "`role` must be a \"string\"");
        let body = String::from_utf8(e.body()).unwrap();
        assert_eq!(
            body,
            r#"{"error":{"message":"`role` must be a \"string\"","type":"invalid_request_error","param":"messages[0].role","code":"invalid_value"}}"#
        );
        let resp = String::from_utf8(e.to_response(b"", true)).unwrap();
        assert!(resp.starts_with("HTTP/1.1 400 Bad Request\r\n"));
        assert!(resp.contains(&format!("Content-Length: {}\r\n", body.len())));
    }

    #[test]
    fn method_not_allowed_has_allow() {
        let e = GatewayError::new(ErrorKind::MethodNotAllowed, "no");
        let resp = String::from_utf8(e.to_response(b"Allow: POST\r\n", true)).unwrap();
        assert!(resp.contains("Allow: POST\r\n"));
        assert!(!resp.contains("Allow: GET, POST"));
    }
}
