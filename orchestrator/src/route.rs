//! One routing decision end to end, the way the gateway makes it: look the prompt's
//! blocks up in the prefix index, fill in each candidate's matched blocks and session
//! flag, ask the policy, and record in the index that the pick now holds the prompt.
//!
//! The simulator (`radixgate-bench sim`) goes through [`route`]. The gateway
//! (`src/proxy/route.rs`) takes the same steps over its shard's replica — match, fill
//! the candidates, the same policy object, insert — with its own candidate filling
//! (health, breaker, drain, capabilities, pending prefill) and replication around them,
//! so both decide with the same policy code. Everything around the decision stays with the
//! caller: which backends are healthy and how loaded (the `fleet` it passes),
//! replicating the insert to other shards, binding the session, logging.

use crate::index::{PrefixIndex, PrefixMatch};
use crate::policy::{BackendIdx, Candidate, Pick, RouteInput, RoutingPolicy};

/// The request as routing sees it.
#[derive(Clone, Copy, Debug)]
pub struct RouteRequest<'a> {
    /// The prompt's chained block hashes ([`crate::PromptHasher::blocks`]).
    pub blocks: &'a [u64],
    /// [`crate::PromptHasher::affinity_key`].
    pub affinity_key: Option<u64>,
    /// The backend the request's session is bound to, if any.
    pub session_home: Option<BackendIdx>,
}

/// Buffers reused across decisions so that a decision does not allocate once warm.
#[derive(Clone, Debug, Default)]
pub struct RouteScratch {
    pub matches: PrefixMatch,
    pub candidates: Vec<Candidate>,
}

/// What [`route`] decided, with the belief it was based on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Routed {
    pub pick: Pick,
    /// Leading prompt blocks the pick held according to the index, before this request.
    pub matched_blocks: u32,
    /// The pick's in-flight count before this request.
    pub in_flight_before: u32,
    /// The longest match any candidate had.
    pub longest_match: u32,
}

/// Decides where `request` goes among `fleet` (the healthy candidates with their load;
/// their `matched_blocks` and `session_home` are overwritten from the index and
/// `request.session_home`), then inserts the prompt's blocks into `index` for the pick
/// at time `now` (a no-op for a prompt without a complete block). `None` when `fleet`
/// is empty.
pub fn route<P: RoutingPolicy + ?Sized>(
    policy: &mut P,
    index: &mut PrefixIndex,
    fleet: impl IntoIterator<Item = Candidate>,
    request: &RouteRequest<'_>,
    now: u64,
    rng: &mut fastrand::Rng,
    scratch: &mut RouteScratch,
) -> Option<Routed> {
    index.match_prefix(request.blocks, &mut scratch.matches);
    let matched = &scratch.matches.matched;
    scratch.candidates.clear();
    scratch
        .candidates
        .extend(fleet.into_iter().map(|c| Candidate {
            matched_blocks: matched.get(c.backend).copied().unwrap_or(0),
            session_home: request.session_home == Some(c.backend),
            cache_free_blocks: free_blocks(index, c.backend),
            ..c
        }));
    let input = RouteInput {
        candidates: &scratch.candidates,
        affinity_key: request.affinity_key,
        prompt_blocks: request.blocks.len() as u32,
    };
    let pick = policy.pick(&input, rng)?;
    let chosen = scratch
        .candidates
        .iter()
        .find(|c| c.backend == pick.backend)
        .copied()
        .unwrap_or_default();
    index.insert(pick.backend, request.blocks, now);
    Some(Routed {
        pick,
        matched_blocks: chosen.matched_blocks,
        in_flight_before: chosen.in_flight,
        longest_match: scratch.matches.longest,
    })
}

/// [`Candidate::cache_free_blocks`] from the index (saturated to `u32::MAX`).
pub fn free_blocks(index: &PrefixIndex, backend: BackendIdx) -> Option<u32> {
    index
        .free_blocks(backend)
        .map(|free| u32::try_from(free).unwrap_or(u32::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{build_policy, IndexConfig, PolicyConfig, PolicyName, Reason};

    #[test]
    fn routes_to_the_holder_and_records_the_insert() {
        let mut index = PrefixIndex::new(IndexConfig { max_blocks: 1000 });
        for b in 0..3 {
            index.set_capacity(b, 100);
        }
        let mut policy = build_policy(PolicyName::PrefixAware, &PolicyConfig::default());
        let mut rng = fastrand::Rng::with_seed(7);
        let mut scratch = RouteScratch::default();
        let blocks: Vec<u64> = (1..=20).collect();
        let request = RouteRequest {
            blocks: &blocks,
            affinity_key: Some(1),
            session_home: None,
        };
        let fleet = || (0..3).map(|b| Candidate::new(b, 0));
        let first = route(
            &mut policy,
            &mut index,
            fleet(),
            &request,
            1,
            &mut rng,
            &mut scratch,
        )
        .unwrap();
        assert_eq!(first.pick.reason, Reason::NoMatch);
        assert_eq!((first.matched_blocks, first.longest_match), (0, 0));
        assert_eq!(index.held_blocks(first.pick.backend), 20);

        let again = route(
            &mut policy,
            &mut index,
            fleet(),
            &request,
            2,
            &mut rng,
            &mut scratch,
        )
        .unwrap();
        assert_eq!(again.pick.backend, first.pick.backend);
        assert_eq!(again.pick.reason, Reason::LongestPrefix);
        assert_eq!(again.matched_blocks, 20);

        let home = (first.pick.backend + 1) % 3;
        let bound = route(
            &mut policy,
            &mut index,
            fleet(),
            &RouteRequest {
                session_home: Some(home),
                ..request
            },
            3,
            &mut rng,
            &mut scratch,
        )
        .unwrap();
        assert_eq!(
            bound.pick,
            Pick {
                backend: home,
                reason: Reason::SessionAffinity
            }
        );
        assert!(route(
            &mut policy,
            &mut index,
            std::iter::empty(),
            &request,
            4,
            &mut rng,
            &mut scratch
        )
        .is_none());
    }
}
