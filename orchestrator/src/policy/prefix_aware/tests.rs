//! Unit tests for `prefix_aware`: one situation per reason, the tie band, tie-breaking
//! by load then seed, saturation, sessions, and a hot prefix replicating. Seeds are
//! fixed, so nothing here can flake.

use super::*;
use crate::policy::{build_policy, BackendIdx, PolicyConfig, PolicyName};

const MS: f64 = 1_000_000.0;

/// A candidate holding `matched` leading blocks with `in_flight` requests in flight.
fn c(backend: BackendIdx, in_flight: u32, matched: u32) -> Candidate {
    Candidate {
        matched_blocks: matched,
        ..Candidate::new(backend, in_flight)
    }
}

fn defaults() -> PrefixAware {
    PrefixAware::new(&base())
}

/// [`defaults`] placing new prefixes by room alone, so that one policy can be asked
/// many times about the same fleet (spreading remembers its placements).
fn by_room() -> PrefixAware {
    PrefixAware::new(&PrefixAwareConfig {
        spread_new_prefixes: false,
        ..base()
    })
}

/// The configuration these tests were written against (5 ms per queued request,
/// full at 32), pinned so that tuning the defaults does not move them.
fn base() -> PrefixAwareConfig {
    PrefixAwareConfig {
        queue_ns_per_request: 5_000_000,
        saturation_inflight: 32,
        ..PrefixAwareConfig::default()
    }
}

fn pick_seeded(p: &mut PrefixAware, cands: &[Candidate], prompt_blocks: u32, seed: u64) -> Pick {
    let input = RouteInput {
        candidates: cands,
        affinity_key: Some(7),
        prompt_blocks,
        ..RouteInput::default()
    };
    p.pick(&input, &mut fastrand::Rng::with_seed(seed)).unwrap()
}

fn pick(p: &mut PrefixAware, cands: &[Candidate], prompt_blocks: u32) -> Pick {
    pick_seeded(p, cands, prompt_blocks, 0)
}

fn picked(backend: BackendIdx, reason: Reason) -> Pick {
    Pick { backend, reason }
}

/// The backends `pick` chooses over seeds 0..64, as a bitset.
fn spread(p: &mut PrefixAware, cands: &[Candidate], prompt_blocks: u32, reason: Reason) -> u64 {
    (0..64).fold(0, |seen, seed| {
        let pick = pick_seeded(p, cands, prompt_blocks, seed);
        assert_eq!(pick.reason, reason);
        seen | 1 << pick.backend
    })
}

#[test]
fn default_config() {
    assert_eq!(
        PrefixAwareConfig::default(),
        PrefixAwareConfig {
            tokens_per_block: 16.0,
            default_prefill_ns_per_token: 20_000,
            queue_ns_per_request: 2_500_000,
            min_match_blocks: 2,
            saturation_inflight: 64,
            hysteresis: 0.1,
            learned_queue_cost: true,
            eviction_weight: 0.25,
            new_prefix_slack_requests: 1,
            learned_fixed_delay: true,
            room_stale_after_ms: 60_000,
            spread_new_prefixes: true,
            price_footprint: true,
            price_cache_in_use: true,
            forget_unused_placements: true,
        }
    );
}

#[test]
fn a_learned_queue_cost_makes_affinity_yield_to_a_queue() {
    // A CPU engine: 1 ms per token to prefill, and a request ahead costs 150 ms.
    let slow = |c: Candidate| Candidate {
        prefill_ns_per_token: 1_000_000,
        queue_ns_per_request: 150_000_000,
        ..c
    };
    // The holder of 20 of 24 blocks has 3 requests ahead; an idle backend holds
    // nothing. Holder: 3 × 150 ms + 4 blocks × 16 tok × 1 ms = 514 ms; idle:
    // 24 × 16 × 1 ms = 384 ms.
    let cands = [slow(c(0, 3, 20)), slow(c(1, 0, 0))];
    let mut p = defaults();
    assert_eq!(
        pick(&mut p, &cands, 24),
        picked(1, Reason::FallbackLeastLoaded)
    );
    // At the configured 5 ms a request, the same queue is worth staying for.
    let mut fixed = PrefixAware::new(&PrefixAwareConfig {
        learned_queue_cost: false,
        ..base()
    });
    assert_eq!(
        pick(&mut fixed, &cands, 24),
        picked(0, Reason::LongestPrefix)
    );
    // One request ahead (150 + 64 = 214 ms) is worth staying for.
    let cands = [slow(c(0, 1, 20)), slow(c(1, 0, 0))];
    assert_eq!(pick(&mut p, &cands, 24), picked(0, Reason::LongestPrefix));
}

#[test]
fn est_ttft_formula() {
    let p = defaults();
    let mut x = Candidate {
        engine_waiting: 1,
        ..c(0, 3, 10)
    };
    // max(3 in flight, 1 waiting) × 5 ms + 20 missing blocks × 16 tok × 20 µs.
    assert_eq!(p.est_ttft_ns(&x, 30), 15.0 * MS + 6.4 * MS);
    x.prefill_ns_per_token = 10_000;
    assert_eq!(p.est_ttft_ns(&x, 30), 15.0 * MS + 3.2 * MS);
    // Fully cached (or an index claiming more than the prompt): queueing only.
    assert_eq!(p.est_ttft_ns(&x, 10), 15.0 * MS);
    assert_eq!(p.est_ttft_ns(&x, 4), 15.0 * MS);
    // The engine queue counts when it exceeds the gateway's own in-flight requests
    // (other clients), and is not added on top of them.
    let busy = Candidate {
        engine_waiting: 7,
        ..c(0, 3, 10)
    };
    assert_eq!(p.est_ttft_ns(&busy, 10), 35.0 * MS);
    // Queued prefill work is charged at the backend's prefill cost: 500 tokens × 10 µs.
    x.pending_prefill_tokens = 500;
    assert_eq!(p.est_ttft_ns(&x, 10), 15.0 * MS + 5.0 * MS);
    assert_eq!(p.est_ttft_ns(&x, 30), 15.0 * MS + 5.0 * MS + 3.2 * MS);
    x.pending_prefill_tokens = 0;

    let odd = PrefixAware::new(&PrefixAwareConfig {
        tokens_per_block: f64::NAN,
        ..base()
    });
    assert_eq!(odd.est_ttft_ns(&x, 30), 15.0 * MS);
    let huge = PrefixAware::new(&PrefixAwareConfig {
        tokens_per_block: 1e305,
        ..base()
    });
    assert_eq!(huge.est_ttft_ns(&x, 10), 15.0 * MS);
    assert_eq!(huge.est_ttft_ns(&x, 30), f64::INFINITY);
}

#[test]
fn fullness_counts_the_engine_queue() {
    let p = defaults();
    assert!(!p.is_full(&c(0, 31, 0)));
    assert!(p.is_full(&c(0, 32, 0)));
    let queued = Candidate {
        engine_waiting: 40,
        ..c(0, 20, 0)
    };
    assert!(p.is_full(&queued));
    // Not the sum: 20 in flight and 12 waiting is 20 requests ahead.
    let own_queue = Candidate {
        engine_waiting: 12,
        ..c(0, 20, 0)
    };
    assert!(!p.is_full(&own_queue));
}

#[test]
fn saturation_is_relative_to_the_fleet() {
    let p = defaults();
    // Full, and 1.5× the mean or more: saturated.
    assert!(p.is_saturated(&c(0, 40, 0), 20.0));
    assert!(p.is_saturated(&c(0, 32, 0), 21.0));
    // Full, but the whole fleet is as busy: still has room.
    assert!(!p.is_saturated(&c(0, 40, 0), 36.0));
    assert!(!p.is_saturated(&c(0, 32, 0), 22.0));
    // Not full: never saturated, however far above the mean.
    assert!(!p.is_saturated(&c(0, 31, 0), 1.0));
    assert_eq!(mean_load(&[c(0, 30, 0), c(1, 10, 0), c(2, 2, 0)]), 14.0);
    assert_eq!(mean_load(&[]), 0.0);
}

#[test]
fn a_busy_fleet_keeps_its_affinity() {
    let mut p = defaults();
    // Every backend is past the cap, none at 1.5× the mean: the holder keeps the
    // prompt instead of the pick degenerating into least-loaded.
    let cands = [c(0, 70, 40), c(1, 66, 0), c(2, 64, 0)];
    assert_eq!(pick(&mut p, &cands, 50), picked(0, Reason::LongestPrefix));
}

