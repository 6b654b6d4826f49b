//! The router without a socket: every filter, every policy and reason, the ops a
//! decision carries, roll-back, the pair decision and the admission estimate.

use super::*;
use crate::{ChunkIndex, IndexConfig, PrefixIndex, SessionTable};

type TestFleet = FleetState;

fn replica(backends: usize, capacity: usize) -> Replica {
    let mut index = PrefixIndex::new(IndexConfig { max_blocks: 10_000 });
    for b in 0..backends {
        index.set_capacity(b, capacity);
    }
    Replica::new(index, SessionTable::new(60_000, 100), ChunkIndex::new(100))
}

fn router() -> Router {
    Router::new(
        RouterConfig {
            policy: PolicyConfig {
                backend_ids: (0..4).map(|b| format!("b{b}")).collect(),
                ..PolicyConfig::default()
            },
            ..RouterConfig::default()
        },
        7,
    )
}

const TEXT: MediaNeeds = MediaNeeds::TEXT_ONLY;

fn facts<'a>(policy: PolicyName, blocks: &'a [u64]) -> RoutingFacts<'a> {
    RoutingFacts {
        model: 0,
        adapter: None,
        policy,
        blocks,
        affinity_key: blocks.first().copied(),
        media: &TEXT,
        session: None,
        chunks: &[],
        excluded: &[],
    }
}

/// Decides and applies the decision's ops, as every caller does.
fn route(
    router: &mut Router,
    replica: &mut Replica,
    fleet: &TestFleet,
    facts: &RoutingFacts<'_>,
    now_ms: u64,
) -> Decision {
    let mut d = router.decide(replica, fleet, facts, now_ms).unwrap();
    let ops: Vec<IndexOp> = d.ops.take().collect();
    for op in &ops {
        replica.apply(op);
    }
    d.ops = Ops::default();
    for op in ops {
        d.ops.push(op);
    }
    d
}

fn prompt(start: u64, n: u64) -> Vec<u64> {
    (start..start + n).collect()
}

#[test]
fn filters_unhealthy_open_draining_excluded_and_wrong_role() {
    let mut r = router();
    let rep = replica(6, 100);
    let mut fleet = TestFleet::healthy(6);
    fleet.states[0].healthy = false;
    fleet.states[1].breaker = BreakerState::Open;
    fleet.states[2].draining = true;
    fleet.states[3].role = Role::Prefill;
    let blocks = prompt(1, 4);
    let f = RoutingFacts {
        excluded: &[4],
        ..facts(PolicyName::LeastLoaded, &blocks)
    };
    let d = r.decide(&rep, &fleet, &f, 1).unwrap();
    assert_eq!(d.pick.backend, 5);
    assert_eq!(d.alternatives, 0);
    let none = RoutingFacts {
        excluded: &[4, 5],
        ..f
    };
    assert_eq!(
        r.decide(&rep, &fleet, &none, 1),
        Err(RouteError::NoCandidate)
    );
}

#[test]
fn a_half_open_backend_takes_only_as_many_probes_as_configured() {
    let mut r = router();
    let rep = replica(1, 100);
    let mut fleet = TestFleet::healthy(1);
    fleet.states[0].breaker = BreakerState::HalfOpen;
    let blocks = prompt(1, 2);
    let f = facts(PolicyName::RoundRobin, &blocks);
    let d = r.decide(&rep, &fleet, &f, 1).unwrap();
    assert!(d.probe);
    fleet.states[0].probes_in_flight = 1;
    assert_eq!(r.decide(&rep, &fleet, &f, 1), Err(RouteError::NoCandidate));
}

#[test]
fn a_model_without_backends_and_media_nobody_accepts_are_their_own_errors() {
    let mut r = router();
    let rep = replica(2, 100);
    let mut fleet = TestFleet::healthy(2);
    let blocks = prompt(1, 2);
    let gone = RoutingFacts {
        model: 1,
        ..facts(PolicyName::RoundRobin, &blocks)
    };
    assert_eq!(r.decide(&rep, &fleet, &gone, 1), Err(RouteError::ModelGone));
    let image = Capabilities::IMAGE;
    let mut media = MediaNeeds::TEXT_ONLY;
    media.note(image, 0);
    let f = RoutingFacts {
        media: &media,
        ..facts(PolicyName::RoundRobin, &blocks)
    };
    assert_eq!(
        r.decide(&rep, &fleet, &f, 1),
        Err(RouteError::UnsupportedMedia(image))
    );
    // One capable backend, unhealthy: no candidate, not unsupported.
    fleet.states[1].capabilities = Capabilities::TEXT.union(image);
    fleet.states[1].healthy = false;
    assert_eq!(r.decide(&rep, &fleet, &f, 1), Err(RouteError::NoCandidate));
    fleet.states[1].healthy = true;
    assert_eq!(r.decide(&rep, &fleet, &f, 1).unwrap().pick.backend, 1);
}

