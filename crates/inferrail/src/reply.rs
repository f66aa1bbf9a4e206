//! The protobuf boundary: what the router tells Envoy, as ext_proc messages.
//!
//! A decision becomes header mutations (`x-gateway-destination-endpoint`
//! with `raw_value`, as Envoy requires), dynamic metadata in namespaces
//! `envoy.lb` (read by the override_host load balancer) and `inferrail` (read
//! by the route to add response headers), and, when the model was rewritten,
//! the new body. Answers the router gives itself are ImmediateResponses in
//! the OpenAI error shape vLLM uses.

use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::service::ext_proc::v3::body_mutation::Mutation;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse, ProcessingResponse, TrailersResponse,
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

/// Lets response trailers through unchanged.
pub fn continue_trailers() -> ProcessingResponse {
    ProcessingResponse { response: Some(Response::ResponseTrailers(TrailersResponse::default())), ..Default::default() }
}

/// Asks Envoy to wait longer for the headers' answer: the body is still arriving.
pub fn wait_for_body(timeout: std::time::Duration) -> ProcessingResponse {
    let timeout = envoy_types::pb::google::protobuf::Duration { seconds: timeout.as_secs() as i64, nanos: timeout.subsec_nanos() as i32 };
    ProcessingResponse { override_message_timeout: Some(timeout), ..Default::default() }
}

/// The answer to body chunk `index`: let through, or, when the body was
/// rewritten, replaced by the whole new body (the first chunk) or emptied.
pub fn chunk(rewritten: Option<&[u8]>, index: usize) -> ProcessingResponse {
    let mutation = rewritten.map(|b| match index {
        0 => Mutation::Body(b.to_vec()),
        _ => Mutation::ClearBody(true),
    });
    ProcessingResponse {
        response: Some(Response::RequestBody(BodyResponse {
            response: Some(CommonResponse { body_mutation: mutation.map(|m| BodyMutation { mutation: Some(m) }), ..Default::default() }),
        })),
        ..Default::default()
    }
}

/// The decision, as the answer to the request's headers (Envoy held them,
/// and the body chunks it streamed, until now), followed by one answer for
/// each of the `chunks` body chunks. `set_request_id` when the request goes
/// by an id the client did not send. A rewritten body replaces the first
/// chunk and clears the rest. Envoy drops `content-length` from a streamed
/// body's request, so the upstream request goes out chunked.
pub fn decision(d: &Decision, set_request_id: bool, chunks: usize) -> Vec<ProcessingResponse> {
    let targets: Vec<String> = d.targets.iter().map(|r| r.addr.to_string()).collect();
    let targets = targets.join(",");
    let mut set = vec![header(DESTINATION, &targets)];
    if set_request_id {
        set.push(header("x-request-id", &d.request_id));
    }
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
    let headers = ProcessingResponse {
        response: Some(Response::RequestHeaders(HeadersResponse {
            response: Some(CommonResponse {
                header_mutation: Some(HeaderMutation { set_headers: set, ..Default::default() }),
                ..Default::default()
            }),
        })),
        dynamic_metadata: Some(metadata),
        ..Default::default()
    };
    let body = (0..chunks).map(|i| chunk(d.body.as_deref(), i));
    std::iter::once(headers).chain(body).collect()
}
