//! Plans and commits over in-memory fleets.

use super::*;
use crate::kv::Place;
use inferrail_config::Config;
use inferrail_policy::Prefill;
use proptest::prelude::*;

pub(crate) fn core(policy: &str, n: usize) -> (Core, Arc<Fleet>) {
    core_with(policy, "", n)
}

/// [`core`], with `more` of model `m`'s YAML fields after its policy.
fn core_with(policy: &str, more: &str, n: usize) -> (Core, Arc<Fleet>) {
    let mut yaml = format!("retry: {{fallbacks: 1}}\nmodels:\n  - {{name: m, policy: {policy}{more}}}\n  - {{name: other}}\nreplicas:\n");
    for i in 0..n {
        yaml += &format!("  - {{id: r{i}, address: '127.0.0.1:{}', models: [m], max_concurrency: 8}}\n", 8001 + i);
    }
    yaml += "  - {id: o, address: '127.0.0.1:9000', models: [other]}\n";
    let config = Config::parse(&yaml).unwrap();
    let core = Core::new(&config).unwrap();
    let replicas: Vec<Arc<Replica>> = config
        .replicas
        .iter()
        .map(|r| {
            let models = r.serving.models.iter().map(|m| usize::from(m == "other")).collect();
            Arc::new(Replica::new(
                r.id.clone(),
                r.address.parse().unwrap(),
                models,
                r.serving.limits(),
                r.serving.cache(),
                core.kv.slot(&r.id),
            ))
        })
        .collect();
    for r in &replicas {
        core.join(r);
    }
    (core, Arc::new(Fleet::new(replicas, 2)))
}

pub(crate) fn prompt(first: u32, n: u32) -> Prompt {
    Prompt { ids: (first..first + n).collect(), max_tokens: Some(4), cache_salt: None, adapter: None, special_at: Vec::new() }
}

pub(crate) fn view<'a>(core: &Core, fleet: &Fleet, p: &Prompt) -> View<'a> {
    View {
        model: 0,
        prediction: Some(core.prepare(0, p, fleet)),
        session: None,
        text: None,
        subset: None,
        share: Share::ALONE,
        replica_share: 1.0,
    }
}

pub(crate) const NONE: &dyn Fn(&Replica) -> Option<Report> = &|_| None;

#[test]
fn planning_changes_nothing_and_the_next_decision_picks_the_planned_winner() {
    for policy in ["round_robin", "random", "p2c", "least_request", "kv_aware", "cost_model", "prefix_hash"] {
        let (core, fleet) = core(policy, 4);
        let mut held = Vec::new();
        for i in 0..12u32 {
            let p = prompt(i % 3 * 10_000, 300 + i);
            let v = view(&core, &fleet, &p);
            let now = Duration::from_millis(u64::from(i) * 10);
            let explained = core.plan(&v, &fleet, NONE, now).unwrap();
            let again = core.plan(&v, &fleet, NONE, now).unwrap();
            assert_eq!(explained.order, again.order, "{policy}: planning twice gives the same plan");
            let (_, committed) = core.decide(&v, &fleet, NONE, now).unwrap();
            assert_eq!(committed.targets[0].id, explained.winner().id, "{policy}: the explained winner is routed");
            assert_eq!(committed.targets.len(), 2, "winner and one fallback");
            assert_ne!(committed.targets[0].id, committed.targets[1].id);
            held.push(committed.lease);
        }
    }
}

