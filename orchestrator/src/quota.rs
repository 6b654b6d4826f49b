//! A token bucket in one atomic word: the quota check behind tenants' requests/s and
//! tokens/s limits (`src/tenants.rs`), and the fairness benchmark
//! (`radixgate-bench sim --edge fairness`), which runs this very code.
//!
//! Time comes in as an argument (milliseconds on the caller's clock); the bucket is
//! shared across shards and updated with compare-and-swap, never a lock.

use std::sync::atomic::{AtomicU64, Ordering};

/// A token bucket in one atomic word: high 32 bits = tokens × 1000, low 32 bits =
/// time of the last refill in ms (wrapping).
pub struct Bucket {
    state: AtomicU64,
    /// Tokens added per millisecond, × 1000.
    rate_milli_per_ms: f64,
    capacity_milli: u64,
    pub limit_per_sec: f64,
}

fn pack(tokens_milli: u64, now_ms: u32) -> u64 {
    (tokens_milli.min(u32::MAX as u64) << 32) | now_ms as u64
}

fn unpack(s: u64) -> (u64, u32) {
    (s >> 32, s as u32)
}

impl Bucket {
    /// A bucket refilling `per_sec` tokens a second, holding at most one second's
    /// worth (and at least one token), starting full.
    pub fn new(per_sec: f64, now_ms: u64) -> Self {
        let capacity_milli = ((per_sec.max(1.0)) * 1000.0) as u64;
        Self {
            state: AtomicU64::new(pack(capacity_milli, now_ms as u32)),
            rate_milli_per_ms: per_sec,
            capacity_milli: capacity_milli.min(u32::MAX as u64),
            limit_per_sec: per_sec,
        }
    }

    fn refilled(&self, s: u64, now_ms: u64) -> u64 {
        let (tokens, last) = unpack(s);
        let elapsed = (now_ms as u32).wrapping_sub(last) as f64;
        ((tokens as f64 + elapsed * self.rate_milli_per_ms) as u64).min(self.capacity_milli)
    }

    /// Takes `cost` tokens. `Ok(remaining)` or `Err(wait_ms)` until they would exist.
    pub fn take(&self, cost: u64, now_ms: u64) -> Result<u64, u64> {
        let cost_milli = cost.saturating_mul(1000).min(self.capacity_milli);
        let mut s = self.state.load(Ordering::Relaxed);
        loop {
            let tokens = self.refilled(s, now_ms);
            if tokens < cost_milli {
                let missing = (cost_milli - tokens) as f64;
                return Err((missing / self.rate_milli_per_ms.max(1e-9)).ceil() as u64);
            }
            let next = pack(tokens - cost_milli, now_ms as u32);
            match self
                .state
                .compare_exchange_weak(s, next, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return Ok((tokens - cost_milli) / 1000),
                Err(actual) => s = actual,
            }
        }
    }

    /// Gives back (`delta > 0`) or charges more (`delta < 0`) tokens after the fact,
    /// never below zero or above capacity.
    pub fn adjust(&self, delta: i64, now_ms: u64) {
        let mut s = self.state.load(Ordering::Relaxed);
        loop {
            let tokens = self.refilled(s, now_ms) as i64 + delta.saturating_mul(1000);
            let tokens = tokens.clamp(0, self.capacity_milli as i64) as u64;
            match self.state.compare_exchange_weak(
                s,
                pack(tokens, now_ms as u32),
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return,
                Err(actual) => s = actual,
            }
        }
    }

    /// A bucket refilling `per_sec` tokens a second that carries this one's use
    /// over: it starts at its own capacity less what this one lacks of its
    /// capacity at `now_ms` (never below zero). So a raised limit gives its extra
    /// room at once, and a lowered one grants no fresh burst.
    pub fn rescaled(&self, per_sec: f64, now_ms: u64) -> Bucket {
        let next = Bucket::new(per_sec, now_ms);
        let used = self
            .capacity_milli
            .saturating_sub(self.refilled(self.state.load(Ordering::Relaxed), now_ms));
        let start = next.capacity_milli.saturating_sub(used);
        next.state
            .store(pack(start, now_ms as u32), Ordering::Relaxed);
        next
    }

    pub fn remaining(&self, now_ms: u64) -> u64 {
        self.refilled(self.state.load(Ordering::Relaxed), now_ms) / 1000
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_refills_and_reports_wait() {
        let b = Bucket::new(10.0, 0);
        for _ in 0..10 {
            assert!(b.take(1, 0).is_ok());
        }
        assert_eq!(b.take(1, 0), Err(100), "one token every 100 ms");
        assert!(b.take(1, 100).is_ok());
        b.adjust(5, 100);
        assert_eq!(b.remaining(100), 5);
        b.adjust(-50, 100);
        assert_eq!(b.remaining(100), 0);
    }

    #[test]
    fn a_rescaled_bucket_carries_what_was_used() {
        let b = Bucket::new(10.0, 0);
        b.take(4, 0).unwrap();
        assert_eq!(b.rescaled(100.0, 0).remaining(0), 96);
        assert_eq!(b.rescaled(2.0, 0).remaining(0), 0);
        let lower = b.rescaled(5.0, 0);
        assert_eq!(lower.remaining(0), 1);
        assert_eq!(lower.take(1, 200), Ok(1), "refills at the new rate");
    }
}
