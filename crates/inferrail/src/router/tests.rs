//! Decisions over in-memory fleets.

use super::*;
use inferrail_config::Config;

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
    Router::new(Config::parse(&yaml).unwrap())
}

fn ids(d: &Decision) -> Vec<&str> {
    d.targets.iter().map(|r| r.id.as_str()).collect()
}

#[test]
fn round_robin_names_the_winner_and_distinct_fallbacks() {
    let r = router("round_robin", 2);
    let a = r.decide(br#"{"model":"big"}"#, "1").unwrap();
    let b = r.decide(br#"{"model":"big"}"#, "2").unwrap();
    assert_eq!(ids(&a), ["r1", "r2", "r3"]);
    assert_eq!(ids(&b), ["r2", "r3", "r1"]);
    assert_eq!(a.policy, "round_robin");
    assert!(a.body.is_none(), "the engine's own name needs no rewrite");
}

#[test]
fn aliases_and_a_missing_model_are_rewritten_in_the_body() {
    let r = router("round_robin", 0);
    let d = r.decide(br#"{"model": "b", "prompt": "x"}"#, "1").unwrap();
    assert_eq!(d.body.as_deref(), Some(&br#"{"model": "big", "prompt": "x"}"#[..]));
    assert_eq!(d.targets.len(), 1);
    assert_eq!(r.decide(br#"{"prompt": "x"}"#, "2").unwrap_err(), RouteError::MissingModel);
    assert_eq!(r.decide(br#"{"model": "huge"}"#, "3").unwrap_err(), RouteError::UnknownModel("huge".into()));
    assert!(matches!(r.decide(b"not json", "4").unwrap_err(), RouteError::Body(_)));
}

#[test]
fn only_replicas_with_room_that_serve_the_model_are_offered() {
    let r = router("least_request", 2);
    let small = r.decide(br#"{"model":"small"}"#, "s").unwrap();
    assert_eq!(ids(&small), ["r2"]);
    // r1 takes at most 2; fill it and it is never offered again.
    let fleet = r.fleet();
    let r1 = fleet.replicas.iter().find(|x| x.id == "r1").unwrap().clone();
    let _held: Vec<Lease> = (0..2).map(|_| Lease::new(r1.clone(), 0)).collect();
    for i in 0..20 {
        let d = r.decide(br#"{"model":"big"}"#, &format!("b{i}")).unwrap();
        assert!(!ids(&d).contains(&"r1"), "{:?}", ids(&d));
        r.forget(&format!("b{i}"));
    }
}

#[test]
fn leases_follow_the_request_and_are_released_at_its_end() {
    let r = router("least_request", 1);
    let d = r.decide(br#"{"model":"small"}"#, "x").unwrap();
    assert_eq!(d.targets[0].in_flight(), 1);
    assert_eq!(r.leases_held(), 1);
    drop(r.forget("x"));
    assert_eq!(d.targets[0].in_flight(), 0);
    assert_eq!(r.leases_held(), 0);
}

#[test]
fn an_unhealthy_fleet_is_reported_as_such() {
    let r = router("p2c", 1);
    for rep in &r.fleet().replicas {
        rep.set_probe(false);
    }
    assert_eq!(r.decide(br#"{"model":"big"}"#, "x").unwrap_err(), RouteError::NoReplica(NoReplica::AllUnhealthy));
    assert_eq!(r.decide(br#"{"model":"big"}"#, "x").unwrap_err().http().0, 503);
}

#[test]
fn a_request_id_already_in_flight_gets_a_fresh_one() {
    let r = router("round_robin", 0);
    let a = r.decide(br#"{"model":"big"}"#, "dup").unwrap();
    let b = r.decide(br#"{"model":"big"}"#, "dup").unwrap();
    assert_eq!(a.request_id, "dup");
    assert_eq!(b.request_id, "dup.1");
    assert_eq!(r.leases_held(), 2);
    r.forget("dup");
    assert_eq!(b.targets[0].in_flight(), 1, "the second request's slot is untouched");
}

#[test]
fn a_null_model_is_replaced_where_it_sits() {
    let r = router("round_robin", 0);
    assert_eq!(r.decide(br#"{"model": null}"#, "x").unwrap_err(), RouteError::MissingModel);
    let single = Router::new(Config::parse("models: [{name: only}]\nreplicas: [{id: a, address: 127.0.0.1:1, models: [only]}]\n").unwrap());
    let d = single.decide(br#"{"model": null, "prompt": "p"}"#, "y").unwrap();
    assert_eq!(d.body.as_deref(), Some(&br#"{"model": "only", "prompt": "p"}"#[..]));
}
