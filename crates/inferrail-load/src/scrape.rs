//! Scraping engines' `/metrics` pages on a fixed interval into a [`LoadTable`].
//!
//! Every target has its own task, and every scrape is bounded in time (the
//! whole request, body included) and in bytes (the body is read chunk by chunk
//! and dropped past the limit), so a dead, hung, slow, huge or endless page
//! only ever costs its own replica its freshness. Scrapes are counted in
//! `inferrail_scrapes_total{replica}` and timed in
//! `inferrail_scrape_seconds{replica}`; failures are counted in
//! `inferrail_scrape_errors_total{replica,reason}` and logged when a replica's
//! failure changes, not on every tick. Each outcome is also broadcast to
//! [`Scraper::subscribe`]rs (the sidecar streams them).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::broadcast;
use tokio::task::JoinHandle;

use crate::page::{self, PageError};
use crate::table::{LoadTable, Snapshot};

/// The counter of failed scrapes, labelled `replica` and `reason`.
pub const ERRORS_METRIC: &str = "inferrail_scrape_errors_total";
/// The counter of scrapes, failed or not, labelled `replica`.
pub const SCRAPES_METRIC: &str = "inferrail_scrapes_total";
/// How long each scrape took, body and parse included, labelled `replica`.
pub const SECONDS_METRIC: &str = "inferrail_scrape_seconds";

/// How often and how far to scrape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScrapeConfig {
    /// Time between the starts of two scrapes of one target.
    pub interval: Duration,
    /// Longest one scrape may take, body included.
    pub timeout: Duration,
    /// Largest body read; a longer page is a failure.
    pub max_bytes: usize,
}

impl From<&inferrail_config::Load> for ScrapeConfig {
    fn from(l: &inferrail_config::Load) -> Self {
        Self { interval: Duration::from_millis(l.interval_ms), timeout: Duration::from_millis(l.timeout_ms), max_bytes: l.max_bytes }
    }
}

impl Default for ScrapeConfig {
    /// The `load:` section's defaults.
    fn default() -> Self {
        Self::from(&inferrail_config::Load::default())
    }
}

/// Why one scrape produced no snapshot.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ScrapeError {
    /// The whole scrape took longer than the timeout.
    #[error("no complete page within {0:?}")]
    Timeout(Duration),
    /// The body was longer than the limit.
    #[error("page longer than {0} bytes")]
    TooLarge(usize),
    /// The connection failed or the status was not a success.
    #[error("http: {0}")]
    Http(String),
    /// The page was read but is not an engine's metrics page.
    #[error("unreadable page: {0}")]
    Unreadable(#[from] PageError),
}

impl ScrapeError {
    /// The `reason` label of [`ERRORS_METRIC`].
    pub fn reason(&self) -> &'static str {
        match self {
            ScrapeError::Timeout(_) => "timeout",
            ScrapeError::TooLarge(_) => "too_large",
            ScrapeError::Http(_) => "http",
            ScrapeError::Unreadable(_) => "unreadable",
        }
    }
}

/// The outcome of one scrape of one target.
#[derive(Debug, Clone, PartialEq)]
pub struct Scrape {
    /// The replica's id.
    pub id: Arc<str>,
    /// Where it was scraped.
    pub addr: SocketAddr,
    /// Wall-clock time the scrape completed (what crosses process boundaries).
    pub wall: SystemTime,
    /// The snapshot, or why there is none.
    pub outcome: Result<Snapshot, ScrapeError>,
}

