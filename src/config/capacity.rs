//! `[capacity]`: the capacity signal's target and measurement (wire struct and
//! validation). The fleet-wide TTFT SLO lives here: tier budgets
//! (`[tiers.<name>].ttft_budget_ms`) are per-request admission checks, while the
//! capacity signal sizes every engine pool for one target (see `docs/capacity.md`).

use serde::{Deserialize, Serialize};
use std::time::Duration;

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct CapacityWire {
    /// The TTFT the fleet is sized for, in milliseconds: each pool's recommended
    /// engine count keeps its predicted queueing delay (at `quantile`) plus the
    /// measured service part of the first token within it.
    ttft_slo_ms: u64,
    /// Quantile of the queueing delay held to the SLO, in (0, 1); 0.95 = p95.
    quantile: f64,
    /// Concurrency slots per engine (vLLM's `max_num_seqs`, SGLang's
    /// `max_running_requests`): how many requests one engine serves at once.
    engine_slots: u32,
    /// How often the gateway samples its request counters and the engines' load.
    interval_ms: u64,
    /// The sliding window the arrival rate and service times are measured over.
    window_ms: u64,
}

impl Default for CapacityWire {
    fn default() -> Self {
        Self {
            ttft_slo_ms: 2_000,
            quantile: 0.95,
            engine_slots: 256,
            interval_ms: 5_000,
            window_ms: 60_000,
        }
    }
}

/// The capacity signal's settings (all live: the capacity thread reads them from
/// each fleet snapshot).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CapacityConfig {
    pub ttft_slo: Duration,
    pub quantile: f64,
    pub engine_slots: u32,
    pub interval: Duration,
    pub window: Duration,
}

impl Default for CapacityConfig {
    fn default() -> Self {
        validate(CapacityWire::default(), &mut Vec::new())
    }
}

pub(super) fn validate(w: CapacityWire, errors: &mut Vec<String>) -> CapacityConfig {
    if w.ttft_slo_ms == 0 {
        errors.push("capacity.ttft_slo_ms: must be at least 1".into());
    }
    if !(w.quantile > 0.0 && w.quantile < 1.0) {
        errors.push("capacity.quantile: must be between 0 and 1 (exclusive)".into());
    }
    if w.engine_slots == 0 {
        errors.push("capacity.engine_slots: must be at least 1".into());
    }
    if w.interval_ms == 0 {
        errors.push("capacity.interval_ms: must be at least 1".into());
    }
    if w.window_ms < w.interval_ms.saturating_mul(2) {
        errors.push(format!(
            "capacity.window_ms: must be at least twice capacity.interval_ms ({} ms)",
            w.interval_ms
        ));
    }
    CapacityConfig {
        ttft_slo: Duration::from_millis(w.ttft_slo_ms.max(1)),
        quantile: if w.quantile > 0.0 && w.quantile < 1.0 {
            w.quantile
        } else {
            0.95
        },
        engine_slots: w.engine_slots.max(1),
        interval: Duration::from_millis(w.interval_ms.max(1)),
        window: Duration::from_millis(w.window_ms.max(2)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_and_bad_values_are_named() {
        let mut errors = Vec::new();
        let c = validate(CapacityWire::default(), &mut errors);
        assert!(errors.is_empty());
        assert_eq!(c.ttft_slo, Duration::from_secs(2));
        assert_eq!(c.engine_slots, 256);
        let wire = CapacityWire {
            ttft_slo_ms: 0,
            quantile: 1.0,
            engine_slots: 0,
            interval_ms: 1_000,
            window_ms: 1_500,
        };
        validate(wire, &mut errors);
        for key in [
            "capacity.ttft_slo_ms",
            "capacity.quantile",
            "capacity.engine_slots",
            "capacity.window_ms",
        ] {
            assert!(
                errors.iter().any(|e| e.starts_with(key)),
                "{key}: {errors:?}"
            );
        }
    }
}
