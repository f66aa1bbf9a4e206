//! The lifecycle against a reference written as facts: over any order of
//! events, what the machine has done so far must equal what the first
//! status, first byte, first usage and first end heard before the life was
//! over call for.

use super::*;
use proptest::prelude::*;

const WINNER: u64 = 1;
const TIMING: Timing = Timing { grace: Duration::from_millis(500), max_life: Duration::from_millis(3_000) };

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn status(code: u16) -> Event {
    Event::Status { code, served_by: None }
}

/// Every effect an event sequence produced, added up.
#[derive(Debug, Default, PartialEq, Eq)]
struct Totals {
    moved_to: Vec<u64>,
    retried_from: Vec<u64>,
    answered: Vec<(u64, bool)>,
    complete: u32,
    take_back: u32,
    end_claim: u32,
    first_byte: Vec<Duration>,
    usage: Vec<Usage>,
    release: u32,
    outcome: Vec<Outcome>,
}

impl Totals {
    fn add(&mut self, e: Effects) {
        self.moved_to.extend(e.moved_to);
        self.retried_from.extend(e.retried_from);
        self.answered.extend(e.answered);
        self.complete += u32::from(e.complete);
        self.take_back += u32::from(e.take_back);
        self.end_claim += u32::from(e.end_claim);
        self.first_byte.extend(e.first_byte);
        self.usage.extend(e.usage);
        self.release += u32::from(e.release);
        self.outcome.extend(e.outcome);
    }
}

fn run(events: &[(Duration, Event)]) -> (Life, Totals) {
    let mut life = Life::new(Duration::ZERO, WINNER, TIMING);
    let mut totals = Totals::default();
    for &(at, event) in events {
        totals.add(life.on(at, event));
    }
    (life, totals)
}

/// The first of each kind of fact, among the events heard before the life was over.
#[derive(Debug, Default, Clone, Copy)]
struct Facts {
    status: Option<(Duration, u16, Option<u64>)>,
    first_byte: Option<Duration>,
    usage: Option<Usage>,
    end: Option<(Duration, bool)>,
    now: Duration,
    /// Events heard, and the count when the status and the end were heard.
    heard: usize,
    status_heard: Option<usize>,
    end_heard: Option<usize>,
}

impl Facts {
    fn hear(&mut self, at: Duration, event: Event) {
        self.now = at;
        self.heard += 1;
        match event {
            Event::Status { .. } => self.status_heard = self.status_heard.or(Some(self.heard)),
            Event::End | Event::Gone => self.end_heard = self.end_heard.or(Some(self.heard)),
            _ => {}
        }
        match event {
            Event::Status { code, served_by } => self.status = self.status.or(Some((at, code, served_by))),
            Event::FirstByte => self.first_byte = self.first_byte.or(Some(at)),
            Event::Usage(u) => self.usage = self.usage.or(Some(u)),
            Event::End => self.end = self.end.or(Some((at, false))),
            Event::Gone => self.end = self.end.or(Some((at, true))),
            Event::Tick => {}
        }
    }

    fn expired(&self) -> bool {
        self.end.is_none() && self.now >= TIMING.max_life
    }

    fn over(&self) -> bool {
        match self.end {
            Some(_) if self.status.is_some() && self.first_byte.is_some() => true,
            Some((end, _)) => self.now >= end + TIMING.grace,
            None => self.expired(),
        }
    }

    /// The replica that served: the status's sender when it names one.
    fn holder(&self) -> u64 {
        self.status.and_then(|(_, _, by)| by).unwrap_or(WINNER)
    }

