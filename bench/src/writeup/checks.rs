//! The must-show checks of issues 11 and 39, each computed from the results with
//! its target, the measured value, and whether it passed; a check whose data
//! is not in the results says so instead of passing.

use super::real::{fastest, find};
use super::{Contenders, mean, num, paired_p99, paired_ttfts, ttft_p99};
use crate::writeup::inputs::{CompareRun, FleetWorkload, Ladder, Loaded, RealCapacity};

/// One check's outcome.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    Pass,
    Fail,
    /// The results hold no data for it.
    NotMeasured,
}

/// A computed check.
#[derive(Debug, Clone)]
pub struct Check {
    pub name: String,
    pub target: String,
    pub measured: String,
    pub verdict: Verdict,
}

fn check(name: impl Into<String>, target: &str, measured: String, pass: Option<bool>) -> Check {
    let verdict = match pass {
        Some(true) => Verdict::Pass,
        Some(false) => Verdict::Fail,
        None => Verdict::NotMeasured,
    };
    Check { name: name.into(), target: target.into(), measured, verdict }
}

/// The policy the checks are about.
pub const HERO: &str = "cost_model";
/// The cache-blind policies (W1's hit rate and a mixed fleet's capacity are compared with them).
pub const BLIND: [&str; 2] = ["round_robin", "least_request"];

/// A peer router's round robin and the contender that runs the same
/// algorithm through Envoy and inferrail: where that router is the best
/// other, with any policy, the two measure the path apart from the routing.
const PEER_TWINS: [(&str, &str); 3] =
    [("sglang:round_robin", "round_robin"), ("smg:round_robin", "round_robin"), ("vllm-router:round_robin", "round_robin")];

/// The router a contender runs in (`sglang` of `sglang:cache_aware`; inferrail for its own policies).
fn router_of(contender: &str) -> &str {
    contender.split_once(':').map_or("inferrail", |(router, _)| router)
}

fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

