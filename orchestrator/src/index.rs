//! The prefix index: which backends hold which prompt prefixes in their engines' KV
//! caches.
//!
//! A request's prompt arrives as chained block hashes (see [`crate::PromptHasher`]):
//! block `i`'s hash depends on blocks `0..=i`, so one hash names a whole prefix. The
//! index is a path-compressed radix tree over those hashes, stored in an arena
//! (`Vec<Node>` with `u32` links and a free list; no `Rc`, no cycles). Each shard keeps
//! a replica for its routing policy ([`PrefixIndex::match_prefix`] is the hot path);
//! the coordinator keeps the authoritative copy and broadcasts the operations it
//! applies.
//!
//! # Model
//!
//! The observable state is, per declared backend, a set of blocks it holds, each with
//! a `last_used` time. Everything the index decides is a deterministic function of the
//! operations applied to it, never of node ids, allocation order or hashing seeds:
//!
//! - [`insert`](PrefixIndex::insert) touches every block of the chain
//!   (`last_used = max(last_used, now)`; the `max` makes touches commute, so replicas
//!   that see inserts in a different order still agree), then evicts the backend's
//!   least-recently-used blocks beyond its capacity, then the globally
//!   least-recently-used blocks beyond [`IndexConfig::max_blocks`] (from every holder).
//! - Eviction order is `(last_used, deepest first, smaller hash first)`; a block's
//!   global time is the newest `last_used` among its holders. A block is only ever
//!   touched together with its parent, so a child is never newer than its parent and,
//!   with deepest-first tie-breaking, always goes before it: **a backend that holds a
//!   block holds all of its ancestors** (checked by [`PrefixIndex::assert_invariants`]).
//! - [`remove`](PrefixIndex::remove) drops a block and all its descendants from one
//!   backend; nodes left without holders are pruned at once.
//!
//! Inserts commute, capacity evictions included, as long as the global bound does not
//! bite: the held set is then the top-`capacity` blocks by final key whatever the
//! order. Global evictions (memory pressure) depend on what other backends did first,
//! so replicas under global pressure may differ until their next updates.
//!
//! # Layout
//!
//! Every node is *uniform*: each of its holders holds the whole edge with one
//! `last_used`. Inserts that end inside an edge and evictions that cut one split the
//! node; a node whose only child has exactly the same holders and times is merged with
//! it. The tree is therefore canonical (its shape follows from the model state alone)
//! and a match visits one node per branch point or change of holders along its path.
//!
//! Eviction keeps one ordered key per (node, holder) in that backend's LRU set and one
//! per node in the global set, each naming the node's deepest block, which is the
//! node's least-recently-used block. Evicting pops the smallest key and cuts as many
//! tail blocks of that node as come before the next key, so it costs `O(log n)` per
//! node touched rather than per block.
//!
//! Hashes are positional in the tree: a hash that appears under two different parents
//! (which chained hashing rules out) is treated as two blocks.

use std::cmp::Reverse;
use std::collections::BTreeSet;

use crate::policy::BackendIdx;

mod arena;
mod check;
mod evict;
mod export;

pub use export::Held;
#[cfg(test)]
mod model;
#[cfg(test)]
mod tests;

/// How many of a backend's least recently used nodes [`PrefixIndex::room_blocks`]
/// looks at: a bound on a routing decision's cost, not on the answer's use (a cache
/// with more stale nodes than this is counted as holding only these many stale).
pub const STALE_WALK_NODES: usize = 64;

/// Sentinel for "no node" in parent links.
const NIL: u32 = u32::MAX;
/// The root: an empty edge, no holders, never freed.
const ROOT: u32 = 0;

#[derive(Clone, Debug)]
pub struct IndexConfig {
    /// Bound on the blocks stored across all nodes (the sum of edge lengths); beyond
    /// it the globally least-recently-used blocks are evicted from every holder.
    pub max_blocks: usize,
}

/// What [`PrefixIndex::match_prefix`] found. Reuse one across calls: once sized, a
/// lookup does not allocate.
#[derive(Clone, Debug, Default)]
pub struct PrefixMatch {
    /// Per backend slot (index = [`BackendIdx`]), the number of leading query blocks
    /// it holds. Its length is the number of backend slots ever declared (highest
    /// declared index + 1); undeclared slots read 0.
    pub matched: Vec<u32>,
    /// The largest entry of `matched`.
    pub longest: u32,
    /// The node holding the query's last block when the whole query is in the tree
    /// (for [`PrefixIndex::last_used_matched`]).
    chain_end: Option<u32>,
}

