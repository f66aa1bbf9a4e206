//! The engines' own counters: each engine's `/metrics` scraped before and
//! after a run, `vllm:prefix_cache_hits_total`,
//! `vllm:prefix_cache_queries_total`, `vllm:request_success_total` and
//! `vllm:kv_offload_allocation_failure_total` summed over their lines. The
//! requests each engine served give every router's replica shares the same
//! way, whether or not it names the replica.
//! While a run goes on, the requests the engines hold deferred (waiting on a
//! LoRA slot or a KV transfer, `vllm:num_requests_waiting_by_reason` with
//! reason `deferred`) are sampled: vLLM counts no deferrals, so their mean
//! number over the run stands for how many were deferred and for how long.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context;
use serde::{Deserialize, Serialize};

const HITS: &str = "vllm:prefix_cache_hits_total";
const QUERIES: &str = "vllm:prefix_cache_queries_total";
const REQUESTS: &str = "vllm:request_success_total";
const STORE_FAILURES: &str = "vllm:kv_offload_allocation_failure_total";
const WAITING_BY_REASON: &str = "vllm:num_requests_waiting_by_reason";

/// How often the deferred requests are sampled during a run.
const SAMPLE_EVERY: Duration = Duration::from_millis(100);

/// Prefix cache counters of one engine at one moment, tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Counters {
    /// Prompt tokens found cached.
    pub hits: f64,
    /// Prompt tokens looked up.
    pub queries: f64,
    /// Requests finished.
    pub requests: f64,
    /// Offers to the host tier that found too few blocks to evict, and
    /// were made again a step later.
    pub store_failures: f64,
}

/// One engine's counters over a run.
#[derive(Debug, Clone, Serialize)]
pub struct EngineHits {
    /// The engine's base URL.
    pub url: String,
    /// Growth of the counters over the run.
    pub delta: Counters,
    /// `hits / queries` over the run.
    pub hit_rate: Option<f64>,
}

/// Every engine's counters over a run, and their total.
#[derive(Debug, Clone, Serialize)]
pub struct FleetHits {
    /// Per engine.
    pub engines: Vec<EngineHits>,
    /// Summed over the engines.
    pub total: Counters,
    /// `hits / queries` summed over the engines.
    pub hit_rate: Option<f64>,
    /// The share of the requests finished by the engine that finished most.
    pub busiest_share: Option<f64>,
}

/// Sums the counters in a Prometheus text page.
pub fn parse(page: &str) -> Counters {
    let mut c = Counters::default();
    for line in page.lines().filter(|l| !l.starts_with('#')) {
        let value = || line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
        let named = |name: &str| line.strip_prefix(name).is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '));
        if named(HITS) {
            c.hits += value();
        } else if named(QUERIES) {
            c.queries += value();
        } else if named(REQUESTS) {
            c.requests += value();
        } else if named(STORE_FAILURES) {
            c.store_failures += value();
        }
    }
    c
}

/// Requests an engine holds deferred, summed over its lines; `None` when
/// the page has no such line (an engine that does not say).
pub fn deferred(page: &str) -> Option<f64> {
    page.lines()
        .filter(|l| l.strip_prefix(WAITING_BY_REASON).is_some_and(|rest| rest.starts_with('{') && rest.contains(r#"reason="deferred""#)))
        .map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0))
        .fold(None, |sum, v| Some(sum.unwrap_or(0.0) + v))
}

async fn page(http: &reqwest::Client, url: &str) -> anyhow::Result<String> {
    Ok(http
        .get(format!("{url}/metrics"))
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .with_context(|| format!("scraping {url}/metrics"))?
        .text()
        .await?)
}

/// Scrapes every engine.
pub async fn scrape(http: &reqwest::Client, urls: &[String]) -> anyhow::Result<Vec<Counters>> {
    let mut out = Vec::with_capacity(urls.len());
    for url in urls {
        out.push(parse(&page(http, url).await?));
    }
    Ok(out)
}

/// The requests the engines held deferred, sampled over a run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Deferred {
    /// Samples taken (every engine answered).
    pub samples: usize,
    /// Mean over the samples of the deferred requests, summed over the engines.
    pub mean: f64,
    /// The most at one sample.
    pub max: f64,
}

