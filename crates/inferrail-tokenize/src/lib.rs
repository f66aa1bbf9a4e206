//! Turns a request's prompt into the token ids an engine will see.
//!
//! The router can only predict what an engine has cached if it cuts a prompt
//! into exactly the engine's tokens. A [`Tokenizer`] loads a model's Hugging
//! Face tokenizer files (or `builtin:sim`, the simulator's own); [`template`]
//! renders chat templates as transformers does; [`chat`] prepares an OpenAI
//! request's prompt the way vLLM 0.32.0 does before it encodes it.
#![forbid(unsafe_code)]

pub mod chat;
pub mod python;
pub mod sim;
pub mod template;
pub mod tokenizer;

pub use tokenizer::{LoadError, Tokenizer};
