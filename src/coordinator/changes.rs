//! Changing the fleet at run time: adding and removing backends (admin API) and
//! applying a reloaded config, each published to every shard as one snapshot.
//!
//! Order matters and is the same for every change: per-slot state and the
//! authoritative index first, index events to the shards next (a new backend is
//! declared in every replica, a removed one's blocks dropped), then the new
//! [`LiveConfig`] to the health and log threads, and last the fleet snapshot that
//! makes it routable or stops routing to it. Shard command channels are FIFO, so a
//! shard never routes to a backend its replica does not know.

use super::{breaker_config, Coordinator};
use crate::backends::{BackendTable, LiveConfig, MAX_BACKEND_SLOTS};
use crate::config::keys::Class;
use crate::config::{BackendConfig, Config};
use crate::error::{ErrorKind, GatewayError};
use crate::reload;
use crate::replica::{IndexEvent, IndexOp, Origin};
use radixgate_orchestrator::Breaker;
use serde_json::{json, Value};
use std::sync::Arc;

impl Coordinator {
    /// `POST /admin/backends`: a new backend, healthy until its checks say otherwise
    /// (as every backend is at start-up), routable on every shard at once.
    pub(super) fn on_add(&mut self, backend: BackendConfig) -> Result<Value, GatewayError> {
        let mut errors = Vec::new();
        let split = &self.live.config.split_models;
        crate::config::check_backend_role(&backend, split, "backend", &mut errors);
        if !errors.is_empty() {
            return Err(GatewayError::new(
                ErrorKind::InvalidConfig,
                format!("invalid backend: {}", errors.join("; ")),
            ));
        }
        let mut table = self.live.backends.clone();
        let id = backend.id.clone();
        let slot = self.add_slot(&mut table, backend)?;
        tracing::info!(backend = %id, slot, "admin: backend added");
        self.set_live(self.live.with_backends(table));
        Ok(self.backend_json(slot))
    }

    /// `DELETE /admin/backends/{id}`: no new requests from now on, its requests in
    /// flight finish, its index entries and idle connections go.
    pub(super) fn on_remove(&mut self, id: &str) -> Result<Value, GatewayError> {
        let slot = self.live.backends.find(id).ok_or_else(|| {
            GatewayError::new(
                ErrorKind::PathNotFound,
                format!("no backend with id `{id}`"),
            )
        })?;
        if self.live.backends.live_count() == 1 {
            return Err(GatewayError::new(
                ErrorKind::Conflict,
                format!("`{id}` is the last backend; add another before removing it"),
            ));
        }
        let mut table = self.live.backends.clone();
        self.retire_slot(&mut table, slot);
        tracing::info!(backend = %id, slot, "admin: backend removed");
        self.set_live(self.live.with_backends(table));
        Ok(json!({
            "id": id,
            "removed": true,
            "in_flight": self.shared.in_flight.local_total(slot),
        }))
    }

