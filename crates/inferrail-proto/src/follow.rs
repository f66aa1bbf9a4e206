//! The router's side of the sidecar: follow its `Watch` stream into a
//! [`LoadTable`], reconnecting forever.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

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
/// arrives. A report is dated by its age when sent, counted back from its
/// receipt ([`convert::received_at`]). Losing the stream, and getting it
/// back, is logged once each.
pub async fn follow(endpoint: Endpoint, table: LoadTable) {
    let endpoint = endpoint
        .connect_timeout(Duration::from_secs(1))
        .http2_keep_alive_interval(Duration::from_secs(1))
        .keep_alive_timeout(Duration::from_secs(2))
        .keep_alive_while_idle(true);
    // Whether reports are coming: a change is logged once. True at the start,
    // so that a sidecar that is not there is reported.
    let flowing = AtomicBool::new(true);
    let ended = |received, why: &str, retry_in| {
        if flowing.swap(false, Ordering::Relaxed) {
            tracing::warn!(endpoint = %endpoint.uri(), %why, "no load reports from the sidecar; routing on the router's own counters until they come");
        }
        tracing::debug!(endpoint = %endpoint.uri(), received, %why, ?retry_in, "load stream ended");
    };
    reopening(|| watch_once(&endpoint, &table, &flowing), ended).await
}

/// Reopens a stream forever. `once` is one connection's worth of it: how
/// many messages arrived and why it ended; `ended` hears that and the wait
/// before the next attempt, 100 ms doubling to 2 s, back to 100 ms once a
/// message arrived.
pub async fn reopening<F, Fut>(mut once: F, ended: impl Fn(u64, &str, Duration)) -> !
where
    F: FnMut() -> Fut,
    Fut: Future<Output = (u64, String)>,
{
    let mut backoff = MIN_BACKOFF;
    loop {
        let (received, why) = once().await;
        if received > 0 {
            backoff = MIN_BACKOFF;
        }
        ended(received, &why, backoff);
        tokio::time::sleep(backoff).await;
        if received == 0 {
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }
}

/// One connection's worth of reports; how many arrived and why it ended.
async fn watch_once(endpoint: &Endpoint, table: &LoadTable, flowing: &AtomicBool) -> (u64, String) {
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
        if !flowing.swap(true, Ordering::Relaxed) {
            tracing::info!(endpoint = %endpoint.uri(), "load reports from the sidecar are coming");
        }
        match convert::outcome(&report) {
            Ok(Ok(load)) => {
                let at = convert::received_at(&report, Instant::now());
                table.insert(&report.replica, Snapshot { at, load });
            }
            // A failed scrape adds nothing; the replica's last snapshot ages out.
            Ok(Err(_)) => {}
            Err(e) => tracing::debug!(replica = %report.replica, error = %e, "unusable load report"),
        }
    }
}
