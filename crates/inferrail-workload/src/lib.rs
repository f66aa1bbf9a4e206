//! `inferrail-workload`: seeded, deterministic workloads, the requests a
//! benchmark run or a fleet simulation sends, each with its
//! scheduled arrival, body, session and the prompt tokens it is known to share
//! with earlier requests (counted with the simulator's `builtin:sim`
//! tokenizer, one token per word), for hit-rate accounting.
//!
//! - `w1`: a handful of long system prompts shared by all users, short unique
//!   questions, uniform choice of prompt.
//! - `hot`: `w1` with the prompt drawn by Zipf weight (`--zipf-exponent`).
//! - `w6`: nothing shared: every prompt starts with its own marker, with
//!   the length of a `w1` prompt.
//! - `mix`: each request `w1` or `w6` with even odds.
//! - `w2`: multi-turn chats resending their history, in `sessions`.
//! - `rag`, `burst` and `agent`: documents by Zipf weight between an
//!   application's prompt and a question, few-shot batches arriving within a
//!   second, and closed-loop agents resending the model's replies, in `reuse`.
//! - `replay`: a JSONL trace, in `replay`.
//!
//! Same seed, same requests. Arrivals are Poisson at `rate` (for `w2`,
//! conversations arrive at `rate` divided by the mean turn count, and so do
//! `agent`'s agents).
#![forbid(unsafe_code)]

pub mod arrivals;
mod replay;
mod reuse;
mod sessions;
#[cfg(test)]
mod tests;
pub mod text;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, ValueEnum};
use inferrail_tokenize::Tokenizer;
use inferrail_tokenize::chat::{self, Endpoint, RequestTemplates};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::{Value, json};

pub use text::Span;

/// One request of a workload.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// Scheduled send time, from the start of the run.
    pub at: Duration,
    /// Chat or completions.
    pub api: Api,
    /// The OpenAI body, without the streaming fields the sender adds.
    pub body: Value,
    /// The conversation, sent as `x-session-id`.
    pub session: Option<String>,
    /// Prompt tokens (`builtin:sim`).
    pub prompt_tokens: usize,
    /// Leading prompt tokens the workload knows earlier requests share
    /// (a `w1` system prompt, a `w2` conversation's previous turn).
    pub shared_prefix_tokens: usize,
    /// A step of a closed-loop agent (`agent`); `None` for a request sent on
    /// its schedule alone.
    pub step: Option<Step>,
}

/// A step of a closed-loop agent. Every step of an agent has the agent's
/// arrival as its `at`, and they follow each other in the workload's order.
/// The first is a whole request, sent at `at`. Each later one is sent
/// `think` after the previous step's answer ended; its body holds only the
/// messages it adds, and the sender puts the conversation so far before
/// them: the previous step's messages and the reply the engine streamed.
/// Its `prompt_tokens` count those added messages alone, since the reply
/// is not known before the run.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    /// The agent, numbered in arrival order.
    pub agent: usize,
    /// The wait after the previous step's answer: the tool call and the
    /// agent framework's own work.
    pub think: Duration,
}

/// An agent's later step `step` (its own messages) as sent: `messages`,
/// the conversation so far, gains the `reply` to the step before and the
/// step's messages, and the body carries all of them.
pub fn continue_conversation(messages: &mut Vec<serde_json::Value>, reply: &str, step: &serde_json::Value) -> serde_json::Value {
    messages.push(serde_json::json!({"role": "assistant", "content": reply}));
    messages.extend(step["messages"].as_array().into_iter().flatten().cloned());
    let mut body = step.clone();
    body["messages"] = serde_json::Value::Array(messages.clone());
    body
}

/// Which OpenAI endpoint a request goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Api {
    /// `/v1/chat/completions`
    Chat,
    /// `/v1/completions`
    Completions,
}

impl Api {
    /// The path under the base URL.
    pub fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Completions => "/v1/completions",
        }
    }
}

