use super::*;
use proptest::prelude::*;

fn close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol
}

fn input(rate: f64, service: f64, budget: f64, slots: u32) -> CapacityInput {
    CapacityInput {
        arrival_rate: rate,
        service_seconds: service,
        wait_budget_seconds: budget,
        slots,
        quantile: 0.95,
    }
}

#[test]
fn erlang_c_matches_textbook_values() {
    // a = 2 Erlangs on 3 servers: P(wait) = 4/9.
    assert!(close(erlang_c(3, 2.0), 4.0 / 9.0, 1e-12));
    // M/M/1: P(wait) = ρ; M/M/2 at a = 1: 1/3.
    assert!(close(erlang_c(1, 0.5), 0.5, 1e-12));
    assert!(close(erlang_c(2, 1.0), 1.0 / 3.0, 1e-12));
    // The call-centre tables: 10 Erlangs on 11 agents, 20 on 25, 90 on 100.
    assert!(close(erlang_c(11, 10.0), 0.682118, 1e-6));
    assert!(close(erlang_c(25, 20.0), 0.209103, 1e-6));
    assert!(close(erlang_c(100, 90.0), 0.216940, 1e-6));
    // Unstable: everyone waits.
    assert_eq!(erlang_c(3, 3.0), 1.0);
}

#[test]
fn mm1_mean_wait_is_rho_over_mu_minus_lambda() {
    // λ = 0.5/s, service 1 s, one slot: Wq = ρ/(μ − λ) = 0.5/0.5 = 1 s.
    let q = queue_at(&input(0.5, 1.0, 0.0, 1), 1).unwrap();
    assert!(close(q.mean_wait_seconds, 1.0, 1e-12));
    assert!(close(q.utilisation, 0.5, 1e-12));
    // p95: ln(0.5 / 0.05) / 0.5 = 2 ln 10.
    assert!(close(q.quantile_wait_seconds, 2.0 * 10f64.ln(), 1e-9));
    assert!(queue_at(&input(1.0, 1.0, 0.0, 1), 1).is_none());
}

#[test]
fn engines_are_slots_times_count() {
    // 2 Erlangs (4 req/s × 0.5 s), 3 slots per engine: one engine is the textbook
    // M/M/3; its p95 wait is ln(0.4444 / 0.05) / (6 − 4) = 1.092 s.
    let one = queue_at(&input(4.0, 0.5, 0.0, 3), 1).unwrap();
    assert!(close(one.wait_probability, 4.0 / 9.0, 1e-12));
    assert!(close(
        one.quantile_wait_seconds,
        (4.0f64 / 9.0 / 0.05).ln() / 2.0,
        1e-9
    ));
    // A budget of 1.1 s takes one engine; 1.0 s needs a second.
    assert_eq!(recommend(&input(4.0, 0.5, 1.1, 3)).engines, 1);
    let two = recommend(&input(4.0, 0.5, 1.0, 3));
    assert_eq!(two.engines, 2);
    assert!(close(two.utilisation, 2.0 / 6.0, 1e-12));
}

#[test]
fn no_load_needs_no_engine_and_bad_inputs_count_as_none() {
    assert_eq!(recommend(&input(0.0, 1.0, 1.0, 4)).engines, 0);
    assert_eq!(recommend(&input(5.0, 0.0, 1.0, 4)).engines, 0);
    assert_eq!(recommend(&input(f64::NAN, 1.0, 1.0, 4)).engines, 0);
    assert_eq!(recommend(&input(5.0, f64::INFINITY, 1.0, 4)).engines, 0);
}

#[test]
fn a_spent_budget_asks_for_no_queueing_at_the_quantile() {
    let r = recommend(&input(50.0, 1.0, -3.0, 8));
    assert!(r.wait_probability <= 0.05);
    assert_eq!(r.quantile_wait_seconds, 0.0);
    let fewer = queue_at(&input(50.0, 1.0, 0.0, 8), r.engines - 1);
    assert!(fewer.is_none_or(|q| q.wait_probability > 0.05));
}

#[test]
fn absurd_loads_stop_at_the_cap() {
    let r = recommend(&input(1e12, 10.0, 0.0, 1));
    assert_eq!(r.engines, MAX_ENGINES);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn the_answer_meets_the_budget_below_full_utilisation_and_is_the_smallest(
        rate in 0.01f64..500.0,
        service in 0.001f64..20.0,
        budget in -1.0f64..5.0,
        slots in 1u32..64,
    ) {
        let i = input(rate, service, budget, slots);
        let r = recommend(&i);
        prop_assume!(r.engines < MAX_ENGINES);
        prop_assert!(r.engines >= 1);
        prop_assert!(r.utilisation < 1.0);
        prop_assert!(r.quantile_wait_seconds <= budget.max(0.0) + 1e-12);
        prop_assert!(r.wait_probability >= 0.0 && r.wait_probability <= 1.0);
        if r.engines > 1 {
            let fewer = queue_at(&i, r.engines - 1);
            prop_assert!(fewer.is_none_or(|q| q.quantile_wait_seconds > budget.max(0.0)));
        }
    }

    #[test]
    fn more_load_never_needs_fewer_engines(
        rate in 0.01f64..200.0,
        more in 1.0f64..4.0,
        service in 0.001f64..10.0,
        budget in 0.0f64..3.0,
        slots in 1u32..32,
    ) {
        let low = recommend(&input(rate, service, budget, slots));
        let high = recommend(&input(rate * more, service, budget, slots));
        prop_assert!(high.engines >= low.engines);
        let slower = recommend(&input(rate, service * more, budget, slots));
        prop_assert!(slower.engines >= low.engines);
    }

    #[test]
    fn more_budget_or_slots_never_needs_more_engines(
        rate in 0.01f64..200.0,
        service in 0.001f64..10.0,
        budget in 0.0f64..3.0,
        extra in 0.0f64..3.0,
        slots in 1u32..32,
    ) {
        let tight = recommend(&input(rate, service, budget, slots));
        let loose = recommend(&input(rate, service, budget + extra, slots));
        prop_assert!(loose.engines <= tight.engines);
        let wider = recommend(&input(rate, service, budget, slots * 2));
        prop_assert!(wider.engines <= tight.engines);
    }

    #[test]
    fn erlang_c_falls_as_servers_are_added(erlangs in 0.01f64..200.0, extra in 1u64..20) {
        let n = erlangs.ceil() as u64 + 1;
        let c = erlang_c(n, erlangs);
        prop_assert!((0.0..=1.0).contains(&c));
        prop_assert!(erlang_c(n + extra, erlangs) <= c + 1e-12);
    }
}
