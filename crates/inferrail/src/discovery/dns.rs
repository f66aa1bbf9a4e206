//! DNS discovery: each group's name is resolved on its interval and its
//! members become replicas named `<group>-<ip>-<port>`, published to the
//! router as the group's wanted set. A member that
//! survives a lookup keeps its state (in-flight counts, health, backoff);
//! a failed lookup keeps the last set rather than emptying the group.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use inferrail_config::DnsGroup;

use inferrail_route::fleet::Replica;

use crate::router::Router;

/// The id of a discovered member.
pub fn member_id(group: &str, addr: SocketAddr) -> String {
    format!("{group}-{}-{}", addr.ip(), addr.port())
}

/// Current members of every group; each group publishes its own to the router as `dns:<group>`.
pub struct Discovery {
    groups: Vec<DnsGroup>,
    members: Vec<Vec<Arc<Replica>>>,
}

impl Discovery {
    /// Every group empty.
    pub fn new(router: &Router) -> Self {
        let groups = router.config().discovery.clone();
        let members = vec![Vec::new(); groups.len()];
        Self { groups, members }
    }

    /// Applies one lookup of group `g`; returns whether its membership changed.
    pub fn apply(&mut self, router: &Router, g: usize, lookup: Result<Vec<IpAddr>, String>) -> bool {
        let group = &self.groups[g];
        let ips = match lookup {
            Ok(ips) => ips,
            Err(e) => {
                metrics::counter!("inferrail_dns_failures_total", "group" => group.group.clone()).increment(1);
                tracing::warn!(group = %group.group, host = %group.host, error = %e, "lookup failed; keeping the last members");
                return false;
            }
        };
        let mut addrs: Vec<SocketAddr> = ips.into_iter().map(|ip| SocketAddr::new(ip, group.port)).collect();
        addrs.sort();
        addrs.dedup();
        let old = &self.members[g];
        let new: Vec<Arc<Replica>> = addrs
            .iter()
            .map(|&a| {
                let kept = old.iter().find(|r| r.addr == a).cloned();
                kept.unwrap_or_else(|| {
                    router.cold_replica(member_id(&group.group, a), a, router.model_slots(&group.serving.models), &group.serving, None)
                })
            })
            .collect();
        let changed = new.len() != old.len() || new.iter().zip(old).any(|(a, b)| !Arc::ptr_eq(a, b));
        for gone in old.iter().filter(|r| !new.iter().any(|n| Arc::ptr_eq(n, r))) {
            router.core.leave(gone);
        }
        if changed {
            tracing::info!(group = %group.group, members = ?addrs, "membership changed");
            router.publish(&format!("dns:{}", group.group), new.clone());
            self.members[g] = new;
        }
        changed
    }
}

/// A resolver asking `nameserver` (UDP, then TCP), or the system's configuration.
fn resolver(nameserver: Option<SocketAddr>) -> Result<hickory_resolver::TokioResolver, String> {
    use hickory_resolver::config::{NameServerConfig, ResolverConfig};
    let builder = match nameserver {
        None => hickory_resolver::TokioResolver::builder_tokio().map_err(|e| e.to_string())?,
        Some(at) => {
            let mut server = NameServerConfig::udp_and_tcp(at.ip());
            for c in &mut server.connections {
                c.port = at.port();
            }
            let config = ResolverConfig::from_name_servers(vec![server]);
            hickory_resolver::TokioResolver::builder_with_config(config, Default::default())
        }
    };
    builder.build().map_err(|e| e.to_string())
}

