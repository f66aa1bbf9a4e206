//! What the router reads of a request: method, path, request id, session
//! and trace context from the headers, then the few body fields routing needs. The body is otherwise
//! left byte for byte as the client sent it; only the model name may be
//! rewritten, in place, when the client used an alias or none.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::admission::Asked;
use crate::decision::BodyError;

/// A request id for a request that came without one.
pub fn new_request_id() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    format!("inferrail-{nanos:x}-{:x}", NEXT.fetch_add(1, Ordering::Relaxed))
}

/// The request line and the headers the router cares about.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Head {
    /// `:method`.
    pub method: String,
    /// `:path` without its query.
    pub path: String,
    /// `x-request-id`, as Envoy generated or passed it.
    pub request_id: Option<String>,
    /// `x-session-id`: the conversation the request belongs to.
    pub session: Option<String>,
    /// `traceparent`: the client's W3C trace context, continued by the decision's span.
    pub traceparent: Option<String>,
    /// Its key, band and tenant, as admission reads them.
    pub asked: Asked,
}

/// A header's value: Envoy sends it in `raw_value`, older versions in `value`.
pub fn header_value(hv: &HeaderValue) -> String {
    if hv.raw_value.is_empty() { hv.value.clone() } else { String::from_utf8_lossy(&hv.raw_value).into_owned() }
}

/// The value of header `key` (pseudo-headers included), if present.
pub fn header(headers: Option<&HeaderMap>, key: &str) -> Option<String> {
    headers?.headers.iter().find(|hv| hv.key == key).map(header_value)
}

/// Reads the head from Envoy's header map.
pub fn head(headers: Option<&HeaderMap>) -> Head {
    let all = headers.map(|m| m.headers.as_slice()).unwrap_or_default();
    head_of(all.iter().map(|hv| (hv.key.as_str(), header_value(hv))))
}

/// Reads the head from headers as (lowercase name, value) pairs, pseudo-headers included.
pub fn head_of<K: AsRef<str>>(headers: impl Iterator<Item = (K, String)>) -> Head {
    let mut h = Head::default();
    for (key, value) in headers {
        match key.as_ref() {
            ":method" => h.method = value,
            ":path" => h.path = value.split('?').next().unwrap_or_default().to_string(),
            "x-request-id" => h.request_id = Some(value),
            "x-session-id" => h.session = Some(value),
            "traceparent" => h.traceparent = Some(value),
            key => ask(&mut h.asked, key, value),
        }
    }
    h
}

/// What headers (lowercase names) ask of admission.
pub fn asked(headers: impl Iterator<Item = (String, String)>) -> Asked {
    let mut asked = Asked::default();
    for (key, value) in headers {
        ask(&mut asked, &key, value);
    }
    asked
}

fn ask(asked: &mut Asked, key: &str, value: String) {
    match key {
        "authorization" => asked.authorization = Some(value),
        "x-inferrail-band" => asked.band = Some(value),
        "x-inferrail-tenant" => asked.tenant = Some(value),
        "x-gateway-inference-objective" => asked.objective = Some(value),
        _ => {}
    }
}

/// What a request asks of the router.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/chat/completions` or `/v1/completions`: route it.
    Generate(inferrail_tokenize::chat::Endpoint),
    /// `GET /v1/models`: answered by the router.
    Models,
    /// `GET /health`: answered by the router.
    Health,
    /// A known path asked with the wrong method; the methods it takes.
    WrongMethod(&'static str),
    /// No such path.
    NotFound,
}

/// Dispatches on method and path.
pub fn endpoint(method: &str, path: &str) -> Endpoint {
    let (allowed, ok) = match path {
        "/v1/chat/completions" => ("POST", Endpoint::Generate(inferrail_tokenize::chat::Endpoint::Chat)),
        "/v1/completions" => ("POST", Endpoint::Generate(inferrail_tokenize::chat::Endpoint::Completions)),
        "/v1/models" => ("GET", Endpoint::Models),
        "/health" => ("GET", Endpoint::Health),
        _ => return Endpoint::NotFound,
    };
    if method == allowed { ok } else { Endpoint::WrongMethod(allowed) }
}

/// The body fields routing reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fields {
    /// The model asked for (`null` counts as none).
    pub model: Option<String>,
    /// Where the `model` value sits in the body, `null` included.
    pub model_at: Option<Range<usize>>,
    /// The body's `user`, when it is a string: names a conversation for session affinity.
    pub user: Option<String>,
}

