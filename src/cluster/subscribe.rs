//! The `radixgate-cluster-sub` thread: every peer's routing ops and load, in from
//! the bus.
//!
//! It subscribes to the fleet's channel and decodes each message
//! ([`wire::decode`], which never panics). A message that is not ours, of another
//! version or fingerprint, cut short or malformed is counted by kind and dropped,
//! and so are this replica's own messages and those [`Peers`] fences off
//! (duplicates, older epochs). The index ops of the rest become
//! [`IndexEvent`]s from a peer, sent to the coordinator like the KV-event thread's:
//! it applies them to the authoritative index and fans them out to every shard.
//! Block chains are applied at this replica's own index clock (the publisher's is
//! another process's). Load reports update [`Peers`], and about once per report
//! interval the peers' summed load is written into the peers' row of the in-flight
//! and pending-prefill counters, after dropping the peers that fell silent.
//!
//! When the bus goes away the thread logs it once, counts an outage, and
//! reconnects every [`RECONNECT_EVERY`]; routing never waits for it.
//!
//! **Warm start.** Each time it joins (at start, and again after an outage) the
//! thread is subscribed before it asks, so it misses nothing published after: once
//! it has heard a peer since joining, it publishes a `SnapshotRequest` with a fresh nonce
//! (again every two report intervals until a snapshot is stored: a peer's publisher
//! can be back on the bus before its subscriber); every
//! warm peer asks its coordinator for the authoritative index and session bindings
//! and stores them, as one wire batch, under the nonce's key (`SET NX`, so one copy
//! is kept, expiring after 30 s). The joiner loads the first copy it finds, with
//! each entry's age (not the peer's clock) carried over, and is warm: `/ready`
//! answers 200 from then on. With no peer heard within three report intervals it is
//! warm at once (the first replica; after an outage it listens up to `peer_timeout_ms`,
//! capped by `warm_timeout_ms`, as the peers reconnect one by one); with no snapshot within `warm_timeout_ms` it
//! is warm anyway, with a warning. Ops published while it loads arrive on the
//! subscription as usual; applying one twice is harmless.

use super::peers::{Peers, Verdict};
use super::wire::{self, BackendKey, Header, Op};
use super::{publish::backend_keys, RECONNECT_EVERY};
use crate::backends::LiveConfig;
use crate::config::ClusterConfig;
use crate::control::AdminRequest;
use crate::control::Shared;
use crate::replica::{IndexEvent, IndexOp, Origin};
use crate::status::{ClusterStatus, Dropped};
use crossbeam_channel::{Receiver, RecvTimeoutError, TryRecvError};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The longest one read waits, so the thread sees `stop` and its report tick.
const READ_WAIT: Duration = Duration::from_millis(50);
/// The same while warming up (the snapshot key is polled between reads).
const WARMING_READ_WAIT: Duration = Duration::from_millis(5);
/// How long a stored snapshot lives.
const SNAPSHOT_TTL_MS: u64 = 30_000;
/// Lag samples kept per report interval (beyond this, the rest are not sampled).
const LAG_SAMPLES: usize = 4_096;

struct Subscriber {
    config: ClusterConfig,
    status: Arc<ClusterStatus>,
    shared: Arc<Shared>,
    live: Arc<LiveConfig>,
    slots: HashMap<BackendKey, usize>,
    peers: Peers,
    /// What the peers' row holds now, per slot: (in flight, pending tokens).
    written: Vec<(u32, u32)>,
    lags_us: Vec<u64>,
    /// Each kind of bad message is logged once.
    logged: [bool; Dropped::ALL.len()],
    /// The bus was lost and has not come back yet.
    down: bool,
    next_report: Instant,
    /// To ask the coordinator for a snapshot a peer wants.
    coordinator: crossbeam_channel::Sender<AdminRequest>,
    /// A plain connection beside the subscription (which can run nothing else),
    /// for the warm-start requests and snapshots.
    commands: Option<redis::Connection>,
    /// Since when this (re)join has been warming up, and the request sent.
    warming: Option<Warming>,
}

struct Warming {
    since: Instant,
    /// The roll call's nonce, and when it was last published.
    asked: Option<(u64, Instant)>,
    /// How long to listen for a peer before concluding there is none.
    roll_call: Duration,
}

