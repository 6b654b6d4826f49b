//! `[admission]` and `[tiers.<name>]`: TTFT budgets, priorities, shedding under fleet
//! pressure and the per-shard edge queue (wire structs and their validation).
//!
//! A tenant's `tier` names one `[tiers.<name>]` table; once any tier is configured,
//! every tenant must name one. Keyless requests use `admission.anonymous_tier`, or
//! the built-in defaults (priority 0, no budget, never shed for pressure).

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct AdmissionWire {
    /// Requests each shard may hold in its edge queue while every candidate backend
    /// is saturated (`routing.prefix_aware.saturation_inflight`); 0 = no queue (a
    /// saturated fleet then takes the request on its least-loaded backend).
    queue_capacity: usize,
    /// Longest a request waits in the edge queue (a budgeted request waits at most
    /// its remaining budget) before 503 `overloaded`.
    queue_timeout_ms: u64,
    /// Mean engine waiting queue (scraped) per backend that counts as pressure 1.0.
    pressure_queue: f64,
    /// Mean engine KV-cache usage (0–1, scraped) that counts as pressure 1.0.
    pressure_kv: f64,
    /// Tier for requests without an API key; unset = built-in defaults.
    anonymous_tier: Option<String>,
}

impl Default for AdmissionWire {
    fn default() -> Self {
        Self {
            queue_capacity: 0,
            queue_timeout_ms: 2_000,
            pressure_queue: 16.0,
            pressure_kv: 0.95,
            anonymous_tier: None,
        }
    }
}

#[derive(Debug, Deserialize, Serialize, Default)]
#[serde(deny_unknown_fields, default)]
pub(super) struct TierWire {
    /// Edge-queue order: higher first (then earlier deadline).
    priority: u8,
    /// Default TTFT budget for the tier's requests (`X-SLO-TTFT-Ms` overrides it);
    /// unset = no SLO check unless the request sends one.
    ttft_budget_ms: Option<u64>,
    /// Shed the tier's requests (503 `overloaded`) once fleet pressure reaches this;
    /// unset = never shed for pressure. Give lower tiers lower values.
    shed_pressure: Option<f64>,
}

/// One tier's admission settings.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TierConfig {
    pub priority: u8,
    pub ttft_budget: Option<Duration>,
    pub shed_pressure: Option<f64>,
}

#[derive(Debug, Clone)]
pub struct AdmissionConfig {
    pub queue_capacity: usize,
    pub queue_timeout: Duration,
    pub pressure_queue: f64,
    pub pressure_kv: f64,
    /// Settings for keyless requests, and the tier they are counted under.
    pub anonymous: TierConfig,
    pub anonymous_tier: Option<String>,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        validate(AdmissionWire::default(), BTreeMap::new(), &mut Vec::new()).0
    }
}

/// Validates `[admission]` and `[tiers]`; returns the config and the tier table that
/// `tenants[i].tier` is resolved against (see [`resolve_tier`]).
pub(super) fn validate(
    a: AdmissionWire,
    tiers: BTreeMap<String, TierWire>,
    errors: &mut Vec<String>,
) -> (AdmissionConfig, BTreeMap<String, TierConfig>) {
    let mut table = BTreeMap::new();
    for (name, t) in tiers {
        if t.ttft_budget_ms == Some(0) {
            errors.push(format!("tiers.{name}.ttft_budget_ms: must be at least 1"));
        }
        if t.shed_pressure.is_some_and(|p| !(p > 0.0 && p.is_finite())) {
            errors.push(format!(
                "tiers.{name}.shed_pressure: must be a positive number"
            ));
        }
        table.insert(
            name,
            TierConfig {
                priority: t.priority,
                ttft_budget: t.ttft_budget_ms.map(Duration::from_millis),
                shed_pressure: t.shed_pressure,
            },
        );
    }
    if a.queue_timeout_ms == 0 {
        errors.push("admission.queue_timeout_ms: must be at least 1".into());
    }
    if a.queue_capacity > 1 << 16 {
        errors.push("admission.queue_capacity: at most 65536 per shard".into());
    }
    if !(a.pressure_queue > 0.0 && a.pressure_queue.is_finite()) {
        errors.push("admission.pressure_queue: must be a positive number".into());
    }
    if !(a.pressure_kv > 0.0 && a.pressure_kv <= 1.0) {
        errors.push("admission.pressure_kv: must be in (0, 1]".into());
    }
    let anonymous = match &a.anonymous_tier {
        None => TierConfig::default(),
        Some(name) => resolve_tier(&table, name, "admission.anonymous_tier", errors),
    };
    let config = AdmissionConfig {
        queue_capacity: a.queue_capacity,
        queue_timeout: Duration::from_millis(a.queue_timeout_ms.max(1)),
        pressure_queue: a.pressure_queue,
        pressure_kv: a.pressure_kv,
        anonymous,
        anonymous_tier: a.anonymous_tier,
    };
    (config, table)
}

/// The settings of tier `name`; with no tiers configured, the defaults. An unknown
/// name (once tiers exist) is an error at `key`.
pub(super) fn resolve_tier(
    table: &BTreeMap<String, TierConfig>,
    name: &str,
    key: &str,
    errors: &mut Vec<String>,
) -> TierConfig {
    if table.is_empty() {
        return TierConfig::default();
    }
    table.get(name).copied().unwrap_or_else(|| {
        let known: Vec<&str> = table.keys().map(String::as_str).collect();
        errors.push(format!(
            "{key}: unknown tier `{name}`; configured: {}",
            known.join(", ")
        ));
        TierConfig::default()
    })
}
