//! `inferrail`: the Envoy ext_proc service that picks a replica for each
//! OpenAI-compatible request.
//!
//! To follow one request: [`extproc`] receives Envoy's messages and asks
//! [`router`] for a decision once the body is in; the router reads the body
//! through [`request`], tokenizes its prompt in [`prompt`] (crate
//! `inferrail-tokenize`), predicts each candidate's cached prefix in [`kv`]
//! (crate `inferrail-kv`), ranks the model's eligible replicas of the
//! [`fleet`] with the model's policy (crate `inferrail-policy`) and leases
//! the winner;
//! [`reply`] turns the decision into headers and dynamic metadata for Envoy.
//! The route stream's closing, in [`extproc`], ends the lease; the observe
//! filter's stream reports the upstream status, retries and first byte. [`health`] probes replicas and ejects failing
//! ones; [`discovery`] keeps DNS groups' members current; [`admin`] serves
//! metrics and health; [`service`] wires it together.
#![forbid(unsafe_code)]

pub mod admin;
pub mod discovery;
pub mod extproc;
pub mod fleet;
pub mod health;
pub mod kv;
pub mod prompt;
pub mod reply;
pub mod request;
pub mod router;
pub mod service;