/// A field's raw JSON when present, `null` included (an `Option` would
/// turn `null` into absent).
#[derive(Default)]
struct Present<'a>(Option<&'a RawValue>);

impl<'de: 'a, 'a> Deserialize<'de> for Present<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        <&'a RawValue>::deserialize(d).map(|raw| Present(Some(raw)))
    }
}

#[derive(Deserialize)]
struct Borrowed<'a> {
    #[serde(borrow, default)]
    model: Present<'a>,
    #[serde(borrow, default)]
    user: Present<'a>,
}

/// Parses the fields routing needs; the whole body must be valid JSON.
pub fn fields(body: &[u8]) -> Result<Fields, BodyError> {
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(BodyError::NotJson("expected an object".into()));
    }
    let parsed: Borrowed<'_> = serde_json::from_slice(body).map_err(|e| BodyError::NotJson(e.to_string()))?;
    let user = parsed.user.0.and_then(|raw| serde_json::from_str::<String>(raw.get()).ok());
    let Present(Some(raw)) = parsed.model else { return Ok(Fields { model: None, model_at: None, user }) };
    // The raw value borrows from `body`; its offset is where it sits.
    let start = raw.get().as_ptr() as usize - body.as_ptr() as usize;
    let model_at = Some(start..start + raw.get().len());
    let model = match raw.get() {
        "null" => None,
        text => Some(serde_json::from_str::<String>(text).map_err(|_| BodyError::ModelNotString)?),
    };
    Ok(Fields { model, model_at, user })
}

/// The body with the model set to `name`: the old value replaced in place,
/// or the field inserted first when there was none.
pub fn with_model(body: &[u8], at: Option<Range<usize>>, name: &str) -> Vec<u8> {
    let quoted = serde_json::Value::String(name.to_string()).to_string();
    let mut out = Vec::with_capacity(body.len() + quoted.len() + 10);
    match at {
        Some(range) => {
            out.extend_from_slice(&body[..range.start]);
            out.extend_from_slice(quoted.as_bytes());
            out.extend_from_slice(&body[range.end..]);
        }
        None => {
            let open = body.iter().position(|&b| b == b'{').unwrap_or(0);
            let empty = body[open + 1..].iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'}');
            out.extend_from_slice(&body[..=open]);
            out.extend_from_slice(b"\"model\":");
            out.extend_from_slice(quoted.as_bytes());
            if !empty {
                out.push(b',');
            }
            out.extend_from_slice(&body[open + 1..]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dispatch_by_method_and_path() {
        assert_eq!(endpoint("POST", "/v1/chat/completions"), Endpoint::Generate(inferrail_tokenize::chat::Endpoint::Chat));
        assert_eq!(endpoint("GET", "/v1/completions"), Endpoint::WrongMethod("POST"));
        assert_eq!(endpoint("GET", "/v1/models"), Endpoint::Models);
        assert_eq!(endpoint("POST", "/health"), Endpoint::WrongMethod("GET"));
        assert_eq!(endpoint("GET", "/tokenize"), Endpoint::NotFound);
    }

    #[test]
    fn the_model_is_found_where_it_sits() {
        let body = br#"{"messages": [], "model" : "sim", "stream": true}"#;
        let f = fields(body).unwrap();
        assert_eq!(f.model.as_deref(), Some("sim"));
        let at = f.model_at.unwrap();
        assert_eq!(&body[at.clone()], br#""sim""#);
        let rewritten = with_model(body, Some(at), "inferrail/sim-8b");
        assert_eq!(rewritten, br#"{"messages": [], "model" : "inferrail/sim-8b", "stream": true}"#);
    }

    #[test]
    fn a_missing_model_is_inserted_first() {
        assert_eq!(with_model(br#" {"prompt": "x"}"#, None, "m"), br#" {"model":"m","prompt": "x"}"#);
        assert_eq!(with_model(b"{ }", None, "m"), br#"{"model":"m" }"#);
        let null = fields(br#"{"model": null}"#).unwrap();
        assert_eq!((null.model, null.model_at), (None, Some(10..14)));
    }

    #[test]
    fn bad_bodies_are_refused() {
        assert!(matches!(fields(b"{\"model\": "), Err(BodyError::NotJson(_))));
        assert!(matches!(fields(b"[1]"), Err(BodyError::NotJson(_))));
        assert_eq!(fields(br#"{"model": 5}"#), Err(BodyError::ModelNotString));
        assert!(matches!(fields(br#"{"model": "a", "model": "b"}"#), Err(BodyError::NotJson(_))));
    }
}