#[test]
fn queued_prefill_work_moves_a_cold_prompt() {
    let mut p = defaults();
    // Equal counts, but backend 0's queue holds 2000 tokens still to prefill (40 ms)
    // and backend 1's holds cache hits: the cold prompt goes to 1.
    let cands = [
        Candidate {
            pending_prefill_tokens: 2000,
            ..c(0, 4, 0)
        },
        Candidate {
            pending_prefill_tokens: 16,
            ..c(1, 4, 0)
        },
    ];
    let blocks = 10;
    // Both hold 2 blocks so the match is long enough to use the estimate.
    let cands = cands.map(|c| Candidate {
        matched_blocks: 2,
        ..c
    });
    assert_eq!(
        pick(&mut p, &cands, blocks),
        picked(1, Reason::LongestPrefix)
    );
}

#[test]
fn progress_on_the_queued_prefill_is_credited() {
    let p = defaults();
    // 2000 tokens queued at 20 µs = 40 ms; the head request has prefilled for 15 ms.
    let queued = Candidate {
        pending_prefill_tokens: 2000,
        ..c(0, 0, 0)
    };
    let started = Candidate {
        prefill_progress_ns: 15_000_000,
        ..queued
    };
    assert_eq!(p.pending_prefill_ns(&queued), 40.0 * MS);
    assert_eq!(p.pending_prefill_ns(&started), 25.0 * MS);
    // The prompt's own prefill (10 blocks × 16 tokens × 20 µs) is never credited.
    assert_eq!(p.est_ttft_ns(&started, 10), 25.0 * MS + 3.2 * MS);
    assert_eq!(p.queue_ns(&started), 25.0 * MS);
    // Progress that reaches the queued work: the engine is slower than its prefill
    // cost says (it would have answered), so the credit is dropped, never turned
    // into an idle backend or a negative wait.
    let over = Candidate {
        prefill_progress_ns: 40_000_000,
        ..queued
    };
    assert_eq!(p.pending_prefill_ns(&over), 40.0 * MS);
    // Beyond everything expected before a new request could start (here the 40 ms
    // queued, nothing ahead), the backend is late: its wait is what it has spent.
    let late = Candidate {
        prefill_progress_ns: 90_000_000,
        ..queued
    };
    assert_eq!(p.queue_ns(&late), 90.0 * MS);
    assert_eq!(p.est_ttft_ns(&late, 10), 90.0 * MS + 3.2 * MS);
    // With requests ahead (two at 5 ms), lateness starts only past them too.
    let busy = Candidate {
        in_flight: 2,
        prefill_progress_ns: 42_000_000,
        ..queued
    };
    assert_eq!(p.queue_ns(&busy), 50.0 * MS);
    let busy_late = Candidate {
        prefill_progress_ns: 60_000_000,
        ..busy
    };
    assert_eq!(p.queue_ns(&busy_late), 60.0 * MS);
    let nearly = Candidate {
        prefill_progress_ns: 39_000_000,
        ..queued
    };
    assert_eq!(p.pending_prefill_ns(&nearly), 1.0 * MS);
    // On schedule, however far along: never late while progress is within the work.
    assert_eq!(p.queue_ns(&nearly), 1.0 * MS);
    // Progress with nothing queued means nothing.
    let idle = Candidate {
        prefill_progress_ns: 5_000_000,
        ..c(0, 0, 0)
    };
    assert_eq!(p.est_ttft_ns(&idle, 10), 3.2 * MS);
}

#[test]
fn a_late_backend_loses_its_cached_prompts_to_an_idle_one() {
    let mut p = defaults();
    // Backend 0 holds the whole 40-block prompt but has not answered its 500 pending
    // tokens (10 ms of work, 5 ms for the request ahead) for 2 s; backend 1 is idle
    // and cold (12.8 ms of prefill).
    let stalled = Candidate {
        pending_prefill_tokens: 500,
        prefill_progress_ns: 2_000_000_000,
        ..c(0, 1, 40)
    };
    assert_eq!(
        pick(&mut p, &[stalled, c(1, 0, 0)], 40),
        picked(1, Reason::FallbackLeastLoaded)
    );
    // On time (5 ms in), it keeps them.
    let on_time = Candidate {
        prefill_progress_ns: 5_000_000,
        ..stalled
    };
    assert_eq!(
        pick(&mut p, &[on_time, c(1, 0, 0)], 40),
        picked(0, Reason::LongestPrefix)
    );
}

#[test]
fn progress_moves_a_cold_prompt_to_the_queue_nearly_done() {
    let mut p = defaults();
    // Equal queued tokens (1000 = 20 ms each); backend 1's head has run 18 ms of it.
    let cands = [
        Candidate {
            pending_prefill_tokens: 1000,
            ..c(0, 1, 0)
        },
        Candidate {
            pending_prefill_tokens: 1000,
            prefill_progress_ns: 18_000_000,
            ..c(1, 1, 0)
        },
    ];
    assert_eq!(pick(&mut p, &cands, 10), picked(1, Reason::NoMatch));
}

#[test]
fn no_match_goes_to_the_least_loaded() {
    let mut p = defaults();
    let cands = [c(0, 4, 0), c(1, 1, 0), c(2, 3, 0)];
    assert_eq!(pick(&mut p, &cands, 50), picked(1, Reason::NoMatch));
    // A prompt shorter than one block can match nothing.
    assert_eq!(pick(&mut p, &cands, 0), picked(1, Reason::NoMatch));
    // Engine queues count as load too.
    let queued = [
        c(0, 4, 0),
        Candidate {
            engine_waiting: 5,
            ..c(1, 1, 0)
        },
        c(2, 3, 0),
    ];
    assert_eq!(pick(&mut p, &queued, 50), picked(2, Reason::NoMatch));
}

#[test]
fn a_match_below_the_minimum_routes_least_loaded() {
    let mut p = defaults();
    // One block is below min_match_blocks = 2: the holder's cache does not count.
    let cands = [c(0, 3, 1), c(1, 0, 0), c(2, 2, 1)];
    assert_eq!(
        pick(&mut p, &cands, 50),
        picked(1, Reason::FallbackLeastLoaded)
    );
    // Even when the least loaded holds that block, it is a fallback, not affinity.
    let cands = [c(0, 3, 0), c(1, 0, 1)];
    assert_eq!(
        pick(&mut p, &cands, 50),
        picked(1, Reason::FallbackLeastLoaded)
    );
    // Saturated backends are not avoided here: least loaded is least loaded.
    let cands = [c(0, 40, 0), c(1, 33, 1)];
    assert_eq!(
        pick(&mut p, &cands, 50),
        picked(1, Reason::FallbackLeastLoaded)
    );
}

#[test]
fn min_match_blocks_zero_still_means_no_match() {
    let mut p = PrefixAware::new(&PrefixAwareConfig {
        min_match_blocks: 0,
        ..base()
    });
    let cands = [c(0, 3, 0), c(1, 1, 0)];
    assert_eq!(pick(&mut p, &cands, 50), picked(1, Reason::NoMatch));
    // With 0 as the minimum, one matched block is enough for affinity.
    let cands = [c(0, 0, 0), c(1, 0, 1)];
    assert_eq!(pick(&mut p, &cands, 50), picked(1, Reason::LongestPrefix));
}

#[test]
fn the_longest_prefix_wins_while_load_is_close() {
    let mut p = defaults();
    let cands = [c(0, 0, 0), c(1, 2, 40), c(2, 1, 12)];
    assert_eq!(pick(&mut p, &cands, 50), picked(1, Reason::LongestPrefix));
}

#[test]
fn load_beats_a_short_match() {
    let mut p = defaults();
    // Holder: 3 × 5 ms + 46 blocks × 0.32 ms = 29.72 ms; idle: 50 × 0.32 = 16 ms,
    // band up to 18.6 ms.
    let cands = [c(0, 3, 4), c(1, 0, 0)];
    assert_eq!(
        pick(&mut p, &cands, 50),
        picked(1, Reason::FallbackLeastLoaded)
    );
}

