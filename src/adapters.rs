//! The LoRA adapters the engines serve, as the shards see them.
//!
//! vLLM serves adapters next to its base model and lists each in `GET /v1/models` as
//! an entry whose `parent` is the base model's id (`root`: where it was loaded from);
//! base models have `parent: null`. The probe thread polls that list with the health
//! checks ([`parse_model_list`]), the coordinator keeps each backend's last answer
//! and derives an [`AdapterTable`] from them whenever an answer or the backend table
//! changes; the table travels in the [`crate::fleet::FleetSnapshot`], so a shard
//! swaps it together with everything else it routes with.
//!
//! An adapter is routable on a backend when the backend lists it and its parent is
//! one of the models the backend is configured for (`backends[].models`); the
//! request's model is then the parent and the router keeps only backends serving the
//! adapter. A configured model name always wins over an adapter of the same name.
//! Adapter indices are append-only, like model indices: a request parsed against
//! one snapshot may be routed (or retried) against a later one. An adapter that no
//! backend serves any more keeps its index and is refused as an unknown model.

use crate::backends::BackendTable;
use crate::openai::{ModelNames, ModelRef, ModelTable};
use radixgate_orchestrator::adapter_seed;
use std::collections::HashMap;

/// Adapters a gateway keeps track of over its life; adapters first seen beyond
/// this are ignored (and logged by the coordinator).
pub const MAX_ADAPTERS: usize = 4096;

/// One adapter entry of an engine's `GET /v1/models`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineAdapter {
    pub name: String,
    /// The base model's id.
    pub parent: String,
    /// Where the engine loaded it from (vLLM's `root`), if it said.
    pub root: Option<String>,
}

/// The adapters in a `GET /v1/models` answer (entries with a string `parent`);
/// `None` when the body is not a model list.
pub fn parse_model_list(body: &[u8]) -> Option<Vec<EngineAdapter>> {
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    let data = value.get("data")?.as_array()?;
    Some(
        data.iter()
            .filter_map(|m| {
                Some(EngineAdapter {
                    name: m.get("id")?.as_str()?.to_string(),
                    parent: m.get("parent")?.as_str()?.to_string(),
                    root: m.get("root").and_then(|r| r.as_str()).map(str::to_string),
                })
            })
            .collect(),
    )
}

#[derive(Debug, Clone)]
struct Adapter {
    name: String,
    /// The parent's index in the backend table's model table.
    parent: usize,
    root: Option<String>,
    seed: u64,
    /// Live slots serving it, in slot order.
    serving: Vec<usize>,
}

/// Every adapter seen since start, by stable index, and which live backends serve
/// each one now.
#[derive(Debug, Clone, Default)]
pub struct AdapterTable {
    adapters: Vec<Adapter>,
    index: HashMap<String, usize, foldhash::fast::RandomState>,
}

impl AdapterTable {
    /// The table for `learned[slot]` (each backend's adapters as last polled), keeping
    /// every index of `previous`. Returns it and the adapters ignored for the cap.
    pub fn derive(
        previous: &AdapterTable,
        learned: &[Vec<EngineAdapter>],
        backends: &BackendTable,
    ) -> (AdapterTable, usize) {
        let mut table = AdapterTable {
            adapters: previous
                .adapters
                .iter()
                .map(|a| Adapter {
                    serving: Vec::new(),
                    ..a.clone()
                })
                .collect(),
            index: previous.index.clone(),
        };
        let models = backends.models();
        let mut ignored = 0;
        for (slot, config) in backends.live() {
            for a in learned.get(slot).map_or(&[][..], |l| l.as_slice()) {
                if !config.models.contains(&a.parent) || models.get(&a.name).is_some() {
                    continue;
                }
                let Some(parent) = models.get(&a.parent) else {
                    continue;
                };
                let idx = match table.index.get(&a.name) {
                    Some(&i) => i,
                    None if table.adapters.len() >= MAX_ADAPTERS => {
                        ignored += 1;
                        continue;
                    }
                    None => {
                        table.index.insert(a.name.clone(), table.adapters.len());
                        table.adapters.push(Adapter {
                            name: a.name.clone(),
                            parent,
                            root: a.root.clone(),
                            seed: adapter_seed(&a.parent, &a.name),
                            serving: Vec::new(),
                        });
                        table.adapters.len() - 1
                    }
                };
                let adapter = &mut table.adapters[idx];
                // An adapter keeps the parent it was first seen with: a backend
                // listing the name under another base model serves something else.
                if adapter.parent == parent && !adapter.serving.contains(&slot) {
                    adapter.serving.push(slot);
                    if adapter.root.is_none() {
                        adapter.root = a.root.clone();
                    }
                }
            }
        }
        (table, ignored)
    }

    pub fn get(&self, name: &str) -> Option<usize> {
        self.index.get(name).copied()
    }

    pub fn name(&self, adapter: usize) -> &str {
        &self.adapters[adapter].name
    }

    /// Whether `backend` serves the adapter now.
    pub fn serves(&self, backend: usize, adapter: usize) -> bool {
        self.adapters
            .get(adapter)
            .is_some_and(|a| a.serving.contains(&backend))
    }

