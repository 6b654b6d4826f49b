//! The simulated engine's side of disaggregated serving, in both protocols, so that
//! the gateway's prefill/decode orchestration runs against engines that check it.
//!
//! - **vLLM** (NIXL-style): a prefill engine given `kv_transfer_params.do_remote_decode`
//!   computes the prompt, answers one token with `kv_transfer_params` naming its engine
//!   id, the block ids, its host and port, and holds those blocks for `hold`. A decode
//!   engine given `do_remote_prefill` pulls them from the named prefill engine (a
//!   `POST /kv/pull` to `remote_host:remote_port`, as a connector pulls KV from the
//!   prefill side), which hands them over once and only to the same `X-Request-Id`;
//!   unknown, expired or already pulled blocks make the decode engine answer 400, as a
//!   real connector error does. A transfer costs `tokens × kv_bytes_per_token /
//!   link_bytes_per_sec`, and the decode engine then skips prefill.
//! - **SGLang**: a prefill engine given a `bootstrap_room` computes the prompt and
//!   publishes the room on its bootstrap port; a decode engine given the same room asks
//!   `bootstrap_host:bootstrap_port` for it (`POST /kv/room`), waiting up to `hold` for
//!   the prefill to finish (the two legs arrive at the same time), and answers 400 if
//!   it never does.
//!
//! Requests without these fields are served whole, as an engine with `kv_both` would.

use crate::config::{Protocol, Role};
use monoio::io::{AsyncReadRent, AsyncWriteRentExt};
use monoio::net::TcpStream;
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

/// A simulated engine's place in a split pool.
#[derive(Debug, Clone)]
pub struct SimDisagg {
    /// `Prefill` or `Decode` (`Both` serves whole requests only).
    pub role: Role,
    pub protocol: Protocol,
    /// KV bytes per token (Llama-3-8B in bf16: 128 KiB).
    pub kv_bytes_per_token: u64,
    /// Link bandwidth between prefill and decode engines, bytes per second.
    pub link_bytes_per_sec: f64,
    /// How long a prefill engine holds handed-off blocks (vLLM) or a finished room
    /// (SGLang), and how long a decode engine waits for a room.
    pub hold: Duration,
}

impl SimDisagg {
    pub fn new(role: Role, protocol: Protocol) -> Self {
        Self {
            role,
            protocol,
            kv_bytes_per_token: 128 << 10,
            link_bytes_per_sec: 10e9,
            hold: Duration::from_secs(30),
        }
    }

    pub fn transfer_time(&self, tokens: u64) -> Duration {
        if self.link_bytes_per_sec <= 0.0 {
            return Duration::ZERO;
        }
        Duration::from_secs_f64(
            tokens as f64 * self.kv_bytes_per_token as f64 / self.link_bytes_per_sec,
        )
    }
}

/// What a request asks of this engine in a split pool.
#[derive(Debug)]
pub enum Leg {
    /// A whole request (no hand-off fields).
    Whole,
    /// vLLM: compute the prompt and hand it off.
    VllmPrefill,
    /// SGLang: compute the prompt and publish it in `room`.
    SglangPrefill { room: u64 },
    /// Decode from KV pulled from a prefill engine.
    Decode(Pull),
}

/// Where a decode engine pulls its KV from.
#[derive(Debug)]
pub enum Pull {
    Vllm {
        from: SocketAddr,
        engine_id: String,
        block_ids: Vec<u64>,
    },
    Sglang {
        from: SocketAddr,
        room: u64,
    },
}

