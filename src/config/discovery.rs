//! `[[discovery]]`: backends found by DNS (wire struct and validation).
//!
//! An entry names a DNS name instead of addresses: its A/AAAA records with a fixed
//! `port`, or (`srv = true`) its SRV records, whose targets and ports give the
//! addresses. Every address found becomes one backend with the entry's per-backend
//! settings (models, cache blocks, role, ...), validated here as a `[[backends]]`
//! entry is, once, as a template. The resolving itself runs on the discovery thread
//! (`crate::discovery`); see `docs/discovery.md`.

use super::{validate_backend, BackendConfig, BackendWire};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::time::Duration;

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(super) struct DiscoveryWire {
    /// The DNS name to resolve (`engines.default.svc.cluster.local`, or the SRV
    /// name `_http._tcp.engines.default.svc.cluster.local` with `srv = true`).
    /// Its discovered backends are named `NAME@IP:PORT`.
    name: String,
    /// The engines' port, for A/AAAA records (required unless `srv`).
    #[serde(default)]
    port: Option<u16>,
    /// Resolve SRV records: each record's target (resolved to A/AAAA) and port is
    /// one backend. Excludes `port`.
    #[serde(default)]
    srv: bool,
    /// How often the name is resolved again; a shorter record TTL resolves sooner.
    #[serde(default = "default_interval_ms")]
    interval_ms: u64,
    /// The shortest wait between two resolutions, whatever the records' TTLs.
    #[serde(default = "default_min_interval_ms")]
    min_interval_ms: u64,
    /// How long a vanished address stays draining (its requests in flight finish)
    /// before it is removed even with requests still running.
    #[serde(default = "default_drain_timeout_ms")]
    drain_timeout_ms: u64,
    /// The DNS server to ask, `IP:PORT` (UDP; TCP for a truncated answer); unset:
    /// the system's `/etc/resolv.conf` (and `/etc/hosts`).
    #[serde(default)]
    resolver: Option<String>,
    /// Model names every discovered backend serves.
    models: Vec<String>,
    /// As `backends[].api_key_env`, for every discovered backend.
    #[serde(default)]
    api_key_env: Option<String>,
    /// As `backends[].cache_blocks`, for every discovered backend.
    #[serde(default = "super::default_cache_blocks")]
    cache_blocks: usize,
    /// As `backends[].capabilities`, for every discovered backend.
    #[serde(default = "super::default_capabilities")]
    capabilities: Vec<String>,
    /// As `backends[].role`, for every discovered backend.
    #[serde(default = "super::default_role")]
    role: String,
    /// As `backends[].bootstrap_port`, for every discovered backend.
    #[serde(default)]
    bootstrap_port: Option<u16>,
}

fn default_interval_ms() -> u64 {
    10_000
}

fn default_min_interval_ms() -> u64 {
    1_000
}

fn default_drain_timeout_ms() -> u64 {
    30_000
}

/// How the addresses of an entry are found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    /// A and AAAA records, each with this port.
    Address { port: u16 },
    /// SRV records: targets resolved to A/AAAA, with the records' ports.
    Srv,
}

/// One `[[discovery]]` entry, validated.
#[derive(Debug, Clone)]
pub struct DiscoveryConfig {
    /// The DNS name as configured (also the discovered backends' id prefix).
    pub name: String,
    pub lookup: Lookup,
    pub interval: Duration,
    pub min_interval: Duration,
    pub drain_timeout: Duration,
    /// The DNS server to ask; `None`: the system's configuration.
    pub resolver: Option<SocketAddr>,
    /// What every discovered backend is: its id, address and `file` are filled in
    /// per address ([`DiscoveryConfig::backend`]).
    pub template: BackendConfig,
}

impl DiscoveryConfig {
    /// The backend for one discovered address.
    pub fn backend(&self, addr: SocketAddr) -> BackendConfig {
        let mut b = self.template.clone();
        b.id = format!("{}@{addr}", self.name);
        b.addr = addr;
        b.host = addr.to_string();
        b.discovered = Some(self.name.clone());
        if let Some(file) = b.file.as_object_mut() {
            file.insert("id".into(), b.id.clone().into());
            file.insert("url".into(), format!("http://{addr}").into());
        }
        b
    }
}

