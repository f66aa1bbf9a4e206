//! Preparing and tokenizing a long chat with a real tokenizer (Qwen3), cold
//! and with its earlier pieces seen before.
#![allow(missing_docs, clippy::unwrap_used)]

use criterion::{Criterion, criterion_group, criterion_main};
use inferrail_tokenize::Tokenizer;
use inferrail_tokenize::chat::{Endpoint, RequestTemplates, prompt_ids, render};
use serde_json::{Map, Value, json};

const WORDS: [&str; 16] = [
    "river", "stone", "cloud", "lantern", "garden", "silver", "copper", "window", "mountain", "ocean", "the", "of", "and", "数据", "naïve",
    "42",
];

fn text(seed: usize, words: usize) -> String {
    (0..words).map(|i| WORDS[(i * 7 + seed * 13 + i / 3) % WORDS.len()]).collect::<Vec<_>>().join(" ")
}

/// A chat of about 8,000 tokens: a 2,000-token system prompt and 24 turns.
fn chat(tok: &Tokenizer, last_turn: &str) -> Map<String, Value> {
    let mut messages = vec![json!({"role": "system", "content": text(0, 1_700)})];
    for t in 0..24 {
        let role = if t % 2 == 0 { "user" } else { "assistant" };
        messages.push(json!({"role": role, "content": text(t + 1, 200)}));
    }
    messages.push(json!({"role": "user", "content": last_turn}));
    let Value::Object(body) = json!({"model": "m", "messages": messages}) else { unreachable!() };
    let n = prompt_ids(tok, Endpoint::Chat, &body, RequestTemplates::Decline).unwrap().len();
    assert!((7_500..8_500).contains(&n), "the chat should be about 8,000 tokens, is {n}");
    body
}

fn tokenize(c: &mut Criterion) {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../.cache/tokenizers/qwen3");
    let cold = Tokenizer::load(dir, 0).unwrap();
    let warm = Tokenizer::load(dir, 1 << 20).unwrap();
    let body = chat(&cold, "What changed since yesterday?");
    c.bench_function("8k-token chat, no chunk cache", |b| {
        b.iter(|| prompt_ids(&cold, Endpoint::Chat, &body, RequestTemplates::Decline).unwrap())
    });
    // The same conversation was seen before: only the new last turn is new.
    chat(&warm, "What changed since yesterday?");
    let mut turn = 0u64;
    c.bench_function("8k-token chat, earlier turns seen", |b| {
        b.iter_batched_ref(
            || {
                turn += 1;
                let mut next = body.clone();
                next["messages"].as_array_mut().unwrap().last_mut().unwrap()["content"] = json!(format!("And what about item {turn}?"));
                next
            },
            |next| prompt_ids(&warm, Endpoint::Chat, next, RequestTemplates::Decline).unwrap(),
            criterion::BatchSize::SmallInput,
        )
    });
    c.bench_function("8k-token chat, rendered only", |b| b.iter(|| render(&cold, &body, RequestTemplates::Decline).unwrap()));
    let system = text(0, 1_700);
    // No chunk cache, but after the first iteration every word is in the word cache.
    c.bench_function("2k-token system prompt, encode only, no chunk cache", |b| b.iter(|| cold.encode(&system, false)));
    // The other families, all on the fast encoder: Llama 3 and DeepSeek V3 byte-level, Gemma 3 cut at its `▁` runs.
    for family in ["llama3_1", "deepseek_v3", "gemma3"] {
        let tok = Tokenizer::load(&format!("{}/../../.cache/tokenizers/{family}", env!("CARGO_MANIFEST_DIR")), 0).unwrap();
        c.bench_function(&format!("2k-token system prompt, encode only, no chunk cache, {family}"), |b| {
            b.iter(|| tok.encode(&system, false))
        });
    }
    // One 220 KB user message (a long document) after a prefix never seen
    // before: the passage's pieces are cached from the runs before, its words
    // too. Words of random letters, so the passage has as many places to cut
    // as prose.
    let mut state = 3u64;
    let passage: String = (0..36_000)
        .map(|_| {
            let mut word = String::from(" ");
            for _ in 0..5 {
                state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                word.push(char::from(b'a' + ((state >> 33) % 26) as u8));
            }
            word
        })
        .collect();
    let mut request = 0u64;
    c.bench_function("220 KB message, a passage seen before after a new prefix", |b| {
        b.iter_batched_ref(
            || {
                request += 1;
                format!("<|im_start|>user\nrequest {request}:{passage}<|im_end|>\n")
            },
            |text| warm.encode(text, false),
            criterion::BatchSize::SmallInput,
        )
    });
    // One 8,000-letter word (a blob without spaces): merged every time, never cached.
    let blob: String = (0..8_000u32).map(|i| char::from(b'a' + (i.wrapping_mul(2_654_435_761) >> 27) as u8 % 26)).collect();
    c.bench_function("one 8,000-letter word, encode only", |b| b.iter(|| cold.encode(&blob, false)));
    // Words never seen before, so every one is merged by the BPE model.
    let mut next_word = 0u64;
    c.bench_function("500 unseen words, encode only", |b| {
        b.iter_batched_ref(
            || {
                (0..500)
                    .map(|_| {
                        next_word += 1;
                        let mut n = next_word * 7_919;
                        let mut word = String::from(" ");
                        while n > 0 {
                            word.push(char::from(b'a' + (n % 26) as u8));
                            n /= 26;
                        }
                        word
                    })
                    .collect::<String>()
            },
            |text| cold.encode(text, false),
            criterion::BatchSize::SmallInput,
        )
    });
}

criterion_group!(benches, tokenize);
criterion_main!(benches);
