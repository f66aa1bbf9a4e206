//! A consumer's side: a SUB socket that yields each engine batch with its
//! sequence number, and a one-shot replay client.
//!
//! The subscriber mirrors vLLM's rule: where the engine connects (an
//! endpoint such as `tcp://127.0.0.1:5557`) the subscriber binds, and where
//! the engine binds (`tcp://*:5557`, `ipc://...`) it connects. A connecting
//! [`Subscriber::start`] waits for the first connection (zmq.rs gives up
//! after 30 s, an [`EndpointError`]); after that zmq.rs reconnects by itself
//! when the engine restarts, backing off from 100 ms to 30 s.
//! [`SubscriberConfig::bind`] can say otherwise than the rule, e.g. to
//! connect to `tcp://engine-0:5557` when the engine was started with
//! `tcp://*:5557`.
//!
//! Only messages whose topic is exactly the configured one are yielded (an
//! empty topic takes every message). A message that is not a vLLM event
//! batch is an error for that message only; the subscriber goes on. Gap
//! detection and what to do about a gap are the caller's: [`replay`] asks an
//! engine's replay service for everything it still holds from a sequence
//! number on.

use std::time::Duration;

use bytes::Bytes;
use zeromq::{DealerSocket, Socket, SocketOptions, SocketRecv, SocketSend, SubSocket, ZmqError, ZmqMessage};

use crate::endpoint::{self, EndpointError, engine_binds};
use crate::wire::{self, EventBatch, REPLAY_END_SEQ, WireError};

/// Where and what to subscribe to.
#[derive(Debug, Clone)]
pub struct SubscriberConfig {
    /// The engine's `endpoint`.
    pub endpoint: String,
    /// The engine's `topic`; empty takes every message.
    pub topic: String,
    /// Bind (the engine connects) or connect (the engine binds).
    pub bind: bool,
}

impl SubscriberConfig {
    /// The subscriber for an engine started with this `endpoint` and
    /// `topic`: it binds exactly when the engine connects.
    pub fn new(endpoint: &str, topic: &str) -> Self {
        Self { endpoint: endpoint.to_owned(), topic: topic.to_owned(), bind: !engine_binds(endpoint) }
    }
}

