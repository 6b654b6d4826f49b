//! `[cluster]`: joining a fleet of replicas over a Redis or Valkey bus (wire struct
//! and validation; the threads are [`crate::cluster`]).
//!
//! Off unless `url` is set, and `url` is the only key a replica needs. The bus
//! password never sits in the config: it comes from an environment variable or a
//! file (`password_env`, `password_file`), and the URL may not carry one. A
//! `rediss://` URL speaks TLS to the bus; its files are read here ([`tls`]).

mod tls;

pub use tls::BusTls;

use serde::{Deserialize, Serialize};
use std::time::Duration;

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct ClusterWire {
    /// The bus: `redis://HOST:PORT` (Redis or Valkey; `valkey://` is the same), or
    /// `rediss://HOST:PORT` (`valkeys://`) for TLS, with an optional `/DB`; empty =
    /// not in a cluster.
    url: String,
    /// This replica's name in the fleet; default `HOSTNAME-PID`. Give each replica
    /// its own (a restarted replica may keep its name: its epoch tells it apart).
    node: String,
    /// Pub/sub channel and key prefix: replicas on the same channel share state.
    channel: String,
    /// ACL user (Redis 6+); empty = the default user.
    username: String,
    /// Environment variable holding the bus password (`AUTH`).
    password_env: String,
    /// File holding the bus password (trailing newline ignored).
    password_file: String,
    /// With `rediss://`: a PEM bundle of the CAs to trust for the bus's certificate;
    /// empty = the system's roots.
    ca_file: String,
    /// With `rediss://`: this replica's PEM certificate chain, for a bus that asks
    /// clients for one (mTLS; Redis' `tls-auth-clients`). Needs `key_file`.
    cert_file: String,
    /// With `rediss://`: the PEM private key of `cert_file`.
    key_file: String,
    /// Longest a routing op waits before its batch is published.
    batch_ms: u64,
    /// Most ops in one bus message.
    batch_ops: usize,
    /// How often this replica publishes its per-backend load (also its heartbeat).
    report_interval_ms: u64,
    /// A peer silent for this long is dropped, and its load with it.
    peer_timeout_ms: u64,
    /// Longest a joining replica waits for a peer's snapshot of the index before it
    /// reports ready anyway (with a warning).
    warm_timeout_ms: u64,
}

impl Default for ClusterWire {
    fn default() -> Self {
        Self {
            url: String::new(),
            node: String::new(),
            channel: "radixgate".into(),
            username: String::new(),
            password_env: String::new(),
            password_file: String::new(),
            ca_file: String::new(),
            cert_file: String::new(),
            key_file: String::new(),
            batch_ms: 1,
            batch_ops: 64,
            report_interval_ms: 100,
            peer_timeout_ms: 3_000,
            warm_timeout_ms: 2_000,
        }
    }
}

#[derive(Clone)]
pub struct ClusterConfig {
    /// `redis://HOST:PORT[/DB]` or `rediss://…`, never with a password.
    pub url: String,
    /// Set for a `rediss://` URL (and only then): what to trust, who to be.
    pub tls: Option<BusTls>,
    pub node: String,
    pub channel: String,
    pub username: Option<String>,
    /// Read at start from `password_env` or `password_file`.
    pub password: Option<String>,
    pub batch: Duration,
    pub batch_ops: usize,
    pub report_interval: Duration,
    pub peer_timeout: Duration,
    pub warm_timeout: Duration,
}

impl std::fmt::Debug for ClusterConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterConfig")
            .field("url", &self.url)
            .field("tls", &self.tls)
            .field("node", &self.node)
            .field("channel", &self.channel)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .finish_non_exhaustive()
    }
}

