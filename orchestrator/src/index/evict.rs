//! Eviction and removal for the prefix index: per-backend LRU beyond its capacity,
//! global LRU beyond `max_blocks`, and dropping a backend from a subtree.
//!
//! Both LRU sets hold one key per node naming its deepest block, which is the node's
//! least-recently-used block (uniform time, deepest first). Evicting takes the
//! smallest key and cuts as many tail blocks of that node as sort before the next key
//! (bounded by the excess), which is exactly what evicting one block at a time would
//! do, at `O(log n)` per node instead of per block. The node found is always a leaf
//! for the evicting side: a child is never newer than its parent and sorts first on
//! equal times, so its key would have come up before.

use std::cmp::Reverse;

use super::{LruKey, PrefixIndex};
use crate::policy::BackendIdx;

// === impl PrefixIndex: eviction ===

impl PrefixIndex {
    /// Evicts `backend`'s least-recently-used blocks until it is within capacity.
    pub(super) fn evict_backend(&mut self, backend: BackendIdx) {
        loop {
            let slot = &self.backends[backend];
            if slot.held <= slot.capacity {
                return;
            }
            let excess = slot.held - slot.capacity;
            let mut keys = slot.lru.iter();
            let first = *keys.next().expect("a backend holding blocks has keys");
            let next = keys.next().copied();
            let k = self.evictable(first, next, excess);
            self.evict_tail(first.node, backend as u32, k);
        }
    }

    /// Evicts globally least-recently-used blocks, from all holders, until the index
    /// is within `max_blocks`.
    pub(super) fn evict_global(&mut self) {
        while self.total_blocks > self.config.max_blocks {
            let excess = self.total_blocks - self.config.max_blocks;
            let mut keys = self.global_lru.iter();
            let first = *keys.next().expect("a non-empty index has keys");
            let next = keys.next().copied();
            let k = self.evictable(first, next, excess);
            self.trim_leaf(first.node, k);
        }
    }

    /// How many tail blocks of `first.node` (all at `first.last_used`) sort before
    /// `next`, capped at `excess`; at least one.
    fn evictable(&self, first: LruKey, next: Option<LruKey>, excess: usize) -> usize {
        let node = &self.nodes[first.node as usize];
        let limit = excess.min(node.edge.len());
        match next {
            Some(next) if next.last_used == first.last_used => {
                let mut k = 1;
                while k < limit {
                    let depth = first.depth.0 - k as u32;
                    let key = LruKey {
                        last_used: first.last_used,
                        depth: Reverse(depth),
                        hash: node.edge[(depth - node.depth) as usize],
                        node: first.node,
                    };
                    if key > next {
                        break;
                    }
                    k += 1;
                }
                k
            }
            // The next key is newer (or there is none): the whole run goes first.
            _ => limit,
        }
    }

    /// Evicts the last `k` blocks of `n` from `b`, which holds none of `n`'s children.
    fn evict_tail(&mut self, n: u32, b: u32, k: usize) {
        let node = &self.nodes[n as usize];
        if node.holders.len() == 1 {
            debug_assert_eq!(node.holders[0].backend, b);
            self.trim_leaf(n, k);
            return;
        }
        let len = node.edge.len();
        let target = if k < len { self.split(n, len - k) } else { n };
        debug_assert!(self.first_held_child(target, b).is_none());
        let survived = self.drop_holder(target, b);
        debug_assert!(survived, "other holders keep the node");
    }
}

// === impl PrefixIndex: removal ===

impl PrefixIndex {
    /// Drops `b` from `top` and every descendant it holds, deepest first, pruning
    /// nodes left without holders and merging those that now agree with their only
    /// child.
    pub(super) fn drop_subtree(&mut self, b: u32, top: u32) {
        let mut list = std::mem::take(&mut self.scratch);
        list.clear();
        list.push(top);
        let mut i = 0;
        while i < list.len() {
            let n = list[i];
            for &(_, c) in &self.nodes[n as usize].children {
                if self.holder(c, b).is_some() {
                    list.push(c);
                }
            }
            i += 1;
        }
        // Breadth-first order reversed: every node comes after all its descendants, so
        // a merge only ever frees a node already handled.
        for &n in list.iter().rev() {
            self.drop_holder(n, b);
        }
        self.scratch = list;
    }
}
