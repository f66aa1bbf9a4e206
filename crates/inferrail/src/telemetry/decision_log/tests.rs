//! The log's lines, its sampling, and what happens when the disk falls behind.

use std::time::Duration;

use inferrail_config::Config;
use inferrail_tokenize::chat::Endpoint;
use serde_json::{Value, json};

use crate::router::Router;

fn router(path: &std::path::Path, sample_rate: f64, queue: usize) -> Router {
    let yaml = format!(
        "observability: {{decision_log: {{path: '{}', sample_rate: {sample_rate}, queue: {queue}}}}}\n\
         models: [{{name: m, policy: cost_model, tokenizer: builtin:sim}}]\n\
         replicas:\n  - {{id: a, address: 127.0.0.1:1, models: [m]}}\n  - {{id: b, address: 127.0.0.1:2, models: [m]}}\n",
        path.display()
    );
    Router::new(Config::parse(&yaml).unwrap()).unwrap()
}

const BODY: &[u8] = br#"{"model": "m", "messages": [{"role": "user", "content": "a secret prompt about otters"}]}"#;

fn lines(path: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path).unwrap_or_default().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

#[tokio::test]
async fn at_full_sampling_under_1000_decisions_a_second_every_decision_is_logged_and_never_the_prompt() {
    let dir = std::env::temp_dir().join(format!("inferrail-dlog-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("decisions.jsonl");
    let r = router(&path, 1.0, 4096);
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    for i in 0..1_000 {
        tick.tick().await;
        let d = r.decide(BODY, Endpoint::Chat, &format!("req-{i}"), None, None).await.unwrap();
        r.forget(&d.request_id);
    }
    let log = r.decision_log.as_ref().unwrap();
    // Closing writes what is still queued.
    log.close();
    let written = lines(&path);
    assert_eq!((written.len(), log.dropped()), (1_000, 0));
    let first = &written[0];
    assert_eq!(
        (first["kind"].as_str(), first["policy"].as_str(), first["request_id"].as_str()),
        (Some("decision"), Some("cost_model"), Some("req-0"))
    );
    assert_eq!(first["candidates"].as_array().unwrap().len(), 2);
    assert!(first["candidates"][0]["terms"]["prefill"].as_f64().unwrap() > 0.0);
    // No request in flight holds the prompt, and no engine has reported its free room.
    let candidate = first["candidates"][0].as_object().unwrap();
    assert_eq!((candidate.get("held_cached_tokens"), candidate.get("free_kv_tokens")), (Some(&json!(0)), Some(&Value::Null)));
    // No offload tier holds it either.
    assert_eq!((candidate.get("host_cached_tokens"), candidate.get("disk_cached_tokens")), (Some(&json!(0)), Some(&json!(0))));
    assert!(["a", "b"].contains(&first["winner"].as_str().unwrap()));
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(!text.contains("otters"), "the prompt is never logged");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn sampling_keeps_about_its_share_by_request_id() {
    let dir = std::env::temp_dir().join(format!("inferrail-dlog-sample-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let r = router(&dir.join("d.jsonl"), 0.25, 16);
    let log = r.decision_log.as_ref().unwrap();
    let kept = (0..4_000).filter(|i| log.sampled(&format!("req-{i}"))).count();
    assert!((800..1_200).contains(&kept), "{kept} of 4,000 at 0.25");
    assert!(log.sampled("req-7") == log.sampled("req-7"), "a request's decision and outcome go together");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn a_writer_that_cannot_keep_up_costs_lines_counted_never_a_wait() {
    // A FIFO whose reader never reads: once the pipe's buffer is full the
    // writer thread blocks, and the queue of 8 fills behind it.
    let dir = std::env::temp_dir().join(format!("inferrail-dlog-fifo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fifo = dir.join("stuck");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || std::fs::File::open(fifo).unwrap())
    };
    let r = router(&fifo, 1.0, 8);
    let _unread = reader.join().unwrap();
    for i in 0..2_000 {
        let d = r.decide(BODY, Endpoint::Chat, &format!("req-{i}"), None, None).await.unwrap();
        r.forget(&d.request_id);
    }
    // Had a decision waited for the writer, this test would never get here.
    let dropped = r.decision_log.as_ref().unwrap().dropped();
    assert!(dropped > 1_000, "{dropped} of 2,000 lines dropped and counted (a pipe holds 64 KiB, the queue 8)");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_log_that_cannot_be_opened_stops_the_router_from_starting() {
    let missing = std::path::Path::new("/nonexistent-inferrail-dir/decisions.jsonl");
    let yaml = format!(
        "observability: {{decision_log: {{path: '{}', sample_rate: 1.0}}}}\nmodels: [{{name: m}}]\nreplicas: [{{id: a, address: 127.0.0.1:1, models: [m]}}]\n",
        missing.display()
    );
    let e = Router::new(Config::parse(&yaml).unwrap()).err().expect("started without its log");
    assert!(e.to_string().contains("opening the decision log"), "{e}");
}

#[tokio::test]
async fn a_shadow_policys_choice_is_logged_beside_the_live_one() {
    let dir = std::env::temp_dir().join(format!("inferrail-dlog-shadow-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("decisions.jsonl");
    let yaml = format!(
        "observability: {{decision_log: {{path: '{}', sample_rate: 1.0}}}}\n\
         models: [{{name: m, policy: round_robin, shadow_policy: cost_model, tokenizer: builtin:sim}}]\n\
         replicas:\n  - {{id: a, address: 127.0.0.1:1, models: [m]}}\n  - {{id: b, address: 127.0.0.1:2, models: [m]}}\n",
        path.display()
    );
    let r = Router::new(Config::parse(&yaml).unwrap()).unwrap();
    for i in 0..4 {
        let d = r.decide(BODY, Endpoint::Chat, &format!("req-{i}"), None, None).await.unwrap();
        r.forget(&d.request_id);
    }
    r.decision_log.as_ref().unwrap().close();
    let decisions: Vec<Value> = lines(&path).into_iter().filter(|l| l["kind"] == "decision").collect();
    assert_eq!(decisions.len(), 4);
    for d in &decisions {
        let shadow = &d["shadow"];
        assert_eq!(shadow["policy"], "cost_model", "{d}");
        assert_eq!(shadow["agreed"], json!(shadow["winner"] == d["winner"]), "{d}");
        assert!(shadow["score"].as_f64().is_some_and(|s| s > 0.0), "{d}");
    }
    // Round robin alternates; the shadow keeps the prompt where it is cached, so they part at least once.
    assert!(decisions.iter().any(|d| d["shadow"]["agreed"] == json!(false)));
    std::fs::remove_dir_all(&dir).ok();
}
