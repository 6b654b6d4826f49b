//! What the discovery thread (`crate::discovery`) reports per `[[discovery]]` name:
//! resolutions, failures and the addresses in force, read by `/metrics`
//! (`radixgate_discovery_*`). Plain atomics, one set per configured name, in config
//! order; the discovery thread is their only writer.

use std::sync::atomic::{AtomicU64, Ordering};

/// One name's counters.
#[derive(Debug, Default)]
pub struct NameStatus {
    pub name: String,
    /// Resolutions that gave at least one address.
    pub resolutions: AtomicU64,
    /// Resolutions that failed (NXDOMAIN, timeout, an empty answer, a bad record):
    /// each counted, the last good set kept.
    pub failures: AtomicU64,
    /// Addresses found by the last good resolution (backends routed to or about
    /// to be; vanished ones draining are not counted).
    pub addresses: AtomicU64,
    /// Vanished addresses still draining before their removal.
    pub draining: AtomicU64,
}

/// Every configured name's counters, in config order.
#[derive(Debug, Default)]
pub struct DiscoveryStatus {
    pub names: Vec<NameStatus>,
}

impl DiscoveryStatus {
    pub fn new<'a>(names: impl Iterator<Item = &'a str>) -> Self {
        Self {
            names: names
                .map(|n| NameStatus {
                    name: n.to_string(),
                    ..Default::default()
                })
                .collect(),
        }
    }
}

impl NameStatus {
    pub fn get(counter: &AtomicU64) -> u64 {
        // Counters read for a scrape: no ordering with other memory is needed.
        counter.load(Ordering::Relaxed)
    }
}
