//! The simulated engine's KV-cache events, published as vLLM publishes them
//! (`--kv-events-config` with publisher `zmq`), so precise mode can be tested without
//! vLLM.
//!
//! - A PUB socket at `endpoint`, bound or connected by vLLM's own rule: bound when the
//!   endpoint has `*` or `::` in it or is `ipc://` / `inproc://`, connected otherwise
//!   (so `tcp://127.0.0.1:N` connects to a gateway that binds it, `tcp://*:N` binds for
//!   gateways that connect).
//! - Each message is three frames: the topic, an 8-byte big-endian sequence number
//!   (0, 1, 2, ...), and a msgpack `[ts, [event, ...], dp_rank]`. Events are maps with
//!   a `type` key, as vLLM 0.32 sends them: `BlockStored` (`block_hashes`,
//!   `parent_block_hash`, `token_ids`, `block_size`, `lora_id`, `medium`,
//!   `lora_name`), `BlockRemoved` (`block_hashes`, `medium`), `AllBlocksCleared`.
//!   Block hashes are the engine's own (8 bytes each), not the gateway's.
//! - With `replay`, a ROUTER socket bound there answers replay requests as vLLM's
//!   `_service_replay` does (vLLM 0.32): a request is `[identity, "", start_seq]`;
//!   every buffered batch with a sequence at or after `start_seq` goes back as
//!   `[identity, "", topic, seq, payload]`, then `[identity, "", "", -1, ""]` ends
//!   it. The last `buffer_steps` batches are kept.
//! - `lose_every` (tests): every Nth batch is buffered for replay but never sent on
//!   the PUB socket, a message lost on the wire.
//!
//! The sockets live on their own thread (`radixgate-engine-kv`), as vLLM's publisher
//! thread: the engine hands it batches over a channel and never waits on ZeroMQ.

use rmpv::Value;
use std::collections::VecDeque;
use std::io;
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// What the engine publishes and where (`radixgate engine-sim --kv-events ...`).
#[derive(Debug, Clone)]
pub struct SimKvEvents {
    /// The PUB socket's endpoint (vLLM's `endpoint`).
    pub endpoint: String,
    /// The replay ROUTER's endpoint, bound (vLLM's `replay_endpoint`).
    pub replay: Option<String>,
    /// The first frame of every message (vLLM's `topic`, default empty).
    pub topic: String,
    /// Batches kept for replay (vLLM's `buffer_steps`, default 10000).
    pub buffer_steps: usize,
    /// Every Nth batch is not sent (0: none lost).
    pub lose_every: u64,
}

impl SimKvEvents {
    pub fn new(endpoint: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            replay: None,
            topic: String::new(),
            buffer_steps: 10_000,
            lose_every: 0,
        }
    }
}

/// One KV-cache event; hashes are the engine's block keys.
#[derive(Debug, Clone, PartialEq)]
pub enum SimEvent {
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
        tokens: Vec<u32>,
        block_size: usize,
    },
    Removed {
        hashes: Vec<u64>,
    },
    Cleared,
}

/// The engine's end of the publisher thread.
pub struct Publisher {
    tx: flume::Sender<Vec<SimEvent>>,
}

impl Publisher {
    /// Queues one batch (never blocks; dropped if the thread has ended).
    pub fn publish(&self, batch: Vec<SimEvent>) {
        if !batch.is_empty() {
            let _ = self.tx.send(batch);
        }
    }
}

/// vLLM's rule for its PUB socket: bind a wildcard or a local transport, else connect.
pub fn binds(endpoint: &str) -> bool {
    endpoint.contains('*')
        || endpoint.contains("::")
        || endpoint.starts_with("ipc://")
        || endpoint.starts_with("inproc://")
}

