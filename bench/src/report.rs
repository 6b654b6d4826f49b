//! What a load run measured, and how it is printed.
//!
//! Each connection thread fills its own [`Stats`]; the runner merges them at the end.
//! Latency and TTFT go into hdrhistograms at microsecond precision and are printed in
//! milliseconds. The report is a Markdown table by default, or one JSON object for
//! scripts (`--json`).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use hdrhistogram::Histogram;

use crate::http::Exchange;
use crate::json;

/// Highest recordable latency: one hour, in microseconds; longer values saturate.
const MAX_US: u64 = 3_600_000_000;

// === impl Stats ===

#[derive(Clone, Debug)]
pub struct Stats {
    /// Total latency of 2xx responses, microseconds.
    pub latency: Histogram<u64>,
    /// Time to first body byte of 2xx responses, microseconds.
    pub ttft: Histogram<u64>,
    pub ok: u64,
    /// Failed requests by HTTP status ("503") or transport error kind ("timeout").
    pub errors: BTreeMap<String, u64>,
    /// Responses (any status) by their `X-Router-Backend` header.
    pub backends: BTreeMap<String, u64>,
    /// Responses (any status) by their `X-Router-Reason` header.
    pub reasons: BTreeMap<String, u64>,
    /// Responses that reported `cached_tokens`, and the sums over just those.
    pub usage_reports: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// Connection threads that stopped early because the target kept refusing them.
    pub workers_gave_up: u64,
}

impl Default for Stats {
    fn default() -> Self {
        let hist =
            || Histogram::new_with_bounds(1, MAX_US, 3).expect("static histogram bounds are valid");
        Stats {
            latency: hist(),
            ttft: hist(),
            ok: 0,
            errors: BTreeMap::new(),
            backends: BTreeMap::new(),
            reasons: BTreeMap::new(),
            usage_reports: 0,
            prompt_tokens: 0,
            cached_tokens: 0,
            workers_gave_up: 0,
        }
    }
}

impl Stats {
    pub fn record(&mut self, ex: &Exchange) {
        if (200..300).contains(&ex.status) {
            self.ok += 1;
            self.latency.saturating_record(micros(ex.total));
            self.ttft.saturating_record(micros(ex.ttft));
        } else {
            *self.errors.entry(ex.status.to_string()).or_default() += 1;
        }
        if let Some(backend) = &ex.backend {
            *self.backends.entry(backend.clone()).or_default() += 1;
        }
        if let Some(reason) = &ex.reason {
            *self.reasons.entry(reason.clone()).or_default() += 1;
        }
        if let Some(usage) = ex.usage {
            self.usage_reports += 1;
            self.prompt_tokens += usage.prompt_tokens;
            self.cached_tokens += usage.cached_tokens;
        }
    }

    pub fn record_error(&mut self, kind: &str) {
        *self.errors.entry(kind.to_string()).or_default() += 1;
    }

    pub fn merge(&mut self, other: &Stats) {
        // Same bounds on both sides, so adding cannot fail.
        self.latency
            .add(&other.latency)
            .expect("histograms share bounds");
        self.ttft.add(&other.ttft).expect("histograms share bounds");
        self.ok += other.ok;
        for (k, v) in &other.errors {
            *self.errors.entry(k.clone()).or_default() += v;
        }
        for (k, v) in &other.backends {
            *self.backends.entry(k.clone()).or_default() += v;
        }
        for (k, v) in &other.reasons {
            *self.reasons.entry(k.clone()).or_default() += v;
        }
        self.usage_reports += other.usage_reports;
        self.prompt_tokens += other.prompt_tokens;
        self.cached_tokens += other.cached_tokens;
        self.workers_gave_up += other.workers_gave_up;
    }

    pub fn failed(&self) -> u64 {
        self.errors.values().sum()
    }

    /// Sum of cached over sum of prompt tokens, over responses that reported both.
    pub fn cached_share(&self) -> Option<f64> {
        (self.prompt_tokens > 0).then(|| self.cached_tokens as f64 / self.prompt_tokens as f64)
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX).max(1)
}

// === impl Report ===

/// A finished run, ready to print.
pub struct Report<'a> {
    pub url: &'a str,
    pub workload: &'a str,
    pub concurrency: usize,
    pub stream: bool,
    pub elapsed: Duration,
    pub stats: &'a Stats,
}

