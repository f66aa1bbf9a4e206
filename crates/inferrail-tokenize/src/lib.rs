//! Turns a request's prompt into the token ids an engine will see.
//!
//! The router can only predict what an engine has cached if it cuts a prompt
//! into exactly the engine's tokens. Today this crate holds `builtin:sim`, the
//! tokenizer and chat format of `inferrail-sim`, so a router configured with it
//! tokenizes exactly as its simulators do. Hugging Face tokenizers and chat
//! templates join it behind the same plain functions.
#![forbid(unsafe_code)]

pub mod sim;
