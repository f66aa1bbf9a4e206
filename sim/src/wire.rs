//! Requests in, response bodies out, field for field as vLLM 0.32.0 writes them.
//!
//! Parsing reads only what the engine needs and checks it the way vLLM does;
//! response builders write fields in vLLM's order with its explicit nulls and
//! omissions (`serde_json` keeps insertion order here).

use inferrail_kv::hash::{BlockHash, salt};
use inferrail_tokenize::Tokenizer;
use inferrail_tokenize::chat::{self, Endpoint, RequestTemplates};
use serde_json::{Map, Value, json};

use crate::errors::{ApiError, json_error};
use crate::lora::Adapter;
use crate::metrics::FinishReason;

/// Which OpenAI endpoint a request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `/v1/chat/completions`
    Chat,
    /// `/v1/completions`
    Completion,
}

/// A validated generation request.
#[derive(Debug, Clone)]
pub struct GenRequest {
    /// The served name asked for (an adapter's name for an adapter).
    pub model: String,
    /// The adapter asked for, if any.
    pub adapter: Option<Adapter>,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// `max_tokens` as sent.
    pub max_tokens: Option<usize>,
    /// Stream as server-sent events.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// `stream_options.continuous_usage_stats`.
    pub continuous_usage: bool,
    /// `return_token_ids`.
    pub return_token_ids: bool,
    /// Chain start from the adapter and `cache_salt`.
    pub salt: BlockHash,
    /// `cache_salt` as sent.
    pub cache_salt: Option<String>,
    /// `kv_transfer_params` as sent, for a KV connector to read.
    pub kv_transfer_params: Option<Value>,
}

/// What the server knows when it parses.
#[derive(Debug, Clone)]
pub struct Served<'a> {
    /// Names clients may ask for.
    pub names: &'a [String],
    /// Context length.
    pub max_model_len: usize,
    /// The model's tokenizer.
    pub tokenizer: &'a Tokenizer,
    /// The adapters served, in load order.
    pub adapters: Vec<Adapter>,
}

/// Parses a JSON body into an object, with vLLM's errors.
pub fn parse_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Err(e) => Err(json_error(body, &e)),
        Ok(Value::Object(m)) => Ok(m),
        Ok(other) => Err(ApiError::validation(
            "model_attributes_type",
            "body",
            "Input should be a valid dictionary or object to extract fields from",
            &other,
            None,
        )),
    }
}

fn type_error(field: &str, kind: &str, msg: &str, v: &Value) -> ApiError {
    ApiError::validation(kind, &format!("body.{field}"), msg, v, None)
}

fn opt_bool(m: &Map<String, Value>, field: &str) -> Result<Option<bool>, ApiError> {
    match m.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(type_error(field, "bool_type", "Input should be a valid boolean", v)),
    }
}

fn opt_str<'a>(m: &'a Map<String, Value>, field: &str) -> Result<Option<&'a str>, ApiError> {
    match m.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(type_error(field, "string_type", "Input should be a valid string", v)),
    }
}

fn opt_int(m: &Map<String, Value>, field: &str) -> Result<Option<i64>, ApiError> {
    match m.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_i64().map(Some).ok_or_else(|| type_error(field, "int_type", "Input should be a valid integer", v)),
    }
}

/// The served name a request asks for: `model` if given, else the first name.
pub fn resolve_model(m: &Map<String, Value>, served: &Served<'_>) -> Result<(String, Option<Adapter>), ApiError> {
    match opt_str(m, "model")? {
        None => Ok((served.names.first().cloned().unwrap_or_default(), None)),
        Some(name) if served.names.iter().any(|n| n == name) => Ok((name.to_string(), None)),
        Some(name) => match served.adapters.iter().find(|a| &*a.name == name) {
            Some(a) => Ok((name.to_string(), Some(a.clone()))),
            // Adapters are not among the aliases vLLM lists.
            None => Err(ApiError::unknown_model(name, served.names)),
        },
    }
}

