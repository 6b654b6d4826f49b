//! `/metrics` as Prometheus reads it: every sample line well formed, every counter
//! named `_total`, requests counted per model and status, and each shard's
//! event-loop lag recorded by its stall watcher. Both I/O drivers.

mod common;

use common::*;
use std::time::Duration;

/// `name{labels} value` → (name, labels, value); panics on a malformed line.
fn sample(line: &str) -> (&str, &str, f64) {
    let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("{line}"));
    let value: f64 = match value {
        "+Inf" => f64::INFINITY,
        v => v.parse().unwrap_or_else(|_| panic!("bad value: {line}")),
    };
    let (name, labels) = match series.find('{') {
        Some(i) => {
            assert!(series.ends_with('}'), "{line}");
            (&series[..i], &series[i..])
        }
        None => (series, ""),
    };
    assert!(
        name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'),
        "{line}"
    );
    (name, labels, value)
}

fn exposition_is_well_formed(io: &str) {
    let (_engines, gw) = instant_fleet(io, 2, 2, "");
    let mut c = Client::connect(gw.local_addr());
    for i in 0..3 {
        let r = c.post(
            "/v1/chat/completions",
            &chat_body(&format!("q{i}"), false),
            &[],
        );
        assert_eq!(r.status, 200);
    }
    let r = c.post(
        "/v1/chat/completions",
        r#"{"model":"nope","messages":[{"role":"user","content":"x"}]}"#,
        &[],
    );
    assert_eq!(r.status, 404);
    // Both shards' watchers have ticked (10 ms each).
    let ticked = eventually(Duration::from_secs(5), || {
        let m = Client::connect(gw.local_addr()).get("/metrics").text();
        ["0", "1"].iter().all(|s| {
            let prefix = format!("radixgate_shard_event_loop_lag_seconds_count{{shard=\"{s}\"}}");
            metric(&m, &prefix).is_some_and(|n| n > 0.0)
        })
    });
    assert!(ticked);
    let r = Client::connect(gw.local_addr()).get("/metrics");
    assert_eq!(r.header("content-type"), Some("text/plain; version=0.0.4"));
    let m = r.text();
    let mut types = std::collections::HashMap::new();
    for line in m.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            if kind == "counter" {
                assert!(name.ends_with("_total"), "{line}");
            }
            types.insert(name.to_string(), kind.to_string());
        } else if !line.starts_with("# HELP ") {
            let (name, _, _) = sample(line);
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s).filter(|f| types.contains_key(*f)))
                .unwrap_or(name);
            assert!(types.contains_key(family), "no TYPE before {line}");
        }
    }
    // Requests per model and backend: the three routed ones under `sim` and a
    // backend; the unknown model's 404 under model="" (the label only takes
    // configured names), as is every answer the gateway gave itself.
    let routed: Vec<(&str, f64)> = m
        .lines()
        .filter(|l| l.starts_with("radixgate_requests_total{") && l.contains("model=\"sim\""))
        .map(|l| {
            let (_, labels, v) = sample(l);
            (labels, v)
        })
        .collect();
    assert!(
        routed.iter().all(|(l, _)| l.contains("status=\"200\"")
            && (l.contains("backend=\"e0\"") || l.contains("backend=\"e1\""))),
        "{routed:?}"
    );
    assert_eq!(
        routed.iter().map(|(_, v)| v).sum::<f64>(),
        3.0,
        "{routed:?}"
    );
    assert!(!m.contains("model=\"nope\""));
    assert_eq!(
        metric(
            &m,
            "radixgate_requests_total{backend=\"none\",status=\"404\",reason=\"model_not_found\",model=\"\"}"
        ),
        Some(1.0)
    );
    assert_eq!(types["radixgate_shard_event_loop_lag_seconds"], "histogram");
    // A routing decision per routed request; the unknown model never got one.
    assert_eq!(
        metric(
            &m,
            "radixgate_routing_decision_seconds_count{shard=\"all\"}"
        ),
        Some(3.0)
    );
    // Every family exposed is in the metrics table (docs/operations.md).
    let documented = documented_metrics();
    for name in types.keys() {
        assert!(
            documented.contains(name),
            "{name} is not in the metrics table (docs/operations.md)"
        );
    }
    // No trace export configured: no span counters.
    assert!(!m.contains("radixgate_trace_spans_total"));
}
both_drivers!(exposition_is_well_formed);
