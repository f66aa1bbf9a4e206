//! Admission at the router (ADR 0042): who a request is (its API key's
//! tenant, or the tenant it names), which band it is in and whether it may
//! be, whether its tenant has tokens left in its windows, and, while its
//! model's fleet is busy, its place in the model's wait queue
//! ([`inferrail_admit`] holds the rules). The router decides when the
//! fleet is busy (`Router::decide`); this module wakes the request the
//! queue says goes next whenever a slot is given back or a first byte
//! comes, and every [`RECHECK`] while any request waits.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use inferrail_admit::keys::{self, Keys};
use inferrail_admit::limit::{Meter, Window};
use inferrail_admit::queue::{Bounds, Entry, Full, Id, Queue};
use inferrail_config::{Admission as Settings, Band, Config, OnMiss};
use tokio::sync::Notify;

use crate::decision::RouteError;

/// How often the request at a queue's head looks again without being woken
/// (estimates fall as prefill completes, which no event announces).
pub const RECHECK: Duration = Duration::from_millis(20);

/// The tenant of a request that presents no key and names none.
pub const ANONYMOUS: &str = "anonymous";

/// What the request's headers ask for.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Asked {
    /// `Authorization`.
    pub authorization: Option<String>,
    /// `x-inferrail-band`.
    pub band: Option<String>,
    /// `x-inferrail-tenant`.
    pub tenant: Option<String>,
    /// `x-gateway-inference-objective`: an Inference Extension `InferenceObjective`'s name.
    pub objective: Option<String>,
}

impl Asked {
    /// Nothing asked.
    pub const NONE: Asked = Asked { authorization: None, band: None, tenant: None, objective: None };
}

/// Who a request is, once its key is checked.
#[derive(Debug, Clone)]
pub struct Who {
    /// Its tenant.
    pub tenant: String,
    /// The bands its key allows (all when empty), its default first.
    allowed: Vec<String>,
}

/// A request's band, once its model is known.
#[derive(Debug, Clone)]
pub struct Placed {
    /// Its tenant.
    pub tenant: String,
    /// Its band's index and settings, when bands are configured.
    pub band: Option<(usize, Band)>,
}

impl Placed {
    /// The estimate its band holds it for being above.
    pub fn objective(&self) -> Option<Duration> {
        self.band.as_ref()?.1.ttft_objective_ms.map(Duration::from_millis)
    }

    /// The part of the replicas its band may use.
    pub fn replica_share(&self) -> f64 {
        self.band.as_ref().map_or(1.0, |b| b.1.replica_share)
    }

    /// Whether an estimated time to first token misses its band's objective.
    pub fn misses(&self, estimate: Duration) -> bool {
        self.objective().is_some_and(|o| estimate > o)
    }

    /// The shed (counted) of a request whose best estimate misses its
    /// band's objective, when the band sheds rather than waits.
    pub fn shed_on_miss(&self, estimate: Duration) -> Option<Shed> {
        let (_, band) = self.band.as_ref()?;
        let objective = self.objective()?;
        (band.on_miss == OnMiss::Shed && estimate > objective).then(|| {
            shed_metric("over_objective", &band.name);
            Shed::OverObjective { estimate, objective }
        })
    }
}

/// The settings in force, with the keys by digest, the tenants by name and
/// the models' bands by model name.
struct Rules {
    settings: Settings,
    keys: Keys<usize>,
    tenants: HashMap<String, (f64, Vec<Window>)>,
    model_bands: HashMap<String, String>,
}

impl Rules {
    fn new(config: &Config) -> Self {
        let settings = &config.admission;
        let keys = Keys::new(settings.keys.iter().enumerate().filter_map(|(i, k)| Some((keys::parse_hex(&k.sha256)?, i))));
        let tenants = settings
            .tenants
            .iter()
            .map(|t| {
                let windows = t.limits.iter().map(|l| Window { tokens: l.tokens, span: Duration::from_millis(l.window_ms) }).collect();
                (t.name.clone(), (t.weight, windows))
            })
            .collect();
        let model_bands = config.models.iter().filter_map(|m| Some((m.name.clone(), m.band.clone()?))).collect();
        Self { settings: settings.clone(), keys, tenants, model_bands }
    }

