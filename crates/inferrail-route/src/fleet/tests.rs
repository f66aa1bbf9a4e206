//! Replicas' counters, leases and ejection.

use super::*;

fn replica(models: Vec<usize>) -> Arc<Replica> {
    let limits = Limits { max_concurrency: 2, max_pending: 1 };
    Arc::new(Replica::new("r".into(), SocketAddr::from(([127, 0, 0, 1], 1)), models, limits, CacheShape::default(), 0))
}

fn counts(r: &Replica) -> (u32, u32, u64) {
    let c = r.candidate(Duration::ZERO, (0, 0), None, Share::ALONE);
    (c.in_flight, c.pending, r.prompt_tokens())
}

#[test]
fn a_candidate_counts_the_kv_tokens_sent_after_its_engine_report() {
    let r = replica(vec![0]);
    let ms = Duration::from_millis;
    let report = |at| Some(Report { at, load: inferrail_policy::EngineReport { running: 0, waiting: 0, deferred: 0, kv_usage: 0.0 } });
    r.sent(ms(1_000), 300, 0);
    r.sent(ms(1_050), 200, 0);
    assert_eq!(
        r.candidate(ms(1_060), (0, 0), report(ms(1_000)), Share::ALONE).unreported_kv_tokens,
        200,
        "the first was sent before the report"
    );
    assert_eq!(r.candidate(ms(1_060), (0, 0), report(ms(900)), Share::ALONE).unreported_kv_tokens, 500);
    // A request over has freed its blocks: it takes no room the report counts as free.
    let lease = Lease::new(r.clone(), 0, 400);
    lease.sent_kv(ms(1_055), 400);
    assert_eq!(r.candidate(ms(1_060), (0, 0), report(ms(900)), Share::ALONE).unreported_kv_tokens, 900);
    lease.release();
    assert_eq!(r.candidate(ms(1_060), (0, 0), report(ms(900)), Share::ALONE).unreported_kv_tokens, 500, "released, it counts no more");
    assert_eq!(r.candidate(ms(1_060), (0, 0), None, Share::ALONE).unreported_kv_tokens, 0, "no report, nothing to correct");
    // Sends older than any fresh report are let go.
    r.sent(ms(1_000) + FRESH + ms(20), 7, 0);
    assert_eq!(r.sent.lock().unwrap().len(), 3, "the send at 1,000 ms can predate no fresh report");
    assert_eq!(r.candidate(ms(1_400), (0, 0), report(ms(1_200)), Share::ALONE).unreported_kv_tokens, 7);
}

#[test]
fn an_engine_has_started_all_but_the_newest_requests_it_reports_waiting() {
    let r = replica(vec![0]);
    let ms = Duration::from_millis;
    let report =
        |at, waiting| Some(Report { at, load: inferrail_policy::EngineReport { running: 2, waiting, deferred: 0, kv_usage: 0.0 } });
    let a = Lease::new(r.clone(), 0, 100);
    a.queue_prefill(ms(300));
    a.sent_kv(ms(1_000), 100);
    let b = Lease::new(r.clone(), 0, 100);
    b.queue_prefill(ms(200));
    b.sent_kv(ms(1_050), 100);
    let queued = |report| r.candidate(ms(1_060), (0, 0), report, Share::ALONE).queued_prefill_secs;
    assert_eq!(queued(None), 0.5, "no report: all of it");
    assert_eq!(queued(report(ms(1_020), 3)), 0.5, "more waiting than the router sent before the report: all of it");
    assert_eq!(queued(report(ms(1_020), 0)), 0.2, "nothing waiting at 1,020 ms: only what was sent after");
    assert_eq!(queued(report(ms(1_060), 0)), 0.0);
    assert_eq!(queued(report(ms(1_060), 1)), 0.2, "one waiting at 1,060 ms: the newest");
    assert_eq!(queued(report(ms(1_060), 2)), 0.5);
    let deferring =
        |deferred| Some(Report { at: ms(1_060), load: inferrail_policy::EngineReport { running: 2, waiting: 2, deferred, kv_usage: 0.0 } });
    assert_eq!(queued(deferring(1)), 0.2, "of two waiting, one is passed over until an adapter slot frees: it holds no place");
    assert_eq!(queued(deferring(2)), 0.0);
    b.first_byte();
    assert_eq!(queued(report(ms(900), 0)), 0.3, "a first byte takes its prefill out of the sent ones too");
    assert_eq!(r.queued_prefill(), ms(300), "the queue itself is the router's own count");
}

