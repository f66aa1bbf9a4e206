//! Kubernetes discovery: the ready pods an InferencePool selects become
//! replicas, published to the router as `k8s:<pool>`.
//!
//! The pool (`inference.networking.k8s.io/v1`) and its pods are watched
//! with kube's watcher, never polled: it lists, then watches from the
//! list's resourceVersion, resumes a dropped watch from the last version it
//! saw, and lists again when the server answers 410 Gone; a relist replaces
//! what was known only once it is complete. The pool's selector and first
//! target port say which pods and where: a pod counts while it has an IP,
//! its Ready condition is true and it is not being deleted.
//!
//! A replica's identity is its pod (by uid), not its address: a new pod on
//! a reused IP, or under a reused name, starts with a cold KV index. A pod's
//! KV events come from its `inferrail.io/kv-events` annotation (and
//! `inferrail.io/kv-events-replay`), else from the `kv_events` template
//! with `{host}` its IP. A pod
//! that leaves is offered no new request; its requests in flight finish
//! on it, holding it through their leases.
//!
//! The pool's `InferenceObjective`s (`inference.networking.x-k8s.io/v1alpha2`)
//! are watched too: their priorities place requests that name them in
//! admission bands (`min_priority`, ADR 0042).

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use futures_util::StreamExt;
use inferrail_config::{KubernetesPool, ReplicaKvEvents};
use inferrail_route::fleet::Replica;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};

use crate::router::Router;

/// What routing reads of an InferencePool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolSpec {
    /// `spec.selector.matchLabels`.
    pub selector: BTreeMap<String, String>,
    /// The first of `spec.targetPorts`.
    pub port: u16,
}

impl PoolSpec {
    /// Reads a pool object's spec; `None` when it has no selector or port.
    pub fn read(pool: &DynamicObject) -> Option<Self> {
        let spec = pool.data.get("spec")?;
        let labels = spec.get("selector")?.get("matchLabels")?.as_object()?;
        let selector = labels.iter().filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string()))).collect();
        let port = spec.get("targetPorts")?.get(0)?.get("number")?.as_u64()?;
        Some(Self { selector, port: u16::try_from(port).ok()? })
    }

    fn label_selector(&self) -> String {
        self.selector.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",")
    }
}

/// What routing reads of a pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodView {
    /// `metadata.uid`: its identity.
    pub uid: String,
    /// `metadata.name`: the replica's id.
    pub name: String,
    /// `status.podIP`.
    pub ip: Option<IpAddr>,
    /// Its Ready condition is true and it is not being deleted.
    pub ready: bool,
    /// Its KV events, from its annotations.
    pub kv_events: Option<ReplicaKvEvents>,
}

/// The pod annotation naming where its engine publishes KV events (`{host}`: its IP).
pub const KV_EVENTS_ANNOTATION: &str = "inferrail.io/kv-events";
/// The pod annotation naming its engine's KV event replay endpoint.
pub const KV_EVENTS_REPLAY_ANNOTATION: &str = "inferrail.io/kv-events-replay";

impl PodView {
    /// Reads a pod.
    pub fn read(pod: &Pod) -> Option<Self> {
        let meta = &pod.metadata;
        let status = pod.status.as_ref();
        let ip = status.and_then(|s| s.pod_ip.as_deref()).and_then(|ip| ip.parse().ok());
        let ready_condition =
            status.and_then(|s| s.conditions.as_ref()).is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
        let ready = ready_condition && meta.deletion_timestamp.is_none();
        let annotation = |key: &str| meta.annotations.as_ref().and_then(|a| a.get(key)).cloned();
        let kv_events = annotation(KV_EVENTS_ANNOTATION).map(|endpoint| ReplicaKvEvents {
            endpoint,
            replay_endpoint: annotation(KV_EVENTS_REPLAY_ANNOTATION),
            topic: None,
            bind: None,
        });
        Some(Self { uid: meta.uid.clone()?, name: meta.name.clone()?, ip, ready, kv_events })
    }
}

/// The pool's current replicas, kept by pod between changes.
pub struct Members {
    source: String,
    config: KubernetesPool,
    current: Vec<(String, Arc<Replica>)>,
}

impl Members {
    /// None yet.
    pub fn new(config: KubernetesPool) -> Self {
        Self { source: format!("k8s:{}", config.pool), config, current: Vec::new() }
    }

