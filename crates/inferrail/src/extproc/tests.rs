//! The ext_proc service over loopback gRPC, driven by tonic's generated
//! client the way Envoy drives it: the route stream (headers, then the
//! buffered body, then the response's headers, held open until the request
//! is over), the observe stream (response headers with `request.id` and
//! `upstream.address`, then the first body chunk), and the access log's
//! records of first bytes.

use std::collections::HashMap;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::envoy::service::ext_proc::v3::{BodyResponse, HttpBody, ProcessingResponse, ProtocolConfiguration, body_mutation};
use envoy_types::pb::google::protobuf::{ListValue, Struct, Value};
use inferrail_config::Config;
use inferrail_route::lifecycle::Usage;
use tonic::transport::Channel;

use std::sync::Arc;

use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use envoy_types::pb::envoy::service::ext_proc::v3::{HttpHeaders, ProcessingRequest};

use super::*;
use crate::response::usage;
use crate::router::Router;
use envoy_types::pb::google::protobuf::value::Kind;

const CONFIG: &str = "
models: [{name: m, policy: round_robin}]
replicas:
  - {id: r1, address: 127.0.0.1:8001, models: [m]}
  - {id: r2, address: 127.0.0.1:8002, models: [m]}
";

/// A router behind a loopback ext_proc server, and a client to it.
async fn serve() -> (Arc<Router>, ExternalProcessorClient<Channel>) {
    let router = Arc::new(Router::new(Config::parse(CONFIG).unwrap()).unwrap());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let models = Arc::new(arc_swap::ArcSwap::from_pointee(String::new()));
    let service = ExternalProcessorServer::new(ExtProc::new(crate::front::Front::new(router.clone(), models)));
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    tokio::spawn(tonic::transport::Server::builder().add_service(service).serve_with_incoming(incoming));
    (router, ExternalProcessorClient::connect(format!("http://{addr}")).await.unwrap())
}

fn headers(pairs: &[(&str, &str)]) -> Option<HeaderMap> {
    let headers = pairs.iter().map(|(k, v)| HeaderValue { key: k.to_string(), raw_value: v.as_bytes().to_vec(), ..Default::default() });
    Some(HeaderMap { headers: headers.collect() })
}

/// One ext_proc stream: what the client sends, what the server answers.
struct Stream {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: Streaming<ProcessingResponse>,
}

impl Stream {
    async fn open(client: &mut ExternalProcessorClient<Channel>) -> Self {
        let (tx, rx) = mpsc::channel(4);
        let rx = client.process(ReceiverStream::new(rx)).await.unwrap().into_inner();
        Self { tx, rx }
    }

    async fn send(&self, request: ProcessingRequest) {
        self.tx.send(request).await.unwrap();
    }

    /// Closes the client's side and waits until the server has closed its own.
    async fn close(self) {
        let Self { tx, mut rx } = self;
        drop(tx);
        while rx.message().await.unwrap().is_some() {}
    }
}

/// Routes a completion as Envoy's route filter would; returns the open stream and the replicas named in `envoy.lb`.
async fn route(client: &mut ExternalProcessorClient<Channel>, id: &str) -> (Stream, String) {
    let mut stream = Stream::open(client).await;
    let head = headers(&[(":method", "POST"), (":path", "/v1/completions"), ("x-request-id", id)]);
    stream
        .send(ProcessingRequest {
            request: Some(Request::RequestHeaders(HttpHeaders { headers: head, ..Default::default() })),
            ..Default::default()
        })
        .await;
    let continued = stream.rx.message().await.unwrap().unwrap();
    assert!(matches!(continued.response, Some(Response::RequestHeaders(_))));
    let body = br#"{"model": "m", "prompt": "tell me about otters", "max_tokens": 4}"#.to_vec();
    stream
        .send(ProcessingRequest {
            request: Some(Request::RequestBody(HttpBody { body, end_of_stream: true, ..Default::default() })),
            ..Default::default()
        })
        .await;
    let decided = stream.rx.message().await.unwrap().unwrap();
    assert!(matches!(decided.response, Some(Response::RequestBody(_))));
    let lb = &decided.dynamic_metadata.unwrap().fields["envoy.lb"];
    let Some(Kind::StructValue(lb)) = &lb.kind else { panic!("envoy.lb is a struct") };
    let Some(Kind::StringValue(targets)) = &lb.fields[crate::decision::DESTINATION].kind else { panic!("the destination is a string") };
    (stream, targets.clone())
}

/// Reports an upstream response as Envoy's observe filter would, and waits until the server is done with it.
fn string(s: &str) -> Value {
    Value { kind: Some(Kind::StringValue(s.into())) }
}