#[test]
fn a_committed_prompt_is_predicted_cached_and_its_prefill_queued_on_the_winner() {
    let (core, fleet) = core("cost_model", 3);
    let p = prompt(0, 2_000);
    let (_, first) = core.decide(&view(&core, &fleet, &p), &fleet, NONE, Duration::ZERO).unwrap();
    let winner = first.targets[0].clone();
    let expected = core.model(0).params.prefill.secs(2_000, 0);
    let queued = first.lease.hold().prefill;
    assert!((queued.as_secs_f64() - expected).abs() < 2e-6, "to the microsecond");
    assert_eq!(winner.queued_prefill(), queued);
    assert_eq!(winner.prompt_tokens(), 2_000);
    let plan = core.plan(&view(&core, &fleet, &prompt(0, 2_100)), &fleet, NONE, Duration::ZERO).unwrap();
    let on = |id: &str| (0..3).find(|&i| plan.replica(i).id == id).unwrap();
    assert_eq!(plan.candidates[on(&winner.id)].cached_tokens, 2_000);
    assert!((0..3).filter(|&i| plan.replica(i).id != winner.id).all(|i| plan.candidates[i].cached_tokens == 0));
    assert_eq!(plan.terms, ["queue", "decode", "prefill", "hot_credit", "share", "copy", "adapter", "offload"]);
    let score = plan.scores[on(&winner.id)].unwrap();
    assert!((score.terms[0] - queued.as_secs_f64()).abs() < 1e-6, "the queued prefill is the queue term");
    // Its first byte empties the queue; the lease's end the counters.
    first.lease.first_byte();
    assert_eq!(winner.queued_prefill(), Duration::ZERO);
    first.lease.release();
    assert_eq!(winner.prompt_tokens(), 0);
}

#[test]
fn a_replica_with_its_own_prefill_cost_is_priced_and_queued_by_it() {
    // Three idle replicas; the two the first decision does not pick get an
    // engine a quarter as fast, so the second prompt (cold everywhere)
    // goes where the first went, and queues that engine's prefill.
    let (core, fleet) = core("cost_model", 3);
    let (_, first) = core.decide(&view(&core, &fleet, &prompt(0, 500)), &fleet, NONE, Duration::ZERO).unwrap();
    first.lease.first_byte();
    let fast = first.targets[0].clone();
    let slow = Prefill { prefill_token_us: 400.0, prefill_pair_ns: 13.2, prefill_fixed_ms: 20.0 };
    for r in fleet.serving(0).iter().filter(|r| r.id != fast.id) {
        r.set_prefill(Some(slow));
    }
    let (_, second) = core.decide(&view(&core, &fleet, &prompt(50_000, 2_000)), &fleet, NONE, Duration::ZERO).unwrap();
    assert_eq!(second.targets[0].id, fast.id, "2,000 tokens on the fast engine beat the slow ones despite the request in flight there");
    // A slow one, the only one the gateway allows, queues its own engine's cost.
    let only = [fleet.serving(0).iter().find(|r| r.id != fast.id).unwrap().addr];
    let p = prompt(90_000, 1_000);
    let v = View { subset: Some(&only), ..view(&core, &fleet, &p) };
    let (_, third) = core.decide(&v, &fleet, NONE, Duration::ZERO).unwrap();
    assert_eq!(third.targets[0].addr, only[0]);
    let queued = third.lease.hold().prefill.as_secs_f64();
    assert!((queued - slow.secs(1_000, 0)).abs() < 2e-6, "queued {queued} s, the slow engine's {} s", slow.secs(1_000, 0));
}

#[test]
fn unhealthy_and_full_replicas_are_set_aside_with_their_reason() {
    let (core, fleet) = core("cost_model", 3);
    let [a, b, _c] = [0, 1, 2].map(|i| fleet.serving(0)[i].clone());
    a.set_probe(false);
    let _held: Vec<Lease> = (0..8).map(|_| Lease::new(b.clone(), 0, 0)).collect();
    let plan = core.plan(&view(&core, &fleet, &prompt(0, 100)), &fleet, NONE, Duration::ZERO).unwrap();
    assert_eq!(plan.set_aside, [Some(SetAside::Unhealthy), Some(SetAside::Full), None]);
    assert_eq!(plan.order, [2]);
    assert!((0..plan.candidates.len()).all(|i| plan.replica(i).models.contains(&0)), "only replicas serving the model");
}

