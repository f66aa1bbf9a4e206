//! The protobuf boundary: what the router tells Envoy, as ext_proc messages.
//!
//! A decision becomes header mutations (`x-gateway-destination-endpoint`
//! with `raw_value`, as Envoy requires, and the decision span's
//! `traceparent` when traces are on), dynamic metadata in namespaces
//! `envoy.lb` (read by the override_host load balancer) and `inferrail` (read
//! by the route to add response headers), and, when the model was rewritten,
//! the new body. Answers the router gives itself are ImmediateResponses in
//! the OpenAI error shape vLLM uses.

use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::service::ext_proc::v3::body_mutation::Mutation;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse, ProcessingResponse,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use serde_json::json;

use crate::router::{Decision, RouteError};

/// The header (and `envoy.lb` key) naming the chosen replicas.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";

fn header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue { key: key.into(), raw_value: value.as_bytes().to_vec(), ..Default::default() }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

fn string(s: &str) -> Value {
    Value { kind: Some(Kind::StringValue(s.into())) }
}

fn object(fields: impl IntoIterator<Item = (&'static str, Value)>) -> Value {
    Value { kind: Some(Kind::StructValue(Struct { fields: fields.into_iter().map(|(k, v)| (k.to_string(), v)).collect() })) }
}

/// An error body in the OpenAI shape vLLM uses.
pub fn error_body(status: u16, kind: &str, message: &str, param: Option<&str>) -> String {
    json!({"error": {"message": message, "type": kind, "param": param, "code": status}}).to_string()
}

/// The router answers the request itself.
pub fn immediate(status: u16, body: String, headers: &[(&str, &str)], details: &str) -> ProcessingResponse {
    let mut set = vec![header("content-type", "application/json")];
    set.extend(headers.iter().map(|(k, v)| header(k, v)));
    ProcessingResponse {
        response: Some(Response::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus { code: i32::from(status) }),
            headers: Some(HeaderMutation { set_headers: set, ..Default::default() }),
            body: body.into_bytes(),
            details: details.into(),
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// An error the router answers, in the OpenAI shape.
pub fn route_error(e: &RouteError) -> ProcessingResponse {
    let (status, kind, param) = e.http();
    immediate(status, error_body(status, kind, &e.to_string(), param), &[], &format!("inferrail_{}", e.reason()))
}

/// Let the headers through and wait for the body.
pub fn continue_headers(set: &[(&str, &str)]) -> ProcessingResponse {
    let header_mutation =
        (!set.is_empty()).then(|| HeaderMutation { set_headers: set.iter().map(|(k, v)| header(k, v)).collect(), ..Default::default() });
    ProcessingResponse {
        response: Some(Response::RequestHeaders(HeadersResponse {
            response: Some(CommonResponse { header_mutation, ..Default::default() }),
        })),
        ..Default::default()
    }
}

/// The decision, as the body-phase answer; `renamed` when the request's id
/// was already in flight and the request now goes by `d.request_id`;
/// `traceparent`, the decision span's context, goes on to the engine.
pub fn decision(d: &Decision, renamed: bool, traceparent: Option<&str>) -> ProcessingResponse {
    let targets: Vec<String> = d.targets.iter().map(|r| r.addr.to_string()).collect();
    let targets = targets.join(",");
    let mut set = vec![header(DESTINATION, &targets)];
    if renamed {
        set.push(header("x-request-id", &d.request_id));
    }
    if let Some(tp) = traceparent {
        set.push(header("traceparent", tp));
    }
    let body_mutation = d.body.as_ref().map(|b| {
        set.push(header("content-length", &b.len().to_string()));
        BodyMutation { mutation: Some(Mutation::Body(b.clone())) }
    });
    let mut ours = vec![
        ("replica", string(&d.targets[0].id)),
        ("policy", string(d.policy)),
        ("model", string(&d.model)),
        ("request_id", string(&d.request_id)),
    ];
    if let (Some(n), Some(cached)) = (d.prompt_tokens, d.cached_tokens.first()) {
        ours.push(("prompt_tokens", string(&n.to_string())));
        ours.push(("cached_tokens", string(&cached.to_string())));
    }
    let metadata = Struct {
        fields: [("envoy.lb".to_string(), object([(DESTINATION, string(&targets))])), ("inferrail".to_string(), object(ours))]
            .into_iter()
            .collect(),
    };
    ProcessingResponse {
        response: Some(Response::RequestBody(BodyResponse {
            response: Some(CommonResponse {
                header_mutation: Some(HeaderMutation { set_headers: set, ..Default::default() }),
                body_mutation,
                ..Default::default()
            }),
        })),
        dynamic_metadata: Some(metadata),
        ..Default::default()
    }
}
