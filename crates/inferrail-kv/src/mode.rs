//! Whether a replica's entry in the index is exact, and if not why: a small
//! state machine over one engine's KV event stream (ADR 0012).
//!
//! The index may claim to know an engine's cache exactly only while it has
//! applied every event since a moment the cache was known empty: the
//! engine's first message (sequence 0), or an `AllBlocksCleared`. Sequence
//! numbers prove nothing was lost in between. A gap, a lost (unreadable)
//! message, messages the router itself dropped, or an event the index
//! cannot apply make the replica approximate; the replay endpoint, when
//! there is one, is asked for the missing messages first, and filling the
//! gap keeps the replica exact. Back from approximate only through a known
//! empty cache again: an `AllBlocksCleared`, the engine's restart (its
//! sequence starting again at 0), or a replay from sequence 0.
//!
//! Two states keep the exact view while labelling the replica approximate,
//! because nothing is known to be lost yet: a publisher silent while the
//! router has requests on the replica, and a lost message waiting for the
//! replay of it. The next message in sequence (or the replay) restores exact
//! mode; a gap ends the view.
//!
//! Plain data: each input is a method that returns what the caller must do
//! to the index. Times are milliseconds on the caller's clock.

/// A replica's mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The index holds exactly the engine's blocks (plus what the router sent since).
    Exact,
    /// The index learns from the router's decisions, for this reason.
    Approximate(Reason),
}

impl Mode {
    /// `exact`, or the reason it is approximate.
    pub fn as_str(&self) -> &'static str {
        match self {
            Mode::Exact => "exact",
            Mode::Approximate(r) => r.as_str(),
        }
    }
}

/// Why a replica is approximate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// The replica has no KV events configured.
    NoEventsConfigured,
    /// No message has come yet.
    WaitingForFirstEvent,
    /// The first message was not the engine's first and the replay did not fill in from 0.
    MissedHistory,
    /// Sequence numbers skipped and no replay filled the gap.
    SequenceGap,
    /// The router's own queue dropped messages (it fell behind).
    FellBehind,
    /// No message for a while with requests on the replica.
    PublisherSilent,
    /// The sequence went back and the engine's new history was not all seen.
    EngineRestarted,
    /// A message could not be read.
    GarbageFrames,
    /// A stored block's parent was never stored.
    UnknownParent,
    /// A removed block was never stored.
    UnknownBlock,
    /// A block was removed while blocks after it were held.
    BrokenPrefix,
    /// The event's block size is not the replica's.
    BlockSizeMismatch,
    /// An event's token ids do not fill its blocks.
    MalformedEvent,
}

impl Reason {
    /// Every reason, for exporting one gauge per reason.
    pub const ALL: [Reason; 13] = [
        Reason::NoEventsConfigured,
        Reason::WaitingForFirstEvent,
        Reason::MissedHistory,
        Reason::SequenceGap,
        Reason::FellBehind,
        Reason::PublisherSilent,
        Reason::EngineRestarted,
        Reason::GarbageFrames,
        Reason::UnknownParent,
        Reason::UnknownBlock,
        Reason::BrokenPrefix,
        Reason::BlockSizeMismatch,
        Reason::MalformedEvent,
    ];

    /// The reason's name in metrics, Explain and logs.
    pub fn as_str(&self) -> &'static str {
        match self {
            Reason::NoEventsConfigured => "no-events-configured",
            Reason::WaitingForFirstEvent => "waiting-for-first-event",
            Reason::MissedHistory => "missed-history",
            Reason::SequenceGap => "sequence-gap",
            Reason::FellBehind => "fell-behind",
            Reason::PublisherSilent => "publisher-silent",
            Reason::EngineRestarted => "engine-restarted",
            Reason::GarbageFrames => "garbage-frames",
            Reason::UnknownParent => "unknown-parent",
            Reason::UnknownBlock => "unknown-block",
            Reason::BrokenPrefix => "broken-prefix",
            Reason::BlockSizeMismatch => "block-size-mismatch",
            Reason::MalformedEvent => "malformed-event",
        }
    }
}

