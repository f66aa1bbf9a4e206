//! LoRA adapters over HTTP, with the bytes vLLM 0.32 answers: the model
//! list, requests naming an adapter, loading and unloading at run time,
//! the adapters' own cache and KV events, and `vllm:lora_requests_info`.

mod common;

use std::time::Duration;

use common::{get, json, post, start};
use inferrail_kv_events::subscribe::{Subscriber, SubscriberConfig};
use inferrail_kv_events::wire::{ExtraKey, KvEvent};
use serde_json::json;

const BASE: &str = "inferrail/sim-8b";

fn dir() -> String {
    std::env::temp_dir().to_string_lossy().into_owned()
}

fn completion(model: &str, prompt: &[u32]) -> serde_json::Value {
    json!({"model": model, "prompt": prompt, "max_tokens": 2})
}

#[tokio::test]
async fn adapters_are_listed_after_the_base_model_and_load_and_unload_at_run_time() {
    let path = dir();
    let module = format!("sql={path}");
    let sim = start(&["--zero-latency", "--enable-lora", "--lora-modules", &module, "--allow-runtime-lora-updating"]).await;
    let models = json(&get(&sim, "/v1/models").await.1);
    let ids: Vec<&str> = models["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, [BASE, "sql"]);
    let card = &models["data"][1];
    assert_eq!((card["root"].as_str(), card["parent"].as_str(), &card["max_model_len"]), (Some(path.as_str()), Some(BASE), &json!(null)));

    let (status, text) = post(&sim, "/v1/load_lora_adapter", &json!({"lora_name": "chat", "lora_path": path})).await;
    assert_eq!((status, text.as_str()), (200, "Success: LoRA adapter 'chat' added successfully."));
    let (status, text) = post(&sim, "/v1/load_lora_adapter", &json!({"lora_name": "chat", "lora_path": path})).await;
    assert_eq!(status, 400);
    assert_eq!(json(&text)["error"]["type"], "InvalidUserInput");
    let (status, text) = post(&sim, "/v1/load_lora_adapter", &json!({"lora_name": "gone", "lora_path": "/no/such/adapter"})).await;
    assert_eq!((status, json(&text)["error"]["message"].as_str()), (404, Some("Loading lora gone failed: No adapter found for <path>")));

    let (status, text) = post(&sim, "/v1/completions", &completion("chat", &[1, 2, 3])).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(json(&text)["model"], "chat", "the response names the adapter");
    let (status, text) = post(&sim, "/tokenize", &json!({"model": "chat", "prompt": ""})).await;
    assert_eq!((status, json(&text)["tokens"].clone()), (200, json!([])), "an empty prompt has no tokens: {text}");

    let (status, text) = post(&sim, "/v1/unload_lora_adapter", &json!({"lora_name": "chat"})).await;
    assert_eq!((status, text.as_str()), (200, "Success: LoRA adapter 'chat' removed successfully."));
    let (status, text) = post(&sim, "/v1/completions", &completion("chat", &[1, 2, 3])).await;
    assert_eq!(status, 404);
    assert_eq!(json(&text)["error"]["message"], format!("The model `chat` does not exist. Valid aliases: {BASE}."));
    let (status, _) = post(&sim, "/v1/unload_lora_adapter", &json!({"lora_name": "chat"})).await;
    assert_eq!(status, 404);
}

#[tokio::test]
async fn without_runtime_updating_the_routes_do_not_exist_and_modules_need_lora_on() {
    let sim = start(&["--zero-latency", "--enable-lora"]).await;
    let (status, text) = post(&sim, "/v1/load_lora_adapter", &json!({"lora_name": "a", "lora_path": dir()})).await;
    assert_eq!((status, text.as_str()), (404, r#"{"detail":"Not Found"}"#));
    let args = inferrail_sim::args::Args::for_test(&["--lora-modules", "a=/tmp"]);
    assert!(inferrail_sim::Sim::start(args).await.is_err(), "--lora-modules without --enable-lora");
    let args = inferrail_sim::args::Args::for_test(&["--enable-lora", "--lora-modules", "a=/no/such/adapter"]);
    assert!(inferrail_sim::Sim::start(args).await.is_err(), "a module that cannot be loaded stops the start");
}

/// An adapter's blocks are its own: the same prompt is cached for the
/// adapter that computed it and not for the base model or another adapter,
/// and its KV events carry the adapter's id and name as vLLM's do.
#[tokio::test]
async fn an_adapters_cache_and_events_are_its_own() {
    let mut sub = Subscriber::start(&SubscriberConfig::new("tcp://127.0.0.1:0", "kv")).await.unwrap_or_else(|e| panic!("{e}"));
    let events = json!({"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": sub.endpoint(), "topic": "kv"}).to_string();
    let (a, b) = (format!("a={}", dir()), format!("b={}", dir()));
    let sim = start(&[
        "--zero-latency",
        "--enable-prompt-tokens-details",
        "--block-size",
        "4",
        "--max-model-len",
        "1024",
        "--enable-lora",
        "--max-loras",
        "2",
        "--lora-modules",
        &a,
        &b,
        "--kv-events-config",
        &events,
    ])
    .await;
    let prompt: Vec<u32> = (500..510).collect();
    let cached = |text: String| json(&text)["usage"]["prompt_tokens_details"]["cached_tokens"].clone();
    assert_eq!(cached(post(&sim, "/v1/completions", &completion("a", &prompt)).await.1), json!(0));
    assert_eq!(cached(post(&sim, "/v1/completions", &completion("a", &prompt)).await.1), json!(8), "the adapter's own blocks");
    assert_eq!(cached(post(&sim, "/v1/completions", &completion("b", &prompt)).await.1), json!(0), "another adapter's are not");
    assert_eq!(cached(post(&sim, "/v1/completions", &completion(BASE, &prompt)).await.1), json!(0), "nor the base model's");

    let (_, batch) = tokio::time::timeout(Duration::from_secs(10), sub.next()).await.expect("an event batch").expect("a batch");
    let KvEvent::BlockStored(stored) = &batch.events[0] else { panic!("{:?}", batch.events) };
    assert_eq!((stored.lora_id, stored.lora_name.as_deref()), (Some(1), Some("a")));
    let keys = stored.extra_keys.clone().unwrap_or_default();
    assert!(!keys.is_empty() && keys.iter().all(|k| k.as_deref() == Some(&[ExtraKey::Str("a".into())][..])), "{keys:?}");

    let page = get(&sim, "/metrics").await.1;
    let info: Vec<&str> = page.lines().filter(|l| l.starts_with("vllm:lora_requests_info{")).collect();
    assert!(info.iter().any(|l| l.contains(r#"running_lora_adapters="a""#)), "{info:?}");
    assert!(info.iter().all(|l| l.starts_with(r#"vllm:lora_requests_info{max_lora="2","#)), "{info:?}");
    assert!(page.contains("# HELP vllm:lora_requests_info Running stats on lora requests.\n# TYPE vllm:lora_requests_info gauge"));
}
