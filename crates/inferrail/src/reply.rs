//! The protobuf boundary: what the router tells Envoy, as ext_proc messages.
//!
//! A decision becomes header mutations (`x-gateway-destination-endpoint`
//! with `raw_value`, as Envoy requires, and the decision span's
//! `traceparent` when traces are on), dynamic metadata in namespaces
//! `envoy.lb` (read by the override_host load balancer) and `inferrail` (read
//! by the route to add response headers: a split request's prefill replica
//! among them), and, when the model was rewritten or a prefill leg ran, the
//! new body. On a full-duplex stream the same decision answers the held
//! request headers and the body is echoed back in chunks. Answers the router
//! gives itself are ImmediateResponses in the OpenAI error shape vLLM uses.

use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::service::ext_proc::v3::body_mutation::Mutation;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse, ProcessingResponse,
    StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use serde_json::json;

use crate::decision::{Decision, RouteError};

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

/// An error the router answers, in the OpenAI shape, with `Retry-After`
/// (whole seconds, at least one) when the client should try again later.
pub fn route_error(e: &RouteError) -> ProcessingResponse {
    let (status, kind, param) = e.http();
    let retry = e.retry_after().map(|d| d.as_secs_f64().ceil().max(1.0).to_string());
    let headers: Vec<(&str, &str)> = retry.iter().map(|s| ("retry-after", s.as_str())).collect();
    immediate(status, error_body(status, kind, &e.to_string(), param), &headers, &format!("inferrail_{}", e.reason()))
}

/// Asks Envoy to wait up to `wait` for the answer to the message in hand:
/// the request is queued at the router, and must not be let through
/// unrouted by the filter's `message_timeout`. Envoy honours it up to the
/// filter's `max_message_timeout`.
pub fn wait(wait: std::time::Duration) -> ProcessingResponse {
    let seconds = i64::try_from(wait.as_secs()).unwrap_or(i64::MAX);
    let timeout = envoy_types::pb::google::protobuf::Duration { seconds, nanos: wait.subsec_nanos() as i32 };
    ProcessingResponse { override_message_timeout: Some(timeout), ..Default::default() }
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
    let mut set = decision_headers(d, renamed, traceparent);
    let body_mutation = d.body.as_ref().map(|b| {
        set.push(header("content-length", &b.len().to_string()));
        BodyMutation { mutation: Some(Mutation::Body(b.clone())) }
    });
    ProcessingResponse {
        response: Some(Response::RequestBody(BodyResponse {
            response: Some(CommonResponse {
                header_mutation: Some(HeaderMutation { set_headers: set, ..Default::default() }),
                body_mutation,
                ..Default::default()
            }),
        })),
        dynamic_metadata: Some(decision_metadata(d)),
        ..Default::default()
    }
}

/// Bodies go back to a full-duplex stream in pieces of at most this many bytes.
const CHUNK: usize = 62_000;

/// The decision on a full-duplex stream: the held request headers'
/// answer (the destination and metadata, as in [`decision`]), then `body`
/// (the request's, or the one with the model rewritten) in chunks, the last
/// ending the stream unless `trailers` follow. Envoy drops any
/// `content-length` set here.
pub fn held_decision(d: &Decision, renamed: bool, traceparent: Option<&str>, body: &[u8], trailers: bool) -> Vec<ProcessingResponse> {
    let set = decision_headers(d, renamed, traceparent);
    let headers = ProcessingResponse {
        response: Some(Response::RequestHeaders(HeadersResponse {
            response: Some(CommonResponse {
                header_mutation: Some(HeaderMutation { set_headers: set, ..Default::default() }),
                ..Default::default()
            }),
        })),
        dynamic_metadata: Some(decision_metadata(d)),
        ..Default::default()
    };
    let chunks = body.chunks(CHUNK).map(<[u8]>::to_vec).collect::<Vec<_>>();
    let last = chunks.len().saturating_sub(1);
    let body = match chunks.is_empty() {
        true => vec![streamed(false, Vec::new(), !trailers)],
        false => chunks.into_iter().enumerate().map(|(i, c)| streamed(false, c, i == last && !trailers)).collect(),
    };
    let trailers = trailers.then(|| continue_trailers(false));
    std::iter::once(headers).chain(body).chain(trailers).collect()
}

