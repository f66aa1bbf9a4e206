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

fn main() -> anyhow::Result<()> {
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
    // `server.threads` (ADR 0035): one thread by default, since on a few
    // cores shared with Envoy and engines a pool spends more waking its
    // workers than it gains.
    let runtime = match config.server.threads {
        1 => tokio::runtime::Builder::new_current_thread().enable_all().build()?,
        n => tokio::runtime::Builder::new_multi_thread().worker_threads(n).enable_all().build()?,
    };
    runtime.block_on(serve(args, config))
}

async fn serve(args: Args, config: Config) -> anyhow::Result<()> {
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
    running.wait().await?;
    Ok(())
}
