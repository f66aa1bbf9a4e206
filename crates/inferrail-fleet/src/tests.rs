//! Tests of the fleet simulation: its requests are the harness's, it replays
//! from its seed, cache-aware routing keeps the caches warm where
//! cache-blind routing does not, hot traffic still spreads, and capacity
//! searches end and grow with the fleet.

use std::time::Duration;

use inferrail_config::Limits;
use inferrail_policy::{PolicyKind, TextKind};
use inferrail_route::lifecycle::Timing;

use crate::capacity::{self, Search};
use crate::sim::{self, Outcome, Setup};
use crate::traffic::{Arrival, Traffic};
use crate::{default_kv_blocks, line};
use inferrail_workload::{self as workload, Counter, Kind, Span, Spec};

/// A small W-something: short prompts so tests run in debug builds.
fn small(kind: Kind) -> Spec {
    Spec {
        system_tokens: Span { min: 200, max: 800 },
        question_tokens: Span { min: 10, max: 60 },
        output_tokens: Span { min: 10, max: 40 },
        ..Spec::new(kind)
    }
}

fn setup(spec: &Spec, replicas: usize) -> Setup {
    Setup {
        replicas,
        kv_blocks: default_kv_blocks(spec, 1, 16).expect("kv blocks"),
        mixed: Vec::new(),
        block_size: 16,
        max_loras: 0,
        host_blocks: 0,
        time_scale: 1.0,
        policies: serde_yaml::Value::Null,
        limits: Limits::default(),
        seed: 1,
        model: spec.model.clone(),
        routers: 1,
        peers: true,
        peer_delay: std::time::Duration::from_micros(500),
        timing: Timing::ROUTER,
        status_after_end: None,
        first_byte_after_end: None,
        prefill_replicas: 0,
    }
}

fn run(spec: &Spec, replicas: usize, policy: PolicyKind, rate: f64, requests: usize) -> Outcome {
    let s = setup(spec, replicas);
    let text = inferrail_route::Core::new(&sim::config(&s, policy)).expect("core").wants_text(0);
    let o = sim::simulate(&s, policy, Traffic::new(spec, rate, requests, 1, text).expect("traffic")).expect("simulate");
    eprintln!("{}", line(&o));
    o
}

#[test]
fn same_requests_as_the_harness() {
    let counter = Counter::new().expect("tokenizer");
    for (spec, n) in
        [(small(Kind::W1), 300), (small(Kind::Mix), 300), (small(Kind::Hot), 300), (small(Kind::W6), 100), (Spec::new(Kind::W1), 30)]
    {
        let secs = (n as f64 * 1.2 + 100.0) / 5.0;
        let mut harness = workload::generate(&spec, 5.0, secs, 7).expect("harness");
        harness.truncate(n);
        let fast: Vec<Arrival> =
            Traffic::new(&spec, 5.0, n, 7, TextKind::Contents).expect("traffic").collect::<anyhow::Result<_>>().expect("arrivals");
        assert_eq!(fast.len(), n);
        for (h, f) in harness.iter().zip(&fast) {
            assert_eq!(h.at, f.at);
            assert_eq!(counter.ids(h.api, &h.body).expect("ids"), f.ids, "{:?}", spec.workload);
            assert_eq!(h.body["max_tokens"].as_u64(), Some(f.max_tokens as u64));
            let contents: Vec<&str> =
                h.body["messages"].as_array().expect("messages").iter().filter_map(|m| m["content"].as_str()).collect();
            assert_eq!(f.text.as_deref(), Some(contents.join(" ").as_str()));
        }
    }
}