    /// Makes the replicas the pods that count under `spec` (none without
    /// one) and publishes them if that changed anything; returns whether it did.
    pub fn apply<'a>(&mut self, router: &Router, spec: Option<&PoolSpec>, pods: impl IntoIterator<Item = &'a PodView>) -> bool {
        let mut wanted: Vec<(&PodView, SocketAddr)> = match spec {
            Some(spec) => pods.into_iter().filter(|p| p.ready).filter_map(|p| Some((p, SocketAddr::new(p.ip?, spec.port)))).collect(),
            None => Vec::new(),
        };
        wanted.sort_by(|a, b| a.0.name.cmp(&b.0.name));
        let next: Vec<(String, Arc<Replica>)> = wanted
            .into_iter()
            .map(|(pod, addr)| {
                let kept = self.current.iter().find(|(uid, r)| *uid == pod.uid && r.addr == addr && r.kv_events == pod.kv_events);
                let replica = kept.map(|(_, r)| r.clone()).unwrap_or_else(|| {
                    // Another pod of the same name (a StatefulSet's, recreated) was another engine.
                    if let Some((_, before)) = self.current.iter().find(|(_, r)| r.id == pod.name) {
                        router.core.leave(before);
                    }
                    router.cold_replica(
                        pod.name.clone(),
                        addr,
                        router.model_slots(&self.config.serving.models),
                        &self.config.serving,
                        pod.kv_events.clone(),
                    )
                });
                (pod.uid.clone(), replica)
            })
            .collect();
        let same = |a: &[(String, Arc<Replica>)], b: &[(String, Arc<Replica>)]| {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| Arc::ptr_eq(&x.1, &y.1))
        };
        if same(&next, &self.current) {
            return false;
        }
        for (_, gone) in self.current.iter().filter(|(_, r)| !next.iter().any(|(_, n)| Arc::ptr_eq(n, r))) {
            if !next.iter().any(|(_, n)| n.id == gone.id) {
                router.core.leave(gone);
            }
        }
        let ids: Vec<&str> = next.iter().map(|(_, r)| r.id.as_str()).collect();
        tracing::info!(pool = %self.config.pool, members = ?ids, "pool membership changed");
        router.publish(&self.source, next.iter().map(|(_, r)| r.clone()).collect());
        self.current = next;
        true
    }
}

/// The InferencePool resource.
fn inference_pools() -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("inference.networking.k8s.io", "v1", "InferencePool"), "inferencepools")
}

/// The InferenceObjective resource.
fn inference_objectives() -> ApiResource {
    let gvk = GroupVersionKind::gvk("inference.networking.x-k8s.io", "v1alpha2", "InferenceObjective");
    ApiResource::from_gvk_with_plural(&gvk, "inferenceobjectives")
}

/// An InferenceObjective's name and priority (unset: 0, as the Inference
/// Extension reads it), when it refers to `pool`.
pub fn objective(object: &DynamicObject, pool: &str) -> Option<(String, i64)> {
    let spec = object.data.get("spec")?;
    (spec.get("poolRef")?.get("name")?.as_str()? == pool).then_some(())?;
    Some((object.metadata.name.clone()?, spec.get("priority").and_then(serde_json::Value::as_i64).unwrap_or(0)))
}

/// Follows the configured pool from the API server this process finds (in
/// a pod, its service account), forever.
pub async fn run(router: Arc<Router>) {
    let Some(config) = router.config().kubernetes.clone() else { return };
    match kube::Client::try_default().await {
        Ok(client) => follow(router, client, config).await,
        Err(e) => tracing::error!(error = %e, "no Kubernetes API server; the pool stays empty"),
    }
}

