"""Router CPU per request with one router and with two peer routers (ADR 0034).

The end-to-end suite's fleet (three zero-latency simulators, Envoy, inferrail
with cost_model) on release builds: closed-loop clients send the same chat
request (a ~250-token system prompt, one output token) through Envoy, and
each process's CPU time (utime + stime from /proc) is read before and after.
With two routers, each ext_proc stream's router is drawn at random and the
routers are each other's peers; their CPU is summed. Runs alternate between
one and two routers, since this machine's speed drifts between minutes.

Run with `just bench-routers-cpu` (it builds the release binaries).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "crates" / "inferrail" / "tests" / "e2e"))
from conftest import MODEL, Fleet, http  # noqa: E402  (the end-to-end suite's fleet)

HZ = os.sysconf("SC_CLK_TCK")
BODY = {"model": MODEL, "max_tokens": 1,
        "messages": [{"role": "system", "content": "You are a helpful assistant. " * 40}, {"role": "user", "content": "hi"}]}


def cpu_s(pid):
    """A process's user and system CPU seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / HZ


def run(routers, requests, clients, warmup):
    with tempfile.TemporaryDirectory() as tmp:
        fleet = Fleet(Path(tmp), policy="cost_model", sim_flags=["--zero-latency"], routers=routers).start()
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
    return {"routers": routers, "requests": sent, "rps": round(sent / elapsed),
            "router_cpu_us_per_request": per(sum(v for k, v in used.items() if k != "envoy")),
            "envoy_cpu_us_per_request": per(used["envoy"])}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    runs = []
    for _ in range(a.rounds):
        for routers in (1, 2):
            runs.append(run(routers, a.requests, a.clients, a.warmup))
            print(runs[-1], file=sys.stderr, flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    result = {
        "benchmark": "router-cpu-per-request", "commit": commit, "command": "just bench-routers-cpu",
        "setup": f"3 inferrail-sim --zero-latency, Envoy (envoy/local.yaml; two routers: streams drawn at random), inferrail "
                 f"release builds, peers listed, cost_model, builtin:sim tokenizer; a ~250-token system prompt and 1 output token "
                 f"from {a.clients} closed-loop clients, {a.requests} measured after {a.warmup}; CPU from /proc (utime + stime), "
                 f"summed over the routers; rounds alternate one and two routers",
        "runs": runs,
    }
    text = json.dumps(result, indent=1) + "\n"
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
