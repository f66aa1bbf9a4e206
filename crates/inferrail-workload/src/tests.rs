//! Workload shapes and determinism.

use std::collections::{HashMap, HashSet};

use rand::SeedableRng;
use rand::rngs::StdRng;
use serde_json::Value;

use super::*;

fn small(kind: Kind) -> Spec {
    Spec { system_tokens: Span { min: 200, max: 400 }, question_tokens: Span { min: 20, max: 40 }, ..Spec::new(kind) }
}

fn system_of(r: &Request) -> Option<&str> {
    r.body["messages"].as_array()?.iter().find(|m| m["role"] == "system")?["content"].as_str()
}

fn max_tokens(r: &Request) -> u64 {
    r.body["max_tokens"].as_u64().unwrap_or(0)
}

#[test]
fn the_same_seed_gives_the_same_requests_and_another_seed_others() {
    for kind in [Kind::W1, Kind::W2, Kind::W6, Kind::Mix, Kind::Hot, Kind::Rag, Kind::Burst, Kind::Long, Kind::Agent] {
        let spec = small(kind);
        let a = generate(&spec, 4.0, 60.0, 1).expect("generates");
        assert!(!a.is_empty(), "{kind:?}");
        assert_eq!(a, generate(&spec, 4.0, 60.0, 1).expect("generates"), "{kind:?}");
        assert_ne!(a, generate(&spec, 4.0, 60.0, 2).expect("generates"), "{kind:?}");
        assert!(a.windows(2).all(|w| w[0].at <= w[1].at));
        assert!(a.iter().all(|r| (50..=300).contains(&max_tokens(r)) || kind == Kind::W2));
    }
}

#[test]
fn w1_shares_a_handful_of_long_system_prompts_and_asks_short_questions() {
    let spec = Spec::new(Kind::W1);
    let reqs = generate(&spec, 2.0, 60.0, 7).expect("generates");
    let systems: HashSet<&str> = reqs.iter().filter_map(system_of).collect();
    assert!((4..=6).contains(&systems.len()), "{}", systems.len());
    assert!(systems.iter().all(|s| (2000..=8000).contains(&s.split(' ').count())));
    for r in &reqs {
        assert!((2000..8040).contains(&r.shared_prefix_tokens), "{}", r.shared_prefix_tokens);
        let question = r.prompt_tokens - r.shared_prefix_tokens;
        assert!((50..=520).contains(&question), "{question}");
    }
    // Requests with the same system prompt share exactly the known prefix.
    let counter = Counter::new().expect("tokenizer");
    let (a, b) = reqs
        .iter()
        .enumerate()
        .find_map(|(i, a)| reqs[i + 1..].iter().find(|b| system_of(a) == system_of(b)).map(|b| (a, b)))
        .expect("two requests share a prompt");
    let lcp = common_prefix(&counter.ids(a.api, &a.body).expect("ids"), &counter.ids(b.api, &b.body).expect("ids"));
    assert_eq!(lcp, a.shared_prefix_tokens);
}

#[test]
fn w6_shares_nothing_beyond_the_chat_template() {
    let reqs = generate(&small(Kind::W6), 2.0, 20.0, 3).expect("generates");
    let counter = Counter::new().expect("tokenizer");
    let ids: Vec<Vec<u32>> = reqs.iter().map(|r| counter.ids(r.api, &r.body).expect("ids")).collect();
    for (i, a) in ids.iter().enumerate() {
        for b in &ids[i + 1..] {
            assert!(common_prefix(a, b) < 16, "shared a whole KV block");
        }
    }
    assert!(reqs.iter().all(|r| r.shared_prefix_tokens == 0 && system_of(r).is_none()));
    assert!(reqs.iter().all(|r| (220..=450).contains(&r.prompt_tokens)));
}

#[test]
fn mix_is_half_w1_half_w6() {
    let reqs = generate(&small(Kind::Mix), 20.0, 50.0, 5).expect("generates");
    let shared = reqs.iter().filter(|r| r.shared_prefix_tokens > 0).count() as f64 / reqs.len() as f64;
    assert!((0.45..0.55).contains(&shared), "{shared}");
}

#[test]
fn hot_draws_prompts_by_zipf_weight() {
    let zipf = Zipf::new(6, 1.1);
    let expected = 1.0 / (1..=6).map(|k| (k as f64).powf(-1.1)).sum::<f64>();
    assert!((zipf.top_share() - expected).abs() < 1e-12);
    let mut rng = StdRng::seed_from_u64(9);
    let mut counts = [0usize; 6];
    for _ in 0..100_000 {
        counts[zipf.draw(&mut rng)] += 1;
    }
    assert!((counts[0] as f64 / 1e5 - expected).abs() < 0.01, "{counts:?}");
    assert!(counts.windows(2).all(|w| w[0] > w[1]), "{counts:?}");

    let reqs = generate(&small(Kind::Hot), 20.0, 100.0, 5).expect("generates");
    let mut by_prompt: HashMap<&str, usize> = HashMap::new();
    for r in &reqs {
        *by_prompt.entry(system_of(r).unwrap_or("")).or_default() += 1;
    }
    let top = by_prompt.values().max().copied().unwrap_or(0) as f64 / reqs.len() as f64;
    assert!((top - expected).abs() < 0.04, "top share {top}, expected {expected}");
}