    /// What the machine must have done, given these facts.
    fn expected(&self) -> Totals {
        let code = self.status.map(|(_, code, _)| code);
        let moved = self.status.and_then(|(_, _, by)| by).filter(|&by| by != WINNER);
        let ended_or_expired = self.end.is_some() || self.over() && self.expired();
        let over = self.over();
        let outcome = over.then(|| {
            let verdict = match (code, self.end) {
                _ if self.expired() => Verdict::Expired,
                (Some(c), _) if c >= 500 => Verdict::ServerError,
                (Some(c), _) if c >= 400 => Verdict::ClientError,
                (Some(_), _) => Verdict::Ok,
                (None, Some((_, true))) => Verdict::Cancelled,
                (None, _) => Verdict::NoResponse,
            };
            let end = self.end.map_or(self.now, |(at, _)| at);
            Outcome { verdict, status: code, replica: self.holder(), ttft: self.first_byte, usage: self.usage, duration: end }
        });
        Totals {
            moved_to: moved.into_iter().collect(),
            retried_from: moved.map(|_| WINNER).into_iter().collect(),
            answered: code.map(|c| (self.holder(), c < 500)).into_iter().collect(),
            complete: u32::from(code.is_some_and(|c| c < 400) && ended_or_expired),
            take_back: u32::from(code.is_some_and(|c| c >= 400) || code.is_none() && over),
            // Ended before any status came.
            end_claim: u32::from(self.end_heard.is_some_and(|end| self.status_heard.is_none_or(|status| status > end))),
            first_byte: self.first_byte.into_iter().collect(),
            usage: self.usage.into_iter().collect(),
            release: u32::from(ended_or_expired),
            outcome: outcome.into_iter().collect(),
        }
    }
}

/// The facts of a sequence, as of each of its prefixes, frozen once over.
fn reference(events: &[(Duration, Event)]) -> Facts {
    let mut facts = Facts::default();
    for &(at, event) in events {
        if facts.over() {
            break;
        }
        facts.hear(at, event);
    }
    facts
}

fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        (prop::sample::select(vec![200u16, 201, 404, 429, 500, 503]), prop::option::of(1u64..4))
            .prop_map(|(code, served_by)| Event::Status { code, served_by }),
        Just(Event::FirstByte),
        (1u64..100, 0u64..100).prop_map(|(p, c)| Event::Usage(Usage { prompt_tokens: p + c, cached_tokens: c, completion_tokens: 1 })),
        Just(Event::End),
        Just(Event::Gone),
        Just(Event::Tick),
    ]
}

/// Events at non-decreasing times, some far enough apart to pass the grace or the lifetime.
fn history() -> impl Strategy<Value = Vec<(Duration, Event)>> {
    prop::collection::vec((prop::sample::select(vec![0u64, 1, 40, 300, 700, 2_000]), event()), 0..12).prop_map(|steps| {
        let mut at = Duration::ZERO;
        steps
            .into_iter()
            .map(|(gap, e)| {
                at += ms(gap);
                (at, e)
            })
            .collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4_000))]

    #[test]
    fn every_prefix_of_any_history_does_what_its_facts_call_for(events in history()) {
        for n in 0..=events.len() {
            let (life, totals) = run(&events[..n]);
            let facts = reference(&events[..n]);
            prop_assert_eq!(&totals, &facts.expected(), "after {:?}", &events[..n]);
            prop_assert_eq!(life.over(), facts.over());
            prop_assert_eq!(life.holder(), facts.holder());
        }
    }

    #[test]
    fn a_tick_at_the_deadline_always_ends_the_life(events in history()) {
        let (mut life, mut totals) = run(&events);
        if let Some(due) = life.deadline() {
            let before = life.deadline();
            totals.add(life.on(due - ms(1), Event::Tick));
            prop_assert_eq!(life.deadline(), before, "a tick before the deadline changes nothing");
            totals.add(life.on(due, Event::Tick));
        }
        prop_assert!(life.over() && life.deadline().is_none());
        prop_assert_eq!(totals.outcome.len(), 1, "counted once");
        prop_assert_eq!(totals.complete + totals.take_back, 1, "the record settles once");
        prop_assert_eq!(totals.release, 1, "the slot goes back once");
        // Nothing more happens, whatever comes.
        for e in [status(200), Event::FirstByte, Event::End, Event::Gone, Event::Tick] {
            prop_assert_eq!(life.on(ms(100_000), e), Effects::default());
        }
    }
}

