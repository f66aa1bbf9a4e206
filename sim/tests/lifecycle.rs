//! The simulator over HTTP: prefix caching across turns, request ids,
//! clients that go away, injected faults, and stream framing under any
//! chunking.

mod common;

use std::time::Duration;

use common::{LIKE_RECORDING, client, get, json, metric, post, sse_events, start, wait_for_metrics};
use futures_util::StreamExt;
use proptest::prelude::*;
use serde_json::json;

const ABORTS: &str = "engine=\"0\",finished_reason=\"abort\",model_name=\"tiny-qwen3\"";
const ENGINE: &str = "engine=\"0\",model_name=\"tiny-qwen3\"";

#[tokio::test]
async fn a_conversation_reuses_its_earlier_turns() {
    let sim = start(&LIKE_RECORDING).await;
    let system = "You are a careful assistant. ".repeat(40);
    let mut messages = vec![json!({"role": "system", "content": system}), json!({"role": "user", "content": "First question?"})];
    let (_, body) = post(&sim, "/v1/chat/completions", &json!({"model": "tiny-qwen3", "messages": messages, "max_tokens": 40})).await;
    let turn1 = json(&body);
    assert_eq!(turn1["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let reply = turn1["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_string();
    let n1 = turn1["usage"]["prompt_tokens"].as_u64().unwrap_or(0);

    messages.push(json!({"role": "assistant", "content": reply}));
    messages.push(json!({"role": "user", "content": "And a second one?"}));
    let (_, body) = post(&sim, "/v1/chat/completions", &json!({"model": "tiny-qwen3", "messages": messages, "max_tokens": 4})).await;
    let turn2 = json(&body);
    let cached = turn2["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    // Turn 1's prompt and its reply (all but the last generated token) were
    // cached in whole 32-token blocks; the reply retokenizes to the same ids.
    assert_eq!(cached, (n1 + 40 - 1) / 32 * 32, "turn 2 reported {turn2}");
}

#[tokio::test]
async fn cache_salt_separates_prefixes_and_reset_forgets_them() {
    let sim = start(&LIKE_RECORDING).await;
    let prompt = "shared context ".repeat(50);
    let send = |salt: Option<&str>| {
        let mut b = json!({"model": "tiny-qwen3", "prompt": prompt, "max_tokens": 1});
        if let Some(s) = salt {
            b["cache_salt"] = json!(s);
        }
        let sim = &sim;
        async move { json(&post(sim, "/v1/completions", &b).await.1)["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() }
    };
    assert_eq!(send(None).await, Some(0));
    assert!(send(None).await > Some(0));
    assert_eq!(send(Some("tenant-a")).await, Some(0));
    assert!(send(Some("tenant-a")).await > Some(0));
    let (status, _) = post(&sim, "/reset_prefix_cache", &json!({})).await;
    assert_eq!(status, 200);
    assert_eq!(send(None).await, Some(0));
}

#[tokio::test]
async fn the_request_id_header_names_the_response() {
    let sim = start(&LIKE_RECORDING).await;
    let r = client()
        .post(format!("{}/v1/chat/completions", sim.url()))
        .header("x-request-id", "req-42")
        .json(&json!({"model": "tiny-qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}))
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.headers().get("x-request-id").and_then(|v| v.to_str().ok()), Some("req-42"));
    assert_eq!(json(&r.text().await.unwrap_or_default())["id"], "chatcmpl-req-42");
}

#[tokio::test]
async fn a_client_that_leaves_mid_stream_frees_its_slot_and_blocks() {
    // Real timing, so the request is still running when the client leaves.
    let sim = start(&["--served-model-name", "tiny-qwen3", "--decode-token-ms", "5", "--max-model-len", "4096"]).await;
    let r = client()
        .post(format!("{}/v1/completions", sim.url()))
        .json(&json!({"model": "tiny-qwen3", "prompt": "a long story", "max_tokens": 2000, "stream": true}))
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut stream = r.bytes_stream();
    let first = stream.next().await;
    assert!(first.is_some_and(|c| c.is_ok()));
    let page = get(&sim, "/metrics").await.1;
    assert_eq!(metric(&page, "vllm:num_requests_running", ENGINE), 1.0);
    assert!(metric(&page, "vllm:kv_cache_usage_perc", ENGINE) > 0.0);
    assert_eq!(json(&get(&sim, "/_sim/requests").await.1), json!({"in_flight": 1, "peak_in_flight": 1}));
    drop(stream);
    let page = wait_for_metrics(&sim, 500, |p| metric(p, "vllm:request_success_total", ABORTS) == 1.0).await;
    assert_eq!(metric(&page, "vllm:num_requests_running", ENGINE), 0.0);
    assert_eq!(metric(&page, "vllm:kv_cache_usage_perc", ENGINE), 0.0);
    assert_eq!(json(&get(&sim, "/_sim/requests").await.1), json!({"in_flight": 0, "peak_in_flight": 1}), "the peak stays");
}

#[tokio::test]
async fn a_client_that_gives_up_on_a_whole_response_aborts_it() {
    let sim = start(&["--served-model-name", "tiny-qwen3", "--decode-token-ms", "5", "--max-model-len", "4096"]).await;
    let http = reqwest::Client::builder().timeout(Duration::from_millis(200)).build().unwrap_or_default();
    let r = http
        .post(format!("{}/v1/completions", sim.url()))
        .json(&json!({"model": "tiny-qwen3", "prompt": "a long story", "max_tokens": 3000}))
        .send()
        .await;
    assert!(r.is_err_and(|e| e.is_timeout()));
    let page = wait_for_metrics(&sim, 500, |p| metric(p, "vllm:request_success_total", ABORTS) == 1.0).await;
    assert_eq!(metric(&page, "vllm:num_requests_running", ENGINE) + metric(&page, "vllm:num_requests_waiting", ENGINE), 0.0);
    assert_eq!(get(&sim, "/load").await.1, r#"{"server_load":0}"#);
}

async fn set_fault(sim: &inferrail_sim::Sim, fault: serde_json::Value) {
    let (status, body) = post(sim, "/_sim/fault", &fault).await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test]
async fn faults_make_the_engine_misbehave_on_demand() {
    let sim = start(&LIKE_RECORDING).await;
    // A hung request is seen as a client timeout; it is generous so that a
    // slow machine never mistakes a healthy answer for a hang.
    let http = reqwest::Client::builder().timeout(Duration::from_secs(2)).pool_max_idle_per_host(0).build().unwrap_or_default();
    let url = format!("{}/v1/completions", sim.url());
    let req = json!({"model": "tiny-qwen3", "prompt": "x", "max_tokens": 1});
    let send = || http.post(&url).json(&req).send();

    set_fault(&sim, json!({"mode": "error", "status": 503})).await;
    let r = send().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.status().as_u16(), 503);
    assert_eq!(json(&r.text().await.unwrap_or_default())["error"]["code"], 503);

    set_fault(&sim, json!({"mode": "close"})).await;
    let e = send().await.expect_err("the connection is closed without an answer");
    assert!(!e.is_timeout(), "{e}");

    set_fault(&sim, json!({"mode": "hang"})).await;
    assert!(send().await.is_err_and(|e| e.is_timeout()));

    set_fault(&sim, json!({"mode": "delay", "ms": 10})).await;
    assert_eq!(send().await.map(|r| r.status().as_u16()).ok(), Some(200));

    set_fault(&sim, json!({"mode": "refuse", "for_ms": 300})).await;
    let e = send().await.expect_err("connections are refused");
    assert!(e.is_connect(), "{e}");
    // It clears itself and the port is served again.
    let mut back = false;
    for _ in 0..200 {
        if send().await.is_ok_and(|r| r.status().is_success()) {
            back = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(back, "the simulator never accepted connections again");

    set_fault(&sim, json!({"mode": "flap", "period_ms": 40, "status": 500})).await;
    let (mut up, mut down) = (0, 0);
    for _ in 0..400 {
        match send().await.map(|r| r.status().as_u16()) {
            Ok(200) => up += 1,
            Ok(500) => down += 1,
            other => panic!("unexpected {other:?}"),
        }
        if up > 0 && down > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(up > 0 && down > 0, "flap gave {up} up and {down} down");

    set_fault(&sim, json!({"mode": "none"})).await;
    assert_eq!(send().await.map(|r| r.status().as_u16()).ok(), Some(200));
    let (status, _) = post(&sim, "/_sim/fault", &json!({"mode": "explode"})).await;
    assert_eq!(status, 400);
}

/// Splits `bytes` at the given cut points.
fn rechunk(bytes: &[u8], cuts: &[usize]) -> Vec<Vec<u8>> {
    let mut points: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
    points.sort_unstable();
    points.dedup();
    let mut out = Vec::new();
    let mut last = 0;
    for p in points.into_iter().chain([bytes.len()]) {
        out.push(bytes[last..p].to_vec());
        last = p;
    }
    out
}

fn parse_sse(chunks: Vec<Vec<u8>>) -> Vec<String> {
    use eventsource_stream::Eventsource;
    let stream = futures_util::stream::iter(chunks.into_iter().map(Ok::<_, std::io::Error>)).eventsource();
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap_or_else(|e| panic!("{e}"));
    rt.block_on(stream.map(|e| e.map(|e| e.data).unwrap_or_else(|e| panic!("{e}"))).collect())
}

#[test]
fn streamed_output_parses_the_same_under_any_chunking() {
    let rt = tokio::runtime::Runtime::new().unwrap_or_else(|e| panic!("{e}"));
    let body = rt.block_on(async {
        let sim = start(&LIKE_RECORDING).await;
        let req = json!({"model": "tiny-qwen3", "messages": [{"role": "user", "content": "Tell me, quickly: \u{00e9}t\u{00e9} \u{65e5}\u{672c}"}], "max_tokens": 12, "stream": true,
            "stream_options": {"include_usage": true, "continuous_usage_stats": true}});
        post(&sim, "/v1/chat/completions", &req).await.1
    });
    let whole = sse_events(&body);
    assert_eq!(whole.len(), 1 + 12 + 1 + 1, "role, 12 tokens, usage, [DONE]");
    assert_eq!(parse_sse(vec![body.clone().into_bytes()]), whole);
    proptest!(ProptestConfig::with_cases(200), |(cuts in proptest::collection::vec(any::<usize>(), 0..40))| {
        prop_assert_eq!(parse_sse(rechunk(body.as_bytes(), &cuts)), whole.clone());
    });
}
