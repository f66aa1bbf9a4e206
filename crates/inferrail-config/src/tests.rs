//! Parsing, defaults and validation.

use super::*;

const MINIMAL: &str = "
models:
  - name: m
    aliases: [sim]
    policy: p2c
replicas:
  - {id: a, address: 127.0.0.1:8001, models: [m]}
";

#[test]
fn the_minimal_config_takes_defaults() {
    let c = Config::parse(MINIMAL).unwrap();
    assert_eq!(c.server.listen, "127.0.0.1:9002");
    assert_eq!(c.retry.fallbacks, 2);
    assert_eq!(c.replicas[0].serving.limits(), Limits::default());
    assert_eq!(c.models[0].policy, PolicyKind::P2c);
    assert_eq!(c.models[0].aliases, ["sim"]);
}

#[test]
fn every_problem_is_reported_at_once_with_its_path() {
    let text = "
server: {listen: nowhere, colour: blue}
retry: {fallbacks: 9}
models:
  - {name: m, aliases: [m2]}
  - {name: m2}
  - {name: lonely}
replicas:
  - {id: a, address: 'localhost:8001', models: [m, ghost], max_concurrency: 0}
  - {id: a, address: 127.0.0.1:8002, models: [m], spare: 1}
";
    let Err(ConfigError::Invalid(problems)) = Config::parse(text) else { panic!("accepted") };
    let expected = [
        "server.colour: unknown key",
        "replicas[1].spare: unknown key",
        "server.listen: \"nowhere\" is not ip:port",
        "retry.fallbacks: 9 is more than 8",
        "models[1]: the name \"m2\" is used twice",
        "replicas[0].address: \"localhost:8001\"",
        "replicas[0].models[1]: \"ghost\" is not a configured model name",
        "replicas[0]: max_concurrency and max_pending must be at least 1",
        "replicas[1].id: \"a\" is used twice",
        "models[1]: no replica or discovery group serves \"m2\"",
        "models[2]: no replica or discovery group serves \"lonely\"",
    ];
    for e in expected {
        assert!(problems.iter().any(|p| p.starts_with(e)), "missing {e:?} in {problems:#?}");
    }
    assert_eq!(problems.len(), expected.len(), "{problems:#?}");
}

#[test]
fn wrong_types_are_refused() {
    let e = Config::parse("retry: {fallbacks: many}\n").unwrap_err();
    assert!(matches!(e, ConfigError::Parse(_)), "{e}");
    assert!(e.to_string().contains("fallbacks"), "{e}");
}

#[test]
fn the_documented_example_is_valid_and_complete() {
    let text = include_str!("../example.yaml");
    let parsed = Config::parse(text).unwrap();
    // Every option appears in the example: its keys cover the full default tree.
    let full = serde_yaml::to_value(Config { discovery: parsed.discovery.clone(), ..Config::default() }).unwrap();
    let example: serde_yaml::Value = serde_yaml::from_str(text).unwrap();
    fn keys(v: &serde_yaml::Value, prefix: &str, out: &mut Vec<String>) {
        if let serde_yaml::Value::Mapping(m) = v {
            for (k, v) in m {
                let k = format!("{prefix}{}", k.as_str().unwrap_or_default());
                keys(v, &format!("{k}."), out);
                out.push(k);
            }
        }
    }
    let (mut want, mut have) = (Vec::new(), Vec::new());
    keys(&full, "", &mut want);
    keys(&example, "", &mut have);
    for k in want {
        assert!(have.contains(&k), "example.yaml does not document {k}");
    }
    // And the policy parameters it shows are the defaults.
    assert_eq!(parsed.routing.policies, Config::default().routing.policies, "example.yaml's policy parameters differ from the defaults");
}

