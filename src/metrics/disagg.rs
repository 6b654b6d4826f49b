//! Metrics of split prefill/decode serving (see `proxy::disagg`): how requests to
//! split models were served, each leg's latency, the hand-off as the gateway sees
//! it, and failures by leg.

use super::{header, Histogram};
use std::collections::BTreeMap;
use std::fmt::Write;

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

    pub(super) fn render(&self, out: &mut String) {
        header(
            out,
            "radixgate_disagg_requests_total",
            "counter",
            "Requests to split models by how they were served: mode split (reason split) or local (small_uncached, prefill_bottleneck, no_prefill, no_decode, prefill_failed, decode_failed).",
        );
        for ((mode, reason), v) in &self.served {
            let _ = writeln!(
                out,
                "radixgate_disagg_requests_total{{mode=\"{mode}\",reason=\"{reason}\"}} {v}"
            );
        }
        header(
            out,
            "radixgate_disagg_leg_seconds",
            "histogram",
            "Split requests' legs, start to end, by leg (prefill, decode).",
        );
        self.prefill_leg
            .render(out, "radixgate_disagg_leg_seconds", "leg=\"prefill\"");
        self.decode_leg
            .render(out, "radixgate_disagg_leg_seconds", "leg=\"decode\"");
        header(
            out,
            "radixgate_disagg_transfer_seconds",
            "histogram",
            "Decode legs from start to first byte: the KV transfer plus the first token, as the gateway sees the hand-off.",
        );
        self.handoff
            .render(out, "radixgate_disagg_transfer_seconds", "protocol=\"any\"");
        header(
            out,
            "radixgate_disagg_leg_failures_total",
            "counter",
            "Failed legs of split requests, by leg (prefill, decode).",
        );
        for leg in ["prefill", "decode"] {
            let v = self.failures.get(leg).copied().unwrap_or(0);
            let _ = writeln!(
                out,
                "radixgate_disagg_leg_failures_total{{leg=\"{leg}\"}} {v}"
            );
        }
    }
}
