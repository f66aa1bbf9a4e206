//! The engine over HTTP: its model card, its metrics page, and one-token completions.
//!
//! Only what calibration needs of vLLM's OpenAI-compatible API: `GET
//! /v1/models` for the served name and `max_model_len`, `GET /metrics`, and
//! `POST /v1/completions` with the prompt as token ids and `max_tokens: 1`, so
//! the prompt's length is exact and the request ends at its first token.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::scrape::Counters;

/// Why the engine could not be used.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The request did not complete.
    #[error("{what}: {source}")]
    Http {
        /// The request.
        what: String,
        /// The transport's error.
        #[source]
        source: reqwest::Error,
    },
    /// The engine answered with an error status.
    #[error("{what}: HTTP {status}: {body}")]
    Status {
        /// The request.
        what: String,
        /// The status.
        status: u16,
        /// The start of the body.
        body: String,
    },
    /// The engine answered something calibration cannot read.
    #[error("{what}: {problem}")]
    Unreadable {
        /// The request.
        what: String,
        /// What is missing or wrong.
        problem: String,
    },
    /// `--model` names a model the engine does not serve.
    #[error("the engine serves {served:?}, not {wanted:?}")]
    UnknownModel {
        /// The requested name.
        wanted: String,
        /// What `/v1/models` lists.
        served: Vec<String>,
    },
}

/// What a one-token completion reported.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Completion {
    /// `usage.prompt_tokens`.
    pub prompt_tokens: usize,
    /// `usage.prompt_tokens_details.cached_tokens`, when the engine reports it.
    pub cached_tokens: Option<usize>,
    /// From sending the request to reading the whole response, seconds.
    pub client_secs: f64,
}

/// A connection to one engine and the model calibrated on it.
#[derive(Debug, Clone)]
pub struct Engine {
    http: reqwest::Client,
    base: String,
    /// The served model name the probes use.
    pub model: String,
    /// The engine's context length, tokens.
    pub max_model_len: usize,
}

impl Engine {
    /// Reads the model card at `url`; `model` picks one when several are served.
    pub async fn connect(url: &str, model: Option<&str>, timeout: Duration) -> Result<Self, EngineError> {
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .build()
            .map_err(|source| EngineError::Http { what: "building the HTTP client".into(), source })?;
        let base = url.trim_end_matches('/').to_string();
        let what = format!("GET {base}/v1/models");
        let card: Value = read_json(http.get(format!("{base}/v1/models")), &what).await?.0;
        let data = card.get("data").and_then(Value::as_array).cloned().unwrap_or_default();
        let served: Vec<String> = data.iter().filter_map(|m| m.get("id").and_then(Value::as_str).map(str::to_string)).collect();
        let entry = match model {
            Some(wanted) => data.iter().find(|m| m.get("id").and_then(Value::as_str) == Some(wanted)),
            None => data.first(),
        };
        let Some(entry) = entry else {
            return match model {
                Some(wanted) => Err(EngineError::UnknownModel { wanted: wanted.into(), served }),
                None => Err(EngineError::Unreadable { what, problem: "no model is listed".into() }),
            };
        };
        let name = entry.get("id").and_then(Value::as_str).unwrap_or_default().to_string();
        let Some(max_model_len) = entry.get("max_model_len").and_then(Value::as_u64).and_then(|v| usize::try_from(v).ok()) else {
            return Err(EngineError::Unreadable { what, problem: format!("model {name:?} has no max_model_len") });
        };
        Ok(Self { http, base, model: name, max_model_len })
    }

    /// The base URL.
    pub fn url(&self) -> &str {
        &self.base
    }

    /// Reads `/metrics`.
    pub async fn scrape(&self) -> Result<Counters, EngineError> {
        let what = format!("GET {}/metrics", self.base);
        let resp = self
            .http
            .get(format!("{}/metrics", self.base))
            .send()
            .await
            .map_err(|source| EngineError::Http { what: what.clone(), source })?;
        let status = resp.status().as_u16();
        let body = resp.text().await.map_err(|source| EngineError::Http { what: what.clone(), source })?;
        if status != 200 {
            return Err(EngineError::Status { what, status, body: head(&body) });
        }
        Ok(Counters::parse(&body))
    }

    /// Sends `prompt` as token ids for one generated token and waits for the answer.
    pub async fn complete(&self, prompt: &[u32]) -> Result<Completion, EngineError> {
        let what = format!("POST {}/v1/completions ({} prompt tokens)", self.base, prompt.len());
        let body = json!({
            "model": self.model,
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0.0,
            "stream": false,
        });
        let (answer, client_secs) = read_json(self.http.post(format!("{}/v1/completions", self.base)).json(&body), &what).await?;
        let usage = answer.get("usage");
        let count = |v: Option<&Value>| v.and_then(Value::as_u64).and_then(|v| usize::try_from(v).ok());
        let Some(prompt_tokens) = count(usage.and_then(|u| u.get("prompt_tokens"))) else {
            return Err(EngineError::Unreadable { what, problem: "no usage.prompt_tokens".into() });
        };
        let cached_tokens = count(usage.and_then(|u| u.get("prompt_tokens_details")).and_then(|d| d.get("cached_tokens")));
        Ok(Completion { prompt_tokens, cached_tokens, client_secs })
    }
}

/// Sends a request and reads a JSON answer, timing it.
async fn read_json(req: reqwest::RequestBuilder, what: &str) -> Result<(Value, f64), EngineError> {
    let start = Instant::now();
    let resp = req.send().await.map_err(|source| EngineError::Http { what: what.into(), source })?;
    let status = resp.status().as_u16();
    let body = resp.text().await.map_err(|source| EngineError::Http { what: what.into(), source })?;
    let secs = start.elapsed().as_secs_f64();
    if status != 200 {
        return Err(EngineError::Status { what: what.into(), status, body: head(&body) });
    }
    let value =
        serde_json::from_str(&body).map_err(|e| EngineError::Unreadable { what: what.into(), problem: format!("not JSON: {e}") })?;
    Ok((value, secs))
}

/// The first 300 characters of a body, for error messages.
fn head(body: &str) -> String {
    body.chars().take(300).collect()
}
