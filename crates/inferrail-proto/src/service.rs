//! The sidecar's `LoadReports` service: every scrape's outcome, streamed to
//! every watcher as it happens.

use std::pin::Pin;
use std::time::Instant;

use inferrail_load::Scrape;
use tokio::sync::broadcast;
use tokio_stream::wrappers::BroadcastStream;
use tokio_stream::wrappers::errors::BroadcastStreamRecvError;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};

use crate::convert;
use crate::load::v1::load_reports_server::{LoadReports, LoadReportsServer};
use crate::load::v1::{LoadReport, WatchRequest};

/// Streams the scrapes sent on a broadcast channel (`Scraper::sender`).
#[derive(Debug, Clone)]
pub struct LoadReportsService {
    scrapes: broadcast::Sender<Scrape>,
}

impl LoadReportsService {
    /// A service streaming what is sent on `scrapes`.
    pub fn new(scrapes: broadcast::Sender<Scrape>) -> Self {
        Self { scrapes }
    }

    /// The service ready to add to a tonic server.
    pub fn into_server(self) -> LoadReportsServer<Self> {
        LoadReportsServer::new(self)
    }
}

type ReportStream = Pin<Box<dyn Stream<Item = Result<LoadReport, Status>> + Send>>;

#[tonic::async_trait]
impl LoadReports for LoadReportsService {
    type WatchStream = ReportStream;

    async fn watch(&self, request: Request<WatchRequest>) -> Result<Response<ReportStream>, Status> {
        let only = request.into_inner().replicas;
        let stream = BroadcastStream::new(self.scrapes.subscribe()).filter_map(move |item| match item {
            Ok(scrape) if only.is_empty() || only.iter().any(|id| **id == *scrape.id) => Some(Ok(convert::report(&scrape, Instant::now()))),
            Ok(_) => None,
            Err(BroadcastStreamRecvError::Lagged(n)) => {
                // A slow watcher misses old reports; newer ones follow at once.
                tracing::debug!(missed = n, "load watcher fell behind");
                None
            }
        });
        Ok(Response::new(Box::pin(stream)))
    }
}
