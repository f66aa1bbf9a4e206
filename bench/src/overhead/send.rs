//! The two ways the ladder sends: open loop (requests leave on a Poisson
//! schedule whatever earlier ones are doing; latency counts from the
//! scheduled time) and closed loop (each of N clients sends its next
//! request when the last one's answer is over; TTFT counts from the send).

use std::collections::BTreeMap;
use std::time::Duration;

use futures_util::StreamExt;
use tokio::time::Instant;

use crate::harness::REPLICA_HEADER;

/// The router's response header with the prompt tokens it counted.
const PROMPT_TOKENS_HEADER: &str = "x-inferrail-prompt-tokens";

/// What requests through one rung measured.
#[derive(Debug, Default)]
pub struct Sample {
    /// Measured latencies: to the last byte (open loop) or first byte (closed loop).
    pub latency: Vec<Duration>,
    /// How late open-loop requests left against their schedule.
    pub lag: Vec<Duration>,
    /// Measured requests that failed or were not 2xx, by kind (`status 503`, `send timeout`, `body`).
    pub failures: BTreeMap<String, usize>,
    /// Every request sent, warmup included: what the CPU time is divided by.
    pub sent: usize,
    /// Measured requests answered with a replica named by inferrail.
    pub named: usize,
    /// Prompt tokens inferrail counted, per answered request that says.
    pub prompt_tokens: Vec<u64>,
}

impl Sample {
    /// A measured request failed for `kind`.
    fn fail(&mut self, kind: String) {
        *self.failures.entry(kind).or_default() += 1;
    }

    /// Measured requests that failed.
    pub fn errors(&self) -> usize {
        self.failures.values().sum()
    }

    /// Adds `other`'s requests to these.
    pub fn merge(&mut self, other: Sample) {
        self.latency.extend(other.latency);
        self.lag.extend(other.lag);
        self.prompt_tokens.extend(other.prompt_tokens);
        for (kind, n) in other.failures {
            *self.failures.entry(kind).or_default() += n;
        }
        (self.sent, self.named) = (self.sent + other.sent, self.named + other.named);
    }
}

/// A sent request's response when it is a 2xx, else the kind of failure:
/// its status, or why it could not be sent (timed out, no connection).
fn answered(sent: reqwest::Result<reqwest::Response>) -> Result<reqwest::Response, String> {
    match sent {
        Ok(r) if r.status().is_success() => Ok(r),
        Ok(r) => Err(format!("status {}", r.status().as_u16())),
        Err(e) if e.is_timeout() => Err("send timeout".into()),
        Err(e) if e.is_connect() => Err("send connect".into()),
        Err(_) => Err("send".into()),
    }
}

/// One response's headers that the ladder reads.
fn read_headers(r: &reqwest::Response, sample: &mut Sample) {
    if r.headers().contains_key(REPLICA_HEADER) {
        sample.named += 1;
    }
    if let Some(n) = r.headers().get(PROMPT_TOKENS_HEADER).and_then(|v| v.to_str().ok()).and_then(|v| v.trim().parse().ok()) {
        sample.prompt_tokens.push(n);
    }
}

/// Sends `bodies[i]` at `offsets[i]` from now to `urls[i % urls.len()]`
/// (`/v1/chat/completions`); those at or after `warmup` are measured.
pub async fn open_loop(
    http: &reqwest::Client,
    urls: &[String],
    bodies: &[Vec<u8>],
    offsets: &[Duration],
    warmup: Duration,
    out: &mut Sample,
) -> anyhow::Result<()> {
    anyhow::ensure!(!urls.is_empty() && bodies.len() == offsets.len(), "one body per send time, and somewhere to send them");
    let start = Instant::now() + Duration::from_millis(50);
    let tasks: Vec<_> = offsets
        .iter()
        .zip(bodies)
        .enumerate()
        .map(|(i, (&offset, body))| {
            let request = http.post(format!("{}/v1/chat/completions", urls[i % urls.len()])).header("content-type", "application/json");
            let request = request.body(body.clone());
            let at = start + offset;
            tokio::spawn(async move {
                tokio::time::sleep_until(at).await;
                let lag = at.elapsed();
                let answer = async {
                    let r = answered(request.send().await)?;
                    let mut headers = Sample::default();
                    read_headers(&r, &mut headers);
                    r.bytes().await.map(|_| headers).map_err(|_| "body".to_string())
                }
                .await;
                (offset >= warmup, answer, at.elapsed(), lag)
            })
        })
        .collect();
    out.sent += tasks.len();
    for t in tasks {
        let (measured, answer, took, lag) = t.await?;
        if !measured {
            continue;
        }
        match answer {
            Ok(headers) => {
                out.latency.push(took);
                out.lag.push(lag);
                out.named += headers.named;
                out.prompt_tokens.extend(headers.prompt_tokens);
            }
            Err(kind) => out.fail(kind),
        }
    }
    Ok(())
}

