//! The prefix index's tree surgery: node allocation in the arena, lookups, splitting
//! and merging edges, touching holders, and keeping the LRU key sets in step with
//! every change.
//!
//! Keys name a node's deepest block and its time, so any change to a node's edge or
//! holders goes `unlink` (remove its keys) → mutate → `link` (insert fresh keys). The
//! helpers here keep two invariants that the rest of the index relies on: every node
//! is uniform (each holder holds the whole edge at one time), and no node has a single
//! child with exactly the same holders (such pairs are merged), which makes the tree's
//! shape a function of the model state.

use std::cmp::Reverse;

use super::{Holder, LruKey, Node, PrefixIndex, NIL, ROOT};

// === impl PrefixIndex: lookups ===

impl PrefixIndex {
    /// The child of `n` whose edge starts with `first`.
    #[inline]
    pub(super) fn child(&self, n: u32, first: u64) -> Option<u32> {
        let children = &self.nodes[n as usize].children;
        children
            .binary_search_by_key(&first, |&(h, _)| h)
            .ok()
            .map(|i| children[i].1)
    }

    #[inline]
    pub(super) fn holder(&self, n: u32, b: u32) -> Option<Holder> {
        let holders = &self.nodes[n as usize].holders;
        holders
            .binary_search_by_key(&b, |h| h.backend)
            .ok()
            .map(|i| holders[i])
    }

    pub(super) fn first_held_child(&self, n: u32, b: u32) -> Option<u32> {
        self.nodes[n as usize]
            .children
            .iter()
            .map(|&(_, c)| c)
            .find(|&c| self.holder(c, b).is_some())
    }

    /// The key of `n`'s deepest block at time `last_used`.
    pub(super) fn tail_key(&self, n: u32, last_used: u64) -> LruKey {
        let node = &self.nodes[n as usize];
        LruKey {
            last_used,
            depth: Reverse(node.depth + node.edge.len() as u32 - 1),
            hash: *node.edge.last().expect("live nodes have an edge"),
            node: n,
        }
    }

    /// A node's global time: its newest holder's.
    pub(super) fn global_time(&self, n: u32) -> u64 {
        let holders = &self.nodes[n as usize].holders;
        holders.iter().map(|h| h.last_used).max().unwrap_or(0)
    }
}

// === impl PrefixIndex: LRU keys ===

impl PrefixIndex {
    /// Removes `n`'s keys from the LRU sets (before its edge or holders change).
    pub(super) fn unlink(&mut self, n: u32) {
        for i in 0..self.nodes[n as usize].holders.len() {
            let h = self.nodes[n as usize].holders[i];
            let key = self.tail_key(n, h.last_used);
            let removed = self.backends[h.backend as usize].lru.remove(&key);
            debug_assert!(removed, "missing backend key {key:?}");
        }
        let key = self.tail_key(n, self.global_time(n));
        let removed = self.global_lru.remove(&key);
        debug_assert!(removed, "missing global key {key:?}");
    }

    /// Inserts `n`'s keys into the LRU sets (after its edge or holders changed).
    pub(super) fn link(&mut self, n: u32) {
        for i in 0..self.nodes[n as usize].holders.len() {
            let h = self.nodes[n as usize].holders[i];
            let key = self.tail_key(n, h.last_used);
            self.backends[h.backend as usize].lru.insert(key);
        }
        let key = self.tail_key(n, self.global_time(n));
        self.global_lru.insert(key);
    }
}

// === impl PrefixIndex: surgery ===

impl PrefixIndex {
    fn alloc(&mut self, node: Node) -> u32 {
        match self.free.pop() {
            Some(n) => {
                self.nodes[n as usize] = node;
                n
            }
            None => {
                let n = self.nodes.len() as u32;
                assert!(n < NIL, "prefix index arena full");
                self.nodes.push(node);
                n
            }
        }
    }

    /// Drops a node that has no holders and no children (its keys already unlinked)
    /// and detaches it from its parent.
    pub(super) fn free_node(&mut self, n: u32) {
        debug_assert!(n != ROOT);
        let node = std::mem::take(&mut self.nodes[n as usize]);
        debug_assert!(node.holders.is_empty() && node.children.is_empty());
        let siblings = &mut self.nodes[node.parent as usize].children;
        let i = siblings
            .binary_search_by_key(&node.edge[0], |&(h, _)| h)
            .expect("a live node is its parent's child");
        siblings.remove(i);
        self.total_blocks -= node.edge.len();
        self.nodes[n as usize].parent = NIL;
        self.free.push(n);
    }

    /// Hangs a new node for `blocks` held by `b` at `now` under `parent`.
    pub(super) fn add_leaf(&mut self, parent: u32, blocks: &[u64], b: u32, now: u64) -> u32 {
        let leaf = self.alloc(Node {
            edge: blocks.to_vec(),
            depth: self.end_depth(parent),
            parent,
            children: Vec::new(),
            holders: vec![Holder {
                backend: b,
                last_used: now,
            }],
        });
        let children = &mut self.nodes[parent as usize].children;
        let i = children
            .binary_search_by_key(&blocks[0], |&(h, _)| h)
            .expect_err("no child starts with this block");
        children.insert(i, (blocks[0], leaf));
        self.total_blocks += blocks.len();
        self.backends[b as usize].held += blocks.len();
        self.link(leaf);
        leaf
    }

