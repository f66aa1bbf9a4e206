//! The ledger over real decisions: what each life's effects do to the leases and the index.

use super::*;
use crate::lifecycle::Verdict;
use crate::tests::{NONE, core, prompt, view};

const TIMING: Timing = Timing { grace: Duration::from_millis(500), max_life: Duration::from_secs(3_600) };

/// A 1,024-token prompt's cached tokens where it is held: all but its last
/// block of 16, since the engine computes at least its last token.
const HELD: usize = 1_008;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Decides a 1,024-token prompt starting at token `first` and tracks it as `id`: the id it got and its winner.
fn decided(core: &Core, fleet: &Arc<Fleet>, ledger: &Ledger, id: &str, first: u32) -> (String, Arc<Replica>) {
    let p = prompt(first, 1_024);
    let (_, committed) = core.decide(&view(core, fleet, &p), fleet, NONE, ms(0)).unwrap();
    let winner = committed.targets[0].clone();
    (ledger.insert(id, committed.lease, ms(0)), winner)
}

/// The prompt's predicted cached tokens on each replica serving the model.
fn cached(core: &Core, fleet: &Arc<Fleet>, first: u32) -> Vec<usize> {
    let p = prompt(first, 1_024);
    core.plan_all(&view(core, fleet, &p), fleet, NONE, ms(0)).candidates.iter().map(|c| c.cached_tokens).collect()
}

fn in_flight(fleet: &Fleet) -> Vec<(u32, u32)> {
    fleet.serving(0).iter().map(|r| (r.in_flight(), r.pending())).collect()
}

fn status(code: u16, served_by: Option<u64>) -> Event {
    Event::Status { code, served_by }
}

#[test]
fn a_served_request_keeps_its_prompt_cached_and_gives_back_its_slot() {
    let (core, fleet) = core("round_robin", 3);
    let ledger = Ledger::new(TIMING);
    let (id, winner) = decided(&core, &fleet, &ledger, "a", 0);
    assert_eq!(in_flight(&fleet)[0], (1, 1));
    assert_eq!(ledger.lease(&id).unwrap().replica.id, winner.id);
    let heard = ledger.hear(&id, ms(5), status(200, Some(winner.key)), &core, &fleet).unwrap();
    assert_eq!(heard.answered().map(|(r, ok)| (r.id.clone(), ok)), Some((winner.id.clone(), true)));
    ledger.hear(&id, ms(8), Event::FirstByte, &core, &fleet).unwrap();
    assert_eq!(in_flight(&fleet)[0], (1, 0), "streaming: no longer pending");
    let end = ledger.hear(&id, ms(40), Event::End, &core, &fleet).unwrap();
    assert_eq!(end.effects.outcome.map(|o| o.verdict), Some(Verdict::Ok));
    assert_eq!(in_flight(&fleet), [(0, 0); 3]);
    assert!(ledger.is_empty(), "counted and forgotten");
    assert_eq!(cached(&core, &fleet, 0)[0], HELD, "the engine holds what it served");
    assert!(ledger.hear(&id, ms(41), Event::End, &core, &fleet).is_none(), "a late message finds nothing");
}

#[test]
fn a_retry_moves_the_slot_and_the_record_to_the_replica_that_served() {
    let (core, fleet) = core("round_robin", 3);
    let ledger = Ledger::new(TIMING);
    let (id, winner) = decided(&core, &fleet, &ledger, "a", 0);
    let other = fleet.serving(0)[1].clone();
    let heard = ledger.hear(&id, ms(5), status(200, Some(other.key)), &core, &fleet).unwrap();
    assert_eq!(heard.retried_from.as_ref().map(|r| r.id.as_str()), Some(winner.id.as_str()));
    assert_eq!(heard.lease.replica.id, other.id);
    assert_eq!(in_flight(&fleet), [(0, 0), (1, 1), (0, 0)]);
    assert_eq!(cached(&core, &fleet, 0), [0, HELD, 0]);
    ledger.hear(&id, ms(9), Event::End, &core, &fleet).unwrap();
    assert_eq!(in_flight(&fleet), [(0, 0); 3]);
}

