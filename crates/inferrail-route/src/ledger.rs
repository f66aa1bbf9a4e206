//! The requests in flight by id, each with its lease and its [`Life`].
//!
//! A transport says what it heard of a request ([`Ledger::hear`]); the
//! ledger runs the request's life and applies the effects to the lease and
//! the KV index, in the order [`Effects`] gives, under the request's own
//! lock (the route and observe streams of one request may speak at once).
//! It hands back what the service does besides: health, metrics and the
//! decision log. [`Ledger::tick`] delivers the deadlines that came due;
//! a request whose life is over is forgotten. With several routers it also
//! holds the requests its peers decided ([`Ledger::mirror`]), under the
//! decider's id and their own, driven by what the decider tells.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::Core;
use crate::fleet::{Fleet, Lease, Replica};
use crate::lifecycle::{Effects, Event, Life, Timing};

struct Entry {
    life: Life,
    lease: Arc<Lease>,
    /// The peer that decided it, for a mirror.
    decider: Option<u64>,
    /// A split request's prefill leg, by its id.
    prefill: Option<String>,
}

/// The id a peer's request is mirrored under: the decider's, then its own.
pub fn mirror_id(decider: u64, id: &str) -> String {
    format!("{decider:016x}/{id}")
}

/// The id a split request's prefill leg is heard under: its own, then `/prefill`.
pub fn prefill_id(id: &str) -> String {
    format!("{id}/prefill")
}

/// What a split request's decode leg hearing `event` tells of its prefill
/// leg. The prefill replica keeps its blocks until the decoder has read
/// them, as it has once the decoder answers: only then is the leg over.
/// When a sidecar runs the leg (`sidecar`), the router hears nothing of it
/// but the decoder's status, which stands for the prefill's (a decoder that
/// could not read the blocks fails or recomputes them).
pub fn prefill_leg_event(event: Event, sidecar: bool) -> Option<Event> {
    match event {
        Event::Status { code, .. } if sidecar => Some(Event::Status { code, served_by: None }),
        Event::FirstByte | Event::End | Event::Gone => Some(Event::End),
        _ => None,
    }
}

/// What one event did, for the service to act on.
#[derive(Debug)]
pub struct Heard {
    /// The request's id in the ledger.
    pub id: String,
    /// The lease holding the request after the event (on the replica that served, after a retry).
    pub lease: Arc<Lease>,
    /// The replica Envoy retried away from, when it did and that replica is known.
    pub retried_from: Option<Arc<Replica>>,
    /// What the request's life called for (already applied to the lease and the index).
    pub effects: Effects,
    /// Whether a KV record was taken back.
    pub took_back: bool,
    /// The peer that decided it, when it is a mirror: that router counts its outcome.
    pub decider: Option<u64>,
    /// A split request's prefill leg, by its id, what its decode leg hears tells of.
    pub prefill: Option<String>,
}

impl Heard {
    /// The replica that answered, if it is the lease's, and whether it answered below 500.
    pub fn answered(&self) -> Option<(&Arc<Replica>, bool)> {
        self.effects.answered.filter(|(key, _)| *key == self.lease.replica.key).map(|(_, ok)| (&self.lease.replica, ok))
    }
}

/// The requests in flight.
pub struct Ledger {
    entries: papaya::HashMap<String, Arc<Mutex<Entry>>>,
    timing: Timing,
}

impl Ledger {
    /// An empty ledger whose requests wait as `timing` says.
    pub fn new(timing: Timing) -> Self {
        Self { entries: papaya::HashMap::new(), timing }
    }

    /// Tracks a request decided at `at` under `id`, or `id.1`, `id.2`, ...
    /// when a request in flight already uses it (ids come from clients).
    /// Returns the id it is known by.
    pub fn insert(&self, id: &str, lease: Arc<Lease>, at: Duration) -> String {
        let entry =
            Arc::new(Mutex::new(Entry { life: Life::new(at, lease.replica.key, self.timing), lease, decider: None, prefill: None }));
        let entries = self.entries.pin();
        let mut key = id.to_string();
        let mut n = 0u32;
        while entries.try_insert(key.clone(), entry.clone()).is_err() {
            n += 1;
            key = format!("{id}.{n}");
        }
        key
    }

    /// Tracks the prefill leg of split request `id` (as [`Ledger::insert`]
    /// returned it) under [`prefill_id`], and links it to `id`: what `id`
    /// hears names it ([`Heard::prefill`]). Returns the leg's id.
    pub fn insert_prefill(&self, id: &str, lease: Arc<Lease>, at: Duration) -> String {
        let leg = self.insert(&prefill_id(id), lease, at);
        if let Some(entry) = self.entries.pin().get(id) {
            lock(entry).prefill = Some(leg.clone());
        }
        leg
    }

