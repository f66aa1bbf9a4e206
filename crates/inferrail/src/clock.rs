//! The router's clock: time since the router started, as a [`Duration`],
//! read from tokio's clock so that tests drive it with tokio's paused time
//! (`#[tokio::test(start_paused = true)]`, `tokio::time::advance`). Every
//! part of the router that needs the time reads this clock or is handed
//! the time; the decision core and the ledger never read one themselves.

use std::time::Duration;

use tokio::time::Instant;

/// Time since a start.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    start: Instant,
}

impl Clock {
    /// A clock whose zero is now.
    pub fn start() -> Self {
        Self { start: Instant::now() }
    }

    /// Time since the start.
    pub fn now(&self) -> Duration {
        self.start.elapsed()
    }

    /// When `at` (a moment another part of the process noted, such as a
    /// scrape) was, on this clock; zero for a moment before the start.
    pub fn since_start(&self, at: std::time::Instant) -> Duration {
        at.saturating_duration_since(self.start.into_std())
    }
}
