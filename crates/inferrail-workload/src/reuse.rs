//! The reuse patterns beyond shared system prompts and chats:
//!
//! - `rag`: retrieval-augmented questions. Each request picks an
//!   application (its system prompt, `--system-prompts` of them, uniform)
//!   and a document by Zipf weight (`--documents` of `--document-tokens`,
//!   `--zipf-exponent`), placed where RAG templates put it: after the
//!   system prompt, before the question, in the user message.
//! - `burst`: few-shot evaluation batches. Bursts of `--burst-size`
//!   requests arrive within one second, Poisson at `rate / burst-size`;
//!   each burst runs one task, a long few-shot prefix (`--system-tokens`,
//!   one of `--system-prompts`, uniform), then a short question each.
//! - `agent`: closed-loop agents, arriving Poisson at `rate` divided by the
//!   mean steps (`--turns`). Each starts from a framework prompt
//!   (`--system-tokens`, one of `--system-prompts`, uniform) and a task
//!   (`--question-tokens`); after each step's answer it waits
//!   `--agent-think-ms` and sends the whole history again with a tool's
//!   output added (`--tool-tokens`). See [`super::Step`] for how the sender
//!   runs them.

use std::collections::HashMap;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use serde_json::json;

use super::{Api, Counter, Request, Spec, Step, Zipf, chat_body, shared_up_to_question, text, unique_texts};
use crate::arrivals;

/// `rag` over `secs` seconds at `rate` per second.
pub fn rag(spec: &Spec, rate: f64, secs: f64, seed: u64, counter: &Counter) -> anyhow::Result<Vec<Request>> {
    anyhow::ensure!(spec.system_prompts > 0 && spec.documents > 0, "--system-prompts and --documents must be at least 1");
    let mut rng = StdRng::seed_from_u64(seed);
    let apps = unique_texts(&mut rng, spec.system_prompts, spec.app_tokens, "app");
    let documents = unique_texts(&mut rng, spec.documents, spec.document_tokens, "doc");
    let zipf = Zipf::new(spec.documents, spec.zipf_exponent);
    let times = arrivals::poisson(&mut StdRng::seed_from_u64(seed ^ 0x5eed_a77e), rate, secs);
    // What each (application, document) pair shares: up to where the question starts.
    let mut shared: HashMap<(usize, usize), usize> = HashMap::new();
    let mut out = Vec::with_capacity(times.len());
    for (i, at) in times.into_iter().enumerate() {
        let (app, doc) = (rng.random_range(0..apps.len()), zipf.draw(&mut rng));
        let max_tokens = spec.output_tokens.draw(&mut rng);
        let tokens = spec.question_tokens.draw(&mut rng) as usize;
        let question = text::unique(&mut rng, &format!("q{i}"), tokens);
        let user = |q: &str| format!("Answer from this document.\n\n{}\n\nQuestion: {q}", documents[doc]);
        let body = chat_body(&spec.model, Some(&apps[app]), &user(&question), max_tokens);
        let shared_prefix_tokens = match shared.get(&(app, doc)) {
            Some(&n) => n,
            None => *shared.entry((app, doc)).or_insert(shared_up_to_question(counter, &spec.model, &apps[app], user)?),
        };
        let prompt_tokens = counter.ids(Api::Chat, &body)?.len();
        out.push(Request { at, api: Api::Chat, body, session: None, prompt_tokens, shared_prefix_tokens, step: None });
    }
    Ok(out)
}

/// `burst` over `secs` seconds at `rate` requests per second on average.
pub fn burst(spec: &Spec, rate: f64, secs: f64, seed: u64, counter: &Counter) -> anyhow::Result<Vec<Request>> {
    anyhow::ensure!(spec.system_prompts > 0 && spec.burst_size > 0, "--system-prompts and --burst-size must be at least 1");
    let mut rng = StdRng::seed_from_u64(seed);
    let tasks = unique_texts(&mut rng, spec.system_prompts, spec.system_tokens, "shots");
    let shared = tasks.iter().map(|t| shared_up_to_question(counter, &spec.model, t, str::to_owned)).collect::<anyhow::Result<Vec<_>>>()?;
    let starts = arrivals::poisson(&mut StdRng::seed_from_u64(seed ^ 0x5eed_a77e), rate / spec.burst_size as f64, secs);
    let mut out = Vec::with_capacity(starts.len() * spec.burst_size);
    for (b, start) in starts.into_iter().enumerate() {
        let task = rng.random_range(0..tasks.len());
        for i in 0..spec.burst_size {
            let at = start + Duration::from_secs_f64(rng.random_range(0.0..1.0));
            if at.as_secs_f64() >= secs {
                continue;
            }
            let max_tokens = spec.output_tokens.draw(&mut rng);
            let tokens = spec.question_tokens.draw(&mut rng) as usize;
            let question = text::unique(&mut rng, &format!("b{b}q{i}"), tokens);
            let body = chat_body(&spec.model, Some(&tasks[task]), &question, max_tokens);
            let prompt_tokens = counter.ids(Api::Chat, &body)?.len();
            out.push(Request { at, api: Api::Chat, body, session: None, prompt_tokens, shared_prefix_tokens: shared[task], step: None });
        }
    }
    Ok(out)
}

/// `agent` over `secs` seconds at `rate` steps per second on average.
pub fn agents(spec: &Spec, rate: f64, secs: f64, seed: u64, counter: &Counter) -> anyhow::Result<Vec<Request>> {
    anyhow::ensure!(spec.system_prompts > 0, "--system-prompts must be at least 1");
    let mut rng = StdRng::seed_from_u64(seed);
    let frameworks = unique_texts(&mut rng, spec.system_prompts, spec.system_tokens, "agent");
    let shared =
        frameworks.iter().map(|f| shared_up_to_question(counter, &spec.model, f, str::to_owned)).collect::<anyhow::Result<Vec<_>>>()?;
    let starts = arrivals::poisson(&mut StdRng::seed_from_u64(seed ^ 0x5eed_a77e), rate / spec.turns.mean().max(1.0), secs);
    let mut out = Vec::new();
    for (agent, at) in starts.into_iter().enumerate() {
        let framework = rng.random_range(0..frameworks.len());
        let tokens = spec.question_tokens.draw(&mut rng) as usize;
        let task = text::unique(&mut rng, &format!("a{agent}"), tokens);
        for k in 0..spec.turns.draw(&mut rng).max(1) {
            let max_tokens = spec.output_tokens.draw(&mut rng);
            let (body, think, shared_prefix_tokens) = if k == 0 {
                (chat_body(&spec.model, Some(&frameworks[framework]), &task, max_tokens), Duration::ZERO, shared[framework])
            } else {
                let tokens = spec.tool_tokens.draw(&mut rng) as usize;
                let output = text::unique(&mut rng, &format!("a{agent}t{k}"), tokens);
                let messages = [json!({"role": "user", "content": format!("Tool output: {output}")})];
                let think = Duration::from_millis(spec.agent_think_ms.draw(&mut rng));
                // What it shares with the previous step is known once that step's answer is.
                (json!({"model": spec.model, "messages": messages, "max_tokens": max_tokens}), think, 0)
            };
            let prompt_tokens = counter.ids(Api::Chat, &body)?.len();
            let step = Some(Step { agent, think });
            out.push(Request { at, api: Api::Chat, body, session: None, prompt_tokens, shared_prefix_tokens, step });
        }
    }
    Ok(out)
}