    /// Mirrors request `id` that peer `decider` decided at `at` (on this
    /// router's clock), under [`mirror_id`]. A mirror still under that id
    /// (the decider has forgotten it, this router is still in its grace) is
    /// released and replaced.
    pub fn mirror(&self, decider: u64, id: &str, lease: Arc<Lease>, at: Duration) {
        let entry = Arc::new(Mutex::new(Entry {
            life: Life::new(at, lease.replica.key, self.timing),
            lease,
            decider: Some(decider),
            prefill: None,
        }));
        if let Some(old) = self.entries.pin().insert(mirror_id(decider, id), entry) {
            lock(old).lease.release();
        }
    }

    /// Forgets every request peer `decider` decided (it is gone: nobody will
    /// tell their end), releasing their leases. Returns how many.
    pub fn forget_decider(&self, decider: u64) -> usize {
        let entries = self.entries.pin();
        let theirs: Vec<String> = entries.iter().filter(|(_, e)| lock(e).decider == Some(decider)).map(|(id, _)| id.clone()).collect();
        theirs.iter().filter(|id| self.forget(id).is_some()).count()
    }

    /// The requests this router decided that hold their lease now, by id.
    pub fn own(&self) -> Vec<(String, Arc<Lease>)> {
        let entries = self.entries.pin();
        entries
            .iter()
            .filter_map(|(id, e)| {
                let e = lock(e);
                (e.decider.is_none() && !e.lease.released()).then(|| (id.clone(), e.lease.clone()))
            })
            .collect()
    }

    /// The lease a request holds now.
    pub fn lease(&self, id: &str) -> Option<Arc<Lease>> {
        let entry = self.entries.pin().get(id)?.clone();
        let lease = lock(&entry).lease.clone();
        Some(lease)
    }

    /// Hears `event` of request `id` at `at`; `None` for a request it does not track.
    pub fn hear(&self, id: &str, at: Duration, event: Event, core: &Core, fleet: &Fleet) -> Option<Heard> {
        let entry = self.entries.pin().get(id)?.clone();
        Some(self.run(id, &entry, at, event, core, fleet))
    }

    /// Delivers every deadline due by `at`: what each did, for the requests
    /// it ended.
    pub fn tick(&self, at: Duration, core: &Core, fleet: &Fleet) -> Vec<Heard> {
        let due: Vec<(String, Arc<Mutex<Entry>>)> = self
            .entries
            .pin()
            .iter()
            .filter(|(_, e)| lock(e).life.deadline().is_some_and(|d| d <= at))
            .map(|(id, e)| (id.clone(), e.clone()))
            .collect();
        due.into_iter().map(|(id, entry)| self.run(&id, &entry, at, Event::Tick, core, fleet)).collect()
    }

    fn run(&self, id: &str, entry: &Arc<Mutex<Entry>>, at: Duration, event: Event, core: &Core, fleet: &Fleet) -> Heard {
        let mut held = lock(entry);
        let effects = held.life.on(at, event);
        let mut retried_from = None;
        if let Some(to) = effects.moved_to
            && let Some(to) = fleet.replicas.iter().find(|r| r.key == to)
        {
            let moved = core.move_lease(&held.lease, to);
            retried_from = Some(std::mem::replace(&mut held.lease, moved).replica.clone());
        }
        let lease = &held.lease;
        if effects.complete {
            core.complete(lease, at);
        }
        let took_back = effects.take_back && core.take_back(lease);
        if effects.end_claim {
            core.end_claim(lease);
        }
        if effects.first_byte.is_some() {
            lease.first_byte();
            core.decoding(lease, at);
        }
        // A lease moved after its request ended holds no slot either.
        if held.life.released() {
            lease.release();
        }
        if effects.outcome.is_some() {
            // Only this entry: the id may be taken again by a request decided since.
            let _ = self.entries.pin().remove_if(id, |_, e| Arc::ptr_eq(e, entry));
        }
        Heard {
            id: id.to_string(),
            lease: held.lease.clone(),
            retried_from,
            effects,
            took_back,
            decider: held.decider,
            prefill: held.prefill.clone(),
        }
    }

    /// Stops tracking a request (releasing its lease) and returns its lease.
    pub fn forget(&self, id: &str) -> Option<Arc<Lease>> {
        let entry = self.entries.pin().remove(id)?.clone();
        let lease = lock(&entry).lease.clone();
        lease.release();
        Some(lease)
    }

    /// Requests tracked now.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether none is tracked.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

fn lock(entry: &Mutex<Entry>) -> std::sync::MutexGuard<'_, Entry> {
    entry.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests;
