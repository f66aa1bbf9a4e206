//! Reloads and discovery changes, as a pure difference and then its
//! application. [`refused_sections`] says which sections of a new routing
//! YAML differ in ways that need a restart; [`Router::listed`] plans which
//! listed replicas are kept (with everything learned of them), which join
//! cold and which leave; [`ReplicaPlan::apply`] carries that out on the
//! core; [`Router::publish`] swaps in the fleet every discovery source
//! wants together.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use inferrail_config::{Config, ReplicaKvEvents, Serving};
use inferrail_route::BadParams;
use inferrail_route::fleet::{Fleet, Replica};

use super::{Router, Routing, STATIC};
use crate::decision::Reloaded;

/// Why a reload was refused; the configuration in force stays.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// Sections that only a restart changes.
    #[error("only models, replicas and policy parameters reload; {} changed otherwise and need a restart", .0.join(", "))]
    NeedsRestart(Vec<&'static str>),
    /// A replica whose address is not `ip:port`.
    #[error("replica `{id}`: `{address}` is not an ip:port address")]
    BadAddress {
        /// The replica.
        id: String,
        /// Its address as written.
        address: String,
    },
    /// A new or changed model's tokenizer did not load.
    #[error("{0:#}")]
    Tokenizer(anyhow::Error),
    /// A model's policy parameters could not be read.
    #[error(transparent)]
    Params(#[from] BadParams),
}

/// Every name clients may use for `config`'s models (theirs, their aliases
/// and their adapters'), to the model's slot.
pub fn names_of(config: &Config, slots: &[usize]) -> HashMap<String, usize> {
    let mut names = HashMap::new();
    for (m, &slot) in config.models.iter().zip(slots) {
        for n in std::iter::once(&m.name).chain(&m.aliases).chain(&m.adapters) {
            names.insert(n.clone(), slot);
        }
    }
    names
}

/// The slots `names` gives the models named (unknown names left out).
pub fn slots_of(names: &HashMap<String, usize>, models: &[String]) -> Vec<usize> {
    models.iter().filter_map(|m| names.get(m).copied()).collect()
}

/// The sections of `new` that differ from `old` beyond what reloads
/// (models, replicas, policy parameters, admission); empty when it may reload.
pub fn refused_sections(old: &Config, new: &Config) -> Vec<&'static str> {
    let fixed = |c: &Config| {
        let mut c = Config { replicas: Vec::new(), ..c.clone() };
        c.routing.policies = Default::default();
        c.models = Vec::new();
        c.admission = Default::default();
        c
    };
    let (n, o) = (fixed(new), fixed(old));
    let mut differ = [
        ("server", n.server != o.server),
        ("admin", n.admin != o.admin),
        ("routing", n.routing != o.routing),
        ("retry", n.retry != o.retry),
        ("health", n.health != o.health),
        ("tokenizer", n.tokenizer != o.tokenizer),
        ("kv", n.kv != o.kv),
        ("kv_events", n.kv_events != o.kv_events),
        ("load", n.load != o.load),
        ("observability", n.observability != o.observability),
        ("discovery", n.discovery != o.discovery),
        ("kubernetes", n.kubernetes != o.kubernetes),
        ("eds", n.eds != o.eds),
        ("peers", n.peers != o.peers),
    ]
    .into_iter()
    .filter_map(|(name, changed)| changed.then_some(name))
    .collect::<Vec<_>>();
    if differ.is_empty() && n != o {
        differ.push("another section");
    }
    differ
}

/// A listed replica that joins cold: its entry, address and models' slots,
/// and the replica of the same id it replaces, if any.
pub struct Joining<'a> {
    entry: &'a inferrail_config::Replica,
    addr: SocketAddr,
    models: Vec<usize>,
    replaces: Option<Arc<Replica>>,
}

/// What a new replica list does to the current one, in the list's order.
pub struct ReplicaPlan<'a> {
    /// Each listed replica: kept (with its entry) or joining.
    next: Vec<Result<(Arc<Replica>, &'a inferrail_config::Replica), Joining<'a>>>,
    /// Current replicas no longer listed.
    left: Vec<Arc<Replica>>,
}

impl ReplicaPlan<'_> {
    /// Counts it into `done`.
    pub fn count(&self, done: &mut Reloaded) {
        done.kept += self.next.iter().filter(|n| n.is_ok()).count();
        done.joined += self.next.iter().filter(|n| n.is_err()).count();
        done.left += self.left.len();
    }

    /// Carries it out: the kept take their new limits, the replaced and the
    /// gone leave the core, the joining start cold. Every one takes its drain.
    pub fn apply(self, router: &Router) -> Vec<Arc<Replica>> {
        let mut out = Vec::with_capacity(self.next.len());
        for n in self.next {
            let (replica, entry) = match n {
                Ok((kept, entry)) => {
                    kept.set_limits(entry.serving.limits());
                    kept.set_prefill(entry.serving.prefill);
                    kept.set_role(entry.serving.role);
                    (kept, entry)
                }
                Err(j) => {
                    if let Some(before) = &j.replaces {
                        router.core.leave(before);
                    }
                    let r = router.cold_replica(j.entry.id.clone(), j.addr, j.models, &j.entry.serving, j.entry.kv_events.clone());
                    (r, j.entry)
                }
            };
            replica.set_draining(entry.drain);
            out.push(replica);
        }
        for gone in &self.left {
            router.core.leave(gone);
        }
        out
    }
}

