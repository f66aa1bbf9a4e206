//! The engines' own prefix cache counters: each engine's `/metrics` scraped
//! before and after a run, `vllm:prefix_cache_hits_total` and
//! `vllm:prefix_cache_queries_total` summed over their lines.

use anyhow::Context;
use serde::Serialize;

const HITS: &str = "vllm:prefix_cache_hits_total";
const QUERIES: &str = "vllm:prefix_cache_queries_total";

/// Prefix cache counters of one engine at one moment, tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Counters {
    /// Prompt tokens found cached.
    pub hits: f64,
    /// Prompt tokens looked up.
    pub queries: f64,
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
        }
    }
    c
}

/// Scrapes every engine.
pub async fn scrape(http: &reqwest::Client, urls: &[String]) -> anyhow::Result<Vec<Counters>> {
    let mut out = Vec::with_capacity(urls.len());
    for url in urls {
        let page = http
            .get(format!("{url}/metrics"))
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .with_context(|| format!("scraping {url}/metrics"))?
            .text()
            .await?;
        out.push(parse(&page));
    }
    Ok(out)
}

/// The counters' growth between two scrapes of the same engines.
pub fn over_run(urls: &[String], before: &[Counters], after: &[Counters]) -> FleetHits {
    let rate = |c: Counters| (c.queries > 0.0).then(|| c.hits / c.queries);
    let mut total = Counters::default();
    let engines = urls
        .iter()
        .zip(before.iter().zip(after))
        .map(|(url, (b, a))| {
            let delta = Counters { hits: a.hits - b.hits, queries: a.queries - b.queries };
            total.hits += delta.hits;
            total.queries += delta.queries;
            EngineHits { url: url.clone(), delta, hit_rate: rate(delta) }
        })
        .collect();
    FleetHits { engines, total, hit_rate: rate(total) }
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
            vllm:external_prefix_cache_hits_total 7\n\
            vllm:prefix_cache_hits_created 1.7e9\n";
        assert_eq!(parse(page), Counters { hits: 25.0, queries: 39.0 });
        let run = over_run(&["a".into()], &[Counters { hits: 5.0, queries: 9.0 }], &[parse(page)]);
        assert_eq!(run.hit_rate, Some(20.0 / 30.0));
    }
}
