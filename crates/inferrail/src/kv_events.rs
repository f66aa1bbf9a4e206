//! The engines' KV events, applied to the KV index (exact mode, ADR 0012).
//!
//! Each replica with an event source has a [`Follow`]: it runs the
//! replica's follower (crate `inferrail-kv`, `mode`) over the messages
//! received, turns vLLM's wire events (crate `inferrail-kv-events`) into the
//! index's events, renamed with the router's own hash chain (the seed of
//! the event's adapter, else of the replica's first model, and the first
//! block's cache salt), and keeps the replica's mode, metrics and log
//! line current. Large stored events are applied in pieces, so a decision
//! recording a request never waits long on the index's lock. [`Follow`]
//! does no I/O.
//!
//! [`run`] keeps one task per replica with an event source (its own
//! `kv_events`, else the template) as the fleet changes. A replica's task
//! receives on its SUB socket (binding or connecting as configured) and
//! hands messages to the applying loop through a bounded queue: when the
//! queue is full the message is dropped and counted, so an event storm
//! never waits on the index, and the follower treats the loss as such
//! (replayed, else the replica falls back). The applying loop fetches the
//! replays the follower asks for and ticks it every second.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use inferrail_config::EventSource;
use inferrail_kv_events::{SubscribeError, Subscriber, SubscriberConfig, replay};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use inferrail_kv::index::{Event, Stored, Tier};
use inferrail_kv::mode::{Act, Follower, Mode, Reason};
use inferrail_kv_events::{EventBatch, ExtraKey, KvEvent};
use inferrail_route::fleet::Replica;
use inferrail_route::kv::seed;

use crate::router::Router;

/// Blocks applied under one hold of the index's lock.
const PIECE: usize = 256;

/// One replica's follower and what it needs to apply events.
pub struct Follow {
    replica: Arc<Replica>,
    follower: Follower,
    /// The model a block without an adapter belongs to.
    base: String,
    /// Engine restarts heard of through the replica's counters.
    restarts: u64,
}

impl Follow {
    /// Starts following `replica`; `replay` says whether a replay endpoint is configured.
    pub fn new(router: &Router, replica: Arc<Replica>, replay: bool) -> Self {
        let base = replica.models.first().map(|&m| router.core.model(m).name.clone()).unwrap_or_default();
        let restarts = replica.restarts.load(std::sync::atomic::Ordering::Relaxed);
        let follow = Self { follower: Follower::new(replay, router.now_ms()), base, restarts, replica };
        follow.publish(Mode::Approximate(Reason::NoEventsConfigured));
        follow
    }

    /// A message arrived. Returns the sequence numbers `from..to` to fetch
    /// from the replay endpoint, when the follower asks for them: the caller
    /// passes what it got to [`Follow::replayed`] and this message here again.
    pub fn message(&mut self, router: &Router, seq: u64, batch: &EventBatch) -> Option<(u64, u64)> {
        metrics::counter!("inferrail_kv_events_messages_total", "replica" => self.replica.id.clone()).increment(1);
        let act = self.follower.message(seq, last_clear(batch), router.now_ms());
        self.act(router, act, &batch.events)
    }

    /// What the replay endpoint answered for `from..to` (nothing when it did not answer).
    pub fn replayed(&mut self, router: &Router, messages: &[(u64, EventBatch)]) {
        for (seq, batch) in messages {
            let act = self.follower.replayed(*seq, last_clear(batch));
            self.act(router, act, &batch.events);
        }
    }

    /// A message that is not a KV event batch; `seq` when its sequence frame was readable.
    pub fn garbage(&mut self, router: &Router, seq: Option<u64>) {
        metrics::counter!("inferrail_kv_events_garbage_total", "replica" => self.replica.id.clone()).increment(1);
        let act = self.follower.garbage(seq);
        self.act(router, act, &[]);
    }

    /// The queue dropped a message.
    pub fn dropped(&mut self, router: &Router) {
        metrics::counter!("inferrail_kv_events_dropped_total", "replica" => self.replica.id.clone()).increment(1);
        let act = self.follower.dropped();
        self.act(router, act, &[]);
    }

    /// Time passed: hears of engine restarts through the replica's counters and of a silent publisher.
    pub fn tick(&mut self, router: &Router) {
        let restarts = self.replica.restarts.load(std::sync::atomic::Ordering::Relaxed);
        if restarts != self.restarts {
            self.restarts = restarts;
            let act = self.follower.restarted();
            self.act(router, act, &[]);
        }
        let busy = self.replica.in_flight() > 0;
        self.follower.tick(router.now_ms(), busy, router.config().kv_events.silent_after_ms);
        self.publish(self.replica.kv_mode());
    }

