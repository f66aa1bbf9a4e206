//! Sending a plan to an idle engine and reading each probe's cost from its own metrics.
//!
//! Requests go one at a time. Around each probe the metrics page is read
//! before and after, and the probe's prefill time is the difference of
//! `vllm:request_prefill_time_seconds_sum` (or of the TTFT sum where the
//! engine has no prefill histogram), so network and HTTP time stay out of the
//! fit. Engines may publish metrics a little after answering, so "after"
//! waits until the histogram has counted exactly one more request; counting
//! more means someone else is using the engine, and the run stops. The
//! tokens the engine really found cached come from the difference of
//! `vllm:prefix_cache_hits_total`, else from the response's `cached_tokens`,
//! so an engine that cached less than planned is fitted on what it computed.

use std::time::{Duration, Instant};

use crate::engine::{Completion, Engine, EngineError};
use crate::fit::Observation;
use crate::plan::{Plan, Probe};
use crate::scrape::{Counters, Histogram};

/// Where a probe's time came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimedBy {
    /// `vllm:request_prefill_time_seconds_sum`.
    PrefillHistogram,
    /// `vllm:time_to_first_token_seconds_sum`.
    TtftHistogram,
}

/// Where a probe's cached token count came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CachedFrom {
    /// `vllm:prefix_cache_hits_total`.
    HitsCounter,
    /// `usage.prompt_tokens_details.cached_tokens`.
    Usage,
}

/// One probe as the engine served it.
#[derive(Debug, Clone, PartialEq)]
pub struct Measurement {
    /// The plan's cached tokens.
    pub planned_cached: usize,
    /// The plan's uncached tokens.
    pub planned_uncached: usize,
    /// Prompt tokens the engine counted.
    pub prompt_tokens: usize,
    /// Prompt tokens the engine found cached.
    pub cached_tokens: usize,
    /// Source of `cached_tokens`.
    pub cached_from: CachedFrom,
    /// Prefill time by the engine's metrics, seconds.
    pub engine_secs: f64,
    /// Source of `engine_secs`.
    pub timed_by: TimedBy,
    /// The engine's time to first token, seconds, when it exports one.
    pub engine_ttft_secs: Option<f64>,
    /// The whole request as the client timed it, seconds.
    pub client_secs: f64,
}

impl Measurement {
    /// The probe as the fit sees it: what was really computed and cached.
    pub fn observation(&self) -> Observation {
        Observation { uncached: self.prompt_tokens.saturating_sub(self.cached_tokens), cached: self.cached_tokens, secs: self.engine_secs }
    }

    /// Client time beyond the engine's own time to first token (or prefill
    /// time): network, HTTP, queueing before the engine saw it, the one
    /// decoded token's detokenization.
    pub fn overhead_secs(&self) -> f64 {
        self.client_secs - self.engine_ttft_secs.unwrap_or(self.engine_secs)
    }
}

/// What the runner has just done, for progress reporting.
#[derive(Debug, Clone, Copy)]
pub enum Step<'a> {
    /// A group's prefix was sent and cached.
    Prefix {
        /// Its length, tokens.
        tokens: usize,
    },
    /// A probe was measured.
    Probe(&'a Measurement),
    /// An unmeasured warm-up request was served.
    Warmup,
}

/// How the runner waits for the engine.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RunOptions {
    /// Longest wait for metrics to count a finished request, or for the engine to go idle at the start.
    pub settle: Duration,
    /// Pause between reads of the metrics page while waiting.
    pub poll: Duration,
}

impl Default for RunOptions {
    fn default() -> Self {
        Self { settle: Duration::from_secs(10), poll: Duration::from_millis(5) }
    }
}

/// Why a run stopped.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// Talking to the engine failed.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The page has neither a prefill nor a TTFT histogram.
    #[error("the metrics page has neither vllm:request_prefill_time_seconds nor vllm:time_to_first_token_seconds")]
    NoTiming,
    /// Neither the hits counter nor usage says what was cached.
    #[error("neither vllm:prefix_cache_hits_total nor usage.prompt_tokens_details.cached_tokens is available")]
    NoCachedCount,
    /// The engine still had requests when the run began.
    #[error("the engine is busy ({in_flight} requests running or waiting); calibrate an idle engine")]
    Busy {
        /// Requests running or waiting.
        in_flight: f64,
    },
    /// The metrics never counted a finished request.
    #[error("the metrics page did not count the request within {0:?}")]
    Stuck(Duration),
    /// More requests finished than the run sent.
    #[error("the engine served {0} requests during one probe; calibrate an idle engine")]
    Interference(f64),
}

