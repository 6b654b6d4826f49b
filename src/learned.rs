//! What a shard learns about each backend's speed from its own finished requests,
//! for the cost model ([`radixgate_orchestrator::PrefixAware`]): the prefill cost per
//! uncached prompt token, and the delay each request ahead adds beyond the prefill
//! queued there.
//!
//! Both come from the time to first byte of successful responses that reported
//! `cached_tokens` (the engine's own count, so `uncached` is exact), and each is the
//! median of its last [`SAMPLES`] samples:
//!
//! - **Prefill** is learned from requests that found nothing in flight on their
//!   backend: `ttft / uncached`.
//! - **Queue** is learned from requests that found `k ≥ 1` ahead: what their wait
//!   exceeded their own prefill and the prefill queued ahead of them (at the learned
//!   rate), divided by `k`. On a simulated engine a request ahead costs a few
//!   milliseconds; on a CPU vLLM engine it costs hundreds (its decode steps share
//!   every batch the new prefill joins), and without this the cost model's fixed
//!   exchange rate let affinity pile requests onto one engine.
//!
//! A median, because one request can meet a delay that is not the engine's rate: on
//! a CPU host where two engines share a core, a 196-token prefill once took a second
//! (5.4 ms a token against the usual 0.4–0.9). A weighted mean took a fifth of that
//! sample and made the engine look three times slower than it was, after which it drew
//! no more traffic that could correct it (`radixgate-bench real`, multiturn); a decayed
//! ratio of sums was no better (2.1 ms a token). The queue cost was such a weighted
//! mean until the same trace showed it too: after stalls of seconds, three equal
//! engines had learned 966, 0 and 1,707 ms a request. The router still bounds how far
//! one backend's queue cost may stray from the others'
//! ([`radixgate_orchestrator::policy::prefix_aware::bound_queue_costs`]).
//!
//! Both are per shard, with no lock: a shard learns from what it routed. 0 means not
//! learned yet (the policy then uses its configured default).

/// Samples come only from responses with at least this many uncached prompt tokens
/// (shorter ones are dominated by fixed overheads).
pub const MIN_LEARN_TOKENS: u64 = 64;

/// How many recent samples each learned cost is the median of.
pub const SAMPLES: usize = 5;

/// The learned costs of one backend (0: not learned yet).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LearnedCost {
    /// The median of the recent prefill samples.
    pub prefill_ns_per_token: u32,
    /// The median of the recent queue samples.
    pub queue_ns_per_request: u32,
    prefill: Recent,
    queue: Recent,
}

/// One finished request, as far as learning needs it.
#[derive(Clone, Copy, Debug)]
pub struct Sample {
    pub ttft_ns: u64,
    /// Prompt tokens the engine computed (prompt less its reported cached tokens).
    pub uncached_tokens: u64,
    /// Requests in flight on the backend when this one was routed.
    pub in_flight_before: u32,
    /// Prefill tokens the gateway expected queued ahead of it then.
    pub pending_prefill_before: u32,
}

impl LearnedCost {
    /// Folds one successful request's timing in.
    pub fn learn(&mut self, s: Sample) {
        if s.uncached_tokens < MIN_LEARN_TOKENS {
            return;
        }
        match s.in_flight_before {
            0 => {
                let sample = clamp(s.ttft_ns / s.uncached_tokens);
                self.prefill_ns_per_token = self.prefill.push(sample);
            }
            // A split request's leg (`u32::MAX`) is not a whole request's wait.
            u32::MAX => {}
            ahead if self.prefill_ns_per_token > 0 => {
                let own_and_queued = u64::from(self.prefill_ns_per_token)
                    * (s.uncached_tokens + u64::from(s.pending_prefill_before));
                let sample = clamp(s.ttft_ns.saturating_sub(own_and_queued) / u64::from(ahead));
                self.queue_ns_per_request = self.queue.push(sample);
            }
            // Without a prefill rate the excess cannot be told apart.
            _ => {}
        }
    }
}

/// The last [`SAMPLES`] samples of one cost, oldest overwritten first.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Recent {
    /// 0: no sample yet (samples are stored as at least 1).
    samples: [u32; SAMPLES],
    /// Where the next sample goes.
    next: u8,
}

