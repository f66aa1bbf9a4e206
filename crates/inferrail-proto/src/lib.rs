//! Inferrail's own gRPC APIs, generated from `proto/` at build time without a
//! system `protoc`, and what sits at that boundary: conversions between the
//! protobuf messages and the domain types of `inferrail-load` ([`convert`]),
//! the sidecar's `LoadReports` service ([`service`]) and the router's client
//! that follows it into a `LoadTable` ([`follow`]).
#![forbid(unsafe_code)]

pub mod convert;
pub mod follow;
pub mod service;

/// `inferrail.load.v1`: load snapshots from the scraper sidecar.
#[allow(missing_docs, clippy::all, clippy::unwrap_used, clippy::expect_used)]
pub mod load {
    /// Version 1.
    pub mod v1 {
        tonic::include_proto!("inferrail.load.v1");
    }
}

pub use follow::follow;
pub use service::LoadReportsService;