    /// Does what the follower says; returns a replay wanted.
    fn act(&mut self, router: &Router, act: Act, events: &[KvEvent]) -> Option<(u64, u64)> {
        let (index, slot) = (router.core.kv.index(), self.replica.slot);
        let before = self.replica.kv_mode();
        let replay = match act {
            Act::Start { from } => {
                index.enter_exact(slot, self.replica.block_size(router.core.kv.defaults.block_size));
                self.apply(router, &events[from.min(events.len())..]);
                None
            }
            Act::Apply { from } => {
                self.apply(router, &events[from.min(events.len())..]);
                None
            }
            Act::Leave { keep } => {
                index.leave_exact(slot, keep);
                if !keep {
                    index.clear_replica(slot);
                }
                None
            }
            Act::Replay { from, to } => Some((from, to)),
            Act::Nothing => None,
        };
        self.publish(before);
        replay
    }

    /// Applies events to the exact view; the first the index refuses ends it.
    fn apply(&mut self, router: &Router, events: &[KvEvent]) {
        let index = router.core.kv.index();
        // The batch is applied as it comes: its time is now.
        index.advance(&[self.replica.slot], router.now());
        for event in events {
            // Each stored run says whether its hashes cover tokens past the blocks (ADR 0058).
            if let KvEvent::BlockStored(s) = event {
                let ahead = s.lookahead_token_ids.as_ref().and_then(|l| l.first()).map_or(0, Vec::len);
                if self.replica.learn_lookahead(ahead) {
                    tracing::info!(replica = %self.replica.id, tokens = ahead, "lookahead tokens in the engine's block hashes");
                }
            }
            let applied = self.pieces(event).try_for_each(|e| index.apply(self.replica.slot, &e));
            if let Err(e) = applied {
                tracing::warn!(replica = %self.replica.id, error = %e, "KV event refused; the replica's index is approximate");
                let act = self.follower.rejected(Reason::from(&e));
                if let Act::Leave { keep } = act {
                    index.leave_exact(self.replica.slot, keep);
                }
                return;
            }
        }
    }

    /// The index's events for one wire event, stored blocks `PIECE` at a time.
    fn pieces<'a>(&'a self, event: &'a KvEvent) -> Box<dyn Iterator<Item = Event<'a>> + 'a> {
        match event {
            KvEvent::BlockStored(s) => {
                let tier = tier(s.medium.as_deref(), s.group_idx);
                let bs = s.block_size as usize;
                let model = s.lora_name.as_deref().unwrap_or(&self.base);
                let salt = s.parent_block_hash.is_none().then(|| cache_salt(s.lora_name.is_some(), s.extra_keys.as_deref())).flatten();
                let chain = seed(model, salt);
                // Token ids that do not fill the blocks go whole, for the index to refuse.
                let n = if s.token_ids.len() == s.block_hashes.len() * bs { PIECE } else { s.block_hashes.len().max(1) };
                Box::new(s.block_hashes.chunks(n).enumerate().map(move |(i, hashes)| {
                    let parent = if i == 0 { s.parent_block_hash } else { Some(s.block_hashes[i * n - 1]) };
                    let tokens = s.token_ids.get(i * n * bs..((i * n + hashes.len()) * bs).min(s.token_ids.len())).unwrap_or_default();
                    Event::Stored(Stored { hashes, parent, tokens, block_size: bs, seed: chain, tier })
                }))
            }
            KvEvent::BlockRemoved(r) => {
                Box::new(std::iter::once(Event::Removed { hashes: &r.block_hashes, tier: tier(r.medium.as_deref(), r.group_idx) }))
            }
            KvEvent::AllBlocksCleared => Box::new(std::iter::once(Event::Cleared)),
        }
    }

    /// Puts the follower's mode on the replica; logs and counts a change from `before`.
    fn publish(&self, before: Mode) {
        let mode = self.follower.mode();
        self.replica.set_kv_mode(mode);
        if mode == before {
            return;
        }
        tracing::info!(replica = %self.replica.id, mode = mode.as_str(), was = before.as_str(), "KV index mode");
        gauge_modes(&self.replica.id, mode);
    }
}

/// Follows the KV events of every replica with an event source, as the fleet changes.
pub async fn run(router: Arc<Router>) {
    // By replica: a replica replaced (a new pod, new events) is followed anew.
    let mut tasks: Vec<(Arc<Replica>, JoinHandle<()>)> = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        let fleet = router.fleet();
        tasks.retain(|(replica, task)| {
            let stays = fleet.replicas.iter().any(|r| Arc::ptr_eq(r, replica));
            if !stays {
                task.abort();
            }
            stays
        });
        for r in &fleet.replicas {
            if tasks.iter().any(|(t, _)| Arc::ptr_eq(t, r)) {
                continue;
            }
            let Some(source) = router.config().event_source(r.kv_events.as_ref(), r.addr.ip()) else { continue };
            tasks.push((r.clone(), tokio::spawn(follow_replica(router.clone(), r.clone(), source))));
        }
    }
}

/// What the receiving task hands the applying loop.
enum Received {
    Batch(u64, EventBatch),
    /// Not a KV event batch; its sequence number when readable.
    Garbage(Option<u64>),
}

