//! `inferrail`: the Envoy ext_proc service that picks a replica for each
//! OpenAI-compatible request.
//!
//! One request passes eight files (`docs/architecture.md` draws them):
//! [`extproc::route`] (or the picker's stream) reads Envoy's messages;
//! [`extproc::front`] answers what the router serves itself and asks for the
//! decision; [`router::decide`] checks the key, reads the body, tokenizes the
//! prompt, places the request in its band and has the decision core
//! (`inferrail-route`'s `lib.rs`) plan and commit it into the ledger
//! (`inferrail-route`'s `ledger.rs`); [`reply`] turns the [`decision`] into
//! headers and metadata. Then [`extproc::response`] turns the response into
//! lifecycle events, [`router::hear`] has the ledger run the request's life
//! (`inferrail-route`'s `lifecycle.rs`) and acts on what follows.
//!
//! Around that path: [`router`] holds the state (the routing snapshot, the
//! core, the ledger, the engines' reports, the injected [`clock`]) and
//! [`router::reconcile`] applies reloads and discovery; [`admission`] holds
//! keys, bands, token limits and queues; [`prompt`] the tokenizers;
//! [`access_log`] hears first bytes from Envoy's access log; [`health`]
//! probes replicas; [`load`] keeps the engines' reports current;
//! [`kv_events`] applies the engines' KV events to the index; [`discovery`]
//! keeps DNS groups and an InferencePool current and hands Envoy the fleet
//! as EDS; [`reload`] watches the routing YAML; [`peers`] shares the requests
//! in flight with the other routers; [`telemetry`] exports traces, the
//! decision log and gauges; [`admin`] serves metrics and health; [`explain`]
//! answers why a request would go where it goes; [`service`] wires it
//! together.
#![forbid(unsafe_code)]

pub mod access_log;
pub mod admin;
pub mod admission;
pub mod clock;
pub mod decision;
pub mod discovery;
pub mod explain;
pub mod extproc;
pub mod front;
pub mod health;
pub mod kv_events;
pub mod legs;
pub mod load;
pub mod peers;
pub mod prompt;
pub mod reload;
pub mod reply;
pub mod request;
pub mod response;
pub mod router;
pub mod service;
pub mod sidecar;
pub mod telemetry;
