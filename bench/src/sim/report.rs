//! What one simulated run measured, and the Markdown tables and JSON it is printed as.
//!
//! Hit rates are the engines' truth, not the router's belief:
//!
//! - `hit_rate`: cached prompt tokens / prompt tokens, tokens counted as the gateway's
//!   simulated engine reports them (canonical bytes / 4; cached = whole cached blocks ×
//!   16 tokens, never the prompt's last token). Bytes after the last complete block
//!   (in `docs`, the unique question) can never hit, so this stays below 100% even for
//!   a perfect router.
//! - `block_hit_rate`: cached blocks / complete blocks.
//! - `ceiling_*`: the same rates for one engine with an unbounded cache fed the same
//!   requests in the same order, where only first occurrences miss: no router can do
//!   better.
//! - `belief_block_hit_rate`: the blocks the router's index said the pick held, over
//!   complete blocks (the router's prediction of `block_hit_rate`).
//!
//! Load: `load_cov` is the coefficient of variation (population standard deviation
//! over mean) of requests per backend; shares are each backend's fraction of requests.
//! TTFT comes from the engines' cost model (queue wait + own prefill).

use std::fmt::Write as _;

use radixgate_orchestrator::{PolicyName, Reason};

use crate::chat::HashedPrompt;
use crate::json;

#[derive(Clone, Debug, PartialEq)]
pub struct RunResult {
    pub requests: u64,
    pub per_backend: Vec<u64>,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub prompt_blocks: u64,
    pub cached_blocks: u64,
    pub belief_blocks: u64,
    pub ceiling_tokens: u64,
    pub ceiling_blocks: u64,
    /// Per request, issue to first token, ns (sorted once finished).
    pub ttft_ns: Vec<u64>,
    /// Per request, arrival at the engine to the start of its prefill, ns.
    pub queue_ns_total: u64,
    /// Routing reasons, in [`Reason::ALL`] order.
    pub reasons: Vec<u64>,
    /// Simulated time at the last completion, ns.
    pub makespan_ns: u64,
}

impl RunResult {
    pub fn new(backends: usize) -> Self {
        RunResult {
            requests: 0,
            per_backend: vec![0; backends],
            prompt_tokens: 0,
            cached_tokens: 0,
            prompt_blocks: 0,
            cached_blocks: 0,
            belief_blocks: 0,
            ceiling_tokens: 0,
            ceiling_blocks: 0,
            ttft_ns: Vec::new(),
            queue_ns_total: 0,
            reasons: vec![0; Reason::ALL.len()],
            makespan_ns: 0,
        }
    }

    pub(super) fn record_route(&mut self, backend: usize, reason: Reason, believed_blocks: u32) {
        self.requests += 1;
        self.per_backend[backend] += 1;
        self.reasons[super::reason_index(reason)] += 1;
        self.belief_blocks += u64::from(believed_blocks);
    }

    pub(super) fn record_ceiling(&mut self, p: &HashedPrompt, blocks: u64, tokens_per_block: u64) {
        self.ceiling_blocks += blocks;
        self.ceiling_tokens += super::cached_tokens(p, blocks, tokens_per_block);
    }

    pub(super) fn record_served(
        &mut self,
        p: &HashedPrompt,
        cached_blocks: u64,
        cached_tokens: u64,
        queued_ns: u64,
    ) {
        self.prompt_tokens += p.tokens();
        self.cached_tokens += cached_tokens;
        self.prompt_blocks += p.blocks.len() as u64;
        self.cached_blocks += cached_blocks;
        self.queue_ns_total += queued_ns;
    }

    pub(super) fn record_ttft(&mut self, ns: u64) {
        self.ttft_ns.push(ns);
    }

    pub(super) fn finish(&mut self, now: u64) {
        self.makespan_ns = now;
        self.ttft_ns.sort_unstable();
    }

    pub fn hit_rate(&self) -> f64 {
        ratio(self.cached_tokens, self.prompt_tokens)
    }

    pub fn block_hit_rate(&self) -> f64 {
        ratio(self.cached_blocks, self.prompt_blocks)
    }

    pub fn belief_block_hit_rate(&self) -> f64 {
        ratio(self.belief_blocks, self.prompt_blocks)
    }

    pub fn ceiling_hit_rate(&self) -> f64 {
        ratio(self.ceiling_tokens, self.prompt_tokens)
    }

    pub fn ceiling_block_hit_rate(&self) -> f64 {
        ratio(self.ceiling_blocks, self.prompt_blocks)
    }

