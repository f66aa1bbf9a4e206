//! A request's prompt prepared as vLLM 0.32.0 prepares it, then encoded.
//!
//! Chat: vLLM turns each OpenAI message into a conversation message (text
//! parts joined with newlines, or kept as a list of `{type, text}` parts when
//! the template loops over `message.content`; `tool_calls` arguments parsed
//! from JSON; `tool_call_id` and `name` kept), dumps tools as pydantic does,
//! renders the chat template with transformers (`add_generation_prompt`,
//! `continue_final_message`, `documents`, `chat_template_kwargs`, special
//! tokens), then encodes the text without adding special tokens again.
//! Completions: a string or token ids, special tokens added by default.

use std::borrow::Cow;

use serde_json::{Map, Value};

use crate::template::{self, Template};
use crate::tokenizer::Tokenizer;

/// Which OpenAI endpoint a body was sent to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`
    Chat,
    /// `/v1/completions`
    Completions,
}

/// Why a request's tokens were not computed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Declined {
    /// Images, audio, video or files: the engine's tokens for them are not text tokens.
    #[error("{0}")]
    NotText(String),
    /// The request carries its own chat template.
    #[error("the request carries its own chat template")]
    RequestTemplate,
    /// A completions request with several prompts.
    #[error("a batch of {0} prompts")]
    Batch(usize),
    /// The model has no chat template.
    #[error("the model has no chat template")]
    NoTemplate,
    /// The template refused the conversation or failed.
    #[error("{0}")]
    Template(String),
    /// The body is not a valid request.
    #[error("{0}")]
    Invalid(String),
}

impl Declined {
    /// A short label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            Declined::NotText(_) => "not_text",
            Declined::RequestTemplate => "request_template",
            Declined::Batch(_) => "batch",
            Declined::NoTemplate => "no_template",
            Declined::Template(_) => "template_error",
            Declined::Invalid(_) => "invalid",
        }
    }
}

/// Whether a request's own `chat_template` is rendered (the simulator does, as
/// vLLM does) or declined (the router does: compiling untrusted templates on
/// the routing path costs more than the prediction is worth).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestTemplates {
    /// Compile and render it.
    Render,
    /// Decline the request.
    Decline,
}

/// The token ids of a chat or completions body.
pub fn prompt_ids(
    tok: &Tokenizer,
    endpoint: Endpoint,
    body: &Map<String, Value>,
    templates: RequestTemplates,
) -> Result<Vec<u32>, Declined> {
    match endpoint {
        Endpoint::Chat => {
            let text = render(tok, body, templates)?;
            Ok(tok.encode(&text, flag(body, "add_special_tokens")?.unwrap_or(false)))
        }
        Endpoint::Completions => completion_ids(tok, body),
    }
}

/// The prompt of a completions body: a string or token ids, or a batch of one of either.
pub fn completion_ids(tok: &Tokenizer, body: &Map<String, Value>) -> Result<Vec<u32>, Declined> {
    let add_special = flag(body, "add_special_tokens")?.unwrap_or(true);
    let prompt = match body.get("prompt") {
        Some(Value::Array(batch)) if batch.iter().all(|p| p.is_string() || p.is_array()) && !batch.is_empty() => {
            if batch.len() > 1 {
                return Err(Declined::Batch(batch.len()));
            }
            &batch[0]
        }
        Some(p) => p,
        None => return Err(Declined::Invalid("prompt is required".into())),
    };
    match prompt {
        Value::String(s) if s.is_empty() => Err(Declined::Invalid("Either prompt or prompt_embeds must be provided and non-empty.".into())),
        Value::String(s) => Ok(tok.encode(s, add_special)),
        Value::Array(ids) => ids
            .iter()
            .map(|id| {
                id.as_u64().and_then(|t| u32::try_from(t).ok()).ok_or_else(|| Declined::Invalid(format!("token id {id} is not valid")))
            })
            .collect(),
        other => Err(Declined::Invalid(format!("prompt must be a string or token ids, not {other}"))),
    }
}

