//! TTFT-budget admission at the edge, between the tenant's quotas and routing.
//!
//! The budget is the request's `X-SLO-TTFT-Ms`, else its tier's `ttft_budget_ms`. The
//! shard asks its router for the estimate over the candidates it would route to
//! ([`radixgate_orchestrator::Router::estimate`]) and the orchestrator
//! ([`radixgate_orchestrator::admission`]) for the verdict: the `prefix_aware` cost model's best
//! estimate — whatever the routing policy, so for the other policies the check is a
//! lower bound on the TTFT their pick gets: it never refuses a request that could
//! have met its budget, and may admit one whose pick then misses it. Refusals: 429
//! `slo_unattainable` (estimate over budget) or 503 `overloaded` (the tier is shed
//! under fleet pressure, or the edge queue is full or timed out), both with
//! `Retry-After`. A request that must wait (every candidate saturated) waits in the
//! shard's [`EdgeQueue`](crate::shard::edge_queue::EdgeQueue).
//!
//! Requests with no budget, whose tier is never shed and with no edge queue
//! configured skip all of this (no index lookup, no cost).

use super::route::{routing_facts, with_fleet};
use crate::config::TierConfig;
use crate::error::{ErrorKind, GatewayError};
use crate::http::request::RequestHead;
use crate::openai::RequestFacts;
use crate::shard::edge_queue::EdgeQueue;
use crate::shard::Shard;
use monoio::time::Instant;
use radixgate_orchestrator::admission::{decide, fleet_pressure};
use radixgate_orchestrator::{AdmissionInput, PolicyName, ShedReason, Verdict};
use std::time::Duration;

/// Longest TTFT budget a client may ask for.
const MAX_BUDGET_MS: u64 = 3_600_000;

/// Why admission refused a request (for the metrics and the response).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Refusal {
    Shed(ShedReason),
    QueueFull,
    QueueTimeout,
}

impl Refusal {
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::Shed(r) => r.as_str(),
            Refusal::QueueFull => "queue_full",
            Refusal::QueueTimeout => "queue_timeout",
        }
    }

    pub fn retry_after_secs(self) -> u64 {
        match self {
            Refusal::Shed(ShedReason::SloUnattainable { over_ns }) => {
                ((over_ns / 1e9).ceil() as u64).clamp(1, 60)
            }
            _ => 1,
        }
    }

    pub fn error(self, budget: Option<Duration>, best_ns: f64) -> GatewayError {
        match self {
            Refusal::Shed(ShedReason::SloUnattainable { .. }) => GatewayError::new(
                ErrorKind::SloUnattainable,
                format!(
                    "The estimated time to first token ({:.0} ms) exceeds the request's TTFT budget ({} ms).",
                    best_ns / 1e6,
                    budget.map_or(0, |b| b.as_millis())
                ),
            ),
            Refusal::Shed(ShedReason::Pressure) => GatewayError::new(
                ErrorKind::Overloaded,
                "The backends are under pressure; requests of this tier are shed. Retry later.",
            ),
            Refusal::QueueFull => GatewayError::new(
                ErrorKind::Overloaded,
                "Every backend is saturated and the admission queue is full. Retry later.",
            ),
            Refusal::QueueTimeout => GatewayError::new(
                ErrorKind::Overloaded,
                "Every backend stayed saturated for the request's whole wait in the admission queue.",
            ),
        }
    }
}

/// How a request got in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admitted {
    Direct,
    AfterQueue,
}

/// The request's TTFT budget: `X-SLO-TTFT-Ms` (whole milliseconds, 1 to 3,600,000),
/// else the tier's default.
pub fn budget(head: &RequestHead, tier: &TierConfig) -> Result<Option<Duration>, GatewayError> {
    if head.slo_ttft_ms.is_empty() {
        return Ok(tier.ttft_budget);
    }
    crate::http::parse_content_length(head.slo_ttft_ms.as_bytes())
        .filter(|ms| (1..=MAX_BUDGET_MS).contains(ms))
        .map(|ms| Some(Duration::from_millis(ms)))
        .ok_or_else(|| {
            GatewayError::invalid_param(
                "X-SLO-TTFT-Ms",
                format!("`X-SLO-TTFT-Ms` must be whole milliseconds from 1 to {MAX_BUDGET_MS}"),
            )
        })
}

/// One request's admission: its tier, budget and start.
pub struct Admission<'a> {
    pub shard: &'a Shard,
    pub facts: &'a RequestFacts,
    pub tenant: Option<usize>,
    pub tier: TierConfig,
    pub budget: Option<Duration>,
    pub started: Instant,
}

