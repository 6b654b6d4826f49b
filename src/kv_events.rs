//! Precise mode's other half: the engines' own word on what their KV caches hold.
//!
//! vLLM publishes KV-cache events over ZeroMQ (`--kv-events-config`, publisher
//! `zmq`). Who binds is vLLM's rule: for a concrete `tcp://HOST:N` endpoint the engine
//! *connects* its PUB socket, so this side binds a SUB socket there
//! (`backends[].kv_events`, one gateway process only); for `tcp://*:N` or `ipc://`
//! the engine binds and this side connects (`backends[].kv_events_connect`), as any
//! number of gateway replicas can. All sockets are polled by one thread
//! (`radixgate-kv`), off the shards. Each message has three frames: topic, an 8-byte
//! big-endian sequence number, and a msgpack `[ts, [event, ...], dp_rank]` (or the
//! same as a map). vLLM 0.32 sends each event as a map with a `type` key; older
//! releases as a positional array tagged by name; both are read:
//!
//! - `BlockStored` (`block_hashes`, `parent_block_hash`, `token_ids`, `block_size`, ..):
//!   the engine computed these blocks. Their tokens are re-hashed with the gateway's
//!   own chain (the same [`PromptHasher`] token blocks requests get in precise mode,
//!   seeded by the backend's model, continuing from the parent's chain), and the whole
//!   chain is inserted for that backend. A chain's first blocks stored for a LoRA
//!   adapter (`lora_name`) are seeded as the adapter's requests are
//!   ([`adapter_seed_from`]), so they never match the base model's blocks; an
//!   adapter's blocks named only by `lora_id` (older vLLM) are not inserted at all
//!   (counted as rejected), for the same reason.
//! - `BlockRemoved` (`block_hashes`, ..): evicted; the block and its descendants are
//!   removed for that backend.
//! - `AllBlocksCleared`: the backend's entries are dropped.
//!
//! Engine block hashes (bytes or integers) are mapped to the gateway's chains per
//! backend. A gap in sequence numbers means lost events. With
//! `backends[].kv_events_replay` (vLLM's `replay_endpoint`, a ROUTER) a DEALER asks
//! for them back as vLLM's `_service_replay` expects: `["", start_seq]`; the answer
//! is `["", seq, payload]` per buffered batch, then `["", -1, ""]`. Live messages are
//! held meanwhile and applied after (those the replay covered are skipped). At start
//! a replay from 0 catches up with what the engine still buffers. Without a replay
//! socket, or when it does not end its answer within [`REPLAY_TIMEOUT`], or when its
//! buffer no longer reaches back to the gap, the backend's entries are dropped (marked
//! stale) and rebuilt from the events that follow, while routing-time inserts keep
//! serving in between. Nothing here waits on a socket: replies are polled with the
//! subscriptions. Changes go to the coordinator as ordinary [`IndexEvent`]s, so
//! every shard's replica gets them the usual way.

use crate::config::KvEventsSource;
use crate::replica::{IndexEvent, IndexOp, Origin};
use crossbeam_channel::{Receiver, TryRecvError};
use radixgate_orchestrator::{adapter_seed_from, model_seed, BackendIdx, PromptHasher};
use rmpv::Value;
use std::collections::{HashMap, VecDeque};
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long one poll waits before checking for shutdown.
const POLL_MS: i64 = 200;

/// How long a replay request may take (to its end marker) before the gap is handled
/// as if there were no replay socket: the backend's entries are dropped.
pub const REPLAY_TIMEOUT: Duration = Duration::from_secs(1);

/// Live messages held back while a replay is under way; beyond this the replay is
/// given up (as on a timeout).
const MAX_HELD: usize = 10_000;

/// vLLM's end-of-replay marker: sequence -1 as 8 big-endian bytes, empty payload.
pub const END_SEQ: [u8; 8] = [0xff; 8];

/// Per-backend counters, written by the `radixgate-kv` thread, read at scrape time.
#[derive(Default)]
pub struct KvEventCounters {
    pub stored_blocks: AtomicU64,
    pub removed_blocks: AtomicU64,
    pub cleared: AtomicU64,
    /// Sequence gaps seen and not filled by a replay (each drops the backend's
    /// entries: stale, then rebuilt).
    pub gaps: AtomicU64,
    /// Messages (event batches) received from the engine's replay socket and applied:
    /// gaps filled, or history caught up at start.
    pub replayed: AtomicU64,
    /// Messages or events that did not decode, or stored blocks whose parent was
    /// unknown.
    pub rejected: AtomicU64,
}

/// One subscription: which backend, where, and its model's hash seed.
pub struct Subscription {
    pub backend: BackendIdx,
    pub source: KvEventsSource,
    pub seed: u64,
}

impl Subscription {
    pub fn new(backend: BackendIdx, source: KvEventsSource, model: &str) -> Self {
        Self {
            backend,
            source,
            seed: model_seed(model),
        }
    }
}

