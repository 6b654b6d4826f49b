//! Starting and stopping the gateway: binds every shard's listener, spawns the
//! pinned shard threads and the coordinator, and hands back a [`Gateway`] handle.
//!
//! Listeners are bound on the caller's thread before any thread starts, so a caller
//! (a test, the demo) knows the port at once and never waits for start-up.

use crate::backends::LiveConfig;
use crate::config::Config;
use crate::control::{AdminRequest, Shared};
use crate::coordinator::{run_health_checks, Coordinator};
use crate::fleet::FleetSnapshot;
use crate::runtime::{bind_reuseport, stop_listening, Driver, ShardRuntime};
use crate::server::{accept_loop, drain};
use crate::shard::Shard;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

pub struct Gateway {
    addr: SocketAddr,
    driver: Driver,
    shard_threads: Vec<JoinHandle<()>>,
    shard_stops: Vec<flume::Sender<()>>,
    /// Dropping the sender stops the coordinator and health threads.
    control: Option<(crossbeam_channel::Sender<()>, Vec<JoinHandle<()>>)>,
    admin_addr: Option<SocketAddr>,
    /// To the coordinator (reloads); held for the gateway's life, so the
    /// coordinator's admin channel never disconnects.
    coordinator: crossbeam_channel::Sender<AdminRequest>,
    /// The config file a reload re-reads.
    source: Option<std::path::PathBuf>,
    /// One per thread that writes out what it holds once the shards are gone (the
    /// access log, the span exporter): disconnected when that thread has ended.
    flushed: Vec<crossbeam_channel::Receiver<()>>,
}

/// How long a stop waits for the log and span threads' last writes (a span export
/// may take up to its 5 s I/O limit).
const FLUSH_WAIT: Duration = Duration::from_secs(6);

