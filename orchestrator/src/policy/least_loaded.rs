//! Least loaded: the candidate with the fewest requests in flight fleet-wide.
//!
//! Ties are broken by a rotating cursor: the scan starts just after the previous
//! pick, so equally loaded backends take turns instead of the first one absorbing every
//! burst that arrives before in-flight counts catch up.

use super::{Candidate, Pick, Reason, RouteInput, RoutingPolicy};

#[derive(Clone, Debug, Default)]
pub struct LeastLoaded {
    cursor: usize,
}

impl LeastLoaded {
    pub fn new() -> Self {
        Self::default()
    }

    /// The least-loaded candidate, or `None` when there are none; advances the cursor.
    pub fn select(&mut self, candidates: &[Candidate]) -> Option<Candidate> {
        let n = candidates.len();
        if n == 0 {
            return None;
        }
        let start = self.cursor % n;
        let mut best = start;
        for step in 1..n {
            let i = (start + step) % n;
            if candidates[i].in_flight < candidates[best].in_flight {
                best = i;
            }
        }
        self.cursor = best + 1;
        Some(candidates[best])
    }
}

impl RoutingPolicy for LeastLoaded {
    fn pick(&mut self, input: &RouteInput<'_>, _rng: &mut fastrand::Rng) -> Option<Pick> {
        self.select(input.candidates).map(|c| Pick {
            backend: c.backend,
            reason: Reason::LeastLoaded,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cands(loads: &[u32]) -> Vec<Candidate> {
        loads
            .iter()
            .enumerate()
            .map(|(backend, &in_flight)| Candidate::new(backend, in_flight))
            .collect()
    }

    fn pick(ll: &mut LeastLoaded, c: &[Candidate]) -> usize {
        let input = RouteInput {
            candidates: c,
            affinity_key: None,
            prompt_blocks: 0,
            ..RouteInput::default()
        };
        let p = ll.pick(&input, &mut fastrand::Rng::with_seed(0)).unwrap();
        assert_eq!(p.reason, Reason::LeastLoaded);
        p.backend
    }

    #[test]
    fn picks_the_minimum() {
        let mut ll = LeastLoaded::new();
        for _ in 0..5 {
            assert_eq!(pick(&mut ll, &cands(&[5, 3, 9, 1, 4])), 3);
        }
        assert_eq!(ll.select(&[]), None);
    }

    #[test]
    fn rotates_among_ties() {
        let mut ll = LeastLoaded::new();
        let c = cands(&[2, 7, 2, 2, 9]);
        let picks: Vec<_> = (0..6).map(|_| pick(&mut ll, &c)).collect();
        assert_eq!(picks, [0, 2, 3, 0, 2, 3]);
    }

    #[test]
    fn spreads_a_burst_when_loads_are_counted() {
        let mut ll = LeastLoaded::new();
        let mut c = cands(&[0; 4]);
        for _ in 0..40 {
            let b = pick(&mut ll, &c);
            c[b].in_flight += 1;
        }
        assert!(c.iter().all(|c| c.in_flight == 10), "{c:?}");
    }
}
