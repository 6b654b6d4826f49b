//! Retrieval-augmented requests: one canonical prefix per chunk set, and chunk
//! affinity.
//!
//! A RAG request names its retrieved chunks instead of pasting them into a prompt
//! (`rag: {system, chunks, query}`, parsed by the gateway). [`canonical_chunks`]
//! de-duplicates them and puts them in a fixed order (by [`chunk_id`]), and
//! [`render_context`] lays them out after the system text, so the same set of
//! chunks always makes the same prompt prefix whatever order the retriever returned
//! them in — the prefix index and the engine's cache then do the rest.
//!
//! Two requests that share *most* of their chunks still diverge at the first chunk
//! that differs. [`ChunkIndex`] remembers which backends were sent which chunk ids, and
//! [`ChunkIndex::pick`] scores each candidate by the request's chunks it holds against
//! its load (`overlap * chunk_weight - (in_flight + engine_waiting)`), so requests over
//! overlapping chunk sets meet on one engine until it is clearly busier than the rest.
//! It decides only where the routing policy found no cached prefix to follow
//! ([`with_chunk_affinity`]).

use std::collections::HashMap;

use xxhash_rust::xxh3::xxh3_64;

use crate::policy::{BackendIdx, Candidate, Pick, Reason};

/// A chunk's id: the xxh3 of its text.
pub fn chunk_id(text: &str) -> u64 {
    xxh3_64(text.as_bytes())
}

/// `chunks` de-duplicated (by id) and sorted by id, with their ids.
pub fn canonical_chunks<'a>(chunks: impl IntoIterator<Item = &'a str>) -> Vec<(u64, &'a str)> {
    let mut out: Vec<(u64, &str)> = chunks.into_iter().map(|c| (chunk_id(c), c)).collect();
    out.sort_unstable();
    out.dedup_by_key(|(id, _)| *id);
    out
}

/// The system message a RAG request becomes: its system text (if any), then each
/// chunk in canonical order, separated by blank lines.
pub fn render_context(system: Option<&str>, chunks: &[(u64, &str)]) -> String {
    let len = system.map_or(0, str::len) + chunks.iter().map(|(_, c)| c.len() + 2).sum::<usize>();
    let mut out = String::with_capacity(len + 2);
    if let Some(s) = system {
        out.push_str(s);
    }
    for (_, chunk) in chunks {
        if !out.is_empty() {
            out.push_str("\n\n");
        }
        out.push_str(chunk);
    }
    out
}

/// The final pick for a RAG request: the policy's own when it followed a cached
/// prefix (or a session), else the chunk index's when it has one. An engine's prefix
/// cache reuses only the leading run of identical blocks, so where the prefix index
/// knows a holder, that beats any chunk overlap; chunk affinity decides only what the
/// policy would have decided by load alone.
pub fn with_chunk_affinity(policy: Pick, chunk: Option<ChunkPick>) -> Pick {
    let followed_cache = matches!(
        policy.reason,
        Reason::LongestPrefix | Reason::SpilledFromSaturated | Reason::SessionAffinity
    );
    match chunk {
        Some(c) if !followed_cache => Pick {
            backend: c.backend,
            reason: Reason::ChunkAffinity,
        },
        _ => policy,
    }
}

/// Backends remembered per chunk (the most recent ones win a place).
const HOLDERS_PER_CHUNK: usize = 4;

/// Which backends were sent which chunks, bounded to `max_chunks` ids (the least
/// recently used half is dropped when full).
#[derive(Clone, Debug)]
pub struct ChunkIndex {
    holders: HashMap<u64, Holders>,
    max_chunks: usize,
}

#[derive(Clone, Debug, Default)]
struct Holders {
    /// `(backend, last sent at ms)`, at most [`HOLDERS_PER_CHUNK`].
    backends: Vec<(BackendIdx, u64)>,
    last_ms: u64,
}

/// What [`ChunkIndex::pick`] chose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkPick {
    pub backend: BackendIdx,
    /// The request's chunks the backend held.
    pub overlap: u32,
}

// === impl ChunkIndex ===

impl ChunkIndex {
    pub fn new(max_chunks: usize) -> Self {
        Self {
            holders: HashMap::new(),
            max_chunks: max_chunks.max(1),
        }
    }

