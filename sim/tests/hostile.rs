//! Bad input never panics or hangs the simulator: thousands of malformed and
//! hostile requests all get an error in one of vLLM's shapes, and the server
//! answers normally afterwards.

mod common;

use common::{LIKE_RECORDING, client, json, post, start};
use futures_util::StreamExt;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

const REQUESTS: usize = 3_000;

/// One hostile request: method, path, body bytes.
fn hostile(rng: &mut StdRng) -> (reqwest::Method, &'static str, Vec<u8>) {
    let paths = ["/v1/chat/completions", "/v1/completions", "/tokenize"];
    let path = paths[rng.random_range(0..paths.len())];
    let valid_chat = json!({"model": "tiny-qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let body: Vec<u8> = match rng.random_range(0..14) {
        // Random bytes, often not UTF-8.
        0 => (0..rng.random_range(0..200)).map(|_| rng.random::<u8>()).collect(),
        // A valid body cut short.
        1 => {
            let s = valid_chat.to_string().into_bytes();
            let cut = rng.random_range(0..s.len());
            s[..cut].to_vec()
        }
        // Nesting deeper than any parser should follow.
        2 => format!("{}{}", "[".repeat(rng.random_range(100..5000)), "]".repeat(rng.random_range(0..100))).into_bytes(),
        // Wrong JSON types at the top.
        3 => [&b"[]"[..], b"null", b"42", b"\"x\"", b"true", b""][rng.random_range(0..6)].to_vec(),
        // Each field with a wrong type or value.
        4 => {
            let field = ["model", "messages", "prompt", "max_tokens", "stream", "stream_options", "n", "cache_salt", "return_token_ids"]
                [rng.random_range(0..9)];
            let value = [json!(null), json!(-1), json!(0), json!(1e300), json!("x"), json!([]), json!({}), json!([1, "a"]), json!(u64::MAX), json!(true)]
                [rng.random_range(0..10)]
            .clone();
            let mut v = valid_chat.clone();
            v[field] = value;
            v.to_string().into_bytes()
        }
        // Messages that are not messages.
        5 => {
            let bad = [json!([1]), json!({"role": 5}), json!({"content": "no role"}), json!({"role": "user", "content": {"x": 1}})];
            let first = rng.random_range(0..bad.len());
            json!({"messages": bad[first..].to_vec(), "model": "tiny-qwen3"}).to_string().into_bytes()
        }
        // Content parts the engine cannot read.
        6 => json!({"model": "tiny-qwen3", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}, {"type": "text"}, 7]}]})
            .to_string()
            .into_bytes(),
        // Prompts longer than the context, or too long with their output.
        7 => json!({"model": "tiny-qwen3", "prompt": "word ".repeat(rng.random_range(1000..3000)), "max_tokens": rng.random_range(1..3000)}).to_string().into_bytes(),
        // Token ids outside the vocabulary, negative or not numbers.
        8 => {
            let odd = [json!(-1), json!(999_999_999), json!("a"), json!(1.5)][rng.random_range(0..4)].clone();
            json!({"model": "tiny-qwen3", "prompt": [1, 2, odd]}).to_string().into_bytes()
        }
        // Unsupported parameters.
        9 => {
            let (k, v) = [("n", json!(3)), ("best_of", json!(2)), ("echo", json!(true)), ("logprobs", json!(true)), ("prompt_logprobs", json!(1))][rng.random_range(0..5)].clone();
            let mut b = json!({"model": "tiny-qwen3", "prompt": "x", "messages": [{"role": "user", "content": "x"}]});
            b[k] = v;
            b.to_string().into_bytes()
        }
        // Stream options without streaming.
        10 => json!({"model": "tiny-qwen3", "prompt": "x", "stream_options": {"include_usage": true}}).to_string().into_bytes(),
        // Empty prompts and batches.
        11 => {
            let prompt = [json!([]), json!(""), json!(["a", "b"]), json!([[1], [2]])][rng.random_range(0..4)].clone();
            json!({"model": "tiny-qwen3", "prompt": prompt}).to_string().into_bytes()
        }
        // Strings full of control characters, quotes and invalid escapes.
        12 => format!(r#"{{"model": "tiny-qwen3", "prompt": "\u0000\"{}\q"}}"#, "\u{1}".repeat(rng.random_range(0..5))).into_bytes(),
        // Unknown models with odd names.
        _ => {
            let model = ["", "../../etc", "nope\u{0}", "tiny-qwen3 "][rng.random_range(0..4)];
            json!({"model": model, "prompt": "x"}).to_string().into_bytes()
        }
    };
    (reqwest::Method::POST, path, body)
}

