//! The cluster bus's wire format: one versioned, compact binary batch per message.
//!
//! A replica's cluster thread collects the ops it has to share (index inserts and
//! removals, RAG chunk holds, session bindings, per-backend load, health and breaker
//! state, tenant consumption) and publishes them as one [`Batch`] per message (per
//! millisecond or per few dozen ops). Every peer decodes it with [`decode`], which
//! never panics: a message that is not ours, from another format version, from a
//! fleet whose routing-relevant configuration differs, cut short or otherwise
//! malformed is a distinct [`WireError`], to be counted and dropped.
//!
//! Layout, all integers little-endian:
//!
//! ```text
//! header (50 bytes)
//!   magic        4  b"RGCL"
//!   version      1  VERSION (1)
//!   flags        1  0 (reserved: any other value is Malformed)
//!   fingerprint  8  hash of the routing-relevant config (block size, hashing mode,
//!                   model seeds); a peer with another fingerprint is refused
//!   node         8  the publisher's node id
//!   epoch        8  the publisher's epoch (its start time): a restarted replica's
//!                   old state is told apart from its new one
//!   seq          8  per (node, epoch), +1 per batch: gaps and duplicates show
//!   sent_us      8  wall-clock microseconds at publish (peers measure event lag)
//!   op count     4
//! ops, each a tag byte then its fields:
//!   1 Insert      backend u64, now_ms varint, n varint, n x u64 block hashes
//!   2 Remove      backend u64, from varint, n varint, n x u64 (the chain; blocks
//!                 [from..] are gone)
//!   3 Clear       backend u64
//!   4 HoldChunks  backend u64, now_ms varint, n varint, n x u64 chunk ids
//!   5 BindSession session u64, backend u64, now_ms varint
//!   6 Load        backend u64, in_flight varint, pending_prefill_tokens varint
//!   7 Health      backend u64, healthy u8 (0/1), breaker u8 (0 closed, 1 open,
//!                 2 half-open)
//!   8 Tenant      name (len varint <= 256, UTF-8), requests varint, tokens varint
//!   9 SnapshotRequest  nonce u64 (a joining replica asks for its peers' index)
//! ```
//!
//! Backends are named by a stable [`BackendKey`] (a hash of the backend's URL, the
//! same on every replica), never by a replica's local slot index. Varints are LEB128
//! (at most 10 bytes for a u64). Block hashes and keys are fixed 8 bytes: they are
//! uniformly random, so a varint would only make them longer. An Insert of a
//! four-block chain is 48 bytes.
//!
//! Hand-written rather than serde + postcard/bincode: the format is a dozen fields,
//! the codec has no dependencies (so `radixgate-bench` compiles this very file for
//! its `wire` cost measurement), hash lists decode straight into the `Arc<[u64]>`
//! that `replica::IndexOp` carries, and every bound (list lengths against
//! the bytes left, the tenant name's length) is checked before anything is
//! allocated.

use std::fmt;
use std::sync::Arc;

pub const MAGIC: [u8; 4] = *b"RGCL";
pub const VERSION: u8 = 1;
/// Bytes before the first op.
pub const HEADER_LEN: usize = 50;
/// Longest tenant name on the wire, in bytes.
pub const MAX_TENANT_LEN: usize = 256;

const TAG_INSERT: u8 = 1;
const TAG_REMOVE: u8 = 2;
const TAG_CLEAR: u8 = 3;
const TAG_HOLD_CHUNKS: u8 = 4;
const TAG_BIND_SESSION: u8 = 5;
const TAG_LOAD: u8 = 6;
const TAG_HEALTH: u8 = 7;
const TAG_TENANT: u8 = 8;
const TAG_SNAPSHOT_REQUEST: u8 = 9;

/// A backend as every replica names it: a hash of its URL (computed by the cluster
/// module), the same whatever slot the backend has in each replica's config.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendKey(pub u64);

/// A backend's circuit breaker, as published.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Breaker {
    Closed,
    Open,
    HalfOpen,
}

impl Breaker {
    fn to_byte(self) -> u8 {
        match self {
            Breaker::Closed => 0,
            Breaker::Open => 1,
            Breaker::HalfOpen => 2,
        }
    }

    fn from_byte(b: u8) -> Option<Breaker> {
        match b {
            0 => Some(Breaker::Closed),
            1 => Some(Breaker::Open),
            2 => Some(Breaker::HalfOpen),
            _ => None,
        }
    }
}

/// Who sent a batch and where it sits in that sender's stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Hash of the routing-relevant configuration.
    pub fingerprint: u64,
    /// The publishing replica.
    pub node: u64,
    /// The publisher's epoch (e.g. its start time in ms): ops of an older epoch of
    /// the same node are stale.
    pub epoch: u64,
    /// The batch's number within (node, epoch), from 0, +1 per batch.
    pub seq: u64,
    /// Wall-clock microseconds since the Unix epoch when the batch was published.
    pub sent_us: u64,
}