/// The index op a peer's wire op stands for, at this replica's backend slot, with
/// its time mapped by `at` (live ops take the receipt time, a snapshot's carry
/// ages): `Ok(None)` for a backend this replica lacks, `Err` (the op back) for an
/// op that is not an index op.
fn index_op(
    op: Op,
    slots: &HashMap<BackendKey, usize>,
    at: impl Fn(u64) -> u64,
) -> Result<Option<IndexOp>, Op> {
    let slot = |key: BackendKey| slots.get(&key).copied();
    Ok(match op {
        Op::Insert {
            backend,
            blocks,
            now_ms,
        } => slot(backend).map(|backend| IndexOp::Insert {
            backend,
            blocks,
            now_ms: at(now_ms),
        }),
        Op::Remove {
            backend,
            blocks,
            from,
        } => slot(backend).map(|backend| IndexOp::Remove {
            backend,
            blocks,
            from: from as usize,
        }),
        Op::Clear { backend } => slot(backend).map(|backend| IndexOp::Clear { backend }),
        Op::HoldChunks {
            backend,
            chunks,
            now_ms,
        } => slot(backend).map(|backend| IndexOp::HoldChunks {
            backend,
            chunks,
            now_ms: at(now_ms),
        }),
        Op::BindSession {
            session,
            backend,
            now_ms,
        } => slot(backend).map(|backend| IndexOp::BindSession {
            session,
            backend,
            now_ms: at(now_ms),
        }),
        other => return Err(other),
    })
}

fn slots_of(live: &LiveConfig) -> HashMap<BackendKey, usize> {
    backend_keys(live)
        .into_iter()
        .enumerate()
        .filter_map(|(slot, key)| Some((key?, slot)))
        .collect()
}

/// Runs until `stop` disconnects.
#[allow(clippy::disallowed_methods)] // its own thread, never a shard
pub fn run(
    start: super::Start,
    coordinator: crossbeam_channel::Sender<AdminRequest>,
    updates: Receiver<Arc<LiveConfig>>,
    stop: Receiver<()>,
) {
    let super::Start {
        config,
        status,
        shared,
        live,
    } = start;
    let mut s = Subscriber {
        coordinator,
        commands: None,
        warming: None,
        peers: Peers::new(config.peer_timeout),
        slots: slots_of(&live),
        config,
        status,
        shared,
        live,
        written: Vec::new(),
        lags_us: Vec::with_capacity(LAG_SAMPLES),
        logged: [false; Dropped::ALL.len()],
        down: false,
        next_report: Instant::now(),
    };
    let stopped = || matches!(stop.try_recv(), Ok(()) | Err(TryRecvError::Disconnected));
    while !stopped() {
        let mut conn = match super::connect(&s.config) {
            Ok(c) => c,
            Err(e) => {
                s.lost(&e.to_string());
                s.idle(&updates, RECONNECT_EVERY);
                continue;
            }
        };
        match super::claim_fingerprint(&mut conn, &s.config, s.status.fingerprint) {
            Ok(true) => {}
            Ok(false) => {
                super::publish::refuse(&s.status, &s.config);
                // Out of the cluster for good: keep the peers' row empty.
                s.peers = Peers::new(s.config.peer_timeout);
                s.write_peer_load();
                while !stopped() {
                    s.idle(&updates, RECONNECT_EVERY);
                }
                return;
            }
            Err(e) => {
                s.lost(&e.to_string());
                s.idle(&updates, RECONNECT_EVERY);
                continue;
            }
        }
        let mut pubsub = conn.as_pubsub();
        if let Err(e) = pubsub
            .subscribe(super::channel(&s.config))
            .and_then(|()| pubsub.set_read_timeout(Some(READ_WAIT)))
        {
            s.lost(&e.to_string());
            drop(pubsub);
            s.idle(&updates, RECONNECT_EVERY);
            continue;
        }
        s.joined();
        let mut wait = READ_WAIT;
        while !stopped() {
            while let Ok(newer) = updates.try_recv() {
                s.follow(newer);
            }
            let want = match s.warming {
                Some(_) => WARMING_READ_WAIT,
                None => READ_WAIT,
            };
            if want != wait && pubsub.set_read_timeout(Some(want)).is_ok() {
                wait = want;
            }
            match pubsub.get_message() {
                Ok(msg) => s.on_message(msg.get_payload_bytes()),
                Err(e) if e.is_timeout() => {}
                Err(e) => {
                    s.lost(&e.to_string());
                    break;
                }
            }
            s.warm_up();
            s.tick();
        }
    }
}

