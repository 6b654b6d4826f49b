//! A token bucket in one atomic word: the quota check behind tenants' requests/s and
//! tokens/s limits (`src/tenants.rs`), and the fairness benchmark
//! (`radixgate-bench sim --edge fairness`), which runs this very code.
//!
//! Time comes in as an argument (milliseconds on the caller's clock); the bucket is
//! shared across shards and updated with compare-and-swap, never a lock.

use std::sync::atomic::{AtomicU64, Ordering};

/// A token bucket in one atomic word: high 32 bits = the balance × 1000 plus the
/// capacity (so the balance can run down to minus one capacity: debt from use
/// elsewhere, see [`Bucket::charge`]), low 32 bits = time of the last refill in ms
/// (wrapping).
pub struct Bucket {
    state: AtomicU64,
    /// Tokens added per millisecond, × 1000.
    rate_milli_per_ms: f64,
    capacity_milli: i64,
    pub limit_per_sec: f64,
    /// Cluster mode: what this process took, net of refunds, × 1000 (for its peers).
    used_milli: Option<AtomicU64>,
}

/// Whole tokens in thousandths, saturating.
fn milli(tokens: u64) -> i64 {
    i64::try_from(tokens.saturating_mul(1000)).unwrap_or(i64::MAX)
}

impl Bucket {
    /// A bucket refilling `per_sec` tokens a second, holding at most one second's
    /// worth (and at least one token), starting full.
    pub fn new(per_sec: f64, now_ms: u64) -> Self {
        let capacity_milli = ((per_sec.max(1.0)) * 1000.0).min(i32::MAX as f64) as i64;
        let b = Self {
            state: AtomicU64::new(0),
            rate_milli_per_ms: per_sec,
            capacity_milli,
            limit_per_sec: per_sec,
            used_milli: None,
        };
        b.state
            .store(b.pack(capacity_milli, now_ms), Ordering::Relaxed);
        b
    }

    /// The same bucket, also counting what this process takes ([`Self::used`]), for
    /// a cluster's peers to charge.
    pub fn tracking_use(mut self) -> Self {
        self.used_milli = Some(AtomicU64::new(0));
        self
    }

    fn pack(&self, balance_milli: i64, now_ms: u64) -> u64 {
        let c = self.capacity_milli;
        let stored = (balance_milli.clamp(-c, c) + c) as u64;
        (stored << 32) | (now_ms as u32) as u64
    }

    /// `(balance × 1000, last refill)`.
    fn unpack(&self, s: u64) -> (i64, u32) {
        ((s >> 32) as i64 - self.capacity_milli, s as u32)
    }

    fn refilled(&self, s: u64, now_ms: u64) -> i64 {
        let (balance, last) = self.unpack(s);
        let elapsed = (now_ms as u32).wrapping_sub(last) as f64;
        ((balance as f64 + elapsed * self.rate_milli_per_ms) as i64).min(self.capacity_milli)
    }

    fn count_use(&self, delta_milli: i64) {
        if let Some(u) = &self.used_milli {
            if delta_milli >= 0 {
                u.fetch_add(delta_milli as u64, Ordering::Relaxed);
            } else {
                u.fetch_sub(delta_milli.unsigned_abs(), Ordering::Relaxed);
            }
        }
    }

    /// Applies `f` to the refilled balance at `now_ms` in one compare-and-swap loop;
    /// `f` returns the new balance, or an error to leave the bucket as it is.
    fn update<T, E>(&self, now_ms: u64, f: impl Fn(i64) -> Result<(i64, T), E>) -> Result<T, E> {
        let mut s = self.state.load(Ordering::Relaxed);
        loop {
            let (next, out) = f(self.refilled(s, now_ms))?;
            match self.state.compare_exchange_weak(
                s,
                self.pack(next, now_ms),
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Ok(out),
                Err(actual) => s = actual,
            }
        }
    }