/// Whether `name` is a DNS name: dot-separated labels of letters, digits, `-` and
/// `_` (SRV names: `_http._tcp.x`), 1 to 63 bytes each, 253 in all; one trailing dot
/// allowed.
pub fn is_dns_name(name: &str) -> bool {
    let bare = name.strip_suffix('.').unwrap_or(name);
    !bare.is_empty()
        && bare.len() <= 253
        && bare.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_')
        })
}

pub(super) fn validate(wire: Vec<DiscoveryWire>, errors: &mut Vec<String>) -> Vec<DiscoveryConfig> {
    let mut out: Vec<DiscoveryConfig> = Vec::with_capacity(wire.len());
    for (i, d) in wire.into_iter().enumerate() {
        let at = format!("discovery[{i}]");
        if !is_dns_name(&d.name) {
            errors.push(format!(
                "{at}.name: `{}` is not a DNS name (dot-separated labels of letters, digits, \
                 `-` and `_`, at most 63 bytes each)",
                d.name
            ));
        }
        if out.iter().any(|prev| prev.name == d.name) {
            errors.push(format!("{at}.name: duplicate name `{}`", d.name));
        }
        let lookup = match (d.srv, d.port) {
            (true, None) => Lookup::Srv,
            (false, Some(port)) if port > 0 => Lookup::Address { port },
            (true, Some(_)) => {
                errors.push(format!(
                    "{at}.port: excludes srv = true (SRV records carry the ports)"
                ));
                Lookup::Srv
            }
            (false, _) => {
                errors.push(format!(
                    "{at}.port: set the engines' port (1-65535) for A/AAAA records, or srv = true"
                ));
                Lookup::Address { port: 1 }
            }
        };
        let resolver = d.resolver.as_deref().and_then(|r| {
            r.parse::<SocketAddr>()
                .map_err(|_| {
                    errors.push(format!(
                        "{at}.resolver: `{r}` is not IP:PORT (e.g. \"127.0.0.1:53\")"
                    ))
                })
                .ok()
        });
        let interval = super::millis(d.interval_ms, &format!("{at}.interval_ms"), errors);
        let min_interval =
            super::millis(d.min_interval_ms, &format!("{at}.min_interval_ms"), errors);
        if min_interval > interval {
            errors.push(format!(
                "{at}.min_interval_ms: must not exceed interval_ms ({})",
                d.interval_ms
            ));
        }
        let drain_timeout = super::millis(
            d.drain_timeout_ms,
            &format!("{at}.drain_timeout_ms"),
            errors,
        );
        // The per-backend settings, checked once as a `[[backends]]` entry would be.
        let template = validate_backend(
            BackendWire {
                id: d.name.clone(),
                url: "http://127.0.0.1:1".into(),
                models: d.models,
                api_key_env: d.api_key_env,
                cache_blocks: d.cache_blocks,
                kv_events: None,
                kv_events_connect: None,
                kv_events_replay: None,
                capabilities: d.capabilities,
                role: d.role,
                bootstrap_port: d.bootstrap_port,
                compute_group: None,
                tls_ca: None,
                tls_server_name: None,
            },
            &at,
            // Discovered engines are reached over plain HTTP.
            (None, false),
            errors,
        );
        out.push(DiscoveryConfig {
            name: d.name,
            lookup,
            interval,
            min_interval,
            drain_timeout,
            resolver,
            template,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dns_names() {
        for ok in [
            "localhost",
            "engines.default.svc.cluster.local",
            "_http._tcp.engines.test.",
            "a-b.c1",
        ] {
            assert!(is_dns_name(ok), "{ok}");
        }
        for bad in [
            "",
            ".",
            "engines!.test",
            "a..b",
            "-a.b",
            "a b",
            "http://x",
            "x:80",
            &"a".repeat(64),
        ] {
            assert!(!is_dns_name(bad), "{bad}");
        }
    }
}
