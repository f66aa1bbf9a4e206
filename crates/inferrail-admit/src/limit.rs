//! Token limits per tenant over sliding windows. A tenant is admitted while
//! every one of its windows holds fewer tokens than its limit; the request
//! is then charged its prompt tokens, counted exactly, and later the output
//! tokens its usage reports. So the tokens admitted in any window exceed
//! the limit by at most the last request's. A short window with a small
//! limit next to a long one is the burst allowance.

use std::collections::VecDeque;
use std::time::Duration;

/// At most `tokens` tokens in any span of `span`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// The limit.
    pub tokens: u64,
    /// The span it applies over (nonzero).
    pub span: Duration,
}

/// One tenant's charges, as long as its longest window remembers them.
#[derive(Debug, Default, Clone)]
pub struct Meter {
    log: VecDeque<(Duration, u64)>,
}

impl Meter {
    /// Whether the tenant may be admitted at `now`: `Err` says how long
    /// until every window is below its limit again.
    pub fn check(&mut self, now: Duration, windows: &[Window]) -> Result<(), Duration> {
        self.forget(now, windows);
        let mut wait = Duration::ZERO;
        for w in windows {
            let inside = |&&(at, _): &&(Duration, u64)| now.saturating_sub(at) < w.span;
            let mut used: u64 = self.log.iter().filter(inside).map(|&(_, t)| t).sum();
            if used < w.tokens {
                continue;
            }
            // The window frees as its oldest charges leave it.
            for &(at, tokens) in self.log.iter().filter(inside) {
                used -= tokens;
                if used < w.tokens {
                    wait = wait.max((at + w.span).saturating_sub(now));
                    break;
                }
            }
        }
        if wait.is_zero() { Ok(()) } else { Err(wait) }
    }

    /// Charges `tokens` at `now` (times never go back).
    pub fn charge(&mut self, now: Duration, tokens: u64) {
        if tokens > 0 {
            self.log.push_back((now, tokens));
        }
    }

    /// Tokens charged within `span` before `now`.
    pub fn used(&self, now: Duration, span: Duration) -> u64 {
        self.log.iter().filter(|(at, _)| now.saturating_sub(*at) < span).map(|(_, t)| t).sum()
    }

    /// Whether nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.log.is_empty()
    }

    /// Drops charges older than the longest window.
    fn forget(&mut self, now: Duration, windows: &[Window]) {
        let longest = windows.iter().map(|w| w.span).max().unwrap_or_default();
        while self.log.front().is_some_and(|(at, _)| now.saturating_sub(*at) >= longest) {
            self.log.pop_front();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn refuses_once_the_window_is_full_and_says_when_it_frees() {
        let windows = [Window { tokens: 100, span: 10 * S }];
        let mut m = Meter::default();
        assert_eq!(m.check(Duration::ZERO, &windows), Ok(()));
        m.charge(Duration::ZERO, 60);
        assert_eq!(m.check(2 * S, &windows), Ok(()));
        m.charge(2 * S, 60);
        // 120 in the window: full until the first 60 leave at 10 s.
        assert_eq!(m.check(3 * S, &windows), Err(7 * S));
        assert_eq!(m.check(10 * S, &windows), Ok(()));
        assert_eq!(m.used(10 * S, 10 * S), 60);
    }

    #[test]
    fn the_longest_wait_of_several_windows_is_reported() {
        let windows = [Window { tokens: 50, span: S }, Window { tokens: 1000, span: 60 * S }];
        let mut m = Meter::default();
        m.charge(Duration::ZERO, 50);
        // The burst window frees after one second.
        assert_eq!(m.check(Duration::from_millis(200), &windows), Err(Duration::from_millis(800)));
        for i in 1..20 {
            m.charge(i * S, 50);
        }
        // 1000 in the minute: the minute window frees when the first charge leaves it.
        assert_eq!(m.check(20 * S, &windows), Err(40 * S));
    }

    #[test]
    fn output_tokens_charged_later_count_against_the_limit() {
        let windows = [Window { tokens: 100, span: 10 * S }];
        let mut m = Meter::default();
        m.charge(Duration::ZERO, 40);
        assert_eq!(m.check(S, &windows), Ok(()));
        m.charge(S, 70);
        assert!(m.check(2 * S, &windows).is_err());
    }

    proptest! {
        /// Admitting whenever the meter allows, the prompt tokens admitted
        /// in any window never exceed its limit by more than one request.
        #[test]
        fn admitted_tokens_exceed_a_window_by_at_most_one_request(
            steps in prop::collection::vec((0u64..400, 1u64..300, prop::option::of(0u64..200)), 1..200),
            limit in 1u64..1000,
            span_ms in 100u64..5000,
        ) {
            let windows = [Window { tokens: limit, span: Duration::from_millis(span_ms) }];
            let mut m = Meter::default();
            let (mut now, mut admitted) = (Duration::ZERO, Vec::new());
            for (gap, prompt, output) in steps {
                now += Duration::from_millis(gap);
                if m.check(now, &windows).is_ok() {
                    m.charge(now, prompt);
                    admitted.push((now, prompt));
                    if let Some(out) = output {
                        m.charge(now, out);
                    }
                }
            }
            let biggest = admitted.iter().map(|&(_, t)| t).max().unwrap_or(0);
            for &(end, _) in &admitted {
                let inside: u64 = admitted.iter().filter(|(at, _)| *at <= end && end - *at < windows[0].span).map(|(_, t)| t).sum();
                prop_assert!(inside <= limit + biggest, "{inside} tokens in the window ending at {end:?}, limit {limit}");
            }
        }
    }
}