#[test]
fn every_load_policy_gives_its_reason() {
    let rep = replica(3, 100);
    let mut fleet = TestFleet::healthy(3);
    fleet.states[0].in_flight = 5;
    fleet.states[1].in_flight = 1;
    fleet.states[2].in_flight = 3;
    let blocks = prompt(1, 2);
    let cases = [
        (PolicyName::RoundRobin, Reason::RoundRobin),
        (PolicyName::Random, Reason::Random),
        (PolicyName::LeastLoaded, Reason::LeastLoaded),
        (PolicyName::PrefixAware, Reason::NoMatch),
    ];
    for (policy, reason) in cases {
        let d = router()
            .decide(&rep, &fleet, &facts(policy, &blocks), 1)
            .unwrap();
        assert_eq!(d.pick.reason, reason, "{policy}");
    }
    let ll = router()
        .decide(&rep, &fleet, &facts(PolicyName::LeastLoaded, &blocks), 1)
        .unwrap();
    assert_eq!(ll.pick.backend, 1);
    assert_eq!(ll.in_flight_before, 1);
}

#[test]
fn consistent_hash_reasons() {
    let rep = replica(3, 100);
    let fleet = TestFleet::healthy(3);
    let blocks = prompt(1, 2);
    let mut r = router();
    let home = r
        .decide(&rep, &fleet, &facts(PolicyName::ConsistentHash, &blocks), 1)
        .unwrap();
    assert_eq!(home.pick.reason, Reason::HashRing);
    let no_key = RoutingFacts {
        affinity_key: None,
        ..facts(PolicyName::ConsistentHash, &blocks)
    };
    assert_eq!(
        r.decide(&rep, &fleet, &no_key, 1).unwrap().pick.reason,
        Reason::HashNoKey
    );
    let mut busy = TestFleet::healthy(3);
    busy.states[home.pick.backend].in_flight = 50;
    let spill = r
        .decide(&rep, &busy, &facts(PolicyName::ConsistentHash, &blocks), 1)
        .unwrap();
    assert_eq!(spill.pick.reason, Reason::HashRingSpill);
    assert_ne!(spill.pick.backend, home.pick.backend);
}

#[test]
fn prefix_aware_follows_the_holder_and_spills_when_it_is_swamped() {
    let mut r = router();
    let mut rep = replica(3, 1000);
    let fleet = TestFleet::healthy(3);
    let blocks = prompt(1, 40);
    let f = facts(PolicyName::PrefixAware, &blocks);
    let first = route(&mut r, &mut rep, &fleet, &f, 1);
    assert_eq!(first.pick.reason, Reason::NoMatch);
    assert_eq!(first.uncached_tokens, 40 * 16);
    let again = route(&mut r, &mut rep, &fleet, &f, 500);
    assert_eq!(
        again.pick,
        Pick {
            backend: first.pick.backend,
            reason: Reason::LongestPrefix
        }
    );
    assert_eq!((again.matched_blocks, again.uncached_tokens), (40, 0));

    let mut swamped = TestFleet::healthy(3);
    swamped.states[first.pick.backend].in_flight = 40;
    let d = r.decide(&rep, &swamped, &f, 1000).unwrap();
    assert!(
        matches!(
            d.pick.reason,
            Reason::SpilledFromSaturated | Reason::FallbackLeastLoaded
        ),
        "{:?}",
        d.pick.reason
    );
    assert_ne!(d.pick.backend, first.pick.backend);
}

