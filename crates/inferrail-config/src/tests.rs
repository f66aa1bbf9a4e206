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
    assert_eq!(c.replicas[0].limits(), Limits::default());
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
}