#[test]
fn an_agents_next_step_resends_the_reply_its_engine_generated() {
    let spec = Spec { system_prompts: 1, turns: Span { min: 4, max: 4 }, ..small(Kind::Agent) };
    let counter = Counter::new().expect("tokenizer");
    let firsts: Vec<Arrival> =
        Traffic::new(&spec, 8.0, 40, 3, TextKind::None).expect("traffic").collect::<anyhow::Result<_>>().expect("arrivals");
    assert_eq!(firsts.len(), 10, "40 steps are 10 agents of 4; the later steps are made as the run goes");
    let mut step = firsts[0].clone();
    for k in 1..4 {
        let agent = step.agent.take().expect("an agent's step");
        let reply = agent.reply(step.max_tokens);
        let reply_ids = inferrail_tokenize::sim::encode(&reply);
        assert_eq!(reply_ids.len(), step.max_tokens, "as long as it asked");
        let next = agent.next(&reply, Duration::from_secs(5), &counter).expect("a next step").expect("tokenizes");
        assert!((Duration::from_millis(5200)..=Duration::from_secs(6)).contains(&next.at), "{:?}", next.at);
        let resent: Vec<u32> = step.ids.iter().chain(&reply_ids).copied().collect();
        assert_eq!(next.ids[..resent.len()], resent[..], "step {k} starts with the last prompt and its reply");
        assert!(next.ids.len() >= resent.len() + 60, "and adds a tool's output");
        step = next;
    }
    let last = step.agent.take().expect("the last step is an agent's too");
    assert!(last.next("done", Duration::ZERO, &counter).is_none());
}

/// The simulation runs the router's own ledger: with statuses heard 100 ms
/// after each request's end (as an access log tells them), the lifecycle's
/// grace (500 ms) waits for them and the KV records complete, so every
/// prediction on one replica is exact. With the grace cut to 50 ms (the
/// rule broken), the records are taken back before the status comes and
/// the index forgets prompts the engine holds.
#[test]
fn the_simulation_runs_the_routers_lifecycle() {
    let spec = Spec { system_prompts: 2, turns: Span { min: 8, max: 8 }, ..small(Kind::Agent) };
    let late = Setup { kv_blocks: 1500, status_after_end: Some(Duration::from_millis(100)), ..setup(&spec, 1) };
    let run = |s: &Setup| {
        let o =
            sim::simulate(s, PolicyKind::CostModel, Traffic::new(&spec, 10.0, 400, 1, TextKind::None).expect("traffic")).expect("simulate");
        eprintln!("{}", line(&o));
        o
    };
    let kept = run(&late);
    assert_eq!((kept.requests, kept.rejected), (400, 0));
    assert_eq!(kept.prediction_exact, 1.0, "the status came within the grace: every record completed");
    let short = Timing { grace: Duration::from_millis(50), ..Timing::ROUTER };
    let broken = run(&Setup { timing: short, ..late.clone() });
    assert!(broken.prediction_exact < 0.5, "records taken back before their status: {}", broken.prediction_exact);
    assert_eq!(run(&Setup { status_after_end: None, ..late }).prediction_exact, 1.0, "a status with the first token needs no grace");
}

#[test]
fn agents_find_their_replies_cached_where_they_were_generated() {
    let spec = Spec { system_prompts: 2, turns: Span { min: 8, max: 8 }, ..small(Kind::Agent) };
    let s = Setup { kv_blocks: 1500, ..setup(&spec, 3) };
    let run = |policy, replicas| {
        let s = Setup { replicas, ..s.clone() };
        let o = sim::simulate(&s, policy, Traffic::new(&spec, 10.0, 800, 1, TextKind::None).expect("traffic")).expect("simulate");
        eprintln!("{}", line(&o));
        o
    };
    // One replica with room for every agent: each step finds the last one's
    // prompt and reply. The router's prediction counts the reply cached only
    // where the engine cached it, so exact predictions show the engine did.
    let one = run(PolicyKind::CostModel, 1);
    assert_eq!((one.requests, one.rejected), (800, 0), "every step of 100 agents arrived");
    assert_eq!(one.prediction_exact, 1.0);
    let (cost, rr) = (run(PolicyKind::CostModel, 3), run(PolicyKind::RoundRobin, 3));
    assert!(cost.prediction_exact >= 0.99, "{}", cost.prediction_exact);
    assert!(cost.hit_rate > rr.hit_rate + 0.1, "cost_model {} round robin {}", cost.hit_rate, rr.hit_rate);
}

#[test]
fn a_seed_replays_the_same_simulation() {
    let spec = small(Kind::Mix);
    let strip = |o: Outcome| {
        let mut v = serde_json::to_value(o).expect("json");
        v.as_object_mut().expect("object").remove("wall_s");
        v
    };
    for policy in [PolicyKind::CostModel, PolicyKind::Random, PolicyKind::SglangCacheAware] {
        let a = strip(run(&spec, 3, policy, 3.0, 2_000));
        let b = strip(run(&spec, 3, policy, 3.0, 2_000));
        assert_eq!(a, b, "{policy:?}");
    }
}

