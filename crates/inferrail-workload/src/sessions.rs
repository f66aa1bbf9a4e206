//! W2: multi-turn chats. Conversations arrive on a Poisson schedule; each
//! resends its whole history every turn and names itself in `x-session-id`;
//! its user thinks `--think-s` seconds between one turn's scheduled send and
//! the next. Generated conversations carry unique user messages and, as the
//! assistant's earlier replies, text of the simulator's vocabulary as long
//! as the `max_tokens` asked (the engine's actual reply is not known when the
//! schedule is drawn). ShareGPT conversations (`--sharegpt`) carry their own
//! replies, and each turn asks for as many tokens as its recorded reply.

use std::time::Duration;

use anyhow::Context;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Deserialize;
use serde_json::{Value, json};

use super::{Api, Counter, Request, Spec, common_prefix, text};
use crate::arrivals;

/// One conversation: `(role, content)` turns, `user` then `assistant`.
type Conversation = Vec<(String, String)>;

/// A ShareGPT file: `[{"conversations": [{"from": ..., "value": ...}]}]`.
#[derive(Deserialize)]
struct ShareGpt {
    conversations: Vec<ShareGptTurn>,
}

#[derive(Deserialize)]
struct ShareGptTurn {
    from: String,
    value: String,
}

/// Parses a ShareGPT file into conversations that have at least one user turn.
pub fn parse_sharegpt(text: &str) -> anyhow::Result<Vec<Conversation>> {
    let items: Vec<ShareGpt> = serde_json::from_str(text).context("not a ShareGPT JSON file")?;
    let convs: Vec<Conversation> = items
        .into_iter()
        .map(|c| {
            c.conversations
                .into_iter()
                .filter_map(|t| {
                    let role = match t.from.as_str() {
                        "human" | "user" => "user",
                        "gpt" | "assistant" | "chatgpt" | "bard" | "bing" => "assistant",
                        "system" => "system",
                        _ => return None,
                    };
                    Some((role.to_string(), t.value))
                })
                .collect::<Conversation>()
        })
        .filter(|c| c.iter().any(|(role, _)| role == "user"))
        .collect();
    anyhow::ensure!(!convs.is_empty(), "the ShareGPT file has no conversation with a human turn");
    Ok(convs)
}

/// The requests of W2 over `secs` seconds.
pub fn generate(spec: &Spec, rate: f64, secs: f64, seed: u64, counter: &Counter) -> anyhow::Result<Vec<Request>> {
    let recorded = match &spec.sharegpt {
        Some(path) => Some(parse_sharegpt(&std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?)?),
        None => None,
    };
    let mut rng = StdRng::seed_from_u64(seed);
    let starts = arrivals::poisson(&mut StdRng::seed_from_u64(seed ^ 0x5eed_a77e), rate / spec.turns.mean().max(1.0), secs);
    let mut out = Vec::new();
    for (c, start) in starts.into_iter().enumerate() {
        let session = format!("conv-{seed}-{c}");
        let mut messages: Vec<Value> = Vec::new();
        let mut previous: Option<Vec<u32>> = None;
        let mut at = start.as_secs_f64();
        let turns = match &recorded {
            Some(convs) => convs[rng.random_range(0..convs.len())].clone(),
            None => synthetic(spec, &mut rng, c),
        };
        let mut turns = turns.into_iter().peekable();
        while let Some((role, content)) = turns.next() {
            if role != "user" {
                messages.push(json!({"role": role, "content": content}));
                continue;
            }
            messages.push(json!({"role": "user", "content": content}));
            let reply = turns.next_if(|(r, _)| r == "assistant").map(|(_, content)| content);
            let max_tokens = match &reply {
                Some(r) => (inferrail_tokenize::sim::encode(r).len() as u64).max(1),
                None => spec.output_tokens.draw(&mut rng),
            };
            let body = json!({"model": spec.model, "messages": messages, "max_tokens": max_tokens});
            let ids = counter.ids(Api::Chat, &body)?;
            let shared_prefix_tokens = previous.as_deref().map_or(0, |p| common_prefix(p, &ids));
            if at < secs {
                out.push(Request {
                    at: Duration::from_secs_f64(at),
                    api: Api::Chat,
                    body,
                    session: Some(session.clone()),
                    prompt_tokens: ids.len(),
                    shared_prefix_tokens,
                    step: None,
                });
            }
            previous = Some(ids);
            if let Some(r) = reply {
                messages.push(json!({"role": "assistant", "content": r}));
            }
            at += spec.think_s.draw_f64(&mut rng);
        }
    }
    Ok(out)
}

/// A generated conversation: unique questions, replies of simulator words.
fn synthetic(spec: &Spec, rng: &mut StdRng, c: usize) -> Conversation {
    let turns = spec.turns.draw(rng).max(1) as usize;
    let mut conv = Vec::with_capacity(2 * turns);
    for t in 0..turns {
        let tokens = spec.question_tokens.draw(rng) as usize;
        conv.push(("user".to_string(), text::unique(rng, &format!("c{c}t{t}"), tokens)));
        if t + 1 < turns {
            let tokens = spec.output_tokens.draw(rng) as usize;
            let reply = text::generated(rng, tokens);
            conv.push(("assistant".to_string(), reply));
        }
    }
    conv
}