#[test]
fn a_fresh_touch_is_coalesced_and_a_due_one_is_not() {
    let mut r = router();
    let mut rep = replica(2, 1000);
    let fleet = TestFleet::healthy(2);
    let blocks = prompt(1, 8);
    let f = facts(PolicyName::PrefixAware, &blocks);
    let first = route(&mut r, &mut rep, &fleet, &f, 1_000);
    assert!(first.inserted.is_some());
    assert_eq!(first.ops.iter().count(), 1);
    let soon = r.decide(&rep, &fleet, &f, 1_050).unwrap();
    assert_eq!((soon.coalesced, soon.ops.iter().count()), (1, 0));
    assert_eq!(soon.inserted, None);
    assert_eq!(soon.roll_back(), None);
    let late = r.decide(&rep, &fleet, &f, 1_200).unwrap();
    assert_eq!((late.coalesced, late.ops.iter().count()), (0, 1));
}

#[test]
fn roll_back_forgets_only_what_the_pick_did_not_hold() {
    let mut r = router();
    let mut rep = replica(1, 1000);
    let fleet = TestFleet::healthy(1);
    let short = prompt(1, 4);
    route(
        &mut r,
        &mut rep,
        &fleet,
        &facts(PolicyName::PrefixAware, &short),
        1,
    );
    let long = prompt(1, 10);
    let d = route(
        &mut r,
        &mut rep,
        &fleet,
        &facts(PolicyName::PrefixAware, &long),
        2,
    );
    assert_eq!(d.matched_blocks, 4);
    assert_eq!(rep.index.held_blocks(0), 10);
    let undo = d.roll_back().unwrap();
    assert!(matches!(
        &undo,
        IndexOp::Remove {
            from: 4,
            backend: 0,
            ..
        }
    ));
    rep.apply(&undo);
    assert_eq!(rep.index.held_blocks(0), 4);
}

#[test]
fn sessions_bind_once_per_interval_and_pull_the_request_home() {
    let mut r = router();
    let mut rep = replica(3, 1000);
    let fleet = TestFleet::healthy(3);
    let blocks = prompt(1, 4);
    let f = RoutingFacts {
        session: Some(42),
        ..facts(PolicyName::PrefixAware, &blocks)
    };
    let first = route(&mut r, &mut rep, &fleet, &f, 1);
    assert!(first
        .ops
        .iter()
        .any(|op| matches!(op, IndexOp::BindSession { session: 42, .. })));
    // A different prompt in the same session goes home.
    let other = prompt(100, 4);
    let g = RoutingFacts {
        blocks: &other,
        affinity_key: Some(100),
        ..f
    };
    let home = r.decide(&rep, &fleet, &g, 20).unwrap();
    assert_eq!(
        home.pick,
        Pick {
            backend: first.pick.backend,
            reason: Reason::SessionAffinity
        }
    );
    assert!(!home
        .ops
        .iter()
        .any(|op| matches!(op, IndexOp::BindSession { .. })));
    assert_eq!(home.coalesced, 1);
}

#[test]
fn rag_chunks_pull_a_load_routed_request_to_their_holder() {
    let mut r = router();
    let mut rep = replica(3, 1000);
    let fleet = TestFleet::healthy(3);
    let chunks = [7, 8, 9];
    let a = prompt(1, 3);
    let f = RoutingFacts {
        chunks: &chunks,
        ..facts(PolicyName::PrefixAware, &a)
    };
    let first = route(&mut r, &mut rep, &fleet, &f, 1);
    assert_eq!(first.chunk_overlap, Some((0, 3)));
    // Another question over the same chunks: no prefix in common, the chunks decide.
    let b = prompt(50, 3);
    let g = RoutingFacts {
        blocks: &b,
        affinity_key: Some(50),
        ..f
    };
    let second = r.decide(&rep, &fleet, &g, 2).unwrap();
    assert_eq!(
        second.pick,
        Pick {
            backend: first.pick.backend,
            reason: Reason::ChunkAffinity
        }
    );
    assert_eq!(second.chunk_overlap, Some((3, 3)));
    // Not under another policy.
    let ll = RoutingFacts {
        policy: PolicyName::LeastLoaded,
        ..g
    };
    assert_eq!(
        r.decide(&rep, &fleet, &ll, 2).unwrap().pick.reason,
        Reason::LeastLoaded
    );
}

