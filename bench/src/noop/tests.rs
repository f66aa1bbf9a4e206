//! The no-op processor over loopback gRPC with the generated client, and
//! through a real Envoy with inferrail's filters in front of simulators.

use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{HttpBody, HttpHeaders};

use super::*;
use crate::processes::{self, Processes};

async fn started() -> anyhow::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(serve(listener));
    Ok(addr)
}

fn message(request: Request, observability_mode: bool) -> ProcessingRequest {
    ProcessingRequest { request: Some(request), observability_mode, ..Default::default() }
}

#[tokio::test]
async fn every_phase_continues_unchanged_and_observe_streams_get_no_answer() -> anyhow::Result<()> {
    let addr = started().await?;
    let mut client = ExternalProcessorClient::connect(format!("http://{addr}")).await?;
    let route = vec![
        message(Request::RequestHeaders(HttpHeaders::default()), false),
        message(Request::RequestBody(HttpBody { body: b"{}".to_vec(), end_of_stream: true, ..Default::default() }), false),
    ];
    let mut answers = client.process(tokio_stream::iter(route)).await?.into_inner();
    let first = answers.message().await?.and_then(|m| m.response);
    let Some(Response::RequestHeaders(HeadersResponse { response: Some(headers) })) = first else {
        anyhow::bail!("the headers got {first:?}")
    };
    assert_eq!(headers, CommonResponse::default(), "CONTINUE, no mutation");
    let second = answers.message().await?.and_then(|m| m.response);
    assert!(matches!(second, Some(Response::RequestBody(BodyResponse { response: Some(ref b) })) if *b == CommonResponse::default()));
    assert!(answers.message().await?.is_none(), "one answer a message, then the stream ends with the request's");

    let observe = vec![message(Request::ResponseHeaders(HttpHeaders::default()), true)];
    let mut answers = client.process(tokio_stream::iter(observe)).await?.into_inner();
    assert!(answers.message().await?.is_none(), "observability mode is never answered");
    Ok(())
}

/// A port free now (bound, then released) for a process that needs it named.
fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_passes_through_envoy_with_the_noop_processor() -> anyhow::Result<()> {
    let envoy = std::path::Path::new("../.venv/bin/envoy");
    anyhow::ensure!(envoy.exists(), "{} is missing: run `just setup`", envoy.display());
    let mut sims = Vec::new();
    for _ in 0..3 {
        sims.push(inferrail_sim::Sim::start(inferrail_sim::args::Args::for_test(&["--zero-latency"])).await?);
    }
    let processor = started().await?;
    let (entry, admin) = (free_port()?, free_port()?);
    let mut moves = vec![(8080, entry), (9901, admin), (9002, processor.port())];
    moves.extend(sims.iter().zip([8001, 8002, 8003]).map(|(s, from)| (from, s.addr.port())));
    let logs = std::env::temp_dir().join(format!("inferrail-noop-test-{}", std::process::id()));
    std::fs::create_dir_all(&logs)?;
    let config = logs.join("envoy.yaml");
    std::fs::write(&config, processes::envoy_config("../envoy/local.yaml", &moves)?)?;
    let mut fleet = Processes::default();
    let flags = ["-c", &config.display().to_string(), "--disable-hot-restart", "--log-level", "warn", "--concurrency", "1"];
    fleet.spawn("envoy", &logs, envoy, &flags.map(str::to_string))?;
    let http = reqwest::Client::new();
    let body =
        serde_json::json!({"model": "inferrail/sim-8b", "messages": [{"role": "user", "content": "through envoy"}], "max_tokens": 2});
    let url = format!("http://127.0.0.1:{entry}/v1/chat/completions");
    let mut answered = None;
    processes::until(&mut fleet, Duration::from_secs(30), "an answer through Envoy", async || {
        match http.post(&url).json(&body).timeout(Duration::from_secs(2)).send().await {
            Ok(r) if r.status().is_success() => {
                answered = Some((r.headers().get("x-inferrail-replica").is_some(), r.json::<serde_json::Value>().await.ok()));
                true
            }
            _ => false,
        }
    })
    .await?;
    let Some((named, Some(json))) = answered else { anyhow::bail!("no JSON answer") };
    assert!(!named, "the no-op processor names no replica");
    assert_eq!(json["usage"]["completion_tokens"], 2, "{json}");
    // Envoy really sent the request to the processor: its ext_proc stats count the streams.
    let stats = http.get(format!("http://127.0.0.1:{admin}/stats?filter=ext_proc")).send().await?.text().await?;
    let streams: u64 = stats
        .lines()
        .filter(|l| l.contains("streams_started"))
        .filter_map(|l| l.rsplit_once(": ").and_then(|(_, n)| n.trim().parse::<u64>().ok()))
        .sum();
    assert!(streams >= 1, "{stats}");
    drop(fleet);
    std::fs::remove_dir_all(&logs)?;
    Ok(())
}