#[test]
fn a_spill_into_a_full_cache_pays_for_what_it_evicts() {
    // As in the exchange-rate test: a 100-block prompt whose 96-block document backend
    // 0 holds. With room on backend 1, the seventh request ahead spills; when backend
    // 1's cache is full, the spill would evict 100 blocks (+8 ms at a quarter of their
    // 32 ms prefill), so the holder keeps it up to eight ahead; with room for half the
    // prompt, up to seven.
    let mut p = defaults();
    let target = |free| Candidate {
        cache_free_blocks: free,
        ..c(1, 0, 0)
    };
    for (free, keeps_up_to) in [(None, 6), (Some(100), 6), (Some(50), 7), (Some(0), 8)] {
        for ahead in 0..=keeps_up_to {
            let cands = [c(0, ahead, 96), target(free)];
            assert_eq!(
                pick(&mut p, &cands, 100),
                picked(0, Reason::LongestPrefix),
                "free {free:?}, {ahead} ahead"
            );
        }
        let cands = [c(0, keeps_up_to + 1, 96), target(free)];
        assert_eq!(
            pick(&mut p, &cands, 100),
            picked(1, Reason::FallbackLeastLoaded),
            "free {free:?}"
        );
    }
    // Ranking only: the TTFT estimate admission uses does not include it.
    assert_eq!(
        p.est_ttft_ns(&target(Some(0)), 100),
        p.est_ttft_ns(&target(None), 100)
    );
    assert_eq!(p.eviction_ns(&target(Some(0)), 100), 8.0 * MS);
    assert_eq!(p.eviction_ns(&target(Some(100)), 100), 0.0);
    assert_eq!(p.eviction_ns(&c(0, 0, 96), 100), 0.0);

    // The ablation: at weight 0 a full cache is priced like an empty one, so the
    // holder keeps the prompt only up to six ahead, as without cache room known.
    let mut off = PrefixAware::new(&PrefixAwareConfig {
        eviction_weight: 0.0,
        ..base()
    });
    assert_eq!(off.eviction_ns(&target(Some(0)), 100), 0.0);
    let cands = [c(0, 7, 96), target(Some(0))];
    assert_eq!(
        pick(&mut off, &cands, 100),
        picked(1, Reason::FallbackLeastLoaded)
    );
    for bad in [-1.0, f64::NAN, f64::INFINITY] {
        let p = PrefixAware::new(&PrefixAwareConfig {
            eviction_weight: bad,
            ..base()
        });
        assert_eq!(p.eviction_ns(&target(Some(0)), 100), 0.0, "{bad}");
    }
}

#[test]
fn the_documented_exchange_rate() {
    // A 6 KB document (96 blocks) plus a 4-block question: the holder keeps it with up
    // to six more requests than an idle backend, and the seventh spills.
    let mut p = defaults();
    for ahead in 0..=6 {
        let cands = [c(0, ahead, 96), c(1, 0, 0)];
        assert_eq!(pick(&mut p, &cands, 100), picked(0, Reason::LongestPrefix));
    }
    let cands = [c(0, 7, 96), c(1, 0, 0)];
    assert_eq!(
        pick(&mut p, &cands, 100),
        picked(1, Reason::FallbackLeastLoaded)
    );
    // Relative to the other backends' load, not absolute.
    let cands = [c(0, 11, 96), c(1, 5, 0)];
    assert_eq!(pick(&mut p, &cands, 100), picked(0, Reason::LongestPrefix));
}

#[test]
fn a_saturated_holder_spills() {
    let mut p = defaults();
    let cands = [c(0, 32, 40), c(1, 5, 0), c(2, 1, 0)];
    assert_eq!(
        pick(&mut p, &cands, 50),
        picked(2, Reason::SpilledFromSaturated)
    );
    // Saturated by the engine's own queue.
    let queued = [
        Candidate {
            engine_waiting: 40,
            ..c(0, 2, 40)
        },
        c(1, 5, 0),
    ];
    assert_eq!(
        pick(&mut p, &queued, 50),
        picked(1, Reason::SpilledFromSaturated)
    );
    // A holder of a shorter prefix is preferred as the spill target.
    let cands = [c(0, 32, 40), c(1, 1, 20), c(2, 0, 0)];
    assert_eq!(
        pick(&mut p, &cands, 50),
        picked(1, Reason::SpilledFromSaturated)
    );
}

#[test]
fn an_unsaturated_holder_takes_it_when_another_is_saturated() {
    let mut p = defaults();
    let cands = [c(0, 32, 40), c(1, 2, 40), c(2, 0, 0)];
    assert_eq!(pick(&mut p, &cands, 50), picked(1, Reason::LongestPrefix));
}

#[test]
fn everyone_saturated_decides_by_the_estimate() {
    let mut p = defaults();
    // With a cap of 0 every backend is full, and on an idle fleet every one is at
    // 1.5× the mean of 0: none has room, so all compete on the estimate.
    let mut zero = PrefixAware::new(&PrefixAwareConfig {
        saturation_inflight: 0,
        ..base()
    });
    let cands = [c(0, 0, 40), c(1, 0, 0), c(2, 0, 0)];
    assert_eq!(
        pick(&mut zero, &cands, 50),
        picked(0, Reason::LongestPrefix)
    );
    // The holder's queued prefill (5000 tokens, 100 ms) outweighs its match: a
    // shorter holder takes it, reported as a spill.
    let cands = [
        Candidate {
            pending_prefill_tokens: 5000,
            ..c(0, 0, 40)
        },
        c(1, 0, 30),
        c(2, 0, 0),
    ];
    assert_eq!(
        pick(&mut zero, &cands, 50),
        picked(1, Reason::SpilledFromSaturated)
    );
    // Among equals, the least loaded by seed.
    assert_eq!(
        spread(
            &mut p,
            &[c(0, 0, 0), c(1, 0, 0), c(2, 5, 0)],
            50,
            Reason::NoMatch
        ),
        0b011
    );
}

#[test]
fn session_affinity_is_honoured_unless_saturated() {
    let mut p = defaults();
    let home = |in_flight| Candidate {
        session_home: true,
        ..c(2, in_flight, 0)
    };
    // The home wins over a long cached prefix and over an idle backend.
    let cands = [c(0, 0, 0), c(1, 1, 40), home(20)];
    assert_eq!(pick(&mut p, &cands, 50), picked(2, Reason::SessionAffinity));
    // Saturated: the ordinary rules apply.
    let cands = [c(0, 0, 0), c(1, 1, 40), home(32)];
    assert_eq!(pick(&mut p, &cands, 50), picked(1, Reason::LongestPrefix));
    let cands = [c(0, 0, 0), c(1, 1, 0), home(32)];
    assert_eq!(pick(&mut p, &cands, 50), picked(0, Reason::NoMatch));
    // Saturated by the engine queue.
    let queued = Candidate {
        engine_waiting: 40,
        ..home(2)
    };
    assert_eq!(
        pick(&mut p, &[c(0, 0, 0), queued], 50),
        picked(0, Reason::NoMatch)
    );
}

#[test]
fn ties_go_to_the_least_loaded_then_the_rng() {
    let mut p = defaults();
    // Two holders of the same prefix: the less loaded one.
    let cands = [c(0, 3, 40), c(1, 1, 40), c(2, 9, 0)];
    assert_eq!(pick(&mut p, &cands, 50), picked(1, Reason::LongestPrefix));
    // Equally loaded holders share the work by seed, and the non-holder never gets it.
    let cands = [c(0, 2, 40), c(1, 2, 40), c(2, 0, 0), c(3, 2, 40)];
    assert_eq!(spread(&mut p, &cands, 50, Reason::LongestPrefix), 0b1011);
    // The same seed replays the same pick.
    assert_eq!(
        pick_seeded(&mut p, &cands, 50, 42),
        pick_seeded(&mut p, &cands, 50, 42)
    );
    // Without matches: the least loaded ones, by seed.
    let cands = [c(0, 1, 0), c(1, 4, 0), c(2, 1, 0), c(3, 1, 0)];
    assert_eq!(spread(&mut p, &cands, 50, Reason::NoMatch), 0b1101);
}

#[test]
fn equal_loads_go_to_the_most_free_cache_room() {
    let mut p = by_room();
    let room = |backend, in_flight, matched, free| Candidate {
        cache_free_blocks: free,
        ..c(backend, in_flight, matched)
    };
    // An idle fleet and a new prefix: the cache with the most room, whatever the seed.
    let cands = [
        room(0, 0, 0, Some(10)),
        room(1, 0, 0, Some(300)),
        room(2, 0, 0, None),
    ];
    assert_eq!(spread(&mut p, &cands, 50, Reason::NoMatch), 0b010);
    // Load still comes first.
    let cands = [room(0, 0, 0, Some(10)), room(1, 2, 0, Some(300))];
    assert_eq!(pick(&mut p, &cands, 50), picked(0, Reason::NoMatch));
    // Between equally loaded holders of the same match, too; and equal rooms are
    // still shared by seed.
    let cands = [
        room(0, 1, 40, Some(5)),
        room(1, 1, 40, Some(80)),
        room(2, 0, 0, Some(900)),
    ];
    assert_eq!(spread(&mut p, &cands, 50, Reason::LongestPrefix), 0b010);
    let cands = [room(0, 1, 40, Some(80)), room(1, 1, 40, Some(80))];
    assert_eq!(spread(&mut p, &cands, 50, Reason::LongestPrefix), 0b011);
}