/// A `rag` request's document: the user message up to the question.
fn document_of(r: &Request) -> &str {
    let user = r.body["messages"][1]["content"].as_str().unwrap_or("");
    user.split("\n\nQuestion: ").next().unwrap_or("")
}

#[test]
fn rag_places_documents_drawn_by_zipf_weight_between_an_apps_prompt_and_the_question() {
    let spec = Spec { documents: 20, document_tokens: Span { min: 300, max: 600 }, ..small(Kind::Rag) };
    let reqs = generate(&spec, 20.0, 100.0, 3).expect("generates");
    let mut by_doc: HashMap<&str, usize> = HashMap::new();
    for r in &reqs {
        *by_doc.entry(document_of(r)).or_default() += 1;
    }
    let expected = Zipf::new(20, 1.1).top_share();
    let top = by_doc.values().max().copied().unwrap_or(0) as f64 / reqs.len() as f64;
    assert!((top - expected).abs() < 0.04, "the top document's share {top}, expected {expected}");
    let apps: HashSet<&str> = reqs.iter().filter_map(system_of).collect();
    assert_eq!(apps.len(), 6);
    // Requests of one application and document share exactly the known prefix: its prompt and the document.
    let counter = Counter::new().expect("tokenizer");
    let (a, b) = reqs
        .iter()
        .enumerate()
        .find_map(|(i, a)| reqs[i + 1..].iter().find(|b| system_of(a) == system_of(b) && document_of(a) == document_of(b)).map(|b| (a, b)))
        .expect("two requests share an application and a document");
    let lcp = common_prefix(&counter.ids(a.api, &a.body).expect("ids"), &counter.ids(b.api, &b.body).expect("ids"));
    assert_eq!(lcp, a.shared_prefix_tokens);
    assert!(a.shared_prefix_tokens >= 300, "{}", a.shared_prefix_tokens);
}

#[test]
fn bursts_share_one_task_and_arrive_within_a_second() {
    let spec = Spec { burst_size: 50, ..small(Kind::Burst) };
    let reqs = generate(&spec, 10.0, 100.0, 4).expect("generates");
    // Each question starts with its marker, `b{burst}q{i}`.
    let mut bursts: HashMap<&str, Vec<&Request>> = HashMap::new();
    for r in &reqs {
        let question = r.body["messages"][1]["content"].as_str().unwrap_or("");
        let burst = question.split('q').next().unwrap_or("");
        bursts.entry(burst).or_default().push(r);
    }
    // 0.2 bursts a second over 100 s.
    assert!((10..=30).contains(&bursts.len()), "{} bursts", bursts.len());
    for (name, b) in &bursts {
        let (first, last) = (b[0].at.as_secs_f64(), b[b.len() - 1].at.as_secs_f64());
        assert!(last - first < 1.0, "{name} spans {first}..{last}");
        // The last burst may be cut at the end of the run.
        assert!(b.len() == 50 || last > 98.0, "{name}: {} requests", b.len());
        let tasks: HashSet<&str> = b.iter().filter_map(|r| system_of(r)).collect();
        assert_eq!(tasks.len(), 1, "one task a burst");
        assert!(b.iter().all(|r| r.shared_prefix_tokens >= 200));
    }
}

#[test]
fn w2_sessions_resend_their_history_and_think_10_to_20_s() {
    let reqs = generate(&small(Kind::W2), 2.0, 120.0, 4).expect("generates");
    let mut sessions: HashMap<&str, Vec<&Request>> = HashMap::new();
    for r in &reqs {
        sessions.entry(r.session.as_deref().expect("a session")).or_default().push(r);
    }
    assert!(sessions.values().any(|turns| turns.len() >= 3));
    for turns in sessions.values() {
        assert_eq!(turns[0].shared_prefix_tokens, 0);
        for w in turns.windows(2) {
            let gap = (w[1].at - w[0].at).as_secs_f64();
            assert!((10.0..=20.0).contains(&gap), "{gap}");
            let (prev, cur) = (w[0].body["messages"].as_array().expect("list"), w[1].body["messages"].as_array().expect("list"));
            assert_eq!(&cur[..prev.len()], &prev[..], "the history is resent");
            assert_eq!(cur.len(), prev.len() + 2);
            assert_eq!(cur[prev.len()]["role"], "assistant");
            let reply = cur[prev.len()]["content"].as_str().expect("text");
            assert_eq!(inferrail_tokenize::sim::encode(reply).len() as u64, max_tokens(w[0]), "the reply is as long as asked");
            assert_eq!(w[1].shared_prefix_tokens, w[0].prompt_tokens, "the previous prompt is a prefix");
        }
    }
}