/// Samples the engines' deferred requests every [`SAMPLE_EVERY`] until
/// `stop` is set; a sample that some engine did not answer (within ten
/// sampling intervals) or answered without the family is skipped. `None`
/// when no sample was taken.
pub async fn sample_deferred(http: reqwest::Client, urls: Vec<String>, stop: Arc<AtomicBool>) -> Option<Deferred> {
    let mut d = Deferred::default();
    let mut total = 0.0;
    let mut tick = tokio::time::interval(SAMPLE_EVERY);
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        let mut now = Some(0.0);
        for url in &urls {
            let read = tokio::time::timeout(SAMPLE_EVERY * 10, page(&http, url)).await;
            let found = read.ok().and_then(Result::ok).and_then(|p| deferred(&p));
            now = now.zip(found).map(|(sum, v)| sum + v);
        }
        if let Some(now) = now {
            d.samples += 1;
            total += now;
            d.max = d.max.max(now);
        }
    }
    (d.samples > 0).then(|| Deferred { mean: total / d.samples as f64, ..d })
}

/// The counters' growth between two scrapes of the same engines.
pub fn over_run(urls: &[String], before: &[Counters], after: &[Counters]) -> FleetHits {
    let rate = |c: Counters| (c.queries > 0.0).then(|| c.hits / c.queries);
    let mut total = Counters::default();
    let engines = urls
        .iter()
        .zip(before.iter().zip(after))
        .map(|(url, (b, a))| {
            let delta = Counters {
                hits: a.hits - b.hits,
                queries: a.queries - b.queries,
                requests: a.requests - b.requests,
                store_failures: a.store_failures - b.store_failures,
            };
            total.hits += delta.hits;
            total.queries += delta.queries;
            total.requests += delta.requests;
            total.store_failures += delta.store_failures;
            EngineHits { url: url.clone(), delta, hit_rate: rate(delta) }
        })
        .collect::<Vec<_>>();
    let most = engines.iter().map(|e| e.delta.requests).fold(0.0, f64::max);
    let busiest_share = (total.requests > 0.0).then(|| most / total.requests);
    FleetHits { engines, total, hit_rate: rate(total), busiest_share }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_sum_over_lines_and_ignore_lookalikes() {
        let page = "# HELP vllm:prefix_cache_hits_total x\n\
            vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 20.0\n\
            vllm:prefix_cache_hits_total{engine=\"1\",model_name=\"m\"} 5\n\
            vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"m\"} 39.0\n\
            vllm:request_success_total{engine=\"0\",finished_reason=\"length\"} 4\n\
            vllm:request_success_total{engine=\"0\",finished_reason=\"stop\"} 2\n\
            vllm:external_prefix_cache_hits_total 7\n\
            vllm:prefix_cache_hits_created 1.7e9\n\
            vllm:kv_offload_allocation_failure_total{engine=\"0\",model_name=\"m\"} 3\n";
        assert_eq!(parse(page), Counters { hits: 25.0, queries: 39.0, requests: 6.0, store_failures: 3.0 });
        let before = Counters { hits: 5.0, queries: 9.0, requests: 0.0, store_failures: 1.0 };
        let run = over_run(&["a".into(), "b".into()], &[before, before], &[parse(page), Counters { requests: 2.0, ..before }]);
        assert_eq!(run.hit_rate, Some(20.0 / 30.0));
        assert_eq!(run.busiest_share, Some(6.0 / 8.0));
        assert_eq!(run.total.store_failures, 2.0, "3 - 1 on the first engine, none on the second");
    }

    #[test]
    fn deferred_requests_are_the_deferred_reasons_lines_summed() {
        let page = "# TYPE vllm:num_requests_waiting_by_reason gauge\n\
            vllm:num_requests_waiting_by_reason{engine=\"0\",model_name=\"m\",reason=\"capacity\"} 4.0\n\
            vllm:num_requests_waiting_by_reason{engine=\"0\",model_name=\"m\",reason=\"deferred\"} 2.0\n\
            vllm:num_requests_waiting_by_reason{engine=\"1\",model_name=\"m\",reason=\"deferred\"} 1.0\n\
            vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 7.0\n";
        assert_eq!(deferred(page), Some(3.0));
        assert_eq!(deferred("vllm:num_requests_waiting 3\n"), None, "an engine that does not say");
    }
}
