//! One HTTP request inside Envoy, top to bottom, in safe code: the headers
//! read (and the router's own answers given), the body buffered to its end,
//! the decision asked of the same [`Front`] the ext_proc streams use, and
//! the winner and fallbacks named to Envoy's override-host balancer; then
//! the response heard in-process (status and who served, first byte, a
//! limited tenant's usage, end) as the router's lifecycle events.
//!
//! The decision runs on the Envoy worker that holds the stream, polled once
//! inline in the router runtime's context: a small prompt is tokenized and
//! placed without leaving the worker. A decision that must wait (a queue in
//! admission, a large body on the tokenizer workers, a prefill leg) goes on
//! as a task on the router's runtime, and the stream stays paused until the
//! task asks Envoy, through the stream's [`Scheduler`], to resume it on its
//! worker. A client that leaves meanwhile cancels the task, which takes the
//! request out of its queue; a decision that misses its deadline lets the
//! request go on unrouted ([`crate::wait`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use inferrail::decision::Answer;
use inferrail::front::Front;
use inferrail::request::{self, Head};
use inferrail::response::Phase;
use inferrail_route::lifecycle::Event;
use inferrail_tokenize::chat::Endpoint as Generation;

use crate::abi::Stream;
pub use crate::process::Shared;
use crate::wait::{Decided, Slot, Taken, gone};

/// What the request-headers hook tells Envoy (`on_http_filter_request_headers_status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Headers {
    /// Go on.
    Continue = 0,
    /// Hold the headers; the body still comes.
    StopIteration = 1,
}

/// What a body hook tells Envoy (`on_http_filter_{request,response}_body_status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Body {
    /// Go on.
    Continue = 0,
    /// Keep buffering the body and hold the request.
    StopIterationAndBuffer = 1,
    /// Hold the request without buffering: it was answered locally.
    StopIterationNoBuffer = 3,
}

/// What the request-trailers hook tells Envoy (`on_http_filter_request_trailers_status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Trailers {
    /// Go on.
    Continue = 0,
    /// Hold the request.
    StopIteration = 1,
}

/// What becomes of a request once its decision was asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Next {
    /// Routed (or let through): it goes on now.
    Go,
    /// Its decision goes on on the router's runtime; the stream is paused.
    Wait,
    /// The router answered it locally.
    Answered,
}

/// A decision left running on the router's runtime.
struct Waiting {
    slot: Arc<Slot>,
    task: tokio::task::AbortHandle,
}

/// A request read up to its body.
struct Asking {
    head: Head,
    generation: Generation,
    request_id: String,
}

/// One request's filter.
pub struct Filter {
    shared: Shared,
    asking: Option<Asking>,
    waiting: Option<Waiting>,
    /// The id the router knows the request by, once decided.
    decided: Option<String>,
    /// Its tenant has token limits: the response's last bytes are kept for its usage.
    wants_usage: bool,
    phase: Phase,
    /// A panic was caught: the request goes on as it stands, unrouted.
    open: bool,
}

impl Filter {
    /// A filter for a new stream.
    pub fn new(shared: Shared) -> Self {
        Self { shared, asking: None, waiting: None, decided: None, wants_usage: false, phase: Phase::default(), open: false }
    }

    fn front(&self) -> &Front {
        &self.shared.front
    }

    /// A panic was caught in a hook: from now on the filter lets the request
    /// and its response through as they stand; a decision already leased ends as
    /// the stream does.
    pub fn fall_open(&mut self) {
        self.open = true;
        self.asking = None;
    }

    /// The request's headers: the router's own answer, or held for the body.
    pub fn request_headers(&mut self, s: &Stream, end_of_stream: bool) -> Headers {
        if self.open {
            return Headers::Continue;
        }
        let head = request::head_of(s.request_headers().into_iter());
        let generation = match self.front().own_answer(&head) {
            Ok(generation) => generation,
            Err(answer) => {
                send(s, &answer);
                return Headers::StopIteration;
            }
        };
        let request_id = match &head.request_id {
            Some(id) => id.clone(),
            None => {
                let id = request::new_request_id();
                s.set_request_header("x-request-id", &id);
                id
            }
        };
        self.asking = Some(Asking { head, generation, request_id });
        if !end_of_stream {
            return Headers::StopIteration;
        }
        match self.decide(s, Vec::new(), false) {
            Next::Go => Headers::Continue,
            Next::Wait | Next::Answered => Headers::StopIteration,
        }
    }

    /// A chunk of the request's body: buffered until the last, which decides.
    pub fn request_body(&mut self, s: &Stream, end_of_stream: bool) -> Body {
        if self.open || self.asking.is_none() {
            return Body::Continue;
        }
        if !end_of_stream {
            return Body::StopIterationAndBuffer;
        }
        self.shared.failpoint("request_body");
        match self.decide(s, s.request_body(), true) {
            Next::Go => Body::Continue,
            Next::Wait => Body::StopIterationAndBuffer,
            Next::Answered => Body::StopIterationNoBuffer,
        }
    }

    /// The request's trailers, which end a body that came before them: the
    /// body Envoy buffered decides.
    pub fn request_trailers(&mut self, s: &Stream) -> Trailers {
        if self.open || self.asking.is_none() {
            return Trailers::Continue;
        }
        match self.decide(s, s.request_body(), false) {
            Next::Go => Trailers::Continue,
            Next::Wait | Next::Answered => Trailers::StopIteration,
        }
    }

