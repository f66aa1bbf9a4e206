"""Production controls through Envoy on three simulators (the end-to-end
suite's fleet, release builds): tenant fairness, token limits, shedding
under full load, and shadow mode. Run with `just bench-controls`; each
scenario can run alone (`--scenarios fairness,limits,shed,shadow`).

- fairness: replicas with 4 slots each. A polite tenant sends `--polite`
  requests per second (Poisson), a greedy one ten times as many, both
  with 32-token completions, for a warm-up and a measured span. "alone":
  the polite tenant by itself. "shared": both, naming no tenant, so one
  queue in arrival order. "fair": both naming their tenants, so the band
  shares out by virtual token counters (ADR 0042). The polite tenant's
  completions per second in each.
- limits: one tenant with a limit of `--limit-tokens` prompt tokens per
  second sends three times that. From the decision log (every decision,
  with its time and prompt tokens): the most tokens admitted in any one
  second window against the limit, and the largest request; the 429s and
  their Retry-After.
- shed: two slots per replica, all taken by long requests, and a queue of
  8; then a burst of 60 requests at once. Their statuses, how long the
  refusals took, whether each carried Retry-After, and whether Envoy sent
  any request the router had not routed (its fell-open and timed-out
  counters, and requests sent to the replicas against decisions made).
- shadow: the same routing run twice (shared system prompts, a steady
  rate), without and with `shadow_policy: kv_aware` beside cost_model:
  the agreement rate, and the live decision's time and the router's CPU
  time per request in each.
"""

import argparse
import json
import random
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

from admission import Fleet, head_commit, pct, poisson, post, words

MODEL = "sim"


def sending(port, make, out):
    """A `poisson` arrival that posts `make(rng)` (body, headers) and
    appends (sent at, Answer) to `out`."""
    def arrival(rng, at):
        body, headers = make(rng)
        return lambda: out.append((at, post(port, body, headers=headers, timeout=120)))
    return arrival


def statuses(answers):
    out = {}
    for a in answers:
        out[str(a.status)] = out.get(str(a.status), 0) + 1
    return out


def cpu_seconds(pid):
    """User and system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0


def fleet(name, **kw):
    return Fleet(Path(tempfile.mkdtemp(prefix=f"controls-{name}-")), **kw).start()


FAIRNESS = """admission:
  bands:
    - {name: shared, max_wait_ms: 3000}
  max_queued_requests: 32
  tenants:
    - {name: polite}
    - {name: greedy}