/// The workloads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// Shared system prompts, unique questions.
    W1,
    /// Multi-turn chats resending their history.
    W2,
    /// Nothing shared.
    W6,
    /// W1 and W6 half each.
    Mix,
    /// W1 with prompts drawn by Zipf weight.
    Hot,
    /// Retrieval-augmented questions: documents drawn by Zipf weight.
    Rag,
    /// Few-shot batches: bursts of requests sharing a long prefix within a second.
    Burst,
    /// Closed-loop agents: each step resends the history, the model's
    /// replies and the tools' outputs included.
    Agent,
    /// Long contexts: W1's shape, named apart for system prompts that take
    /// a large part of a cache (`--system-tokens`; `just bench-reuse long`
    /// uses 32,000-100,000).
    Long,
    /// A JSONL trace (`--trace`).
    Replay,
    /// Hot's shape over LoRA adapters: each system prompt is one adapter's
    /// (`lora-<k>`, named in `model`), drawn by Zipf weight.
    Lora,
}

/// The name `lora` requests give adapter `k`.
pub fn adapter_name(k: usize) -> String {
    format!("lora-{k}")
}

/// What to generate; the flags of every command that sends a workload.
#[derive(Debug, Clone, Args, Serialize)]
pub struct Spec {
    /// Workload.
    #[arg(long, value_enum, default_value = "w1")]
    pub workload: Kind,
    /// Model to ask for.
    #[arg(long, default_value = "inferrail/sim-8b")]
    pub model: String,
    /// Shared system prompts (w1, hot, mix).
    #[arg(long, default_value_t = 6)]
    pub system_prompts: usize,
    /// Tokens of each system prompt, and of a w6 prompt's body.
    #[arg(long, default_value = "2000-8000")]
    #[serde(serialize_with = "display")]
    pub system_tokens: Span,
    /// Tokens of each question (a w2 turn's user message).
    #[arg(long, default_value = "50-500")]
    #[serde(serialize_with = "display")]
    pub question_tokens: Span,
    /// `max_tokens` of each request.
    #[arg(long, default_value = "50-300")]
    #[serde(serialize_with = "display")]
    pub output_tokens: Span,
    /// Zipf exponent of `hot` and of `rag`'s documents.
    #[arg(long, default_value_t = 1.1)]
    pub zipf_exponent: f64,
    /// Tokens of each `rag` application's system prompt.
    #[arg(long, default_value = "200-800")]
    #[serde(serialize_with = "display")]
    pub app_tokens: Span,
    /// Documents `rag` retrieves from.
    #[arg(long, default_value_t = 50)]
    pub documents: usize,
    /// Tokens of each `rag` document.
    #[arg(long, default_value = "1000-4000")]
    #[serde(serialize_with = "display")]
    pub document_tokens: Span,
    /// Requests of each `burst`.
    #[arg(long, default_value_t = 200)]
    pub burst_size: usize,
    /// Turns per w2 conversation; steps per agent.
    #[arg(long, default_value = "2-6")]
    #[serde(serialize_with = "display")]
    pub turns: Span,
    /// Seconds a w2 user thinks between turns (from one turn's scheduled
    /// send to the next).
    #[arg(long, default_value = "10-20")]
    #[serde(serialize_with = "display")]
    pub think_s: Span,
    /// Tokens of each tool output an agent adds after a reply.
    #[arg(long, default_value = "60-200")]
    #[serde(serialize_with = "display")]
    pub tool_tokens: Span,
    /// Milliseconds an agent waits between a step's answer and its next
    /// step (its tool call and its framework's work).
    #[arg(long, default_value = "200-1000")]
    #[serde(serialize_with = "display")]
    pub agent_think_ms: Span,
    /// W2 conversations from a ShareGPT JSON file instead of generated ones.
    #[arg(long)]
    pub sharegpt: Option<PathBuf>,
    /// The JSONL trace of `replay`.
    #[arg(long)]
    pub trace: Option<PathBuf>,
}

