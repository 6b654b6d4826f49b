//! The index as a list of inserts that rebuild it: what a new cluster replica loads
//! from a peer to start warm.
//!
//! [`PrefixIndex::export`] walks the tree once and lists, per holder of each node,
//! the chain from the root to the node's end with that holder's `last_used`, oldest
//! first (ancestors before descendants at equal times). Applied in that order to an
//! index with the same capacities, the inserts rebuild the same held blocks with the
//! same times: a block's time is never older than its descendants', so its own insert
//! comes after theirs and sets it exactly. A holder whose time equals one of its
//! children's is covered by that child's chain and gets no entry of its own.

use super::{PrefixIndex, NIL, ROOT};
use crate::policy::BackendIdx;

/// One insert of an export.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Held {
    pub backend: BackendIdx,
    pub blocks: Vec<u64>,
    pub last_used: u64,
}

impl PrefixIndex {
    /// The inserts that rebuild this index, oldest first.
    pub fn export(&self) -> Vec<Held> {
        let mut out = Vec::new();
        let mut chain: Vec<u64> = Vec::new();
        // (node, chain length before its edge); children pushed after their parent.
        let mut stack: Vec<(u32, usize)> = self.nodes[ROOT as usize]
            .children
            .iter()
            .map(|&(_, c)| (c, 0))
            .collect();
        while let Some((n, above)) = stack.pop() {
            let node = &self.nodes[n as usize];
            debug_assert!(node.parent != NIL);
            chain.truncate(above);
            chain.extend_from_slice(&node.edge);
            for h in &node.holders {
                let covered = node.children.iter().any(|&(_, c)| {
                    self.holder(c, h.backend)
                        .is_some_and(|ch| ch.last_used == h.last_used)
                });
                if !covered {
                    out.push(Held {
                        backend: h.backend as BackendIdx,
                        blocks: chain.clone(),
                        last_used: h.last_used,
                    });
                }
            }
            let len = chain.len();
            stack.extend(node.children.iter().map(|&(_, c)| (c, len)));
        }
        out.sort_by(|a, b| {
            (a.last_used, a.blocks.len(), &a.blocks, a.backend).cmp(&(
                b.last_used,
                b.blocks.len(),
                &b.blocks,
                b.backend,
            ))
        });
        out
    }
}