#[test]
fn a_split_request_gets_a_pair_that_both_insert_the_prompt() {
    let mut r = router();
    let rep = replica(4, 1000);
    let mut fleet = TestFleet::healthy(4);
    fleet.states[0].role = Role::Prefill;
    fleet.states[1].role = Role::Prefill;
    fleet.states[2].role = Role::Decode;
    fleet.states[3].role = Role::Decode;
    fleet.states[3].engine_running = 10;
    let blocks = prompt(1, 64);
    let f = facts(PolicyName::PrefixAware, &blocks);
    let always = DisaggPolicy {
        always: true,
        ..DisaggPolicy::default()
    };
    let PairOutcome::Split { prefill, decode } =
        r.decide_pair(&rep, &fleet, &f, &always, 1).unwrap()
    else {
        panic!("expected a pair")
    };
    assert_eq!(prefill.pick.reason, Reason::DisaggSplit);
    assert_eq!(decode.pick.backend, 2);
    assert_eq!(decode.prefill, Some(prefill.pick.backend));
    assert_eq!(decode.in_flight_before, u32::MAX);
    for leg in [&prefill, &decode] {
        assert!(leg.ops.iter().any(
            |op| matches!(op, IndexOp::Insert { backend, .. } if *backend == leg.pick.backend)
        ));
    }
    // Without prefill servers the request is served whole.
    fleet.states[0].healthy = false;
    fleet.states[1].healthy = false;
    assert_eq!(
        r.decide_pair(&rep, &fleet, &f, &always, 1).unwrap(),
        PairOutcome::Local(LocalWhy::NoPrefill)
    );
    // A short prompt is not worth the hop.
    fleet.states[0].healthy = true;
    let tiny = prompt(1, 2);
    assert_eq!(
        r.decide_pair(
            &rep,
            &fleet,
            &facts(PolicyName::PrefixAware, &tiny),
            &DisaggPolicy::default(),
            1
        )
        .unwrap(),
        PairOutcome::Local(LocalWhy::SmallUncached)
    );
}

#[test]
fn the_estimate_sees_the_same_candidates_as_the_decision() {
    let mut r = router();
    let mut rep = replica(2, 1000);
    let mut fleet = TestFleet::healthy(2);
    let blocks = prompt(1, 50);
    let f = facts(PolicyName::RoundRobin, &blocks);
    let cold = r.estimate(&rep, &fleet, &f).unwrap();
    rep.apply(&IndexOp::Insert {
        backend: 1,
        blocks: blocks.clone().into(),
        now_ms: 1,
    });
    let warm = r.estimate(&rep, &fleet, &f).unwrap();
    assert!(warm.best_ns < cold.best_ns);
    // The holder unhealthy: back to the cold estimate.
    fleet.states[1].healthy = false;
    assert_eq!(r.estimate(&rep, &fleet, &f).unwrap(), cold);
    fleet.states[0].healthy = false;
    assert_eq!(r.estimate(&rep, &fleet, &f), None);
}

#[test]
fn a_late_stream_trusts_only_learned_candidates() {
    let mut r = router();
    let rep = replica(3, 1000);
    let mut fleet = TestFleet::healthy(3);
    let blocks = prompt(1, 10);
    let late = [0];
    let f = RoutingFacts {
        excluded: &late,
        ..facts(PolicyName::RoundRobin, &blocks)
    };
    // Nothing learned anywhere: every price is the default, busy (backend 1) or idle
    // (backend 2). Nothing to trust, though the admission estimate counts them.
    fleet.states[1].in_flight = 3;
    fleet.states[1].pending_prefill_tokens = 30;
    assert_eq!(r.soonest_first_token_ns(&rep, &fleet, &f), None);
    let at_default = 10.0 * 16.0 * 20_000.0; // the idle one's prefill
    assert_eq!(r.estimate(&rep, &fleet, &f).unwrap().best_ns, at_default);
    // Backend 2 learned a cost: it counts (the idle one's prefill at that cost), and
    // lends it to backend 1.
    fleet.states[2].prefill_ns_per_token = 1_000_000;
    let idle = r.soonest_first_token_ns(&rep, &fleet, &f).unwrap();
    assert_eq!(idle, 10.0 * 16.0 * 1e6);
    fleet.states[2].in_flight = 1;
    let busy = r.soonest_first_token_ns(&rep, &fleet, &f).unwrap();
    assert!(busy > idle, "{busy}");
    // The late backend is never among them, however cheap.
    fleet.states[1].in_flight = 0;
    fleet.states[1].pending_prefill_tokens = 0;
    fleet.states[2].in_flight = 0;
    fleet.states[0].prefill_ns_per_token = 1;
    let without_late = r.soonest_first_token_ns(&rep, &fleet, &f).unwrap();
    assert!(without_late >= 160.0 * 1e6, "{without_late}");
}

