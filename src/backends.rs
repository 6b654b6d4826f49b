//! The backend table and the live configuration, as every shard sees them.
//!
//! Backends live in numbered slots that never move: a slot index is the backend's
//! `BackendIdx` in the prefix index, the in-flight counters, the metrics and every
//! request routed to it. Adding a backend appends a slot; removing one retires its
//! slot (a tombstone that keeps its config, so requests still in flight to it can
//! finish) and never shifts the others. Model indices are append-only for the same
//! reason. A slot is never reused, so at most [`MAX_BACKEND_SLOTS`] backends can be
//! added over a process's life.
//!
//! [`LiveConfig`] bundles the table with the settings that can change at run time
//! (every key [`crate::config::keys::KEYS`] classifies live: routing policy and
//! knobs, admission, server limits, upstream timeouts, health, retry, breaker) and
//! the tenant table; the coordinator builds a new one for every change and
//! publishes it inside the fleet snapshot, so shards swap all of it at once.

use crate::config::{BackendConfig, Config, DisaggConfig};
use crate::openai::ModelTable;
use crate::tenants::TenantTable;
use radixgate_orchestrator::{PolicyConfig, RouterConfig};
use std::sync::Arc;

/// Backend slots a gateway can hold over its life (the in-flight counters are
/// sized for them up front: 64 bytes per slot and shard).
pub const MAX_BACKEND_SLOTS: usize = 1024;

#[derive(Debug, Clone)]
struct Slot {
    config: Arc<BackendConfig>,
    removed: bool,
}

/// Every backend since start, by stable slot, and which models each live one serves.
#[derive(Debug, Clone)]
pub struct BackendTable {
    slots: Vec<Slot>,
    models: ModelTable,
    /// `serving[model]`: live slots serving that model, in slot order.
    serving: Vec<Vec<usize>>,
    /// `compute_peers[slot]`: the other live slots in its `compute_group`.
    compute_peers: Vec<Vec<usize>>,
}

impl BackendTable {
    pub fn new(backends: &[BackendConfig]) -> Self {
        let slots = backends
            .iter()
            .map(|b| Slot {
                config: Arc::new(b.clone()),
                removed: false,
            })
            .collect();
        Self::derive(slots, Vec::new())
    }

    /// Rebuilds the model table (keeping every known model's index) and `serving`.
    fn derive(slots: Vec<Slot>, mut names: Vec<String>) -> Self {
        for s in slots.iter().filter(|s| !s.removed) {
            for m in &s.config.models {
                if !names.contains(m) {
                    names.push(m.clone());
                }
            }
        }
        let serving = names
            .iter()
            .map(|m| {
                slots
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| !s.removed && s.config.models.contains(m))
                    .map(|(i, _)| i)
                    .collect()
            })
            .collect();
        fn group(s: &Slot) -> Option<&str> {
            s.config.compute_group.as_deref().filter(|_| !s.removed)
        }
        let compute_peers = slots
            .iter()
            .enumerate()
            .map(|(i, slot)| match group(slot) {
                None => Vec::new(),
                Some(g) => (0..slots.len())
                    .filter(|&j| j != i && group(&slots[j]) == Some(g))
                    .collect(),
            })
            .collect();
        Self {
            slots,
            models: ModelTable::new(names),
            serving,
            compute_peers,
        }
    }

    /// Slots, retired ones included.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// The slot's backend (also for a retired slot, whose requests may still run).
    pub fn config(&self, slot: usize) -> &Arc<BackendConfig> {
        &self.slots[slot].config
    }

    pub fn id(&self, slot: usize) -> &str {
        &self.slots[slot].config.id
    }

    pub fn is_live(&self, slot: usize) -> bool {
        self.slots.get(slot).is_some_and(|s| !s.removed)
    }

    /// Live slots with their backends.
    pub fn live(&self) -> impl Iterator<Item = (usize, &BackendConfig)> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, s)| !s.removed)
            .map(|(i, s)| (i, &*s.config))
    }

    pub fn live_count(&self) -> usize {
        self.slots.iter().filter(|s| !s.removed).count()
    }

    /// The live slot with this id.
    pub fn find(&self, id: &str) -> Option<usize> {
        self.live().find(|(_, b)| b.id == id).map(|(i, _)| i)
    }

    /// Every model ever served (indices are stable), for parsing and metrics.
    pub fn models(&self) -> &ModelTable {
        &self.models
    }

    /// Live slots serving `model`; empty when no live backend serves it any more.
    pub fn serving(&self, model: usize) -> &[usize] {
        self.serving.get(model).map_or(&[], |s| s.as_slice())
    }

    /// The other live slots that share `slot`'s compute (`compute_group`).
    pub fn compute_peers(&self, slot: usize) -> &[usize] {
        self.compute_peers.get(slot).map_or(&[], |p| p.as_slice())
    }

    /// Every slot's id, retired ones included (metrics labels, the hash ring).
    pub fn ids(&self) -> Vec<String> {
        self.slots.iter().map(|s| s.config.id.clone()).collect()
    }

    /// This table plus `backend` in a new slot; returns the slot.
    pub fn with_added(&self, backend: BackendConfig) -> (BackendTable, usize) {
        let mut slots = self.slots.clone();
        slots.push(Slot {
            config: Arc::new(backend),
            removed: false,
        });
        let slot = slots.len() - 1;
        (Self::derive(slots, self.models.names().to_vec()), slot)
    }

    /// This table with `slot` retired.
    pub fn with_removed(&self, slot: usize) -> BackendTable {
        let mut slots = self.slots.clone();
        slots[slot].removed = true;
        Self::derive(slots, self.models.names().to_vec())
    }

    /// This table with `slot`'s backend replaced in place (same engine address).
    pub fn with_updated(&self, slot: usize, backend: BackendConfig) -> BackendTable {
        let mut slots = self.slots.clone();
        slots[slot].config = Arc::new(backend);
        Self::derive(slots, self.models.names().to_vec())
    }
}

