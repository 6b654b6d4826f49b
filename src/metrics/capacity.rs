//! The capacity signal on `/metrics`: per pool, the engines the Erlang-C model
//! recommends (`radixgate_capacity_recommended_engines`, what an autoscaler
//! follows), its inputs, and the engines' own busy count beside it.

use super::families::{Families, Kind, Value};
use crate::status::capacity::{CapacityReport, PoolCapacity};

type Read = fn(&PoolCapacity) -> f64;

/// Gauges per pool: name, help, value.
const POOL_GAUGES: [(&str, &str, Read); 9] = [
    (
        "radixgate_capacity_recommended_engines",
        "Engines the pool needs for its measured load to meet capacity.ttft_slo_ms (Erlang C, queueing delay at capacity.quantile).",
        |p| f64::from(p.model.engines),
    ),
    (
        "radixgate_capacity_arrival_rate",
        "Requests (split pools: legs) per second completed on the pool over capacity.window_ms.",
        |p| p.inputs.arrival_rate,
    ),
    (
        "radixgate_capacity_service_seconds",
        "Mean time a request holds an engine slot: measured duration less engine queueing (Little's law).",
        |p| p.inputs.service_seconds,
    ),
    (
        "radixgate_capacity_first_token_service_seconds",
        "Mean service part of the first token: measured TTFT (or leg) less engine queueing.",
        |p| p.inputs.first_service_seconds,
    ),
    (
        "radixgate_capacity_offered_erlangs",
        "Offered load in Erlangs (arrival rate × service time): engine slots busy on average.",
        |p| p.model.offered_erlangs,
    ),
    (
        "radixgate_capacity_utilisation",
        "Slot utilisation at the recommended engine count (below 1).",
        |p| p.model.utilisation,
    ),
    (
        "radixgate_capacity_predicted_queue_seconds",
        "The model's queueing delay at capacity.quantile with the recommended engines.",
        |p| p.model.quantile_wait_seconds,
    ),
    (
        "radixgate_capacity_engines",
        "Engines in the pool now (healthy, not draining).",
        |p| f64::from(p.observed.engines),
    ),
    (
        "radixgate_capacity_busy_engines",
        "Engines of the pool with a request running or waiting at their last scrape (the engines' own view).",
        |p| f64::from(p.observed.busy_engines),
    ),
];

pub(super) fn render(out: &mut Families, report: &CapacityReport) {
    for (name, help, read) in POOL_GAUGES {
        let f = out.family(name, Kind::Gauge, help);
        for p in &report.pools {
            let v = read(p);
            f.row(
                vec![("pool", p.pool.clone())],
                Value::Float(if v.is_finite() { v } else { f64::MAX }),
            );
        }
    }
    out.family(
        "radixgate_capacity_ttft_slo_seconds",
        Kind::Gauge,
        "The TTFT the capacity signal sizes pools for (capacity.ttft_slo_ms).",
    )
    .row(vec![], Value::Float(report.ttft_slo_seconds));
}
