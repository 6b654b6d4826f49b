//! Pair selection for a split request, on the shard: the router's
//! [`decide_pair`](radixgate_orchestrator::Router::decide_pair) over this shard's
//! replica and fleet view, and its decisions (both ends of the pair now hold the
//! prompt) applied here and published.

use super::super::route::{apply, route_error, with_fleet};
use crate::config::DisaggConfig;
use crate::error::GatewayError;
use crate::openai::RequestFacts;
use crate::shard::Shard;
use radixgate_orchestrator::{PairOutcome, PolicyName, RoutingFacts};

/// Chooses the pair (or local serving) among the backends not excluded by earlier
/// failed attempts, and records the prompt's blocks for both ends of a pair.
pub(super) fn choose(
    shard: &Shard,
    blocks: &[u64],
    request: &RequestFacts,
    split: &DisaggConfig,
    excluded: &[usize],
) -> Result<PairOutcome, GatewayError> {
    let facts = RoutingFacts {
        model: request.model,
        adapter: request.adapter,
        policy: PolicyName::PrefixAware,
        blocks,
        affinity_key: None,
        media: &request.media,
        session: None,
        chunks: &[],
        excluded,
    };
    let now = std::time::Instant::now();
    let now_ms = shard.shared.ms_at(now);
    let mut outcome = with_fleet(shard, now, |fleet| {
        shard.router.borrow_mut().decide_pair(
            &shard.replica.borrow(),
            fleet,
            &facts,
            &split.policy,
            now_ms,
        )
    })
    .map_err(|e| route_error(shard, &facts, e))?;
    if let PairOutcome::Split { prefill, decode } = &mut outcome {
        apply(shard, prefill);
        apply(shard, decode);
    }
    Ok(outcome)
}