#[test]
fn a_new_prefix_goes_to_the_most_room_within_one_request_of_the_soonest() {
    let mut p = by_room();
    let room = |backend, in_flight, free| Candidate {
        cache_free_blocks: Some(free),
        ..c(backend, in_flight, 0)
    };
    // One request more than the idlest (5 ms here) is close enough to go by room;
    // two are not.
    let cands = [room(0, 0, 10), room(1, 1, 300), room(2, 2, 900)];
    assert_eq!(pick(&mut p, &cands, 50), picked(1, Reason::NoMatch));
    // A learned cost per request sets the width: at 300 ms a request, an engine
    // with one request ahead is within it, and one with 60 ms of prefill queued
    // besides is not.
    let learned = |b, in_flight, pending, free| Candidate {
        queue_ns_per_request: 300_000_000,
        prefill_ns_per_token: 200_000,
        pending_prefill_tokens: pending,
        ..room(b, in_flight, free)
    };
    let cands = [
        learned(0, 0, 0, 100),
        learned(1, 1, 0, 400),
        learned(2, 1, 300, 900),
    ];
    assert_eq!(pick(&mut p, &cands, 50), picked(1, Reason::NoMatch));
}

#[test]
fn new_conversations_spread_over_the_caches_when_one_engine_is_always_idle() {
    // The fast engine (1) has answered by the time each new conversation arrives;
    // the other two are each still busy with one request. Every conversation of 16
    // blocks is placed by free room within one request's wait, so the fast engine
    // does not collect them all (it had five of eight on a real fleet, and they
    // evicted each other as they grew).
    let mut p = defaults();
    let mut free = [512u32; 3];
    let mut placed = [0u32; 3];
    for seed in 0..9 {
        let cands: Vec<Candidate> = (0..3)
            .map(|b| Candidate {
                cache_free_blocks: Some(free[b]),
                ..c(b, u32::from(b != 1), 0)
            })
            .collect();
        let chosen = pick_seeded(&mut p, &cands, 16, seed).backend;
        placed[chosen] += 1;
        free[chosen] -= 16;
    }
    assert_eq!(placed, [3, 3, 3]);
}

#[test]
fn within_the_band_the_longest_match_beats_a_lower_estimate() {
    // Idle backend: 100 × 0.32 ms = 32 ms. Holder of 30: 5 ms × L + 22.4 ms.
    let config = |hysteresis| PrefixAwareConfig {
        hysteresis,
        ..base()
    };
    let mut wide = PrefixAware::new(&config(0.2)); // band up to 32 × 1.2 + 1 = 39.4 ms
    let mut none = PrefixAware::new(&config(0.0)); // band up to 33 ms
    let at = |l| [c(0, 0, 0), c(1, l, 30)];
    // L = 2: 32.4 ms, a tie in both (the 1 ms floor covers the 0.4 ms).
    assert_eq!(
        pick(&mut wide, &at(2), 100),
        picked(1, Reason::LongestPrefix)
    );
    assert_eq!(
        pick(&mut none, &at(2), 100),
        picked(1, Reason::LongestPrefix)
    );
    // L = 3: 37.4 ms, a tie only in the 20% band.
    assert_eq!(
        pick(&mut wide, &at(3), 100),
        picked(1, Reason::LongestPrefix)
    );
    assert_eq!(
        pick(&mut none, &at(3), 100),
        picked(0, Reason::FallbackLeastLoaded)
    );
    // L = 4: 42.4 ms, outside both.
    assert_eq!(
        pick(&mut wide, &at(4), 100),
        picked(0, Reason::FallbackLeastLoaded)
    );
    // Negative or NaN hysteresis counts as none.
    for odd in [-1.0, f64::NAN] {
        let mut p = PrefixAware::new(&config(odd));
        assert_eq!(
            pick(&mut p, &at(3), 100),
            picked(0, Reason::FallbackLeastLoaded)
        );
    }
}

#[test]
fn the_floor_keeps_tiny_estimates_a_tie() {
    let mut p = PrefixAware::new(&PrefixAwareConfig {
        hysteresis: 0.0,
        ..base()
    });
    let slow = |prefill, matched| Candidate {
        prefill_ns_per_token: prefill,
        ..c(0, 0, matched)
    };
    let fast = Candidate {
        prefill_ns_per_token: 10_000,
        ..c(1, 0, 8)
    };
    // The holder of 10/12 on a slow engine: 2 × 16 × 40 µs = 1.28 ms; the holder of
    // 8/12 on a fast one: 4 × 16 × 10 µs = 0.64 ms. Within 1 ms: the longer match.
    assert_eq!(
        pick(&mut p, &[slow(40_000, 10), fast], 12),
        picked(0, Reason::LongestPrefix)
    );
    // 60 µs per token: 1.92 ms, more than 1 ms behind: the faster engine.
    assert_eq!(
        pick(&mut p, &[slow(60_000, 10), fast], 12),
        picked(1, Reason::FallbackLeastLoaded)
    );
    // Everything cached everywhere (all estimates 0): still a tie, spread by seed.
    let cands = [c(0, 0, 12), c(1, 0, 12), c(2, 0, 12)];
    assert_eq!(spread(&mut p, &cands, 12, Reason::LongestPrefix), 0b111);
}

#[test]
fn a_hot_prefix_replicates_instead_of_piling_up() {
    // One 96-block document asked about 100 times, nothing completing: the gateway
    // records each pick as a holder, as it inserts the prompt's blocks.
    let mut p = defaults();
    let mut rng = fastrand::Rng::with_seed(11);
    let mut cands: Vec<Candidate> = (0..4).map(|b| Candidate::new(b, 0)).collect();
    let mut reasons = Vec::new();
    let mut order = Vec::new();
    for _ in 0..100 {
        let input = RouteInput {
            candidates: &cands,
            affinity_key: Some(1),
            prompt_blocks: 100,
            ..RouteInput::default()
        };
        let Pick { backend, reason } = p.pick(&input, &mut rng).unwrap();
        reasons.push(reason);
        if !order.contains(&backend) {
            order.push(backend);
        }
        cands[backend].in_flight += 1;
        cands[backend].matched_blocks = 96;
    }
    // Seven to the first holder, then load beats affinity and a second backend
    // becomes a holder; and so on until all four hold it.
    assert_eq!(reasons[0], Reason::NoMatch);
    for start in [7, 14, 21] {
        assert_eq!(reasons[start], Reason::FallbackLeastLoaded);
        assert!(reasons[start + 1..start + 7]
            .iter()
            .all(|&r| r == Reason::LongestPrefix));
    }
    assert_eq!(order.len(), 4);
    // From then on ties between holders go to the least loaded: loads stay level.
    assert!(reasons[21..]
        .iter()
        .skip(1)
        .all(|&r| r == Reason::LongestPrefix));
    assert!(cands.iter().all(|c| c.in_flight == 25), "{cands:?}");
}

#[test]
fn no_candidates_no_pick() {
    let mut p = defaults();
    let input = RouteInput {
        candidates: &[],
        affinity_key: None,
        prompt_blocks: 10,
        ..RouteInput::default()
    };
    assert_eq!(p.pick(&input, &mut fastrand::Rng::with_seed(0)), None);
}

#[test]
fn the_factory_passes_the_prefix_config() {
    let config = PolicyConfig {
        prefix: PrefixAwareConfig {
            min_match_blocks: 50,
            ..base()
        },
        ..PolicyConfig::default()
    };
    let mut policy = build_policy(PolicyName::PrefixAware, &config);
    assert_eq!(policy.name(), PolicyName::PrefixAware);
    let cands = [c(0, 0, 0), c(1, 1, 40)];
    let input = RouteInput {
        candidates: &cands,
        affinity_key: None,
        prompt_blocks: 60,
        ..RouteInput::default()
    };
    let pick = policy.pick(&input, &mut fastrand::Rng::with_seed(0));
    assert_eq!(pick, Some(picked(0, Reason::FallbackLeastLoaded)));
}

#[test]
fn learned_queue_costs_are_bounded_around_their_median() {
    let with = |costs: &[u32]| -> Vec<u32> {
        let mut cands: Vec<Candidate> = costs
            .iter()
            .enumerate()
            .map(|(b, &q)| Candidate {
                queue_ns_per_request: q,
                ..c(b, 0, 0)
            })
            .collect();
        bound_queue_costs(&mut cands);
        cands.iter().map(|c| c.queue_ns_per_request).collect()
    };
    // The median of the learned three is 966: "free" is raised to 966 / 1.5, the
    // 1,707 lowered to 966 × 1.5, and the one not learned yet takes the median.
    assert_eq!(with(&[966, 1, 1707, 0]), [966, 644, 1449, 966]);
    assert_eq!(with(&[100, 110, 1000]), [100, 110, 165]);
    // None learned: the configured default stays in charge.
    assert_eq!(with(&[0, 0]), [0, 0]);
    // One learned: everyone is priced like it.
    assert_eq!(with(&[0, 40, 0]), [40, 40, 40]);
}

