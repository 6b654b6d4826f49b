//! The routing decision for one attempt: look the prompt up in this shard's index
//! replica, build the candidates (health, breaker, load, matches, session), ask the
//! policy, and record the belief that the pick now holds the prompt — applied here at
//! once and replicated through the coordinator, and rolled back if the attempt fails.

use crate::config::Role;
use crate::error::{ErrorKind, GatewayError};
use crate::http::request::RequestHead;
use crate::openai::RequestFacts;
use crate::replica::{IndexEvent, IndexOp};
use crate::shard::Shard;
use radixgate_orchestrator::{
    BreakerState, Candidate, MediaNeeds, Pick, PolicyName, RouteInput, RoutingPolicy,
};
use std::sync::Arc;

pub(super) fn policy_for(shard: &Shard, head: &RequestHead) -> Result<PolicyName, GatewayError> {
    let fleet = shard.fleet.borrow();
    let routing = &fleet.live.config.routing;
    if routing.allow_policy_header && !head.policy_override.is_empty() {
        return head
            .policy_override
            .parse()
            .map_err(|e: radixgate_orchestrator::UnknownPolicy| {
                GatewayError::invalid_param("X-Router-Policy", e.to_string())
            });
    }
    Ok(routing.policy)
}

/// A routing decision and the index belief recorded for it.
pub(super) struct Route {
    pub pick: Pick,
    /// Leading prompt blocks the chosen backend held, per this shard's replica.
    pub matched_blocks: u32,
    /// In-flight requests on the chosen backend before this one.
    pub in_flight_before: u32,
    /// Prompt tokens the pick is expected to prefill (its unmatched blocks), counted
    /// in its pending prefill until the first response byte.
    pub uncached_tokens: u32,
    /// The pick is half-open: this attempt is one of the shard's bounded probes.
    pub probe: bool,
    /// Other candidates a retry could go to.
    pub alternatives: usize,
    /// The prompt's blocks when they were inserted in the index as now held by the
    /// pick (what [`Route::roll_back`] undoes); `None` when nothing was inserted (no
    /// blocks, or the pick already held them all and the touch was coalesced).
    pub blocks: Option<Arc<[u64]>>,
    /// RAG requests: `(chunks the pick held before, distinct chunks in the request)`.
    pub chunk_overlap: Option<(u32, u32)>,
    /// A split request: the prefill backend (the pick is the decode backend).
    pub prefill: Option<usize>,
}

impl Route {
    /// The attempt failed before the engine could cache anything: forget the blocks
    /// the pick did not already hold, here and (via the coordinator) everywhere.
    pub fn roll_back(&self, shard: &Shard) {
        let Some(blocks) = &self.blocks else { return };
        let from = self.matched_blocks as usize;
        if from >= blocks.len() {
            return;
        }
        shard
            .index
            .borrow_mut()
            .remove(self.pick.backend, blocks, from);
        publish(
            shard,
            IndexOp::Remove {
                backend: self.pick.backend,
                blocks: blocks.clone(),
                from,
            },
        );
    }
}

/// Records that `backend` now holds the prompt `blocks` (of which this shard's
/// replica showed it holding `matched`): applied here and published to the
/// coordinator, unless the backend already holds all of them and last used them
/// less than `routing.index_touch_ms` ago. Then nothing changes but that recency,
/// so the insert is skipped here and never sent: every replica stays the same, and
/// a hot prompt costs the coordinator one event per interval instead of one per
/// request. Returns the blocks inserted (copied once, shared with the event), `None`
/// when skipped. `shard.matches` must hold this replica's match of `blocks` (from
/// [`fill_candidates`] in the same routing step), so the check needs no second walk.
fn record_insert(
    shard: &Shard,
    backend: usize,
    blocks: &[u64],
    matched: u32,
    now_ms: u64,
    touch_ms: u64,
) -> Option<Arc<[u64]>> {
    if matched as usize == blocks.len() {
        let index = shard.index.borrow();
        let due = index.touch_is_due_matched(&shard.matches.borrow(), backend, now_ms, touch_ms);
        if !due {
            shard.metrics.borrow_mut().index_touches_coalesced += 1;
            return None;
        }
    }
    let blocks: Arc<[u64]> = blocks.into();
    insert_and_publish(shard, backend, &blocks, now_ms);
    Some(blocks)
}

/// Records in this shard's replica that `backend` now holds `blocks` (at `now_ms`) and
/// sends the insert to the coordinator for the other replicas.
pub(super) fn insert_and_publish(shard: &Shard, backend: usize, blocks: &Arc<[u64]>, now_ms: u64) {
    shard.index.borrow_mut().insert(backend, blocks, now_ms);
    publish(
        shard,
        IndexOp::Insert {
            backend,
            blocks: blocks.clone(),
            now_ms,
        },
    );
}

