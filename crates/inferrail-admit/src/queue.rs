//! The wait queue of one model's requests while its fleet is busy, ordered
//! by priority band and, within a band, fairly across tenants by virtual
//! token counters (VTC, ADR 0042).
//!
//! Bands go strictly in order: nothing waits in a band while a more urgent
//! one has a request waiting. Within a band each tenant with requests
//! waiting has a counter of the prompt tokens it was admitted from the
//! queue, divided by its weight; the tenant with the lowest counter goes
//! next (ties: the oldest first request), its requests first come first
//! served. A tenant that starts waiting is lifted to the lowest counter of
//! those waiting (or, with none waiting, to the band's virtual time, the
//! counter the last admitted request started at), so a tenant that was
//! quiet banks no credit, and one that floods the band gets its share and
//! no more. Counters are forgotten when the band empties.
//!
//! The queue is bounded in requests and prompt tokens. An arrival that
//! would overflow it pushes out the requests that would be admitted last
//! (least urgent band, then the tenant furthest ahead of its share,
//! newest first), or is refused itself when it would be among them.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::Duration;

/// A waiting request's id, unique among those waiting.
pub type Id = u64;

/// A request waiting.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// Its id.
    pub id: Id,
    /// Its band: 0 is the most urgent.
    pub band: usize,
    /// Its tenant.
    pub tenant: String,
    /// Its tenant's weight (positive): its share of the band.
    pub weight: f64,
    /// Its prompt tokens.
    pub tokens: u64,
    /// When it arrived.
    pub at: Duration,
}

/// How much may wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// Requests.
    pub requests: usize,
    /// Prompt tokens.
    pub tokens: u64,
}

/// The arrival does not fit, and it would be the first pushed out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Full;

#[derive(Debug, Default)]
struct Tenant {
    counter: f64,
    weight: f64,
    waiting: VecDeque<Entry>,
}

impl Tenant {
    /// Its counter once everything it has waiting is admitted.
    fn finish(&self) -> f64 {
        self.counter + self.waiting.iter().map(|e| e.tokens as f64).sum::<f64>() / self.weight
    }
}

#[derive(Debug, Default)]
struct Band {
    tenants: BTreeMap<String, Tenant>,
    /// The counter the last request admitted from the band started at.
    virtual_time: f64,
    waiting: usize,
}

/// One model's wait queue.
#[derive(Debug)]
pub struct Queue {
    bands: Vec<Band>,
    bounds: Bounds,
    tokens: u64,
    /// Each waiting request's band and tenant.
    at: HashMap<Id, (usize, String)>,
}

impl Queue {
    /// An empty queue of `bands` bands within `bounds`.
    pub fn new(bands: usize, bounds: Bounds) -> Self {
        Self { bands: (0..bands).map(|_| Band::default()).collect(), bounds, tokens: 0, at: HashMap::new() }
    }

    /// Takes new bounds: what waits stays, later arrivals fit the new ones.
    pub fn set_bounds(&mut self, bounds: Bounds) {
        self.bounds = bounds;
    }

    /// Requests waiting.
    pub fn len(&self) -> usize {
        self.at.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.at.is_empty()
    }

    /// Prompt tokens waiting.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Whether `id` is waiting.
    pub fn contains(&self, id: Id) -> bool {
        self.at.contains_key(&id)
    }

    /// Requests and tokens waiting, by band and tenant.
    pub fn waiting(&self) -> impl Iterator<Item = (usize, &str, usize, u64)> {
        self.bands.iter().enumerate().flat_map(|(b, band)| {
            band.tenants
                .iter()
                .filter(|(_, t)| !t.waiting.is_empty())
                .map(move |(name, t)| (b, name.as_str(), t.waiting.len(), t.waiting.iter().map(|e| e.tokens).sum()))
        })
    }

    /// Whether nothing waits in band `band` or a more urgent one: a request
    /// of that band arriving now may go ahead without waiting.
    pub fn clear_for(&self, band: usize) -> bool {
        self.bands.iter().take(band + 1).all(|b| b.waiting == 0)
    }

    /// The request that goes next.
    pub fn next(&self) -> Option<&Entry> {
        let band = self.bands.iter().find(|b| b.waiting > 0)?;
        band.tenants
            .values()
            .filter_map(|t| t.waiting.front().map(|head| (t.counter, head)))
            .min_by(|(ca, a), (cb, b)| ca.total_cmp(cb).then(a.at.cmp(&b.at)).then(a.id.cmp(&b.id)))
            .map(|(_, head)| head)
    }