#[allow(clippy::disallowed_methods)] // read once at start-up, off the shards
pub(super) fn validate(wire: ClusterWire, errors: &mut Vec<String>) -> Option<ClusterConfig> {
    if wire.url.is_empty() {
        return None;
    }
    let url = if let Some(rest) = wire.url.strip_prefix("valkey://") {
        format!("redis://{rest}")
    } else if let Some(rest) = wire.url.strip_prefix("valkeys://") {
        format!("rediss://{rest}")
    } else {
        wire.url.clone()
    };
    let mut tls = None;
    match url.split_once("://") {
        Some((scheme @ ("redis" | "rediss"), rest)) => {
            let authority = rest.split('/').next().unwrap_or("");
            if authority.contains('@') {
                errors.push(
                    "cluster.url: must not carry credentials; set cluster.username and \
                     cluster.password_env or cluster.password_file"
                        .into(),
                );
            }
            if authority.is_empty() {
                errors.push(format!("cluster.url: `{}` has no host", wire.url));
            }
            if scheme == "rediss" {
                tls = tls::read(&url, &wire.ca_file, &wire.cert_file, &wire.key_file, errors);
            }
        }
        Some(("nats", _)) => errors.push(
            "cluster.url: the cluster bus speaks the Redis protocol (Redis or Valkey); NATS \
             was measured but not chosen (docs/cluster.md)"
                .into(),
        ),
        _ => errors.push(format!(
            "cluster.url: `{}` is not a redis:// or valkey:// URL",
            wire.url
        )),
    }
    if tls.is_none() {
        for (key, value) in [
            ("ca_file", &wire.ca_file),
            ("cert_file", &wire.cert_file),
            ("key_file", &wire.key_file),
        ] {
            if !value.is_empty() && url.starts_with("redis://") {
                errors.push(format!(
                    "cluster.{key}: only for TLS to the bus; set cluster.url to rediss://"
                ));
            }
        }
    }
    if wire.channel.is_empty() || wire.channel.len() > 128 {
        errors.push("cluster.channel: must be 1 to 128 characters".into());
    }
    if wire.batch_ops == 0 || wire.batch_ops > 4096 {
        errors.push("cluster.batch_ops: must be between 1 and 4096".into());
    }
    if wire.batch_ms > 1_000 {
        errors.push("cluster.batch_ms: must be at most 1000".into());
    }
    if wire.report_interval_ms == 0 {
        errors.push("cluster.report_interval_ms: must be greater than 0".into());
    }
    if wire.peer_timeout_ms < 2 * wire.report_interval_ms {
        errors.push(
            "cluster.peer_timeout_ms: must be at least twice cluster.report_interval_ms".into(),
        );
    }
    let password = match (wire.password_env.as_str(), wire.password_file.as_str()) {
        ("", "") => None,
        (var, "") => match std::env::var(var) {
            Ok(p) if !p.is_empty() => Some(p),
            _ => {
                errors.push(format!(
                    "cluster.password_env: environment variable `{var}` is not set"
                ));
                None
            }
        },
        ("", path) => match std::fs::read_to_string(path) {
            Ok(p) if !p.trim_end().is_empty() => Some(p.trim_end_matches(['\r', '\n']).into()),
            Ok(_) => {
                errors.push(format!("cluster.password_file: `{path}` is empty"));
                None
            }
            Err(e) => {
                errors.push(format!("cluster.password_file: cannot read `{path}`: {e}"));
                None
            }
        },
        _ => {
            errors.push("cluster: set one of password_env and password_file, not both".into());
            None
        }
    };
    let node = match wire.node.is_empty() {
        true => default_node(),
        false => wire.node,
    };
    Some(ClusterConfig {
        url,
        tls,
        node,
        channel: wire.channel,
        username: (!wire.username.is_empty()).then_some(wire.username),
        password,
        batch: Duration::from_millis(wire.batch_ms),
        batch_ops: wire.batch_ops,
        report_interval: Duration::from_millis(wire.report_interval_ms),
        peer_timeout: Duration::from_millis(wire.peer_timeout_ms),
        warm_timeout: Duration::from_millis(wire.warm_timeout_ms),
    })
}

/// `HOSTNAME-PID`: unique among the replicas of one host, and across hosts.
#[allow(clippy::disallowed_methods)] // read once at start-up, off the shards
fn default_node() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "radixgate".into());
    format!("{host}-{}", std::process::id())
}
