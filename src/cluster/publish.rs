//! The `radixgate-cluster-pub` thread: this replica's routing ops and load, out to
//! the bus.
//!
//! The coordinator hands it every index op of this replica's routing decisions
//! and every health or breaker change its own checks and requests made (bounded
//! channel, `try_send`: the coordinator never waits on it). Ops are
//! batched (at most `batch_ops` per message, at most `batch_ms` after a batch's
//! first op) and each batch is one `PUBLISH` of a [`wire`](super::wire) message.
//! Every `report_interval` it publishes the replica's in-flight requests and
//! pending prefill per live backend (absolute values, so a lost report is mended
//! by the next; also the replica's heartbeat), what each limited tenant used
//! since the last report, and renews the fleet's fingerprint key.
//!
//! A publish that fails drops its batch (counted as unsent; the batch keeps its
//! sequence number, so peers see the gap) and the thread reconnects every
//! [`RECONNECT_EVERY`]; what it could not send while the bus was down is lost, and
//! routing goes on from local state. The subscriber counts and logs the outage.

use super::wire::{self, BackendKey, Header, Op};
use super::{backend_key, RECONNECT_EVERY};
use crate::backends::LiveConfig;
use crate::config::ClusterConfig;
use crate::control::Share;
use crate::control::Shared;
use crate::replica::IndexOp;
use crate::status::ClusterStatus;
use crossbeam_channel::{select, Receiver};
use radixgate_orchestrator::BreakerState;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

/// Ops queued from the coordinator beyond this are dropped (counted as unsent):
/// the bus is not keeping up.
pub const QUEUE: usize = 65_536;

/// The bus names of a live config's backend slots (`None`: retired).
pub fn backend_keys(live: &LiveConfig) -> Vec<Option<BackendKey>> {
    let mut keys = vec![None; live.backends.len()];
    for (slot, b) in live.backends.live() {
        keys[slot] = Some(backend_key(&format!("http://{}", b.host)));
    }
    keys
}

/// The wire form of what the coordinator shares.
fn share_to_wire(share: &Share, keys: &[Option<BackendKey>]) -> Option<Op> {
    match share {
        Share::Index(op) => to_wire(op, keys),
        Share::Health {
            backend,
            healthy,
            breaker,
        } => Some(Op::Health {
            backend: keys.get(*backend).copied().flatten()?,
            healthy: *healthy,
            breaker: match breaker {
                BreakerState::Closed => wire::Breaker::Closed,
                BreakerState::Open => wire::Breaker::Open,
                BreakerState::HalfOpen => wire::Breaker::HalfOpen,
            },
        }),
    }
}

/// The wire form of a routing op; `None` for ops a replica keeps to itself (engine
/// facts and config changes: every replica learns those on its own).
pub(super) fn to_wire(op: &IndexOp, keys: &[Option<BackendKey>]) -> Option<Op> {
    let key = |slot: usize| keys.get(slot).copied().flatten();
    Some(match op {
        IndexOp::Insert {
            backend,
            blocks,
            now_ms,
        } => Op::Insert {
            backend: key(*backend)?,
            blocks: blocks.clone(),
            now_ms: *now_ms,
        },
        IndexOp::Remove {
            backend,
            blocks,
            from,
        } => Op::Remove {
            backend: key(*backend)?,
            blocks: blocks.clone(),
            from: u32::try_from(*from).ok()?,
        },
        IndexOp::HoldChunks {
            backend,
            chunks,
            now_ms,
        } => Op::HoldChunks {
            backend: key(*backend)?,
            chunks: chunks.clone(),
            now_ms: *now_ms,
        },
        IndexOp::BindSession {
            session,
            backend,
            now_ms,
        } => Op::BindSession {
            session: *session,
            backend: key(*backend)?,
            now_ms: *now_ms,
        },
        IndexOp::SetCapacity { .. } | IndexOp::Clear { .. } | IndexOp::RemoveBackend { .. } => {
            return None
        }
    })
}