"""


def fairness(args):
    results = {}
    for mode in ["alone", "shared", "fair"]:
        f = fleet(f"fairness-{mode}", policy="cost_model", config_extra=FAIRNESS, replica_extra=", max_concurrency: 4")
        try:
            def sender(tenant):
                def make(rng):
                    headers = {"x-inferrail-tenant": tenant} if mode != "shared" else {}
                    return {"model": MODEL, "prompt": words(rng, 100), "max_tokens": 32}, headers
                return make

            polite, greedy = [], []
            span = args.warmup_s + args.measure_s
            senders = [threading.Thread(target=poisson, args=(random.Random(args.seed), args.polite, span, sending(f.listen, sender("polite"), polite)))]
            if mode != "alone":
                greedy_arrivals = sending(f.listen, sender("greedy"), greedy)
                senders.append(threading.Thread(target=poisson, args=(random.Random(args.seed + 1), 10 * args.polite, span, greedy_arrivals)))
            started = time.monotonic()
            for s in senders:
                s.start()
            for s in senders:
                s.join()
            since, until = started + args.warmup_s, started + span

            def served(sent):
                kept = [a for at, a in sent if since <= at < until]
                return {"sent": len(kept), "statuses": statuses(kept),
                        "completed_per_s": round(sum(a.status == 200 for a in kept) / args.measure_s, 2)}

            results[mode] = {"polite": served(polite), "greedy": served(greedy) if greedy else None}
            print(mode, json.dumps(results[mode]), flush=True)
        finally:
            f.stop()
    alone = results["alone"]["polite"]["completed_per_s"]
    for mode in ["shared", "fair"]:
        results[mode]["polite_share_of_alone"] = round(results[mode]["polite"]["completed_per_s"] / alone, 3) if alone else None
    return results


def limits(args):
    window_ms = 1000
    extra = (f"admission:\n  tenants:\n    - {{name: metered, limits: [{{tokens: {args.limit_tokens}, window_ms: {window_ms}}}]}}\n"
             "observability: {decision_log: {path: DECISIONS, sample_rate: 1.0}}\n")
    tmp = Path(tempfile.mkdtemp(prefix="controls-limits-"))
    log = tmp / "decisions.jsonl"
    f = Fleet(tmp / "fleet", policy="cost_model", config_extra=extra.replace("DECISIONS", str(log))).start()
    try:
        sent = []

        def make(rng):
            return {"model": MODEL, "prompt": words(rng, 100), "max_tokens": 4}, {"x-inferrail-tenant": "metered"}

        # About 130 prompt tokens each: three times the limit.
        rate = 3 * args.limit_tokens / 130
        poisson(random.Random(args.seed), rate, args.measure_s, sending(f.listen, make, sent))
        time.sleep(1)
    finally:
        f.stop()
    decisions = [json.loads(line) for line in log.read_text().splitlines()]
    admitted = sorted((d["time"], d["prompt_tokens"]) for d in decisions if d["kind"] == "decision")
    # The most tokens admitted in any window ending at an admission.
    most, start, total = 0, 0, 0
    for t, n in admitted:
        total += n
        while admitted[start][0] <= t - window_ms:
            total -= admitted[start][1]
            start += 1
        most = max(most, total)
    answers = [a for _, a in sent]
    refused = [a for a in answers if a.status == 429]
    retry = [float(a.headers["retry-after"]) for a in refused if "retry-after" in a.headers]
    result = {
        "limit_tokens": args.limit_tokens, "window_ms": window_ms, "sent_per_s": round(rate, 1), "statuses": statuses(answers),
        "admitted": len(admitted), "most_tokens_in_a_window": most, "largest_request_tokens": max((n for _, n in admitted), default=0),
        "over_limit_by": max(0, most - args.limit_tokens), "refusals_with_retry_after": f"{len(retry)}/{len(refused)}",
        "retry_after_s": sorted(set(retry)),
        "openai_error_shape": all(json.loads(a.body).get("error", {}).get("type") for a in refused),
    }
    print("limits", json.dumps(result), flush=True)
    return result


def decisions(f):
    """Decisions the router made so far."""
    return sum(float(v) for v in re.findall(r'^inferrail_decisions_total\{[^}]*\} (\S+)$', f.metrics(), re.M))


SHED = """admission:
  bands:
    - {name: only, max_wait_ms: 2000}
  max_queued_requests: 8
