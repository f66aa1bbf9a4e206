//! Disaggregated prefill and decode between two simulators, with the bytes
//! vLLM 0.32's NixlConnector and its proxies exchange.
//!
//! The prefill leg's request is what `vllm-router` and vLLM's toy proxy send
//! (`max_tokens: 1`, not streamed, `do_remote_decode`); its response's
//! top-level `kv_transfer_params` are what `NixlConnector.request_finished`
//! returns in vLLM 0.32 (keys in its order, `remote_prefill_cached_tokens`
//! added by the scheduler); the decode leg gets them unchanged.

mod common;

use std::time::Duration;

use common::{get, json, metric, post, sse_events, start, wait_for_metrics};
use inferrail_kv_events::subscribe::{Subscriber, SubscriberConfig};
use inferrail_kv_events::wire::KvEvent;
use inferrail_sim::Sim;
use serde_json::{Value, json};

async fn sim(role: &str, extra: &[&str]) -> Sim {
    sim_with_config(&json!({"kv_connector": "NixlConnector", "kv_role": role}), extra).await
}

/// 4-token blocks, so prompts of token ids fill a known number of blocks.
async fn sim_with_config(config: &Value, extra: &[&str]) -> Sim {
    let c = config.to_string();
    let mut f = vec![
        "--zero-latency",
        "--enable-prompt-tokens-details",
        "--block-size",
        "4",
        "--num-gpu-blocks-override",
        "64",
        "--max-model-len",
        "128",
    ];
    f.extend(["--kv-transfer-config", &c]);
    f.extend(extra);
    start(&f).await
}

fn prompt(n: u32) -> Vec<u32> {
    (0..n).map(|i| 300 + i).collect()
}

/// The prefill leg's body, as the proxies build it from a client's.
fn prefill_body(mut client: Value) -> Value {
    client["stream"] = json!(false);
    client["max_tokens"] = json!(1);
    if let Some(m) = client.as_object_mut() {
        m.remove("stream_options");
        m.remove("min_tokens");
    }
    client["kv_transfer_params"] = json!({
        "do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
        "remote_block_ids": null, "remote_host": null, "remote_port": null,
    });
    client
}

async fn post_id(sim: &Sim, path: &str, body: &Value, id: &str) -> (u16, String) {
    let r = common::client().post(format!("{}{path}", sim.url())).header("x-request-id", id).json(body).send().await;
    let r = r.unwrap_or_else(|e| panic!("POST {path}: {e}"));
    (r.status().as_u16(), r.text().await.unwrap_or_default())
}

/// Runs the prefill leg on `p`; returns its `kv_transfer_params`.
async fn prefill(p: &Sim, path: &str, client: &Value, id: &str) -> Value {
    let (status, text) = post_id(p, path, &prefill_body(client.clone()), id).await;
    assert_eq!(status, 200, "{text}");
    let body = json(&text);
    assert_eq!(body["usage"]["completion_tokens"], 1, "{text}");
    body["kv_transfer_params"].clone()
}

fn with_params(client: &Value, params: &Value) -> Value {
    let mut d = client.clone();
    d["kv_transfer_params"] = params.clone();
    d
}

async fn usage(sim: &Sim) -> f64 {
    metric(&get(sim, "/metrics").await.1, "vllm:kv_cache_usage_perc", "engine=\"0\",model_name=\"inferrail/sim-8b\"")
}

fn counter(page: &str, name: &str) -> f64 {
    metric(page, name, "engine=\"0\",model_name=\"inferrail/sim-8b\"")
}