/// Why a message could not be had.
#[derive(Debug, thiserror::Error)]
pub enum SubscribeError {
    /// The endpoint is unusable or could not be bound or connected.
    #[error(transparent)]
    Endpoint(#[from] EndpointError),
    /// A message that is not a vLLM event batch; `seq` when its sequence
    /// frame could still be read.
    #[error("garbage KV event message (seq {seq:?}): {error}")]
    Garbage {
        /// The sequence number, if readable.
        seq: Option<u64>,
        /// What is wrong with it.
        error: WireError,
    },
    /// The socket failed to receive (a peer's connection broke).
    #[error("receiving KV events: {0}")]
    Socket(#[from] ZmqError),
}

/// A subscribed SUB socket.
pub struct Subscriber {
    socket: SubSocket,
    topic: String,
    endpoint: String,
}

impl Subscriber {
    /// Binds or connects, and subscribes to the topic.
    pub async fn start(config: &SubscriberConfig) -> Result<Self, SubscribeError> {
        let mut socket = SubSocket::new();
        let endpoint = if config.bind {
            endpoint::bind(&mut socket, &config.endpoint).await?
        } else {
            let target = endpoint::for_zmq_rs(&config.endpoint)?;
            // Waits for the first connection; zmq.rs reconnects by itself after it.
            socket.connect(&target).await.map_err(|source| EndpointError::Socket { endpoint: config.endpoint.clone(), source })?;
            config.endpoint.clone()
        };
        socket.subscribe(&config.topic).await?;
        Ok(Self { socket, topic: config.topic.clone(), endpoint })
    }

    /// Where the socket is bound (a wildcard port resolved) or connected.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Closes the socket, waiting until a bound endpoint is free again.
    pub async fn close(self) {
        for e in self.socket.close().await {
            tracing::debug!(error = %e, "closing the KV event subscriber");
        }
    }

    /// The next batch of the topic with its sequence number.
    pub async fn next(&mut self) -> Result<(u64, EventBatch), SubscribeError> {
        loop {
            let message = self.socket.recv().await?.into_vec();
            if !self.topic.is_empty() && message.first().map(|t| t.as_ref()) != Some(self.topic.as_bytes()) {
                continue;
            }
            return match wire::parse_message(&message) {
                Ok((_, seq, batch)) => Ok((seq, batch)),
                Err(error) => Err(SubscribeError::Garbage { seq: message.get(1).and_then(|s| wire::parse_seq(s).ok()), error }),
            };
        }
    }
}

/// Why a replay failed.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The endpoint is unusable.
    #[error(transparent)]
    Endpoint(#[from] EndpointError),
    /// No end-of-replay marker within the timeout.
    #[error("no complete replay from {endpoint} within {timeout:?}")]
    Timeout {
        /// The replay endpoint.
        endpoint: String,
        /// How long it was given.
        timeout: Duration,
    },
    /// The socket failed.
    #[error("replay from {endpoint}: {source}")]
    Socket {
        /// The replay endpoint.
        endpoint: String,
        /// What ZMQ said.
        source: ZmqError,
    },
    /// A reply that is not `[empty, seq, payload]` with a vLLM event batch.
    #[error("replay from {endpoint}: {error}")]
    Garbage {
        /// The replay endpoint.
        endpoint: String,
        /// What is wrong with it.
        error: WireError,
    },
}

/// Asks the replay service at `endpoint` for every batch it holds from
/// `from_seq` on; returns them in order, up to its end-of-replay marker.
/// What it no longer holds is simply not there: the caller compares the
/// first sequence number with the one it asked for.
pub async fn replay(endpoint: &str, from_seq: u64, timeout: Duration) -> Result<Vec<(u64, EventBatch)>, ReplayError> {
    let target = endpoint::for_zmq_rs(endpoint)?;
    let timed_out = || ReplayError::Timeout { endpoint: endpoint.to_owned(), timeout };
    tokio::time::timeout(timeout, replay_from(endpoint, &target, from_seq, timeout)).await.map_err(|_| timed_out())?
}

async fn replay_from(endpoint: &str, target: &str, from_seq: u64, timeout: Duration) -> Result<Vec<(u64, EventBatch)>, ReplayError> {
    let socket_error = |source| ReplayError::Socket { endpoint: endpoint.to_owned(), source };
    let garbage = |error| ReplayError::Garbage { endpoint: endpoint.to_owned(), error };
    let mut options = SocketOptions::default();
    options.connect_timeout(timeout);
    let mut socket = DealerSocket::with_options(options);
    socket.connect(target).await.map_err(socket_error)?;
    let mut request = ZmqMessage::from(Bytes::new());
    request.push_back(Bytes::copy_from_slice(&from_seq.to_be_bytes()));
    socket.send(request).await.map_err(socket_error)?;
    let mut batches = Vec::new();
    loop {
        let reply = socket.recv().await.map_err(socket_error)?.into_vec();
        // vLLM 0.32.0 sends the topic before the sequence number; earlier vLLMs did not.
        let (delimiter, seq, payload) = match reply.as_slice() {
            [delimiter, _, seq, payload] | [delimiter, seq, payload] => (delimiter, seq, payload),
            _ => return Err(garbage(WireError::Frames(reply.len()))),
        };
        if !delimiter.is_empty() {
            return Err(garbage(WireError::Delimiter));
        }
        if seq.as_ref() == REPLAY_END_SEQ {
            return Ok(batches);
        }
        let seq = wire::parse_seq(seq).map_err(garbage)?;
        batches.push((seq, wire::decode(payload).map_err(garbage)?));
    }
}
