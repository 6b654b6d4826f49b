//! Every config key, classified in one place: `live` (a reload applies it) or
//! `restart required` (read once at start; a reload reports it and leaves it as
//! running); and the key trees that reload diffs and `GET /admin/config` shows.
//!
//! A key is its path in the file: `routing.prefix_aware.hysteresis`. Entries of
//! `[[backends]]` are named by `id`, `[[tenants]]` and `[[discovery]]` by `name`, so a config's tree
//! (see [`keyed`]) holds `backends.b0.url` and `tenants.acme.requests_per_sec`, and
//! `[tiers.<name>]` and `[models.<name>]` keep their names: `*` in [`KEYS`] stands
//! for any one such name. A name that is not a bare key is quoted as in TOML:
//! `models."llama-3.1".disagg.mode`.
//!
//! The tests walk every leaf of a full config (the serde wire structs serialized,
//! defaults filled in) and fail on a key [`KEYS`] does not classify, and change each
//! key alone to check that a reload reports it, and applies it or leaves it exactly
//! as the class says.

use serde_json::{Map, Value};

/// Whether a reload applies a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// Applied by a reload: reaches the shards in the next fleet snapshot.
    Live,
    /// Read once at start; a changed value is reported and waits for a restart.
    Restart,
}

impl Class {
    /// How a reload's answer marks a changed key of this class.
    pub fn status(self) -> &'static str {
        match self {
            Class::Live => "applied",
            Class::Restart => "restart required",
        }
    }
}

/// One key (or entry) pattern and its class.
#[derive(Debug)]
pub struct Key {
    pub path: &'static str,
    pub class: Class,
    /// Shown as `"<redacted>"` by `GET /admin/config`.
    pub secret: bool,
}

const fn live(path: &'static str) -> Key {
    Key {
        path,
        class: Class::Live,
        secret: false,
    }
}

const fn restart(path: &'static str) -> Key {
    Key {
        path,
        class: Class::Restart,
        secret: false,
    }
}

const fn secret(path: &'static str) -> Key {
    Key {
        path,
        class: Class::Live,
        secret: true,
    }
}