/// The chat prompt as text: the conversation rendered by the model's (or the request's) template.
pub fn render(tok: &Tokenizer, body: &Map<String, Value>, templates: RequestTemplates) -> Result<String, Declined> {
    let own;
    let template = match body.get("chat_template") {
        Some(Value::String(src)) => match templates {
            RequestTemplates::Decline => return Err(Declined::RequestTemplate),
            RequestTemplates::Render => {
                own = Template::new(src).map_err(|e| Declined::Template(e.to_string()))?;
                &own
            }
        },
        None | Some(Value::Null) => tok.template.as_ref().ok_or(Declined::NoTemplate)?,
        Some(_) => return Err(Declined::Invalid("chat_template must be a string".into())),
    };
    let add_generation_prompt = flag(body, "add_generation_prompt")?.unwrap_or(true);
    let continue_final = flag(body, "continue_final_message")?.unwrap_or(false);
    if add_generation_prompt && continue_final {
        return Err(Declined::Invalid("Cannot set both `continue_final_message` and `add_generation_prompt` to True.".into()));
    }
    let Some(Value::Array(messages)) = body.get("messages") else {
        return Err(Declined::Invalid("messages must be a list".into()));
    };
    if messages.is_empty() {
        return Err(Declined::Template("Cannot apply chat template to an empty conversation. Provide at least one message.".into()));
    }
    let mut conversation = messages.iter().map(|m| Message::new(m, template.openai_content)).collect::<Result<Vec<_>, _>>()?;
    if !template.names_developer {
        developers_to_system(&mut conversation);
    }
    if continue_final {
        if !template.mentions_content {
            return Err(Declined::Template("continue_final_message is set but the chat template does not use message content".into()));
        }
        mark_final_message(&mut conversation)?;
    }

    // Template variables: special tokens, then the request's kwargs (vLLM's
    // request fields win over the same keys in chat_template_kwargs; null and
    // "auto" values are dropped), then transformers' own.
    let mut kwargs: Vec<(String, Value)> = match body.get("chat_template_kwargs") {
        Some(Value::Object(k)) => k.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        None | Some(Value::Null) => Vec::new(),
        Some(_) => return Err(Declined::Invalid("chat_template_kwargs must be an object".into())),
    };
    let effort = body.get("reasoning_effort").filter(|v| !v.is_null());
    if let Some(effort) = effort
        && !kwargs.iter().any(|(k, _)| k == "enable_thinking")
    {
        kwargs.push(("enable_thinking".into(), Value::Bool(effort != "none")));
    }
    for key in ["documents", "reasoning_effort"] {
        if let Some(v) = body.get(key).filter(|v| !v.is_null()) {
            kwargs.retain(|(k, _)| k != key);
            kwargs.push((key.into(), v.clone()));
        }
    }
    kwargs.retain(|(_, v)| !v.is_null() && v != "auto");
    let documents = kwargs.iter().find(|(k, _)| k == "documents").map_or(Value::Null, |(_, v)| v.clone());
    let mut ctx: Vec<(String, minijinja::Value)> =
        tok.special.named.iter().map(|(k, v)| (k.clone(), minijinja::Value::from(v.as_str()))).collect();
    ctx.extend(kwargs.iter().map(|(k, v)| (k.clone(), template::value(v))));
    ctx.push(("messages".into(), conversation.into_iter().map(Message::into_value).collect()));
    ctx.push(("tools".into(), tools(body.get("tools"))?));
    ctx.push(("documents".into(), template::value(&documents)));
    ctx.push(("add_generation_prompt".into(), minijinja::Value::from(add_generation_prompt)));
    let mut text = template.render(minijinja::Value::from_pairs(ctx)).map_err(|e| Declined::Template(template_error(&e)))?;
    if continue_final {
        let at = text.rfind(CONTINUE_TAG).ok_or_else(|| {
            Declined::Template("continue_final_message is set but the final message does not appear in the rendered chat".into())
        })?;
        let spaced = text[at + CONTINUE_TAG.len()..].starts_with(' ');
        text.truncate(at);
        if !spaced {
            text.truncate(text.trim_end().len());
        }
    }
    Ok(text)
}

/// transformers marks the final message's end with this (and a space), renders, and cuts there.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG";