#[test]
fn when_no_replica_can_take_a_request_the_plan_still_says_what_each_lacks() {
    let (core, fleet) = core("cost_model", 2);
    let v = view(&core, &fleet, &prompt(0, 100));
    fleet.serving(0)[0].set_probe(false);
    let _held: Vec<Lease> = (0..8).map(|_| Lease::new(fleet.serving(0)[1].clone(), 0, 0)).collect();
    assert_eq!(core.plan(&v, &fleet, NONE, Duration::ZERO).unwrap_err(), NoReplica::AllFull);
    assert_eq!(core.decide(&v, &fleet, NONE, Duration::ZERO).unwrap_err(), NoReplica::AllFull);
    let plan = core.plan_all(&v, &fleet, NONE, Duration::ZERO);
    assert_eq!(plan.unavailable, Some(NoReplica::AllFull));
    assert_eq!(plan.set_aside, [Some(SetAside::Unhealthy), Some(SetAside::Full)]);
    assert!(plan.order.is_empty() && plan.scores.iter().all(Option::is_none));
}

proptest! {
    #[test]
    fn a_stale_report_is_never_read(ages in proptest::collection::vec(0u64..600, 3), usage in 0.0f64..1.0) {
        let (core, fleet) = core("cost_model", 3);
        let now = Duration::from_secs(10);
        let reports = |r: &Replica| {
            let i: usize = r.id[1..].parse().ok()?;
            Some(Report { at: now - Duration::from_millis(ages[i]), load: EngineReport { running: 7, waiting: 3, deferred: 0, kv_usage: usage } })
        };
        let plan = core.plan(&view(&core, &fleet, &prompt(0, 100)), &fleet, &reports, now).unwrap();
        for ((c, report), &age) in plan.candidates.iter().zip(&plan.reports).zip(&ages) {
            let (_, seen_age) = report.unwrap();
            prop_assert_eq!(seen_age, Duration::from_millis(age));
            prop_assert_eq!(c.engine.is_some(), age <= 250, "a report {}ms old", age);
        }
    }
}

#[test]
fn new_prompts_spread_over_idle_replicas_rather_than_pile_on_one() {
    // Every lease ends before the next decision, as with one client at a time.
    let (core, fleet) = core("cost_model", 3);
    let mut wins = std::collections::HashMap::new();
    for i in 0..30u32 {
        let p = prompt(i * 100_000, 350);
        let (plan, c) = core.decide(&view(&core, &fleet, &p), &fleet, NONE, Duration::from_millis(u64::from(i) * 20)).unwrap();
        assert!(plan.scores.iter().all(|s| s.unwrap().terms[3] == 0.0), "no hot credit for a root nobody holds");
        *wins.entry(c.targets[0].id.clone()).or_insert(0) += 1;
        c.lease.first_byte();
        c.lease.release();
    }
    assert!(wins.values().all(|&n| n >= 5) && wins.len() == 3, "{wins:?}");
}

#[test]
fn concurrent_decisions_take_turns_so_no_limit_is_exceeded_and_every_turn_is_taken() {
    let (core, fleet) = core("round_robin", 4);
    let core = Arc::new(core);
    let results: Vec<(Vec<String>, Vec<Arc<Lease>>)> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..8)
            .map(|t| {
                let (core, fleet) = (core.clone(), fleet.clone());
                s.spawn(move || {
                    let mut held = Vec::new();
                    let mut won = Vec::new();
                    for i in 0..4u32 {
                        let p = prompt(t * 1_000 + i, 64);
                        let (_, c) = core.decide(&view(&core, &fleet, &p), &fleet, NONE, Duration::ZERO).unwrap();
                        won.push(c.targets[0].id.clone());
                        held.push(c.lease);
                    }
                    (won, held)
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).collect()
    });
    // 32 leases held on 4 replicas taking 8 each: round robin's turns were never shared, so all fit exactly.
    let mut per: std::collections::HashMap<&str, usize> = Default::default();
    for id in results.iter().flat_map(|r| &r.0) {
        *per.entry(id).or_default() += 1;
    }
    assert_eq!(per.values().copied().collect::<Vec<_>>(), [8, 8, 8, 8], "{per:?}");
    assert_eq!(core.decide(&view(&core, &fleet, &prompt(0, 64)), &fleet, NONE, Duration::ZERO).unwrap_err(), NoReplica::AllFull);
}