/// `clients` clients, each sending streaming requests to `url` one after
/// another for `secs` seconds: request `n` of client `c` is `body(c, n)`.
/// Time to the first body byte is measured for every request.
pub async fn closed_loop(
    http: &reqwest::Client,
    url: &str,
    clients: usize,
    secs: f64,
    body: std::sync::Arc<dyn Fn(usize, usize) -> Vec<u8> + Send + Sync>,
    out: &mut Sample,
) -> anyhow::Result<()> {
    let end = Instant::now() + Duration::from_secs_f64(secs);
    let url = format!("{url}/v1/chat/completions");
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let (http, url, body) = (http.clone(), url.clone(), body.clone());
            tokio::spawn(async move {
                let mut sample = Sample::default();
                for n in 0.. {
                    if Instant::now() >= end {
                        break;
                    }
                    // Made before the clock starts: the client's own work is not the router's.
                    let request = http.post(&url).header("content-type", "application/json").body(body(c, n));
                    let sent = Instant::now();
                    sample.sent += 1;
                    match first_byte(request, &mut sample).await {
                        Ok(ttft) => sample.latency.push(ttft - sent),
                        Err(kind) => sample.fail(kind),
                    }
                }
                sample
            })
        })
        .collect();
    for t in tasks {
        out.merge(t.await?);
    }
    Ok(())
}

/// Sends `request`, returns when its first body byte came, and reads the
/// rest; the kind of failure when it failed anywhere.
async fn first_byte(request: reqwest::RequestBuilder, sample: &mut Sample) -> Result<Instant, String> {
    let r = answered(request.send().await)?;
    read_headers(&r, sample);
    let mut body = r.bytes_stream();
    let first = loop {
        match body.next().await {
            Some(Ok(chunk)) if chunk.is_empty() => continue,
            Some(Ok(_)) => break Instant::now(),
            _ => return Err("body".into()),
        }
    };
    while let Some(chunk) = body.next().await {
        chunk.map_err(|_| "body".to_string())?;
    }
    Ok(first)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A server answering every request 503, and a port with nothing behind it.
    async fn failing() -> (String, String) {
        let server = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let busy = format!("http://{}", server.local_addr().unwrap());
        tokio::spawn(async move {
            while let Ok((mut s, _)) = server.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    let _ = s.read(&mut buf).await;
                    let _ = s.write_all(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n").await;
                });
            }
        });
        let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let dead = format!("http://{}", closed.local_addr().unwrap());
        drop(closed);
        (busy, dead)
    }

    #[tokio::test]
    async fn failures_are_counted_by_kind_and_merged() {
        let (busy, dead) = failing().await;
        let http = reqwest::Client::new();
        let mut out = Sample::default();
        let offsets = vec![Duration::ZERO; 4];
        open_loop(&http, &[busy, dead], &vec![b"{}".to_vec(); 4], &offsets, Duration::ZERO, &mut out).await.unwrap();
        let expected = BTreeMap::from([("send connect".to_string(), 2), ("status 503".to_string(), 2)]);
        assert_eq!(out.failures, expected);
        assert_eq!((out.errors(), out.latency.len(), out.sent), (4, 0, 4));
        let mut all = Sample::default();
        all.merge(out);
        all.merge(Sample { failures: BTreeMap::from([("body".to_string(), 1)]), ..Sample::default() });
        assert_eq!(all.errors(), 5);
        assert_eq!(all.failures["status 503"], 2);
    }
}
