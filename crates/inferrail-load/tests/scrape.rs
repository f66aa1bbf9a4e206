//! The scraper against real HTTP servers: misbehaving targets never delay a
//! healthy one, and a real simulator is read correctly.

mod common;

use std::time::{Duration, Instant};

use common::Behaviour;
use inferrail_load::{Engine, LoadTable, ScrapeConfig, Scraper};

/// Whether `id`'s snapshot is renewed `times` times (each newer than the
/// last seen) within `limit`: the scraper keeps reading it.
async fn renewed(table: &LoadTable, id: &str, times: usize, limit: Duration) -> bool {
    let mut last = None;
    for _ in 0..times {
        let newer = |t: &LoadTable| t.get(id).is_some_and(|s| last.is_none_or(|l| s.at > l));
        if !eventually(limit, || newer(table)).await {
            return false;
        }
        last = table.get(id).map(|s| s.at);
    }
    true
}

/// Polls until `ok` holds, for at most `limit`.
async fn eventually(limit: Duration, mut ok: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if ok() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_targets_never_delay_a_healthy_one() {
    common::record_metrics();
    let healthy = common::serve(Behaviour::Healthy).await;
    let hang = common::serve(Behaviour::Hang).await;
    let huge = common::serve(Behaviour::Huge(50 << 20)).await;
    let endless = common::serve(Behaviour::Endless).await;
    // A minute's timeout: the hung target's first read is still pending
    // while the healthy one is read again and again, which could not happen
    // if reads waited for one another.
    let patient = ScrapeConfig { timeout: Duration::from_secs(60), ..ScrapeConfig::default() };
    let table = LoadTable::new();
    let scraper = Scraper::new(patient, table.clone()).unwrap();
    scraper.set_targets([
        ("ok".to_string(), healthy),
        ("hang".to_string(), hang),
        ("huge".to_string(), huge),
        ("endless".to_string(), endless),
    ]);
    assert!(renewed(&table, "ok", 10, Duration::from_secs(10)).await, "the healthy target is not read again and again");
    let snap = table.get("ok").expect("the healthy target has a snapshot");
    assert_eq!((snap.load.engine, snap.load.running), (Engine::Vllm, 4));
    assert!(common::scrape_errors("hang").is_empty() && table.get("hang").is_none(), "the hung read is still pending");
    assert!(eventually(Duration::from_secs(10), || !common::scrape_errors("endless").is_empty()).await);
    drop(scraper);
    // With the default timeout, the hung target's reads fail as timeouts.
    let scraper = Scraper::new(ScrapeConfig::default(), table.clone()).unwrap();
    scraper.set_targets([("hang".to_string(), hang)]);
    assert!(eventually(Duration::from_secs(10), || !common::scrape_errors("hang").is_empty()).await);
    for bad in ["hang", "huge", "endless"] {
        assert_eq!(table.get(bad), None, "{bad} has a snapshot");
        let errors = common::scrape_errors(bad);
        assert!(!errors.is_empty(), "{bad}: no scrape error counted");
        for (reason, n) in &errors {
            assert!(*n > 0 && ["timeout", "too_large"].contains(&reason.as_str()), "{bad}: {errors:?}");
        }
    }
    assert_eq!(common::scrape_errors("hang").iter().map(|e| e.0.as_str()).collect::<Vec<_>>(), ["timeout"]);
    assert_eq!(common::scrape_errors("huge").iter().map(|e| e.0.as_str()).collect::<Vec<_>>(), ["too_large"]);
    assert!(common::scrape_errors("ok").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_past_the_limit_is_dropped_while_it_streams() {
    common::record_metrics();
    let addr = common::serve(Behaviour::ChunkedHuge(4 << 20)).await;
    let config = ScrapeConfig { timeout: Duration::from_secs(5), max_bytes: 64 << 10, ..ScrapeConfig::default() };
    let scraper = Scraper::new(config, LoadTable::new()).unwrap();
    let mut events = scraper.subscribe();
    scraper.set_targets([("chunked".to_string(), addr)]);
    let scrape = tokio::time::timeout(Duration::from_secs(10), events.recv()).await.unwrap().unwrap();
    assert_eq!(scrape.outcome.unwrap_err().reason(), "too_large");
    assert!(eventually(Duration::from_secs(2), || !common::scrape_errors("chunked").is_empty()).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_that_is_not_metrics_is_unreadable_and_a_dead_port_is_http() {
    common::record_metrics();
    let html = common::serve(Behaviour::Html).await;
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let table = LoadTable::new();
    let scraper = Scraper::new(ScrapeConfig::default(), table.clone()).unwrap();
    scraper.set_targets([("html".to_string(), html), ("dead".to_string(), dead)]);
    let counted = |id: &str, reason: &str| common::scrape_errors(id).iter().any(|(r, n)| r == reason && *n > 0);
    assert!(eventually(Duration::from_secs(3), || counted("html", "unreadable") && counted("dead", "http")).await);
    assert_eq!((table.get("html"), table.get("dead")), (None, None));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn targets_come_and_go() {
    let a = common::serve(Behaviour::Healthy).await;
    let b = common::serve(Behaviour::Healthy).await;
    let table = LoadTable::new();
    let scraper = Scraper::new(ScrapeConfig::default(), table.clone()).unwrap();
    scraper.set_targets([("a".to_string(), a)]);
    assert!(eventually(Duration::from_secs(3), || table.get("a").is_some()).await);
    scraper.set_targets([("b".to_string(), b)]);
    assert_eq!(table.get("a"), None, "a removed target leaves the table");
    // While b is read again and again, a never comes back.
    assert!(renewed(&table, "b", 3, Duration::from_secs(3)).await);
    assert_eq!(table.get("a"), None, "a removed target is no longer scraped");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_simulator_is_scraped_fresh() {
    let (_sim, addr) = common::start_sim();
    let table = LoadTable::new();
    let scraper = Scraper::new(ScrapeConfig::default(), table.clone()).unwrap();
    scraper.set_targets([("sim".to_string(), addr)]);
    assert!(renewed(&table, "sim", 5, Duration::from_secs(5)).await, "the simulator is not read again and again");
    let load = table.get("sim").unwrap().load;
    assert_eq!((load.engine, load.running, load.waiting), (Engine::Vllm, 0, 0));
    assert_eq!(load.cache.map(|c| c.block_size), Some(32));
    assert!(load.prefix_queries.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_simulator_under_load_is_reported_fresh_with_its_load() {
    // The default latency model: 48 streams of 100 tokens at 20 ms a token keep it busy for seconds.
    let (_sim, addr) = common::start_sim_with(&["--max-num-seqs", "32"]);
    let table = LoadTable::new();
    let scraper = Scraper::new(ScrapeConfig::default(), table.clone()).unwrap();
    scraper.set_targets([("sim".to_string(), addr)]);
    let http = reqwest::Client::new();
    let mut streams = Vec::new();
    for i in 0..48 {
        let body = format!(r#"{{"model": "tiny-qwen3", "prompt": "load {i}", "max_tokens": 100, "stream": true}}"#);
        let req = http.post(format!("http://{addr}/v1/completions")).header("content-type", "application/json").body(body);
        // Read to the end: a dropped response would cancel the request.
        streams.push(tokio::spawn(async move { req.send().await?.bytes().await }));
    }
    let busy = || table.get("sim").is_some_and(|s| s.load.running == 32 && s.load.waiting == 16);
    assert!(eventually(Duration::from_secs(5), busy).await, "the report shows 32 running and 16 waiting");
    // While the engine streams, its page keeps being read.
    assert!(renewed(&table, "sim", 5, Duration::from_secs(5)).await, "the busy simulator is not read again and again");
    assert!(table.get("sim").is_some_and(|s| s.load.running > 0), "still busy while renewed");
    for s in streams {
        s.abort();
    }
}
