//! Fault injection: make the simulator misbehave on purpose, for tests.
//!
//! A fault is set by flag at start or at any time with `POST /_sim/fault`
//! (`{"mode": "hang"}`, `{"mode": "delay", "ms": 200, "for_ms": 5000}`, ...;
//! `for_ms` makes it clear itself). The control path itself is never faulted,
//! except by `refuse`, which closes the listening socket and drops each open
//! connection at its next request: give it a `for_ms`.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::time::Instant;

/// A way to misbehave.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "snake_case")]
pub enum Fault {
    /// Behave.
    None,
    /// Refuse new connections; drop open ones at their next request.
    Refuse,
    /// Close each connection when a request arrives, without answering.
    Close,
    /// Never answer until the fault is cleared.
    Hang,
    /// Answer after a delay.
    Delay {
        /// The delay, milliseconds.
        ms: u64,
    },
    /// Answer with this status in the OpenAI error shape.
    Error {
        /// HTTP status.
        status: u16,
    },
    /// Alternate: healthy for a period, then `status` for a period.
    Flap {
        /// Length of each phase, milliseconds.
        period_ms: u64,
        /// Status answered while down.
        status: u16,
    },
}

/// What a fault means for a request arriving now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Serve it.
    Serve,
    /// Drop the connection; also keep the listener closed.
    Refuse,
    /// Drop the connection.
    Close,
    /// Wait until the fault changes.
    Hang,
    /// Serve after this long.
    Delay(Duration),
    /// Answer this status.
    Error(u16),
}

/// A fault as set, with when it was set and when it clears itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FaultRequest {
    /// The fault.
    #[serde(flatten)]
    pub fault: Fault,
    /// Clear it after this many milliseconds.
    #[serde(default)]
    pub for_ms: Option<u64>,
}

#[derive(Debug, Clone, Copy)]
struct State {
    fault: Fault,
    since: Instant,
    until: Option<Instant>,
}

/// The current fault, shared by every connection.
#[derive(Debug)]
pub struct Faults {
    tx: watch::Sender<State>,
}

impl Faults {
    /// Starts with `fault` in force.
    pub fn new(fault: Fault) -> Self {
        Self { tx: watch::Sender::new(State { fault, since: Instant::now(), until: None }) }
    }

    /// Puts a fault in force now.
    pub fn set(&self, req: FaultRequest) {
        let now = Instant::now();
        let until = req.for_ms.map(|ms| now + Duration::from_millis(ms));
        self.tx.send_replace(State { fault: req.fault, since: now, until });
    }

    /// The fault in force and its remaining time.
    pub fn current(&self) -> FaultRequest {
        let s = *self.tx.borrow();
        let now = Instant::now();
        if s.until.is_some_and(|u| u <= now) {
            return FaultRequest { fault: Fault::None, for_ms: None };
        }
        FaultRequest { fault: s.fault, for_ms: s.until.map(|u| (u - now).as_millis() as u64) }
    }

    /// What to do with a request arriving now.
    pub fn action(&self) -> Action {
        let s = *self.tx.borrow();
        let now = Instant::now();
        if s.until.is_some_and(|u| u <= now) {
            return Action::Serve;
        }
        match s.fault {
            Fault::None => Action::Serve,
            Fault::Refuse => Action::Refuse,
            Fault::Close => Action::Close,
            Fault::Hang => Action::Hang,
            Fault::Delay { ms } => Action::Delay(Duration::from_millis(ms)),
            Fault::Error { status } => Action::Error(status),
            Fault::Flap { period_ms, status } => {
                let phase = (now - s.since).as_millis() / u128::from(period_ms.max(1));
                if phase.is_multiple_of(2) { Action::Serve } else { Action::Error(status) }
            }
        }
    }

    /// Waits until the fault is set anew or clears itself.
    pub async fn changed(&self) {
        let mut rx = self.tx.subscribe();
        // A deadline already passed is no deadline: the fault has cleared.
        let until = rx.borrow_and_update().until.filter(|&u| u > Instant::now());
        tokio::select! {
            _ = rx.changed() => {}
            () = sleep_until_opt(until) => {}
        }
    }

    /// Waits while the fault in force is `hang`.
    pub async fn hang(&self) {
        while self.action() == Action::Hang {
            self.changed().await;
        }
    }
}

async fn sleep_until_opt(t: Option<Instant>) {
    match t {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_timed_fault_clears_itself() {
        let f = Faults::new(Fault::None);
        f.set(FaultRequest { fault: Fault::Error { status: 503 }, for_ms: Some(100) });
        assert_eq!(f.action(), Action::Error(503));
        tokio::time::advance(Duration::from_millis(101)).await;
        assert_eq!(f.action(), Action::Serve);
    }

    #[tokio::test(start_paused = true)]
    async fn flap_alternates() {
        let f = Faults::new(Fault::Flap { period_ms: 50, status: 500 });
        assert_eq!(f.action(), Action::Serve);
        tokio::time::advance(Duration::from_millis(60)).await;
        assert_eq!(f.action(), Action::Error(500));
        tokio::time::advance(Duration::from_millis(50)).await;
        assert_eq!(f.action(), Action::Serve);
    }

    #[test]
    fn control_bodies_parse() {
        let r: FaultRequest =
            serde_json::from_str(r#"{"mode":"delay","ms":20,"for_ms":1000}"#).unwrap_or(FaultRequest { fault: Fault::None, for_ms: None });
        assert_eq!(r, FaultRequest { fault: Fault::Delay { ms: 20 }, for_ms: Some(1000) });
        assert!(serde_json::from_str::<FaultRequest>(r#"{"mode":"explode"}"#).is_err());
    }
}