#[test]
fn cost_model_keeps_w1_cached_where_round_robin_cannot() {
    let spec = small(Kind::W1);
    // Measured at seed 1 (caches of half the shared prompts): cost_model 84.2%, round robin 38.5%, 97.8% of predictions exact.
    let cost = run(&spec, 3, PolicyKind::CostModel, 2.0, 4_000);
    let rr = run(&spec, 3, PolicyKind::RoundRobin, 2.0, 4_000);
    assert!(cost.hit_rate >= 0.75, "cost_model {:.3}", cost.hit_rate);
    assert!(rr.hit_rate < 0.45, "round_robin {:.3}", rr.hit_rate);
    assert!(cost.rejected == 0 && rr.rejected == 0);
    assert!(cost.ttft.p50_ms < rr.ttft.p50_ms);
    assert!(cost.prediction_exact > 0.9, "the router's shadow follows the engines: {:.3}", cost.prediction_exact);
}

#[test]
fn routers_that_are_peers_route_as_one_and_keep_the_limits_together() {
    let spec = small(Kind::W1);
    let go = |routers, peers, max_concurrency| {
        let s = Setup { routers, peers, limits: Limits { max_concurrency, max_pending: max_concurrency }, ..setup(&spec, 3) };
        let text = inferrail_route::Core::new(&sim::config(&s, PolicyKind::CostModel)).expect("core").wants_text(0);
        let o = sim::simulate(&s, PolicyKind::CostModel, Traffic::new(&spec, 2.0, 3_000, 1, text).expect("traffic")).expect("simulate");
        eprintln!("{}", line(&o));
        o
    };
    let (one, two, blind) = (go(1, true, 256), go(2, true, 256), go(2, false, 256));
    assert!((one.hit_rate - two.hit_rate).abs() <= 0.03, "one router {:.3}, two peers {:.3}", one.hit_rate, two.hit_rate);
    assert!(blind.hit_rate < two.hit_rate, "without peers each router knows half: {:.3} against {:.3}", blind.hit_rate, two.hit_rate);
    // Three replicas of two slots, far more traffic than they serve: the routers shed, and as peers never exceed the limit together.
    let busy = |routers, peers| {
        let s = Setup { routers, peers, limits: Limits { max_concurrency: 2, max_pending: 2 }, ..setup(&spec, 3) };
        sim::simulate(&s, PolicyKind::LeastRequest, Traffic::new(&spec, 50.0, 2_000, 1, TextKind::None).expect("traffic"))
            .expect("simulate")
    };
    let (peers, alone) = (busy(3, true), busy(3, false));
    assert!(peers.rejected > 0 && peers.peak_in_flight == 2, "{} refused, peak {}", peers.rejected, peers.peak_in_flight);
    assert!(alone.peak_in_flight > 2, "routers that are not peers each admit the limit: peak {}", alone.peak_in_flight);
}

#[test]
fn hot_traffic_still_spreads() {
    let spec = small(Kind::Hot);
    // Measured at seed 1: 33.6%; prefix_hash, which pins each prompt to one replica, 61.9%.
    let cost = run(&spec, 3, PolicyKind::CostModel, 2.0, 4_000);
    let pinned = run(&spec, 3, PolicyKind::PrefixHash, 2.0, 4_000);
    assert_eq!(cost.rejected, 0);
    assert!(cost.busiest_share <= 0.40, "busiest {:.3}", cost.busiest_share);
    assert!(pinned.busiest_share > 0.5, "the traffic is hot: {:.3}", pinned.busiest_share);
}

/// `requests` of `spec` at 20/s, round robin over two replicas of `kv_blocks` blocks.
fn round_robin_on_two(spec: &Spec, kv_blocks: usize, requests: usize) -> Outcome {
    let s = Setup { kv_blocks, ..setup(spec, 2) };
    let traffic = Traffic::new(spec, 20.0, requests, 1, TextKind::Contents).expect("traffic");
    let o = sim::simulate(&s, PolicyKind::RoundRobin, traffic).expect("simulate");
    eprintln!("{}", line(&o));
    o
}

