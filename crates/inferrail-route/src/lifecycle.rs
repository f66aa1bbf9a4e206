//! One request's life after its decision, as a pure state machine.
//!
//! Every transport turns what it hears into [`Event`]s: the route stream's
//! closing, the observe stream's response headers and first body chunk, an
//! Inference Extension gateway's full-duplex stream, an access-log entry,
//! another router forwarding what it heard. [`Life::on`] says what follows
//! as [`Effects`]: the lease's first byte (from which the KV record's output
//! fills blocks) and release, the KV record
//! completed, taken back or its exact claim ended, a move to the replica
//! that really served, health, and at the end one [`Outcome`]. Nothing here
//! touches the lease or the index; [`crate::ledger`] applies the effects.
//!
//! The rules (ADR 0029):
//! - The first status wins; later ones (a second source, a duplicate) are
//!   ignored. A status from another replica than the one holding the
//!   request means Envoy retried there: the holder failed it and the
//!   request moves. A first byte heard as before the decision is ignored.
//! - The KV record settles once: taken back on a status of 400 or more,
//!   completed once both a status below 400 and the end are known, taken
//!   back when the request ends with no status and none comes within the
//!   grace. An end with no status ends an exact replica's claim at once.
//! - The slot is released once, on the first end.
//! - The outcome is counted once: when the request has ended and its status
//!   and first byte are known, else at the grace's end. A request whose end
//!   is never heard expires `max_life` after its decision.
//!
//! Time is passed in with each event; [`Life::deadline`] says when a
//! [`Event::Tick`] is next due.

use std::time::Duration;

/// What the engine reported it used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Of those, the ones served from its prefix cache.
    pub cached_tokens: u64,
    /// Tokens generated.
    pub completion_tokens: u64,
}

/// Something heard of a request after its decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// The upstream's response headers: their status and, when the
    /// transport says, the replica that sent them (its [`crate::fleet::Replica::key`]).
    Status {
        /// HTTP status.
        code: u16,
        /// Who answered, when known.
        served_by: Option<u64>,
    },
    /// The response's first body byte (or headers that end the response).
    FirstByte,
    /// The engine's usage report.
    Usage(Usage),
    /// The request is over: its stream closed, its response ended, or a log says so.
    End,
    /// The client went away before the response ended.
    Gone,
    /// Time passed; due at [`Life::deadline`].
    Tick,
}

/// How a request ended, for counting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Answered below 400.
    Ok,
    /// Answered 400 to 499.
    ClientError,
    /// Answered 500 or more.
    ServerError,
    /// Ended with no status heard.
    NoResponse,
    /// The client left before any status was heard.
    Cancelled,
    /// No end was heard within `max_life`.
    Expired,
}

impl Verdict {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::ClientError => "4xx",
            Self::ServerError => "5xx",
            Self::NoResponse => "no_response",
            Self::Cancelled => "cancelled",
            Self::Expired => "expired",
        }
    }
}

/// What a request came to, counted once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// How it ended.
    pub verdict: Verdict,
    /// The status heard, if any.
    pub status: Option<u16>,
    /// The replica holding it at the end (the one that served, after retries).
    pub replica: u64,
    /// From the decision to the first byte.
    pub ttft: Option<Duration>,
    /// The engine's usage, when reported.
    pub usage: Option<Usage>,
    /// From the decision to the end (or the expiry).
    pub duration: Duration,
}

/// What an event calls for. Whoever applies them does so in field order:
/// the move first, then the KV record, then the lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Effects {
    /// Envoy retried: the request (its lease and KV record) moves to this replica.
    pub moved_to: Option<u64>,
    /// The replica Envoy retried away from failed the request.
    pub retried_from: Option<u64>,
    /// The replica that answered, and whether it answered below 500.
    pub answered: Option<(u64, bool)>,
    /// The engine answered and the request is over: its blocks were freed.
    pub complete: bool,
    /// The engine refused or failed it, or never answered: its prompt is not in that cache.
    pub take_back: bool,
    /// Over with no status yet: an exact replica's claim ends now.
    pub end_claim: bool,
    /// Time to the first byte, the first time it is heard.
    pub first_byte: Option<Duration>,
    /// The engine's usage, the first time it is heard.
    pub usage: Option<Usage>,
    /// The slot goes back.
    pub release: bool,
    /// The request's life is over: count it and forget it.
    pub outcome: Option<Outcome>,
}

/// How long a life waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// After the end, for a status or first byte still on its way.
    pub grace: Duration,
    /// After the decision, for an end that may never be heard.
    pub max_life: Duration,
}

impl Timing {
    /// The router's: a request waits half a second, once over, for its
    /// status or first byte still on its way; one whose end is never heard
    /// counts for at most an hour.
    pub const ROUTER: Timing = Timing { grace: Duration::from_millis(500), max_life: Duration::from_secs(3_600) };
}