/// Sends `plan` to `engine` one request at a time; `on_step` hears each step.
pub async fn run(engine: &Engine, plan: &Plan, opts: RunOptions, mut on_step: impl FnMut(Step<'_>)) -> Result<Vec<Measurement>, RunError> {
    let mut now = wait_idle(engine, opts).await?;
    let timed_by = match (now.prefill, now.ttft) {
        (Some(_), _) => TimedBy::PrefillHistogram,
        (None, Some(_)) => TimedBy::TtftHistogram,
        (None, None) => return Err(RunError::NoTiming),
    };
    for prompt in &plan.warmup {
        engine.complete(prompt).await?;
        now = settle(engine, &now, timed_by, opts).await?;
        on_step(Step::Warmup);
    }
    let mut out = Vec::with_capacity(plan.probes());
    for group in &plan.groups {
        if !group.prefix.is_empty() {
            engine.complete(&group.prefix).await?;
            now = settle(engine, &now, timed_by, opts).await?;
            on_step(Step::Prefix { tokens: group.prefix.len() });
        }
        for probe in &group.probes {
            let before = now;
            let done = engine.complete(&probe.prompt).await?;
            now = settle(engine, &before, timed_by, opts).await?;
            let m = measure(probe, &done, &before, &now, timed_by)?;
            on_step(Step::Probe(&m));
            out.push(m);
        }
    }
    Ok(out)
}

/// Waits until nothing is running or waiting, and returns that page.
async fn wait_idle(engine: &Engine, opts: RunOptions) -> Result<Counters, RunError> {
    let start = Instant::now();
    loop {
        let c = engine.scrape().await?;
        match c.in_flight {
            Some(n) if n > 0.0 => {
                if start.elapsed() >= opts.settle {
                    return Err(RunError::Busy { in_flight: n });
                }
                tokio::time::sleep(opts.poll).await;
            }
            _ => return Ok(c),
        }
    }
}

/// Reads the page until the timing histogram has counted one more request than `before`.
async fn settle(engine: &Engine, before: &Counters, timed_by: TimedBy, opts: RunOptions) -> Result<Counters, RunError> {
    let start = Instant::now();
    let want = histogram(before, timed_by).map(|h| h.count).unwrap_or(0.0) + 1.0;
    loop {
        let c = engine.scrape().await?;
        let count = histogram(&c, timed_by).map(|h| h.count).unwrap_or(0.0);
        if count > want {
            return Err(RunError::Interference(count - want + 1.0));
        }
        if count == want {
            return Ok(c);
        }
        if start.elapsed() >= opts.settle {
            return Err(RunError::Stuck(opts.settle));
        }
        tokio::time::sleep(opts.poll).await;
    }
}

fn histogram(c: &Counters, timed_by: TimedBy) -> Option<Histogram> {
    match timed_by {
        TimedBy::PrefillHistogram => c.prefill,
        TimedBy::TtftHistogram => c.ttft,
    }
}

/// One probe's measurement from the pages around it.
fn measure(probe: &Probe, done: &Completion, before: &Counters, after: &Counters, timed_by: TimedBy) -> Result<Measurement, RunError> {
    let delta = |f: fn(&Counters) -> Option<f64>| Some(f(after)? - f(before)?);
    let engine_secs = match timed_by {
        TimedBy::PrefillHistogram => delta(|c| c.prefill.map(|h| h.sum)),
        TimedBy::TtftHistogram => delta(|c| c.ttft.map(|h| h.sum)),
    }
    .ok_or(RunError::NoTiming)?;
    let engine_ttft_secs = delta(|c| c.ttft.map(|h| h.sum));
    let (cached_tokens, cached_from) = match (delta(|c| c.cache_hits), done.cached_tokens) {
        (Some(hits), _) => (hits.round().max(0.0) as usize, CachedFrom::HitsCounter),
        (None, Some(cached)) => (cached, CachedFrom::Usage),
        (None, None) => return Err(RunError::NoCachedCount),
    };
    Ok(Measurement {
        planned_cached: probe.cached,
        planned_uncached: probe.uncached,
        prompt_tokens: done.prompt_tokens,
        cached_tokens: cached_tokens.min(done.prompt_tokens),
        cached_from,
        engine_secs,
        timed_by,
        engine_ttft_secs,
        client_secs: done.client_secs,
    })
}
