//! Brute-force reference for the prefix index, and the differential check that the
//! property tests (`index/tests.rs`) and the fuzz target (`fuzz/`, which includes this
//! file by path) run against it.
//!
//! The model is the index's semantics spelled out as plainly as possible: per backend
//! a map `block hash -> (last_used, depth)`, scans for every eviction, parent links
//! learned from the chains for removals. It uses only `std` and expects its parent
//! module to have `PrefixIndex`, `IndexConfig` and `PrefixMatch` in scope.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};

use super::{IndexConfig, PrefixIndex, PrefixMatch};

/// One operation on the index, as the tests and the fuzzer generate them.
#[derive(Clone, Debug)]
pub enum Op {
    SetCapacity {
        backend: usize,
        capacity: usize,
    },
    Insert {
        backend: usize,
        chain: Vec<u64>,
        now: u64,
    },
    Remove {
        backend: usize,
        chain: Vec<u64>,
        from: usize,
    },
    RemoveBackend {
        backend: usize,
    },
}

/// The chained hashes of a path in a small tree of prompts: each element (`< 4`)
/// picks a branch. Distinct paths (up to 27 deep) give distinct hashes (base-5
/// numbering scrambled by an odd multiplier, both injective), so a hash names its
/// whole prefix, as real chained hashes do.
pub fn chain_of(path: &[u8]) -> Vec<u64> {
    assert!(
        path.len() <= 27,
        "5^27 < 2^64 keeps the numbering injective"
    );
    let mut h: u64 = 0;
    path.iter()
        .map(|&d| {
            assert!(d < 4, "branch {d} out of range");
            h = h * 5 + u64::from(d) + 1;
            h.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        })
        .collect()
}

#[derive(Clone, Debug, Default)]
struct Backend {
    capacity: usize,
    /// block -> (last_used, depth)
    blocks: BTreeMap<u64, (u64, usize)>,
}

#[derive(Clone, Debug)]
pub struct Model {
    max_blocks: usize,
    backends: Vec<Option<Backend>>,
    parent: BTreeMap<u64, Option<u64>>,
}

impl Model {
    pub fn new(max_blocks: usize) -> Self {
        Self {
            max_blocks,
            backends: Vec::new(),
            parent: BTreeMap::new(),
        }
    }

    pub fn apply(&mut self, op: &Op) {
        match *op {
            Op::SetCapacity { backend, capacity } => {
                if backend >= self.backends.len() {
                    self.backends.resize_with(backend + 1, || None);
                }
                self.backends[backend]
                    .get_or_insert_with(Backend::default)
                    .capacity = capacity;
                self.evict_backend(backend);
            }
            Op::Insert {
                backend,
                ref chain,
                now,
            } => {
                let Some(Some(be)) = self.backends.get_mut(backend) else {
                    return;
                };
                for (depth, &h) in chain.iter().enumerate() {
                    let e = be.blocks.entry(h).or_insert((now, depth));
                    e.0 = e.0.max(now);
                    let parent = depth.checked_sub(1).map(|p| chain[p]);
                    self.parent.insert(h, parent);
                }
                self.evict_backend(backend);
                self.evict_global();
            }
            Op::Remove {
                backend,
                ref chain,
                from,
            } => {
                if from >= chain.len() {
                    return;
                }
                let target = chain[from];
                let parent = &self.parent;
                let Some(Some(be)) = self.backends.get_mut(backend) else {
                    return;
                };
                be.blocks
                    .retain(|&h, _| !chain[from..].contains(&h) && !descends(parent, h, target));
            }
            Op::RemoveBackend { backend } => {
                if let Some(slot) = self.backends.get_mut(backend) {
                    *slot = None;
                }
            }
        }
    }

    fn evict_backend(&mut self, backend: usize) {
        let be = self.backends[backend].as_mut().expect("declared");
        while be.blocks.len() > be.capacity {
            let (&victim, _) = be
                .blocks
                .iter()
                .min_by_key(|(&h, &(t, d))| (t, Reverse(d), h))
                .expect("over capacity means non-empty");
            be.blocks.remove(&victim);
        }
    }

    /// block -> (newest holder's last_used, depth), over all holders.
    fn existing(&self) -> BTreeMap<u64, (u64, usize)> {
        let mut all: BTreeMap<u64, (u64, usize)> = BTreeMap::new();
        for be in self.backends.iter().flatten() {
            for (&h, &(t, d)) in &be.blocks {
                let e = all.entry(h).or_insert((t, d));
                e.0 = e.0.max(t);
            }
        }
        all
    }

    fn evict_global(&mut self) {
        loop {
            let all = self.existing();
            if all.len() <= self.max_blocks {
                return;
            }
            let (&victim, _) = all
                .iter()
                .min_by_key(|(&h, &(t, d))| (t, Reverse(d), h))
                .expect("over the bound means non-empty");
            for be in self.backends.iter_mut().flatten() {
                be.blocks.remove(&victim);
            }
        }
    }

    pub fn slots(&self) -> usize {
        self.backends.len()
    }

    pub fn matched(&self, chain: &[u64]) -> Vec<u32> {
        self.backends
            .iter()
            .map(|be| match be {
                Some(be) => chain
                    .iter()
                    .take_while(|h| be.blocks.contains_key(h))
                    .count() as u32,
                None => 0,
            })
            .collect()
    }

    /// The `last_used` of the chain's last block when `backend` holds every block of
    /// the (non-empty) chain.
    pub fn last_used(&self, backend: usize, chain: &[u64]) -> Option<u64> {
        let be = self.backends.get(backend)?.as_ref()?;
        let mut last = None;
        for h in chain {
            last = Some(be.blocks.get(h)?.0);
        }
        last
    }