struct Publisher {
    config: ClusterConfig,
    status: Arc<ClusterStatus>,
    channel: String,
    conn: Option<redis::Connection>,
    retry_at: Instant,
    seq: u64,
    buf: Vec<u8>,
    /// Per tenant, its use (cumulative) at the last report.
    tenants_sent: std::collections::HashMap<String, (u64, u64)>,
}

impl Publisher {
    /// Publishes `ops` as one batch (an empty one is a heartbeat).
    fn publish(&mut self, ops: &[Op]) {
        let header = Header {
            fingerprint: self.status.fingerprint,
            node: self.status.node_id,
            epoch: self.status.epoch,
            seq: self.seq,
            sent_us: super::unix_us(),
        };
        self.seq += 1;
        let n = ops.len() as u64;
        if self.status.refused.load(Ordering::Relaxed) || !self.connected() {
            self.status.ops_unsent.fetch_add(n, Ordering::Relaxed);
            return;
        }
        self.buf.clear();
        let mut enc = wire::Encoder::new(&mut self.buf, &header);
        for op in ops {
            enc.push(op);
        }
        enc.finish();
        let Some(conn) = self.conn.as_mut() else {
            return;
        };
        let sent: redis::RedisResult<i64> = redis::cmd("PUBLISH")
            .arg(&self.channel)
            .arg(&self.buf[..])
            .query(conn);
        match sent {
            Ok(_) => {
                self.status
                    .batches_published
                    .fetch_add(1, Ordering::Relaxed);
                self.status.ops_published.fetch_add(n, Ordering::Relaxed);
            }
            Err(e) => {
                tracing::debug!(error = %e, "cluster: publish failed; reconnecting");
                self.status.ops_unsent.fetch_add(n, Ordering::Relaxed);
                self.drop_connection();
            }
        }
    }

    fn drop_connection(&mut self) {
        self.conn = None;
        self.retry_at = Instant::now() + RECONNECT_EVERY;
    }

    /// True when a connection is up, after trying to open one if it is time to.
    fn connected(&mut self) -> bool {
        if self.conn.is_some() {
            return true;
        }
        if Instant::now() < self.retry_at {
            return false;
        }
        match super::connect(&self.config) {
            Ok(mut conn) => {
                match super::claim_fingerprint(&mut conn, &self.config, self.status.fingerprint) {
                    Ok(true) => self.conn = Some(conn),
                    Ok(false) => refuse(&self.status, &self.config),
                    Err(_) => self.drop_connection(),
                }
            }
            Err(_) => self.drop_connection(),
        }
        self.conn.is_some()
    }

    fn renew_fingerprint(&mut self) {
        if let Some(conn) = self.conn.as_mut() {
            if super::renew_fingerprint(conn, &self.config, self.status.fingerprint).is_err() {
                self.drop_connection();
            }
        }
    }
}

/// Marks this replica refused (another routing fingerprint holds the fleet) and
/// says so once.
pub fn refuse(status: &ClusterStatus, config: &ClusterConfig) {
    if !status.refused.swap(true, Ordering::Relaxed) {
        tracing::error!(
            channel = %config.channel,
            "cluster: the fleet routes with another fingerprint (routing.block_bytes, \
             routing.hashing, the tokenizer or tenancy.prefix_isolation differ); this \
             replica stays out of the cluster and routes on local state"
        );
    }
}