#[test]
fn a_candidate_knows_its_kv_cache_size_once_the_engine_reported_it() {
    let r = replica(vec![0]);
    assert_eq!(r.candidate(Duration::ZERO, (0, 0), None, Share::ALONE).kv_capacity_tokens, 0, "unknown until reported");
    r.learn_cache(16, 1_100);
    assert_eq!(r.candidate(Duration::ZERO, (0, 0), None, Share::ALONE).kv_capacity_tokens, 17_600);
}

#[test]
fn a_lease_counts_until_dropped_and_pending_until_its_first_byte() {
    let r = replica(vec![0]);
    let lease = Lease::new(r.clone(), 0, 700);
    assert_eq!(counts(&r), (1, 1, 700));
    assert!(!r.candidate(Duration::ZERO, (0, 0), None, Share::ALONE).has_room(), "max_pending is 1");
    assert!(lease.first_byte());
    assert!(!lease.first_byte());
    assert_eq!(counts(&r), (1, 0, 700));
    drop(lease);
    assert_eq!(counts(&r), (0, 0, 0));
    drop(Lease::new(r.clone(), 0, 5));
    assert_eq!(counts(&r), (0, 0, 0));
}

#[test]
fn a_peers_request_counts_on_the_replica_but_not_in_this_routers_part_of_its_limits() {
    let r = replica(vec![0]);
    let half = Share { rank: 1, of: 2 };
    let mirrored = Lease::mirror(r.clone(), 0, 5);
    let c = r.candidate(Duration::ZERO, (0, 0), None, half);
    assert_eq!((c.in_flight, c.pending), (1, 1));
    assert_eq!(c.own, Some(Own { in_flight: 0, pending: 0, max_concurrency: 1, max_pending: 0 }), "2 and 1 split over two routers");
    assert!(!c.has_room(), "its part of max_pending is nothing");
    assert!(r.candidate(Duration::ZERO, (0, 0), None, Share { rank: 0, of: 2 }).own.is_some_and(|o| o.max_pending == 1));
    let mine = Lease::new(r.clone(), 0, 5);
    assert_eq!(r.candidate(Duration::ZERO, (0, 0), None, half).own.map(|o| (o.in_flight, o.pending)), Some((1, 1)));
    mine.first_byte();
    assert_eq!(r.candidate(Duration::ZERO, (0, 0), None, half).own.map(|o| (o.in_flight, o.pending)), Some((1, 0)));
    drop(mine);
    drop(mirrored);
    assert_eq!(r.candidate(Duration::ZERO, (0, 0), None, half).own.map(|o| (o.in_flight, o.pending)), Some((0, 0)));
    assert_eq!(counts(&r), (0, 0, 0));
    assert_eq!(r.candidate(Duration::ZERO, (0, 0), None, Share::ALONE).own, None, "alone, its part is the whole");
}

#[test]
fn the_prefill_queue_holds_what_has_had_no_first_byte_and_empties_with_the_last() {
    let r = replica(vec![0]);
    let ms = Duration::from_millis;
    let a = Lease::new(r.clone(), 0, 10);
    a.queue_prefill(ms(300));
    let b = Lease::new(r.clone(), 0, 10);
    b.queue_prefill(ms(200));
    // However long it has been, neither has had its first byte, so neither prefill is known done.
    assert_eq!(r.queued_prefill(), ms(500), "the second waits behind the first");
    b.first_byte();
    assert_eq!(r.queued_prefill(), ms(300), "a first byte takes its own prefill out");
    let c = Lease::new(r.clone(), 0, 10);
    c.queue_prefill(ms(100));
    assert_eq!(r.queued_prefill(), ms(400));
    a.first_byte();
    assert_eq!(r.queued_prefill(), ms(100));
    drop(c);
    assert_eq!(r.queued_prefill(), Duration::ZERO, "every request there has had its first byte or is over");
    let d = Lease::new(r.clone(), 0, 10);
    d.queue_prefill(ms(50));
    assert_eq!(r.queued_prefill(), ms(50));
    d.release();
    d.release();
    assert_eq!(r.queued_prefill(), Duration::ZERO, "released once");
}

#[test]
fn ejections_double_up_to_the_cap() {
    let cfg = HealthConfig { base_ejection_ms: 100, max_ejection_ms: 350, ..HealthConfig::default() };
    let r = replica(vec![0]);
    assert_eq!(r.eject(0, &cfg), 100);
    assert!(!r.healthy(50) && r.healthy(100));
    r.record_success();
    assert_eq!(r.eject(200, &cfg), 200, "successes between ejections do not undo the backoff");
    assert_eq!(r.eject(500, &cfg), 350);
    // In service for max_ejection_ms since the last ejection ended: back to the base.
    assert_eq!(r.eject(5_000, &cfg), 100);
}

