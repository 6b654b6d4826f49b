use super::*;

#[test]
fn policy_names_round_trip() {
    for name in PolicyName::ALL {
        assert_eq!(name.as_str().parse::<PolicyName>(), Ok(name));
        assert_eq!(name.to_string(), name.as_str());
    }
}

#[test]
fn unknown_policy_is_an_error_with_the_choices() {
    let err = "power_of_two".parse::<PolicyName>().unwrap_err();
    assert_eq!(
        err.to_string(),
        "unknown routing policy `power_of_two`; expected one of: \
         round_robin, random, least_loaded, consistent_hash, prefix_aware"
    );
    assert!("Round_Robin".parse::<PolicyName>().is_err());
    assert!("".parse::<PolicyName>().is_err());
    let _: &dyn std::error::Error = &err;
}

#[test]
fn reason_strings() {
    let strs: Vec<_> = Reason::ALL.iter().map(|r| r.as_str()).collect();
    assert_eq!(
        strs,
        [
            "round-robin",
            "random",
            "least-loaded",
            "hash-ring",
            "hash-ring-spill",
            "hash-no-key",
            "longest-prefix",
            "spilled-from-saturated",
            "fallback-least-loaded",
            "no-match",
            "session-affinity",
            "chunk-affinity",
            "disagg-split",
            "disagg-local",
        ]
    );
}

#[test]
fn factory_builds_each_policy_and_dispatch_picks() {
    let config = PolicyConfig {
        backend_ids: vec!["a".into(), "b".into(), "c".into()],
        ..PolicyConfig::default()
    };
    let cands: Vec<_> = (0..3).map(|backend| Candidate::new(backend, 0)).collect();
    let input = RouteInput {
        candidates: &cands,
        affinity_key: Some(99),
        prompt_blocks: 0,
        ..RouteInput::default()
    };
    let mut rng = fastrand::Rng::with_seed(5);
    for name in PolicyName::ALL {
        let mut policy = build_policy(name, &config);
        assert_eq!(policy.name(), name);
        let pick = policy.pick(&input, &mut rng).unwrap();
        assert!(pick.backend < 3);
        let expected = match name {
            PolicyName::RoundRobin => Reason::RoundRobin,
            PolicyName::Random => Reason::Random,
            PolicyName::LeastLoaded => Reason::LeastLoaded,
            PolicyName::ConsistentHash => Reason::HashRing,
            PolicyName::PrefixAware => Reason::NoMatch,
        };
        assert_eq!(pick.reason, expected);
        let empty = RouteInput {
            candidates: &[],
            affinity_key: None,
            prompt_blocks: 0,
            ..RouteInput::default()
        };
        assert_eq!(policy.pick(&empty, &mut rng), None);
    }
}

#[test]
fn default_config() {
    let c = PolicyConfig::default();
    assert!(c.backend_ids.is_empty());
    assert_eq!(c.hash_load_factor, 1.25);
    assert_eq!(c.hash_virtual_nodes, 160);
    assert_eq!(c.prefix, PrefixAwareConfig::default());
}

#[test]
fn candidate_new_leaves_the_extras_unknown() {
    let c = Candidate::new(4, 7);
    assert_eq!(
        c,
        Candidate {
            backend: 4,
            in_flight: 7,
            matched_blocks: 0,
            engine_waiting: 0,
            prefill_ns_per_token: 0,
            prefill_fixed_ns: 0,
            queue_ns_per_request: 0,
            pending_prefill_tokens: 0,
            prefill_progress_ns: 0,
            session_home: false,
            uncached_media_tokens: 0,
            cache_free_blocks: None,
            cache_blocks: 0,
            peer_queue_ns: 0,
            peers_busy: 0,
            compute_group: None,
            in_flight_blocks: 0,
            engine_used_blocks: None,
        }
    );
}