/// Validates a chat or completion body and tokenizes its prompt.
pub fn parse_generation(kind: Kind, body: &[u8], served: &Served<'_>) -> Result<GenRequest, ApiError> {
    let m = parse_object(body)?;
    let (model, adapter) = resolve_model(&m, served)?;
    let prompt = match kind {
        Kind::Chat => chat_prompt(&m, served.tokenizer)?,
        Kind::Completion => completion_prompt(&m, served.tokenizer)?,
    };

    let stream = opt_bool(&m, "stream")?.unwrap_or(false);
    let (mut include_usage, mut continuous_usage) = (false, false);
    match m.get("stream_options") {
        None | Some(Value::Null) => {}
        Some(Value::Object(o)) => {
            if !stream {
                return Err(ApiError::bad_request("Stream options can only be defined when `stream=True`.", None));
            }
            include_usage = opt_bool(o, "include_usage")?.unwrap_or(false);
            continuous_usage = opt_bool(o, "continuous_usage_stats")?.unwrap_or(false);
        }
        Some(v) => return Err(type_error("stream_options", "model_type", "Input should be a valid dictionary", v)),
    }

    for field in ["n", "best_of"] {
        if let Some(n) = opt_int(&m, field)?
            && n != 1
        {
            return Err(ApiError::unsupported(field, &json!(n)));
        }
    }
    let unsupported_flags: &[&str] = match kind {
        Kind::Chat => &["logprobs", "echo"],
        Kind::Completion => &["echo"],
    };
    for &field in unsupported_flags {
        if opt_bool(&m, field)? == Some(true) {
            return Err(ApiError::unsupported(field, &json!(true)));
        }
    }
    if kind == Kind::Completion
        && let Some(v) = m.get("logprobs").filter(|v| !v.is_null())
    {
        return Err(ApiError::unsupported("logprobs", v));
    }
    if let Some(v) = m.get("prompt_logprobs").filter(|v| !v.is_null()) {
        return Err(ApiError::unsupported("prompt_logprobs", v));
    }

    let max_tokens = match opt_int(&m, "max_completion_tokens")?.or(opt_int(&m, "max_tokens")?) {
        None => None,
        Some(n) if n < 1 => {
            return Err(ApiError::bad_request(&format!("max_tokens must be at least 1, got {n}."), Some("max_tokens")));
        }
        Some(n) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
    };
    let max_tokens = match (kind, max_tokens) {
        (Kind::Completion, None) => Some(16),
        (_, given) => given,
    };
    check_length(prompt.len(), max_tokens, served.max_model_len)?;

    let cache_salt = opt_str(&m, "cache_salt")?;
    // An adapter's blocks are its own, as vLLM's ("lora", name, path) key makes them.
    let salt = match (&adapter, cache_salt) {
        (None, None) => 0,
        (None, Some(s)) => salt(&[s]),
        (Some(a), s) => salt(&["lora", &a.name, &a.path, s.unwrap_or_default()]),
    };
    Ok(GenRequest {
        model,
        adapter,
        prompt,
        max_tokens,
        stream,
        include_usage,
        continuous_usage,
        return_token_ids: opt_bool(&m, "return_token_ids")?.unwrap_or(false),
        salt,
        cache_salt: cache_salt.map(str::to_owned),
        kv_transfer_params: m.get("kv_transfer_params").filter(|v| !v.is_null()).cloned(),
    })
}

/// vLLM's context-length checks.
fn check_length(prompt: usize, max_tokens: Option<usize>, max_len: usize) -> Result<(), ApiError> {
    if let Some(m) = max_tokens
        && m > max_len
    {
        let msg = format!(
            "max_tokens={m} cannot be greater than max_model_len={max_len}. Please request fewer output tokens. (parameter=max_tokens, value={m})"
        );
        return Err(ApiError::bad_request(&msg, Some("max_tokens")));
    }
    if prompt >= max_len {
        let msg = format!(
            "This model's maximum context length is {max_len} tokens. However, your request has {prompt} input tokens. Please reduce the length of the input messages. (parameter=input_tokens, value={prompt})"
        );
        return Err(ApiError::bad_request(&msg, Some("input_tokens")));
    }
    if let Some(m) = max_tokens
        && prompt + m > max_len
    {
        let msg = format!(
            "'max_tokens' is too large: {m}. This model's maximum context length is {max_len} tokens and your request has {prompt} input tokens ({m} > {max_len} - {prompt}). (parameter=max_tokens, value={m})"
        );
        return Err(ApiError::bad_request(&msg, Some("max_tokens")));
    }
    Ok(())
}