/// One target's task.
struct Target {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

/// Scrapes a changing set of targets into a [`LoadTable`]; dropping it stops every task.
pub struct Scraper {
    config: ScrapeConfig,
    table: LoadTable,
    client: reqwest::Client,
    events: broadcast::Sender<Scrape>,
    targets: Mutex<HashMap<String, Target>>,
}

/// The scraper's HTTP client could not be built.
#[derive(Debug, thiserror::Error)]
#[error("building the HTTP client: {0}")]
pub struct ClientError(#[from] reqwest::Error);

impl Scraper {
    /// A scraper with no targets yet, filling `table`. Call within a tokio runtime.
    pub fn new(config: ScrapeConfig, table: LoadTable) -> Result<Self, ClientError> {
        let client = reqwest::Client::builder().no_proxy().connect_timeout(config.timeout).pool_max_idle_per_host(1).build()?;
        let (events, _) = broadcast::channel(1024);
        Ok(Self { config, table, client, events, targets: Mutex::new(HashMap::new()) })
    }

    /// The table the scraper fills.
    pub fn table(&self) -> &LoadTable {
        &self.table
    }

    /// Every scrape's outcome from now on. A receiver that falls behind loses the oldest.
    pub fn subscribe(&self) -> broadcast::Receiver<Scrape> {
        self.events.subscribe()
    }

    /// The channel outcomes are broadcast on (to serve them, or to inject them in tests).
    pub fn sender(&self) -> broadcast::Sender<Scrape> {
        self.events.clone()
    }

    /// Makes `targets` the set scraped: new ones start, gone ones stop and leave
    /// the table, ones whose address changed restart.
    pub fn set_targets(&self, targets: impl IntoIterator<Item = (String, SocketAddr)>) {
        let wanted: HashMap<String, SocketAddr> = targets.into_iter().collect();
        let mut current = self.targets.lock().unwrap_or_else(PoisonError::into_inner);
        current.retain(|id, t| {
            let keep = wanted.get(id) == Some(&t.addr);
            if !keep {
                t.task.abort();
                self.table.remove(id);
            }
            keep
        });
        for (id, addr) in wanted {
            if current.contains_key(&id) {
                continue;
            }
            // Parsed once, not on every scrape.
            let Ok(url) = reqwest::Url::parse(&format!("http://{addr}/metrics")) else {
                tracing::error!(replica = %id, %addr, "no metrics URL for this address; not scraped");
                continue;
            };
            let worker = Worker {
                id: Arc::from(id.as_str()),
                addr,
                url,
                config: self.config,
                client: self.client.clone(),
                table: self.table.clone(),
                events: self.events.clone(),
            };
            current.insert(id, Target { addr, task: tokio::spawn(worker.run()) });
        }
    }
}

impl Drop for Scraper {
    fn drop(&mut self) {
        let targets = self.targets.get_mut().unwrap_or_else(PoisonError::into_inner);
        for t in targets.values() {
            t.task.abort();
        }
    }
}

/// Scrapes one target forever.
struct Worker {
    id: Arc<str>,
    addr: SocketAddr,
    url: reqwest::Url,
    config: ScrapeConfig,
    client: reqwest::Client,
    table: LoadTable,
    events: broadcast::Sender<Scrape>,
}

impl Worker {
    async fn run(self) {
        let mut tick = tokio::time::interval(self.config.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The failure last logged, so that a lasting one is logged once.
        let mut last_failure: Option<ScrapeError> = None;
        loop {
            tick.tick().await;
            let started = Instant::now();
            let outcome = match tokio::time::timeout(self.config.timeout, self.fetch()).await {
                Ok(Ok(body)) => page::parse(&body).map_err(ScrapeError::from),
                Ok(Err(e)) => Err(e),
                Err(_) => Err(ScrapeError::Timeout(self.config.timeout)),
            };
            metrics::counter!(SCRAPES_METRIC, "replica" => self.id.to_string()).increment(1);
            metrics::histogram!(SECONDS_METRIC, "replica" => self.id.to_string()).record(started.elapsed().as_secs_f64());
            let outcome = outcome.map(|load| Snapshot { at: Instant::now(), load });
            match &outcome {
                Ok(snapshot) => {
                    self.table.insert(&self.id, snapshot.clone());
                    if last_failure.take().is_some() {
                        tracing::info!(replica = %self.id, addr = %self.addr, "metrics scrape recovered");
                    }
                }
                Err(e) => {
                    let reason = e.reason();
                    metrics::counter!(ERRORS_METRIC, "replica" => self.id.to_string(), "reason" => reason).increment(1);
                    if last_failure.as_ref() != Some(e) {
                        tracing::warn!(replica = %self.id, addr = %self.addr, reason, error = %e, "metrics scrape failed");
                        last_failure = Some(e.clone());
                    }
                }
            }
            // An error only means nobody is listening; the table has the snapshot.
            self.events.send(Scrape { id: self.id.clone(), addr: self.addr, wall: SystemTime::now(), outcome }).ok();
        }
    }

    /// GETs the page, reading at most `max_bytes` of body.
    async fn fetch(&self) -> Result<String, ScrapeError> {
        let http = |e: reqwest::Error| ScrapeError::Http(e.without_url().to_string());
        let mut response = self.client.get(self.url.clone()).send().await.map_err(http)?;
        let status = response.status();
        if !status.is_success() {
            return Err(ScrapeError::Http(format!("status {}", status.as_u16())));
        }
        let limit = self.config.max_bytes;
        if response.content_length().is_some_and(|n| n > limit as u64) {
            return Err(ScrapeError::TooLarge(limit));
        }
        let mut body = Vec::with_capacity(response.content_length().map_or(64 << 10, |n| n as usize));
        while let Some(chunk) = response.chunk().await.map_err(http)? {
            if body.len() + chunk.len() > limit {
                return Err(ScrapeError::TooLarge(limit));
            }
            body.extend_from_slice(&chunk);
        }
        String::from_utf8(body).map_err(|_| ScrapeError::Unreadable(PageError::NotUtf8))
    }
}