pub(super) fn publish(shard: &Shard, op: IndexOp) {
    shard.metrics.borrow_mut().index_events_published += 1;
    let _ = shard.shared.index_events.send(IndexEvent {
        origin_shard: shard.id,
        created: std::time::Instant::now(),
        op,
    });
}

/// Which of a model's backends a candidate list is for.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Pool {
    /// Whole requests: every role but `prefill`.
    Whole,
    /// A split request's prefill leg.
    Prefill,
    /// A split request's decode leg.
    Decode,
}

impl Pool {
    fn admits(self, role: Role) -> bool {
        match self {
            Pool::Whole => role != Role::Prefill,
            Pool::Prefill => role == Role::Prefill,
            Pool::Decode => role == Role::Decode,
        }
    }
}

/// Fills the shard's candidate scratch for `model`: the backends of `pool` that are
/// healthy, undrained, whose breaker lets a request through, that accept the
/// request's `media` (and not in `excluded`), with their load and the leading `blocks`
/// each holds per this shard's index replica, as of `now`. 415 when no backend of the
/// model accepts the media.
#[allow(clippy::too_many_arguments)]
pub(super) fn fill_candidates(
    shard: &Shard,
    now: std::time::Instant,
    blocks: &[u64],
    model: usize,
    media: &MediaNeeds,
    session_home: Option<usize>,
    excluded: &[usize],
    pool: Pool,
) -> Result<(), GatewayError> {
    let shared = &shard.shared;
    shard.candidates.borrow_mut().clear();
    let mut matches = shard.matches.borrow_mut();
    let index = shard.index.borrow();
    index.match_prefix(blocks, &mut matches);
    let fleet = shard.fleet.borrow();
    let live = &*fleet.live;
    let serving = live.backends.serving(model);
    if serving.is_empty() {
        // Its last backend was removed since the model was first seen.
        let model = live.backends.models().name(model);
        return Err(GatewayError {
            kind: ErrorKind::ModelNotFound,
            message: format!("The model `{model}` does not exist."),
            param: Some("model".into()),
        });
    }
    let needs = media.kinds;
    if !needs.is_empty()
        && !serving
            .iter()
            .any(|&b| live.backends.config(b).capabilities.covers(needs))
    {
        return Err(unsupported_media(live.backends.models().name(model), needs));
    }
    let prefill_ns = shard.prefill_ns.borrow();
    let probes = shard.probes.borrow();
    let probe_limit = live.config.breaker.half_open_probes;
    let mut candidates = shard.candidates.borrow_mut();
    candidates.clear();
    for &b in serving {
        let breaker_allows = match fleet.breaker[b] {
            BreakerState::Closed => true,
            BreakerState::Open => false,
            BreakerState::HalfOpen => probes[b] < probe_limit,
        };
        let capable = live.backends.config(b).capabilities.covers(needs);
        if capable
            && fleet.healthy[b]
            && breaker_allows
            && !fleet.draining[b]
            && !excluded.contains(&b)
            && pool.admits(live.backends.config(b).role)
        {
            let matched_blocks = matches.matched.get(b).copied().unwrap_or(0);
            candidates.push(Candidate {
                backend: b,
                in_flight: shared.in_flight.total(b),
                matched_blocks,
                engine_waiting: fleet.engine_waiting(b),
                pending_prefill_tokens: shared.pending_prefill.tokens(b),
                prefill_progress_ns: shared.pending_prefill.progress_ns(b, now),
                prefill_ns_per_token: prefill_ns[b],
                session_home: session_home == Some(b),
                uncached_media_tokens: media.uncached_tokens(matched_blocks),
                cache_free_blocks: radixgate_orchestrator::route::free_blocks(&index, b),
            });
        }
    }
    Ok(())
}

/// 415: the request carries media that no backend of its model accepts.
fn unsupported_media(model: &str, needs: radixgate_orchestrator::Capabilities) -> GatewayError {
    GatewayError {
        kind: ErrorKind::UnsupportedMedia,
        message: format!(
            "The request carries {needs} content, which no backend serving model `{model}` accepts."
        ),
        param: Some("messages".into()),
    }
}