#[test]
fn policies_read_the_blocks_of_the_most_common_block_size() {
    let at = |sizes: &[usize]| {
        sizes.iter().map(|&block_size| Place { slot: 0, block_size, lookahead: 0, adapter_ahead: None }).collect::<Vec<_>>()
    };
    assert_eq!(most_common_block_size(&at(&[32, 16, 16])), Some(16));
    assert_eq!(most_common_block_size(&at(&[32, 16, 32, 64])), Some(32));
    assert_eq!(most_common_block_size(&at(&[64, 16])), Some(16), "a tie goes to the smaller");
    assert_eq!(most_common_block_size(&[]), None);
}

#[test]
fn a_gateways_subset_hint_limits_the_winner_and_the_fallbacks_and_none_in_it_is_unavailable() {
    let (core, fleet) = core("round_robin", 4);
    let p = prompt(0, 64);
    let serving = fleet.serving(0);
    let subset = [serving[2].addr, serving[3].addr, "10.0.0.9:80".parse().unwrap()];
    for _ in 0..4 {
        let v = View { subset: Some(&subset), ..view(&core, &fleet, &p) };
        let (plan, committed) = core.decide(&v, &fleet, NONE, Duration::ZERO).unwrap();
        assert!(committed.targets.iter().all(|t| subset.contains(&t.addr)), "only the offered endpoints");
        assert_eq!(committed.targets.len(), 2, "the fallback comes from the subset too");
        assert_eq!(plan.set_aside[..2], [Some(SetAside::OutsideSubset); 2]);
    }
    let none = View { subset: Some(&[]), ..view(&core, &fleet, &p) };
    assert_eq!(core.plan(&none, &fleet, NONE, Duration::ZERO).unwrap_err(), NoReplica::NoneInSubset);
    let elsewhere = ["10.0.0.9:80".parse().unwrap()];
    let v = View { subset: Some(&elsewhere), ..view(&core, &fleet, &p) };
    assert_eq!(core.decide(&v, &fleet, NONE, Duration::ZERO).unwrap_err(), NoReplica::NoneInSubset);
}

#[test]
fn a_draining_replica_is_offered_nothing_and_a_fleet_all_draining_is_unavailable() {
    let (core, fleet) = core("round_robin", 3);
    let p = prompt(0, 64);
    let serving = fleet.serving(0);
    assert!(serving[1].set_draining(true) && !serving[1].set_draining(true), "only a change counts");
    for _ in 0..6 {
        let (plan, committed) = core.decide(&view(&core, &fleet, &p), &fleet, NONE, Duration::ZERO).unwrap();
        assert!(committed.targets.iter().all(|t| t.id != serving[1].id), "neither the winner nor a fallback");
        assert_eq!(plan.set_aside[1], Some(SetAside::Draining));
    }
    serving[0].set_draining(true);
    serving[2].set_draining(true);
    assert_eq!(core.plan(&view(&core, &fleet, &p), &fleet, NONE, Duration::ZERO).unwrap_err(), NoReplica::AllDraining);
    serving[2].set_draining(false);
    assert_eq!(core.decide(&view(&core, &fleet, &p), &fleet, NONE, Duration::ZERO).unwrap().1.targets[0].id, serving[2].id);
}

