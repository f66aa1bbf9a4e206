//! Reloads of a routing YAML on disk into a live router.

use inferrail_route::lifecycle::Event;
use inferrail_tokenize::chat::Endpoint;

use super::*;

fn yaml(replicas: &str) -> String {
    format!("models: [{{name: m, policy: round_robin, tokenizer: \"builtin:sim\"}}]\nretry: {{fallbacks: 0}}\nreplicas:\n{replicas}")
}

const TWO: &str = "  - {id: r1, address: 127.0.0.1:8001, models: [m]}\n  - {id: r2, address: 127.0.0.1:8002, models: [m]}\n";

const PROMPT_1: &str =
    r#"{"model": "m", "prompt": "otters hold hands while they sleep so that they do not drift apart on the water at night"}"#;
const PROMPT_2: &str =
    r#"{"model": "m", "prompt": "a heron stands still in the shallows for a long time and then strikes faster than the eye can follow"}"#;

/// The prompt's predicted cached tokens on each replica, in fleet order.
async fn cached(router: &Router, body: &str) -> Vec<usize> {
    let explained = router.explain(body.as_bytes(), Endpoint::Completions, None, &Default::default()).await.unwrap();
    explained.plan.candidates.iter().map(|c| c.cached_tokens).collect()
}

fn ids(router: &Router) -> Vec<String> {
    router.fleet().replicas.iter().map(|r| r.id.clone()).collect()
}

fn replica(router: &Router, id: &str) -> Arc<inferrail_route::fleet::Replica> {
    router.fleet().replicas.iter().find(|r| r.id == id).unwrap().clone()
}