impl Gateway {
    pub fn start(config: Config) -> io::Result<Gateway> {
        let driver = Driver::resolve(config.server.io);
        let shards = config.server.shards.get();

        // Bind every listener up front; shard 0 resolves port 0 for the others.
        let first = bind_reuseport(config.server.listen, driver)?;
        let addr = first.local_addr()?;
        let mut listeners = vec![first];
        for _ in 1..shards {
            listeners.push(bind_reuseport(addr, driver)?);
        }

        let (cmd_txs, cmd_rxs): (Vec<_>, Vec<_>) = (0..shards).map(|_| flume::unbounded()).unzip();
        let (events_tx, events_rx) = crossbeam_channel::unbounded();
        let (outcomes_tx, outcomes_rx) = crossbeam_channel::unbounded();
        let (admin_tx, admin_rx) = crossbeam_channel::unbounded();
        let (access_tx, access_rx) = match config.log.access {
            true => {
                let (tx, rx) = crossbeam_channel::unbounded();
                (Some(tx), Some(rx))
            }
            false => (None, None),
        };
        // Bind the admin listener up front too, so its errors surface here.
        let admin_listener = match &config.admin {
            Some(a) => Some((std::net::TcpListener::bind(a.listen)?, a.token.clone())),
            None => None,
        };
        let admin_addr = admin_listener
            .as_ref()
            .map(|(l, _)| l.local_addr())
            .transpose()?;
        let core_ids = core_affinity::get_core_ids().unwrap_or_default();
        let cores = config.server.cores.clone();
        let coordinator_core = config.server.coordinator_core;
        let source = config.source.clone();
        let live = LiveConfig::initial(&config);
        let (spans_tx, spans_rx) = match config.traces.is_some() {
            true => {
                let (tx, rx) = crossbeam_channel::bounded(crate::trace::CHANNEL_CAPACITY);
                (Some(tx), Some(rx))
            }
            false => (None, None),
        };
        // Cluster mode: refuse to start into a fleet that routes differently.
        let cluster = match &config.cluster {
            Some(c) => {
                let fingerprint = crate::cluster::config_fingerprint(&config);
                crate::cluster::check_join(c, fingerprint).map_err(io::Error::other)?;
                Some((
                    c.clone(),
                    Arc::new(crate::cluster::new_status(c, fingerprint)),
                ))
            }
            None => None,
        };
        let mut shared = Shared::new(config, cmd_txs, events_tx, outcomes_tx, access_tx);
        shared.spans = spans_tx;
        shared.cluster = cluster.as_ref().map(|(_, status)| status.clone());
        let shared = Arc::new(shared);
        let initial = Arc::new(FleetSnapshot::all_healthy(live.clone()));
        // Precise mode: bind the KV-event endpoints now, so a bad one fails start-up.
        let kv_sockets = kv_subscriptions(&shared.config)
            .map(|(subs, block_tokens)| {
                crate::kv_events::bind(subs).map(|sockets| (sockets, block_tokens))
            })
            .transpose()
            .map_err(io::Error::other)?;

        let mut shard_threads = Vec::with_capacity(shards);
        let mut shard_stops = Vec::with_capacity(shards);
        for (id, (listener, commands)) in listeners.into_iter().zip(cmd_rxs).enumerate() {
            let (stop_tx, stop_rx) = flume::bounded::<()>(1);
            shard_stops.push(stop_tx);
            let shared = shared.clone();
            let fleet = initial.clone();
            let core = (!cores.is_empty()).then(|| cores[id % cores.len()]);
            let core_id = core.and_then(|c| core_ids.iter().find(|k| k.id == c).copied());
            if let (Some(c), None) = (core, core_id) {
                // The core exists (config validation checked the host) but this process
                // may not run there, e.g. under a narrower `taskset`.
                tracing::warn!(
                    shard = id,
                    core = c,
                    "server.cores: core is outside this process's CPU affinity; shard runs unpinned"
                );
            }
            let handle = std::thread::Builder::new()
                .name(format!("radixgate-shard-{id}"))
                .spawn(move || {
                    let pinned = core_id.is_some_and(|core| {
                        let ok = core_affinity::set_for_current(core);
                        if !ok {
                            tracing::warn!(shard = id, core = core.id, "could not pin shard to core");
                        }
                        ok
                    });
                    let mut runtime = match ShardRuntime::build(driver) {
                        Ok(rt) => rt,
                        Err(e) => {
                            tracing::error!(shard = id, error = %e, "could not build the shard runtime");
                            return;
                        }
                    };
                    shared.placements.record(id, core, pinned, driver);
                    runtime.block_on(async move {
                        let listener = match monoio::net::TcpListener::from_std(listener) {
                            Ok(l) => l,
                            Err(e) => {
                                tracing::error!(shard = id, error = %e, "could not adopt listener");
                                return;
                            }
                        };
                        let shard = Shard::new(id, shared, fleet);
                        monoio::spawn(shard.clone().command_loop(commands));
                        monoio::spawn(crate::stall::watch(shard.clone()));
                        monoio::spawn(crate::shard::reclaim::watch(shard.clone()));
                        monoio::select! {
                            _ = accept_loop(shard.clone(), &listener) => {}
                            _ = stop_rx.recv_async() => {}
                        }
                        // Stop listening (an accept parked in io_uring would keep
                        // the socket open past a plain drop), then finish what is in
                        // flight.
                        stop_listening(&listener);
                        drop(listener);
                        // `server.shutdown_timeout_ms` as last reloaded.
                        let shutdown_timeout =
                            shard.fleet.borrow().live.config.server.shutdown_timeout;
                        drain(&shard, shutdown_timeout).await;
                    });
                })?;
            shard_threads.push(handle);
        }

        // Dropping `stop_tx` ends the coordinator and the health checker.
        let (stop_tx, stop_rx) = crossbeam_channel::bounded::<()>(0);
        let (health_tx, health_rx) = crossbeam_channel::unbounded();
        // The health checker and the access log follow backend and setting changes.
        let (health_live_tx, health_live_rx) = crossbeam_channel::unbounded();
        let mut followers = vec![health_live_tx];
        let log_live_rx = access_rx.is_some().then(|| {
            let (tx, rx) = crossbeam_channel::unbounded();
            followers.push(tx);
            rx
        });
        let otlp_live_rx = spans_rx.is_some().then(|| {
            let (tx, rx) = crossbeam_channel::unbounded();
            followers.push(tx);
            rx
        });
        // The cluster threads follow backend changes too (bus names of the slots).
        let cluster = cluster.map(|(config, status)| {
            let (pub_tx, pub_rx) = crossbeam_channel::unbounded();
            let (sub_tx, sub_rx) = crossbeam_channel::unbounded();
            followers.push(pub_tx);
            followers.push(sub_tx);
            let (ops_tx, ops_rx) = crossbeam_channel::bounded(crate::cluster::publish::QUEUE);
            (config, status, pub_rx, sub_rx, ops_tx, ops_rx)
        });
        let mut coordinator = Coordinator::new(shared.clone(), live.clone(), followers);
        if let Some((_, _, _, _, ops_tx, _)) = &cluster {
            coordinator = coordinator.with_cluster(ops_tx.clone());
        }
        let coordinator_core_id =
            coordinator_core.and_then(|c| core_ids.iter().find(|k| k.id == c).copied());
        let coord_stop = stop_rx.clone();
        let coord_handle = std::thread::Builder::new()
            .name("radixgate-coord".into())
            .spawn(move || {
                if let Some(core) = coordinator_core_id {
                    core_affinity::set_for_current(core);
                }
                coordinator.run(coord_stop, events_rx, health_rx, outcomes_rx, admin_rx)
            })?;
        let mut control_threads = vec![coord_handle];
        let mut flushed = Vec::new();
        if let (Some(records), Some(updates)) = (access_rx, log_live_rx) {
            let live = live.clone();
            let (done, ended) = crossbeam_channel::bounded::<()>(0);
            flushed.push(ended);
            // Ends (after a last write) when the stop signal comes, after the shards
            // have ended; `done` goes with it.
            let stop = stop_rx.clone();
            std::thread::Builder::new()
                .name("radixgate-log".into())
                .spawn(move || {
                    let _done = done;
                    crate::access_log::run(records, live, updates, stop)
                })?;
        }
        if let (Some(spans), Some(updates), Some(traces)) =
            (spans_rx, otlp_live_rx, shared.config.traces.clone())
        {
            let (live, counters) = (live.clone(), shared.span_counters.clone());
            let (done, ended) = crossbeam_channel::bounded::<()>(0);
            flushed.push(ended);
            // Ends (after a last export) when the stop signal comes, after the shards
            // have ended.
            let stop = stop_rx.clone();
            std::thread::Builder::new()
                .name("radixgate-otlp".into())
                .spawn(move || {
                    let _done = done;
                    crate::otlp::run(spans, traces, live, updates, counters, stop)
                })?;
        }
        if let Some((listener, token)) = admin_listener {
            let admin_stop = stop_rx.clone();
            let (admin_tx, source, shared) = (admin_tx.clone(), source.clone(), shared.clone());
            control_threads.push(
                std::thread::Builder::new()
                    .name("radixgate-admin".into())
                    .spawn(move || {
                        crate::admin::serve(listener, token, admin_tx, source, shared, admin_stop)
                    })?,
            );
        }
        if let Some((sockets, block_tokens)) = kv_sockets {
            let out = crate::kv_events::Outputs {
                index: shared.index_events.clone(),
                counters: shared.kv_events.clone(),
                epoch: shared.epoch,
            };
            let stop = stop_rx.clone();
            control_threads.push(
                std::thread::Builder::new()
                    .name("radixgate-kv".into())
                    .spawn(move || crate::kv_events::run(sockets, block_tokens, out, stop))?,
            );
        }
        if let Some((config, status, pub_rx, sub_rx, ops_tx, ops_rx)) = cluster {
            drop(ops_tx); // the coordinator holds the sender
            let start = |config| crate::cluster::Start {
                config,
                status: status.clone(),
                shared: shared.clone(),
                live: live.clone(),
            };
            let (publisher, subscriber) = (start(config.clone()), start(config));
            let stop = stop_rx.clone();
            control_threads.push(
                std::thread::Builder::new()
                    .name("radixgate-cluster-pub".into())
                    .spawn(move || crate::cluster::publish::run(publisher, pub_rx, ops_rx, stop))?,
            );
            let (coordinator, stop) = (admin_tx.clone(), stop_rx.clone());
            control_threads.push(
                std::thread::Builder::new()
                    .name("radixgate-cluster-sub".into())
                    .spawn(move || {
                        crate::cluster::subscribe::run(subscriber, coordinator, sub_rx, stop)
                    })?,
            );
        }
        {
            let (shared, coordinator, stop) = (shared.clone(), admin_tx.clone(), stop_rx.clone());
            control_threads.push(
                std::thread::Builder::new()
                    .name("radixgate-capacity".into())
                    .spawn(move || crate::capacity::run(shared, coordinator, stop))?,
            );
        }
        if !shared.config.discovery.is_empty() {
            let (shared, coordinator, stop) = (shared.clone(), admin_tx.clone(), stop_rx.clone());
            control_threads.push(
                std::thread::Builder::new()
                    .name("radixgate-discovery".into())
                    .spawn(move || crate::discovery::run(shared, coordinator, stop))?,
            );
        }
        let health_handle = std::thread::Builder::new()
            .name("radixgate-health".into())
            .spawn(move || {
                if let Some(core) = coordinator_core_id {
                    core_affinity::set_for_current(core);
                }
                run_health_checks(live, health_live_rx, health_tx, stop_rx)
            })?;
        tracing::info!(%addr, shards, driver = driver.as_str(), "radixgate listening");
        Ok(Gateway {
            addr,
            driver,
            shard_threads,
            shard_stops,
            control: Some((stop_tx, {
                control_threads.push(health_handle);
                control_threads
            })),
            admin_addr,
            coordinator: admin_tx,
            source,
            flushed,
        })
    }