#[test]
fn a_backend_not_learned_yet_is_priced_like_the_learned_ones() {
    // The trace in `lend_learned_prefill_costs`' docs: two engines learned 5.9 and
    // 5.6 ms a token (82 and 93 ms fixed); the third has learned nothing. The first
    // holds half of a 4-block prompt.
    let learned = [(5_900_000, 82_000_000), (5_600_000, 93_000_000), (0, 0)];
    let cands = || -> Vec<Candidate> {
        learned
            .iter()
            .enumerate()
            .map(|(b, &(rate, fixed))| Candidate {
                prefill_ns_per_token: rate,
                prefill_fixed_ns: fixed,
                ..c(b, 0, if b == 0 { 2 } else { 0 })
            })
            .collect()
    };
    let mut lent = cands();
    lend_learned_prefill_costs(&mut lent);
    let costs: Vec<(u32, u32)> = lent
        .iter()
        .map(|c| (c.prefill_ns_per_token, c.prefill_fixed_ns))
        .collect();
    // The median of two is the higher (index n / 2), rate and fixed delay each.
    assert_eq!(
        costs,
        [learned[0], learned[1], (5_900_000, 93_000_000)],
        "learned costs stay, the unlearned one borrows"
    );
    // At the default the unlearned engine looks free and takes the prompt away from
    // the engine that holds half of it; priced like its peers, it does not.
    assert_eq!(pick(&mut defaults(), &cands(), 4).backend, 2);
    assert_eq!(pick(&mut defaults(), &lent, 4).backend, 0);
    // None learned, or all: nothing changes.
    let mut none: Vec<Candidate> = (0..3).map(|b| c(b, 0, 0)).collect();
    lend_learned_prefill_costs(&mut none);
    assert!(none.iter().all(|c| c.prefill_ns_per_token == 0));
    let mut all = lent.clone();
    lend_learned_prefill_costs(&mut all);
    assert_eq!(all, lent);
}

#[test]
fn bounded_queue_costs_spread_new_conversations_over_equal_engines() {
    // Three equal engines (0.5 ms a token) whose learned queue costs strayed as in
    // the trace `bound_queue_costs` describes: 966, ~0 and 1,707 ms a request. Eight
    // new ~300-token conversations arrive at once.
    let learned = [966_000_000, 1, 1_707_000_000];
    let place = |bound: bool| {
        let mut p = by_room();
        let mut in_flight = [0u32; 3];
        let mut pending = [0u32; 3];
        for seed in 0..8 {
            let mut cands: Vec<Candidate> = (0..3)
                .map(|b| Candidate {
                    prefill_ns_per_token: 500_000,
                    queue_ns_per_request: learned[b],
                    pending_prefill_tokens: pending[b],
                    ..c(b, in_flight[b], 0)
                })
                .collect();
            if bound {
                bound_queue_costs(&mut cands);
            }
            let chosen = pick_seeded(&mut p, &cands, 19, seed).backend;
            in_flight[chosen] += 1;
            pending[chosen] += 300;
        }
        in_flight
    };
    // Unbounded, the "free" engine takes nearly all of them.
    assert!(place(false)[1] >= 6, "{:?}", place(false));
    // Bounded, none takes more than three.
    let spread = place(true);
    assert!(spread.iter().all(|&n| n <= 3), "{spread:?}");
}

/// Places eight new conversations of `prompt_blocks` blocks, of which every engine
/// holds the first `shared`, on three idle engines with 100, 100 and 400 blocks of
/// cache room (each takes its new blocks from its engine's room). Returns how many
/// each engine took and the reasons given.
fn place_eight(p: &mut PrefixAware, shared: u32, prompt_blocks: u32) -> ([u32; 3], Vec<Reason>) {
    let mut free = [100u32, 100, 400];
    let mut placed = [0u32; 3];
    let mut reasons = Vec::new();
    for seed in 0..8 {
        let cands: Vec<Candidate> = (0..3)
            .map(|b| Candidate {
                cache_free_blocks: Some(free[b]),
                ..c(b, 0, shared)
            })
            .collect();
        let pick = pick_seeded(p, &cands, prompt_blocks, seed);
        free[pick.backend] -= prompt_blocks - shared;
        placed[pick.backend] += 1;
        reasons.push(pick.reason);
    }
    (placed, reasons)
}

#[test]
fn new_prefixes_spread_by_count_before_room() {
    // Three idle engines; engine 2's cache has far more room. By room alone, all
    // eight new conversations go there (they are 7 blocks each now and grow at every
    // turn); counted, they spread 3/3/2 and the room decides only among equals.
    let place = |mut p: PrefixAware| place_eight(&mut p, 0, 7).0;
    assert_eq!(place(by_room()), [0, 0, 8]);
    let mut spread = place(defaults());
    assert_eq!(
        spread[2], 3,
        "the roomiest engine takes the third of each round"
    );
    spread.sort_unstable();
    assert_eq!(spread, [2, 3, 3]);
}

#[test]
fn recent_placements_fade() {
    let mut r = RecentPlacements::default();
    assert_eq!(r.placed(5), 0);
    r.record(1, &[], 0, 0);
    assert_eq!((r.placed(0), r.placed(1)), (0, 1));
    // Sixteen placements elsewhere later, the one on backend 1 counts as 0.36:
    // rounded, none.
    for _ in 0..16 {
        r.record(0, &[], 0, 0);
    }
    assert_eq!(r.placed(1), 0);
    assert!(r.placed(0) >= 9);
}

/// Conversation `k`'s prompt at `blocks` blocks, as chained hashes: every turn
/// repeats the earlier ones, so it extends the prompts before it.
fn conversation(k: u64, blocks: u64) -> Vec<u64> {
    (0..blocks).map(|b| k * 1_000 + b).collect()
}

/// `p`'s pick among `cands` for conversation `k`'s prompt at `blocks` blocks, at
/// `now_ms`, ties broken by `seed`.
fn pick_turn(
    p: &mut PrefixAware,
    cands: &[Candidate],
    (k, blocks): (u64, u64),
    now_ms: u64,
    seed: u64,
) -> Pick {
    let input = RouteInput {
        candidates: cands,
        prompt_blocks: blocks as u32,
        prompt: &conversation(k, blocks),
        now_ms,
        ..RouteInput::default()
    };
    p.pick(&input, &mut fastrand::Rng::with_seed(seed)).unwrap()
}

/// Conversation 1 placed on backend 1 and conversation 2 on backend 0, at 0 ms.
fn two_conversations() -> RecentPlacements {
    let mut r = RecentPlacements::default();
    r.record(1, &conversation(1, 5), 0, 0);
    r.record(0, &conversation(2, 5), 0, 0);
    r
}

/// The placements in use on backends 0 and 1 at `now_ms`.
fn counted(r: &mut RecentPlacements, now_ms: u64) -> (u32, u32) {
    r.count(now_ms);
    (r.placed(0), r.placed(1))
}

#[test]
fn a_placement_counts_while_its_prefix_is_used() {
    // A turn every second.
    let mut r = two_conversations();
    for turn in 1..=4 {
        r.observe(&conversation(1, 5 + 5 * turn), turn * 1_000);
        r.observe(&conversation(2, 5 + 5 * turn), turn * 1_000);
    }
    assert_eq!(counted(&mut r, 4_000), (1, 1));
    // Conversation 1 ends; 2 goes on. Three gaps after its last turn, 1 still counts;
    // past that it is over.
    for turn in 5..=7 {
        r.observe(&conversation(2, 5 + 5 * turn), turn * 1_000);
    }
    assert_eq!(counted(&mut r, 7_000), (1, 1));
    assert_eq!(counted(&mut r, 7_001), (1, 0));
    // A request about something else says nothing of either, nor one that shares
    // only the first blocks (a chat template) with conversation 1's first turn.
    r.observe(&conversation(3, 9), 7_002);
    let same_template = [1_000, 1_001, 1_002, 3_003, 3_004];
    r.observe(&same_template, 7_002);
    assert_eq!(counted(&mut r, 7_002), (1, 0));
}

#[test]
fn once_its_last_request_ended_a_placement_counts_for_the_clients_think_time() {
    // A turn every 2 s: each turn takes 1.9 s (queue, prefill, decode) and the
    // client sends the next 100 ms after the last one ended.
    let mut r = two_conversations();
    for turn in 1..=4u64 {
        for c in [1, 2] {
            let last = conversation(c, 5 * turn);
            r.ended(prompt_tail(&last), turn * 2_000 - 100);
            r.observe(&conversation(c, 5 + 5 * turn), turn * 2_000);
        }
    }
    // In flight, each counts whatever the time (here, its gaps decide: 3 x 2 s).
    assert_eq!(counted(&mut r, 13_999), (1, 1));
    // Conversation 1's last turn ends at 9.9 s; 2 goes on. Think time is floored at
    // THINK_FLOOR_MS: 1 counts for three of those after its end, then it is over,
    // 4 s before its gaps alone would have said so.
    r.ended(prompt_tail(&conversation(1, 25)), 9_900);
    let over = 9_900 + (IN_USE_GAPS * THINK_FLOOR_MS) as u64;
    assert_eq!(counted(&mut r, over), (1, 1));
    assert_eq!(counted(&mut r, over + 1), (1, 0));
    // An end names the request by its prompt's tail: another prompt's end, or an
    // earlier turn's, says nothing of conversation 2's turn in flight.
    r.ended(prompt_tail(&conversation(3, 9)), over);
    r.ended(prompt_tail(&conversation(2, 20)), over);
    assert_eq!(counted(&mut r, over + 1), (1, 0));
    // A client that thinks for 5 s between turns: its placement counts for three
    // of those after each end.
    let mut r = RecentPlacements::default();
    r.record(0, &conversation(4, 5), 0, 0);
    r.ended(prompt_tail(&conversation(4, 5)), 1_000);
    r.observe(&conversation(4, 10), 6_000);
    r.ended(prompt_tail(&conversation(4, 10)), 7_000);
    r.count(22_000);
    assert_eq!(r.placed(0), 1);
    r.count(22_001);
    assert_eq!(r.placed(0), 0);
}