/// The radix tree of held prompt prefixes, with per-backend and global LRU bounds.
#[derive(Clone, Debug)]
pub struct PrefixIndex {
    config: IndexConfig,
    nodes: Vec<Node>,
    free: Vec<u32>,
    backends: Vec<BackendSlot>,
    /// One key per live non-root node, at its global (newest holder's) time.
    global_lru: BTreeSet<LruKey>,
    /// Sum of edge lengths over live nodes.
    total_blocks: usize,
    /// Reused by insert (the walked path) and removals (the subtree to drop).
    scratch: Vec<u32>,
}

#[derive(Clone, Debug, Default)]
struct Node {
    /// Block hashes along the edge into this node; empty only for the root and for
    /// free slots.
    edge: Vec<u64>,
    /// Depth of `edge[0]` in the chain (blocks above this edge).
    depth: u32,
    parent: u32,
    /// `(first block of the child's edge, child)`, sorted by hash.
    children: Vec<(u64, u32)>,
    /// Sorted by backend; every holder holds the whole edge.
    holders: Vec<Holder>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Holder {
    backend: u32,
    last_used: u64,
}

/// Eviction order of a node's deepest block: oldest first, then deepest, then the
/// smaller hash (unique for valid chains), then the node (never reached for valid
/// chains; keeps the order total).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct LruKey {
    last_used: u64,
    depth: Reverse<u32>,
    hash: u64,
    node: u32,
}

#[derive(Clone, Debug, Default)]
struct BackendSlot {
    declared: bool,
    capacity: usize,
    held: usize,
    /// One key per node this backend holds, at its `last_used`.
    lru: BTreeSet<LruKey>,
}

// === impl PrefixIndex ===

impl PrefixIndex {
    pub fn new(config: IndexConfig) -> Self {
        Self {
            config,
            nodes: vec![Node {
                parent: NIL,
                ..Node::default()
            }],
            free: Vec::new(),
            backends: Vec::new(),
            global_lru: BTreeSet::new(),
            total_blocks: 0,
            scratch: Vec::new(),
        }
    }

    pub fn config(&self) -> &IndexConfig {
        &self.config
    }

    /// Declares a backend (or changes its capacity, evicting its least-recently-used
    /// blocks if it is now over). Capacity in blocks mirrors the engine's KV cache.
    /// Backend indices are dense: declaring index `i` sizes match results to `i + 1`.
    pub fn set_capacity(&mut self, backend: BackendIdx, capacity_blocks: usize) {
        assert!(
            backend < NIL as usize,
            "backend index {backend} out of range"
        );
        if backend >= self.backends.len() {
            self.backends.resize_with(backend + 1, BackendSlot::default);
        }
        let slot = &mut self.backends[backend];
        slot.declared = true;
        slot.capacity = capacity_blocks;
        self.evict_backend(backend);
    }

    /// The backend now holds `blocks` (the whole chain) as of logical time `now`:
    /// touches the blocks it already holds, adds the rest (splitting edges as needed),
    /// then evicts beyond its capacity and beyond the global bound. An undeclared
    /// backend holds nothing (capacity 0), so inserting for it is a no-op.
    pub fn insert(&mut self, backend: BackendIdx, blocks: &[u64], now: u64) {
        let Some(slot) = self.backends.get(backend) else {
            return;
        };
        if !slot.declared || slot.capacity == 0 || blocks.is_empty() {
            return;
        }
        let b = backend as u32;
        let mut path = std::mem::take(&mut self.scratch);
        path.clear();
        let mut cur = ROOT;
        let mut i = 0;
        while i < blocks.len() {
            let Some(child) = self.child(cur, blocks[i]) else {
                let leaf = self.add_leaf(cur, &blocks[i..], b, now);
                path.push(leaf);
                break;
            };
            let edge = &self.nodes[child as usize].edge;
            let m = common_prefix(edge, &blocks[i..]);
            if m < edge.len() {
                let ends_here = i + m == blocks.len();
                if ends_here && self.holder(child, b).is_some_and(|h| h.last_used >= now) {
                    // Touching part of this edge would change nothing.
                    break;
                }
                self.split(child, m);
            }
            self.touch(child, b, now);
            path.push(child);
            cur = child;
            i += m;
        }
        // Only nodes on the path changed; merging bottom-up keeps the ids still to be
        // visited alive (a merge frees the child, never the node merged into).
        for &n in path.iter().rev() {
            self.try_merge(n);
        }
        self.scratch = path;
        self.evict_backend(backend);
        self.evict_global();
    }

