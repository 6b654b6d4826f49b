//! The coordinator thread: the fleet's source of truth off the request path.
//!
//! It runs active health checks (`GET /health` on every backend each
//! `health.interval`, with thresholds for flipping state) and publishes a new
//! immutable [`FleetSnapshot`] to every shard whenever the picture changes. It may
//! block (plain std sockets with timeouts): it never runs on a shard's core unless
//! pinned there.

use crate::config::{BackendConfig, HealthConfig};
use crate::fleet::FleetSnapshot;
use crate::shard::ShardCommand;
use crossbeam_channel::{select, Receiver};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

pub struct Coordinator {
    backends: Vec<BackendConfig>,
    health: HealthConfig,
    shards: Vec<flume::Sender<ShardCommand>>,
    healthy: Vec<bool>,
    passes: Vec<u32>,
    failures: Vec<u32>,
    version: u64,
}

impl Coordinator {
    pub fn new(
        backends: Vec<BackendConfig>,
        health: HealthConfig,
        shards: Vec<flume::Sender<ShardCommand>>,
    ) -> Self {
        let n = backends.len();
        Self {
            backends,
            health,
            shards,
            healthy: vec![true; n],
            passes: vec![0; n],
            failures: vec![0; n],
            version: 0,
        }
    }

    /// Runs until `stop` fires (or its sender is dropped).
    pub fn run(mut self, stop: Receiver<()>) {
        loop {
            self.check_round();
            select! {
                recv(stop) -> _ => return,
                default(self.health.interval) => {}
            }
        }
    }

    fn check_round(&mut self) {
        let mut changed = false;
        for i in 0..self.backends.len() {
            let ok = probe_health(&self.backends[i], self.health.timeout);
            if ok {
                self.passes[i] += 1;
                self.failures[i] = 0;
                if !self.healthy[i] && self.passes[i] >= self.health.healthy_threshold {
                    self.healthy[i] = true;
                    changed = true;
                    tracing::info!(backend = %self.backends[i].id, "backend is healthy again");
                }
            } else {
                self.failures[i] += 1;
                self.passes[i] = 0;
                if self.healthy[i] && self.failures[i] >= self.health.unhealthy_threshold {
                    self.healthy[i] = false;
                    changed = true;
                    tracing::warn!(backend = %self.backends[i].id, "backend failed its health checks");
                }
            }
        }
        if changed {
            self.version += 1;
            let snapshot = Arc::new(FleetSnapshot {
                version: self.version,
                healthy: self.healthy.clone().into_boxed_slice(),
            });
            for s in &self.shards {
                let _ = s.send(ShardCommand::Fleet(snapshot.clone()));
            }
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
