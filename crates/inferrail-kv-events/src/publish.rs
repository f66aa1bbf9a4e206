//! An engine's side: numbers event batches, sends them on a ZMQ PUB socket
//! and serves replays of the recent ones, as vLLM's `ZmqEventPublisher` does.
//!
//! [`Publisher::publish`] never waits: it numbers the batch (0, 1, 2, ...)
//! and puts it on a bounded queue (`max_queue_size`); when the queue is full
//! the batch is dropped and counted, and its sequence number is never sent,
//! so subscribers see the gap. A task drains the queue: it encodes each
//! batch, sends `[topic, seq, payload]`, and keeps the last `buffer_steps`
//! payloads for replay.
//!
//! The PUB socket binds or connects by vLLM's rule ([`engine_binds`]). A
//! connecting publisher reconnects by itself whenever its subscriber goes
//! away (zmq.rs, unlike libzmq, does not), and drops what is published while
//! no subscriber is attached, as libzmq's PUB does. zmq.rs has no high-water
//! mark setting: each subscriber's queue holds 100,000 messages, vLLM's
//! default `hwm`, and a full queue drops messages for that subscriber.
//!
//! The replay service, when `replay_endpoint` is set, is a ROUTER socket
//! that binds. A client (REQ, or DEALER sending an empty delimiter frame)
//! sends the first sequence number it wants as 8 bytes big-endian; it gets
//! `[topic, seq, payload]` for every buffered batch from there on, then
//! `["", -1, ""]`, after the empty delimiter, as vLLM 0.32.0 sends them
//! (`ZmqEventPublisher._service_replay`).
//!
//! [`Skip`] is a fault for tests: chosen sequence numbers are kept for
//! replay but never sent, as if the network lost them.

use std::collections::{BTreeSet, VecDeque};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use futures_util::StreamExt;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use zeromq::{PubSocket, RouterSendHalf, RouterSocket, Socket, SocketEvent, SocketOptions, SocketRecv, SocketSend, ZmqMessage};

use crate::endpoint::{self, CONNECT_ATTEMPT, EndpointError, engine_binds};
use crate::wire::{self, EventBatch, REPLAY_END_SEQ};

/// How a publisher is set up: the fields of vLLM's `--kv-events-config`
/// that concern it, and a fault.
#[derive(Debug, Clone)]
pub struct PublisherConfig {
    /// Where the PUB socket binds or connects.
    pub endpoint: String,
    /// Where the replay ROUTER socket binds; `None` serves no replays.
    pub replay_endpoint: Option<String>,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// Batches waiting to be sent before new ones are dropped.
    pub max_queue_size: usize,
    /// The first frame of every message.
    pub topic: String,
    /// Written into batches that carry no `dp_rank`, as vLLM does.
    pub dp_rank: i64,
    /// Sequence numbers to keep for replay but never send.
    pub skip: Skip,
}

/// A fault: which sequence numbers the publisher pretends to lose.
#[derive(Debug, Clone, PartialEq)]
pub enum Skip {
    /// Send everything.
    Never,
    /// Lose exactly these.
    Seqs(BTreeSet<u64>),
    /// Lose each with this probability, decided by the sequence number and
    /// the seed, so a run is repeatable.
    Random {
        /// Between 0 and 1.
        probability: f64,
        /// Picks which ones.
        seed: u64,
    },
}

/// A `--kv-events-skip` value that does not parse.
#[derive(Debug, thiserror::Error)]
#[error("{0:?}: expected `rate:P` with 0 <= P <= 1 or `seq:N,N,...`")]
pub struct SkipParseError(String);

impl Skip {
    /// Whether `seq` is to be lost.
    pub fn skips(&self, seq: u64) -> bool {
        match self {
            Skip::Never => false,
            Skip::Seqs(seqs) => seqs.contains(&seq),
            Skip::Random { probability, seed } => unit_interval(seed ^ seq.wrapping_mul(0x9e37_79b9_7f4a_7c15)) < *probability,
        }
    }

