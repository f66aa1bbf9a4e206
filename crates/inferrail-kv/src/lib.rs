//! Names the KV-cache blocks of a prompt.
//!
//! An engine with prefix caching keeps the attention state of full blocks of
//! `block_size` tokens and finds them again by a hash that covers the block
//! and everything before it. This crate computes those names, so the router
//! and the simulator agree on what "the same prefix" means, and keeps the
//! approximate index of which replica holds which blocks, and the order in
//! which an engine's host memory tier evicts them.
#![forbid(unsafe_code)]

pub mod hash;
pub mod host;
pub mod index;
pub mod mode;
