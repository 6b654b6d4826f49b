//! Per-backend circuit breaker: closed → open after N consecutive failures → half-open
//! (a bounded number of probes) → closed on a probe's success, open again on its
//! failure.
//!
//! The coordinator runs one [`Breaker`] per backend over the outcomes shards report,
//! and publishes the [`BreakerState`] in every fleet snapshot. Shards enforce it:
//! no traffic while open, at most `half_open_probes` requests in flight per shard
//! while half-open (never all traffic). A 5xx counts as a failure, not a success.
//! Time comes in as milliseconds on the caller's clock.

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BreakerState {
    #[default]
    Closed,
    Open,
    HalfOpen,
}

impl BreakerState {
    pub fn as_str(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::HalfOpen => "half_open",
        }
    }

    /// Gauge value: 0 closed, 1 half-open, 2 open.
    pub fn level(self) -> u8 {
        match self {
            BreakerState::Closed => 0,
            BreakerState::HalfOpen => 1,
            BreakerState::Open => 2,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BreakerConfig {
    pub failure_threshold: u32,
    pub open_ms: u64,
}

#[derive(Clone, Debug, Default)]
pub struct Breaker {
    state: BreakerState,
    consecutive_failures: u32,
    opened_at_ms: u64,
}

impl Breaker {
    pub fn state(&self) -> BreakerState {
        self.state
    }

    /// Records one request outcome; returns true when the state changed.
    pub fn on_outcome(&mut self, ok: bool, now_ms: u64, config: &BreakerConfig) -> bool {
        let before = self.state;
        match (self.state, ok) {
            (BreakerState::Closed, true) => self.consecutive_failures = 0,
            (BreakerState::Closed, false) => {
                self.consecutive_failures += 1;
                if self.consecutive_failures >= config.failure_threshold {
                    self.open(now_ms);
                }
            }
            // Stragglers sent before the breaker opened change nothing.
            (BreakerState::Open, _) => {}
            (BreakerState::HalfOpen, true) => {
                self.state = BreakerState::Closed;
                self.consecutive_failures = 0;
            }
            (BreakerState::HalfOpen, false) => self.open(now_ms),
        }
        self.state != before
    }

    /// Opens the breaker on word from elsewhere (a peer replica saw the backend fail);
    /// true on change. An open breaker stays as it is (its open time unchanged); a
    /// half-open one opens again. It half-opens after `open_ms` as usual, so word
    /// that was wrong costs at most that.
    pub fn trip(&mut self, now_ms: u64) -> bool {
        if self.state == BreakerState::Open {
            return false;
        }
        self.open(now_ms);
        true
    }

    /// Moves an open breaker to half-open once `open_ms` has passed; true on change.
    pub fn tick(&mut self, now_ms: u64, config: &BreakerConfig) -> bool {
        if self.state == BreakerState::Open
            && now_ms.saturating_sub(self.opened_at_ms) >= config.open_ms
        {
            self.state = BreakerState::HalfOpen;
            return true;
        }
        false
    }

    /// When [`Self::tick`] next has something to do.
    pub fn next_tick_ms(&self, config: &BreakerConfig) -> Option<u64> {
        (self.state == BreakerState::Open).then(|| self.opened_at_ms + config.open_ms)
    }

    fn open(&mut self, now_ms: u64) {
        self.state = BreakerState::Open;
        self.opened_at_ms = now_ms;
        self.consecutive_failures = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trip_opens_and_half_opens_after_open_ms() {
        let mut b = Breaker::default();
        assert!(b.trip(10));
        assert_eq!(b.state(), BreakerState::Open);
        assert!(!b.trip(50), "an open breaker keeps its open time");
        assert!(!b.tick(109, &CFG));
        assert!(b.tick(110, &CFG));
        assert_eq!(b.state(), BreakerState::HalfOpen);
        assert!(b.trip(120), "word from a peer re-opens a half-open breaker");
        assert!(!b.on_outcome(false, 121, &CFG), "stragglers change nothing");
    }

    const CFG: BreakerConfig = BreakerConfig {
        failure_threshold: 3,
        open_ms: 100,
    };

    #[test]
    fn full_cycle() {
        let mut b = Breaker::default();
        assert!(!b.on_outcome(false, 0, &CFG));
        assert!(!b.on_outcome(false, 1, &CFG));
        assert!(!b.on_outcome(true, 2, &CFG), "a success resets the streak");
        assert!(!b.on_outcome(false, 3, &CFG));
        assert!(!b.on_outcome(false, 4, &CFG));
        assert!(b.on_outcome(false, 5, &CFG));
        assert_eq!(b.state(), BreakerState::Open);
        assert_eq!(b.next_tick_ms(&CFG), Some(105));
        assert!(
            !b.on_outcome(true, 6, &CFG),
            "stragglers ignored while open"
        );
        assert!(!b.tick(104, &CFG));
        assert!(b.tick(105, &CFG));
        assert_eq!(b.state(), BreakerState::HalfOpen);
        assert!(b.on_outcome(false, 106, &CFG), "a failed probe reopens");
        assert_eq!(b.state(), BreakerState::Open);
        assert!(b.tick(206, &CFG));
        assert!(b.on_outcome(true, 207, &CFG), "a good probe closes");
        assert_eq!(b.state(), BreakerState::Closed);
    }
}
