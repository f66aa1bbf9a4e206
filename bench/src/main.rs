//! `inferrail-bench`: load generators that measure the simulator and, later,
//! the router end to end. Results are written as JSON, to be committed with
//! the commit that produced them.

mod compare;
mod cpu;
mod engines;
mod fleet;
mod harness;
mod noop;
mod overhead;
mod processes;
mod report;
mod run;
mod sim_load;
mod summary;
mod writeup;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "inferrail-bench", version, about = "Benchmarks for inferrail and inferrail-sim")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Open many streams at once against one engine; every one must finish.
    Streams(sim_load::StreamsArgs),
    /// Closed-loop requests per second against one engine.
    Throughput(sim_load::ThroughputArgs),
    /// The overhead ladder: latency and CPU per request added by Envoy, a no-op ext_proc processor, inferrail and SGLang's router.
    Overhead(overhead::OverheadArgs),
    /// An ext_proc processor that answers CONTINUE to everything: the ladder's no-op rung.
    NoopExtproc(noop::NoopArgs),
    /// One workload, open loop, streaming, summarized against an SLO.
    Run(run::RunArgs),
    /// Every policy and SGLang's router on the same requests, each on a cold fleet.
    Compare(Box<compare::CompareArgs>),
    /// The Markdown report with PNG charts, from the committed results.
    Report(writeup::ReportArgs),
    /// The router's decision core over simulated replicas on a virtual clock; capacity at the SLO.
    Fleet(fleet::FleetArgs),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Streams(args) => sim_load::streams(args).await,
        Command::Throughput(args) => sim_load::throughput(args).await,
        Command::Overhead(args) => overhead::overhead(args).await,
        Command::NoopExtproc(args) => noop::noop_extproc(args).await,
        Command::Run(args) => run::run(args).await,
        Command::Compare(args) => compare::compare(*args).await,
        Command::Fleet(args) => fleet::fleet(args),
        Command::Report(args) => writeup::report(args),
    }
}