#[test]
fn kept_unused_a_placement_counts_until_others_displace_it() {
    let mut r = RecentPlacements {
        keep_unused: true,
        ..RecentPlacements::default()
    };
    r.record(1, &conversation(1, 5), 0, 0);
    r.record(0, &conversation(2, 5), 0, 0);
    for turn in 1..=9 {
        r.observe(&conversation(2, 5 + 5 * turn), turn * 1_000);
    }
    r.count(9_000);
    assert_eq!((r.placed(0), r.placed(1)), (1, 1));
}

#[test]
fn a_conversation_that_leaves_its_backend_takes_its_count_along() {
    let mut r = RecentPlacements::default();
    r.record(0, &conversation(1, 5), 0, 0);
    // Its next turn goes to backend 2, which held none of it.
    r.record(2, &conversation(1, 10), 0, 1_000);
    assert_eq!((r.placed(0), r.placed(2)), (0, 1));
}

#[test]
fn conversations_that_have_ended_do_not_crowd_their_engine() {
    // The trace: engine 1 (idle) was given four conversations and engine 0 two, a
    // turn every second; at 45 blocks each, five fill engine 1's 179-block cache.
    // Engine 0 has two requests in flight. When engine 1's conversations go on, a
    // fifth there would overflow it and the new one goes to engine 0; once they have
    // ended (their last turn 4.5 s ago), engine 1 takes it.
    let new_conversation_goes_to = |engine_1_ended: bool| {
        let mut p = PrefixAware::new(&PrefixAwareConfig {
            tokens_per_block: 10.0,
            ..base()
        });
        for _ in 0..PROMPT_SIZES_KEPT {
            p.prompt_sizes.record(45);
        }
        let on = |k: u64| if k <= 4 { 1 } else { 0 };
        for k in 1..=6 {
            p.recent_new_prefixes
                .record(on(k), &conversation(k, 5), 0, 0);
        }
        for turn in 1..=9 {
            for k in 1..=6 {
                if on(k) == 1 && engine_1_ended && turn > 5 {
                    continue;
                }
                let blocks = (5 + 5 * turn).min(45);
                p.recent_new_prefixes
                    .observe(&conversation(k, blocks), turn * 1_000);
            }
        }
        let engine = |b, in_flight| Candidate {
            prefill_ns_per_token: 1_000_000,
            cache_blocks: 179,
            cache_free_blocks: Some(0),
            ..c(b, in_flight, 0)
        };
        let cands = [engine(0, 2), engine(1, 0)];
        pick_turn(&mut p, &cands, (7, 5), 9_500, 0)
    };
    assert_eq!(new_conversation_goes_to(false), picked(0, Reason::NoMatch));
    assert_eq!(new_conversation_goes_to(true), picked(1, Reason::NoMatch));
}

#[test]
fn a_second_turn_whose_match_is_too_short_to_count_stays_with_its_first() {
    // The trace (precise mode, 128-token blocks, three idle engines): eight new
    // conversations of one block each went 1, 0, 1, 0, ... (engine 1 alone on its
    // core). At their second turns (4 blocks) each held one block, too short a match
    // to count, so each was placed again as a new prefix: by the fewest new prefixes
    // lately, which counted its own first turn against its engine, four of eight
    // moved and paid a cold prefill, and one engine ended with five.
    let second_turn_goes_to = |first_on: BackendIdx| {
        let mut p = defaults();
        for k in 1..=8 {
            let on = if k == 1 {
                first_on
            } else {
                [1, 0][k as usize % 2]
            };
            p.recent_new_prefixes.record(on, &conversation(k, 1), 0, 0);
        }
        let cands: Vec<Candidate> = (0..3)
            .map(|b| c(b, 0, if b == first_on { 1 } else { 0 }))
            .collect();
        pick_turn(&mut p, &cands, (1, 4), 1_000, 0)
    };
    for first_on in 0..3 {
        assert_eq!(
            second_turn_goes_to(first_on),
            picked(first_on, Reason::FallbackLeastLoaded),
            "first turn on {first_on}"
        );
    }
}

#[test]
fn a_second_turn_is_not_charged_for_its_own_conversation_on_its_first_turns_engine() {
    // The trace (precise mode, 128-token blocks, 64-block caches, prompts lately
    // 16 blocks): a conversation's second turn (4 blocks) held its first turn's one
    // block on engine 0, which had the shortest wait (841 ms) and 3.5 conversations
    // placed lately (by weight), this one among them; it went to engine 2 (4.5 s). The
    // crowding charge counted the conversation twice on engine 0, as one of its
    // placements and again as a new one: 6.6 s of overflow that made engine 0
    // no longer close to the soonest, so its being the conversation's home never
    // came into it. Counted once, engine 0's four fit its cache.
    let mut p = defaults();
    for _ in 0..PROMPT_SIZES_KEPT {
        p.prompt_sizes.record(16);
    }
    for k in 1..=4 {
        p.recent_new_prefixes.record(0, &conversation(k, 1), 0, 0);
    }
    let engine = |b, in_flight, matched| Candidate {
        prefill_ns_per_token: 1_000_000,
        cache_blocks: 64,
        ..c(b, in_flight, matched)
    };
    // Engine 0 waits one request (5 ms), engine 2 none, engine 1 two.
    let cands = [engine(0, 1, 1), engine(1, 2, 0), engine(2, 0, 0)];
    let pick = pick_turn(&mut p, &cands, (1, 4), 1_000, 0);
    assert_eq!(pick, picked(0, Reason::FallbackLeastLoaded));
    // A new conversation there is charged for the four and itself.
    p.recent_new_prefixes.count(1_000);
    assert!(p.crowding_ns(&cands[0], 16, 0.0) > 0.0);
}

#[test]
fn new_prefixes_spread_over_the_caches_of_backends_that_share_a_core() {
    // The same trace's first turns: engines 0 and 2 share a core, engine 1 has its
    // own. Spread over hardware, engine 1 took every other conversation; within the
    // shared core the most free room decided, and engine 0 (whose free room barely
    // moved, as one-block prompts use little of it) took all four of the others
    // while engine 2's cache stayed empty. Each engine caches its own.
    let mut p = defaults();
    let mut taken = [0u32; 3];
    for k in 1..=8 {
        let cands: Vec<Candidate> = [(0, Some(0), 19), (1, None, 29), (2, Some(0), 12)]
            .into_iter()
            .map(|(b, group, room)| Candidate {
                compute_group: group,
                cache_free_blocks: Some(room),
                cache_blocks: 64,
                ..c(b, 0, 0)
            })
            .collect();
        let chosen = pick_turn(&mut p, &cands, (k, 1), k * 1_000, k);
        taken[chosen.backend] += 1;
    }
    assert_eq!(taken, [2, 4, 2]);
}

#[test]
fn a_fixed_delay_counts_once_so_a_cached_follow_up_stays_with_its_holder() {
    // The trace: engine 0 waits a second before every first token (its core
    // neighbour's busy loop) and holds 180 of a 200-block conversation; engine 2 is
    // idle and cold. Both prefill at 0.45 ms a token. Cached on 0: 1 s + 20 blocks,
    // 1.14 s; cold on 2: 200 blocks, 1.44 s. Read as a rate alone (the same second
    // over a 320-token follow-up: 3.6 ms a token), engine 0 would have cost 11.5 s
    // for this conversation cold, and its own first turns looked as slow.
    let mut p = defaults();
    let engine = |b, fixed_ns, matched| Candidate {
        prefill_ns_per_token: 450_000,
        prefill_fixed_ns: fixed_ns,
        ..c(b, 0, matched)
    };
    let cands = [engine(0, 1_000_000_000, 180), engine(2, 0, 0)];
    let cached = p.est_ttft_ns(&cands[0], 200);
    let cold = p.est_ttft_ns(&cands[1], 200);
    assert_eq!(cached, 1_000.0 * MS + 20.0 * 16.0 * 0.45 * MS);
    assert_eq!(cold, 200.0 * 16.0 * 0.45 * MS);
    assert!(cached < cold);
    assert_eq!(pick(&mut p, &cands, 200), picked(0, Reason::LongestPrefix));
    // A fully cached prompt still waits the fixed delay.
    assert_eq!(p.est_ttft_ns(&cands[0], 180), 1_000.0 * MS);
}