#[test]
fn a_band_with_part_of_the_replicas_keeps_to_the_first_by_id_and_waits_when_they_are_full() {
    let (core, fleet) = core("round_robin", 3);
    let p = prompt(0, 64);
    let serving = fleet.serving(0);
    let part = |share| View { replica_share: share, ..view(&core, &fleet, &p) };
    let mut held = Vec::new();
    for _ in 0..16 {
        let (plan, committed) = core.decide(&part(0.67), &fleet, NONE, Duration::ZERO).unwrap();
        assert_ne!(committed.lease.replica.id, "r2", "two of three: r0 and r1");
        assert_eq!(plan.set_aside[2], Some(SetAside::KeptForUrgent));
        held.push(committed.lease);
    }
    // r0 and r1 hold 8 each, their limit: full for this band, though r2 is free.
    assert_eq!(core.plan(&part(0.67), &fleet, NONE, Duration::ZERO).unwrap_err(), NoReplica::AllFull);
    assert_eq!(core.decide(&part(1.0), &fleet, NONE, Duration::ZERO).unwrap().1.lease.replica.id, "r2", "a band with all of them");
    held.clear();
    // A draining replica leaves the pool: of r1 and r2, 0.67 keeps one (at least one), the first by id.
    serving[0].set_draining(true);
    let (plan, committed) = core.decide(&part(0.67), &fleet, NONE, Duration::ZERO).unwrap();
    assert_eq!(committed.lease.replica.id, "r1");
    assert_eq!(plan.set_aside, vec![Some(SetAside::Draining), None, Some(SetAside::KeptForUrgent)]);
    assert_eq!(core.decide(&part(0.1), &fleet, NONE, Duration::ZERO).unwrap().1.lease.replica.id, "r1", "at least one");
}

#[test]
fn a_peers_decision_held_here_counts_caches_and_teaches_the_policy() {
    // Router A decides; router B, with its own core over the same replicas, mirrors it.
    let (a, fleet_a) = core("round_robin", 3);
    let (b, fleet_b) = core("round_robin", 3);
    let p = prompt(0, 200);
    let (_, decided) = a.decide(&view(&a, &fleet_a, &p), &fleet_a, NONE, Duration::ZERO).unwrap();
    let on_b = fleet_b.replicas.iter().find(|r| r.id == decided.targets[0].id).unwrap().clone();
    let mirror = b.mirror(0, &on_b, &decided.lease.hold(), None, Duration::ZERO);
    assert!(!mirror.mine);
    let plan = b.plan(&view(&b, &fleet_b, &prompt(0, 300)), &fleet_b, NONE, Duration::ZERO).unwrap();
    let i = (0..3).find(|&i| plan.replica(i).id == on_b.id).unwrap();
    assert_eq!((plan.candidates[i].in_flight, plan.candidates[i].cached_tokens), (1, 192), "held there, its prompt's blocks recorded");
    assert_eq!(plan.candidates[i].own, None, "alone, no part of the limits");
    // Round robin's turn moved past the mirrored pick, as A's did.
    let (_, next_a) = a.decide(&view(&a, &fleet_a, &prompt(1, 50)), &fleet_a, NONE, Duration::ZERO).unwrap();
    let (_, next_b) = b.decide(&view(&b, &fleet_b, &prompt(1, 50)), &fleet_b, NONE, Duration::ZERO).unwrap();
    assert_eq!(next_b.targets[0].id, next_a.targets[0].id);
    assert_ne!(next_b.targets[0].id, on_b.id);
}

#[test]
fn a_peers_request_that_envoy_retried_elsewhere_stays_the_peers() {
    let (core, fleet) = core("round_robin", 3);
    let hold =
        Hold { prompt_tokens: Some(100), prefill: Duration::from_millis(5), estimate: Duration::ZERO, kv_tokens: 100, prediction: None };
    let mirror = core.mirror(0, &fleet.replicas[0], &hold, None, Duration::ZERO);
    let moved = core.move_lease(&mirror, &fleet.replicas[1]);
    assert!(!moved.mine);
    let c = fleet.replicas[1].candidate(Duration::ZERO, (0, 0), None, Share { rank: 0, of: 2 });
    assert_eq!((c.in_flight, c.own.map(|o| o.in_flight)), (1, Some(0)), "on the replica, but not in this router's part of its limits");
}

