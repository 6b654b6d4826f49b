//! The discovery thread (`radixgate-discovery`): turns `[[discovery]]` DNS names
//! into backends, off the shards and the coordinator.
//!
//! Each name is resolved at start and again every `interval_ms`, or sooner when its
//! records' TTL runs out first (never sooner than `min_interval_ms` after the last
//! round). A good round is diffed against the addresses in force ([`changes`]): a
//! new address is added as a backend, a vanished one is drained, and a draining
//! one that comes back is undrained. A draining backend is removed once its
//! requests in flight have finished, or after `drain_timeout_ms` (removal lets the
//! ones still running finish too). Every change goes through the same
//! [`AdminRequest`]s as the admin API (`AddBackend`, `Drain`, `RemoveBackend`), so
//! the coordinator publishes it to the shards as any other.
//!
//! A failed round (NXDOMAIN, timeout, an answer without addresses) changes nothing:
//! the last good set stands. It is counted
//! (`radixgate_discovery_failures_total{name}`) and logged once per streak of
//! failures. A name that has never resolved has no backends and is retried every
//! `interval_ms`.

mod resolve;

pub use resolve::Found;

use crate::config::DiscoveryConfig;
use crate::control::{ask, AdminRequest, Shared};
use crate::error::ErrorKind;
use crate::status::discovery::NameStatus;
use crossbeam_channel::{select, Receiver, Sender};
use resolve::NameResolver;
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often draining backends are checked for requests still in flight.
const DRAIN_POLL: Duration = Duration::from_millis(100);

/// What a good round changes, given the addresses in force and those draining.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Changes {
    /// New addresses: a backend each.
    pub add: Vec<SocketAddr>,
    /// Draining addresses that are back: routed to again.
    pub undrain: Vec<SocketAddr>,
    /// Vanished addresses: drained, then removed.
    pub drain: Vec<SocketAddr>,
}

/// The changes that make `found` the addresses in force.
pub fn changes(
    current: &BTreeSet<SocketAddr>,
    draining: &BTreeMap<SocketAddr, Instant>,
    found: &BTreeSet<SocketAddr>,
) -> Changes {
    let (undrain, add) = found
        .difference(current)
        .partition(|a| draining.contains_key(a));
    Changes {
        add,
        undrain,
        drain: current.difference(found).copied().collect(),
    }
}

/// When to resolve again after a good round: at `min(interval, ttl)`, never sooner
/// than `min_interval`.
pub fn next_round(config: &DiscoveryConfig, ttl: Duration) -> Duration {
    ttl.min(config.interval).max(config.min_interval)
}

/// One name's state on the thread.
struct Name {
    config: DiscoveryConfig,
    resolver: Option<NameResolver>,
    /// Addresses in force: each a live, undrained backend.
    current: BTreeSet<SocketAddr>,
    /// Vanished addresses whose backends are draining, with when they vanished.
    draining: BTreeMap<SocketAddr, Instant>,
    /// Failed rounds in a row (logged at the first, and when it ends).
    failures: u64,
    next: Instant,
}

/// Runs until `stop` fires or is dropped.
pub fn run(shared: Arc<Shared>, coordinator: Sender<AdminRequest>, stop: Receiver<()>) {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!(error = %e, "discovery: cannot start its DNS runtime; no backends will be discovered");
            return;
        }
    };
    let now = Instant::now();
    let mut names: Vec<Name> = shared
        .config
        .discovery
        .iter()
        .map(|config| Name {
            config: config.clone(),
            resolver: None,
            current: BTreeSet::new(),
            draining: BTreeMap::new(),
            failures: 0,
            next: now,
        })
        .collect();
    let ctx = Context {
        coordinator: &coordinator,
        runtime: &runtime,
    };
    loop {
        let now = Instant::now();
        for (name, status) in names.iter_mut().zip(&shared.discovery.names) {
            if name.next <= now {
                ctx.round(name, status);
            }
            if !name.draining.is_empty() {
                ctx.progress_drains(name, status);
            }
        }
        let now = Instant::now();
        let wait = names
            .iter()
            .map(|n| match n.draining.is_empty() {
                true => n.next.saturating_duration_since(now),
                false => DRAIN_POLL.min(n.next.saturating_duration_since(now)),
            })
            .min()
            .unwrap_or(Duration::from_secs(3600));
        select! {
            recv(stop) -> _ => return,
            default(wait) => {}
        }
    }
}

