//! `inferrail-engine`: the model of one vLLM engine that both the HTTP
//! simulator (`inferrail-sim`) and the fleet simulation (`inferrail-fleet`)
//! run: [`cost`] says how long a step takes, [`cache`] is the KV block
//! pool with its prefix cache and LRU eviction. No I/O and no clock: the
//! callers bring the time.
#![forbid(unsafe_code)]

pub mod cache;
pub mod cost;
