//! The follower on named streams, and against an engine model with every fault: it never says exact while the view differs from the engine.

use super::*;
use proptest::prelude::*;
use std::collections::BTreeSet;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ev {
    Store(u32),
    Remove(u32),
    Clear,
}

fn clear_in(events: &[Ev]) -> Option<usize> {
    events.iter().rposition(|e| *e == Ev::Clear)
}

/// The engine: its blocks, its next sequence number and the messages it can replay.
#[derive(Debug, Default)]
struct Engine {
    seq: u64,
    blocks: BTreeSet<u32>,
    log: Vec<(u64, Vec<Ev>)>,
}

impl Engine {
    /// Runs `events` and publishes them: returns the message.
    fn emit(&mut self, events: Vec<Ev>, keep: usize) -> (u64, Vec<Ev>) {
        for e in &events {
            match *e {
                Ev::Store(b) => {
                    self.blocks.insert(b);
                }
                Ev::Remove(b) => {
                    self.blocks.remove(&b);
                }
                Ev::Clear => self.blocks.clear(),
            }
        }
        let msg = (self.seq, events);
        self.seq += 1;
        self.log.push(msg.clone());
        if self.log.len() > keep {
            self.log.remove(0);
        }
        msg
    }

    fn restart(&mut self) {
        *self = Engine::default();
    }
}

/// The router: its follower and the index's exact view, if any.
struct Router {
    follower: Follower,
    view: Option<BTreeSet<u32>>,
}

impl Router {
    fn new(replay: bool) -> Self {
        Self { follower: Follower::new(replay, 0), view: None }
    }

    fn act(&mut self, act: Act, events: &[Ev]) {
        let from = match act {
            Act::Apply { from } => from,
            Act::Start { from } => {
                self.view = Some(BTreeSet::new());
                from
            }
            Act::Leave { .. } => {
                self.view = None;
                return;
            }
            Act::Nothing => return,
            Act::Replay { .. } => unreachable!("replays are answered by deliver"),
        };
        let view = self.view.as_mut().expect("events are applied only to an exact view");
        for e in &events[from..] {
            match *e {
                Ev::Store(b) => {
                    view.insert(b);
                }
                Ev::Remove(b) => {
                    view.remove(&b);
                }
                Ev::Clear => view.clear(),
            }
        }
    }

    /// Delivers a message, answering replays from `engine` when `answers`.
    fn deliver(&mut self, engine: &Engine, (seq, events): &(u64, Vec<Ev>), answers: bool) -> Vec<Act> {
        let mut acts = Vec::new();
        let mut act = self.follower.message(*seq, clear_in(events), 0);
        while let Act::Replay { from, to } = act {
            acts.push(act);
            if answers {
                for (s, evs) in engine.log.iter().filter(|(s, _)| (from..to).contains(s)) {
                    let a = self.follower.replayed(*s, clear_in(evs));
                    self.act(a, evs);
                }
            }
            act = self.follower.message(*seq, clear_in(events), 0);
        }
        acts.push(act);
        self.act(act, events);
        acts
    }
}

/// An engine that published its first message, and a router without a replay endpoint that read it.
fn started() -> (Engine, Router) {
    let mut engine = Engine::default();
    let mut router = Router::new(false);
    let m = engine.emit(vec![Ev::Store(1)], 100);
    router.deliver(&engine, &m, false);
    (engine, router)
}

fn approximate(r: Reason) -> Mode {
    Mode::Approximate(r)
}

#[test]
fn the_first_message_decides_whether_history_is_known() {
    let mut engine = Engine::default();
    let mut router = Router::new(false);
    assert_eq!(router.follower.mode(), approximate(Reason::WaitingForFirstEvent));
    let first = engine.emit(vec![Ev::Store(1)], 100);
    router.deliver(&engine, &first, false);
    assert_eq!(router.follower.mode(), Mode::Exact);

    let mut late = Router::new(false);
    let second = engine.emit(vec![Ev::Store(2)], 100);
    assert_eq!(late.deliver(&engine, &second, false), [Act::Nothing]);
    assert_eq!(late.follower.mode(), approximate(Reason::MissedHistory));

    let mut replaying = Router::new(true);
    let acts = replaying.deliver(&engine, &second, true);
    assert_eq!(acts, [Act::Replay { from: 0, to: 1 }, Act::Apply { from: 0 }]);
    assert_eq!(replaying.follower.mode(), Mode::Exact);
    assert_eq!(replaying.view.as_ref(), Some(&engine.blocks));
}