/// One shared change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// `backend` now holds this chain of blocks (a routing-time insert).
    Insert {
        backend: BackendKey,
        blocks: Arc<[u64]>,
        now_ms: u64,
    },
    /// `backend` no longer holds `blocks[from..]`.
    Remove {
        backend: BackendKey,
        blocks: Arc<[u64]>,
        from: u32,
    },
    /// `backend`'s cache was cleared: it holds nothing now.
    Clear { backend: BackendKey },
    /// `backend` was sent these RAG chunks (ids).
    HoldChunks {
        backend: BackendKey,
        chunks: Arc<[u64]>,
        now_ms: u64,
    },
    /// The conversation `session` (hash of its session id) lives on `backend`.
    BindSession {
        session: u64,
        backend: BackendKey,
        now_ms: u64,
    },
    /// The publisher's own requests on `backend` now (absolute, not a delta, so a
    /// lost report is corrected by the next one).
    Load {
        backend: BackendKey,
        in_flight: u32,
        pending_prefill_tokens: u64,
    },
    /// The publisher's view of `backend`'s health and breaker.
    Health {
        backend: BackendKey,
        healthy: bool,
        breaker: Breaker,
    },
    /// What `tenant` used on the publisher since its previous report (requests and
    /// tokens, net of refunds): peers charge it to their own buckets. A repeated
    /// batch is fenced off by its sequence number; a lost one is use never charged.
    Tenant {
        tenant: String,
        requests: u64,
        tokens: u64,
    },
    /// A joining (or rejoining) replica asks for its peers' index: they answer by
    /// storing a snapshot under a key named by `nonce`.
    SnapshotRequest { nonce: u64 },
}

/// A decoded message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    pub header: Header,
    pub ops: Vec<Op>,
}

/// Why a message was dropped. Each kind is counted apart.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WireError {
    /// Does not start with [`MAGIC`]: not a radixgate cluster message.
    Foreign,
    /// A radixgate message in another format version.
    Version { found: u8 },
    /// From a fleet whose routing-relevant configuration differs.
    Fingerprint { found: u64, expected: u64 },
    /// Ends before its header or an op does.
    Truncated,
    /// Complete but inconsistent: what is wrong.
    Malformed(&'static str),
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WireError::Foreign => write!(f, "not a radixgate cluster message (bad magic)"),
            WireError::Version { found } => {
                write!(f, "wire version {found}, this replica speaks {VERSION}")
            }
            WireError::Fingerprint { found, expected } => write!(
                f,
                "routing config fingerprint {found:016x}, this replica's is {expected:016x}"
            ),
            WireError::Truncated => write!(f, "truncated message"),
            WireError::Malformed(what) => write!(f, "malformed message: {what}"),
        }
    }
}

impl std::error::Error for WireError {}

impl WireError {
    /// A short label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            WireError::Foreign => "foreign",
            WireError::Version { .. } => "version",
            WireError::Fingerprint { .. } => "fingerprint",
            WireError::Truncated => "truncated",
            WireError::Malformed(_) => "malformed",
        }
    }
}

// === encoding ===

/// Builds one batch in a caller-owned buffer: [`Encoder::new`], then ops, then
/// [`Encoder::finish`] (which writes the op count).
pub struct Encoder<'a> {
    buf: &'a mut Vec<u8>,
    start: usize,
    ops: u32,
}

