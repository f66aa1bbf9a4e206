//! What a response tells the router, whatever carries it to the router (an
//! ext_proc stream, or Envoy's own filter callbacks in the dynamic module):
//! the status and the replica that served, the first byte once, the usage in
//! the response's last bytes, and its end, as lifecycle events for
//! [`crate::router::Router::hear`].

use std::net::SocketAddr;

use inferrail_route::lifecycle::{Event, Usage};
use serde::Deserialize;

use crate::router::Router;

/// How much of the response's end is kept to read its usage from.
const TAIL: usize = 8 << 10;

/// What a response has shown so far.
#[derive(Default)]
pub struct Phase {
    first_byte: bool,
    tail: Tail,
}

impl Phase {
    /// The response headers: `status` is their `:status`, `served` the
    /// upstream host that answered (`ip:port`) when known.
    pub fn headers(&mut self, router: &Router, status: Option<&str>, served: Option<&str>, end_of_stream: bool, events: &mut Vec<Event>) {
        events.extend(status_event(router, status, served));
        if end_of_stream {
            self.first_byte(events);
            events.push(Event::End);
        }
    }

    /// A chunk of the response body, the last one with `end_of_stream`.
    pub fn body(&mut self, chunk: &[u8], end_of_stream: bool, events: &mut Vec<Event>) {
        self.first_byte(events);
        self.tail.keep(chunk);
        if end_of_stream {
            events.extend(self.tail.usage().map(Event::Usage));
            events.push(Event::End);
        }
    }

    /// The response trailers, which end it.
    pub fn trailers(&mut self, events: &mut Vec<Event>) {
        events.extend(self.tail.usage().map(Event::Usage));
        events.push(Event::End);
    }

    /// The first byte, told once.
    fn first_byte(&mut self, events: &mut Vec<Event>) {
        if !std::mem::replace(&mut self.first_byte, true) {
            events.push(Event::FirstByte);
        }
    }
}

/// The status a response's `:status` tells, from the replica at `served`
/// (`ip:port`) when known. A `:status` that is missing or not a number
/// from 100 to 999 is no answer: `None`, counted by reason in
/// `inferrail_bad_events_total`.
pub fn status_event(router: &Router, status: Option<&str>, served: Option<&str>) -> Option<Event> {
    let Some(text) = status else {
        metrics::counter!("inferrail_bad_events_total", "source" => "envoy", "reason" => "no_status").increment(1);
        return None;
    };
    let Some(code) = text.trim().parse::<u16>().ok().filter(|c| (100..=999).contains(c)) else {
        metrics::counter!("inferrail_bad_events_total", "source" => "envoy", "reason" => "bad_status").increment(1);
        tracing::debug!(status = text, "a response status that is not an HTTP status");
        return None;
    };
    Some(Event::Status { code, served_by: served.and_then(|a| served_by(router, a)) })
}

/// The replica at `addr` (`ip:port`, as Envoy names an upstream host), by its key.
fn served_by(router: &Router, addr: &str) -> Option<u64> {
    let addr: SocketAddr = addr.parse().ok()?;
    router.fleet().replicas.iter().find(|r| r.addr == addr).map(|r| r.key)
}

/// A response's last bytes, kept to read its usage from.
#[derive(Default)]
pub struct Tail(Vec<u8>);

impl Tail {
    /// Keeps the last [`TAIL`] bytes (or up to twice that) of what came so far, with `chunk`.
    pub fn keep(&mut self, chunk: &[u8]) {
        self.0.extend_from_slice(&chunk[chunk.len().saturating_sub(TAIL)..]);
        if self.0.len() > 2 * TAIL {
            self.0.drain(..self.0.len() - TAIL);
        }
    }

    /// The usage the response ended with, if it reported one.
    pub fn usage(&self) -> Option<Usage> {
        usage(&self.0)
    }
}

#[derive(Deserialize)]
struct UsageJson {
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
    prompt_tokens_details: Option<Details>,
}

#[derive(Deserialize)]
struct Details {
    #[serde(default)]
    cached_tokens: u64,
}

/// The last `usage` object in a response's final bytes: an SSE stream's
/// last chunk with usage, or a whole JSON answer's.
pub fn usage(tail: &[u8]) -> Option<Usage> {
    const KEY: &[u8] = b"\"usage\"";
    let at = tail.windows(KEY.len()).rposition(|w| w == KEY)? + KEY.len();
    let rest = &tail[at..];
    let colon = rest.iter().position(|&b| !b.is_ascii_whitespace()).filter(|&i| rest[i] == b':')?;
    let mut values = serde_json::Deserializer::from_slice(&rest[colon + 1..]).into_iter::<Option<UsageJson>>();
    let u = values.next()?.ok()??;
    let cached_tokens = u.prompt_tokens_details.map_or(0, |d| d.cached_tokens);
    Some(Usage { prompt_tokens: u.prompt_tokens, cached_tokens, completion_tokens: u.completion_tokens })
}