    /// Whether one of the keys stands for `tenant`.
    fn keyed(&self, tenant: &str) -> bool {
        self.settings.keys.iter().any(|k| k.tenant == tenant)
    }

    /// The tenant as a metric label: a configured tenant or a key's by
    /// name, any other (a name a client made up) as `other`.
    fn label(&self, tenant: &str) -> String {
        let known = self.tenants.contains_key(tenant) || self.keyed(tenant) || tenant == ANONYMOUS;
        if known { tenant.to_owned() } else { "other".to_owned() }
    }

    fn weight(&self, tenant: &str) -> f64 {
        self.tenants.get(tenant).map_or(1.0, |t| t.0)
    }

    fn windows(&self, tenant: &str) -> &[Window] {
        self.tenants.get(tenant).map_or(&[], |t| &t.1)
    }
}

#[derive(Default)]
struct State {
    /// Each model's wait queue, by slot.
    queues: HashMap<usize, Queue>,
    /// Each waiting request's wake-up.
    waiting: HashMap<Id, Arc<Notify>>,
    /// Each limited tenant's charges.
    meters: HashMap<String, Meter>,
    /// Requests in flight whose tenant has limits: their output tokens are charged when their usage comes.
    charged: HashMap<String, String>,
    next_id: Id,
}

/// Admission: the rules in force and the queues.
pub struct Admission {
    rules: ArcSwap<Rules>,
    state: Mutex<State>,
    /// The pool's `InferenceObjective`s' priorities by name, as Kubernetes has them.
    priorities: ArcSwap<HashMap<String, i64>>,
}

impl Admission {
    /// Admission under `config`'s rules.
    pub fn new(config: &Config) -> Self {
        Self { rules: ArcSwap::from_pointee(Rules::new(config)), state: Mutex::new(State::default()), priorities: ArcSwap::default() }
    }

    /// Takes a reloaded configuration's rules. While the bands stay the
    /// same (names and order), requests waiting keep their place and the
    /// queues take the new bounds; when they change, the queues are
    /// emptied and their requests shed (503), since their places were in
    /// bands that are no longer there.
    pub fn reload(&self, config: &Config) {
        let names = |s: &Settings| s.bands.iter().map(|b| b.name.clone()).collect::<Vec<_>>();
        let same_bands = names(&self.rules.load().settings) == names(&config.admission);
        self.rules.store(Arc::new(Rules::new(config)));
        let a = &config.admission;
        let bounds = Bounds { requests: a.max_queued_requests, tokens: a.max_queued_tokens };
        let mut state = self.lock();
        if same_bands {
            state.queues.values_mut().for_each(|q| q.set_bounds(bounds));
        } else {
            state.queues.clear();
            // Each finds itself gone and is shed.
            state.waiting.values().for_each(|n| n.notify_one());
        }
    }