/// The subscriptions' sockets, bound or connected, and their ZeroMQ context (the
/// replay sockets are made from it).
pub struct Sockets {
    ctx: zmq::Context,
    subs: Vec<(Subscription, zmq::Socket)>,
}

/// Binds (`kv_events`) or connects (`kv_events_connect`) every subscription's SUB
/// socket; errors here fail start-up. A connected socket needs no engine yet:
/// ZeroMQ connects, and reconnects, in the background.
pub fn bind(subs: Vec<Subscription>) -> Result<Sockets, String> {
    let ctx = zmq::Context::new();
    let subs = subs
        .into_iter()
        .map(|s| {
            let socket = ctx.socket(zmq::SUB).map_err(|e| e.to_string())?;
            let endpoint = &s.source.endpoint;
            socket
                .set_subscribe(b"")
                .and_then(|_| socket.set_rcvhwm(100_000))
                .and_then(|_| socket.set_reconnect_ivl_max(2_000))
                .map_err(|e| e.to_string())?;
            if s.source.connect {
                socket
                    .connect(endpoint)
                    .map_err(|e| format!("kv_events_connect: cannot connect `{endpoint}`: {e}"))?;
            } else {
                socket
                    .bind(endpoint)
                    .map_err(|e| format!("kv_events: cannot bind `{endpoint}`: {e}"))?;
            }
            if let Some(replay) = &s.source.replay {
                // Checked now so a malformed endpoint fails start-up, not the thread.
                replay_socket(&ctx, replay)?;
            }
            Ok((s, socket))
        })
        .collect::<Result<_, String>>()?;
    Ok(Sockets { ctx, subs })
}

/// A DEALER connected to an engine's replay ROUTER (never blocks: unsent requests
/// are dropped when it closes).
fn replay_socket(ctx: &zmq::Context, endpoint: &str) -> Result<zmq::Socket, String> {
    let socket = ctx.socket(zmq::DEALER).map_err(|e| e.to_string())?;
    socket
        .set_linger(0)
        .and_then(|_| socket.set_rcvhwm(0))
        .and_then(|_| socket.set_reconnect_ivl_max(2_000))
        .map_err(|e| e.to_string())?;
    socket
        .connect(endpoint)
        .map_err(|e| format!("kv_events_replay: cannot connect `{endpoint}`: {e}"))?;
    Ok(socket)
}

/// A replay under way: live messages wait in `held` until the replay's end marker
/// (or its deadline).
struct Pending {
    deadline: Instant,
    /// At start (nothing seen yet): a replay that does not answer is no gap.
    at_start: bool,
    held: VecDeque<Vec<Vec<u8>>>,
    /// The highest sequence applied from the replay.
    replayed_to: Option<u64>,
}

/// One backend's sockets and state on the `radixgate-kv` thread.
struct Link {
    state: BackendState,
    sub: zmq::Socket,
    /// The replay endpoint and its socket (made on first use, remade after a
    /// timeout so a late answer cannot mix with the next one).
    replay: Option<(String, Option<zmq::Socket>)>,
    pending: Option<Pending>,
}

/// Where the `radixgate-kv` thread's results go.
pub struct Outputs {
    /// To the coordinator, which applies the ops and fans them out to the shards.
    pub index: crossbeam_channel::Sender<IndexEvent>,
    /// Per backend slot, read at scrape time.
    pub counters: Arc<[KvEventCounters]>,
    /// Zero of the index's logical clock.
    pub epoch: Instant,
}

