//! What a run's outcomes add up to: latency percentiles, throughput, goodput
//! against an SLO, prefix hit rate from usage, errors, send lag, load per
//! replica, and how well the router predicted cached tokens.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

use crate::harness::Outcome;
use crate::report::{self, Latency};

/// The service level a request must meet to count toward goodput.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Slo {
    /// Most time to first token, milliseconds.
    pub ttft_ms: f64,
    /// Most time per output token, milliseconds.
    pub tpot_ms: f64,
}

impl Slo {
    /// Whether a finished request met it (one with a single token has no TPOT).
    pub fn met(&self, o: &Outcome) -> bool {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        o.ok() && o.ttft.is_some_and(|t| ms(t) <= self.ttft_ms) && o.tpot().is_none_or(|t| ms(t) <= self.tpot_ms)
    }
}

/// The summary of the measured requests.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// Requests measured (warmup excluded).
    pub requests: usize,
    /// Streamed to `[DONE]`.
    pub ok: usize,
    /// Failed, by cause (HTTP status or error text).
    pub errors: BTreeMap<String, usize>,
    /// Seconds from the first measured scheduled send to the last completion.
    pub window_s: f64,
    /// Successful requests per second over the window.
    pub requests_per_s: f64,
    /// Output tokens per second over the window.
    pub output_tokens_per_s: f64,
    /// Time to first token, from the scheduled send.
    pub ttft: Latency,
    /// Time per output token after the first.
    pub tpot: Latency,
    /// Gaps between content chunks.
    pub itl: Latency,
    /// Scheduled send to `[DONE]`.
    pub e2e: Latency,
    /// Actual send minus scheduled send.
    pub send_lag: Latency,
    /// Requests within the SLO.
    pub goodput: Goodput,
    /// Prefix cache hits reported in usage.
    pub prefix: Prefix,
    /// Requests per replica the router named.
    pub replicas: Replicas,
    /// Predicted cached tokens against usage.
    pub prediction: Prediction,
}

/// Requests within the SLO.
#[derive(Debug, Clone, Serialize)]
pub struct Goodput {
    /// The SLO.
    pub slo: Slo,
    /// Requests that met it.
    pub met: usize,
    /// Their share of the measured requests.
    pub share: f64,
    /// Per second over the window.
    pub per_s: f64,
}

/// Prompt tokens cached, from `usage`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Prefix {
    /// Requests whose usage reported cached tokens.
    pub requests: usize,
    /// Their prompt tokens.
    pub prompt_tokens: u64,
    /// Their cached prompt tokens.
    pub cached_tokens: u64,
    /// `cached_tokens / prompt_tokens`; `None` when no usage reported them.
    pub hit_rate: Option<f64>,
    /// Of their prompt tokens, the share the workload knows is shared with
    /// earlier requests: the most a perfect cache could hit (and a bit more
    /// for the first request of each shared prompt).
    pub known_shared_rate: Option<f64>,
}

/// Load per replica.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Replicas {
    /// Requests per replica named by `x-inferrail-replica`.
    pub requests: BTreeMap<String, usize>,
    /// Requests answered without the header.
    pub unnamed: usize,
    /// The busiest replica's share of the named requests.
    pub busiest_share: Option<f64>,
}

/// Predicted cached tokens (`x-inferrail-cached-tokens`) against usage.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Prediction {
    /// Requests with both.
    pub compared: usize,
    /// Predicted exactly.
    pub exact: usize,
    /// Predicted more than the engine cached.
    pub over: usize,
    /// Predicted less.
    pub under: usize,
    /// Mean of |predicted - cached|, tokens.
    pub mean_abs_error_tokens: Option<f64>,
}

