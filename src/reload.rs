//! Hot reload (`POST /admin/reload`, SIGHUP): re-read the config file the gateway
//! started with, validate it exactly as at start-up, and hand it to the coordinator,
//! which applies it atomically (see `coordinator::changes`).
//!
//! What a reload changes, and what needs a restart:
//!
//! - applied: `[[backends]]` (diffed by id: added, removed, updated in place — a
//!   changed `capabilities` list too — or replaced when `url` changed), `routing.policy`, `routing.allow_policy_header`,
//!   `routing.hash_load_factor`, `routing.hash_virtual_nodes`, `routing.index_touch_ms`,
//!   `routing.prefix_aware.*`, `routing.rag_chunk_weight`, `[upstream]`, `[health]`,
//!   `[retry]`, `[breaker]`, `[models.*]` (split pools);
//! - restart only (reported under `restart_required` and left as running): every
//!   `[server]` key (listeners, shards, cores, driver, limits), `[admin]`, `[log]`, `[traces]`,
//!   `routing.block_bytes`, `routing.hashing`, `routing.tokenizer`,
//!   `routing.block_tokens`, `routing.bytes_per_token` (they change every block hash),
//!   `routing.index_max_blocks`, `routing.session_ttl_ms`, `routing.max_sessions`,
//!   `routing.rag_field`, `routing.rag_max_chunks`, `[workflows]`,
//!   `[auth]`, `[tenancy]` and `[[tenants]]` (quota buckets and key tables are held
//!   by requests in flight).
//!
//! Listeners and pooled upstream connections carry over; requests in flight keep
//! the settings they started with.

use crate::admin::{ask, AdminRequest};
use crate::config::{BackendConfig, Config};
use crate::error::{ErrorKind, GatewayError};
use crossbeam_channel::Sender;
use std::path::Path;

/// The config to run after a reload, and which keys changed.
pub struct ReloadPlan {
    /// `new`'s live keys over `running`'s restart-only ones.
    pub config: Config,
    /// Live keys whose value changed (now applied).
    pub changed: Vec<&'static str>,
    /// Restart-only keys whose value changed (ignored until a restart).
    pub restart_required: Vec<&'static str>,
}