#[test]
fn policy_parameters_are_global_with_per_model_overrides_and_bad_ones_are_named_by_path() {
    let text = "
routing:
  policies:
    prefill: {prefill_token_us: 80}
    cost_model: {epsilon: 0.5}
models:
  - name: m
    policy: cost_model
    policies:
      cost_model: {kappa: 0.8, hot_prefix: {blocks: 8}}
  - {name: n, policy: kv_aware}
replicas:
  - {id: a, address: 127.0.0.1:8001, models: [m, n]}
";
    let c = Config::parse(text).unwrap();
    let (m, n) = (c.params(0).unwrap(), c.params(1).unwrap());
    assert_eq!((m.cost_model.epsilon, m.cost_model.kappa, m.cost_model.hot_prefix.blocks), (0.5, 0.8, 8));
    assert_eq!(m.cost_model.hot_prefix.window_secs, 60.0, "fields not given keep the global value");
    assert_eq!((m.prefill.prefill_token_us, n.prefill.prefill_token_us), (80.0, 80.0));
    assert_eq!((n.cost_model.epsilon, n.cost_model.kappa), (0.5, 0.92));

    let bad = "
routing:
  policies:
    cost_model: {kappa: 1.5, epsilon: -1, colour: red}
models:
  - name: m
    policies: {kv_aware: {load_weight: -2, spin: 1}, prefix_hash: {blocks: 0}}
replicas:
  - {id: a, address: 127.0.0.1:8001, models: [m]}
";
    let Err(ConfigError::Invalid(problems)) = Config::parse(bad) else { panic!("accepted") };
    let expected = [
        "routing.policies.cost_model.colour: unknown key",
        "routing.policies.cost_model.epsilon: -1 is not a non-negative number",
        "routing.policies.cost_model.kappa: 1.5 is not in (0, 1]",
        "models[0].policies.kv_aware.spin: unknown key",
    ];
    for e in expected {
        assert!(problems.iter().any(|p| p.starts_with(e)), "missing {e:?} in {problems:#?}");
    }
    assert_eq!(problems.len(), expected.len(), "an override with unknown keys is not validated further: {problems:#?}");
}

#[test]
fn traces_are_off_by_default_and_bad_trace_settings_are_named_by_path() {
    let c = Config::parse(MINIMAL).unwrap();
    assert_eq!((c.observability.otlp_endpoint.as_deref(), c.observability.trace_sample_ratio), (None, 1.0));
    let text = format!("{MINIMAL}observability: {{otlp_endpoint: 'https://collector:4318', trace_sample_ratio: 1.5}}\n");
    let Err(ConfigError::Invalid(problems)) = Config::parse(&text) else { panic!("accepted") };
    assert!(problems.iter().any(|p| p.starts_with("observability.trace_sample_ratio: 1.5")), "{problems:#?}");
    assert!(problems.iter().any(|p| p.starts_with("observability.otlp_endpoint: \"https://collector:4318\"")), "{problems:#?}");
    assert_eq!(problems.len(), 2, "{problems:#?}");
    let ok = format!("{MINIMAL}observability: {{otlp_endpoint: 'http://127.0.0.1:4318', trace_sample_ratio: 0.1}}\n");
    assert_eq!(Config::parse(&ok).unwrap().observability.otlp_endpoint.as_deref(), Some("http://127.0.0.1:4318"));
}

#[test]
fn kv_events_come_from_the_replica_or_the_template() {
    let c = Config::parse(
        r#"
models: [{name: m}]
kv_events: {endpoint: "tcp://{host}:5557", replay_endpoint: "tcp://{host}:5558", topic: kv-events}
replicas:
  - {id: a, address: "10.0.0.1:8000", models: [m]}
  - {id: b, address: "10.0.0.2:8000", models: [m], kv_events: {endpoint: "tcp://*:6000", bind: true}}
"#,
    )
    .unwrap();
    let own = |id: &str| c.replicas.iter().find(|r| r.id == id).and_then(|r| r.kv_events.as_ref());
    let a = c.event_source(own("a"), "10.0.0.1".parse().unwrap()).unwrap();
    assert_eq!(
        (a.endpoint.as_str(), a.replay_endpoint.as_deref(), a.topic.as_str(), a.bind),
        ("tcp://10.0.0.1:5557", Some("tcp://10.0.0.1:5558"), "kv-events", false)
    );
    let b = c.event_source(own("b"), "10.0.0.2".parse().unwrap()).unwrap();
    assert_eq!((b.endpoint.as_str(), b.replay_endpoint, b.topic.as_str(), b.bind), ("tcp://*:6000", None, "kv-events", true));
    assert_eq!(Config::default().event_source(None, "10.0.0.1".parse().unwrap()), None, "no template, no events");
    let bad = Config::parse("models: [{name: m}]\nkv_events: {endpoint: \"http://x\", queue: 0}\n");
    let Err(ConfigError::Invalid(problems)) = bad else { panic!("accepted {bad:?}") };
    assert!(problems.iter().any(|p| p.starts_with("kv_events.endpoint")), "{problems:?}");
    assert!(problems.iter().any(|p| p.contains("queue")), "{problems:?}");
}

