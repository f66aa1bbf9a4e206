"""Admission by band: interactive time to first token while batch traffic
saturates the fleet, with admission off and on.

The fleet is the end-to-end suite's (three simulators with the default
latency model, Envoy, inferrail with cost_model). Each mode runs:

- idle: interactive requests alone, `--rate` per second (Poisson), short
  prompts of their own, 4 tokens, streamed (TTFT is the first body byte);
- loaded: the same interactive stream while `--batch` clients (threads of
  a process of their own) each keep one long request in flight (a closed
  loop: a prompt of ~`--batch-words` words of its own, 64 tokens, not
  streamed), the first `--warmup-s` not counted.

"off" has no `admission` section: every request is forwarded at once.
"bands" sends interactive requests in band `interactive` and batch requests
in band `batch` (BANDS below). "kept" is "bands" with the batch band kept
to two of the three replicas (`replica_share: 0.67`), leaving the third to
interactive requests; "kept-one" keeps batch to one (`--modes` picks any;
the default runs the first three). The batch band's completions per
second are its throughput.

Run with `just bench-admission` (it builds the release binaries).
"""

import argparse
import http.client as httpc
import json
import multiprocessing
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "crates" / "inferrail" / "tests" / "e2e"))
from conftest import Fleet  # noqa: E402  (the end-to-end suite's fleet)

WORDS = ("the of and to in is that river stone cloud lantern garden silver copper window mountain ocean forest "
         "delta build test file error result value function return list table query index status").split(" ")

BANDS = """admission:
  bands:
    - {name: interactive, ttft_objective_ms: 1000, max_wait_ms: 10000}
    - {name: batch, ttft_objective_ms: 150, max_wait_ms: 200000, replica_share: %s}
"""
CONFIG = {"off": "", "bands": BANDS % 1.0, "kept": BANDS % 0.67, "kept-one": BANDS % 0.34}


def head_commit():
    """The commit the results come from."""
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()


