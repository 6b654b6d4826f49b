//! The admin API: its own listener (loopback by default), bearer-token protected,
//! served by one plain thread so it never touches a shard.
//!
//! Requests that read or change fleet state go to the coordinator as
//! [`AdminRequest`]s over crossbeam and are answered from its authoritative view;
//! every change reaches the shards as one new fleet snapshot. A reload reads and
//! validates the config file here, off the coordinator (see [`crate::reload`]).
//! `GET /admin/config` shows every key in force (secrets redacted).
//! `GET /admin/shards` asks the shards themselves (see [`crate::placement`]).
//! `GET /admin/capacity` shows the capacity signal's last report (see
//! [`crate::capacity`]).

use crate::config::BackendConfig;
use crate::control::{ask, AdminRequest, Shared};
use crate::error::{ErrorKind, GatewayError};
use crate::http::request::bearer;
use crossbeam_channel::{Receiver, Sender};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Largest admin request body (a backend definition).
const MAX_BODY: usize = 64 << 10;

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
/// request that found it idle waited up to 25 ms before being read (the probe's
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
        ("GET", ["admin", "shards"]) => ok(shards_json(&ctx.shared)),
        ("GET", ["admin", "capacity"]) => ok(match ctx.shared.capacity.get() {
            Some(report) => report.to_json(),
            None => serde_json::json!({ "samples": 0, "pools": [] }),
        }),
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
            | ["admin", "capacity"]
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

/// The body of `GET /admin/shards`: per shard, its placement, the kernel's view of
/// its thread and its live counters. Blocks the calling (admin) thread up to 2 s for
/// the shards' counters; a shard that does not answer in time is listed without them.
fn shards_json(shared: &Shared) -> serde_json::Value {
    let (rx, asked) = shared.ask_shards_for_metrics();
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    let mut collected: Vec<Option<crate::metrics::ShardMetrics>> =
        (0..shared.shard_commands.len()).map(|_| None).collect();
    for _ in 0..asked {
        match rx.recv_deadline(deadline) {
            Ok(m) => {
                let k = m.shard;
                collected[k] = Some(m);
            }
            Err(_) => break,
        }
    }
    let backends = crate::backends::MAX_BACKEND_SLOTS;
    let shards: Vec<serde_json::Value> = collected
        .iter()
        .enumerate()
        .map(|(k, m)| {
            let p = shared.placements.get(k);
            let tid = p.map(|p| p.tid);
            let stat = tid.and_then(crate::placement::thread_stat);
            let counters = m.as_ref().map(|m| {
                serde_json::json!({
                    "requests": m.requests.values().sum::<u64>(),
                    "open_connections": m.open_connections,
                    "active_requests": m.active_requests,
                    "in_flight_upstream": (0..backends)
                        .map(|b| u64::from(shared.in_flight.get(k, b)))
                        .sum::<u64>(),
                    "queued": m.queue_depth,
                    "index_events_published": m.index_events_published,
                    "replica_events_applied": m.replica_applied,
                    "replica_blocks": m.replica_blocks,
                })
            });
            serde_json::json!({
                "shard": k,
                "thread": format!("radixgate-shard-{k}"),
                "thread_id": tid,
                "core": p.and_then(|p| p.core),
                "pinned": p.is_some_and(|p| p.pinned),
                "io": p.map(|p| p.driver.as_str()),
                "cpus_allowed": tid.and_then(|t| crate::placement::thread_status(t, "Cpus_allowed_list")),
                "last_cpu": stat.map(|s| s.0),
                "cpu_seconds": stat.map(|s| s.1),
                "counters": counters,
            })
        })
        .collect();
    serde_json::json!({
        "shards": shards,
        "coordinator_core": shared.config.server.coordinator_core,
    })
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
