//! Edge admission: admit a request now, make it wait in the shard's edge queue, or
//! refuse it at once — decided from its TTFT budget, its tier and the fleet's load.
//!
//! The gateway builds the same candidates it would route over and asks the
//! `prefix_aware` cost model for the best one's estimated time to first token
//! ([`PrefixAware::best_estimate`]); that is the earliest first token the fleet can
//! promise, whichever policy then picks. The gateway also reduces the engines' scraped
//! queues and KV usage to one [`fleet_pressure`] number. [`decide`] then goes, in order:
//!
//! 1. the tier is shed under pressure (`pressure >= shed_pressure`): [`Verdict::Shed`]
//!    with [`ShedReason::Pressure`] — lower tiers get lower thresholds, so they go first;
//! 2. the best estimate is over the request's budget: [`ShedReason::SloUnattainable`]
//!    at once (queueing would only make it later). A request whose best estimate fits
//!    its budget is never refused here: the check is a lower bound on what any pick gets;
//! 3. every candidate is saturated and the edge queue is on: [`Verdict::Wait`];
//! 4. otherwise [`Verdict::Admit`].
//!
//! Pure: no clock, no I/O; the caller measures budgets against its own `now`.

use crate::policy::prefix_aware::PrefixAware;
use crate::policy::RouteInput;

/// The best candidate's estimated TTFT, as the `prefix_aware` cost model sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Estimate {
    /// Smallest estimate among unsaturated candidates (among all of them when every
    /// one is saturated), in ns; infinite when there are no candidates.
    pub best_ns: f64,
    /// Every candidate is at its saturation cap.
    pub all_saturated: bool,
}

/// What [`decide`] weighs for one request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdmissionInput {
    /// TTFT budget left, in ns (`None`: no SLO check).
    pub budget_ns: Option<f64>,
    pub estimate: Estimate,
    /// See [`fleet_pressure`].
    pub pressure: f64,
    /// The tier is shed once pressure reaches this (`None`: never for pressure).
    pub shed_pressure: Option<f64>,
    /// The shard has an edge queue with room for this request.
    pub may_wait: bool,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Verdict {
    Admit,
    Wait,
    Shed(ShedReason),
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ShedReason {
    /// The fleet is under pressure and the request's tier is shed at this level.
    Pressure,
    /// The best estimate exceeds the budget by `over_ns`.
    SloUnattainable { over_ns: f64 },
}

impl ShedReason {
    pub fn as_str(self) -> &'static str {
        match self {
            ShedReason::Pressure => "pressure",
            ShedReason::SloUnattainable { .. } => "slo_unattainable",
        }
    }
}

pub fn decide(input: &AdmissionInput) -> Verdict {
    if input.shed_pressure.is_some_and(|at| input.pressure >= at) {
        return Verdict::Shed(ShedReason::Pressure);
    }
    if let Some(budget) = input.budget_ns {
        let over = input.estimate.best_ns - budget;
        if over > 0.0 {
            return Verdict::Shed(ShedReason::SloUnattainable { over_ns: over });
        }
    }
    if input.estimate.all_saturated && input.may_wait {
        return Verdict::Wait;
    }
    Verdict::Admit
}

/// The fleet's load for one model as one number: 1.0 means "full" — the engines'
/// mean waiting queue at `queue_full` requests, or their mean KV usage at `kv_full`
/// — whichever is higher. Engines never scraped (`None`) do not count; with none
/// scraped the pressure is 0.
pub fn fleet_pressure(
    engines: impl Iterator<Item = Option<(u32, f32)>>,
    queue_full: f64,
    kv_full: f64,
) -> f64 {
    let (mut n, mut waiting, mut kv) = (0u32, 0f64, 0f64);
    for (w, k) in engines.flatten() {
        n += 1;
        waiting += f64::from(w);
        kv += f64::from(k);
    }
    if n == 0 {
        return 0.0;
    }
    let n = f64::from(n);
    let ratio = |x: f64, full: f64| if full > 0.0 { x / n / full } else { 0.0 };
    ratio(waiting, queue_full).max(ratio(kv, kv_full))
}

// === impl PrefixAware (estimate) ===

