//! The simulator against recordings of a real vLLM 0.32.0: the same fields in
//! the same order with the same nulls, the same stream framing, the same
//! error bodies, and the same metric families, labels and buckets.

mod common;

use std::collections::BTreeMap;

use common::{LIKE_RECORDING, get, json, post, sse_events, start};
use serde_json::{Value, json};

fn fixture(name: &str) -> String {
    let path = format!("{}/tests/fixtures/vllm-0.32.0/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The structure of a JSON value: keys in order, value kinds, nulls. Arrays
/// are described by their first element, since lengths follow the text.
fn shape(v: &Value) -> Value {
    match v {
        Value::Null => json!("null"),
        Value::Bool(_) => json!("bool"),
        Value::Number(n) if n.is_f64() => json!("float"),
        Value::Number(_) => json!("int"),
        Value::String(_) => json!("string"),
        Value::Array(a) => json!([a.first().map(shape)]),
        Value::Object(m) => {
            let fields: Vec<Value> = m.iter().map(|(k, v)| json!([k, shape(v)])).collect();
            json!(fields)
        }
    }
}

fn assert_same_shape(ours: &str, recorded: &str, what: &str) {
    let (a, b) = (shape(&json(ours)), shape(&json(recorded)));
    assert_eq!(a, b, "{what}: shape differs\n ours: {ours}\n vllm: {recorded}");
}

fn stream_shapes(body: &str) -> Vec<Value> {
    sse_events(body).iter().map(|e| if e == "[DONE]" { json!("[DONE]") } else { shape(&json(e)) }).collect()
}

#[tokio::test]
async fn whole_responses_have_vllms_fields_order_and_nulls() {
    let sim = start(&LIKE_RECORDING).await;
    let chat = json!({"model": "tiny-qwen3", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 16, "temperature": 0});
    let (status, body) = post(&sim, "/v1/chat/completions", &chat).await;
    assert_eq!(status, 200);
    assert_same_shape(&body, &fixture("chat-nonstream.json"), "chat");

    let completion = json!({"model": "tiny-qwen3", "prompt": "Hello", "max_tokens": 8});
    let (_, body) = post(&sim, "/v1/completions", &completion).await;
    assert_same_shape(&body, &fixture("completions-nonstream.json"), "completion");

    let ids = json!({"model": "tiny-qwen3", "prompt": "100 101 102", "max_tokens": 40, "return_token_ids": true});
    let (_, body) = post(&sim, "/v1/completions", &ids).await;
    assert_same_shape(&body, &fixture("kv1-completion.json"), "completion with token ids");
    let v = json(&body);
    assert_eq!(v["choices"][0]["token_ids"].as_array().map(Vec::len), Some(40));
    assert_eq!(v["choices"][0]["prompt_token_ids"].as_array().map(Vec::len), v["usage"]["prompt_tokens"].as_u64().map(|n| n as usize));
}

#[tokio::test]
async fn streams_frame_and_close_as_vllm_does() {
    let sim = start(&LIKE_RECORDING).await;
    let cases = [
        (
            "/v1/chat/completions",
            json!({"model": "tiny-qwen3", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "stream": true, "stream_options": {"include_usage": true}}),
            "chat-stream.txt",
        ),
        (
            "/v1/completions",
            json!({"model": "tiny-qwen3", "prompt": "Hello", "max_tokens": 4, "stream": true, "stream_options": {"include_usage": true}}),
            "completions-stream.txt",
        ),
        (
            "/v1/completions",
            json!({"model": "tiny-qwen3", "prompt": "Hello", "max_tokens": 2, "stream": true, "stream_options": {"include_usage": true, "continuous_usage_stats": true}}),
            "completions-stream-continuous.txt",
        ),
    ];
    for (path, req, recorded) in cases {
        let (status, body) = post(&sim, path, &req).await;
        assert_eq!(status, 200);
        let want = fixture(recorded);
        assert!(body.ends_with("data: [DONE]\n\n"), "{recorded}: {body}");
        assert_eq!(stream_shapes(&body), stream_shapes(&want), "{recorded}\n ours: {body}\n vllm: {want}");
    }
}

#[tokio::test]
async fn cached_tokens_come_in_whole_blocks_without_the_last_token() {
    let sim = start(&LIKE_RECORDING).await;
    let req: Value = json(&fixture("long600-completions.req.json"));
    let (_, first) = post(&sim, "/v1/completions", &req).await;
    let (_, second) = post(&sim, "/v1/completions", &req).await;
    assert_same_shape(&second, &fixture("long600-completions-2.json"), "repeated completion");
    let (first, second) = (json(&first), json(&second));
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let n = second["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
    assert!(n > 600, "the recorded prompt is long: {n} tokens");
    // As recorded: 666 prompt tokens gave 640 cached with 32-token blocks.
    assert_eq!(second["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(), Some((n - 1) / 32 * 32));

    // The recorded chat stream reports the same rule in its usage chunk.
    let chat = json!({"model": "tiny-qwen3", "messages": [{"role": "user", "content": req["prompt"]}], "max_tokens": 16, "stream": true, "stream_options": {"include_usage": true}});
    post(&sim, "/v1/chat/completions", &chat).await;
    let (_, body) = post(&sim, "/v1/chat/completions", &chat).await;
    let recorded = fixture("long600-chat-stream-2.txt");
    assert_eq!(stream_shapes(&body), stream_shapes(&recorded));
    let usage = json(&sse_events(&body)[17])["usage"].clone();
    let n = usage["prompt_tokens"].as_u64().unwrap_or(0);
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"].as_u64(), Some((n - 1) / 32 * 32));
}

/// `(title, status, body)` of each recorded exchange in an `=== title` file.
fn exchanges(text: &str) -> Vec<(String, u16, String)> {
    text.split("=== ")
        .filter(|s| !s.trim().is_empty())
        .map(|s| {
            let (title, rest) = s.split_once('\n').unwrap_or((s, ""));
            let status = rest.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
            let rest = rest.replace("\r\n", "\n");
            let body = rest.split_once("\n\n").map(|(_, b)| b.trim_end_matches('\n')).unwrap_or("");
            (title.trim().to_string(), status, body.to_string())
        })
        .collect()
}

#[tokio::test]
async fn error_bodies_match_the_recording() {
    let sim = start(&LIKE_RECORDING).await;
    let recorded: BTreeMap<String, (u16, String)> = exchanges(&fixture("errors.txt")).into_iter().map(|(t, s, b)| (t, (s, b))).collect();
    let raw = |body: &'static str| {
        let url = format!("{}/v1/chat/completions", sim.url());
        async move {
            let r = reqwest::Client::new().post(url).header("content-type", "application/json").body(body).send().await;
            let r = r.unwrap_or_else(|e| panic!("{e}"));
            (r.status().as_u16(), r.text().await.unwrap_or_default())
        }
    };
    let cases = [
        ("unknown model", raw(r#"{"model":"nope","messages":[{"role":"user","content":"hi"}]}"#).await),
        ("missing messages", raw(r#"{"model":"tiny-qwen3"}"#).await),
        (
            "prompt too long (max_tokens 4000 > max_model_len)",
            raw(r#"{"model":"tiny-qwen3","messages":[{"role":"user","content":"hi"}],"max_tokens":4000}"#).await,
        ),
        ("stream error (unknown model, stream=true)", raw(r#"{"model":"nope","messages":[],"stream":true}"#).await),
        ("unknown route", get(&sim, "/v1/nothing-here").await),
    ];
    for (title, got) in cases {
        let want = recorded.get(title).unwrap_or_else(|| panic!("no recording named {title}"));
        assert_eq!(&got, want, "{title}");
    }
    // Bad JSON: the offset depends on the body sent; everything else matches.
    let (status, body) = raw(r#"{"model": "tiny-qwen3", "messages": [{"role":"#).await;
    let want = &recorded["bad JSON"];
    assert_eq!(status, want.0);
    assert_same_shape(&body, &want.1, "bad JSON");
    let v = json(&body);
    assert_eq!(v["error"]["type"], "Bad Request");
    assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("'type': 'json_invalid'") && m.contains("'Expecting value'")));
}

#[tokio::test]
async fn plain_endpoints_match_the_recording() {
    let sim = start(&LIKE_RECORDING).await;
    for (title, status, body) in exchanges(&fixture("get-endpoints.txt")) {
        let path = title.trim_start_matches("GET ");
        let (s, b) = get(&sim, path).await;
        assert_eq!(s, status, "{path}");
        match path {
            "/health" | "/ping" | "/version" => assert_eq!(b, body, "{path}"),
            _ => assert_same_shape(&b, &body, path),
        }
    }
    let (_, b) = post(&sim, "/tokenize", &json!({"model": "tiny-qwen3", "prompt": "The quick brown fox jumps over the lazy dog"})).await;
    assert_same_shape(&b, &fixture("tokenize-short.json"), "tokenize");
}

/// A family as a metrics page presents it: help, type and the label names
/// and buckets of each sample name.
#[derive(Debug, Default, PartialEq)]
struct Family {
    help: String,
    kind: String,
    samples: BTreeMap<String, Vec<Vec<String>>>,
}

fn families(page: &str) -> BTreeMap<String, Family> {
    let mut out: BTreeMap<String, Family> = BTreeMap::new();
    let mut current = String::new();
    for line in page.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            current = name.to_string();
            out.entry(current.clone()).or_default().help = help.to_string();
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            out.entry(current.clone()).or_default().kind = rest.split_once(' ').map(|x| x.1).unwrap_or("").to_string();
        } else if let Some((name, labels)) = line.split_once('{') {
            let labels = labels.rsplit_once("} ").map(|x| x.0).unwrap_or("");
            let keys: Vec<String> = labels
                .split("\",")
                .map(|kv| {
                    let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
                    if k == "le" { format!("le={}", v.trim_matches('"')) } else { k.to_string() }
                })
                .collect();
            out.entry(current.clone()).or_default().samples.entry(name.to_string()).or_default().push(keys);
        }
    }
    out
}

#[tokio::test]
async fn every_recorded_vllm_metric_family_is_there_with_its_labels_and_buckets() {
    let sim = start(&LIKE_RECORDING).await;
    post(&sim, "/v1/completions", &json!({"model": "tiny-qwen3", "prompt": "warm up", "max_tokens": 3})).await;
    let (status, page) = get(&sim, "/metrics").await;
    assert_eq!(status, 200);
    let ours = families(&page);
    let recorded = families(&fixture("metrics-under-load.txt"));
    let mut checked = 0;
    for (name, want) in recorded.iter().filter(|(n, _)| n.starts_with("vllm:")) {
        let got = ours.get(name).unwrap_or_else(|| panic!("family {name} missing"));
        assert_eq!(got, want, "family {name}");
        checked += 1;
    }
    assert!(checked > 70, "only {checked} families compared");
    assert!(ours.keys().all(|n| recorded.contains_key(n)), "the simulator invents no family");
}