/// What shards route with and may change at run time: the backend table, the live
/// settings, the tenants and the policy factory's input derived from them. `config`
/// holds the settings in force; its restart-only keys keep their start-up values,
/// `config.backends` is only the list last loaded (the table is the truth) and
/// `config.tenants` the tenants as configured (`tenants` is the truth).
#[derive(Debug)]
pub struct LiveConfig {
    pub config: Config,
    pub backends: BackendTable,
    /// The tenants in force, with their keys and quota buckets.
    pub tenants: Arc<TenantTable>,
    /// The router's settings (the policies' input included), derived from both.
    pub router: RouterConfig,
    /// `split[model]`: the model's split-pool settings, `None` when served whole.
    pub split: Vec<Option<Arc<DisaggConfig>>>,
}

impl LiveConfig {
    pub fn new(config: Config, backends: BackendTable, tenants: Arc<TenantTable>) -> Self {
        let router = RouterConfig {
            policy: PolicyConfig {
                backend_ids: backends.ids(),
                hash_load_factor: config.routing.hash_load_factor,
                hash_virtual_nodes: config.routing.hash_virtual_nodes,
                prefix: config.routing.prefix_aware.clone(),
            },
            index_touch_ms: config.routing.index_touch_ms,
            rag_chunk_weight: config.routing.rag_chunk_weight,
            half_open_probes: config.breaker.half_open_probes,
            estimate_picks: config.retry.first_token_timeout.is_some()
                && config.retry.first_token_timeout_factor > 0.0,
        };
        let split = backends
            .models()
            .names()
            .iter()
            .map(|m| config.split_models.get(m).cloned())
            .collect();
        Self {
            config,
            backends,
            tenants,
            router,
            split,
        }
    }

    /// This config with another backend table (an admin API change).
    pub fn with_backends(&self, backends: BackendTable) -> Self {
        Self::new(self.config.clone(), backends, self.tenants.clone())
    }

    /// Every key in force as a JSON tree (`GET /admin/config` redacts it): the
    /// config's, with the backends of the table.
    pub fn tree(&self) -> serde_json::Value {
        crate::config::keys::tree(&self.config, self.backends.live().map(|(_, b)| b))
    }

    /// The model's split-pool settings, if it is served by one.
    pub fn split(&self, model: usize) -> Option<&Arc<DisaggConfig>> {
        self.split.get(model).and_then(|s| s.as_ref())
    }

    /// The configuration as started: every backend in its config order.
    pub fn initial(config: &Config) -> Arc<LiveConfig> {
        Arc::new(Self::new(
            config.clone(),
            BackendTable::new(&config.backends),
            Arc::new(TenantTable::new(
                &config.tenants,
                0,
                config.cluster.is_some(),
            )),
        ))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A backend config for tests: `id` serving `models`, everything else default.
    pub(crate) fn backend(id: &str, models: &[&str]) -> BackendConfig {
        BackendConfig {
            id: id.into(),
            addr: "127.0.0.1:1".parse().unwrap(),
            host: "127.0.0.1:1".into(),
            tls: None,
            models: models.iter().map(|m| m.to_string()).collect(),
            cache_blocks: 1,
            upstream_auth: None,
            kv_events: None,
            capabilities: Default::default(),
            role: Default::default(),
            bootstrap_port: None,
            compute_group: None,
            file: serde_json::Value::Null,
            discovered: None,
        }
    }

    #[test]
    fn slots_are_stable_and_models_append_only() {
        let t = BackendTable::new(&[backend("a", &["m"]), backend("b", &["m", "n"])]);
        assert_eq!(t.serving(1), &[1]);
        let t = t.with_removed(0);
        assert_eq!(t.serving(0), &[1]);
        assert!(!t.is_live(0) && t.is_live(1));
        assert_eq!(t.find("a"), None);
        assert_eq!(t.id(0), "a");
        let (t, slot) = t.with_added(backend("a", &["o"]));
        assert_eq!(slot, 2);
        assert_eq!(t.find("a"), Some(2));
        assert_eq!(t.models().get("o"), Some(2));
        let t = t.with_removed(1);
        // Model indices never move, even for models no live backend serves.
        assert_eq!(t.models().get("n"), Some(1));
        assert!(t.serving(1).is_empty());
        assert_eq!(t.live_count(), 1);
        let t = t.with_updated(2, backend("a", &["m"]));
        assert_eq!(t.serving(0), &[2]);
    }

    #[test]
    fn compute_peers_are_the_other_live_slots_of_a_group() {
        let grouped = |id: &str, group: Option<&str>| BackendConfig {
            compute_group: group.map(String::from),
            ..backend(id, &["m"])
        };
        let t = BackendTable::new(&[
            grouped("a", Some("core0")),
            grouped("b", None),
            grouped("c", Some("core0")),
            grouped("d", Some("core1")),
        ]);
        assert_eq!(t.compute_peers(0), &[2]);
        assert_eq!(t.compute_peers(2), &[0]);
        assert!(t.compute_peers(1).is_empty() && t.compute_peers(3).is_empty());
        let (t, e) = t.with_added(grouped("e", Some("core0")));
        assert_eq!(t.compute_peers(0), &[2, e]);
        // A retired slot neither has peers nor is one.
        let t = t.with_removed(2);
        assert_eq!(t.compute_peers(0), &[e]);
        assert!(t.compute_peers(2).is_empty());
        let t = t.with_updated(e, grouped("e", None));
        assert!(t.compute_peers(0).is_empty());
    }
}
