//! What Envoy's messages carry besides headers and bodies, read in the
//! router's terms: attributes (`request.id`, `upstream.address`), the
//! gateway's subset hint and served endpoint, the `inferrail` metadata a
//! decision set.

use std::net::SocketAddr;

use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::google::protobuf::Struct;
use envoy_types::pb::google::protobuf::value::Kind;

/// Where the gateway reports the endpoint that served.
const SERVED: &str = "x-gateway-destination-endpoint-served";

/// Attributes as Envoy sends them, keyed by the filter's name.
pub type Attributes = std::collections::HashMap<String, Struct>;

/// A string attribute Envoy sent (`request.id`, `upstream.address`, ...),
/// keyed by the filter's name; the value is looked up under any key.
pub fn attribute(attributes: &Attributes, name: &str) -> Option<String> {
    attributes.values().flat_map(|s| s.fields.iter()).find_map(|(k, v)| match (k == name, &v.kind) {
        (true, Some(Kind::StringValue(a))) => Some(a.clone()),
        _ => None,
    })
}

/// The endpoints an Inference Extension gateway offers for a request:
/// `envoy.lb.subset_hint` / `x-gateway-destination-endpoint-subset` in the
/// request's metadata, a list of `ip:port` (or one comma-separated string).
/// Entries that are not addresses are left out, so a hint naming none
/// leaves nothing to pick from.
pub fn subset(metadata: &Option<Metadata>) -> Option<Vec<SocketAddr>> {
    let hint = metadata.as_ref()?.filter_metadata.get("envoy.lb.subset_hint")?.fields.get("x-gateway-destination-endpoint-subset")?;
    let parse = |s: &str| s.split(',').filter_map(|a| a.trim().parse().ok()).collect::<Vec<SocketAddr>>();
    Some(match &hint.kind {
        Some(Kind::ListValue(list)) => list
            .values
            .iter()
            .filter_map(|v| match &v.kind {
                Some(Kind::StringValue(s)) => Some(parse(s)),
                _ => None,
            })
            .flatten()
            .collect(),
        Some(Kind::StringValue(s)) => parse(s),
        _ => Vec::new(),
    })
}

/// The endpoint that served, as the gateway reports it in `envoy.lb`.
pub fn served(metadata: &Option<Metadata>) -> Option<String> {
    let lb = metadata.as_ref()?.filter_metadata.get("envoy.lb")?;
    match &lb.fields.get(SERVED)?.kind {
        Some(Kind::StringValue(s)) => Some(s.clone()),
        _ => None,
    }
}

/// The router that decided a request and the id it knows it by, from the
/// `inferrail` metadata its decision set (the observe filter forwards that
/// namespace).
pub fn decided_by(metadata: &Option<Metadata>) -> Option<(u64, String)> {
    let ours = &metadata.as_ref()?.filter_metadata.get("inferrail")?.fields;
    let text = |key: &str| match ours.get(key).and_then(|v| v.kind.as_ref()) {
        Some(Kind::StringValue(s)) => Some(s.clone()),
        _ => None,
    };
    Some((crate::decision::decider_id(&text("router")?)?, text("request_id")?))
}