#[test]
fn reconfigure_rebuilds_the_cost_model() {
    let mut r = router();
    let rep = replica(1, 1000);
    let fleet = TestFleet::healthy(1);
    let blocks = prompt(1, 10);
    let f = facts(PolicyName::PrefixAware, &blocks);
    let before = r.estimate(&rep, &fleet, &f).unwrap().best_ns;
    let mut config = r.config().clone();
    config.policy.prefix.default_prefill_ns_per_token *= 2;
    r.reconfigure(config);
    let after = r.estimate(&rep, &fleet, &f).unwrap().best_ns;
    assert!((after - 2.0 * before).abs() < 1.0, "{before} -> {after}");
}

#[test]
fn an_adapter_request_goes_only_to_backends_serving_the_adapter() {
    let mut r = router();
    let mut rep = replica(3, 100);
    let mut fleet = TestFleet::healthy(3);
    fleet.adapters = vec![(1, 0), (2, 1)];
    let blocks = prompt(1, 4);
    let a = RoutingFacts {
        adapter: Some(0),
        ..facts(PolicyName::LeastLoaded, &blocks)
    };
    for _ in 0..5 {
        let d = route(&mut r, &mut rep, &fleet, &a, 1);
        assert_eq!(d.pick.backend, 1);
        assert_eq!(d.alternatives, 0);
    }
    // Base-model requests still go anywhere, the adapter's holders included.
    fleet.states[0].in_flight = 5;
    fleet.states[2].in_flight = 5;
    let base = facts(PolicyName::LeastLoaded, &blocks);
    assert_eq!(r.decide(&rep, &fleet, &base, 1).unwrap().pick.backend, 1);
    // The adapter's holder unhealthy: no candidate, not an unknown model.
    fleet.states[1].healthy = false;
    assert_eq!(r.decide(&rep, &fleet, &a, 1), Err(RouteError::NoCandidate));
    // An adapter nobody serves is gone.
    let unknown = RoutingFacts {
        adapter: Some(7),
        ..a
    };
    assert_eq!(
        r.decide(&rep, &fleet, &unknown, 1),
        Err(RouteError::AdapterGone)
    );
    // Its holder excluded by a failed attempt: no candidate left, as for a model.
    fleet.states[1].healthy = true;
    let excluded = RoutingFacts {
        excluded: &[1],
        ..a
    };
    assert_eq!(
        r.decide(&rep, &fleet, &excluded, 1),
        Err(RouteError::NoCandidate)
    );
    // The admission estimate sees the same candidates.
    assert!(r.estimate(&rep, &fleet, &a).is_some());
    assert!(r.estimate(&rep, &fleet, &unknown).is_none());
}

#[test]
fn an_adapter_nobody_serves_is_gone_before_media_is_judged() {
    let mut r = router();
    let rep = replica(2, 100);
    let mut fleet = TestFleet::healthy(2);
    fleet.adapters = vec![(0, 0)];
    let mut media = MediaNeeds::TEXT_ONLY;
    media.note(Capabilities::IMAGE, 0);
    let blocks = prompt(1, 2);
    let f = RoutingFacts {
        adapter: Some(3),
        media: &media,
        ..facts(PolicyName::RoundRobin, &blocks)
    };
    assert_eq!(r.decide(&rep, &fleet, &f, 1), Err(RouteError::AdapterGone));
    let held = RoutingFacts {
        adapter: Some(0),
        ..f
    };
    assert_eq!(
        r.decide(&rep, &fleet, &held, 1),
        Err(RouteError::UnsupportedMedia(Capabilities::IMAGE))
    );
}

#[test]
fn a_split_adapter_request_pairs_only_backends_serving_it() {
    let mut r = router();
    let rep = replica(4, 100);
    let mut fleet = TestFleet::healthy(4);
    fleet.states[0].role = Role::Prefill;
    fleet.states[1].role = Role::Prefill;
    fleet.states[2].role = Role::Decode;
    fleet.states[3].role = Role::Decode;
    fleet.adapters = vec![(1, 0), (3, 0)];
    let blocks = prompt(1, 64);
    let f = RoutingFacts {
        adapter: Some(0),
        ..facts(PolicyName::PrefixAware, &blocks)
    };
    let split = DisaggPolicy {
        always: true,
        ..DisaggPolicy::default()
    };
    match r.decide_pair(&rep, &fleet, &f, &split, 1).unwrap() {
        PairOutcome::Split { prefill, decode } => {
            assert_eq!((prefill.pick.backend, decode.pick.backend), (1, 3));
        }
        PairOutcome::Local(why) => panic!("served whole: {why:?}"),
    }
}

