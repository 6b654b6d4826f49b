//! A full consistency check of the prefix index, for tests and fuzzing: rebuilds
//! every count and key set from the tree and compares, and checks the structural
//! invariants the fast paths rely on (prefix closure, uniform and canonical nodes,
//! parent links, sorted children, bounds).

use std::collections::BTreeSet;

use super::{LruKey, PrefixIndex, NIL, ROOT};

// === impl PrefixIndex: invariants ===

impl PrefixIndex {
    /// Panics with a description of the first broken invariant. `O(n log n)`; for
    /// tests and fuzzing, not for production paths.
    #[doc(hidden)]
    pub fn assert_invariants(&self) {
        let root = &self.nodes[ROOT as usize];
        assert!(root.edge.is_empty() && root.holders.is_empty() && root.parent == NIL);
        let slots = self.backends.len();
        let mut held = vec![0usize; slots];
        let mut backend_keys: Vec<BTreeSet<LruKey>> = vec![BTreeSet::new(); slots];
        let mut global_keys = BTreeSet::new();
        let mut total = 0;
        let mut live = 0;
        let mut stack = vec![ROOT];
        while let Some(n) = stack.pop() {
            let node = &self.nodes[n as usize];
            assert!(
                node.children.windows(2).all(|w| w[0].0 < w[1].0),
                "node {n}: children not sorted or not distinct"
            );
            if n != ROOT {
                if let [(_, c)] = node.children[..] {
                    assert_ne!(
                        node.holders, self.nodes[c as usize].holders,
                        "node {n} should have merged with its only child {c}"
                    );
                }
            }
            for &(first, c) in &node.children {
                let child = &self.nodes[c as usize];
                assert_eq!(child.parent, n, "node {c}: parent link");
                assert_eq!(child.edge.first(), Some(&first), "node {c}: child key");
                assert_eq!(child.depth, self.end_depth(n), "node {c}: depth");
                assert!(
                    !child.holders.is_empty(),
                    "node {c}: no holders, not pruned"
                );
                assert!(
                    child
                        .holders
                        .windows(2)
                        .all(|w| w[0].backend < w[1].backend),
                    "node {c}: holders not sorted or not distinct"
                );
                for h in &child.holders {
                    let b = h.backend as usize;
                    assert!(self.backends[b].declared, "node {c}: undeclared holder {b}");
                    if n != ROOT {
                        let above = self.holder(n, h.backend);
                        let above = above.unwrap_or_else(|| {
                            panic!("node {c}: backend {b} holds it but not its parent")
                        });
                        assert!(
                            above.last_used >= h.last_used,
                            "node {c}: backend {b} newer than in its parent"
                        );
                    }
                    held[b] += child.edge.len();
                    backend_keys[b].insert(self.tail_key(c, h.last_used));
                }
                global_keys.insert(self.tail_key(c, self.global_time(c)));
                total += child.edge.len();
                live += 1;
                stack.push(c);
            }
        }
        assert_eq!(live, self.node_count(), "live nodes vs arena bookkeeping");
        assert_eq!(total, self.total_blocks, "total_blocks");
        assert!(total <= self.config.max_blocks, "over max_blocks");
        for (b, slot) in self.backends.iter().enumerate() {
            assert_eq!(slot.held, held[b], "backend {b}: held count");
            assert!(slot.held <= slot.capacity, "backend {b}: over capacity");
            assert!(
                slot.declared || slot.held == 0,
                "backend {b}: undeclared holds"
            );
            assert!(
                slot.lru == backend_keys[b],
                "backend {b}: LRU keys out of step"
            );
        }
        assert!(
            self.global_lru == global_keys,
            "global LRU keys out of step"
        );
        for &f in &self.free {
            let node = &self.nodes[f as usize];
            assert!(
                node.edge.is_empty() && node.parent == NIL,
                "free slot {f} in use"
            );
        }
    }
}
