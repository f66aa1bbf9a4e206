//! The routing path's tokenizer stage: a request body in, its prompt tokens
//! out, and the prompt's text for a policy that reads text, from one parse.
//!
//! Each model's tokenizer is loaded once (again by a reload that changes it). Small bodies are tokenized inline;
//! larger ones go to a bounded pool of worker threads so a long prompt never
//! stalls the event loop. A body that finds the queue full, or whose tokens
//! take longer than `tokenizer.max_wait_ms`, is routed without a prediction
//! rather than delayed; so is one the tokenizer cannot follow (images, a
//! template of its own, a batch). Every outcome is counted by reason.

use std::sync::Arc;
use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use inferrail_config::Config;
use inferrail_policy::TextKind;
pub use inferrail_route::kv::Prompt;
use inferrail_tokenize::Tokenizer;
use inferrail_tokenize::chat::{self, Endpoint, RequestTemplates};
use serde_json::{Map, Value};
use tokio::sync::oneshot;

struct Job {
    tokenizer: Option<Arc<Tokenizer>>,
    endpoint: Endpoint,
    body: Vec<u8>,
    text: TextKind,
    reply: oneshot::Sender<Read>,
}

/// What the routing path reads of a body, from one parse of it: the
/// prompt's tokens (or why there are none) and, for a policy that reads it,
/// the prompt's text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Read {
    /// The prompt's tokens, or the reason label of why there are none.
    pub prompt: Result<Prompt, &'static str>,
    /// The text the model's policy reads.
    pub text: Option<String>,
}

/// A tokenizer for each model slot (none for a model without one).
pub type Tokenizers = Vec<Option<Arc<Tokenizer>>>;

/// Tokenizers by model slot, and the worker pool.
pub struct Prompts {
    tokenizers: ArcSwap<Tokenizers>,
    cache_tokens: usize,
    jobs: SyncSender<Job>,
    inline_below: usize,
    max_wait: Duration,
}

impl Prompts {
    /// Loads every model's tokenizer (slots in file order) and starts the workers.
    pub fn new(config: &Config) -> anyhow::Result<Self> {
        let t = &config.tokenizer;
        let tokenizers = config.models.iter().map(|m| load(m, t.cache_tokens)).collect::<anyhow::Result<_>>()?;
        let (jobs, queue) = sync_channel::<Job>(t.queue);
        let queue = Arc::new(std::sync::Mutex::new(queue));
        for i in 0..t.workers {
            let queue = queue.clone();
            std::thread::Builder::new().name(format!("tokenize-{i}")).spawn(move || {
                loop {
                    // The lock is held only while waiting for the next job.
                    let job = match queue.lock().unwrap_or_else(|p| p.into_inner()).recv() {
                        Ok(job) => job,
                        Err(_) => return,
                    };
                    if job.reply.is_closed() {
                        continue;
                    }
                    let _ = job.reply.send(read(job.tokenizer.as_deref(), job.endpoint, &job.body, job.text));
                }
            })?;
        }
        Ok(Self {
            tokenizers: ArcSwap::from_pointee(tokenizers),
            cache_tokens: t.cache_tokens,
            jobs,
            inline_below: t.inline_below_bytes,
            max_wait: Duration::from_millis(t.max_wait_ms),
        })
    }

    /// The tokenizers `new`'s models need in their `slots`: the one a model
    /// of the same name and tokenizer in `old` has, else loaded now. A slot
    /// no model names keeps its tokenizer. Nothing changes until [`Prompts::swap`].
    pub fn load_for(&self, old: &Config, new: &Config, slots: &[usize]) -> anyhow::Result<Tokenizers> {
        let mut next = self.tokenizers.load().to_vec();
        for (m, &slot) in new.models.iter().zip(slots) {
            if old.models.iter().any(|o| o.name == m.name && o.tokenizer == m.tokenizer) {
                continue;
            }
            let tokenizer = load(m, self.cache_tokens)?;
            match next.get_mut(slot) {
                Some(at) => *at = tokenizer,
                None => next.push(tokenizer),
            }
        }
        Ok(next)
    }

    /// Puts `tokenizers` (from [`Prompts::load_for`]) in force.
    pub fn swap(&self, tokenizers: Tokenizers) {
        self.tokenizers.store(Arc::new(tokenizers));
    }

    /// Reads a body sent to `model`: its prompt's tokens and the text of
    /// kind `text`, parsing it once, inline or on a worker.
    pub async fn read(&self, model: usize, endpoint: Endpoint, body: &[u8], text: TextKind) -> Read {
        let started = Instant::now();
        let tokenizer = self.tokenizers.load().get(model).cloned().flatten();
        let read = if tokenizer.is_none() && text == TextKind::None {
            Read { prompt: Err("no_tokenizer"), text: None }
        } else if body.len() < self.inline_below {
            read(tokenizer.as_deref(), endpoint, body, text)
        } else {
            let (reply, answer) = oneshot::channel();
            let failed = |reason| Read { prompt: Err(reason), text: None };
            match self.jobs.try_send(Job { tokenizer, endpoint, body: body.to_vec(), text, reply }) {
                Err(TrySendError::Full(_)) => failed("queue_full"),
                Err(TrySendError::Disconnected(_)) => failed("no_workers"),
                Ok(()) => match tokio::time::timeout(self.max_wait, answer).await {
                    Ok(Ok(read)) => read,
                    Ok(Err(_)) => failed("no_workers"),
                    Err(_) => failed("timeout"),
                },
            }
        };
        let outcome = match &read.prompt {
            Ok(_) => "ok",
            Err(reason) => reason,
        };
        metrics::counter!("inferrail_tokenize_total", "outcome" => outcome).increment(1);
        metrics::histogram!("inferrail_tokenize_seconds").record(started.elapsed().as_secs_f64());
        read
    }
}

