//! Shard event-loop stall detection: a task on each shard asks for a wake-up every
//! [`TICK`] and records how late it came (`radixgate_shard_event_loop_lag_seconds`).
//!
//! A monoio shard runs one task at a time; a handler that computes or blocks for
//! long delays every other connection on its core, and shows up here as lag. Cost:
//! one timer per shard per tick, recorded into the shard's own metrics (no lock).

use crate::shard::Shard;
use monoio::time::Instant;
use std::rc::Rc;
use std::time::Duration;

pub const TICK: Duration = Duration::from_millis(10);

/// Runs for the shard's life (the runtime drops it at shutdown).
pub async fn watch(shard: Rc<Shard>) {
    loop {
        let due = Instant::now() + TICK;
        monoio::time::sleep(TICK).await;
        let late = Instant::now().saturating_duration_since(due);
        shard.metrics.borrow_mut().loop_lag.observe(late);
    }
}