const QUANTILES: [(&str, f64); 3] = [("p50", 0.50), ("p90", 0.90), ("p99", 0.99)];

impl Report<'_> {
    /// 2xx responses per second of wall time.
    pub fn ok_per_sec(&self) -> f64 {
        let secs = self.elapsed.as_secs_f64();
        if secs > 0.0 {
            self.stats.ok as f64 / secs
        } else {
            0.0
        }
    }

    pub fn to_markdown(&self) -> String {
        let s = self.stats;
        let mut out = String::new();
        let _ = writeln!(out, "| run | value |\n|---|---|");
        let _ = writeln!(out, "| url | {} |", self.url);
        let _ = writeln!(
            out,
            "| workload | {}{} |",
            self.workload,
            if self.stream { " (stream)" } else { "" }
        );
        let _ = writeln!(out, "| concurrency | {} |", self.concurrency);
        let _ = writeln!(out, "| elapsed s | {:.3} |", self.elapsed.as_secs_f64());
        let _ = writeln!(out, "| requests ok | {} |", s.ok);
        let _ = writeln!(out, "| requests failed | {} |", s.failed());
        let _ = writeln!(out, "| ok req/s | {:.1} |", self.ok_per_sec());
        let share = match s.cached_share() {
            Some(x) => format!(
                "{:.1}% ({} of {} prompt tokens, {} reports)",
                x * 100.0,
                s.cached_tokens,
                s.prompt_tokens,
                s.usage_reports
            ),
            None => "n/a (no response reported cached_tokens)".to_string(),
        };
        let _ = writeln!(out, "| cached-token share (hit rate) | {share} |");
        if s.workers_gave_up > 0 {
            let _ = writeln!(out, "| connections given up | {} |", s.workers_gave_up);
        }

        let _ = writeln!(
            out,
            "\n| ms | p50 | p90 | p99 | max |\n|---|---|---|---|---|"
        );
        for (name, h) in [("latency", &s.latency), ("ttft", &s.ttft)] {
            let _ = write!(out, "| {name} |");
            for (_, q) in QUANTILES {
                let _ = write!(out, " {} |", ms_text(h, Some(q)));
            }
            let _ = writeln!(out, " {} |", ms_text(h, None));
        }

        if !s.backends.is_empty() {
            let _ = writeln!(out, "\n| backend | responses |\n|---|---|");
            for (b, n) in &s.backends {
                let _ = writeln!(out, "| {b} | {n} |");
            }
        }
        if !s.reasons.is_empty() {
            let _ = writeln!(out, "\n| routing reason | responses |\n|---|---|");
            for (r, n) in &s.reasons {
                let _ = writeln!(out, "| {r} | {n} |");
            }
        }
        if !s.errors.is_empty() {
            let _ = writeln!(out, "\n| error | count |\n|---|---|");
            for (e, n) in &s.errors {
                let _ = writeln!(out, "| {e} | {n} |");
            }
        }
        out
    }

    pub fn to_json(&self) -> String {
        let s = self.stats;
        let mut out = String::from("{\"url\":");
        json::push_str(&mut out, self.url);
        out.push_str(",\"workload\":");
        json::push_str(&mut out, self.workload);
        let _ = write!(
            out,
            ",\"stream\":{},\"concurrency\":{},\"elapsed_s\":{:.6},\"requests_ok\":{},\"requests_failed\":{},\"ok_req_per_s\":{:.3}",
            self.stream,
            self.concurrency,
            self.elapsed.as_secs_f64(),
            s.ok,
            s.failed(),
            self.ok_per_sec()
        );
        for (name, h) in [("latency_ms", &s.latency), ("ttft_ms", &s.ttft)] {
            let _ = write!(out, ",\"{name}\":{{");
            for (label, q) in QUANTILES {
                let _ = write!(out, "\"{label}\":{},", ms_json(h, Some(q)));
            }
            let _ = write!(out, "\"max\":{}}}", ms_json(h, None));
        }
        push_map(&mut out, "errors", &s.errors);
        push_map(&mut out, "backends", &s.backends);
        push_map(&mut out, "reasons", &s.reasons);
        let share = s
            .cached_share()
            .map_or("null".to_string(), |x| format!("{x:.6}"));
        let _ = write!(
            out,
            ",\"usage_reports\":{},\"prompt_tokens\":{},\"cached_tokens\":{},\"cached_token_share\":{share},\"connections_given_up\":{}}}",
            s.usage_reports, s.prompt_tokens, s.cached_tokens, s.workers_gave_up
        );
        out
    }
}