def words(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


class Answer:
    """One completion through Envoy: its status (0: no answer), seconds to
    its first body byte and in all, its headers and its body."""

    def __init__(self, status, first, total, headers=None, body=b""):
        self.status, self.first, self.total, self.headers, self.body = status, first, total, headers or {}, body


def post(port, body, band=None, stream=False, timeout=300, headers=None):
    """Posts a completion through Envoy, in `band` when given, with more `headers`."""
    started = time.monotonic()
    c = httpc.HTTPConnection("127.0.0.1", port, timeout=timeout)
    sent = {"content-type": "application/json", **(headers or {})}
    if band:
        sent["x-inferrail-band"] = band
    try:
        c.request("POST", "/v1/completions", body=json.dumps({**body, "stream": stream}), headers=sent)
        r = c.getresponse()
        head = r.read(1)
        first = time.monotonic() - started
        rest = r.read()
        return Answer(r.status, first, time.monotonic() - started, {k.lower(): v for k, v in r.getheaders()}, head + rest)
    except OSError:
        return Answer(0, None, time.monotonic() - started)
    finally:
        c.close()


def poisson(rng, rate, seconds, arrival):
    """Poisson arrivals at `rate` for `seconds`: each runs `arrival(rng, at)`
    (the function it returns, on a thread of its own; `at`: when it
    arrived). Returns when every one has run."""
    threads, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        t = threading.Thread(target=arrival(rng, time.monotonic()))
        t.start()
        threads.append(t)
        time.sleep(rng.expovariate(rate))
    for t in threads:
        t.join()


def interactive(port, rng, rate, seconds, banded, out):
    """Interactive requests at Poisson arrivals for `seconds`; each appended
    to `out` as (sent at, status, ttft, upstream, seconds in all)."""
    def arrival(rng, at):
        body = {"model": "sim", "prompt": words(rng, 40), "max_tokens": 4}

        def one():
            a = post(port, body, "interactive" if banded else None, True)
            out.append((at, a.status, a.first, a.headers.get("x-inferrail-upstream"), a.total))
        return one

    poisson(rng, rate, seconds, arrival)


def batch(port, seed, banded, words_n, stop, done):
    rng = random.Random(seed)
    while not stop.is_set():
        body = {"model": "sim", "prompt": words(rng, words_n), "max_tokens": 64}
        done.append((time.monotonic(), post(port, body, "batch" if banded else None).status))


def batch_clients(port, seed, n, banded, words_n, stop, answers):
    """`n` batch clients in a process of their own, so that their threads
    never hold the measuring client's interpreter lock; when `stop` is set,
    puts their (time, status) list on `answers`."""
    done = []
    clients = [threading.Thread(target=batch, args=(port, seed + i, banded, words_n, stop, done)) for i in range(n)]
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    answers.put(done)


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def summary(results, since):
    kept = [r for r in results if r[0] >= since]
    ttfts = [r[2] for r in kept if r[1] == 200 and r[2] is not None]
    statuses = {}
    for r in kept:
        statuses[str(r[1])] = statuses.get(str(r[1]), 0) + 1
    upstreams = {}
    for r in kept:
        upstreams[str(r[3])] = upstreams.get(str(r[3]), 0) + 1
    # Whether another interactive request was still being answered by the same replica when it was sent.
    def shared(r):
        return any(o is not r and o[3] == r[3] and o[0] <= r[0] < o[0] + o[4] for o in results)

    ok = [r for r in kept if r[1] == 200 and r[2] is not None]
    alone = [r[2] for r in ok if not shared(r)]
    ms = lambda v: v and round(v * 1e3, 1)  # noqa: E731
    slowest = sorted(((ms(r[2]), r[3], shared(r)) for r in ok), reverse=True)[:3]
    return {"requests": len(kept), "statuses": statuses,
            "ttft_p50_ms": ms(pct(ttfts, 0.5)), "ttft_p99_ms": ms(pct(ttfts, 0.99)),
            "by_upstream": upstreams, "slowest_ms_upstream_and_shared": slowest,
            "not_sharing": {"requests": len(alone), "ttft_p50_ms": ms(pct(alone, 0.5)), "ttft_p99_ms": ms(pct(alone, 0.99))}}


def run(mode, args):
    banded = mode != "off"
    tmp = Path(tempfile.mkdtemp(prefix=f"admission-{mode}-"))
    fleet = Fleet(tmp, policy="cost_model", config_extra=CONFIG[mode]).start()
    try:
        rng = random.Random(args.seed)
        idle = []
        interactive(fleet.listen, rng, args.rate, args.idle_s, banded, idle)
        mp = multiprocessing.get_context("fork")
        stop, answers = mp.Event(), mp.Queue()
        clients = mp.Process(target=batch_clients, args=(fleet.listen, args.seed + 1, args.batch, banded, args.batch_words, stop, answers))
        clients.start()
        started = time.monotonic()
        loaded = []
        interactive(fleet.listen, rng, args.rate, args.warmup_s + args.measure_s, banded, loaded)
        measured_from = started + args.warmup_s
        ended = time.monotonic()
        stop.set()
        # Both processes read the same monotonic clock.
        completed = [d for d in answers.get() if measured_from <= d[0] <= ended]
        clients.join()
        batch_statuses = {}
        for d in completed:
            batch_statuses[str(d[1])] = batch_statuses.get(str(d[1]), 0) + 1
        return {
            "mode": mode,
            "idle": summary(idle, 0),
            "loaded": summary(loaded, measured_from),
            "batch": {"completed_per_s": round(sum(1 for d in completed if d[1] == 200) / (ended - measured_from), 2),
                      "statuses": batch_statuses},
            "sheds": fleet.metric("inferrail_admission_shed_total", 'reason="waited",band="batch"') if banded else None,
        }
    finally:
        fleet.stop()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=2.0)
    p.add_argument("--batch", type=int, default=500)
    p.add_argument("--batch-words", type=int, default=600)
    p.add_argument("--idle-s", type=float, default=20)
    p.add_argument("--warmup-s", type=float, default=15)
    p.add_argument("--measure-s", type=float, default=40)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--modes", default="off,bands,kept")
    p.add_argument("--out", default="bench/results/admission/bands.json")
    args = p.parse_args()
    commit = head_commit()
    out = Path(args.out)
    # Modes run earlier stay, each with its commit and arguments.
    results = {r["mode"]: r for r in json.loads(out.read_text())["results"]} if out.exists() else {}
    for mode in args.modes.split(","):
        r = {"commit": commit, "args": vars(args), "admission": CONFIG[mode], **run(mode, args)}
        idle, loaded = r["idle"]["ttft_p99_ms"], r["loaded"]["ttft_p99_ms"]
        r["p99_over_idle"] = round(loaded / idle, 2) if idle and loaded else None
        print(json.dumps(r), flush=True)
        results[mode] = r
    out.write_text(json.dumps({"results": list(results.values())}, indent=1) + "\n")


if __name__ == "__main__":
    main()
