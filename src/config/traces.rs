//! `[traces]`: OpenTelemetry span export over OTLP/HTTP (wire struct and validation).
//!
//! Off unless `otlp_endpoint` is set. Only plain `http://` endpoints: the exporter
//! is meant to reach a local OpenTelemetry Collector or agent (sidecar, node agent),
//! which forwards with TLS and auth where needed.

use serde::{Deserialize, Serialize};
use std::time::Duration;

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct TracesWire {
    /// OTLP/HTTP traces URL, e.g. `http://127.0.0.1:4318/v1/traces`; empty = off.
    otlp_endpoint: String,
    /// `service.name` of the exported resource.
    service_name: String,
    /// Share of new traces (requests without a `traceparent`) recorded, 0-1. A
    /// client's `traceparent` decides by its sampled flag.
    sample_ratio: f64,
    /// Longest a finished span waits before it is sent.
    export_interval_ms: u64,
}

impl Default for TracesWire {
    fn default() -> Self {
        Self {
            otlp_endpoint: String::new(),
            service_name: "radixgate".into(),
            sample_ratio: 1.0,
            export_interval_ms: 1_000,
        }
    }
}

#[derive(Debug, Clone)]
pub struct TracesConfig {
    /// `host:port` to connect to.
    pub authority: String,
    /// Request path, e.g. `/v1/traces`.
    pub path: String,
    pub service_name: String,
    pub sample_ratio: f64,
    pub export_interval: Duration,
}

pub(super) fn validate(wire: TracesWire, errors: &mut Vec<String>) -> Option<TracesConfig> {
    if wire.otlp_endpoint.is_empty() {
        return None;
    }
    if !(0.0..=1.0).contains(&wire.sample_ratio) {
        errors.push("traces.sample_ratio: must be between 0 and 1".into());
    }
    if wire.export_interval_ms == 0 {
        errors.push("traces.export_interval_ms: must be greater than 0".into());
    }
    if wire.service_name.is_empty() {
        errors.push("traces.service_name: must not be empty".into());
    }
    let Some(rest) = wire.otlp_endpoint.strip_prefix("http://") else {
        errors.push(format!(
            "traces.otlp_endpoint: `{}` is not an http:// URL (send to a local collector; https is not supported)",
            wire.otlp_endpoint
        ));
        return None;
    };
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/v1/traces"),
    };
    let authority = if authority.contains(':') {
        authority.to_string()
    } else {
        format!("{authority}:80")
    };
    if authority.starts_with(':') || authority.ends_with(':') {
        errors.push(format!(
            "traces.otlp_endpoint: `{}` has no host or port",
            wire.otlp_endpoint
        ));
    }
    Some(TracesConfig {
        authority,
        path: path.to_string(),
        service_name: wire.service_name,
        sample_ratio: wire.sample_ratio,
        export_interval: Duration::from_millis(wire.export_interval_ms),
    })
}