impl Recent {
    /// Records `sample` and returns the median of the samples held, at least 1 ns:
    /// learned to be free is not "not learned" (0).
    fn push(&mut self, sample: u32) -> u32 {
        self.samples[usize::from(self.next)] = sample.max(1);
        self.next = (self.next + 1) % SAMPLES as u8;
        let mut sorted = self.samples;
        sorted.sort_unstable();
        let taken = &sorted[sorted.iter().take_while(|&&x| x == 0).count()..];
        let n = taken.len();
        if n % 2 == 1 {
            taken[n / 2]
        } else {
            // The mean of the middle two.
            ((u64::from(taken[n / 2 - 1]) + u64::from(taken[n / 2])) / 2) as u32
        }
    }
}

fn clamp(ns: u64) -> u32 {
    ns.min(u64::from(u32::MAX)) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(ttft_ms: u64, uncached: u64, ahead: u32, pending: u32) -> Sample {
        Sample {
            ttft_ns: ttft_ms * 1_000_000,
            uncached_tokens: uncached,
            in_flight_before: ahead,
            pending_prefill_before: pending,
        }
    }

    #[test]
    fn prefill_is_learned_alone_and_queue_only_once_prefill_is_known() {
        let mut l = LearnedCost::default();
        // Two ahead before any prefill rate: nothing to learn from.
        l.learn(sample(900, 500, 2, 0));
        assert_eq!(l, LearnedCost::default());
        // Alone: 500 ms for 500 tokens = 1 ms per token.
        l.learn(sample(500, 500, 0, 0));
        assert_eq!(l.prefill_ns_per_token, 1_000_000);
        // Two ahead, 200 tokens queued before it: 500 + 200 ms of prefill, the other
        // 300 ms are the two requests ahead, 150 ms each.
        l.learn(sample(1000, 500, 2, 200));
        assert_eq!(l.queue_ns_per_request, 150_000_000);
        // A faster wait than the prefill alone learns (nearly) 0 per request; the
        // median of two is their mean.
        l.learn(sample(100, 500, 1, 0));
        assert_eq!(l.queue_ns_per_request, 75_000_000);
        // An engine where requests ahead cost nothing beyond their prefill is
        // learned as (nearly) free, never as unknown.
        let mut free = LearnedCost {
            prefill_ns_per_token: 1_000_000,
            ..LearnedCost::default()
        };
        free.learn(sample(500, 500, 3, 0));
        assert_eq!(free.queue_ns_per_request, 1);
    }

    /// The trace that motivated the median: an engine's third request met a second
    /// of delay that was not its rate.
    #[test]
    fn one_slow_request_does_not_set_the_prefill_rate() {
        let mut l = LearnedCost::default();
        l.learn(sample(118, 309, 0, 0)); // 0.38 ms a token
        assert_eq!(l.prefill_ns_per_token, 381_877);
        l.learn(sample(258, 298, 0, 0)); // 0.87: the mean of two
        assert_eq!(l.prefill_ns_per_token, (381_877 + 865_771) / 2);
        l.learn(sample(1068, 196, 0, 0)); // 5.45: an outlier
        assert_eq!(l.prefill_ns_per_token, 865_771);
        // Only the last five count: five slow samples are the engine's rate now.
        for _ in 0..SAMPLES {
            l.learn(sample(2000, 1000, 0, 0));
        }
        assert_eq!(l.prefill_ns_per_token, 2_000_000);
    }

    /// A request stuck behind a core neighbour's burst waited seconds; the queue cost
    /// stays what the other samples say.
    #[test]
    fn one_stalled_request_does_not_set_the_queue_cost() {
        let mut l = LearnedCost::default();
        l.learn(sample(500, 500, 0, 0)); // 1 ms a token
        l.learn(sample(800, 500, 1, 0)); // 300 ms a request
        l.learn(sample(850, 500, 1, 0)); // 350
        l.learn(sample(7500, 500, 1, 0)); // 7,000: the stall
        assert_eq!(l.queue_ns_per_request, 350_000_000);
    }

    #[test]
    fn short_prompts_and_split_legs_teach_nothing() {
        let mut l = LearnedCost {
            prefill_ns_per_token: 1_000,
            queue_ns_per_request: 5_000,
            ..LearnedCost::default()
        };
        let before = l;
        l.learn(sample(500, MIN_LEARN_TOKENS - 1, 0, 0));
        l.learn(sample(500, 500, u32::MAX, 0));
        assert_eq!(l, before);
    }
}
