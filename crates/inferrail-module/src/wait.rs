//! A decision that waits: the [`Slot`] its task leaves it in, the deadline
//! past which the paused stream goes on without it, and the [`Watchdog`]
//! thread that keeps deadlines even when the router's runtime cannot run.
//!
//! The deadline is the ext_proc route filter's, kept the same way: a
//! decision gets [`FIRST_WAIT`] (its `message_timeout`, ADR 0014), and a
//! request that has to wait longer says so through the caller's `on_wait`
//! (a queue in admission, a prefill leg), which moves the deadline to that
//! wait plus [`MARGIN`] (its `max_message_timeout` override). A stream
//! whose decision does not come by then is resumed unrouted, and the
//! cluster's own balancing serves it, as ext_proc's `failure_mode_allow`
//! would.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Duration, Instant};

use inferrail::decision::{Answer, Decision};
use inferrail::router::Router;
use inferrail_route::lifecycle::Event;

use crate::abi::Scheduler;

/// How long a decision may take before the stream goes on without it.
pub const FIRST_WAIT: Duration = Duration::from_secs(1);

/// Added to a wait the request says it has, for the answer's way back.
pub const MARGIN: Duration = Duration::from_secs(1);

/// How often the watchdog looks.
const TICK: Duration = Duration::from_millis(20);

/// A decision, or the router's own answer, with the id the request came by.
pub type Decided = (Result<(Decision, Option<String>), Answer>, String);

/// What the stream finds when it is resumed.
pub enum Taken {
    /// The decision came.
    Decided(Box<Decided>),
    /// Its deadline passed first: the stream goes on unrouted.
    TimedOut,
    /// Nothing (the stream was not waiting).
    Nothing,
}

/// Where a decision task leaves the decision, and how it wakes its stream.
pub struct Slot(Mutex<State>);

struct State {
    decided: Option<Decided>,
    /// Deleted once the stream takes the decision, times out or ends, so no commit follows.
    scheduler: Option<Scheduler>,
    deadline: Instant,
    timed_out: bool,
    /// The stream ended: a decision that comes now is nobody's.
    closed: bool,
}

impl Default for Slot {
    /// A slot whose decision is due within [`FIRST_WAIT`].
    fn default() -> Self {
        let state = State { decided: None, scheduler: None, deadline: Instant::now() + FIRST_WAIT, timed_out: false, closed: false };
        Self(Mutex::new(state))
    }
}

impl Slot {
    fn state(&self) -> MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The request may wait `wait` more (the caller's `on_wait`).
    pub fn extend(&self, wait: Duration) {
        let mut state = self.state();
        state.deadline = state.deadline.max(Instant::now() + wait + MARGIN);
    }

    /// The stream is paused: `scheduler` resumes it.
    pub fn pause(&self, scheduler: Scheduler) {
        self.state().scheduler = Some(scheduler);
    }

    /// The task's decision: handed to the stream, whose worker is asked to
    /// resume it, or (when the stream ended or went on first) its leases
    /// ended.
    pub fn put(&self, decided: Decided, router: &Router) {
        let mut state = self.state();
        if state.closed || state.timed_out {
            drop(state);
            gone(router, decided);
            return;
        }
        state.decided = Some(decided);
        if let Some(s) = &state.scheduler {
            s.commit(0);
        }
    }

    /// What the stream finds; nothing more will come. `closing`: the stream ended.
    pub fn take(&self, closing: bool) -> Taken {
        let mut state = self.state();
        state.closed |= closing;
        drop(state.scheduler.take());
        match state.decided.take() {
            Some(decided) => Taken::Decided(Box::new(decided)),
            None if state.timed_out => Taken::TimedOut,
            None => Taken::Nothing,
        }
    }

    /// Resumes the stream if its deadline passed with no decision; whether
    /// the slot still needs watching.
    fn watch(&self, now: Instant) -> bool {
        let mut state = self.state();
        if state.closed || state.timed_out || state.decided.is_some() || state.scheduler.is_none() {
            return false;
        }
        if now < state.deadline {
            return true;
        }
        state.timed_out = true;
        if let Some(s) = &state.scheduler {
            s.commit(0);
        }
        false
    }
}

/// A decision nobody applied: its leases end as the client's leaving.
pub fn gone(router: &Router, (decided, _): Decided) {
    if let Ok((d, _)) = decided {
        router.hear(&d.request_id, Event::Gone);
        if let Some(leg) = &d.prefill {
            router.hear(&leg.request_id, Event::Gone);
        }
    }
}

/// The slots of paused streams, watched by a thread of its own (not the
/// router's runtime, which may be what is stuck). Workers only hand new
/// slots over, under a lock the thread holds just long enough to take
/// them: it scans (and commits) with no lock a worker waits on. With
/// nothing to watch it sleeps until a slot is handed over, so a process
/// whose decisions all come at once (most do) never wakes it.
#[derive(Default)]
pub struct Watchdog {
    handed: Mutex<Vec<Weak<Slot>>>,
    wake: Condvar,
}

impl Watchdog {
    /// Starts the thread that keeps the deadlines.
    pub fn start() -> std::io::Result<Arc<Self>> {
        let dog = Arc::new(Self::default());
        let handed = dog.clone();
        std::thread::Builder::new().name("inferrail-watchdog".into()).spawn(move || {
            let mut watched: Vec<Weak<Slot>> = Vec::new();
            loop {
                let mut new = handed.handed.lock().unwrap_or_else(PoisonError::into_inner);
                while watched.is_empty() && new.is_empty() {
                    new = handed.wake.wait(new).unwrap_or_else(PoisonError::into_inner);
                }
                watched.append(&mut new);
                drop(new);
                // Slots handed over meanwhile are looked at on the next round.
                std::thread::sleep(TICK);
                let now = Instant::now();
                watched.retain(|s| s.upgrade().is_some_and(|s| s.watch(now)));
            }
        })?;
        Ok(dog)
    }

    /// Watches `slot` until its decision comes, its stream ends or its deadline passes.
    pub fn watch(&self, slot: &Arc<Slot>) {
        self.handed.lock().unwrap_or_else(PoisonError::into_inner).push(Arc::downgrade(slot));
        self.wake.notify_one();
    }
}