/// Compares `new` with the config in force key by key.
pub fn plan(running: &Config, new: &Config) -> ReloadPlan {
    let mut changed = Vec::new();
    let mut restart = Vec::new();
    fn diff<T: PartialEq>(out: &mut Vec<&'static str>, key: &'static str, a: T, b: T) {
        if a != b {
            out.push(key);
        }
    }
    let (r0, r1) = (&running.routing, &new.routing);
    let (p0, p1) = (&r0.prefix_aware, &r1.prefix_aware);
    diff(&mut changed, "routing.policy", r0.policy, r1.policy);
    diff(
        &mut changed,
        "routing.allow_policy_header",
        r0.allow_policy_header,
        r1.allow_policy_header,
    );
    diff(
        &mut changed,
        "routing.hash_load_factor",
        r0.hash_load_factor,
        r1.hash_load_factor,
    );
    diff(
        &mut changed,
        "routing.hash_virtual_nodes",
        r0.hash_virtual_nodes,
        r1.hash_virtual_nodes,
    );
    diff(
        &mut changed,
        "routing.index_touch_ms",
        r0.index_touch_ms,
        r1.index_touch_ms,
    );
    for (key, a, b) in [
        (
            "routing.prefix_aware.min_match_blocks",
            p0.min_match_blocks as f64,
            p1.min_match_blocks as f64,
        ),
        (
            "routing.prefix_aware.saturation_inflight",
            p0.saturation_inflight as f64,
            p1.saturation_inflight as f64,
        ),
        (
            "routing.prefix_aware.hysteresis",
            p0.hysteresis,
            p1.hysteresis,
        ),
        (
            "routing.prefix_aware.queue_ms_per_request",
            p0.queue_ns_per_request as f64,
            p1.queue_ns_per_request as f64,
        ),
        (
            "routing.prefix_aware.prefill_us_per_token",
            p0.default_prefill_ns_per_token as f64,
            p1.default_prefill_ns_per_token as f64,
        ),
    ] {
        diff(&mut changed, key, a, b);
    }
    let (u0, u1) = (&running.upstream, &new.upstream);
    diff(
        &mut changed,
        "upstream.connect_timeout_ms",
        u0.connect_timeout,
        u1.connect_timeout,
    );
    diff(
        &mut changed,
        "upstream.first_byte_timeout_ms",
        u0.first_byte_timeout,
        u1.first_byte_timeout,
    );
    diff(
        &mut changed,
        "upstream.idle_timeout_ms",
        u0.idle_timeout,
        u1.idle_timeout,
    );
    diff(
        &mut changed,
        "upstream.pool_max_idle",
        u0.pool_max_idle,
        u1.pool_max_idle,
    );
    diff(
        &mut changed,
        "upstream.pool_idle_expiry_ms",
        u0.pool_idle_expiry,
        u1.pool_idle_expiry,
    );
    let (h0, h1) = (&running.health, &new.health);
    diff(&mut changed, "health.interval_ms", h0.interval, h1.interval);
    diff(&mut changed, "health.timeout_ms", h0.timeout, h1.timeout);
    diff(
        &mut changed,
        "health.unhealthy_threshold",
        h0.unhealthy_threshold,
        h1.unhealthy_threshold,
    );
    diff(
        &mut changed,
        "health.healthy_threshold",
        h0.healthy_threshold,
        h1.healthy_threshold,
    );
    diff(
        &mut changed,
        "health.scrape_interval_ms",
        h0.scrape_interval,
        h1.scrape_interval,
    );
    let (t0, t1) = (&running.retry, &new.retry);
    diff(
        &mut changed,
        "retry.max_attempts",
        t0.max_attempts,
        t1.max_attempts,
    );
    diff(
        &mut changed,
        "retry.budget_ratio",
        t0.budget_ratio,
        t1.budget_ratio,
    );
    diff(
        &mut changed,
        "retry.min_retries_per_sec",
        t0.min_retries_per_sec,
        t1.min_retries_per_sec,
    );
    let (b0, b1) = (&running.breaker, &new.breaker);
    diff(
        &mut changed,
        "breaker.failure_threshold",
        b0.failure_threshold,
        b1.failure_threshold,
    );
    diff(&mut changed, "breaker.open_ms", b0.open, b1.open);
    diff(
        &mut changed,
        "breaker.half_open_probes",
        b0.half_open_probes,
        b1.half_open_probes,
    );

    diff(
        &mut changed,
        "routing.rag_chunk_weight",
        r0.rag_chunk_weight,
        r1.rag_chunk_weight,
    );
    diff(
        &mut restart,
        "routing.rag_field",
        &r0.rag_field,
        &r1.rag_field,
    );
    diff(
        &mut restart,
        "routing.rag_max_chunks",
        r0.rag_max_chunks,
        r1.rag_max_chunks,
    );
    diff(&mut restart, "workflows", running.workflows, new.workflows);

    let (s0, s1) = (&running.server, &new.server);
    diff(&mut restart, "server.listen", s0.listen, s1.listen);
    diff(&mut restart, "server.shards", s0.shards, s1.shards);
    diff(&mut restart, "server.cores", &s0.cores, &s1.cores);
    diff(
        &mut restart,
        "server.coordinator_core",
        s0.coordinator_core,
        s1.coordinator_core,
    );
    diff(&mut restart, "server.io", s0.io, s1.io);
    diff(
        &mut restart,
        "server.max_body_bytes",
        s0.max_body_bytes,
        s1.max_body_bytes,
    );
    diff(
        &mut restart,
        "server.max_head_bytes",
        s0.max_head_bytes,
        s1.max_head_bytes,
    );
    diff(
        &mut restart,
        "server.client_idle_timeout_ms",
        s0.client_idle_timeout,
        s1.client_idle_timeout,
    );
    diff(
        &mut restart,
        "server.shutdown_timeout_ms",
        s0.shutdown_timeout,
        s1.shutdown_timeout,
    );
    diff(
        &mut restart,
        "routing.block_bytes",
        r0.block_bytes,
        r1.block_bytes,
    );
    diff(
        &mut restart,
        "routing.hashing",
        format!("{:?}", r0.hashing),
        format!("{:?}", r1.hashing),
    );
    diff(
        &mut restart,
        "routing.bytes_per_token",
        r0.bytes_per_token,
        r1.bytes_per_token,
    );
    diff(
        &mut restart,
        "routing.index_max_blocks",
        r0.index_max_blocks,
        r1.index_max_blocks,
    );
    diff(
        &mut restart,
        "routing.session_ttl_ms",
        r0.session_ttl,
        r1.session_ttl,
    );
    diff(
        &mut restart,
        "routing.max_sessions",
        r0.max_sessions,
        r1.max_sessions,
    );
    let admin = |c: &Config| c.admin.as_ref().map(|a| (a.listen, a.token.clone()));
    diff(&mut restart, "admin", admin(running), admin(new));
    let log = |c: &Config| (c.log.json, c.log.level.clone(), c.log.access);
    diff(&mut restart, "log", log(running), log(new));
    let traces = |c: &Config| {
        c.traces.as_ref().map(|t| {
            let ratio = t.sample_ratio.to_bits();
            (
                t.authority.clone(),
                t.path.clone(),
                t.service_name.clone(),
                ratio,
                t.export_interval,
            )
        })
    };
    diff(&mut restart, "traces", traces(running), traces(new));
    diff(
        &mut restart,
        "auth.required",
        running.auth_required,
        new.auth_required,
    );
    diff(
        &mut restart,
        "tenancy.prefix_isolation",
        running.tenant_prefix_isolation,
        new.tenant_prefix_isolation,
    );
    diff(
        &mut restart,
        "tenants",
        format!("{:?}", running.tenants),
        format!("{:?}", new.tenants),
    );

    let mut config = running.clone();
    config.routing.policy = r1.policy;
    config.routing.allow_policy_header = r1.allow_policy_header;
    config.routing.hash_load_factor = r1.hash_load_factor;
    config.routing.hash_virtual_nodes = r1.hash_virtual_nodes;
    config.routing.prefix_aware = radixgate_orchestrator::PrefixAwareConfig {
        // Derived from restart-only keys (block size, hashing).
        tokens_per_block: p0.tokens_per_block,
        ..p1.clone()
    };
    config.upstream = new.upstream.clone();
    config.health = new.health.clone();
    config.retry = new.retry.clone();
    config.breaker = new.breaker.clone();
    config.backends = new.backends.clone();
    diff(
        &mut changed,
        "models",
        &running.split_models,
        &new.split_models,
    );
    config.split_models = new.split_models.clone();
    config.source = new.source.clone().or(config.source);
    ReloadPlan {
        config,
        changed,
        restart_required: restart,
    }
}

