//! Replay of a JSONL trace, one request a line:
//! `{"timestamp_ms": 1200, "prompt": "..."}` (completions) or
//! `{"timestamp_ms": 1200, "messages": [...]}` (chat), optionally with
//! `max_tokens` (or `output_tokens`, default 128) and `session_id`. Requests
//! leave at their timestamps, counted from the trace's first one, up to the
//! run's length; the rate is the trace's own. A request's known shared prefix
//! is what it shares with the previous request of its session.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::Context;
use serde::Deserialize;
use serde_json::{Value, json};

use super::{Api, Counter, Request, common_prefix};

/// `max_tokens` of a line that names none.
const DEFAULT_OUTPUT_TOKENS: u64 = 128;

#[derive(Deserialize)]
struct Line {
    timestamp_ms: f64,
    #[serde(default)]
    prompt: Option<Value>,
    #[serde(default)]
    messages: Option<Value>,
    #[serde(default, alias = "output_tokens")]
    max_tokens: Option<u64>,
    #[serde(default)]
    session_id: Option<String>,
}

/// The trace's requests before `secs` seconds.
pub fn parse(text: &str, model: &str, secs: f64, counter: &Counter) -> anyhow::Result<Vec<Request>> {
    let mut lines = Vec::new();
    for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let line: Line = serde_json::from_str(line).with_context(|| format!("trace line {}", n + 1))?;
        anyhow::ensure!(line.timestamp_ms.is_finite(), "trace line {}: timestamp_ms is not a number", n + 1);
        lines.push(line);
    }
    lines.sort_by(|a, b| a.timestamp_ms.total_cmp(&b.timestamp_ms));
    let first = lines.first().map_or(0.0, |l| l.timestamp_ms);
    let mut last_of_session: HashMap<String, Vec<u32>> = HashMap::new();
    let mut out = Vec::with_capacity(lines.len());
    for (n, line) in lines.into_iter().enumerate() {
        let at = (line.timestamp_ms - first) / 1e3;
        if at >= secs {
            break;
        }
        let max_tokens = line.max_tokens.unwrap_or(DEFAULT_OUTPUT_TOKENS);
        let (api, body) = match (line.messages, line.prompt) {
            (Some(messages), _) => (Api::Chat, json!({"model": model, "messages": messages, "max_tokens": max_tokens})),
            (None, Some(prompt)) => (Api::Completions, json!({"model": model, "prompt": prompt, "max_tokens": max_tokens})),
            (None, None) => anyhow::bail!("trace request {}: neither prompt nor messages", n + 1),
        };
        let ids = counter.ids(api, &body).with_context(|| format!("trace request {}", n + 1))?;
        let shared_prefix_tokens = match &line.session_id {
            Some(s) => last_of_session.insert(s.clone(), ids.clone()).map_or(0, |prev| common_prefix(&prev, &ids)),
            None => 0,
        };
        out.push(Request {
            at: Duration::from_secs_f64(at),
            api,
            body,
            session: line.session_id,
            prompt_tokens: ids.len(),
            shared_prefix_tokens,
            step: None,
        });
    }
    Ok(out)
}
