//! The admin API: its own listener (loopback by default), bearer-token protected,
//! served by one plain thread so it never touches a shard.
//!
//! Requests that read or change fleet state go to the coordinator as
//! [`AdminRequest`]s over crossbeam and are answered from its authoritative view;
//! every change reaches the shards as one new fleet snapshot. A reload reads and
//! validates the config file here, off the coordinator (see [`crate::reload`]).
//! `GET /admin/config` shows every key in force (secrets redacted).
//! `GET /admin/shards` asks the shards themselves (see [`crate::placement`]).

use crate::config::{BackendConfig, Config};
use crate::error::{ErrorKind, GatewayError};
use crate::shard::Shared;
use crossbeam_channel::{bounded, Receiver, Sender};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Largest admin request body (a backend definition).
const MAX_BODY: usize = 64 << 10;

type Reply = Sender<Result<serde_json::Value, GatewayError>>;

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
    /// The configuration in force as JSON, secrets redacted.
    Config(Sender<serde_json::Value>),
    /// Add a validated backend (409 for a duplicate id).
    AddBackend {
        backend: Box<BackendConfig>,
        reply: Reply,
    },
    /// Remove the backend with this id (404 unknown, 409 the last one).
    RemoveBackend { id: String, reply: Reply },
    /// Apply a reloaded, validated config; the reply summarises what changed.
    Reload { config: Box<Config>, reply: Reply },
    /// The authoritative index and session bindings, for a joining cluster peer
    /// (asked by the cluster subscriber, not the admin API).
    Snapshot(Sender<crate::cluster::Snapshot>),
    /// A peer replica saw this backend slot fail (from the cluster subscriber).
    PeerFault { backend: usize },
    /// A peer's snapshot, as index ops: applied (and fanned out to every shard)
    /// before the reply, so a replica is ready only once its index holds it.
    LoadPeerOps {
        ops: Vec<crate::replica::IndexOp>,
        reply: Sender<()>,
    },
}

/// Serves the admin API on `listener` until `stop` fires or is dropped. `source` is
/// the config file a reload re-reads.
pub fn serve(
    listener: TcpListener,
    token: String,
    coordinator: Sender<AdminRequest>,
    source: Option<PathBuf>,
    shared: Arc<Shared>,
    stop: Receiver<()>,
) {
    let _ = listener.set_nonblocking(true);
    let ctx = Context {
        token,
        coordinator,
        source,
        shared,
    };
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                let _ = stream.set_nonblocking(false);
                // One write per response already; no Nagle wait on small answers.
                let _ = stream.set_nodelay(true);
                handle(stream, &ctx);
            }
            Err(_) => {
                if !matches!(stop.try_recv(), Err(crossbeam_channel::TryRecvError::Empty)) {
                    return;
                }
                wait_for_connection(&listener, STOP_CHECK);
            }
        }
    }
}

/// How often the idle admin thread checks whether the gateway is stopping.
const STOP_CHECK: Duration = Duration::from_millis(25);

