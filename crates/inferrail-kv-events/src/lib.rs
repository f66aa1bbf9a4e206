//! vLLM's KV cache events, shared by the engine side and the router side.
//!
//! vLLM publishes every block its prefix cache stores or evicts over ZMQ as
//! msgpack; a router that reads them knows exactly what each engine holds.
//! This crate is that protocol and nothing more: [`wire`] is the message
//! format of vLLM 0.32.0, byte for byte; [`publish`] is an engine's publisher
//! (used by `inferrail-sim`), with vLLM's bind-or-connect rule, sequence
//! numbers and replay service; [`subscribe`] is the consumer's socket and
//! replay client (used by the router, which builds gap detection and its
//! index on top).
//!
//! Reading order: [`wire`], [`endpoint`], [`publish`], [`subscribe`].
#![forbid(unsafe_code)]

pub mod endpoint;
pub mod publish;
pub mod subscribe;
pub mod wire;

pub use endpoint::{EndpointError, engine_binds};
pub use publish::{PublishError, PublishStats, Publisher, PublisherConfig, Skip, SkipParseError};
pub use subscribe::{ReplayError, SubscribeError, Subscriber, SubscriberConfig, replay};
pub use wire::{BlockRemoved, BlockStored, EventBatch, ExtraKey, KvEvent, REPLAY_END_SEQ, WireError, decode, encode, parse_message};
