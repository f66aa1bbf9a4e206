//! `inferrail-calibrate`: fits the router's prefill cost model to a real engine.
//!
//! The router estimates how long a replica takes to prefill `u` uncached
//! tokens after `c` cached ones as `a*u + b*u*(c + u/2) + d` seconds. This
//! crate measures an idle vLLM (or the simulator) and finds `a`, `b` and `d`.
//! Reading order: [`plan`] lays out probe prompts of known cached and
//! uncached lengths from fresh seeded tokens; [`engine`] talks to the engine
//! over HTTP and [`scrape`] reads its metrics page; [`run`] sends the probes
//! one at a time and times each by the engine's own histograms; [`fit`]
//! solves for the parameters with the non-negative least squares of [`nnls`];
//! [`report`] prints the probes, the fit and the config fragment. The binary
//! only parses flags and wires these together.
#![forbid(unsafe_code)]

pub mod engine;
pub mod fit;
pub mod nnls;
pub mod plan;
pub mod report;
pub mod run;
pub mod scrape;