#[test]
fn the_slowest_first_tokens_are_split_by_phase_and_wait_for_kv_room_only_in_a_short_cache() {
    let spec = small(Kind::W6);
    // Room for every request at once, and for about four (a request's prompt and output take up to 57 blocks).
    let (roomy, short) = (round_robin_on_two(&spec, 100_000, 1_000), round_robin_on_two(&spec, 240, 1_000));
    for o in [&roomy, &short] {
        let s = &o.slowest;
        assert_eq!(s.requests, 10, "1% of 1,000");
        // The phases add up to the slowest tenth's mean time to first token, which lies between p99 and the maximum.
        let total = s.queued_ms + s.kv_wait_ms + s.prefill_ms;
        assert!(total >= o.ttft.p99_ms - 1e-6 && total <= o.ttft.max_ms + 1e-6, "{total} against {:?}", o.ttft);
        assert!(s.prefill_ms > 0.0);
    }
    assert_eq!(roomy.slowest.kv_wait_ms, 0.0, "nothing waits for room in a cache that holds everything");
    assert!(short.slowest.kv_wait_ms > 0.0, "{:?}", short.slowest);
}

/// Outputs that outgrow a short cache: decoding requests take a block as
/// their tokens fill the last, the newest is preempted when none is free,
/// and every preempted request recomputes and completes. A cache with room
/// for everything preempts nothing.
#[test]
fn a_short_cache_preempts_the_newest_and_every_request_still_completes() {
    let spec = Spec { output_tokens: Span { min: 200, max: 400 }, ..small(Kind::W6) };
    let (roomy, short) = (round_robin_on_two(&spec, 100_000, 400), round_robin_on_two(&spec, 240, 400));
    assert_eq!(roomy.preemptions, 0);
    assert!(short.preemptions > 10, "{} preemptions", short.preemptions);
    for o in [&roomy, &short] {
        assert_eq!(o.rejected, 0);
        assert_eq!(o.completed, o.requests, "every request completes");
        assert_eq!(o.ttft.count, o.requests, "one first token each, preempted or not");
    }
}

#[test]
fn prefixes_per_replica_count_the_shared_prompts_each_replica_serves() {
    // System prompts long enough to have a root prefix (16 blocks of 16).
    let w1 = Spec { system_tokens: Span { min: 400, max: 800 }, ..small(Kind::W1) };
    let blind = run(&w1, 3, PolicyKind::RoundRobin, 2.0, 600);
    let hashed = run(&w1, 3, PolicyKind::PrefixHash, 2.0, 600);
    // Round robin sends each of the six prompts everywhere, about equally.
    assert!(blind.prefixes_per_replica.0 > 5.0, "{:?}", blind.prefixes_per_replica);
    // Prefix hashing sends each prompt to one replica: the six are split
    // among three, at most two a replica on average.
    assert!(hashed.prefixes_per_replica.0 <= 2.0 + 1e-9, "{:?}", hashed.prefixes_per_replica);
    assert!(hashed.prefixes_per_replica.0 < blind.prefixes_per_replica.0 / 2.0);
    // One system prompt: one prefix on every replica, whatever the policy.
    let one = Spec { system_prompts: 1, ..w1.clone() };
    for policy in [PolicyKind::RoundRobin, PolicyKind::CostModel] {
        let o = run(&one, 3, policy, 2.0, 300);
        assert!(
            (o.prefixes_per_replica.0 - 1.0).abs() < 1e-9 && (o.prefixes_per_replica.1 - 1.0).abs() < 1e-9,
            "{policy:?} {:?}",
            o.prefixes_per_replica
        );
    }
    // Nothing shared: no prefix counts.
    let w6 = Spec { system_tokens: Span { min: 400, max: 800 }, ..small(Kind::W6) };
    let none = run(&w6, 3, PolicyKind::RoundRobin, 2.0, 100).prefixes_per_replica;
    assert!(none.0.to_bits() == 0 && none.1.to_bits() == 0, "{none:?}");
}

#[test]
fn capacity_search_ends_and_grows_with_the_fleet() {
    let spec = small(Kind::W1);
    let search = Search { slo_s: 2.0, tolerance: 0.1, guess_per_replica: 2.0 };
    let capacity = |n: usize| {
        let s = setup(&spec, n);
        let c = capacity::rate(n, search, |rate| {
            sim::simulate(&s, PolicyKind::CostModel, Traffic::new(&spec, rate, 1_500, 1, TextKind::None)?)
        })
        .expect("search");
        eprintln!("{n} replicas: {:.1} req/s after {} probes", c.rate, c.probes);
        assert!(c.rate > 0.0 && c.probes < 40);
        c.rate
    };
    let (one, two, four) = (capacity(1), capacity(2), capacity(4));
    assert!(one <= two && two <= four, "{one} {two} {four}");
    let needed = capacity::replicas(1, 16, 2.0, |n| {
        sim::simulate(&setup(&spec, n), PolicyKind::CostModel, Traffic::new(&spec, two, 1_500, 1, TextKind::None)?)
    })
    .expect("replicas");
    assert!(needed.is_some_and(|n| n <= 2), "{needed:?}");
}

