//! What routing believes about where prompts live: one [`Replica`] (the prefix index,
//! session bindings and RAG chunk holdings) and the [`IndexOp`]s that change it.
//!
//! Every belief change is an [`IndexOp`], whoever makes it: a routing [`Decision`]
//! carries the ops it implies ([`crate::router`]), KV events and admin changes make
//! their own, and [`Replica::apply`] is the one place an op takes effect. The gateway
//! applies each op to its shard's replica, the coordinator's authoritative replica and
//! every other shard's; the simulators apply them to theirs. So a replica anywhere
//! reaches the same state from the same ops.
//!
//! [`Decision`]: crate::router::Decision

use crate::index::PrefixIndex;
use crate::policy::BackendIdx;
use crate::rag::ChunkIndex;
use std::collections::HashMap;
use std::sync::Arc;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IndexOp {
    /// `backend` now holds this whole chain of blocks.
    Insert {
        backend: BackendIdx,
        blocks: Arc<[u64]>,
        now_ms: u64,
    },
    /// `backend` no longer holds `blocks[from..]` (a failed attempt rolled back, or an
    /// engine eviction).
    Remove {
        backend: BackendIdx,
        blocks: Arc<[u64]>,
        from: usize,
    },
    /// The backend's capacity in the index: configured (which declares a new
    /// backend) or reported by the engine.
    SetCapacity { backend: BackendIdx, blocks: usize },
    /// The engine's cache was cleared, or its KV events had a gap: the backend
    /// holds nothing now (its capacity stays).
    Clear { backend: BackendIdx },
    /// The backend was removed: drop every block it held and undeclare it.
    RemoveBackend { backend: BackendIdx },
    /// `backend` was sent these RAG chunks (ids).
    HoldChunks {
        backend: BackendIdx,
        chunks: Arc<[u64]>,
        now_ms: u64,
    },
    /// The conversation `session` (hash of its `X-Session-ID`) lives on `backend`.
    BindSession {
        session: u64,
        backend: BackendIdx,
        now_ms: u64,
    },
}

/// One copy of routing's beliefs.
#[derive(Clone, Debug)]
pub struct Replica {
    pub index: PrefixIndex,
    pub sessions: SessionTable,
    /// Which backends were sent which RAG chunks.
    pub chunks: ChunkIndex,
}

// === impl Replica ===

impl Replica {
    pub fn new(index: PrefixIndex, sessions: SessionTable, chunks: ChunkIndex) -> Self {
        Self {
            index,
            sessions,
            chunks,
        }
    }

    /// The one place a belief change takes effect.
    pub fn apply(&mut self, op: &IndexOp) {
        match op {
            IndexOp::Insert {
                backend,
                blocks,
                now_ms,
            } => self.index.insert(*backend, blocks, *now_ms),
            IndexOp::Remove {
                backend,
                blocks,
                from,
            } => self.index.remove(*backend, blocks, *from),
            IndexOp::SetCapacity { backend, blocks } => self.index.set_capacity(*backend, *blocks),
            IndexOp::Clear { backend } => {
                let capacity = self.index.capacity(*backend);
                self.index.remove_backend(*backend);
                self.index.set_capacity(*backend, capacity);
                self.chunks.remove_backend(*backend);
            }
            IndexOp::RemoveBackend { backend } => {
                self.index.remove_backend(*backend);
                self.chunks.remove_backend(*backend);
            }
            IndexOp::HoldChunks {
                backend,
                chunks,
                now_ms,
            } => self.chunks.insert(*backend, chunks, *now_ms),
            IndexOp::BindSession {
                session,
                backend,
                now_ms,
            } => self.sessions.bind(*session, *backend, *now_ms),
        }
    }
}

/// Session → backend bindings with a time-to-live and a size bound.
#[derive(Clone, Debug)]
pub struct SessionTable {
    bindings: HashMap<u64, (BackendIdx, u64)>,
    ttl_ms: u64,
    max: usize,
}

// === impl SessionTable ===

impl SessionTable {
    pub fn new(ttl_ms: u64, max: usize) -> Self {
        Self {
            bindings: HashMap::new(),
            ttl_ms,
            max,
        }
    }

    pub fn get(&self, session: u64, now_ms: u64) -> Option<BackendIdx> {
        self.bindings
            .get(&session)
            .filter(|(_, seen)| now_ms.saturating_sub(*seen) <= self.ttl_ms)
            .map(|(b, _)| *b)
    }

    /// The session's backend and when it was last bound, expired or not.
    pub fn binding(&self, session: u64) -> Option<(BackendIdx, u64)> {
        self.bindings.get(&session).copied()
    }

    pub fn bind(&mut self, session: u64, backend: BackendIdx, now_ms: u64) {
        if self.bindings.len() >= self.max && !self.bindings.contains_key(&session) {
            // Drop expired bindings; if none expired, the oldest half.
            let ttl = self.ttl_ms;
            self.bindings
                .retain(|_, (_, seen)| now_ms.saturating_sub(*seen) <= ttl);
            if self.bindings.len() >= self.max {
                let mut ages: Vec<u64> = self.bindings.values().map(|(_, s)| *s).collect();
                ages.sort_unstable();
                let cutoff = ages[ages.len() / 2];
                self.bindings.retain(|_, (_, seen)| *seen > cutoff);
            }
        }
        let entry = self.bindings.entry(session).or_insert((backend, now_ms));
        entry.0 = backend;
        entry.1 = entry.1.max(now_ms);
    }

    /// Every binding as `(session, backend, last bound)`, expired or not, in session
    /// order (what a joining cluster replica loads).
    pub fn export(&self) -> Vec<(u64, BackendIdx, u64)> {
        let mut v: Vec<_> = self
            .bindings
            .iter()
            .map(|(&s, &(b, t))| (s, b, t))
            .collect();
        v.sort_unstable();
        v
    }

    pub fn len(&self) -> usize {
        self.bindings.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bindings.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::IndexConfig;

    #[test]
    fn sessions_expire_and_stay_bounded() {
        let mut t = SessionTable::new(100, 4);
        t.bind(1, 0, 0);
        assert_eq!(t.get(1, 50), Some(0));
        assert_eq!(t.get(1, 500), None);
        for s in 2..20 {
            t.bind(s, 1, s * 10);
        }
        assert!(t.len() <= 4);
        assert_eq!(t.get(19, 190), Some(1));
    }

    #[test]
    fn clear_keeps_the_capacity_and_drops_the_chunks() {
        let mut r = Replica::new(
            PrefixIndex::new(IndexConfig { max_blocks: 100 }),
            SessionTable::new(1000, 10),
            ChunkIndex::new(10),
        );
        r.apply(&IndexOp::SetCapacity {
            backend: 0,
            blocks: 50,
        });
        r.apply(&IndexOp::Insert {
            backend: 0,
            blocks: vec![1, 2, 3].into(),
            now_ms: 1,
        });
        r.apply(&IndexOp::HoldChunks {
            backend: 0,
            chunks: vec![9].into(),
            now_ms: 1,
        });
        r.apply(&IndexOp::Clear { backend: 0 });
        assert_eq!(r.index.held_blocks(0), 0);
        assert_eq!(r.index.capacity(0), 50);
        assert_eq!(r.chunks.overlap(0, &[9]), 0);
    }
}
