//! One 220 KB chat request (about 37,500 Qwen3 tokens, the overhead
//! ladder's long-prompt body) through the router, whole and stage by stage:
//! the body's routing fields, the body parsed for its prompt, the chat
//! template rendered, the text encoded, the prompt cut into block hashes,
//! and the whole decision (`Router::decide`, inline and through the
//! tokenizer pool). Every body is new (its own marker at the start of the
//! user's text), so nothing is served from the chunk cache.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use inferrail::prompt::Prompt;
use inferrail::request;
use inferrail::router::Router;
use inferrail_config::Config;
use inferrail_tokenize::Tokenizer;
use inferrail_tokenize::chat::{Endpoint, RequestTemplates, render};
use serde_json::Value;

const WORDS: [&str; 12] = ["river", "stone", "cloud", "lantern", "garden", "silver", "copper", "window", "the", "of", "and", "42"];

/// A chat body of about 220 KB whose user text starts with `marker`.
fn body(marker: u64) -> Vec<u8> {
    let mut text = format!("request {marker}");
    let mut i = 0usize;
    while text.len() < 219_000 {
        text.push(' ');
        text.push_str(WORDS[(i * 7 + i / 5) % WORDS.len()]);
        i += 1;
    }
    let body = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 1, "stream": true});
    serde_json::to_vec(&body).unwrap()
}

fn router(inline_below_bytes: usize) -> Router {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../.cache/tokenizers/qwen3");
    let yaml = format!(
        "tokenizer: {{inline_below_bytes: {inline_below_bytes}, max_wait_ms: 10000}}\n\
         models: [{{name: m, policy: cost_model, tokenizer: '{dir}'}}]\n\
         replicas:\n  - {{id: a, address: 127.0.0.1:1, models: [m]}}\n  - {{id: b, address: 127.0.0.1:2, models: [m]}}\n  \
         - {{id: c, address: 127.0.0.1:3, models: [m]}}\n"
    );
    Router::new(Config::parse(&yaml).unwrap()).unwrap()
}

fn long_prompt(c: &mut Criterion) {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../.cache/tokenizers/qwen3");
    let tok = Tokenizer::load(dir, 0).unwrap();
    let sample = body(0);
    let Ok(Value::Object(parsed)) = serde_json::from_slice::<Value>(&sample) else { panic!("not an object") };
    let text = render(&tok, &parsed, RequestTemplates::Decline).unwrap();
    let ids = tok.encode(&text, false);
    eprintln!("body {} bytes, prompt {} tokens", sample.len(), ids.len());

    let mut g = c.benchmark_group("220 KB chat");
    g.sample_size(20);
    g.bench_function("routing fields (model, user)", |b| b.iter(|| request::fields(&sample).unwrap()));
    g.bench_function("parsed to a serde value", |b| b.iter(|| serde_json::from_slice::<Value>(&sample).unwrap()));
    g.bench_function("chat template rendered", |b| b.iter(|| render(&tok, &parsed, RequestTemplates::Decline).unwrap()));
    g.bench_function("rendered text encoded", |b| b.iter(|| tok.encode(&text, false)));

    let hashing = router(usize::MAX);
    let prompt = Prompt { ids: ids.clone(), max_tokens: Some(1), cache_salt: None, adapter: None, special_at: Vec::new() };
    g.bench_function("cut into block hashes", |b| b.iter(|| hashing.core.prepare(0, &prompt, &hashing.fleet())));

    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    for (name, inline_below) in [("decided inline", usize::MAX), ("decided through the tokenizer pool", 8 << 10)] {
        let r = router(inline_below);
        let mut n = 0u64;
        g.bench_function(name, |b| {
            b.iter_batched(
                || {
                    n += 1;
                    (body(n), n.to_string())
                },
                |(body, id)| {
                    let d = runtime.block_on(r.decide(&body, Endpoint::Chat, &id, None, None)).unwrap();
                    assert!(d.prompt_tokens.is_some(), "the prompt was tokenized");
                    r.forget(&id);
                },
                BatchSize::LargeInput,
            )
        });
    }
    g.finish();
}

criterion_group!(benches, long_prompt);
criterion_main!(benches);