impl Router {
    /// The replicas discovery source `source` wants now (the routing YAML's
    /// list is [`STATIC`], a DNS group `dns:<group>`): the fleet becomes the
    /// union of every source's, in the order sources first published,
    /// swapped whole.
    pub fn publish(&self, source: &str, replicas: Vec<Arc<Replica>>) {
        let mut sources = self.sources.lock().unwrap_or_else(|p| p.into_inner());
        let fleet = self.wanted(&mut sources, source, replicas);
        self.routing.rcu(|r| Routing { fleet: fleet.clone(), ..Routing::clone(r) });
    }

    /// Puts `replicas` as what `source` wants into `sources`; returns the fleet that makes.
    fn wanted(&self, sources: &mut Vec<(String, Vec<Arc<Replica>>)>, source: &str, replicas: Vec<Arc<Replica>>) -> Arc<Fleet> {
        match sources.iter_mut().find(|(s, _)| s == source) {
            Some((_, wanted)) => *wanted = replicas,
            None => sources.push((source.to_string(), replicas)),
        }
        let all = sources.iter().flat_map(|(_, r)| r).cloned().collect();
        Arc::new(Fleet::new(all, self.core.models().len()))
    }

    /// Applies a new, validated configuration: its models and replicas,
    /// each swapped whole. Models are known by name: one whose entry and
    /// parameters are unchanged keeps its policy's state and tokenizer,
    /// wherever it now stands in the file; one that changed, or is new,
    /// starts fresh (a new or changed tokenizer is loaded first, and a load
    /// that fails refuses the whole file); one removed is no longer
    /// offered. A replica that keeps its id, address, models, cache shape
    /// and KV events keeps everything learned of it (requests in flight,
    /// health, its KV index entry) and takes the new limits and drain; one
    /// that changed starts cold, like a new one; one gone is forgotten once
    /// its requests are over (their leases hold it). Anything else
    /// differing from the configuration in force (the listeners,
    /// `routing.seed`, ...) is refused with the sections that differ, and
    /// nothing changes.
    pub fn reload(&self, new: Config) -> Result<Reloaded, ReloadError> {
        let old = self.config();
        let differ = refused_sections(&old, &new);
        if !differ.is_empty() {
            return Err(ReloadError::NeedsRestart(differ));
        }
        // Slots never move nor go: a request that read a name before the swap finds its model after it.
        let slots = self.core.slots(&new);
        let names = Arc::new(names_of(&new, &slots));
        let mut sources = self.sources.lock().unwrap_or_else(|p| p.into_inner());
        let current = sources.iter().find(|(s, _)| s == STATIC).map(|(_, r)| r.clone()).unwrap_or_default();
        let plan = self.listed(&new.replicas, &names, &current)?;
        let tokenizers = self.prompts.load_for(&old, &new, &slots).map_err(ReloadError::Tokenizer)?;
        let models = self.core.reload_models(&old, &new, &slots)?;
        self.prompts.swap(tokenizers);
        // The new models are in their slots, unnamed; one swap names them, with their replicas.
        let mut done = Reloaded { models, ..Reloaded::default() };
        plan.count(&mut done);
        let next = plan.apply(self);
        let fleet = self.wanted(&mut sources, STATIC, next);
        self.admission.reload(&new);
        self.routing.store(Arc::new(Routing { config: Arc::new(new), names, fleet }));
        Ok(done)
    }

    /// Plans the replicas `listed` names against `current`: each of
    /// `current` whose identity holds (the same id, address, models, cache
    /// shape and KV events) is kept; the others are new and cold;
    /// `current`'s others leave. Changes nothing.
    pub fn listed<'a>(
        &self,
        listed: &'a [inferrail_config::Replica],
        names: &HashMap<String, usize>,
        current: &[Arc<Replica>],
    ) -> Result<ReplicaPlan<'a>, ReloadError> {
        let mut next = Vec::with_capacity(listed.len());
        for r in listed {
            let addr: SocketAddr =
                r.address.parse().map_err(|_| ReloadError::BadAddress { id: r.id.clone(), address: r.address.clone() })?;
            let s = &r.serving;
            let models = slots_of(names, &s.models);
            let same = |c: &&Arc<Replica>| {
                c.id == r.id && c.addr == addr && c.models == models && c.cache == s.cache() && c.kv_events == r.kv_events
            };
            next.push(match current.iter().find(same) {
                Some(kept) => Ok((kept.clone(), r)),
                None => Err(Joining { entry: r, addr, models, replaces: current.iter().find(|c| c.id == r.id).cloned() }),
            });
        }
        let left = current.iter().filter(|c| !listed.iter().any(|n| n.id == c.id)).cloned().collect();
        Ok(ReplicaPlan { next, left })
    }

    /// A new replica serving `models` (slots) with `serving`'s limits and cache shape, with a cold KV slot.
    pub fn cold_replica(
        &self,
        id: String,
        addr: SocketAddr,
        models: Vec<usize>,
        serving: &Serving,
        kv_events: Option<ReplicaKvEvents>,
    ) -> Arc<Replica> {
        let slot = self.core.kv.slot(&id);
        let r = Arc::new(Replica::new(id, addr, models, serving.limits(), serving.cache(), slot).with_kv_events(kv_events));
        r.set_prefill(serving.prefill);
        r.set_role(serving.role);
        if self.hold_joiners.probe.load(std::sync::atomic::Ordering::Relaxed) {
            r.hold_until_probed(self.hold_joiners.eds.load(std::sync::atomic::Ordering::Relaxed));
        }
        self.core.join(&r);
        r
    }
}