fn mark_final_message(conversation: &mut [Message<'_>]) -> Result<(), Declined> {
    let none =
        || Declined::Template("continue_final_message is set but we could not find any text to continue in the final message!".into());
    let last = conversation.last_mut().ok_or_else(none)?;
    if !last.parts && last.texts.is_empty() {
        // An absent content is an empty string to the template.
        last.texts.push((Cow::Borrowed(""), Vec::new()));
    }
    let (text, _) = last.texts.last_mut().ok_or_else(none)?;
    text.to_mut().push_str(&format!("{CONTINUE_TAG} "));
    Ok(())
}

/// vLLM's handling of `developer` messages for templates that do not know the
/// role: they become `system` messages, and when a system message is not
/// first or there are several, all of them merge into one first message.
fn developers_to_system(conversation: &mut Vec<Message<'_>>) {
    if !conversation.iter().any(|m| m.role == "developer") {
        return;
    }
    for m in conversation.iter_mut().filter(|m| m.role == "developer") {
        m.role = "system";
        m.fields.retain(|(k, _)| *k != "tools");
    }
    let systems: Vec<usize> = conversation.iter().enumerate().filter(|(_, m)| m.role == "system").map(|(i, _)| i).collect();
    if systems.len() > 1 || systems.first().is_some_and(|&i| i != 0) {
        let merged: Vec<String> = systems.iter().map(|&i| conversation[i].joined()).filter(|t| !t.is_empty()).collect();
        conversation.retain(|m| m.role != "system");
        let text = (Cow::Owned(merged.join("\n\n")), Vec::new());
        conversation.insert(0, Message { role: "system", texts: vec![text], parts: false, fields: Vec::new() });
    }
}

/// Keys of a content part besides its type and text.
type PartKeys<'a> = Vec<(&'a String, &'a Value)>;

/// One OpenAI message as vLLM hands it to the template, its text borrowed
/// from the request until it becomes a template value.
struct Message<'a> {
    role: &'a str,
    /// The texts of its content and the other keys of each one's part.
    texts: Vec<(Cow<'a, str>, PartKeys<'a>)>,
    /// Whether the template sees content as `{type, text}` parts or as one string.
    parts: bool,
    /// Keys after `content`, in order.
    fields: Vec<(&'static str, minijinja::Value)>,
}

impl<'a> Message<'a> {
    fn new(m: &'a Value, openai_content: bool) -> Result<Self, Declined> {
        let Value::Object(m) = m else { return Err(Declined::Invalid("a message must be an object".into())) };
        let role = m.get("role").and_then(Value::as_str).ok_or_else(|| Declined::Invalid("a message needs a role".into()))?;
        let mut texts = Vec::new();
        match m.get("content") {
            None => {}
            Some(Value::Null) if role == "assistant" => {}
            Some(Value::Null) => return Err(Declined::Invalid(format!("content of a {role} message cannot be null"))),
            Some(Value::String(s)) => texts.push((Cow::Borrowed(s.as_str()), Vec::new())),
            Some(Value::Array(parts)) => {
                for part in parts {
                    match part {
                        Value::String(s) => texts.push((Cow::Borrowed(s.as_str()), Vec::new())),
                        Value::Object(p) => {
                            let kind = p.get("type").and_then(Value::as_str);
                            let Some(key) = text_field(kind) else {
                                return Err(Declined::NotText(format!("content part of type {}", kind.unwrap_or_default())));
                            };
                            match p.get(key) {
                                Some(Value::String(t)) => {
                                    let extra = p.iter().filter(|(k, _)| *k != "type" && *k != key).collect();
                                    texts.push((Cow::Borrowed(t.as_str()), extra));
                                }
                                None | Some(Value::Null) => {}
                                Some(_) => return Err(Declined::Invalid("a text part's text must be a string".into())),
                            }
                        }
                        _ => return Err(Declined::Invalid("a content part must be an object".into())),
                    }
                }
            }
            Some(_) => return Err(Declined::Invalid("content must be a string or a list of parts".into())),
        }
        if role == "system" {
            strip_billing_header(&mut texts);
        }
        if !openai_content {
            // An empty part is falsy to vLLM and dropped before the join; as a `{type, text}` dict it is kept.
            texts.retain(|(t, _)| !t.is_empty());
        }
        let parts = openai_content && !(role == "tool" && matches!(m.get("content"), Some(Value::Array(_))));
        let mut fields = Vec::new();
        if role == "assistant" {
            if let Some(Value::Array(calls)) = m.get("tool_calls")
                && !calls.is_empty()
            {
                let calls = calls.iter().map(parse_arguments).collect::<Result<Vec<_>, _>>()?;
                fields.push(("tool_calls", template::value(&Value::Array(calls))));
            }
            if let Some(r) = m.get("reasoning").or_else(|| m.get("reasoning_content")).filter(|v| !v.is_null()) {
                let r = template::value(r);
                fields.push(("reasoning", r.clone()));
                fields.push(("reasoning_content", r));
            }
        }
        if role == "tool"
            && let Some(id) = m.get("tool_call_id")
        {
            fields.push(("tool_call_id", template::value(id)));
        }
        for key in ["name", "task"] {
            if let Some(v @ Value::String(_)) = m.get(key) {
                fields.push((key, template::value(v)));
            }
        }
        if role == "developer" {
            fields.push(("tools", minijinja::Value::from(())));
        }
        Ok(Message { role, texts, parts, fields })
    }

    /// The content as one string: its texts joined by newlines.
    fn joined(&self) -> String {
        self.texts.iter().map(|(t, _)| t.as_ref()).collect::<Vec<_>>().join("\n")
    }

    fn into_value(self) -> minijinja::Value {
        use minijinja::Value as V;
        let content = if self.parts {
            self.texts
                .iter()
                .map(|(t, extra)| {
                    let head = [("type", V::from("text")), ("text", V::from(t.as_ref()))].map(|(k, v)| (V::from(k), v));
                    V::from_pairs(head.into_iter().chain(extra.iter().map(|(k, v)| (V::from(k.as_str()), template::value(v)))))
                })
                .collect::<V>()
        } else if let [(text, _)] = self.texts.as_slice() {
            V::from(text.as_ref())
        } else {
            V::from(self.joined())
        };
        let head = [(V::from("role"), V::from(self.role)), (V::from("content"), content)];
        V::from_pairs(head.into_iter().chain(self.fields.into_iter().map(|(k, v)| (V::from(k), v))))
    }
}

/// The field holding a content part's text, by the part's `type`; `None` for
/// parts that are not text (images, audio, files).
pub fn text_field(kind: Option<&str>) -> Option<&'static str> {
    match kind {
        Some("text" | "input_text" | "output_text") | None => Some("text"),
        Some("refusal") => Some("refusal"),
        Some("thinking") => Some("thinking"),
        Some(_) => None,
    }
}

