//! Metrics of split prefill/decode serving (see `proxy::disagg`): how requests to
//! split models were served, each leg's latency, the hand-off as the gateway sees
//! it, and failures by leg.

use super::families::{Families, Kind, Value};
use super::Histogram;
use std::collections::BTreeMap;

#[derive(Debug, Clone, Default)]
pub struct DisaggMetrics {
    /// (mode: split | local, reason) → requests.
    pub served: BTreeMap<(&'static str, &'static str), u64>,
    /// Prefill legs, start to end.
    pub prefill_leg: Histogram,
    /// Decode legs, start to end.
    pub decode_leg: Histogram,
    /// Decode legs, start to first byte: the KV transfer plus the first token.
    pub handoff: Histogram,
    /// leg → failed legs.
    pub failures: BTreeMap<&'static str, u64>,
}

impl DisaggMetrics {
    pub fn count(&mut self, mode: &'static str, reason: &'static str) {
        *self.served.entry((mode, reason)).or_insert(0) += 1;
    }

    pub fn fail(&mut self, leg: &'static str) {
        *self.failures.entry(leg).or_insert(0) += 1;
    }

    pub(super) fn merge(&mut self, other: &DisaggMetrics) {
        for (k, v) in &other.served {
            *self.served.entry(*k).or_insert(0) += v;
        }
        for (k, v) in &other.failures {
            *self.failures.entry(*k).or_insert(0) += v;
        }
        self.prefill_leg.merge(&other.prefill_leg);
        self.decode_leg.merge(&other.decode_leg);
        self.handoff.merge(&other.handoff);
    }

    pub(super) fn render(&self, out: &mut Families) {
        let f = out.family(
            "radixgate_disagg_requests_total",
            Kind::Counter,
            "Requests to split models by how they were served: mode split (reason split) or local (small_uncached, prefill_bottleneck, no_prefill, no_decode, prefill_failed, decode_failed).",
        );
        for ((mode, reason), v) in &self.served {
            f.row(
                vec![("mode", mode.to_string()), ("reason", reason.to_string())],
                Value::Int(*v),
            );
        }
        out.family(
            "radixgate_disagg_leg_seconds",
            Kind::Histogram,
            "Split requests' legs, start to end, by leg (prefill, decode).",
        )
        .row(
            vec![("leg", "prefill".into())],
            Value::Hist(self.prefill_leg.clone()),
        )
        .row(
            vec![("leg", "decode".into())],
            Value::Hist(self.decode_leg.clone()),
        );
        out.family(
            "radixgate_disagg_transfer_seconds",
            Kind::Histogram,
            "Decode legs from start to first byte: the KV transfer plus the first token, as the gateway sees the hand-off.",
        )
        .row(
            vec![("protocol", "any".into())],
            Value::Hist(self.handoff.clone()),
        );
        let f = out.family(
            "radixgate_disagg_leg_failures_total",
            Kind::Counter,
            "Failed legs of split requests, by leg (prefill, decode).",
        );
        for leg in ["prefill", "decode"] {
            let v = self.failures.get(leg).copied().unwrap_or(0);
            f.row(vec![("leg", leg.to_string())], Value::Int(v));
        }
    }
}
