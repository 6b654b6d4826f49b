//! One structured line per request, written off the shards.
//!
//! A shard fills a fixed-size [`AccessRecord`] (no heap allocation, no prompt or
//! completion text, no credentials) and sends it over a lock-free crossbeam channel;
//! the `radixgate-log` thread resolves names and emits it through `tracing` (JSON
//! or text per `log.format`), so the request path never takes the stderr lock or
//! makes a write syscall for logging. That thread's lines are buffered
//! ([`crate::log_writer`]) and written at most [`LINGER`] after the first of them,
//! so a burst of requests costs one write; when the gateway stops it waits for the
//! thread to write every record the shards sent. Backend and model names come from the backend
//! table, which the coordinator sends here before any shard can route with it.

use crate::backends::LiveConfig;
use crossbeam_channel::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The longest a line waits in the log thread's buffer: a burst of requests within
/// it costs one write (or one per [`crate::log_writer::FLUSH_AT`] bytes).
pub const LINGER: Duration = Duration::from_millis(10);

const ID_CAP: usize = 128;

/// A request id stored inline (ids are printable ASCII, at most 128 bytes).
#[derive(Clone, Copy)]
pub struct InlineId {
    len: u8,
    bytes: [u8; ID_CAP],
}

impl InlineId {
    pub fn new(id: &str) -> Self {
        let len = id.len().min(ID_CAP);
        let mut bytes = [0u8; ID_CAP];
        bytes[..len].copy_from_slice(&id.as_bytes()[..len]);
        Self {
            len: len as u8,
            bytes,
        }
    }

    pub fn as_str(&self) -> &str {
        std::str::from_utf8(&self.bytes[..self.len as usize]).unwrap_or("")
    }
}

#[derive(Clone, Copy)]
pub struct AccessRecord {
    pub shard: usize,
    pub request_id: InlineId,
    /// W3C trace id when the client sent a `traceparent` (else zero).
    pub trace_id: u128,
    pub tenant: Option<usize>,
    pub model: Option<usize>,
    pub policy: &'static str,
    pub backend: Option<usize>,
    pub reason: &'static str,
    pub matched_blocks: u32,
    pub cached_tokens: Option<u64>,
    pub prompt_tokens: Option<u64>,
    pub status: u16,
    /// How the request ended: `completed` (an answer went out whole), `refused`
    /// (the gateway answered itself with an error), `client_closed` (the client left
    /// first; status 499).
    pub outcome: &'static str,
    pub ttft_us: Option<u64>,
    pub total_us: u64,
    pub retries: u32,
}

impl AccessRecord {
    /// A request the gateway answered itself with an error, before any backend.
    pub fn refused(
        shard: usize,
        request_id: &str,
        trace_id: u128,
        tenant: Option<usize>,
        error: &crate::error::GatewayError,
        total_us: u64,
    ) -> Self {
        Self {
            shard,
            request_id: InlineId::new(request_id),
            trace_id,
            tenant,
            model: None,
            policy: "",
            backend: None,
            reason: error.code(),
            matched_blocks: 0,
            cached_tokens: None,
            prompt_tokens: None,
            status: error.status(),
            outcome: "refused",
            ttft_us: None,
            total_us,
            retries: 0,
        }
    }
}

/// Runs the log thread until every sender is gone or `stop` disconnects (the
/// gateway stops it once the shards have ended, so every record is queued by then),
/// then writes what is queued and buffered. `live` gives the names behind the
/// records' backend and model indices; `updates` brings each new table, sent before
/// the shards get it, so it is always here before the records that use it.
pub fn run(
    records: Receiver<AccessRecord>,
    live: Arc<LiveConfig>,
    updates: Receiver<Arc<LiveConfig>>,
    tenants: Vec<String>,
    stop: Receiver<()>,
) {
    use crate::log_writer::{flush, pending, FLUSH_AT};
    crate::log_writer::buffer();
    let mut writer = Writer {
        live,
        updates,
        tenants,
    };
    // When the oldest line not yet written was buffered.
    let mut oldest: Option<Instant> = None;
    loop {
        let linger = oldest.map_or_else(crossbeam_channel::never, |t| {
            crossbeam_channel::at(t + LINGER)
        });
        crossbeam_channel::select! {
            recv(records) -> r => match r {
                Ok(r) => {
                    writer.write(r);
                    oldest.get_or_insert_with(Instant::now);
                }
                Err(_) => break,
            },
            recv(stop) -> _ => {
                for r in records.try_iter() {
                    writer.write(r);
                }
                break;
            }
            recv(linger) -> _ => {
                flush();
                oldest = None;
            }
        }
        if pending() >= FLUSH_AT {
            flush();
            oldest = None;
        }
    }
    flush();
}

/// Turns records into lines, with the names of the latest backend table.
struct Writer {
    live: Arc<LiveConfig>,
    updates: Receiver<Arc<LiveConfig>>,
    tenants: Vec<String>,
}

impl Writer {
    fn write(&mut self, r: AccessRecord) {
        while let Ok(newer) = self.updates.try_recv() {
            self.live = newer;
        }
        let table = &self.live.backends;
        let tenant = r.tenant.map_or("", |t| self.tenants[t].as_str());
        let model = r.model.map_or("", |m| table.models().name(m));
        let backend = r.backend.map_or("", |b| table.id(b));
        let trace_id = if r.trace_id == 0 {
            String::new()
        } else {
            format!("{:032x}", r.trace_id)
        };
        tracing::info!(
            target: "radixgate::access",
            request_id = r.request_id.as_str(),
            trace_id = %trace_id,
            shard = r.shard,
            tenant,
            model,
            policy = r.policy,
            backend,
            reason = r.reason,
            matched_blocks = r.matched_blocks,
            cached_tokens = r.cached_tokens,
            prompt_tokens = r.prompt_tokens,
            status = r.status,
            outcome = r.outcome,
            ttft_ms = r.ttft_us.map(|us| us as f64 / 1000.0),
            total_ms = r.total_us as f64 / 1000.0,
            retries = r.retries,
            "request"
        );
    }
}