impl Subscriber {
    fn follow(&mut self, live: Arc<LiveConfig>) {
        self.slots = slots_of(&live);
        self.live = live;
    }

    /// Waits `wait` while disconnected, following config changes and keeping the
    /// peers' row current (silent peers still expire).
    #[allow(clippy::disallowed_methods)] // its own thread, never a shard
    fn idle(&mut self, updates: &Receiver<Arc<LiveConfig>>, wait: Duration) {
        match updates.recv_timeout(wait) {
            Ok(newer) => self.follow(newer),
            Err(RecvTimeoutError::Timeout) => {}
            // The coordinator has ended; `stop` follows.
            Err(RecvTimeoutError::Disconnected) => std::thread::sleep(wait),
        }
        self.tick();
    }

    fn joined(&mut self) {
        self.status.connected.store(true, Ordering::Relaxed);
        if let Ok(mut e) = self.status.last_error.lock() {
            e.clear();
        }
        // After an outage the peers come back one by one, each on its own
        // reconnect schedule: listen for them as long as a live peer may stay
        // silent, or a replica that reconnects first would skip the resync.
        let first_join = 3 * self.config.report_interval;
        let roll_call = match self.down {
            true => first_join
                .max(self.config.peer_timeout)
                .min(self.config.warm_timeout),
            false => first_join,
        };
        self.warming = Some(Warming {
            since: Instant::now(),
            asked: None,
            roll_call,
        });
        if self.down {
            self.down = false;
            tracing::info!(url = %self.config.url, "cluster bus is back; sharing routing state again");
        } else {
            tracing::info!(url = %self.config.url, node = %self.config.node, "joined the cluster");
        }
    }

    /// The bus went away (or never answered): counted and logged once per outage.
    fn lost(&mut self, error: &str) {
        self.status.connected.store(false, Ordering::Relaxed);
        let hint = super::tls::hint(&self.config, error);
        if let Ok(mut e) = self.status.last_error.lock() {
            if !e.starts_with(error) {
                *e = match hint {
                    Some(hint) => format!("{error} ({hint})"),
                    None => error.to_string(),
                };
            }
        }
        if !self.down {
            self.down = true;
            self.status.outages.fetch_add(1, Ordering::Relaxed);
            match hint {
                Some(hint) => {
                    tracing::error!(url = %self.config.url, error, hint, "cluster bus refused the connection; routing on local state, and retrying")
                }
                None => {
                    tracing::warn!(url = %self.config.url, error, "cluster bus lost; routing on local state until it is back")
                }
            }
        }
    }

    fn on_message(&mut self, bytes: &[u8]) {
        self.status.batches_received.fetch_add(1, Ordering::Relaxed);
        // The bus hands every subscriber its own messages too: drop those on the
        // header alone.
        if let Ok(h) = wire::decode_header(bytes, self.status.fingerprint) {
            if h.node == self.status.node_id && h.epoch == self.status.epoch {
                return;
            }
        }
        let batch = match wire::decode(bytes, self.status.fingerprint) {
            Ok(b) => b,
            Err(e) => {
                let why = super::dropped_of(&e);
                self.status.count_dropped(why);
                if !std::mem::replace(&mut self.logged[why as usize], true) {
                    tracing::warn!(error = %e, "cluster: dropped a bus message (logged once per kind; counted in radixgate_cluster_messages_dropped_total)");
                }
                return;
            }
        };
        let h = batch.header;
        // A joiner's roll call is outside its numbered stream: never fenced.
        if let [Op::SnapshotRequest { nonce }] = batch.ops.as_slice() {
            return self.serve_snapshot(*nonce, &h);
        }
        let now = Instant::now();
        match self.peers.admit(&h, now) {
            Verdict::Apply { gap } => {
                if gap > 0 {
                    self.status.gaps.fetch_add(gap, Ordering::Relaxed);
                }
            }
            Verdict::Duplicate => return self.status.count_dropped(Dropped::Duplicate),
            Verdict::Stale => return self.status.count_dropped(Dropped::Stale),
        }
        if self.lags_us.len() < LAG_SAMPLES {
            self.lags_us
                .push(super::unix_us().saturating_sub(h.sent_us));
        }
        let now_ms = self.shared.now_ms();
        for op in batch.ops {
            self.apply(h.node, op, now, now_ms);
        }
    }

