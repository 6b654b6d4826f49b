//! Disaggregated serving: for a request to a split model, pick the prefill/decode
//! pair, or decide to serve it whole on one backend (conditional disaggregation).
//!
//! The gateway (`src/proxy/disagg`) fills in the prefill candidates (with the prompt
//! blocks each holds, their load and learned prefill cost) and the decode candidates
//! (in flight, the engine's running requests and KV usage, the prompt blocks each
//! holds already), and runs the legs; this module only decides:
//!
//! - **prefill server**: the least estimated time to first token under the
//!   `prefix_aware` cost model (queue ahead plus prefill of the uncached blocks), so
//!   prefix affinity and the prefill queue trade off as they do for whole requests;
//!   ties go to the longest match, then the lower slot;
//! - **decode server**: the lowest `decode_ns_per_request × (in_flight + running) +
//!   kv_usage_ns × kv_usage + transfer_ns_per_token × tokens to move`, where the
//!   tokens to move are the prompt blocks the decode server does not hold yet (engines
//!   pull only the blocks they miss);
//! - **local** instead of split, unless `always`: when the uncached part of the prompt
//!   (on the best prefill server) is below `min_uncached_tokens` — the hop would cost
//!   more than the interference it saves — or when the prefill pool is the bottleneck
//!   (its least-loaded server has `prefill_saturation` requests or more). No prefill
//!   or no decode candidate also means local; the caller decides whether local is
//!   allowed.

use crate::policy::prefix_aware::PrefixAware;
use crate::policy::{BackendIdx, Candidate, PrefixAwareConfig};

/// The knobs of pair selection (`[models.<name>.disagg]`).
#[derive(Clone, Debug, PartialEq)]
pub struct DisaggPolicy {
    /// Split whenever a pair is available (no conditional local serving).
    pub always: bool,
    /// Split only when at least this many prompt tokens are uncached on the prefill pick.
    pub min_uncached_tokens: u64,
    /// The prefill pool is the bottleneck when its least-loaded server has this many
    /// requests in flight plus queued.
    pub prefill_saturation: u32,
    /// Estimated cost of moving one token's KV to a decode server, in ns.
    pub transfer_ns_per_token: f64,
    /// What each running or in-flight request on a decode server costs a newcomer, in ns.
    pub decode_ns_per_request: f64,
    /// What a full KV cache (usage 1.0) on a decode server costs a newcomer, in ns.
    pub kv_usage_ns: f64,
}

