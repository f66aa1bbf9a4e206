//! Inferrail's own gRPC APIs, generated from `proto/` at build time without a
//! system `protoc`, and what sits at that boundary: conversions between the
//! protobuf messages and the domain types of `inferrail-load` ([`convert`]),
//! the sidecar's `LoadReports` service ([`service`]) and the router's client
//! that follows it into a `LoadTable` ([`follow`]). The router's admin API
//! (`inferrail.admin.v1`: Explain, Replicas) and the routers' peer API
//! (`inferrail.peer.v1`) are generated here too; the router implements them.
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

/// `inferrail.admin.v1`: Explain and the fleet, on the router's admin gRPC listener.
#[allow(missing_docs, clippy::all, clippy::unwrap_used, clippy::expect_used)]
pub mod admin {
    /// Version 1.
    pub mod v1 {
        tonic::include_proto!("inferrail.admin.v1");
    }
}

/// `inferrail.peer.v1`: routers sharing the requests in flight.
#[allow(missing_docs, clippy::all, clippy::unwrap_used, clippy::expect_used)]
pub mod peer {
    /// Version 1.
    pub mod v1 {
        tonic::include_proto!("inferrail.peer.v1");
    }
}

/// The encoded descriptors of `inferrail.admin.v1`, for gRPC server reflection.
pub const ADMIN_DESCRIPTORS: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/admin.descriptors.bin"));

/// The encoded descriptors of `inferrail.load.v1`, for gRPC server reflection.
pub const LOAD_DESCRIPTORS: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/load.descriptors.bin"));

pub use follow::follow;
pub use service::LoadReportsService;