    /// Depth just below `n`'s edge.
    pub(super) fn end_depth(&self, n: u32) -> u32 {
        let node = &self.nodes[n as usize];
        node.depth + node.edge.len() as u32
    }

    /// Cuts `n`'s edge after `at` blocks (`0 < at < len`): `n` keeps the upper part,
    /// the returned new node takes the lower part and `n`'s children. Both keep all
    /// of `n`'s holders.
    pub(super) fn split(&mut self, n: u32, at: usize) -> u32 {
        let node = &self.nodes[n as usize];
        debug_assert!(at > 0 && at < node.edge.len());
        self.unlink(n);
        let node = &mut self.nodes[n as usize];
        let lower_edge = node.edge.split_off(at);
        shrink_if_sparse(&mut node.edge);
        let lower = Node {
            edge: lower_edge,
            depth: node.depth + at as u32,
            parent: n,
            children: std::mem::take(&mut node.children),
            holders: node.holders.clone(),
        };
        let first = lower.edge[0];
        let lower = self.alloc(lower);
        for i in 0..self.nodes[lower as usize].children.len() {
            let c = self.nodes[lower as usize].children[i].1;
            self.nodes[c as usize].parent = lower;
        }
        self.nodes[n as usize].children.push((first, lower));
        self.link(n);
        self.link(lower);
        lower
    }

    /// `b` holds all of `n` as of `now` (the newer of that and what it had).
    pub(super) fn touch(&mut self, n: u32, b: u32, now: u64) {
        let i = self.nodes[n as usize]
            .holders
            .binary_search_by_key(&b, |h| h.backend);
        if let Ok(i) = i {
            if self.nodes[n as usize].holders[i].last_used >= now {
                return;
            }
        }
        self.unlink(n);
        let node = &mut self.nodes[n as usize];
        let len = node.edge.len();
        match i {
            Ok(i) => node.holders[i].last_used = now,
            Err(i) => {
                node.holders.insert(
                    i,
                    Holder {
                        backend: b,
                        last_used: now,
                    },
                );
                self.backends[b as usize].held += len;
            }
        }
        self.link(n);
    }

    /// Drops `b` from `n` (which must not be `b`'s only hold on a node with children
    /// held by `b`); frees `n` if no holder is left, else merges it with its only
    /// child if they now agree. Returns whether `n` survived.
    pub(super) fn drop_holder(&mut self, n: u32, b: u32) -> bool {
        self.unlink(n);
        let node = &mut self.nodes[n as usize];
        let i = node
            .holders
            .binary_search_by_key(&b, |h| h.backend)
            .expect("dropping a holder the node has");
        node.holders.remove(i);
        self.backends[b as usize].held -= node.edge.len();
        if node.holders.is_empty() {
            self.free_node(n);
            false
        } else {
            self.link(n);
            self.try_merge(n);
            true
        }
    }

    /// Merges `n` with its only child if both have the same holders at the same times.
    /// `n` keeps its id; the child's is freed.
    pub(super) fn try_merge(&mut self, n: u32) {
        if n == ROOT {
            return;
        }
        let node = &self.nodes[n as usize];
        let [(_, c)] = node.children[..] else {
            return;
        };
        if node.holders != self.nodes[c as usize].holders {
            return;
        }
        self.unlink(n);
        self.unlink(c);
        let child = std::mem::take(&mut self.nodes[c as usize]);
        self.nodes[c as usize].parent = NIL;
        self.free.push(c);
        for &(_, g) in &child.children {
            self.nodes[g as usize].parent = n;
        }
        let node = &mut self.nodes[n as usize];
        node.edge.extend_from_slice(&child.edge);
        node.children = child.children;
        self.link(n);
    }

    /// Cuts the last `k` blocks off leaf `n` for all its holders; frees it if nothing
    /// is left (then its parent may merge with a remaining only child).
    pub(super) fn trim_leaf(&mut self, n: u32, k: usize) {
        debug_assert!(self.nodes[n as usize].children.is_empty());
        self.unlink(n);
        let node = &mut self.nodes[n as usize];
        let len = node.edge.len();
        debug_assert!(k > 0 && k <= len);
        for h in &node.holders {
            self.backends[h.backend as usize].held -= k;
        }
        if k == len {
            let parent = node.parent;
            node.holders.clear();
            self.free_node(n);
            self.try_merge(parent);
        } else {
            node.edge.truncate(len - k);
            shrink_if_sparse(&mut node.edge);
            self.total_blocks -= k;
            self.link(n);
        }
    }
}

/// Gives back edge storage after a cut, so memory stays proportional to the blocks
/// stored (and so to `max_blocks`).
fn shrink_if_sparse(edge: &mut Vec<u64>) {
    if edge.capacity() > 2 * edge.len() + 8 {
        edge.shrink_to_fit();
    }
}
