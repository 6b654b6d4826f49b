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
    BreakerState, Candidate, Pick, PolicyName, RouteInput, RoutingPolicy,
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
    /// The pick is half-open: this attempt is one of the shard's bounded probes.
    pub probe: bool,
    /// Other candidates a retry could go to.
    pub alternatives: usize,
    /// The prompt's blocks, recorded in the index as now held by the pick.
    pub blocks: Option<Arc<[u64]>>,
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
/// healthy, undrained, whose breaker lets a request through (and not in `excluded`),
/// with their load and the leading `blocks` each holds per this shard's index replica.
pub(super) fn fill_candidates(
    shard: &Shard,
    blocks: &[u64],
    model: usize,
    session_home: Option<usize>,
    excluded: &[usize],
    pool: Pool,
) -> Result<(), GatewayError> {
    let shared = &shard.shared;
    shard.candidates.borrow_mut().clear();
    let mut matches = shard.matches.borrow_mut();
    shard.index.borrow().match_prefix(blocks, &mut matches);
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
        if fleet.healthy[b]
            && breaker_allows
            && !fleet.draining[b]
            && !excluded.contains(&b)
            && pool.admits(live.backends.config(b).role)
        {
            candidates.push(Candidate {
                backend: b,
                in_flight: shared.in_flight.total(b),
                matched_blocks: matches.matched.get(b).copied().unwrap_or(0),
                engine_waiting: fleet.engine_waiting(b),
                prefill_ns_per_token: prefill_ns[b],
                session_home: session_home == Some(b),
            });
        }
    }
    Ok(())
}

/// Looks the prompt (`blocks`) up in this shard's index replica, asks the policy,
/// and records the belief that the pick now holds the prompt (applied here at once,
/// replicated through the coordinator).
pub(super) fn route(
    shard: &Shard,
    blocks: &[u64],
    facts: &RequestFacts,
    policy: PolicyName,
    session: Option<u64>,
    excluded: &[usize],
) -> Result<Route, GatewayError> {
    let shared = &shard.shared;
    let now_ms = shared.now_ms();
    let session_home = session.and_then(|s| shard.sessions.borrow().get(s, now_ms));
    fill_candidates(
        shard,
        blocks,
        facts.model,
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
    let chosen = candidates
        .iter()
        .find(|c| c.backend == pick.backend)
        .copied()
        .unwrap_or_default();
    let recorded = (!blocks.is_empty()).then(|| {
        shard
            .index
            .borrow_mut()
            .insert(pick.backend, blocks, now_ms);
        let blocks: Arc<[u64]> = blocks.into();
        publish(
            shard,
            IndexOp::Insert {
                backend: pick.backend,
                blocks: blocks.clone(),
                now_ms,
            },
        );
        blocks
    });
    if let Some(session) = session {
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
    Ok(Route {
        pick,
        matched_blocks: chosen.matched_blocks,
        in_flight_before: chosen.in_flight,
        probe: fleet.breaker[pick.backend] == BreakerState::HalfOpen,
        alternatives: candidates.len() - 1,
        blocks: recorded,
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
