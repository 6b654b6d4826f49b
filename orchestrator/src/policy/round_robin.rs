//! Round robin: a per-shard cursor over the candidate slice.
//!
//! Each shard owns its own instance, so the fleet sees the shards' cycles interleaved;
//! when the candidate set changes the cursor simply continues modulo the new length.

use super::{Pick, Reason, RouteInput, RoutingPolicy};

#[derive(Clone, Debug, Default)]
pub struct RoundRobin {
    cursor: usize,
}

impl RoundRobin {
    pub fn new() -> Self {
        Self::default()
    }
}

impl RoutingPolicy for RoundRobin {
    fn pick(&mut self, input: &RouteInput<'_>, _rng: &mut fastrand::Rng) -> Option<Pick> {
        let candidates = input.candidates;
        if candidates.is_empty() {
            return None;
        }
        let chosen = &candidates[self.cursor % candidates.len()];
        self.cursor = self.cursor.wrapping_add(1);
        Some(Pick {
            backend: chosen.backend,
            reason: Reason::RoundRobin,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Candidate;

    #[test]
    fn cycles_through_candidates() {
        let cands: Vec<Candidate> = [4, 7, 9].map(|backend| Candidate::new(backend, 0)).to_vec();
        let input = RouteInput {
            candidates: &cands,
            affinity_key: Some(1),
            prompt_blocks: 0,
            ..RouteInput::default()
        };
        let mut rng = fastrand::Rng::with_seed(0);
        let mut rr = RoundRobin::new();
        let picks: Vec<_> = (0..7)
            .map(|_| rr.pick(&input, &mut rng).unwrap().backend)
            .collect();
        assert_eq!(picks, [4, 7, 9, 4, 7, 9, 4]);
        let empty = RouteInput {
            candidates: &[],
            affinity_key: None,
            prompt_blocks: 0,
            ..RouteInput::default()
        };
        assert_eq!(rr.pick(&empty, &mut rng), None);
    }
}
