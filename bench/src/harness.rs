//! The open-loop sender: every request leaves at its scheduled time, in its
//! own task, whatever the earlier ones are doing (nothing bounds how many are
//! in flight), and streams its answer. Latencies count from the scheduled
//! time, so a sender or server that falls behind shows as latency, and the
//! gap between schedule and actual send is recorded as the send lag.

#[cfg(test)]
mod tests;

use std::time::Duration;

use anyhow::Context;
use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::Value;
use tokio::time::Instant;

use inferrail_workload::Request;

/// The router's response header naming the replica it picked.
pub const REPLICA_HEADER: &str = "x-inferrail-replica";
/// The router's response header with the cached tokens it predicted.
pub const PREDICTED_HEADER: &str = "x-inferrail-cached-tokens";

/// What one request measured.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// Scheduled send time, from the start of the run; for a closed-loop
    /// agent's step, the agent's arrival (so the warmup holds the same steps
    /// whoever answers them).
    pub at: Duration,
    /// Actual send minus scheduled send (zero for an agent's later steps,
    /// sent when they are ready).
    pub send_lag: Duration,
    /// When its latencies count from, from the start of the run: the
    /// scheduled send, or an agent's later step's own send.
    pub started: Duration,
    /// HTTP status, when one came.
    pub status: Option<u16>,
    /// Why the request failed; `None` when it streamed to `[DONE]`.
    pub error: Option<String>,
    /// `started` to the first content chunk.
    pub ttft: Option<Duration>,
    /// `started` to `[DONE]`.
    pub e2e: Option<Duration>,
    /// Gaps between consecutive content chunks.
    pub itl: Vec<Duration>,
    /// Output tokens: `usage.completion_tokens`, else the content chunks.
    pub output_tokens: usize,
    /// The streamed content, which an agent's next step resends.
    pub reply: String,
    /// `usage.prompt_tokens`.
    pub prompt_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: Option<u64>,
    /// The replica the router named (`x-inferrail-replica`).
    pub replica: Option<String>,
    /// The cached tokens the router predicted (`x-inferrail-cached-tokens`).
    pub predicted_cached_tokens: Option<u64>,
    /// Its `x-request-id`, as the router's decision log and the engine's log name it.
    pub request_id: Option<String>,
    /// Prompt tokens the workload knows earlier requests share.
    pub shared_prefix_tokens: usize,
}

impl Outcome {
    /// Whether the request streamed to its end.
    pub fn ok(&self) -> bool {
        self.error.is_none()
    }

    /// Time per output token after the first: `(e2e - ttft) / (tokens - 1)`.
    pub fn tpot(&self) -> Option<Duration> {
        let (ttft, e2e) = (self.ttft?, self.e2e?);
        let n = u32::try_from(self.output_tokens).ok()?;
        (n >= 2).then(|| e2e.saturating_sub(ttft) / (n - 1))
    }
}

/// Sends `requests` to `base` on their schedule, starting shortly after the
/// call, and returns their outcomes in the same order. A closed-loop agent's
/// steps (`Request::step`) run one after another in one task, each sent
/// when the previous one's answer ended and its think time passed.
pub async fn send_all(http: &reqwest::Client, base: &str, requests: &[Request], progress: bool) -> anyhow::Result<Vec<Outcome>> {
    let bar = if progress { ProgressBar::new(requests.len() as u64) } else { ProgressBar::hidden() };
    bar.set_style(ProgressStyle::with_template("{elapsed_precise} [{wide_bar}] {pos}/{len} done")?);
    let start = Instant::now() + Duration::from_millis(100);
    let mut tasks = Vec::with_capacity(requests.len());
    for chain in chains(requests) {
        let steps: Vec<Request> = chain.iter().map(|&i| requests[i].clone()).collect();
        let at = start + steps[0].at;
        // Checked before the first is sent, so a bad body fails the run, not a request.
        streaming_body(&steps[0].body)?;
        tokio::time::sleep_until(at).await;
        let (http, base, bar) = (http.clone(), base.to_string(), bar.clone());
        tasks.push(tokio::spawn(async move { (chain, send_chain(&http, &base, &steps, at, &bar).await) }));
    }
    let mut out = vec![Outcome::default(); requests.len()];
    for t in tasks {
        let (chain, outcomes) = t.await.context("request task")?;
        for (i, o) in chain.into_iter().zip(outcomes) {
            out[i] = o;
        }
    }
    bar.finish_and_clear();
    Ok(out)
}

/// The requests grouped into what one task sends in turn: an agent's steps
/// together, every other request alone; ordered by their first request.
fn chains(requests: &[Request]) -> Vec<Vec<usize>> {
    let mut chains: Vec<Vec<usize>> = Vec::new();
    let mut of_agent: std::collections::HashMap<usize, usize> = std::collections::HashMap::new();
    for (i, r) in requests.iter().enumerate() {
        match r.step.as_ref().and_then(|s| of_agent.get(&s.agent)) {
            Some(&c) => chains[c].push(i),
            None => {
                if let Some(s) = &r.step {
                    of_agent.insert(s.agent, chains.len());
                }
                chains.push(vec![i]);
            }
        }
    }
    chains
}