impl Default for DisaggPolicy {
    fn default() -> Self {
        Self {
            always: false,
            min_uncached_tokens: 256,
            prefill_saturation: 16,
            transfer_ns_per_token: 1_000.0,
            decode_ns_per_request: 2_000_000.0,
            kv_usage_ns: 50_000_000.0,
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DecodeCandidate {
    pub backend: BackendIdx,
    /// Requests in flight to it, across all shards.
    pub in_flight: u32,
    /// The engine's running requests as last scraped (0 when unknown).
    pub running: u32,
    /// The engine's KV-cache usage, 0–1, as last scraped (0 when unknown).
    pub kv_usage: f32,
    /// Leading prompt blocks it holds per the prefix index.
    pub matched_blocks: u32,
}

#[derive(Clone, Copy, Debug)]
pub struct PairInput<'a> {
    pub prefill: &'a [Candidate],
    pub decode: &'a [DecodeCandidate],
    /// Complete blocks in the prompt.
    pub prompt_blocks: u32,
}

/// Why a split model's request is served whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LocalWhy {
    /// Too little of the prompt is uncached for the hop to pay.
    SmallUncached,
    /// Every prefill server is at `prefill_saturation`.
    PrefillBottleneck,
    NoPrefill,
    NoDecode,
}

impl LocalWhy {
    pub fn as_str(self) -> &'static str {
        match self {
            LocalWhy::SmallUncached => "small_uncached",
            LocalWhy::PrefillBottleneck => "prefill_bottleneck",
            LocalWhy::NoPrefill => "no_prefill",
            LocalWhy::NoDecode => "no_decode",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PairDecision {
    Split {
        prefill: BackendIdx,
        decode: BackendIdx,
        /// Leading prompt blocks the prefill pick held.
        prefill_matched: u32,
    },
    Local(LocalWhy),
}

/// Decides split or local for one request (see the module docs). `cost` is the
/// gateway's `prefix_aware` cost model (tokens per block, prefill cost, queue cost).
pub fn decide(
    policy: &DisaggPolicy,
    cost: &PrefixAwareConfig,
    input: &PairInput<'_>,
) -> PairDecision {
    let model = PrefixAware::new(cost);
    let Some(prefill) = best_prefill(&model, input) else {
        return PairDecision::Local(LocalWhy::NoPrefill);
    };
    let Some(decode) = best_decode(policy, cost.tokens_per_block, input) else {
        return PairDecision::Local(LocalWhy::NoDecode);
    };
    if !policy.always {
        let uncached_blocks = input.prompt_blocks.saturating_sub(prefill.matched_blocks);
        let uncached_tokens = (f64::from(uncached_blocks) * cost.tokens_per_block.max(0.0)) as u64;
        if uncached_tokens < policy.min_uncached_tokens {
            return PairDecision::Local(LocalWhy::SmallUncached);
        }
        let least = input
            .prefill
            .iter()
            .map(|c| u64::from(c.in_flight) + u64::from(c.engine_waiting))
            .min()
            .unwrap_or(0);
        if least >= u64::from(policy.prefill_saturation) {
            return PairDecision::Local(LocalWhy::PrefillBottleneck);
        }
    }
    PairDecision::Split {
        prefill: prefill.backend,
        decode,
        prefill_matched: prefill.matched_blocks,
    }
}

fn best_prefill<'a>(model: &PrefixAware, input: &PairInput<'a>) -> Option<&'a Candidate> {
    input.prefill.iter().min_by(|a, b| {
        let (ea, eb) = (
            model.est_ttft_ns(a, input.prompt_blocks),
            model.est_ttft_ns(b, input.prompt_blocks),
        );
        ea.total_cmp(&eb)
            .then(b.matched_blocks.cmp(&a.matched_blocks))
            .then(a.backend.cmp(&b.backend))
    })
}

/// The decode candidate's cost to a newcomer, in ns.
pub fn decode_cost(
    policy: &DisaggPolicy,
    tokens_per_block: f64,
    prompt_blocks: u32,
    c: &DecodeCandidate,
) -> f64 {
    let load = f64::from(c.in_flight) + f64::from(c.running);
    let missing = prompt_blocks.saturating_sub(c.matched_blocks);
    policy.decode_ns_per_request * load
        + policy.kv_usage_ns * f64::from(c.kv_usage.clamp(0.0, 1.0))
        + policy.transfer_ns_per_token * tokens_per_block.max(0.0) * f64::from(missing)
}

fn best_decode(
    policy: &DisaggPolicy,
    tokens_per_block: f64,
    input: &PairInput<'_>,
) -> Option<BackendIdx> {
    input
        .decode
        .iter()
        .min_by(|a, b| {
            let ca = decode_cost(policy, tokens_per_block, input.prompt_blocks, a);
            let cb = decode_cost(policy, tokens_per_block, input.prompt_blocks, b);
            ca.total_cmp(&cb).then(a.backend.cmp(&b.backend))
        })
        .map(|c| c.backend)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prefill(backend: BackendIdx, in_flight: u32, matched_blocks: u32) -> Candidate {
        Candidate {
            backend,
            in_flight,
            matched_blocks,
            ..Candidate::default()
        }
    }

    fn decode(backend: BackendIdx, in_flight: u32, kv_usage: f32, matched: u32) -> DecodeCandidate {
        DecodeCandidate {
            backend,
            in_flight,
            running: 0,
            kv_usage,
            matched_blocks: matched,
        }
    }

    fn always() -> DisaggPolicy {
        DisaggPolicy {
            always: true,
            ..DisaggPolicy::default()
        }
    }

    #[test]
    fn prefill_follows_the_prefix_until_its_queue_costs_more() {
        let cost = PrefixAwareConfig::default();
        let d = [decode(9, 0, 0.0, 0)];
        // 100 blocks × 16 tokens × 20 µs = 32 ms cold; backend 1 holds 90 blocks.
        let p = [prefill(0, 0, 0), prefill(1, 3, 90)];
        let input = PairInput {
            prefill: &p,
            decode: &d,
            prompt_blocks: 100,
        };
        assert!(matches!(
            decide(&always(), &cost, &input),
            PairDecision::Split {
                prefill: 1,
                decode: 9,
                prefill_matched: 90
            }
        ));
        // 20 requests ahead (40 ms) cost more than recomputing 90 blocks (28.8 ms).
        let p = [prefill(0, 0, 0), prefill(1, 20, 90)];
        let input = PairInput {
            prefill: &p,
            ..input
        };
        assert!(matches!(
            decide(&always(), &cost, &input),
            PairDecision::Split { prefill: 0, .. }
        ));
    }

    #[test]
    fn decode_weighs_load_kv_usage_and_transfer() {
        let policy = always();
        let cost = PrefixAwareConfig::default();
        let p = [prefill(0, 0, 0)];
        let pick = |d: &[DecodeCandidate]| match decide(
            &policy,
            &cost,
            &PairInput {
                prefill: &p,
                decode: d,
                prompt_blocks: 100,
            },
        ) {
            PairDecision::Split { decode, .. } => decode,
            other => panic!("{other:?}"),
        };
        assert_eq!(pick(&[decode(1, 4, 0.0, 0), decode(2, 1, 0.0, 0)]), 2);
        assert_eq!(pick(&[decode(1, 1, 0.9, 0), decode(2, 1, 0.1, 0)]), 2);
        // Equal load: the one that already holds the prompt needs no transfer.
        assert_eq!(pick(&[decode(1, 1, 0.0, 0), decode(2, 1, 0.0, 100)]), 2);
        // Ties go to the lower slot.
        assert_eq!(pick(&[decode(3, 0, 0.0, 0), decode(2, 0, 0.0, 0)]), 2);
    }

    #[test]
    fn conditional_serves_small_uncached_prompts_and_bottlenecks_locally() {
        let policy = DisaggPolicy::default(); // 256 tokens, saturation 16
        let cost = PrefixAwareConfig::default(); // 16 tokens per block
        let d = [decode(5, 0, 0.0, 0)];
        let input = |p: &'static [Candidate], blocks| PairInput {
            prefill: p,
            decode: &d,
            prompt_blocks: blocks,
        };
        static COLD: [Candidate; 1] = [Candidate {
            backend: 0,
            in_flight: 0,
            matched_blocks: 0,
            engine_waiting: 0,
            prefill_ns_per_token: 0,
            prefill_fixed_ns: 0,
            queue_ns_per_request: 0,
            session_home: false,
            pending_prefill_tokens: 0,
            prefill_progress_ns: 0,
            uncached_media_tokens: 0,
            cache_free_blocks: None,
            cache_blocks: 0,
            peer_queue_ns: 0,
            peers_busy: 0,
            compute_group: None,
            in_flight_blocks: 0,
            engine_used_blocks: None,
        }];
        // 15 blocks = 240 tokens < 256: local.
        assert_eq!(
            decide(&policy, &cost, &input(&COLD, 15)),
            PairDecision::Local(LocalWhy::SmallUncached)
        );
        assert!(matches!(
            decide(&policy, &cost, &input(&COLD, 16)),
            PairDecision::Split { .. }
        ));
        // A long prompt that is almost all cached on the prefill pick: local.
        static WARM: [Candidate; 1] = [Candidate {
            backend: 0,
            in_flight: 0,
            matched_blocks: 95,
            engine_waiting: 0,
            prefill_ns_per_token: 0,
            prefill_fixed_ns: 0,
            queue_ns_per_request: 0,
            session_home: false,
            pending_prefill_tokens: 0,
            prefill_progress_ns: 0,
            uncached_media_tokens: 0,
            cache_free_blocks: None,
            cache_blocks: 0,
            peer_queue_ns: 0,
            peers_busy: 0,
            compute_group: None,
            in_flight_blocks: 0,
            engine_used_blocks: None,
        }];
        assert_eq!(
            decide(&policy, &cost, &input(&WARM, 100)),
            PairDecision::Local(LocalWhy::SmallUncached)
        );
        static BUSY: [Candidate; 2] = [
            Candidate {
                backend: 0,
                in_flight: 10,
                matched_blocks: 0,
                engine_waiting: 6,
                prefill_ns_per_token: 0,
                prefill_fixed_ns: 0,
                queue_ns_per_request: 0,
                session_home: false,
                pending_prefill_tokens: 0,
                prefill_progress_ns: 0,
                uncached_media_tokens: 0,
                cache_free_blocks: None,
                cache_blocks: 0,
                peer_queue_ns: 0,
                peers_busy: 0,
                compute_group: None,
                in_flight_blocks: 0,
                engine_used_blocks: None,
            },
            Candidate {
                backend: 1,
                in_flight: 16,
                matched_blocks: 0,
                engine_waiting: 0,
                prefill_ns_per_token: 0,
                prefill_fixed_ns: 0,
                queue_ns_per_request: 0,
                session_home: false,
                pending_prefill_tokens: 0,
                prefill_progress_ns: 0,
                uncached_media_tokens: 0,
                cache_free_blocks: None,
                cache_blocks: 0,
                peer_queue_ns: 0,
                peers_busy: 0,
                compute_group: None,
                in_flight_blocks: 0,
                engine_used_blocks: None,
            },
        ];
        assert_eq!(
            decide(&policy, &cost, &input(&BUSY, 100)),
            PairDecision::Local(LocalWhy::PrefillBottleneck)
        );
        // `always` splits all of them.
        for (p, blocks) in [(&COLD, 1), (&WARM, 100)] {
            assert!(matches!(
                decide(&always(), &cost, &input(p, blocks)),
                PairDecision::Split { .. }
            ));
        }
        assert!(matches!(
            decide(&always(), &cost, &input(&BUSY, 100)),
            PairDecision::Split { .. }
        ));
    }

    #[test]
    fn missing_pools_mean_local() {
        let cost = PrefixAwareConfig::default();
        let p = [prefill(0, 0, 0)];
        let d = [decode(1, 0, 0.0, 0)];
        let none = |prefill, decode| PairInput {
            prefill,
            decode,
            prompt_blocks: 100,
        };
        assert_eq!(
            decide(&always(), &cost, &none(&[], &d)),
            PairDecision::Local(LocalWhy::NoPrefill)
        );
        assert_eq!(
            decide(&always(), &cost, &none(&p, &[])),
            PairDecision::Local(LocalWhy::NoDecode)
        );
    }
}
