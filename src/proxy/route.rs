//! The gateway's side of a routing decision: turn a parsed request into the
//! orchestrator's [`RoutingFacts`], show the [`Router`](radixgate_orchestrator::Router)
//! this shard's view of the fleet ([`ShardFleet`]), and apply the [`Decision`] it
//! returns: its index ops go into this shard's replica at once and to the coordinator
//! for every other replica, and are rolled back the same way if the attempt fails.
//! The decision itself is made in the orchestrator, as in the simulators.

use crate::error::{ErrorKind, GatewayError};
use crate::fleet::{FleetSnapshot, InFlight};
use crate::http::request::RequestHead;
use crate::openai::RequestFacts;
use crate::pending_prefill::PendingPrefill;
use crate::replica::{IndexEvent, IndexOp, Origin};
use crate::shard::{PerBackend, Shard};
use radixgate_orchestrator::{
    AdapterIdx, BackendIdx, BackendState, BreakerState, Decision, FleetView, ModelIdx, PolicyName,
    RouteError, RoutingFacts,
};
use std::time::Instant;

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

/// The fleet as this shard sees it at one instant: the coordinator's snapshot
/// (health, breaker, drain, engine load, the backend table), the cross-shard
/// in-flight and pending-prefill counters, and the shard's own learned costs and
/// half-open probes ([`PerBackend`]).
pub struct ShardFleet<'a> {
    pub snapshot: &'a FleetSnapshot,
    pub in_flight: &'a InFlight,
    pub pending_prefill: &'a PendingPrefill,
    pub per_backend: &'a [PerBackend],
    pub now: Instant,
}

impl FleetView for ShardFleet<'_> {
    fn serving(&self, model: ModelIdx) -> &[BackendIdx] {
        self.snapshot.live.backends.serving(model)
    }

    fn breaker(&self, b: BackendIdx) -> BreakerState {
        self.snapshot.breaker[b]
    }

    fn serves_adapter(&self, b: BackendIdx, adapter: AdapterIdx) -> bool {
        self.snapshot.adapters.serves(b, adapter)
    }

    fn compute_peers(&self, b: BackendIdx) -> &[BackendIdx] {
        self.snapshot.live.backends.compute_peers(b)
    }

    fn backend(&self, b: BackendIdx) -> BackendState {
        let snapshot = self.snapshot;
        let config = snapshot.live.backends.config(b);
        let engine = snapshot.engine[b];
        let local = self.per_backend.get(b).copied().unwrap_or_default();
        let fixed_delay = snapshot
            .live
            .config
            .routing
            .prefix_aware
            .learned_fixed_delay;
        let (prefill_ns_per_token, prefill_fixed_ns) = local.learned.prefill_cost(fixed_delay);
        let (in_flight, in_flight_blocks) = self.in_flight.counts(b);
        BackendState {
            role: config.role,
            capabilities: config.capabilities,
            healthy: snapshot.healthy[b],
            breaker: snapshot.breaker[b],
            draining: snapshot.draining[b],
            probes_in_flight: local.probes,
            in_flight,
            in_flight_blocks,
            engine_waiting: engine.map_or(0, |e| e.waiting),
            engine_running: engine.map_or(0, |e| e.running),
            engine_kv_usage: engine.map_or(0.0, |e| e.kv_usage),
            pending_prefill_tokens: self.pending_prefill.tokens(b),
            prefill_progress_ns: self.pending_prefill.progress_ns(b, self.now),
            prefill_ns_per_token,
            prefill_fixed_ns,
            queue_ns_per_request: local.learned.queue_ns_per_request,
        }
    }
}

/// Runs `f` with this shard's fleet view as of `now`.
pub(super) fn with_fleet<T>(
    shard: &Shard,
    now: Instant,
    f: impl FnOnce(&ShardFleet<'_>) -> T,
) -> T {
    let snapshot = shard.fleet.borrow();
    let per_backend = shard.per_backend.borrow();
    f(&ShardFleet {
        snapshot: &snapshot,
        in_flight: &shard.shared.in_flight,
        pending_prefill: &shard.shared.pending_prefill,
        per_backend: &per_backend,
        now,
    })
}

/// The routing facts of a request to `facts.model` with prompt `blocks`.
pub(super) fn routing_facts<'a>(
    facts: &'a RequestFacts,
    policy: PolicyName,
    blocks: &'a [u64],
    session: Option<u64>,
    chunks: &'a [u64],
    excluded: &'a [usize],
) -> RoutingFacts<'a> {
    RoutingFacts {
        model: facts.model,
        adapter: facts.adapter,
        policy,
        blocks,
        affinity_key: facts.affinity_key,
        media: &facts.media,
        session,
        chunks,
        excluded,
    }
}

/// Asks the router where the request goes, then applies the decision's ops to this
/// shard's replica and publishes them to the coordinator.
pub(super) fn route(shard: &Shard, facts: &RoutingFacts<'_>) -> Result<Decision, GatewayError> {
    route_at(shard, facts, Instant::now())
}

/// [`route`] at `now`, a clock reading the caller already has (one reading for the
/// index's clock and the candidates' prefill progress).
pub(super) fn route_at(
    shard: &Shard,
    facts: &RoutingFacts<'_>,
    now: Instant,
) -> Result<Decision, GatewayError> {
    let now_ms = shard.shared.ms_at(now);
    let decided = with_fleet(shard, now, |fleet| {
        shard
            .router
            .borrow_mut()
            .decide(&shard.replica.borrow(), fleet, facts, now_ms)
    });
    let mut decision = decided.map_err(|e| route_error(shard, facts, e))?;
    if tracing::enabled!(target: "radixgate::decision", tracing::Level::DEBUG) {
        explain(shard, facts, &decision);
    }
    apply(shard, &mut decision);
    Ok(decision)
}

