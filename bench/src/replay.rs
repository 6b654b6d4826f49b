//! `replay`: fires a [trace](crate::trace) at a live gateway and records what each
//! request got back.
//!
//! `concurrency` threads, each with one keep-alive [`Client`], take requests from a
//! shared schedule: the earliest line (by `at_ms`, then file order) whose time has
//! come (`at_ms / speedup` after the start) and whose session's previous turn has
//! completed (successfully or not). A line that is not yet due, or waits for its
//! predecessor, does not hold up other sessions. Each request carries `X-Session-ID:
//! <session>`; per request it records status, TTFT, total time, `X-Router-Backend`,
//! `X-Router-Reason` and the engine's `usage` (prompt and cached tokens). The summary
//! is the load generator's [`Stats`], which also counts reasons and the cached-token
//! share (the hit rate as the engines report it).
//!
//! With several targets (gateway replicas) each request goes to one of them chosen at
//! random, as an L4 balancer that spreads requests (not connections) would send it:
//! every thread keeps one keep-alive connection per target and draws the target per
//! request from its own seeded generator ([`Spread`]).

use std::collections::{BTreeSet, HashMap};
use std::fmt::Write as _;
use std::sync::{Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use crate::http::{Client, Target};
use crate::json;
use crate::report::Stats;
use crate::trace::TraceLine;

#[derive(Clone, Debug)]
pub struct ReplayConfig {
    /// One or more gateways; with several, each request goes to a random one.
    pub targets: Vec<Target>,
    /// Seeds the per-request target choice ([`Spread`]).
    pub spread_seed: u64,
    /// Requests in flight at most (one thread and connection each).
    pub concurrency: usize,
    /// `at_ms` is divided by this (2.0 replays twice as fast); values ≤ 0 or not
    /// finite send every line as soon as its turn order allows.
    pub speedup: f64,
    /// Extra headers on every request.
    pub headers: Vec<(String, String)>,
    pub timeout: Duration,
}

/// What one trace line got.
#[derive(Clone, Debug, PartialEq)]
pub struct Record {
    pub session: String,
    pub turn: u64,
    /// Index of the target (in [`ReplayConfig::targets`]) it was sent to.
    pub target: usize,
    /// Since the start of the replay, ms.
    pub start_ms: f64,
    /// `None` for a transport error.
    pub status: Option<u16>,
    /// Transport error kind (`connect`, `timeout`, `io`, `protocol`).
    pub error: Option<&'static str>,
    pub ttft_ms: Option<f64>,
    pub total_ms: Option<f64>,
    pub backend: Option<String>,
    pub reason: Option<String>,
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
}

impl Record {
    pub fn to_json(&self) -> String {
        let mut s = String::from("{\"session\":");
        json::push_str(&mut s, &self.session);
        let _ = write!(
            s,
            ",\"turn\":{},\"target\":{},\"start_ms\":{:.3}",
            self.turn, self.target, self.start_ms
        );
        let num = |v: Option<f64>| v.map_or("null".to_string(), |x| format!("{x:.3}"));
        let int = |v: Option<u64>| v.map_or("null".to_string(), |x| x.to_string());
        let text = |v: Option<&str>| {
            let mut s = String::new();
            match v {
                Some(t) => json::push_str(&mut s, t),
                None => s.push_str("null"),
            }
            s
        };
        let _ = write!(
            s,
            ",\"status\":{},\"error\":{},\"ttft_ms\":{},\"total_ms\":{},\"backend\":{},\"reason\":{},\"prompt_tokens\":{},\"cached_tokens\":{}}}",
            int(self.status.map(u64::from)),
            text(self.error),
            num(self.ttft_ms),
            num(self.total_ms),
            text(self.backend.as_deref()),
            text(self.reason.as_deref()),
            int(self.prompt_tokens),
            int(self.cached_tokens),
        );
        s
    }
}

pub struct ReplayResult {
    pub stats: Stats,
    pub elapsed: Duration,
    /// In trace order.
    pub records: Vec<Record>,
}

/// Which line may go next.
struct Schedule {
    /// Line indices by (`at_ms`, file order).
    order: Vec<usize>,
    /// Positions in `order` not yet started.
    pending: BTreeSet<usize>,
    /// The session's previous turn, per line.
    pred: Vec<Option<usize>>,
    done: Vec<bool>,
}

impl Schedule {
    fn new(lines: &[TraceLine]) -> Schedule {
        let mut order: Vec<usize> = (0..lines.len()).collect();
        order.sort_by(|&a, &b| lines[a].at_ms.total_cmp(&lines[b].at_ms).then(a.cmp(&b)));
        let mut by_session: HashMap<&str, Vec<usize>> = HashMap::new();
        for (i, l) in lines.iter().enumerate() {
            by_session.entry(&l.session).or_default().push(i);
        }
        let mut pred = vec![None; lines.len()];
        for turns in by_session.values_mut() {
            turns.sort_by_key(|&i| (lines[i].turn, i));
            for w in turns.windows(2) {
                pred[w[1]] = Some(w[0]);
            }
        }
        Schedule {
            pending: (0..order.len()).collect(),
            order,
            pred,
            done: vec![false; lines.len()],
        }
    }

    /// The next line to send at `now_ms` (scaled trace time), or how long to wait:
    /// `Err(Some(ms))` until the next line falls due, `Err(None)` until a completion.
    /// `Ok(None)`: nothing left.
    fn take(
        &mut self,
        lines: &[TraceLine],
        now_ms: f64,
        speedup: f64,
    ) -> Result<Option<usize>, Option<f64>> {
        if self.pending.is_empty() {
            return Ok(None);
        }
        let mut found = None;
        let mut next_due = None;
        for &pos in &self.pending {
            let i = self.order[pos];
            let due = if speedup > 0.0 && speedup.is_finite() {
                lines[i].at_ms / speedup
            } else {
                0.0
            };
            if due > now_ms {
                next_due = Some(due - now_ms);
                break;
            }
            if self.pred[i].is_none_or(|p| self.done[p]) {
                found = Some(pos);
                break;
            }
        }
        match found {
            Some(pos) => {
                self.pending.remove(&pos);
                Ok(Some(self.order[pos]))
            }
            None => Err(next_due),
        }
    }
}

/// The per-request choice of target: uniform at random over `n` targets, a function
/// of the seed and the request's line number alone (always 0 with one target), so
/// the split does not depend on which replay thread takes which request.
pub struct Spread {
    n: usize,
    seed: u64,
}

impl Spread {
    pub fn new(n: usize, seed: u64) -> Spread {
        assert!(n >= 1, "at least one target");
        Spread { n, seed }
    }

    /// The target of the trace's line `line`.
    pub fn pick(&self, line: usize) -> usize {
        if self.n == 1 {
            0
        } else {
            let draw = crate::workload::mix(&[self.seed, 0x5EAD, line as u64]);
            fastrand::Rng::with_seed(draw).usize(..self.n)
        }
    }
}

pub fn run(cfg: &ReplayConfig, lines: &[TraceLine]) -> std::io::Result<ReplayResult> {
    assert!(cfg.concurrency >= 1, "concurrency must be at least 1");
    assert!(!cfg.targets.is_empty(), "at least one target");
    let threads = cfg
        .concurrency
        .min(crate::load::MAX_CONCURRENCY)
        .min(lines.len().max(1));
    let schedule = Mutex::new(Schedule::new(lines));
    let wake = Condvar::new();
    let start = Instant::now();
    let (stats, mut records) = thread::scope(|scope| {
        let mut handles = Vec::with_capacity(threads);
        for k in 0..threads {
            let (schedule, wake) = (&schedule, &wake);
            let handle = thread::Builder::new()
                .name(format!("radixgate-bench-replay-{k}"))
                .stack_size(256 * 1024)
                .spawn_scoped(scope, move || worker(cfg, lines, schedule, wake, start))?;
            handles.push(handle);
        }
        let mut stats = Stats::default();
        let mut records = Vec::with_capacity(lines.len());
        for h in handles {
            let (s, r) = h.join().expect("a replay thread panicked");
            stats.merge(&s);
            records.extend(r);
        }
        Ok::<_, std::io::Error>((stats, records))
    })?;
    records.sort_by_key(|(i, _)| *i);
    Ok(ReplayResult {
        stats,
        elapsed: start.elapsed(),
        records: records.into_iter().map(|(_, r)| r).collect(),
    })
}

fn worker(
    cfg: &ReplayConfig,
    lines: &[TraceLine],
    schedule: &Mutex<Schedule>,
    wake: &Condvar,
    start: Instant,
) -> (Stats, Vec<(usize, Record)>) {
    let mut clients: Vec<Client> = cfg
        .targets
        .iter()
        .map(|t| Client::new(t.clone(), &cfg.headers, false, cfg.timeout))
        .collect();
    let spread = Spread::new(clients.len(), cfg.spread_seed);
    let mut stats = Stats::default();
    let mut records = Vec::new();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    loop {
        let i = {
            let mut s = schedule
                .lock()
                .expect("no thread panics holding the schedule");
            loop {
                match s.take(lines, ms(start.elapsed()), cfg.speedup) {
                    Ok(Some(i)) => break Some(i),
                    Ok(None) => break None,
                    Err(Some(wait_ms)) => {
                        let wait = Duration::from_secs_f64(wait_ms / 1000.0);
                        s = wake.wait_timeout(s, wait).expect("not poisoned").0;
                    }
                    Err(None) => s = wake.wait(s).expect("not poisoned"),
                }
            }
        };
        let Some(i) = i else { break };
        let line = &lines[i];
        let start_ms = ms(start.elapsed());
        let session_ok = !line.session.contains(['\r', '\n']);
        let headers: &[(&str, &str)] = if session_ok {
            &[("X-Session-ID", line.session.as_str())]
        } else {
            &[]
        };
        let target = spread.pick(i);
        let mut record = Record {
            session: line.session.clone(),
            turn: line.turn,
            target,
            start_ms,
            status: None,
            error: None,
            ttft_ms: None,
            total_ms: None,
            backend: None,
            reason: None,
            prompt_tokens: None,
            cached_tokens: None,
        };
        match clients[target].send_with(line.body.as_bytes(), headers) {
            Ok(ex) => {
                stats.record(&ex);
                record.status = Some(ex.status);
                record.ttft_ms = Some(ms(ex.ttft));
                record.total_ms = Some(ms(ex.total));
                record.prompt_tokens = ex.usage.map(|u| u.prompt_tokens);
                record.cached_tokens = ex.usage.map(|u| u.cached_tokens);
                record.backend = ex.backend;
                record.reason = ex.reason;
            }
            Err(e) => {
                stats.record_error(e.kind());
                record.error = Some(e.kind());
            }
        }
        records.push((i, record));
        schedule.lock().expect("not poisoned").done[i] = true;
        wake.notify_all();
    }
    (stats, records)
}

#[cfg(test)]
mod tests;
