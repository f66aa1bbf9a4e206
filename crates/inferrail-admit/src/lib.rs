//! Admission, as pure data and functions clocked from outside: who a
//! request's API key says it is ([`keys`]), whether its tenant has tokens
//! left in its windows ([`limit`]), and, while the fleet is busy, the order
//! requests wait in, by priority band and fairly across tenants ([`queue`]).
//! The router (`crates/inferrail/src/admission.rs`) decides when the fleet
//! is busy and wakes the request this crate says goes next.
#![forbid(unsafe_code)]

pub mod keys;
pub mod limit;
pub mod queue;
