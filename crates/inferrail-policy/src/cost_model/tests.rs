//! The cost model's estimate, guards, hot prefixes and sessions.

use super::*;
use crate::testing::{fleet, rng};
use crate::{EngineReport, decide};
use proptest::prelude::*;

fn policy(config: Config) -> CostModel {
    CostModel::new(config, Prefill::default())
}

/// What the guard says of `req` on `c`, and which replicas it sets aside.
fn guarded(p: &CostModel, req: &Request, c: &[Candidate]) -> (Option<&'static str>, Vec<Option<SetAside>>) {
    let mut aside = vec![None; c.len()];
    (p.guard(req, c, &mut aside), aside)
}

/// A 700-token prompt at `now` whose blocks are `blocks` (16 tokens each).
fn rooted(now: Duration, blocks: &'static [u128]) -> Request<'static> {
    Request { now, prompt_tokens: Some(700), blocks, block_size: 16, ..Request::default() }
}

#[test]
fn a_cached_replica_behind_a_long_queue_loses_to_an_idle_cold_one_and_wins_once_the_cold_one_is_busier() {
    // The design's worked example: 8,000 prompt tokens, 6,000 of them cached on replica 0.
    let p = policy(Config::default());
    let req = Request { prompt_tokens: Some(8_000), ..Request::default() };
    let mut c = fleet(&[4, 0]);
    c[0].cached_tokens = 6_000;
    c[0].queued_prefill_secs = 2.0;
    let mut r = rng(1);
    let cold = Prefill::default().secs(8_000, 0);
    assert!(cold < 2.0, "an idle cold replica computes it all in {cold:.3} s, under the 2 s queue");
    assert_eq!(decide(&p, &req, &c, &mut r).unwrap()[0], 1);
    c[1].queued_prefill_secs = 2.0;
    c[1].in_flight = 4;
    assert_eq!(decide(&p, &req, &c, &mut r).unwrap()[0], 0, "with equal queues the cache decides");
}

#[test]
fn kv_pressure_sets_aside_a_full_cache_for_long_uncached_prompts_unless_every_replica_is_full() {
    let p = policy(Config::default());
    let full = Some(EngineReport { running: 3, waiting: 0, deferred: 0, kv_usage: 0.97 });
    let mut c = fleet(&[0, 5]);
    c[0].engine = full;
    let long = Request { prompt_tokens: Some(2_000), ..Request::default() };
    let (waived, aside) = guarded(&p, &long, &c);
    assert_eq!(waived, None);
    assert_eq!(aside, [Some(SetAside::KvPressure { usage: 0.97 }), None]);
    // A short prompt, or one mostly cached there, is spared.
    assert_eq!(guarded(&p, &Request { prompt_tokens: Some(200), ..long }, &c).1, [None, None]);
    c[0].cached_tokens = 1_900;
    assert_eq!(guarded(&p, &long, &c).1, [None, None]);
    // Every replica under pressure: the guard is waived, and says so.
    c[0].cached_tokens = 0;
    c[1].engine = full;
    let (waived, aside) = guarded(&p, &long, &c);
    assert_eq!(waived, Some("kv_waived"));
    assert_eq!(aside, [None, None]);
}

#[test]
fn kv_pressure_sets_aside_a_replica_without_room_for_the_prompt() {
    let p = policy(Config::default());
    // 8,000 prompt tokens; both caches hold 14,000 tokens, the first half in
    // use (7,000 free), far below kappa, the other empty.
    let req = Request { prompt_tokens: Some(8_000), ..Request::default() };
    let used = |kv_usage| Some(EngineReport { running: 1, waiting: 0, deferred: 0, kv_usage });
    let mut c = fleet(&[1, 1]);
    for x in &mut c {
        (x.engine, x.kv_capacity_tokens) = (used(0.5), 14_000);
    }
    c[1].engine = used(0.0);
    let (waived, aside) = guarded(&p, &req, &c);
    assert_eq!(waived, None);
    assert_eq!(aside, [Some(SetAside::KvRoom { free_tokens: 7_000 }), None], "8,000 tokens do not fit in 7,000 free");
    // 1,500 of it cached there does not make room: the engine takes those
    // blocks out of its free pool too when no running request holds them.
    c[0].cached_tokens = 1_500;
    assert_eq!(guarded(&p, &req, &c).1, [Some(SetAside::KvRoom { free_tokens: 7_000 }), None]);
    // Those a request in flight holds take no free room: 7,000 left to find, and found.
    c[0].held_cached_tokens = 1_000;
    assert_eq!(guarded(&p, &req, &c).1, [None, None], "8,000 less 1,000 held fits in 7,000");
    c[0].held_cached_tokens = 999;
    assert_eq!(guarded(&p, &req, &c).1, [Some(SetAside::KvRoom { free_tokens: 7_000 }), None]);
    c[0].held_cached_tokens = 0;
    // 40% in use: 8,400 free, room for all of it.
    c[0].engine = used(0.4);
    assert_eq!(guarded(&p, &req, &c).1, [None, None]);
    // Unless a request sent after the engine's report takes 1,000 of the room.
    c[0].unreported_kv_tokens = 1_000;
    assert_eq!(guarded(&p, &req, &c).1, [Some(SetAside::KvRoom { free_tokens: 7_400 }), None], "8,000 tokens do not fit in 8,400 - 1,000");
    // Without the cache's size the engine's usage says nothing of room.
    c[0].kv_capacity_tokens = 0;
    assert_eq!(guarded(&p, &req, &c).1, [None, None]);
}

#[test]
fn kv_pressure_never_turns_a_hit_into_a_miss_but_a_few_shared_blocks_are_not_a_hit() {
    let p = policy(Config::default());
    let full = Some(EngineReport { running: 9, waiting: 2, deferred: 0, kv_usage: 0.97 });
    // 8,000 prompt tokens: the full replica holds the 7,600-token system
    // prompt, the other none of it; 400 new tokens is past `short_prompt_tokens`.
    let req = Request { prompt_tokens: Some(8_000), ..Request::default() };
    let mut c = fleet(&[6, 1]);
    c[0].engine = full;
    c[0].cached_tokens = 7_600;
    let (waived, aside) = guarded(&p, &req, &c);
    assert_eq!(waived, None);
    assert_eq!(aside, [None, None], "computing 8,000 tokens elsewhere takes more room than 400 here");
    // Three quarters of it cached is still a hit: 2,000 tokens here against 8,000.
    c[0].cached_tokens = 6_000;
    assert_eq!(guarded(&p, &req, &c).1, [None, None]);
    // Less is not worth waiting for room: 2,016 tokens against 8,000.
    c[0].cached_tokens = 5_984;
    assert_eq!(guarded(&p, &req, &c).1, [Some(SetAside::KvPressure { usage: 0.97 }), None]);
    // Half of it cached is not either.
    c[0].cached_tokens = 4_000;
    assert_eq!(guarded(&p, &req, &c).1, [Some(SetAside::KvPressure { usage: 0.97 }), None]);
    // One below kappa that holds as much: the full one is set aside, and no hit is lost.
    c[0].cached_tokens = 7_600;
    c[1].cached_tokens = 7_600;
    assert_eq!(guarded(&p, &req, &c).1, [Some(SetAside::KvPressure { usage: 0.97 }), None]);
}

#[test]
fn a_session_goes_back_to_its_replica_while_the_guards_allow_then_follows_the_new_one() {
    let p = policy(Config { session_affinity: true, ..Config::default() });
    let mut r = rng(2);
    let mut c = fleet(&[1, 1, 1]);
    let req = Request { prompt_tokens: Some(100), session: Some("chat-7"), ..Request::default() };
    let first = decide(&p, &req, &c, &mut r).unwrap()[0];
    p.picked(&req, &c, first);
    // Another replica looks cheaper now, but the conversation stays.
    let other = (first + 1) % 3;
    c[other].cached_tokens = 100;
    c[first].queued_prefill_secs = 0.5;
    assert_eq!(decide(&p, &req, &c, &mut r).unwrap()[0], first);
    // Overloaded beyond the bounded-load cap: it moves, and the session follows.
    c[first].in_flight = 20;
    let moved = decide(&p, &req, &c, &mut r).unwrap()[0];
    assert_ne!(moved, first);
    p.picked(&req, &c, moved);
    c[first].in_flight = 1;
    assert_eq!(decide(&p, &req, &c, &mut r).unwrap()[0], moved);
}

#[test]
fn a_hot_root_prefix_gets_more_owners_and_a_cold_one_stays_on_its_holder() {
    let p = policy(Config::default());
    let hot: Vec<u128> = (1..=40).collect();
    let cold: Vec<u128> = (101..=140).collect();
    let mut c = fleet(&[0, 0, 0, 0]);
    c[0].cached_tokens = 640;
    let mut r = rng(3);
    let at = |t_ms: u64, blocks: &'static [u128]| rooted(Duration::from_millis(t_ms), blocks);
    let (hot, cold): (&'static [u128], &'static [u128]) = (hot.leak(), cold.leak());
    assert_eq!(decide(&p, &at(0, hot), &c, &mut r).unwrap()[0], 0, "not hot yet: the holder wins");
    // Four requests in five ask for the hot root: 3.2 replicas' fair shares of 4; the cold one asks for 0.8.
    for t in 0..500 {
        let req = at(t * 10, if t % 5 == 4 { cold } else { hot });
        let w = decide(&p, &req, &c, &mut r).unwrap()[0];
        p.picked(&req, &c, w);
    }
    let owners = p.owners(hot[15], 4);
    assert_eq!(owners, 4, "the hot root needs every replica");
    assert_eq!(p.owners(cold[15], 4), 1, "the cold root keeps one owner");
    let req = at(5_000, hot);
    let mut scores = vec![Score::default(); 4];
    p.score(&req, &c, &[0, 1, 2, 3], &mut r, &mut scores);
    assert!(scores.iter().all(|s| s.terms[3] == 0.0), "an idle holder serves it at once: no copy: {scores:?}");
    c[0].in_flight = 1;
    c[0].queued_prefill_secs = 0.2;
    p.score(&req, &c, &[0, 1, 2, 3], &mut r, &mut scores);
    let credited = scores.iter().filter(|s| s.terms[3] > 0.0).count();
    assert_eq!(credited, 3, "{scores:?}");
    assert_ne!(decide(&p, &req, &c, &mut r).unwrap()[0], 0, "the queued holder shares its hot prefix");
    // What replica 0 holds would take 64% of replicas 1 and 2's caches: only replica 3 is priced as a copy.
    (c[1].kv_capacity_tokens, c[2].kv_capacity_tokens, c[3].kv_capacity_tokens) = (1_000, 1_000, 100_000);
    p.score(&req, &c, &[0, 1, 2, 3], &mut r, &mut scores);
    let credited: Vec<usize> = (0..4).filter(|&k| scores[k].terms[3] > 0.0).collect();
    assert_eq!(credited, [3], "{scores:?}");
    // Replica 3 was just sent the cold root's 700-token prompt: on a
    // 1,300-token cache the 640 copied tokens do not fit beside it, though
    // they are under 60% of it. Replicas 1 and 2 have room for both.
    p.picked(&at(5_000, cold), &c, 3);
    (c[1].kv_capacity_tokens, c[2].kv_capacity_tokens, c[3].kv_capacity_tokens) = (100_000, 100_000, 1_300);
    p.score(&req, &c, &[0, 1, 2, 3], &mut r, &mut scores);
    let credited: Vec<usize> = (0..4).filter(|&k| scores[k].terms[3] > 0.0).collect();
    assert_eq!(credited, [1, 2], "{scores:?}");
    c[3].kv_capacity_tokens = 1_340;
    p.score(&req, &c, &[0, 1, 2, 3], &mut r, &mut scores);
    assert!(scores[3].terms[3] > 0.0, "640 + 700 fit in 1,340: {scores:?}");
}

proptest! {
    #[test]
    fn bounded_load_is_never_exceeded_over_any_arrivals_and_departures(
        n in 1usize..8,
        epsilon in 0.0f64..2.0,
        ops in proptest::collection::vec((any::<bool>(), 0usize..8, 0usize..3000, 0.0f64..1.0), 1..300),
        seed in any::<u64>(),
    ) {
        let p = policy(Config { epsilon, ..Config::default() });
        let mut c = fleet(&vec![0; n]);
        let mut r = rng(seed);
        for (arrive, who, cached, queue) in ops {
            if arrive {
                c[who % n].cached_tokens = cached;
                c[who % n].queued_prefill_secs = queue;
                let req = Request { prompt_tokens: Some(3_000), ..Request::default() };
                let total: u32 = c.iter().map(|x| x.in_flight).sum();
                let cap = ((1.0 + epsilon) * f64::from(total + 1) / n as f64).ceil() as u32;
                let w = decide(&p, &req, &c, &mut r).unwrap()[0];
                c[w].in_flight += 1;
                prop_assert!(c[w].in_flight <= cap, "{} in flight over the cap {cap}", c[w].in_flight);
                p.picked(&req, &c, w);
            } else if c[who % n].in_flight > 0 {
                c[who % n].in_flight -= 1;
            }
        }
    }

    #[test]
    fn more_cache_never_costs_more(prompt in 1usize..32_000, a in 0usize..32_000, b in 0usize..32_000, queue in 0.0f64..5.0, running in 0u32..64) {
        let p = policy(Config::default());
        let (lo, hi) = (a.min(b), a.max(b));
        let mut c = fleet(&[running])[0].clone();
        c.queued_prefill_secs = queue;
        prop_assert!(p.estimate(&c, Some(prompt), hi, Offloaded::default()).total <= p.estimate(&c, Some(prompt), lo, Offloaded::default()).total + 1e-12);
    }
}

#[test]
fn a_replica_over_its_share_of_recent_requests_loses_to_an_equal_holder_but_not_to_a_miss() {
    let p = policy(Config::default());
    let mut r = rng(5);
    let mut c = fleet(&[0, 0, 0]);
    c[0].cached_tokens = 4_000;
    c[1].cached_tokens = 4_000;
    let req = Request { prompt_tokens: Some(4_200), ..Request::default() };
    let mut scores = vec![Score::default(); 3];
    // Too few requests yet to say anything of load.
    for k in [0, 0, 1] {
        p.picked(&req, &c, k);
    }
    p.score(&req, &c, &[0, 1, 2], &mut r, &mut scores);
    assert!(scores.iter().all(|s| s.terms[4] == 0.0), "{scores:?}");
    // Replica 0 took half of twelve: 1.5 fair shares, half a share over.
    for k in [0, 0, 0, 0, 1, 1, 2, 2, 2] {
        p.picked(&req, &c, k);
    }
    p.score(&req, &c, &[0, 1, 2], &mut r, &mut scores);
    let whole = Prefill::default().secs(4_200, 0);
    assert!((scores[0].terms[4] - 0.5 * whole).abs() < 1e-9, "half a whole prefill: {scores:?}");
    assert_eq!((scores[1].terms[4], scores[2].terms[4]), (0.0, 0.0), "at or under their share");
    assert_eq!(decide(&p, &req, &c, &mut r).unwrap()[0], 1, "the other holder wins");
    // Without another holder, a miss costs more than half a share.
    c[1].cached_tokens = 0;
    assert_eq!(decide(&p, &req, &c, &mut r).unwrap()[0], 0);
}

#[test]
fn a_hot_root_whose_holders_keep_up_is_not_copied() {
    let p = policy(Config::default());
    let hot: &'static [u128] = (1..=40).collect::<Vec<_>>().leak();
    let mut c = fleet(&[0, 0, 0, 0]);
    c[0].cached_tokens = 640;
    c[1].cached_tokens = 640;
    let mut r = rng(4);
    let req = |t_ms: u64| rooted(Duration::from_millis(t_ms), hot);
    // Every request asks for the root (4 fair shares of 4: 4 owners), but
    // the requests went evenly to all four replicas: the two holders take
    // their fair share, no more.
    for t in 0..400 {
        p.picked(&req(t * 10), &c, (t % 4) as usize);
    }
    assert_eq!(p.owners(hot[15], 4), 4);
    let mut scores = vec![Score::default(); 4];
    p.score(&req(4_000), &c, &[0, 1, 2, 3], &mut r, &mut scores);
    assert!(scores.iter().all(|s| s.terms[3] == 0.0), "no credit while the holders keep up: {scores:?}");
}

#[test]
fn a_miss_is_charged_for_a_copy_next_to_another_root_but_not_on_an_idle_replica() {
    let p = policy(Config { copy_weight: 0.25, ..Config::default() });
    let a: &'static [u128] = (1..=40).collect::<Vec<_>>().leak();
    let b: &'static [u128] = (101..=140).collect::<Vec<_>>().leak();
    let req = |t_s: u64, blocks: &'static [u128]| rooted(Duration::from_secs(t_s), blocks);
    let mut r = rng(6);
    // Replica 0 holds root A behind a queue that costs a tenth of a prefill
    // more than computing the prompt on an idle replica; replica 1 was just
    // sent root B, replica 2 nothing.
    let mut c = fleet(&[0, 0, 0]);
    c[0].cached_tokens = 640;
    let full = Prefill::default().secs(700, 0);
    let hit = Prefill::default().secs(60, 640);
    c[0].queued_prefill_secs = 1.1 * full - hit;
    p.picked(&req(10, b), &c, 1);
    let mut scores = vec![Score::default(); 3];
    p.score(&req(11, a), &c, &[0, 1, 2], &mut r, &mut scores);
    assert_eq!(scores[0].terms[5], 0.0, "the holder copies nothing: {scores:?}");
    assert!((scores[1].terms[5] - 0.25 * full).abs() < 1e-12, "a quarter of the prefill it would compute: {scores:?}");
    assert_eq!(scores[2].terms[5], 0.0, "an idle replica serves no other root: {scores:?}");
    assert_eq!(decide(&p, &req(11, a), &c, &mut r).unwrap()[0], 2, "the copy goes where it evicts nothing");
    // A root nobody holds is no copy: a first placement, or a prompt shared with none.
    let mut unheld = c.clone();
    unheld[0].cached_tokens = 0;
    p.score(&req(11, a), &unheld, &[0, 1, 2], &mut r, &mut scores);
    assert!(scores.iter().all(|s| s.terms[5] == 0.0), "{scores:?}");
    // Once replica 2 serves B too, waiting for the holder is cheaper than either copy.
    p.picked(&req(12, b), &c, 2);
    assert_eq!(decide(&p, &req(13, a), &c, &mut r).unwrap()[0], 0);
    // A replica sent A after B still serves B; past the window, B is forgotten.
    p.picked(&req(14, a), &c, 1);
    p.score(&req(15, a), &c, &[0, 1, 2], &mut r, &mut scores);
    assert!(scores[1].terms[5] > 0.0, "{scores:?}");
    p.score(&req(12 + 61, a), &c, &[0, 1, 2], &mut r, &mut scores);
    assert_eq!((scores[1].terms[5], scores[2].terms[5]), (0.0, 0.0), "B was last sent over a minute before: {scores:?}");
    // Without the charge, the first copy is as likely to land next to B as not.
    let blind = policy(Config { copy_weight: 0.0, ..Config::default() });
    blind.picked(&req(10, b), &c, 1);
    blind.score(&req(11, a), &c, &[0, 1, 2], &mut r, &mut scores);
    assert_eq!(scores[1].total, scores[2].total, "{scores:?}");
}

#[test]
fn each_replica_is_priced_by_its_own_engine_when_the_fleet_is_mixed() {
    // Two idle replicas, neither holding the prompt: the same price, so
    // the tie goes by the prompt; an engine half as fast loses it.
    let p = policy(Config::default());
    let req = Request { prompt_tokens: Some(4_000), ..Request::default() };
    let slow = Prefill { prefill_token_us: 200.0, prefill_pair_ns: 6.6, prefill_fixed_ms: 10.0 };
    let mut c = fleet(&[0, 0]);
    let mut r = rng(1);
    let first = decide(&p, &req, &c, &mut r).unwrap()[0];
    c[first].prefill = Some(slow);
    assert_eq!(decide(&p, &req, &c, &mut r).unwrap()[0], 1 - first, "the fast engine computes it in half the time");
    // The slow engine holding 3,000 of the 4,000 tokens computes 1,000 of
    // them there, still faster than 4,000 on the fast one.
    c[first].cached_tokens = 3_000;
    let (held, cold) = (slow.secs(1_000, 3_000), Prefill::default().secs(4_000, 0));
    assert!(held < cold, "{held:.3} s against {cold:.3} s");
    assert_eq!(decide(&p, &req, &c, &mut r).unwrap()[0], first);
    // The estimate it explains is the replica's own.
    let mut out = [Score::default(); 2];
    p.score(&req, &c, &[0, 1], &mut r, &mut out);
    assert!((out[first].terms[2] - held).abs() < 1e-9 && (out[1 - first].terms[2] - cold).abs() < 1e-9, "{out:?}");
}

/// A request's adapter: a replica where it runs costs nothing more; one
/// with free slots costs its load, and its last free slot a share of the
/// wait the next adapter there will have; one whose slots every other
/// adapter takes costs the whole wait for a slot, and loses to a busier
/// replica with room, but not to one whose queue is longer than that wait.
#[test]
fn an_adapters_load_and_its_wait_for_a_slot_are_priced() {
    let p = policy(Config::default());
    let a = Config::default().adapters;
    let req = Request { prompt_tokens: Some(500), ..Request::default() };
    let fit = |resident, others| Some(AdapterFit { resident, others, max_loras: Some(3) });
    let mut c = fleet(&[0, 0, 0, 0]);
    (c[0].adapter, c[1].adapter, c[2].adapter, c[3].adapter) = (fit(false, 3), fit(false, 2), fit(true, 2), fit(false, 0));
    let costs: Vec<f64> = c.iter().map(|x| p.estimate(x, req.prompt_tokens, 0, Offloaded::default()).terms[6]).collect();
    let last = (a.load_ms + a.last_slot_share * a.slot_wait_ms) * 1e-3;
    assert_eq!(costs, [(a.load_ms + a.slot_wait_ms) * 1e-3, last, 0.0, a.load_ms * 1e-3]);
    let mut r = rng(1);
    assert_eq!(decide(&p, &req, &c, &mut r).unwrap()[0], 2, "where the adapter runs");
    c[2].queued_prefill_secs = 1.0;
    assert_eq!(decide(&p, &req, &c, &mut r).unwrap()[0], 3, "free slots beat a second of queue");
    c[3].queued_prefill_secs = 1.0;
    assert_eq!(decide(&p, &req, &c, &mut r).unwrap()[0], 2, "the last free slot costs more than that");
    for x in &mut c[1..] {
        x.queued_prefill_secs = 6.0;
    }
    assert_eq!(decide(&p, &req, &c, &mut r).unwrap()[0], 0, "the wait for a slot beats a longer queue");
    // Two more adapters in flight than slots there: they wait first, each for a slot.
    c[0].adapter = fit(false, 5);
    assert_eq!(p.estimate(&c[0], req.prompt_tokens, 0, Offloaded::default()).terms[6], (a.load_ms + 3.0 * a.slot_wait_ms) * 1e-3);
    assert_eq!(decide(&p, &req, &c, &mut r).unwrap()[0], 2, "behind two waiting adapters, the longer queue where it runs is shorter");
}

/// Offloaded tokens are loaded, not computed: a replica whose engine holds
/// the prompt in host memory beats a cold one by the prefill it saves less
/// the load; a tier slower than computing loses, since the engine loads anyway.
#[test]
fn offloaded_tokens_cost_their_load_instead_of_their_prefill() {
    let p = policy(Config::default());
    let o = Config::default().offload;
    let req = Request { prompt_tokens: Some(4_000), ..Request::default() };
    let mut c = fleet(&[0, 0, 0]);
    c[0].cached_tokens = 1_000;
    c[1].cached_tokens = 1_000;
    c[1].offloaded = Offloaded { host: 2_000, disk: 1_000 };
    let (gpu, tiers) =
        (p.estimate(&c[0], req.prompt_tokens, 1_000, c[0].offloaded), p.estimate(&c[1], req.prompt_tokens, 1_000, c[1].offloaded));
    let load = (2_000.0 * o.host_token_us + 1_000.0 * o.disk_token_us) * 1e-6;
    assert!((tiers.terms[7] - load).abs() < 1e-12 && gpu.terms[7] == 0.0, "{tiers:?}");
    assert!((tiers.terms[2] - Prefill::default().secs(0, 4_000)).abs() < 1e-12, "nothing left to compute but the fixed cost: {tiers:?}");
    let mut r = rng(1);
    assert_eq!(decide(&p, &req, &c, &mut r).unwrap()[0], 1, "{gpu:?} {tiers:?}");
    // A storage tier slower than prefill: the engine still loads, and the replica loses.
    let slow = policy(Config { offload: Offload { disk_token_us: 10_000.0, ..o.clone() }, ..Config::default() });
    assert_eq!(decide(&slow, &req, &c, &mut r).unwrap()[0], 0);
    // Unaware, both replicas compute 3,000 tokens as far as it knows: a tie by the prompt, and no offload term.
    let unaware = policy(Config { offload: Offload { aware: false, ..o.clone() }, ..Config::default() });
    let mut out = [Score::default(); 3];
    unaware.score(&req, &c, &[0, 1, 2], &mut r, &mut out);
    assert_eq!((out[0].total, out[1].terms[7]), (out[1].total, 0.0), "{out:?}");
    assert_eq!(c[1].engine_cached_tokens(), 4_000);
}