/// The verdict's inputs at one instant, kept for the refusal message.
struct Check {
    verdict: Verdict,
    best_ns: f64,
}

impl Admission<'_> {
    /// Whether any part of admission applies to this request.
    pub fn applies(&self) -> bool {
        self.budget.is_some()
            || self.tier.shed_pressure.is_some()
            || self.shard.edge_queue.capacity() > 0
    }

    fn check(&self, blocks: &[u64], may_wait: bool) -> Check {
        let shard = self.shard;
        let live = shard.fleet.borrow().live.clone();
        let cfg = &live.config.admission;
        // A model left without backends leaves no candidates: routing answers it.
        let facts = routing_facts(self.facts, PolicyName::PrefixAware, blocks, None, &[], &[]);
        let estimate = with_fleet(shard, std::time::Instant::now(), |fleet| {
            shard
                .router
                .borrow_mut()
                .estimate(&shard.replica.borrow(), fleet, &facts)
        });
        let fleet = shard.fleet.borrow();
        let pressure = fleet_pressure(
            fleet
                .live
                .backends
                .serving(self.facts.model)
                .iter()
                .map(|&b| fleet.engine[b].map(|e| (e.waiting, e.kv_usage))),
            cfg.pressure_queue,
            cfg.pressure_kv,
        );
        let budget_ns = self
            .budget
            .map(|b| b.saturating_sub(self.started.elapsed()).as_nanos() as f64);
        let Some(estimate) = estimate else {
            // No candidates: routing answers "no healthy backend" itself.
            return Check {
                verdict: Verdict::Admit,
                best_ns: f64::INFINITY,
            };
        };
        let verdict = decide(&AdmissionInput {
            budget_ns,
            estimate,
            pressure,
            shed_pressure: self.tier.shed_pressure,
            may_wait,
        });
        Check {
            verdict,
            best_ns: estimate.best_ns,
        }
    }

    /// Decides at once from the shard's current prompt scratch. `Ok(None)`: admitted;
    /// `Ok(Some(deadline))`: must wait in the edge queue until at most `deadline`
    /// (the caller copies the prompt's blocks off the scratch, then calls
    /// [`Admission::wait`]).
    pub fn first(&self, blocks: &[u64]) -> Result<Option<Instant>, (Refusal, GatewayError)> {
        let queue: &EdgeQueue = &self.shard.edge_queue;
        let check = self.check(blocks, queue.capacity() > 0);
        match check.verdict {
            Verdict::Admit => Ok(None),
            Verdict::Shed(r) => Err(self.refuse(Refusal::Shed(r), check.best_ns)),
            Verdict::Wait => {
                let timeout = self
                    .shard
                    .fleet
                    .borrow()
                    .live
                    .config
                    .admission
                    .queue_timeout;
                let mut deadline = Instant::now() + timeout;
                if let Some(b) = self.budget {
                    deadline = deadline.min(self.started + b);
                }
                Ok(Some(deadline))
            }
        }
    }

    /// Waits in the edge queue until the head's re-check admits it, sheds it, or
    /// `deadline` passes.
    pub async fn wait(
        &self,
        blocks: &[u64],
        deadline: Instant,
    ) -> Result<(), (Refusal, GatewayError)> {
        let queue: &EdgeQueue = &self.shard.edge_queue;
        let Some(place) = queue.join(self.tier.priority, deadline) else {
            return Err(self.refuse(Refusal::QueueFull, 0.0));
        };
        super::count_admission(self.shard, self.tenant, "queued", "saturated");
        let joined = Instant::now();
        let _observe = scopeguard(|| {
            self.shard
                .metrics
                .borrow_mut()
                .queue_wait
                .observe(joined.elapsed())
        });
        loop {
            if place.is_head() {
                let check = self.check(blocks, true);
                match check.verdict {
                    Verdict::Admit => return Ok(()),
                    Verdict::Shed(r) => return Err(self.refuse(Refusal::Shed(r), check.best_ns)),
                    Verdict::Wait => {}
                }
            }
            if Instant::now() >= deadline {
                return Err(self.refuse(Refusal::QueueTimeout, 0.0));
            }
            place.wait(deadline).await;
        }
    }

    fn refuse(&self, r: Refusal, best_ns: f64) -> (Refusal, GatewayError) {
        (r, r.error(self.budget, best_ns))
    }
}

/// Runs `f` when dropped (however the wait ends, the client going away included).
fn scopeguard<F: FnMut()>(f: F) -> impl Drop {
    struct Guard<F: FnMut()>(F);
    impl<F: FnMut()> Drop for Guard<F> {
        fn drop(&mut self) {
            (self.0)()
        }
    }
    Guard(f)
}