    /// Decides with the whole `body`: what becomes of the request.
    fn decide(&mut self, s: &Stream, body: Vec<u8>, in_body_hook: bool) -> Next {
        let Some(Asking { head, generation, request_id }) = self.asking.take() else { return Next::Go };
        let front = self.front().clone();
        let slot = Arc::new(Slot::default());
        let waits = slot.clone();
        let mut deciding: Pin<Box<dyn Future<Output = Decided> + Send>> = Box::pin(async move {
            // A request that must wait (admission, a prefill leg) moves its deadline.
            let on_wait = move |wait| waits.extend(wait);
            let decided = front.decide(&head, &body, generation, &request_id, None, &on_wait).await;
            (decided, request_id)
        });
        let runtime = self.shared.runtime.clone();
        let _context = runtime.enter();
        match deciding.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(decided) => {
                metrics::counter!("inferrail_module_decisions_total", "path" => "inline").increment(1);
                self.apply(s, decided, in_body_hook)
            }
            Poll::Pending => {
                metrics::counter!("inferrail_module_decisions_total", "path" => "runtime").increment(1);
                self.shared.failpoint_stall();
                slot.pause(s.scheduler());
                self.shared.watchdog.watch(&slot);
                let (to, router) = (slot.clone(), self.front().router.clone());
                let task = runtime.spawn(async move { to.put(deciding.await, &router) }).abort_handle();
                self.waiting = Some(Waiting { slot, task });
                Next::Wait
            }
        }
    }

    /// The decision that went on the runtime is ready; whether the paused
    /// request goes on (not when it was answered locally, nor when this
    /// stream was not waiting).
    pub fn scheduled(&mut self, s: &Stream) -> bool {
        let Some(waiting) = self.waiting.take() else { return false };
        match waiting.slot.take(false) {
            Taken::Decided(decided) if !self.open => self.apply(s, *decided, false) == Next::Go,
            Taken::Decided(decided) => {
                gone(&self.front().router, *decided);
                true
            }
            Taken::TimedOut => {
                // The task may still finish: it then ends its own leases (Slot::put).
                waiting.task.abort();
                crate::abi::log(true, "inferrail: no decision within the deadline; the request goes on unrouted");
                metrics::counter!("inferrail_module_fell_open_total", "reason" => "deadline").increment(1);
                true
            }
            Taken::Nothing => false,
        }
    }

    /// Names the decision's replicas to Envoy, or answers the request.
    fn apply(&mut self, s: &Stream, (decided, request_id): Decided, in_body_hook: bool) -> Next {
        match decided {
            Ok((d, traceparent)) => {
                // Held first: if what follows panics, the stream's end still ends the lease.
                self.decided = Some(d.request_id.clone());
                self.wants_usage = d.wants_usage;
                for (key, value) in d.headers(d.request_id != request_id, traceparent.as_deref()) {
                    s.set_request_header(key, &value);
                }
                for (namespace, fields) in d.metadata() {
                    for (key, value) in fields {
                        s.set_metadata(namespace, key, &value);
                    }
                }
                if let Some(body) = &d.body {
                    s.replace_request_body(body, in_body_hook);
                }
                Next::Go
            }
            Err(answer) => {
                send(s, &answer);
                Next::Answered
            }
        }
    }

    /// Hears what a response hook brought.
    fn hear(&mut self, events: Vec<Event>) {
        if let Some(id) = &self.decided {
            for event in events {
                self.front().router.hear(id, event);
            }
        }
    }

    /// The response's headers: its status and who served.
    pub fn response_headers(&mut self, s: &Stream, end_of_stream: bool) {
        if self.decided.is_none() {
            return;
        }
        let mut events = Vec::new();
        let (status, served) = (s.response_header(":status"), s.upstream_address());
        self.phase.headers(&self.shared.front.router, status.as_deref(), served.as_deref(), end_of_stream, &mut events);
        self.hear(events);
    }

    /// A chunk of the response's body: the first byte, and, for a tenant
    /// with token limits, the usage at its end.
    pub fn response_body(&mut self, s: &Stream, end_of_stream: bool) {
        if self.decided.is_none() {
            return;
        }
        let mut events = Vec::new();
        if self.wants_usage {
            s.response_chunks(|chunk| self.phase.body(chunk, false, &mut events));
        } else {
            // Only that a chunk came: the bytes are read where the usage counts, as the ext_proc filter asks for them.
            self.phase.body(&[], false, &mut events);
        }
        if end_of_stream {
            self.phase.body(&[], true, &mut events);
        }
        self.hear(events);
    }

    /// The response's trailers, which end it.
    pub fn response_trailers(&mut self) {
        let mut events = Vec::new();
        self.phase.trailers(&mut events);
        self.hear(events);
    }

    /// The stream is over, however it ended: a decision still running is
    /// cancelled (the request leaves its queue), one made and not applied
    /// ends as the client's leaving, a routed request ends.
    pub fn complete(&mut self) {
        if let Some(waiting) = self.waiting.take() {
            waiting.task.abort();
            if let Taken::Decided(decided) = waiting.slot.take(true) {
                gone(&self.front().router, *decided);
            }
        }
        self.hear(vec![Event::End]);
        self.decided = None;
    }
}

impl Drop for Filter {
    /// A stream Envoy destroys without completing it still ends (once).
    fn drop(&mut self) {
        self.complete();
    }
}

/// Answers the request locally with the router's own answer.
fn send(s: &Stream, answer: &Answer) {
    let mut headers = vec![("content-type", "application/json")];
    headers.extend(answer.headers.iter().map(|(k, v)| (*k, v.as_str())));
    s.send_response(answer.status, &headers, answer.body.as_bytes(), &answer.details);
}