/// The `radixgate-kv` thread: polls the sockets until `stop` disconnects.
#[allow(clippy::disallowed_methods)] // its own thread, never a shard
pub fn run(sockets: Sockets, block_tokens: NonZeroUsize, out: Outputs, stop: Receiver<()>) {
    let Sockets { ctx, subs } = sockets;
    let Outputs {
        index,
        counters,
        epoch,
    } = out;
    let clock = || Instant::now().saturating_duration_since(epoch).as_millis() as u64;
    let send = |ops: Vec<IndexOp>| {
        for op in ops {
            let _ = index.send(IndexEvent {
                origin: Origin::Local,
                created: Instant::now(),
                op,
            });
        }
    };
    let mut links: Vec<Link> = subs
        .into_iter()
        .map(|(s, sub)| Link {
            state: BackendState::new(s.backend, s.seed, block_tokens),
            sub,
            replay: s.source.replay.map(|e| (e, None)),
            pending: None,
        })
        .collect();
    // At start, ask every replay socket for what it still holds.
    for link in &mut links {
        if link.replay.is_some() {
            link.request_replay(&ctx, 0, true);
        }
    }
    let mut frames = Vec::new();
    while matches!(stop.try_recv(), Err(TryRecvError::Empty)) {
        let now = Instant::now();
        let wait = links
            .iter()
            .filter_map(|l| l.pending.as_ref())
            .map(|p| p.deadline.saturating_duration_since(now).as_millis() as i64 + 1)
            .fold(POLL_MS, i64::min);
        // Each link's SUB socket, then its replay socket while a replay is pending.
        let mut items: Vec<zmq::PollItem> = Vec::with_capacity(links.len() * 2);
        let mut owner = Vec::with_capacity(links.len() * 2);
        for (k, l) in links.iter().enumerate() {
            items.push(l.sub.as_poll_item(zmq::POLLIN));
            owner.push((k, false));
            if let (Some(_), Some((_, Some(r)))) = (&l.pending, &l.replay) {
                items.push(r.as_poll_item(zmq::POLLIN));
                owner.push((k, true));
            }
        }
        if zmq::poll(&mut items, wait).is_err() {
            std::thread::sleep(Duration::from_millis(POLL_MS as u64));
            continue;
        }
        let ready: Vec<(usize, bool)> = items
            .iter()
            .zip(&owner)
            .filter(|(i, _)| i.is_readable())
            .map(|(_, o)| *o)
            .collect();
        drop(items);
        let now_ms = clock();
        for (k, replay) in ready {
            let link = &mut links[k];
            let c = &counters[link.state.backend];
            if replay {
                send(link.on_replay_ready(c, now_ms));
                continue;
            }
            // Drain what is queued without blocking.
            while let Ok(msg) = link.sub.recv_multipart(zmq::DONTWAIT) {
                frames.clear();
                frames.extend(msg);
                send(link.on_live(&ctx, &mut frames, c, now_ms));
            }
        }
        let now = Instant::now();
        for link in &mut links {
            if link.pending.as_ref().is_some_and(|p| p.deadline <= now) {
                let c = &counters[link.state.backend];
                send(link.give_up_replay(c, clock()));
            }
        }
    }
}

impl Link {
    /// Sends a replay request from `from` and starts holding live messages.
    fn request_replay(&mut self, ctx: &zmq::Context, from: u64, at_start: bool) -> bool {
        let Some((endpoint, socket)) = &mut self.replay else {
            return false;
        };
        if socket.is_none() {
            match replay_socket(ctx, endpoint) {
                Ok(s) => *socket = Some(s),
                Err(e) => {
                    tracing::warn!(backend = self.state.backend, error = %e, "KV-event replay socket");
                    return false;
                }
            }
        }
        let Some(s) = socket else {
            return false;
        };
        // A DEALER speaks to vLLM's ROUTER as a REQ would: an empty delimiter frame,
        // then the starting sequence number (8 bytes, big-endian).
        let request: [&[u8]; 2] = [b"", &from.to_be_bytes()];
        if s.send_multipart(request, zmq::DONTWAIT).is_err() {
            return false;
        }
        tracing::debug!(
            backend = self.state.backend,
            from,
            "KV-event replay requested"
        );
        self.pending = Some(Pending {
            deadline: Instant::now() + REPLAY_TIMEOUT,
            at_start,
            held: VecDeque::new(),
            replayed_to: None,
        });
        true
    }

    /// One live message: applied, held while a replay is pending, or (a gap with a
    /// replay socket) held while the missing sequence numbers are asked back.
    fn on_live(
        &mut self,
        ctx: &zmq::Context,
        frames: &mut Vec<Vec<u8>>,
        c: &KvEventCounters,
        now_ms: u64,
    ) -> Vec<IndexOp> {
        if let Some(p) = &mut self.pending {
            if p.held.len() >= MAX_HELD {
                let mut ops = self.give_up_replay(c, now_ms);
                ops.extend(self.state.on_message(frames, c, now_ms));
                return ops;
            }
            p.held.push_back(std::mem::take(frames));
            return Vec::new();
        }
        if let (Some(seq), Some(last)) = (seq_of(frames), self.state.last_seq) {
            // Only forward gaps are asked back: a sequence that went backwards is an
            // engine that restarted (its cache is empty anyway).
            if seq > last.wrapping_add(1)
                && seq > last
                && self.request_replay(ctx, last.wrapping_add(1), false)
            {
                if let Some(p) = &mut self.pending {
                    p.held.push_back(std::mem::take(frames));
                }
                return Vec::new();
            }
        }
        self.state.on_message(frames, c, now_ms)
    }

