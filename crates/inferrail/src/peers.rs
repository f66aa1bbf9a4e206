//! Several routers, one ledger (ADR 0034): each router opens a `Peer/Share`
//! stream to every other router behind the same Envoys and tells it, in
//! order, every request it decided and everything it heard of them; the
//! peer mirrors those requests in its own ledger (their slots, queued
//! prefill and KV records), so each router counts the whole fleet's
//! requests in flight and predicts the caches from every router's
//! decisions. What a router hears of a request another decided (Envoy
//! balances each ext_proc stream on its own) goes to the decider, whose id
//! travels in the request's `inferrail` metadata; the decider applies it
//! and tells the rest. A request's outcome is counted once, where it was
//! decided. When a peer goes, its mirrors are forgotten: nobody is left to
//! tell their end.

//!
//! [`link`] holds this router's id and its streams to its peers; [`wire`]
//! turns decisions and lifecycle events into the messages peers exchange
//! and back; [`service`] applies what a peer says; [`dial`] keeps a stream
//! open to every peer the configuration names.

pub mod dial;
pub mod link;
pub mod service;
pub mod wire;