/// Logs the decision and every candidate as the cost model weighed it (debug level,
/// target `radixgate::decision`): what to read when a pick looks wrong. Off by
/// default; the check above is all it costs then.
fn explain(shard: &Shard, facts: &RoutingFacts<'_>, decision: &Decision) {
    use std::fmt::Write;
    let ms = |ns: f64| ns / 1e6;
    let mut candidates = String::new();
    for e in shard
        .router
        .borrow()
        .explain_last(facts.blocks.len() as u32)
    {
        let _ = write!(
            candidates,
            "{}: matched={} kept={} busy={} in_flight={} est_ms={:.0} wait_ms={:.0} \
             eviction_ms={:.0} crowding_ms={:.0} placed={} room={}; ",
            shard.backend_id(e.backend),
            e.matched_blocks,
            e.kept_blocks,
            e.busy_blocks.map_or(-1, i64::from),
            e.in_flight,
            ms(e.est_ttft_ns),
            ms(e.shared_wait_ns),
            ms(e.eviction_ns),
            ms(e.crowding_ns),
            e.placed_on_hardware,
            e.free_room,
        );
    }
    tracing::debug!(
        target: "radixgate::decision",
        backend = %shard.backend_id(decision.pick.backend),
        reason = decision.pick.reason.as_str(),
        prompt_blocks = facts.blocks.len(),
        candidates = %candidates,
        "routed"
    );
}

/// Applies a decision's ops here and publishes them.
pub(super) fn apply(shard: &Shard, decision: &mut Decision) {
    if decision.coalesced > 0 {
        shard.metrics.borrow_mut().index_touches_coalesced += u64::from(decision.coalesced);
    }
    for op in decision.ops.take() {
        shard.replica.borrow_mut().apply(&op);
        publish(shard, op);
    }
}

/// The attempt failed before the engine could cache anything: forget the blocks the
/// pick did not already hold, here and (via the coordinator) everywhere.
pub(super) fn roll_back(shard: &Shard, decision: &Decision) {
    if let Some(op) = decision.roll_back() {
        shard.replica.borrow_mut().apply(&op);
        publish(shard, op);
    }
}

pub(super) fn publish(shard: &Shard, op: IndexOp) {
    shard.metrics.borrow_mut().index_events_published += 1;
    let _ = shard.shared.index_events.send(IndexEvent {
        origin: Origin::Shard(shard.id),
        created: Instant::now(),
        op,
    });
}

/// The client-facing error for a request the router could not place.
pub(super) fn route_error(
    shard: &Shard,
    facts: &RoutingFacts<'_>,
    error: RouteError,
) -> GatewayError {
    let fleet = shard.fleet.borrow();
    let name = fleet.live.backends.models().name(facts.model);
    match error {
        // No backend of its base model lists the adapter (any more).
        RouteError::AdapterGone => {
            let adapter = facts.adapter.map_or("", |a| fleet.adapters.name(a));
            GatewayError {
                kind: ErrorKind::ModelNotFound,
                message: format!("The model `{adapter}` does not exist."),
                param: Some("model".into()),
            }
        }
        // Its last backend was removed since the model was first seen.
        RouteError::ModelGone => GatewayError {
            kind: ErrorKind::ModelNotFound,
            message: format!("The model `{name}` does not exist."),
            param: Some("model".into()),
        },
        RouteError::UnsupportedMedia(needs) => GatewayError {
            kind: ErrorKind::UnsupportedMedia,
            message: format!(
                "The request carries {needs} content, which no backend serving model `{name}` accepts."
            ),
            param: Some("messages".into()),
        },
        RouteError::NoCandidate => GatewayError::new(
            ErrorKind::NoHealthyBackend,
            format!("no healthy backend serves model `{name}`"),
        ),
    }
}

/// Tells the shard's router when an attempt it placed ends, however it ends (the
/// `prefix_aware` policy times its placements' use from their requests' ends:
/// [`radixgate_orchestrator::Router::request_ended`]). `None` when there is nothing
/// to tell.
pub(super) struct EndGuard<'s> {
    shard: &'s Shard,
    tail: (usize, u64),
}

impl<'s> EndGuard<'s> {
    pub fn enter(shard: &'s Shard, decision: &Decision) -> Option<Self> {
        decision.prompt_tail.map(|tail| EndGuard { shard, tail })
    }
}

impl Drop for EndGuard<'_> {
    fn drop(&mut self) {
        let now_ms = self.shard.shared.now_ms();
        // Never borrowed across an await; `try_` so that a drop during a decision
        // (a panic unwinding through one) cannot panic again.
        if let Ok(mut router) = self.shard.router.try_borrow_mut() {
            router.request_ended(Some(self.tail), now_ms);
        }
    }
}

/// Holds one of the shard's half-open probe slots for a backend while an attempt runs.
pub(super) struct ProbeGuard<'s> {
    shard: &'s Shard,
    backend: usize,
}

impl<'s> ProbeGuard<'s> {
    pub fn enter(shard: &'s Shard, decision: &Decision) -> Option<Self> {
        decision.probe.then(|| {
            shard.per_backend.borrow_mut()[decision.pick.backend].probes += 1;
            ProbeGuard {
                shard,
                backend: decision.pick.backend,
            }
        })
    }
}

impl Drop for ProbeGuard<'_> {
    fn drop(&mut self) {
        let mut per_backend = self.shard.per_backend.borrow_mut();
        let probes = &mut per_backend[self.backend].probes;
        *probes = probes.saturating_sub(1);
    }
}

#[cfg(test)]
mod tests;
