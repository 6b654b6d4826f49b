use super::*;

fn ids(names: &[&str]) -> Vec<String> {
    names.iter().map(|s| s.to_string()).collect()
}

fn idle(backends: impl IntoIterator<Item = BackendIdx>) -> Vec<Candidate> {
    backends
        .into_iter()
        .map(|backend| Candidate::new(backend, 0))
        .collect()
}

fn five() -> ConsistentHash {
    ConsistentHash::new(&ids(&["a", "b", "c", "d", "e"]), 160, 1.25)
}

fn key(i: u64) -> u64 {
    xxh3_64(&i.to_le_bytes())
}

fn pick(ch: &mut ConsistentHash, cands: &[Candidate], key: Option<u64>) -> Pick {
    let input = RouteInput {
        candidates: cands,
        affinity_key: key,
        prompt_blocks: 0,
        ..RouteInput::default()
    };
    ch.pick(&input, &mut fastrand::Rng::with_seed(0)).unwrap()
}

#[test]
fn same_key_same_backend() {
    let mut ch = five();
    let cands = idle(0..5);
    for i in 0..100 {
        let first = pick(&mut ch, &cands, Some(key(i)));
        assert_eq!(first.reason, Reason::HashRing);
        for _ in 0..3 {
            assert_eq!(pick(&mut ch, &cands, Some(key(i))), first);
        }
        assert_eq!(pick(&mut five(), &cands, Some(key(i))), first);
    }
}

#[test]
fn keys_spread_over_all_backends() {
    let mut ch = five();
    let cands = idle(0..5);
    let mut counts = [0u32; 5];
    for i in 0..1000 {
        counts[pick(&mut ch, &cands, Some(key(i))).backend] += 1;
    }
    // Deterministic inputs; 160 points each keep every share near 200.
    assert!(counts.iter().all(|&n| n >= 100), "{counts:?}");
}

#[test]
fn homes_follow_ids_not_config_order() {
    let mut abc = ConsistentHash::new(&ids(&["a", "b", "c"]), 160, 1.25);
    let mut cab = ConsistentHash::new(&ids(&["c", "a", "b"]), 160, 1.25);
    let cands = idle(0..3);
    let abc_names = ["a", "b", "c"];
    let cab_names = ["c", "a", "b"];
    for i in 0..300 {
        let x = pick(&mut abc, &cands, Some(key(i))).backend;
        let y = pick(&mut cab, &cands, Some(key(i))).backend;
        assert_eq!(abc_names[x], cab_names[y]);
    }
}

#[test]
fn removing_a_backend_moves_only_its_keys() {
    let mut ch = five();
    let all = idle(0..5);
    let without_c = idle([0, 1, 3, 4]);
    let mut moved = 0;
    for i in 0..1000 {
        let before = pick(&mut ch, &all, Some(key(i)));
        let after = pick(&mut ch, &without_c, Some(key(i)));
        assert_eq!(after.reason, Reason::HashRing);
        if before.backend == 2 {
            assert_ne!(after.backend, 2);
            moved += 1;
        } else {
            assert_eq!(after.backend, before.backend, "key {i}");
        }
    }
    assert!(moved > 0);
}

#[test]
fn capacity_formula() {
    let ch = five();
    let loads = [3, 2, 4, 1];
    let cands: Vec<_> = loads
        .iter()
        .enumerate()
        .map(|(backend, &in_flight)| Candidate::new(backend, in_flight))
        .collect();
    // ceil(1.25 * 11 / 4) = ceil(3.4375)
    assert_eq!(ch.capacity(&cands), 4);
    assert_eq!(ch.capacity(&idle(0..5)), 1);
    let strict = ConsistentHash::new(&ids(&["a"]), 1, f64::NAN);
    assert_eq!(strict.capacity(&idle(0..4)), 1);
    assert_eq!(ConsistentHash::new(&[], 1, 0.5).capacity(&cands), 3);
}

#[test]
fn full_home_spills_to_the_next_candidate() {
    let mut ch = five();
    let mut cands = idle(0..5);
    let k = Some(key(42));
    let home = pick(&mut ch, &cands, k).backend;
    for c in cands.iter_mut() {
        c.in_flight = 4;
    }
    // total 20, capacity ceil(1.25 * 21 / 5) = 6: home at 6 is full.
    cands[home].in_flight = 6;
    assert_eq!(ch.capacity(&cands), 6);
    let spilled = pick(&mut ch, &cands, k);
    assert_eq!(spilled.reason, Reason::HashRingSpill);
    assert_ne!(spilled.backend, home);
    cands[home].in_flight = 5;
    assert_eq!(
        pick(&mut ch, &cands, k),
        Pick {
            backend: home,
            reason: Reason::HashRing
        }
    );
}

#[test]
fn hot_key_never_exceeds_capacity() {
    let mut ch = five();
    let mut cands = idle(0..5);
    let k = Some(key(7));
    let home = pick(&mut ch, &cands, k).backend;
    cands[(home + 1) % 5].in_flight = 3;
    let mut spills = 0;
    for _ in 0..500 {
        let capacity = ch.capacity(&cands);
        let p = pick(&mut ch, &cands, k);
        let c = cands.iter_mut().find(|c| c.backend == p.backend).unwrap();
        assert!(u64::from(c.in_flight) < capacity);
        c.in_flight += 1;
        assert!(u64::from(c.in_flight) <= capacity);
        match p.reason {
            Reason::HashRing => assert_eq!(p.backend, home),
            Reason::HashRingSpill => {
                assert_ne!(p.backend, home);
                spills += 1;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(spills > 0);
    let max = cands.iter().map(|c| c.in_flight).max().unwrap();
    let min = cands.iter().map(|c| c.in_flight).min().unwrap();
    assert!(
        f64::from(max) <= 1.25 * f64::from(503) / 5.0 + 1.0,
        "{cands:?}"
    );
    assert!(min > 0, "{cands:?}");
}

#[test]
fn no_key_falls_back_to_least_loaded() {
    let mut ch = five();
    let mut cands = idle(0..5);
    cands[0].in_flight = 2;
    cands[2].in_flight = 1;
    let p = pick(&mut ch, &cands[..3], None);
    assert_eq!(
        p,
        Pick {
            backend: 1,
            reason: Reason::HashNoKey
        }
    );
}

#[test]
fn off_ring_candidates_are_still_served() {
    let mut ch = ConsistentHash::new(&ids(&["a", "b"]), 16, 1.0);
    let only_new = idle([5, 6]);
    let p = pick(&mut ch, &only_new, Some(key(1)));
    assert_eq!(p.reason, Reason::HashRingSpill);
    assert!([5, 6].contains(&p.backend));

    let mixed = [Candidate::new(0, 9), Candidate::new(7, 0)];
    assert_eq!(
        pick(&mut ch, &mixed, Some(key(1))),
        Pick {
            backend: 7,
            reason: Reason::HashRingSpill
        }
    );
}

#[test]
fn empty_candidates_or_ring() {
    let mut ch = five();
    assert!(ch
        .pick(
            &RouteInput {
                candidates: &[],
                affinity_key: Some(1),
                prompt_blocks: 0,
                ..RouteInput::default()
            },
            &mut fastrand::Rng::with_seed(0)
        )
        .is_none());
    let mut empty_ring = ConsistentHash::new(&[], 0, 1.25);
    assert_eq!(pick(&mut empty_ring, &idle([3]), Some(1)).backend, 3);
}
