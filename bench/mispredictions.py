"""Why a harness run's predictions missed: each mispredicted request, as the
router foresaw it and as the engine found it.

`inferrail-bench compare` lists each run's mispredicted requests (up to 200)
with their `x-request-id` in its JSON. This joins each one with the router's
decision for it (`logs/<run>/decisions.jsonl`: the winner's GPU, host and
held prefix) and with the simulator's `scheduled` line for it (tokens found
on the GPU and in host memory, then and when it arrived, time queued, free
blocks, and, with KV events on, what evicted the first block it lacked and
how many steps before), which the simulators log when the harness runs with
`RUST_LOG=info,inferrail_sim=debug`.

Each miss is then put in one of four kinds: over or under (predicted more or
fewer cached tokens than the engine reported), on the GPU or in host memory
(where the prediction and the engine's find first part). The misses whose
prediction was what the engine held when the request arrived are counted
too: there the router's view was right, and what happened while the
request waited was not foreseen.

    python3 bench/mispredictions.py OUT_DIR [RUN]
"""

import argparse
import collections
import json
import re
import sys
from pathlib import Path

ANSI = re.compile(r"\x1b\[[0-9;]*m")
FIELD = re.compile(r"(\w+)=(\S+)")


def decisions(path):
    """Each decision of the log, by request id."""
    out = {}
    for line in path.open():
        d = json.loads(line)
        if d.get("kind") == "decision" and d.get("request_id"):
            out[d["request_id"]] = d
    return out


def scheduled(logs):
    """Each simulator's `scheduled` lines, by request id."""
    out = {}
    for path in sorted(logs.glob("sim-*.log")):
        for line in path.open(errors="replace"):
            line = ANSI.sub("", line)
            if " scheduled " not in line and not line.rstrip().endswith("scheduled"):
                continue
            fields = dict(FIELD.findall(line))
            if "request_id" in fields:
                out[fields["request_id"]] = {k: int(v) if v.isdigit() else v.strip('"') for k, v in fields.items()}
    return out


def kind(predicted, cached, gpu_predicted, engine):
    """Over or under, and where the two first part."""
    side = "over" if predicted > cached else "under"
    if engine is not None:
        where = "gpu" if engine["gpu_cached_tokens"] != gpu_predicted else "host"
    else:
        where = "gpu" if min(predicted, cached) < gpu_predicted else "host"
    return f"{side}/{where}"


def report(result, logs, out):
    run = json.loads(result.read_text())
    missed = run.get("mispredicted", [])
    decided = decisions(logs / "decisions.jsonl") if (logs / "decisions.jsonl").exists() else {}
    found = scheduled(logs)
    kinds, takers = collections.Counter(), collections.Counter()
    # Misses whose prediction was what the engine held when the request
    # arrived: the view was right, and the wait changed what it found.
    as_arrived, known = 0, 0
    print(f"## {result.stem}: {len(missed)} mispredicted", file=out)
    print("at s | replica | prompt | predicted (gpu + host, held) | engine (gpu + host) | on arrival (gpu + host) | queued ms | free blocks | first block lacked, evicted by | kind", file=out)
    for m in missed:
        rid = m.get("request_id")
        d = decided.get(rid, {})
        winner = next((c for c in d.get("candidates", []) if c.get("replica") == m.get("replica")), None)
        predicted, cached = m.get("predicted_cached_tokens") or 0, m.get("cached_tokens") or 0
        host = winner["host_cached_tokens"] if winner else 0
        gpu = predicted - host
        held = winner["held_cached_tokens"] if winner else "?"
        engine = found.get(rid)
        k = kind(predicted, cached, gpu, engine)
        kinds[k] += 1
        seen = f"{engine['gpu_cached_tokens']} + {engine['host_cached_tokens']}" if engine else "?"
        arrived = f"{engine.get('gpu_at_arrival', '?')} + {engine.get('host_at_arrival', '?')}" if engine else "?"
        if engine and isinstance(engine.get("gpu_at_arrival"), int) and isinstance(engine.get("host_at_arrival"), int):
            known += 1
            as_arrived += int(predicted == engine["gpu_at_arrival"] + engine["host_at_arrival"])
        queued = engine.get("queued_ms", "?") if engine else "?"
        free = engine.get("free_blocks", "?") if engine else "?"
        by = engine.get("first_missing_evicted_by", "?") if engine else "?"
        takers[f"{k} {by}"] += 1
        if by not in ("?", "none"):
            by = f"{by}, {engine.get('first_missing_evicted_steps_ago')} steps before"
        print(f"{m['at_s']:.1f} | {m.get('replica')} | {m.get('prompt_tokens')} | {gpu} + {host}, {held} | {seen} | {arrived} | {queued} | {free} | {by} | {k}", file=out)
    print("kinds: " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())), file=out)
    print("first block lacked, evicted by: " + ", ".join(f"{k} {n}" for k, n in sorted(takers.items())), file=out)
    if known:
        print(f"predicted what the engine held when the request arrived (the wait changed it): {as_arrived} of {known}", file=out)
    return kinds


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path, help="an `inferrail-bench compare --out-dir`")
    p.add_argument("run", nargs="?", help="one run's name (its JSON's stem); all runs otherwise")
    a = p.parse_args()
    results = sorted(r for r in a.out_dir.glob("*.json") if a.run in (None, r.stem))
    if not results:
        sys.exit(f"no run results in {a.out_dir}")
    total = collections.Counter()
    for r in results:
        total += report(r, a.out_dir / "logs" / r.stem, sys.stdout)
    if len(results) > 1:
        print("all runs: " + ", ".join(f"{k} {n}" for k, n in sorted(total.items())))


if __name__ == "__main__":
    main()
