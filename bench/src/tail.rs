//! Where a run's TTFT tail comes from, from its per-request [`Trace`]s: the slowest
//! 5% of requests, which backend served them, how much of their
//! prompt was cached, and how many requests were already outstanding on that backend
//! when each was sent (from the traces themselves: sent before it and not yet
//! finished). A tail of cold requests on idle backends is prefill; a tail of cached
//! requests behind a long queue on one backend is affinity piling load; a tail spread
//! evenly is the engines.

use std::fmt::Write as _;
use std::time::Duration;

use crate::load::Trace;

/// The tail's shape in one line (empty without traces).
pub fn summary(traces: &[Trace]) -> String {
    let ok: Vec<&Trace> = traces.iter().filter(|t| t.status == 200).collect();
    if ok.is_empty() {
        return String::new();
    }
    // The slowest 5% (at least one).
    let mut by_ttft = ok.clone();
    by_ttft.sort_by_key(|t| std::cmp::Reverse(t.ttft));
    let tail = &by_ttft[..ok.len().div_ceil(20)];
    let p95 = tail.last().map_or(Duration::ZERO, |t| t.ttft);
    let ahead = |t: &Trace| outstanding_at_send(traces, t) as f64;
    let mean = |xs: &mut dyn Iterator<Item = f64>| {
        let (sum, n) = xs.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
        if n == 0 {
            0.0
        } else {
            sum / n as f64
        }
    };
    let cached = |t: &Trace| match (t.cached_tokens, t.prompt_tokens) {
        (Some(c), Some(p)) if p > 0 => Some(c as f64 / p as f64),
        _ => None,
    };
    let mut backends: Vec<(String, usize)> = Vec::new();
    for t in tail {
        let b = t.backend.clone().unwrap_or_else(|| "?".into());
        match backends.iter_mut().find(|(name, _)| *name == b) {
            Some((_, n)) => *n += 1,
            None => backends.push((b, 1)),
        }
    }
    backends.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let mut out = format!(
        "tail (slowest 5%, TTFT >= {:.0} ms, {} requests): ahead on its backend {:.1} (all {:.1}), cached {:.0}% (all {:.0}%), backends",
        p95.as_secs_f64() * 1e3,
        tail.len(),
        mean(&mut tail.iter().map(|t| ahead(t))),
        mean(&mut ok.iter().map(|t| ahead(t))),
        100.0 * mean(&mut tail.iter().filter_map(|t| cached(t))),
        100.0 * mean(&mut ok.iter().filter_map(|t| cached(t))),
    );
    for (b, n) in backends {
        let _ = write!(out, " {b}x{n}");
    }
    out
}

/// Requests on `t`'s backend sent before it and not finished when it was sent.
pub fn outstanding_at_send(traces: &[Trace], t: &Trace) -> usize {
    traces
        .iter()
        .filter(|o| {
            o.request != t.request
                && o.backend.is_some()
                && o.backend == t.backend
                && o.sent <= t.sent
                && o.sent + o.total > t.sent
        })
        .count()
}

/// The traces as CSV, one row per request.
pub fn to_csv(traces: &[Trace]) -> String {
    let mut out = String::from(
        "request,sent_ms,status,backend,reason,ttft_ms,total_ms,prompt_tokens,cached_tokens,ahead_on_backend\n",
    );
    let opt = |v: Option<u64>| v.map_or(String::new(), |v| v.to_string());
    for t in traces {
        let _ = writeln!(
            out,
            "{},{:.1},{},{},{},{:.1},{:.1},{},{},{}",
            t.request,
            t.sent.as_secs_f64() * 1e3,
            t.status,
            t.backend.as_deref().unwrap_or(""),
            t.reason.as_deref().unwrap_or(""),
            t.ttft.as_secs_f64() * 1e3,
            t.total.as_secs_f64() * 1e3,
            opt(t.prompt_tokens),
            opt(t.cached_tokens),
            outstanding_at_send(traces, t),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(request: u64, sent_ms: u64, total_ms: u64, backend: &str, cached: u64) -> Trace {
        Trace {
            request,
            sent: Duration::from_millis(sent_ms),
            status: 200,
            backend: Some(backend.into()),
            reason: Some("longest-prefix".into()),
            ttft: Duration::from_millis(total_ms),
            total: Duration::from_millis(total_ms),
            prompt_tokens: Some(100),
            cached_tokens: Some(cached),
        }
    }

    #[test]
    fn outstanding_counts_only_unfinished_requests_on_the_same_backend() {
        let traces = [
            t(0, 0, 100, "a", 0),
            t(1, 10, 500, "a", 90),
            t(2, 20, 10, "b", 0),
            t(3, 200, 50, "a", 90),
        ];
        assert_eq!(outstanding_at_send(&traces, &traces[0]), 0);
        assert_eq!(outstanding_at_send(&traces, &traces[1]), 1);
        assert_eq!(outstanding_at_send(&traces, &traces[2]), 0);
        // Request 0 finished at 100 ms; request 1 runs until 510 ms.
        assert_eq!(outstanding_at_send(&traces, &traces[3]), 1);
        let csv = to_csv(&traces);
        assert_eq!(csv.lines().count(), 5);
        assert!(csv
            .lines()
            .nth(2)
            .unwrap()
            .ends_with(",a,longest-prefix,500.0,500.0,100,90,1"));
    }

    #[test]
    fn the_summary_names_the_tails_backend_and_queue() {
        let mut traces: Vec<Trace> = (0..19).map(|i| t(i, i * 1000, 100, "b", 0)).collect();
        traces.push(t(19, 30_000, 4000, "a", 90));
        let s = summary(&traces);
        assert!(s.contains("1 requests"), "{s}");
        assert!(s.contains("backends ax1"), "{s}");
        assert!(s.contains("cached 90%"), "{s}");
        assert_eq!(summary(&[]), "");
    }
}
