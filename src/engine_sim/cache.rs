//! The simulated engine's prefix cache: an LRU over chained prompt-block hashes,
//! sized in blocks like vLLM's KV cache.
//!
//! A prompt hits on its longest run of leading blocks that are all resident (as
//! vLLM's prefix caching does: a block only counts if every block before it does).

use std::collections::{BTreeMap, HashMap};

pub struct PrefixCache {
    capacity: usize,
    tick: u64,
    last_used: HashMap<u64, u64>,
    by_age: BTreeMap<u64, u64>,
}

impl PrefixCache {
    pub fn new(capacity: usize) -> Self {
        Self {
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

    /// Leading blocks of `blocks` already cached.
    pub fn matched(&self, blocks: &[u64]) -> usize {
        blocks
            .iter()
            .take_while(|b| self.last_used.contains_key(b))
            .count()
    }

    /// Marks every block as used now, inserting missing ones and evicting the least
    /// recently used beyond capacity. Blocks are touched last to first, so within one
    /// prompt the tail is older than the head and is evicted first (as vLLM frees a
    /// sequence's blocks tail first): a partly evicted prompt keeps a usable prefix.
    pub fn touch(&mut self, blocks: &[u64]) {
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
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_prefix_hits() {
        let mut c = PrefixCache::new(3);
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