    fn apply(&mut self, node: u64, op: Op, now: Instant, now_ms: u64) {
        let op = match index_op(op, &self.slots, |_| now_ms) {
            Ok(Some(op)) => {
                self.status.ops_applied.fetch_add(1, Ordering::Relaxed);
                let _ = self.shared.index_events.send(IndexEvent {
                    origin: Origin::Peer,
                    created: now,
                    op,
                });
                return;
            }
            Ok(None) => {
                self.status
                    .ops_unknown_backend
                    .fetch_add(1, Ordering::Relaxed);
                return;
            }
            Err(op) => op,
        };
        let slot = |key: BackendKey| self.slots.get(&key).copied();
        match op {
            Op::Load {
                backend,
                in_flight,
                pending_prefill_tokens,
            } => match slot(backend) {
                Some(s) => self.peers.set_load(
                    node,
                    s,
                    in_flight,
                    u32::try_from(pending_prefill_tokens).unwrap_or(u32::MAX),
                ),
                None => {
                    self.status
                        .ops_unknown_backend
                        .fetch_add(1, Ordering::Relaxed);
                }
            },
            // A peer saw the backend fail: this replica's breaker opens too. Good
            // news is left to this replica's own probes and requests.
            Op::Health {
                backend,
                healthy,
                breaker,
            } => {
                if let Some(s) = slot(backend) {
                    if !healthy || breaker == wire::Breaker::Open {
                        self.status.peer_faults.fetch_add(1, Ordering::Relaxed);
                        let _ = self
                            .coordinator
                            .send(AdminRequest::PeerFault { backend: s });
                    }
                }
            }
            // A peer's use of a tenant's quota is charged here too (into debt if
            // need be), so the fleet together keeps the tenant's limits.
            Op::Tenant {
                tenant,
                requests,
                tokens,
            } => {
                if let Some(t) = self.live.tenants.by_name(&tenant) {
                    if let (Some(b), 1..) = (&t.requests, requests) {
                        b.charge(requests, now_ms);
                    }
                    if let (Some(b), 1..) = (&t.tokens, tokens) {
                        b.charge(tokens, now_ms);
                    }
                    self.status.tenant_charges.fetch_add(1, Ordering::Relaxed);
                }
            }
            // A roll call inside a numbered batch is not one a joiner sends.
            Op::SnapshotRequest { .. } => {}
            // Index ops were handled above.
            Op::Insert { .. }
            | Op::Remove { .. }
            | Op::Clear { .. }
            | Op::HoldChunks { .. }
            | Op::BindSession { .. } => {}
        }
    }

    /// About once per report interval: expire silent peers, write their load into
    /// the peers' row, publish the view and the lag percentiles.
    fn tick(&mut self) {
        let now = Instant::now();
        if now < self.next_report {
            return;
        }
        self.next_report = now + self.config.report_interval;
        let expired = self.peers.expire(now);
        if expired > 0 {
            tracing::info!(
                expired,
                "cluster: peers fell silent and were dropped with their load"
            );
        }
        self.write_peer_load();
        if let Ok(mut views) = self.status.peers.lock() {
            *views = self.peers.views(now);
        }
        if !self.lags_us.is_empty() {
            self.lags_us.sort_unstable();
            let at = |q: f64| self.lags_us[((self.lags_us.len() - 1) as f64 * q) as usize];
            self.status.lag_p50_us.store(at(0.5), Ordering::Relaxed);
            self.status.lag_p99_us.store(at(0.99), Ordering::Relaxed);
            self.lags_us.clear();
        }
    }

    fn write_peer_load(&mut self) {
        let slots = self.live.backends.len();
        let (in_flight, tokens) = self.peers.totals(slots);
        self.written.resize(slots, (0, 0));
        for slot in 0..slots {
            let now = (in_flight[slot], tokens[slot]);
            if self.written[slot] != now {
                self.written[slot] = now;
                self.shared.in_flight.set_peers(slot, now.0);
                self.status.set_peer_pending_tokens(slot, now.1);
            }
        }
    }

