//! Hot reload (`POST /admin/reload`, SIGHUP): re-read the config file the gateway
//! started with, validate it exactly as at start-up, and hand it to the coordinator,
//! which applies it atomically (see `coordinator::changes`).
//!
//! A reload is a typed diff. [`plan`] compares the running config's key tree with
//! the new one key by key ([`keys::diff`]); every key is classified in one place,
//! [`keys::KEYS`], as live or restart required. The config put in force is the new
//! one with every restart-only key (and what is derived from them: block hashing,
//! the cost model's tokens per block) kept as running, so no live key can be
//! dropped on the way. The answer lists each changed key with its status,
//! `applied` or `restart required`.
//!
//! What is derived from live keys is rebuilt from the new config: the policies and
//! the cost model, admission settings, the server limits, the tenants (their keys
//! and quotas; see [`crate::tenants::TenantTable::reloaded`] for what happens to
//! their buckets), the backend table (diffed by id: added, removed, updated in
//! place, or replaced when `url` changed). Listeners and pooled upstream
//! connections carry over; requests in flight keep the settings they started with.

use crate::config::keys::{self, Change, Class};
use crate::config::{BackendConfig, Config};
use crate::control::{ask, AdminRequest};
use crate::error::{ErrorKind, GatewayError};
use crossbeam_channel::Sender;
use serde_json::{json, Value};
use std::path::Path;

/// The config to run after a reload, and which keys changed.
pub struct ReloadPlan {
    /// `new`'s live keys over `running`'s restart-only ones.
    pub config: Config,
    /// Every key whose value changed, in key order.
    pub changes: Vec<Change>,
}

impl ReloadPlan {
    /// Changed keys of `class`.
    pub fn keys(&self, class: Class) -> Vec<&str> {
        self.changes
            .iter()
            .filter(|c| c.class == class)
            .map(|c| c.key.as_str())
            .collect()
    }

    /// `[{"key": ..., "status": "applied" | "restart required"}, ...]`.
    pub fn keys_json(&self) -> Value {
        self.changes
            .iter()
            .map(|c| json!({"key": c.key, "status": c.class.status()}))
            .collect()
    }
}

/// Compares `new` with the config in force (`running`, whose backends are
/// `running_backends`) key by key, and builds the config to put in force.
pub fn plan(running: &Config, running_backends: &[&BackendConfig], new: &Config) -> ReloadPlan {
    let before = keys::tree(running, running_backends.iter().copied());
    let changes = keys::diff(&before, &new.file);
    let mut config = new.clone();
    config.file = keys::merge(&before, &new.file);
    keep_restart_only(&mut config, running, running_backends);
    config.source = new.source.clone().or_else(|| running.source.clone());
    ReloadPlan { config, changes }
}

/// Puts `running`'s value back into `config` for every restart-only key of
/// [`keys::KEYS`] (the tests check each one).
fn keep_restart_only(config: &mut Config, running: &Config, running_backends: &[&BackendConfig]) {
    let (s, s0) = (&mut config.server, &running.server);
    s.listen = s0.listen;
    s.shards = s0.shards;
    s.cores = s0.cores.clone();
    s.coordinator_core = s0.coordinator_core;
    s.io = s0.io;
    let (r, r0) = (&mut config.routing, &running.routing);
    r.block_bytes = r0.block_bytes;
    r.hashing = r0.hashing.clone();
    r.bytes_per_token = r0.bytes_per_token;
    r.index_max_blocks = r0.index_max_blocks;
    r.session_ttl = r0.session_ttl;
    r.max_sessions = r0.max_sessions;
    r.rag_max_chunks = r0.rag_max_chunks;
    // Derived from the block hashing keys.
    r.prefix_aware.tokens_per_block = r0.prefix_aware.tokens_per_block;
    config.admin = running.admin.clone();
    config.log = running.log.clone();
    config.traces = running.traces.clone();
    config.cluster = running.cluster.clone();
    config.tenant_prefix_isolation = running.tenant_prefix_isolation;
    // The discovery thread started with its entries; they change on restart.
    config.discovery = running.discovery.clone();
    for b in &mut config.backends {
        let kv_events = running_backends
            .iter()
            .find(|r| r.id == b.id)
            .and_then(|r| r.kv_events.clone());
        let (bind, connect, replay) = match &kv_events {
            Some(k) if k.connect => (None, Some(&k.endpoint), k.replay.as_ref()),
            Some(k) => (Some(&k.endpoint), None, k.replay.as_ref()),
            None => (None, None, None),
        };
        b.file["kv_events"] = json!(bind);
        b.file["kv_events_connect"] = json!(connect);
        b.file["kv_events_replay"] = json!(replay);
        b.kv_events = kv_events;
    }
}

