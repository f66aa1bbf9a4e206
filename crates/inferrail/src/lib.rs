//! `inferrail`: the Envoy ext_proc service that picks a replica for each
//! OpenAI-compatible request.
//!
//! To follow one request: [`extproc`] receives Envoy's messages and asks
//! [`router`] for a decision once the body is in; the router reads the body
//! through [`request`] (its API key checked first, in [`admission`]), tokenizes its prompt in [`prompt`] (crate
//! `inferrail-tokenize`), and hands it to the decision core (crate
//! `inferrail-route`), which predicts each candidate's cached prefix (crate
//! `inferrail-kv`), scores the model's eligible replicas with the model's
//! policy (crate `inferrail-policy`) and leases the winner, once
//! [`admission`] has placed it in a band, charged its tenant's token limits
//! and, while the fleet is busy, let its turn come in the model's queue;
//! [`reply`] turns the decision into headers and dynamic metadata for Envoy.
//! After it, [`extproc`] and [`access_log`] turn what Envoy tells (on the
//! route stream, the response's status, the replica that served and the
//! stream's closing; in the access log, or on an observe stream, the first
//! byte) into events of the request's life, which the router hands to
//! the ledger (crate `inferrail-route`) and acts on. [`health`] probes replicas and ejects failing
//! ones; [`load`] keeps the engines' load reports current; [`kv_events`] applies the engines' KV events to the index; [`discovery`] keeps DNS groups' members current and [`kubernetes`] an InferencePool's; [`reload`] applies a changed routing YAML; [`peers`] shares the requests in flight with the other routers; [`admin`] serves
//! metrics and health; [`explain`] answers why a request would go where it
//! goes; [`decision_log`] writes sampled decisions and [`traces`] exports a
//! span per decision, whose `traceparent` [`reply`] passes on to the engine;
//! [`service`] wires it together.
#![forbid(unsafe_code)]

pub mod access_log;
pub mod admin;
pub mod admission;
pub mod clock;
pub mod decision;
pub mod discovery;
pub mod explain;
pub mod extproc;
pub mod health;
pub mod kv_events;
pub mod load;
pub mod peers;
pub mod prompt;
pub mod reload;
pub mod reply;
pub mod request;
pub mod router;
pub mod service;
pub mod telemetry;
