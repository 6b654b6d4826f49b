//! From samples of cumulative counters to each pool's model inputs and answer.
//!
//! Pools: a split model's `prefill` and `decode` backends form the `prefill` and
//! `decode` pools (their legs are counted apart from whole requests); backends
//! serving a model whole (role `both`) form a pool named after the model, one per
//! model, since a model's engines scale as one deployment. Per pool, over the
//! window (newest sample against oldest):
//!
//! - arrival rate λ = completed requests (legs) / elapsed time;
//! - measured times: whole requests' mean duration and mean TTFT; a prefill leg's
//!   mean length (both); a decode leg's mean length and mean time to first byte;
//! - engine queueing W = mean `num_requests_waiting` over the window / λ (Little's
//!   law), taken off the measured times to leave the service: a slot's holding time
//!   and the first token's service part;
//! - the wait budget: the SLO less the first token's service part; for a split
//!   model, the SLO less both legs' first-token parts, halved between the pools.

use crate::backends::LiveConfig;
use crate::config::{CapacityConfig, Role};
use crate::fleet::FleetSnapshot;
use crate::metrics::{Histogram, ShardMetrics};
use crate::status::capacity::{CapacityReport, PoolCapacity, PoolInputs, PoolObserved};
use radixgate_orchestrator::capacity::{queue_at, recommend, CapacityInput};
use std::collections::VecDeque;
use std::time::Instant;

/// A count and a sum of seconds, cumulative.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Sums {
    pub count: u64,
    pub seconds: f64,
}

impl Sums {
    pub fn new(count: u64, seconds: f64) -> Self {
        Sums { count, seconds }
    }

    fn add(&mut self, h: &Histogram) {
        self.count += h.count();
        self.seconds += h.sum_seconds();
    }

    /// `self − earlier`, never below zero.
    fn since(self, earlier: Sums) -> Sums {
        Sums {
            count: self.count.saturating_sub(earlier.count),
            seconds: (self.seconds - earlier.seconds).max(0.0),
        }
    }

