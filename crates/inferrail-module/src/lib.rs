//! `inferrail-module`: Inferrail inside Envoy, as an HTTP dynamic module
//! (`envoy.filters.http.dynamic_modules`) that Envoy 1.40 loads from
//! `libinferrail_module.so`. No gRPC hop: each request is decided on the
//! Envoy worker that holds it, by the same router the ext_proc service
//! runs, and its response is heard in-process.
//!
//! Read it in this order: [`abi`] binds Envoy's C ABI (the only `unsafe`
//! here) and catches panics at the boundary; [`filter`] is one request,
//! from its headers to its end, and [`wait`] the deadline of one that waits
//! for its decision; [`process`] starts the router once per Envoy process,
//! with all its background work on a runtime of its own.
//! The filter's configuration is the routing YAML's path.

#[allow(unsafe_code)]
pub mod abi;
pub mod filter;
pub mod process;
pub mod wait;