/// Opens the sockets (errors fail the engine's start) and starts the thread; it ends
/// when the returned stop sender is dropped (or sends), or the [`Publisher`] is.
pub fn start(config: &SimKvEvents) -> io::Result<(Publisher, JoinHandle<()>, flume::Sender<()>)> {
    let ctx = zmq::Context::new();
    let err = |what: &str, e: zmq::Error| io::Error::other(format!("kv events: {what}: {e}"));
    let publisher = ctx.socket(zmq::PUB).map_err(|e| err("socket", e))?;
    publisher
        .set_sndhwm(100_000)
        .and_then(|_| publisher.set_linger(0))
        .map_err(|e| err("socket", e))?;
    if binds(&config.endpoint) {
        publisher
            .bind(&config.endpoint)
            .map_err(|e| err(&format!("cannot bind `{}`", config.endpoint), e))?;
    } else {
        publisher
            .connect(&config.endpoint)
            .map_err(|e| err(&format!("cannot connect `{}`", config.endpoint), e))?;
    }
    let router = match &config.replay {
        Some(endpoint) => {
            let r = ctx.socket(zmq::ROUTER).map_err(|e| err("socket", e))?;
            r.set_linger(0).map_err(|e| err("socket", e))?;
            r.bind(endpoint)
                .map_err(|e| err(&format!("cannot bind replay `{endpoint}`"), e))?;
            Some(r)
        }
        None => None,
    };
    let (tx, rx) = flume::unbounded::<Vec<SimEvent>>();
    let (stop_tx, stop_rx) = flume::bounded::<()>(1);
    let mut state = Thread {
        publisher,
        router,
        topic: config.topic.clone().into_bytes(),
        buffer: VecDeque::new(),
        buffer_steps: config.buffer_steps.max(1),
        lose_every: config.lose_every,
        next_seq: 0,
    };
    let thread = std::thread::Builder::new()
        .name("radixgate-engine-kv".into())
        .spawn(move || {
            let _ctx = ctx;
            while matches!(stop_rx.try_recv(), Err(flume::TryRecvError::Empty)) {
                match rx.recv_timeout(Duration::from_millis(5)) {
                    Ok(batch) => {
                        state.send(&batch);
                        while let Ok(batch) = rx.try_recv() {
                            state.send(&batch);
                        }
                    }
                    Err(flume::RecvTimeoutError::Timeout) => {}
                    Err(flume::RecvTimeoutError::Disconnected) => break,
                }
                state.serve_replays();
            }
        })?;
    Ok((Publisher { tx }, thread, stop_tx))
}

struct Thread {
    publisher: zmq::Socket,
    router: Option<zmq::Socket>,
    topic: Vec<u8>,
    buffer: VecDeque<(u64, Vec<u8>)>,
    buffer_steps: usize,
    lose_every: u64,
    next_seq: u64,
}

impl Thread {
    fn send(&mut self, batch: &[SimEvent]) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let payload = encode_batch(batch);
        let lost = self.lose_every > 0 && (seq + 1).is_multiple_of(self.lose_every);
        if !lost {
            let frames: [&[u8]; 3] = [&self.topic, &seq.to_be_bytes(), &payload];
            if let Err(e) = self.publisher.send_multipart(frames, zmq::DONTWAIT) {
                tracing::debug!(error = %e, "engine-sim: KV-event batch not sent");
            }
        }
        if self.buffer.len() == self.buffer_steps {
            self.buffer.pop_front();
        }
        self.buffer.push_back((seq, payload));
    }

    fn serve_replays(&mut self) {
        let Some(router) = &self.router else {
            return;
        };
        while let Ok(frames) = router.recv_multipart(zmq::DONTWAIT) {
            let [id, _, start] = &frames[..] else {
                continue; // vLLM logs and ignores a malformed request
            };
            let Ok(start) = <[u8; 8]>::try_from(start.as_slice()).map(u64::from_be_bytes) else {
                continue;
            };
            for (seq, payload) in self.buffer.iter().filter(|(s, _)| *s >= start) {
                let reply: [&[u8]; 5] = [id, b"", &self.topic, &seq.to_be_bytes(), payload];
                let _ = router.send_multipart(reply, zmq::DONTWAIT);
            }
            let end: [&[u8]; 5] = [id, b"", b"", &[0xff; 8], b""];
            let _ = router.send_multipart(end, zmq::DONTWAIT);
        }
    }
}

/// `[ts, [event, ...], dp_rank]` in msgpack, events as maps with a `type` key.
pub fn encode_batch(batch: &[SimEvent]) -> Vec<u8> {
    let ts = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    let key = |k: &str| Value::from(k);
    let hash = |h: u64| Value::Binary(h.to_be_bytes().to_vec());
    let hashes = |hs: &[u64]| Value::Array(hs.iter().map(|&h| hash(h)).collect());
    let events = batch
        .iter()
        .map(|e| match e {
            SimEvent::Stored {
                hashes: hs,
                parent,
                tokens,
                block_size,
            } => Value::Map(vec![
                (key("type"), key("BlockStored")),
                (key("block_hashes"), hashes(hs)),
                (key("parent_block_hash"), parent.map_or(Value::Nil, hash)),
                (
                    key("token_ids"),
                    Value::Array(tokens.iter().map(|&t| Value::from(t)).collect()),
                ),
                (key("block_size"), Value::from(*block_size as u64)),
                (key("lora_id"), Value::Nil),
                (key("medium"), key("GPU")),
                (key("lora_name"), Value::Nil),
            ]),
            SimEvent::Removed { hashes: hs } => Value::Map(vec![
                (key("type"), key("BlockRemoved")),
                (key("block_hashes"), hashes(hs)),
                (key("medium"), key("GPU")),
            ]),
            SimEvent::Cleared => Value::Map(vec![(key("type"), key("AllBlocksCleared"))]),
        })
        .collect();
    let v = Value::Array(vec![Value::F64(ts), Value::Array(events), Value::from(0)]);
    let mut out = Vec::new();
    let _ = rmpv::encode::write_value(&mut out, &v);
    out
}
