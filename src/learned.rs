//! What a shard learns about each backend's speed from its own finished requests,
//! for the cost model ([`radixgate_orchestrator::PrefixAware`]): the prefill cost per
//! uncached prompt token, and the delay each request ahead adds beyond the prefill
//! queued there.
//!
//! Both come from the time to first byte of successful responses that reported
//! `cached_tokens` (the engine's own count, so `uncached` is exact):
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
//! Each is an exponentially weighted mean (1/5 on the new sample), per shard, with no
//! lock: a shard learns from what it routed. 0 means not learned yet (the policy then
//! uses its configured default).

/// Samples come only from responses with at least this many uncached prompt tokens
/// (shorter ones are dominated by fixed overheads).
pub const MIN_LEARN_TOKENS: u64 = 64;

/// The learned costs of one backend (0: not learned yet).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LearnedCost {
    pub prefill_ns_per_token: u32,
    pub queue_ns_per_request: u32,
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
                self.prefill_ns_per_token = ewma(self.prefill_ns_per_token, sample);
            }
            // A split request's leg (`u32::MAX`) is not a whole request's wait.
            u32::MAX => {}
            ahead if self.prefill_ns_per_token > 0 => {
                let own_and_queued = u64::from(self.prefill_ns_per_token)
                    * (s.uncached_tokens + u64::from(s.pending_prefill_before));
                let sample = clamp(s.ttft_ns.saturating_sub(own_and_queued) / u64::from(ahead));
                // At least 1 ns: learned to be free is not "not learned" (0).
                self.queue_ns_per_request = ewma(self.queue_ns_per_request, sample).max(1);
            }
            // Without a prefill rate the excess cannot be told apart.
            _ => {}
        }
    }
}

fn clamp(ns: u64) -> u32 {
    ns.min(u64::from(u32::MAX)) as u32
}

/// Exponentially weighted moving average with weight 1/5 on the new sample; the
/// first sample is taken whole.
fn ewma(old: u32, sample: u32) -> u32 {
    match old {
        0 => sample,
        old => ((u64::from(old) * 4 + u64::from(sample)) / 5) as u32,
    }
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
        // A faster wait than the prefill alone learns 0 per request, averaged in.
        l.learn(sample(100, 500, 1, 0));
        assert_eq!(l.queue_ns_per_request, 120_000_000);
        // An engine where requests ahead cost nothing beyond their prefill is
        // learned as (nearly) free, never as unknown.
        let mut free = LearnedCost {
            prefill_ns_per_token: 1_000_000,
            ..LearnedCost::default()
        };
        free.learn(sample(500, 500, 3, 0));
        assert_eq!(free.queue_ns_per_request, 1);
    }

    #[test]
    fn short_prompts_and_split_legs_teach_nothing() {
        let mut l = LearnedCost {
            prefill_ns_per_token: 1_000,
            queue_ns_per_request: 5_000,
        };
        let before = l;
        l.learn(sample(500, MIN_LEARN_TOKENS - 1, 0, 0));
        l.learn(sample(500, 500, u32::MAX, 0));
        assert_eq!(l, before);
    }
}