fn push_map(out: &mut String, name: &str, map: &BTreeMap<String, u64>) {
    let _ = write!(out, ",\"{name}\":{{");
    for (k, (key, n)) in map.iter().enumerate() {
        if k > 0 {
            out.push(',');
        }
        json::push_str(out, key);
        let _ = write!(out, ":{n}");
    }
    out.push('}');
}

/// A quantile (or the max with `None`) in milliseconds; `None` when nothing was recorded.
fn ms(h: &Histogram<u64>, q: Option<f64>) -> Option<f64> {
    if h.is_empty() {
        return None;
    }
    let us = match q {
        Some(q) => h.value_at_quantile(q),
        None => h.max(),
    };
    Some(us as f64 / 1000.0)
}

fn ms_text(h: &Histogram<u64>, q: Option<f64>) -> String {
    ms(h, q).map_or("-".to_string(), |v| format!("{v:.3}"))
}

fn ms_json(h: &Histogram<u64>, q: Option<f64>) -> String {
    ms(h, q).map_or("null".to_string(), |v| format!("{v:.3}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::Usage;

    fn exchange(
        status: u16,
        ms: u64,
        backend: Option<&str>,
        usage: Option<(u64, u64)>,
    ) -> Exchange {
        Exchange {
            status,
            backend: backend.map(str::to_string),
            reason: backend.map(|_| "round-robin".to_string()),
            ttft: Duration::from_millis(ms / 2),
            total: Duration::from_millis(ms),
            body_bytes: 0,
            usage: usage.map(|(prompt_tokens, cached_tokens)| Usage {
                prompt_tokens,
                cached_tokens,
            }),
        }
    }

    #[test]
    fn merges_and_renders() {
        let mut a = Stats::default();
        a.record(&exchange(200, 10, Some("e1"), Some((100, 25))));
        a.record(&exchange(503, 1, None, None));
        let mut b = Stats::default();
        b.record(&exchange(200, 30, Some("e2"), Some((100, 75))));
        b.record_error("timeout");
        a.merge(&b);
        assert_eq!((a.ok, a.failed(), a.usage_reports), (2, 2, 2));
        assert_eq!(a.cached_share(), Some(0.5));
        assert_eq!(a.latency.max(), a.latency.highest_equivalent(30_000));

        let r = Report {
            url: "http://127.0.0.1:8080/v1/chat/completions",
            workload: "docs",
            concurrency: 2,
            stream: false,
            elapsed: Duration::from_secs(2),
            stats: &a,
        };
        let md = r.to_markdown();
        assert!(md.contains("| ok req/s | 1.0 |"), "{md}");
        assert!(
            md.contains("| 503 | 1 |") && md.contains("| timeout | 1 |"),
            "{md}"
        );
        assert!(md.contains("| e1 | 1 |") && md.contains("50.0%"), "{md}");
        let js = r.to_json();
        assert!(js.starts_with('{') && js.ends_with('}'), "{js}");
        assert!(js.contains("\"errors\":{\"503\":1,\"timeout\":1}"), "{js}");
        assert!(js.contains("\"backends\":{\"e1\":1,\"e2\":1}"), "{js}");
        assert!(js.contains("\"reasons\":{\"round-robin\":2}"), "{js}");
        assert!(md.contains("| round-robin | 2 |"), "{md}");
        assert!(js.contains("\"cached_token_share\":0.500000"), "{js}");
    }

    #[test]
    fn empty_run_renders_placeholders() {
        let s = Stats::default();
        let r = Report {
            url: "u",
            workload: "fixed",
            concurrency: 1,
            stream: true,
            elapsed: Duration::ZERO,
            stats: &s,
        };
        assert!(r.to_markdown().contains("| latency | - | - | - | - |"));
        assert!(r
            .to_json()
            .contains("\"latency_ms\":{\"p50\":null,\"p90\":null,\"p99\":null,\"max\":null}"));
        assert!(r.to_json().contains("\"cached_token_share\":null"));
    }
}
