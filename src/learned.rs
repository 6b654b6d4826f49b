//! What a shard learns about each backend's speed from its own finished requests,
//! for the cost model ([`radixgate_orchestrator::PrefixAware`]): the prefill cost per
//! uncached prompt token, a fixed delay every request pays before its first token, and
//! the delay each request ahead adds beyond the prefill queued there.
//!
//! All come from the time to first byte of successful responses that reported
//! `cached_tokens` (the engine's own count, so `uncached` is exact):
//!
//! - **Prefill** is learned from requests that found nothing in flight on their
//!   backend, as `ttft = fixed + ns_per_token * uncached` (the [`PrefillFit`]): the
//!   rate is the second fastest `ttft / uncached` among the last [`SAMPLES`] prompts
//!   of at least [`LONG_PROMPT_TOKENS`] uncached, the fixed part the interquartile
//!   mean of what the last [`FIT_SAMPLES`] requests of any size took beyond that rate. Until two long
//!   prompts were seen, and with `routing.prefix_aware.learn_fixed_delay = false` (the
//!   ablation), the cost is the median of `ttft / uncached` over the last [`SAMPLES`]
//!   requests with at least [`MIN_LEARN_TOKENS`] uncached, with no fixed part.
//! - **Queue** is learned from requests that found `k ≥ 1` ahead: what their wait
//!   exceeded their own fixed delay and prefill and the prefill queued ahead of them
//!   (at the learned cost), divided by `k`; the median of the last [`SAMPLES`]. On a
//!   simulated engine a request ahead costs a few milliseconds; on a CPU vLLM engine
//!   it costs hundreds (its decode steps share every batch the new prefill joins), and
//!   without this the cost model's fixed exchange rate let affinity pile requests
//!   onto one engine.
//!
//! Why (nearly) the fastest for the rate: disturbances only ever add time. A straight line
//! fitted through the samples (Theil–Sen, medians of pairwise slopes) came out at 0
//! and at 6.4 ms a token on engines whose requests met a neighbour's second about
//! half the time: pairs of a disturbed and an undisturbed request have slopes of
//! ±1 s over their difference in tokens (`radixgate-bench real`, docs).
//!
//! Why a fixed part: on a CPU host where two engines share a core, the engine whose
//! neighbour has just worked waits up to a second before its first token whatever
//! its prompt (cached prompts took 1.1 s there against 70 ms alone, cold ones 1.8 s
//! against 0.9). Read as a rate, that second made a 300-token follow-up look as slow
//! as a 2,300-token cold prefill elsewhere, and conversations left the engine holding
//! them for one that then held too many (`radixgate-bench real`, multiturn,
//! concurrency 1: engine hit rate 0.48 of the ceiling). As a fixed delay it costs the
//! same on every prompt, and the cached follow-up stays cheaper where it is cached.
//!
//! Medians, because one request can meet a delay that is not the engine's: a
//! 196-token prefill once took a second (5.4 ms a token against the usual 0.4–0.9). A
//! weighted mean took a fifth of that sample and made the engine look three times
//! slower than it was, after which it drew no more traffic that could correct it; a
//! decayed ratio of sums was no better (2.1 ms a token). The queue cost was such a
//! weighted mean until the same trace showed it too: after stalls of seconds, three
//! equal engines had learned 966, 0 and 1,707 ms a request. The router still bounds
//! how far one backend's queue cost may stray from the others'
//! ([`radixgate_orchestrator::policy::prefix_aware::bound_queue_costs`]).
//!
//! A backend that shares its compute with others (`backends[].compute_group`) learns
//! its own costs, not what sharing added: a request whose `k` sharing peers had
//! requests in flight both when it was routed and at its first token had
//! `1 / (1 + k)` of the hardware all along, and is learned as `ttft / (1 + k)`; one
//! whose peers started or finished work in between teaches nothing (what share it
//! had is unknown). The cost model adds the sharing back once, the same way, from the
//! peers busy at the decision (`PrefixAware::sharing_ns`). Learned as they were,
//! three CPU engines of which two shared a core learned 1.1–1.9 ms a token on the
//! shared core against 0.53 alone, and priced on top of that, sharing counted
//! twice. Less only the peers' queue at the decision, the two shared-core engines
//! learned 10.6 and 11.8 ms a token against 5.5 (the third, alone on its core, 5.9)
//! under least-loaded at concurrency 8, where a neighbour's work mostly began during
//! the request's own prefill (`radixgate-bench real`, multiturn).
//!
//! All are per shard, with no lock: a shard learns from what it routed. 0 means not
//! learned yet (the policy then uses its configured default).

