//! A split request's prefill leg, run by the router itself, for plain Envoy
//! and gateways without a sidecar in front of the decode engines.
//!
//! The prefill replica gets the request as vLLM's disaggregated proxies
//! send it: not streamed, one output token (`max_completion_tokens` too when
//! the client set it), no `stream_options` or `min_tokens`, and
//! `kv_transfer_params` asking for a remote decode, under the request's own
//! `x-request-id`. Its answer's top-level `kv_transfer_params` go, unchanged,
//! into the body the decode replica gets, which the decision names.
//!
//! What happens to the leg is heard under its own id (`prefill_id`), so its
//! lease, KV record, health and outcome are the ledger's, as any request's:
//! its status (from the replica that answered: a fallback's moves the
//! lease) and its first byte here; its end when the decode leg answers (the
//! prefill replica keeps the blocks until the decoder has read them). A prefill replica that cannot be
//! reached, times out or answers without `kv_transfer_params` is followed by
//! the leg's fallbacks; when none answers, the request runs whole on its
//! decode replica, which computes the prompt itself.

use std::time::Duration;

use inferrail_route::lifecycle::Event;
use serde_json::{Map, Value, json};

use crate::decision::Decision;
use crate::request::Head;
use crate::router::Router;

/// What became of a prefill leg.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// A prefill replica answered; the decode replica reads its blocks.
    Split,
    /// None did; the decode replica runs the request whole.
    Whole,
}

impl Outcome {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Split => "split",
            Outcome::Whole => "whole",
        }
    }
}

/// The prefill leg's body, from the client's.
pub fn prefill_body(client: &Map<String, Value>) -> Map<String, Value> {
    let mut p = client.clone();
    p.insert("stream".into(), json!(false));
    p.insert("max_tokens".into(), json!(1));
    if p.contains_key("max_completion_tokens") {
        p.insert("max_completion_tokens".into(), json!(1));
    }
    for gone in ["stream_options", "min_tokens", "min_completion_tokens"] {
        p.remove(gone);
    }
    p.insert(
        "kv_transfer_params".into(),
        json!({
            "do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
            "remote_block_ids": null, "remote_host": null, "remote_port": null,
        }),
    );
    p
}

/// Runs `d`'s prefill leg, if it has one, for the request `head` and
/// `body` (the client's): on success the decision's body is the decode
/// leg's; else the leg is dropped and the request runs whole. Returns what
/// became of it.
pub async fn run(router: &Router, http: &reqwest::Client, d: &mut Decision, body: &[u8], head: &Head) -> Option<Outcome> {
    let leg = d.prefill.as_ref().filter(|leg| !leg.sidecar)?.request_id.clone();
    let outcome = match prefill(router, http, d, body, head).await {
        Some((decode, served)) => {
            d.body = Some(decode);
            if let Some(leg) = d.prefill.as_mut() {
                // The replica that answered comes first: the one the response names.
                leg.targets.drain(..served);
                leg.cached_tokens.drain(..served.min(leg.cached_tokens.len()));
            }
            Outcome::Split
        }
        None => {
            d.prefill = None;
            Outcome::Whole
        }
    };
    if outcome == Outcome::Whole {
        router.hear(&leg, Event::End);
    }
    metrics::counter!("inferrail_prefill_legs_total", "outcome" => outcome.label()).increment(1);
    Some(outcome)
}

/// Asks each of the leg's replicas in turn, with the client's
/// `Authorization` (the decoder gets it too); returns the decode leg's body
/// once one answers with its `kv_transfer_params`, and which one did.
async fn prefill(router: &Router, http: &reqwest::Client, d: &Decision, body: &[u8], head: &Head) -> Option<(Vec<u8>, usize)> {
    let leg = d.prefill.as_ref()?;
    let Ok(Value::Object(client)) = serde_json::from_slice::<Value>(d.body.as_deref().unwrap_or(body)) else { return None };
    let sent = serde_json::to_vec(&prefill_body(&client)).ok()?;
    let timeout = Duration::from_millis(router.config().retry.prefill_timeout_ms);
    for (i, target) in leg.targets.iter().enumerate() {
        let url = format!("http://{}{}", target.addr, head.path);
        let answer = ask(http, &url, sent.clone(), &d.request_id, head.asked.authorization.as_deref(), timeout).await;
        if let Some(code) = answer.status {
            router.hear(&leg.request_id, Event::Status { code, served_by: Some(target.key) });
            router.hear(&leg.request_id, Event::FirstByte);
        }
        let Some(params) = answer.params else {
            tracing::warn!(replica = %target.id, status = ?answer.status, "prefill leg: no kv_transfer_params from the prefill replica");
            let reason = if answer.status.is_some() { "answer" } else { "no_answer" };
            metrics::counter!("inferrail_prefill_leg_failures_total", "reason" => reason).increment(1);
            continue;
        };
        return decode_body(client, params).map(|b| (b, i));
    }
    None
}

/// The decode leg's body: the client's, with the prefill's `kv_transfer_params`.
pub fn decode_body(mut client: Map<String, Value>, params: Value) -> Option<Vec<u8>> {
    client.insert("kv_transfer_params".into(), params);
    serde_json::to_vec(&client).ok()
}

/// What a prefill replica answered a leg: its status, when it answered,
/// and its `kv_transfer_params`, when it answered them with a success.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    /// The HTTP status, if an answer came.
    pub status: Option<u16>,
    /// The top-level `kv_transfer_params` of a successful answer.
    pub params: Option<Value>,
}

/// Sends a prefill leg's `body` to `url` under `request_id`, with the
/// client's `authorization`, waiting up to `timeout` for the whole answer.
pub async fn ask(
    http: &reqwest::Client,
    url: &str,
    body: Vec<u8>,
    request_id: &str,
    authorization: Option<&str>,
    timeout: Duration,
) -> Answer {
    let mut asked = http.post(url).header("content-type", "application/json").header("x-request-id", request_id);
    if let Some(a) = authorization {
        asked = asked.header("authorization", a);
    }
    let response = match asked.timeout(timeout).body(body).send().await {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(url, error = %e, "prefill leg: no answer");
            return Answer { status: None, params: None };
        }
    };
    let status = response.status();
    let params = match response.bytes().await {
        Ok(b) if status.is_success() => serde_json::from_slice::<Value>(&b).ok().and_then(|mut v| {
            let p = v.get_mut("kv_transfer_params")?.take();
            p.is_object().then_some(p)
        }),
        _ => None,
    };
    Answer { status: Some(status.as_u16()), params }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefill_body_is_the_clients_for_one_token_unstreamed_asking_for_a_remote_decode() {
        let client = json!({"model": "m", "messages": [], "stream": true, "stream_options": {"include_usage": true}, "max_tokens": 99, "max_completion_tokens": 99, "min_tokens": 5, "temperature": 0.5});
        let Value::Object(client) = client else { unreachable!() };
        let p = Value::Object(prefill_body(&client));
        assert_eq!(
            p,
            json!({"model": "m", "messages": [], "stream": false, "max_tokens": 1, "max_completion_tokens": 1, "temperature": 0.5,
                "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null}})
        );
        let Value::Object(plain) = json!({"model": "m", "prompt": "x"}) else { unreachable!() };
        assert!(!prefill_body(&plain).contains_key("max_completion_tokens"), "set only when the client set it");
    }
}
