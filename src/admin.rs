//! The admin API: its own listener (loopback by default), bearer-token protected,
//! served by one plain thread so it never touches a shard.
//!
//! Requests that read or change fleet state go to the coordinator as
//! [`AdminRequest`]s over crossbeam and are answered from its authoritative view;
//! every change reaches the shards as one new fleet snapshot.

use crate::error::{ErrorKind, GatewayError};
use crossbeam_channel::{bounded, Receiver, Sender};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

/// What the admin thread asks the coordinator; each carries its reply channel.
pub enum AdminRequest {
    /// JSON array describing every backend.
    Backends(Sender<serde_json::Value>),
    /// Drain (`on = true`) or undrain a backend by id; `Err` for an unknown id.
    Drain {
        id: String,
        on: bool,
        reply: Sender<Result<serde_json::Value, String>>,
    },
    /// JSON summary of the prefix index.
    Index(Sender<serde_json::Value>),
}

/// Serves the admin API on `listener` until `stop` fires or is dropped.
pub fn serve(
    listener: TcpListener,
    token: String,
    coordinator: Sender<AdminRequest>,
    stop: Receiver<()>,
) {
    let _ = listener.set_nonblocking(true);
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                let _ = stream.set_nonblocking(false);
                handle(stream, &token, &coordinator);
            }
            Err(_) => {
                if !matches!(
                    stop.recv_timeout(Duration::from_millis(25)),
                    Err(crossbeam_channel::RecvTimeoutError::Timeout)
                ) {
                    return;
                }
            }
        }
    }
}

fn handle(mut stream: TcpStream, token: &str, coordinator: &Sender<AdminRequest>) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = stream.set_write_timeout(Some(Duration::from_secs(5)));
    let mut buf = Vec::with_capacity(2048);
    let mut chunk = [0u8; 4096];
    let (method, path, authorized) = loop {
        match stream.read(&mut chunk) {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut req = httparse::Request::new(&mut headers);
        match req.parse(&buf) {
            Ok(httparse::Status::Complete(_)) => {
                let authorized = req.headers.iter().any(|h| {
                    h.name.eq_ignore_ascii_case("authorization")
                        && bearer(h.value).is_some_and(|t| {
                            constant_time_eq::constant_time_eq(t, token.as_bytes())
                        })
                });
                break (
                    req.method.unwrap_or("").to_string(),
                    req.path.unwrap_or("").to_string(),
                    authorized,
                );
            }
            Ok(httparse::Status::Partial) if buf.len() < 16 << 10 => continue,
            _ => {
                let e = GatewayError::new(ErrorKind::BadHttp, "malformed admin request");
                let _ = stream.write_all(&e.to_response(b"", false));
                return;
            }
        }
    };
    let result = if authorized {
        route(&method, &path, coordinator)
    } else {
        Err(GatewayError::new(
            ErrorKind::Unauthorized,
            "the admin API needs `Authorization: Bearer <admin token>`",
        ))
    };
    let response = match result {
        Ok(body) => {
            let body = body.to_string();
            format!(
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            )
            .into_bytes()
        }
        Err(e) => e.to_response(b"", false),
    };
    let _ = stream.write_all(&response);
}

/// The token of an `Authorization: Bearer <token>` value.
pub fn bearer(value: &[u8]) -> Option<&[u8]> {
    let v = value.trim_ascii();
    if v.len() > 7 && v[..7].eq_ignore_ascii_case(b"bearer ") {
        Some(v[7..].trim_ascii())
    } else {
        None
    }
}

fn ask<T>(
    coordinator: &Sender<AdminRequest>,
    make: impl FnOnce(Sender<T>) -> AdminRequest,
) -> Result<T, GatewayError> {
    let (tx, rx) = bounded(1);
    let unavailable = || {
        GatewayError::new(
            ErrorKind::NoHealthyBackend,
            "the coordinator is not answering",
        )
    };
    coordinator.send(make(tx)).map_err(|_| unavailable())?;
    rx.recv_timeout(Duration::from_secs(5))
        .map_err(|_| unavailable())
}

fn route(
    method: &str,
    path: &str,
    coordinator: &Sender<AdminRequest>,
) -> Result<serde_json::Value, GatewayError> {
    let path = path.split('?').next().unwrap_or("");
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    match (method, segments.as_slice()) {
        ("GET", ["admin", "backends"]) => ask(coordinator, AdminRequest::Backends),
        ("GET", ["admin", "index"]) => ask(coordinator, AdminRequest::Index),
        ("POST", ["admin", "backends", id, action @ ("drain" | "undrain")]) => {
            let id = id.to_string();
            let on = *action == "drain";
            ask(coordinator, |reply| AdminRequest::Drain { id, on, reply })?
                .map_err(|e| GatewayError::new(ErrorKind::PathNotFound, e))
        }
        ("POST", ["admin", "backends"]) | ("DELETE", ["admin", "backends", _]) | ("POST", ["admin", "reload"]) => {
            Err(GatewayError::new(
                ErrorKind::NotImplemented,
                "adding and removing backends and config reload are not implemented yet; restart with the new config",
            ))
        }
        (_, ["admin", "backends"] | ["admin", "index"] | ["admin", "backends", _, _]) => Err(GatewayError::new(
            ErrorKind::MethodNotAllowed,
            "method not allowed on this admin endpoint",
        )),
        _ => Err(GatewayError::new(ErrorKind::PathNotFound, format!("no admin endpoint {path}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_parsing() {
        assert_eq!(bearer(b"Bearer abc"), Some(&b"abc"[..]));
        assert_eq!(bearer(b"bearer  abc "), Some(&b"abc"[..]));
        assert_eq!(bearer(b"Basic abc"), None);
        assert_eq!(bearer(b"Bearer"), None);
    }
}