/// The per-token ratio and the queue cost learn only from responses with at least
/// this many uncached prompt tokens (shorter ones are dominated by fixed overheads).
pub const MIN_LEARN_TOKENS: u64 = 64;

/// How many recent samples the ratio and the queue cost are the median of.
pub const SAMPLES: usize = 5;

/// How many recent requests that did not queue the prefill fit uses.
pub const FIT_SAMPLES: usize = 8;

/// A prompt with at least this many uncached tokens is long: its time per token is
/// mostly prefill, so the fastest of them bounds the engine's rate.
pub const LONG_PROMPT_TOKENS: u32 = 256;

/// The fit needs at least this many long prompts among the last [`SAMPLES`] (its
/// rate is the second fastest of them).
const MIN_LONG_PROMPTS: usize = 2;

/// The learned costs of one backend (0: not learned yet).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LearnedCost {
    /// The median of the recent `ttft / uncached` samples (no fixed part).
    pub prefill_ns_per_token: u32,
    /// The fit of recent TTFTs against uncached tokens, once the samples allow one.
    pub prefill_fit: Option<PrefillFit>,
    /// The median of the recent queue samples.
    pub queue_ns_per_request: u32,
    prefill: Recent,
    queue: Recent,
    alone: Alone,
}

/// `ttft = fixed_ns + ns_per_token * uncached`, fitted to requests that did not queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefillFit {
    /// What every request waits before its first token whatever its prompt.
    pub fixed_ns: u32,
    /// What each uncached prompt token adds (at least 1).
    pub ns_per_token: u32,
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
    /// The backends sharing its compute that had requests in flight when it was
    /// routed ([`radixgate_orchestrator::Decision::peers_busy_before`]) and at its
    /// first token.
    pub peers_busy_before: u32,
    pub peers_busy_at_first_token: u32,
}

impl Sample {
    /// The time to first token the request would have had with its compute to
    /// itself, when the gateway can tell: with `k` peers busy when it was routed and
    /// still at its first token, it had `1 / (1 + k)` of the hardware all along, so
    /// its own time is `ttft / (1 + k)`. A peer that started or finished work
    /// meanwhile took some unknown part of it: `None`, the request teaches nothing.
    fn unshared_ttft_ns(&self) -> Option<u64> {
        (self.peers_busy_before == self.peers_busy_at_first_token)
            .then(|| self.ttft_ns / (1 + u64::from(self.peers_busy_before)))
    }
}

impl LearnedCost {
    /// The prefill cost the cost model uses, `(ns per uncached token, fixed ns)`: the
    /// fit when `fixed_delay` is on and there is one, else the ratio with no fixed part.
    pub fn prefill_cost(&self, fixed_delay: bool) -> (u32, u32) {
        match self.prefill_fit {
            Some(fit) if fixed_delay => (fit.ns_per_token, fit.fixed_ns),
            _ => (self.prefill_ns_per_token, 0),
        }
    }

    /// Folds one successful request's timing in; `fixed_delay` is
    /// `routing.prefix_aware.learn_fixed_delay` (which prefill cost the queue
    /// samples are measured against).
    pub fn learn(&mut self, s: Sample, fixed_delay: bool) {
        // Costs are the backend's own: what its neighbours took is priced apart
        // (`PrefixAware::sharing_ns`), and learned into the costs too it would be
        // counted twice.
        let Some(ttft_ns) = s.unshared_ttft_ns() else {
            return;
        };
        let s = Sample { ttft_ns, ..s };
        if s.in_flight_before == 0 && s.uncached_tokens > 0 {
            self.prefill_fit = self.alone.push(clamp(s.uncached_tokens), s.ttft_ns);
        }
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
                let (ns_per_token, fixed_ns) = self.prefill_cost(fixed_delay);
                let own_and_queued = u64::from(fixed_ns)
                    + u64::from(ns_per_token)
                        * (s.uncached_tokens + u64::from(s.pending_prefill_before));
                let sample = clamp(s.ttft_ns.saturating_sub(own_and_queued) / u64::from(ahead));
                self.queue_ns_per_request = self.queue.push(sample);
            }
            // Without a prefill rate the excess cannot be told apart.
            _ => {}
        }
    }
}