/// Resolves every group on its interval, forever.
pub async fn run(router: Arc<Router>) {
    let config = router.config();
    let groups = &config.discovery;
    if groups.is_empty() {
        return;
    }
    let resolvers: Vec<_> = groups
        .iter()
        .map(|group| {
            resolver(group.nameserver)
                .inspect_err(|e| tracing::error!(group = %group.group, error = %e, "no DNS resolver; the group stays empty"))
                .ok()
        })
        .collect();
    let mut discovery = Discovery::new(&router);
    let mut next = vec![tokio::time::Instant::now(); groups.len()];
    loop {
        // The next group due among those with a resolver.
        let due = next.iter().zip(&resolvers).enumerate().filter_map(|(g, (t, r))| Some((g, *t, r.as_ref()?))).min_by_key(|(_, t, _)| *t);
        let Some((g, at, resolver)) = due else { return };
        tokio::time::sleep_until(at).await;
        let group = &groups[g];
        let lookup = resolver.lookup_ip(group.host.as_str()).await.map(|ips| ips.iter().collect()).map_err(|e| e.to_string());
        discovery.apply(&router, g, lookup);
        next[g] = tokio::time::Instant::now() + Duration::from_millis(group.interval_ms);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use inferrail_config::Config;

    fn router() -> Router {
        let yaml = "
models: [{name: m}]
replicas: [{id: listed, address: 127.0.0.1:7000, models: [m]}]
discovery: [{group: pool, host: pool.internal, port: 8000, models: [m]}]
";
        Router::new(Config::parse(yaml).unwrap()).unwrap()
    }

    fn ids(r: &Router) -> Vec<String> {
        r.fleet().replicas.iter().map(|x| x.id.clone()).collect()
    }

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    #[tokio::test]
    async fn members_join_and_leave_and_survivors_keep_their_state() {
        let r = router();
        let mut d = Discovery::new(&r);
        assert!(d.apply(&r, 0, Ok(vec![ip(2), ip(1), ip(1)])));
        assert_eq!(ids(&r), ["listed", "pool-10.0.0.1-8000", "pool-10.0.0.2-8000"]);
        let survivor = r.fleet().replicas[2].clone();
        let lease = r.decide(br#"{"model": "m"}"#, inferrail_tokenize::chat::Endpoint::Chat, "req", None, None).await;
        assert!(lease.is_ok());
        survivor.set_probe(false);

        assert!(!d.apply(&r, 0, Ok(vec![ip(1), ip(2)])), "same members, no change");
        assert!(d.apply(&r, 0, Ok(vec![ip(2), ip(3)])));
        assert_eq!(ids(&r), ["listed", "pool-10.0.0.2-8000", "pool-10.0.0.3-8000"]);
        let kept = r.fleet().replicas[1].clone();
        assert!(Arc::ptr_eq(&kept, &survivor), "the survivor is the same replica");
        assert!(!kept.healthy(r.now_ms()), "and keeps its health state");
    }

    #[test]
    fn a_failed_lookup_keeps_the_last_members() {
        let r = router();
        let mut d = Discovery::new(&r);
        d.apply(&r, 0, Ok(vec![ip(1)]));
        assert!(!d.apply(&r, 0, Err("SERVFAIL".into())));
        assert_eq!(ids(&r), ["listed", "pool-10.0.0.1-8000"]);
        assert!(d.apply(&r, 0, Ok(vec![])), "an empty answer is an answer");
        assert_eq!(ids(&r), ["listed"]);
    }

    /// Once the service runs its probes and its EDS writer, a member that
    /// joins is not offered until the EDS file has listed it and a probe
    /// has found it healthy: before then Envoy could not send it what the
    /// router names it for. Members that were there from the start are not held.
    #[tokio::test]
    async fn a_member_that_joins_is_offered_once_envoy_knows_it_and_a_probe_found_it_healthy() {
        use std::sync::atomic::Ordering::Relaxed;
        let r = router();
        let mut d = Discovery::new(&r);
        d.apply(&r, 0, Ok(vec![ip(1)]));
        r.hold_joiners.probe.store(true, Relaxed);
        r.hold_joiners.eds.store(true, Relaxed);
        d.apply(&r, 0, Ok(vec![ip(1), ip(2)]));
        let fleet = r.fleet();
        let member = |n: u8| fleet.replicas.iter().find(|x| x.id == format!("pool-10.0.0.{n}-8000")).unwrap().clone();
        let (old, new) = (member(1), member(2));
        assert!(old.healthy(r.now_ms()) && old.announced(), "a member from before the service started is not held");
        assert!(!new.healthy(r.now_ms()) && !new.announced());
        assert!(!routed(&r, 30).await.contains(&new.id), "held: not offered");
        new.announce();
        assert!(!routed(&r, 30).await.contains(&new.id), "announced, not yet probed: not offered");
        new.set_probe(true);
        assert!(routed(&r, 30).await.contains(&new.id), "announced and probed: offered");
    }

    /// The replicas `n` completions with distinct prompts were routed to.
    async fn routed(r: &Router, n: usize) -> std::collections::HashSet<String> {
        let mut ids = std::collections::HashSet::new();
        for k in 0..n {
            let id = format!("routed-{k}");
            let body = format!(r#"{{"model": "m", "prompt": "{k}"}}"#);
            let decided = r.decide(body.as_bytes(), inferrail_tokenize::chat::Endpoint::Completions, &id, None, None).await.unwrap();
            ids.insert(decided.targets[0].id.clone());
            r.hear(&id, inferrail_route::lifecycle::Event::End);
        }
        ids
    }

    /// A group's own `nameserver` is asked, not the system's: a DNS server
    /// on a loopback port answers `pool.test` with the members it is
    /// given, and each lookup through the group's resolver sees the set of
    /// the moment (the answers' zero TTL is never cached).
    #[tokio::test]
    async fn a_groups_nameserver_answers_its_lookups() {
        use hickory_resolver::proto::op::Message;
        use hickory_resolver::proto::rr::{RData, Record, rdata::A};
        let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let at = socket.local_addr().unwrap();
        let (set, members) = tokio::sync::watch::channel(vec![std::net::Ipv4Addr::new(10, 0, 0, 1)]);
        let asked = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = asked.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 512];
            while let Ok((n, from)) = socket.recv_from(&mut buf).await {
                counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let query = Message::from_vec(&buf[..n]).unwrap();
                let mut answer = Message::response(query.metadata.id, query.metadata.op_code);
                answer.metadata.recursion_available = true;
                answer.metadata.recursion_desired = query.metadata.recursion_desired;
                for q in &query.queries {
                    answer.queries.push(q.clone());
                    if q.query_type() == hickory_resolver::proto::rr::RecordType::A {
                        for ip in members.borrow().iter() {
                            answer.answers.push(Record::from_rdata(q.name().clone(), 0, RData::A(A(*ip))));
                        }
                    }
                }
                socket.send_to(&answer.to_vec().unwrap(), from).await.unwrap();
            }
        });
        let resolver = resolver(Some(at)).unwrap();
        let lookup = |name: &'static str| {
            let resolver = resolver.clone();
            async move {
                let mut ips: Vec<IpAddr> = resolver.lookup_ip(name).await.unwrap().iter().collect();
                ips.sort();
                ips
            }
        };
        assert_eq!(lookup("pool.test.").await, [ip(1)]);
        set.send(vec![std::net::Ipv4Addr::new(10, 0, 0, 2), std::net::Ipv4Addr::new(10, 0, 0, 3)]).unwrap();
        assert_eq!(lookup("pool.test.").await, [ip(2), ip(3)]);
        assert!(asked.load(std::sync::atomic::Ordering::Relaxed) >= 2, "the group's server was asked");
    }

    /// Members joining and leaving on every lookup (issue 54's churn), with
    /// requests decided, answered and ended across the changes: every
    /// decision names a member of the fleet as it is then, no series of a
    /// departed replica is left on the metrics page, and once the requests
    /// end no lease or in-flight count is left anywhere.
    #[tokio::test]
    async fn under_churn_requests_go_to_members_and_nothing_of_a_departed_one_is_left() {
        use inferrail_route::lifecycle::Event;
        let metrics = crate::service::metrics_handle();
        let r = router();
        let mut d = Discovery::new(&r);
        let mut seed = 54u64;
        let mut open = std::collections::VecDeque::new();
        let mut departed = 0;
        for round in 0..200 {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let members: Vec<IpAddr> = (1..=8).filter(|b| seed >> (32 + b) & 1 == 1).map(ip).collect();
            let before = ids(&r);
            d.apply(&r, 0, Ok(members));
            let now = ids(&r);
            departed += before.iter().filter(|id| !now.contains(id)).count();
            for k in 0..3 {
                let id = format!("{round}-{k}");
                let decided = r.decide(br#"{"model": "m"}"#, inferrail_tokenize::chat::Endpoint::Chat, &id, None, None).await.unwrap();
                assert!(decided.targets.iter().all(|t| now.contains(&t.id)), "{:?} not in {now:?}", decided.targets);
                r.hear(&id, Event::Status { code: 200, served_by: None });
                r.hear(&id, Event::FirstByte);
                open.push_back(id);
            }
            // Requests outlive the lookups that took their replica away.
            while open.len() > 6 {
                r.hear(&open.pop_front().unwrap(), Event::End);
            }
            let page = crate::telemetry::gauges::page(&r, &metrics);
            for line in page.lines() {
                if let Some(id) = crate::telemetry::gauges::replica_label(line) {
                    assert!(now.iter().any(|n| n == id), "{id} left, yet: {line}");
                }
            }
        }
        assert!(departed > 100, "the fault fired: {departed} departures");
        for id in open {
            r.hear(&id, Event::End);
        }
        r.sweep_at(r.now() + Duration::from_secs(1));
        assert_eq!(r.leases_held(), 0);
        assert!(r.fleet().replicas.iter().all(|x| x.in_flight() == 0 && x.pending() == 0));
    }
}