/// Every key of the config file, and the entries (`backends.*`, `tenants.*`,
/// `tiers.*`, `models.*`) that a reload may add or remove whole. Why a key needs a
/// restart is said beside it.
pub const KEYS: &[Key] = &[
    // Listeners, threads and the I/O driver are set up once.
    restart("server.listen"),
    restart("server.shards"),
    restart("server.cores"),
    restart("server.coordinator_core"),
    restart("server.io"),
    // Limits: read per request (a connection's next request uses the new ones).
    live("server.max_body_bytes"),
    live("server.max_head_bytes"),
    live("server.max_uri_bytes"),
    live("server.client_idle_timeout_ms"),
    live("server.client_park_after_ms"),
    live("server.head_timeout_ms"),
    live("server.body_timeout_ms"),
    live("server.max_connections"),
    live("server.shutdown_timeout_ms"),
    // Read at every reload: a new certificate serves new handshakes (open
    // connections keep theirs); with the table added or removed, new connections
    // are accepted with or without TLS.
    live("server.tls"),
    live("server.tls.cert"),
    live("server.tls.key"),
    live("routing.policy"),
    live("routing.allow_policy_header"),
    // Block hashing: a change would change every block hash in the index.
    restart("routing.block_bytes"),
    restart("routing.hashing"),
    restart("routing.tokenizer"),
    restart("routing.block_tokens"),
    restart("routing.chat_template"),
    restart("routing.bytes_per_token"),
    live("routing.hash_load_factor"),
    live("routing.hash_virtual_nodes"),
    // Sizes of tables built at start (the index, sessions, chunk index).
    restart("routing.index_max_blocks"),
    live("routing.index_touch_ms"),
    restart("routing.session_ttl_ms"),
    restart("routing.max_sessions"),
    live("routing.prefix_aware.min_match_blocks"),
    live("routing.prefix_aware.saturation_inflight"),
    live("routing.prefix_aware.hysteresis"),
    live("routing.prefix_aware.queue_ms_per_request"),
    live("routing.prefix_aware.prefill_us_per_token"),
    live("routing.prefix_aware.learn_queue_cost"),
    live("routing.prefix_aware.eviction_weight"),
    live("routing.prefix_aware.new_prefix_slack_requests"),
    live("routing.prefix_aware.learn_fixed_delay"),
    live("routing.prefix_aware.room_stale_after_ms"),
    live("routing.prefix_aware.spread_new_prefixes"),
    live("routing.prefix_aware.price_footprint"),
    live("routing.prefix_aware.price_cache_in_use"),
    live("routing.prefix_aware.forget_unused_placements"),
    live("routing.rag_field"),
    live("routing.rag_chunk_weight"),
    restart("routing.rag_max_chunks"),
    live("upstream.connect_timeout_ms"),
    live("upstream.first_byte_timeout_ms"),
    live("upstream.idle_timeout_ms"),
    live("upstream.pool_max_idle"),
    live("upstream.pool_idle_expiry_ms"),
    // New upstream connections use it; pooled ones carry on.
    live("upstream.tls_ca"),
    live("health.interval_ms"),
    live("health.timeout_ms"),
    live("health.unhealthy_threshold"),
    live("health.healthy_threshold"),
    live("health.scrape_interval_ms"),
    live("retry.max_attempts"),
    live("retry.budget_ratio"),
    live("retry.min_retries_per_sec"),
    live("retry.migrate_streams"),
    live("retry.max_stream_migrations"),
    live("retry.first_token_timeout_ms"),
    live("retry.first_token_timeout_factor"),
    live("breaker.failure_threshold"),
    live("breaker.open_ms"),
    live("breaker.half_open_probes"),
    // The admin listener and its token, logging and span export start once.
    restart("admin.listen"),
    restart("admin.token_file"),
    restart("admin.token_env"),
    restart("log.format"),
    restart("log.level"),
    restart("log.access"),
    restart("traces.otlp_endpoint"),
    restart("traces.service_name"),
    restart("traces.sample_ratio"),
    restart("traces.export_interval_ms"),
    // Joining a cluster (the bus connection and its threads) happens once, at start.
    restart("cluster.url"),
    restart("cluster.node"),
    restart("cluster.channel"),
    restart("cluster.username"),
    restart("cluster.password_env"),
    restart("cluster.password_file"),
    restart("cluster.ca_file"),
    restart("cluster.cert_file"),
    restart("cluster.key_file"),
    restart("cluster.batch_ms"),
    restart("cluster.batch_ops"),
    restart("cluster.report_interval_ms"),
    restart("cluster.peer_timeout_ms"),
    restart("cluster.warm_timeout_ms"),
    live("auth.required"),
    // Salts every tenant's hash chains: the whole index would change meaning.
    restart("tenancy.prefix_isolation"),
    live("admission.queue_capacity"),
    live("admission.queue_timeout_ms"),
    live("admission.pressure_queue"),
    live("admission.pressure_kv"),
    live("admission.anonymous_tier"),
    live("tiers.*"),
    live("tiers.*.priority"),
    live("tiers.*.ttft_budget_ms"),
    live("tiers.*.shed_pressure"),
    live("tenants.*"),
    live("tenants.*.name"),
    live("tenants.*.tier"),
    secret("tenants.*.keys"),
    live("tenants.*.requests_per_sec"),
    live("tenants.*.tokens_per_sec"),
    live("tenants.*.max_concurrency"),
    live("workflows.max_nodes"),
    live("workflows.max_fan_out"),
    live("workflows.max_node_response_bytes"),
    // The capacity thread reads these from each fleet snapshot.
    live("capacity.ttft_slo_ms"),
    live("capacity.quantile"),
    live("capacity.engine_slots"),
    live("capacity.interval_ms"),
    live("capacity.window_ms"),
    live("backends.*"),
    live("backends.*.id"),
    live("backends.*.url"),
    live("backends.*.tls_ca"),
    live("backends.*.tls_server_name"),
    live("backends.*.models"),
    live("backends.*.api_key_env"),
    live("backends.*.cache_blocks"),
    // KV-event subscriptions are bound or connected at start.
    restart("backends.*.kv_events"),
    restart("backends.*.kv_events_connect"),
    restart("backends.*.kv_events_replay"),
    live("backends.*.capabilities"),
    live("backends.*.role"),
    live("backends.*.bootstrap_port"),
    live("backends.*.compute_group"),
    // DNS discovery: each entry's resolver and schedule live on the discovery
    // thread, which starts once; its backends come and go with the records.
    restart("discovery.*"),
    restart("discovery.*.name"),
    restart("discovery.*.port"),
    restart("discovery.*.srv"),
    restart("discovery.*.interval_ms"),
    restart("discovery.*.min_interval_ms"),
    restart("discovery.*.drain_timeout_ms"),
    restart("discovery.*.resolver"),
    restart("discovery.*.models"),
    restart("discovery.*.api_key_env"),
    restart("discovery.*.cache_blocks"),
    restart("discovery.*.capabilities"),
    restart("discovery.*.role"),
    restart("discovery.*.bootstrap_port"),
    live("models.*"),
    live("models.*.disagg"),
    live("models.*.disagg.protocol"),
    live("models.*.disagg.mode"),
    live("models.*.disagg.min_uncached_tokens"),
    live("models.*.disagg.prefill_saturation"),
    live("models.*.disagg.transfer_us_per_token"),
    live("models.*.disagg.prefill_attempts"),
    live("models.*.disagg.decode_attempts"),
    live("models.*.disagg.local_fallback"),
    live("models.*.disagg.prefill_timeout_ms"),
    live("models.*.disagg.decode_first_byte_timeout_ms"),
];

