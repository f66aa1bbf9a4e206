//! Decision spans against a real OTLP/HTTP receiver in the test, and a
//! dead collector that must cost a decision nothing.

use std::time::SystemTime;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use inferrail_config::Config;
use inferrail_tokenize::chat::Endpoint;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span as ProtoSpan;
use prost::Message;
use tokio::sync::mpsc;

use super::*;
use crate::router::Router;

const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";
const BODY: &[u8] = br#"{"model": "m", "messages": [{"role": "user", "content": "tell me about otters, at length"}]}"#;

/// An OTLP/HTTP receiver: every `POST /v1/traces` body, decoded, arrives on the channel.
async fn receiver() -> (String, mpsc::UnboundedReceiver<(String, ExportTraceServiceRequest)>) {
    receiver_on(0).await
}

async fn receiver_on(port: u16) -> (String, mpsc::UnboundedReceiver<(String, ExportTraceServiceRequest)>) {
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req: Request<hyper::body::Incoming>| {
                    let tx = tx.clone();
                    async move {
                        let path = format!("{} {}", req.method(), req.uri().path());
                        let body = req.into_body().collect().await?.to_bytes();
                        let decoded = ExportTraceServiceRequest::decode(body).unwrap_or_default();
                        let _ = tx.send((path, decoded));
                        let mut answer = Response::new(Full::new(Bytes::new()));
                        answer.headers_mut().insert("content-type", hyper::header::HeaderValue::from_static("application/x-protobuf"));
                        Ok::<_, hyper::Error>(answer)
                    }
                });
                let _ = http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
            });
        }
    });
    (format!("http://{addr}"), rx)
}

fn router(endpoint: &str, ratio: f64) -> Router {
    let yaml = format!(
        "observability: {{otlp_endpoint: '{endpoint}', trace_sample_ratio: {ratio}}}\n\
         models: [{{name: m, policy: cost_model, tokenizer: builtin:sim}}]\n\
         replicas:\n  - {{id: a, address: 127.0.0.1:1, models: [m]}}\n  - {{id: b, address: 127.0.0.1:2, models: [m]}}\n"
    );
    Router::new(Config::parse(&yaml).unwrap()).unwrap()
}

/// Every span received, flushing first (on a blocking thread: the receiver runs on this runtime).
async fn flushed(router: &std::sync::Arc<Router>, rx: &mut mpsc::UnboundedReceiver<(String, ExportTraceServiceRequest)>) -> Vec<ProtoSpan> {
    let r = router.clone();
    tokio::task::spawn_blocking(move || r.traces.as_ref().unwrap().flush()).await.unwrap().unwrap();
    let mut spans = Vec::new();
    while let Ok((path, request)) = rx.try_recv() {
        assert_eq!(path, "POST /v1/traces");
        for rs in request.resource_spans {
            let resource = rs.resource.unwrap_or_default();
            assert!(resource.attributes.iter().any(|a| a.key == "service.name"
                && matches!(&a.value.as_ref().and_then(|v| v.value.clone()), Some(Value::StringValue(s)) if s == "inferrail")));
            spans.extend(rs.scope_spans.into_iter().flat_map(|s| s.spans));
        }
    }
    spans
}

