"""CPU per small request: the router and Envoy, for each way of running them.

The end-to-end suite's fleet (three zero-latency simulators, Envoy, inferrail
with cost_model) on release builds: closed-loop clients send the same chat
request (a ~250-token system prompt, one output token) through Envoy, and
each process's CPU time (utime + stime from /proc) is read before and after.
Small requests show what every request pays besides tokenizing; the
overhead ladder (`just bench-overhead`) measures long prompts.

Variants (ADR 0034, ADR 0035):
- `shipped`: `envoy/local.yaml` as it is (the route stream carries the
  response's status, the access log its first body byte), one router
  thread (`server.threads: 1`);
- `observe`: the observe filter (`envoy/filters/observe.yaml`) in place of
  the access log, the route stream's response headers off: the layout
  before ADR 0035;
- `observe-2-threads`: that with `server.threads: 2`, what ran before;
- `two-routers`: shipped, with two peer routers (streams drawn at random;
  their CPU is summed);
- `round-robin`: shipped, with round_robin instead of cost_model;
- `pd-split`: that on a disaggregated fleet (one prefill replica, two
  decoders): every request is split, and the router sends each prefill leg
  itself (ADR 0056). Against `round-robin`, what running the leg costs.
Rounds go through every variant in turn, since this machine's speed drifts
between minutes: compare variants within a round.

Run with `just bench-cpu` (it builds the release binaries).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "crates" / "inferrail" / "tests" / "e2e"))
from conftest import MODEL, Fleet, http, observe_filter  # noqa: E402  (the end-to-end suite's fleet)

HZ = os.sysconf("SC_CLK_TCK")
BODY = {"model": MODEL, "max_tokens": 1,
        "messages": [{"role": "system", "content": "You are a helpful assistant. " * 40}, {"role": "user", "content": "hi"}]}


def cpu_s(pid):
    """A process's user and system CPU seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / HZ


def observe_layout(envoy):
    """`envoy/local.yaml` as it ran before ADR 0035: the observe filter in
    place of the access log, and the route stream without the response's headers."""
    envoy, n = re.subn(r"response_header_mode: SEND", "response_header_mode: SKIP", envoy)
    assert n == 1, "envoy/local.yaml's route filter should send the response's headers"
    return observe_filter(envoy)


VARIANTS = {
    "shipped": dict(routers=1, threads=1, edit=None),
    "observe": dict(routers=1, threads=1, edit=observe_layout),
    "observe-2-threads": dict(routers=1, threads=2, edit=observe_layout),
    "two-routers": dict(routers=2, threads=1, edit=None),
    "round-robin": dict(routers=1, threads=1, edit=None, policy="round_robin"),
    "pd-split": dict(routers=1, threads=1, edit=None, policy="round_robin", roles=["prefill", "decode", "decode"]),
}


def run(variant, requests, clients, warmup):
    v = VARIANTS[variant]
    with tempfile.TemporaryDirectory() as tmp:
        fleet = Fleet(Path(tmp), policy=v.get("policy", "cost_model"), sim_flags=["--zero-latency"], routers=v["routers"],
                      envoy_edit=v["edit"], roles=v.get("roles"))
        for c in fleet.configs:
            text = c.read_text()
            c.write_text(text.replace("shutdown_grace_ms: 2000}", f"shutdown_grace_ms: 2000, threads: {v['threads']}}}", 1))
        fleet.start()
        try:
            for _ in range(warmup):
                assert http("POST", f"{fleet.url}/v1/chat/completions", BODY).status == 200
            names = [k for k in fleet.procs if k.startswith("inferrail")] + ["envoy"]
            before = {k: cpu_s(fleet.procs[k].pid) for k in names}
            start = time.monotonic()

            def client(_):
                for _ in range(requests // clients):
                    assert http("POST", f"{fleet.url}/v1/chat/completions", BODY).status == 200

            with ThreadPoolExecutor(clients) as pool:
                list(pool.map(client, range(clients)))
            elapsed = time.monotonic() - start
            used = {k: cpu_s(fleet.procs[k].pid) - before[k] for k in names}
        finally:
            fleet.stop()
    sent = requests // clients * clients
    per = lambda s: round(s / sent * 1e6)
    router, envoy = per(sum(v for k, v in used.items() if k != "envoy")), per(used["envoy"])
    return {"variant": variant, "requests": sent, "rps": round(sent / elapsed),
            "router_cpu_us_per_request": router, "envoy_cpu_us_per_request": envoy, "both_us": router + envoy}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    variants = a.variants.split(",")
    runs = []
    for _ in range(a.rounds):
        for variant in variants:
            runs.append(run(variant, a.requests, a.clients, a.warmup))
            print(runs[-1], file=sys.stderr, flush=True)
    # Each variant against `shipped` in the same round, then the median over rounds.
    ratios = {}
    for variant in variants:
        per_round = [r["both_us"] / s["both_us"] for r, s in zip(runs[variants.index(variant)::len(variants)],
                                                                  runs[variants.index("shipped")::len(variants)])] \
            if "shipped" in variants else []
        if per_round:
            ratios[variant] = round(sorted(per_round)[len(per_round) // 2], 3)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    result = {
        "benchmark": "cpu-per-small-request", "commit": commit, "command": "just bench-cpu",
        "setup": f"3 inferrail-sim --zero-latency, Envoy (envoy/local.yaml, --concurrency 2), inferrail release builds, cost_model, "
                 f"builtin:sim tokenizer; a ~250-token system prompt and 1 output token from {a.clients} closed-loop clients, "
                 f"{a.requests} measured after {a.warmup}; CPU from /proc (utime + stime); rounds go through the variants in turn",
        "variants": {k: {kk: vv for kk, vv in v.items() if kk != "edit"} | {"envoy": "observe filter" if v["edit"] else "access log"}
                     for k, v in VARIANTS.items() if k in variants},
        "router_and_envoy_cpu_over_shipped_median": ratios,
        "runs": runs,
    }
    text = json.dumps(result, indent=1) + "\n"
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