    /// Reads what the replay socket has: buffered batches, then the end marker.
    fn on_replay_ready(&mut self, c: &KvEventCounters, now_ms: u64) -> Vec<IndexOp> {
        let mut ops = Vec::new();
        loop {
            let Some((_, Some(socket))) = &self.replay else {
                return ops;
            };
            let Ok(mut msg) = socket.recv_multipart(zmq::DONTWAIT) else {
                return ops;
            };
            // [empty delimiter, topic, seq, payload] (the ROUTER's identity is gone;
            // the end is [delimiter, "", -1, ""]), as vLLM 0.32 answers. Earlier
            // vLLM sent no topic frame: [delimiter, seq, payload].
            if msg.first().is_some_and(Vec::is_empty) {
                msg.remove(0);
            }
            if msg.len() >= 3 {
                msg.remove(0);
            }
            let Some(p) = &mut self.pending else {
                continue; // a late answer to a replay already given up: dropped
            };
            if msg.first().is_some_and(|s| s.as_slice() == END_SEQ) {
                ops.extend(self.finish_replay(c, now_ms));
                return ops;
            }
            let Some(seq) = msg
                .first()
                .and_then(|s| <[u8; 8]>::try_from(s.as_slice()).ok())
            else {
                c.rejected.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            let seq = u64::from_be_bytes(seq);
            if self.state.last_seq.is_some_and(|last| seq <= last) {
                continue; // already applied
            }
            p.replayed_to = Some(seq);
            // The state sees it as a live message would come: [topic, seq, payload].
            let mut frames = Vec::with_capacity(3);
            frames.push(Vec::new());
            frames.extend(msg);
            let filled = self
                .state
                .last_seq
                .is_none_or(|last| seq == last.wrapping_add(1));
            if filled {
                c.replayed.fetch_add(1, Ordering::Relaxed);
            }
            ops.extend(self.state.on_message(&frames, c, now_ms));
        }
    }

    /// The replay ended: the held live messages follow (those the replay already
    /// covered are skipped; a gap left between them is handled as without replay).
    fn finish_replay(&mut self, c: &KvEventCounters, now_ms: u64) -> Vec<IndexOp> {
        let mut ops = Vec::new();
        let Some(p) = self.pending.take() else {
            return ops;
        };
        for frames in p.held {
            let covered = match (seq_of(&frames), p.replayed_to) {
                (Some(seq), Some(to)) => seq <= to,
                _ => false,
            };
            if !covered {
                ops.extend(self.state.on_message(&frames, c, now_ms));
            }
        }
        ops
    }

    /// The replay did not answer in time: as without one, a gap drops the backend's
    /// entries (not at start: nothing was known), then the held messages apply.
    fn give_up_replay(&mut self, c: &KvEventCounters, now_ms: u64) -> Vec<IndexOp> {
        let mut ops = Vec::new();
        let Some(p) = self.pending.take() else {
            return ops;
        };
        tracing::debug!(
            backend = self.state.backend,
            "KV-event replay gave no answer in time"
        );
        if let Some((_, socket)) = &mut self.replay {
            *socket = None; // a late answer must not mix with the next request's
        }
        if !p.at_start && p.replayed_to.is_none() {
            ops.extend(self.state.gap(c));
        }
        self.pending = Some(p);
        ops.extend(self.finish_replay(c, now_ms));
        ops
    }
}

/// The sequence number of a live message, if it has one.
fn seq_of(frames: &[Vec<u8>]) -> Option<u64> {
    let seq = frames.get(1)?;
    <[u8; 8]>::try_from(seq.as_slice())
        .ok()
        .map(u64::from_be_bytes)
}

/// What the gateway knows of one engine's cache: engine block hash → (the gateway's
/// chain hash for that block, the engine's parent hash).
struct BackendState {
    backend: BackendIdx,
    seed: u64,
    blocks: HashMap<u64, (u64, Option<u64>)>,
    last_seq: Option<u64>,
    hasher: PromptHasher,
}

impl BackendState {
    fn new(backend: BackendIdx, seed: u64, block_tokens: NonZeroUsize) -> Self {
        Self {
            backend,
            seed,
            blocks: HashMap::new(),
            last_seq: None,
            hasher: PromptHasher::for_tokens(block_tokens),
        }
    }

    /// Events were lost: drops what is known of this backend (counted as a gap).
    fn gap(&mut self, c: &KvEventCounters) -> Option<IndexOp> {
        c.gaps.fetch_add(1, Ordering::Relaxed);
        self.blocks.clear();
        self.last_seq = None;
        Some(IndexOp::Clear {
            backend: self.backend,
        })
    }