#[test]
fn a_shadow_policy_plans_alongside_and_changes_nothing_the_live_one_does() {
    // Round robin live over three replicas, cost_model in the shadow: four
    // prompts in turn, each sent three times. The live order is round
    // robin's with or without the shadow; the shadow sends each repeat
    // where its prompt is cached most, and agrees exactly when round robin
    // happened to go there.
    let (plain, plain_fleet) = core_with("round_robin", "", 3);
    let (shadowed, fleet) = core_with("round_robin", ", shadow_policy: cost_model", 3);
    let (mut agreed, mut shadowed_decisions) = (0, 0);
    for i in 0..12u32 {
        let p = prompt(i % 4 * 10_000, 400);
        let now = Duration::from_millis(u64::from(i) * 10);
        let (live, a) = plain.decide(&view(&plain, &plain_fleet, &p), &plain_fleet, NONE, now).unwrap();
        let v = view(&shadowed, &fleet, &p);
        let cached = shadowed.plan(&v, &fleet, NONE, now).unwrap().candidates.iter().map(|c| c.cached_tokens).collect::<Vec<_>>();
        let (plan, b) = shadowed.decide(&v, &fleet, NONE, now).unwrap();
        assert_eq!(live.order, plan.order, "the shadow changes no live decision");
        assert_eq!(a.targets[0].id, b.targets[0].id);
        assert!(live.shadow.is_none());
        let shadow = plan.shadow.expect("a shadow plan on every decision");
        assert_eq!(shadow.policy, "cost_model");
        assert_eq!(shadow.agreed, shadow.winner.id == b.targets[0].id);
        if i >= 4 {
            // A repeat: the shadow picks a replica holding the most of its prompt.
            let most = cached.iter().copied().max().unwrap_or(0);
            assert!(most > 0, "cached somewhere after the first send");
            let at = fleet.serving(0).iter().position(|r| r.id == shadow.winner.id).unwrap();
            assert_eq!(cached[at], most, "decision {i}: {cached:?}");
            assert!(shadow.estimate.is_some_and(|e| e > 0.0));
            shadowed_decisions += 1;
            agreed += usize::from(shadow.agreed);
        }
        for lease in [a.lease, b.lease] {
            lease.first_byte();
            lease.release();
        }
    }
    // Four prompts over three replicas in turn: round robin sends every
    // repeat to a replica that has not seen its prompt, so it never agrees.
    assert_eq!((agreed, shadowed_decisions), (0, 8));
    // The same policy in the shadow, told each live pick, picks the same every time.
    let (same, fleet) = core_with("cost_model", ", shadow_policy: cost_model", 3);
    for i in 0..12u32 {
        let p = prompt(i % 4 * 10_000, 400);
        let (plan, committed) = same.decide(&view(&same, &fleet, &p), &fleet, NONE, Duration::from_millis(u64::from(i) * 10)).unwrap();
        assert!(plan.shadow.is_some_and(|s| s.agreed), "decision {i}");
        committed.lease.first_byte();
        committed.lease.release();
    }
}

/// Model `m` on a prefill-only replica `p` and a decode-only one `d`, under `policy`.
fn disaggregated(policy: &str) -> (Core, Arc<Fleet>) {
    let (core, fleet) = core(policy, 2);
    let roles = [inferrail_config::Role::Prefill, inferrail_config::Role::Decode];
    for (r, role) in fleet.serving(0).iter().zip(roles) {
        r.set_role(role);
    }
    (core, fleet)
}