/// Reads the hand-off fields of a request body for an engine with `role`.
pub fn leg(role: Role, protocol: Protocol, body: &[u8]) -> Result<Leg, String> {
    let v: serde_json::Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    match protocol {
        Protocol::Vllm => {
            let Some(p) = v.get("kv_transfer_params").filter(|p| !p.is_null()) else {
                return Ok(Leg::Whole);
            };
            let flag = |k: &str| p.get(k).and_then(|x| x.as_bool()).unwrap_or(false);
            match role {
                Role::Prefill if flag("do_remote_decode") => Ok(Leg::VllmPrefill),
                Role::Decode if flag("do_remote_prefill") => {
                    let host = p["remote_host"]
                        .as_str()
                        .ok_or("kv_transfer_params.remote_host missing")?;
                    let port = p["remote_port"]
                        .as_u64()
                        .ok_or("kv_transfer_params.remote_port missing")?;
                    let ip: IpAddr = host
                        .parse()
                        .map_err(|_| format!("remote_host `{host}` is not an IP"))?;
                    let engine_id = p["remote_engine_id"]
                        .as_str()
                        .ok_or("kv_transfer_params.remote_engine_id missing")?
                        .to_string();
                    let block_ids = p["remote_block_ids"]
                        .as_array()
                        .ok_or("kv_transfer_params.remote_block_ids missing")?
                        .iter()
                        .filter_map(|b| b.as_u64())
                        .collect();
                    Ok(Leg::Decode(Pull::Vllm {
                        from: SocketAddr::new(ip, port as u16),
                        engine_id,
                        block_ids,
                    }))
                }
                _ => Err(format!(
                    "kv_transfer_params do not fit a {} engine",
                    role.as_str()
                )),
            }
        }
        Protocol::Sglang => {
            let Some(room) = v.get("bootstrap_room").and_then(|r| r.as_u64()) else {
                return Ok(Leg::Whole);
            };
            match role {
                Role::Prefill => Ok(Leg::SglangPrefill { room }),
                Role::Decode => {
                    let host = v["bootstrap_host"]
                        .as_str()
                        .ok_or("bootstrap_host missing")?;
                    let port = v["bootstrap_port"]
                        .as_u64()
                        .ok_or("bootstrap_port missing")?;
                    let ip: IpAddr = host
                        .parse()
                        .map_err(|_| format!("bootstrap_host `{host}` is not an IP"))?;
                    Ok(Leg::Decode(Pull::Sglang {
                        from: SocketAddr::new(ip, port as u16),
                        room,
                    }))
                }
                Role::Both => Ok(Leg::Whole),
            }
        }
    }
}

struct Held {
    tokens: u64,
    blocks: usize,
    request_id: String,
    expires: Instant,
}

enum Room {
    Ready { tokens: u64, expires: Instant },
    Waiting(Vec<flume::Sender<u64>>),
}

/// A prefill engine's hand-off state: blocks held for decode engines (vLLM) and
/// rooms (SGLang).
#[derive(Default)]
pub struct Handoffs {
    held: HashMap<u64, Held>,
    rooms: HashMap<u64, Room>,
    next_block: u64,
}

impl Handoffs {
    /// vLLM: holds `tokens` of KV in fresh blocks for `request_id`; the block ids.
    pub fn hold(
        &mut self,
        tokens: u64,
        block_tokens: usize,
        request_id: &str,
        hold: Duration,
    ) -> Vec<u64> {
        let now = Instant::now();
        self.held.retain(|_, h| h.expires > now);
        let blocks = (tokens as usize).div_ceil(block_tokens.max(1)).max(1);
        let first = self.next_block;
        self.next_block += blocks as u64;
        self.held.insert(
            first,
            Held {
                tokens,
                blocks,
                request_id: request_id.to_string(),
                expires: now + hold,
            },
        );
        (first..first + blocks as u64).collect()
    }

    /// vLLM: hands the blocks over once; the tokens they hold.
    pub fn take(&mut self, block_ids: &[u64], request_id: &str) -> Result<u64, String> {
        let first = *block_ids.first().ok_or("no block ids")?;
        let h = self.held.get(&first).ok_or("unknown block ids")?;
        if h.expires <= Instant::now() {
            self.held.remove(&first);
            return Err("the blocks expired".into());
        }
        if h.blocks != block_ids.len() {
            return Err("block ids do not match the hand-off".into());
        }
        if h.request_id != request_id {
            return Err(format!(
                "request id `{request_id}` does not match the prefill's `{}`",
                h.request_id
            ));
        }
        Ok(self.held.remove(&first).map_or(0, |h| h.tokens))
    }

    /// SGLang: the prefill for `room` finished.
    pub fn publish(&mut self, room: u64, tokens: u64, hold: Duration) {
        let now = Instant::now();
        self.rooms
            .retain(|_, r| !matches!(r, Room::Ready { expires, .. } if *expires <= now));
        if let Some(Room::Waiting(waiters)) = self.rooms.remove(&room) {
            for w in waiters {
                if w.send(tokens).is_ok() {
                    return;
                }
            }
        }
        self.rooms.insert(
            room,
            Room::Ready {
                tokens,
                expires: now + hold,
            },
        );
    }