    /// Decodes one message and returns the index changes it implies.
    fn on_message(&mut self, frames: &[Vec<u8>], c: &KvEventCounters, now_ms: u64) -> Vec<IndexOp> {
        let mut ops = Vec::new();
        let backend = self.backend;
        let reject = |why: &str| {
            c.rejected.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(
                backend,
                frames = frames.len(),
                why,
                "KV-event message rejected"
            );
        };
        let (Some(seq), Some(payload)) = (frames.get(1), frames.get(2)) else {
            reject("fewer than three frames");
            return ops;
        };
        let Ok(seq) = <[u8; 8]>::try_from(seq.as_slice()).map(u64::from_be_bytes) else {
            reject("sequence frame is not 8 bytes");
            return ops;
        };
        if self
            .last_seq
            .is_some_and(|last| seq != last.wrapping_add(1))
        {
            // Lost events: what we hold for this backend may be wrong. Drop it all
            // and rebuild from here on.
            ops.extend(self.gap(c));
        }
        self.last_seq = Some(seq);
        let Ok(batch) = rmpv::decode::read_value(&mut payload.as_slice()) else {
            reject("payload is not msgpack");
            return ops;
        };
        // `[ts, [events], dp_rank]`, or the same as a map (`ts`, `events`,
        // `data_parallel_rank`) as msgspec writes a struct without `array_like`.
        let Some(events) = Event(&batch).field("events", 1).and_then(Value::as_array) else {
            reject("payload is not [ts, [events], ..]");
            return ops;
        };
        for event in events {
            if !self.on_event(event, c, now_ms, &mut ops) {
                reject("event not decoded or its parent block unknown");
            }
        }
        ops
    }

    /// Applies one event; false if it did not decode or could not be placed.
    fn on_event(
        &mut self,
        event: &Value,
        c: &KvEventCounters,
        now_ms: u64,
        ops: &mut Vec<IndexOp>,
    ) -> bool {
        let event = Event(event);
        match event.field("type", 0).and_then(Value::as_str) {
            Some("BlockStored") => {
                let (Some(hashes), Some(tokens)) = (
                    event.field("block_hashes", 1).and_then(Value::as_array),
                    event.field("token_ids", 3).and_then(Value::as_array),
                ) else {
                    return false;
                };
                let parent = event.field("parent_block_hash", 2).unwrap_or(&Value::Nil);
                let parent = if parent.is_nil() {
                    None
                } else {
                    match block_key(parent) {
                        Some(p) => Some(p),
                        None => return false,
                    }
                };
                // The chain's seed: the model's, or a LoRA adapter's (vLLM keeps each
                // adapter's blocks apart from the base model's, and so does the index).
                let root_seed = match (
                    event.field("lora_name", 7).and_then(Value::as_str),
                    event.field("lora_id", 5).filter(|v| !v.is_nil()),
                ) {
                    (Some(name), _) => adapter_seed_from(self.seed, name),
                    (None, Some(_)) => return false,
                    (None, None) => self.seed,
                };
                let Some(mut chain) = self.chain_of(parent) else {
                    // The parent was never seen (stored before we subscribed, or lost).
                    return false;
                };
                let ids: Option<Vec<u32>> = tokens
                    .iter()
                    .map(|t| t.as_u64().map(|v| v as u32))
                    .collect();
                let Some(ids) = ids else {
                    return false;
                };
                self.hasher
                    .reset(chain.last().copied().unwrap_or(root_seed));
                self.hasher.feed_token_ids(&ids);
                let new = self.hasher.blocks();
                if new.len() != hashes.len() {
                    // Block sizes disagree with routing.block_tokens.
                    return false;
                }
                let mut engine_parent = parent;
                for (h, &ours) in hashes.iter().zip(new) {
                    let Some(key) = block_key(h) else {
                        return false;
                    };
                    self.blocks.insert(key, (ours, engine_parent));
                    engine_parent = Some(key);
                }
                chain.extend_from_slice(new);
                c.stored_blocks
                    .fetch_add(new.len() as u64, Ordering::Relaxed);
                ops.push(IndexOp::Insert {
                    backend: self.backend,
                    blocks: chain.into(),
                    now_ms,
                });
                true
            }
            Some("BlockRemoved") => {
                let Some(hashes) = event.field("block_hashes", 1).and_then(Value::as_array) else {
                    return false;
                };
                for h in hashes {
                    let Some(key) = block_key(h) else {
                        return false;
                    };
                    let Some(chain) = self.chain_of(Some(key)) else {
                        continue;
                    };
                    self.blocks.remove(&key);
                    c.removed_blocks.fetch_add(1, Ordering::Relaxed);
                    let from = chain.len() - 1;
                    ops.push(IndexOp::Remove {
                        backend: self.backend,
                        blocks: chain.into(),
                        from,
                    });
                }
                true
            }
            Some("AllBlocksCleared") => {
                self.blocks.clear();
                c.cleared.fetch_add(1, Ordering::Relaxed);
                ops.push(IndexOp::Clear {
                    backend: self.backend,
                });
                true
            }
            _ => false,
        }
    }

    /// The gateway's chain from the root to engine block `block` (empty for `None`,
    /// the root); `None` if a block on the way is unknown.
    fn chain_of(&self, mut block: Option<u64>) -> Option<Vec<u64>> {
        let mut chain = Vec::new();
        while let Some(b) = block {
            let &(ours, parent) = self.blocks.get(&b)?;
            chain.push(ours);
            block = parent;
            if chain.len() > self.blocks.len() {
                return None; // a cycle: corrupt input
            }
        }
        chain.reverse();
        Some(chain)
    }
}

/// One event as vLLM encodes it: a map with a `type` key (vLLM 0.32), or a
/// positional array tagged by name in its first element (msgspec `array_like`).
struct Event<'a>(&'a Value);