    /// How many of `chunks` `backend` holds.
    pub fn overlap(&self, backend: BackendIdx, chunks: &[u64]) -> u32 {
        chunks
            .iter()
            .filter(|id| {
                self.holders
                    .get(id)
                    .is_some_and(|h| h.backends.iter().any(|(b, _)| *b == backend))
            })
            .count() as u32
    }

    /// The candidate with the best `overlap * chunk_weight - load`, ties to the less
    /// loaded, then the earlier candidate. `None` when that candidate holds none of
    /// `chunks` (nobody holds any, or the holders are too busy): the caller's policy
    /// decides then.
    pub fn pick(
        &self,
        candidates: &[Candidate],
        chunks: &[u64],
        chunk_weight: u32,
    ) -> Option<ChunkPick> {
        let mut best: Option<(i64, u32, ChunkPick)> = None;
        for c in candidates {
            let overlap = self.overlap(c.backend, chunks);
            let load = c.in_flight.saturating_add(c.engine_waiting);
            let score = i64::from(overlap) * i64::from(chunk_weight) - i64::from(load);
            let better = match &best {
                None => true,
                Some((s, l, _)) => score > *s || (score == *s && load < *l),
            };
            if better {
                best = Some((
                    score,
                    load,
                    ChunkPick {
                        backend: c.backend,
                        overlap,
                    },
                ));
            }
        }
        best.map(|(_, _, p)| p).filter(|p| p.overlap > 0)
    }

    /// `backend` was sent `chunks` at `now_ms`.
    pub fn insert(&mut self, backend: BackendIdx, chunks: &[u64], now_ms: u64) {
        if self.holders.len() + chunks.len() > self.max_chunks {
            self.shrink();
        }
        for id in chunks {
            let h = self.holders.entry(*id).or_default();
            h.last_ms = h.last_ms.max(now_ms);
            match h.backends.iter_mut().find(|(b, _)| *b == backend) {
                Some(entry) => entry.1 = entry.1.max(now_ms),
                None => {
                    if h.backends.len() >= HOLDERS_PER_CHUNK {
                        let oldest = (0..h.backends.len())
                            .min_by_key(|&i| h.backends[i].1)
                            .unwrap_or(0);
                        h.backends.swap_remove(oldest);
                    }
                    h.backends.push((backend, now_ms));
                }
            }
        }
    }

    /// Forgets everything `backend` held (it was removed or its cache cleared).
    pub fn remove_backend(&mut self, backend: BackendIdx) {
        self.holders.retain(|_, h| {
            h.backends.retain(|(b, _)| *b != backend);
            !h.backends.is_empty()
        });
    }

    /// Every holding, for a joining replica: `(backend, sent at ms, chunks)`, one
    /// entry per backend and time (the chunks one request sent there together),
    /// sorted. Inserting each entry into an empty index rebuilds this one.
    pub fn export(&self) -> Vec<(BackendIdx, u64, Vec<u64>)> {
        let mut groups: HashMap<(BackendIdx, u64), Vec<u64>> = HashMap::new();
        for (&chunk, h) in &self.holders {
            for &(backend, at) in &h.backends {
                groups.entry((backend, at)).or_default().push(chunk);
            }
        }
        let mut out: Vec<_> = groups
            .into_iter()
            .map(|((backend, at), mut chunks)| {
                chunks.sort_unstable();
                (backend, at, chunks)
            })
            .collect();
        out.sort_unstable();
        out
    }

    pub fn len(&self) -> usize {
        self.holders.len()
    }

    pub fn is_empty(&self) -> bool {
        self.holders.is_empty()
    }