#[test]
fn blocks_unused_for_a_minute_count_as_room_for_a_new_prefix() {
    // Backend 0's cache is full of a document last used at t = 0; backend 1 holds a
    // conversation used two seconds ago and has 40 blocks free. A minute later a new
    // prompt goes where the cache is full of what nobody uses: 100 blocks of room
    // against 40.
    let mut r = router();
    let mut rep = replica(2, 100);
    let fleet = TestFleet::healthy(2);
    rep.index.insert(0, &prompt(1_000, 100), 0);
    rep.index.insert(1, &prompt(2_000, 60), 59_000);
    let new = prompt(3_000, 10);
    let d = r
        .decide(&rep, &fleet, &facts(PolicyName::PrefixAware, &new), 61_000)
        .unwrap();
    assert_eq!((d.pick.backend, d.pick.reason), (0, Reason::NoMatch));
    // Counting only truly free blocks (0 against 40), the other way round.
    let mut config = r.config().clone();
    config.policy.prefix.room_stale_after_ms = 0;
    r.reconfigure(config);
    let d = r
        .decide(&rep, &fleet, &facts(PolicyName::PrefixAware, &new), 61_000)
        .unwrap();
    assert_eq!((d.pick.backend, d.pick.reason), (1, Reason::NoMatch));
}

#[test]
fn a_burst_of_new_prompts_counts_engines_that_share_compute_as_one() {
    // Engines 0 and 2 share a core, 1 has its own: eight new 20-block prompts
    // arriving at once (nothing answers in between) load the shared core no more
    // than the other. Without `compute_peers`, each of 0 and 2 looked as free as 1
    // and the core they share took five of eight.
    let place = |peers: Vec<Vec<BackendIdx>>| {
        let mut r = router();
        let mut rep = replica(3, 1_000);
        let mut fleet = TestFleet::healthy(3);
        fleet.compute_peers = peers;
        let mut placed = [0u32; 3];
        for i in 0..8 {
            let blocks = prompt(1_000 * (i + 1), 20);
            let d = route(
                &mut r,
                &mut rep,
                &fleet,
                &facts(PolicyName::PrefixAware, &blocks),
                0,
            );
            let b = d.pick.backend;
            placed[b] += 1;
            fleet.states[b].in_flight += 1;
            fleet.states[b].pending_prefill_tokens += d.uncached_tokens;
        }
        placed
    };
    let shared = place(vec![vec![2], vec![], vec![0]]);
    assert_eq!(shared[0] + shared[2], shared[1], "{shared:?}");
    let unaware = place(Vec::new());
    assert!(unaware[0] + unaware[2] > unaware[1], "{unaware:?}");
}

#[test]
fn a_peer_outside_the_candidates_is_priced_from_its_state() {
    // Backend 1 is a prefill-only engine on backend 0's GPU: not a candidate for a
    // whole request, but its queue still slows backend 0.
    let mut r = router();
    let rep = replica(2, 100);
    let mut fleet = TestFleet::healthy(2);
    fleet.states[1].role = Role::Prefill;
    fleet.states[1].pending_prefill_tokens = 1_000;
    fleet.compute_peers = vec![vec![1], vec![0]];
    let blocks = prompt(1, 4);
    let f = facts(PolicyName::PrefixAware, &blocks);
    let alone = r.estimate(&rep, &TestFleet::healthy(2), &f).unwrap();
    let shared = r.estimate(&rep, &fleet, &f).unwrap();
    // 4 blocks × 16 tokens × 20 µs alone; the neighbour's 20 ms queue overlaps all of
    // it.
    assert_eq!(alone.best_ns, 1_280_000.0);
    assert_eq!(shared.best_ns, 2.0 * 1_280_000.0);
}