struct Context<'a> {
    coordinator: &'a Sender<AdminRequest>,
    runtime: &'a tokio::runtime::Runtime,
}

impl Context<'_> {
    /// Resolves `name` once and applies what changed.
    fn round(&self, name: &mut Name, status: &NameStatus) {
        let mut result = Err(String::new());
        if name.resolver.is_none() {
            match NameResolver::new(&name.config, self.runtime) {
                Ok(r) => name.resolver = Some(r),
                Err(e) => result = Err(e),
            }
        }
        if let Some(r) = &name.resolver {
            result = r.resolve(self.runtime);
        }
        let config = &name.config;
        match result {
            Ok(found) => {
                status.resolutions.fetch_add(1, Ordering::Relaxed);
                if name.failures > 0 {
                    tracing::info!(
                        name = %config.name,
                        failed_rounds = name.failures,
                        addresses = found.addrs.len(),
                        "discovery: the name resolves again"
                    );
                    name.failures = 0;
                }
                name.next = Instant::now() + next_round(config, found.ttl);
                self.apply(name, &found.addrs);
            }
            Err(error) => {
                status.failures.fetch_add(1, Ordering::Relaxed);
                let never = NameStatus::get(&status.resolutions) == 0;
                if name.failures == 0 && never {
                    tracing::warn!(
                        name = %config.name,
                        %error,
                        retry_ms = config.interval.as_millis() as u64,
                        "discovery: the name does not resolve yet; no backends from it until it does"
                    );
                } else if name.failures == 0 {
                    tracing::warn!(
                        name = %config.name,
                        %error,
                        kept = name.current.len(),
                        retry_ms = config.interval.as_millis() as u64,
                        "discovery: resolution failed; the last good set of addresses stands"
                    );
                }
                name.failures += 1;
                name.next = Instant::now() + config.interval;
            }
        }
        self.publish(name, status);
    }

    /// Makes `found` the addresses in force: adds, undrains, drains.
    fn apply(&self, name: &mut Name, found: &BTreeSet<SocketAddr>) {
        self.forget_removed(name);
        let plan = changes(&name.current, &name.draining, found);
        let config = &name.config;
        for addr in plan.undrain {
            name.draining.remove(&addr);
            if self.drain(config, addr, false) {
                name.current.insert(addr);
            } else if self.add(config, addr) {
                // Removed meanwhile (the admin API): added again.
                name.current.insert(addr);
            }
        }
        for addr in plan.add {
            if self.add(config, addr) {
                name.current.insert(addr);
            }
        }
        for addr in plan.drain {
            name.current.remove(&addr);
            if self.drain(config, addr, true) {
                name.draining.insert(addr, Instant::now());
            }
        }
    }

    /// Forgets addresses whose backends were removed by someone else (the admin
    /// API), so that the records, which are the truth here, add them again.
    fn forget_removed(&self, name: &mut Name) {
        if name.current.is_empty() {
            return;
        }
        let Ok(backends) = ask(self.coordinator, AdminRequest::Backends) else {
            return;
        };
        let live: BTreeSet<&str> = backends
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|b| b["id"].as_str())
            .collect();
        let config = &name.config;
        name.current.retain(|addr| {
            let id = backend_id(config, *addr);
            let kept = live.contains(id.as_str());
            if !kept {
                tracing::info!(name = %config.name, backend = %id, "discovery: backend removed outside discovery; adding it again");
            }
            kept
        });
    }

    /// Adds `addr`'s backend; false when the coordinator refused it (retried at the
    /// next round).
    fn add(&self, config: &DiscoveryConfig, addr: SocketAddr) -> bool {
        let backend = Box::new(config.backend(addr));
        let id = backend.id.clone();
        match ask(self.coordinator, |reply| AdminRequest::AddBackend {
            backend,
            reply,
        }) {
            Ok(Ok(_)) => {
                tracing::info!(name = %config.name, backend = %id, "discovery: address added");
                true
            }
            Ok(Err(e)) | Err(e) => {
                tracing::warn!(name = %config.name, backend = %id, error = %e, "discovery: could not add the address; retrying at the next round");
                false
            }
        }
    }

    /// Drains (`on`) or undrains `addr`'s backend; false when it no longer exists.
    fn drain(&self, config: &DiscoveryConfig, addr: SocketAddr, on: bool) -> bool {
        let id = backend_id(config, addr);
        let asked = ask(self.coordinator, |reply| AdminRequest::Drain {
            id: id.clone(),
            on,
            reply,
        });
        match asked {
            Ok(Ok(_)) => {
                let what = if on {
                    "address vanished; draining"
                } else {
                    "address is back; undrained"
                };
                tracing::info!(name = %config.name, backend = %id, "discovery: {what}");
                true
            }
            Ok(Err(e)) => {
                tracing::info!(name = %config.name, backend = %id, error = %e, "discovery: backend already gone");
                false
            }
            Err(e) => {
                tracing::warn!(name = %config.name, backend = %id, error = %e, "discovery: drain not applied");
                false
            }
        }
    }

    /// Removes the draining backends with nothing left in flight, and those past
    /// `drain_timeout_ms`.
    fn progress_drains(&self, name: &mut Name, status: &NameStatus) {
        let Ok(backends) = ask(self.coordinator, AdminRequest::Backends) else {
            return;
        };
        let in_flight = |id: &str| -> Option<u64> {
            backends
                .as_array()?
                .iter()
                .find(|b| b["id"] == id)
                .map(|b| b["in_flight"].as_u64().unwrap_or(0))
        };
        let config = &name.config;
        let now = Instant::now();
        name.draining.retain(|addr, since| {
            let id = backend_id(config, *addr);
            let Some(running) = in_flight(&id) else {
                return false; // removed meanwhile
            };
            let timed_out = now.saturating_duration_since(*since) >= config.drain_timeout;
            if running > 0 && !timed_out {
                return true;
            }
            let removed = ask(self.coordinator, |reply| AdminRequest::RemoveBackend {
                id: id.clone(),
                reply,
            });
            match removed {
                Ok(Ok(_)) => {
                    tracing::info!(name = %config.name, backend = %id, in_flight = running, "discovery: drained backend removed");
                    false
                }
                Ok(Err(e)) if e.kind == ErrorKind::PathNotFound => false,
                Ok(Err(e)) | Err(e) => {
                    tracing::debug!(name = %config.name, backend = %id, error = %e, "discovery: drained backend not removed yet");
                    true
                }
            }
        });
        self.publish(name, status);
    }

    fn publish(&self, name: &Name, status: &NameStatus) {
        status
            .addresses
            .store(name.current.len() as u64, Ordering::Relaxed);
        status
            .draining
            .store(name.draining.len() as u64, Ordering::Relaxed);
    }
}