    /// Takes the pool's `InferenceObjective`s' priorities, by name.
    pub fn set_priorities(&self, priorities: HashMap<String, i64>) {
        self.priorities.store(Arc::new(priorities));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Who the request is: its key's tenant, or the one it names when it
    /// presents none and keys are optional. A key that is not one of the
    /// configured ones is refused whether or not keys are required, and so
    /// is a request naming a tenant that has keys without presenting one
    /// (it would spend that tenant's limits and share).
    pub fn identify(&self, asked: &Asked) -> Result<Who, RouteError> {
        let rules = self.rules.load();
        let presented = asked.authorization.as_deref().and_then(keys::bearer);
        match presented {
            Some(key) if !rules.keys.is_empty() => {
                let &i = rules.keys.find(key).ok_or(RouteError::Unauthorized)?;
                let k = &rules.settings.keys[i];
                Ok(Who { tenant: k.tenant.clone(), allowed: k.bands.clone() })
            }
            _ if rules.settings.require_keys => Err(RouteError::Unauthorized),
            _ if asked.tenant.as_deref().is_some_and(|t| rules.keyed(t)) => Err(RouteError::Unauthorized),
            _ => Ok(Who { tenant: asked.tenant.clone().unwrap_or_else(|| ANONYMOUS.into()), allowed: Vec::new() }),
        }
    }

    /// The request's band: the one it names (by name, or by
    /// `InferenceObjective`: a band's `objectives`, else the objective's
    /// priority against the bands' `min_priority`), else its key's default, else its model's,
    /// else the configured default, else the last; refused when its key
    /// does not allow it. `model` is the engines' name for its model.
    pub fn place(&self, who: Who, asked: &Asked, model: &str) -> Result<Placed, RouteError> {
        let rules = self.rules.load();
        let s = &rules.settings;
        if s.bands.is_empty() {
            return Ok(Placed { tenant: who.tenant, band: None });
        }
        // An objective a band names, else one of the pool's by its priority.
        let by_objective = || {
            let name = asked.objective.as_deref()?;
            s.bands.iter().position(|b| b.objectives.iter().any(|n| n == name)).or_else(|| {
                let priority = *self.priorities.load().get(name)?;
                s.bands.iter().position(|b| b.min_priority.is_some_and(|m| priority >= m))
            })
        };
        let named = match &asked.band {
            Some(name) => Some(s.band(name).ok_or_else(|| RouteError::UnknownBand(name.clone()))?),
            None => by_objective(),
        };
        let model_band = rules.model_bands.get(model).map(String::as_str);
        let fallback = who.allowed.first().map(String::as_str).or(model_band).or(s.default_band.as_deref());
        let index = named.or_else(|| fallback.and_then(|n| s.band(n))).unwrap_or(s.bands.len() - 1);
        let band = s.bands[index].clone();
        if !who.allowed.is_empty() && !who.allowed.contains(&band.name) {
            return Err(RouteError::BandNotAllowed(band.name));
        }
        Ok(Placed { tenant: who.tenant, band: Some((index, band)) })
    }

    /// Charges a request of `prompt_tokens` to its tenant's limits at `now`,
    /// or refuses it (429) with the time until the tenant's windows free.
    pub fn limit(&self, placed: &Placed, prompt_tokens: u64, now: Duration) -> Result<(), RouteError> {
        let rules = self.rules.load();
        let windows = rules.windows(&placed.tenant);
        if windows.is_empty() {
            return Ok(());
        }
        let mut state = self.lock();
        let meter = state.meters.entry(placed.tenant.clone()).or_default();
        if let Err(retry_after) = meter.check(now, windows) {
            metrics::counter!("inferrail_admission_limited_total", "tenant" => placed.tenant.clone()).increment(1);
            return Err(RouteError::RateLimited { tenant: placed.tenant.clone(), retry_after });
        }
        meter.charge(now, prompt_tokens);
        metrics::counter!("inferrail_admission_charged_tokens_total", "tenant" => placed.tenant.clone(), "kind" => "prompt")
            .increment(prompt_tokens);
        Ok(())
    }

    /// A request of a tenant with limits was decided under `request_id`:
    /// its output tokens are charged when its usage comes. Returns whether
    /// they will be (whether its usage is wanted).
    pub fn decided(&self, placed: &Placed, request_id: &str) -> bool {
        let limited = !self.rules.load().windows(&placed.tenant).is_empty();
        if limited {
            self.lock().charged.insert(request_id.to_owned(), placed.tenant.clone());
        }
        limited
    }

    /// A request's usage came: its output tokens count against its tenant's limits.
    pub fn usage(&self, request_id: &str, completion_tokens: u64, now: Duration) {
        let mut state = self.lock();
        if let Some(tenant) = state.charged.remove(request_id)
            && let Some(meter) = state.meters.get_mut(&tenant)
        {
            meter.charge(now, completion_tokens);
            metrics::counter!("inferrail_admission_charged_tokens_total", "tenant" => tenant, "kind" => "output")
                .increment(completion_tokens);
        }
    }

    /// A request is over: nothing more is charged for it.
    pub fn over(&self, request_id: &str) {
        let mut state = self.lock();
        if !state.charged.is_empty() {
            state.charged.remove(request_id);
        }
    }

    /// Whether a request of `placed`'s band may go ahead of the queue for
    /// model `model`: nothing waits in its band or a more urgent one.
    pub fn clear_for(&self, model: usize, placed: &Placed) -> bool {
        let Some((band, _)) = placed.band else { return true };
        self.lock().queues.get(&model).is_none_or(|q| q.clear_for(band))
    }

    /// Puts a request in model `model`'s queue, pushing out what would go
    /// last if it is full, or refuses it (503) when it would go last itself.
    pub fn enter(&self, model: usize, placed: &Placed, tokens: u64, now: Duration) -> Result<Ticket<'_>, RouteError> {
        let rules = self.rules.load();
        // Only a request in a band waits; without bands there is no queue to enter.
        let Some((band, settings)) = placed.band.clone() else { return Err(RouteError::Shed(Shed::QueueFull)) };
        let mut state = self.lock();
        let id = state.next_id;
        state.next_id += 1;
        let s = &rules.settings;
        let bounds = Bounds { requests: s.max_queued_requests, tokens: s.max_queued_tokens };
        let queue = state.queues.entry(model).or_insert_with(|| Queue::new(s.bands.len(), bounds));
        let entry = Entry { id, band, tenant: placed.tenant.clone(), weight: rules.weight(&placed.tenant), tokens, at: now };
        let pushed_out = queue.push(entry).map_err(|Full| {
            shed_metric("queue_full", &settings.name);
            RouteError::Shed(Shed::QueueFull)
        })?;
        let notify = Arc::new(Notify::new());
        state.waiting.insert(id, notify.clone());
        for e in pushed_out {
            // Its own wake finds it gone and sheds it.
            if let Some(n) = state.waiting.get(&e.id) {
                n.notify_one();
            }
        }
        metrics::counter!("inferrail_admission_queued_total", "band" => settings.name.clone()).increment(1);
        let deadline = now + Duration::from_millis(settings.max_wait_ms);
        let tenant = rules.label(&placed.tenant);
        metrics::gauge!("inferrail_admission_waiting", "band" => settings.name.clone(), "tenant" => tenant.clone()).increment(1.0);
        Ok(Ticket { admission: self, model, id, notify, entered: now, deadline, band: settings.name, tenant })
    }