/// Aborts a task when dropped (the replica's follow ended or was aborted).
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// One replica's events: receive, queue, apply.
async fn follow_replica(router: Arc<Router>, replica: Arc<Replica>, source: EventSource) {
    let mut follow = Follow::new(&router, replica.clone(), source.replay_endpoint.is_some());
    let (tx, mut rx) = mpsc::channel(router.config().kv_events.queue);
    let dropped = Arc::new(AtomicU64::new(0));
    let config = SubscriberConfig { endpoint: source.endpoint.clone(), topic: source.topic.clone(), bind: source.bind };
    let _receiver = AbortOnDrop(tokio::spawn(receive(replica.id.clone(), config, tx, dropped.clone())));
    let timeout = Duration::from_millis(router.config().kv_events.replay_timeout_ms);
    let mut seen_drops = 0;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        let got = tokio::select! {
            got = rx.recv() => got,
            _ = tick.tick() => {
                follow.tick(&router);
                continue;
            }
        };
        let Some(got) = got else { return };
        // Drops are of messages newer than this one: the follower expects their gap.
        let drops = dropped.load(Ordering::Relaxed);
        if drops != seen_drops {
            seen_drops = drops;
            follow.dropped(&router);
        }
        match got {
            Received::Garbage(seq) => follow.garbage(&router, seq),
            Received::Batch(seq, batch) => {
                while let Some((from, to)) = follow.message(&router, seq, &batch) {
                    let Some(endpoint) = &source.replay_endpoint else { break };
                    let answer = replay(endpoint, from, timeout).await;
                    let result = if answer.is_ok() { "answered" } else { "failed" };
                    metrics::counter!("inferrail_kv_events_replays_total", "replica" => replica.id.clone(), "result" => result)
                        .increment(1);
                    match answer {
                        Ok(messages) => {
                            let wanted: Vec<_> = messages.into_iter().filter(|(s, _)| (from..to).contains(s)).collect();
                            follow.replayed(&router, &wanted);
                        }
                        Err(e) => tracing::warn!(replica = %replica.id, error = %e, from, to, "KV event replay failed"),
                    }
                }
            }
        }
    }
}

/// Receives a replica's messages into the queue, dropping (and counting) what does not fit.
async fn receive(id: String, config: SubscriberConfig, tx: mpsc::Sender<Received>, dropped: Arc<AtomicU64>) {
    let mut wait = Duration::from_millis(500);
    let mut subscriber = loop {
        match Subscriber::start(&config).await {
            Ok(s) => break s,
            Err(e) => {
                tracing::warn!(replica = %id, endpoint = %config.endpoint, error = %e, "cannot subscribe to KV events; retrying");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(30));
            }
        }
    };
    tracing::info!(replica = %id, endpoint = subscriber.endpoint(), bind = config.bind, "following KV events");
    loop {
        let got = match subscriber.next().await {
            Ok((seq, batch)) => Received::Batch(seq, batch),
            Err(SubscribeError::Garbage { seq, error }) => {
                tracing::debug!(replica = %id, ?seq, %error, "garbage KV event message");
                Received::Garbage(seq)
            }
            Err(e) => {
                tracing::warn!(replica = %id, error = %e, "receiving KV events");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        match tx.try_send(got) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => {
                dropped.fetch_add(1, Ordering::Relaxed);
            }
            Err(mpsc::error::TrySendError::Closed(_)) => return,
        }
    }
}

/// One gauge per replica and mode, 1 for the current one.
fn gauge_modes(replica: &str, mode: Mode) {
    let all = std::iter::once(Mode::Exact).chain(Reason::ALL.iter().map(|&r| Mode::Approximate(r)));
    for m in all {
        metrics::gauge!("inferrail_kv_mode", "replica" => replica.to_owned(), "mode" => m.as_str()).set(f64::from(u8::from(m == mode)));
    }
}

fn tier(medium: Option<&str>, group: Option<u32>) -> Tier<'_> {
    Tier { medium: medium.unwrap_or("GPU"), group: group.unwrap_or(0) }
}

/// Where the last `AllBlocksCleared` of a batch is.
fn last_clear(batch: &EventBatch) -> Option<usize> {
    batch.events.iter().rposition(|e| matches!(e, KvEvent::AllBlocksCleared))
}

/// The cache salt in a prompt's first block's extra keys: vLLM lists an
/// adapter's name first, then media keys (tuples), then the salt, then
/// prompt-embedding digests (bytes).
fn cache_salt(adapter: bool, extra_keys: Option<&[Option<Vec<ExtraKey>>]>) -> Option<&str> {
    let first = extra_keys?.first()?.as_ref()?;
    let mut strings = first.iter().filter_map(|k| match k {
        ExtraKey::Str(s) => Some(s.as_str()),
        _ => None,
    });
    if adapter {
        strings.next();
    }
    strings.next()
}

#[cfg(test)]
mod tests;
