//! The scrape's metric families, built from the merged shard copies and handed to
//! `prometheus-client` for the exposition format (Prometheus text 0.0.4: escaping,
//! `HELP`/`TYPE` lines, `_total`, histogram `_bucket`/`_sum`/`_count` and `le`
//! formatting are the crate's, not ours).
//!
//! Recording stays shard-local (plain integers, see [`super::ShardMetrics`]); the
//! families are owned values made once per scrape, which the crate's [`Collector`]
//! interface requires.

use super::{Histogram, BUCKETS};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

#[derive(Debug)]
pub enum Value {
    Int(u64),
    Float(f64),
    Hist(Histogram),
}

type Labels = Vec<(&'static str, String)>;

#[derive(Debug)]
pub struct Family {
    /// The full exposed name (counters end in `_total`).
    name: &'static str,
    help: &'static str,
    kind: Kind,
    rows: Vec<(Labels, Value)>,
}

impl Family {
    pub fn row(&mut self, labels: Labels, value: Value) -> &mut Self {
        self.rows.push((labels, value));
        self
    }
}

/// Every family of one scrape, in the order they are exposed.
#[derive(Debug, Default)]
pub struct Families(Vec<Family>);

impl Families {
    pub fn family(&mut self, name: &'static str, kind: Kind, help: &'static str) -> &mut Family {
        self.0.push(Family {
            name,
            help,
            kind,
            rows: Vec::new(),
        });
        self.0.last_mut().expect("just pushed")
    }

    /// The Prometheus text exposition of every family.
    pub fn encode(self) -> String {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(self));
        let mut out = String::with_capacity(16 << 10);
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &registry);
        out
    }
}

impl Collector for Families {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for f in &self.0 {
            let (name, kind) = match f.kind {
                // The encoder appends `_total` to counters.
                Kind::Counter => (
                    f.name.strip_suffix("_total").unwrap_or(f.name),
                    MetricType::Counter,
                ),
                Kind::Gauge => (f.name, MetricType::Gauge),
                Kind::Histogram => (f.name, MetricType::Histogram),
            };
            let mut family = encoder.encode_descriptor(name, f.help, None, kind)?;
            for (labels, value) in &f.rows {
                let mut m = family.encode_family(labels)?;
                match (f.kind, value) {
                    (Kind::Counter, Value::Int(n)) => {
                        m.encode_counter::<NoLabelSet, _, f64>(n, None)?
                    }
                    (Kind::Counter, Value::Float(x)) => {
                        m.encode_counter::<NoLabelSet, _, f64>(x, None)?
                    }
                    (_, Value::Int(n)) => m.encode_gauge(n)?,
                    (_, Value::Float(x)) => m.encode_gauge(x)?,
                    (_, Value::Hist(h)) => {
                        let buckets: Vec<(f64, u64)> =
                            BUCKETS.iter().copied().zip(h.counts).collect();
                        m.encode_histogram::<NoLabelSet>(h.sum_seconds, h.count, &buckets, None)?
                    }
                }
            }
        }
        Ok(())
    }
}
