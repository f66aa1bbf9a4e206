//! The fleet simulation's requests: the `run` harness's workloads, as token
//! ids, generated lazily in arrival order.
//!
//! W1, W6, mix and hot are drawn here with the very same random draws as
//! [`crate::workload`] (same seed, same requests, same arrival times), but
//! straight into `builtin:sim` token ids: each system prompt and the chat
//! template around a message are tokenized once, and every filler word is one
//! known piece, so a 100,000-request run tokenizes nothing per request. The
//! `same_requests_as_the_harness` test holds this equal to tokenizing the
//! harness's bodies. W2 and replay take the slow road: the harness's
//! requests, each tokenized when it arrives.
//!
//! An `agent`'s first step arrives on the workload's schedule and carries
//! the rest of its agent ([`Agent`]); the simulation makes each later step
//! when the one before completes, from the reply it generated.

use std::collections::VecDeque;
use std::time::Duration;

use anyhow::Context;
use inferrail_policy::TextKind;
use inferrail_tokenize::sim::{encode, piece_id};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;

use inferrail_workload::arrivals;
use inferrail_workload::text::WORDS;
use inferrail_workload::{self as workload, Api, Counter, Kind, Spec, Zipf, chat_body, common_prefix};

/// One request as the simulation sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Arrival {
    /// Arrival time from the start.
    pub at: Duration,
    /// Prompt token ids.
    pub ids: Vec<u32>,
    /// `max_tokens`.
    pub max_tokens: usize,
    /// The conversation it names.
    pub session: Option<String>,
    /// The prompt as text, for policies that read it.
    pub text: Option<String>,
    /// A closed-loop agent's later steps, if this is one of its steps.
    pub agent: Option<Box<Agent>>,
    /// The LoRA adapter it asks for, by its index (`lora`).
    pub adapter: Option<usize>,
}

/// What a closed-loop agent's step carries to make the next: the
/// conversation it sent and the steps still to come.
#[derive(Debug, Clone, PartialEq)]
pub struct Agent {
    /// The messages the step sent.
    messages: Vec<Value>,
    /// The later steps as the workload made them: their own messages, `max_tokens` and think time.
    steps: VecDeque<workload::Request>,
    /// Which prompt text policies read.
    text: TextKind,
    /// Seeds the replies.
    seed: u64,
}

impl Agent {
    /// The reply of `tokens` the engine generates for the step that carries
    /// this: the simulator's words, seeded by the agent and the step.
    pub fn reply(&self, tokens: usize) -> String {
        let mut rng = StdRng::seed_from_u64(self.seed ^ (self.steps.len() as u64).rotate_left(32));
        workload::text::generated(&mut rng, tokens)
    }

    /// The next step, once `reply` to this one ended at `ended`; `None` when
    /// the agent is done.
    pub fn next(mut self: Box<Self>, reply: &str, ended: Duration, counter: &Counter) -> Option<anyhow::Result<Arrival>> {
        let r = self.steps.pop_front()?;
        let body = workload::continue_conversation(&mut self.messages, reply, &r.body);
        let at = ended + r.step.as_ref().map_or(Duration::ZERO, |s| s.think);
        let arrival = slow(counter, workload::Request { at, body, ..r }, self.text);
        Some(arrival.map(|a| Arrival { agent: Some(self), ..a }))
    }
}

/// A workload's requests in arrival order; see the module doc.
pub struct Traffic {
    source: Source,
    text: TextKind,
    counter: Counter,
}

enum Source {
    Fast(Box<Fast>),
    Slow {
        requests: std::vec::IntoIter<workload::Request>,
    },
    /// Each agent's first step and the rest of it.
    Agents {
        agents: std::vec::IntoIter<(workload::Request, Agent)>,
    },
}

/// What W1, W6, mix and hot need, tokenized once.
struct Fast {
    spec: Spec,
    rng: StdRng,
    zipf: Zipf,
    times: std::iter::Enumerate<std::vec::IntoIter<Duration>>,
    /// Each system prompt's text and its ids up to the user message.
    systems: Vec<(String, Vec<u32>)>,
    /// The ids up to the user message without a system prompt.
    user_prefix: Vec<u32>,
    /// Each word followed by a space.
    word_ids: [u32; 64],
    /// Each word as the message's last, with the template after it.
    last_ids: Vec<Vec<u32>>,
    /// The model the bodies name.
    model: String,
}