    pub fn load_cov(&self) -> f64 {
        let n = self.per_backend.len() as f64;
        let mean = self.requests as f64 / n;
        if mean == 0.0 {
            return 0.0;
        }
        let var = self
            .per_backend
            .iter()
            .map(|&c| (c as f64 - mean).powi(2))
            .sum::<f64>()
            / n;
        var.sqrt() / mean
    }

    pub fn max_share(&self) -> f64 {
        ratio(
            self.per_backend.iter().copied().max().unwrap_or(0),
            self.requests,
        )
    }

    pub fn min_share(&self) -> f64 {
        ratio(
            self.per_backend.iter().copied().min().unwrap_or(0),
            self.requests,
        )
    }

    pub fn ttft_mean_ms(&self) -> f64 {
        if self.ttft_ns.is_empty() {
            return 0.0;
        }
        self.ttft_ns.iter().sum::<u64>() as f64 / self.ttft_ns.len() as f64 / 1e6
    }

    /// Nearest-rank quantile, ms.
    pub fn ttft_quantile_ms(&self, q: f64) -> f64 {
        if self.ttft_ns.is_empty() {
            return 0.0;
        }
        let rank = ((q * self.ttft_ns.len() as f64).ceil() as usize).clamp(1, self.ttft_ns.len());
        self.ttft_ns[rank - 1] as f64 / 1e6
    }

    /// Completed requests per second of simulated time.
    pub fn throughput(&self) -> f64 {
        if self.makespan_ns == 0 {
            return 0.0;
        }
        self.requests as f64 / (self.makespan_ns as f64 / 1e9)
    }

