//! Validation: every range and cross-reference problem of a configuration,
//! each with its path.

use std::collections::HashSet;
use std::net::SocketAddr;

use super::{Config, Serving};

impl Config {
    /// Every range and cross-reference problem, each with its path.
    pub fn validate(&self) -> Vec<String> {
        let mut p = Vec::new();
        let e = &self.kv_events;
        if e.queue == 0 || e.silent_after_ms == 0 || e.replay_timeout_ms == 0 {
            p.push("kv_events: queue, silent_after_ms and replay_timeout_ms must be at least 1".into());
        }
        let own = self.replicas.iter().filter_map(|r| r.kv_events.as_ref().map(|k| (format!("replicas[{}].kv_events", r.id), k)));
        let endpoints = [("kv_events".to_owned(), e.endpoint.as_deref(), e.replay_endpoint.as_deref())]
            .into_iter()
            .chain(own.map(|(path, k)| (path, Some(k.endpoint.as_str()), k.replay_endpoint.as_deref())));
        for (path, endpoint, replay) in endpoints {
            for (field, value) in [("endpoint", endpoint), ("replay_endpoint", replay)] {
                if let Some(v) = value
                    && !["tcp://", "ipc://", "inproc://"].iter().any(|s| v.starts_with(s))
                {
                    p.push(format!("{path}.{field}: {v:?} is not a tcp://, ipc:// or inproc:// endpoint"));
                }
            }
        }
        for (path, addr) in
            [("server.listen", &self.server.listen), ("admin.listen", &self.admin.listen), ("admin.grpc_listen", &self.admin.grpc_listen)]
        {
            if addr.parse::<SocketAddr>().is_err() {
                p.push(format!("{path}: {addr:?} is not ip:port"));
            }
        }
        if self.server.max_body_bytes == 0 {
            p.push("server.max_body_bytes: must be at least 1".into());
        }
        if self.server.threads == 0 {
            p.push("server.threads: must be at least 1".into());
        }
        if self.retry.fallbacks > 8 {
            p.push(format!("retry.fallbacks: {} is more than 8", self.retry.fallbacks));
        }
        if self.retry.prefill_timeout_ms == 0 {
            p.push("retry.prefill_timeout_ms: must be at least 1".into());
        }
        let h = &self.health;
        if h.probe_interval_ms == 0 || h.probe_timeout_ms == 0 || h.base_ejection_ms == 0 {
            p.push("health: probe_interval_ms, probe_timeout_ms and base_ejection_ms must be at least 1".into());
        }
        if h.max_ejection_ms < h.base_ejection_ms {
            p.push("health.max_ejection_ms: shorter than base_ejection_ms".into());
        }
        if h.consecutive_failures == 0 {
            p.push("health.consecutive_failures: must be at least 1".into());
        }
        if h.unhealthy_probes == 0 {
            p.push("health.unhealthy_probes: must be at least 1".into());
        }
        if !(0.0..=1.0).contains(&h.max_ejected_fraction) {
            p.push(format!("health.max_ejected_fraction: {} is not between 0 and 1", h.max_ejected_fraction));
        }
        if self.models.is_empty() {
            p.push("models: at least one model is needed".into());
        }
        let t = &self.tokenizer;
        if t.workers == 0 || t.queue == 0 || t.max_wait_ms == 0 {
            p.push("tokenizer: workers, queue and max_wait_ms must be at least 1".into());
        }
        let l = &self.load;
        if l.interval_ms == 0 || l.timeout_ms == 0 || l.max_bytes == 0 {
            p.push("load: interval_ms, timeout_ms and max_bytes must be at least 1".into());
        }
        if l.interval_ms >= 250 {
            p.push(format!("load.interval_ms: {} would leave most reports older than the 250 ms after which none is used", l.interval_ms));
        }
        let d = &self.observability.decision_log;
        if !(0.0..=1.0).contains(&d.sample_rate) {
            p.push(format!("observability.decision_log.sample_rate: {} is not between 0 and 1", d.sample_rate));
        }
        if d.queue == 0 {
            p.push("observability.decision_log.queue: must be at least 1".into());
        }
        if d.sample_rate > 0.0 && d.path.is_none() {
            p.push("observability.decision_log.path: needed when sample_rate is above 0".into());
        }
        let o = &self.observability;
        if !(0.0..=1.0).contains(&o.trace_sample_ratio) {
            p.push(format!("observability.trace_sample_ratio: {} is not between 0 and 1", o.trace_sample_ratio));
        }
        if let Some(e) = &o.otlp_endpoint
            && !e.starts_with("http://")
        {
            p.push(format!(
                "observability.otlp_endpoint: {e:?} is not an http:// address (traces are sent without TLS: use a local collector)"
            ));
        }
        if let Some(s) = &l.sidecar
            && !(s.starts_with("http://") || s.starts_with("https://"))
        {
            p.push(format!("load.sidecar: {s:?} is not an http:// or https:// address"));
        }
        for (i, a) in self.peers.addresses.iter().enumerate() {
            if !host_port(a) {
                p.push(format!("peers.addresses[{i}]: {a:?} is not host:port"));
            }
        }
        if let Some(d) = &self.peers.dns
            && !host_port(d)
        {
            p.push(format!("peers.dns: {d:?} is not name:port"));
        }
        if self.peers.resolve_interval_ms == 0 {
            p.push("peers.resolve_interval_ms: must be at least 1".into());
        }
        if self.eds.cluster.is_empty() {
            p.push("eds.cluster: the replica cluster's name is required".into());
        }
        if self.kv.block_size == 0 || self.kv.blocks == 0 {
            p.push("kv: block_size and blocks must be at least 1".into());
        }
        p.extend(self.routing.policies.validate("routing.policies"));
        p.extend(self.admission.validate(self.models.iter().map(|m| (m.name.as_str(), m.band.as_deref()))));
        let mut names = HashSet::new();
        for (i, m) in self.models.iter().enumerate() {
            if m.name.is_empty() {
                p.push(format!("models[{i}].name: missing"));
            }
            if !m.policies.is_null() {
                match self.params(i) {
                    Ok(params) => p.extend(params.validate(&format!("models[{i}].policies"))),
                    Err(e) => p.extend(e),
                }
            }
            if m.max_loras == Some(0) {
                p.push(format!("models[{i}].max_loras: must be at least 1"));
            }
            for n in std::iter::once(&m.name).chain(&m.aliases).chain(&m.adapters) {
                if !n.is_empty() && !names.insert(n.as_str()) {
                    p.push(format!("models[{i}]: the name {n:?} is used twice"));
                }
            }
        }
        let known: HashSet<&str> = self.models.iter().map(|m| m.name.as_str()).collect();
        let mut ids = HashSet::new();
        let mut served: HashSet<&str> = HashSet::new();
        for (i, r) in self.replicas.iter().enumerate() {
            let at = format!("replicas[{i}]");
            if r.id.is_empty() {
                p.push(format!("{at}.id: missing"));
            } else if !ids.insert(r.id.as_str()) {
                p.push(format!("{at}.id: {:?} is used twice", r.id));
            }
            if r.address.parse::<SocketAddr>().is_err() {
                p.push(format!("{at}.address: {:?} is not ip:port (Envoy's override_host matches ip:port exactly)", r.address));
            }
            r.serving.check(&mut p, &at, &known, &mut served);
        }
        for (i, g) in self.discovery.iter().enumerate() {
            let at = format!("discovery[{i}]");
            if g.group.is_empty() || g.host.is_empty() {
                p.push(format!("{at}: group and host are required"));
            }
            if g.port == 0 || g.interval_ms == 0 {
                p.push(format!("{at}: port and interval_ms must be at least 1"));
            }
            g.serving.check(&mut p, &at, &known, &mut served);
        }
        if let Some(k) = &self.kubernetes {
            if k.pool.is_empty() {
                p.push("kubernetes.pool: the InferencePool's name is required".into());
            }
            k.serving.check(&mut p, "kubernetes", &known, &mut served);
        }
        for (i, m) in self.models.iter().enumerate() {
            if !m.name.is_empty() && !served.contains(m.name.as_str()) {
                p.push(format!(
                    "models[{i}]: no replica or discovery group serves {:?} (a prefill-only replica needs a decode or both one beside it)",
                    m.name
                ));
            }
        }
        p
    }
}

impl Serving {
    /// Its problems, at path `at`; the models it names go into `served`
    /// unless it only prefills.
    fn check<'a>(&'a self, p: &mut Vec<String>, at: &str, known: &HashSet<&str>, served: &mut HashSet<&'a str>) {
        if self.models.is_empty() {
            p.push(format!("{at}.models: serves no model"));
        }
        for (j, m) in self.models.iter().enumerate() {
            if known.contains(m.as_str()) {
                if self.role.decodes() {
                    served.insert(m);
                }
            } else {
                p.push(format!("{at}.models[{j}]: {m:?} is not a configured model name"));
            }
        }
        if self.max_concurrency == 0 || self.max_pending == 0 {
            p.push(format!("{at}: max_concurrency and max_pending must be at least 1"));
        }
        if self.block_size == Some(0) || self.kv_blocks == Some(0) || self.host_kv_blocks == Some(0) {
            p.push(format!("{at}: block_size, kv_blocks and host_kv_blocks must be at least 1 when set"));
        }
        if let Some(prefill) = &self.prefill {
            prefill.validate(&format!("{at}.prefill"), p);
        }
    }
}

/// `host:port` with a host and a port number.
fn host_port(s: &str) -> bool {
    s.rsplit_once(':').is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok())
}
