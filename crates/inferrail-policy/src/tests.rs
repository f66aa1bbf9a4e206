//! Eligibility, limits shared between routers, the order's tie-breaks, and
//! properties every policy keeps.

use super::testing::*;
use super::*;
use proptest::prelude::*;

fn eligible(c: &[Candidate]) -> Result<Vec<usize>, NoReplica> {
    let mut aside = vec![None; c.len()];
    eligibility(c, &mut aside)?;
    Ok((0..c.len()).filter(|&i| aside[i].is_none()).collect())
}

#[test]
fn eligibility_names_why_nobody_can_serve() {
    assert_eq!(eligible(&[]), Err(NoReplica::NoneServe));
    let sick = Candidate { healthy: false, ..load(0) };
    // Every replica failing its probes: all offered (panic), as Envoy's balancer does.
    assert_eq!(eligible(&[sick.clone(), sick.clone()]), Ok(vec![0, 1]));
    assert!(panicking(&[sick.clone(), sick.clone()]) && !panicking(&[sick.clone(), load(0)]));
    let full = Candidate { in_flight: 100, ..load(0) };
    assert_eq!(eligible(&[sick.clone(), full.clone()]), Err(NoReplica::AllFull));
    let waiting = Candidate { pending: 100, ..load(0) };
    assert_eq!(eligible(&[sick, full, waiting, load(3)]), Ok(vec![3]));
}

#[test]
fn routers_sharing_a_replica_split_its_limits_so_that_the_parts_add_up() {
    for limit in [0, 1, 2, 7, 256] {
        for of in 1..=5 {
            assert_eq!((0..of).map(|rank| Share { rank, of }.part(limit)).sum::<u32>(), limit, "{limit} over {of}");
        }
    }
    assert_eq!([0, 1, 2].map(|rank| Share { rank, of: 3 }.part(7)), [3, 2, 2]);
    assert_eq!(Share::ALONE.part(7), 7);
    let own = |in_flight| Some(Own { in_flight, pending: 0, max_concurrency: 3, max_pending: 3 });
    assert!(Candidate { own: own(2), ..load(10) }.has_room());
    assert!(!Candidate { own: own(3), ..load(10) }.has_room(), "its part is used up though the replica has room");
    assert!(!Candidate { own: own(0), ..load(100) }.has_room(), "the replica's own limit still holds");
    let waiting = Some(Own { pending: 3, ..own(3).unwrap() });
    assert!(!Candidate { own: waiting, max_concurrency: 1_000, ..load(10) }.has_room(), "its part of max_pending is used up");
}

#[test]
fn ties_go_to_fewer_in_flight_then_to_chance() {
    let c = fleet(&[4, 2, 2]);
    let scores = [Score::single(1.0); 3];
    let mut wins = [0; 3];
    let mut r = rng(5);
    for _ in 0..300 {
        let o = order(&c, &[0, 1, 2], &scores, 3, None, &mut r);
        assert_eq!(o[2], 0, "the busiest is last on equal scores");
        wins[o[0]] += 1;
    }
    assert!(wins[1] > 100 && wins[2] > 100, "{wins:?}");
}

#[test]
fn ties_follow_the_prompts_last_block_whatever_the_draws() {
    let c = fleet(&[4, 2, 2]);
    let scores = [Score::single(1.0); 3];
    let mut wins = [0; 3];
    for last in 0..300u128 {
        let last = last << 70 | last;
        let first = order(&c, &[0, 1, 2], &scores, 3, Some(last), &mut rng(1));
        assert_eq!(first[2], 0, "the busiest is still last on equal scores");
        for seed in 2..5 {
            assert_eq!(order(&c, &[0, 1, 2], &scores, 3, Some(last), &mut rng(seed)), first, "another router, the same order");
        }
        wins[first[0]] += 1;
    }
    assert!(wins[1] > 100 && wins[2] > 100, "prompts spread over the tied replicas: {wins:?}");
}

proptest! {
    #[test]
    fn the_best_k_are_the_first_k_of_the_whole_order(
        totals in proptest::collection::vec((0u8..4, 0u32..3), 1..40),
        k in 0usize..45,
        seed in any::<u64>(),
    ) {
        let c = fleet(&totals.iter().map(|t| t.1).collect::<Vec<_>>());
        let scores: Vec<Score> = totals.iter().map(|t| Score::single(f64::from(t.0))).collect();
        let offered: Vec<usize> = (0..c.len()).collect();
        let last = (seed % 2 == 0).then_some(u128::from(seed));
        let all = order(&c, &offered, &scores, usize::MAX, last, &mut rng(seed));
        let best = order(&c, &offered, &scores, k, last, &mut rng(seed));
        prop_assert_eq!(&best[..], &all[..k.min(all.len())]);
    }

    #[test]
    fn every_policy_ranks_each_offered_candidate_exactly_once_and_never_an_ineligible_one(
        loads in proptest::collection::vec((0u32..20, any::<bool>(), 0usize..4000, 0.0f64..2.0), 1..12),
        seed in any::<u64>(),
        prompt in proptest::option::of(0usize..4000),
        calls in 1usize..5,
    ) {
        let mut c = fleet(&loads.iter().map(|l| l.0).collect::<Vec<_>>());
        for (x, l) in c.iter_mut().zip(&loads) {
            x.healthy = l.1;
            x.cached_tokens = l.2;
            x.queued_prefill_secs = l.3;
        }
        let blocks: Vec<BlockHash> = (0..prompt.unwrap_or(0) as u128 / 16).collect();
        let text = prompt.map(|n| "ab ".repeat(n % 300));
        let req = Request { prompt_tokens: prompt, blocks: &blocks, block_size: 16, text: text.as_deref(), ..Request::default() };
        let mut r = rng(seed);
        for kind in ALL {
            let policy = build(kind, &Params::default());
            for _ in 0..calls {
                match decide(policy.as_ref(), &req, &c, &mut r) {
                    Ok(ranked) => {
                        prop_assert!(!ranked.is_empty());
                        let eligible = eligible(&c).unwrap_or_default();
                        prop_assert!(ranked.iter().all(|i| eligible.contains(i)), "{kind:?} offered an ineligible replica");
                        let mut dedup = ranked.clone();
                        dedup.sort_unstable();
                        dedup.dedup();
                        prop_assert_eq!(dedup.len(), ranked.len());
                        policy.picked(&req, &c, ranked[0]);
                    }
                    Err(e) => prop_assert_eq!(Some(e), eligible(&c).err()),
                }
            }
        }
    }

    #[test]
    fn a_seed_replays_the_same_choices(loads in proptest::collection::vec(0u32..5, 2..8), seed in any::<u64>()) {
        let c = fleet(&loads);
        for kind in ALL {
            let (a, b) = (build(kind, &Params::default()), build(kind, &Params::default()));
            let (mut ra, mut rb) = (rng(seed), rng(seed));
            for _ in 0..10 {
                let req = Request::default();
                let x = decide(a.as_ref(), &req, &c, &mut ra).unwrap();
                let y = decide(b.as_ref(), &req, &c, &mut rb).unwrap();
                a.picked(&req, &c, x[0]);
                b.picked(&req, &c, y[0]);
                prop_assert_eq!(x, y);
            }
        }
    }
}
