//! The queue against a reference that knows only what must hold whatever
//! the fairness rule: who is waiting, in which band, in which order within
//! a tenant; and fairness itself as a bound between tenants that keep
//! requests waiting.

use super::*;
use proptest::prelude::*;

fn entry(id: Id, band: usize, tenant: &str, tokens: u64) -> Entry {
    Entry { id, band, tenant: tenant.into(), weight: 1.0, tokens, at: Duration::from_millis(id) }
}

fn roomy() -> Bounds {
    Bounds { requests: 1000, tokens: 1 << 40 }
}

#[test]
fn bands_go_strictly_in_order() {
    let mut q = Queue::new(2, roomy());
    q.push(entry(1, 1, "a", 10)).unwrap();
    assert!(q.clear_for(0));
    assert!(!q.clear_for(1));
    q.push(entry(2, 0, "b", 10)).unwrap();
    assert_eq!(q.next().map(|e| e.id), Some(2));
    assert!(!q.clear_for(0));
    q.admit(2);
    assert_eq!(q.next().map(|e| e.id), Some(1));
}

#[test]
fn a_flooding_tenant_gets_its_share_and_no_more() {
    let mut q = Queue::new(1, roomy());
    for id in 1..=10 {
        q.push(entry(id, 0, "greedy", 100)).unwrap();
    }
    q.admit(1);
    q.admit(2);
    // The polite tenant starts level with the greedy one and goes before its backlog.
    q.push(entry(11, 0, "polite", 100)).unwrap();
    q.push(entry(12, 0, "polite", 100)).unwrap();
    let mut order = Vec::new();
    while let Some(e) = q.next().map(|e| e.id) {
        q.admit(e);
        order.push(e);
    }
    assert_eq!(order, vec![3, 11, 4, 12, 5, 6, 7, 8, 9, 10]);
}

#[test]
fn weights_share_a_band_by_tokens() {
    let mut q = Queue::new(1, roomy());
    for id in 0..40 {
        let (tenant, weight) = if id % 2 == 0 { ("heavy", 3.0) } else { ("light", 1.0) };
        q.push(Entry { weight, ..entry(id, 0, tenant, 10) }).unwrap();
    }
    let first: Vec<String> = (0..16).map(|_| q.admit(q.next().unwrap().id).unwrap().tenant).collect();
    assert_eq!(first.iter().filter(|t| *t == "heavy").count(), 12);
}

#[test]
fn a_quiet_tenant_banks_no_credit() {
    let mut q = Queue::new(1, roomy());
    for id in 1..=4 {
        q.push(entry(id, 0, "busy", 100)).unwrap();
    }
    for id in 1..=3 {
        q.admit(id);
    }
    // "late" never waited before: it starts at busy's counter, not at zero.
    q.push(entry(5, 0, "late", 100)).unwrap();
    q.push(entry(6, 0, "late", 100)).unwrap();
    q.push(entry(7, 0, "busy", 100)).unwrap();
    let order: Vec<Id> = (0..4).map(|_| q.admit(q.next().unwrap().id).unwrap().id).collect();
    // Without the lift it would have gone twice before busy's next (5, 6, 4, 7).
    assert_eq!(order, vec![4, 5, 6, 7]);
}

#[test]
fn overflow_pushes_out_the_least_urgent_newest_and_refuses_when_the_arrival_is_last() {
    let mut q = Queue::new(2, Bounds { requests: 3, tokens: 1000 });
    q.push(entry(1, 1, "batch", 10)).unwrap();
    q.push(entry(2, 1, "batch", 10)).unwrap();
    q.push(entry(3, 0, "chat", 10)).unwrap();
    // Full: an urgent arrival pushes out the newest batch request.
    let out = q.push(entry(4, 0, "chat", 10)).unwrap();
    assert_eq!(out.iter().map(|e| e.id).collect::<Vec<_>>(), vec![2]);
    // A batch arrival would be the first out: refused, nothing changes.
    assert_eq!(q.push(entry(5, 1, "batch", 10)), Err(Full));
    assert_eq!(q.len(), 3);
    assert!(q.contains(1) && q.contains(3) && q.contains(4));
    // A request larger than the bound never fits.
    assert_eq!(q.push(entry(6, 0, "chat", 1001)), Err(Full));
    // Tokens bound the queue too.
    let mut q = Queue::new(2, Bounds { requests: 10, tokens: 100 });
    q.push(entry(1, 1, "batch", 60)).unwrap();
    let out = q.push(entry(2, 0, "chat", 50)).unwrap();
    assert_eq!(out.iter().map(|e| e.id).collect::<Vec<_>>(), vec![1]);
    assert_eq!(q.tokens(), 50);
    // Within a band, the tenant furthest ahead of its share goes first: here the arrival.
    assert_eq!(q.push(entry(3, 0, "other", 60)), Err(Full));
}

#[test]
fn a_refused_arrival_leaves_its_tenant_as_it_was() {
    let mut q = Queue::new(1, Bounds { requests: 1, tokens: 1000 });
    q.push(entry(1, 0, "a", 10)).unwrap();
    assert_eq!(q.push(entry(2, 0, "b", 10)), Err(Full));
    assert_eq!(q.waiting().map(|(_, t, n, _)| (t.to_string(), n)).collect::<Vec<_>>(), vec![("a".to_string(), 1)]);
}