/// Model `m`'s tokenizer, if it names one.
fn load(m: &inferrail_config::Model, cache_tokens: usize) -> anyhow::Result<Option<Arc<Tokenizer>>> {
    let Some(spec) = &m.tokenizer else { return Ok(None) };
    let tokenizer = Tokenizer::load(spec, cache_tokens).map_err(|e| anyhow::anyhow!("model {}: tokenizer {spec}: {e}", m.name))?;
    Ok(Some(Arc::new(tokenizer)))
}

/// Parses a body once and reads its prompt (with `tokenizer`) and its text.
fn read(tokenizer: Option<&Tokenizer>, endpoint: Endpoint, body: &[u8], text: TextKind) -> Read {
    let Ok(Value::Object(body)) = serde_json::from_slice::<Value>(body) else { return Read { prompt: Err("invalid"), text: None } };
    let prompt = tokenizer.map_or(Err("no_tokenizer"), |t| prompt(t, endpoint, &body));
    Read { prompt, text: text.read(&body) }
}

/// Tokenizes one parsed body; the error is a reason label.
fn prompt(tokenizer: &Tokenizer, endpoint: Endpoint, body: &Map<String, Value>) -> Result<Prompt, &'static str> {
    // The router never compiles a client's template on the routing path.
    let ids = chat::prompt_ids(tokenizer, endpoint, body, RequestTemplates::Decline).map_err(|e| e.reason())?;
    if ids.is_empty() {
        return Err("empty");
    }
    Ok(Prompt {
        special_at: tokenizer.special_positions(&ids),
        ids,
        max_tokens: max_tokens(body, endpoint),
        cache_salt: body.get("cache_salt").and_then(Value::as_str).map(str::to_owned),
        // The router knows an adapter's name from its model list.
        adapter: None,
    })
}

/// `max_completion_tokens`, else `max_tokens`; completions default to 16 as in vLLM.
fn max_tokens(body: &Map<String, Value>, endpoint: Endpoint) -> Option<usize> {
    let asked = ["max_completion_tokens", "max_tokens"].iter().find_map(|k| body.get(*k).and_then(Value::as_u64));
    match (asked, endpoint) {
        (Some(n), _) => usize::try_from(n).ok(),
        (None, Endpoint::Completions) => Some(16),
        (None, Endpoint::Chat) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompts(inline_below_bytes: usize) -> Prompts {
        let yaml = format!(
            "tokenizer: {{inline_below_bytes: {inline_below_bytes}, workers: 1}}\n\
             models: [{{name: m, tokenizer: builtin:sim}}, {{name: bare}}]\n\
             replicas: [{{id: a, address: 127.0.0.1:1, models: [m, bare]}}]\n"
        );
        Prompts::new(&Config::parse(&yaml).unwrap()).unwrap()
    }

    async fn tokens(p: &Prompts, model: usize, endpoint: Endpoint, body: &[u8]) -> Result<Prompt, &'static str> {
        p.read(model, endpoint, body, TextKind::None).await.prompt
    }

    #[tokio::test]
    async fn large_bodies_go_to_the_workers_and_come_back_the_same() {
        let body = br#"{"model": "m", "messages": [{"role": "user", "content": "Hello there, how are you?"}], "max_tokens": 3, "cache_salt": "s"}"#;
        let inline = prompts(1 << 20).read(0, Endpoint::Chat, body, TextKind::Serialized).await;
        let pooled = prompts(1).read(0, Endpoint::Chat, body, TextKind::Serialized).await;
        assert_eq!(inline, pooled);
        let prompt = inline.prompt.unwrap();
        assert_eq!((prompt.max_tokens, prompt.cache_salt.as_deref()), (Some(3), Some("s")));
        assert!(!prompt.ids.is_empty());
        assert_eq!(inline.text.as_deref(), Some(r#"[{"role":"user","content":"Hello there, how are you?"}]"#));
    }

    #[tokio::test]
    async fn no_tokenizer_or_a_body_it_cannot_follow_gives_no_prompt_but_the_text_is_still_read() {
        let p = prompts(1 << 20);
        let chat = br#"{"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": [{"type": "text", "text": "y"}]}]}"#;
        assert_eq!(tokens(&p, 1, Endpoint::Chat, chat).await, Err("no_tokenizer"));
        assert_eq!(p.read(1, Endpoint::Chat, chat, TextKind::Contents).await.text.as_deref(), Some("x y"));
        assert!(tokens(&p, 0, Endpoint::Completions, br#"{"prompt": ["a", "b"]}"#).await.is_err());
        assert_eq!(tokens(&p, 0, Endpoint::Completions, b"not json").await, Err("invalid"));
        assert_eq!(tokens(&p, 0, Endpoint::Completions, br#"{"prompt": "a"}"#).await.unwrap().max_tokens, Some(16), "vLLM's default");
    }
}