    /// Wakes the request at the head of every queue: a slot came back or a
    /// first byte came, and it may fit now.
    pub fn kick(&self) {
        let state = self.lock();
        if state.waiting.is_empty() {
            return;
        }
        for q in state.queues.values() {
            if let Some(n) = q.next().and_then(|e| state.waiting.get(&e.id)) {
                n.notify_one();
            }
        }
    }

    /// Where a request of `placed`'s band would stand in model `model`'s
    /// queue now: requests waiting in its band and more urgent ones.
    pub fn ahead(&self, model: usize, placed: &Placed) -> usize {
        let Some((band, _)) = placed.band else { return 0 };
        let state = self.lock();
        state.queues.get(&model).map_or(0, |q| q.waiting().filter(|w| w.0 <= band).map(|w| w.2).sum())
    }
}

/// Why a request was shed (503).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shed {
    /// The queue was full and it would have gone last.
    QueueFull,
    /// Its wait ran out (or it was pushed out for a more urgent request).
    Waited(Duration),
    /// The best replica's estimate missed its band's objective, which sheds rather than waits.
    OverObjective {
        /// The best replica's estimated time to first token.
        estimate: Duration,
        /// The band's objective.
        objective: Duration,
    },
}

impl Shed {
    /// A short label for metrics.
    pub fn label(self) -> &'static str {
        match self {
            Self::QueueFull => "queue_full",
            Self::Waited(_) => "waited",
            Self::OverObjective { .. } => "over_objective",
        }
    }

    /// When to try again.
    pub fn retry_after(self) -> Duration {
        match self {
            Self::QueueFull | Self::Waited(_) => Duration::from_secs(1),
            Self::OverObjective { estimate, objective } => estimate.saturating_sub(objective),
        }
    }
}

