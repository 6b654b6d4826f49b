//! Random: a uniform pick with the caller's seeded RNG, the baseline for benchmarks.

use super::{Pick, Reason, RouteInput, RoutingPolicy};

#[derive(Clone, Debug, Default)]
pub struct Random;

impl Random {
    pub fn new() -> Self {
        Self
    }
}

impl RoutingPolicy for Random {
    fn pick(&mut self, input: &RouteInput<'_>, rng: &mut fastrand::Rng) -> Option<Pick> {
        let candidates = input.candidates;
        if candidates.is_empty() {
            return None;
        }
        Some(Pick {
            backend: candidates[rng.usize(..candidates.len())].backend,
            reason: Reason::Random,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Candidate;

    #[test]
    fn stays_in_range_and_covers_all() {
        let cands: Vec<Candidate> = (10..15).map(|backend| Candidate::new(backend, 0)).collect();
        let input = RouteInput {
            candidates: &cands,
            affinity_key: None,
            prompt_blocks: 0,
            ..RouteInput::default()
        };
        let mut rng = fastrand::Rng::with_seed(1234);
        let mut seen = [0u32; 5];
        for _ in 0..500 {
            let pick = Random::new().pick(&input, &mut rng).unwrap();
            assert_eq!(pick.reason, Reason::Random);
            assert!((10..15).contains(&pick.backend));
            seen[pick.backend - 10] += 1;
        }
        // Fixed seed: deterministic, so this cannot flake.
        assert!(seen.iter().all(|&n| n > 0), "{seen:?}");
        let empty = RouteInput {
            candidates: &[],
            affinity_key: None,
            prompt_blocks: 0,
            ..RouteInput::default()
        };
        assert_eq!(Random::new().pick(&empty, &mut rng), None);
    }
}
