//! The `inferrail-scraper` sidecar: scrapes every replica's `/metrics` page
//! every 100 ms and streams each outcome to every watcher over gRPC
//! (`inferrail.load.v1.LoadReports/Watch`). The router follows that stream.
//! Its targets are the replicas it is given, and with `--router` the
//! router's own fleet as it changes ([`fleet`]). With `--metrics-listen` it
//! serves its own `/metrics` for Prometheus: scrapes, their time and their
//! failures per replica.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Parser;
use inferrail_config::Load;
use inferrail_load::{LoadTable, ScrapeConfig, Scraper};
use inferrail_proto::LoadReportsService;
use tracing_subscriber::EnvFilter;

mod fleet;

/// Scrapes engine metrics and streams load snapshots to the router.
#[derive(Debug, Parser)]
#[command(name = "inferrail-scraper", version)]
struct Args {
    /// A replica to scrape, `id=ip:port` (repeatable).
    #[arg(long = "replica", value_parser = parse_replica)]
    replicas: Vec<(String, SocketAddr)>,
    /// The router's YAML configuration; only its `replicas:` (id, address) are read.
    #[arg(long)]
    config: Option<PathBuf>,
    /// The router's admin gRPC listener (e.g. `http://127.0.0.1:9091`): its
    /// replicas, discovered ones included, are scraped too, as they change.
    #[arg(long)]
    router: Option<String>,
    /// Address the gRPC service listens on (port 0 picks a free one and prints it).
    #[arg(long, default_value = "127.0.0.1:9095")]
    listen: SocketAddr,
    /// Address of its own Prometheus `/metrics` page (none when unset).
    #[arg(long)]
    metrics_listen: Option<SocketAddr>,
    /// Time between two scrapes of a replica, milliseconds.
    #[arg(long, default_value_t = Load::default().interval_ms)]
    interval_ms: u64,
    /// Longest one scrape may take, body included, milliseconds.
    #[arg(long, default_value_t = Load::default().timeout_ms)]
    timeout_ms: u64,
    /// Largest metrics page read, bytes.
    #[arg(long, default_value_t = Load::default().max_bytes)]
    max_bytes: usize,
}

fn parse_replica(s: &str) -> Result<(String, SocketAddr), String> {
    let (id, addr) = s.split_once('=').ok_or("expected id=ip:port")?;
    let addr = addr.parse().map_err(|e| format!("{addr:?}: {e}"))?;
    if id.is_empty() {
        return Err("empty replica id".into());
    }
    Ok((id.to_string(), addr))
}

/// The part of the router's configuration the sidecar reads.
#[derive(Debug, serde::Deserialize)]
struct RouterConfig {
    #[serde(default)]
    replicas: Vec<ConfigReplica>,
}

#[derive(Debug, serde::Deserialize)]
struct ConfigReplica {
    id: String,
    address: SocketAddr,
}

fn replicas(args: &Args) -> anyhow::Result<Vec<(String, SocketAddr)>> {
    let mut all = args.replicas.clone();
    if let Some(path) = &args.config {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let config: RouterConfig = serde_yaml::from_str(&text).with_context(|| format!("reading replicas from {}", path.display()))?;
        all.extend(config.replicas.into_iter().map(|r| (r.id, r.address)));
    }
    if all.is_empty() && args.router.is_none() {
        bail!("no replicas: pass --replica id=ip:port, --config or --router");
    }
    let mut ids: Vec<&str> = all.iter().map(|(id, _)| id.as_str()).collect();
    ids.sort_unstable();
    if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
        bail!("replica {} is listed twice", w[0]);
    }
    Ok(all)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    // Logs go to stderr; stdout carries only the address line scripts read.
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    let args = Args::parse();
    let targets = replicas(&args)?;
    if let Some(addr) = args.metrics_listen {
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .with_http_listener(addr)
            .install()
            .with_context(|| format!("serving /metrics on {addr}"))?;
    }
    let load = Load { interval_ms: args.interval_ms, timeout_ms: args.timeout_ms, max_bytes: args.max_bytes, ..Load::default() };
    let config = ScrapeConfig::from(&load);
    let scraper = std::sync::Arc::new(Scraper::new(config, LoadTable::new())?);
    let count = targets.len();
    scraper.set_targets(targets.clone());
    if let Some(router) = &args.router {
        let endpoint = tonic::transport::Endpoint::from_shared(router.clone()).with_context(|| format!("--router {router}"))?;
        let scraper = scraper.clone();
        tokio::spawn(async move { fleet::follow(endpoint, &scraper, &targets).await });
    }

    let listener = tokio::net::TcpListener::bind(args.listen).await.with_context(|| format!("binding {}", args.listen))?;
    let addr = listener.local_addr()?;
    tracing::info!(%addr, replicas = count, "inferrail-scraper listening");
    println!("inferrail-scraper listening on {addr}");
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    // Reflection (both versions; grpcurl before 1.9 speaks only v1alpha), so
    // `grpcurl -plaintext <listen> list` works without the proto.
    let reflection =
        || tonic_reflection::server::Builder::configure().register_encoded_file_descriptor_set(inferrail_proto::LOAD_DESCRIPTORS);
    let server = tonic::transport::Server::builder()
        .add_service(LoadReportsService::new(scraper.sender()).into_server())
        .add_service(reflection().build_v1()?)
        .add_service(reflection().build_v1alpha()?)
        .serve_with_incoming_shutdown(tokio_stream::wrappers::TcpListenerStream::new(listener), async {
            stopped.await.ok();
        });
    tokio::pin!(server);
    tokio::select! {
        r = &mut server => return Ok(r?),
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tracing::info!("shutting down");
    stop.send(()).ok();
    // Watch streams never end by themselves: give them a moment, then leave.
    if let Ok(r) = tokio::time::timeout(Duration::from_millis(500), server).await {
        r?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replicas_come_from_flags_and_the_router_config() {
        let dir = std::env::temp_dir().join(format!("inferrail-scraper-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("router.yaml");
        let yaml = "server: {listen: 127.0.0.1:9002}\nreplicas:\n  - {id: a, address: 127.0.0.1:8001, models: [m]}\n";
        std::fs::write(&path, yaml).unwrap();
        let args = Args::parse_from(["x", "--replica", "b=127.0.0.1:8002", "--config", path.to_str().unwrap()]);
        let ids: Vec<String> = replicas(&args).unwrap().into_iter().map(|(id, a)| format!("{id}={a}")).collect();
        assert_eq!(ids, ["b=127.0.0.1:8002", "a=127.0.0.1:8001"]);
        let twice = Args::parse_from(["x", "--replica", "a=127.0.0.1:1", "--config", path.to_str().unwrap()]);
        assert!(replicas(&twice).is_err());
        assert!(replicas(&Args::parse_from(["x"])).is_err());
        assert!(parse_replica("127.0.0.1:1").is_err() && parse_replica("=127.0.0.1:1").is_err());
        std::fs::remove_dir_all(&dir).ok();
    }
}