#[test]
fn on_a_mixed_fleet_cost_model_gives_the_faster_engine_more_and_round_robin_does_not() {
    // W6 shares nothing, so only speed can tell the replicas apart: one
    // engine four times as fast as the other, the router told each cost;
    // 4 req/s keeps the slow one under half busy with half the requests.
    let spec = small(Kind::W6);
    let base = setup(&spec, 2);
    let mixed = Setup { mixed: vec![(0.5, base.kv_blocks), (2.0, base.kv_blocks)], ..base.clone() };
    let go = |s: &Setup, policy| {
        let o = sim::simulate(s, policy, Traffic::new(&spec, 4.0, 2_000, 1, TextKind::None).expect("traffic")).expect("simulate");
        eprintln!("{}", line(&o));
        o
    };
    let (cost, rr) = (go(&mixed, PolicyKind::CostModel), go(&mixed, PolicyKind::RoundRobin));
    assert!(cost.busiest_share > 0.6, "cost_model sent the fast engine {:.3}", cost.busiest_share);
    assert!(rr.busiest_share < 0.51, "round robin alternates: {:.3}", rr.busiest_share);
    assert!(cost.ttft.p99_ms < rr.ttft.p99_ms, "cost_model p99 {} ms, round robin {} ms", cost.ttft.p99_ms, rr.ttft.p99_ms);
    // The engines are timed by their own model: the same fleet unmixed is another simulation.
    let plain = go(&base, PolicyKind::RoundRobin);
    assert_ne!(plain.ttft.p99_ms, rr.ttft.p99_ms);
}

/// The shipped layout hears each first byte from the access log, after the
/// response's end: the index estimates when each request begins decoding
/// from the prefills ahead of it, and learns the replica's times from the
/// first bytes heard late. On W1 whose shared prompts outgrow the caches,
/// with long outputs growing into them, its predictions are then within a
/// point of those with first bytes heard as they come (99.5% against
/// 99.7%; 94.2% with the output taken only at the end).
#[test]
fn first_bytes_heard_after_the_end_still_pace_the_outputs() {
    let spec = Spec {
        system_prompts: 8,
        system_tokens: Span { min: 600, max: 900 },
        output_tokens: Span { min: 100, max: 300 },
        ..small(Kind::W1)
    };
    let on_time = Setup { kv_blocks: 300, ..setup(&spec, 2) };
    let late = Setup { first_byte_after_end: Some(Duration::from_millis(50)), ..on_time.clone() };
    let run = |s: &Setup| {
        let o =
            sim::simulate(s, PolicyKind::CostModel, Traffic::new(&spec, 1.0, 600, 1, TextKind::None).expect("traffic")).expect("simulate");
        eprintln!("{}", line(&o));
        o
    };
    let (on_time, late) = (run(&on_time), run(&late));
    assert_eq!(late.completed, late.requests);
    let gap = on_time.prediction_exact - late.prediction_exact;
    assert!(gap < 0.01, "exact {} heard late against {} on time", late.prediction_exact, on_time.prediction_exact);
}

/// A disaggregated fleet runs each split request's two legs through the
/// router's ledger: every request completes, every lease (both legs') is
/// let go, and the prefill replicas' caches are predicted exactly.
/// Round robin splits every request and spreads each shared prompt over
/// both prefill replicas; cost_model keeps them apart.
#[test]
fn a_disaggregated_fleet_runs_both_legs_and_cost_model_keeps_the_prefill_caches() {
    let spec = small(Kind::W1);
    let s = Setup { prefill_replicas: 2, ..setup(&spec, 4) };
    let run = |policy| {
        let o = sim::simulate(&s, policy, Traffic::new(&spec, 2.0, 2_000, 1, TextKind::None).expect("traffic")).expect("simulate");
        eprintln!("{}", line(&o));
        o
    };
    let (cost, rr) = (run(PolicyKind::CostModel), run(PolicyKind::RoundRobin));
    for o in [&cost, &rr] {
        assert_eq!((o.rejected, o.completed), (0, 2_000), "{}", o.policy);
        assert_eq!(o.leases_at_end, 0, "{}: every leg's lease let go", o.policy);
        assert!(o.prediction_exact >= 0.99, "{}: {}", o.policy, o.prediction_exact);
    }
    assert_eq!(rr.split, 2_000, "round robin always splits");
    assert!(cost.split > 0, "cost_model splits where it pays");
    assert!(cost.hit_rate > rr.hit_rate + 0.1, "cost_model {:.3} round robin {:.3}", cost.hit_rate, rr.hit_rate);
}