    /// Adds `entry` (its band must exist, its id be new and its weight
    /// positive) and returns the requests pushed out to make room, or
    /// refuses it, changing nothing, when it would be pushed out itself.
    pub fn push(&mut self, entry: Entry) -> Result<Vec<Entry>, Full> {
        if entry.tokens > self.bounds.tokens || self.bounds.requests == 0 {
            return Err(Full);
        }
        let (id, b) = (entry.id, entry.band);
        let lifted = {
            let band = &self.bands[b];
            let lowest = band.tenants.values().filter(|t| !t.waiting.is_empty()).map(|t| t.counter).min_by(f64::total_cmp);
            lowest.unwrap_or(band.virtual_time)
        };
        let existed = self.bands[b].tenants.contains_key(&entry.tenant);
        let tenant = self.bands[b].tenants.entry(entry.tenant.clone()).or_default();
        let before = (tenant.counter, tenant.weight);
        if tenant.waiting.is_empty() {
            tenant.counter = tenant.counter.max(lifted);
        }
        tenant.weight = entry.weight;
        tenant.waiting.push_back(entry.clone());
        self.bands[b].waiting += 1;
        self.tokens += entry.tokens;
        self.at.insert(id, (b, entry.tenant.clone()));
        let out = self.overflow();
        if out.contains(&id) {
            if let Some(undone) = self.take(id) {
                let tenants = &mut self.bands[b].tenants;
                match tenants.get_mut(&undone.tenant) {
                    Some(t) if existed => (t.counter, t.weight) = before,
                    _ => drop(tenants.remove(&undone.tenant)),
                }
            }
            self.tidy(b);
            return Err(Full);
        }
        Ok(out.into_iter().filter_map(|victim| self.remove(victim)).collect())
    }

    /// The requests to push out for the queue to fit its bounds, the one
    /// that would be admitted last first.
    fn overflow(&self) -> Vec<Id> {
        let (mut len, mut tokens) = (self.len(), self.tokens);
        if len <= self.bounds.requests && tokens <= self.bounds.tokens {
            return Vec::new();
        }
        let mut last_first: Vec<(usize, f64, &Entry)> = self
            .bands
            .iter()
            .enumerate()
            .flat_map(|(b, band)| band.tenants.values().flat_map(move |t| t.waiting.iter().map(move |e| (b, t.finish(), e))))
            .collect();
        last_first.sort_by(|(ba, fa, a), (bb, fb, b)| bb.cmp(ba).then(fb.total_cmp(fa)).then(b.at.cmp(&a.at)).then(b.id.cmp(&a.id)));
        let mut out = Vec::new();
        for (_, _, e) in last_first {
            if len <= self.bounds.requests && tokens <= self.bounds.tokens {
                break;
            }
            out.push(e.id);
            len -= 1;
            tokens -= e.tokens;
        }
        out
    }

    /// Takes `id` out because it was admitted: its tenant's counter grows by
    /// its tokens over its weight.
    pub fn admit(&mut self, id: Id) -> Option<Entry> {
        let e = self.take(id)?;
        let band = &mut self.bands[e.band];
        if let Some(t) = band.tenants.get_mut(&e.tenant) {
            band.virtual_time = band.virtual_time.max(t.counter);
            t.counter += e.tokens as f64 / t.weight;
        }
        self.tidy(e.band);
        Some(e)
    }

    /// Takes `id` out unadmitted (its client left, its wait ran out, it was
    /// pushed out): nobody is charged.
    pub fn remove(&mut self, id: Id) -> Option<Entry> {
        let e = self.take(id)?;
        self.tidy(e.band);
        Some(e)
    }

    fn take(&mut self, id: Id) -> Option<Entry> {
        let (b, tenant) = self.at.remove(&id)?;
        let band = &mut self.bands[b];
        let t = band.tenants.get_mut(&tenant)?;
        let i = t.waiting.iter().position(|e| e.id == id)?;
        let e = t.waiting.remove(i)?;
        band.waiting -= 1;
        self.tokens -= e.tokens;
        Some(e)
    }

    /// Forgets the band's counters once nothing waits in it.
    fn tidy(&mut self, b: usize) {
        if self.bands[b].waiting == 0 {
            self.bands[b].tenants.clear();
        }
    }
}

#[cfg(test)]
mod tests;