fn display<S: serde::Serializer>(v: &Span, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(v)
}

impl Spec {
    /// Defaults for `workload`, as the command line has them.
    pub fn new(workload: Kind) -> Self {
        Spec {
            workload,
            model: "inferrail/sim-8b".into(),
            system_prompts: 6,
            system_tokens: Span { min: 2000, max: 8000 },
            question_tokens: Span { min: 50, max: 500 },
            output_tokens: Span { min: 50, max: 300 },
            zipf_exponent: 1.1,
            app_tokens: Span { min: 200, max: 800 },
            documents: 50,
            document_tokens: Span { min: 1000, max: 4000 },
            burst_size: 200,
            turns: Span { min: 2, max: 6 },
            think_s: Span { min: 10, max: 20 },
            tool_tokens: Span { min: 60, max: 200 },
            agent_think_ms: Span { min: 200, max: 1000 },
            sharegpt: None,
            trace: None,
        }
    }
}

/// The requests of `spec` arriving at `rate` per second over `secs` seconds,
/// from `seed`, ordered by arrival.
pub fn generate(spec: &Spec, rate: f64, secs: f64, seed: u64) -> anyhow::Result<Vec<Request>> {
    let counter = Counter::new()?;
    let mut out = match spec.workload {
        Kind::W1 | Kind::Long | Kind::W6 | Kind::Mix | Kind::Hot | Kind::Lora => single_turn(spec, rate, secs, seed, &counter)?,
        Kind::W2 => sessions::generate(spec, rate, secs, seed, &counter)?,
        Kind::Rag => reuse::rag(spec, rate, secs, seed, &counter)?,
        Kind::Burst => reuse::burst(spec, rate, secs, seed, &counter)?,
        Kind::Agent => reuse::agents(spec, rate, secs, seed, &counter)?,
        Kind::Replay => {
            let path = spec.trace.as_ref().context("replay needs --trace")?;
            let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            replay::parse(&text, &spec.model, secs, &counter)?
        }
    };
    // Stable: an agent's steps share its arrival and keep their order.
    out.sort_by_key(|r| r.at);
    Ok(out)
}

/// W1 (and long), W6, mix and hot.
fn single_turn(spec: &Spec, rate: f64, secs: f64, seed: u64, counter: &Counter) -> anyhow::Result<Vec<Request>> {
    anyhow::ensure!(spec.system_prompts > 0, "--system-prompts must be at least 1");
    let mut rng = StdRng::seed_from_u64(seed);
    let prompts = unique_texts(&mut rng, spec.system_prompts, spec.system_tokens, "sys");
    let shared =
        prompts.iter().map(|p| shared_up_to_question(counter, &spec.model, p, str::to_owned)).collect::<anyhow::Result<Vec<_>>>()?;
    let zipf = Zipf::new(spec.system_prompts, spec.zipf_exponent);
    let times = arrivals::poisson(&mut StdRng::seed_from_u64(seed ^ 0x5eed_a77e), rate, secs);
    let mut out = Vec::with_capacity(times.len());
    for (i, at) in times.into_iter().enumerate() {
        let max_tokens = spec.output_tokens.draw(&mut rng);
        let shares = match spec.workload {
            Kind::W6 => false,
            Kind::Mix => rng.random_bool(0.5),
            _ => true,
        };
        let (body, shared_prefix_tokens) = if shares {
            let k = if matches!(spec.workload, Kind::Hot | Kind::Lora) { zipf.draw(&mut rng) } else { rng.random_range(0..prompts.len()) };
            let tokens = spec.question_tokens.draw(&mut rng) as usize;
            let question = text::unique(&mut rng, &format!("q{i}"), tokens);
            let model = if spec.workload == Kind::Lora { adapter_name(k) } else { spec.model.clone() };
            (chat_body(&model, Some(&prompts[k]), &question, max_tokens), shared[k])
        } else {
            let tokens = spec.system_tokens.draw(&mut rng) + spec.question_tokens.draw(&mut rng);
            (chat_body(&spec.model, None, &text::unique(&mut rng, &format!("u{i}"), tokens as usize), max_tokens), 0)
        };
        let prompt_tokens = counter.ids(Api::Chat, &body)?.len();
        out.push(Request { at, api: Api::Chat, body, session: None, prompt_tokens, shared_prefix_tokens, step: None });
    }
    Ok(out)
}