    /// The backend no longer holds `blocks[from..]`: drops it from `blocks[from]` and
    /// every descendant (a block without its parent is useless to prefix caching) and
    /// prunes nodes left without holders. A no-op where it does not hold
    /// `blocks[from]` or `from` is past the end.
    pub fn remove(&mut self, backend: BackendIdx, blocks: &[u64], from: usize) {
        if from >= blocks.len() || backend >= self.backends.len() {
            return;
        }
        let b = backend as u32;
        let mut cur = ROOT;
        let mut i = 0;
        let (node, offset) = loop {
            let Some(child) = self.child(cur, blocks[i]) else {
                return;
            };
            let edge = &self.nodes[child as usize].edge;
            let m = common_prefix(edge, &blocks[i..]);
            if from < i + m {
                break (child, from - i);
            }
            if m < edge.len() {
                return;
            }
            cur = child;
            i += m;
        };
        if self.holder(node, b).is_none() {
            return;
        }
        let (parent, top) = if offset > 0 {
            (node, self.split(node, offset))
        } else {
            (cur, node)
        };
        self.drop_subtree(b, top);
        self.try_merge(parent);
    }

    /// Forgets a backend: drops it from every block and undeclares it (inserts for it
    /// are no-ops until [`set_capacity`](Self::set_capacity) declares it again).
    pub fn remove_backend(&mut self, backend: BackendIdx) {
        if backend >= self.backends.len() {
            return;
        }
        let b = backend as u32;
        while let Some(top) = self.first_held_child(ROOT, b) {
            self.drop_subtree(b, top);
        }
        let slot = &mut self.backends[backend];
        debug_assert!(slot.held == 0 && slot.lru.is_empty());
        slot.declared = false;
        slot.capacity = 0;
    }

    /// Per backend, the longest leading run of `blocks` it holds. Walks the query down
    /// the tree once: `O(blocks + holders on the path)`, no allocation once `out` is
    /// sized.
    pub fn match_prefix(&self, blocks: &[u64], out: &mut PrefixMatch) {
        out.matched.clear();
        out.matched.resize(self.backends.len(), 0);
        out.longest = 0;
        out.chain_end = None;
        let mut cur = ROOT;
        let mut i = 0;
        while i < blocks.len() {
            let Some(child) = self.child(cur, blocks[i]) else {
                break;
            };
            let node = &self.nodes[child as usize];
            let m = common_prefix(&node.edge, &blocks[i..]);
            let reached = (i + m) as u32;
            for h in &node.holders {
                out.matched[h.backend as usize] = reached;
            }
            // Every live node has a holder, so the deepest node reached sets the max.
            out.longest = reached;
            if reached as usize == blocks.len() {
                out.chain_end = Some(child);
            }
            if m < node.edge.len() {
                break;
            }
            cur = child;
            i += m;
        }
    }

    /// When `backend` last used the whole chain `blocks`: the `last_used` of its
    /// deepest block (never newer than its ancestors'), or `None` when it does not
    /// hold every block of the chain (or the chain is empty).
    pub fn last_used(&self, backend: BackendIdx, blocks: &[u64]) -> Option<u64> {
        let b = u32::try_from(backend).ok()?;
        let mut cur = ROOT;
        let mut i = 0;
        let mut deepest = None;
        while i < blocks.len() {
            let child = self.child(cur, blocks[i])?;
            let edge = &self.nodes[child as usize].edge;
            let m = common_prefix(edge, &blocks[i..]);
            if m < edge.len() && i + m < blocks.len() {
                return None; // the chain leaves the tree inside this edge
            }
            deepest = Some(child);
            cur = child;
            i += m;
        }
        // A holder holds the whole edge, and every ancestor of a block it holds.
        Some(self.holder(deepest?, b)?.last_used)
    }

    /// [`Self::last_used`] for the query that `m` is the unchanged index's
    /// [`Self::match_prefix`] of, without walking the tree again.
    pub fn last_used_matched(&self, m: &PrefixMatch, backend: BackendIdx) -> Option<u64> {
        let b = u32::try_from(backend).ok()?;
        Some(self.holder(m.chain_end?, b)?.last_used)
    }

    /// [`Self::touch_is_due`] for the query that `m` is the unchanged index's
    /// [`Self::match_prefix`] of, without walking the tree again.
    pub fn touch_is_due_matched(
        &self,
        m: &PrefixMatch,
        backend: BackendIdx,
        now: u64,
        resolution: u64,
    ) -> bool {
        self.last_used_matched(m, backend)
            .is_none_or(|t| self.touch_is_due_at(backend, t, now, resolution))
    }