/// Issue 11's checks, in its order (with the lowest p99 and highest
/// goodput on issue 39's workloads where they ran).
pub fn all(routing: &Contenders, fleet: &[FleetWorkload], real: &[Loaded<RealCapacity>], ladder: Option<&Loaded<Ladder>>) -> Vec<Check> {
    let mut out = Vec::new();
    // Over every repetition's requests together.
    let p99 = |w: &str, c: &str| routing.get(w, c).map(|runs| ttft_p99(runs).value);
    // Issue 11's workloads whether or not they ran, then any other that did (issue 39's reuse patterns).
    let issue_11 = ["w1", "mix", "hot", "w6"].map(String::from);
    let lowest: Vec<String> = issue_11.iter().cloned().chain(routing.workloads().into_iter().filter(|w| !issue_11.contains(w))).collect();
    for w in &lowest {
        let w = w.as_str();
        let name = format!("{HERO} has the lowest p99 TTFT of all contenders on {w}");
        let others: Vec<(String, f64)> =
            routing.contenders(w).into_iter().filter(|c| c != HERO).filter_map(|c| p99(w, &c).map(|v| (c, v))).collect();
        match (p99(w, HERO), others.iter().min_by(|a, b| a.1.total_cmp(&b.1))) {
            (Some(hero), Some((best, other))) => {
                // Whole milliseconds, unless they would show a near-tie as equal.
                let digits = if format!("{hero:.0}") == format!("{other:.0}") { 1 } else { 0 };
                let mut measured = format!("{hero:.digits$} ms; best other: {best} {other:.digits$} ms");
                // The same requests under both: how sure the order is, and what every request pays.
                let paired = |a: &str, b: &str| {
                    routing.get(w, a).zip(routing.get(w, b)).and_then(|(x, y)| paired_ttfts(x, y)).map(|p| paired_p99(&p))
                };
                if let Some(p) = paired(HERO, best) {
                    measured += &format!(
                        "; over the same {} requests, {HERO}'s p99 minus {best}'s {:+.1} ms (95% bootstrap interval {:+.1} to {:+.1}), the median request's difference {:+.1} ms",
                        num(p.requests as f64),
                        p.difference,
                        p.low,
                        p.high,
                        p.median_request
                    );
                }
                // Against the peer, the path apart from the routing: the peer's own algorithm run through Envoy and inferrail.
                if let Some(&(peer, ours)) = PEER_TWINS.iter().find(|(peer, _)| router_of(peer) == router_of(best))
                    && let Some(p) = paired(ours, peer)
                {
                    measured += &format!(
                        "; the path alone ({ours} through Envoy and inferrail minus {peer}, one algorithm): p99 {:+.1} ms, the median request {:+.1} ms",
                        p.difference, p.median_request
                    );
                }
                out.push(check(name, "lowest", measured, Some(hero <= *other)))
            }
            _ => out.push(check(name, "lowest", format!("{w} not in the routing results with {HERO} and another contender"), None)),
        }
    }
    let workloads = routing.workloads();
    // Goodput: the mean share of requests within the SLO over the repetitions.
    let goodput = |w: &str, c: &str| routing.get(w, c).map(|runs| mean(runs.iter().map(|r| r.summary.goodput.share)));
    for w in &workloads {
        let others = routing.contenders(w).into_iter().filter(|c| c != HERO).filter_map(|c| goodput(w, &c).map(|g| (c, g)));
        let name = format!("{HERO} has the highest goodput of all contenders on {w}");
        out.push(match (goodput(w, HERO), others.max_by(|a, b| a.1.total_cmp(&b.1))) {
            (Some(hero), Some((best, other))) => {
                check(name, "highest", format!("{}; best other: {best} {}", pct(hero), pct(other)), Some(hero >= other))
            }
            _ => check(name, "highest", format!("{w} not in the routing results with {HERO} and another contender"), None),
        });
    }
    let pairs: Vec<(String, f64, f64)> =
        workloads.iter().filter_map(|w| Some((w.clone(), p99(w, HERO)?, p99(w, "least_request")?))).collect();
    let worse: Vec<String> = pairs.iter().filter(|(_, h, l)| h > l).map(|(w, h, l)| format!("{w}: {h:.0} > {l:.0} ms")).collect();
    out.push(check(
        format!("{HERO} never has a worse p99 TTFT than least_request"),
        "nowhere worse",
        if pairs.is_empty() {
            "no workload with both".into()
        } else if worse.is_empty() {
            format!("not worse on {}", pairs.iter().map(|p| p.0.as_str()).collect::<Vec<_>>().join(", "))
        } else {
            format!("worse on {}", worse.join("; "))
        },
        (!pairs.is_empty()).then_some(worse.is_empty()),
    ));
    let hit = |c: &str| {
        routing
            .get("w1", c)
            .and_then(|runs| runs.iter().map(|r| r.summary.prefix.hit_rate).collect::<Option<Vec<_>>>())
            .map(|v| mean(v.into_iter()))
    };
    let blind: Vec<String> = BLIND.iter().filter_map(|c| hit(c).map(|h| format!("{c} {}", pct(h)))).collect();
    out.push(check(
        format!("{HERO} keeps at least 88% of W1's prompt tokens cached (usage)"),
        ">= 88%",
        match hit(HERO) {
            Some(h) => format!("{}; cache-blind: {}", pct(h), if blind.is_empty() { "not measured".into() } else { blind.join(", ") }),
            None => "not measured".into(),
        },
        hit(HERO).map(|h| h >= 0.88),
    ));
    let cut = p99("w1", HERO).zip(p99("w1", "round_robin")).map(|(h, rr)| 1.0 - h / rr);
    out.push(check(
        format!("{HERO} cuts round_robin's p99 TTFT on W1 by at least 55%"),
        ">= 55%",
        cut.map_or("not measured".into(), pct),
        cut.map(|c| c >= 0.55),
    ));
    let busiest = routing
        .get("hot", HERO)
        .and_then(|runs| runs.iter().map(|r| r.engines.as_ref().and_then(|e| e.busiest_share)).collect::<Option<Vec<_>>>())
        .map(|v| mean(v.into_iter()));
    out.push(check(
        format!("under hot traffic {HERO}'s busiest replica takes at most 37% of requests (engines' counters, 3 replicas)"),
        "<= 37%",
        busiest.map_or("not measured (no hot run)".into(), pct),
        busiest.map(|b| b <= 0.37),
    ));
    for w in ["w1", "mix"] {
        let name = format!("fleet simulation: {HERO}'s capacity at the SLO on {w} is at least 1.33x round_robin's");
        let Some(g) = fleet.iter().find(|g| g.workload == w) else {
            out.push(check(name, ">= 1.33x", "not measured".into(), None));
            continue;
        };
        let ratios: Vec<(usize, f64, usize)> =
            g.sizes().into_iter().filter_map(|n| g.ratio(HERO, "round_robin", n).map(|(r, k)| (n, r, k))).collect();
        if ratios.is_empty() {
            out.push(check(name, ">= 1.33x", "a policy is missing".into(), None));
            continue;
        }
        let seeds = |k: usize| if k == 1 { "one seed".to_string() } else { format!("summed over {k} seeds") };
        let measured = if ratios.iter().all(|(_, _, k)| *k == ratios[0].2) {
            let each: Vec<String> = ratios.iter().map(|(n, r, _)| format!("{r:.2}x at {n}")).collect();
            format!("{} ({})", each.join(", "), seeds(ratios[0].2))
        } else {
            ratios.iter().map(|(n, r, k)| format!("{r:.2}x at {n} ({})", seeds(*k))).collect::<Vec<_>>().join(", ")
        };
        out.push(check(name, ">= 1.33x at every size", measured, Some(ratios.iter().all(|(_, r, _)| *r >= 1.33))));
    }
    for w in ["w1", "mix"] {
        let found = find(real, w, HERO).zip(find(real, w, "round_robin"));
        let ratio = found.map(|(h, rr)| if rr.rate > 0.0 { h.rate / rr.rate } else { f64::INFINITY });
        out.push(check(
            format!("{HERO}'s capacity at the SLO on three real simulator processes is at least 1.33x round_robin's on {w}"),
            ">= 1.33x",
            match found.zip(ratio) {
                Some(((h, rr), r)) => {
                    let sims = if h.replicas == rr.replicas {
                        format!("{} simulators each", h.replicas)
                    } else {
                        format!("{} and {} simulators", h.replicas, rr.replicas)
                    };
                    format!("{r:.2}x ({HERO} {} req/s, round_robin {} req/s, on {sims})", num(h.rate), num(rr.rate))
                }
                None => format!("not measured: no capacity search of both on {w} over real simulators in the results"),
            },
            ratio.map(|r| r >= 1.33),
        ));
    }
    let (mut compared, mut exact) = (0, 0);
    for w in &workloads {
        for r in routing.get(w, HERO).unwrap_or_default() {
            compared += r.summary.prediction.compared;
            exact += r.summary.prediction.exact;
        }
    }
    out.push(check(
        format!("predicted cached tokens equal the engines' on at least 99.9% of requests ({HERO}, every routing run)"),
        ">= 99.9%",
        if compared > 0 { format!("{} ({exact} of {compared})", pct(exact as f64 / compared as f64)) } else { "not measured".into() },
        (compared > 0).then(|| exact as f64 / compared as f64 >= 0.999),
    ));
    // Inferrail's own share at a client count: over the same Envoy without it; over the floor as well, for the record.
    let added = |clients: usize| {
        let level = ladder.and_then(|l| l.value.long_prompt.as_ref()).and_then(|lp| lp.levels.iter().find(|l| l.clients == clients));
        let rung = |name: &str| level.and_then(|l| l.rungs.iter().find(|r| r.rung == name));
        rung("inferrail").zip(rung("envoy")).map(|(i, e)| (i.latency.mean_ms - e.latency.mean_ms, i.added_mean_ms))
    };
    // One client, where nothing waits for the cores, for the record: what Inferrail itself takes.
    let alone = added(1).map_or(String::new(), |(over_envoy, _)| format!("; {over_envoy:.1} ms from one client"));
    let added = added(20);
    out.push(check(
        "inferrail adds under 10 ms mean TTFT over plain Envoy with 220 KB prompts from 20 clients",
        "< 10 ms",
        added.map_or("not measured".into(), |(over_envoy, over_floor)| {
            format!("{over_envoy:.1} ms ({over_floor:.1} ms over straight to the simulators{alone})")
        }),
        added.map(|(over_envoy, _)| over_envoy < 10.0),
    ));
    out
}