    pub fn held(&self, backend: usize) -> usize {
        match self.backends.get(backend) {
            Some(Some(be)) => be.blocks.len(),
            _ => 0,
        }
    }

    pub fn total(&self) -> usize {
        self.existing().len()
    }

    /// Nodes of the canonical path-compressed tree over the current state: a block
    /// starts a node unless its parent has it as its only child and both have the same
    /// holders at the same times.
    pub fn canonical_nodes(&self) -> usize {
        let holders = |h: u64| -> Vec<(usize, u64)> {
            self.backends
                .iter()
                .enumerate()
                .filter_map(|(b, be)| Some((b, be.as_ref()?.blocks.get(&h)?.0)))
                .collect()
        };
        let all = self.existing();
        let mut children: BTreeMap<u64, usize> = BTreeMap::new();
        for &h in all.keys() {
            if let Some(Some(p)) = self.parent.get(&h) {
                *children.entry(*p).or_default() += 1;
            }
        }
        all.keys()
            .filter(|&&h| match self.parent.get(&h) {
                Some(Some(p)) => children[p] != 1 || holders(*p) != holders(h),
                _ => true,
            })
            .count()
    }
}

fn descends(parent: &BTreeMap<u64, Option<u64>>, mut h: u64, ancestor: u64) -> bool {
    while let Some(&Some(p)) = parent.get(&h) {
        if p == ancestor {
            return true;
        }
        h = p;
    }
    false
}

pub fn apply(index: &mut PrefixIndex, op: &Op) {
    match *op {
        Op::SetCapacity { backend, capacity } => index.set_capacity(backend, capacity),
        Op::Insert {
            backend,
            ref chain,
            now,
        } => index.insert(backend, chain, now),
        Op::Remove {
            backend,
            ref chain,
            from,
        } => index.remove(backend, chain, from),
        Op::RemoveBackend { backend } => index.remove_backend(backend),
    }
}

/// Every chain the ops mention, with each of its prefixes: the queries worth asking.
pub fn probes(ops: &[Op]) -> Vec<Vec<u64>> {
    let mut probes = BTreeSet::new();
    for op in ops {
        if let Op::Insert { chain, .. } | Op::Remove { chain, .. } = op {
            for n in 0..=chain.len() {
                probes.insert(chain[..n].to_vec());
            }
        }
    }
    probes.into_iter().collect()
}

/// Applies `ops` to a fresh index and a fresh model side by side and, after every op,
/// checks that they agree on every probe's match, on held and total counts and on the
/// node count of the canonical tree, that the budgets hold, and the index's internal
/// invariants.
pub fn check_against_model(max_blocks: usize, ops: &[Op]) -> PrefixIndex {
    let probes = probes(ops);
    let mut index = PrefixIndex::new(IndexConfig { max_blocks });
    let mut model = Model::new(max_blocks);
    let mut out = PrefixMatch::default();
    for (step, op) in ops.iter().enumerate() {
        apply(&mut index, op);
        model.apply(op);
        index.assert_invariants();
        let ctx = || format!("after op {step}: {op:?}");
        assert_eq!(index.total_blocks(), model.total(), "total, {}", ctx());
        assert!(index.total_blocks() <= max_blocks, "{}", ctx());
        assert_eq!(
            index.node_count(),
            model.canonical_nodes(),
            "nodes, {}",
            ctx()
        );
        for b in 0..model.slots() + 1 {
            assert_eq!(index.held_blocks(b), model.held(b), "held {b}, {}", ctx());
            assert!(index.held_blocks(b) <= index.capacity(b), "{}", ctx());
            for probe in &probes {
                assert_eq!(
                    index.last_used(b, probe),
                    model.last_used(b, probe),
                    "last_used {b} {probe:?}, {}",
                    ctx()
                );
            }
        }
        for probe in &probes {
            index.match_prefix(probe, &mut out);
            for b in 0..model.slots() + 1 {
                assert_eq!(
                    index.last_used_matched(&out, b),
                    model.last_used(b, probe),
                    "last_used_matched {b} {probe:?}, {}",
                    ctx()
                );
            }
            let want = model.matched(probe);
            assert_eq!(out.matched, want, "match {probe:?}, {}", ctx());
            assert_eq!(
                out.longest,
                want.iter().copied().max().unwrap_or(0),
                "{}",
                ctx()
            );
        }
    }
    index
}

/// The same ops with every hash folded into a tiny alphabet, so one hash shows up at
/// several depths and under several parents (which chained hashing rules out). The
/// model no longer applies, but the index must stay internally consistent, within
/// its budgets, and never panic.
pub fn check_with_colliding_hashes(max_blocks: usize, ops: &[Op]) {
    let fold = |chain: &[u64]| chain.iter().map(|h| h % 3).collect::<Vec<u64>>();
    let mut index = PrefixIndex::new(IndexConfig { max_blocks });
    let mut out = PrefixMatch::default();
    for op in ops {
        let op = match op {
            Op::Insert {
                backend,
                chain,
                now,
            } => Op::Insert {
                backend: *backend,
                chain: fold(chain),
                now: *now,
            },
            Op::Remove {
                backend,
                chain,
                from,
            } => Op::Remove {
                backend: *backend,
                chain: fold(chain),
                from: *from,
            },
            other => other.clone(),
        };
        apply(&mut index, &op);
        index.assert_invariants();
        if let Op::Insert { chain, .. } | Op::Remove { chain, .. } = &op {
            index.match_prefix(chain, &mut out);
            assert!(out.longest as usize <= chain.len());
            assert_eq!(out.matched.len(), index.backend_slots());
        }
    }
}
