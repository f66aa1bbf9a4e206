//! The `inferrail` binary: load the routing YAML, then serve ext_proc until
//! SIGTERM or SIGINT, reloading the file when it changes or on SIGHUP;
//! `--check` only validates the file.

use clap::Parser;
use inferrail_config::Config;
use tracing_subscriber::EnvFilter;

/// KV-cache-aware routing for LLM replicas behind Envoy.
#[derive(Debug, Parser)]
#[command(name = "inferrail", version)]
struct Args {
    /// The routing configuration (YAML).
    #[arg(long)]
    config: String,
    /// Validate the configuration, report every problem, and exit.
    #[arg(long)]
    check: bool,
}

// One worker thread per core: a long prompt's KV record (a millisecond or
// more for 40,000 tokens) holds one worker while the others keep reading
// and answering Envoy's streams.
#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let config = match Config::load(&args.config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{}: {e}", args.config);
            std::process::exit(2);
        }
    };
    if args.check {
        println!(
            "{}: ok ({} models, {} replicas, {} discovery groups)",
            args.config,
            config.models.len(),
            config.replicas.len(),
            config.discovery.len()
        );
        return Ok(());
    }
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    let running = inferrail::service::start(config, async {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(t) => t,
            Err(e) => {
                tracing::error!(error = %e, "no SIGTERM handler; stop with SIGINT");
                let _ = tokio::signal::ctrl_c().await;
                return;
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    })
    .await?;
    tracing::info!(grpc = %running.grpc, admin = %running.admin, "inferrail serving");
    tokio::spawn(inferrail::reload::run(running.router.clone(), args.config.clone()));
    println!("inferrail ext_proc on {}, admin on http://{}", running.grpc, running.admin);
    running.wait().await
}