/// Sends `steps` in turn, the first at `at`; each later one continues the
/// conversation with the reply to the one before (see [`inferrail_workload::Step`]).
async fn send_chain(http: &reqwest::Client, base: &str, steps: &[Request], at: Instant, bar: &ProgressBar) -> Vec<Outcome> {
    let mut out: Vec<Outcome> = Vec::with_capacity(steps.len());
    let mut messages: Vec<Value> = Vec::new();
    for r in steps {
        let mut o = Outcome { at: r.at, shared_prefix_tokens: r.shared_prefix_tokens, ..Outcome::default() };
        let (body, sent) = match out.last() {
            None => {
                o.send_lag = at.elapsed();
                o.started = r.at;
                if steps.len() > 1 {
                    messages = r.body["messages"].as_array().cloned().unwrap_or_default();
                }
                (r.body.clone(), at)
            }
            Some(previous) if !previous.ok() => {
                o.error = Some("an earlier step of its agent failed".into());
                (Value::Null, at)
            }
            Some(previous) => {
                tokio::time::sleep(r.step.as_ref().map_or(Duration::ZERO, |s| s.think)).await;
                let body = inferrail_workload::continue_conversation(&mut messages, &previous.reply, &r.body);
                // It shares the previous step's prompt and reply, as usage counted them.
                o.shared_prefix_tokens = previous.prompt_tokens.unwrap_or(0) as usize + previous.output_tokens;
                let now = Instant::now();
                o.started = r.at + (now - at);
                (body, now)
            }
        };
        if o.error.is_none() {
            match streaming_body(&body) {
                Ok(bytes) => {
                    let request = http.post(format!("{base}{}", r.api.path())).header("content-type", "application/json").body(bytes);
                    let request = match &r.session {
                        Some(s) => request.header("x-session-id", s),
                        None => request,
                    };
                    if let Err(e) = stream(request, sent, &mut o).await {
                        o.error = Some(format!("{e:#}"));
                    }
                }
                Err(e) => o.error = Some(format!("{e:#}")),
            }
        }
        bar.inc(1);
        out.push(o);
    }
    out
}

/// The body with `stream: true` and usage in the last chunk.
fn streaming_body(body: &Value) -> anyhow::Result<Vec<u8>> {
    let mut body = body.clone();
    let map = body.as_object_mut().context("a request body must be a JSON object")?;
    map.insert("stream".into(), Value::Bool(true));
    map.insert("stream_options".into(), serde_json::json!({"include_usage": true}));
    Ok(serde_json::to_vec(&body)?)
}

/// Sends one request and reads its stream into `o`, timing from `at`.
async fn stream(request: reqwest::RequestBuilder, at: Instant, o: &mut Outcome) -> anyhow::Result<()> {
    let r = request.send().await?;
    o.status = Some(r.status().as_u16());
    let header = |name: &str| r.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_string);
    o.replica = header(REPLICA_HEADER);
    o.request_id = header("x-request-id");
    o.predicted_cached_tokens = header(PREDICTED_HEADER).and_then(|v| v.trim().parse().ok());
    if !r.status().is_success() {
        let status = r.status();
        let text = r.text().await.unwrap_or_else(|e| format!("(body unreadable: {e})"));
        anyhow::bail!("HTTP {status}: {}", text.chars().take(200).collect::<String>());
    }
    let mut events = r.bytes_stream().eventsource();
    let (mut last, mut chunks, mut completion_tokens, mut done) = (None, 0usize, None, false);
    while let Some(event) = events.next().await {
        let data = event?.data;
        if data == "[DONE]" {
            done = true;
            break;
        }
        let v: Value = serde_json::from_str(&data).context("a stream chunk is not JSON")?;
        if let Some(e) = v.get("error") {
            anyhow::bail!("error in the stream: {e}");
        }
        let choice = &v["choices"][0];
        let content = choice["delta"]["content"].as_str().or_else(|| choice["text"].as_str());
        if let Some(c) = content.filter(|c| !c.is_empty()) {
            o.reply.push_str(c);
            let now = Instant::now();
            match last {
                Some(prev) => o.itl.push(now - prev),
                None => o.ttft = Some(now - at),
            }
            last = Some(now);
            chunks += 1;
        }
        let usage = &v["usage"];
        if usage.is_object() {
            o.prompt_tokens = usage["prompt_tokens"].as_u64();
            o.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"].as_u64();
            completion_tokens = usage["completion_tokens"].as_u64();
        }
    }
    anyhow::ensure!(done, "the stream ended before [DONE]");
    o.e2e = Some(at.elapsed());
    o.output_tokens = completion_tokens.and_then(|n| usize::try_from(n).ok()).unwrap_or(chunks);
    Ok(())
}