#[test]
fn a_decision_counts_the_busy_peers_of_its_pick() {
    // Engines 0 and 2 share a core with a prefill-only engine 3 (not a candidate);
    // least_loaded picks 0, the idle one. What learning reads from the decision: how
    // many of its peers had work when it was routed.
    let mut r = router();
    let rep = replica(4, 100);
    let mut fleet = TestFleet::healthy(4);
    fleet.states[3].role = Role::Prefill;
    fleet.compute_peers = vec![vec![2, 3], vec![], vec![0, 3], vec![0, 2]];
    fleet.states[1].in_flight = 5;
    let blocks = prompt(1, 4);
    let f = facts(PolicyName::LeastLoaded, &blocks);
    let busy_peers = |r: &mut Router, fleet: &TestFleet| {
        let d = r.decide(&rep, fleet, &f, 0).unwrap();
        assert_eq!(d.pick.backend, 0);
        d.peers_busy_before
    };
    assert_eq!(busy_peers(&mut r, &fleet), 0);
    fleet.states[2].in_flight = 1;
    assert_eq!(busy_peers(&mut r, &fleet), 1);
    fleet.states[3].in_flight = 2;
    assert_eq!(busy_peers(&mut r, &fleet), 2);
}

#[test]
fn the_last_decision_is_explained_candidate_by_candidate() {
    let mut r = router();
    let mut rep = replica(2, 64);
    let mut fleet = TestFleet::healthy(2);
    let blocks = prompt(1, 10);
    // Backend 0 holds the prompt; backend 1 has 50 prompt blocks in flight.
    rep.apply(&IndexOp::Insert {
        backend: 0,
        blocks: blocks.clone().into(),
        now_ms: 1,
    });
    fleet.states[1].in_flight = 2;
    fleet.states[1].in_flight_blocks = 50;
    fleet.states[1].engine_kv_usage = 0.5;
    let d = route(
        &mut r,
        &mut rep,
        &fleet,
        &facts(PolicyName::PrefixAware, &blocks),
        2,
    );
    assert_eq!(d.pick.backend, 0);
    assert_eq!(d.prompt_blocks, 10);
    let explained: Vec<Explained> = r.explain_last(10).collect();
    assert_eq!(explained.len(), 2);
    let (holder, busy) = (explained[0], explained[1]);
    assert_eq!(
        (holder.backend, holder.matched_blocks, holder.kept_blocks),
        (0, 10, 10)
    );
    assert_eq!(holder.est_ttft_ns, 0.0);
    // Its engine reports half its 64 blocks in use: what is in flight is bounded
    // by that (nothing is pending).
    assert_eq!(
        (busy.backend, busy.in_flight, busy.busy_blocks),
        (1, 2, Some(32))
    );
    assert_eq!(holder.busy_blocks, None);
    assert!(busy.est_ttft_ns > 0.0);
    // The holder was given no new prefix; the free room is what the index says.
    assert_eq!((holder.placed_on_hardware, holder.free_room), (0, 54));
    assert_eq!(busy.free_room, 64);
}

#[test]
fn the_end_of_a_request_reaches_the_placements_it_used() {
    // Two new prompts on an idle fleet, the second 851 ms after the first: the
    // first counts as a recent placement unless its request was said to have ended
    // more than three think-time floors (750 ms) before.
    let placed_after = |first_ended: bool| {
        let mut r = router();
        let mut rep = replica(2, 100);
        let fleet = TestFleet::healthy(2);
        let (a, b) = (prompt(1, 8), prompt(100, 8));
        let d = route(
            &mut r,
            &mut rep,
            &fleet,
            &facts(PolicyName::PrefixAware, &a),
            0,
        );
        assert_eq!(d.prompt_tail, Some((7, 8)));
        if first_ended {
            r.request_ended(d.prompt_tail, 100);
        }
        route(
            &mut r,
            &mut rep,
            &fleet,
            &facts(PolicyName::PrefixAware, &b),
            851,
        );
        r.explain_last(8).map(|e| e.placed_on_hardware).sum::<u32>()
    };
    assert_eq!(placed_after(false), 2);
    assert_eq!(placed_after(true), 1);
    // Other policies keep no placements: nothing to tell.
    let mut r = router();
    let mut rep = replica(2, 100);
    let a = prompt(1, 8);
    let d = route(
        &mut r,
        &mut rep,
        &TestFleet::healthy(2),
        &facts(PolicyName::RoundRobin, &a),
        0,
    );
    assert_eq!(d.prompt_tail, None);
}