    /// `longest-prefix 2950, no-match 15`: the non-zero reasons, most frequent first.
    pub fn reasons_text(&self) -> String {
        let mut v: Vec<(Reason, u64)> = Reason::ALL
            .iter()
            .zip(&self.reasons)
            .filter(|(_, &n)| n > 0)
            .map(|(&r, &n)| (r, n))
            .collect();
        v.sort_by_key(|&(_, n)| std::cmp::Reverse(n));
        v.iter()
            .map(|(r, n)| format!("{} {n}", r.as_str()))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// A run with its labels, one JSON object / table row.
pub struct Row<'a> {
    pub workload: &'a str,
    pub distribution: String,
    /// Sweep parameter (`docs`, `alpha`, `window`) and its value, when sweeping.
    pub sweep: Option<(&'static str, f64)>,
    pub policy: PolicyName,
    pub result: &'a RunResult,
}

impl Row<'_> {
    pub fn to_json(&self) -> String {
        let r = self.result;
        let mut s = String::from("{\"workload\":");
        json::push_str(&mut s, self.workload);
        s.push_str(",\"distribution\":");
        json::push_str(&mut s, &self.distribution);
        if let Some((name, value)) = self.sweep {
            let _ = write!(s, ",\"sweep\":\"{name}\",\"{name}\":{value}");
        }
        let _ = write!(
            s,
            ",\"policy\":\"{}\",\"requests\":{},\"hit_rate\":{:.6},\"block_hit_rate\":{:.6},\"ceiling_hit_rate\":{:.6},\"ceiling_block_hit_rate\":{:.6},\"belief_block_hit_rate\":{:.6},\"load_cov\":{:.6},\"max_share\":{:.6},\"min_share\":{:.6},\"ttft_mean_ms\":{:.3},\"ttft_p50_ms\":{:.3},\"ttft_p99_ms\":{:.3},\"throughput_rps\":{:.1},\"prompt_tokens\":{},\"cached_tokens\":{},\"per_backend\":[",
            self.policy.as_str(),
            r.requests,
            r.hit_rate(),
            r.block_hit_rate(),
            r.ceiling_hit_rate(),
            r.ceiling_block_hit_rate(),
            r.belief_block_hit_rate(),
            r.load_cov(),
            r.max_share(),
            r.min_share(),
            r.ttft_mean_ms(),
            r.ttft_quantile_ms(0.5),
            r.ttft_quantile_ms(0.99),
            r.throughput(),
            r.prompt_tokens,
            r.cached_tokens,
        );
        for (i, n) in r.per_backend.iter().enumerate() {
            if i > 0 {
                s.push(',');
            }
            let _ = write!(s, "{n}");
        }
        s.push_str("],\"reasons\":{");
        let mut first = true;
        for (reason, &n) in Reason::ALL.iter().zip(&r.reasons) {
            if n == 0 {
                continue;
            }
            if !first {
                s.push(',');
            }
            first = false;
            let _ = write!(s, "\"{}\":{n}", reason.as_str());
        }
        s.push_str("}}");
        s
    }
}

/// `[{..},{..}]`, one object per line.
pub fn json_array(rows: &[Row<'_>]) -> String {
    let mut s = String::from("[\n");
    for (i, row) in rows.iter().enumerate() {
        s.push_str(&row.to_json());
        s.push_str(if i + 1 < rows.len() { ",\n" } else { "\n" });
    }
    s.push_str("]\n");
    s
}

fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

/// One workload's table: a row per policy.
pub fn policy_table(title: &str, rows: &[Row<'_>]) -> String {
    let mut out = format!("### {title}\n\n");
    out.push_str("| policy | hit rate | block hit rate | load CoV | max / min share | mean TTFT ms | p99 TTFT ms | belief | reasons |\n");
    out.push_str("|---|---|---|---|---|---|---|---|---|\n");
    for row in rows {
        let r = row.result;
        let _ = writeln!(
            out,
            "| {} | {} | {} | {:.3} | {} / {} | {:.2} | {:.2} | {} | {} |",
            row.policy.as_str(),
            pct(r.hit_rate()),
            pct(r.block_hit_rate()),
            r.load_cov(),
            pct(r.max_share()),
            pct(r.min_share()),
            r.ttft_mean_ms(),
            r.ttft_quantile_ms(0.99),
            pct(r.belief_block_hit_rate()),
            r.reasons_text(),
        );
    }
    if let Some(first) = rows.first() {
        let r = first.result;
        let _ = writeln!(
            out,
            "\nCeiling (one engine, unbounded cache, same request order): hit rate {}, block hit rate {}.",
            pct(r.ceiling_hit_rate()),
            pct(r.ceiling_block_hit_rate())
        );
    }
    out
}

/// A sweep's table: a row per parameter value, a column per policy with
/// `hit rate / block hit rate / load CoV / p99 TTFT`.
pub fn sweep_table(title: &str, param: &str, policies: &[PolicyName], rows: &[Row<'_>]) -> String {
    let mut out = format!(
        "### {title}\n\nCells: hit rate · block hit rate · load CoV · p99 TTFT ms.\n\n| {param} |"
    );
    for p in policies {
        let _ = write!(out, " {} |", p.as_str());
    }
    out.push_str("\n|---|");
    for _ in policies {
        out.push_str("---|");
    }
    out.push('\n');
    let mut values: Vec<f64> = Vec::new();
    for row in rows {
        if let Some((_, v)) = row.sweep {
            if !values.contains(&v) {
                values.push(v);
            }
        }
    }
    for v in values {
        let _ = write!(out, "| {v} |");
        for p in policies {
            match rows
                .iter()
                .find(|r| r.sweep.map(|s| s.1) == Some(v) && r.policy == *p)
            {
                Some(row) => {
                    let r = row.result;
                    let _ = write!(
                        out,
                        " {} · {} · {:.2} · {:.1} |",
                        pct(r.hit_rate()),
                        pct(r.block_hit_rate()),
                        r.load_cov(),
                        r.ttft_quantile_ms(0.99)
                    );
                }
                None => out.push_str(" - |"),
            }
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statistics() {
        let mut r = RunResult::new(3);
        r.per_backend = vec![10, 20, 30];
        r.requests = 60;
        // mean 20, population sd sqrt(200/3) ≈ 8.165.
        assert!((r.load_cov() - 0.408_248).abs() < 1e-5);
        assert!((r.max_share() - 0.5).abs() < 1e-12);
        r.ttft_ns = (1..=100).map(|i| i * 1_000_000).collect();
        assert_eq!(r.ttft_quantile_ms(0.99), 99.0);
        assert_eq!(r.ttft_quantile_ms(0.5), 50.0);
        assert_eq!(r.ttft_mean_ms(), 50.5);
        r.reasons[super::super::reason_index(Reason::NoMatch)] = 2;
        r.reasons[super::super::reason_index(Reason::LongestPrefix)] = 5;
        assert_eq!(r.reasons_text(), "longest-prefix 5, no-match 2");
        let row = Row {
            workload: "docs",
            distribution: "uniform".into(),
            sweep: Some(("alpha", 0.5)),
            policy: PolicyName::PrefixAware,
            result: &r,
        };
        let js = row.to_json();
        assert!(js.starts_with("{\"workload\":\"docs\",\"distribution\":\"uniform\",\"sweep\":\"alpha\",\"alpha\":0.5,\"policy\":\"prefix_aware\""), "{js}");
        assert!(js.contains("\"load_cov\":0.408248"), "{js}");
        assert!(
            js.ends_with("\"reasons\":{\"longest-prefix\":5,\"no-match\":2}}"),
            "{js}"
        );
    }
}
