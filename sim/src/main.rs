//! The `inferrail-sim` binary: parse flags, serve until SIGINT or SIGTERM.

use clap::Parser;
use inferrail_sim::Sim;
use inferrail_sim::args::Args;
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    // Logs go to stderr; stdout carries only the address line scripts read.
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    let args = Args::parse();
    let sim = Sim::start(args.clone()).await?;
    tracing::info!(addr = %sim.addr, model = %args.served_names().join(","), "inferrail-sim listening");
    println!("inferrail-sim listening on {}", sim.url());
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r?,
        _ = term.recv() => {}
    }
    sim.stop().await
}