/// Follows `config`'s pool and its pods through `client`.
pub async fn follow(router: Arc<Router>, client: kube::Client, config: KubernetesPool) {
    let namespace = config.namespace.clone().unwrap_or_else(|| client.default_namespace().to_string());
    let pools: Api<DynamicObject> = Api::namespaced_with(client.clone(), &namespace, &inference_pools());
    let objectives: Api<DynamicObject> = Api::namespaced_with(client.clone(), &namespace, &inference_objectives());
    let pods_api: Api<Pod> = Api::namespaced(client, &namespace);
    let by_name = watcher::Config::default().fields(&format!("metadata.name={}", config.pool));
    let mut pool_events = watcher::watcher(pools, by_name).default_backoff().boxed();
    let mut pod_events = futures_util::stream::pending().boxed();
    let mut objective_events = watcher::watcher(objectives, watcher::Config::default()).default_backoff().boxed();
    // The pool's objectives' priorities by name; while a (re)list is in progress, the one being built.
    let (mut priorities, mut objectives_listing): (HashMap<String, i64>, Option<HashMap<String, i64>>) = (HashMap::new(), None);
    let mut objectives_failing = false;
    let mut members = Members::new(config);
    let mut spec: Option<PoolSpec> = None;
    // Pods by uid; while a (re)list is in progress, the one being built.
    let (mut pods, mut listing): (HashMap<String, PodView>, Option<HashMap<String, PodView>>) = (HashMap::new(), None);
    loop {
        tokio::select! {
            event = pool_events.next() => {
                let read = match event {
                    Some(Ok(Event::Apply(p) | Event::InitApply(p))) => PoolSpec::read(&p),
                    Some(Ok(Event::Delete(_))) => None,
                    Some(Ok(Event::Init | Event::InitDone)) => continue,
                    Some(Err(e)) => {
                        tracing::warn!(error = %e, "watching the InferencePool failed; retrying");
                        continue;
                    }
                    None => return,
                };
                if read == spec {
                    continue;
                }
                spec = read;
                // What the old selector found stands until the new one's list is complete.
                listing = spec.is_some().then(HashMap::new);
                pod_events = match &spec {
                    Some(s) => watcher::watcher(pods_api.clone(), watcher::Config::default().labels(&s.label_selector())).default_backoff().boxed(),
                    None => futures_util::stream::pending().boxed(),
                };
            }
            event = objective_events.next() => {
                match event {
                    Some(Ok(Event::Init)) => objectives_listing = Some(HashMap::new()),
                    Some(Ok(Event::InitApply(o))) => objectives_listing.iter_mut().for_each(|l| l.extend(objective(&o, &members.config.pool))),
                    Some(Ok(Event::InitDone)) => priorities = objectives_listing.take().unwrap_or_default(),
                    Some(Ok(Event::Apply(o))) => {
                        // Changed, or moved to another pool: out, then back in if it is (still) the pool's.
                        if let Some(name) = &o.metadata.name {
                            priorities.remove(name);
                        }
                        priorities.extend(objective(&o, &members.config.pool));
                    }
                    Some(Ok(Event::Delete(o))) => {
                        if let Some(name) = &o.metadata.name {
                            priorities.remove(name);
                        }
                    }
                    Some(Err(e)) => {
                        // Without the CRD (or the right to read it) this fails at every retry: said once.
                        if !objectives_failing {
                            tracing::warn!(error = %e, "watching InferenceObjectives failed; bands by priority wait for them");
                        }
                        objectives_failing = true;
                        continue;
                    }
                    None => return,
                }
                objectives_failing = false;
                if objectives_listing.is_none() {
                    router.admission.set_priorities(priorities.clone());
                }
                continue;
            }
            event = pod_events.next() => {
                match event {
                    Some(Ok(Event::Init)) => {
                        listing = Some(HashMap::new());
                        continue;
                    }
                    Some(Ok(Event::InitApply(p))) => {
                        if let (Some(list), Some(v)) = (listing.as_mut(), PodView::read(&p)) {
                            list.insert(v.uid.clone(), v);
                        }
                        continue;
                    }
                    Some(Ok(Event::InitDone)) => pods = listing.take().unwrap_or_default(),
                    Some(Ok(Event::Apply(p))) => {
                        if let Some(v) = PodView::read(&p) {
                            pods.insert(v.uid.clone(), v);
                        }
                    }
                    Some(Ok(Event::Delete(p))) => {
                        if let Some(uid) = &p.metadata.uid {
                            pods.remove(uid);
                        }
                    }
                    Some(Err(e)) => {
                        tracing::warn!(error = %e, "watching the pool's pods failed; retrying");
                        continue;
                    }
                    None => return,
                }
            }
        }
        // While a relist is in progress, what was known before stands.
        if listing.is_none() {
            members.apply(&router, spec.as_ref(), pods.values());
        }
    }
}

#[cfg(test)]
mod tests;
