//! The request path's promise: once warmed up, picks and prompt hashing never touch
//! the allocator. A counting global allocator (per thread, so parallel tests do not
//! interfere) checks it.

use std::num::NonZeroUsize;

use radixgate_orchestrator::{
    build_policy, model_seed, Candidate, PolicyConfig, PolicyName, PromptHasher, Reason,
    RouteInput, RoutingPolicy,
};

mod support;

use support::{allocations_during, Counting};

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn picks_do_not_allocate() {
    let config = PolicyConfig {
        backend_ids: (0..70).map(|i| format!("engine-{i}")).collect(),
        ..PolicyConfig::default()
    };
    let plain: Vec<Candidate> = (0..70)
        .map(|backend| Candidate::new(backend, (backend % 7) as u32))
        .collect();
    // What `prefix_aware` looks at: matches, engine queues (some saturated), learned
    // prefill costs; then the same with a session home, with one-block matches only,
    // and with every holder of the longest match saturated, so each of its branches
    // runs below.
    let rich: Vec<Candidate> = (0..70)
        .map(|backend| Candidate {
            matched_blocks: ((7 - backend % 7) * 6) as u32,
            engine_waiting: (backend % 3) as u32,
            prefill_ns_per_token: if backend % 4 == 0 {
                0
            } else {
                15_000 + backend as u32 * 100
            },
            ..Candidate::new(
                backend,
                if backend % 11 == 0 {
                    40
                } else {
                    (backend % 7) as u32
                },
            )
        })
        .collect();
    let session: Vec<Candidate> = rich
        .iter()
        .map(|&c| Candidate {
            session_home: c.backend == 9,
            ..c
        })
        .collect();
    let short: Vec<Candidate> = plain
        .iter()
        .map(|&c| Candidate {
            matched_blocks: (c.backend % 2) as u32,
            ..c
        })
        .collect();
    // Every holder of the longest match full and far above the fleet's mean load.
    let saturated: Vec<Candidate> = rich
        .iter()
        .map(|&c| Candidate {
            in_flight: if c.backend % 7 == 0 { 100 } else { c.in_flight },
            ..c
        })
        .collect();
    let sets = [&plain, &rich, &session, &short, &saturated];
    let mut rng = fastrand::Rng::with_seed(3);
    for name in PolicyName::ALL {
        let mut policy = build_policy(name, &config);
        let mut seen = [0u32; Reason::ALL.len()];
        let n = allocations_during(|| {
            for i in 0..1000u64 {
                let input = RouteInput {
                    candidates: &sets[(i % 5) as usize][(i % 7) as usize..],
                    affinity_key: (i % 3 != 0).then_some(i.wrapping_mul(0x9E37_79B9_7F4A_7C15)),
                    prompt_blocks: (i % 97) as u32,
                    ..RouteInput::default()
                };
                let pick = policy.pick(&input, &mut rng).unwrap();
                seen[Reason::ALL.iter().position(|&r| r == pick.reason).unwrap()] += 1;
            }
        });
        assert_eq!(n, 0, "{name}");
        if name == PolicyName::PrefixAware {
            for reason in [
                Reason::LongestPrefix,
                Reason::SpilledFromSaturated,
                Reason::FallbackLeastLoaded,
                Reason::NoMatch,
                Reason::SessionAffinity,
            ] {
                let i = Reason::ALL.iter().position(|&r| r == reason).unwrap();
                assert!(seen[i] > 0, "{reason} never picked: {seen:?}");
            }
        }
    }
}

#[test]
fn warmed_up_hasher_does_not_allocate() {
    let mut h = PromptHasher::new(NonZeroUsize::new(64).unwrap());
    let content = "lorem ipsum dolor sit amet ".repeat(40);
    let hash_prompt = |h: &mut PromptHasher| {
        h.reset(model_seed("m"));
        h.feed_message("system", None, &content);
        h.feed_message("user", Some("ann"), "hello");
        h.feed_content_part(&content);
        h.affinity_key()
    };
    let first = hash_prompt(&mut h);
    let n = allocations_during(|| {
        for _ in 0..100 {
            assert_eq!(hash_prompt(&mut h), first);
        }
    });
    assert_eq!(n, 0);
}