impl PrefixAware {
    /// The best candidate's estimated TTFT for `input` (see [`Estimate`]).
    pub fn best_estimate(&self, input: &RouteInput<'_>) -> Estimate {
        let (mut open, mut all) = (f64::INFINITY, f64::INFINITY);
        for c in input.candidates {
            let est = self.est_ttft_ns(c, input.prompt_blocks);
            all = all.min(est);
            if !self.is_full(c) {
                open = open.min(est);
            }
        }
        let all_saturated = open.is_infinite() && !input.candidates.is_empty();
        Estimate {
            best_ns: if all_saturated { all } else { open },
            all_saturated,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{Candidate, PrefixAwareConfig};

    fn estimate(candidates: &[Candidate], blocks: u32) -> Estimate {
        let model = PrefixAware::new(&PrefixAwareConfig {
            saturation_inflight: 4,
            ..PrefixAwareConfig::default()
        });
        model.best_estimate(&RouteInput {
            candidates,
            affinity_key: None,
            prompt_blocks: blocks,
            ..RouteInput::default()
        })
    }

    fn input(budget_ms: Option<f64>, est: Estimate) -> AdmissionInput {
        AdmissionInput {
            budget_ns: budget_ms.map(|ms| ms * 1e6),
            estimate: est,
            pressure: 0.0,
            shed_pressure: None,
            may_wait: true,
        }
    }

    #[test]
    fn best_estimate_prefers_open_candidates() {
        let cold = Candidate::new(0, 0);
        let warm = Candidate {
            matched_blocks: 10,
            ..Candidate::new(1, 1)
        };
        // 10 blocks × 16 tokens × 20 µs = 3.2 ms cold; warm: one request ahead = 2.5 ms.
        let e = estimate(&[cold, warm], 10);
        assert_eq!(e.best_ns, 2.5e6);
        // The warm one's queue holds 100 tokens still to prefill (2 ms): now cold wins.
        let queued = Candidate {
            pending_prefill_tokens: 100,
            ..warm
        };
        assert_eq!(estimate(&[cold, queued], 10).best_ns, 3.2e6);
        // Its head request is 1.5 ms into that prefill: 0.5 ms of it is left, plus
        // 2.5 ms for the request ahead; the warm one is best again.
        let started = Candidate {
            prefill_progress_ns: 1_500_000,
            ..queued
        };
        assert_eq!(estimate(&[cold, started], 10).best_ns, 3.0e6);
        assert!(!e.all_saturated);
        let full = Candidate::new(2, 4);
        let e = estimate(&[full], 0);
        assert!(e.all_saturated);
        assert_eq!(e.best_ns, 10e6);
        assert!(estimate(&[], 3).best_ns.is_infinite());
    }

    #[test]
    fn refuses_only_what_cannot_meet_its_budget() {
        let e = Estimate {
            best_ns: 50e6,
            all_saturated: false,
        };
        assert_eq!(
            decide(&input(Some(20.0), e)),
            Verdict::Shed(ShedReason::SloUnattainable { over_ns: 30e6 })
        );
        // The same fleet, a generous budget: admitted.
        assert_eq!(decide(&input(Some(50.0), e)), Verdict::Admit);
        assert_eq!(decide(&input(None, e)), Verdict::Admit);
    }

    #[test]
    fn saturation_waits_and_pressure_sheds_by_tier() {
        let e = Estimate {
            best_ns: 1e6,
            all_saturated: true,
        };
        assert_eq!(decide(&input(Some(100.0), e)), Verdict::Wait);
        let mut no_queue = input(Some(100.0), e);
        no_queue.may_wait = false;
        assert_eq!(decide(&no_queue), Verdict::Admit);
        let mut low = input(None, e);
        low.pressure = 1.2;
        low.shed_pressure = Some(1.0);
        assert_eq!(decide(&low), Verdict::Shed(ShedReason::Pressure));
        let mut high = low;
        high.shed_pressure = Some(2.0);
        assert_eq!(decide(&high), Verdict::Wait);
    }

    #[test]
    fn pressure_is_the_worse_of_queue_and_kv() {
        let engines = [Some((8, 0.5)), Some((24, 0.7)), None];
        let p = fleet_pressure(engines.into_iter(), 16.0, 0.9);
        assert!((p - 1.0).abs() < 1e-9, "{p}");
        let p = fleet_pressure([Some((0, 0.9f32))].into_iter(), 16.0, 0.9);
        assert!((p - 1.0).abs() < 1e-6, "{p}");
        assert_eq!(fleet_pressure([None].into_iter(), 16.0, 0.9), 0.0);
    }
}