    /// Re-reads the config file the gateway started with and applies it (what
    /// SIGHUP and `POST /admin/reload` do): the JSON summary of what changed, or the
    /// validation errors, in which case the running config stays.
    pub fn reload(&self) -> Result<serde_json::Value, crate::error::GatewayError> {
        crate::reload::from_file(self.source.as_deref(), &self.coordinator)
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Where the admin API listens, when configured.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin_addr
    }

    pub fn driver(&self) -> Driver {
        self.driver
    }

    /// Graceful stop: every shard stops accepting, finishes its requests in flight
    /// (up to `server.shutdown_timeout`), closes its connections; then the
    /// coordinator and health threads stop, and the access log and span exporter
    /// write out what they hold. Returns when every thread has ended (the last two
    /// waited for up to [`FLUSH_WAIT`] in all).
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        for s in self.shard_stops.drain(..) {
            let _ = s.send(());
        }
        for t in self.shard_threads.drain(..) {
            let _ = t.join();
        }
        if let Some((stop, handles)) = self.control.take() {
            drop(stop);
            for h in handles {
                let _ = h.join();
            }
        }
        let deadline = std::time::Instant::now() + FLUSH_WAIT;
        for ended in self.flushed.drain(..) {
            // Disconnected once the thread has ended; nothing is ever sent.
            let _ = ended.recv_deadline(deadline);
        }
    }
}

/// The KV-event subscriptions precise mode asks for, with its block size; `None`
/// when no backend has `kv_events`.
fn kv_subscriptions(
    config: &crate::config::Config,
) -> Option<(Vec<crate::kv_events::Subscription>, std::num::NonZeroUsize)> {
    let crate::config::Hashing::Tokens { block_tokens, .. } = &config.routing.hashing else {
        return None;
    };
    let subs: Vec<_> = config
        .backends
        .iter()
        .enumerate()
        .filter_map(|(i, b)| {
            let source = b.kv_events.clone()?;
            Some(crate::kv_events::Subscription::new(i, source, &b.models[0]))
        })
        .collect();
    (!subs.is_empty()).then_some((subs, *block_tokens))
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.stop();
    }
}
