//! Gateway metrics: recorded shard-locally, merged and rendered at scrape time.
//!
//! Each shard owns a [`ShardMetrics`] (plain integers behind its `RefCell`, no atomics,
//! no locks). A `/metrics` scrape on any shard asks every shard for a copy over its
//! command channel, merges the copies and renders Prometheus text.

use std::collections::HashMap;
use std::fmt::Write;
use std::time::Duration;

/// Upper bounds of the latency buckets, in seconds.
const BUCKETS: [f64; 16] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

#[derive(Debug, Clone, Default)]
pub struct Histogram {
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum_seconds: f64,
}

impl Histogram {
    pub fn observe(&mut self, d: Duration) {
        let s = d.as_secs_f64();
        if let Some(i) = BUCKETS.iter().position(|b| s <= *b) {
            self.counts[i] += 1;
        }
        self.count += 1;
        self.sum_seconds += s;
    }

    fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(other.counts.iter()) {
            *a += b;
        }
        self.count += other.count;
        self.sum_seconds += other.sum_seconds;
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let mut cumulative = 0;
        for (i, b) in BUCKETS.iter().enumerate() {
            cumulative += self.counts[i];
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{b}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum_seconds);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", self.count);
    }
}

/// Requests are counted by (backend, status, reason); `backend` is `None` for
/// requests answered by the gateway itself (bad input, no backend...).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RequestKey {
    pub backend: Option<usize>,
    pub status: u16,
    pub reason: &'static str,
}

#[derive(Debug, Clone, Default)]
pub struct ShardMetrics {
    pub requests: HashMap<RequestKey, u64>,
    /// Per model index.
    pub ttft: Vec<Histogram>,
    /// Per model index.
    pub total: Vec<Histogram>,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub completion_tokens: u64,
}

impl ShardMetrics {
    pub fn new(models: usize) -> Self {
        Self {
            ttft: vec![Histogram::default(); models],
            total: vec![Histogram::default(); models],
            ..Default::default()
        }
    }

    pub fn count_request(&mut self, key: RequestKey) {
        *self.requests.entry(key).or_insert(0) += 1;
    }

    pub fn merge(&mut self, other: &ShardMetrics) {
        for (k, v) in &other.requests {
            *self.requests.entry(*k).or_insert(0) += v;
        }
        for (a, b) in self.ttft.iter_mut().zip(&other.ttft) {
            a.merge(b);
        }
        for (a, b) in self.total.iter_mut().zip(&other.total) {
            a.merge(b);
        }
        self.prompt_tokens += other.prompt_tokens;
        self.cached_tokens += other.cached_tokens;
        self.completion_tokens += other.completion_tokens;
    }
}

/// Renders merged metrics. `in_flight[i]` is the current count for backend `i`.
pub fn render(
    merged: &ShardMetrics,
    backend_ids: &[String],
    models: &[String],
    in_flight: &[u32],
) -> String {
    let mut out = String::with_capacity(8 << 10);
    out.push_str("# HELP radixgate_requests_total Requests answered, by backend, HTTP status and routing reason.\n");
    out.push_str("# TYPE radixgate_requests_total counter\n");
    let mut rows: Vec<_> = merged.requests.iter().collect();
    rows.sort_by_key(|(k, _)| (k.backend, k.status, k.reason));
    for (k, v) in rows {
        let backend = k.backend.map_or("none", |b| backend_ids[b].as_str());
        let _ = writeln!(
            out,
            "radixgate_requests_total{{backend=\"{backend}\",status=\"{}\",reason=\"{}\"}} {v}",
            k.status, k.reason
        );
    }
    out.push_str("# HELP radixgate_ttft_seconds Time from receiving a request to the first response body byte.\n");
    out.push_str("# TYPE radixgate_ttft_seconds histogram\n");
    for (i, h) in merged.ttft.iter().enumerate() {
        h.render(
            &mut out,
            "radixgate_ttft_seconds",
            &format!("model=\"{}\"", models[i]),
        );
    }
    out.push_str("# HELP radixgate_request_duration_seconds Time from receiving a request to the end of its response.\n");
    out.push_str("# TYPE radixgate_request_duration_seconds histogram\n");
    for (i, h) in merged.total.iter().enumerate() {
        h.render(
            &mut out,
            "radixgate_request_duration_seconds",
            &format!("model=\"{}\"", models[i]),
        );
    }
    out.push_str("# HELP radixgate_backend_in_flight Requests currently in flight to each backend, across shards.\n");
    out.push_str("# TYPE radixgate_backend_in_flight gauge\n");
    for (i, id) in backend_ids.iter().enumerate() {
        let _ = writeln!(
            out,
            "radixgate_backend_in_flight{{backend=\"{id}\"}} {}",
            in_flight[i]
        );
    }
    for (name, help, v) in [
        ("radixgate_prompt_tokens_total", "Prompt tokens reported in upstream usage.", merged.prompt_tokens),
        ("radixgate_cached_tokens_total", "Cached prompt tokens reported in upstream usage (prompt_tokens_details.cached_tokens).", merged.cached_tokens),
        ("radixgate_completion_tokens_total", "Completion tokens reported in upstream usage.", merged.completion_tokens),
    ] {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_and_renders() {
        let mut a = ShardMetrics::new(1);
        let mut b = ShardMetrics::new(1);
        let key = RequestKey {
            backend: Some(0),
            status: 200,
            reason: "round-robin",
        };
        a.count_request(key);
        b.count_request(key);
        a.ttft[0].observe(Duration::from_millis(3));
        b.ttft[0].observe(Duration::from_millis(300));
        a.merge(&b);
        let text = render(&a, &["b0".into()], &["sim".into()], &[4]);
        assert!(text.contains(
            "radixgate_requests_total{backend=\"b0\",status=\"200\",reason=\"round-robin\"} 2"
        ));
        assert!(text.contains("radixgate_ttft_seconds_bucket{model=\"sim\",le=\"0.005\"} 1"));
        assert!(text.contains("radixgate_ttft_seconds_count{model=\"sim\"} 2"));
        assert!(text.contains("radixgate_backend_in_flight{backend=\"b0\"} 4"));
    }
}