#[test]
fn a_success_heard_on_both_streams_completes_at_the_end_and_counts_once_all_is_known() {
    let mut life = Life::new(ms(10), WINNER, TIMING);
    let e = life.on(ms(20), status(200));
    assert_eq!(e.answered, Some((WINNER, true)));
    assert!(!e.complete, "still running: its blocks are held");
    assert_eq!(life.on(ms(35), Event::FirstByte).first_byte, Some(ms(25)));
    let end = life.on(ms(90), Event::End);
    assert!(end.complete && end.release && !end.end_claim && !end.take_back);
    let outcome = end.outcome.expect("status, first byte and end are known: nothing to wait for");
    assert_eq!((outcome.verdict, outcome.ttft, outcome.duration), (Verdict::Ok, Some(ms(25)), ms(80)));
}

#[test]
fn an_end_before_the_status_ends_the_claim_and_the_late_status_completes() {
    let mut life = Life::new(ms(0), WINNER, TIMING);
    let end = life.on(ms(50), Event::End);
    assert!(end.release && end.end_claim && !end.complete && end.outcome.is_none());
    assert_eq!(life.deadline(), Some(ms(550)));
    let late = life.on(ms(60), status(200));
    assert!(late.complete && !late.take_back);
    assert!(late.outcome.is_none(), "the first byte may still come");
    let first = life.on(ms(61), Event::FirstByte);
    assert_eq!(first.outcome.map(|o| o.verdict), Some(Verdict::Ok));
}

#[test]
fn no_status_within_the_grace_takes_the_record_back() {
    let mut life = Life::new(ms(0), WINNER, TIMING);
    life.on(ms(50), Event::End);
    assert_eq!(life.on(ms(549), Event::Tick), Effects::default());
    let due = life.on(ms(550), Event::Tick);
    assert!(due.take_back);
    assert_eq!(due.outcome.map(|o| (o.verdict, o.duration)), Some((Verdict::NoResponse, ms(50))));
    let mut gone = Life::new(ms(0), WINNER, TIMING);
    gone.on(ms(5), Event::Gone);
    assert_eq!(gone.on(ms(505), Event::Tick).outcome.map(|o| o.verdict), Some(Verdict::Cancelled));
}

#[test]
fn a_status_from_another_replica_is_a_retry_that_moves_the_request() {
    let mut life = Life::new(ms(0), WINNER, TIMING);
    let e = life.on(ms(30), Event::Status { code: 200, served_by: Some(7) });
    assert_eq!((e.moved_to, e.retried_from, e.answered), (Some(7), Some(WINNER), Some((7, true))));
    assert_eq!(life.holder(), 7);
    let again = life.on(ms(31), Event::Status { code: 503, served_by: Some(9) });
    assert_eq!(again, Effects::default(), "the first status wins");
    let same = Life::new(ms(0), WINNER, TIMING).on(ms(30), Event::Status { code: 200, served_by: Some(WINNER) });
    assert_eq!((same.moved_to, same.retried_from), (None, None), "its own address is no retry");
}

#[test]
fn a_refusal_takes_the_record_back_at_once_and_fails_the_replica_only_from_500() {
    let e = Life::new(ms(0), WINNER, TIMING).on(ms(5), status(429));
    assert!(e.take_back && !e.release);
    assert_eq!(e.answered, Some((WINNER, true)), "a 4xx is the request's fault, not the replica's");
    assert_eq!(Life::new(ms(0), WINNER, TIMING).on(ms(5), status(503)).answered, Some((WINNER, false)));
}

#[test]
fn a_request_whose_end_is_never_heard_expires() {
    let mut life = Life::new(ms(100), WINNER, TIMING);
    life.on(ms(200), status(200));
    assert_eq!(life.deadline(), Some(ms(3_100)));
    let e = life.on(ms(3_100), Event::Tick);
    assert!(e.release && e.complete);
    assert_eq!(e.outcome.map(|o| (o.verdict, o.duration)), Some((Verdict::Expired, ms(3_000))));
}

#[test]
fn a_first_byte_told_as_before_the_decision_is_not_this_requests() {
    let mut life = Life::new(ms(100), WINNER, TIMING);
    assert_eq!(life.on(ms(99), Event::FirstByte), Effects::default(), "a late record of an earlier request with the same id");
    assert_eq!(life.on(ms(130), Event::FirstByte).first_byte, Some(ms(30)));
}