    /// A plain bus connection for commands, opened when first needed.
    fn commands(&mut self) -> Option<&mut redis::Connection> {
        if self.commands.is_none() {
            self.commands = super::connect(&self.config).ok();
        }
        self.commands.as_mut()
    }

    /// One step of warming up (see the module docs); called between reads.
    fn warm_up(&mut self) {
        let Some(w) = &self.warming else {
            return;
        };
        let (since, asked, roll_call) = (w.since, w.asked, w.roll_call);
        let waited = since.elapsed();
        // A peer's publisher can be back on the bus before its subscriber: a roll
        // call it missed is published again (same nonce: one stored copy).
        let again = 2 * self.config.report_interval;
        let asked = match asked {
            Some((nonce, at)) if at.elapsed() >= again => Err(nonce),
            Some((nonce, _)) => Ok(Some(nonce)),
            None => Ok(None),
        };
        match asked {
            // Heard since this join: a peer remembered from before an outage
            // may not be subscribed yet, and would miss the request.
            Ok(None) if !self.peers.heard_since(since) => {
                if waited >= roll_call {
                    self.warmed(
                        since,
                        "no peer answered the roll call: this replica starts the fleet's index",
                    );
                }
            }
            Ok(None) | Err(_) => {
                let nonce = asked.err().unwrap_or_else(|| fastrand::u64(..));
                let request = wire::encode(&self.header(0), &[Op::SnapshotRequest { nonce }]);
                let channel = super::channel(&self.config);
                let sent = self.commands().map(|c| {
                    redis::cmd("PUBLISH")
                        .arg(&channel)
                        .arg(&request)
                        .query::<i64>(c)
                });
                match sent {
                    Some(Ok(_)) => {
                        if let Some(w) = &mut self.warming {
                            w.asked = Some((nonce, Instant::now()));
                        }
                    }
                    _ => self.commands = None,
                }
            }
            Ok(Some(nonce)) => {
                let key = super::snapshot_key(&self.config, nonce);
                let got = self
                    .commands()
                    .map(|c| redis::cmd("GET").arg(&key).query::<Option<Vec<u8>>>(c));
                match got {
                    Some(Ok(Some(bytes))) => {
                        self.load_snapshot(&bytes, since);
                        return;
                    }
                    Some(Ok(None)) => {}
                    _ => self.commands = None,
                }
            }
        }
        if self.warming.is_some() && waited >= self.config.warm_timeout {
            tracing::warn!(
                waited_ms = waited.as_millis() as u64,
                "cluster: no peer's snapshot arrived in cluster.warm_timeout_ms; ready with what the bus brings from now on"
            );
            self.warmed(since, "");
        }
    }

    fn warmed(&mut self, since: Instant, why: &str) {
        self.warming = None;
        self.status
            .warm_ms
            .store(since.elapsed().as_millis() as u64, Ordering::Relaxed);
        if !why.is_empty() {
            tracing::info!("cluster: {why}");
        }
        self.status.warm.store(true, Ordering::Relaxed);
    }

    /// Loads a peer's snapshot into the coordinator (and so every shard).
    fn load_snapshot(&mut self, bytes: &[u8], since: Instant) {
        let batch = match wire::decode(bytes, self.status.fingerprint) {
            Ok(b) => b,
            Err(e) => {
                self.status.count_dropped(super::dropped_of(&e));
                tracing::warn!(error = %e, "cluster: a peer's snapshot did not decode; starting from what the bus brings");
                return self.warmed(since, "");
            }
        };
        let now_ms = self.shared.now_ms();
        let mut blocks = 0u64;
        let mut load = Vec::with_capacity(batch.ops.len());
        for op in batch.ops {
            if !matches!(
                op,
                Op::Insert { .. } | Op::BindSession { .. } | Op::HoldChunks { .. }
            ) {
                continue;
            }
            // Snapshot times are ages: this replica's clock is not the peer's.
            if let Ok(Some(op)) = index_op(op, &self.slots, |age| now_ms.saturating_sub(age)) {
                if let IndexOp::Insert { blocks: chain, .. } = &op {
                    blocks += chain.len() as u64;
                }
                load.push(op);
            }
        }
        let ops = load.len() as u64;
        // Applied by the coordinator (and sent on to every shard) before this
        // replica calls itself warm.
        let (tx, rx) = crossbeam_channel::bounded(1);
        if self
            .coordinator
            .send(AdminRequest::LoadPeerOps {
                ops: load,
                reply: tx,
            })
            .is_ok()
        {
            let _ = rx.recv_timeout(Duration::from_secs(10));
        }
        self.status.snapshots_loaded.fetch_add(1, Ordering::Relaxed);
        self.status.snapshot_ops.fetch_add(ops, Ordering::Relaxed);
        tracing::info!(
            ops,
            blocks,
            ms = since.elapsed().as_millis() as u64,
            "cluster: warm from a peer's snapshot"
        );
        self.warmed(since, "");
    }

