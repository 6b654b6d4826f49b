use super::*;
use crate::config::Config;
use crate::engine_metrics::EngineLoad;
use std::time::Duration;

fn fleet(toml: &str) -> FleetSnapshot {
    let config = Config::from_toml(toml).unwrap();
    FleetSnapshot::all_healthy(LiveConfig::initial(&config))
}

const PLAIN: &str = "[capacity]\nttft_slo_ms = 1000\nengine_slots = 4\n\
    [[backends]]\nid = \"a\"\nurl = \"http://127.0.0.1:9\"\nmodels = [\"m\"]\n\
    [[backends]]\nid = \"b\"\nurl = \"http://127.0.0.1:10\"\nmodels = [\"m\"]\n";

const SPLIT: &str = "[capacity]\nttft_slo_ms = 1000\nengine_slots = 4\n\
    [models.m.disagg]\nprotocol = \"vllm\"\n\
    [[backends]]\nid = \"p\"\nurl = \"http://127.0.0.1:9\"\nmodels = [\"m\"]\nrole = \"prefill\"\n\
    [[backends]]\nid = \"d\"\nurl = \"http://127.0.0.1:10\"\nmodels = [\"m\"]\nrole = \"decode\"\n";

fn sample(at: Instant, first: Sums, whole: Sums, waiting: u32) -> Sample {
    Sample {
        at,
        first: vec![first],
        whole: vec![whole],
        prefill_leg: Sums::default(),
        decode_leg: Sums::default(),
        handoff: Sums::default(),
        load: vec![("m".into(), 3, waiting)],
    }
}

#[test]
fn plain_models_are_pools_and_split_roles_are_prefill_and_decode() {
    let f = fleet(PLAIN);
    let p = pools(&f.live);
    assert_eq!(p.len(), 1);
    assert_eq!((p[0].name.as_str(), p[0].kind), ("m", PoolKind::Model(0)));
    assert_eq!(p[0].backends, [0, 1]);
    let f = fleet(SPLIT);
    let names: Vec<_> = pools(&f.live)
        .into_iter()
        .map(|p| (p.name, p.kind))
        .collect();
    assert_eq!(
        names,
        [
            ("prefill".to_string(), PoolKind::Prefill),
            ("decode".to_string(), PoolKind::Decode)
        ]
    );
}

#[test]
fn rates_and_times_come_from_the_window_and_feed_the_model() {
    let f = fleet(PLAIN);
    let p = pools(&f.live);
    let config = f.live.config.capacity;
    let t0 = Instant::now();
    let window: VecDeque<Sample> = [
        sample(t0, Sums::new(10, 5.0), Sums::new(10, 20.0), 0),
        sample(
            t0 + Duration::from_secs(5),
            Sums::new(60, 30.0),
            Sums::new(60, 120.0),
            0,
        ),
        sample(
            t0 + Duration::from_secs(10),
            Sums::new(110, 55.0),
            Sums::new(110, 220.0),
            0,
        ),
    ]
    .into();
    let r = estimate(&window, &p, &f, &config);
    assert_eq!(r.samples, 3);
    assert!((r.window_seconds - 10.0).abs() < 1e-9);
    let pool = &r.pools[0];
    let i = pool.inputs;
    assert_eq!(i.requests, 100);
    assert!((i.arrival_rate - 10.0).abs() < 1e-9);
    assert!((i.service_seconds - 2.0).abs() < 1e-9);
    assert!((i.first_service_seconds - 0.5).abs() < 1e-9);
    assert!((i.wait_budget_seconds - 0.5).abs() < 1e-9);
    let expected = recommend(&CapacityInput {
        arrival_rate: 10.0,
        service_seconds: 2.0,
        wait_budget_seconds: 0.5,
        slots: 4,
        quantile: 0.95,
    });
    assert_eq!(pool.model, expected);
    // 20 Erlangs on 4-slot engines: at least 6 engines for utilisation < 1.
    assert!(pool.model.engines >= 6);
    assert!(pool.predicted_ttft_seconds <= 1.0);
    assert_eq!(pool.backends, ["a", "b"]);
    assert!((pool.observed.mean_running - 3.0).abs() < 1e-9);
    assert_eq!(pool.observed.engines, 2);
}

#[test]
fn engine_queueing_is_taken_off_by_littles_law() {
    let f = fleet(PLAIN);
    let p = pools(&f.live);
    let t0 = Instant::now();
    // λ = 10/s and 4 requests waiting on average: 0.4 s of each TTFT was queueing.
    let window: VecDeque<Sample> = [
        sample(t0, Sums::default(), Sums::default(), 4),
        sample(
            t0 + Duration::from_secs(10),
            Sums::new(100, 60.0),
            Sums::new(100, 200.0),
            4,
        ),
    ]
    .into();
    let i = estimate(&window, &p, &f, &f.live.config.capacity).pools[0].inputs;
    assert!((i.engine_queue_seconds - 0.4).abs() < 1e-9);
    assert!((i.first_service_seconds - 0.2).abs() < 1e-9);
    assert!((i.service_seconds - 1.6).abs() < 1e-9);
}

#[test]
fn split_pools_share_the_slack_and_count_legs() {
    let f = fleet(SPLIT);
    let p = pools(&f.live);
    let t0 = Instant::now();
    let legs = |n: u64, prefill: f64, decode: f64, handoff: f64| Sample {
        at: t0 + Duration::from_secs(n),
        first: vec![],
        whole: vec![],
        prefill_leg: Sums::new(n * 10, prefill),
        decode_leg: Sums::new(n * 10, decode),
        handoff: Sums::new(n * 10, handoff),
        load: vec![],
    };
    let window: VecDeque<Sample> = [legs(0, 0.0, 0.0, 0.0), legs(10, 20.0, 300.0, 10.0)].into();
    let r = estimate(&window, &p, &f, &f.live.config.capacity);
    let (pre, dec) = (&r.pools[0].inputs, &r.pools[1].inputs);
    assert!((pre.arrival_rate - 10.0).abs() < 1e-9);
    assert!((pre.service_seconds - 0.2).abs() < 1e-9);
    assert!((dec.service_seconds - 3.0).abs() < 1e-9);
    assert!((dec.first_service_seconds - 0.1).abs() < 1e-9);
    // (1.0 − 0.2 − 0.1) / 2 each.
    assert!((pre.wait_budget_seconds - 0.35).abs() < 1e-9);
    assert!((dec.wait_budget_seconds - 0.35).abs() < 1e-9);
    assert!(r.pools[1].model.engines > r.pools[0].model.engines);
}

#[test]
fn no_window_no_load_and_engines_are_observed() {
    let mut f = fleet(PLAIN);
    let load = |running, waiting| {
        Some(EngineLoad {
            running,
            waiting,
            ..Default::default()
        })
    };
    f.engine = vec![load(2, 1), load(0, 0)].into_boxed_slice();
    let p = pools(&f.live);
    let r = estimate(&VecDeque::new(), &p, &f, &f.live.config.capacity);
    let pool = &r.pools[0];
    assert_eq!(pool.model.engines, 0);
    assert_eq!(pool.inputs.arrival_rate, 0.0);
    assert_eq!((pool.observed.engines, pool.observed.busy_engines), (2, 1));
    assert_eq!((pool.observed.running, pool.observed.waiting), (2, 1));
    let one: VecDeque<Sample> = [Sample::new(Instant::now(), &[], &f, &p)].into();
    let r = estimate(&one, &p, &f, &f.live.config.capacity);
    assert_eq!(r.pools[0].model.engines, 0);
}
