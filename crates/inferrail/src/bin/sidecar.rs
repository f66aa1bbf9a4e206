//! `inferrail-sidecar`: runs split requests' prefill legs in front of one
//! decode engine (see `inferrail::sidecar`).

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;

/// Runs a split request's prefill leg in front of a decode engine, as llm-d's sidecar does.
#[derive(Debug, Parser)]
#[command(name = "inferrail-sidecar", version)]
struct Args {
    /// Where Envoy reaches it: the address the router lists for the decoder.
    #[arg(long, default_value = "127.0.0.1:8000")]
    listen: SocketAddr,
    /// The decode engine's base URL.
    #[arg(long)]
    decoder: String,
    /// How long each try of the prefill replica may take, milliseconds.
    #[arg(long, default_value_t = 30_000)]
    prefill_timeout_ms: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .init();
    let a = Args::parse();
    inferrail::sidecar::run(a.listen, a.decoder, Duration::from_millis(a.prefill_timeout_ms)).await
}
