//! Engine load as the engines themselves report it: their Prometheus
//! `/metrics` pages (vLLM or SGLang) read into [`EngineLoad`], scraped on a
//! short interval by [`Scraper`] into a [`LoadTable`] of timestamped
//! [`Snapshot`]s. Shared by the `inferrail-scraper` sidecar, which scrapes,
//! and the router, which reads the table (filled by the sidecar's stream or by
//! an in-process scraper) and ignores snapshots that have grown stale.
//!
//! Reading order: [`page`] (one page to one load), [`table`], [`scrape`].
#![forbid(unsafe_code)]

pub mod page;
pub mod scrape;
pub mod table;

pub use page::{CacheInfo, Engine, EngineLoad, LoraReport, PageError, parse};
pub use scrape::{ClientError, ERRORS_METRIC, Scrape, ScrapeConfig, ScrapeError, Scraper};
pub use table::{LoadTable, Snapshot};