    /// `POST /admin/reload` and SIGHUP, with a config already validated: the
    /// backends are diffed by id (added, removed, updated in place, or replaced when
    /// the url changed), live settings are swapped, restart-only keys are reported
    /// and left as they are. Everything reaches the shards as one snapshot.
    pub(super) fn on_reload(&mut self, new: Config) -> Result<Value, GatewayError> {
        // Discovered backends are discovery's: the file neither lists nor removes them.
        let running: Vec<&BackendConfig> = self
            .live
            .backends
            .live()
            .map(|(_, b)| b)
            .filter(|b| b.discovered.is_none())
            .collect();
        let plan = reload::plan(&self.live.config, &running, &new);
        let new = &plan.config;
        let mut table = self.live.backends.clone();
        let old = &self.live.backends;
        let removed: Vec<usize> = old
            .live()
            .filter(|(_, b)| b.discovered.is_none())
            .filter(|(_, b)| !new.backends.iter().any(|n| n.id == b.id))
            .map(|(slot, _)| slot)
            .collect();
        let mut added = Vec::new();
        let mut replaced = Vec::new();
        let mut updated = Vec::new();
        for b in &new.backends {
            match old.find(&b.id) {
                None => added.push(b.clone()),
                Some(slot) if reload::same_engine(old.config(slot), b) => {
                    if !reload::same_backend(old.config(slot), b) {
                        updated.push((slot, b.clone()));
                    }
                }
                Some(slot) => replaced.push((slot, b.clone())),
            }
        }
        let new_slots = added.len() + replaced.len();
        if table.len() + new_slots > MAX_BACKEND_SLOTS {
            return Err(slots_exhausted());
        }
        let ids = |slots: &[usize]| -> Vec<String> {
            slots.iter().map(|s| old.id(*s).to_string()).collect()
        };
        let summary_removed = ids(&removed);
        let summary_updated: Vec<&str> = updated.iter().map(|(_, b)| b.id.as_str()).collect();
        let summary_replaced: Vec<&str> = replaced.iter().map(|(_, b)| b.id.as_str()).collect();
        let summary_added: Vec<&str> = added.iter().map(|b| b.id.as_str()).collect();
        let summary = json!({
            "reloaded": true,
            "source": new.source.as_ref().map(|p| p.display().to_string()),
            "backends": {
                "added": summary_added,
                "removed": summary_removed,
                "updated": summary_updated,
                "replaced": summary_replaced,
            },
            "keys": plan.keys_json(),
            // The files are read at every reload: the certificate new handshakes get.
            "tls": plan.config.server.tls.as_ref().map(|t| json!({
                "cert": t.cert,
                "fingerprint_sha256": t.fingerprint,
                "changed": self.live.config.server.tls.as_ref()
                    .is_none_or(|old| old.fingerprint != t.fingerprint),
            })),
            "changed": plan.keys(Class::Live),
            "restart_required": plan.keys(Class::Restart),
        });

        for slot in removed {
            self.retire_slot(&mut table, slot);
        }
        for (slot, b) in replaced {
            self.retire_slot(&mut table, slot);
            self.add_slot(&mut table, b)?;
        }
        for b in added {
            self.add_slot(&mut table, b)?;
        }
        for (slot, b) in updated {
            let blocks = b.cache_blocks;
            table = table.with_updated(slot, b);
            if self.capacity[slot] != blocks {
                self.capacity[slot] = blocks;
                self.declare(slot, blocks);
            }
        }
        self.restart_pending = plan
            .keys(Class::Restart)
            .into_iter()
            .map(String::from)
            .collect();
        let now = self.shared.now_ms();
        let tenants = Arc::new(self.live.tenants.reloaded(&plan.config.tenants, now));
        self.breaker_config = breaker_config(&plan.config);
        self.set_live(LiveConfig::new(plan.config, table, tenants));
        tracing::info!(keys = %reload::describe(&summary), summary = %summary, "config reloaded");
        Ok(summary)
    }

    /// Appends a slot for `backend` with fresh state, declared in every index.
    fn add_slot(
        &mut self,
        table: &mut BackendTable,
        backend: BackendConfig,
    ) -> Result<usize, GatewayError> {
        if table.find(&backend.id).is_some() {
            return Err(GatewayError::new(
                ErrorKind::Conflict,
                format!("a backend with id `{}` already exists", backend.id),
            ));
        }
        if table.len() >= MAX_BACKEND_SLOTS {
            return Err(slots_exhausted());
        }
        let blocks = backend.cache_blocks;
        let (next, slot) = table.with_added(backend);
        *table = next;
        self.breakers.push(Breaker::default());
        self.healthy.push(true);
        self.passes.push(0);
        self.failures.push(0);
        self.draining.push(false);
        self.engine.push(None);
        self.capacity.push(blocks);
        self.declare(slot, blocks);
        Ok(slot)
    }

    /// Retires `slot`: out of the table, out of every index.
    fn retire_slot(&mut self, table: &mut BackendTable, slot: usize) {
        *table = table.with_removed(slot);
        self.breakers[slot] = Breaker::default();
        self.draining[slot] = false;
        self.apply_and_fan_out(index_op(IndexOp::RemoveBackend { backend: slot }));
    }

    fn declare(&mut self, slot: usize, blocks: usize) {
        self.apply_and_fan_out(index_op(IndexOp::SetCapacity {
            backend: slot,
            blocks,
        }));
    }

    /// Makes `live` the config in force: to the health and log threads first, then
    /// to every shard in one fleet snapshot.
    fn set_live(&mut self, live: LiveConfig) {
        self.live = Arc::new(live);
        for f in &self.followers {
            let _ = f.send(self.live.clone());
        }
        self.publish_fleet();
    }
}

fn index_op(op: IndexOp) -> IndexEvent {
    IndexEvent {
        origin: Origin::Local,
        created: std::time::Instant::now(),
        op,
    }
}

fn slots_exhausted() -> GatewayError {
    GatewayError::new(
        ErrorKind::Conflict,
        format!(
            "all {MAX_BACKEND_SLOTS} backend slots are used (a removed backend's slot is \
             not reused); restart the gateway to add more"
        ),
    )
}