/// The id of the backend discovered at `addr` (as [`DiscoveryConfig::backend`]
/// names it).
fn backend_id(config: &DiscoveryConfig, addr: SocketAddr) -> String {
    format!("{}@{addr}", config.name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(addrs: &[&str]) -> BTreeSet<SocketAddr> {
        addrs.iter().map(|a| a.parse().unwrap()).collect()
    }

    #[test]
    fn changes_add_drain_and_undrain() {
        let current = set(&["10.0.0.1:80", "10.0.0.2:80"]);
        let draining: BTreeMap<SocketAddr, Instant> = set(&["10.0.0.3:80"])
            .into_iter()
            .map(|a| (a, Instant::now()))
            .collect();
        let found = set(&["10.0.0.2:80", "10.0.0.3:80", "10.0.0.4:80"]);
        let c = changes(&current, &draining, &found);
        assert_eq!(c.add, vec!["10.0.0.4:80".parse::<SocketAddr>().unwrap()]);
        assert_eq!(
            c.undrain,
            vec!["10.0.0.3:80".parse::<SocketAddr>().unwrap()]
        );
        assert_eq!(c.drain, vec!["10.0.0.1:80".parse::<SocketAddr>().unwrap()]);
        assert_eq!(
            changes(&found, &BTreeMap::new(), &found),
            Changes::default()
        );
    }

    #[test]
    fn next_round_honours_ttl_interval_and_floor() {
        let config = crate::config::Config::from_toml(
            "[[discovery]]\nname = \"e.test\"\nport = 80\nmodels = [\"m\"]\n\
             interval_ms = 10000\nmin_interval_ms = 1000\n",
        )
        .unwrap()
        .discovery
        .remove(0);
        let s = Duration::from_secs;
        assert_eq!(next_round(&config, s(3)), s(3));
        assert_eq!(next_round(&config, s(300)), s(10));
        assert_eq!(next_round(&config, s(0)), s(1));
        assert_eq!(
            config.backend("10.0.0.1:80".parse().unwrap()).id,
            "e.test@10.0.0.1:80"
        );
    }
}