#[tokio::test]
async fn a_prefill_leg_keeps_its_blocks_and_names_them_as_vllm_does() {
    let p = sim("kv_producer", &[]).await;
    let client = json!({"model": "inferrail/sim-8b", "prompt": prompt(10), "max_tokens": 5});
    let params = prefill(&p, "/v1/completions", &client, "req-1").await;
    let keys: Vec<&str> = params.as_object().map(|m| m.keys().map(String::as_str).collect()).unwrap_or_default();
    assert_eq!(
        keys,
        [
            "do_remote_prefill",
            "do_remote_decode",
            "remote_block_ids",
            "remote_engine_id",
            "remote_request_id",
            "remote_host",
            "remote_port",
            "tp_size",
            "dcp_size",
            "pp_size",
            "remote_num_tokens",
            "remote_blocks_expiry_time",
            "transfer_mode",
            "remote_prefill_cached_tokens"
        ]
    );
    assert_eq!((params["do_remote_prefill"].clone(), params["do_remote_decode"].clone()), (json!(true), json!(false)));
    // Ten tokens in 4-token blocks: three blocks, the last one partial.
    assert_eq!(params["remote_block_ids"].as_array().map(|g| (g.len(), g[0].as_array().map(Vec::len))), Some((1, Some(3))));
    assert_eq!(params["remote_port"], p.addr.port());
    assert_eq!((params["remote_num_tokens"].clone(), params["transfer_mode"].clone()), (json!(10), json!("pull")));
    assert_eq!(params["remote_prefill_cached_tokens"], 0);
    let id = params["remote_request_id"].as_str().unwrap_or_default();
    assert!(id.starts_with("cmpl-req-1-0-") && id.len() == "cmpl-req-1-0-".len() + 8, "{id}");
    assert_eq!(params["remote_engine_id"].as_str().map(str::len), Some(36));
    // The blocks stay in use; a reset is refused while they do.
    assert!(usage(&p).await > 0.0);

    // A chat prefill: its internal id has no prompt index.
    let chat = json!({"model": "inferrail/sim-8b", "messages": [{"role": "user", "content": "hello there"}]});
    let params = prefill(&p, "/v1/chat/completions", &chat, "req-2").await;
    let id = params["remote_request_id"].as_str().unwrap_or_default();
    assert!(id.starts_with("chatcmpl-req-2-") && !id.starts_with("chatcmpl-req-2-0-"), "{id}");

    // Ordinary requests answer null, and so does a streamed prefill leg.
    let (_, text) = post(&p, "/v1/completions", &client).await;
    assert_eq!(json(&text)["kv_transfer_params"], Value::Null);
    let mut streamed = prefill_body(client.clone());
    streamed["stream"] = json!(true);
    let (_, text) = post(&p, "/v1/completions", &streamed).await;
    assert!(!text.contains("kv_transfer_params"), "{text}");
}

#[tokio::test]
async fn a_decode_leg_reads_only_what_it_lacks_and_the_prefill_frees_what_was_read() {
    let p = sim("kv_producer", &[]).await;
    let mut sub = Subscriber::start(&SubscriberConfig::new("tcp://127.0.0.1:0", "kv")).await.unwrap_or_else(|e| panic!("{e}"));
    let events = json!({"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": sub.endpoint(), "topic": "kv"}).to_string();
    let d = sim("kv_consumer", &["--kv-events-config", &events]).await;
    let client = json!({"model": "inferrail/sim-8b", "prompt": prompt(10), "max_tokens": 5});

    let params = prefill(&p, "/v1/completions", &client, "a").await;
    let (status, text) = post_id(&d, "/v1/completions", &with_params(&client, &params), "a").await;
    assert_eq!(status, 200, "{text}");
    let body = json(&text);
    // D generates every token itself and reports P's cached tokens.
    assert_eq!(
        (body["usage"]["completion_tokens"].clone(), body["usage"]["prompt_tokens_details"]["cached_tokens"].clone()),
        (json!(5), json!(0))
    );
    assert_eq!(body["kv_transfer_params"], Value::Null);
    // P freed the blocks once read.
    wait_for_metrics(&p, 200, |page| counter(page, "vllm:kv_cache_usage_perc") == 0.0).await;
    let page = get(&d, "/metrics").await.1;
    assert_eq!(counter(&page, "vllm:nixl_xfer_time_seconds_count"), 1.0);
    assert_eq!(counter(&page, "vllm:nixl_num_descriptors_sum"), 3.0, "all three blocks read");
    assert_eq!(counter(&page, "vllm:nixl_bytes_transferred_sum"), 3.0 * 4.0 * 131_072.0);
    assert_eq!(
        metric(&page, "vllm:prompt_tokens_by_source_total", "engine=\"0\",model_name=\"inferrail/sim-8b\",source=\"external_kv_transfer\""),
        10.0
    );

    // D published the two full blocks it read as its own.
    let mut stored = Vec::new();
    while stored.len() < 2 {
        let (_, batch) = tokio::time::timeout(Duration::from_secs(10), sub.next())
            .await
            .unwrap_or_else(|_| panic!("no KV events from D"))
            .unwrap_or_else(|e| panic!("{e}"));
        for e in batch.events {
            if let KvEvent::BlockStored(s) = e {
                stored.extend(s.token_ids.chunks(4).map(<[u32]>::to_vec));
            }
        }
    }
    assert_eq!(stored[..2], [prompt(4), prompt(8)[4..].to_vec()]);

    // The same id cannot be read twice: P counts the late read.
    let again = json!({"remote_request_id": params["remote_request_id"], "block_ids": params["remote_block_ids"][0], "transfer_s": 0.0});
    let (status, text) = post(&p, "/_sim/nixl/read", &again).await;
    assert_eq!(status, 404, "{text}");
    assert_eq!(counter(&get(&p, "/metrics").await.1, "vllm:nixl_num_notifications_after_expiry_total"), 1.0);

    // A longer prompt sharing D's two cached blocks: P's answer names four
    // blocks, D reads only the two it lacks.
    let longer = json!({"model": "inferrail/sim-8b", "prompt": prompt(14), "max_tokens": 3});
    let params = prefill(&p, "/v1/completions", &longer, "b").await;
    assert_eq!(params["remote_prefill_cached_tokens"], 8, "P had the first two blocks cached too");
    let (status, text) = post_id(&d, "/v1/completions", &with_params(&longer, &params), "b").await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(json(&text)["usage"]["prompt_tokens_details"]["cached_tokens"], 8);
    let page = get(&d, "/metrics").await.1;
    assert_eq!(counter(&page, "vllm:nixl_num_descriptors_sum"), 5.0, "3 then 2 blocks read");
}