/// `n` unique texts of `tokens` each, the `k`th marked `{marker}{k}`.
fn unique_texts(rng: &mut StdRng, n: usize, tokens: Span, marker: &str) -> Vec<String> {
    (0..n)
        .map(|k| {
            let tokens = tokens.draw(rng) as usize;
            text::unique(rng, &format!("{marker}{k}"), tokens)
        })
        .collect()
}

/// The tokens two chats with `system` and the user message `user(question)`
/// share whatever the question: up to where it starts.
fn shared_up_to_question(counter: &Counter, model: &str, system: &str, user: impl Fn(&str) -> String) -> anyhow::Result<usize> {
    let a = counter.ids(Api::Chat, &chat_body(model, Some(system), &user("a"), 1))?;
    let b = counter.ids(Api::Chat, &chat_body(model, Some(system), &user("b"), 1))?;
    Ok(common_prefix(&a, &b))
}

/// A chat body: an optional system message and one user message.
pub fn chat_body(model: &str, system: Option<&str>, user: &str, max_tokens: u64) -> Value {
    let mut messages = Vec::new();
    if let Some(s) = system {
        messages.push(json!({"role": "system", "content": s}));
    }
    messages.push(json!({"role": "user", "content": user}));
    json!({"model": model, "messages": messages, "max_tokens": max_tokens})
}

/// How many leading tokens two prompts share.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Counts prompt tokens as the simulator does (`builtin:sim`, its chat template).
pub struct Counter(Tokenizer);

impl Counter {
    /// The `builtin:sim` tokenizer.
    pub fn new() -> anyhow::Result<Self> {
        Ok(Counter(Tokenizer::load("builtin:sim", 0)?))
    }

    /// The prompt's token ids.
    pub fn ids(&self, api: Api, body: &Value) -> anyhow::Result<Vec<u32>> {
        let map = body.as_object().context("a request body must be a JSON object")?;
        let endpoint = match api {
            Api::Chat => Endpoint::Chat,
            Api::Completions => Endpoint::Completions,
        };
        Ok(chat::prompt_ids(&self.0, endpoint, map, RequestTemplates::Render)?)
    }

    /// Where the prompt's turn markers are, as the router finds them.
    pub fn special_positions(&self, ids: &[u32]) -> Vec<usize> {
        self.0.special_positions(ids)
    }
}

/// Draws ranks `0..n` with weight `1 / (rank + 1)^s`.
pub struct Zipf {
    cumulative: Vec<f64>,
}

impl Zipf {
    /// Weights for `n` ranks with exponent `s`.
    pub fn new(n: usize, s: f64) -> Self {
        let mut total = 0.0;
        let cumulative = (1..=n)
            .map(|k| {
                total += (k as f64).powf(-s);
                total
            })
            .collect();
        Zipf { cumulative }
    }

    /// One rank.
    pub fn draw(&self, rng: &mut StdRng) -> usize {
        let total = self.cumulative.last().copied().unwrap_or(0.0);
        let u = rng.random_range(0.0..1.0) * total;
        self.cumulative.partition_point(|&c| c <= u).min(self.cumulative.len().saturating_sub(1))
    }

    /// The expected share of rank 0.
    #[cfg(test)]
    pub fn top_share(&self) -> f64 {
        match (self.cumulative.first(), self.cumulative.last()) {
            (Some(first), Some(total)) => first / total,
            _ => 0.0,
        }
    }
}
