//! The capacity signal's latest answer, as the capacity thread (`crate::capacity`)
//! wrote it: read by `/metrics` (`radixgate_capacity_*`) and `GET /admin/capacity`.
//!
//! One `Arc` swapped under a mutex every `capacity.interval_ms`; a reader holds the
//! lock only to clone the `Arc`.

use radixgate_orchestrator::Recommendation;
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};

/// Where the capacity thread leaves its report.
#[derive(Default)]
pub struct CapacityStatus {
    latest: Mutex<Option<Arc<CapacityReport>>>,
}

impl CapacityStatus {
    pub fn set(&self, report: CapacityReport) {
        if let Ok(mut latest) = self.latest.lock() {
            *latest = Some(Arc::new(report));
        }
    }

    /// The last report; `None` before the first.
    pub fn get(&self) -> Option<Arc<CapacityReport>> {
        self.latest.lock().ok().and_then(|l| l.clone())
    }
}

/// Every pool's measured load, the model's answer and the engines' own figures.
#[derive(Debug, Clone, PartialEq)]
pub struct CapacityReport {
    /// Seconds of traffic the rates were measured over (0 until two samples).
    pub window_seconds: f64,
    /// Samples of the gateway's counters in the window.
    pub samples: usize,
    pub ttft_slo_seconds: f64,
    pub quantile: f64,
    pub engine_slots: u32,
    pub pools: Vec<PoolCapacity>,
}

/// One engine pool: `prefill` or `decode` (a split model's roles), or a model's
/// name (backends serving it whole).
#[derive(Debug, Clone, PartialEq)]
pub struct PoolCapacity {
    pub pool: String,
    pub backends: Vec<String>,
    pub inputs: PoolInputs,
    pub model: Recommendation,
    /// The first token's service part plus the model's queueing delay at the
    /// quantile, at the recommended engine count.
    pub predicted_ttft_seconds: f64,
    /// The queue's figures with the engines the pool has now (`None` when it is
    /// unstable there or idle): what the model predicts the fleet is seeing.
    pub current: Option<Recommendation>,
    pub observed: PoolObserved,
}

/// What the gateway measured for a pool over the window.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PoolInputs {
    /// Requests (legs, for split pools) completed in the window.
    pub requests: u64,
    pub arrival_rate: f64,
    /// Mean time from a request's start to its end on this pool, as the gateway saw
    /// it (engine queueing included).
    pub measured_seconds: f64,
    /// Mean time to this pool's first output byte (TTFT; a prefill leg's whole
    /// length; a decode leg's hand-off), engine queueing included.
    pub measured_first_seconds: f64,
    /// Mean wait in the engines' own queues, by Little's law from their scraped
    /// `num_requests_waiting` (0 when not scraped).
    pub engine_queue_seconds: f64,
    /// `measured_seconds` less the engine queueing: the time a request holds a slot.
    pub service_seconds: f64,
    /// `measured_first_seconds` less the engine queueing.
    pub first_service_seconds: f64,
    /// What the SLO leaves this pool for queueing.
    pub wait_budget_seconds: f64,
}

/// The engines' own view of a pool, from their last scrapes.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PoolObserved {
    /// Backends in the pool that are healthy and not draining.
    pub engines: u32,
    /// Of those, engines with at least one request running or waiting.
    pub busy_engines: u32,
    pub running: u32,
    pub waiting: u32,
    /// Running requests summed over the pool, averaged over the window's samples:
    /// by Little's law the offered load the model computes (`offered_erlangs`).
    pub mean_running: f64,
}

impl CapacityReport {
    /// The body of `GET /admin/capacity`.
    pub fn to_json(&self) -> Value {
        let pools: Vec<Value> = self.pools.iter().map(PoolCapacity::to_json).collect();
        json!({
            "window_seconds": self.window_seconds,
            "samples": self.samples,
            "ttft_slo_seconds": self.ttft_slo_seconds,
            "quantile": self.quantile,
            "engine_slots": self.engine_slots,
            "pools": pools,
        })
    }
}

/// JSON has no infinity: an unbounded figure is `null`.
fn finite(x: f64) -> Value {
    if x.is_finite() {
        json!(x)
    } else {
        Value::Null
    }
}

impl PoolCapacity {
    fn to_json(&self) -> Value {
        let (i, m, o) = (&self.inputs, &self.model, &self.observed);
        json!({
            "pool": self.pool,
            "backends": self.backends,
            "recommended_engines": m.engines,
            "inputs": {
                "requests": i.requests,
                "arrival_rate": i.arrival_rate,
                "measured_seconds": i.measured_seconds,
                "measured_first_seconds": i.measured_first_seconds,
                "engine_queue_seconds": i.engine_queue_seconds,
                "service_seconds": i.service_seconds,
                "first_service_seconds": i.first_service_seconds,
                "wait_budget_seconds": i.wait_budget_seconds,
            },
            "model": {
                "engines": m.engines,
                "offered_erlangs": m.offered_erlangs,
                "utilisation": m.utilisation,
                "wait_probability": m.wait_probability,
                "mean_wait_seconds": finite(m.mean_wait_seconds),
                "quantile_wait_seconds": finite(m.quantile_wait_seconds),
                "predicted_ttft_seconds": finite(self.predicted_ttft_seconds),
            },
            "current": self.current.map(|c| json!({
                "engines": c.engines,
                "utilisation": c.utilisation,
                "wait_probability": c.wait_probability,
                "mean_wait_seconds": c.mean_wait_seconds,
                "quantile_wait_seconds": c.quantile_wait_seconds,
            })),
            "observed": {
                "engines": o.engines,
                "busy_engines": o.busy_engines,
                "running": o.running,
                "waiting": o.waiting,
                "mean_running": o.mean_running,
            },
        })
    }
}
