//! Decisions over in-memory fleets.

use super::*;
use crate::decision::{Decision, RouteError};
use inferrail_config::Config;
use inferrail_policy::NoReplica;
use inferrail_route::fleet::Lease;
use inferrail_tokenize::chat::Endpoint;

fn router(policy: &str, fallbacks: usize) -> Router {
    let yaml = format!(
        "
retry: {{fallbacks: {fallbacks}}}
models:
  - {{name: big, aliases: [b], policy: {policy}}}
  - {{name: small}}
replicas:
  - {{id: r1, address: 127.0.0.1:8001, models: [big], max_concurrency: 2}}
  - {{id: r2, address: 127.0.0.1:8002, models: [big, small]}}
  - {{id: r3, address: 127.0.0.1:8003, models: [big]}}
"
    );
    Router::new(Config::parse(&yaml).unwrap()).unwrap()
}

fn ids(d: &Decision) -> Vec<&str> {
    d.targets.iter().map(|r| r.id.as_str()).collect()
}

#[tokio::test]
async fn round_robin_names_the_winner_and_distinct_fallbacks() {
    let r = router("round_robin", 2);
    let a = r.decide(br#"{"model":"big"}"#, Endpoint::Completions, "1", None, None).await.unwrap();
    let b = r.decide(br#"{"model":"big"}"#, Endpoint::Completions, "2", None, None).await.unwrap();
    assert_eq!(ids(&a), ["r1", "r2", "r3"]);
    assert_eq!(ids(&b), ["r2", "r3", "r1"]);
    assert_eq!(a.policy, "round_robin");
    assert!(a.body.is_none(), "the engine's own name needs no rewrite");
}

#[tokio::test]
async fn aliases_and_a_missing_model_are_rewritten_in_the_body() {
    let r = router("round_robin", 0);
    let d = r.decide(br#"{"model": "b", "prompt": "x"}"#, Endpoint::Completions, "1", None, None).await.unwrap();
    assert_eq!(d.body.as_deref(), Some(&br#"{"model": "big", "prompt": "x"}"#[..]));
    assert_eq!(d.targets.len(), 1);
    assert_eq!(r.decide(br#"{"prompt": "x"}"#, Endpoint::Completions, "2", None, None).await.unwrap_err(), RouteError::MissingModel);
    assert_eq!(
        r.decide(br#"{"model": "huge"}"#, Endpoint::Completions, "3", None, None).await.unwrap_err(),
        RouteError::UnknownModel("huge".into())
    );
    assert!(matches!(r.decide(b"not json", Endpoint::Completions, "4", None, None).await.unwrap_err(), RouteError::Body(_)));
}

#[tokio::test]
async fn only_replicas_with_room_that_serve_the_model_are_offered() {
    let r = router("least_request", 2);
    let small = r.decide(br#"{"model":"small"}"#, Endpoint::Completions, "s", None, None).await.unwrap();
    assert_eq!(ids(&small), ["r2"]);
    // r1 takes at most 2; fill it and it is never offered again.
    let fleet = r.fleet();
    let r1 = fleet.replicas.iter().find(|x| x.id == "r1").unwrap().clone();
    let _held: Vec<Lease> = (0..2).map(|_| Lease::new(r1.clone(), 0, 0)).collect();
    for i in 0..20 {
        let d = r.decide(br#"{"model":"big"}"#, Endpoint::Completions, &format!("b{i}"), None, None).await.unwrap();
        assert!(!ids(&d).contains(&"r1"), "{:?}", ids(&d));
        r.forget(&format!("b{i}"));
    }
}

#[tokio::test]
async fn leases_follow_the_request_and_are_released_at_its_end() {
    let r = router("least_request", 1);
    let d = r.decide(br#"{"model":"small"}"#, Endpoint::Completions, "x", None, None).await.unwrap();
    assert_eq!(d.targets[0].in_flight(), 1);
    assert_eq!(r.leases_held(), 1);
    drop(r.forget("x"));
    assert_eq!(d.targets[0].in_flight(), 0);
    assert_eq!(r.leases_held(), 0);
}

#[tokio::test]
async fn a_fleet_failing_every_probe_is_still_routed_and_the_decision_says_panic() {
    let r = router("p2c", 1);
    for rep in &r.fleet().replicas {
        rep.set_probe(false);
    }
    assert!(!r.ready(), "not ready: no replica passes its probes");
    let d = r.decide(br#"{"model":"big"}"#, Endpoint::Completions, "x", None, None).await.unwrap();
    assert_eq!(d.steer, Some("panic"), "every replica offered, as Envoy's balancer does below its panic threshold");
    assert_eq!(d.targets.len(), 2, "the winner and a fallback");
    // One healthy replica again: the others are set aside as before.
    r.fleet().replicas[2].set_probe(true);
    let d = r.decide(br#"{"model":"big"}"#, Endpoint::Completions, "y", None, None).await.unwrap();
    assert_eq!((ids(&d), d.steer), (vec!["r3"], None));
}

#[tokio::test]
async fn a_request_every_replica_is_too_full_for_is_shed_with_a_429() {
    let r = router("least_request", 1);
    let fleet = r.fleet();
    let r2 = fleet.replicas.iter().find(|x| x.id == "r2").unwrap().clone();
    // r2 alone serves `small`, and takes at most max_pending requests waiting for a first byte.
    let _held: Vec<Lease> = (0..r2.limits().max_pending).map(|_| Lease::new(r2.clone(), 1, 0)).collect();
    let e = r.decide(br#"{"model":"small"}"#, Endpoint::Completions, "x", None, None).await.unwrap_err();
    assert_eq!(e, RouteError::NoReplica(NoReplica::AllFull));
    assert_eq!(e.http(), (429, "RateLimitError", None));
}

#[tokio::test]
async fn a_request_id_already_in_flight_gets_a_fresh_one() {
    let r = router("round_robin", 0);
    let a = r.decide(br#"{"model":"big"}"#, Endpoint::Completions, "dup", None, None).await.unwrap();
    let b = r.decide(br#"{"model":"big"}"#, Endpoint::Completions, "dup", None, None).await.unwrap();
    assert_eq!(a.request_id, "dup");
    assert_eq!(b.request_id, "dup.1");
    assert_eq!(r.leases_held(), 2);
    r.forget("dup");
    assert_eq!(b.targets[0].in_flight(), 1, "the second request's slot is untouched");
}

#[tokio::test]
async fn a_null_model_is_replaced_where_it_sits() {
    let r = router("round_robin", 0);
    assert_eq!(r.decide(br#"{"model": null}"#, Endpoint::Completions, "x", None, None).await.unwrap_err(), RouteError::MissingModel);
    let single =
        Router::new(Config::parse("models: [{name: only}]\nreplicas: [{id: a, address: 127.0.0.1:1, models: [only]}]\n").unwrap()).unwrap();
    let d = single.decide(br#"{"model": null, "prompt": "p"}"#, Endpoint::Completions, "y", None, None).await.unwrap();
    assert_eq!(d.body.as_deref(), Some(&br#"{"model": "only", "prompt": "p"}"#[..]));
}

#[tokio::test]
async fn a_repeated_prompt_is_predicted_cached_on_the_replica_that_took_it() {
    let yaml = "
retry: {fallbacks: 1}
models: [{name: m, tokenizer: builtin:sim}]
replicas:
  - {id: a, address: 127.0.0.1:1, models: [m], block_size: 4, kv_blocks: 64}
  - {id: b, address: 127.0.0.1:2, models: [m], block_size: 8, kv_blocks: 64}
";
    let r = Router::new(Config::parse(yaml).unwrap()).unwrap();
    let body = br#"{"model": "m", "prompt": "The quick brown fox jumps over the lazy dog, again and again.", "max_tokens": 1}"#;
    let first = r.decide(body, Endpoint::Completions, "1", None, None).await.unwrap();
    let n = first.prompt_tokens.unwrap();
    assert_eq!(n, inferrail_tokenize::sim::encode("The quick brown fox jumps over the lazy dog, again and again.").len());
    assert_eq!(first.cached_tokens, [0, 0]);
    assert_eq!(ids(&first), ["a", "b"]);
    // Round robin: b takes the second, and a holds the prompt in 4-token blocks, never its last token.
    let second = r.decide(body, Endpoint::Completions, "2", None, None).await.unwrap();
    assert_eq!(ids(&second), ["b", "a"]);
    assert_eq!(second.cached_tokens, [0, (n - 1) / 4 * 4]);
    let third = r.decide(body, Endpoint::Completions, "3", None, None).await.unwrap();
    assert_eq!(third.cached_tokens, [(n - 1) / 4 * 4, (n - 1) / 8 * 8]);
    // A model without a tokenizer, or a body the tokenizer cannot follow, is routed without a prediction.
    let batch = r.decide(br#"{"model": "m", "prompt": ["a", "b"]}"#, Endpoint::Completions, "4", None, None).await.unwrap();
    assert_eq!((batch.prompt_tokens, batch.cached_tokens.len()), (None, 0));
}

#[tokio::test]
async fn a_replica_configured_to_drain_is_offered_nothing() {
    let yaml = "
models: [{name: m, policy: round_robin}]
replicas:
  - {id: r1, address: 127.0.0.1:8001, models: [m], drain: true}
  - {id: r2, address: 127.0.0.1:8002, models: [m]}
";
    let r = Router::new(Config::parse(yaml).unwrap()).unwrap();
    for i in 0..4 {
        let d = r.decide(br#"{"model":"m"}"#, Endpoint::Completions, &i.to_string(), None, None).await.unwrap();
        assert_eq!(ids(&d), ["r2"], "r1 drains: not even a fallback");
    }
}

/// The router's clock is tokio's: with time paused, a request that ended
/// with no status is held for exactly its grace on that clock.
#[tokio::test(start_paused = true)]
async fn the_routers_clock_runs_on_tokios_paused_time() {
    let r = router("round_robin", 0);
    let d = r.decide(br#"{"model": "small", "prompt": "x"}"#, Endpoint::Completions, "p", None, None).await.unwrap();
    let ended = r.now();
    assert!(r.hear(&d.request_id, inferrail_route::lifecycle::Event::End));
    tokio::time::advance(std::time::Duration::from_millis(499)).await;
    assert_eq!(r.now() - ended, std::time::Duration::from_millis(499), "the router reads the paused clock");
    r.sweep();
    assert!(r.lease(&d.request_id).is_some(), "still within its grace");
    tokio::time::advance(std::time::Duration::from_millis(1)).await;
    r.sweep();
    assert!(r.lease(&d.request_id).is_none(), "its grace is over on the paused clock");
}

#[tokio::test]
async fn a_reported_cache_size_keeps_what_the_requests_before_it_put_there() {
    // No cache shape configured: the router starts from the default (blocks of 16) until the engine reports its own.
    let yaml = "
models: [{name: m, tokenizer: builtin:sim, policy: cost_model}]
replicas:
  - {id: a, address: 127.0.0.1:1, models: [m]}
  - {id: b, address: 127.0.0.1:2, models: [m]}
";
    let r = Router::new(Config::parse(yaml).unwrap()).unwrap();
    let prompt = "The quick brown fox jumps over the lazy dog, again and again. ".repeat(8);
    let body = format!(r#"{{"model": "m", "prompt": "{prompt}", "max_tokens": 1}}"#);
    let first = r.decide(body.as_bytes(), Endpoint::Completions, "1", None, None).await.unwrap();
    assert!(r.hear("1", inferrail_route::lifecycle::Event::End));
    let held = first.targets[0].id.clone();
    let n = first.prompt_tokens.unwrap();
    assert!(n > 32);
    // The first scrape reports a larger cache of the same block size, then a smaller one that still holds the prompt.
    for blocks in [100_000, 64] {
        for replica in &r.fleet().replicas {
            r.core.learned(replica, 16, blocks);
        }
        let id = format!("again-{blocks}");
        let again = r.decide(body.as_bytes(), Endpoint::Completions, &id, None, None).await.unwrap();
        assert_eq!((again.targets[0].id.as_str(), again.cached_tokens[0]), (held.as_str(), (n - 1) / 16 * 16), "after {blocks} blocks");
        assert!(r.hear(&id, inferrail_route::lifecycle::Event::End));
    }
    // A new block size changes every hash: that shadow starts over.
    for replica in &r.fleet().replicas {
        r.core.learned(replica, 4, 64);
    }
    let other = r.decide(body.as_bytes(), Endpoint::Completions, "other", None, None).await.unwrap();
    assert_eq!(other.cached_tokens[0], 0);
}