    /// Whether inserting `blocks` for `backend` at `now` would change what the index
    /// decides by more than recency finer than `resolution`: false only when the
    /// backend already holds the whole chain, last used less than `resolution` ago,
    /// and not within `resolution` of the oldest block it holds while its cache is
    /// full. Skipping such an insert (everywhere: the gateway never sends it)
    /// refreshes a hot prefix's recency at most once per `resolution`, so LRU order
    /// among blocks used within one `resolution` of each other may differ from exact
    /// LRU; what is held and matched does not change until a full cache evicts.
    ///
    /// The exception is that eviction: a full backend evicts from its oldest blocks,
    /// and a prefix whose recorded use is that close to them could go before blocks
    /// used after its real last use. In the simulator's concurrency sweep (docs, 96
    /// and 192 requests in flight, seeds 1–4) coalescing without the exception cost
    /// 1.8 points of hit rate against refreshing every touch, and with it 0.3.
    /// `resolution = 0` makes every insert due.
    pub fn touch_is_due(
        &self,
        backend: BackendIdx,
        blocks: &[u64],
        now: u64,
        resolution: u64,
    ) -> bool {
        self.last_used(backend, blocks)
            .is_none_or(|t| self.touch_is_due_at(backend, t, now, resolution))
    }

    /// [`Self::touch_is_due`] for a whole chain the backend holds, last used at
    /// `last_used`.
    fn touch_is_due_at(
        &self,
        backend: BackendIdx,
        last_used: u64,
        now: u64,
        resolution: u64,
    ) -> bool {
        if now.saturating_sub(last_used) >= resolution {
            return true;
        }
        // Only a full cache evicts; a backend holding the chain has a slot.
        self.free_blocks(backend) == Some(0)
            && self.backends[backend]
                .lru
                .first()
                .is_some_and(|oldest| last_used.saturating_sub(oldest.last_used) < resolution)
    }

    pub fn total_blocks(&self) -> usize {
        self.total_blocks
    }

    pub fn held_blocks(&self, backend: BackendIdx) -> usize {
        self.backends.get(backend).map_or(0, |s| s.held)
    }

    /// Blocks `backend` can still take before its least-recently-used ones are evicted
    /// (`capacity - held`); `None` for an undeclared backend, which holds nothing.
    pub fn free_blocks(&self, backend: BackendIdx) -> Option<usize> {
        let slot = self.backends.get(backend).filter(|s| s.declared)?;
        Some(slot.capacity.saturating_sub(slot.held))
    }

    /// Blocks `backend` can take without evicting any it used at or after
    /// `stale_before`: its free room plus what it last used before then, counted over
    /// at most [`STALE_WALK_NODES`] of its least recently used nodes (so the cost is
    /// bounded however much is stale). `None` for an undeclared backend. With
    /// `stale_before = 0` nothing is stale: the free room alone.
    pub fn room_blocks(&self, backend: BackendIdx, stale_before: u64) -> Option<usize> {
        let slot = self.backends.get(backend).filter(|s| s.declared)?;
        let mut room = slot.capacity.saturating_sub(slot.held);
        // The common case on the request path: even the oldest block is in use.
        if slot
            .lru
            .first()
            .is_none_or(|oldest| oldest.last_used >= stale_before)
        {
            return Some(room);
        }
        for key in slot.lru.iter().take(STALE_WALK_NODES) {
            if key.last_used >= stale_before {
                break;
            }
            room += self.nodes[key.node as usize].edge.len();
        }
        Some(room.min(slot.capacity))
    }

    /// Live nodes, the root not counted.
    pub fn node_count(&self) -> usize {
        self.nodes.len() - self.free.len() - 1
    }

    /// The backend's capacity in blocks (0 when undeclared).
    pub fn capacity(&self, backend: BackendIdx) -> usize {
        self.backends.get(backend).map_or(0, |s| s.capacity)
    }

    /// Number of backend slots ([`PrefixMatch::matched`]'s length).
    pub fn backend_slots(&self) -> usize {
        self.backends.len()
    }
}

/// Length of the common prefix of an edge and the rest of a query.
#[inline]
fn common_prefix(edge: &[u64], query: &[u64]) -> usize {
    edge.iter()
        .zip(query)
        .position(|(a, b)| a != b)
        .unwrap_or(edge.len().min(query.len()))
}
