//! The capacity signal's model: how many engines a pool needs for its measured load
//! to meet the TTFT SLO, by Erlang C (M/M/c).
//!
//! The gateway measures a pool's arrival rate and service times and hands them here
//! as plain numbers (no clocks, no I/O); [`recommend`] answers with the smallest
//! engine count whose predicted queueing delay fits the pool's wait budget. An
//! engine is `slots` servers (its continuous-batching concurrency, vLLM's
//! `max_num_seqs`): a request holds one slot for its whole service time and waits
//! only when every slot of the pool is taken. The delay compared with the budget is
//! the `quantile` (e.g. p95) of the M/M/c waiting time,
//! `P(W > t) = C(c, a) · e^(−(cμ − λ)t)`, so the answer also keeps utilisation < 1.

/// One pool's measured load and target.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CapacityInput {
    /// Requests per second arriving at the pool (λ).
    pub arrival_rate: f64,
    /// Mean time a request holds an engine slot, seconds (1/μ): queueing excluded.
    pub service_seconds: f64,
    /// Longest the pool's queueing delay may be at `quantile`, seconds: what the
    /// TTFT SLO leaves after the service parts of the first token. Zero or less asks
    /// for no queueing at that quantile (P(wait) ≤ 1 − quantile).
    pub wait_budget_seconds: f64,
    /// Concurrency slots per engine (≥ 1).
    pub slots: u32,
    /// Quantile of the waiting time held to the budget, in (0, 1).
    pub quantile: f64,
}

/// The model's answer for one pool.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Recommendation {
    /// Engines needed (0 when nothing arrives).
    pub engines: u32,
    /// Offered load in Erlangs (λ × service): slots busy on average.
    pub offered_erlangs: f64,
    /// Slot utilisation at that engine count, in [0, 1).
    pub utilisation: f64,
    /// Probability that a request waits for a slot (Erlang C).
    pub wait_probability: f64,
    /// Mean queueing delay, seconds.
    pub mean_wait_seconds: f64,
    /// Queueing delay at the input's quantile, seconds.
    pub quantile_wait_seconds: f64,
}

/// Above this many engines the search stops: the answer is capped there (a
/// measurement gone wrong, not a fleet).
pub const MAX_ENGINES: u32 = 100_000;

/// Erlang C: the probability that an arrival waits, with `servers` servers and
/// `erlangs` offered load. 1.0 when the system is not stable (`erlangs >= servers`).
pub fn erlang_c(servers: u64, erlangs: f64) -> f64 {
    let mut b = 1.0; // Erlang B with 0 servers
    for k in 1..=servers {
        b = erlang_b_step(b, k, erlangs);
    }
    c_from_b(b, servers, erlangs)
}

/// Erlang B for `k` servers from Erlang B for `k − 1` (the stable recurrence).
fn erlang_b_step(b_prev: f64, k: u64, erlangs: f64) -> f64 {
    erlangs * b_prev / (k as f64 + erlangs * b_prev)
}

fn c_from_b(b: f64, servers: u64, erlangs: f64) -> f64 {
    let n = servers as f64;
    if erlangs >= n {
        return 1.0;
    }
    n * b / (n - erlangs * (1.0 - b))
}

/// The `quantile` of the M/M/c waiting time, given P(wait) and the drain rate
/// `cμ − λ` (per second).
fn wait_quantile(p_wait: f64, drain_rate: f64, quantile: f64) -> f64 {
    let tail = 1.0 - quantile;
    if p_wait <= tail {
        0.0
    } else {
        (p_wait / tail).ln() / drain_rate
    }
}

/// The smallest engine count (at most [`MAX_ENGINES`]) whose waiting time at the
/// input's quantile fits its budget, with the queue's figures there. Inputs that
/// are not finite or not positive where they must be count as no load.
pub fn recommend(input: &CapacityInput) -> Recommendation {
    let lambda = input.arrival_rate;
    let service = input.service_seconds;
    let quantile = if input.quantile > 0.0 && input.quantile < 1.0 {
        input.quantile
    } else {
        0.95
    };
    let idle = Recommendation {
        engines: 0,
        offered_erlangs: 0.0,
        utilisation: 0.0,
        wait_probability: 0.0,
        mean_wait_seconds: 0.0,
        quantile_wait_seconds: 0.0,
    };
    if !(lambda > 0.0 && lambda.is_finite() && service > 0.0 && service.is_finite()) {
        return idle;
    }
    let budget = if input.wait_budget_seconds.is_finite() {
        input.wait_budget_seconds.max(0.0)
    } else {
        f64::MAX
    };
    let slots = u64::from(input.slots.max(1));
    let erlangs = lambda * service;
    let mu = 1.0 / service;
    // Erlang B carried up the server counts: each engine adds `slots` steps.
    let mut b = 1.0;
    let mut servers = 0u64;
    for engines in 1..=MAX_ENGINES {
        let top = u64::from(engines) * slots;
        while servers < top {
            servers += 1;
            b = erlang_b_step(b, servers, erlangs);
        }
        let n = servers as f64;
        if erlangs >= n && engines < MAX_ENGINES {
            continue; // unstable: the queue grows without bound
        }
        let p_wait = c_from_b(b, servers, erlangs);
        let drain = n * mu - lambda;
        let at_quantile = if drain > 0.0 {
            wait_quantile(p_wait, drain, quantile)
        } else {
            f64::INFINITY
        };
        if at_quantile <= budget || engines == MAX_ENGINES {
            return Recommendation {
                engines,
                offered_erlangs: erlangs,
                utilisation: (erlangs / n).min(1.0),
                wait_probability: p_wait,
                mean_wait_seconds: if drain > 0.0 {
                    p_wait / drain
                } else {
                    f64::INFINITY
                },
                quantile_wait_seconds: at_quantile,
            };
        }
    }
    unreachable!("the loop returns at MAX_ENGINES")
}

/// The M/M/c queue's figures at a given engine count (for reports and validation):
/// `None` when it is unstable there or there is no load.
pub fn queue_at(input: &CapacityInput, engines: u32) -> Option<Recommendation> {
    let erlangs = input.arrival_rate * input.service_seconds;
    let servers = u64::from(engines) * u64::from(input.slots.max(1));
    if !(erlangs > 0.0 && erlangs.is_finite()) || erlangs >= servers as f64 {
        return None;
    }
    let p_wait = erlang_c(servers, erlangs);
    let drain = servers as f64 / input.service_seconds - input.arrival_rate;
    Some(Recommendation {
        engines,
        offered_erlangs: erlangs,
        utilisation: erlangs / servers as f64,
        wait_probability: p_wait,
        mean_wait_seconds: p_wait / drain,
        quantile_wait_seconds: wait_quantile(p_wait, drain, input.quantile),
    })
}

#[cfg(test)]
mod tests;