#[test]
fn never_more_than_the_allowed_share_is_ejected() {
    let cfg = HealthConfig { max_ejected_fraction: 0.5, ..HealthConfig::default() };
    let all: Vec<Arc<Replica>> = (0..4).map(|_| replica(vec![0])).collect();
    assert!(may_eject(&all[0], &all, 0, &cfg));
    all[0].eject(0, &cfg);
    assert!(may_eject(&all[1], &all, 0, &cfg));
    all[1].eject(0, &cfg);
    assert!(!may_eject(&all[2], &all, 0, &cfg));
}

#[test]
fn a_replica_counts_the_adapters_of_its_requests_in_flight_until_they_are_released() {
    let (r, other) = (replica(vec![0]), replica(vec![0]));
    let (sql, chat): (Arc<str>, Arc<str>) = ("sql".into(), "chat".into());
    let a = Lease::new(r.clone(), 0, 10);
    a.set_adapter(sql.clone());
    a.set_adapter(chat.clone()); // once only
    let b = Lease::new(r.clone(), 0, 10);
    b.set_adapter(sql.clone());
    let c = Lease::new(r.clone(), 0, 10);
    c.set_adapter(chat.clone());
    let fit = |r: &Replica, name| r.adapter_fit(name, Some(2), Duration::ZERO);
    assert_eq!(fit(&r, "sql"), AdapterFit { resident: true, others: 1, max_loras: Some(2) });
    assert_eq!(fit(&r, "other"), AdapterFit { resident: false, others: 2, max_loras: Some(2) });
    assert!(fit(&r, "other").must_wait() && !fit(&r, "sql").must_wait());
    a.release();
    a.release();
    assert!(fit(&r, "sql").resident, "b still runs it");
    // Envoy retried c elsewhere: its adapter goes with it.
    let moved = c.moved(other.clone());
    c.release();
    assert!(fit(&other, "chat").resident, "it runs where it moved");
    assert!(fit(&r, "chat").resident, "and stays in the slot it left, beside sql's");
    b.release();
    moved.release();
    // Ended, but still in the slots the engine had free: no load to pay.
    assert_eq!(fit(&r, "sql"), AdapterFit { resident: true, others: 0, max_loras: Some(2) });
    assert!(!r.adapter_fit("sql", None, Duration::ZERO).resident, "with the slots unknown, only a running adapter counts");
    // Two more adapters run there: the slots are theirs, sql's was evicted.
    let (x, y) = (Lease::new(r.clone(), 0, 10), Lease::new(r.clone(), 0, 10));
    x.set_adapter("x".into());
    y.set_adapter("y".into());
    assert_eq!(fit(&r, "sql"), AdapterFit { resident: false, others: 2, max_loras: Some(2) });
    x.release();
    assert!(fit(&r, "x").resident && !fit(&r, "sql").resident, "the least recently used goes first");
}

#[test]
fn the_engines_fresh_report_adds_its_running_and_waiting_adapters_and_its_slots() {
    let r = replica(vec![0]);
    let a = Lease::new(r.clone(), 0, 10);
    a.set_adapter("sql".into());
    let at = Duration::from_secs(10);
    let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    r.learn_adapters(at, 2, &names(&["sql", "chat"]), &names(&["chat", "code"]));
    let arcs = |v: &[&str]| v.iter().map(|s| Arc::<str>::from(*s)).collect::<Vec<_>>();
    // The router's own request and the engine's report, each adapter once; the slots as the engine says.
    let view = r.adapters(None, at);
    assert_eq!(view, Adapters { running: arcs(&["sql", "chat"]), idle: vec![], waiting: arcs(&["chat", "code"]), max_loras: Some(2) });
    assert_eq!(r.adapter_fit("code", None, at), AdapterFit { resident: false, others: 2, max_loras: Some(2) });
    assert!(r.adapter_fit("code", None, at).must_wait(), "both slots run others");
    assert_eq!(r.adapter_fit("chat", Some(4), at), AdapterFit { resident: true, others: 1, max_loras: Some(4) }, "configured slots win");
    // A stale report names no adapters; its slot count still holds.
    let later = at + FRESH + Duration::from_millis(1);
    assert_eq!(r.adapters(None, later), Adapters { running: arcs(&["sql"]), idle: vec![], waiting: vec![], max_loras: Some(2) });
    a.release();
    assert_eq!(r.adapters(None, later).idle, arcs(&["sql"]), "ended, still in a slot");
}