/// Looks the prompt (`blocks`) up in this shard's index replica, asks the chunk index
/// (a RAG request's `chunks`, under `prefix_aware`) or else the policy, and records
/// the belief that the pick now holds the prompt and the chunks (applied here at
/// once, replicated through the coordinator).
pub(super) fn route(
    shard: &Shard,
    blocks: &[u64],
    facts: &RequestFacts,
    policy: PolicyName,
    session: Option<u64>,
    chunks: &[u64],
    excluded: &[usize],
) -> Result<Route, GatewayError> {
    let shared = &shard.shared;
    // One clock reading for the index's clock and the candidates' prefill progress.
    let now = std::time::Instant::now();
    let now_ms = shared.ms_at(now);
    let session_home = session.and_then(|s| shard.sessions.borrow().get(s, now_ms));
    fill_candidates(
        shard,
        now,
        blocks,
        facts.model,
        &facts.media,
        session_home,
        excluded,
        Pool::Whole,
    )?;
    let fleet = shard.fleet.borrow();
    let live = &*fleet.live;
    let candidates = shard.candidates.borrow();
    let no_backend = || {
        GatewayError::new(
            ErrorKind::NoHealthyBackend,
            format!(
                "no healthy backend serves model `{}`",
                live.backends.models().name(facts.model)
            ),
        )
    };
    if candidates.is_empty() {
        return Err(no_backend());
    }
    let input = RouteInput {
        candidates: &candidates,
        affinity_key: facts.affinity_key,
        prompt_blocks: blocks.len() as u32,
    };
    let pick = shard
        .policies
        .borrow_mut()
        .get(policy, &live.policy)
        .pick(&input, &mut shard.rng.borrow_mut())
        .ok_or_else(no_backend)?;
    // Chunk affinity: a RAG request under the cache-aware policy that found no cached
    // prefix to follow goes where most of its chunks were sent, unless load outweighs
    // them.
    let pick = if policy == PolicyName::PrefixAware && !chunks.is_empty() {
        let chunk_pick =
            shard
                .chunks
                .borrow()
                .pick(&candidates, chunks, live.config.routing.rag_chunk_weight);
        radixgate_orchestrator::rag::with_chunk_affinity(pick, chunk_pick)
    } else {
        pick
    };
    let chunk_overlap = (!chunks.is_empty()).then(|| {
        let overlap = shard.chunks.borrow().overlap(pick.backend, chunks);
        shard
            .chunks
            .borrow_mut()
            .insert(pick.backend, chunks, now_ms);
        publish(
            shard,
            IndexOp::HoldChunks {
                backend: pick.backend,
                chunks: chunks.into(),
                now_ms,
            },
        );
        (overlap, chunks.len() as u32)
    });
    let chosen = candidates
        .iter()
        .find(|c| c.backend == pick.backend)
        .copied()
        .unwrap_or_default();
    let recorded = if blocks.is_empty() {
        None
    } else {
        let touch_ms = live.config.routing.index_touch_ms;
        record_insert(
            shard,
            pick.backend,
            blocks,
            chosen.matched_blocks,
            now_ms,
            touch_ms,
        )
    };
    if let Some(session) = session {
        // Like a prompt already held: a session already bound here, seen less than
        // `index_touch_ms` ago, would only have its time-to-live refreshed.
        let touch_ms = live.config.routing.index_touch_ms;
        let fresh = shard
            .sessions
            .borrow()
            .binding(session)
            .is_some_and(|(b, seen)| b == pick.backend && now_ms.saturating_sub(seen) < touch_ms);
        if fresh {
            shard.metrics.borrow_mut().index_touches_coalesced += 1;
        } else {
            shard
                .sessions
                .borrow_mut()
                .bind(session, pick.backend, now_ms);
            publish(
                shard,
                IndexOp::BindSession {
                    session,
                    backend: pick.backend,
                    now_ms,
                },
            );
        }
    }
    let tokens_per_block = live.config.routing.prefix_aware.tokens_per_block.max(0.0);
    let uncached_blocks = blocks.len().saturating_sub(chosen.matched_blocks as usize);
    Ok(Route {
        pick,
        matched_blocks: chosen.matched_blocks,
        in_flight_before: chosen.in_flight,
        uncached_tokens: (uncached_blocks as f64 * tokens_per_block).min(u32::MAX as f64) as u32,
        probe: fleet.breaker[pick.backend] == BreakerState::HalfOpen,
        alternatives: candidates.len() - 1,
        blocks: recorded,
        chunk_overlap,
        prefill: None,
    })
}

/// Holds one of the shard's half-open probe slots for a backend while an attempt runs.
pub(super) struct ProbeGuard<'s> {
    shard: &'s Shard,
    backend: usize,
}

impl<'s> ProbeGuard<'s> {
    pub fn enter(shard: &'s Shard, route: &Route) -> Option<Self> {
        route.probe.then(|| {
            shard.probes.borrow_mut()[route.pick.backend] += 1;
            ProbeGuard {
                shard,
                backend: route.pick.backend,
            }
        })
    }
}

impl Drop for ProbeGuard<'_> {
    fn drop(&mut self) {
        let mut probes = self.shard.probes.borrow_mut();
        probes[self.backend] = probes[self.backend].saturating_sub(1);
    }
}