#[test]
fn a_gap_is_replayed_or_ends_exact_mode_until_a_clear() {
    for answers in [true, false] {
        let mut engine = Engine::default();
        let mut router = Router::new(true);
        let first = engine.emit(vec![Ev::Store(1)], 100);
        router.deliver(&engine, &first, answers);
        engine.emit(vec![Ev::Store(2)], 100);
        let after = engine.emit(vec![Ev::Store(3)], 100);
        let acts = router.deliver(&engine, &after, answers);
        assert_eq!(acts[0], Act::Replay { from: 1, to: 2 });
        if answers {
            assert_eq!(router.follower.mode(), Mode::Exact);
            assert_eq!(router.view.as_ref(), Some(&engine.blocks));
        } else {
            assert_eq!(acts[1], Act::Leave { keep: true }, "a replay endpoint that does not answer");
            assert_eq!(router.follower.mode(), approximate(Reason::SequenceGap));
            let more = engine.emit(vec![Ev::Store(4)], 100);
            assert_eq!(router.deliver(&engine, &more, answers), [Act::Nothing], "still not trustworthy");
            let cleared = engine.emit(vec![Ev::Store(5), Ev::Clear, Ev::Store(6)], 100);
            assert_eq!(router.deliver(&engine, &cleared, answers), [Act::Start { from: 2 }]);
            assert_eq!(router.follower.mode(), Mode::Exact);
            assert_eq!(router.view.as_ref(), Some(&engine.blocks));
        }
    }
}

#[test]
fn a_restart_starts_over_at_sequence_zero() {
    let mut engine = Engine::default();
    let mut router = Router::new(false);
    for b in 0..3 {
        let m = engine.emit(vec![Ev::Store(b)], 100);
        router.deliver(&engine, &m, false);
    }
    engine.restart();
    let m = engine.emit(vec![Ev::Store(9)], 100);
    assert_eq!(router.deliver(&engine, &m, false), [Act::Start { from: 0 }]);
    assert_eq!(router.view.as_ref(), Some(&engine.blocks));
    // A restart whose first messages were missed: approximate, and the old blocks go.
    for b in 0..3 {
        let m = engine.emit(vec![Ev::Store(b)], 100);
        router.deliver(&engine, &m, false);
    }
    engine.restart();
    engine.emit(vec![Ev::Store(7)], 100);
    let m = engine.emit(vec![Ev::Store(8)], 100);
    assert_eq!(router.deliver(&engine, &m, false), [Act::Leave { keep: false }]);
    assert_eq!(router.follower.mode(), approximate(Reason::EngineRestarted));
}

#[test]
fn junk_proves_no_loss_but_an_unreadable_expected_message_does() {
    let (mut engine, mut router) = started();
    assert_eq!(router.follower.garbage(None), Act::Nothing);
    assert_eq!(router.follower.garbage(Some(0)), Act::Nothing, "from before the expected message");
    assert_eq!(router.follower.mode(), Mode::Exact);
    engine.emit(vec![Ev::Store(2)], 100);
    assert_eq!(router.follower.garbage(Some(1)), Act::Leave { keep: true });
    assert_eq!(router.follower.mode(), approximate(Reason::GarbageFrames));
}

#[test]
fn a_silent_publisher_is_suspect_while_requests_run_and_trusted_again_in_sequence() {
    let (mut engine, mut router) = started();
    router.follower.tick(60_000, false, 10_000);
    assert_eq!(router.follower.mode(), Mode::Exact, "an idle engine publishes nothing");
    router.follower.tick(60_000, true, 10_000);
    assert_eq!(router.follower.mode(), approximate(Reason::PublisherSilent));
    let m = engine.emit(vec![Ev::Store(2)], 100);
    assert_eq!(router.deliver(&engine, &m, false), [Act::Apply { from: 0 }]);
    assert_eq!(router.follower.mode(), Mode::Exact);
}

#[test]
fn a_queue_that_dropped_messages_is_replayed_or_falls_back() {
    let (mut engine, mut router) = started();
    engine.emit(vec![Ev::Store(2)], 100);
    assert_eq!(router.follower.dropped(), Act::Leave { keep: true });
    assert_eq!(router.follower.mode(), approximate(Reason::FellBehind));
    let m = engine.emit(vec![Ev::Store(3)], 100);
    router.deliver(&engine, &m, false);
    assert_eq!(router.follower.mode(), approximate(Reason::FellBehind));
}