impl From<&crate::index::EventError> for Reason {
    fn from(e: &crate::index::EventError) -> Self {
        use crate::index::EventError as E;
        match e {
            E::UnknownParent(_) => Reason::UnknownParent,
            E::UnknownBlock(_) => Reason::UnknownBlock,
            E::BrokenPrefix(_) => Reason::BrokenPrefix,
            E::BlockSizeMismatch { .. } => Reason::BlockSizeMismatch,
            E::Malformed { .. } | E::UnknownReplica(_) | E::NotExact(_) => Reason::MalformedEvent,
        }
    }
}

/// What the caller does to the index for one input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    /// Apply the message's events from `from` on to the exact view.
    Apply {
        /// The first event to apply.
        from: usize,
    },
    /// Put the replica in exact mode from an empty cache, then apply the
    /// message's events from `from` on.
    Start {
        /// The first event to apply.
        from: usize,
    },
    /// Put the replica in approximate mode; with `keep` its shadow starts
    /// from the exact view, without it from nothing (the engine restarted).
    Leave {
        /// Keep what was known.
        keep: bool,
    },
    /// Ask the replay endpoint for sequence numbers `from..to`, feed each
    /// reply to `replayed` (acting on what it says), then feed this message
    /// to `message` again.
    Replay {
        /// First sequence number wanted.
        from: u64,
        /// One past the last.
        to: u64,
    },
    /// Nothing to do.
    Nothing,
}

/// One replica's follower; see the module doc.
#[derive(Debug, Clone)]
pub struct Follower {
    mode: Mode,
    /// The sequence number expected next; `None` before the first message.
    next: Option<u64>,
    /// The index holds an exact view of the replica (in exact mode, and while suspect).
    view: bool,
    /// A replay endpoint is configured.
    replay: bool,
    /// The message a replay was asked for (it is not asked twice).
    asked: Option<u64>,
    /// Messages were lost since the last one taken: dropped by the router's queue, or unreadable.
    lost: Option<Reason>,
    last_message_ms: u64,
}

impl Follower {
    /// A replica whose events are configured, before any message; `replay`
    /// says whether a replay endpoint is.
    pub fn new(replay: bool, now_ms: u64) -> Self {
        Self {
            mode: Mode::Approximate(Reason::WaitingForFirstEvent),
            next: None,
            view: false,
            replay,
            asked: None,
            lost: None,
            last_message_ms: now_ms,
        }
    }

    /// The replica's mode now.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// A message with sequence number `seq` arrived; `clear` is the position
    /// of its last `AllBlocksCleared`, if it has one.
    pub fn message(&mut self, seq: u64, clear: Option<usize>, now_ms: u64) -> Act {
        self.last_message_ms = now_ms;
        let act = match self.next {
            None if seq == 0 => self.start(0),
            None => {
                if let Some(act) = self.replay_for(seq, 0, seq) {
                    return act;
                }
                let reason = self.lost.take().unwrap_or(Reason::MissedHistory);
                self.unknown(reason, clear, true)
            }
            // In sequence: exact again unless a loss is still to be replayed (or the message clears the cache).
            Some(n) if seq == n && self.view => match (self.lost, clear) {
                (None, _) => {
                    self.mode = Mode::Exact;
                    Act::Apply { from: 0 }
                }
                (Some(_), Some(c)) => self.start(c + 1),
                (Some(_), None) => Act::Apply { from: 0 },
            },
            Some(n) if seq == n => clear.map_or(Act::Nothing, |c| self.start(c + 1)),
            Some(n) if seq > n => {
                if self.view
                    && let Some(act) = self.replay_for(seq, n, seq)
                {
                    return act;
                }
                let reason = self.lost.take().unwrap_or(Reason::SequenceGap);
                self.unknown(reason, clear, true)
            }
            // The sequence went back: the engine restarted, its cache empty at its sequence 0.
            Some(_) if seq == 0 => self.start(0),
            Some(_) => {
                if let Some(act) = self.replay_for(seq, 0, seq) {
                    return act;
                }
                self.unknown(Reason::EngineRestarted, clear, false)
            }
        };
        self.asked = None;
        self.next = Some(seq + 1);
        act
    }