async fn observe(client: &mut ExternalProcessorClient<Channel>, id: &str, upstream: &str, status: &str) {
    observe_with(client, id, upstream, status, None).await;
}

/// [`observe`] with the `inferrail` metadata the decision set, forwarded as the observe filter's config says.
async fn observe_with(client: &mut ExternalProcessorClient<Channel>, id: &str, upstream: &str, status: &str, metadata: Option<Metadata>) {
    let stream = Stream::open(client).await;
    let fields = HashMap::from([("request.id".to_string(), string(id)), ("upstream.address".to_string(), string(upstream))]);
    let attributes = HashMap::from([("envoy.filters.http.ext_proc".to_string(), Struct { fields })]);
    let head = HttpHeaders { headers: headers(&[(":status", status)]), ..Default::default() };
    stream
        .send(ProcessingRequest {
            observability_mode: true,
            attributes,
            metadata_context: metadata,
            request: Some(Request::ResponseHeaders(head)),
            ..Default::default()
        })
        .await;
    let chunk = HttpBody { body: b"data: {}\n\n".to_vec(), ..Default::default() };
    stream.send(ProcessingRequest { observability_mode: true, request: Some(Request::ResponseBody(chunk)), ..Default::default() }).await;
    stream.close().await;
}

fn counts(router: &Router) -> Vec<(u32, u32)> {
    router.fleet().replicas.iter().map(|r| (r.in_flight(), r.pending())).collect()
}

#[tokio::test]
async fn a_request_heard_on_both_streams_is_counted_and_forgotten_when_it_ends() {
    let (router, mut client) = serve().await;
    let (stream, targets) = route(&mut client, "a").await;
    assert_eq!(targets, "127.0.0.1:8001,127.0.0.1:8002", "the winner, then the fallback");
    assert_eq!(counts(&router), [(1, 1), (0, 0)], "in flight from the decision");
    observe(&mut client, "a", "127.0.0.1:8001", "200").await;
    assert_eq!(counts(&router), [(1, 0), (0, 0)], "its first byte came: no longer pending");
    assert_eq!(router.leases_held(), 1, "still in flight until the route stream closes");
    stream.close().await;
    assert_eq!(counts(&router), [(0, 0), (0, 0)]);
    assert_eq!(router.leases_held(), 0, "status, first byte and end known: over at once");
}

#[tokio::test]
async fn a_retry_seen_by_the_observe_stream_moves_the_request() {
    let (router, mut client) = serve().await;
    let (stream, targets) = route(&mut client, "b").await;
    assert_eq!(targets, "127.0.0.1:8001,127.0.0.1:8002", "the winner, then the fallback");
    let status = tokio::spawn({
        let mut client = client.clone();
        async move { observe(&mut client, "b", "127.0.0.1:8002", "200").await }
    });
    status.await.unwrap();
    assert_eq!(counts(&router), [(0, 0), (1, 0)], "held by the replica that served");
    stream.close().await;
    assert_eq!(counts(&router), [(0, 0), (0, 0)]);
    assert_eq!(router.leases_held(), 0);
}