/// Top-level arrays of tables, and the member that names each entry in the tree.
const NAMED_ENTRIES: [(&str, &str); 3] = [
    ("backends", "id"),
    ("tenants", "name"),
    ("discovery", "name"),
];

fn matches(pattern: &str, path: &[String]) -> bool {
    let mut segments = pattern.split('.');
    path.iter()
        .all(|p| segments.next().is_some_and(|s| s == "*" || s == p))
        && segments.next().is_none()
}

/// The table's entry for `path`: its own, else its nearest ancestor's.
pub fn key(path: &[String]) -> Option<&'static Key> {
    (0..=path.len())
        .rev()
        .find_map(|n| KEYS.iter().find(|k| matches(k.path, &path[..n])))
}

/// The class of `path`; a path the table does not know counts as restart required
/// (the tests make sure none exists).
pub fn class(path: &[String]) -> Class {
    key(path).map_or(Class::Restart, |k| k.class)
}

/// `path` as a key name: segments joined by `.`, a segment that is not a bare TOML
/// key quoted.
pub fn render(path: &[String]) -> String {
    let mut out = String::new();
    for (i, s) in path.iter().enumerate() {
        if i > 0 {
            out.push('.');
        }
        let bare = !s.is_empty()
            && s.bytes()
                .all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-');
        if bare {
            out.push_str(s);
        } else {
            out.push_str(&Value::String(s.clone()).to_string());
        }
    }
    out
}

/// The key tree of `config` with its backends replaced by `backends` (the backend
/// table in force, which admin API changes also edit).
pub fn tree<'b>(
    config: &super::Config,
    backends: impl Iterator<Item = &'b super::BackendConfig>,
) -> Value {
    let mut tree = config.file.clone();
    let entries = backends.map(|b| (b.id.clone(), b.file.clone())).collect();
    if let Some(t) = tree.as_object_mut() {
        t.insert("backends".into(), Value::Object(entries));
    }
    tree
}

/// The wire tree (serde's view of the file) keyed for diffing: `backends` and
/// `tenants` become objects keyed by `id` and `name` (a later duplicate, which
/// validation refuses anyway, is dropped).
pub fn keyed(mut tree: Value) -> Value {
    for (list, name) in NAMED_ENTRIES {
        if let Some(Value::Array(entries)) = tree.get_mut(list).map(Value::take) {
            let mut by_name = Map::new();
            for e in entries {
                let n = e
                    .get(name)
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string();
                by_name.entry(n).or_insert(e);
            }
            tree[list] = Value::Object(by_name);
        }
    }
    tree
}

/// [`keyed`] undone: the wire shape again (entries in name order), for
/// [`Config::from_json`](super::Config::from_json).
pub fn unkeyed(mut tree: Value) -> Value {
    for (list, _) in NAMED_ENTRIES {
        if let Some(Value::Object(by_name)) = tree.get_mut(list).map(Value::take) {
            tree[list] = Value::Array(by_name.into_iter().map(|(_, e)| e).collect());
        }
    }
    tree
}

/// One key whose value differs between two configs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    pub key: String,
    pub class: Class,
}

/// The keys whose values differ from `running` to `new` (keyed trees), in key
/// order. An entry added or removed whole is one change (`tenants.bob`); an added
/// entry's restart-only keys that are set are reported too (they stay off).
pub fn diff(running: &Value, new: &Value) -> Vec<Change> {
    let mut out = Vec::new();
    diff_at(&mut Vec::new(), Some(running), Some(new), &mut out);
    out
}