    /// Drops the least recently used half.
    fn shrink(&mut self) {
        let mut ages: Vec<u64> = self.holders.values().map(|h| h.last_ms).collect();
        if ages.is_empty() {
            return;
        }
        let mid = ages.len() / 2;
        let (_, cutoff, _) = ages.select_nth_unstable(mid);
        let cutoff = *cutoff;
        self.holders.retain(|_, h| h.last_ms > cutoff);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_set_makes_the_same_context() {
        let a = canonical_chunks(["b", "a", "c", "a"]);
        let b = canonical_chunks(["c", "b", "a"]);
        assert_eq!(a, b);
        assert_eq!(a.len(), 3);
        assert_eq!(
            render_context(Some("sys"), &a),
            render_context(Some("sys"), &b)
        );
        let text = render_context(None, &canonical_chunks(["x"]));
        assert_eq!(text, "x");
        assert_eq!(render_context(Some("s"), &[]), "s");
    }

    #[test]
    fn overlap_wins_until_load_outweighs_it() {
        let mut index = ChunkIndex::new(100);
        let ids: Vec<u64> = (1..=5).collect();
        index.insert(1, &ids[..4], 10);
        index.insert(2, &ids[3..], 10);
        let idle = |b| Candidate::new(b, 0);
        let pick = index.pick(&[idle(0), idle(1), idle(2)], &ids, 2).unwrap();
        assert_eq!(
            pick,
            ChunkPick {
                backend: 1,
                overlap: 4
            }
        );
        // 4 chunks × 2 = 8 against idle backend 2's 2 × 2 = 4: backend 1 keeps the
        // request while it has fewer than 4 in flight...
        let busy = |n| [idle(0), Candidate::new(1, n), idle(2)];
        assert_eq!(index.pick(&busy(3), &ids, 2).unwrap().backend, 1);
        // ...then backend 2 beats it (a tie goes to the less loaded).
        assert_eq!(
            index.pick(&busy(4), &ids, 2).unwrap(),
            ChunkPick {
                backend: 2,
                overlap: 2
            }
        );
        // Holders too busy for their overlap: the caller's policy decides.
        let swamped = [idle(0), Candidate::new(1, 20), Candidate::new(2, 20)];
        assert_eq!(index.pick(&swamped, &ids, 2), None);
        assert_eq!(index.pick(&[idle(0)], &ids, 2), None);
        assert_eq!(index.pick(&[idle(1)], &[99], 2), None);
        index.remove_backend(1);
        assert_eq!(index.overlap(1, &ids), 0);
        assert_eq!(index.len(), 2);
    }

    #[test]
    fn a_followed_prefix_beats_chunk_overlap() {
        let chunk = Some(ChunkPick {
            backend: 2,
            overlap: 3,
        });
        let by = |reason| Pick { backend: 0, reason };
        for reason in [
            Reason::LongestPrefix,
            Reason::SpilledFromSaturated,
            Reason::SessionAffinity,
        ] {
            assert_eq!(with_chunk_affinity(by(reason), chunk), by(reason));
        }
        for reason in [Reason::NoMatch, Reason::FallbackLeastLoaded] {
            assert_eq!(
                with_chunk_affinity(by(reason), chunk),
                Pick {
                    backend: 2,
                    reason: Reason::ChunkAffinity
                }
            );
        }
        assert_eq!(
            with_chunk_affinity(by(Reason::NoMatch), None),
            by(Reason::NoMatch)
        );
    }

    #[test]
    fn an_export_rebuilds_the_holdings() {
        let mut index = ChunkIndex::new(1000);
        index.insert(0, &[1, 2, 3], 10);
        index.insert(1, &[2, 3, 4], 20);
        index.insert(0, &[3], 30);
        for b in 2..6 {
            // More holders than a chunk keeps: the oldest go.
            index.insert(b, &[9], 40 + b as u64);
        }
        let mut rebuilt = ChunkIndex::new(1000);
        for (backend, at, chunks) in index.export() {
            rebuilt.insert(backend, &chunks, at);
        }
        assert_eq!(rebuilt.export(), index.export());
        for backend in 0..6 {
            for query in [&[1, 2, 3][..], &[2, 3, 4], &[3], &[9], &[7]] {
                assert_eq!(
                    rebuilt.overlap(backend, query),
                    index.overlap(backend, query)
                );
            }
        }
        assert_eq!(rebuilt.len(), index.len());
    }

    #[test]
    fn stays_bounded_and_keeps_the_recent() {
        let mut index = ChunkIndex::new(10);
        for t in 0..100u64 {
            index.insert((t % 3) as usize, &[t], t);
        }
        assert!(index.len() <= 10, "{}", index.len());
        assert_eq!(index.overlap(0, &[99]), 1);
        let mut few = ChunkIndex::new(10);
        for b in 0..6 {
            few.insert(b, &[7], b as u64);
        }
        assert_eq!(few.overlap(0, &[7]) + few.overlap(1, &[7]), 0);
        assert_eq!(few.overlap(5, &[7]), 1);
    }
}