/// Summarizes the outcomes scheduled at or after `warmup`.
pub fn summarize(outcomes: &[Outcome], warmup: Duration, slo: Slo) -> Summary {
    let measured: Vec<&Outcome> = outcomes.iter().filter(|o| o.at >= warmup).collect();
    let ok: Vec<&Outcome> = measured.iter().copied().filter(|o| o.ok()).collect();
    let mut errors = BTreeMap::new();
    for o in measured.iter().filter(|o| !o.ok()) {
        let cause = match (o.status, &o.error) {
            (Some(s), _) if !(200..300).contains(&s) => format!("HTTP {s}"),
            (_, Some(e)) => e.chars().take(120).collect(),
            (_, None) => "unknown".into(),
        };
        *errors.entry(cause).or_insert(0) += 1;
    }
    let end = ok.iter().filter_map(|o| o.e2e.map(|e| o.started + e)).max().unwrap_or(warmup);
    let first = measured.iter().map(|o| o.at).min().unwrap_or(warmup);
    let window_s = end.saturating_sub(first).as_secs_f64();
    let per_s = |n: f64| if window_s > 0.0 { n / window_s } else { 0.0 };
    let tokens: usize = ok.iter().map(|o| o.output_tokens).sum();
    let met = measured.iter().filter(|o| slo.met(o)).count();
    Summary {
        requests: measured.len(),
        ok: ok.len(),
        errors,
        window_s,
        requests_per_s: per_s(ok.len() as f64),
        output_tokens_per_s: per_s(tokens as f64),
        ttft: report::latency(ok.iter().filter_map(|o| o.ttft).collect()),
        tpot: report::latency(ok.iter().filter_map(|o| o.tpot()).collect()),
        itl: report::latency(ok.iter().flat_map(|o| o.itl.iter().copied()).collect()),
        e2e: report::latency(ok.iter().filter_map(|o| o.e2e).collect()),
        send_lag: report::latency(measured.iter().map(|o| o.send_lag).collect()),
        goodput: Goodput {
            slo,
            met,
            share: if measured.is_empty() { 0.0 } else { met as f64 / measured.len() as f64 },
            per_s: per_s(met as f64),
        },
        prefix: prefix(ok.iter().copied()),
        replicas: replicas(ok.iter().copied()),
        prediction: prediction(ok.iter().copied()),
    }
}

/// Cached tokens from usage over `outcomes`.
pub fn prefix<'a>(outcomes: impl Iterator<Item = &'a Outcome>) -> Prefix {
    let mut p = Prefix::default();
    let mut shared = 0u64;
    for o in outcomes {
        if let (Some(prompt), Some(cached)) = (o.prompt_tokens, o.cached_tokens) {
            p.requests += 1;
            p.prompt_tokens += prompt;
            p.cached_tokens += cached;
            shared += o.shared_prefix_tokens as u64;
        }
    }
    if p.prompt_tokens > 0 {
        p.hit_rate = Some(p.cached_tokens as f64 / p.prompt_tokens as f64);
        p.known_shared_rate = Some(shared as f64 / p.prompt_tokens as f64);
    }
    p
}

fn replicas<'a>(outcomes: impl Iterator<Item = &'a Outcome>) -> Replicas {
    let mut r = Replicas::default();
    for o in outcomes {
        match &o.replica {
            Some(name) => *r.requests.entry(name.clone()).or_insert(0) += 1,
            None => r.unnamed += 1,
        }
    }
    let named: usize = r.requests.values().sum();
    r.busiest_share = r.requests.values().max().map(|&m| m as f64 / named as f64);
    r
}

fn prediction<'a>(outcomes: impl Iterator<Item = &'a Outcome>) -> Prediction {
    let mut p = Prediction::default();
    let mut error = 0u64;
    for o in outcomes {
        let (Some(predicted), Some(cached)) = (o.predicted_cached_tokens, o.cached_tokens) else {
            continue;
        };
        p.compared += 1;
        match predicted.cmp(&cached) {
            std::cmp::Ordering::Equal => p.exact += 1,
            std::cmp::Ordering::Greater => p.over += 1,
            std::cmp::Ordering::Less => p.under += 1,
        }
        error += predicted.abs_diff(cached);
    }
    if p.compared > 0 {
        p.mean_abs_error_tokens = Some(error as f64 / p.compared as f64);
    }
    p
}