/// Blocks until `listener` has a connection to accept or `timeout` passes. The
/// thread used to sleep `timeout` between accept attempts instead, so every admin
/// request that found it idle waited up to 25 ms before being read (issue 22's
/// "admin latency"); `poll` wakes as the connection arrives.
fn wait_for_connection(listener: &TcpListener, timeout: Duration) {
    use std::os::fd::AsRawFd;
    let mut pollfd = libc::pollfd {
        fd: listener.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd for the listener's open socket, borrowed for the call.
    unsafe { libc::poll(&mut pollfd, 1, timeout.as_millis() as libc::c_int) };
}

struct Context {
    token: String,
    coordinator: Sender<AdminRequest>,
    source: Option<PathBuf>,
    /// Read-only shard state: placements and command channels (`GET /admin/shards`).
    shared: Arc<Shared>,
}

fn handle(mut stream: TcpStream, ctx: &Context) {
    let token = ctx.token.as_str();
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = stream.set_write_timeout(Some(Duration::from_secs(5)));
    let mut buf = Vec::with_capacity(2048);
    let mut chunk = [0u8; 4096];
    let (method, path, authorized, head_len, body_len) = loop {
        match stream.read(&mut chunk) {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut req = httparse::Request::new(&mut headers);
        match req.parse(&buf) {
            Ok(httparse::Status::Complete(head_len)) => {
                let authorized = req.headers.iter().any(|h| {
                    h.name.eq_ignore_ascii_case("authorization")
                        && bearer(h.value).is_some_and(|t| {
                            constant_time_eq::constant_time_eq(t, token.as_bytes())
                        })
                });
                let body_len = req
                    .headers
                    .iter()
                    .find(|h| h.name.eq_ignore_ascii_case("content-length"))
                    .map_or(Some(0), |h| {
                        std::str::from_utf8(h.value)
                            .ok()?
                            .trim()
                            .parse::<usize>()
                            .ok()
                    });
                break (
                    req.method.unwrap_or("").to_string(),
                    req.path.unwrap_or("").to_string(),
                    authorized,
                    head_len,
                    body_len,
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
    let body = match body_len {
        Some(n) if n <= MAX_BODY => read_body(&mut stream, buf, head_len, n),
        _ => None,
    };
    let result = if !authorized {
        Err(GatewayError::new(
            ErrorKind::Unauthorized,
            "the admin API needs `Authorization: Bearer <admin token>`",
        ))
    } else if let Some(body) = body {
        route(&method, &path, &body, ctx)
    } else {
        Err(GatewayError::new(
            ErrorKind::BadHttp,
            format!("the admin request body must have a Content-Length of at most {MAX_BODY}"),
        ))
    };
    let response = match result {
        Ok((status, body)) => {
            let body = body.to_string();
            format!(
                "HTTP/1.1 {status} {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                crate::error::reason_phrase(status),
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

/// The `len`-byte body after the head (part of it may already be in `buf`).
fn read_body(
    stream: &mut TcpStream,
    mut buf: Vec<u8>,
    head_len: usize,
    len: usize,
) -> Option<Vec<u8>> {
    let mut body = buf.split_off(head_len);
    let mut chunk = [0u8; 4096];
    while body.len() < len {
        match stream.read(&mut chunk) {
            Ok(0) | Err(_) => return None,
            Ok(n) => body.extend_from_slice(&chunk[..n]),
        }
    }
    body.truncate(len);
    Some(body)
}

/// Sends `make(reply)` to the coordinator and waits for its answer.
pub(crate) fn ask<T>(
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
    body: &[u8],
    ctx: &Context,
) -> Result<(u16, serde_json::Value), GatewayError> {
    let coordinator = &ctx.coordinator;
    let path = path.split('?').next().unwrap_or("");
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let ok = |v| Ok((200, v));
    match (method, segments.as_slice()) {
        ("GET", ["admin", "backends"]) => ok(ask(coordinator, AdminRequest::Backends)?),
        ("GET", ["admin", "index"]) => ok(ask(coordinator, AdminRequest::Index)?),
        ("GET", ["admin", "config"]) => ok(ask(coordinator, AdminRequest::Config)?),
        ("GET", ["admin", "shards"]) => ok(crate::placement::shards_json(&ctx.shared)),
        ("GET", ["admin", "cluster"]) => match &ctx.shared.cluster {
            Some(status) => ok(status.to_json()),
            None => Err(GatewayError::new(
                ErrorKind::PathNotFound,
                "not in a cluster (set [cluster] url; docs/cluster.md)",
            )),
        },
        ("POST", ["admin", "backends", id, action @ ("drain" | "undrain")]) => {
            let id = id.to_string();
            let on = *action == "drain";
            ok(
                ask(coordinator, |reply| AdminRequest::Drain { id, on, reply })?
                    .map_err(|e| GatewayError::new(ErrorKind::PathNotFound, e))?,
            )
        }
        ("POST", ["admin", "backends"]) => {
            let backend = BackendConfig::from_json(body).map_err(|errors| {
                GatewayError::new(
                    ErrorKind::InvalidConfig,
                    format!("invalid backend: {}", errors.0.join("; ")),
                )
            })?;
            let backend = Box::new(backend);
            let added = ask(coordinator, |reply| AdminRequest::AddBackend {
                backend,
                reply,
            })??;
            Ok((201, added))
        }
        ("DELETE", ["admin", "backends", id]) => {
            let id = id.to_string();
            ok(ask(coordinator, |reply| AdminRequest::RemoveBackend {
                id,
                reply,
            })??)
        }
        ("POST", ["admin", "reload"]) => ok(crate::reload::from_file(
            ctx.source.as_deref(),
            coordinator,
        )?),
        (
            _,
            ["admin", "backends"]
            | ["admin", "index"]
            | ["admin", "config"]
            | ["admin", "shards"]
            | ["admin", "cluster"]
            | ["admin", "reload"]
            | ["admin", "backends", _]
            | ["admin", "backends", _, _],
        ) => Err(GatewayError::new(
            ErrorKind::MethodNotAllowed,
            "method not allowed on this admin endpoint",
        )),
        _ => Err(GatewayError::new(
            ErrorKind::PathNotFound,
            format!("no admin endpoint {path}"),
        )),
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
