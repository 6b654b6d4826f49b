//! Gives memory back to the system after a burst of connections has ended.
//!
//! A shard's allocations live in its thread's own mimalloc heap, which keeps freed
//! pages for reuse; after thousands of connections close, the shard would otherwise
//! hold their memory until it allocates again. Every [`TICK`] a task on each shard
//! compares the most connections open at once since the last tick with the number
//! open now; when at least [`MIN_CLOSED`] closed and fewer than half are left, it
//! shrinks the shard's connection registry and asks mimalloc to return this
//! thread's free pages (`mi_collect`). Cost: one timer per shard per second, and a
//! collection only after a burst.

use crate::shard::Shard;
use std::rc::Rc;
use std::time::Duration;

pub const TICK: Duration = Duration::from_secs(1);

/// The fewest connections that must have closed since the last tick for a
/// collection to be worth its cost.
pub const MIN_CLOSED: usize = 256;

/// Runs for the shard's life (the runtime drops it at shutdown).
pub async fn watch(shard: Rc<Shard>) {
    loop {
        monoio::time::sleep(TICK).await;
        let (peak, open) = shard.conns.take_peak();
        if burst_ended(peak, open) {
            shard.conns.shrink();
            collect_free_pages();
            shard.metrics.borrow_mut().memory_reclaims += 1;
        }
    }
}

fn burst_ended(peak: usize, open: usize) -> bool {
    peak - open >= MIN_CLOSED && open * 2 < peak
}

/// Returns this thread's free mimalloc pages to the system.
fn collect_free_pages() {
    // SAFETY: `mi_collect` only walks and releases the calling thread's own heap;
    // it takes no pointers and is safe to call at any time on any thread.
    unsafe { libmimalloc_sys::mi_collect(true) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collects_only_after_most_of_a_large_burst_closed() {
        assert!(burst_ended(10_000, 0));
        assert!(burst_ended(1_000, 400));
        // Too few closed to be worth it, or most still open.
        assert!(!burst_ended(200, 0));
        assert!(!burst_ended(1_000, 600));
        assert!(!burst_ended(0, 0));
    }
}
