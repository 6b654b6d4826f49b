//! DNS discovery on `/metrics`: per `[[discovery]]` name, its resolutions and
//! failures (counters) and the addresses in force and draining (gauges).

use super::families::{Families, Kind, Value};
use crate::status::discovery::NameStatus;
use std::sync::atomic::AtomicU64;

type Read = fn(&NameStatus) -> &AtomicU64;

const FAMILIES: [(&str, Kind, &str, Read); 4] = [
    (
        "radixgate_discovery_resolutions_total",
        Kind::Counter,
        "Resolutions of a [[discovery]] name that gave at least one address.",
        |n| &n.resolutions,
    ),
    (
        "radixgate_discovery_failures_total",
        Kind::Counter,
        "Resolutions of a [[discovery]] name that failed (NXDOMAIN, timeout, empty answer); the last good set is kept.",
        |n| &n.failures,
    ),
    (
        "radixgate_discovery_addresses",
        Kind::Gauge,
        "Addresses of a [[discovery]] name in force (one backend each), as last resolved.",
        |n| &n.addresses,
    ),
    (
        "radixgate_discovery_draining",
        Kind::Gauge,
        "Backends of a [[discovery]] name whose address vanished, draining before removal.",
        |n| &n.draining,
    ),
];

pub(super) fn render(out: &mut Families, names: &[NameStatus]) {
    if names.is_empty() {
        return;
    }
    for (name, kind, help, read) in FAMILIES {
        let f = out.family(name, kind, help);
        for n in names {
            f.row(
                vec![("name", n.name.clone())],
                Value::Int(NameStatus::get(read(n))),
            );
        }
    }
}