/// Whether a run's router learned the engines' caches from their KV events
/// (exact mode) rather than from its own decisions (approximate).
fn exact_mode(r: &CompareRun) -> bool {
    r.command.split_whitespace().any(|a| a == "--kv-events")
}

/// Issue 39's checks beyond each workload's lowest p99 and highest goodput:
/// a mixed fleet's capacity on real simulators, agent-loop predictions in
/// each mode (over `routing` and the runs kept for `predictions` alone), and
/// the fleet simulation's capacity on agent loops and RAG.
pub fn reuse(routing: &Contenders, predictions: &[CompareRun], mixed: &[Loaded<RealCapacity>], fleet: &[FleetWorkload]) -> Vec<Check> {
    let mut out = Vec::new();
    for w in ["w1", "mix"] {
        let name = format!(
            "on a mixed fleet of real simulators, {HERO}'s capacity at the SLO on {w} is at least 1.3x the best cache-blind policy's and above every peer router's"
        );
        let target = ">= 1.3x cache-blind; above every peer";
        let blind = fastest(BLIND.iter().filter_map(|c| find(mixed, w, c)));
        let peer = fastest(mixed.iter().map(|c| &c.value).filter(|c| c.workload == w && router_of(&c.contender) != "inferrail"));
        out.push(match (find(mixed, w, HERO), blind, peer) {
            (Some(h), Some(b), Some(p)) => {
                let over = |x: &RealCapacity| if x.rate > 0.0 { h.rate / x.rate } else { f64::INFINITY };
                let measured = format!(
                    "{} req/s on {} simulators: {:.2}x {} ({} req/s), {:.2}x the best peer, {} ({} req/s)",
                    num(h.rate),
                    h.replicas,
                    over(b),
                    b.contender,
                    num(b.rate),
                    over(p),
                    p.contender,
                    num(p.rate)
                );
                check(name, target, measured, Some(over(b) >= 1.3 && h.rate > p.rate))
            }
            _ => check(
                name,
                target,
                format!("not measured: no mixed-fleet capacity search of {HERO}, a cache-blind policy and a peer on {w}"),
                None,
            ),
        });
    }
    // A run in both is counted once.
    let compared = routing.get("agent", HERO).unwrap_or_default();
    let apart = predictions
        .iter()
        .filter(|r| r.workload == "agent" && r.contender == HERO && !compared.iter().any(|c| c.command == r.command && c.rep == r.rep));
    let agent: Vec<&CompareRun> = compared.iter().chain(apart).collect();
    for (exact, mode, least) in [(false, "approximate mode", 0.95), (true, "exact mode (KV events)", 0.999)] {
        let (compared, hits) = agent
            .iter()
            .filter(|r| exact_mode(r) == exact)
            .fold((0, 0), |(c, e), r| (c + r.summary.prediction.compared, e + r.summary.prediction.exact));
        out.push(check(
            format!("{mode}: {HERO}'s predicted cached tokens equal the engines' on at least {} of agent-loop steps", pct(least)),
            &format!(">= {}", pct(least)),
            if compared > 0 { format!("{} ({hits} of {compared})", pct(hits as f64 / compared as f64)) } else { "not measured".into() },
            (compared > 0).then(|| hits as f64 / compared as f64 >= least),
        ));
    }
    for w in ["agent", "rag"] {
        let name = format!("fleet simulation: {HERO}'s capacity at the SLO on {w} is above every other policy's at 4, 16 and 64 replicas");
        let target = "above every other at each size";
        let Some(g) = fleet.iter().find(|g| g.workload == w) else {
            out.push(check(name, target, "not measured".into(), None));
            continue;
        };
        let (mut parts, mut failed, mut missing) = (Vec::new(), false, false);
        for n in [4, 16, 64] {
            // Each other policy's ratio to cost_model, the best other being the lowest.
            let ratios: Vec<(&str, f64)> =
                g.policies().into_iter().filter(|p| *p != HERO).filter_map(|p| g.ratio(HERO, p, n).map(|(r, _)| (p, r))).collect();
            let rr = ratios.iter().find(|(p, _)| *p == "round_robin");
            let best = ratios.iter().filter(|(p, _)| *p != "round_robin").min_by(|a, b| a.1.total_cmp(&b.1));
            match (rr, best) {
                (Some((_, r)), Some((b, x))) => {
                    failed |= ratios.iter().any(|(_, r)| *r <= 1.0);
                    parts.push(format!("at {n}: {r:.2}x round_robin, {x:.2}x {b} (the best other)"));
                }
                _ => {
                    missing = true;
                    parts.push(format!("at {n}: not searched"));
                }
            }
        }
        let verdict = if failed { Some(false) } else { (!missing).then_some(true) };
        out.push(check(name, target, parts.join("; "), verdict));
    }
    out
}