impl<'a> Event<'a> {
    /// The field named `name` in map form, at `position` in array form.
    fn field(&self, name: &str, position: usize) -> Option<&'a Value> {
        match self.0 {
            Value::Map(entries) => entries
                .iter()
                .find(|(k, _)| k.as_str() == Some(name))
                .map(|(_, v)| v),
            Value::Array(fields) => fields.get(position),
            _ => None,
        }
    }
}

/// An engine block hash (vLLM sends bytes or an integer) as a map key.
fn block_key(v: &Value) -> Option<u64> {
    match v {
        Value::Integer(i) => i.as_u64().or_else(|| i.as_i64().map(|x| x as u64)),
        Value::Binary(b) => Some(xxhash_rust::xxh3::xxh3_64(b)),
        Value::String(s) => Some(xxhash_rust::xxh3::xxh3_64(s.as_bytes())),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).unwrap();
        out
    }

    fn message(seq: u64, events: Vec<Value>) -> Vec<Vec<u8>> {
        let batch = Value::Array(vec![Value::F64(1.0), Value::Array(events), Value::from(0)]);
        vec![b"kv".to_vec(), seq.to_be_bytes().to_vec(), encode(&batch)]
    }

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> Value {
        Value::Array(vec![
            Value::from("BlockStored"),
            Value::Array(
                hashes
                    .iter()
                    .map(|h| Value::Binary(h.to_be_bytes().to_vec()))
                    .collect(),
            ),
            parent.map_or(Value::Nil, |p| Value::Binary(p.to_be_bytes().to_vec())),
            Value::Array(tokens.iter().map(|&t| Value::from(t)).collect()),
            Value::from(4),
        ])
    }

    fn request_blocks(seed: u64, ids: &[u32]) -> Vec<u64> {
        let mut h = PromptHasher::for_tokens(NonZeroUsize::new(4).unwrap());
        h.reset(seed);
        h.feed_token_ids(ids);
        h.blocks().to_vec()
    }

    fn inserted(ops: &[IndexOp]) -> Vec<Vec<u64>> {
        ops.iter()
            .filter_map(|op| match op {
                IndexOp::Insert { blocks, .. } => Some(blocks.to_vec()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn stored_blocks_rebuild_the_requests_own_chain_across_events() {
        let c = KvEventCounters::default();
        let seed = model_seed("m");
        let mut s = BackendState::new(0, seed, NonZeroUsize::new(4).unwrap());
        let ids: Vec<u32> = (0..12).collect();
        // Two blocks, then a third stored later with the second as parent.
        let ops = s.on_message(&message(1, vec![stored(&[10, 11], None, &ids[..8])]), &c, 0);
        assert_eq!(inserted(&ops), vec![request_blocks(seed, &ids[..8])]);
        let ops = s.on_message(&message(2, vec![stored(&[12], Some(11), &ids[8..])]), &c, 0);
        assert_eq!(inserted(&ops), vec![request_blocks(seed, &ids)]);
        assert_eq!(c.stored_blocks.load(Ordering::Relaxed), 3);
        assert_eq!(c.rejected.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn an_adapters_blocks_get_the_adapters_chain_and_unnamed_ones_are_refused() {
        let c = KvEventCounters::default();
        let seed = model_seed("m");
        let mut s = BackendState::new(0, seed, NonZeroUsize::new(4).unwrap());
        let ids: Vec<u32> = (0..8).collect();
        let with_lora = |hashes: &[u64], parent, id: Value, name: Value| {
            let Value::Array(mut fields) = stored(hashes, parent, &ids[..4]) else {
                unreachable!()
            };
            fields.extend([id, Value::from("GPU"), name]);
            Value::Array(fields)
        };
        let ops = s.on_message(
            &message(
                1,
                vec![with_lora(&[20], None, Value::from(1), Value::from("a"))],
            ),
            &c,
            0,
        );
        let adapter = radixgate_orchestrator::adapter_seed("m", "a");
        assert_eq!(inserted(&ops), vec![request_blocks(adapter, &ids[..4])]);
        assert_ne!(
            request_blocks(adapter, &ids[..4]),
            request_blocks(seed, &ids[..4])
        );
        // A child continues the adapter's chain.
        let child = stored(&[21], Some(20), &ids[4..]);
        let ops = s.on_message(&message(2, vec![child]), &c, 0);
        assert_eq!(inserted(&ops), vec![request_blocks(adapter, &ids)]);
        // An adapter's root block known only by its id: not inserted anywhere.
        let ops = s.on_message(
            &message(3, vec![with_lora(&[30], None, Value::from(2), Value::Nil)]),
            &c,
            0,
        );
        assert!(inserted(&ops).is_empty());
        assert_eq!(c.rejected.load(Ordering::Relaxed), 1);
        // No adapter at all: the base model's chain.
        let ops = s.on_message(
            &message(4, vec![with_lora(&[40], None, Value::Nil, Value::Nil)]),
            &c,
            0,
        );
        assert_eq!(inserted(&ops), vec![request_blocks(seed, &ids[..4])]);
    }

    #[test]
    fn map_form_events_as_vllm_0_32_sends_them() {
        let c = KvEventCounters::default();
        let seed = model_seed("m");
        let mut s = BackendState::new(0, seed, NonZeroUsize::new(4).unwrap());
        let ids: Vec<u32> = (0..8).collect();
        let event = Value::Map(vec![
            (Value::from("type"), Value::from("BlockStored")),
            (
                Value::from("block_hashes"),
                Value::Array(vec![Value::from(u64::MAX), Value::from(7)]),
            ),
            (Value::from("parent_block_hash"), Value::Nil),
            (
                Value::from("token_ids"),
                Value::Array(ids.iter().map(|&t| Value::from(t)).collect()),
            ),
            (Value::from("block_size"), Value::from(4)),
        ]);
        let ops = s.on_message(&message(1, vec![event]), &c, 0);
        assert_eq!(inserted(&ops), vec![request_blocks(seed, &ids)]);
        let removed = Value::Map(vec![
            (Value::from("type"), Value::from("BlockRemoved")),
            (
                Value::from("block_hashes"),
                Value::Array(vec![Value::from(7)]),
            ),
        ]);
        let ops = s.on_message(&message(2, vec![removed]), &c, 0);
        assert!(
            matches!(&ops[..], [IndexOp::Remove { from: 1, .. }]),
            "{ops:?}"
        );
        assert_eq!(c.rejected.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn removal_drops_the_block_and_what_follows_it() {
        let c = KvEventCounters::default();
        let seed = model_seed("m");
        let mut s = BackendState::new(3, seed, NonZeroUsize::new(4).unwrap());
        let ids: Vec<u32> = (0..8).collect();
        s.on_message(&message(1, vec![stored(&[10, 11], None, &ids)]), &c, 0);
        let removed = Value::Array(vec![
            Value::from("BlockRemoved"),
            Value::Array(vec![Value::Binary(11u64.to_be_bytes().to_vec())]),
        ]);
        let ops = s.on_message(&message(2, vec![removed]), &c, 0);
        match &ops[..] {
            [IndexOp::Remove {
                backend,
                blocks,
                from,
            }] => {
                assert_eq!(*backend, 3);
                assert_eq!(blocks.to_vec(), request_blocks(seed, &ids));
                assert_eq!(*from, 1);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_sequence_gap_or_clear_drops_the_backend_and_unknown_parents_are_rejected() {
        let c = KvEventCounters::default();
        let mut s = BackendState::new(1, 7, NonZeroUsize::new(4).unwrap());
        s.on_message(&message(5, vec![stored(&[10], None, &[1, 2, 3, 4])]), &c, 0);
        let ops = s.on_message(&message(9, vec![]), &c, 0);
        assert!(matches!(ops[..], [IndexOp::Clear { backend: 1 }]));
        assert_eq!(c.gaps.load(Ordering::Relaxed), 1);
        // Block 10 was forgotten with the gap: a child of it cannot be placed.
        let ops = s.on_message(
            &message(10, vec![stored(&[11], Some(10), &[5, 6, 7, 8])]),
            &c,
            0,
        );
        assert!(ops.is_empty());
        assert_eq!(c.rejected.load(Ordering::Relaxed), 1);
        let cleared = Value::Array(vec![Value::from("AllBlocksCleared")]);
        let ops = s.on_message(&message(11, vec![cleared]), &c, 0);
        assert!(matches!(ops[..], [IndexOp::Clear { backend: 1 }]));
    }

    fn link(endpoint: &str) -> (zmq::Context, Link) {
        let ctx = zmq::Context::new();
        let sub = ctx.socket(zmq::SUB).unwrap();
        let link = Link {
            state: BackendState::new(0, model_seed("m"), NonZeroUsize::new(4).unwrap()),
            sub,
            replay: Some((endpoint.to_string(), None)),
            pending: None,
        };
        (ctx, link)
    }

    /// Reads the link's replay socket until its replay ends (or `limit`).
    fn drive_replay(link: &mut Link, c: &KvEventCounters, limit: Duration) -> Vec<IndexOp> {
        let end = Instant::now() + limit;
        let mut ops = Vec::new();
        while link.pending.is_some() && Instant::now() < end {
            if let Some((_, Some(s))) = &link.replay {
                let _ = s.poll(zmq::POLLIN, 20);
            }
            ops.extend(link.on_replay_ready(c, 0));
        }
        ops
    }

    #[test]
    fn a_gap_is_filled_from_a_vllm_style_replay_router() {
        let c = KvEventCounters::default();
        let ctx = zmq::Context::new();
        let router = ctx.socket(zmq::ROUTER).unwrap();
        router.bind("tcp://127.0.0.1:*").unwrap();
        let endpoint = router.get_last_endpoint().unwrap().unwrap();
        let (lctx, mut link) = link(&endpoint);
        let ids: Vec<u32> = (0..16).collect();
        let batches: Vec<Vec<Vec<u8>>> = (0..4)
            .map(|k| {
                let parent = (k > 0).then(|| 10 + k as u64 - 1);
                message(
                    1 + k as u64,
                    vec![stored(&[10 + k as u64], parent, &ids[4 * k..4 * k + 4])],
                )
            })
            .collect();
        assert_eq!(
            inserted(&link.on_live(&lctx, &mut batches[0].clone(), &c, 0)).len(),
            1
        );
        // Seq 2 and 3 are lost; 4 arrives: held, and 2.. asked back.
        assert!(link
            .on_live(&lctx, &mut batches[3].clone(), &c, 0)
            .is_empty());
        assert!(link.pending.is_some());
        // The engine's side, as vLLM's `_service_replay` answers.
        let request = router.recv_multipart(0).unwrap();
        assert_eq!(request.len(), 3, "identity, empty delimiter, start seq");
        assert!(request[1].is_empty());
        assert_eq!(request[2], 2u64.to_be_bytes());
        for b in &batches[1..] {
            router
                .send_multipart([&request[0][..], b"", &b[1], &b[2]], 0)
                .unwrap();
        }
        router
            .send_multipart([&request[0][..], b"", &END_SEQ[..], b""], 0)
            .unwrap();
        let ops = drive_replay(&mut link, &c, Duration::from_secs(5));
        assert!(link.pending.is_none(), "replay ended");
        // 2 and 3 from the replay; 4 replayed too (already held live: applied once).
        let chains = inserted(&ops);
        assert_eq!(chains.len(), 3, "{ops:?}");
        assert_eq!(chains[2], request_blocks(model_seed("m"), &ids));
        assert_eq!(c.gaps.load(Ordering::Relaxed), 0);
        assert_eq!(c.replayed.load(Ordering::Relaxed), 3);
        assert_eq!(c.rejected.load(Ordering::Relaxed), 0);
        assert_eq!(link.state.last_seq, Some(4));
    }

    #[test]
    #[allow(clippy::disallowed_methods)] // a test thread, not a shard
    fn a_replay_that_does_not_answer_falls_back_to_clearing() {
        let c = KvEventCounters::default();
        // Bound once to find a free port, then closed: nothing answers there.
        let probe = zmq::Context::new().socket(zmq::ROUTER).unwrap();
        probe.bind("tcp://127.0.0.1:*").unwrap();
        let endpoint = probe.get_last_endpoint().unwrap().unwrap();
        drop(probe);
        let (lctx, mut link) = link(&endpoint);
        let ids: Vec<u32> = (0..8).collect();
        let first = message(1, vec![stored(&[10], None, &ids[..4])]);
        link.on_live(&lctx, &mut first.clone(), &c, 0);
        let mut late = message(5, vec![stored(&[20], None, &ids[4..])]);
        assert!(link.on_live(&lctx, &mut late, &c, 0).is_empty());
        assert!(drive_replay(&mut link, &c, Duration::from_millis(300)).is_empty());
        std::thread::sleep(REPLAY_TIMEOUT);
        let ops = link.give_up_replay(&c, 0);
        assert!(matches!(ops[0], IndexOp::Clear { backend: 0 }), "{ops:?}");
        assert_eq!(
            inserted(&ops).len(),
            1,
            "the held message applies after the clear"
        );
        assert_eq!(c.gaps.load(Ordering::Relaxed), 1);
        assert_eq!(c.replayed.load(Ordering::Relaxed), 0);
        assert!(
            link.replay.as_ref().unwrap().1.is_none(),
            "socket remade next time"
        );
    }

    #[test]
    fn garbage_is_counted_not_fatal() {
        let c = KvEventCounters::default();
        let mut s = BackendState::new(0, 1, NonZeroUsize::new(4).unwrap());
        assert!(s.on_message(&[b"kv".to_vec()], &c, 0).is_empty());
        assert!(s
            .on_message(&[b"kv".to_vec(), vec![1, 2], vec![]], &c, 0)
            .is_empty());
        assert!(s
            .on_message(
                &[b"kv".to_vec(), 1u64.to_be_bytes().to_vec(), vec![0xc1]],
                &c,
                0
            )
            .is_empty());
        let odd = Value::Array(vec![Value::from("Mystery"), Value::from(1)]);
        assert!(s
            .on_message(&message(2, vec![odd, Value::from(3)]), &c, 0)
            .is_empty());
        assert_eq!(c.rejected.load(Ordering::Relaxed), 5);
    }
}