/// One line for the log: each changed key with its status.
pub fn describe(summary: &Value) -> String {
    let keys = summary["keys"].as_array().map_or(&[][..], |k| k.as_slice());
    if keys.is_empty() {
        return "no key changed".into();
    }
    keys.iter()
        .map(|k| {
            format!(
                "{} ({})",
                k["key"].as_str().unwrap_or(""),
                k["status"].as_str().unwrap_or("")
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Same engine: a changed `url` makes it a different engine (new slot, empty cache).
pub fn same_engine(a: &BackendConfig, b: &BackendConfig) -> bool {
    a.addr == b.addr && a.host == b.host && a.tls.is_some() == b.tls.is_some()
}

/// Nothing to update in place.
pub fn same_backend(a: &BackendConfig, b: &BackendConfig) -> bool {
    same_engine(a, b)
        && a.models == b.models
        && a.cache_blocks == b.cache_blocks
        && a.upstream_auth == b.upstream_auth
        && a.capabilities == b.capabilities
        && a.role == b.role
        && a.bootstrap_port == b.bootstrap_port
        && a.tls == b.tls
        && a.file == b.file
}

/// Loads and validates `source` (the file the gateway started with) and has the
/// coordinator apply it; the JSON summary of what changed, or why nothing did.
/// Runs on the admin or signal thread, never a shard (it reads a file).
pub fn from_file(
    source: Option<&Path>,
    coordinator: &Sender<AdminRequest>,
) -> Result<serde_json::Value, GatewayError> {
    let path = source.ok_or_else(|| {
        GatewayError::new(
            ErrorKind::Conflict,
            "the gateway was not started from a config file; there is nothing to reload",
        )
    })?;
    let config = Config::load(path).map_err(|errors| {
        GatewayError::new(
            ErrorKind::InvalidConfig,
            format!(
                "{} is invalid; the running config stays in force: {}",
                path.display(),
                errors.0.join("; ")
            ),
        )
    })?;
    let config = Box::new(config);
    ask(coordinator, |reply| AdminRequest::Reload { config, reply })?
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(shards: usize, extra: &str) -> Config {
        Config::from_toml(&format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nshards = {shards}\n{extra}\n\
             [[backends]]\nid = \"b0\"\nurl = \"http://127.0.0.1:9\"\nmodels = [\"m\"]\n"
        ))
        .unwrap()
    }

    fn plan(running: &Config, new: &Config) -> ReloadPlan {
        super::plan(running, &running.backends.iter().collect::<Vec<_>>(), new)
    }

    #[test]
    fn live_keys_apply_restart_keys_are_reported() {
        let running = config(1, "[routing]\npolicy = \"round_robin\"");
        let new = config(
            3,
            "[routing]\npolicy = \"least_loaded\"\nblock_bytes = 32\nindex_touch_ms = 7\n\
             rag_chunk_weight = 9\n[retry]\nmax_attempts = 1\n[admission]\nqueue_timeout_ms = 5",
        );
        let p = plan(&running, &new);
        assert_eq!(
            p.keys(Class::Live),
            [
                "admission.queue_timeout_ms",
                "retry.max_attempts",
                "routing.index_touch_ms",
                "routing.policy",
                "routing.rag_chunk_weight"
            ]
        );
        assert_eq!(
            p.keys(Class::Restart),
            ["routing.block_bytes", "server.shards"]
        );
        assert_eq!(p.config.routing.policy.as_str(), "least_loaded");
        assert_eq!(p.config.retry.max_attempts.get(), 1);
        // The two keys reload used to report without applying.
        assert_eq!(p.config.routing.index_touch_ms, 7);
        assert_eq!(p.config.routing.rag_chunk_weight, 9);
        assert_eq!(p.config.admission.queue_timeout.as_millis(), 5);
        assert_eq!(p.config.server.shards.get(), 1);
        assert_eq!(p.config.routing.block_bytes.get(), 64);
        // What `GET /admin/config` shows: the values in force.
        assert_eq!(p.config.file["server"]["shards"], 1);
        assert_eq!(p.config.file["routing"]["index_touch_ms"], 7);
        assert_eq!(
            p.keys_json()[0],
            json!({"key": "admission.queue_timeout_ms", "status": "applied"})
        );
        assert!(plan(&running, &running).changes.is_empty());
        // Reloading the same file again changes nothing more.
        assert!(plan(&p.config, &new)
            .changes
            .iter()
            .all(|c| c.class == Class::Restart));
    }

    #[test]
    fn trace_export_changes_need_a_restart() {
        let running = config(1, "");
        let new = config(
            1,
            "[traces]\notlp_endpoint = \"http://127.0.0.1:4318/v1/traces\"",
        );
        let p = plan(&running, &new);
        assert_eq!(p.keys(Class::Restart), ["traces.otlp_endpoint"]);
        assert!(
            p.config.traces.is_none(),
            "the running exporter setting stays"
        );
        assert!(plan(&new, &new).changes.is_empty());
    }

    #[test]
    fn entries_added_and_removed_are_keys_too() {
        let tenant = |name: &str| {
            format!(
                "[[tenants]]\nname = \"{name}\"\nkeys = [\"{}\"]\nrequests_per_sec = 5.0\n",
                crate::tenants::hash_key(name)
            )
        };
        let running = config(1, &tenant("a"));
        let new = config(1, &format!("{}{}", tenant("b"), "[models.\"m.1\"]\n"));
        let p = plan(&running, &new);
        assert_eq!(
            p.keys(Class::Live),
            ["models.\"m.1\"", "tenants.a", "tenants.b"]
        );
        assert_eq!(p.config.tenants[0].name, "b");
        assert_eq!(
            describe(&json!({"keys": p.keys_json()})),
            "models.\"m.1\" (applied), tenants.a (applied), tenants.b (applied)"
        );
    }
}