#[test]
fn a_new_prefix_counts_the_fixed_delay_as_wait() {
    // Equal queues; engine 0 has the most room but waits a second before every first
    // token, more than one request's cost (5 ms here) behind the others: the new
    // conversation goes to the most room among the others.
    let mut p = defaults();
    let engine = |b, fixed_ns, free| Candidate {
        prefill_fixed_ns: fixed_ns,
        cache_free_blocks: Some(free),
        ..c(b, 0, 0)
    };
    let cands = [
        engine(0, 1_000_000_000, 900),
        engine(1, 0, 300),
        engine(2, 2_000_000, 400),
    ];
    assert_eq!(pick(&mut p, &cands, 50), picked(2, Reason::NoMatch));
}

#[test]
fn milliseconds_between_fixed_delays_do_not_decide_a_new_prefix() {
    // The trace: idle engines with learned fixed delays of 39, 51 and 316 ms, a new
    // 1,550-token document (97 blocks at 0.45 ms a token, 700 ms cold). Within one
    // request's wait alone (5 ms here), only the 39-ms engine would do, and it took
    // every document; the tie band's width of the estimate (70 ms) takes in the 51-ms
    // engine, whose cache has room, and not the 316-ms one.
    let mut p = defaults();
    let engine = |b, fixed_ms: u32, free| Candidate {
        prefill_ns_per_token: 450_000,
        prefill_fixed_ns: fixed_ms * 1_000_000,
        cache_free_blocks: Some(free),
        ..c(b, 0, 0)
    };
    let cands = [engine(0, 39, 10), engine(1, 51, 500), engine(2, 316, 900)];
    assert_eq!(pick(&mut p, &cands, 97), picked(1, Reason::NoMatch));
}

/// Places eight new conversations of 7 blocks (the trace's first turns, in a test
/// configuration of 46 tokens a block) on three idle engines whose caches hold 179
/// blocks, after prompts lately grew to 46 blocks; engine 1 answers soonest (fixed
/// delays 96, 2 and 246 ms). Returns how many each engine took.
fn place_growing_conversations(config: PrefixAwareConfig) -> [u32; 3] {
    let mut p = PrefixAware::new(&PrefixAwareConfig {
        tokens_per_block: 46.0,
        ..config
    });
    for _ in 0..PROMPT_SIZES_KEPT {
        p.prompt_sizes.record(46);
    }
    let mut placed = [0u32; 3];
    for seed in 0..8 {
        let cands: Vec<Candidate> = (0..3)
            .map(|b| Candidate {
                prefill_ns_per_token: 400_000,
                prefill_fixed_ns: [96, 2, 246][b] * 1_000_000,
                cache_blocks: 179,
                cache_free_blocks: Some(179 - 7 * placed[b]),
                ..c(b, 0, 0)
            })
            .collect();
        let chosen = pick_seeded(&mut p, &cands, 7, seed).backend;
        placed[chosen] += 1;
    }
    placed
}

#[test]
fn a_new_conversation_goes_past_a_cache_its_growth_would_overflow() {
    // The trace: engine 1 took seven of eight new conversations, which at their sixth
    // turn were 46 blocks each in a 179-block cache and evicted each other at every
    // turn. Priced at what prompts lately grew to, engine 1 takes no more than its
    // cache holds grown (three, and a fourth while the others are as crowded).
    let unpriced = place_growing_conversations(PrefixAwareConfig {
        price_footprint: false,
        ..base()
    });
    assert_eq!(unpriced[1], 8, "{unpriced:?}");
    let priced = place_growing_conversations(base());
    assert!(priced[1] <= 4, "{priced:?}");
    assert!(priced.iter().all(|&n| n <= 4), "{priced:?}");
}

#[test]
fn crowding_needs_a_known_capacity_and_counts_the_overflow_at_a_prefill_a_block() {
    let mut p = PrefixAware::new(&PrefixAwareConfig {
        tokens_per_block: 10.0,
        ..base()
    });
    let engine = |cache_blocks| Candidate {
        prefill_ns_per_token: 1_000_000,
        cache_blocks,
        ..c(0, 0, 0)
    };
    // Capacity unknown: nothing to overflow.
    assert_eq!(p.crowding_ns(&engine(0), 1_000, 0.0), 0.0);
    // One new prefix of 60 blocks fits 100; the second overflows by 20 blocks.
    assert_eq!(p.crowding_ns(&engine(100), 60, 0.0), 0.0);
    p.recent_new_prefixes.record(0, &[], 0, 0);
    assert_eq!(p.crowding_ns(&engine(100), 60, 0.0), 20.0 * 10.0 * MS);
    // Off: never.
    let off = PrefixAware::new(&PrefixAwareConfig {
        price_footprint: false,
        ..base()
    });
    assert_eq!(off.crowding_ns(&engine(1), 1_000, 0.0), 0.0);
}

#[test]
fn prompt_sizes_are_a_large_recent_one_not_the_largest() {
    let mut sizes = PromptSizes::default();
    assert_eq!(sizes.large(), 0);
    sizes.record(7);
    assert_eq!(sizes.large(), 7);
    // 28 prompts of 40 blocks and a few outsized ones: the 90th percentile is 40.
    for _ in 0..28 {
        sizes.record(40);
    }
    for _ in 0..3 {
        sizes.record(5_000);
    }
    assert_eq!(sizes.large(), 40);
    // The ring keeps the last 32: after 32 small prompts, the large ones are gone.
    for _ in 0..PROMPT_SIZES_KEPT {
        sizes.record(3);
    }
    assert_eq!(sizes.large(), 3);
}

#[test]
fn a_system_prompt_every_engine_holds_does_not_make_a_conversation_old() {
    // Every engine holds the 12-block system prompt; eight new conversations of 20
    // blocks arrive at an idle fleet where engine 2's cache has the most room. The
    // match says nothing about where a conversation lives: they spread by count as
    // new prefixes do, instead of all going where the room is.
    let (mut placed, reasons) = place_eight(&mut defaults(), 12, 20);
    assert!(
        reasons.iter().all(|&r| r == Reason::LongestPrefix),
        "{reasons:?}"
    );
    placed.sort_unstable();
    assert_eq!(placed, [2, 3, 3]);
}

#[test]
fn a_prompt_every_engine_holds_whole_goes_by_load() {
    // A hot document every engine holds, and a one-block question: nothing new to
    // place, so the least loaded holder takes it, whatever was placed where lately.
    let mut p = defaults();
    p.recent_new_prefixes.record(1, &[], 0, 0);
    let cands = [c(0, 3, 40), c(1, 1, 40), c(2, 2, 40)];
    assert_eq!(pick(&mut p, &cands, 41), picked(1, Reason::LongestPrefix));
}

#[test]
fn a_conversation_does_not_move_into_a_cache_its_growth_would_overflow() {
    // The trace: engine 0 holds 30 of the conversation's 35 blocks but waits 800 ms
    // before every first token; engine 1 answers at once and was lately given three
    // new conversations, which at the 50 blocks prompts lately reached fill its
    // 179-block cache. Unpriced, the conversation moves to engine 1 (a cold prefill
    // there is sooner than a cached one behind the delay), and seven of eight did in
    // one run; priced, the move costs engine 1 a fourth conversation's overflow.
    let place = |price_footprint| {
        let mut p = PrefixAware::new(&PrefixAwareConfig {
            tokens_per_block: 46.0,
            price_footprint,
            ..base()
        });
        for _ in 0..PROMPT_SIZES_KEPT {
            p.prompt_sizes.record(50);
        }
        for _ in 0..3 {
            p.recent_new_prefixes.record(1, &[], 0, 0);
        }
        let engine = |b, fixed_ms: u32, matched| Candidate {
            prefill_ns_per_token: 500_000,
            prefill_fixed_ns: fixed_ms * 1_000_000,
            cache_blocks: 179,
            cache_free_blocks: Some(100),
            ..c(b, 0, matched)
        };
        let cands = [engine(0, 800, 30), engine(1, 0, 1)];
        pick(&mut p, &cands, 35)
    };
    assert_eq!(place(false), picked(1, Reason::FallbackLeastLoaded));
    assert_eq!(place(true), picked(0, Reason::LongestPrefix));
}

