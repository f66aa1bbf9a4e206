//! `inferrail-fleet`: the router's own decision core over simulated
//! replicas, on a virtual clock, to see what happens beyond one machine.
//!
//! [`traffic`] turns the workloads (`inferrail-workload`) into token ids;
//! [`setup`] is the fleet's shape; [`sim`] runs the discrete-event
//! simulation: the route crate's `Core`, `Ledger` and lifecycle, unchanged,
//! over engines with the simulator's latency model and prefix cache
//! (`inferrail-engine`); [`outcome`] is what one run measured; [`capacity`]
//! searches for the highest rate a policy serves within the TTFT SLO and
//! the replicas it needs for a fixed rate; [`timescale`] scales the engines
//! and the router's costs together; [`latency`] summarizes samples.
#![forbid(unsafe_code)]

pub mod capacity;
pub mod latency;
pub mod outcome;
pub mod setup;
pub mod sim;
pub mod timescale;
pub mod traffic;

pub use outcome::line;
pub use traffic::default_kv_blocks;

#[cfg(test)]
mod tests;