    /// Live slots serving the adapter now.
    pub fn serving(&self, adapter: usize) -> &[usize] {
        self.adapters
            .get(adapter)
            .map_or(&[], |a| a.serving.as_slice())
    }

    /// The adapters some live backend serves now: `(name, parent model index, root)`.
    pub fn served(&self) -> impl Iterator<Item = (&str, usize, Option<&str>)> {
        self.adapters
            .iter()
            .filter(|a| !a.serving.is_empty())
            .map(|a| (a.name.as_str(), a.parent, a.root.as_deref()))
    }

    /// Whether it serves the same adapters on the same backends as `other`.
    pub fn same_as(&self, other: &AdapterTable) -> bool {
        self.adapters.len() == other.adapters.len()
            && self
                .adapters
                .iter()
                .zip(&other.adapters)
                .all(|(a, b)| a.serving == b.serving && a.root == b.root)
    }
}

/// A request's `model` looked up among the configured models, then the adapters.
pub struct WithAdapters<'a> {
    pub models: &'a ModelTable,
    pub adapters: &'a AdapterTable,
}

impl ModelNames for WithAdapters<'_> {
    fn resolve(&self, name: &str) -> Option<ModelRef> {
        if let Some(m) = self.models.resolve(name) {
            return Some(m);
        }
        let idx = self.adapters.get(name)?;
        let a = &self.adapters.adapters[idx];
        Some(ModelRef {
            model: a.parent,
            adapter: Some(idx),
            seed: a.seed,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backends::tests::backend;

    fn adapter(name: &str, parent: &str) -> EngineAdapter {
        EngineAdapter {
            name: name.into(),
            parent: parent.into(),
            root: Some(format!("/loras/{name}")),
        }
    }

    #[test]
    fn reads_vllms_model_list() {
        let body = br#"{"object":"list","data":[
            {"id":"m","object":"model","root":"m","parent":null},
            {"id":"a","object":"model","root":"/loras/a","parent":"m"},
            {"id":"b","parent":"m"}, {"parent":"m"}, {"id":"c","parent":7}]}"#;
        let list = parse_model_list(body).unwrap();
        assert_eq!(
            list,
            vec![
                adapter("a", "m"),
                EngineAdapter {
                    name: "b".into(),
                    parent: "m".into(),
                    root: None
                }
            ]
        );
        assert_eq!(parse_model_list(b"{\"data\":[]}"), Some(vec![]));
        assert_eq!(parse_model_list(b"<html>"), None);
        assert_eq!(parse_model_list(b"{\"object\":\"list\"}"), None);
    }

    #[test]
    fn an_adapter_counts_where_its_parent_is_configured_and_keeps_its_index() {
        let t = BackendTable::new(&[backend("x", &["m"]), backend("y", &["n"])]);
        let learned = vec![
            vec![adapter("a", "m"), adapter("m", "n"), adapter("o", "other")],
            vec![adapter("a", "n"), adapter("b", "n")],
        ];
        let (table, ignored) = AdapterTable::derive(&AdapterTable::default(), &learned, &t);
        assert_eq!(ignored, 0);
        let a = table.get("a").unwrap();
        // `a` first seen under `m` on x; y's `a` (under `n`) is another adapter.
        assert_eq!(table.serving(a), &[0]);
        assert!(table.serves(0, a) && !table.serves(1, a));
        // A configured model name is never an adapter; nor is an unconfigured parent's.
        assert_eq!(table.get("m"), None);
        assert_eq!(table.get("o"), None);
        let b = table.get("b").unwrap();
        let names = WithAdapters {
            models: t.models(),
            adapters: &table,
        };
        let r = names.resolve("b").unwrap();
        assert_eq!((r.model, r.adapter), (1, Some(b)));
        assert_eq!(r.seed, adapter_seed("n", "b"));
        assert_eq!(names.resolve("m").unwrap().adapter, None);
        assert!(names.resolve("zzz").is_none());
        // y stops serving b; x is removed: indices stay, nobody serves them.
        let t = t.with_removed(0);
        let learned = vec![vec![adapter("a", "m")], vec![]];
        let (after, _) = AdapterTable::derive(&table, &learned, &t);
        assert_eq!((after.get("a"), after.get("b")), (Some(a), Some(b)));
        assert!(after.serving(a).is_empty() && after.serving(b).is_empty());
        assert_eq!(after.served().count(), 0);
        assert!(!after.same_as(&table));
        assert!(after.same_as(&after.clone()));
    }

    #[test]
    fn adapters_beyond_the_cap_are_ignored() {
        let t = BackendTable::new(&[backend("x", &["m"])]);
        let many: Vec<_> = (0..MAX_ADAPTERS + 3)
            .map(|i| adapter(&format!("a{i}"), "m"))
            .collect();
        let (table, ignored) = AdapterTable::derive(&AdapterTable::default(), &[many], &t);
        assert_eq!(ignored, 3);
        assert_eq!(table.served().count(), MAX_ADAPTERS);
    }
}