#[test]
fn a_retry_heard_after_the_end_moves_the_record_but_holds_no_slot() {
    let (core, fleet) = core("round_robin", 3);
    let ledger = Ledger::new(TIMING);
    let (id, _) = decided(&core, &fleet, &ledger, "a", 0);
    ledger.hear(&id, ms(9), Event::End, &core, &fleet).unwrap();
    let other = fleet.serving(0)[2].clone();
    ledger.hear(&id, ms(10), status(200, Some(other.key)), &core, &fleet).unwrap();
    assert_eq!(in_flight(&fleet), [(0, 0); 3]);
    assert_eq!(cached(&core, &fleet, 0), [0, 0, HELD]);
}

#[test]
fn an_unanswered_request_is_taken_back_when_its_grace_ends() {
    let (core, fleet) = core("round_robin", 3);
    let ledger = Ledger::new(TIMING);
    let (id, _) = decided(&core, &fleet, &ledger, "a", 0);
    ledger.hear(&id, ms(20), Event::End, &core, &fleet).unwrap();
    assert_eq!(in_flight(&fleet), [(0, 0); 3], "the slot goes back at the end");
    assert!(ledger.tick(ms(519), &core, &fleet).is_empty(), "not due yet");
    assert_eq!(cached(&core, &fleet, 0)[0], HELD, "a status may still come");
    let due = ledger.tick(ms(520), &core, &fleet);
    assert_eq!(due.len(), 1);
    assert!(due[0].took_back);
    assert_eq!(due[0].effects.outcome.map(|o| o.verdict), Some(Verdict::NoResponse));
    assert_eq!(cached(&core, &fleet, 0)[0], 0, "never answered: not in that cache");
    assert!(ledger.is_empty());
}

#[test]
fn a_refusal_is_taken_back_at_once() {
    let (core, fleet) = core("round_robin", 3);
    let ledger = Ledger::new(TIMING);
    let (id, winner) = decided(&core, &fleet, &ledger, "a", 0);
    let heard = ledger.hear(&id, ms(3), status(503, None), &core, &fleet).unwrap();
    assert!(heard.took_back);
    assert_eq!(heard.answered().map(|(r, ok)| (r.id.clone(), ok)), Some((winner.id.clone(), false)));
    assert_eq!(cached(&core, &fleet, 0)[0], 0);
    assert_eq!(in_flight(&fleet)[0], (1, 1), "still in flight until it ends");
}

#[test]
fn a_reused_id_gets_its_own_entry_and_each_is_forgotten_alone() {
    let (core, fleet) = core("round_robin", 3);
    let ledger = Ledger::new(TIMING);
    let (a, _) = decided(&core, &fleet, &ledger, "same", 0);
    let (b, _) = decided(&core, &fleet, &ledger, "same", 5_000);
    assert_eq!((a.as_str(), b.as_str()), ("same", "same.1"));
    ledger.hear(&a, ms(1), Event::End, &core, &fleet).unwrap();
    ledger.tick(ms(600), &core, &fleet);
    assert_eq!(ledger.len(), 1);
    assert!(ledger.forget(&b).is_some());
    assert_eq!(in_flight(&fleet), [(0, 0); 3]);
}

#[test]
fn an_end_and_a_status_at_once_count_one_outcome_and_leave_nothing_held() {
    let (core, fleet) = core("round_robin", 3);
    let (core, ledger) = (Arc::new(core), Arc::new(Ledger::new(TIMING)));
    let mut outcomes = 0;
    for i in 0..500 {
        let (id, _) = decided(&core, &fleet, &ledger, &format!("r{i}"), i * 2_000);
        let barrier = Arc::new(std::sync::Barrier::new(2));
        let observe = {
            let (core, fleet, ledger, id, barrier) = (core.clone(), fleet.clone(), ledger.clone(), id.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                let status = ledger.hear(&id, ms(10), status(200, None), &core, &fleet);
                let first = ledger.hear(&id, ms(11), Event::FirstByte, &core, &fleet);
                [status, first].into_iter().flatten().filter(|h| h.effects.outcome.is_some()).count()
            })
        };
        barrier.wait();
        let end = ledger.hear(&id, ms(10), Event::End, &core, &fleet);
        outcomes += end.into_iter().filter(|h| h.effects.outcome.is_some()).count();
        outcomes += observe.join().unwrap();
        outcomes += ledger.tick(ms(10_000), &core, &fleet).iter().filter(|h| h.effects.outcome.is_some()).count();
        assert_eq!(cached(&core, &fleet, i * 2_000).iter().sum::<usize>(), HELD, "completed where it went, never taken back");
    }
    assert_eq!(outcomes, 500);
    assert!(ledger.is_empty());
    assert_eq!(in_flight(&fleet), [(0, 0); 3]);
}