/// One request's life, from its decision to its outcome.
#[derive(Debug, Clone)]
pub struct Life {
    timing: Timing,
    decided: Duration,
    holder: u64,
    status: Option<u16>,
    ttft: Option<Duration>,
    usage: Option<Usage>,
    ended: Option<Duration>,
    gone: bool,
    record_open: bool,
    released: bool,
    over: bool,
}

impl Life {
    /// A request decided at `at` for replica `holder`.
    pub fn new(at: Duration, holder: u64, timing: Timing) -> Self {
        Self {
            timing,
            decided: at,
            holder,
            status: None,
            ttft: None,
            usage: None,
            ended: None,
            gone: false,
            record_open: true,
            released: false,
            over: false,
        }
    }

    /// The replica holding the request now.
    pub fn holder(&self) -> u64 {
        self.holder
    }

    /// Whether its slot was released.
    pub fn released(&self) -> bool {
        self.released
    }

    /// Whether its outcome was counted (then every event is ignored).
    pub fn over(&self) -> bool {
        self.over
    }

    /// When a [`Event::Tick`] is next due, while the life goes on.
    pub fn deadline(&self) -> Option<Duration> {
        match (self.over, self.ended) {
            (true, _) => None,
            (false, Some(end)) => Some(end + self.timing.grace),
            (false, None) => Some(self.decided + self.timing.max_life),
        }
    }

    /// Hears `event` at `at` (on the clock the decision was made on).
    pub fn on(&mut self, at: Duration, event: Event) -> Effects {
        let mut e = Effects::default();
        if self.over {
            return e;
        }
        match event {
            Event::Status { code, served_by } if self.status.is_none() => {
                if let Some(by) = served_by.filter(|&by| by != self.holder) {
                    e.retried_from = Some(self.holder);
                    e.moved_to = Some(by);
                    self.holder = by;
                }
                self.status = Some(code);
                e.answered = Some((self.holder, code < 500));
                if code >= 400 {
                    e.take_back = self.settle();
                } else if self.ended.is_some() {
                    e.complete = self.settle();
                }
            }
            Event::Status { .. } => {}
            // A first byte told as before the decision is not this request's
            // (an id reused while a log record of the last one was on its way).
            Event::FirstByte if self.ttft.is_none() && at >= self.decided => {
                let ttft = at.saturating_sub(self.decided);
                self.ttft = Some(ttft);
                e.first_byte = Some(ttft);
            }
            Event::Usage(u) if self.usage.is_none() => {
                self.usage = Some(u);
                e.usage = Some(u);
            }
            Event::End | Event::Gone if self.ended.is_none() => {
                self.ended = Some(at);
                self.gone = event == Event::Gone;
                e.release = self.release();
                match self.status {
                    Some(code) if code < 400 => e.complete = self.settle(),
                    None => e.end_claim = self.record_open,
                    Some(_) => {}
                }
            }
            Event::FirstByte | Event::Usage(_) | Event::End | Event::Gone | Event::Tick => {}
        }
        self.close(at, &mut e);
        e
    }

    /// Ends the life when nothing more is worth waiting for.
    fn close(&mut self, at: Duration, e: &mut Effects) {
        let verdict = match (self.ended, self.status) {
            (Some(_), Some(_)) if self.ttft.is_some() => self.answered(),
            (Some(end), _) if at >= end + self.timing.grace => match self.status {
                Some(_) => self.answered(),
                None if self.gone => Verdict::Cancelled,
                None => Verdict::NoResponse,
            },
            (None, _) if at >= self.decided + self.timing.max_life => {
                e.release |= self.release();
                match self.status {
                    Some(code) if code < 400 => e.complete |= self.settle(),
                    _ => {}
                }
                Verdict::Expired
            }
            _ => return,
        };
        if self.status.is_none() {
            e.take_back |= self.settle();
        }
        self.over = true;
        let end = self.ended.unwrap_or(at);
        e.outcome = Some(Outcome {
            verdict,
            status: self.status,
            replica: self.holder,
            ttft: self.ttft,
            usage: self.usage,
            duration: end.saturating_sub(self.decided),
        });
    }

    fn answered(&self) -> Verdict {
        match self.status {
            Some(code) if code >= 500 => Verdict::ServerError,
            Some(code) if code >= 400 => Verdict::ClientError,
            _ => Verdict::Ok,
        }
    }

    /// Settles the KV record; true the first time.
    fn settle(&mut self) -> bool {
        std::mem::replace(&mut self.record_open, false)
    }

    /// Releases the slot; true the first time.
    fn release(&mut self) -> bool {
        !std::mem::replace(&mut self.released, true)
    }
}

#[cfg(test)]
mod tests;
