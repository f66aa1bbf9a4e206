//! What an explanation shows of the KV room check (the cached tokens a
//! request in flight holds and the free tokens as the check counts them)
//! and of LoRA adapters.

use std::time::Instant;

use inferrail_config::Config;
use inferrail_load::page::{Engine, EngineLoad};
use inferrail_load::table::Snapshot;

use inferrail_tokenize::chat::Endpoint;

use super::{Router, explanation, pb};

const BODY: &[u8] = br#"{"model": "m", "prompt": "The quick brown fox jumps over the lazy dog, again and again.", "max_tokens": 1}"#;

fn candidate<'a>(out: &'a pb::ExplainResponse, id: &str) -> &'a pb::Candidate {
    out.candidates.iter().find(|c| c.id == id).unwrap()
}

#[tokio::test]
async fn a_candidate_shows_the_cached_tokens_held_by_requests_in_flight_and_its_free_room() {
    // 64 blocks of 4 tokens each, half in use by the engine's report: 128 free tokens.
    let yaml = "
models: [{name: m, policy: cost_model, tokenizer: builtin:sim}]
replicas:
  - {id: a, address: 127.0.0.1:1, models: [m], block_size: 4, kv_blocks: 64}
  - {id: b, address: 127.0.0.1:2, models: [m], block_size: 4, kv_blocks: 64}
";
    let r = Router::new(Config::parse(yaml).unwrap()).unwrap();
    let load = EngineLoad {
        engine: Engine::Vllm,
        running: 0,
        waiting: 0,
        deferred: 0,
        kv_usage: 0.5,
        prefix_queries: None,
        prefix_hits: None,
        cache: None,
        lora: None,
    };
    for id in ["a", "b"] {
        r.loads.insert(id, Snapshot { at: Instant::now(), load: load.clone() });
    }
    let first = r.decide(BODY, Endpoint::Completions, "1", None, None).await.unwrap();
    let (took, other) = (first.targets[0].id.clone(), first.targets[1].id.clone());
    let n = first.prompt_tokens.unwrap() as u64;
    let cached = (n - 1) / 4 * 4;
    assert!(cached > 0 && n < 128, "{n} tokens");

    // The first request is in flight: it holds every block its prompt's copy would reuse, and its prompt is room the report still counts free.
    let out = explanation(&r, &r.explain(BODY, Endpoint::Completions, None, &Default::default()).await.unwrap());
    let (t, o) = (candidate(&out, &took), candidate(&out, &other));
    assert_eq!((t.predicted_cached_tokens, t.held_cached_tokens, t.free_kv_tokens), (cached, cached, Some(128 - n)));
    assert_eq!((o.predicted_cached_tokens, o.held_cached_tokens, o.free_kv_tokens), (0, 0, Some(128)));

    // Once it is over and answered nothing holds them, though they stay cached.
    let lease = r.forget("1").unwrap();
    r.core.complete(&lease, std::time::Duration::ZERO);
    let out = explanation(&r, &r.explain(BODY, Endpoint::Completions, None, &Default::default()).await.unwrap());
    let t = candidate(&out, &took);
    assert_eq!((t.predicted_cached_tokens, t.held_cached_tokens, t.free_kv_tokens), (cached, 0, Some(128)));

    // Without a report there is no free room to show.
    r.loads.remove(&took);
    let out = explanation(&r, &r.explain(BODY, Endpoint::Completions, None, &Default::default()).await.unwrap());
    assert_eq!(candidate(&out, &took).free_kv_tokens, None);
}

#[tokio::test]
async fn replicas_and_candidates_show_the_adapters_the_engine_reports_and_the_slots() {
    let yaml = "
models: [{name: m, adapters: [sql, chat], max_loras: 1, policy: cost_model, tokenizer: builtin:sim}]
replicas:
  - {id: a, address: 127.0.0.1:1, models: [m]}
  - {id: b, address: 127.0.0.1:2, models: [m]}
";
    let r = Router::new(Config::parse(yaml).unwrap()).unwrap();
    let b = r.fleet().replicas.iter().find(|x| x.id == "b").cloned().unwrap();
    b.learn_adapters(r.now(), 1, &["chat".to_string()], &["sql".to_string()]);
    let body = String::from_utf8_lossy(BODY).replace(r#""model": "m""#, r#""model": "sql""#);
    let out = explanation(&r, &r.explain(body.as_bytes(), Endpoint::Completions, None, &Default::default()).await.unwrap());
    let fit = |id| candidate(&out, id).adapter.clone().unwrap();
    assert_eq!(fit("a"), pb::AdapterFit { name: "sql".into(), resident: false, others: 0, max_loras: 1, must_wait: false });
    assert_eq!(fit("b"), pb::AdapterFit { name: "sql".into(), resident: false, others: 1, max_loras: 1, must_wait: true });
    assert_eq!(out.winner, "a", "b's one slot runs chat");
    let shown = super::fleet(&r);
    let adapters = |id| shown.replicas.iter().find(|x| x.id == id).unwrap().adapters.clone().unwrap();
    assert_eq!(adapters("b"), pb::Adapters { running: vec!["chat".into()], idle: vec![], waiting: vec!["sql".into()], max_loras: 1 });
    assert_eq!(adapters("a"), pb::Adapters { max_loras: 1, ..Default::default() });
    // A request of the base model has no adapter to place.
    let out = explanation(&r, &r.explain(BODY, Endpoint::Completions, None, &Default::default()).await.unwrap());
    assert!(out.candidates.iter().all(|c| c.adapter.is_none()));
}