#[tokio::test]
async fn a_reload_keeps_what_survives_starts_what_changed_cold_and_forgets_what_left() {
    let dir = std::env::temp_dir().join(format!("inferrail-reload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("routing.yaml");
    let path = path.to_str().unwrap();
    std::fs::write(path, yaml(TWO)).unwrap();
    let router = Router::new(Config::load(path).unwrap()).unwrap();
    // What r1 and r2 learned: a prompt each in their caches (served and over), a failed probe on r1.
    for (id, body) in [("x", PROMPT_1), ("y", PROMPT_2)] {
        let d = router.decide(body.as_bytes(), Endpoint::Completions, id, None, None).await.unwrap();
        for event in [Event::Status { code: 200, served_by: None }, Event::FirstByte, Event::End] {
            router.hear(&d.request_id, event);
        }
    }
    assert_eq!((cached(&router, PROMPT_1).await[0] > 0, cached(&router, PROMPT_2).await[1] > 0), (true, true));
    // And a request in flight on r1.
    let d = router.decide(PROMPT_1.as_bytes(), Endpoint::Completions, "a", None, None).await.unwrap();
    assert_eq!(d.targets[0].id, "r1");
    let r1 = replica(&router, "r1");
    r1.set_probe(false);

    // r1 stays with new limits, a calibrated prefill cost and a drain, r2 moves to a new address, r3 joins.
    assert_eq!(r1.prefill(), None);
    let next = "  - {id: r1, address: 127.0.0.1:8001, models: [m], max_concurrency: 7, prefill: {prefill_token_us: 55}, drain: true}\n  \
                - {id: r2, address: 127.0.0.1:9002, models: [m]}\n  - {id: r3, address: 127.0.0.1:8003, models: [m]}\n";
    std::fs::write(path, yaml(next)).unwrap();
    assert_eq!(apply(&router, path), "ok");
    assert_eq!(ids(&router), ["r1", "r2", "r3"]);
    let kept = replica(&router, "r1");
    assert!(Arc::ptr_eq(&kept, &r1), "the same replica, with what it learned");
    assert_eq!((kept.in_flight(), kept.healthy(router.now_ms()), kept.limits().max_concurrency), (1, false, 7));
    assert!(kept.draining());
    assert_eq!(kept.prefill().map(|p| p.prefill_token_us), Some(55.0), "its engine's cost, in place");
    assert_eq!(replica(&router, "r2").addr.port(), 9002);
    let after = (cached(&router, PROMPT_1).await, cached(&router, PROMPT_2).await);
    assert!(after.0[0] > 0, "r1's KV index entry survives");
    assert_eq!(after.1[1], 0, "r2 at a new address is a new engine: cold");
    // The request in flight ends as usual on the replica it holds.
    router.hear(&d.request_id, Event::End);
    assert_eq!(r1.in_flight(), 0);

    // A file that does not validate, and one that changes what does not reload: nothing changes.
    std::fs::write(path, yaml("  - {id: r1, address: not-an-address, models: [m]}\n")).unwrap();
    assert_eq!(apply(&router, path), "invalid");
    std::fs::write(path, format!("routing: {{seed: 9}}\n{}", yaml(TWO))).unwrap();
    assert_eq!(apply(&router, path), "refused");
    let refused = router.reload(Config::load(path).unwrap()).unwrap_err().to_string();
    assert!(refused.contains("routing changed otherwise"), "{refused}");
    // A tokenizer that does not load refuses the whole file.
    std::fs::write(path, yaml(TWO).replace("builtin:sim", "hf:org/absent")).unwrap();
    assert_eq!(apply(&router, path), "refused");
    let refused = router.reload(Config::load(path).unwrap()).unwrap_err().to_string();
    assert!(refused.contains("tokenizer hf:org/absent"), "{refused}");
    assert_eq!(ids(&router), ["r1", "r2", "r3"]);
    assert_eq!(router.config().replicas.len(), 3, "the running configuration stays");
    assert_eq!(router.core.policy(0), "round_robin");

    // r3 leaves.
    std::fs::write(path, yaml(TWO)).unwrap();
    assert_eq!(apply(&router, path), "ok");
    assert_eq!(ids(&router), ["r1", "r2"]);
    assert!(!replica(&router, "r1").draining(), "its drain ended with the field");
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn a_reload_changes_a_models_policy_and_aliases_and_keeps_an_unchanged_models_state() {
    let two_models = |first: &str| {
        format!(
            "models:\n  - {{name: a, policy: round_robin}}\n  - {first}\nretry: {{fallbacks: 0}}\nreplicas:\n  \
             - {{id: r1, address: 127.0.0.1:8001, models: [a, b]}}\n  - {{id: r2, address: 127.0.0.1:8002, models: [a, b]}}\n"
        )
    };
    let router = Router::new(Config::parse(&two_models("{name: b, policy: round_robin}")).unwrap()).unwrap();
    let pick = |model: &'static str, id: &'static str| {
        let router = &router;
        async move {
            let body = format!(r#"{{"model": "{model}"}}"#);
            let d = router.decide(body.as_bytes(), Endpoint::Completions, id, None, None).await.unwrap();
            router.forget(&d.request_id);
            d.targets[0].id.clone()
        }
    };
    assert_eq!((pick("a", "1").await, pick("b", "2").await), ("r1".to_string(), "r1".to_string()));
    let a = router.core.model(0);
    // b changes policy and gains an alias; a is untouched.
    let done = router.reload(Config::parse(&two_models("{name: b, aliases: [bee], policy: least_request}")).unwrap()).unwrap();
    assert_eq!(done.models, 1);
    assert!(Arc::ptr_eq(&a, &router.core.model(0)), "a keeps its policy and its state");
    assert_eq!(router.core.policy(1), "least_request");
    assert_eq!(pick("a", "3").await, "r2", "a's round robin goes on where it was");
    assert_eq!(router.model_index("bee"), Some(1), "the new alias is served");
    // A changed parameter is a change too.
    let tuned = "{name: b, aliases: [bee], policy: least_request, policies: {cost_model: {epsilon: 0.5}}}";
    assert_eq!(router.reload(Config::parse(&two_models(tuned)).unwrap()).unwrap().models, 1);
}

#[tokio::test]
async fn models_are_known_by_name_so_a_reload_may_add_remove_and_reorder_them() {
    let config = |models: &str, served: &str| {
        format!(
            "models:\n{models}retry: {{fallbacks: 0}}\nreplicas:\n  - {{id: r1, address: 127.0.0.1:8001, models: [{served}]}}\n  \
             - {{id: r2, address: 127.0.0.1:8002, models: [{served}]}}\n"
        )
    };
    let (a, b, c) = ("  - {name: a, policy: round_robin}\n", "  - {name: b}\n", "  - {name: c, tokenizer: \"builtin:sim\"}\n");
    let router = Router::new(Config::parse(&config(&format!("{a}{b}"), "a, b")).unwrap()).unwrap();
    let pick = |model: &'static str, id: &'static str| {
        let router = &router;
        async move {
            let body = format!(r#"{{"model": "{model}", "prompt": "otters hold hands while they sleep so that they do not drift apart"}}"#);
            let d = router.decide(body.as_bytes(), Endpoint::Completions, id, None, None).await?;
            router.forget(&d.request_id);
            Ok::<_, crate::decision::RouteError>((d.targets[0].id.clone(), d.prompt_tokens))
        }
    };
    assert_eq!(pick("a", "1").await.unwrap(), ("r1".to_string(), None), "no tokenizer for a");
    let kept = router.core.model(router.model_index("a").unwrap());

    // c comes first, a moves second, b goes.
    let done = router.reload(Config::parse(&config(&format!("{c}{a}"), "a, c")).unwrap()).unwrap();
    assert_eq!(done.models, 1, "only c is new");
    let at = router.model_index("a").unwrap();
    assert!(Arc::ptr_eq(&kept, &router.core.model(at)), "a keeps its policy and its state wherever it stands");
    assert_eq!(pick("a", "2").await.unwrap().0, "r2", "a's round robin goes on where it was");
    let (_, tokens) = pick("c", "3").await.unwrap();
    assert!(tokens.is_some_and(|t| t > 0), "c's tokenizer was loaded by the reload");
    assert_eq!(pick("b", "4").await.unwrap_err(), crate::decision::RouteError::UnknownModel("b".into()));
    let listed: Vec<String> = serde_json::from_str::<serde_json::Value>(&crate::health::cards::models_json(&router, &[])).unwrap()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(listed, ["c", "a"], "/v1/models lists what the file offers, in its order");
    // b comes back: a fresh start in its old place.
    router.reload(Config::parse(&config(&format!("{a}{b}{c}"), "a, b, c")).unwrap()).unwrap();
    assert_eq!(pick("b", "5").await.unwrap().0, "r1");
    assert_eq!(router.core.models().len(), 3, "three names, three slots");
}