/// The requests that did not queue, as the fit needs them: the last [`FIT_SAMPLES`]
/// of any size, and the per-token times of the last [`SAMPLES`] long ones.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Alone {
    uncached_tokens: [u32; FIT_SAMPLES],
    ttft_ns: [u64; FIT_SAMPLES],
    held: u8,
    next: u8,
    /// `ttft / uncached` of the last long prompts (0: none yet).
    long_ns_per_token: [u32; SAMPLES],
    next_long: u8,
}

impl Alone {
    /// Records one request and returns the fit of those held, if they allow one.
    fn push(&mut self, uncached_tokens: u32, ttft_ns: u64) -> Option<PrefillFit> {
        let i = usize::from(self.next);
        self.uncached_tokens[i] = uncached_tokens;
        self.ttft_ns[i] = ttft_ns;
        self.next = (self.next + 1) % FIT_SAMPLES as u8;
        self.held = (self.held + 1).min(FIT_SAMPLES as u8);
        if uncached_tokens >= LONG_PROMPT_TOKENS {
            let per_token = clamp(ttft_ns / u64::from(uncached_tokens)).max(1);
            self.long_ns_per_token[usize::from(self.next_long)] = per_token;
            self.next_long = (self.next_long + 1) % SAMPLES as u8;
        }
        self.fit()
    }

    /// The rate is the second fastest per-token time among the last long prompts:
    /// every disturbance (a neighbour's burst, a stall) only adds time, so the fastest
    /// are the engine's own rate plus a fixed part spread thin over many tokens; the
    /// second, because one reading of 0.003 ms a token (against 0.5) came through a
    /// real run once, and the fastest alone would have kept it. The fixed
    /// part is the interquartile mean of what the last requests took beyond that rate:
    /// the expected delay when some of them met a neighbour's second and some did not,
    /// and no stall among the top quarter moves it. `None` until [`MIN_LONG_PROMPTS`]
    /// long prompts were seen.
    fn fit(&self) -> Option<PrefillFit> {
        let mut long = self.long_ns_per_token;
        long.sort_unstable();
        let mut seen = long.iter().skip_while(|&&r| r == 0);
        // The second fastest: one reading faster than the engine can be sets nothing.
        let ns_per_token = *seen.nth(MIN_LONG_PROMPTS - 1)?;
        let n = usize::from(self.held);
        let mut left = [0.0; FIT_SAMPLES];
        for (i, l) in left.iter_mut().enumerate().take(n) {
            *l = self.ttft_ns[i] as f64
                - f64::from(ns_per_token) * f64::from(self.uncached_tokens[i]);
        }
        let fixed_ns = interquartile_mean(&mut left[..n]).max(0.0);
        Some(PrefillFit {
            fixed_ns: fixed_ns.min(f64::from(u32::MAX)) as u32,
            ns_per_token,
        })
    }
}

