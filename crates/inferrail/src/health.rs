//! The fleet's health as the router sees it and tells it: [`probe`] checks
//! every replica's `/health`; [`grpc`] keeps the router's own gRPC health
//! services current; [`cards`] keeps the `/v1/models` answer. Passive
//! ejection after failed requests is part of what the router does with
//! what it hears (`crate::router::hear`).

pub mod cards;
pub mod grpc;
pub mod probe;
