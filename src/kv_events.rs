//! Precise mode's other half: the engines' own word on what their KV caches hold.
//!
//! vLLM publishes KV-cache events over ZeroMQ (`--kv-events-config`, publisher
//! `zmq`). For a concrete `tcp://127.0.0.1:N` endpoint the engine *connects* its PUB
//! socket, so this side binds a SUB socket there, one per backend with
//! `backends[].kv_events`, all polled by one thread (`radixgate-kv`), off the shards.
//! Each message has three frames: topic, an 8-byte big-endian sequence number, and a
//! msgpack `[ts, [event, ...], dp_rank]`. vLLM 0.32 sends each event as a map with a
//! `type` key; older releases as a positional array tagged by name; both are read:
//!
//! - `BlockStored` (`block_hashes`, `parent_block_hash`, `token_ids`, `block_size`, ..):
//!   the engine computed these blocks. Their tokens are re-hashed with the gateway's
//!   own chain (the same [`PromptHasher`] token blocks requests get in precise mode,
//!   seeded by the backend's model, continuing from the parent's chain), and the whole
//!   chain is inserted for that backend.
//! - `BlockRemoved` (`block_hashes`, ..): evicted; the block and its descendants are
//!   removed for that backend.
//! - `AllBlocksCleared`: the backend's entries are dropped.
//!
//! Engine block hashes (bytes or integers) are mapped to the gateway's chains per
//! backend. A gap in sequence numbers means lost events: the backend's entries are
//! dropped (marked stale) and rebuilt from the events that follow, while routing-time
//! inserts keep serving in between. Changes go to the coordinator as ordinary
//! [`IndexEvent`]s, so every shard's replica gets them the usual way.

use crate::replica::{IndexEvent, IndexOp, Origin};
use crate::shard::Shared;
use crossbeam_channel::{Receiver, TryRecvError};
use radixgate_orchestrator::{model_seed, BackendIdx, PromptHasher};
use rmpv::Value;
use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long one poll waits before checking for shutdown.
const POLL_MS: i64 = 200;

/// Per-backend counters, written by the `radixgate-kv` thread, read at scrape time.
#[derive(Default)]
pub struct KvEventCounters {
    pub stored_blocks: AtomicU64,
    pub removed_blocks: AtomicU64,
    pub cleared: AtomicU64,
    /// Sequence gaps seen (each drops the backend's entries: stale, then rebuilt).
    pub gaps: AtomicU64,
    /// Messages or events that did not decode, or stored blocks whose parent was
    /// unknown.
    pub rejected: AtomicU64,
}

/// One subscription: which backend, where, and its model's hash seed.
pub struct Subscription {
    pub backend: BackendIdx,
    pub endpoint: String,
    pub seed: u64,
}

impl Subscription {
    pub fn new(backend: BackendIdx, endpoint: String, model: &str) -> Self {
        Self {
            backend,
            endpoint,
            seed: model_seed(model),
        }
    }
}

/// Binds every subscription (errors here fail start-up) and returns the thread body.
pub fn bind(subs: Vec<Subscription>) -> Result<Vec<(Subscription, zmq::Socket)>, String> {
    let ctx = zmq::Context::new();
    subs.into_iter()
        .map(|s| {
            let socket = ctx.socket(zmq::SUB).map_err(|e| e.to_string())?;
            socket
                .set_subscribe(b"")
                .and_then(|_| socket.set_rcvhwm(100_000))
                .and_then(|_| socket.bind(&s.endpoint))
                .map_err(|e| format!("kv_events: cannot bind `{}`: {e}", s.endpoint))?;
            Ok((s, socket))
        })
        .collect()
}

/// The `radixgate-kv` thread: polls the sockets until `stop` disconnects.
#[allow(clippy::disallowed_methods)] // its own thread, never a shard
pub fn run(
    sockets: Vec<(Subscription, zmq::Socket)>,
    block_tokens: NonZeroUsize,
    shared: Arc<Shared>,
    stop: Receiver<()>,
) {
    let index = shared.index_events.clone();
    let counters = shared.kv_events.clone();
    let mut states: Vec<BackendState> = sockets
        .iter()
        .map(|(s, _)| BackendState::new(s.backend, s.seed, block_tokens))
        .collect();
    let mut frames = Vec::new();
    while matches!(stop.try_recv(), Err(TryRecvError::Empty)) {
        let mut items: Vec<zmq::PollItem> = sockets
            .iter()
            .map(|(_, s)| s.as_poll_item(zmq::POLLIN))
            .collect();
        if zmq::poll(&mut items, POLL_MS).is_err() {
            std::thread::sleep(Duration::from_millis(POLL_MS as u64));
            continue;
        }
        let ready: Vec<bool> = items.iter().map(|i| i.is_readable()).collect();
        for (k, ((_, socket), state)) in sockets.iter().zip(&mut states).enumerate() {
            if !ready[k] {
                continue;
            }
            let c = &counters[state.backend];
            // Drain what is queued without blocking.
            while let Ok(msg) = socket.recv_multipart(zmq::DONTWAIT) {
                frames.clear();
                frames.extend(msg);
                for op in state.on_message(&frames, c, shared.now_ms()) {
                    let _ = index.send(IndexEvent {
                        origin: Origin::Local,
                        created: Instant::now(),
                        op,
                    });
                }
            }
        }
    }
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
            c.gaps.fetch_add(1, Ordering::Relaxed);
            self.blocks.clear();
            ops.push(IndexOp::Clear {
                backend: self.backend,
            });
        }
        self.last_seq = Some(seq);
        let Ok(batch) = rmpv::decode::read_value(&mut payload.as_slice()) else {
            reject("payload is not msgpack");
            return ops;
        };
        let Some(events) = batch
            .as_array()
            .and_then(|b| b.get(1))
            .and_then(Value::as_array)
        else {
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
                    .reset(chain.last().copied().unwrap_or(self.seed));
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