/// Same engine: a changed `url` makes it a different engine (new slot, empty cache).
pub fn same_engine(a: &BackendConfig, b: &BackendConfig) -> bool {
    a.addr == b.addr && a.host == b.host
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

    #[test]
    fn live_keys_apply_restart_keys_are_reported() {
        let running = config(1, "[routing]\npolicy = \"round_robin\"");
        let new = config(
            3,
            "[routing]\npolicy = \"least_loaded\"\nblock_bytes = 32\n\
             [retry]\nmax_attempts = 1",
        );
        let p = plan(&running, &new);
        assert_eq!(p.changed, ["routing.policy", "retry.max_attempts"]);
        assert_eq!(p.restart_required, ["server.shards", "routing.block_bytes"]);
        assert_eq!(p.config.routing.policy.as_str(), "least_loaded");
        assert_eq!(p.config.retry.max_attempts.get(), 1);
        assert_eq!(p.config.server.shards.get(), 1);
        assert_eq!(p.config.routing.block_bytes.get(), 64);
        assert!(plan(&running, &running).changed.is_empty());
    }

    #[test]
    fn trace_export_changes_need_a_restart() {
        let running = config(1, "");
        let new = config(
            1,
            "[traces]\notlp_endpoint = \"http://127.0.0.1:4318/v1/traces\"",
        );
        let p = plan(&running, &new);
        assert_eq!(p.restart_required, ["traces"]);
        assert!(
            p.config.traces.is_none(),
            "the running exporter setting stays"
        );
        assert!(plan(&new, &new).restart_required.is_empty());
    }
}
