//! `inferrail-sidecar`: a split request's two legs run in front of its
//! decode engine, as llm-d's routing sidecar runs them, for fleets whose
//! router names the prefill replica rather than running the leg itself
//! (`routing.prefill_legs: sidecar`).
//!
//! Every request goes on to the decode engine, streamed back as it
//! answers. A generation request that names its prefill replica in
//! `x-prefiller-host-port` first goes there as its prefill leg ([`legs`]'s
//! body, the same `x-request-id` and `Authorization`). The prefill replica
//! is asked again, up to [`TRIES`] times in all, while it answers 502, 503 or
//! 504 or not at all, as llm-d's sidecar does. Its `kv_transfer_params` then
//! go into the body the decode engine gets. A prefill that does not answer
//! leaves the body as the client sent it, so the decode engine computes the
//! request whole: no request is lost to a prefill replica.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::TryStreamExt;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::net::TcpListener;

use crate::decision::{PREFILLER, error_body};
use crate::legs;

/// Tries of a prefill replica that answers 502-504 or not at all.
pub const TRIES: usize = 3;

/// Largest request body read.
const MAX_BODY: usize = 64 << 20;

/// Headers not passed on: hop-by-hop ones, the length (the body may change)
/// and the prefill replica's name.
const DROPPED: [&str; 7] = ["host", "connection", "content-length", "transfer-encoding", "keep-alive", "upgrade", PREFILLER];

type Body = UnsyncBoxBody<Bytes, std::io::Error>;

/// The sidecar in front of one decode engine.
pub struct Sidecar {
    /// The decode engine's base URL, `http://host:port`.
    pub decoder: String,
    /// How long each prefill try may take.
    pub prefill_timeout: Duration,
    http: reqwest::Client,
}

impl Sidecar {
    /// A sidecar for the engine at `decoder`.
    pub fn new(decoder: String, prefill_timeout: Duration) -> Self {
        // Without TLS the builder cannot fail; a default client would do the same.
        let http = reqwest::Client::builder().pool_max_idle_per_host(64).build().unwrap_or_default();
        Self { decoder: decoder.trim_end_matches('/').to_owned(), prefill_timeout, http }
    }

    /// Serves connections on `listener` until the process ends.
    pub async fn serve(self: Arc<Self>, listener: TcpListener) -> std::io::Result<()> {
        loop {
            let (stream, _) = listener.accept().await?;
            let sidecar = self.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req| sidecar.clone().handle(req));
                if let Err(e) = http1::Builder::new().serve_connection(TokioIo::new(stream), service).await {
                    tracing::debug!(error = %e, "connection ended");
                }
            });
        }
    }

    async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
        let (parts, body) = req.into_parts();
        let body = match Limited::new(body, MAX_BODY).collect().await {
            Ok(b) => b.to_bytes(),
            Err(_) => return Ok(answer(StatusCode::BAD_REQUEST, "BadRequestError", "Could not read the request body.")),
        };
        let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        let header = |name: &str| parts.headers.get(name).and_then(|v| v.to_str().ok());
        let generation = matches!(parts.uri.path(), "/v1/chat/completions" | "/v1/completions");
        let body = match header(PREFILLER).filter(|_| generation) {
            Some(prefiller) => {
                let url = format!("http://{prefiller}{}", parts.uri.path());
                self.prefilled(&url, &body, header("x-request-id").unwrap_or_default(), header("authorization")).await.unwrap_or(body)
            }
            None => body,
        };
        let mut sent = self.http.request(parts.method.clone(), format!("{}{path}", self.decoder));
        for (name, value) in &parts.headers {
            if !DROPPED.contains(&name.as_str()) {
                sent = sent.header(name, value);
            }
        }
        let response = match sent.body(body).send().await {
            Ok(r) => r,
            Err(e) => return Ok(answer(StatusCode::BAD_GATEWAY, "BadGatewayError", &format!("The decode engine did not answer: {e}"))),
        };
        let mut out = Response::builder().status(response.status());
        for (name, value) in response.headers() {
            if !DROPPED.contains(&name.as_str()) {
                out = out.header(name, value);
            }
        }
        let frames = response.bytes_stream().map_ok(Frame::data).map_err(std::io::Error::other);
        Ok(out
            .body(BodyExt::boxed_unsync(StreamBody::new(frames)))
            .unwrap_or_else(|_| answer(StatusCode::BAD_GATEWAY, "BadGatewayError", "Bad answer headers.")))
    }

    /// Runs the prefill leg at `url`; the decode leg's body, or `None` when
    /// the prefill replica gave no `kv_transfer_params`.
    async fn prefilled(&self, url: &str, body: &[u8], request_id: &str, authorization: Option<&str>) -> Option<Bytes> {
        let Ok(Value::Object(client)) = serde_json::from_slice::<Value>(body) else { return None };
        let sent = serde_json::to_vec(&legs::prefill_body(&client)).ok()?;
        for _ in 0..TRIES {
            let answer = legs::ask(&self.http, url, sent.clone(), request_id, authorization, self.prefill_timeout).await;
            if let Some(params) = answer.params {
                return legs::decode_body(client, params).map(Bytes::from);
            }
            if !matches!(answer.status, None | Some(502..=504)) {
                break;
            }
        }
        tracing::warn!(url, "prefill leg failed: the decode engine computes the request whole");
        None
    }
}

/// The sidecar's own answer, in the OpenAI error shape.
fn answer(status: StatusCode, kind: &str, message: &str) -> Response<Body> {
    let body = error_body(status.as_u16(), kind, message, None);
    let mut r = Response::new(BodyExt::boxed_unsync(Full::new(Bytes::from(body)).map_err(|never| match never {})));
    *r.status_mut() = status;
    r.headers_mut().insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static("application/json"));
    r
}

/// Binds `listen` and serves the sidecar for the engine at `decoder`.
pub async fn run(listen: SocketAddr, decoder: String, prefill_timeout: Duration) -> anyhow::Result<()> {
    let listener = TcpListener::bind(listen).await?;
    println!("inferrail-sidecar on {}, in front of {decoder}", listener.local_addr()?);
    Arc::new(Sidecar::new(decoder, prefill_timeout)).serve(listener).await?;
    Ok(())
}