impl std::fmt::Display for Shed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::QueueFull => write!(f, "The router's queue for this model is full; try again later."),
            Self::Waited(w) => write!(f, "No replica could take the request within {} ms; try again later.", w.as_millis()),
            Self::OverObjective { estimate, objective } => write!(
                f,
                "The earliest first token is estimated at {} ms, past this band's {} ms objective; try again later.",
                estimate.as_millis(),
                objective.as_millis()
            ),
        }
    }
}

fn shed_metric(reason: &'static str, band: &str) {
    metrics::counter!("inferrail_admission_shed_total", "reason" => reason, "band" => band.to_owned()).increment(1);
}

/// A request waiting in a queue; dropping it (the client left, the wait
/// ran out) takes it out and wakes the next.
pub struct Ticket<'a> {
    admission: &'a Admission,
    model: usize,
    id: Id,
    notify: Arc<Notify>,
    entered: Duration,
    deadline: Duration,
    band: String,
    /// Its tenant as a metric label.
    tenant: String,
}

impl Ticket<'_> {
    /// How long it may wait in all.
    pub fn max_wait(&self) -> Duration {
        self.deadline - self.entered
    }

    /// Whether it goes next in its queue.
    pub fn is_next(&self) -> bool {
        let state = self.admission.lock();
        state.queues.get(&self.model).and_then(Queue::next).is_some_and(|e| e.id == self.id)
    }

    /// Waits until it is woken or [`RECHECK`] passes, at `now`; refused
    /// (503) once its wait has run out or it was pushed out.
    pub async fn wait(&self, now: Duration) -> Result<(), RouteError> {
        let waited = now.saturating_sub(self.entered);
        let gone = !self.admission.lock().queues.get(&self.model).is_some_and(|q| q.contains(self.id));
        if gone || now >= self.deadline {
            shed_metric(if gone { "pushed_out" } else { "waited" }, &self.band);
            return Err(RouteError::Shed(Shed::Waited(waited)));
        }
        let _ = tokio::time::timeout(RECHECK.min(self.deadline - now), self.notify.notified()).await;
        Ok(())
    }

    /// It goes: its tenant is charged its turn, and the next is woken.
    /// Returns how long it waited.
    pub fn admitted(self, now: Duration) -> Duration {
        let waited = now.saturating_sub(self.entered);
        metrics::histogram!("inferrail_admission_wait_seconds", "band" => self.band.clone(), "tenant" => self.tenant.clone())
            .record(waited.as_secs_f64());
        if let Some(q) = self.admission.lock().queues.get_mut(&self.model) {
            q.admit(self.id);
        }
        // Dropping it wakes the next.
        waited
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        {
            let mut state = self.admission.lock();
            state.waiting.remove(&self.id);
            if let Some(q) = state.queues.get_mut(&self.model) {
                q.remove(self.id);
            }
        }
        metrics::gauge!("inferrail_admission_waiting", "band" => self.band.clone(), "tenant" => self.tenant.clone()).decrement(1.0);
        self.admission.kick();
    }
}

#[cfg(test)]
mod tests;
