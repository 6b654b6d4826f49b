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

use super::peers::{Peers, Verdict};
use super::wire::{self, BackendKey, Op};
use super::{publish::backend_keys, ClusterStatus, Dropped, RECONNECT_EVERY};
use crate::backends::LiveConfig;
use crate::config::ClusterConfig;
use crate::replica::{IndexEvent, IndexOp, Origin};
use crate::shard::Shared;
use crossbeam_channel::{Receiver, RecvTimeoutError, TryRecvError};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The longest one read waits, so the thread sees `stop` and its report tick.
const READ_WAIT: Duration = Duration::from_millis(50);
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
    config: ClusterConfig,
    status: Arc<ClusterStatus>,
    shared: Arc<Shared>,
    live: Arc<LiveConfig>,
    updates: Receiver<Arc<LiveConfig>>,
    stop: Receiver<()>,
) {
    let mut s = Subscriber {
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
        while !stopped() {
            while let Ok(newer) = updates.try_recv() {
                s.follow(newer);
            }
            match pubsub.get_message() {
                Ok(msg) => s.on_message(msg.get_payload_bytes()),
                Err(e) if e.is_timeout() => {}
                Err(e) => {
                    s.lost(&e.to_string());
                    break;
                }
            }
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
        if !self.down {
            self.down = true;
            self.status.outages.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(url = %self.config.url, error, "cluster bus lost; routing on local state until it is back");
        }
    }

    fn on_message(&mut self, bytes: &[u8]) {
        self.status.batches_received.fetch_add(1, Ordering::Relaxed);
        let batch = match wire::decode(bytes, self.status.fingerprint) {
            Ok(b) => b,
            Err(e) => {
                let why = Dropped::of(&e);
                self.status.count_dropped(why);
                if !std::mem::replace(&mut self.logged[why as usize], true) {
                    tracing::warn!(error = %e, "cluster: dropped a bus message (logged once per kind; counted in radixgate_cluster_messages_dropped_total)");
                }
                return;
            }
        };
        let h = batch.header;
        if h.node == self.status.node_id && h.epoch == self.status.epoch {
            return; // our own
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
        let slot = |key: BackendKey| self.slots.get(&key).copied();
        let index_op = match op {
            Op::Insert {
                backend, blocks, ..
            } => slot(backend).map(|backend| IndexOp::Insert {
                backend,
                blocks,
                now_ms,
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
                backend, chunks, ..
            } => slot(backend).map(|backend| IndexOp::HoldChunks {
                backend,
                chunks,
                now_ms,
            }),
            Op::BindSession {
                session, backend, ..
            } => slot(backend).map(|backend| IndexOp::BindSession {
                session,
                backend,
                now_ms,
            }),
            Op::Load {
                backend,
                in_flight,
                pending_prefill_tokens,
            } => {
                match slot(backend) {
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
                }
                return;
            }
            // Not shared yet: each replica checks health and keeps its own quotas.
            Op::Health { .. } | Op::Tenant { .. } => return,
        };
        let Some(op) = index_op else {
            self.status
                .ops_unknown_backend
                .fetch_add(1, Ordering::Relaxed);
            return;
        };
        self.status.ops_applied.fetch_add(1, Ordering::Relaxed);
        let _ = self.shared.index_events.send(IndexEvent {
            origin: Origin::Peer,
            created: now,
            op,
        });
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
                self.shared.pending_prefill.set_peer_tokens(slot, now.1);
            }
        }
    }
}
