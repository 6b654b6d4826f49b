//! A model of an engine's prefix cache: an LRU over the same chained block hashes the
//! router indexes, sized in blocks like vLLM's KV cache.
//!
//! It is the ground truth both simulators measure routing against: the gateway's
//! simulated engine (`radixgate engine-sim`) and `radixgate-bench sim`. A request's
//! cached prefix is the leading run of its blocks present (a block only counts if
//! every block before it does, as in vLLM's prefix caching); then all its blocks are
//! touched, last block first, so within one prompt the tail is evicted before the
//! head, as vLLM frees a sequence's blocks tail first. Not a routing decision, but
//! kept here, beside the index it is compared with, so both simulators share it.

use std::collections::{BTreeMap, HashMap};

/// LRU over block hashes, `capacity` blocks.
#[derive(Clone, Debug)]
pub struct EngineCache {
    capacity: usize,
    tick: u64,
    last_used: HashMap<u64, u64>,
    by_age: BTreeMap<u64, u64>,
}

impl EngineCache {
    pub fn new(capacity: usize) -> Self {
        EngineCache {
            capacity,
            tick: 0,
            last_used: HashMap::new(),
            by_age: BTreeMap::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.last_used.len()
    }

    pub fn is_empty(&self) -> bool {
        self.last_used.is_empty()
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Leading blocks of `blocks` resident.
    pub fn matched(&self, blocks: &[u64]) -> usize {
        blocks
            .iter()
            .take_while(|b| self.last_used.contains_key(b))
            .count()
    }

    /// Makes every block of `blocks` the most recently used, the first block most of
    /// all, then evicts the least recently used beyond capacity.
    pub fn touch(&mut self, blocks: &[u64]) {
        self.touch_evicting(blocks, &mut Vec::new());
    }

    /// [`touch`](Self::touch), appending the blocks it evicts to `evicted`.
    pub fn touch_evicting(&mut self, blocks: &[u64], evicted: &mut Vec<u64>) {
        for &b in blocks.iter().rev() {
            self.tick += 1;
            if let Some(old) = self.last_used.insert(b, self.tick) {
                self.by_age.remove(&old);
            }
            self.by_age.insert(self.tick, b);
        }
        while self.last_used.len() > self.capacity {
            let Some((_, victim)) = self.by_age.pop_first() else {
                break;
            };
            self.last_used.remove(&victim);
            evicted.push(victim);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_prefix_hits() {
        let mut c = EngineCache::new(3);
        c.touch(&[1, 2]);
        assert_eq!(c.matched(&[1, 2, 3]), 2);
        assert_eq!(c.matched(&[2, 1]), 2);
        assert_eq!(c.matched(&[9, 1]), 0);
        c.touch(&[3, 4]); // evicts 2, the tail of the oldest prompt
        assert_eq!(c.len(), 3);
        assert_eq!(
            c.matched(&[1, 2]),
            1,
            "the head of the evicted prompt survives"
        );
        assert_eq!(c.matched(&[3, 4]), 2);
    }
}
