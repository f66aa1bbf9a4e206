//! Reloads the routing YAML when the file changes or on SIGHUP.
//!
//! The file's bytes are read every second and compared with the last ones
//! read, not its modification time: a ConfigMap mount updates by swapping
//! a symlink, which leaves the old file's time as it was. A new file is
//! validated first ([`Config::load`]), then applied as one swap
//! ([`Router::reload`]); an invalid or refused one changes nothing, and the
//! log and `inferrail_config_reloads_total{result}` say why.

use std::sync::Arc;
use std::time::Duration;

use inferrail_config::Config;

use crate::router::Router;

/// Watches `path` and applies each new version of it, forever.
pub async fn run(router: Arc<Router>, path: String) {
    let mut hangup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(error = %e, "no SIGHUP handler; the file is still watched");
            None
        }
    };
    let mut last = std::fs::read(&path).ok();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let asked = tokio::select! {
            _ = tick.tick() => false,
            Some(()) = async { hangup.as_mut()?.recv().await } => true,
        };
        let now = std::fs::read(&path).ok();
        if !asked && now == last {
            continue;
        }
        last = now;
        apply(&router, &path);
    }
}

/// Loads `path` and applies it; returns what the metric's `result` label says.
pub fn apply(router: &Router, path: &str) -> &'static str {
    let result = match Config::load(path) {
        Err(e) => {
            tracing::warn!(path, error = %e, "reload refused: the file is invalid; the running configuration stays");
            "invalid"
        }
        Ok(config) => match router.reload(config) {
            Ok(done) => {
                tracing::info!(
                    path,
                    models = done.models,
                    kept = done.kept,
                    joined = done.joined,
                    left = done.left,
                    "configuration reloaded"
                );
                "ok"
            }
            Err(why) => {
                tracing::warn!(path, reason = %why, "reload refused; the running configuration stays");
                "refused"
            }
        },
    };
    metrics::counter!("inferrail_config_reloads_total", "result" => result).increment(1);
    metrics::gauge!("inferrail_config_last_reload_ok").set(if result == "ok" { 1.0 } else { 0.0 });
    result
}

#[cfg(test)]
mod tests;