    /// A message from the replay endpoint, asked for by `Act::Replay`.
    pub fn replayed(&mut self, seq: u64, clear: Option<usize>) -> Act {
        match self.next {
            // Replaying from 0: the engine's first message, or its first after a restart.
            _ if seq == 0 => {
                self.next = Some(1);
                self.start(0)
            }
            Some(n) if seq == n => {
                self.next = Some(n + 1);
                self.lost = None;
                if self.view { Act::Apply { from: 0 } } else { clear.map_or(Act::Nothing, |c| self.start(c + 1)) }
            }
            // Before the gap (already applied) or past it (the replay skipped some): the message itself decides.
            _ => Act::Nothing,
        }
    }

    /// A message could not be read; `seq` is its sequence number when that
    /// much was readable. Messages up to it are lost: the replica is
    /// approximate, and with a replay endpoint the next message's gap is
    /// replayed.
    pub fn garbage(&mut self, seq: Option<u64>) -> Act {
        // A frame without a readable sequence number, or from before the
        // expected one, proves no loss: the next message's sequence will tell.
        match (seq, self.next) {
            (Some(s), Some(n)) if s >= n => {}
            _ => return Act::Nothing,
        }
        self.lost = Some(Reason::GarbageFrames);
        self.suspect(Reason::GarbageFrames)
    }

    /// The router's queue dropped a message.
    pub fn dropped(&mut self) -> Act {
        self.lost = Some(Reason::FellBehind);
        self.suspect(Reason::FellBehind)
    }

    /// The index refused one of the replica's events: its view is wrong.
    pub fn rejected(&mut self, reason: Reason) -> Act {
        self.mode = Mode::Approximate(reason);
        self.leave(true)
    }

    /// Something other than the event stream (the engine's own counters
    /// going back) says the engine restarted: what the view holds is gone,
    /// and only the new engine's history from its sequence 0 makes the
    /// replica exact again (its first messages may have come already: the
    /// replay endpoint, if any, is asked for them).
    pub fn restarted(&mut self) -> Act {
        self.next = None;
        self.asked = None;
        self.lost = Some(Reason::EngineRestarted);
        self.mode = Mode::Approximate(Reason::EngineRestarted);
        self.leave(false)
    }

    /// Time passed: with requests on the replica (`busy`) and no message for
    /// `silent_after_ms`, an exact replica becomes suspect.
    pub fn tick(&mut self, now_ms: u64, busy: bool, silent_after_ms: u64) {
        if self.mode == Mode::Exact && busy && now_ms.saturating_sub(self.last_message_ms) >= silent_after_ms {
            self.mode = Mode::Approximate(Reason::PublisherSilent);
        }
    }

    fn start(&mut self, from: usize) -> Act {
        self.mode = Mode::Exact;
        self.view = true;
        self.lost = None;
        Act::Start { from }
    }

    /// A replay for this message, unless one was asked already or there is no replay endpoint.
    fn replay_for(&mut self, seq: u64, from: u64, to: u64) -> Option<Act> {
        if !self.replay || self.asked == Some(seq) {
            return None;
        }
        self.asked = Some(seq);
        Some(Act::Replay { from, to })
    }

    /// Events were lost: exact again only from a clear in this message, else approximate.
    fn unknown(&mut self, reason: Reason, clear: Option<usize>, keep: bool) -> Act {
        if let Some(c) = clear {
            return self.start(c + 1);
        }
        self.mode = Mode::Approximate(reason);
        self.leave(keep)
    }

    fn leave(&mut self, keep: bool) -> Act {
        let was = std::mem::replace(&mut self.view, false);
        // A restart's old blocks go, whatever the mode was.
        if was || !keep { Act::Leave { keep } } else { Act::Nothing }
    }

    /// Something was lost: approximate now; with a replay endpoint the view
    /// waits for the next message's gap to be replayed, without one it ends.
    fn suspect(&mut self, reason: Reason) -> Act {
        if !self.view {
            return Act::Nothing;
        }
        self.mode = Mode::Approximate(reason);
        if self.replay { Act::Nothing } else { self.leave(true) }
    }
}

#[cfg(test)]
mod tests;