    fn mean(self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.seconds / self.count as f64
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolKind {
    /// Backends serving model `.0` whole.
    Model(usize),
    /// Split models' prefill backends.
    Prefill,
    /// Split models' decode backends.
    Decode,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Pool {
    pub name: String,
    pub kind: PoolKind,
    /// Backend slots.
    pub backends: Vec<usize>,
}

/// The pools of the live backend table, in a stable order: models by index, then
/// `prefill`, then `decode`. Backends with role `both` of a split model serve its
/// requests whole only when splitting does not pay; they belong to no pool.
pub fn pools(live: &LiveConfig) -> Vec<Pool> {
    let table = &live.backends;
    let mut out: Vec<Pool> = Vec::new();
    for (m, name) in table.models().names().iter().enumerate() {
        if live.split(m).is_some() {
            continue;
        }
        let backends: Vec<usize> = table
            .live()
            .filter(|(_, b)| b.role == Role::Both && b.models.contains(name))
            .map(|(i, _)| i)
            .collect();
        if !backends.is_empty() {
            out.push(Pool {
                name: name.clone(),
                kind: PoolKind::Model(m),
                backends,
            });
        }
    }
    for (kind, role, name) in [
        (PoolKind::Prefill, Role::Prefill, "prefill"),
        (PoolKind::Decode, Role::Decode, "decode"),
    ] {
        let backends: Vec<usize> = table
            .live()
            .filter(|(_, b)| b.role == role)
            .map(|(i, _)| i)
            .collect();
        if !backends.is_empty() {
            out.push(Pool {
                name: name.into(),
                kind,
                backends,
            });
        }
    }
    out
}

/// The gateway's cumulative counters at one moment, and each pool's engine load.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub at: Instant,
    /// Per model: TTFT and whole-request duration.
    pub first: Vec<Sums>,
    pub whole: Vec<Sums>,
    pub prefill_leg: Sums,
    pub decode_leg: Sums,
    /// Decode legs' start to first byte.
    pub handoff: Sums,
    /// Per pool name: engines' `running` and `waiting` summed, as last scraped.
    pub load: Vec<(String, u32, u32)>,
}

impl Sample {
    pub fn new(
        at: Instant,
        shards: &[ShardMetrics],
        fleet: &FleetSnapshot,
        pools: &[Pool],
    ) -> Self {
        let models = shards.iter().map(|s| s.ttft.len()).max().unwrap_or(0);
        let mut sample = Sample {
            at,
            first: vec![Sums::default(); models],
            whole: vec![Sums::default(); models],
            prefill_leg: Sums::default(),
            decode_leg: Sums::default(),
            handoff: Sums::default(),
            load: Vec::new(),
        };
        for s in shards {
            for (m, h) in s.ttft.iter().enumerate() {
                sample.first[m].add(h);
            }
            for (m, h) in s.total.iter().enumerate() {
                sample.whole[m].add(h);
            }
            sample.prefill_leg.add(&s.disagg.prefill_leg);
            sample.decode_leg.add(&s.disagg.decode_leg);
            sample.handoff.add(&s.disagg.handoff);
        }
        sample.load = pools
            .iter()
            .map(|p| {
                let (running, waiting) = p
                    .backends
                    .iter()
                    .filter_map(|b| fleet.engine.get(*b).copied().flatten())
                    .fold((0, 0), |(r, w), e| (r + e.running, w + e.waiting));
                (p.name.clone(), running, waiting)
            })
            .collect();
        sample
    }

    /// The pool's first-output and whole times, cumulative.
    fn times(&self, kind: PoolKind) -> (Sums, Sums) {
        let at = |v: &[Sums], m: usize| v.get(m).copied().unwrap_or_default();
        match kind {
            PoolKind::Model(m) => (at(&self.first, m), at(&self.whole, m)),
            PoolKind::Prefill => (self.prefill_leg, self.prefill_leg),
            PoolKind::Decode => (self.handoff, self.decode_leg),
        }
    }

    fn load_of(&self, pool: &str) -> Option<(u32, u32)> {
        self.load
            .iter()
            .find(|(p, _, _)| p == pool)
            .map(|(_, r, w)| (*r, *w))
    }
}

/// Every pool's report from the window (oldest to newest sample).
pub fn estimate(
    window: &VecDeque<Sample>,
    pools: &[Pool],
    fleet: &FleetSnapshot,
    config: &CapacityConfig,
) -> CapacityReport {
    let slo = config.ttft_slo.as_secs_f64();
    let span = match (window.front(), window.back()) {
        (Some(a), Some(b)) => b.at.saturating_duration_since(a.at).as_secs_f64(),
        _ => 0.0,
    };
    let mut inputs: Vec<PoolInputs> = pools.iter().map(|p| measure(window, p, span)).collect();
    // Budgets: the SLO less the first token's service; a split model's two legs
    // share what is left after both.
    let split_first: f64 = pools
        .iter()
        .zip(&inputs)
        .filter(|(p, _)| !matches!(p.kind, PoolKind::Model(_)))
        .map(|(_, i)| i.first_service_seconds)
        .sum();
    for (p, i) in pools.iter().zip(inputs.iter_mut()) {
        i.wait_budget_seconds = match p.kind {
            PoolKind::Model(_) => slo - i.first_service_seconds,
            PoolKind::Prefill | PoolKind::Decode => (slo - split_first) / 2.0,
        };
    }
    let pools = pools
        .iter()
        .zip(inputs)
        .map(|(p, i)| {
            let input = CapacityInput {
                arrival_rate: i.arrival_rate,
                service_seconds: i.service_seconds,
                wait_budget_seconds: i.wait_budget_seconds,
                slots: config.engine_slots,
                quantile: config.quantile,
            };
            let model = recommend(&input);
            let observed = observe(window, p, fleet);
            PoolCapacity {
                pool: p.name.clone(),
                backends: p
                    .backends
                    .iter()
                    .map(|b| fleet.live.backends.id(*b).to_string())
                    .collect(),
                predicted_ttft_seconds: i.first_service_seconds + model.quantile_wait_seconds,
                current: queue_at(&input, observed.engines),
                observed,
                inputs: i,
                model,
            }
        })
        .collect();
    CapacityReport {
        window_seconds: span,
        samples: window.len(),
        ttft_slo_seconds: slo,
        quantile: config.quantile,
        engine_slots: config.engine_slots,
        pools,
    }
}

/// One pool's inputs over the window (the budget is filled in by the caller).
fn measure(window: &VecDeque<Sample>, pool: &Pool, span: f64) -> PoolInputs {
    let (Some(oldest), Some(newest)) = (window.front(), window.back()) else {
        return PoolInputs::default();
    };
    if span <= 0.0 {
        return PoolInputs::default();
    }
    let (first0, whole0) = oldest.times(pool.kind);
    let (first1, whole1) = newest.times(pool.kind);
    let (first, whole) = (first1.since(first0), whole1.since(whole0));
    let arrival_rate = whole.count as f64 / span;
    let waiting: Vec<f64> = window
        .iter()
        .filter_map(|s| s.load_of(&pool.name))
        .map(|(_, w)| f64::from(w))
        .collect();
    let mean_waiting = if waiting.is_empty() {
        0.0
    } else {
        waiting.iter().sum::<f64>() / waiting.len() as f64
    };
    let (measured, measured_first) = (whole.mean(), first.mean());
    let engine_queue = if arrival_rate > 0.0 {
        (mean_waiting / arrival_rate).min(measured_first)
    } else {
        0.0
    };
    PoolInputs {
        requests: whole.count,
        arrival_rate,
        measured_seconds: measured,
        measured_first_seconds: measured_first,
        engine_queue_seconds: engine_queue,
        service_seconds: if whole.count > 0 {
            (measured - engine_queue).max(1e-6)
        } else {
            0.0
        },
        first_service_seconds: (measured_first - engine_queue).max(0.0),
        wait_budget_seconds: 0.0,
    }
}

fn observe(window: &VecDeque<Sample>, pool: &Pool, fleet: &FleetSnapshot) -> PoolObserved {
    let mut o = PoolObserved::default();
    for &b in &pool.backends {
        let up = fleet.healthy.get(b).copied().unwrap_or(false)
            && !fleet.draining.get(b).copied().unwrap_or(false);
        if !up {
            continue;
        }
        o.engines += 1;
        if let Some(e) = fleet.engine.get(b).copied().flatten() {
            o.running += e.running;
            o.waiting += e.waiting;
            if e.running + e.waiting > 0 {
                o.busy_engines += 1;
            }
        }
    }
    let running: Vec<f64> = window
        .iter()
        .filter_map(|s| s.load_of(&pool.name))
        .map(|(r, _)| f64::from(r))
        .collect();
    if !running.is_empty() {
        o.mean_running = running.iter().sum::<f64>() / running.len() as f64;
    }
    o
}

#[cfg(test)]
mod tests;