"""


def shed(args):
    f = fleet("shed", policy="cost_model", config_extra=SHED, replica_extra=", max_concurrency: 2")
    try:
        rng = random.Random(args.seed)
        before = decisions(f)
        holders = [threading.Thread(target=post, args=(f.listen, {"model": MODEL, "prompt": words(rng, 20), "max_tokens": 600}),
                                    kwargs={"timeout": 120}) for _ in range(6)]
        for h in holders:
            h.start()
        # Every slot taken (three replicas, two each).
        deadline = time.monotonic() + 30
        while decisions(f) < before + 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        burst = []

        def one():
            burst.append(post(f.listen, {"model": MODEL, "prompt": words(random.Random(), 20), "max_tokens": 4}, timeout=120))

        threads = [threading.Thread(target=one) for _ in range(args.burst)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        refused = [a for a in burst if a.status in (429, 503)]
        at_once = [a.total for a in refused if a.total < 1.0]
        decided = decisions(f)
        result = {
            "burst": args.burst, "statuses": statuses(burst),
            "refused_within_1s": len(at_once), "refused_after_waiting": len(refused) - len(at_once),
            "refusal_ms_p50": pct([a.total * 1e3 for a in refused], 0.5), "refusal_ms_max": max((a.total * 1e3 for a in refused), default=None),
            "refusals_with_retry_after": f"{sum('retry-after' in a.headers for a in refused)}/{len(refused)}",
            "envoy_failure_mode_allowed": f.envoy_stat("failure_mode_allowed"), "envoy_message_timeouts": f.envoy_stat("message_timeouts"),
            "sent_to_replicas": f.replicas_stat("upstream_rq_total"), "router_decisions": decided,
        }
        for h in holders:
            h.join()
    finally:
        f.stop()
    print("shed", json.dumps(result), flush=True)
    return result


def shadow(args):
    systems = [words(random.Random(100 + i), 300) for i in range(8)]
    results = {}
    for mode, policy in [("live only", "cost_model"), ("with shadow", "cost_model, shadow_policy: kv_aware")]:
        f = fleet(f"shadow-{mode.replace(' ', '-')}", policy=policy)
        try:
            def make(rng):
                return {"model": MODEL, "prompt": rng.choice(systems) + " " + words(rng, 30), "max_tokens": 16}, {}

            pid = f.procs["inferrail"].pid
            text = f.metrics()
            cpu0 = cpu_seconds(pid)
            sent = []
            poisson(random.Random(args.seed), args.shadow_rate, args.measure_s, sending(f.listen, make, sent))
            cpu = cpu_seconds(pid) - cpu0
            text = f.metrics()
            n = len(sent)

            def total(name):
                return sum(float(v) for v in re.findall(rf'^{name}(?:\{{[^}}]*\}})? (\S+)$', text, re.M))

            agreed = sum(float(v) for v in re.findall(r'^inferrail_shadow_decisions_total\{[^}]*agreed="true"[^}]*\} (\S+)$', text, re.M))
            shadowed = total("inferrail_shadow_decisions_total")
            ttfts = [a.first for _, a in sent if a.status == 200]
            results[mode] = {
                "requests": n, "statuses": statuses(a for _, a in sent),
                "decision_us_mean": round(total("inferrail_decision_seconds_sum") / total("inferrail_decision_seconds_count") * 1e6, 1),
                "router_cpu_ms_per_request": round(cpu / n * 1e3, 3),
                "shadowed": shadowed, "agreement": round(agreed / shadowed, 3) if shadowed else None,
                "client_latency_ms_p50": round(pct(ttfts, 0.5) * 1e3, 1),
            }
            print(mode, json.dumps(results[mode]), flush=True)
        finally:
            f.stop()
    live, both = results["live only"], results["with shadow"]
    results["added_decision_us_mean"] = round(both["decision_us_mean"] - live["decision_us_mean"], 1)
    results["cpu_ratio"] = round(both["router_cpu_ms_per_request"] / live["router_cpu_ms_per_request"], 3)
    return results


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenarios", default="fairness,limits,shed,shadow")
    p.add_argument("--polite", type=float, default=3.0)
    p.add_argument("--limit-tokens", type=int, default=2000)
    p.add_argument("--burst", type=int, default=60)
    p.add_argument("--shadow-rate", type=float, default=20.0)
    p.add_argument("--warmup-s", type=float, default=5)
    p.add_argument("--measure-s", type=float, default=30)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="bench/results/admission/controls.json")
    args = p.parse_args()
    commit = head_commit()
    run = {"fairness": fairness, "limits": limits, "shed": shed, "shadow": shadow}
    out = Path(args.out)
    results = json.loads(out.read_text())["results"] if out.exists() else {}
    for name in args.scenarios.split(","):
        results[name] = {"commit": commit, **run[name](args)}
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