/// A body is one of vLLM's error shapes, consistent with its status.
fn assert_vllm_error(status: u16, body: &str, sent: &[u8]) {
    let v: Value =
        serde_json::from_str(body).unwrap_or_else(|e| panic!("{status} not JSON ({e}): {body}\nsent: {}", String::from_utf8_lossy(sent)));
    if let Some(err) = v.get("error") {
        assert_eq!(err["code"].as_u64(), Some(u64::from(status)), "{body}");
        assert!(err["message"].as_str().is_some_and(|m| !m.is_empty()), "{body}");
        assert!(err["type"].is_string(), "{body}");
        assert!(err.get("param").is_some(), "{body}");
    } else {
        assert!(v["detail"].is_string(), "{body}");
    }
}

#[tokio::test]
async fn malformed_and_hostile_requests_get_vllm_shaped_errors() {
    let sim = start(&LIKE_RECORDING).await;
    let mut rng = StdRng::seed_from_u64(7);
    let requests: Vec<_> = (0..REQUESTS).map(|_| hostile(&mut rng)).collect();
    let http = client();
    let base = sim.url();
    let results: Vec<(u16, String, Vec<u8>)> = futures_util::stream::iter(requests)
        .map(|(method, path, body)| {
            let http = http.clone();
            let url = format!("{base}{path}");
            async move {
                let r = http.request(method, url).header("content-type", "application/json").body(body.clone()).send().await;
                let r = r.unwrap_or_else(|e| panic!("request failed: {e}\nsent: {}", String::from_utf8_lossy(&body)));
                (r.status().as_u16(), r.text().await.unwrap_or_default(), body)
            }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    let mut errors = 0;
    for (status, body, sent) in &results {
        if *status == 200 {
            continue; // some mutations are still valid requests
        }
        assert!((400..500).contains(status), "{status}: {body}\nsent: {}", String::from_utf8_lossy(sent));
        assert_vllm_error(*status, body, sent);
        errors += 1;
    }
    assert!(errors > REQUESTS * 3 / 4, "only {errors} of {REQUESTS} were refused");

    // Still healthy, and still serving.
    let (status, body) = post(&sim, "/v1/completions", &json!({"model": "tiny-qwen3", "prompt": "still here", "max_tokens": 2})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(json(&body)["usage"]["completion_tokens"], 2);
}

#[tokio::test]
async fn unknown_paths_and_methods_answer_as_fastapi_does() {
    let sim = start(&LIKE_RECORDING).await;
    let http = client();
    for (method, path, status, allow) in [
        (reqwest::Method::GET, "/v1/chat/completions", 405, Some("POST")),
        (reqwest::Method::DELETE, "/v1/models", 405, Some("GET")),
        (reqwest::Method::PUT, "/ping", 405, Some("GET, POST")),
        (reqwest::Method::GET, "/v2/anything", 404, None),
        (reqwest::Method::POST, "/", 404, None),
    ] {
        let r = http.request(method.clone(), format!("{}{path}", sim.url())).send().await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(r.status().as_u16(), status, "{method} {path}");
        assert_eq!(r.headers().get("allow").and_then(|v| v.to_str().ok()), allow, "{method} {path}");
        let body = r.text().await.unwrap_or_default();
        assert_vllm_error(status, &body, b"");
    }
}

#[tokio::test]
async fn an_empty_rendered_prompt_is_refused_and_the_engine_lives_on() {
    let sim = start(&LIKE_RECORDING).await;
    for body in [
        json!({"model": "tiny-qwen3", "messages": [], "add_generation_prompt": false}),
        json!({"model": "tiny-qwen3", "messages": [], "continue_final_message": true}),
    ] {
        let (status, text) = post(&sim, "/v1/chat/completions", &body).await;
        assert_eq!(status, 400, "{text}");
        assert_vllm_error(status, &text, body.to_string().as_bytes());
    }
    let (status, _) = post(&sim, "/v1/completions", &json!({"model": "tiny-qwen3", "prompt": "still alive", "max_tokens": 1})).await;
    assert_eq!(status, 200);
}

#[tokio::test]
async fn with_an_api_key_v1_requests_without_it_are_refused_as_vllm_refuses_them() {
    let sim = start(&["--zero-latency", "--api-key", "sk-sim"]).await;
    let body = json!({"model": "inferrail/sim-8b", "prompt": "hi", "max_tokens": 2});
    let url = format!("{}/v1/completions", sim.url());
    for auth in [None, Some("Bearer wrong"), Some("sk-sim")] {
        let mut r = client().post(&url).json(&body);
        if let Some(a) = auth {
            r = r.header("authorization", a);
        }
        let r = r.send().await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(r.status().as_u16(), 401, "{auth:?}");
        assert_eq!(r.text().await.unwrap_or_default(), r#"{"error":"Unauthorized"}"#);
    }
    let r = client().post(&url).header("authorization", "Bearer sk-sim").json(&body).send().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.status().as_u16(), 200);
    // Only /v1 paths are guarded.
    for path in ["/health", "/metrics"] {
        assert_eq!(common::get(&sim, path).await.0, 200, "{path}");
    }
}