impl Summary {
    /// A few human-readable lines.
    pub fn text(&self) -> String {
        let l = |name: &str, l: &Latency| {
            format!(
                "{name:<9} p50 {:>9.1}  p90 {:>9.1}  p99 {:>9.1}  mean {:>9.1} ms (n={})\n",
                l.p50_ms, l.p90_ms, l.p99_ms, l.mean_ms, l.count
            )
        };
        let rate = |r: Option<f64>| r.map_or("n/a".to_string(), |r| format!("{:.1}%", r * 100.0));
        let mut s = format!(
            "requests {} ok {} errors {:?} over {:.1} s: {:.2} req/s, {:.1} output tok/s\n",
            self.requests, self.ok, self.errors, self.window_s, self.requests_per_s, self.output_tokens_per_s
        );
        s += &l("ttft", &self.ttft);
        s += &l("tpot", &self.tpot);
        s += &l("itl", &self.itl);
        s += &l("e2e", &self.e2e);
        s += &l("send lag", &self.send_lag);
        s += &format!(
            "goodput (ttft <= {} ms, tpot <= {} ms): {} = {:.1}%, {:.2} req/s\n",
            self.goodput.slo.ttft_ms,
            self.goodput.slo.tpot_ms,
            self.goodput.met,
            self.goodput.share * 100.0,
            self.goodput.per_s
        );
        s += &format!(
            "prefix hit rate (usage) {} of {} prompt tokens; known shared {}\n",
            rate(self.prefix.hit_rate),
            self.prefix.prompt_tokens,
            rate(self.prefix.known_shared_rate)
        );
        s += &format!(
            "replicas {:?} (unnamed {}), busiest share {}\n",
            self.replicas.requests,
            self.replicas.unnamed,
            rate(self.replicas.busiest_share)
        );
        let p = &self.prediction;
        s += &format!(
            "prediction: {} compared, {} exact, {} over, {} under, mean abs error {}\n",
            p.compared,
            p.exact,
            p.over,
            p.under,
            p.mean_abs_error_tokens.map_or("n/a".into(), |e| format!("{e:.1} tokens"))
        );
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(at_ms: u64, ttft_ms: u64, e2e_ms: u64, tokens: usize) -> Outcome {
        Outcome {
            at: Duration::from_millis(at_ms),
            started: Duration::from_millis(at_ms),
            status: Some(200),
            ttft: Some(Duration::from_millis(ttft_ms)),
            e2e: Some(Duration::from_millis(e2e_ms)),
            output_tokens: tokens,
            ..Outcome::default()
        }
    }

    #[test]
    fn goodput_prediction_replicas_and_hit_rate_add_up() {
        let slo = Slo { ttft_ms: 2000.0, tpot_ms: 100.0 };
        let mut a = ok(1000, 500, 1500, 11); // tpot 100 ms: met
        a.replica = Some("r1".into());
        (a.prompt_tokens, a.cached_tokens, a.predicted_cached_tokens) = (Some(100), Some(80), Some(80));
        let mut b = ok(1100, 2500, 3000, 2); // ttft too long
        b.replica = Some("r1".into());
        (b.prompt_tokens, b.cached_tokens, b.predicted_cached_tokens) = (Some(100), Some(0), Some(16));
        let mut c = ok(1200, 100, 2100, 11); // tpot 200 ms
        c.replica = Some("r2".into());
        let warm = ok(0, 100, 200, 2);
        let failed = Outcome { at: Duration::from_millis(1300), status: Some(503), error: Some("HTTP 503".into()), ..Outcome::default() };
        let s = summarize(&[warm, a, b, c, failed], Duration::from_millis(500), slo);
        assert_eq!((s.requests, s.ok, s.goodput.met), (4, 3, 1));
        assert_eq!(s.errors.get("HTTP 503"), Some(&1));
        assert_eq!(s.prefix.hit_rate, Some(0.4));
        assert_eq!((s.prediction.compared, s.prediction.exact, s.prediction.over, s.prediction.under), (2, 1, 1, 0));
        assert_eq!(s.prediction.mean_abs_error_tokens, Some(8.0));
        assert_eq!(s.replicas.busiest_share, Some(2.0 / 3.0));
        assert!((s.window_s - 3.1).abs() < 1e-9, "{}", s.window_s); // 1.0 s to 1.1 + 3.0 s
        assert_eq!(s.tpot.count, 3);
    }
}