    /// Reads `rate:P` (lose each batch with probability P; `seed` picks
    /// which) or `seq:N,N,...` (lose these sequence numbers).
    pub fn parse(text: &str, seed: u64) -> Result<Self, SkipParseError> {
        let bad = || SkipParseError(text.to_owned());
        if let Some(p) = text.strip_prefix("rate:") {
            let probability = f64::from_str(p).map_err(|_| bad())?;
            if !(0.0..=1.0).contains(&probability) {
                return Err(bad());
            }
            return Ok(Skip::Random { probability, seed });
        }
        let list = text.strip_prefix("seq:").ok_or_else(bad)?;
        list.split(',').map(|n| n.trim().parse::<u64>().map_err(|_| bad())).collect::<Result<_, _>>().map(Skip::Seqs)
    }
}

/// A uniform number in [0, 1) from 64 bits (splitmix64's finalizer).
fn unit_interval(mut z: u64) -> f64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// What a publisher has done so far.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PublishStats {
    /// Batches numbered (the next sequence number).
    pub published: u64,
    /// Batches sent on the PUB socket (to whoever was subscribed).
    pub sent: u64,
    /// Batches kept for replay but not sent ([`Skip`]).
    pub skipped: u64,
    /// Batches dropped because the queue was full; their numbers are gaps
    /// that no replay can fill.
    pub dropped: u64,
}

#[derive(Debug, Default)]
struct Counts {
    sent: AtomicU64,
    skipped: AtomicU64,
    dropped: AtomicU64,
}

/// Why a publisher could not start.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// An endpoint is unusable or could not be bound.
    #[error(transparent)]
    Endpoint(#[from] EndpointError),
}

type Buffer = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

/// What the queue carries to the sending task.
enum Item {
    /// A numbered batch.
    Batch(u64, EventBatch),
    /// Answered once everything queued before it is sent.
    Flush(oneshot::Sender<()>),
}

/// A running publisher; see the module doc.
pub struct Publisher {
    queue: Mutex<(u64, Option<mpsc::Sender<Item>>)>,
    counts: Arc<Counts>,
    dp_rank: i64,
    endpoint: String,
    replay_endpoint: Option<String>,
    task: Option<JoinHandle<()>>,
    replay_task: Option<JoinHandle<()>>,
}

impl Publisher {
    /// Binds what binds (the PUB socket when vLLM's rule says so, the replay
    /// socket), starts connecting what connects, and starts sending.
    pub async fn start(config: PublisherConfig) -> Result<Self, PublishError> {
        let buffer: Buffer = Arc::new(Mutex::new(VecDeque::with_capacity(config.buffer_steps.min(1 << 16))));
        let (tx, rx) = mpsc::channel(config.max_queue_size.max(1));
        let counts = Arc::new(Counts::default());
        let (pub_socket, endpoint) = if engine_binds(&config.endpoint) {
            let mut socket = PubSocket::new();
            let bound = endpoint::bind(&mut socket, &config.endpoint).await?;
            (Some(socket), bound)
        } else {
            endpoint::for_zmq_rs(&config.endpoint)?;
            (None, config.endpoint.clone())
        };
        let (replay_task, replay_endpoint) = match &config.replay_endpoint {
            Some(e) => {
                let mut router = RouterSocket::new();
                let bound = endpoint::bind(&mut router, e).await?;
                (Some(tokio::spawn(serve_replays(router, buffer.clone(), Bytes::from(config.topic.clone().into_bytes())))), Some(bound))
            }
            None => (None, None),
        };
        let sender = Sender {
            connect_to: pub_socket.is_none().then(|| endpoint.clone()),
            socket: pub_socket,
            topic: Bytes::from(config.topic.into_bytes()),
            buffer,
            buffer_steps: config.buffer_steps,
            skip: config.skip,
            counts: counts.clone(),
        };
        let task = tokio::spawn(sender.run(rx));
        Ok(Self {
            queue: Mutex::new((0, Some(tx))),
            counts,
            dp_rank: config.dp_rank,
            endpoint,
            replay_endpoint,
            task: Some(task),
            replay_task,
        })
    }