#[test]
fn agents_take_their_steps_in_order_each_adding_a_tool_output() {
    let spec = Spec { system_prompts: 2, turns: Span { min: 3, max: 8 }, ..small(Kind::Agent) };
    let reqs = generate(&spec, 11.0, 100.0, 5).expect("generates");
    let mut agents: Vec<Vec<&Request>> = Vec::new();
    for r in &reqs {
        let step = r.step.as_ref().expect("every request is a step");
        if step.agent == agents.len() {
            agents.push(Vec::new());
        }
        assert!(step.agent < agents.len(), "agent {} before agent {}", step.agent, agents.len() - 1);
        agents[step.agent].push(r);
    }
    // 11 steps a second over 100 s, 5.5 steps an agent: 200 agents on average.
    assert!((150..=250).contains(&agents.len()), "{} agents", agents.len());
    let frameworks: HashSet<&str> = agents.iter().filter_map(|a| system_of(a[0])).collect();
    assert_eq!(frameworks.len(), 2);
    let counter = Counter::new().expect("tokenizer");
    for steps in &agents {
        assert!((3..=8).contains(&steps.len()), "{}", steps.len());
        assert!(steps.iter().all(|r| r.at == steps[0].at), "every step at the agent's arrival");
        let first = steps[0];
        assert_eq!(first.step.as_ref().map(|s| s.think), Some(Duration::ZERO));
        assert_eq!(first.body["messages"].as_array().map(Vec::len), Some(2), "a framework and a task");
        assert!(first.shared_prefix_tokens >= 200);
        assert_eq!(first.prompt_tokens, counter.ids(Api::Chat, &first.body).expect("ids").len());
        for r in &steps[1..] {
            let think = r.step.as_ref().expect("step").think;
            assert!((200..=1000).contains(&think.as_millis()), "{think:?}");
            let messages = r.body["messages"].as_array().expect("list");
            assert_eq!(messages.len(), 1, "only what the step adds");
            let tool = messages[0]["content"].as_str().expect("text");
            assert!(tool.starts_with("Tool output: a"), "{tool}");
            assert!((60..=200).contains(&(tool.split(' ').count() - 2)), "{tool}");
        }
    }
}

#[test]
fn w2_replays_sharegpt_conversations() {
    let path = std::env::temp_dir().join(format!("inferrail-bench-sharegpt-{}.json", std::process::id()));
    let file = r#"[{"conversations": [{"from": "human", "value": "hello there"}, {"from": "gpt", "value": "hi how are you"}, {"from": "human", "value": "fine thanks"}, {"from": "gpt", "value": "good"}]},
                   {"conversations": [{"from": "gpt", "value": "orphan"}]}]"#;
    std::fs::write(&path, file).expect("writes");
    let spec = Spec { sharegpt: Some(path.clone()), ..small(Kind::W2) };
    let reqs = generate(&spec, 1.0, 60.0, 1);
    std::fs::remove_file(&path).ok();
    let reqs = reqs.expect("generates");
    let second = reqs.iter().find(|r| r.body["messages"].as_array().is_some_and(|m| m.len() == 3)).expect("a second turn");
    assert_eq!(second.body["messages"][1], serde_json::json!({"role": "assistant", "content": "hi how are you"}));
    assert_eq!(max_tokens(second), 1, "asks for as many tokens as the recorded reply");
    assert!(second.shared_prefix_tokens > 0);
}

#[test]
fn replay_follows_the_trace_timestamps() {
    let trace = r#"{"timestamp_ms": 1500, "messages": [{"role": "user", "content": "two"}], "session_id": "s", "max_tokens": 7}

{"timestamp_ms": 1000, "prompt": "one two three", "session_id": "s"}
{"timestamp_ms": 99000, "prompt": "late"}"#;
    let counter = Counter::new().expect("tokenizer");
    let reqs = replay::parse(trace, "m", 60.0, &counter).expect("parses");
    assert_eq!(reqs.len(), 2);
    assert_eq!((reqs[0].api, reqs[1].api), (Api::Completions, Api::Chat));
    assert_eq!(reqs[1].at, Duration::from_millis(500));
    assert_eq!(reqs[0].body["max_tokens"], Value::from(128));
    assert_eq!(reqs[1].body["max_tokens"], Value::from(7));
    assert_eq!(reqs[0].prompt_tokens, 3);
    assert!(replay::parse("{\"timestamp_ms\": 1}", "m", 60.0, &counter).is_err());
}

#[test]
fn spans_parse_from_min_dash_max() {
    assert_eq!("50-300".parse::<Span>(), Ok(Span { min: 50, max: 300 }));
    assert_eq!("7".parse::<Span>(), Ok(Span { min: 7, max: 7 }));
    assert!("9-3".parse::<Span>().is_err());
}
