//! The coordinator thread: the fleet's source of truth, off the request path.
//!
//! It owns the authoritative prefix index and session table, numbers and fans out
//! the index events shards send it (see [`crate::replica`]), and turns health-check
//! results into immutable [`FleetSnapshot`]s published to every shard on change. The
//! health checks themselves run on their own thread ([`run_health_checks`]) so a
//! slow backend never delays replication.

use crate::config::{BackendConfig, HealthConfig};
use crate::fleet::FleetSnapshot;
use crate::replica::{IndexEvent, SessionTable};
use crate::shard::{ShardCommand, Shared};
use crossbeam_channel::{select, Receiver, Sender};
use radixgate_orchestrator::{IndexConfig, PrefixIndex};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

pub struct HealthReport {
    pub backend: usize,
    pub ok: bool,
}

pub struct Coordinator {
    shared: Arc<Shared>,
    healthy: Vec<bool>,
    passes: Vec<u32>,
    failures: Vec<u32>,
    version: u64,
    index: PrefixIndex,
    sessions: SessionTable,
}

impl Coordinator {
    pub fn new(shared: Arc<Shared>) -> Self {
        let n = shared.config.backends.len();
        let index = new_index(&shared);
        let sessions = SessionTable::new(
            shared.config.routing.session_ttl.as_millis() as u64,
            shared.config.routing.max_sessions,
        );
        Self {
            shared,
            healthy: vec![true; n],
            passes: vec![0; n],
            failures: vec![0; n],
            version: 0,
            index,
            sessions,
        }
    }

    /// Runs until `stop` is dropped or fires.
    pub fn run(
        mut self,
        stop: Receiver<()>,
        events: Receiver<IndexEvent>,
        health: Receiver<HealthReport>,
    ) {
        loop {
            select! {
                recv(stop) -> _ => return,
                recv(events) -> ev => match ev {
                    Ok(ev) => self.replicate(ev),
                    Err(_) => return,
                },
                recv(health) -> report => {
                    if let Ok(r) = report {
                        self.on_health(r);
                    }
                }
            }
        }
    }

    fn replicate(&mut self, event: IndexEvent) {
        event.apply(&mut self.index, &mut self.sessions);
        self.shared
            .index_blocks
            .store(self.index.total_blocks() as u64, Ordering::Relaxed);
        let event = Arc::new(event);
        for (k, shard) in self.shared.shard_commands.iter().enumerate() {
            if k != event.origin_shard && shard.send(ShardCommand::Replicate(event.clone())).is_ok()
            {
                self.shared.replica_sent.add(k);
            }
        }
    }

    fn on_health(&mut self, r: HealthReport) {
        let i = r.backend;
        let thresholds = &self.shared.config.health;
        let id = &self.shared.config.backends[i].id;
        let changed = if r.ok {
            self.passes[i] += 1;
            self.failures[i] = 0;
            let up = !self.healthy[i] && self.passes[i] >= thresholds.healthy_threshold;
            if up {
                tracing::info!(backend = %id, "backend is healthy again");
            }
            up
        } else {
            self.failures[i] += 1;
            self.passes[i] = 0;
            let down = self.healthy[i] && self.failures[i] >= thresholds.unhealthy_threshold;
            if down {
                tracing::warn!(backend = %id, "backend failed its health checks");
            }
            down
        };
        if changed {
            self.healthy[i] = r.ok;
            self.version += 1;
            let snapshot = Arc::new(FleetSnapshot {
                version: self.version,
                healthy: self.healthy.clone().into_boxed_slice(),
            });
            for s in &self.shared.shard_commands {
                let _ = s.send(ShardCommand::Fleet(snapshot.clone()));
            }
        }
    }
}

/// A prefix index with every backend declared at its configured capacity.
pub fn new_index(shared: &Shared) -> PrefixIndex {
    let mut index = PrefixIndex::new(IndexConfig {
        max_blocks: shared.config.routing.index_max_blocks,
    });
    for (i, b) in shared.config.backends.iter().enumerate() {
        index.set_capacity(i, b.cache_blocks);
    }
    index
}

/// The health-check thread: probes every backend each interval and reports to the
/// coordinator. Ends when `stop` is dropped or fires.
pub fn run_health_checks(
    backends: Vec<BackendConfig>,
    health: HealthConfig,
    reports: Sender<HealthReport>,
    stop: Receiver<()>,
) {
    loop {
        for (i, b) in backends.iter().enumerate() {
            let ok = probe_health(b, health.timeout);
            if reports.send(HealthReport { backend: i, ok }).is_err() {
                return;
            }
        }
        select! {
            recv(stop) -> _ => return,
            default(health.interval) => {}
        }
    }
}

/// One `GET /health`; true on a 2xx status line within `timeout`.
fn probe_health(backend: &BackendConfig, timeout: Duration) -> bool {
    let Ok(mut s) = TcpStream::connect_timeout(&backend.addr, timeout) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(timeout));
    let _ = s.set_write_timeout(Some(timeout));
    let req = format!(
        "GET /health HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
        backend.host
    );
    if s.write_all(req.as_bytes()).is_err() {
        return false;
    }
    let mut buf = [0u8; 64];
    let mut len = 0;
    while len < 12 {
        match s.read(&mut buf[len..]) {
            Ok(0) | Err(_) => return false,
            Ok(n) => len += n,
        }
    }
    buf.starts_with(b"HTTP/1.") && buf[9] == b'2'
}
