//! Where the replicas come from besides the routing YAML's list, each source
//! publishing the replicas it wants ([`crate::router::Router::publish`]):
//! [`dns`] keeps DNS groups' members current, [`kubernetes`] an
//! InferencePool's pods; [`eds`] hands the whole fleet on to Envoy's own
//! balancing (the fail-open path) as EDS.

pub mod dns;
pub mod eds;
pub mod kubernetes;