    /// Takes `cost` tokens. `Ok(remaining)` or `Err(wait_ms)` until they would exist.
    pub fn take(&self, cost: u64, now_ms: u64) -> Result<u64, u64> {
        let cost_milli = milli(cost).min(self.capacity_milli);
        let taken = self.update(now_ms, |balance| {
            if balance < cost_milli {
                let missing = (cost_milli - balance) as f64;
                return Err((missing / self.rate_milli_per_ms.max(1e-9)).ceil() as u64);
            }
            Ok((balance - cost_milli, ((balance - cost_milli) / 1000) as u64))
        });
        if taken.is_ok() {
            self.count_use(cost_milli);
        }
        taken
    }

    /// Gives back (`delta > 0`) or charges more (`delta < 0`) tokens after the fact,
    /// never below zero or above capacity.
    pub fn adjust(&self, delta: i64, now_ms: u64) {
        let delta_milli = delta.saturating_mul(1000);
        let moved: Result<i64, ()> = self.update(now_ms, |balance| {
            let next = (balance + delta_milli).clamp(balance.min(0), self.capacity_milli);
            Ok((next, next - balance))
        });
        if let Ok(moved) = moved {
            self.count_use(-moved);
        }
    }

    /// Charges `cost` tokens used elsewhere (by a peer replica of a cluster), into
    /// debt down to minus one capacity: this process then admits nothing until
    /// refills pay it, so the fleet together keeps to the limit.
    pub fn charge(&self, cost: u64, now_ms: u64) {
        let cost_milli = milli(cost);
        let _: Result<(), ()> = self.update(now_ms, |balance| {
            Ok(((balance - cost_milli).max(-self.capacity_milli), ()))
        });
    }

    /// What this process took, net of refunds, in whole tokens (0 unless built
    /// [`tracking_use`](Self::tracking_use)).
    pub fn used(&self) -> u64 {
        self.used_milli
            .as_ref()
            .map_or(0, |u| u.load(Ordering::Relaxed) / 1000)
    }

    /// A bucket refilling `per_sec` tokens a second that carries this one's use
    /// over: it starts at its own capacity less what this one lacks of its
    /// capacity at `now_ms` (never below zero). So a raised limit gives its extra
    /// room at once, and a lowered one grants no fresh burst.
    pub fn rescaled(&self, per_sec: f64, now_ms: u64) -> Bucket {
        let mut next = Bucket::new(per_sec, now_ms);
        let used = self.capacity_milli - self.refilled(self.state.load(Ordering::Relaxed), now_ms);
        let start = (next.capacity_milli - used).max(0);
        next.state
            .store(next.pack(start, now_ms), Ordering::Relaxed);
        if let Some(u) = &self.used_milli {
            next.used_milli = Some(AtomicU64::new(u.load(Ordering::Relaxed)));
        }
        next
    }

    pub fn remaining(&self, now_ms: u64) -> u64 {
        (self
            .refilled(self.state.load(Ordering::Relaxed), now_ms)
            .max(0)
            / 1000) as u64
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
    fn a_charge_from_elsewhere_runs_into_debt_that_refills_pay() {
        let b = Bucket::new(10.0, 0).tracking_use();
        b.take(4, 0).unwrap();
        b.charge(10, 0); // a peer used 10: 6 - 10 = 4 in debt
        assert_eq!(b.remaining(0), 0);
        assert_eq!(b.take(1, 0), Err(500), "the debt and the token: 5 at 10/s");
        assert_eq!(b.take(1, 499), Err(1));
        assert!(b.take(1, 500).is_ok());
        // Debt stops at one capacity; local adjustments never deepen it.
        b.charge(1_000, 500);
        assert_eq!(b.take(1, 1_500), Err(100));
        b.adjust(-3, 1_500);
        assert_eq!(b.take(1, 1_600), Ok(0));
        // Only this process's use counts, net of refunds.
        assert_eq!(b.used(), 6);
        b.adjust(2, 1_600);
        assert_eq!(b.used(), 4);
        assert_eq!(Bucket::new(10.0, 0).used(), 0, "not tracked");
        let huge = Bucket::new(10.0, 0);
        huge.charge(u64::MAX, 0);
        assert_eq!(huge.take(1, 0), Err(1_100), "one capacity of debt at most");
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
