//! Pair selection for a split request, on the shard: the prefill and decode
//! candidates from the live fleet and this shard's index replica, handed to the
//! orchestrator's [`radixgate_orchestrator::disagg::decide`], and the index belief that
//! both ends of the pair now hold the prompt.

use super::super::route::{fill_candidates, insert_and_publish, Pool, Route};
use crate::config::DisaggConfig;
use crate::error::GatewayError;
use crate::shard::Shard;
use radixgate_orchestrator::disagg::decide;
use radixgate_orchestrator::{
    BreakerState, Candidate, DecodeCandidate, LocalWhy, MediaNeeds, PairDecision, PairInput, Pick,
    Reason,
};
use std::sync::Arc;

/// What to do with a split model's request.
pub(super) enum Choice {
    /// Prefill on `prefill.pick.backend`, decode on `decode.pick.backend`.
    Split {
        prefill: Route,
        decode: Route,
    },
    Local(LocalWhy),
}

/// Chooses the pair (or local serving) among the backends not excluded by earlier
/// failed attempts, and records the prompt's blocks for both ends of a pair.
pub(super) fn choose(
    shard: &Shard,
    blocks: &Arc<[u64]>,
    model: usize,
    media: &MediaNeeds,
    split: &DisaggConfig,
    excluded: &[usize],
) -> Result<Choice, GatewayError> {
    let now = std::time::Instant::now();
    fill_candidates(
        shard,
        now,
        blocks,
        model,
        media,
        None,
        excluded,
        Pool::Prefill,
    )?;
    let prefill: Vec<Candidate> = shard.candidates.borrow().clone();
    fill_candidates(
        shard,
        now,
        blocks,
        model,
        media,
        None,
        excluded,
        Pool::Decode,
    )?;
    let fleet = shard.fleet.borrow();
    let decode: Vec<DecodeCandidate> = shard
        .candidates
        .borrow()
        .iter()
        .map(|c| {
            let engine = fleet.engine[c.backend];
            DecodeCandidate {
                backend: c.backend,
                in_flight: c.in_flight,
                running: engine.map_or(0, |e| e.running),
                kv_usage: engine.map_or(0.0, |e| e.kv_usage),
                matched_blocks: c.matched_blocks,
            }
        })
        .collect();
    let input = PairInput {
        prefill: &prefill,
        decode: &decode,
        prompt_blocks: blocks.len() as u32,
    };
    let cost = &fleet.live.config.routing.prefix_aware;
    let (p, d, prefill_matched) = match decide(&split.policy, cost, &input) {
        PairDecision::Local(why) => return Ok(Choice::Local(why)),
        PairDecision::Split {
            prefill,
            decode,
            prefill_matched,
        } => (prefill, decode, prefill_matched),
    };
    let decode_matched = decode
        .iter()
        .find(|c| c.backend == d)
        .map_or(0, |c| c.matched_blocks);
    let now_ms = shard.shared.now_ms();
    let recorded = |backend: usize| {
        (!blocks.is_empty()).then(|| {
            insert_and_publish(shard, backend, blocks, now_ms);
            blocks.clone()
        })
    };
    let route = |backend: usize, matched: u32, alternatives: usize, prefill: Option<usize>| Route {
        pick: Pick {
            backend,
            reason: Reason::DisaggSplit,
        },
        matched_blocks: matched,
        // Not learned from: a leg's time is not a whole request's prefill.
        in_flight_before: u32::MAX,
        probe: fleet.breaker[backend] == BreakerState::HalfOpen,
        alternatives,
        blocks: recorded(backend),
        prefill,
        chunk_overlap: None,
        // Legs are not counted in the pending prefill (yet).
        uncached_tokens: 0,
    };
    Ok(Choice::Split {
        prefill: route(p, prefill_matched, prefill.len() - 1, None),
        decode: route(d, decode_matched, decode.len() - 1, Some(p)),
    })
}
