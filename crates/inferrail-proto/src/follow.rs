//! The router's side of the sidecar: follow its `Watch` stream into a
//! [`LoadTable`], reconnecting forever.

use std::time::{Duration, Instant, SystemTime};

use inferrail_load::{LoadTable, Snapshot};
use tonic::transport::Endpoint;

use crate::convert;
use crate::load::v1::WatchRequest;
use crate::load::v1::load_reports_client::LoadReportsClient;

/// First wait before reconnecting; it doubles after each failed attempt.
pub const MIN_BACKOFF: Duration = Duration::from_millis(100);
/// Longest wait before reconnecting.
pub const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// Fills `table` with the snapshots the sidecar at `endpoint` streams; never
/// returns (spawn it, abort it to stop). When the stream ends or fails, it
/// reconnects after a backoff of 100 ms doubling to 2 s, reset once a report
/// arrives. A report's scrape time is wall-clock; it becomes a local instant as
/// `now - (now_unix - scraped_unix)`.
pub async fn follow(endpoint: Endpoint, table: LoadTable) {
    let endpoint = endpoint
        .connect_timeout(Duration::from_secs(1))
        .http2_keep_alive_interval(Duration::from_secs(1))
        .keep_alive_timeout(Duration::from_secs(2))
        .keep_alive_while_idle(true);
    let mut backoff = MIN_BACKOFF;
    loop {
        let (received, why) = watch_once(&endpoint, &table).await;
        if received > 0 {
            backoff = MIN_BACKOFF;
        }
        tracing::debug!(endpoint = %endpoint.uri(), received, %why, retry_in = ?backoff, "load stream ended");
        tokio::time::sleep(backoff).await;
        if received == 0 {
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }
}

/// One connection's worth of reports; how many arrived and why it ended.
async fn watch_once(endpoint: &Endpoint, table: &LoadTable) -> (u64, String) {
    let channel = match endpoint.connect().await {
        Ok(c) => c,
        Err(e) => return (0, format!("connect: {e}")),
    };
    let mut stream = match LoadReportsClient::new(channel).watch(WatchRequest::default()).await {
        Ok(r) => r.into_inner(),
        Err(status) => return (0, format!("watch: {status}")),
    };
    let mut received = 0;
    loop {
        let report = match stream.message().await {
            Ok(Some(r)) => r,
            Ok(None) => return (received, "closed by the sidecar".into()),
            Err(status) => return (received, format!("stream: {status}")),
        };
        received += 1;
        match convert::outcome(&report) {
            Ok(Ok(load)) => {
                let at = convert::instant_of(report.scraped_unix_ms, Instant::now(), SystemTime::now());
                table.insert(&report.replica, Snapshot { at, load });
            }
            // A failed scrape adds nothing; the replica's last snapshot ages out.
            Ok(Err(_)) => {}
            Err(e) => tracing::debug!(replica = %report.replica, error = %e, "unusable load report"),
        }
    }
}