/// The mean of `xs` (not empty; reorders it) without its lowest and highest quarter
/// (`len / 4` values each side).
fn interquartile_mean(xs: &mut [f64]) -> f64 {
    xs.sort_unstable_by(f64::total_cmp);
    let cut = xs.len() / 4;
    let middle = &xs[cut..xs.len() - cut];
    middle.iter().sum::<f64>() / middle.len() as f64
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

    impl LearnedCost {
        fn learn_sample(&mut self, s: Sample) {
            self.learn(s, true);
        }
    }

    fn sample(ttft_ms: u64, uncached: u64, ahead: u32, pending: u32) -> Sample {
        Sample {
            ttft_ns: ttft_ms * 1_000_000,
            uncached_tokens: uncached,
            in_flight_before: ahead,
            pending_prefill_before: pending,
            peers_busy_before: 0,
            peers_busy_at_first_token: 0,
        }
    }

    /// Two engines on one core: a request whose neighbour worked all along ran at
    /// half speed and is learned as it would have run alone, so the rate is the
    /// engine's own and sharing is counted once (by the cost model, from the
    /// neighbours busy at the decision); one whose neighbour started or stopped
    /// meanwhile teaches nothing.
    #[test]
    fn what_a_neighbour_took_is_not_learned_as_the_engines_own() {
        let with_peers = |ttft_ms, before, at_first_token| Sample {
            peers_busy_before: before,
            peers_busy_at_first_token: at_first_token,
            ..sample(ttft_ms, 500, 0, 0)
        };
        // 500 tokens at 1 ms each beside a neighbour busy throughout: 1 s.
        let mut l = LearnedCost::default();
        l.learn_sample(with_peers(1000, 1, 1));
        assert_eq!(l.prefill_ns_per_token, 1_000_000);
        // Beside two: 1.5 s.
        let mut l = LearnedCost::default();
        l.learn_sample(with_peers(1500, 2, 2));
        assert_eq!(l.prefill_ns_per_token, 1_000_000);
        // Alone throughout, as before.
        let mut l = LearnedCost::default();
        l.learn_sample(with_peers(500, 0, 0));
        assert_eq!(l.prefill_ns_per_token, 1_000_000);
        // A neighbour that began or finished work meanwhile: nothing learned, the
        // rate, the fit and the queue cost alike.
        let rate_known = LearnedCost {
            prefill_ns_per_token: 1_000_000,
            ..LearnedCost::default()
        };
        let mut l = rate_known;
        l.learn_sample(with_peers(800, 0, 1));
        l.learn_sample(with_peers(800, 1, 0));
        l.learn_sample(Sample {
            peers_busy_at_first_token: 1,
            ..sample(900, 500, 2, 0)
        });
        assert_eq!(l, rate_known);
    }

    #[test]
    fn prefill_is_learned_alone_and_queue_only_once_prefill_is_known() {
        let mut l = LearnedCost::default();
        // Two ahead before any prefill rate: nothing to learn from.
        l.learn_sample(sample(900, 500, 2, 0));
        assert_eq!(l, LearnedCost::default());
        // Alone: 500 ms for 500 tokens = 1 ms per token.
        l.learn_sample(sample(500, 500, 0, 0));
        assert_eq!(l.prefill_ns_per_token, 1_000_000);
        // Two ahead, 200 tokens queued before it: 500 + 200 ms of prefill, the other
        // 300 ms are the two requests ahead, 150 ms each.
        l.learn_sample(sample(1000, 500, 2, 200));
        assert_eq!(l.queue_ns_per_request, 150_000_000);
        // A faster wait than the prefill alone learns (nearly) 0 per request; the
        // median of two is their mean.
        l.learn_sample(sample(100, 500, 1, 0));
        assert_eq!(l.queue_ns_per_request, 75_000_000);
        // An engine where requests ahead cost nothing beyond their prefill is
        // learned as (nearly) free, never as unknown.
        let mut free = LearnedCost {
            prefill_ns_per_token: 1_000_000,
            ..LearnedCost::default()
        };
        free.learn_sample(sample(500, 500, 3, 0));
        assert_eq!(free.queue_ns_per_request, 1);
    }

    /// The trace that motivated the median: an engine's third request met a second
    /// of delay that was not its rate.
    #[test]
    fn one_slow_request_does_not_set_the_prefill_rate() {
        let mut l = LearnedCost::default();
        l.learn_sample(sample(118, 309, 0, 0)); // 0.38 ms a token
        assert_eq!(l.prefill_ns_per_token, 381_877);
        l.learn_sample(sample(258, 298, 0, 0)); // 0.87: the mean of two
        assert_eq!(l.prefill_ns_per_token, (381_877 + 865_771) / 2);
        l.learn_sample(sample(1068, 196, 0, 0)); // 5.45: an outlier
        assert_eq!(l.prefill_ns_per_token, 865_771);
        // Only the last five count: five slow samples are the engine's rate now.
        for _ in 0..SAMPLES {
            l.learn_sample(sample(2000, 1000, 0, 0));
        }
        assert_eq!(l.prefill_ns_per_token, 2_000_000);
    }

    /// A request stuck behind a core neighbour's burst waited seconds; the queue cost
    /// stays what the other samples say.
    #[test]
    fn one_stalled_request_does_not_set_the_queue_cost() {
        let mut l = LearnedCost::default();
        l.learn_sample(sample(500, 500, 0, 0)); // 1 ms a token
        l.learn_sample(sample(800, 500, 1, 0)); // 300 ms a request
        l.learn_sample(sample(850, 500, 1, 0)); // 350
        l.learn_sample(sample(7500, 500, 1, 0)); // 7,000: the stall
        assert_eq!(l.queue_ns_per_request, 350_000_000);
    }

    #[test]
    fn short_prompts_and_split_legs_teach_nothing() {
        let mut l = LearnedCost {
            prefill_ns_per_token: 1_000,
            queue_ns_per_request: 5_000,
            ..LearnedCost::default()
        };
        l.learn_sample(sample(500, MIN_LEARN_TOKENS - 1, 0, 0));
        l.learn_sample(sample(500, 500, u32::MAX, 0));
        assert_eq!(
            (l.prefill_ns_per_token, l.queue_ns_per_request),
            (1_000, 5_000)
        );
        assert_eq!(l.prefill_fit, None);
    }

    /// The trace behind the fixed part: an engine whose core neighbour has just worked
    /// waits a second before any first token; about half its requests meet that.
    #[test]
    fn a_fixed_delay_is_learned_apart_from_the_rate() {
        let mut l = LearnedCost::default();
        // 0.45 ms a token, plus 50 ms undisturbed or 1,050 ms disturbed.
        let samples = [
            (950, 2_000),   // undisturbed
            (1_185, 300),   // disturbed
            (500, 1_000),   // undisturbed
            (1_095, 100),   // disturbed
            (185, 300),     // undisturbed
            (140, 200),     // undisturbed
            (1_725, 1_500), // disturbed
            (1_140, 200),   // disturbed
        ];
        for (ttft_ms, uncached) in samples {
            l.learn_sample(sample(ttft_ms, uncached, 0, 0));
        }
        // The second fastest long prompt: 500 ms over 1,000 tokens.
        let fit = l.prefill_fit.expect("two long prompts and more");
        assert_eq!(fit.ns_per_token, 500_000);
        // Beyond that rate the eight took -50, 0, 35, 40, 975, 1,035, 1,040 and 1,045
        // ms: the middle four average 521 ms, the expected delay.
        assert_eq!(fit.fixed_ns, 521_250_000);
        assert_eq!(l.prefill_cost(true), (500_000, 521_250_000));
        // As a ratio, with no fixed part, the same engine costs 1.15 ms a token (the
        // median of the last five ratios): a 100-token follow-up at 115 ms (it takes
        // 95 or 1,095) and a 2,000-token prompt at 2.3 s (it takes 0.95 or 1.95).
        let (ratio, fixed) = l.prefill_cost(false);
        assert_eq!((ratio, fixed), (1_150_000, 0));
        // The queue cost is measured past the fixed delay: 671.25 ms expected alone.
        l.learn_sample(sample(1_300, 300, 1, 0));
        assert_eq!(l.queue_ns_per_request, 628_750_000);
    }

    /// Short prompts alone give no rate: the ratio stands until two long ones came.
    #[test]
    fn the_fit_waits_for_two_long_prompts() {
        let mut l = LearnedCost::default();
        for _ in 0..FIT_SAMPLES {
            l.learn_sample(sample(50, 100, 0, 0));
        }
        l.learn_sample(sample(500, 1_000, 0, 0));
        assert_eq!(l.prefill_fit, None);
        assert_eq!(l.prefill_cost(true), (500_000, 0));
        l.learn_sample(sample(400, 800, 0, 0));
        assert_eq!(l.prefill_cost(true), (500_000, 0));
    }

    /// A stall among the samples moves neither the rate nor the fixed part.
    #[test]
    fn one_stall_does_not_move_the_fit() {
        let mut l = LearnedCost::default();
        // 50 ms + 0.5 ms a token, and one request stalled for 9 s.
        for (ttft_ms, uncached) in [
            (550, 1_000),
            (1_050, 2_000),
            (350, 600),
            (9_000, 400),
            (150, 200),
        ] {
            l.learn_sample(sample(ttft_ms, uncached, 0, 0));
        }
        let fit = l.prefill_fit.expect("a fit");
        // The second fastest long prompt, 0.55 ms a token, and beyond it -50, 0, 20,
        // 40 and 8,780 ms: the middle three average 20.
        assert_eq!(fit.ns_per_token, 550_000, "{fit:?}");
        assert_eq!(fit.fixed_ns, 20_000_000, "{fit:?}");
    }

    /// A long prompt answered faster than the engine can prefill it sets nothing.
    #[test]
    fn one_impossible_reading_does_not_set_the_rate() {
        let mut l = LearnedCost::default();
        for (ttft_ms, uncached) in [(500, 1_000), (400, 800), (3, 1_000)] {
            l.learn_sample(sample(ttft_ms, uncached, 0, 0));
        }
        assert_eq!(l.prefill_cost(true), (500_000, 0));
    }
}
