//! A simulated engine: the ground truth the simulator measures routing against.
//!
//! Its KV cache is an LRU over the same chained block hashes the router indexes,
//! sized in blocks. A request's cached prefix is the leading run of its blocks present
//! when its prefill starts (a block only counts if every block before it does, as in
//! vLLM's prefix caching); then all its blocks are touched, last block first, so that
//! within one prompt the tail is evicted before the head (vLLM frees a finished
//! request's blocks in reverse order for the same reason, and the router's index
//! breaks equal times deepest-first too).
//!
//! Cost model: prefills run one at a time in arrival order (FIFO), each taking
//! `uncached tokens × prefill_ns_per_token`; time to first token is the wait plus the
//! request's own prefill. (`slots` > 1 runs that many prefills side by side, 0 any
//! number, which is how the gateway's own simulated engine behaves below its batch
//! limit.) Decoding then takes a fixed time, overlapped with other
//! requests (an unbounded decode batch), before the request completes.

pub use radixgate_orchestrator::EngineCache;
use std::collections::VecDeque;

// === impl Engine ===

/// A request waiting for or in prefill.
#[derive(Clone, Copy, Debug)]
pub struct Job {
    pub request: usize,
    pub arrived_ns: u64,
}

/// What starting a prefill found.
#[derive(Clone, Copy, Debug)]
pub struct Started {
    pub job: Job,
    pub cached_blocks: usize,
    /// When the prefill ends (the request's first token).
    pub done_ns: u64,
}

/// One engine: its cache and its FIFO prefill queue.
#[derive(Clone, Debug)]
pub struct Engine {
    pub cache: EngineCache,
    queue: VecDeque<Job>,
    /// Prefills running.
    busy: usize,
    /// Prefills that may run at once (0: unlimited).
    slots: usize,
}

impl Engine {
    pub fn new(capacity_blocks: usize, slots: usize) -> Self {
        Engine {
            cache: EngineCache::new(capacity_blocks),
            queue: VecDeque::new(),
            busy: 0,
            slots,
        }
    }

    /// Queues a job; returns it to start now if a prefill slot was free.
    pub fn arrive(&mut self, job: Job) -> Option<Job> {
        if self.slots == 0 || self.busy < self.slots {
            self.busy += 1;
            Some(job)
        } else {
            self.queue.push_back(job);
            None
        }
    }

    /// A running prefill ended; returns the next job to start, if any.
    pub fn prefill_done(&mut self) -> Option<Job> {
        let next = self.queue.pop_front();
        if next.is_none() {
            self.busy -= 1;
        }
        next
    }

    /// Requests waiting for the prefill slot (not counting the one in it).
    pub fn waiting(&self) -> usize {
        self.queue.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The obvious LRU: a list, most recent first.
    struct ListLru {
        capacity: usize,
        list: Vec<u64>,
    }

    impl ListLru {
        fn matched(&self, blocks: &[u64]) -> usize {
            blocks.iter().take_while(|b| self.list.contains(b)).count()
        }

        fn touch(&mut self, blocks: &[u64]) {
            for &b in blocks.iter().rev() {
                self.list.retain(|&x| x != b);
                self.list.insert(0, b);
            }
            self.list.truncate(self.capacity);
        }
    }

    #[test]
    fn lru_agrees_with_a_list_model() {
        for seed in 0..20u64 {
            let mut rng = fastrand::Rng::with_seed(seed);
            let capacity = rng.usize(1..40);
            let mut lru = EngineCache::new(capacity);
            let mut model = ListLru {
                capacity,
                list: Vec::new(),
            };
            // Prompts are chains over a small alphabet so they share prefixes.
            for _ in 0..400 {
                let len = rng.usize(0..12);
                let root = rng.u64(0..4);
                let blocks: Vec<u64> = (0..len).map(|i| root * 100 + i as u64).collect();
                let probe: Vec<u64> = (0..rng.usize(0..12)).map(|_| rng.u64(0..450)).collect();
                assert_eq!(lru.matched(&blocks), model.matched(&blocks));
                assert_eq!(lru.matched(&probe), model.matched(&probe));
                lru.touch(&blocks);
                model.touch(&blocks);
                assert_eq!(lru.len(), model.list.len());
            }
        }
    }

    #[test]
    fn tail_goes_before_head() {
        let mut c = EngineCache::new(4);
        c.touch(&[1, 2, 3]);
        c.touch(&[7, 8]);
        // Over by one: the oldest prompt's last block goes, its prefix stays.
        assert_eq!(c.matched(&[1, 2, 3]), 2);
        assert_eq!(c.matched(&[7, 8]), 2);
        assert!(!c.is_empty());
    }

    #[test]
    fn fifo_prefill_slot() {
        let mut e = Engine::new(10, 1);
        let job = |request| Job {
            request,
            arrived_ns: 0,
        };
        assert_eq!(e.arrive(job(0)).map(|j| j.request), Some(0));
        assert!(e.arrive(job(1)).is_none());
        assert!(e.arrive(job(2)).is_none());
        assert_eq!(e.waiting(), 2);
        assert_eq!(e.prefill_done().map(|j| j.request), Some(1));
        assert_eq!(e.prefill_done().map(|j| j.request), Some(2));
        assert!(e.prefill_done().is_none());
        assert_eq!(e.arrive(job(3)).map(|j| j.request), Some(3));

        let mut wide = Engine::new(10, 2);
        assert!(wide.arrive(job(0)).is_some() && wide.arrive(job(1)).is_some());
        assert!(wide.arrive(job(2)).is_none());
        assert_eq!(wide.prefill_done().map(|j| j.request), Some(2));
        assert!(wide.prefill_done().is_none() && wide.prefill_done().is_none());
        assert!(wide.arrive(job(3)).is_some() && wide.arrive(job(4)).is_some());
        let mut unlimited = Engine::new(10, 0);
        assert!((0..100).all(|i| unlimited.arrive(job(i)).is_some()));
    }
}