impl<'a> Encoder<'a> {
    /// Appends a header to `buf` (which is not cleared).
    pub fn new(buf: &'a mut Vec<u8>, header: &Header) -> Encoder<'a> {
        let start = buf.len();
        buf.extend_from_slice(&MAGIC);
        buf.push(VERSION);
        buf.push(0);
        buf.extend_from_slice(&header.fingerprint.to_le_bytes());
        buf.extend_from_slice(&header.node.to_le_bytes());
        buf.extend_from_slice(&header.epoch.to_le_bytes());
        buf.extend_from_slice(&header.seq.to_le_bytes());
        buf.extend_from_slice(&header.sent_us.to_le_bytes());
        buf.extend_from_slice(&0u32.to_le_bytes());
        Encoder { buf, start, ops: 0 }
    }

    /// Ops so far.
    pub fn ops(&self) -> u32 {
        self.ops
    }

    /// Bytes of this batch so far.
    pub fn len(&self) -> usize {
        self.buf.len() - self.start
    }

    pub fn is_empty(&self) -> bool {
        self.ops == 0
    }

    pub fn push(&mut self, op: &Op) {
        let b = &mut *self.buf;
        match op {
            Op::Insert {
                backend,
                blocks,
                now_ms,
            } => {
                b.push(TAG_INSERT);
                put_u64(b, backend.0);
                put_var(b, *now_ms);
                put_list(b, blocks);
            }
            Op::Remove {
                backend,
                blocks,
                from,
            } => {
                b.push(TAG_REMOVE);
                put_u64(b, backend.0);
                put_var(b, u64::from(*from));
                put_list(b, blocks);
            }
            Op::Clear { backend } => {
                b.push(TAG_CLEAR);
                put_u64(b, backend.0);
            }
            Op::HoldChunks {
                backend,
                chunks,
                now_ms,
            } => {
                b.push(TAG_HOLD_CHUNKS);
                put_u64(b, backend.0);
                put_var(b, *now_ms);
                put_list(b, chunks);
            }
            Op::BindSession {
                session,
                backend,
                now_ms,
            } => {
                b.push(TAG_BIND_SESSION);
                put_u64(b, *session);
                put_u64(b, backend.0);
                put_var(b, *now_ms);
            }
            Op::Load {
                backend,
                in_flight,
                pending_prefill_tokens,
            } => {
                b.push(TAG_LOAD);
                put_u64(b, backend.0);
                put_var(b, u64::from(*in_flight));
                put_var(b, *pending_prefill_tokens);
            }
            Op::Health {
                backend,
                healthy,
                breaker,
            } => {
                b.push(TAG_HEALTH);
                put_u64(b, backend.0);
                b.push(u8::from(*healthy));
                b.push(breaker.to_byte());
            }
            Op::Tenant {
                tenant,
                requests,
                tokens,
            } => {
                b.push(TAG_TENANT);
                // Longer names are cut at a char boundary (names are short ids).
                let mut end = tenant.len().min(MAX_TENANT_LEN);
                while !tenant.is_char_boundary(end) {
                    end -= 1;
                }
                put_var(b, end as u64);
                b.extend_from_slice(&tenant.as_bytes()[..end]);
                put_var(b, *requests);
                put_var(b, *tokens);
            }
            Op::SnapshotRequest { nonce } => {
                b.push(TAG_SNAPSHOT_REQUEST);
                put_u64(b, *nonce);
            }
        }
        self.ops += 1;
    }

    /// Writes the op count; the batch is `buf[start..]`. Returns its length.
    pub fn finish(self) -> usize {
        let at = self.start + HEADER_LEN - 4;
        self.buf[at..at + 4].copy_from_slice(&self.ops.to_le_bytes());
        self.buf.len() - self.start
    }
}

/// One whole batch as a new buffer.
pub fn encode(header: &Header, ops: &[Op]) -> Vec<u8> {
    let mut buf = Vec::with_capacity(HEADER_LEN + ops.len() * 48);
    let mut enc = Encoder::new(&mut buf, header);
    for op in ops {
        enc.push(op);
    }
    enc.finish();
    buf
}

fn put_u64(b: &mut Vec<u8>, v: u64) {
    b.extend_from_slice(&v.to_le_bytes());
}

fn put_var(b: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        b.push((v as u8) | 0x80);
        v >>= 7;
    }
    b.push(v as u8);
}

fn put_list(b: &mut Vec<u8>, v: &[u64]) {
    put_var(b, v.len() as u64);
    b.reserve(v.len() * 8);
    for x in v {
        b.extend_from_slice(&x.to_le_bytes());
    }
}

// === decoding ===

/// Reads the header only: magic, version, flags and fingerprint checked.
pub fn decode_header(bytes: &[u8], fingerprint: u64) -> Result<Header, WireError> {
    let n = bytes.len().min(MAGIC.len());
    if bytes[..n] != MAGIC[..n] {
        return Err(WireError::Foreign);
    }
    if bytes.len() <= MAGIC.len() {
        return Err(WireError::Truncated);
    }
    // The version is checked before the length: a later version may have another
    // header.
    if bytes[4] != VERSION {
        return Err(WireError::Version { found: bytes[4] });
    }
    if bytes.len() < HEADER_LEN {
        return Err(WireError::Truncated);
    }
    if bytes[5] != 0 {
        return Err(WireError::Malformed("unknown flags"));
    }
    let mut r = Reader { b: bytes, at: 6 };
    let found = r.u64()?;
    if found != fingerprint {
        return Err(WireError::Fingerprint {
            found,
            expected: fingerprint,
        });
    }
    Ok(Header {
        fingerprint: found,
        node: r.u64()?,
        epoch: r.u64()?,
        seq: r.u64()?,
        sent_us: r.u64()?,
    })
}

