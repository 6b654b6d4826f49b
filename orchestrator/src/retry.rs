//! Retry budget: retries may add only a bounded share of load, so a failing fleet is
//! never hit by a multiple of its traffic.
//!
//! Each original request deposits `ratio` of a token; each retry withdraws one. A
//! floor of `min_per_sec` tokens per second keeps retries possible at low traffic.
//! Tokens are capped so a quiet period cannot bank a retry storm. Each shard owns
//! one budget; time comes in as milliseconds on the caller's clock.

#[derive(Clone, Debug)]
pub struct RetryBudget {
    ratio: f64,
    min_per_sec: f64,
    cap: f64,
    tokens: f64,
    last_ms: u64,
}

impl RetryBudget {
    pub fn new(ratio: f64, min_per_sec: f64, now_ms: u64) -> Self {
        let cap = (min_per_sec * 2.0).max(10.0);
        Self {
            ratio,
            min_per_sec,
            cap,
            tokens: cap,
            last_ms: now_ms,
        }
    }

    fn refill(&mut self, now_ms: u64) {
        let elapsed = now_ms.saturating_sub(self.last_ms) as f64 / 1000.0;
        self.last_ms = self.last_ms.max(now_ms);
        self.tokens = (self.tokens + elapsed * self.min_per_sec).min(self.cap);
    }

    /// An original (not retried) request.
    pub fn deposit(&mut self, now_ms: u64) {
        self.refill(now_ms);
        self.tokens = (self.tokens + self.ratio).min(self.cap);
    }

    /// Whether a retry would be allowed now (without taking it).
    pub fn can_retry(&mut self, now_ms: u64) -> bool {
        self.refill(now_ms);
        self.tokens >= 1.0
    }

    /// Takes a retry token; false when the budget is spent.
    pub fn withdraw(&mut self, now_ms: u64) -> bool {
        if self.can_retry(now_ms) {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_share_of_requests() {
        let mut b = RetryBudget::new(0.2, 0.0, 0);
        // Spend the initial allowance.
        while b.withdraw(0) {}
        let mut retries = 0;
        for _ in 0..1000 {
            b.deposit(0);
            if b.withdraw(0) {
                retries += 1;
            }
        }
        assert_eq!(retries, 200);
    }

    #[test]
    fn floor_refills_with_time() {
        let mut b = RetryBudget::new(0.0, 10.0, 0);
        while b.withdraw(0) {}
        assert!(!b.can_retry(50));
        assert!(b.withdraw(100));
        assert!(!b.withdraw(100));
    }
}
