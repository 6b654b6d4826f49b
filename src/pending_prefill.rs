//! The prefill work the gateway has queued at each engine, and how far the engine has
//! got with it: the `pending_prefill_tokens` and `prefill_progress_ns` that
//! `prefix_aware` routing and SLO admission weigh per candidate
//! ([`radixgate_orchestrator::Candidate`]).
//!
//! A request is *pending* on its backend from the moment it is sent until its first
//! response byte (or until the attempt ends without one); it counts its predicted
//! uncached prompt tokens. Besides the tokens, each backend keeps a clock: the later of
//! the moment its pending set last became non-empty and its last first byte. Since
//! then the engine has been working on the pending set, so the time since is prefill
//! already done and is credited against the tokens. With a FIFO prefill queue it is
//! exactly how far the request now being prefilled has got (the one sent when the set
//! was empty started at once; any later one started at the previous first byte).
//! Without the credit the estimate charged that request its whole prompt, and SLO
//! admission refused requests that would have met their budget (`radixgate-bench sim
//! --edge`: 14% of the offered at 1.5× capacity, 19.5% at 2×; 0 with it).
//!
//! The credit can only over-state the progress when the engine also spends that time
//! on work the gateway does not count as pending (decode steps of streamed requests
//! past their first byte, other clients), which the engine's scraped queue and
//! `queue_ns_per_request` charge, or when the engine prefills slower than the learned
//! cost says; progress that reaches the whole pending work is that case, and the cost
//! model then drops the credit (`prefix_aware`'s module docs).
//!
//! Layout: one padded slot per shard and backend slot, written only by its shard (no
//! locked instruction), read by any. The fleet-wide clock is the earliest "became
//! non-empty" among shards with pending requests and the latest first byte among all:
//! under FIFO that is the same instant as a single fleet-wide clock (a shard's own set
//! can only have become non-empty later than the fleet's, and then nothing was pending
//! elsewhere that is still pending). Counts are relaxed (a load estimate, like the
//! in-flight counts); a shard publishes its "became non-empty" time before the request
//! count with release, so a reader that sees the count sees that time.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Instant;

#[repr(align(64))]
#[derive(Default)]
struct Slot {
    /// Predicted uncached prompt tokens of this shard's pending requests.
    tokens: AtomicU32,
    requests: AtomicU32,
    /// When `requests` last went from 0 to 1, in ns since the epoch.
    since_ns: AtomicU64,
    /// The last first byte (or end without one) of this shard's requests, in ns since
    /// the epoch.
    last_first_byte_ns: AtomicU64,
}

pub struct PendingPrefill {
    /// `rows[shard][backend]`.
    rows: Box<[Box<[Slot]>]>,
    epoch: Instant,
}

impl PendingPrefill {
    pub fn new(shards: usize, backends: usize, epoch: Instant) -> Self {
        let rows = (0..shards)
            .map(|_| (0..backends).map(|_| Slot::default()).collect())
            .collect();
        Self { rows, epoch }
    }

