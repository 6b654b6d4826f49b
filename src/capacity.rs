//! The capacity thread (`radixgate-capacity`): measures each engine pool's load and
//! asks the orchestrator's Erlang-C model ([`radixgate_orchestrator::capacity`]) how
//! many engines the pool needs to meet `capacity.ttft_slo_ms`.
//!
//! Every `capacity.interval_ms` it takes one [`Sample`]: the shards' cumulative
//! request counters (the TTFT and duration histograms' counts and sums per model,
//! the split legs' histograms), collected over their command channels as a
//! `/metrics` scrape does, and the engines' scraped `running`/`waiting` from the
//! coordinator's fleet snapshot. Nothing is added to the request path: the shards
//! already keep those counters. The rates come from a sliding window of samples
//! ([`estimate`]); the report goes to [`crate::status::capacity`], where `/metrics`
//! and `GET /admin/capacity` read it.

mod estimate;

pub use estimate::{estimate, pools, Pool, PoolKind, Sample, Sums};

use crate::control::{ask, AdminRequest, Shared};
use crossbeam_channel::{select, Receiver, Sender};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long one sample waits for the shards' counters; a shard that does not answer
/// in time makes the sample incomplete, and it is skipped.
const SHARD_WAIT: Duration = Duration::from_secs(2);

/// Runs until `stop` fires or is dropped.
pub fn run(shared: Arc<Shared>, coordinator: Sender<AdminRequest>, stop: Receiver<()>) {
    let mut window: VecDeque<Sample> = VecDeque::new();
    loop {
        let mut interval = shared.config.capacity.interval;
        if let Ok(fleet) = ask(&coordinator, AdminRequest::Fleet) {
            let config = fleet.live.config.capacity;
            interval = config.interval;
            let pools = pools(&fleet.live);
            if let Some(sample) = take_sample(&shared, &fleet, &pools) {
                window.push_back(sample);
            }
            trim(&mut window, config.window);
            shared
                .capacity
                .set(estimate(&window, &pools, &fleet, &config));
        }
        select! {
            recv(stop) -> _ => return,
            default(interval) => {}
        }
    }
}

/// Drops samples older than `window` behind the newest, always keeping two.
fn trim(window: &mut VecDeque<Sample>, span: Duration) {
    let Some(newest) = window.back().map(|s| s.at) else {
        return;
    };
    while window.len() > 2
        && window
            .front()
            .is_some_and(|s| newest.saturating_duration_since(s.at) > span)
    {
        window.pop_front();
    }
}

/// The shards' counters summed, and the pools' engine load; `None` when a shard did
/// not answer.
fn take_sample(
    shared: &Shared,
    fleet: &crate::fleet::FleetSnapshot,
    pools: &[Pool],
) -> Option<Sample> {
    let (rx, asked) = shared.ask_shards_for_metrics();
    let deadline = Instant::now() + SHARD_WAIT;
    let mut copies = Vec::with_capacity(asked);
    for _ in 0..asked {
        copies.push(rx.recv_deadline(deadline).ok()?);
    }
    if asked < shared.shard_commands.len() {
        return None; // a stopped shard: its counters are gone from the sums
    }
    Some(Sample::new(Instant::now(), &copies, fleet, pools))
}