#[test]
fn a_replica_may_carry_its_own_prefill_cost_and_bad_values_are_named_by_path() {
    let text = "
models: [{name: m}]
replicas:
  - {id: fast, address: 127.0.0.1:8001, models: [m], prefill: {prefill_token_us: 40, prefill_pair_ns: 1.1}}
  - {id: plain, address: 127.0.0.1:8002, models: [m]}
";
    let c = Config::parse(text).unwrap();
    let fast = c.replicas[0].serving.prefill.expect("fast has its own cost");
    assert_eq!((fast.prefill_token_us, fast.prefill_pair_ns, fast.prefill_fixed_ms), (40.0, 1.1, 5.0), "unset fields keep the defaults");
    assert_eq!(c.replicas[1].serving.prefill, None, "the model's cost applies");

    let bad = "
models: [{name: m}]
replicas:
  - {id: a, address: 127.0.0.1:8001, models: [m], prefill: {prefill_token_us: -3}}
discovery:
  - {group: g, host: localhost, models: [m], prefill: {prefill_fixed_ms: .nan}}
";
    let Err(ConfigError::Invalid(problems)) = Config::parse(bad) else { panic!("accepted") };
    for e in ["replicas[0].prefill.prefill_token_us: -3 is not", "discovery[0].prefill.prefill_fixed_ms: NaN is not"] {
        assert!(problems.iter().any(|p| p.starts_with(e)), "missing {e:?} in {problems:#?}");
    }
}

#[test]
fn a_model_may_name_a_shadow_policy_and_a_wrong_name_is_refused() {
    let ok =
        "models: [{name: m, policy: round_robin, shadow_policy: cost_model}]\nreplicas: [{id: a, address: 127.0.0.1:1, models: [m]}]\n";
    assert_eq!(Config::parse(ok).unwrap().models[0].shadow_policy, Some(PolicyKind::CostModel));
    let bad = ok.replace("shadow_policy: cost_model", "shadow_policy: clairvoyant");
    let e = Config::parse(&bad).unwrap_err().to_string();
    assert!(e.contains("clairvoyant"), "{e}");
}

proptest::proptest! {
    /// Any routing YAML is a configuration or an error that says why, never
    /// a panic: the shipped example with any line's value replaced by a
    /// hostile one, and text of any shape.
    #[test]
    fn any_routing_yaml_is_a_config_or_an_error_never_a_panic(
        line in 0usize..600,
        hostile in proptest::sample::select(vec![
            "-1", "0", "1e309", "18446744073709551616", "[]", "{}", "null", "''", "~", "!!binary AAAA",
            "&a [*a, *a]", "NaN", ".inf", "{name: {}}", "[1, [2, [3, [4]]]]", "'\u{0}'", "0x10", "true",
        ]),
        text in ".{0,300}",
    ) {
        let example = include_str!("../example.yaml");
        let mut lines: Vec<String> = example.lines().map(str::to_owned).collect();
        let at = line % lines.len();
        if let Some((key, _)) = lines[at].split_once(": ") {
            lines[at] = format!("{key}: {hostile}");
        } else {
            lines[at] = hostile.to_string();
        }
        if let Err(e) = Config::parse(&lines.join("\n")) {
            proptest::prop_assert!(!e.to_string().is_empty());
        }
        let _ = Config::parse(&text);
    }
}

#[test]
fn a_model_needs_a_replica_that_decodes_beside_its_prefill_only_ones() {
    let only_prefill = "
models: [{name: m}]
replicas:
  - {id: p, address: 127.0.0.1:8001, models: [m], role: prefill}
";
    let e = Config::parse(only_prefill).unwrap_err().to_string();
    assert!(e.contains("no replica or discovery group serves \"m\""), "{e}");
    let pair = format!("{only_prefill}  - {{id: d, address: 127.0.0.1:8002, models: [m], role: decode}}\n");
    let c = Config::parse(&pair).unwrap();
    assert_eq!(c.replicas.iter().map(|r| r.serving.role).collect::<Vec<_>>(), [Role::Prefill, Role::Decode]);
    assert!(Config::parse(&only_prefill.replace("prefill}", "sideways}")).is_err());
}