    /// The PUB endpoint: where it is bound (a wildcard port resolved), or
    /// where it connects.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Where the replay service is bound, if there is one.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    /// Numbers `batch` and queues it for sending; never waits. Returns its
    /// sequence number, or `None` when the queue was full and it was dropped.
    pub fn publish(&self, mut batch: EventBatch) -> Option<u64> {
        batch.dp_rank.get_or_insert(self.dp_rank);
        let mut queue = lock(&self.queue);
        let seq = queue.0;
        queue.0 += 1;
        match queue.1.as_ref().map(|tx| tx.try_send(Item::Batch(seq, batch))) {
            Some(Ok(())) => Some(seq),
            _ => {
                self.counts.dropped.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    /// Waits until every batch published before the call has been sent,
    /// skipped or dropped.
    pub async fn flush(&self) {
        let (done, wait) = oneshot::channel();
        let tx = lock(&self.queue).1.clone();
        if let Some(tx) = tx
            && tx.send(Item::Flush(done)).await.is_ok()
        {
            // The task answers unless it is gone, and then nothing is pending.
            let _ = wait.await;
        }
    }

    /// What the publisher has done so far.
    pub fn stats(&self) -> PublishStats {
        PublishStats {
            published: lock(&self.queue).0,
            sent: self.counts.sent.load(Ordering::Relaxed),
            skipped: self.counts.skipped.load(Ordering::Relaxed),
            dropped: self.counts.dropped.load(Ordering::Relaxed),
        }
    }

    /// Sends what is queued, then closes the sockets.
    pub async fn shutdown(mut self) {
        lock(&self.queue).1 = None;
        if let Some(task) = self.task.take() {
            // A task that panicked has nothing left to send.
            let _ = task.await;
        }
        if let Some(task) = self.replay_task.take() {
            task.abort();
        }
    }
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("endpoint", &self.endpoint)
            .field("replay_endpoint", &self.replay_endpoint)
            .finish_non_exhaustive()
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        if let Some(task) = self.replay_task.take() {
            task.abort();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The task that owns the PUB socket.
struct Sender {
    socket: Option<PubSocket>,
    connect_to: Option<String>,
    topic: Bytes,
    buffer: Buffer,
    buffer_steps: usize,
    skip: Skip,
    counts: Arc<Counts>,
}

/// The events of one PUB socket (connections made and lost).
type Monitor = futures_util::stream::BoxStream<'static, SocketEvent>;

/// A PUB socket just connected, with its events.
type Connected = (PubSocket, Monitor);

impl Sender {
    async fn run(mut self, mut rx: mpsc::Receiver<Item>) {
        let (connected_tx, mut connected_rx) = mpsc::channel::<Connected>(1);
        let mut monitor: Option<Monitor> = None;
        if let Some(endpoint) = &self.connect_to {
            tokio::spawn(connect(endpoint.clone(), connected_tx.clone()));
        }
        loop {
            tokio::select! {
                item = rx.recv() => match item {
                    Some(Item::Batch(seq, batch)) => self.send(seq, &batch).await,
                    Some(Item::Flush(done)) => {
                        // The caller may have stopped waiting.
                        let _ = done.send(());
                    }
                    None => return,
                },
                Some((socket, events)) = connected_rx.recv() => {
                    self.socket = Some(socket);
                    monitor = Some(events);
                }
                event = next_event(&mut monitor) => {
                    if matches!(event, Some(SocketEvent::Disconnected(_)) | None) {
                        // The subscriber went away: start over with a new socket.
                        self.socket = None;
                        monitor = None;
                        if let Some(endpoint) = &self.connect_to {
                            tokio::spawn(connect(endpoint.clone(), connected_tx.clone()));
                        }
                    }
                }
            }
        }
    }

    async fn send(&mut self, seq: u64, batch: &EventBatch) {
        let payload = Bytes::from(wire::encode(batch));
        {
            let mut buffer = lock(&self.buffer);
            buffer.push_back((seq, payload.clone()));
            while buffer.len() > self.buffer_steps {
                buffer.pop_front();
            }
        }
        if self.skip.skips(seq) {
            self.counts.skipped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let Some(socket) = self.socket.as_mut() else { return };
        let message = message([self.topic.clone(), Bytes::copy_from_slice(&seq.to_be_bytes()), payload]);
        match socket.send(message).await {
            Ok(()) => {
                self.counts.sent.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => tracing::warn!(error = %e, seq, "KV event batch not sent"),
        }
    }
}

/// The next event of the monitor, or never when there is none.
async fn next_event(monitor: &mut Option<Monitor>) -> Option<SocketEvent> {
    match monitor {
        Some(m) => m.next().await,
        None => std::future::pending().await,
    }
}

/// Connects a new PUB socket to `endpoint`, trying again until it works or
/// the publisher is gone.
async fn connect(endpoint: String, done: mpsc::Sender<Connected>) {
    let Ok(target) = endpoint::for_zmq_rs(&endpoint) else { return };
    loop {
        if done.is_closed() {
            return;
        }
        let mut options = SocketOptions::default();
        options.connect_timeout(CONNECT_ATTEMPT);
        let mut socket = PubSocket::with_options(options);
        let events = socket.monitor().boxed();
        match socket.connect(&target).await {
            Ok(()) => {
                // The publisher may have shut down meanwhile; then the socket goes.
                let _ = done.send((socket, events)).await;
                return;
            }
            Err(zeromq::ZmqError::ConnectTimeout(_)) => {}
            Err(e) => {
                tracing::debug!(error = %e, endpoint, "KV event publisher cannot connect yet");
                tokio::time::sleep(CONNECT_ATTEMPT).await;
            }
        }
    }
}

fn message(frames: impl IntoIterator<Item = Bytes>) -> ZmqMessage {
    let mut frames = frames.into_iter();
    let mut message = ZmqMessage::from(frames.next().unwrap_or_default());
    for frame in frames {
        message.push_back(frame);
    }
    message
}

/// Answers replay requests from the buffer until the publisher stops.
async fn serve_replays(router: RouterSocket, buffer: Buffer, topic: Bytes) {
    let (mut tx, mut rx) = router.split();
    loop {
        let request = match rx.recv().await {
            Ok(m) => m.into_vec(),
            Err(e) => {
                tracing::debug!(error = %e, "KV event replay socket");
                continue;
            }
        };
        // [client identity, empty delimiter, start sequence], as vLLM expects.
        let [client, delimiter, start] = request.as_slice() else {
            tracing::warn!(frames = request.len(), "invalid KV event replay request");
            continue;
        };
        if !delimiter.is_empty() || start.len() > 8 {
            tracing::warn!("invalid KV event replay request");
            continue;
        }
        let start = start.iter().fold(0u64, |n, &b| (n << 8) | u64::from(b));
        let batches: Vec<(u64, Bytes)> = lock(&buffer).iter().filter(|(seq, _)| *seq >= start).cloned().collect();
        if let Err(e) = reply(&mut tx, client, &topic, batches).await {
            tracing::debug!(error = %e, "KV event replay client went away");
        }
    }
}

async fn reply(tx: &mut RouterSendHalf, client: &Bytes, topic: &Bytes, batches: Vec<(u64, Bytes)>) -> zeromq::ZmqResult<()> {
    for (seq, payload) in batches {
        tx.send(message([client.clone(), Bytes::new(), topic.clone(), Bytes::copy_from_slice(&seq.to_be_bytes()), payload])).await?;
    }
    tx.send(message([client.clone(), Bytes::new(), Bytes::new(), Bytes::from_static(&REPLAY_END_SEQ), Bytes::new()])).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skip_values_parse_or_say_what_is_expected() {
        assert_eq!(Skip::parse("seq:3, 5,8", 0).ok(), Some(Skip::Seqs([3, 5, 8].into())));
        assert_eq!(Skip::parse("rate:0.25", 7).ok(), Some(Skip::Random { probability: 0.25, seed: 7 }));
        for bad in ["0.25", "rate:2", "rate:x", "seq:", "seq:1,-2", "seq:a"] {
            let err = Skip::parse(bad, 0).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(err.contains("rate:P"), "{bad}: {err}");
        }
    }

    #[test]
    fn a_random_skip_loses_about_its_share_and_the_same_ones_each_run() {
        let skip = Skip::Random { probability: 0.2, seed: 42 };
        let lost: Vec<u64> = (0..10_000).filter(|&s| skip.skips(s)).collect();
        assert!((1_800..2_200).contains(&lost.len()), "{}", lost.len());
        assert_eq!(lost, (0..10_000).filter(|&s| skip.skips(s)).collect::<Vec<_>>());
        assert!(!(0..1000).any(|s| Skip::Random { probability: 0.0, seed: 1 }.skips(s)));
        assert!((0..1000).all(|s| Skip::Random { probability: 1.0, seed: 1 }.skips(s)));
    }
}