/// The chat prompt rendered and tokenized, after the checks vLLM's request model makes.
pub fn chat_prompt(m: &Map<String, Value>, tok: &Tokenizer) -> Result<Vec<u32>, ApiError> {
    let messages = match m.get("messages") {
        None => return Err(ApiError::validation("missing", "body.messages", "Field required", &Value::Object(m.clone()), None)),
        Some(Value::Array(a)) => a,
        Some(v) => return Err(type_error("messages", "list_type", "Input should be a valid list", v)),
    };
    for (i, msg) in messages.iter().enumerate() {
        let loc = format!("body.messages.{i}");
        let Value::Object(msg) = msg else {
            return Err(ApiError::validation("model_type", &loc, "Input should be a valid dictionary", msg, None));
        };
        match msg.get("role") {
            Some(Value::String(_)) => {}
            Some(v) => return Err(ApiError::validation("string_type", &format!("{loc}.role"), "Input should be a valid string", v, None)),
            None => {
                return Err(ApiError::validation("missing", &format!("{loc}.role"), "Field required", &Value::Object(msg.clone()), None));
            }
        }
        match msg.get("content") {
            None | Some(Value::Null | Value::String(_)) => {}
            Some(Value::Array(parts)) => {
                for (j, part) in parts.iter().enumerate() {
                    let kind = part.get("type").and_then(Value::as_str);
                    match (kind, chat::text_field(kind)) {
                        (Some(other), None) => {
                            return Err(ApiError::unsupported(&format!("messages[{i}].content[{j}].type"), &json!(other)));
                        }
                        (Some(_), Some(field)) if part.get(field).is_some_and(Value::is_string) => {}
                        (_, field) => {
                            let field = field.unwrap_or("text");
                            let loc = format!("{loc}.content.{j}");
                            return Err(ApiError::validation("missing", &format!("{loc}.{field}"), "Field required", part, None));
                        }
                    }
                }
            }
            Some(v) => {
                return Err(ApiError::validation("string_type", &format!("{loc}.content"), "Input should be a valid string", v, None));
            }
        }
    }
    let tokens =
        chat::prompt_ids(tok, Endpoint::Chat, m, RequestTemplates::Render).map_err(|e| ApiError::bad_request(&e.to_string(), None))?;
    if tokens.is_empty() {
        return Err(ApiError::bad_request("The rendered prompt is empty.", Some("messages")));
    }
    Ok(tokens)
}

/// The completion prompt: a string, token ids, or a batch of one of either.
pub fn completion_prompt(m: &Map<String, Value>, tok: &Tokenizer) -> Result<Vec<u32>, ApiError> {
    let prompt = match m.get("prompt") {
        None => return Err(ApiError::validation("missing", "body.prompt", "Field required", &Value::Object(m.clone()), None)),
        Some(Value::Array(batch)) if batch.len() == 1 && (batch[0].is_string() || batch[0].is_array()) => &batch[0],
        Some(Value::Array(batch)) if batch.iter().all(|v| v.is_string() || v.is_array()) && batch.len() > 1 => {
            return Err(ApiError::unsupported("prompt", &json!(format!("<batch of {}>", batch.len()))));
        }
        Some(p) => p,
    };
    match prompt {
        Value::String(_) => {}
        Value::Array(ids) => {
            for id in ids {
                match id.as_u64() {
                    Some(t) if t < tok.vocab_size() as u64 => {}
                    Some(t) => return Err(ApiError::bad_request(&format!("Token id {t} is out of vocabulary"), Some("prompt"))),
                    None => return Err(type_error("prompt", "int_type", "Input should be a valid integer", id)),
                }
            }
        }
        v => return Err(type_error("prompt", "string_type", "Input should be a valid string", v)),
    }
    let tokens = chat::completion_ids(tok, m).map_err(|e| ApiError::bad_request(&e.to_string(), Some("prompt")))?;
    if tokens.is_empty() {
        return Err(ApiError::bad_request("Prompt cannot be empty", Some("prompt")));
    }
    Ok(tokens)
}