#[derive(Debug, Clone)]
enum Step {
    /// The engine publishes these and the router reads them.
    Publish(Vec<Ev>),
    /// Published and lost on the way.
    Lose(Vec<Ev>),
    /// Published and unreadable, its sequence number readable or not.
    Garble(Vec<Ev>, bool),
    /// Published and dropped by the router's queue.
    Drop(Vec<Ev>),
    /// A frame from nowhere.
    Junk(Option<u64>),
    /// The engine restarts, and its counters tell the router.
    Restart,
    /// The engine's counters say it restarted, though it did not (or the router hears it late).
    RestartSignal,
    /// The index refuses an event.
    Reject,
    /// Time passes with requests running.
    Silence,
}

fn events() -> impl Strategy<Value = Vec<Ev>> {
    proptest::collection::vec(
        prop_oneof![4 => (0u32..12).prop_map(Ev::Store), 3 => (0u32..12).prop_map(Ev::Remove), 1 => Just(Ev::Clear)],
        1..4,
    )
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        12 => events().prop_map(Step::Publish),
        1 => events().prop_map(Step::Lose),
        1 => (events(), any::<bool>()).prop_map(|(e, s)| Step::Garble(e, s)),
        1 => events().prop_map(Step::Drop),
        1 => proptest::option::of(0u64..40).prop_map(Step::Junk),
        1 => Just(Step::Restart),
        1 => Just(Step::RestartSignal),
        1 => Just(Step::Reject),
        1 => Just(Step::Silence),
    ]
}

proptest! {
    /// Whatever is lost, garbled, dropped or restarted (the router hears of
    /// a restart from the engine's counters, as the service does), and
    /// whether the replay endpoint exists, answers and still holds what is
    /// asked: the follower says exact only while the view is the engine's
    /// cache as of the last message it had word of, and applies events only
    /// to a view.
    #[test]
    fn never_exact_unless_the_view_is_the_engines_cache(
        steps in proptest::collection::vec(step(), 1..60),
        replay in any::<bool>(),
        answers in any::<bool>(),
        keep in 1usize..6,
    ) {
        let mut engine = Engine::default();
        let mut router = Router::new(replay);
        let mut now = 0;
        // The engine's cache as of the last message the router had word of:
        // a message lost on the way cannot be known until the next one comes.
        let mut known = BTreeSet::new();
        for s in steps {
            // An unreadable frame without its sequence number could be junk: like a loss, only the next message tells.
            let heard = !matches!(s, Step::Lose(_) | Step::Garble(_, false) | Step::Silence | Step::Reject | Step::RestartSignal | Step::Junk(_));
            match s {
                Step::Publish(evs) => {
                    let m = engine.emit(evs, keep);
                    router.deliver(&engine, &m, answers);
                    if m.0 == 0 || clear_in(&m.1).is_some() {
                        prop_assert_eq!(router.follower.mode(), Mode::Exact, "a known empty cache makes it exact");
                    }
                }
                Step::Lose(evs) => {
                    engine.emit(evs, keep);
                }
                Step::Garble(evs, readable) => {
                    let (seq, _) = engine.emit(evs, keep);
                    let a = router.follower.garbage(readable.then_some(seq));
                    router.act(a, &[]);
                }
                Step::Drop(evs) => {
                    engine.emit(evs, keep);
                    let a = router.follower.dropped();
                    router.act(a, &[]);
                }
                Step::Junk(seq) => {
                    // Junk that happens to carry the expected sequence number is, to the router, that message garbled.
                    if seq.is_some() && seq == Some(engine.seq) {
                        engine.emit(vec![], keep);
                    }
                    let a = router.follower.garbage(seq);
                    router.act(a, &[]);
                }
                Step::Restart => {
                    engine.restart();
                    let a = router.follower.restarted();
                    router.act(a, &[]);
                }
                Step::RestartSignal => {
                    let a = router.follower.restarted();
                    router.act(a, &[]);
                }
                Step::Reject => {
                    let a = router.follower.rejected(Reason::UnknownParent);
                    router.act(a, &[]);
                }
                Step::Silence => {
                    now += 60_000;
                    router.follower.tick(now, true, 10_000);
                }
            }
            if heard {
                known = engine.blocks.clone();
            }
            if router.follower.mode() == Mode::Exact {
                prop_assert_eq!(router.view.as_ref(), Some(&known));
            }
        }
    }
}