    fn ns(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.epoch).as_nanos() as u64
    }

    /// Counts a request sent at `now` with `tokens` predicted uncached prompt tokens
    /// until the guard is dropped (at its first response byte). Called only by `shard`.
    pub fn enter(
        &self,
        shard: usize,
        backend: usize,
        tokens: u32,
        now: Instant,
    ) -> PendingGuard<'_> {
        let slot = &self.rows[shard][backend];
        let requests = slot.requests.load(Ordering::Relaxed);
        if requests == 0 {
            slot.since_ns.store(self.ns(now), Ordering::Relaxed);
        }
        slot.requests
            .store(requests.saturating_add(1), Ordering::Release);
        let t = slot.tokens.load(Ordering::Relaxed);
        slot.tokens
            .store(t.saturating_add(tokens), Ordering::Relaxed);
        PendingGuard {
            owner: self,
            shard,
            backend,
            tokens,
        }
    }

    fn leave(&self, shard: usize, backend: usize, tokens: u32, now: Instant) {
        let slot = &self.rows[shard][backend];
        let t = slot.tokens.load(Ordering::Relaxed);
        slot.tokens
            .store(t.saturating_sub(tokens), Ordering::Relaxed);
        let now = self.ns(now);
        if now > slot.last_first_byte_ns.load(Ordering::Relaxed) {
            slot.last_first_byte_ns.store(now, Ordering::Relaxed);
        }
        let r = slot.requests.load(Ordering::Relaxed);
        slot.requests.store(r.saturating_sub(1), Ordering::Relaxed);
    }

    /// Pending prefill tokens on `backend`, all shards together.
    pub fn tokens(&self, backend: usize) -> u32 {
        self.rows
            .iter()
            .map(|row| row[backend].tokens.load(Ordering::Relaxed))
            .fold(0, u32::saturating_add)
    }

    /// How long the engine has been working through `backend`'s pending prefill at
    /// `now`, in ns (0 when nothing is pending): see the module docs.
    pub fn progress_ns(&self, backend: usize, now: Instant) -> u64 {
        let (mut since, mut last, mut pending) = (u64::MAX, 0, false);
        for row in self.rows.iter() {
            let slot = &row[backend];
            last = last.max(slot.last_first_byte_ns.load(Ordering::Relaxed));
            if slot.requests.load(Ordering::Acquire) > 0 {
                pending = true;
                since = since.min(slot.since_ns.load(Ordering::Relaxed));
            }
        }
        if !pending {
            return 0;
        }
        self.ns(now).saturating_sub(since.max(last))
    }
}

/// Releases a pending request's tokens when dropped (its first byte, or the end of
/// the attempt however it ends), and stamps the backend's clock.
pub struct PendingGuard<'a> {
    owner: &'a PendingPrefill,
    shard: usize,
    backend: usize,
    tokens: u32,
}

impl PendingGuard<'_> {
    /// Releases the tokens at `now`, a clock reading the caller already has (the
    /// first byte's), instead of reading the clock again on drop.
    pub fn release(self, now: Instant) {
        self.owner.leave(self.shard, self.backend, self.tokens, now);
        std::mem::forget(self);
    }
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        self.owner
            .leave(self.shard, self.backend, self.tokens, Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const MS: u64 = 1_000_000;

    #[test]
    fn counts_tokens_across_shards_and_releases() {
        let epoch = Instant::now();
        let p = PendingPrefill::new(2, 3, epoch);
        {
            let _a = p.enter(0, 2, 300, epoch);
            let _b = p.enter(1, 2, 45, epoch);
            assert_eq!(p.tokens(2), 345);
            assert_eq!(p.tokens(0), 0);
        }
        assert_eq!(p.tokens(2), 0);
        assert_eq!(p.progress_ns(2, epoch + Duration::from_secs(1)), 0);
    }

    #[test]
    fn progress_runs_from_the_later_of_non_empty_and_last_first_byte() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let p = PendingPrefill::new(2, 1, t0);
        assert_eq!(p.progress_ns(0, at(5)), 0, "nothing pending");
        // Shard 0 sends A at 10 ms: the engine starts on it at once.
        let a = p.enter(0, 0, 1000, at(10));
        assert_eq!(p.progress_ns(0, at(25)), 15 * MS);
        // Shard 1 sends B at 20 ms: it queues behind A; progress is still A's.
        let b = p.enter(1, 0, 500, at(20));
        assert_eq!(p.progress_ns(0, at(30)), 20 * MS);
        // A's first byte at 40 ms (released at that reading; dropped, the guard
        // would stamp the real clock): B starts then.
        a.release(at(40));
        assert_eq!(p.tokens(0), 500);
        assert_eq!(p.progress_ns(0, at(45)), 5 * MS);
        // Shard 0's set is empty now; its new request at 50 ms queues behind B,
        // which is still being prefilled: the clock stays at B's start.
        let c = p.enter(0, 0, 100, at(50));
        assert_eq!(p.progress_ns(0, at(55)), 15 * MS);
        b.release(at(60));
        assert_eq!(
            p.progress_ns(0, at(65)),
            5 * MS,
            "C started at B's first byte"
        );
        drop(c);
        assert_eq!(p.tokens(0), 0);
        assert_eq!(p.progress_ns(0, at(70)), 0);
    }
}