/// A body chunk echoed on a full-duplex stream: the request's, or with `response` the response's.
pub fn streamed(response: bool, body: Vec<u8>, end_of_stream: bool) -> ProcessingResponse {
    let mutation = Mutation::StreamedResponse(StreamedBodyResponse { body, end_of_stream, ..Default::default() });
    let answer = BodyResponse {
        response: Some(CommonResponse { body_mutation: Some(BodyMutation { mutation: Some(mutation) }), ..Default::default() }),
    };
    let response = if response { Response::ResponseBody(answer) } else { Response::RequestBody(answer) };
    ProcessingResponse { response: Some(response), ..Default::default() }
}

/// Let the response headers through unchanged.
pub fn continue_response_headers() -> ProcessingResponse {
    ProcessingResponse { response: Some(Response::ResponseHeaders(HeadersResponse::default())), ..Default::default() }
}

/// Let the response's headers through and ask for its body, chunk by chunk
/// as it streams, for this request only (the filter must allow mode
/// overrides): its usage is in its last bytes.
pub fn continue_response_headers_then_body() -> ProcessingResponse {
    use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::ProcessingMode;
    use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::{BodySendMode, HeaderSendMode};
    let mode = ProcessingMode {
        request_header_mode: HeaderSendMode::Send as i32,
        request_body_mode: BodySendMode::Buffered as i32,
        response_header_mode: HeaderSendMode::Send as i32,
        response_body_mode: BodySendMode::Streamed as i32,
        ..Default::default()
    };
    ProcessingResponse { mode_override: Some(mode), ..continue_response_headers() }
}

/// Let a (buffered or streamed) response body chunk through unchanged.
pub fn continue_response_body() -> ProcessingResponse {
    ProcessingResponse { response: Some(Response::ResponseBody(BodyResponse::default())), ..Default::default() }
}

/// Let trailers through unchanged: the request's, or with `response` the response's.
pub fn continue_trailers(response: bool) -> ProcessingResponse {
    let answer = TrailersResponse::default();
    let response = if response { Response::ResponseTrailers(answer) } else { Response::RequestTrailers(answer) };
    ProcessingResponse { response: Some(response), ..Default::default() }
}

/// The header naming a split request's prefill replica to the sidecar in
/// front of its decoder (llm-d's).
pub const PREFILLER: &str = "x-prefiller-host-port";

/// The headers a decision sets: the destination (winner first, then the
/// fallbacks), the prefill replica for a decoder's sidecar, the new request
/// id when it was renamed, the traceparent.
fn decision_headers(d: &Decision, renamed: bool, traceparent: Option<&str>) -> Vec<HeaderValueOption> {
    let mut set = vec![header(DESTINATION, &targets(d))];
    if let Some(leg) = d.prefill.as_ref().filter(|leg| leg.sidecar) {
        set.push(header(PREFILLER, &leg.targets[0].addr.to_string()));
    }
    if renamed {
        set.push(header("x-request-id", &d.request_id));
    }
    if let Some(tp) = traceparent {
        set.push(header("traceparent", tp));
    }
    set
}

fn targets(d: &Decision) -> String {
    let targets: Vec<String> = d.targets.iter().map(|r| r.addr.to_string()).collect();
    targets.join(",")
}

/// How the `router` metadata names the router that decided.
fn router_text(id: u64) -> String {
    format!("{id:016x}")
}

/// The router the `router` metadata names.
pub fn decider_id(text: &str) -> Option<u64> {
    u64::from_str_radix(text, 16).ok()
}

/// The decision as dynamic metadata: `envoy.lb` for the override-host load
/// balancer (the same value as the destination header), `inferrail` for the
/// route's response headers.
fn decision_metadata(d: &Decision) -> Struct {
    let mut ours = vec![
        ("replica", string(&d.targets[0].id)),
        ("policy", string(d.policy)),
        ("model", string(&d.model)),
        ("request_id", string(&d.request_id)),
        ("router", string(&router_text(d.decider))),
    ];
    // A split request's engine reports the prefill replica's cached tokens.
    let cached = match &d.prefill {
        Some(leg) => leg.cached_tokens.first(),
        None => d.cached_tokens.first(),
    };
    if let (Some(n), Some(cached)) = (d.prompt_tokens, cached) {
        ours.push(("prompt_tokens", string(&n.to_string())));
        ours.push(("cached_tokens", string(&cached.to_string())));
    }
    if let Some(leg) = &d.prefill {
        ours.push(("prefill_replica", string(&leg.targets[0].id)));
    }
    Struct {
        fields: [("envoy.lb".to_string(), object([(DESTINATION, string(&targets(d)))])), ("inferrail".to_string(), object(ours))]
            .into_iter()
            .collect(),
    }
}