impl Traffic {
    /// The first `requests` of `spec` at `rate` per second from `seed`;
    /// `text` says which prompt text the policy reads.
    pub fn new(spec: &Spec, rate: f64, requests: usize, seed: u64, text: TextKind) -> anyhow::Result<Self> {
        anyhow::ensure!(rate > 0.0, "the rate must be positive");
        let counter = Counter::new()?;
        // Long enough for `requests` arrivals but for a vanishing chance.
        let secs = (requests as f64 * 1.2 + 100.0) / rate;
        let source = match spec.workload {
            Kind::W1 | Kind::Long | Kind::W6 | Kind::Mix | Kind::Hot | Kind::Lora => {
                Source::Fast(Box::new(Fast::new(spec, rate, secs, requests, seed, &counter)?))
            }
            Kind::W2 | Kind::Rag | Kind::Burst | Kind::Replay => {
                let mut all = workload::generate(spec, rate, secs, seed)?;
                all.truncate(requests);
                Source::Slow { requests: all.into_iter() }
            }
            Kind::Agent => Source::Agents { agents: agents(workload::generate(spec, rate, secs, seed)?, requests, text, seed).into_iter() },
        };
        Ok(Self { source, text, counter })
    }

    /// The system prompts' token counts (up to the user message), for sizing caches.
    pub fn shared_prompt_tokens(&self) -> Vec<usize> {
        match &self.source {
            Source::Fast(f) => f.systems.iter().map(|(_, ids)| ids.len()).collect(),
            Source::Slow { .. } | Source::Agents { .. } => Vec::new(),
        }
    }
}

impl Iterator for Traffic {
    type Item = anyhow::Result<Arrival>;

    fn next(&mut self) -> Option<Self::Item> {
        match &mut self.source {
            Source::Fast(f) => f.next(&self.counter, self.text),
            Source::Slow { requests } => {
                let r = requests.next()?;
                Some(slow(&self.counter, r, self.text))
            }
            Source::Agents { agents } => {
                let (first, agent) = agents.next()?;
                Some(slow(&self.counter, first, self.text).map(|a| Arrival { agent: Some(Box::new(agent)), ..a }))
            }
        }
    }
}

/// The agents of a workload's steps, each as its first step and the rest,
/// as many as take `requests` steps in all.
fn agents(steps: Vec<workload::Request>, requests: usize, text: TextKind, seed: u64) -> Vec<(workload::Request, Agent)> {
    let mut out: Vec<(workload::Request, Agent)> = Vec::new();
    let mut taken = 0;
    for r in steps {
        let Some(step) = &r.step else { continue };
        if let Some((_, agent)) = out.get_mut(step.agent) {
            agent.steps.push_back(r);
        } else if taken < requests {
            let messages = r.body["messages"].as_array().cloned().unwrap_or_default();
            let agent = Agent { messages, steps: VecDeque::new(), text, seed: seed.rotate_left(16) ^ step.agent as u64 };
            out.push((r, agent));
        } else {
            continue;
        }
        taken += 1;
    }
    out
}

fn slow(counter: &Counter, r: workload::Request, kind: TextKind) -> anyhow::Result<Arrival> {
    let ids = counter.ids(r.api, &r.body)?;
    let max_tokens = r.body.get("max_tokens").and_then(Value::as_u64).unwrap_or(256) as usize;
    Ok(Arrival {
        at: r.at,
        ids,
        max_tokens,
        session: r.session,
        text: r.body.as_object().and_then(|b| kind.read(b)),
        agent: None,
        adapter: None,
    })
}

/// The harness's filler: a marker, then `tokens - 1` words (indices into [`WORDS`]).
fn draw_words(rng: &mut StdRng, tokens: usize) -> Vec<u8> {
    (1..tokens).map(|_| rng.random_range(0..WORDS.len()) as u8).collect()
}

fn words_text(marker: &str, words: &[u8]) -> String {
    let mut out = String::with_capacity(marker.len() + words.len() * 7);
    out.push_str(marker);
    for &w in words {
        out.push(' ');
        out.push_str(WORDS[w as usize]);
    }
    out
}