/// A system text starting with `x-anthropic-billing-header` loses its first
/// line, and the part is dropped when nothing follows it.
fn strip_billing_header<T>(texts: &mut Vec<(Cow<'_, str>, T)>) {
    texts.retain_mut(|(t, _)| {
        if !t.starts_with("x-anthropic-billing-header") {
            return true;
        }
        *t = Cow::Owned(t.split_once('\n').map(|(_, rest)| rest.to_owned()).unwrap_or_default());
        !t.is_empty()
    });
}

/// A tool call with `function.arguments` as templates expect: an object
/// (parsed from its JSON string; empty, invalid or not an object gives `{}`).
fn parse_arguments(call: &Value) -> Result<Value, Declined> {
    let mut call = call.clone();
    if !call.get("function").is_some_and(Value::is_object) {
        return Err(Declined::Invalid("a tool call needs a function object".into()));
    }
    if let Some(function) = call.get_mut("function").and_then(Value::as_object_mut) {
        let parsed = match function.get("arguments") {
            Some(Value::Object(o)) => Value::Object(o.clone()),
            Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
                Ok(v @ Value::Object(_)) => v,
                _ => Value::Object(Map::new()),
            },
            _ => Value::Object(Map::new()),
        };
        function.insert("arguments".into(), parsed);
    }
    Ok(call)
}

/// Tools as vLLM dumps its pydantic models: `{type, function: {name,
/// description, parameters[, strict][, defer_loading]}}`, absent description
/// and parameters as null, unknown keys dropped.
fn tools(tools: Option<&Value>) -> Result<minijinja::Value, Declined> {
    let tools = match tools {
        None | Some(Value::Null) => return Ok(minijinja::Value::from(())),
        Some(Value::Array(t)) if t.is_empty() => return Err(Declined::Invalid("tools cannot be an empty list".into())),
        Some(Value::Array(t)) => t,
        Some(_) => return Err(Declined::Invalid("tools must be a list".into())),
    };
    let mut out = Vec::with_capacity(tools.len());
    for tool in tools {
        let Some(Value::Object(f)) = tool.get("function") else {
            return Err(Declined::Invalid("a tool needs a function".into()));
        };
        let mut function = Map::new();
        for key in ["name", "description", "parameters"] {
            function.insert(key.into(), f.get(key).cloned().unwrap_or(Value::Null));
        }
        for key in ["strict", "defer_loading"] {
            if let Some(v) = f.get(key).filter(|v| !v.is_null()) {
                function.insert(key.into(), v.clone());
            }
        }
        out.push(serde_json::json!({"type": "function", "function": function}));
    }
    Ok(template::value(&Value::Array(out)))
}

/// The message of a template error, without minijinja's source excerpt.
fn template_error(e: &minijinja::Error) -> String {
    e.detail().map_or_else(|| e.kind().to_string(), str::to_owned)
}

fn flag(body: &Map<String, Value>, key: &str) -> Result<Option<bool>, Declined> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(Declined::Invalid(format!("{key} must be a boolean"))),
    }
}

#[cfg(test)]
mod tests;