#[tokio::test]
async fn an_unparseable_status_is_counted_and_never_taken_for_an_answer() {
    let metrics = crate::service::metrics_handle();
    let (router, mut client) = serve().await;
    let (stream, _) = route(&mut client, "u").await;
    observe(&mut client, "u", "127.0.0.1:8001", "abc").await;
    assert_eq!(counts(&router), [(1, 0), (0, 0)], "its first byte still counts");
    stream.close().await;
    assert_eq!(counts(&router), [(0, 0), (0, 0)], "the slot goes back at the end");
    assert_eq!(router.leases_held(), 1, "no status was heard: it waits out its grace, unanswered, not a success");
    let page = metrics.render();
    assert!(page.contains(r#"inferrail_bad_events_total{source="envoy",reason="bad_status"} 1"#), "{page}");
}

#[tokio::test]
async fn a_request_with_no_status_waits_out_its_grace_then_is_forgotten() {
    let (router, mut client) = serve().await;
    let (stream, _) = route(&mut client, "c").await;
    stream.close().await;
    assert_eq!(counts(&router), [(0, 0), (0, 0)], "the slot goes back at the end");
    router.sweep();
    assert_eq!(router.leases_held(), 1, "its status may still be on its way");
    router.sweep_at(router.now() + std::time::Duration::from_secs(1));
    assert_eq!(router.leases_held(), 0, "the grace is over: counted as unanswered");
    // An observe stream for a request this router no longer tracks, or never decided, changes nothing.
    observe(&mut client, "unknown", "127.0.0.1:8001", "200").await;
    assert_eq!(counts(&router), [(0, 0), (0, 0)]);
}

/// A stream as an Inference Extension gateway opens it: full-duplex bodies both ways.
fn full_duplex(request: Request) -> ProcessingRequest {
    let mode = BodySendMode::FullDuplexStreamed as i32;
    let protocol_config = Some(ProtocolConfiguration { request_body_mode: mode, response_body_mode: mode, ..Default::default() });
    ProcessingRequest { protocol_config, request: Some(request), ..Default::default() }
}

fn message(request: Request) -> ProcessingRequest {
    ProcessingRequest { request: Some(request), ..Default::default() }
}

fn body(bytes: &[u8], end_of_stream: bool) -> HttpBody {
    HttpBody { body: bytes.to_vec(), end_of_stream, ..Default::default() }
}

/// The bytes of a streamed body answer, and whether it ends the stream.
fn echoed(answer: ProcessingResponse) -> (Vec<u8>, bool) {
    let (Some(Response::RequestBody(b)) | Some(Response::ResponseBody(b))) = answer.response else { panic!("a body answer: {answer:?}") };
    let Some(body_mutation::Mutation::StreamedResponse(s)) = b.response.unwrap().body_mutation.unwrap().mutation else {
        panic!("a streamed body")
    };
    (s.body, s.end_of_stream)
}

#[tokio::test]
async fn a_full_duplex_stream_holds_the_headers_for_the_decision_and_echoes_both_bodies() {
    let (router, mut client) = serve().await;
    let mut stream = Stream::open(&mut client).await;
    let head = headers(&[(":method", "POST"), (":path", "/v1/completions"), ("x-request-id", "fd")]);
    stream.send(full_duplex(Request::RequestHeaders(HttpHeaders { headers: head, ..Default::default() }))).await;
    let sent: &[&[u8]] = &[br#"{"model": "m", "prompt": "tell me"#, br#" about otters", "max_tokens": 4}"#];
    stream.send(message(Request::RequestBody(body(sent[0], false)))).await;
    stream.send(message(Request::RequestBody(body(sent[1], true)))).await;
    // The first answer is the held headers', with the decision.
    let decided = stream.rx.message().await.unwrap().unwrap();
    let Some(Response::RequestHeaders(h)) = &decided.response else { panic!("the headers' answer first: {decided:?}") };
    let set = &h.response.as_ref().unwrap().header_mutation.as_ref().unwrap().set_headers;
    let destination = set.iter().map(|o| o.header.as_ref().unwrap()).find(|h| h.key == crate::decision::DESTINATION).unwrap();
    assert_eq!(destination.raw_value, b"127.0.0.1:8001,127.0.0.1:8002");
    let lb = &decided.dynamic_metadata.as_ref().unwrap().fields["envoy.lb"];
    let Some(Kind::StructValue(lb)) = &lb.kind else { panic!("envoy.lb is a struct") };
    let Some(Kind::StringValue(targets)) = &lb.fields[crate::decision::DESTINATION].kind else { panic!("a string") };
    assert_eq!(targets.as_bytes(), destination.raw_value, "the header and the metadata say the same");
    let (echo, end) = echoed(stream.rx.message().await.unwrap().unwrap());
    assert_eq!((echo, end), (sent.concat(), true), "the body goes on unchanged");
    assert_eq!(counts(&router), [(1, 1), (0, 0)]);
    // The gateway retried on the fallback and says so in envoy.lb.
    let served = Struct { fields: HashMap::from([("x-gateway-destination-endpoint-served".to_string(), string("127.0.0.1:8002"))]) };
    let metadata_context = Some(Metadata { filter_metadata: HashMap::from([("envoy.lb".to_string(), served)]), ..Default::default() });
    let status = HttpHeaders { headers: headers(&[(":status", "200")]), ..Default::default() };
    stream.send(ProcessingRequest { metadata_context, request: Some(Request::ResponseHeaders(status)), ..Default::default() }).await;
    assert!(matches!(stream.rx.message().await.unwrap().unwrap().response, Some(Response::ResponseHeaders(_))));
    assert_eq!(counts(&router), [(0, 0), (1, 1)], "the request moved to the replica that served");
    let chunks: [&[u8]; 2] = [
        b"data: {\"choices\":[{\"text\":\" Otters\"}],\"usage\":null}\n\n",
        b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":4,\"prompt_tokens_details\":{\"cached_tokens\":0}}}\n\ndata: [DONE]\n\n",
    ];
    for (i, chunk) in chunks.iter().enumerate() {
        stream.send(message(Request::ResponseBody(body(chunk, i == 1)))).await;
        assert_eq!(echoed(stream.rx.message().await.unwrap().unwrap()), (chunk.to_vec(), i == 1), "every response byte goes back");
        assert_eq!(counts(&router)[1], (1 - i as u32, 0), "its first byte came; its end with the last");
    }
    stream.close().await;
    assert_eq!(counts(&router), [(0, 0), (0, 0)]);
    assert_eq!(router.leases_held(), 0, "its end, status and first byte all came on the one stream");
}

#[tokio::test]
async fn a_full_duplex_request_the_router_refuses_gets_its_answer_once_the_body_is_in() {
    let (router, mut client) = serve().await;
    let mut stream = Stream::open(&mut client).await;
    let head = headers(&[(":method", "POST"), (":path", "/v1/completions")]);
    stream.send(full_duplex(Request::RequestHeaders(HttpHeaders { headers: head, ..Default::default() }))).await;
    stream.send(message(Request::RequestBody(body(br#"{"model": "huge", "prompt": "x"}"#, true)))).await;
    let answer = stream.rx.message().await.unwrap().unwrap();
    let Some(Response::ImmediateResponse(refused)) = answer.response else { panic!("an immediate answer: {answer:?}") };
    assert_eq!(refused.status.unwrap().code, 404);
    assert!(String::from_utf8(refused.body).unwrap().contains("The model `huge` does not exist."));
    stream.close().await;
    assert_eq!(router.leases_held(), 0);
}

#[test]
fn usage_is_read_from_an_sse_streams_last_chunk_or_a_json_answer() {
    let sse = b"data: {\"usage\":null}\n\ndata: {\"usage\": {\"prompt_tokens\": 900, \"completion_tokens\": 3, \"prompt_tokens_details\": {\"cached_tokens\": 880}}}\n\ndata: [DONE]\n\n";
    assert_eq!(usage(sse), Some(Usage { prompt_tokens: 900, cached_tokens: 880, completion_tokens: 3 }));
    let json = br#"{"id":"cmpl-1","choices":[],"usage":{"prompt_tokens":12,"total_tokens":14,"completion_tokens":2,"prompt_tokens_details":null}}"#;
    assert_eq!(usage(json), Some(Usage { prompt_tokens: 12, cached_tokens: 0, completion_tokens: 2 }));
    assert_eq!(usage(b"data: {\"usage\":null}\n\n"), None, "a stream without usage reports none");
    assert_eq!(usage(b"{\"usage\":{\"prompt_tok"), None, "cut off");
}

#[tokio::test]
async fn a_full_duplex_request_with_trailers_leaves_the_end_of_its_body_to_them() {
    let (router, mut client) = serve().await;
    let mut stream = Stream::open(&mut client).await;
    let head = headers(&[(":method", "POST"), (":path", "/v1/completions")]);
    stream.send(full_duplex(Request::RequestHeaders(HttpHeaders { headers: head, ..Default::default() }))).await;
    let sent = br#"{"model": "m", "prompt": "x"}"#;
    stream.send(message(Request::RequestBody(body(sent, false)))).await;
    stream.send(message(Request::RequestTrailers(Default::default()))).await;
    assert!(matches!(stream.rx.message().await.unwrap().unwrap().response, Some(Response::RequestHeaders(_))));
    assert_eq!(echoed(stream.rx.message().await.unwrap().unwrap()), (sent.to_vec(), false), "the trailers end the request");
    assert!(matches!(stream.rx.message().await.unwrap().unwrap().response, Some(Response::RequestTrailers(_))));
    stream.close().await;
    assert_eq!(router.leases_held(), 1, "no response came: its grace has begun");
}

/// Request metadata carrying a gateway's subset hint.
fn subset_hint(hint: Value) -> Option<Metadata> {
    let fields = HashMap::from([("x-gateway-destination-endpoint-subset".to_string(), hint)]);
    Some(Metadata { filter_metadata: HashMap::from([("envoy.lb.subset_hint".to_string(), Struct { fields })]), ..Default::default() })
}

/// Sends a full-duplex completion with `metadata`; returns the first answer.
async fn picked(client: &mut ExternalProcessorClient<Channel>, metadata: Option<Metadata>) -> ProcessingResponse {
    let mut stream = Stream::open(client).await;
    let head = headers(&[(":method", "POST"), (":path", "/v1/completions")]);
    let first = ProcessingRequest {
        metadata_context: metadata,
        ..full_duplex(Request::RequestHeaders(HttpHeaders { headers: head, ..Default::default() }))
    };
    stream.send(first).await;
    stream.send(message(Request::RequestBody(body(br#"{"model": "m", "prompt": "x"}"#, true)))).await;
    stream.rx.message().await.unwrap().unwrap()
}

#[tokio::test]
async fn a_subset_hint_limits_the_pick_and_one_naming_no_replica_gets_a_503() {
    let (_router, mut client) = serve().await;
    let list = Value { kind: Some(Kind::ListValue(ListValue { values: vec![string("127.0.0.1:8002"), string("10.1.1.1:80")] })) };
    for hint in [list, string("127.0.0.1:8002, 10.1.1.1:80")] {
        for _ in 0..2 {
            let answer = picked(&mut client, subset_hint(hint.clone())).await;
            let lb = &answer.dynamic_metadata.unwrap().fields["envoy.lb"];
            let Some(Kind::StructValue(lb)) = &lb.kind else { panic!("envoy.lb is a struct") };
            let Some(Kind::StringValue(targets)) = &lb.fields[crate::decision::DESTINATION].kind else { panic!("a string") };
            assert_eq!(targets, "127.0.0.1:8002", "only the offered replica, round robin or not");
        }
    }
    for hint in [Value { kind: Some(Kind::ListValue(ListValue::default())) }, string("10.1.1.1:80")] {
        let answer = picked(&mut client, subset_hint(hint)).await;
        let Some(Response::ImmediateResponse(refused)) = answer.response else { panic!("an immediate answer: {answer:?}") };
        assert_eq!(refused.status.unwrap().code, 503);
        assert!(String::from_utf8(refused.body).unwrap().contains("among the endpoints the gateway offered"));
    }
}

/// Two routers that name each other as peers, each behind its own loopback
/// ext_proc server (the peer service beside it), linked both ways.
async fn serve_pair(policy: &str) -> [(Arc<Router>, ExternalProcessorClient<Channel>); 2] {
    let listeners =
        [tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap(), tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap()];
    let addrs: Vec<std::net::SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    let mut pair = Vec::new();
    for (k, listener) in listeners.into_iter().enumerate() {
        let config = format!(
            "server: {{listen: '{}'}}\npeers: {{addresses: ['{}', '{}'], resolve_interval_ms: 20}}\n\
             models: [{{name: m, policy: {policy}, tokenizer: 'builtin:sim'}}]\nreplicas:\n\
             - {{id: r1, address: 127.0.0.1:8001, models: [m], block_size: 4, kv_blocks: 64}}\n\
             - {{id: r2, address: 127.0.0.1:8002, models: [m], block_size: 4, kv_blocks: 64}}\n",
            addrs[k], addrs[0], addrs[1]
        );
        let router = Arc::new(Router::new(Config::parse(&config).unwrap()).unwrap());
        let models = Arc::new(arc_swap::ArcSwap::from_pointee(String::new()));
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
        let server = tonic::transport::Server::builder()
            .add_service(ExternalProcessorServer::new(ExtProc::new(crate::front::Front::new(router.clone(), models))))
            .add_service(inferrail_proto::peer::v1::peer_server::PeerServer::new(crate::peers::service::PeerService::new(router.clone())));
        tokio::spawn(server.serve_with_incoming(incoming));
        tokio::spawn(crate::peers::dial::run(router.clone(), None));
        pair.push(router);
    }
    while pair.iter().any(|r| r.peers.linked() < 1) {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let mut out = Vec::new();
    for (router, addr) in pair.into_iter().zip(addrs) {
        out.push((router, ExternalProcessorClient::connect(format!("http://{addr}")).await.unwrap()));
    }
    out.try_into().unwrap_or_else(|_| unreachable!())
}

/// Waits until `done` holds (a peer's message crossing loopback).
async fn until(mut done: impl FnMut() -> bool) {
    while !done() {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

/// The `inferrail` metadata of a decision's answer, as the observe filter forwards it.
fn decision_metadata(answer: &ProcessingResponse) -> Metadata {
    let ours = &answer.dynamic_metadata.as_ref().unwrap().fields["inferrail"];
    let Some(Kind::StructValue(ours)) = &ours.kind else { panic!("inferrail is a struct") };
    Metadata { filter_metadata: HashMap::from([("inferrail".to_string(), ours.clone())]), ..Default::default() }
}

#[tokio::test]
async fn with_two_routers_each_holds_the_others_requests_and_the_decider_hears_what_the_other_heard() {
    let [(a, mut client_a), (b, mut client_b)] = serve_pair("kv_aware").await;
    assert_ne!(a.peers.id, b.peers.id);
    // Decided by A: B mirrors it (its slot, its KV record) from A's word.
    let mut stream = Stream::open(&mut client_a).await;
    let head = headers(&[(":method", "POST"), (":path", "/v1/completions"), ("x-request-id", "q")]);
    stream
        .send(ProcessingRequest {
            request: Some(Request::RequestHeaders(HttpHeaders { headers: head, ..Default::default() })),
            ..Default::default()
        })
        .await;
    stream.rx.message().await.unwrap().unwrap();
    let body = br#"{"model": "m", "prompt": "tell me about otters, all of them, at length", "max_tokens": 4}"#.to_vec();
    stream
        .send(ProcessingRequest {
            request: Some(Request::RequestBody(HttpBody { body: body.clone(), end_of_stream: true, ..Default::default() })),
            ..Default::default()
        })
        .await;
    let decided = stream.rx.message().await.unwrap().unwrap();
    let metadata = decision_metadata(&decided);
    let winner = a.fleet().replicas.iter().position(|r| r.in_flight() == 1).expect("A leased a replica");
    until(|| b.leases_held() == 1).await;
    assert_eq!(counts(&b), counts(&a), "B counts A's request on the same replica");
    // Envoy sent the observe stream to B: the status and first byte reach A, and come back to B's mirror.
    let upstream = a.fleet().replicas[winner].addr.to_string();
    observe_with(&mut client_b, "q", &upstream, "200", Some(metadata)).await;
    until(|| a.fleet().replicas[winner].pending() == 0 && b.fleet().replicas[winner].pending() == 0).await;
    assert_eq!(a.leases_held(), 1, "A waits for the end: the route stream is still open");
    stream.close().await;
    until(|| a.leases_held() == 0 && b.leases_held() == 0).await;
    assert_eq!(counts(&a), [(0, 0), (0, 0)]);
    assert_eq!(counts(&b), [(0, 0), (0, 0)], "B released its mirror when A told it the end");
    // The engine answered: the prompt stays recorded at the winner in both routers' indexes (not taken back).
    for router in [&a, &b] {
        let explained = router.explain(&body, inferrail_tokenize::chat::Endpoint::Completions, None, &Default::default()).await.unwrap();
        let i = explained.plan.fleet.serving(0).iter().position(|r| r.addr.to_string() == upstream).unwrap();
        assert!(
            explained.plan.candidates[i].cached_tokens > 0,
            "the prompt is predicted cached at the winner: {:?}",
            explained.plan.candidates
        );
    }
}

#[tokio::test]
async fn a_peer_that_goes_takes_its_mirrors_with_it() {
    let [(a, mut client_a), (b, _)] = serve_pair("round_robin").await;
    let (stream, _) = route(&mut client_a, "p").await;
    until(|| b.leases_held() == 1).await;
    assert_eq!(counts(&b), counts(&a));
    // A's stream to B ends (A is gone, as far as B can tell): nobody is left to tell B the request's end.
    a.peers.close();
    until(|| b.leases_held() == 0).await;
    assert_eq!(counts(&b), [(0, 0), (0, 0)], "B's mirror released its slot");
    assert_eq!(a.leases_held(), 1, "A still holds its own request");
    stream.close().await;
}

/// Envoy's answer-awaited response headers on the route stream, from `upstream`.
async fn response_headers(stream: &mut Stream, upstream: &str, status: &str) {
    let fields = HashMap::from([("upstream.address".to_string(), string(upstream))]);
    let attributes = HashMap::from([("envoy.filters.http.ext_proc".to_string(), Struct { fields })]);
    let head = HttpHeaders { headers: headers(&[(":status", status)]), ..Default::default() };
    stream.send(ProcessingRequest { attributes, request: Some(Request::ResponseHeaders(head)), ..Default::default() }).await;
    let answer = stream.rx.message().await.unwrap().unwrap();
    assert!(matches!(answer.response, Some(Response::ResponseHeaders(_))), "Envoy waits for this answer");
}

/// An access-log record of request `id` whose first body byte came `ago`.
fn log_record(
    router: &Router,
    id: &str,
    ago: std::time::Duration,
) -> opentelemetry_proto::tonic::collector::logs::v1::ExportLogsServiceRequest {
    use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
    use opentelemetry_proto::tonic::logs::v1::{LogRecord, ResourceLogs, ScopeLogs};
    let first_byte = std::time::SystemTime::now() - ago;
    let started = first_byte - std::time::Duration::from_millis(5);
    let text = |k: &str, v: String| KeyValue { key: k.into(), value: Some(AnyValue { value: Some(any_value::Value::StringValue(v)) }) };
    let record = LogRecord {
        time_unix_nano: started.duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64,
        attributes: vec![
            text(crate::access_log::attribute::REQUEST_ID, id.into()),
            text(crate::access_log::attribute::ROUTER, format!("{:016x}", router.peers.id)),
            text(crate::access_log::attribute::FIRST_BODY_US, "5000".into()),
        ],
        ..Default::default()
    };
    let scope = ScopeLogs { log_records: vec![record], ..Default::default() };
    opentelemetry_proto::tonic::collector::logs::v1::ExportLogsServiceRequest {
        resource_logs: vec![ResourceLogs { scope_logs: vec![scope], ..Default::default() }],
    }
}

#[tokio::test]
async fn the_route_stream_hears_the_status_and_a_retry_and_the_access_log_the_first_byte() {
    use opentelemetry_proto::tonic::collector::logs::v1::logs_service_server::LogsService;
    let (router, mut client) = serve().await;
    let (mut stream, _) = route(&mut client, "e").await;
    response_headers(&mut stream, "127.0.0.1:8002", "200").await;
    assert_eq!(counts(&router), [(0, 0), (1, 1)], "Envoy retried on the fallback: the request moved, not yet streaming");
    stream.close().await;
    assert_eq!(counts(&router), [(0, 0), (0, 0)], "the slot goes back at the end");
    assert_eq!(router.leases_held(), 1, "the first byte is still to come, in the access log");
    let log = crate::access_log::AccessLog::new(router.clone());
    log.export(tonic::Request::new(log_record(&router, "e", std::time::Duration::ZERO))).await.unwrap();
    assert_eq!(router.leases_held(), 0, "status, end and first byte known: counted and forgotten");
}

#[tokio::test]
async fn an_access_log_record_of_an_earlier_request_with_the_same_id_is_not_the_new_ones() {
    use opentelemetry_proto::tonic::collector::logs::v1::logs_service_server::LogsService;
    let (router, mut client) = serve().await;
    let (stream, _) = route(&mut client, "f").await;
    let log = crate::access_log::AccessLog::new(router.clone());
    // A record of a request that took the id before: its first byte came before this decision.
    log.export(tonic::Request::new(log_record(&router, "f", std::time::Duration::from_secs(3600)))).await.unwrap();
    assert_eq!(counts(&router), [(1, 1), (0, 0)], "still waiting for its own first byte");
    log.export(tonic::Request::new(log_record(&router, "f", std::time::Duration::ZERO))).await.unwrap();
    assert_eq!(counts(&router), [(1, 0), (0, 0)], "its own first byte");
    stream.close().await;
}

#[tokio::test]
async fn a_route_filter_set_to_send_the_response_body_and_trailers_gets_each_answered_at_once() {
    let (router, mut client) = serve().await;
    let (mut stream, _) = route(&mut client, "g").await;
    response_headers(&mut stream, "127.0.0.1:8001", "200").await;
    let chunk = HttpBody { body: b"data: {}\n\n".to_vec(), ..Default::default() };
    stream.send(ProcessingRequest { request: Some(Request::ResponseBody(chunk)), ..Default::default() }).await;
    let answer = stream.rx.message().await.unwrap().unwrap();
    assert!(matches!(answer.response, Some(Response::ResponseBody(BodyResponse { response: None }))), "let through unchanged");
    assert_eq!(counts(&router), [(1, 0), (0, 0)], "the first body chunk is the first byte");
    stream.send(ProcessingRequest { request: Some(Request::ResponseTrailers(Default::default())), ..Default::default() }).await;
    let answer = stream.rx.message().await.unwrap().unwrap();
    assert!(matches!(answer.response, Some(Response::ResponseTrailers(_))));
    stream.close().await;
    assert_eq!(router.leases_held(), 0);
}

/// One message Envoy might send, in any order.
#[derive(Debug, Clone)]
enum Piece {
    RequestHeaders { path: &'static str, end: bool },
    RequestBody { body: &'static [u8], end: bool },
    RequestTrailers,
    ResponseHeaders { status: &'static str, end: bool },
    ResponseBody { body: &'static [u8], end: bool },
    ResponseTrailers,
    Nothing,
}

fn piece() -> impl proptest::strategy::Strategy<Value = Piece> {
    use proptest::prelude::*;
    let path = proptest::sample::select(vec!["/v1/completions", "/v1/chat/completions", "/v1/models", "/nope", ""]);
    let body = proptest::sample::select(vec![
        &br#"{"model": "m", "prompt": "otters", "max_tokens": 4}"#[..],
        &br#"{"model": "m", "messages": [{"role": "user", "content": "hi"}]}"#[..],
        &br#"{"model": 5}"#[..],
        &b"{not json"[..],
        &b""[..],
        &b"\xff\xfe\x00"[..],
        &b"data: {\"usage\": {\"prompt_tokens\": 3, \"completion_tokens\": 1}}\n\n"[..],
    ]);
    let status = proptest::sample::select(vec!["200", "503", "404", "abc", "", "99999", "-1"]);
    prop_oneof![
        (path, any::<bool>()).prop_map(|(path, end)| Piece::RequestHeaders { path, end }),
        (body.clone(), any::<bool>()).prop_map(|(body, end)| Piece::RequestBody { body, end }),
        Just(Piece::RequestTrailers),
        (status, any::<bool>()).prop_map(|(status, end)| Piece::ResponseHeaders { status, end }),
        (body, any::<bool>()).prop_map(|(body, end)| Piece::ResponseBody { body, end }),
        Just(Piece::ResponseTrailers),
        Just(Piece::Nothing),
    ]
}

fn envoy_message(piece: &Piece, duplex: bool, id: &str) -> ProcessingRequest {
    let request = match *piece {
        Piece::RequestHeaders { path, end } => Request::RequestHeaders(HttpHeaders {
            headers: headers(&[(":method", "POST"), (":path", path), ("x-request-id", id)]),
            end_of_stream: end,
            ..Default::default()
        }),
        Piece::RequestBody { body: b, end } => Request::RequestBody(body(b, end)),
        Piece::RequestTrailers => Request::RequestTrailers(Default::default()),
        Piece::ResponseHeaders { status, end } => {
            Request::ResponseHeaders(HttpHeaders { headers: headers(&[(":status", status)]), end_of_stream: end, ..Default::default() })
        }
        Piece::ResponseBody { body: b, end } => Request::ResponseBody(body(b, end)),
        Piece::ResponseTrailers => Request::ResponseTrailers(Default::default()),
        Piece::Nothing => return ProcessingRequest::default(),
    };
    if duplex { full_duplex(request) } else { message(request) }
}

/// Envoy's messages in any order, truncated or repeated, in both body
/// modes: every stream ends, nothing panics, and once every request is
/// over and its longest life has passed, no lease, slot or pending count
/// is left behind.
#[test]
fn extproc_messages_in_any_order_end_every_stream_and_leave_nothing_held() {
    use proptest::strategy::Strategy;
    static PANICS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        hook(info);
    }));
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let (router, client) = runtime.block_on(serve());
    let config = proptest::test_runner::Config { cases: 96, ..Default::default() };
    let mut runner = proptest::test_runner::TestRunner::new(config);
    // A well-formed exchange cut anywhere, then anything, with two messages swapped at times.
    let script = |end: bool| {
        vec![
            Piece::RequestHeaders { path: "/v1/completions", end: false },
            Piece::RequestBody { body: br#"{"model": "m", "prompt": "otters", "max_tokens": 4}"#, end: true },
            Piece::ResponseHeaders { status: "200", end: false },
            Piece::ResponseBody { body: b"data: {\"usage\": {\"prompt_tokens\": 3, \"completion_tokens\": 1}}\n\n", end },
        ]
    };
    let stream = (proptest::bool::ANY, 0usize..=4, proptest::collection::vec(piece(), 0..5), proptest::option::of((0usize..8, 0usize..8)))
        .prop_map(move |(duplex, cut, tail, swap)| {
            let mut pieces: Vec<Piece> = script(duplex).into_iter().take(cut).chain(tail).collect();
            if let Some((i, j)) = swap.filter(|&(i, j)| i < pieces.len() && j < pieces.len()) {
                pieces.swap(i, j);
            }
            (duplex, pieces)
        });
    let streams = proptest::collection::vec(stream, 1..4);
    let (n, decided) = (std::sync::atomic::AtomicUsize::new(0), std::sync::atomic::AtomicUsize::new(0));
    runner
        .run(&streams, |streams| {
            runtime.block_on(async {
                for (duplex, pieces) in streams {
                    let id = format!("fuzz-{}", n.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
                    // Room for every message: a server that stopped reading never blocks the sender.
                    let (tx, rx) = mpsc::channel(pieces.len() + 1);
                    let mut answers = client.clone().process(ReceiverStream::new(rx)).await.unwrap().into_inner();
                    for p in &pieces {
                        tx.try_send(envoy_message(p, duplex, &id)).unwrap();
                    }
                    drop(tx);
                    // Every stream ends, whatever it was sent.
                    while let Ok(Some(answer)) = answers.message().await {
                        if answer.dynamic_metadata.is_some_and(|m| m.fields.contains_key("envoy.lb")) {
                            decided.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                    }
                }
            });
            router.sweep_at(router.now() + std::time::Duration::from_secs(3_601));
            proptest::prop_assert_eq!(router.leases_held(), 0);
            proptest::prop_assert_eq!(counts(&router), [(0, 0), (0, 0)]);
            proptest::prop_assert_eq!(
                router.fleet().replicas.iter().map(|r| r.queued_prefill()).sum::<std::time::Duration>(),
                std::time::Duration::ZERO
            );
            Ok(())
        })
        .unwrap();
    assert_eq!(PANICS.load(std::sync::atomic::Ordering::SeqCst), 0, "no task panicked");
    // Not vacuous: some of the streams got as far as a decision.
    let decided = decided.load(std::sync::atomic::Ordering::Relaxed);
    assert!(decided > 0, "{decided} of {} streams decided", n.load(std::sync::atomic::Ordering::Relaxed));
    eprintln!("{decided} of {} streams decided", n.load(std::sync::atomic::Ordering::Relaxed));
}