impl Fast {
    fn new(spec: &Spec, rate: f64, secs: f64, requests: usize, seed: u64, counter: &Counter) -> anyhow::Result<Self> {
        anyhow::ensure!(spec.system_prompts > 0, "--system-prompts must be at least 1");
        let mut rng = StdRng::seed_from_u64(seed);
        let texts: Vec<String> = (0..spec.system_prompts)
            .map(|k| {
                let tokens = spec.system_tokens.draw(&mut rng) as usize;
                words_text(&format!("sys{k}"), &draw_words(&mut rng, tokens))
            })
            .collect();
        let prefix = |system: Option<&str>| -> anyhow::Result<Vec<u32>> {
            let a = counter.ids(Api::Chat, &chat_body(&spec.model, system, "a", 1))?;
            let b = counter.ids(Api::Chat, &chat_body(&spec.model, system, "b", 1))?;
            let n = common_prefix(&a, &b);
            Ok(a[..n].to_vec())
        };
        let systems = texts.into_iter().map(|t| prefix(Some(&t)).map(|ids| (t, ids))).collect::<anyhow::Result<Vec<_>>>()?;
        let user_prefix = prefix(None)?;
        let last_ids = WORDS
            .iter()
            .map(|w| Ok(counter.ids(Api::Chat, &chat_body(&spec.model, None, w, 1))?[user_prefix.len()..].to_vec()))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let word_ids = WORDS.map(|w| piece_id(&format!("{w} ")));
        let mut times = arrivals::poisson(&mut StdRng::seed_from_u64(seed ^ 0x5eed_a77e), rate, secs);
        times.truncate(requests);
        Ok(Self {
            spec: spec.clone(),
            rng,
            zipf: Zipf::new(spec.system_prompts, spec.zipf_exponent),
            times: times.into_iter().enumerate(),
            systems,
            user_prefix,
            word_ids,
            last_ids,
            model: spec.model.clone(),
        })
    }

    fn next(&mut self, counter: &Counter, kind: TextKind) -> Option<anyhow::Result<Arrival>> {
        let (i, at) = self.times.next()?;
        let rng = &mut self.rng;
        let max_tokens = self.spec.output_tokens.draw(rng);
        let shares = match self.spec.workload {
            Kind::W6 => false,
            Kind::Mix => rng.random_bool(0.5),
            _ => true,
        };
        let (system, marker, words) = if shares {
            let k = if matches!(self.spec.workload, Kind::Hot | Kind::Lora) {
                self.zipf.draw(rng)
            } else {
                rng.random_range(0..self.systems.len())
            };
            let tokens = self.spec.question_tokens.draw(rng) as usize;
            (Some(k), format!("q{i}"), draw_words(rng, tokens))
        } else {
            let tokens = self.spec.system_tokens.draw(rng) + self.spec.question_tokens.draw(rng);
            (None, format!("u{i}"), draw_words(rng, tokens as usize))
        };
        let prefix = system.map_or(&self.user_prefix, |k| &self.systems[k].1);
        let mut ids = Vec::with_capacity(prefix.len() + words.len() + 8);
        ids.extend_from_slice(prefix);
        match words.split_last() {
            Some((&last, rest)) => {
                // The space after the marker always ends a piece.
                ids.extend(encode(&format!("{marker} ")));
                ids.extend(rest.iter().map(|&w| self.word_ids[w as usize]));
                ids.extend_from_slice(&self.last_ids[last as usize]);
            }
            None => {
                let body = chat_body(&self.model, None, &marker, 1);
                match counter.ids(Api::Chat, &body).context("tokenizing a one-word message") {
                    Ok(all) => ids.extend_from_slice(&all[self.user_prefix.len()..]),
                    Err(e) => return Some(Err(e)),
                }
            }
        }
        let text = (kind != TextKind::None).then(|| {
            let body = chat_body(&self.model, system.map(|k| self.systems[k].0.as_str()), &words_text(&marker, &words), max_tokens);
            body.as_object().and_then(|b| kind.read(b))
        });
        let adapter = system.filter(|_| self.spec.workload == Kind::Lora);
        Some(Ok(Arrival { at, ids, max_tokens: max_tokens as usize, session: None, text: text.flatten(), agent: None, adapter }))
    }
}

/// Half the shared system prompts' blocks (a replica holds a third of them
/// and has room for the requests it runs), and room for the largest request.
pub fn default_kv_blocks(spec: &Spec, seed: u64, block_size: usize) -> anyhow::Result<usize> {
    let shared: usize = Traffic::new(spec, 1.0, 0, seed, TextKind::None)?.shared_prompt_tokens().iter().sum();
    let largest = spec.system_tokens.max + spec.question_tokens.max + spec.output_tokens.max + 64;
    Ok((shared / 2).max(largest as usize).div_ceil(block_size))
}