fn attribute(span: &ProtoSpan, key: &str) -> Option<Value> {
    span.attributes.iter().find(|a| a.key == key).and_then(|a| a.value.clone()).and_then(|v| v.value)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn a_bare_endpoint_gets_the_traces_path_and_a_full_url_is_kept() {
    assert_eq!(traces_url("http://collector:4318"), "http://collector:4318/v1/traces");
    assert_eq!(traces_url("http://collector:4318/"), "http://collector:4318/v1/traces");
    assert_eq!(traces_url("http://collector:4318/otlp/v1/traces"), "http://collector:4318/otlp/v1/traces");
}

#[test]
fn without_an_endpoint_nothing_is_built() {
    let config = Config::parse("models: [{name: m}]\nreplicas: [{id: a, address: 127.0.0.1:1, models: [m]}]\n").unwrap();
    assert!(Traces::start(&config.observability).unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_span_continues_the_clients_trace_and_names_the_engines_parent() {
    let (endpoint, mut rx) = receiver().await;
    let router = std::sync::Arc::new(router(&endpoint, 1.0));
    let traces = router.traces.as_ref().unwrap();
    let started = SystemTime::now();
    let d = router.decide(BODY, Endpoint::Chat, "req-1", None, None).await.unwrap();
    let client = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    let engine = traces.decision(Some(&client), started, &d);

    // The engine's traceparent: the client's trace, the decision's span, sampled.
    let parts: Vec<&str> = engine.split('-').collect();
    assert_eq!((parts.len(), parts[0], parts[1], parts[3]), (4, "00", CLIENT_TRACE, "01"), "{engine}");
    assert_ne!(parts[2], CLIENT_SPAN);

    // No traceparent: a new trace.
    let fresh = traces.decision(None, started, &d);
    assert!(!fresh.contains(CLIENT_TRACE) && fresh.ends_with("-01"), "{fresh}");

    let spans = flushed(&router, &mut rx).await;
    assert_eq!(spans.len(), 2, "{spans:#?}");
    let span = spans.iter().find(|s| hex(&s.trace_id) == CLIENT_TRACE).unwrap();
    assert_eq!(span.name, SPAN_NAME);
    assert_eq!(hex(&span.parent_span_id), CLIENT_SPAN, "the client's span is the parent");
    assert_eq!(hex(&span.span_id), parts[2], "the engine's parent is the decision's span");
    assert!(span.end_time_unix_nano >= span.start_time_unix_nano);
    assert_eq!(attribute(span, "inferrail.policy"), Some(Value::StringValue("cost_model".into())));
    assert_eq!(attribute(span, "inferrail.model"), Some(Value::StringValue("m".into())));
    assert_eq!(attribute(span, "inferrail.candidates"), Some(Value::IntValue(2)));
    assert_eq!(attribute(span, "inferrail.winner"), Some(Value::StringValue(d.targets[0].id.clone())));
    assert_eq!(attribute(span, "inferrail.prompt_tokens"), Some(Value::IntValue(d.prompt_tokens.unwrap() as i64)));
    assert_eq!(attribute(span, "inferrail.predicted_cached_tokens"), Some(Value::IntValue(0)));
    assert!(matches!(attribute(span, "inferrail.estimated_ttft_ms"), Some(Value::DoubleValue(ms)) if ms > 0.0), "{span:#?}");
    let root = spans.iter().find(|s| hex(&s.trace_id) != CLIENT_TRACE).unwrap();
    assert!(root.parent_span_id.is_empty(), "a request without traceparent starts a trace");
    assert!(!traces.failing());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_request_is_a_failed_span_and_an_unsampled_client_trace_stays_unsampled() {
    let (endpoint, mut rx) = receiver().await;
    let router = std::sync::Arc::new(router(&endpoint, 1.0));
    let traces = router.traces.as_ref().unwrap();
    let client = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    let e = router.decide(br#"{"model": "nope"}"#, Endpoint::Chat, "req-2", None, None).await.unwrap_err();
    traces.refused(Some(&client), SystemTime::now(), &e);
    // The client decided not to sample: the engine hears so, and nothing is exported.
    let d = router.decide(BODY, Endpoint::Chat, "req-3", None, None).await.unwrap();
    let unsampled = traces.decision(Some(&format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-00")), SystemTime::now(), &d);
    assert!(unsampled.starts_with(&format!("00-{CLIENT_TRACE}-")) && unsampled.ends_with("-00"), "{unsampled}");
    // A malformed traceparent is ignored: a new trace.
    let bad = traces.decision(Some("00-zz-yy-01"), SystemTime::now(), &d);
    assert!(bad.len() == 55 && !bad.contains("zz"), "{bad}");

    let spans = flushed(&router, &mut rx).await;
    assert_eq!(spans.len(), 2, "{spans:#?}");
    let refused = spans.iter().find(|s| hex(&s.trace_id) == CLIENT_TRACE).unwrap();
    assert_eq!(attribute(refused, "inferrail.error"), Some(Value::StringValue("unknown_model".into())));
    assert_eq!(refused.status.as_ref().map(|s| s.code), Some(2), "STATUS_CODE_ERROR");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_collector_costs_decisions_nothing_and_export_resumes_when_it_answers() {
    // A port nobody listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let router = std::sync::Arc::new(router(&format!("http://127.0.0.1:{port}"), 1.0));
    let traces = router.traces.as_ref().unwrap();
    // More spans than the queue holds (2048) while export fails: had a
    // decision waited for the collector or for room in the queue, this loop
    // would not finish.
    for i in 0..3_000 {
        let d = router.decide(BODY, Endpoint::Chat, &format!("r{i}"), None, None).await.unwrap();
        let engine = traces.decision(None, SystemTime::now(), &d);
        assert_eq!(engine.len(), 55);
        router.forget(&d.request_id);
    }
    // Flushing fails on what is still queued, or finds the queue empty when
    // the batch thread already tried; either way export is seen failing.
    let r = router.clone();
    let flush = tokio::task::spawn_blocking(move || r.traces.as_ref().unwrap().flush()).await.unwrap();
    for _ in 0..200 {
        if traces.failing() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(traces.failing(), "export never failed against a closed port (flush: {flush:?})");

    // The collector comes up on that port: export resumes.
    let (_, mut rx) = receiver_on(port).await;
    let d = router.decide(BODY, Endpoint::Chat, "after", None, None).await.unwrap();
    let engine = traces.decision(None, SystemTime::now(), &d);
    let spans = flushed(&router, &mut rx).await;
    assert!(spans.iter().any(|s| engine.contains(&hex(&s.span_id))), "{spans:#?}");
    assert!(!traces.failing());
}