#[test]
fn cost_model_splits_a_request_only_when_its_prefill_would_stall_the_decoders_more_than_the_transfer_costs() {
    let (core, fleet) = disaggregated("cost_model");
    let (p, d) = (fleet.serving(0)[0].clone(), fleet.serving(0)[1].clone());
    assert!(fleet.disaggregated(0));
    // Idle: the decode replica computes the prompt itself; moving it would only add the transfer.
    let first = prompt(0, 2_000);
    let (plan, whole) = core.decide(&view(&core, &fleet, &first), &fleet, NONE, Duration::ZERO).unwrap();
    let pd = plan.pd.as_deref().expect("a disaggregated model is priced both ways");
    assert_eq!((pd.why, whole.targets[0].id.as_str()), (pair::Why::Dearer, d.id.as_str()));
    assert!(whole.prefill.is_none());
    assert_eq!(pd.price.transfer_blocks, 125, "2,000 tokens in 16-token blocks, none on the decoder");
    assert_eq!(plan.set_aside[0], Some(SetAside::Role), "a prefill-only replica never takes a whole request");
    // Now it decodes that request: another prompt's prefill there would stall it.
    whole.lease.first_byte();
    let second = prompt(50_000, 2_000);
    let (plan, split) = core.decide(&view(&core, &fleet, &second), &fleet, NONE, Duration::from_millis(1)).unwrap();
    let pd = plan.pd.as_deref().unwrap();
    assert_eq!(pd.why, pair::Why::Cheaper, "{:?}", pd.price);
    assert!(pd.price.split() < pd.price.whole());
    assert!((pd.price.whole_stall - pd.price.whole_ttft).abs() < 1e-9, "one decoding request waits out the whole prefill");
    let leg = split.prefill.as_ref().expect("a split request has a prefill leg");
    assert_eq!((leg.targets[0].id.as_str(), split.targets[0].id.as_str()), (p.id.as_str(), d.id.as_str()));
    assert_eq!(split.lease.hold().prefill, Duration::ZERO, "the decoder reads the prompt");
    assert!(leg.lease.hold().prefill > Duration::ZERO, "the prefill replica computes it");
    assert_eq!(plan.ttft(core.model(0).params.prefill), Duration::from_secs_f64(pd.price.split_ttft()));
    // Both will hold the prompt.
    let after = core.plan(&view(&core, &fleet, &second), &fleet, NONE, Duration::from_millis(2)).unwrap();
    assert_eq!(after.candidates[1].cached_tokens, 1_984, "the decoder, to the last full block before the last token");
    let prefill_plan = &after.pd.as_deref().unwrap().prefill;
    assert_eq!(prefill_plan.candidates[0].cached_tokens, 1_984, "the prefill replica too");
}

#[test]
fn a_policy_without_times_always_splits_and_a_model_without_prefill_replicas_is_never_priced() {
    let (split, fleet) = disaggregated("round_robin");
    for i in 0..3 {
        let (plan, c) = split.decide(&view(&split, &fleet, &prompt(i * 10_000, 100)), &fleet, NONE, Duration::ZERO).unwrap();
        assert_eq!(plan.pd.as_deref().map(|pd| pd.why), Some(pair::Why::Always));
        assert_eq!(c.prefill.as_ref().map(|l| l.targets[0].id.as_str()), Some("r0"));
        assert_eq!(c.targets[0].id, "r1");
    }
    let (aggregated, fleet) = self::core("cost_model", 2);
    let (plan, c) = aggregated.decide(&view(&aggregated, &fleet, &prompt(0, 100)), &fleet, NONE, Duration::ZERO).unwrap();
    assert!(plan.pd.is_none() && c.prefill.is_none());
}

#[test]
fn with_its_prefill_replica_unavailable_a_request_runs_whole() {
    let (core, fleet) = disaggregated("round_robin");
    fleet.serving(0)[0].set_draining(true);
    let (plan, c) = core.decide(&view(&core, &fleet, &prompt(0, 100)), &fleet, NONE, Duration::ZERO).unwrap();
    assert_eq!(plan.pd.as_deref().map(|pd| pd.why), Some(pair::Why::NoPrefillReplica));
    assert!(c.prefill.is_none());
    assert_eq!(c.targets[0].id, "r1");
}

#[test]
fn round_robin_takes_turns_in_each_pool_of_a_split_fleet() {
    let (core, fleet) = self::core("round_robin", 4);
    let roles =
        [inferrail_config::Role::Prefill, inferrail_config::Role::Prefill, inferrail_config::Role::Decode, inferrail_config::Role::Decode];
    for (r, role) in fleet.serving(0).iter().zip(roles) {
        r.set_role(role);
    }
    let mut pairs = Vec::new();
    for i in 0..4 {
        let (_, c) = core.decide(&view(&core, &fleet, &prompt(i * 10_000, 100)), &fleet, NONE, Duration::ZERO).unwrap();
        pairs.push(format!("{}>{}", c.prefill.as_ref().map_or("-", |l| l.targets[0].id.as_str()), c.targets[0].id));
    }
    assert_eq!(pairs, ["r0>r2", "r1>r3", "r0>r2", "r1>r3"]);
}