/// Runs until `stop` disconnects (or the coordinator's op channel does).
#[allow(clippy::disallowed_methods)] // its own thread, never a shard
pub fn run(
    start: super::Start,
    updates: Receiver<Arc<LiveConfig>>,
    ops: Receiver<Share>,
    stop: Receiver<()>,
) {
    let super::Start {
        config,
        status,
        shared,
        mut live,
    } = start;
    let mut keys = backend_keys(&live);
    let mut p = Publisher {
        channel: super::channel(&config),
        config,
        status,
        conn: None,
        retry_at: Instant::now(),
        seq: 0,
        buf: Vec::with_capacity(4096),
        tenants_sent: Default::default(),
    };
    let batch_ops = p.config.batch_ops;
    let batch_wait = p.config.batch;
    let interval = p.config.report_interval;
    let mut pending: Vec<Op> = Vec::with_capacity(batch_ops);
    let mut first_at: Option<Instant> = None;
    let mut next_report = Instant::now();
    loop {
        let now = Instant::now();
        let mut wake = next_report;
        if let Some(t) = first_at {
            wake = wake.min(t + batch_wait);
        }
        select! {
            recv(stop) -> _ => return,
            recv(ops) -> op => match op {
                Ok(op) => queue(&op, &keys, &mut pending, &mut first_at),
                Err(_) => return,
            },
            recv(updates) -> update => {
                if let Ok(newer) = update {
                    live = newer;
                    keys = backend_keys(&live);
                }
            }
            default(wake.saturating_duration_since(now)) => {}
        }
        while pending.len() < batch_ops {
            match ops.try_recv() {
                Ok(op) => queue(&op, &keys, &mut pending, &mut first_at),
                Err(_) => break,
            }
        }
        let now = Instant::now();
        if pending.len() >= batch_ops || first_at.is_some_and(|t| now >= t + batch_wait) {
            p.publish(&pending);
            pending.clear();
            first_at = None;
        }
        if now >= next_report {
            next_report = now + interval;
            report_load(&mut p, &shared, &live, &keys, batch_ops);
            p.renew_fingerprint();
        }
    }
}

/// Adds a routing op to the batch being built, noting when the batch began.
fn queue(
    op: &Share,
    keys: &[Option<BackendKey>],
    pending: &mut Vec<Op>,
    first_at: &mut Option<Instant>,
) {
    if let Some(w) = share_to_wire(op, keys) {
        pending.push(w);
        first_at.get_or_insert_with(Instant::now);
    }
}

/// Publishes this replica's load on every live backend (at least one batch, so an
/// idle replica still beats).
fn report_load(
    p: &mut Publisher,
    shared: &Shared,
    live: &LiveConfig,
    keys: &[Option<BackendKey>],
    batch_ops: usize,
) {
    let loads: Vec<Op> = live
        .backends
        .live()
        .filter_map(|(slot, _)| {
            Some(Op::Load {
                backend: keys.get(slot).copied().flatten()?,
                in_flight: shared.in_flight.local_total(slot),
                pending_prefill_tokens: u64::from(shared.pending_prefill.tokens(slot)),
            })
        })
        .collect();
    let mut ops = loads;
    ops.extend(tenant_use(p, live));
    if ops.is_empty() {
        p.publish(&[]);
    }
    for chunk in ops.chunks(batch_ops) {
        p.publish(chunk);
    }
}

/// What each limited tenant used on this replica since the last report (net of
/// refunds; only tenants that used something): peers charge it to their own
/// buckets, so the fleet together keeps each limit. A report lost in a bus outage
/// is use the peers never charge (the limits loosen by that much while the bus is
/// down); a repeated one is fenced off by its sequence number.
fn tenant_use(p: &mut Publisher, live: &LiveConfig) -> Vec<Op> {
    let mut ops = Vec::new();
    for t in live.tenants.live() {
        if t.requests.is_none() && t.tokens.is_none() {
            continue;
        }
        let used = (
            t.requests.as_ref().map_or(0, |b| b.used()),
            t.tokens.as_ref().map_or(0, |b| b.used()),
        );
        let before = p
            .tenants_sent
            .insert(t.name.clone(), used)
            .unwrap_or((0, 0));
        let delta = (
            used.0.saturating_sub(before.0),
            used.1.saturating_sub(before.1),
        );
        if delta != (0, 0) {
            ops.push(Op::Tenant {
                tenant: t.name.clone(),
                requests: delta.0,
                tokens: delta.1,
            });
        }
    }
    ops
}