#[test]
fn a_neighbours_queue_slows_the_work_it_overlaps() {
    let p = defaults();
    // 1 in flight (5 ms) + 20 missing blocks × 16 tok × 20 µs (6.4 ms): 11.4 ms alone.
    let alone = c(0, 1, 10);
    assert_eq!(p.est_ttft_ns(&alone, 30), 11.4 * MS);
    // A neighbour with 4 ms queued: the first 4 ms of this work run at half speed.
    let light = Candidate {
        peer_queue_ns: (4.0 * MS) as u64,
        ..alone
    };
    assert_eq!(p.est_ttft_ns(&light, 30), 15.4 * MS);
    // One with more queued than this whole request: all of it runs at half speed.
    let heavy = Candidate {
        peer_queue_ns: (100.0 * MS) as u64,
        ..alone
    };
    assert_eq!(p.est_ttft_ns(&heavy, 30), 22.8 * MS);
    // The wait before the prompt's own prefill: the estimate less that prefill.
    assert_eq!(p.shared_wait_ns(&heavy, 30), 22.8 * MS - 6.4 * MS);
    assert_eq!(p.shared_wait_ns(&alone, 30), 5.0 * MS);
    let infinite = Candidate {
        peer_queue_ns: u64::MAX,
        ..alone
    };
    assert_eq!(p.est_ttft_ns(&infinite, 30), 22.8 * MS);
}

#[test]
fn a_busy_neighbour_takes_its_share_of_all_the_work() {
    let p = defaults();
    // 11.4 ms alone (as above); a neighbour decoding answers has no prefill queued
    // and a small queue cost, but works all along: the request gets half the core.
    let alone = c(0, 1, 10);
    let decoding = Candidate {
        peers_busy: 1,
        peer_queue_ns: (1.0 * MS) as u64,
        ..alone
    };
    assert_eq!(p.est_ttft_ns(&decoding, 30), 22.8 * MS);
    // Two busy neighbours: a third of it.
    let two = Candidate {
        peers_busy: 2,
        ..decoding
    };
    assert_eq!(p.est_ttft_ns(&two, 30), 34.2 * MS);
    // Idle neighbours with queued work (another client's, in the engine's scrape)
    // still count by their queue.
    let queued = Candidate {
        peers_busy: 0,
        peer_queue_ns: (4.0 * MS) as u64,
        ..alone
    };
    assert_eq!(p.est_ttft_ns(&queued, 30), 15.4 * MS);
}

#[test]
fn a_new_prefix_skips_an_idle_engine_whose_neighbour_is_busy() {
    // Engines 0 and 2 share a core; 2 has 40 ms of prefill queued, 0 is idle, and 1
    // (a core of its own) has 3.2 ms of prefill queued. A cold 20-block prompt (6.4
    // ms alone) would start its prefill after 6.4 ms on 0 (the time it loses to its
    // neighbour, all of its work running at half speed), after 3.2 ms on 1.
    let cands = [
        Candidate {
            peer_queue_ns: (40.0 * MS) as u64,
            ..c(0, 0, 0)
        },
        Candidate {
            pending_prefill_tokens: 160,
            ..c(1, 1, 0)
        },
        Candidate {
            pending_prefill_tokens: 2000,
            ..c(2, 1, 0)
        },
    ];
    let configured = PrefixAwareConfig {
        queue_ns_per_request: 0,
        ..base()
    };
    let mut p = PrefixAware::new(&configured);
    assert_eq!(pick(&mut p, &cands, 20), picked(1, Reason::NoMatch));
    // Without the neighbour's queue, engine 0 looks idle and takes it.
    let alone = cands.map(|c| Candidate {
        peer_queue_ns: 0,
        ..c
    });
    let mut p = PrefixAware::new(&configured);
    assert_eq!(pick(&mut p, &alone, 20), picked(0, Reason::NoMatch));
}

#[test]
fn new_prefixes_spread_over_hardware_not_over_backends() {
    // Three idle engines with equal room; 0 and 2 share a core. Counted per backend,
    // eight new conversations spread 3/3/2 and the shared core took five or six;
    // counted per core, each core takes four.
    let mut p = by_count();
    let mut placed = [0u32; 3];
    let mut free = [1_000u32; 3];
    for seed in 0..8 {
        let cands: Vec<Candidate> = (0..3)
            .map(|b| Candidate {
                cache_free_blocks: Some(free[b]),
                compute_group: (b != 1).then_some(0),
                ..c(b, 0, 0)
            })
            .collect();
        let b = pick_seeded(&mut p, &cands, 7, seed).backend;
        placed[b] += 1;
        free[b] -= 7;
    }
    assert_eq!(placed[0] + placed[2], 4, "{placed:?}");
    assert_eq!(placed[1], 4, "{placed:?}");
    assert!(placed[0] == 2 && placed[2] == 2, "{placed:?}");
}

/// [`defaults`] with the footprint unpriced, so only the placement count and room
/// decide a new prefix.
fn by_count() -> PrefixAware {
    PrefixAware::new(&PrefixAwareConfig {
        price_footprint: false,
        ..base()
    })
}

#[test]
fn a_match_counts_only_as_far_as_it_fits_beside_the_work_in_flight() {
    let p = defaults();
    // A 64-block cache holding 12 of a 16-block prompt; the engine reports plenty
    // in use, so the prompts in flight count as they are.
    let holder = |in_flight_blocks| Candidate {
        cache_blocks: 64,
        in_flight_blocks,
        engine_used_blocks: Some(64),
        ..c(0, 3, 12)
    };
    // 40 blocks in flight + the prompt's 16 fit: the whole match is kept.
    assert_eq!(p.kept_blocks(&holder(40), 16), 12);
    // 54 + 16 = 70: the 6 blocks beyond the cache go from the match's tail.
    assert_eq!(p.kept_blocks(&holder(54), 16), 6);
    // The work ahead fills the cache: nothing is left by the request's turn.
    assert_eq!(p.kept_blocks(&holder(80), 16), 0);
    // The estimate prefills what is not kept: 3 × 5 ms + 10 blocks × 0.32 ms.
    assert_eq!(p.est_ttft_ns(&holder(54), 16), 15.0 * MS + 10.0 * 0.32 * MS);
    // Unknown capacity, unknown engine usage, or the term off: the match counts
    // whole.
    let unknown = Candidate {
        cache_blocks: 0,
        ..holder(80)
    };
    assert_eq!(p.kept_blocks(&unknown, 16), 12);
    let unreported = Candidate {
        engine_used_blocks: None,
        ..holder(80)
    };
    assert_eq!(p.busy_blocks(&unreported), None);
    assert_eq!(p.kept_blocks(&unreported, 16), 12);
    let off = PrefixAware::new(&PrefixAwareConfig {
        price_cache_in_use: false,
        ..base()
    });
    assert_eq!(off.kept_blocks(&holder(80), 16), 12);
}

#[test]
fn requests_that_share_a_prefix_hold_it_once() {
    let p = defaults();
    // Five requests for one 16-block document in flight: 80 blocks by their prompts,
    // but the engine reports 20 in use, and 160 pending tokens (10 blocks) are still
    // to come.
    let holder = Candidate {
        cache_blocks: 64,
        in_flight_blocks: 80,
        engine_used_blocks: Some(20),
        pending_prefill_tokens: 160,
        ..c(0, 5, 16)
    };
    assert_eq!(p.busy_blocks(&holder), Some(30));
    assert_eq!(p.kept_blocks(&holder, 17), 16);
    // Where the prompts in flight are fewer than the engine's count, they bound it.
    let light = Candidate {
        in_flight_blocks: 8,
        ..holder
    };
    assert_eq!(p.busy_blocks(&light), Some(8));
}

#[test]
fn a_prefix_the_work_ahead_would_evict_is_not_worth_waiting_for() {
    // CPU-like costs: 1 ms per token (16 ms a block), 5 ms per request ahead. The
    // holder of 12 of 16 blocks has four requests in flight whose 64 blocks fill its
    // cache (the engine says so); the other engine has one request of 16 blocks.
    let slow = |c: Candidate| Candidate {
        prefill_ns_per_token: 1_000_000,
        cache_blocks: 64,
        ..c
    };
    let cands = [
        slow(Candidate {
            in_flight_blocks: 64,
            engine_used_blocks: Some(64),
            ..c(0, 4, 12)
        }),
        slow(Candidate {
            in_flight_blocks: 16,
            engine_used_blocks: Some(16),
            ..c(1, 1, 0)
        }),
    ];
    // Counted whole, the match saves 192 ms of prefill: the holder (84 ms) wins.
    let mut whole = PrefixAware::new(&PrefixAwareConfig {
        price_cache_in_use: false,
        ..base()
    });
    assert_eq!(
        pick(&mut whole, &cands, 16),
        picked(0, Reason::LongestPrefix)
    );
    // Priced, the holder would prefill the whole prompt after four requests: the
    // other engine is sooner.
    let mut priced = defaults();
    assert_eq!(
        pick(&mut priced, &cands, 16),
        picked(1, Reason::FallbackLeastLoaded)
    );
}