/// Adapters in the engines: a step runs at most `max_loras` of them, a
/// request whose adapter would be one too many is passed over (deferred),
/// and each adapter brought into a slot costs its load. Round robin sends
/// every adapter everywhere and defers far more than a single slot's
/// worth; each adapter's cache is its own, predicted exactly.
#[test]
fn adapters_take_slots_and_the_rest_wait() {
    let spec = Spec { system_prompts: 12, ..small(Kind::Lora) };
    let s = Setup { max_loras: 2, ..setup(&spec, 3) };
    let run = |policy, setup: &Setup| {
        let o = sim::simulate(setup, policy, Traffic::new(&spec, 4.0, 1_500, 1, TextKind::None).expect("traffic")).expect("simulate");
        eprintln!("{}", line(&o));
        o
    };
    let rr = run(PolicyKind::RoundRobin, &s);
    assert_eq!((rr.rejected, rr.completed), (0, 1_500));
    assert!(rr.deferred > 0 && rr.adapter_loads > 0, "{} deferred, {} loads", rr.deferred, rr.adapter_loads);
    assert!(rr.prediction_exact >= 0.99, "each adapter's blocks are its own: {}", rr.prediction_exact);
    let unlimited = run(PolicyKind::RoundRobin, &Setup { max_loras: 0, ..s.clone() });
    assert_eq!((unlimited.deferred, unlimited.adapter_loads), (0, 0));
    assert!(rr.ttft.p99_ms > unlimited.ttft.p99_ms, "slots cost time: {} against {}", rr.ttft.p99_ms, unlimited.ttft.p99_ms);
}

/// Host memory behind small GPU caches: prompts evicted from the GPU are
/// loaded back, the router's shadow of each tier predicts them, and
/// pricing them keeps more cached, with faster first tokens at the median
/// and the 90th percentile, than routing as if they had to be computed
/// (`offload.aware` off).
#[test]
fn host_tiers_hold_what_the_gpu_evicts_and_pricing_them_pays() {
    let spec = Spec { system_prompts: 24, ..small(Kind::W1) };
    let gpu = default_kv_blocks(&spec, 1, 16).expect("kv blocks") / 3;
    let s = Setup { kv_blocks: gpu, host_blocks: gpu * 2, ..setup(&spec, 3) };
    let run = |setup: &Setup| {
        let o = sim::simulate(setup, PolicyKind::CostModel, Traffic::new(&spec, 6.0, 2_000, 1, TextKind::None).expect("traffic"))
            .expect("simulate");
        eprintln!("{}", line(&o));
        o
    };
    let aware = run(&s);
    let blind = run(&Setup { policies: serde_yaml::from_str("{cost_model: {offload: {aware: false}}}").expect("yaml"), ..s.clone() });
    let none = run(&Setup { host_blocks: 0, ..s.clone() });
    assert!(aware.host_tokens > 0 && none.host_tokens == 0, "{} {}", aware.host_tokens, none.host_tokens);
    // 99.6% at seed 1 (98.9% while the shadow stored a prompt at its
    // first token, not when it admitted the request: ADR 0063).
    assert!(aware.prediction_exact >= 0.99, "the shadow follows each tier: {}", aware.prediction_exact);
    assert!(aware.hit_rate > blind.hit_rate && blind.hit_rate > none.hit_rate, "{} {} {}", aware.hit_rate, blind.hit_rate, none.hit_rate);
    assert!(aware.ttft.p50_ms < blind.ttft.p50_ms && aware.ttft.p90_ms < blind.ttft.p90_ms, "{:?} against {:?}", aware.ttft, blind.ttft);
}
