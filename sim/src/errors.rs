//! Error bodies exactly as vLLM's OpenAI server writes them.
//!
//! Three shapes exist: the OpenAI error object for errors vLLM raises itself,
//! the same object carrying a pydantic-style message for request validation,
//! and FastAPI's `{"detail": ...}` for unknown routes and wrong methods.

use serde_json::{Value, json};

/// An HTTP error answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: u16,
    /// JSON body.
    pub body: String,
    /// Methods a 405 lists in `Allow`.
    pub allow: Option<&'static str>,
}

impl ApiError {
    /// The OpenAI error object.
    pub fn openai(status: u16, kind: &str, message: &str, param: Option<&str>) -> Self {
        let body = json!({"error": {"message": message, "type": kind, "param": param, "code": status}});
        Self { status, body: body.to_string(), allow: None }
    }

    /// A 400 `BadRequestError` about one parameter.
    pub fn bad_request(message: &str, param: Option<&str>) -> Self {
        Self::openai(400, "BadRequestError", message, param)
    }

    /// A parameter the simulator does not model: refused rather than silently ignored.
    pub fn unsupported(param: &str, value: &Value) -> Self {
        let message = format!(
            "{param}={} is not supported by this simulated engine. (parameter={param}, value={})",
            py_value(value),
            py_value(value)
        );
        Self::bad_request(&message, Some(param))
    }

    /// A 404 for a model this server does not serve.
    pub fn unknown_model(name: &str, served: &[String]) -> Self {
        let message = format!("The model `{name}` does not exist. Valid aliases: {}.", served.join(", "));
        Self::openai(404, "NotFoundError", &message, Some("model"))
    }

    /// A 400 in pydantic's validation error format, `loc` joined with dots.
    pub fn validation(kind: &str, loc: &str, msg: &str, input: &Value, ctx: Option<&str>) -> Self {
        let ctx = ctx.map(|e| format!(", 'ctx': {{'error': {}}}", py_str(e))).unwrap_or_default();
        let message = format!(
            "1 validation error:\n  {{'type': '{kind}', 'loc': '{loc}', 'msg': {}, 'input': {}{ctx}}}",
            py_str(msg),
            summary(input)
        );
        Self::openai(400, "Bad Request", &message, Some(loc))
    }

    /// FastAPI's answer for a path no route serves.
    pub fn no_route() -> Self {
        Self { status: 404, body: r#"{"detail":"Not Found"}"#.into(), allow: None }
    }

    /// FastAPI's answer for a route asked with a method it does not take.
    pub fn wrong_method(allow: &'static str) -> Self {
        Self { status: 405, body: r#"{"detail":"Method Not Allowed"}"#.into(), allow: Some(allow) }
    }
}

/// How vLLM's error formatter shows an input: containers by their size, other values by `repr`.
fn summary(v: &Value) -> String {
    match v {
        Value::Object(m) => format!("'<dict of {} items>'", m.len()),
        Value::Array(a) => format!("'<list of {} items>'", a.len()),
        other => py_value(other),
    }
}

/// Python's `repr` of a JSON scalar.
fn py_value(v: &Value) -> String {
    let mut out = String::new();
    inferrail_tokenize::python::py_repr(&mut out, &inferrail_tokenize::template::value(v));
    out
}

/// Python's `repr` of a string.
fn py_str(s: &str) -> String {
    py_value(&Value::String(s.to_owned()))
}

/// The message Python's `json` module gives for what `serde_json` rejected,
/// and the character offset it reports.
pub fn json_error(body: &[u8], err: &serde_json::Error) -> ApiError {
    let text = String::from_utf8_lossy(body);
    // serde_json counts lines and columns from 1; its column points at the
    // offending character, Python's offset at the same character from 0.
    let offset: usize = text.split_inclusive('\n').take(err.line().saturating_sub(1)).map(|l| l.chars().count()).sum::<usize>()
        + err.column().saturating_sub(1);
    let msg = err.to_string();
    let python = if err.is_eof() && text.trim().is_empty() || msg.starts_with("expected value") {
        "Expecting value"
    } else if msg.starts_with("key must be a string") {
        "Expecting property name enclosed in double quotes"
    } else if msg.starts_with("expected `:`") {
        "Expecting ':' delimiter"
    } else if msg.starts_with("expected `,` or `}`") || msg.starts_with("expected `,` or `]`") {
        "Expecting ',' delimiter"
    } else if msg.starts_with("trailing characters") {
        "Extra data"
    } else if msg.starts_with("control character") || msg.starts_with("EOF while parsing a string") {
        "Unterminated string starting at"
    } else if msg.starts_with("invalid escape") || msg.starts_with("invalid unicode") {
        "Invalid \\escape"
    } else {
        "Expecting value"
    };
    ApiError::validation("json_invalid", &format!("body.{offset}"), "JSON decode error", &json!({}), Some(python))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_model_matches_vllm_bytes() {
        let e = ApiError::unknown_model("nope", &["tiny-qwen3".into()]);
        assert_eq!(e.status, 404);
        assert_eq!(
            e.body,
            r#"{"error":{"message":"The model `nope` does not exist. Valid aliases: tiny-qwen3.","type":"NotFoundError","param":"model","code":404}}"#
        );
    }

    #[test]
    fn missing_field_matches_vllm_bytes() {
        let e = ApiError::validation("missing", "body.messages", "Field required", &json!({"model": "x"}), None);
        assert_eq!(
            e.body,
            r#"{"error":{"message":"1 validation error:\n  {'type': 'missing', 'loc': 'body.messages', 'msg': 'Field required', 'input': '<dict of 1 items>'}","type":"Bad Request","param":"body.messages","code":400}}"#
        );
    }

    #[test]
    fn python_strings_are_quoted_like_repr() {
        assert_eq!(py_str("a'b"), "\"a'b\"");
        assert_eq!(py_str("x\ny"), "'x\\ny'");
    }
}