/// Identity and options of one response.
#[derive(Debug, Clone)]
pub struct Reply {
    /// Endpoint.
    pub kind: Kind,
    /// `chatcmpl-...` or `cmpl-...`.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// Served name.
    pub model: String,
    /// Report `prompt_tokens_details`.
    pub details: bool,
    /// Echo token ids.
    pub return_token_ids: bool,
    /// Continuous usage in every chunk.
    pub continuous_usage: bool,
}

/// Token counts for `usage`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt: usize,
    /// Generated tokens.
    pub completion: usize,
    /// Prompt tokens found cached.
    pub cached: usize,
}

/// vLLM's `system_fingerprint`.
pub const FINGERPRINT: &str = "vllm-0.32.0-c5ebaeb6";

impl Reply {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        }
    }

    fn usage_full(&self, u: Usage) -> Value {
        let details = match (self.details, self.kind) {
            (false, _) => Value::Null,
            (true, Kind::Chat) => json!({"cached_tokens": u.cached, "created_cache_tokens": 0, "multimodal_tokens": null}),
            (true, Kind::Completion) => json!({"cached_tokens": u.cached, "created_cache_tokens": null, "multimodal_tokens": null}),
        };
        json!({
            "prompt_tokens": u.prompt,
            "total_tokens": u.prompt + u.completion,
            "completion_tokens": u.completion,
            "prompt_tokens_details": details,
            "completion_tokens_details": null,
        })
    }

    fn usage_brief(u: Usage) -> Value {
        json!({"prompt_tokens": u.prompt, "total_tokens": u.prompt + u.completion, "completion_tokens": u.completion})
    }

    /// The whole non-streaming response.
    pub fn complete(
        &self,
        text: &str,
        prompt: &[u32],
        output: &[u32],
        finish: FinishReason,
        u: Usage,
        kv_transfer_params: Value,
    ) -> String {
        let ids = |t: &[u32]| if self.return_token_ids { json!(t) } else { Value::Null };
        let mut out = Map::new();
        out.insert("id".into(), json!(self.id));
        out.insert("object".into(), json!(self.object(false)));
        out.insert("created".into(), json!(self.created));
        out.insert("model".into(), json!(self.model));
        let choice = match self.kind {
            Kind::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": null, "annotations": null, "audio": null, "function_call": null, "reasoning": null},
                "logprobs": null,
                "finish_reason": finish.as_str(),
                "stop_reason": null,
                "token_ids": ids(output),
                "routed_experts": null,
            }),
            Kind::Completion => json!({
                "index": 0,
                "text": text,
                "logprobs": null,
                "finish_reason": finish.as_str(),
                "stop_reason": null,
                "token_ids": ids(output),
                "prompt_logprobs": null,
                "prompt_token_ids": ids(prompt),
                "routed_experts": null,
            }),
        };
        out.insert("choices".into(), json!([choice]));
        out.insert("service_tier".into(), Value::Null);
        out.insert("system_fingerprint".into(), json!(FINGERPRINT));
        out.insert("usage".into(), self.usage_full(u));
        if self.kind == Kind::Chat {
            out.insert("prompt_logprobs".into(), Value::Null);
            out.insert("prompt_token_ids".into(), ids(prompt));
            out.insert("prompt_text".into(), Value::Null);
        }
        out.insert("kv_transfer_params".into(), kv_transfer_params);
        out.insert("ec_transfer_params".into(), Value::Null);
        out.insert("metrics".into(), Value::Null);
        Value::Object(out).to_string()
    }

    fn chunk_head(&self) -> Map<String, Value> {
        let mut out = Map::new();
        out.insert("id".into(), json!(self.id));
        out.insert("object".into(), json!(self.object(true)));
        out.insert("created".into(), json!(self.created));
        out.insert("model".into(), json!(self.model));
        out
    }

    /// The chat stream's first chunk, naming the assistant role.
    pub fn role_chunk(&self, prompt: &[u32], u: Usage) -> String {
        let mut out = self.chunk_head();
        out.insert(
            "choices".into(),
            json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]),
        );
        if self.continuous_usage {
            out.insert("usage".into(), Self::usage_brief(u));
        }
        out.insert("prompt_token_ids".into(), if self.return_token_ids { json!(prompt) } else { Value::Null });
        out.insert("prompt_text".into(), Value::Null);
        Value::Object(out).to_string()
    }

    /// One streamed token; the last one carries its finish reason.
    pub fn token_chunk(&self, text: &str, token: u32, finish: Option<FinishReason>, u: Usage) -> String {
        let ids = if self.return_token_ids { json!([token]) } else { Value::Null };
        let mut choice = Map::new();
        choice.insert("index".into(), json!(0));
        match self.kind {
            Kind::Chat => {
                choice.insert("delta".into(), json!({"content": text}));
                choice.insert("logprobs".into(), Value::Null);
                choice.insert("finish_reason".into(), json!(finish.map(FinishReason::as_str)));
                if finish.is_some() {
                    choice.insert("stop_reason".into(), Value::Null);
                }
            }
            Kind::Completion => {
                choice.insert("text".into(), json!(text));
                choice.insert("logprobs".into(), Value::Null);
                choice.insert("finish_reason".into(), json!(finish.map(FinishReason::as_str)));
                choice.insert("stop_reason".into(), Value::Null);
                choice.insert("prompt_token_ids".into(), Value::Null);
            }
        }
        choice.insert("token_ids".into(), ids);
        let mut out = self.chunk_head();
        out.insert("choices".into(), json!([Value::Object(choice)]));
        if self.continuous_usage {
            out.insert("usage".into(), Self::usage_brief(u));
        }
        Value::Object(out).to_string()
    }

    /// The closing usage chunk of `stream_options.include_usage`.
    pub fn usage_chunk(&self, u: Usage) -> String {
        let mut usage = Self::usage_brief(u);
        if self.details
            && let Value::Object(m) = &mut usage
        {
            let details = match self.kind {
                Kind::Chat => json!({"cached_tokens": u.cached, "created_cache_tokens": 0}),
                Kind::Completion => json!({"cached_tokens": u.cached}),
            };
            m.insert("prompt_tokens_details".into(), details);
        }
        let mut out = self.chunk_head();
        out.insert("choices".into(), json!([]));
        out.insert("usage".into(), usage);
        out.insert("system_fingerprint".into(), json!(FINGERPRINT));
        Value::Object(out).to_string()
    }
}

