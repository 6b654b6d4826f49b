//! Per-shard pool of idle keep-alive connections to each backend.
//!
//! A shard owns its pool outright (no sharing, no locks). Connections are reused
//! most-recent-first, so the warmest socket goes out and the oldest ones age out;
//! a connection idle longer than `pool_idle_expiry` is closed instead of reused, and
//! at most `pool_max_idle` are kept per backend. Pools carry over a config reload:
//! new backend slots get an empty queue, and a retired backend's queue is closed.

use crate::tls::Stream;
use monoio::time::Instant;
use std::collections::VecDeque;
use std::time::Duration;

struct IdleConn {
    stream: Stream,
    since: Instant,
}

pub struct UpstreamPool {
    idle: Vec<VecDeque<IdleConn>>,
    max_idle: usize,
    expiry: Duration,
}

impl UpstreamPool {
    pub fn new(backends: usize, max_idle: usize, expiry: Duration) -> Self {
        Self {
            idle: (0..backends).map(|_| VecDeque::new()).collect(),
            max_idle,
            expiry,
        }
    }

    /// Follows new live settings: queues for `backends` slots, new limits.
    pub fn configure(&mut self, backends: usize, max_idle: usize, expiry: Duration) {
        if self.idle.len() < backends {
            self.idle.resize_with(backends, VecDeque::new);
        }
        self.max_idle = max_idle;
        self.expiry = expiry;
        for queue in &mut self.idle {
            while queue.len() > max_idle {
                queue.pop_front();
            }
        }
    }

    /// Closes every idle connection to `backend` (removed, or moved to a new address).
    pub fn close(&mut self, backend: usize) {
        if let Some(queue) = self.idle.get_mut(backend) {
            queue.clear();
        }
    }

    /// The most recently parked connection to `backend` that has not expired by `now`.
    pub fn take(&mut self, backend: usize, now: Instant) -> Option<Stream> {
        let queue = &mut self.idle[backend];
        while let Some(front) = queue.front() {
            if now.saturating_duration_since(front.since) < self.expiry {
                break;
            }
            queue.pop_front();
        }
        queue.pop_back().map(|c| c.stream)
    }

    pub fn put(&mut self, backend: usize, stream: Stream) {
        let queue = &mut self.idle[backend];
        if queue.len() >= self.max_idle {
            queue.pop_front();
        }
        if self.max_idle > 0 {
            queue.push_back(IdleConn {
                stream,
                since: Instant::now(),
            });
        }
    }

    pub fn idle(&self, backend: usize) -> usize {
        self.idle[backend].len()
    }
}