#[tokio::test]
async fn kept_blocks_expire_with_the_lease_and_are_counted() {
    let p = sim_with_config(
        &json!({"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_connector_extra_config": {"kv_lease_duration": 0.05}}),
        &[],
    )
    .await;
    let client = json!({"model": "inferrail/sim-8b", "prompt": prompt(10), "max_tokens": 5});
    prefill(&p, "/v1/completions", &client, "x").await;
    let page = wait_for_metrics(&p, 500, |page| counter(page, "vllm:nixl_num_kv_expired_reqs_total") == 1.0).await;
    assert_eq!(counter(&page, "vllm:kv_cache_usage_perc"), 0.0);
    // The blocks stay cached: the next prefill of the prompt finds them.
    let params = prefill(&p, "/v1/completions", &client, "y").await;
    assert_eq!(params["remote_prefill_cached_tokens"], 8);
}

#[tokio::test]
async fn a_failed_read_fails_the_request_or_recomputes_it_as_configured() {
    // A port nothing listens on: the prefill is gone.
    let gone = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).unwrap_or(1);
    let params = json!({
        "do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [[0, 1, 2]], "remote_engine_id": "e",
        "remote_request_id": "cmpl-z-0-00000000", "remote_host": "127.0.0.1", "remote_port": gone, "remote_prefill_cached_tokens": 0,
    });
    let client = json!({"model": "inferrail/sim-8b", "prompt": prompt(10), "max_tokens": 5});
    let d = sim("kv_consumer", &[]).await;
    let (status, text) = post(&d, "/v1/completions", &with_params(&client, &params)).await;
    assert_eq!(
        (status, text.as_str()),
        (500, r#"{"error":{"message":"Internal server error","type":"InternalServerError","param":null,"code":500}}"#)
    );
    let chat = json!({"model": "inferrail/sim-8b", "messages": [{"role": "user", "content": "hi"}], "stream": true});
    let (status, text) = post(&d, "/v1/chat/completions", &with_params(&chat, &params)).await;
    assert_eq!(status, 200);
    let events = sse_events(&text);
    assert_eq!(events.len(), 3, "{text}");
    assert_eq!(json(&events[0])["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(events[1], r#"{"error": {"message": "Internal server error", "type": "InternalServerError", "param": null, "code": 500}}"#);
    assert_eq!(events[2], "[DONE]");
    let page = get(&d, "/metrics").await.1;
    assert_eq!(counter(&page, "vllm:nixl_num_failed_transfers_total"), 2.0);
    assert_eq!(metric(&page, "vllm:request_success_total", "engine=\"0\",finished_reason=\"error\",model_name=\"inferrail/sim-8b\""), 2.0);
    assert_eq!(usage(&d).await, 0.0, "the failed requests' blocks were freed");

    let d =
        sim_with_config(&json!({"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute"}), &[])
            .await;
    let (status, text) = post(&d, "/v1/completions", &with_params(&client, &params)).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(json(&text)["usage"]["completion_tokens"], 5);
    assert_eq!(counter(&get(&d, "/metrics").await.1, "vllm:nixl_num_failed_transfers_total"), 1.0);
}

#[tokio::test]
async fn without_a_connector_the_params_change_nothing_and_the_nixl_metrics_are_absent() {
    let s = start(&["--zero-latency"]).await;
    let client = json!({"model": "inferrail/sim-8b", "prompt": prompt(10), "max_tokens": 2});
    let (status, text) = post(&s, "/v1/completions", &prefill_body(client)).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(json(&text)["kv_transfer_params"], Value::Null);
    assert!(!get(&s, "/metrics").await.1.contains("nixl"));
}

#[tokio::test]
async fn a_decode_leg_without_its_block_ids_gets_a_clear_error() {
    let d = sim("kv_consumer", &[]).await;
    let client = json!({"model": "inferrail/sim-8b", "prompt": prompt(10), "max_tokens": 2});
    let (status, text) = post(&d, "/v1/completions", &with_params(&client, &json!({"do_remote_prefill": true}))).await;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("remote_block_ids"), "{text}");
}