    /// SGLang: the room's tokens now, or a receiver for when its prefill finishes.
    pub fn join(&mut self, room: u64) -> Result<u64, flume::Receiver<u64>> {
        match self.rooms.remove(&room) {
            Some(Room::Ready { tokens, expires }) if expires > Instant::now() => Ok(tokens),
            Some(Room::Waiting(mut waiters)) => {
                let (tx, rx) = flume::bounded(1);
                waiters.push(tx);
                self.rooms.insert(room, Room::Waiting(waiters));
                Err(rx)
            }
            _ => {
                let (tx, rx) = flume::bounded(1);
                self.rooms.insert(room, Room::Waiting(vec![tx]));
                Err(rx)
            }
        }
    }
}

/// `kv_transfer_params` a vLLM prefill engine returns.
pub fn transfer_params(engine_id: &str, block_ids: &[u64], addr: SocketAddr) -> serde_json::Value {
    serde_json::json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_engine_id": engine_id,
        "remote_block_ids": block_ids,
        "remote_host": addr.ip().to_string(),
        "remote_port": addr.port(),
        "tp_size": 1,
    })
}

/// Pulls KV for a decode engine: the tokens moved, or why not.
pub async fn pull(pull: &Pull, request_id: &str, timeout: Duration) -> Result<u64, String> {
    let (from, path, body) = match pull {
        Pull::Vllm {
            from,
            engine_id,
            block_ids,
        } => (
            *from,
            "/kv/pull",
            serde_json::json!({"engine_id": engine_id, "block_ids": block_ids, "request_id": request_id}),
        ),
        Pull::Sglang { from, room } => (*from, "/kv/room", serde_json::json!({ "room": room })),
    };
    let body = body.to_string();
    let ask = post(from, path, body.as_bytes());
    match monoio::time::timeout(timeout + Duration::from_secs(1), ask).await {
        Ok(Ok((200, body))) => serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v["tokens"].as_u64())
            .ok_or_else(|| "the prefill engine's answer has no tokens".into()),
        Ok(Ok((status, body))) => Err(format!(
            "the prefill engine at {from} refused the KV transfer ({status}: {})",
            String::from_utf8_lossy(&body)
        )),
        Ok(Err(e)) => Err(format!("the prefill engine at {from} is unreachable: {e}")),
        Err(_) => Err(format!("the KV transfer from {from} timed out")),
    }
}

/// One `POST` with `Connection: close`; the status and body.
async fn post(addr: SocketAddr, path: &str, body: &[u8]) -> std::io::Result<(u16, Vec<u8>)> {
    let mut s = TcpStream::connect_addr(addr).await?;
    let mut req = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    req.extend_from_slice(body);
    let (r, _) = s.write_all(req).await;
    r?;
    let mut out = Vec::new();
    loop {
        let buf = Vec::with_capacity(8192);
        let (r, buf) = s.read(buf).await;
        match r? {
            0 => break,
            _ => out.extend_from_slice(&buf),
        }
    }
    let status = out
        .get(9..12)
        .and_then(|s| std::str::from_utf8(s).ok())
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let split = out
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or(out.len(), |p| p + 4);
    Ok((status, out[split..].to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_handed_over_once_to_the_same_request() {
        let mut h = Handoffs::default();
        let ids = h.hold(100, 16, "r1", Duration::from_secs(5));
        assert_eq!(ids.len(), 7);
        assert!(h.take(&ids, "r2").unwrap_err().contains("does not match"));
        assert!(h.take(&ids[..3], "r1").is_err());
        assert_eq!(h.take(&ids, "r1"), Ok(100));
        assert_eq!(h.take(&ids, "r1").unwrap_err(), "unknown block ids");
        let ids = h.hold(10, 16, "r3", Duration::ZERO);
        assert!(h.take(&ids, "r3").is_err());
    }

    #[test]
    fn rooms_join_before_or_after_the_prefill() {
        let mut h = Handoffs::default();
        h.publish(7, 42, Duration::from_secs(5));
        assert_eq!(h.join(7).ok(), Some(42));
        let rx = h.join(8).unwrap_err();
        h.publish(8, 9, Duration::from_secs(5));
        assert_eq!(rx.try_recv(), Ok(9));
    }

    #[test]
    fn transfer_time_is_tokens_times_bytes_over_bandwidth() {
        let d = SimDisagg {
            kv_bytes_per_token: 1000,
            link_bytes_per_sec: 1e6,
            ..SimDisagg::new(Role::Decode, Protocol::Vllm)
        };
        assert_eq!(d.transfer_time(500), Duration::from_millis(500));
    }
}