    /// A peer is joining: store this replica's index for it. Only a warm replica
    /// answers, or it would hand out an empty index, with one exception that keeps
    /// replicas started together from waiting on each other: the oldest replica
    /// heard (earliest epoch, then smallest node id) answers a younger one even
    /// while cold, and is warm from then on (it starts the fleet's index).
    fn serve_snapshot(&mut self, nonce: u64, from: &Header) {
        if !self.status.warm.load(Ordering::Relaxed) {
            let me = (self.status.epoch, self.status.node_id);
            let oldest = self.peers.oldest().is_none_or(|peer| me < peer);
            if !(oldest && me < (from.epoch, from.node)) {
                return;
            }
            if let Some(w) = &self.warming {
                let since = w.since;
                self.warmed(
                    since,
                    "the oldest replica heard: it starts the fleet's index",
                );
            }
        }
        let key = super::snapshot_key(&self.config, nonce);
        let (tx, rx) = crossbeam_channel::bounded(1);
        if self.coordinator.send(AdminRequest::Snapshot(tx)).is_err() {
            return;
        }
        let Ok(snap) = rx.recv_timeout(Duration::from_secs(5)) else {
            return;
        };
        let keys = backend_keys(&self.live);
        let key_of = |slot: usize| keys.get(slot).copied().flatten();
        let mut ops =
            Vec::with_capacity(snap.index.len() + snap.sessions.len() + snap.chunks.len());
        for h in snap.index {
            if let Some(backend) = key_of(h.backend) {
                ops.push(Op::Insert {
                    backend,
                    blocks: h.blocks.into(),
                    now_ms: snap.now_ms.saturating_sub(h.last_used),
                });
            }
        }
        for (session, slot, at) in snap.sessions {
            if let Some(backend) = key_of(slot) {
                ops.push(Op::BindSession {
                    session,
                    backend,
                    now_ms: snap.now_ms.saturating_sub(at),
                });
            }
        }
        for (slot, at, chunks) in snap.chunks {
            if let Some(backend) = key_of(slot) {
                ops.push(Op::HoldChunks {
                    backend,
                    chunks: chunks.into(),
                    now_ms: snap.now_ms.saturating_sub(at),
                });
            }
        }
        let bytes = wire::encode(&self.header(0), &ops);
        let stored = self.commands().map(|c| {
            redis::cmd("SET")
                .arg(&key)
                .arg(&bytes)
                .arg("NX")
                .arg("PX")
                .arg(SNAPSHOT_TTL_MS)
                .query::<Option<String>>(c)
        });
        match stored {
            Some(Ok(Some(_))) => {
                self.status.snapshots_served.fetch_add(1, Ordering::Relaxed);
                tracing::info!(
                    ops = ops.len(),
                    bytes = bytes.len(),
                    "cluster: stored a snapshot for a joining peer"
                );
            }
            Some(Ok(None)) => {} // another peer's copy was first
            _ => self.commands = None,
        }
    }

    /// A header for this replica's own requests and snapshots (outside its
    /// numbered stream: they are never fenced).
    fn header(&self, seq: u64) -> Header {
        Header {
            fingerprint: self.status.fingerprint,
            node: self.status.node_id,
            epoch: self.status.epoch,
            seq,
            sent_us: super::unix_us(),
        }
    }
}
