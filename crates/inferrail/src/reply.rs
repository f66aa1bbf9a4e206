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
//! gives itself ([`Answer`]) are ImmediateResponses.

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

use crate::decision::{Answer, Decision};

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

/// The router answers the request itself.
pub fn immediate(answer: &Answer) -> ProcessingResponse {
    let mut set = vec![header("content-type", "application/json")];
    set.extend(answer.headers.iter().map(|(k, v)| header(k, v)));
    ProcessingResponse {
        response: Some(Response::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus { code: i32::from(answer.status) }),
            headers: Some(HeaderMutation { set_headers: set, ..Default::default() }),
            body: answer.body.clone().into_bytes(),
            details: answer.details.clone(),
            ..Default::default()
        })),
        ..Default::default()
    }
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

/// The headers a decision sets.
fn decision_headers(d: &Decision, renamed: bool, traceparent: Option<&str>) -> Vec<HeaderValueOption> {
    d.headers(renamed, traceparent).iter().map(|(k, v)| header(k, v)).collect()
}

/// The decision as dynamic metadata, namespace by namespace.
fn decision_metadata(d: &Decision) -> Struct {
    let namespace = |fields: Vec<(&'static str, String)>| object(fields.into_iter().map(|(k, v)| (k, string(&v))));
    Struct { fields: d.metadata().into_iter().map(|(ns, fields)| (ns.to_string(), namespace(fields))).collect() }
}