#[derive(Debug, Clone)]
enum Op {
    Push { band: usize, tenant: usize, tokens: u64 },
    AdmitNext,
    Remove(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0usize..3, 0usize..4, 1u64..500).prop_map(|(band, tenant, tokens)| Op::Push { band, tenant, tokens }),
        2 => Just(Op::AdmitNext),
        1 => (0usize..64).prop_map(Op::Remove),
    ]
}

proptest! {
    /// Any sequence of arrivals, admissions and departures: exactly the
    /// requests the reference holds are waiting, within the bounds; the next
    /// is in the most urgent band waiting and is its tenant's oldest; what is
    /// pushed out is never more urgent than what pushed it; a refused
    /// arrival changes nothing; nothing gone comes back.
    #[test]
    fn the_queue_holds_what_the_reference_holds(ops in prop::collection::vec(op(), 1..300), requests in 1usize..12, tokens in 500u64..3000) {
        let bounds = Bounds { requests, tokens };
        let mut q = Queue::new(3, bounds);
        // The reference: (id, band, tenant, tokens) in arrival order.
        let mut model: Vec<(Id, usize, usize, u64)> = Vec::new();
        let mut gone = std::collections::HashSet::new();
        for (i, op) in ops.into_iter().enumerate() {
            let id = i as Id;
            match op {
                Op::Push { band, tenant, tokens } => {
                    let before = q.len();
                    match q.push(entry(id, band, &format!("t{tenant}"), tokens)) {
                        Ok(out) => {
                            model.push((id, band, tenant, tokens));
                            for e in out {
                                prop_assert!(e.band >= band, "a band {} request pushed out by a band {band} one", e.band);
                                prop_assert!(e.id != id);
                                model.retain(|m| m.0 != e.id);
                                gone.insert(e.id);
                            }
                        }
                        Err(Full) => {
                            prop_assert_eq!(q.len(), before);
                            gone.insert(id);
                        }
                    }
                }
                Op::AdmitNext => {
                    if let Some(next) = q.next().cloned() {
                        let urgent = model.iter().map(|m| m.1).min().unwrap();
                        prop_assert_eq!(next.band, urgent);
                        let oldest = model.iter().find(|m| m.1 == next.band && format!("t{}", m.2) == next.tenant).unwrap();
                        prop_assert_eq!(oldest.0, next.id);
                        prop_assert_eq!(q.admit(next.id).map(|e| e.id), Some(next.id));
                        model.retain(|m| m.0 != next.id);
                        gone.insert(next.id);
                    } else {
                        prop_assert!(model.is_empty());
                    }
                }
                Op::Remove(k) => {
                    if !model.is_empty() {
                        let (id, ..) = model.remove(k % model.len());
                        prop_assert!(q.remove(id).is_some());
                        prop_assert!(q.remove(id).is_none());
                        gone.insert(id);
                    }
                }
            }
            prop_assert_eq!(q.len(), model.len());
            prop_assert_eq!(q.tokens(), model.iter().map(|m| m.3).sum::<u64>());
            prop_assert!(q.len() <= bounds.requests && q.tokens() <= bounds.tokens);
            for g in &gone {
                prop_assert!(!q.contains(*g));
            }
            for band in 0..3 {
                prop_assert_eq!(q.clear_for(band), model.iter().all(|m| m.1 > band));
            }
        }
    }

    /// Tenants that keep requests waiting in one band are admitted tokens in
    /// proportion to their weights, to within one request of the largest
    /// size (over the smaller weight), however the sizes vary.
    #[test]
    fn backlogged_tenants_share_by_weight(sizes in prop::collection::vec((0usize..3, 1u64..800), 10..300), weights in prop::collection::vec(1u32..5, 3)) {
        let mut q = Queue::new(1, roomy());
        let mut served = [0u64; 3];
        let mut pending: Vec<std::collections::VecDeque<u64>> = vec![Default::default(); 3];
        for (t, tokens) in &sizes {
            pending[*t].push_back(*tokens);
        }
        let mut id = 0;
        let mut refill = |q: &mut Queue, pending: &mut Vec<std::collections::VecDeque<u64>>| {
            for t in 0..3 {
                let waiting = q.waiting().find(|w| w.1 == format!("t{t}")).map_or(0, |w| w.2);
                for _ in waiting..2 {
                    let Some(tokens) = pending[t].pop_front() else { break };
                    id += 1;
                    q.push(Entry { weight: f64::from(weights[t]), ..entry(id, 0, &format!("t{t}"), tokens) }).unwrap();
                }
            }
        };
        refill(&mut q, &mut pending);
        // Only while every tenant is still waiting is the share owed.
        while pending.iter().all(|p| !p.is_empty()) {
            let e = q.admit(q.next().unwrap().id).unwrap();
            served[e.tenant[1..].parse::<usize>().unwrap()] += e.tokens;
            refill(&mut q, &mut pending);
            let norm: Vec<f64> = (0..3).map(|t| served[t] as f64 / f64::from(weights[t])).collect();
            let (lo, hi) = norm.iter().fold((f64::MAX, f64::MIN), |(lo, hi), &n| (lo.min(n), hi.max(n)));
            prop_assert!(hi - lo <= 800.0, "normalized service {norm:?}");
        }
    }
}