/// Decodes a whole batch; `fingerprint` is this replica's own.
pub fn decode(bytes: &[u8], fingerprint: u64) -> Result<Batch, WireError> {
    let header = decode_header(bytes, fingerprint)?;
    let mut r = Reader {
        b: bytes,
        at: HEADER_LEN - 4,
    };
    let count = r.u32()? as usize;
    // Every op is at least 4 bytes (a Tenant with an empty name), so a count beyond
    // what the bytes can hold is caught before anything is allocated.
    if count > r.left() / 4 {
        return Err(WireError::Truncated);
    }
    let mut ops = Vec::with_capacity(count);
    for _ in 0..count {
        ops.push(r.op()?);
    }
    if r.left() != 0 {
        return Err(WireError::Malformed("bytes after the last op"));
    }
    Ok(Batch { header, ops })
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn left(&self) -> usize {
        self.b.len() - self.at
    }

    fn take(&mut self, n: usize) -> Result<&[u8], WireError> {
        if self.left() < n {
            return Err(WireError::Truncated);
        }
        let s = &self.b[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, WireError> {
        let s = self.take(4)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }

    fn u64(&mut self) -> Result<u64, WireError> {
        let s = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(s);
        Ok(u64::from_le_bytes(a))
    }

    fn var(&mut self) -> Result<u64, WireError> {
        let mut v: u64 = 0;
        for i in 0..10 {
            let byte = self.u8()?;
            let bits = u64::from(byte & 0x7f);
            if i == 9 && byte > 1 {
                return Err(WireError::Malformed("varint overflows u64"));
            }
            v |= bits << (7 * i);
            if byte & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(WireError::Malformed("varint longer than 10 bytes"))
    }

    fn list(&mut self) -> Result<Arc<[u64]>, WireError> {
        let n = self.var()?;
        if n > (self.left() / 8) as u64 {
            return Err(WireError::Truncated);
        }
        let s = self.take(n as usize * 8)?;
        Ok(s.chunks_exact(8)
            .map(|c| {
                let mut a = [0u8; 8];
                a.copy_from_slice(c);
                u64::from_le_bytes(a)
            })
            .collect())
    }

    fn backend(&mut self) -> Result<BackendKey, WireError> {
        self.u64().map(BackendKey)
    }

    fn op(&mut self) -> Result<Op, WireError> {
        Ok(match self.u8()? {
            TAG_INSERT => {
                let backend = self.backend()?;
                let now_ms = self.var()?;
                Op::Insert {
                    backend,
                    now_ms,
                    blocks: self.list()?,
                }
            }
            TAG_REMOVE => {
                let backend = self.backend()?;
                let from = u32::try_from(self.var()?)
                    .map_err(|_| WireError::Malformed("remove offset above u32"))?;
                let blocks = self.list()?;
                if from as usize > blocks.len() {
                    return Err(WireError::Malformed("remove offset past the chain"));
                }
                Op::Remove {
                    backend,
                    blocks,
                    from,
                }
            }
            TAG_CLEAR => Op::Clear {
                backend: self.backend()?,
            },
            TAG_HOLD_CHUNKS => {
                let backend = self.backend()?;
                let now_ms = self.var()?;
                Op::HoldChunks {
                    backend,
                    now_ms,
                    chunks: self.list()?,
                }
            }
            TAG_BIND_SESSION => Op::BindSession {
                session: self.u64()?,
                backend: self.backend()?,
                now_ms: self.var()?,
            },
            TAG_LOAD => Op::Load {
                backend: self.backend()?,
                in_flight: u32::try_from(self.var()?)
                    .map_err(|_| WireError::Malformed("in-flight count above u32"))?,
                pending_prefill_tokens: self.var()?,
            },
            TAG_HEALTH => {
                let backend = self.backend()?;
                let healthy = match self.u8()? {
                    0 => false,
                    1 => true,
                    _ => return Err(WireError::Malformed("health flag not 0 or 1")),
                };
                let breaker = Breaker::from_byte(self.u8()?)
                    .ok_or(WireError::Malformed("unknown breaker state"))?;
                Op::Health {
                    backend,
                    healthy,
                    breaker,
                }
            }
            TAG_TENANT => {
                let len = self.var()?;
                if len > MAX_TENANT_LEN as u64 {
                    return Err(WireError::Malformed("tenant name too long"));
                }
                let name = self.take(len as usize)?;
                let tenant = std::str::from_utf8(name)
                    .map_err(|_| WireError::Malformed("tenant name not UTF-8"))?
                    .to_string();
                Op::Tenant {
                    tenant,
                    requests: self.var()?,
                    tokens: self.var()?,
                }
            }
            TAG_SNAPSHOT_REQUEST => Op::SnapshotRequest { nonce: self.u64()? },
            _ => return Err(WireError::Malformed("unknown op tag")),
        })
    }
}