/// The model list of `GET /v1/models`.
pub fn models(names: &[String], adapters: &[Adapter], root: &str, max_model_len: usize, created: u64, perm_id: &str) -> String {
    // The base model's names, then the adapters in load order.
    let base = names.iter().map(|name| (name.as_str(), root, Value::Null, json!(max_model_len)));
    let adapters = adapters.iter().map(|a| (&*a.name, a.path.as_str(), json!(a.parent), Value::Null));
    let data: Vec<Value> = base
        .chain(adapters)
        .map(|(name, root, parent, max_model_len)| {
            json!({
                "id": name, "object": "model", "created": created, "owned_by": "vllm", "root": root, "parent": parent,
                "max_model_len": max_model_len,
                "permission": [{
                    "id": perm_id, "object": "model_permission", "created": created, "allow_create_engine": false,
                    "allow_sampling": true, "allow_logprobs": true, "allow_search_indices": false, "allow_view": true,
                    "allow_fine_tuning": false, "organization": "*", "group": null, "is_blocking": false
                }]
            })
        })
        .collect();
    json!({"object": "list", "data": data}).to_string()
}

/// `POST /tokenize`: a completion prompt or chat messages, counted.
pub fn tokenize(body: &[u8], served: &Served<'_>) -> Result<String, ApiError> {
    let m = parse_object(body)?;
    resolve_model(&m, served)?;
    // An empty prompt is no tokens here, where generation refuses it.
    let empty = m.get("prompt").is_some_and(|p| p.as_str() == Some("") || p.as_array().is_some_and(Vec::is_empty));
    let tokens = if m.contains_key("messages") {
        chat_prompt(&m, served.tokenizer)?
    } else if empty {
        Vec::new()
    } else {
        completion_prompt(&m, served.tokenizer)?
    };
    Ok(json!({"count": tokens.len(), "max_model_len": served.max_model_len, "tokens": tokens, "token_strs": null}).to_string())
}