fn diff_at(path: &mut Vec<String>, a: Option<&Value>, b: Option<&Value>, out: &mut Vec<Change>) {
    match (a, b) {
        (Some(Value::Object(x)), Some(Value::Object(y))) => {
            let mut names: Vec<&String> = x.keys().chain(y.keys()).collect();
            names.sort();
            names.dedup();
            for n in names {
                path.push(n.clone());
                diff_at(path, x.get(n), y.get(n), out);
                path.pop();
            }
        }
        (Some(x), Some(y)) if x == y => {}
        _ => {
            out.push(Change {
                key: render(path),
                class: class(path),
            });
            if let (None, Some(added)) = (a, b) {
                restart_leaves_set(path, added, out);
            }
        }
    }
}

fn restart_leaves_set(path: &mut Vec<String>, v: &Value, out: &mut Vec<Change>) {
    match v {
        Value::Object(m) => {
            for (n, child) in m {
                path.push(n.clone());
                restart_leaves_set(path, child, out);
                path.pop();
            }
        }
        Value::Null => {}
        _ if class(path) == Class::Restart => out.push(Change {
            key: render(path),
            class: Class::Restart,
        }),
        _ => {}
    }
}

/// The tree in force after a reload from `running` to `new`: live keys from `new`,
/// restart-only keys from `running` (an added entry's restart-only keys null).
pub fn merge(running: &Value, new: &Value) -> Value {
    merge_at(&mut Vec::new(), Some(running), Some(new)).unwrap_or(Value::Null)
}

fn merge_at(path: &mut Vec<String>, a: Option<&Value>, b: Option<&Value>) -> Option<Value> {
    match (a, b) {
        (Some(Value::Object(x)), Some(Value::Object(y))) => {
            let mut out = Map::new();
            for n in x.keys().chain(y.keys()) {
                if out.contains_key(n) {
                    continue;
                }
                path.push(n.clone());
                if let Some(v) = merge_at(path, x.get(n), y.get(n)) {
                    out.insert(n.clone(), v);
                }
                path.pop();
            }
            Some(Value::Object(out))
        }
        (None, Some(added)) if class(path) == Class::Live => {
            let mut added = added.clone();
            null_restart_leaves(path, &mut added);
            Some(added)
        }
        _ if class(path) == Class::Live => b.cloned(),
        _ => a.cloned(),
    }
}

fn null_restart_leaves(path: &mut Vec<String>, v: &mut Value) {
    match v {
        Value::Object(m) => {
            for (n, child) in m.iter_mut() {
                path.push(n.clone());
                null_restart_leaves(path, child);
                path.pop();
            }
        }
        _ if class(path) == Class::Restart => *v = Value::Null,
        _ => {}
    }
}

/// `tree` with every secret replaced: a list by as many `"<redacted>"` strings, any
/// other value by one.
pub fn redacted(mut tree: Value) -> Value {
    redact_at(&mut Vec::new(), &mut tree);
    tree
}

fn redact_at(path: &mut Vec<String>, v: &mut Value) {
    if !path.is_empty() && key(path).is_some_and(|k| k.secret && matches(k.path, path)) {
        let hidden = || Value::String("<redacted>".into());
        *v = match v {
            Value::Null => Value::Null,
            Value::Array(items) => Value::Array(items.iter().map(|_| hidden()).collect()),
            _ => hidden(),
        };
        return;
    }
    if let Value::Object(m) = v {
        for (n, child) in m.iter_mut() {
            path.push(n.clone());
            redact_at(path, child);
            path.pop();
        }
    }
}

/// Every leaf of a keyed tree with its path (an object is walked into; anything
/// else, arrays and empty objects included, is a leaf).
pub fn leaves(tree: &Value) -> Vec<(Vec<String>, &Value)> {
    fn walk<'v>(path: &mut Vec<String>, v: &'v Value, out: &mut Vec<(Vec<String>, &'v Value)>) {
        match v {
            Value::Object(m) if !m.is_empty() => {
                for (n, child) in m {
                    path.push(n.clone());
                    walk(path, child, out);
                    path.pop();
                }
            }
            _ => out.push((path.clone(), v)),
        }
    }
    let mut out = Vec::new();
    walk(&mut Vec::new(), tree, &mut out);
    out
}

#[cfg(test)]
mod tests;
