"""The stress suite (`just stress`): the local fleet (three simulators, the
router, a real Envoy running envoy/local.yaml) driven past what the e2e tests
do, one bounded scenario at a time. Each row says its pass condition and the
figure it measured. Each fault scenario also proves that its fault fired
(a counter, a status seen), so no row passes without its fault.

The table is printed, and then written under bench/results/stress/ as
<commit>.md and <commit>.json. Scenarios are picked with `--only NAME,...`.
Release builds by default (INFERRAIL_PROFILE)."""

import argparse
import concurrent.futures
import http.client as httpc
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "crates" / "inferrail" / "tests" / "e2e"))
sys.path.insert(0, str(ROOT / "crates" / "inferrail" / "tests"))
from conftest import MODEL, TARGET, Fleet  # noqa: E402
from harness import free_ports, http, wait_until  # noqa: E402
from test_picker import ISTIO  # noqa: E402

ROWS = []
# Put before each row's name while a fleet with the router inside Envoy runs.
PREFIX = [""]


def row(name, condition, measured, ok, fault=None):
    name = PREFIX[0] + name
    ROWS.append({"scenario": name, "pass_if": condition, "measured": measured, "fault_fired": fault, "pass": bool(ok)})
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {measured}" + (f" [fault: {fault}]" if fault else ""), flush=True)


def router_of(fleet):
    """The process the router runs in (Envoy's, with the module) and its log."""
    name = "envoy" if fleet.module else "inferrail"
    return fleet.procs[name], fleet.tmp / f"{name}.log"


def decisions(fleet):
    """Requests the (first) router decided so far."""
    return sum(float(line.split()[-1]) for line in fleet.metrics().splitlines() if line.startswith("inferrail_decisions_total{"))


def rss_mb(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def openai_error(body):
    """Whether a body is an error in the OpenAI shape vLLM uses."""
    try:
        e = json.loads(body)["error"]
        return isinstance(e["message"], str) and isinstance(e["type"], str) and "code" in e
    except (ValueError, KeyError, TypeError):
        return False


def raw(fleet, method, path, body=b"", headers=None, timeout=30):
    """One request on its own connection; (status, body), or (None, error) when the connection broke."""
    c = httpc.HTTPConnection("127.0.0.1", fleet.listen, timeout=timeout)
    try:
        c.request(method, path, body=body, headers={"content-type": "application/json", **(headers or {})})
        r = c.getresponse()
        return r.status, r.read()
    except (OSError, httpc.HTTPException) as e:
        return None, repr(e).encode()
    finally:
        c.close()


def hostile_requests(n, rng):
    """`n` requests that a router must answer or forward, never crash on."""
    ok = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    deep = b'{"model": "sim", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    loop = "{% for x in range(99999999) %}{{x}}{% endfor %}"
    makers = [
        lambda: ("POST", "/v1/chat/completions", b"{not json", {}),
        lambda: ("POST", "/v1/chat/completions", b"", {}),
        lambda: ("POST", "/v1/chat/completions", b"[1, 2, 3]", {}),
        lambda: ("POST", "/v1/chat/completions", b"\xff\xfe\xfd{\"model\": \"sim\"}", {}),
        lambda: ("POST", "/v1/chat/completions", json.dumps({**ok, "model": 5}).encode(), {}),
        lambda: ("POST", "/v1/chat/completions", json.dumps({**ok, "messages": "hi"}).encode(), {}),
        lambda: ("POST", "/v1/chat/completions", json.dumps({**ok, "max_tokens": "many"}).encode(), {}),
        lambda: ("POST", "/v1/chat/completions", json.dumps({**ok, "max_tokens": 2**64 - 1}).encode(), {}),
        lambda: ("POST", "/v1/chat/completions", json.dumps({**ok, "max_completion_tokens": 10**30}).encode(), {}),
        lambda: ("POST", "/v1/chat/completions", json.dumps({**ok, "temperature": [1]}).encode(), {}),
        lambda: ("POST", "/v1/chat/completions", json.dumps({**ok, "model": "nobody-serves-this"}).encode(), {}),
        lambda: ("POST", "/v1/chat/completions", json.dumps({**ok, "messages": [{"role": "wizard", "content": 7}]}).encode(), {}),
        lambda: ("POST", "/v1/chat/completions", json.dumps({**ok, "messages": [{"role": "user", "content": [{"type": "x"}]}]}).encode(), {}),
        lambda: ("POST", "/v1/chat/completions", json.dumps({**ok, "tools": [{"type": "function", "function": {"name": 3}}]}).encode(), {}),
        lambda: ("POST", "/v1/chat/completions", json.dumps({**ok, "messages": [{"role": "user", "content": loop}]}).encode(), {}),
        lambda: ("POST", "/v1/completions", deep, {}),
        lambda: ("POST", "/v1/completions", json.dumps({"model": "sim", "prompt": "x" * 1_500_000, "max_tokens": 1}).encode(), {}),
        lambda: ("POST", "/v1/completions", json.dumps({"model": "sim", "prompt": "\ud800 lone surrogate", "max_tokens": 1}).encode("utf-8", "surrogatepass"), {}),
        lambda: ("POST", "/v1/completions", json.dumps({"model": "sim", "prompt": [1, 2, "x"], "max_tokens": 1}).encode(), {}),
        lambda: ("POST", "/v1/completions", json.dumps({"model": "sim", "prompt": "x", "max_tokens": -5}).encode(), {}),
        lambda: ("GET", "/v1/chat/completions", b"", {}),
        lambda: ("PUT", "/v1/completions", json.dumps(ok).encode(), {}),
        lambda: ("DELETE", "/v1/models", b"", {}),
        lambda: ("POST", "/v1/../v1/completions", json.dumps(ok).encode(), {}),
        lambda: ("POST", "/v1/completions?x=1&x=2", json.dumps({"model": "sim", "prompt": "x", "max_tokens": 1}).encode(), {}),
        lambda: ("POST", "/nothing/here", b"{}", {}),
        lambda: ("GET", "/v1/models", b"", {}),
        lambda: ("POST", "/v1/chat/completions", json.dumps(ok).encode(), {"x-request-id": "r" * 4000}),
        lambda: ("POST", "/v1/chat/completions", json.dumps(ok).encode(), {"content-type": "text/plain"}),
        lambda: ("POST", "/v1/chat/completions", json.dumps(ok).encode(), {"authorization": "Bearer " + "k" * 2000}),
        lambda: ("POST", "/v1/chat/completions", json.dumps(ok).encode(), {"x-session-id": "\u00e9"}),
        lambda: ("POST", "/v1/chat/completions", json.dumps(ok).encode(), {}),
    ]
    return [rng.choice(makers)() for _ in range(n)]


def scenario_hostile(fleet):
    rng = random.Random(54)
    requests = hostile_requests(3000, rng)
    router, log = router_of(fleet)

    def send(req):
        method, path, body, headers = req
        return raw(fleet, method, path, body, headers)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(send, requests))
    broken = [b[:120] for s, b in answers if s is None]
    forwarded = sum(1 for s, _ in answers if s is not None and s < 300)
    shaped = sum(1 for s, b in answers if s is not None and s >= 400 and openai_error(b))
    other = [(s, b[:160]) for s, b in answers if s is not None and s >= 300 and not openai_error(b)]
    alive = router.poll() is None
    panics = log.read_text(errors="replace").count("panicked")
    row("input: 3,000 hostile HTTP requests through Envoy",
        "every request forwarded or answered in the OpenAI error shape; no broken connection; router alive, no panic",
        f"{forwarded} forwarded, {shaped} OpenAI-shaped errors, {len(other)} other answers {sorted({s for s, _ in other})}, "
        f"{len(broken)} broken; router alive: {alive}, panics: {panics}",
        not broken and not other and alive and panics == 0, fault=f"{shaped} refusals")
    for s, b in other[:3]:
        print(f"      other answer {s}: {b!r}")
    for b in broken[:3]:
        print(f"      broken: {b!r}")


def scenario_trickle(fleet):
    """An 8 MiB body in one-byte writes (Nagle off, so each goes out on its own where the kernel allows)."""
    body = json.dumps({"model": "sim", "prompt": "x " * (4 << 20), "max_tokens": 1}).encode()[: 8 << 20]
    s = socket.create_connection(("127.0.0.1", fleet.listen), timeout=120)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    started = time.monotonic()
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode())
    router = fleet.procs["inferrail"]
    before = rss_mb(router.pid)
    peak, sent, answered = before, 0, b""
    s.setblocking(False)
    try:
        for i in range(len(body)):
            while True:
                try:
                    s.send(body[i:i + 1])
                    break
                except BlockingIOError:
                    time.sleep(0.001)
            sent = i + 1
            if i % (1 << 20) == 0:
                peak = max(peak, rss_mb(router.pid))
                try:
                    answered += s.recv(65536)
                except BlockingIOError:
                    pass
                if answered:
                    break  # answered before the whole body came (a refusal)
    except OSError:
        pass  # the other side closed: whatever it answered is read below
    s.setblocking(True)
    try:
        while b"\r\n\r\n" not in answered or len(answered) < answered.find(b"\r\n\r\n") + 14:
            chunk = s.recv(65536)
            if not chunk:
                break
            answered += chunk
    except OSError:
        pass
    finally:
        s.close()
    peak = max(peak, rss_mb(router.pid))
    status = int(answered.split(b" ", 2)[1]) if answered.startswith(b"HTTP/1.1 ") else None
    shaped = status is not None and status >= 400 and openai_error(answered[answered.find(b"\r\n\r\n") + 4:])
    row("clients: an 8 MiB body sent one byte at a time",
        "answered (forwarded, or refused in the OpenAI error shape); router memory bounded (under 64 MB more)",
        f"{sent:,} bytes sent, answered {status} ({'OpenAI shape' if shaped else 'other'}) after {time.monotonic() - started:.0f} s; "
        f"router RSS {before:.1f} -> {peak:.1f} MB",
        status is not None and (status < 300 or shaped) and peak - before < 64)


def stream_one(fleet, max_tokens):
    c = httpc.HTTPConnection("127.0.0.1", fleet.listen, timeout=300)
    try:
        body = {"model": "sim", "prompt": "tell me", "max_tokens": max_tokens, "stream": True}
        c.request("POST", "/v1/completions", body=json.dumps(body), headers={"content-type": "application/json"})
        r = c.getresponse()
        text = r.read().decode(errors="replace")
        return "ok" if r.status == 200 and text.endswith("data: [DONE]\n\n") else f"{r.status} {text[-80:]!r}"
    except (OSError, httpc.HTTPException) as e:
        return repr(e)[:80]
    finally:
        c.close()


def scenario_exact_streams(fleet, n=2000):
    """The same streams with the router following the engines' KV events:
    every decision runs exact mode's view and wait forecast over the
    requests in flight (ADR 0067), which must stay cheap with thousands."""
    fleet.until_exact()
    scenario_concurrent_streams(fleet, n, mode=" in exact mode")
    modes = [str(m) for m in fleet.kv_modes()]
    row("exact mode through the streams", "every replica still exact after them",
        f"replicas' modes after: {', '.join(modes)}", all(m == "exact" for m in modes),
        fault="every replica exact before the streams")


def scenario_concurrent_streams(fleet, n=2000, mode=""):
    undecided = fleet.envoy_stat("failure_mode_allowed") or 0
    started = time.monotonic()
    peak = [0.0]
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], fleet.metric("inferrail_leases") or 0)
            time.sleep(0.2)

    watcher = threading.Thread(target=watch)
    watcher.start()
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        done = list(pool.map(lambda _: stream_one(fleet, 200), range(n)))
    stop.set()
    watcher.join()
    wall = time.monotonic() - started
    wait_until(lambda: "inferrail_leases 0\n" in fleet.metrics(), "every lease released", timeout=60)
    failed = [d for d in done if d != "ok"]
    # Those the router did not answer in time go on undecided, naming the alias the client sent.
    undecided = (fleet.envoy_stat("failure_mode_allowed") or 0) - undecided
    row(f"clients: {n:,} concurrent streams of 200 tokens{mode}",
        "every stream completes with [DONE]; leases back to zero",
        f"{n - len(failed):,} of {n:,} complete in {wall:.0f} s, up to {peak[0]:.0f} in flight at once (sampled); leases 0; "
        f"{undecided:.0f} sent on undecided by Envoy"
        + (f"; failures: {sorted(set(failed))[:3]}" if failed else ""),
        not failed, fault=f"{peak[0]:.0f} streams open at once")


def scenario_soak(fleet, n=35_000, clients=8):
    router, _ = router_of(fleet)
    samples, lock, sent, errors = [], threading.Lock(), [0], [0]

    def worker(k):
        c = httpc.HTTPConnection("127.0.0.1", fleet.listen, timeout=30)
        rng = random.Random(k)
        while True:
            with lock:
                if sent[0] >= n:
                    return
                sent[0] += 1
                i = sent[0]
            # Distinct prompts: the index would grow without bound unless it keeps to the replicas' capacity.
            body = {"model": "sim", "prompt": f"soak {i} {rng.random()} " + "word " * 40, "max_tokens": 1}
            try:
                c.request("POST", "/v1/completions", body=json.dumps(body), headers={"content-type": "application/json"})
                r = c.getresponse()
                r.read()
                if r.status != 200:
                    errors[0] += 1
            except (OSError, httpc.HTTPException):
                errors[0] += 1
                c.close()
                c = httpc.HTTPConnection("127.0.0.1", fleet.listen, timeout=30)
            if i % 1000 == 0:
                samples.append((i, rss_mb(router.pid)))

    started = time.monotonic()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - started
    samples.sort()
    base = next(m for i, m in samples if i >= 5000)
    last = samples[-1][1]
    entries = fleet.metric("inferrail_kv_index_entries") or 0
    row(f"soak: {n:,} requests with distinct prompts, router memory sampled",
        "zero errors; router RSS grows by under 10 MB after the first 5,000",
        f"{errors[0]} errors at {n / wall:.0f} req/s; RSS {base:.1f} -> {last:.1f} MB (+{last - base:.1f}); KV index entries {entries:.0f}",
        errors[0] == 0 and last - base < 10)


def load_until(fleet, stop, results, seed, seen=None):
    """Sends completions on one connection until `stop`; appends (time sent,
    status) to `results`, and (time sent, time answered, the replica the
    router named) to `seen` when given."""
    rng = random.Random(seed)
    c = httpc.HTTPConnection("127.0.0.1", fleet.listen, timeout=30)
    while not stop.is_set():
        t = time.monotonic()
        # The engines' own model name: with the router down nothing rewrites an alias.
        body = {"model": MODEL, "prompt": f"load {rng.random()}", "max_tokens": 2}
        try:
            c.request("POST", "/v1/completions", body=json.dumps(body), headers={"content-type": "application/json"})
            r = c.getresponse()
            r.read()
            replica = r.getheader("x-inferrail-replica")
            results.append((t, r.status if replica else f"{r.status} unrouted"))
            if seen is not None:
                seen.append((t, time.monotonic(), replica))
        except (OSError, httpc.HTTPException) as e:
            results.append((t, repr(e)))
            c.close()
            c = httpc.HTTPConnection("127.0.0.1", fleet.listen, timeout=30)


def under_load(fleet, clients, during, seen=None):
    stop, results = threading.Event(), []
    threads = [threading.Thread(target=load_until, args=(fleet, stop, results, k, seen)) for k in range(clients)]
    for t in threads:
        t.start()
    try:
        during(results)
    finally:
        stop.set()
        for t in threads:
            t.join()
    return results


def scenario_flapping(fleet):
    retried_before = fleet.replicas_stat("retry.upstream_rq_503")
    http("POST", fleet.sim_url(1) + "/_sim/fault", {"mode": "flap", "period_ms": 100, "status": 503})

    def during(results):
        wait_until(lambda: fleet.replicas_stat("retry.upstream_rq_503") - retried_before >= 20 and len(results) >= 2000,
                   "20 retried 503s and 2,000 requests", timeout=300)

    results = under_load(fleet, 8, during)
    http("POST", fleet.sim_url(1) + "/_sim/fault", {"mode": "none"})
    wait_until(lambda: fleet.metric("inferrail_replica_healthy", 'replica="sim-2"') == 1.0, "sim-2 back", timeout=60)
    errors = [s for _, s in results if s != 200]
    fired = fleet.replicas_stat("retry.upstream_rq_503") - retried_before
    ejections = fleet.metric("inferrail_ejections_total", 'replica="sim-2"') or 0
    row("faults: a replica flapping between healthy and 503 every 100 ms, under load",
        "zero client errors; the 503s were answered and retried",
        f"{len(errors)} errors in {len(results):,} requests; sim-2 ejected {ejections:.0f} times",
        not errors, fault=f"{fired} 503s retried by Envoy")


def scenario_killed(fleet):
    times = {}

    def during(results):
        wait_until(lambda: len(results) >= 500, "load")
        fleet.kill("sim-3")
        times["killed"] = time.monotonic()
        wait_until(lambda: fleet.metric("inferrail_replica_healthy", 'replica="sim-3"') == 0.0, "sim-3 marked down", timeout=30)
        times["down"] = time.monotonic() - times["killed"]
        fleet.start_sim(2)
        restarted = time.monotonic()
        wait_until(lambda: fleet.metric("inferrail_replica_healthy", 'replica="sim-3"') == 1.0, "sim-3 readmitted", timeout=30)
        times["up"] = time.monotonic() - restarted
        after = time.monotonic()
        wait_until(lambda: sum(1 for t, _ in list(results) if t > after) >= 500, "load after")

    retries_before = fleet.replicas_stat("upstream_rq_retry_success")
    results = under_load(fleet, 8, during)
    after_kill = [s for t, s in results if t > times["killed"]]
    errors = [s for s in after_kill if s != 200]
    retried = fleet.replicas_stat("upstream_rq_retry_success") - retries_before
    row("faults: a simulator killed and restarted under load",
        "zero errors for requests sent after the kill; it is marked down, then readmitted",
        f"{len(errors)} errors in {len(after_kill):,} requests after the kill; marked down {times['down'] * 1e3:.0f} ms after the kill, "
        f"readmitted {times['up'] * 1e3:.0f} ms after its restart",
        not errors and retried > 0, fault=f"{retried} requests retried away from the dead engine")


def scenario_router_restart(fleet):
    """The shipped configuration fails open (envoy/local.yaml, BUFFERED): while
    the router is down, Envoy's own round robin serves."""
    times = {}

    def during(results):
        wait_until(lambda: len(results) >= 500, "load")
        fleet.kill("inferrail")
        times["killed"] = time.monotonic()
        try:
            wait_until(lambda: sum(1 for t, s in list(results) if t > times["killed"] and s == "200 unrouted") >= 200,
                       "requests served without the router", timeout=60)
        except AssertionError:
            from collections import Counter
            print("      after the kill:", Counter(str(s) for t, s in list(results) if t > times["killed"]).most_common(5))
            raise
        fleet.start_router()
        times["back"] = time.monotonic()
        wait_until(lambda: sum(1 for t, s in list(results) if t > times["back"] and s == 200) >= 500, "the router routing again", timeout=60)

    results = under_load(fleet, 8, during)
    after = [s for t, s in results if t > times["killed"]]
    errors = [s for s in after if s not in (200, "200 unrouted")]
    unrouted = sum(1 for s in after if s == "200 unrouted")
    row("faults: the router killed and restarted under load (BUFFERED, fail-open)",
        "zero client errors; while it is down Envoy's own balancing serves, and routing resumes when it is back",
        f"{len(errors)} errors in {len(after):,} requests after the kill ({sorted(set(map(str, errors)))[:3]}); "
        f"{unrouted:,} served unrouted; what it loses while down: the routing, its predictions, and aliases (a request naming one gets the engine's 404)",
        not errors and unrouted > 0, fault=f"{unrouted} requests Envoy served without it")


def report_ages(fleet):
    """Each replica's engine report age in seconds, as the router publishes it."""
    ages = {}
    for line in fleet.metrics().splitlines():
        if line.startswith('inferrail_engine_report_age_seconds{replica="'):
            ages[line.split('"')[1]] = float(line.split()[-1])
    return ages


def scenario_scraper_killed(fleet):
    """The load sidecar (`inferrail-scraper`, `load.sidecar`) killed under
    load and started again: its reports go stale and are not used (each
    decision counts the stale ones), routing goes on on the router's own
    counters, and the stream resumes when it is back."""
    cmd = [TARGET / "inferrail-scraper", "--config", fleet.config, "--listen", f"127.0.0.1:{SIDECAR}"]

    def fresh():
        ages = report_ages(fleet)
        return len(ages) == 3 and max(ages.values()) < 0.25

    def stale():
        return fleet.metric("inferrail_stale_reports_total", 'policy="cost_model"') or 0

    fleet.procs["scraper"] = fleet._spawn("scraper", cmd)
    wait_until(fresh, "fresh sidecar reports of all three replicas", timeout=30)
    times = {}

    def during(results):
        wait_until(lambda: len(results) >= 500, "load")
        fleet.kill("scraper")
        times["killed"] = time.monotonic()
        wait_until(lambda: min(report_ages(fleet).values()) > 0.3, "every report stale", timeout=30)
        times["stale"], times["stale_before"] = time.monotonic(), stale()
        wait_until(lambda: sum(1 for t, _ in list(results) if t > times["stale"]) >= 1000, "load on stale reports")
        times["stale_counted"] = stale() - times["stale_before"]
        times["sent_stale"] = sum(1 for t, _ in list(results) if t > times["stale"])
        fleet.procs["scraper"] = fleet._spawn("scraper", cmd)
        restarted = time.monotonic()
        wait_until(fresh, "fresh reports again", timeout=30)
        times["fresh_again"] = time.monotonic() - restarted
        after = time.monotonic()
        wait_until(lambda: sum(1 for t, _ in list(results) if t > after) >= 500, "load after")

    results = under_load(fleet, 8, during)
    errors = [s for _, s in results if s != 200]
    row("faults: the scraper sidecar killed and restarted under load",
        "zero errors, every request routed; while it is down its reports are stale and unused (counted), and fresh again once it is back",
        f"{len(errors)} errors in {len(results):,} requests, all routed; {times['stale_counted']:.0f} stale reports passed over "
        f"in about {times['sent_stale']:,} decisions while it was down; reports fresh {times['fresh_again'] * 1e3:.0f} ms after its restart",
        not errors and times["stale_counted"] > 0, fault=f"{times['stale_counted']:.0f} stale reports counted")


def scenario_picker_restart(fleet):
    """The picker protocol's fail-closed configuration (Istio's, as
    test_picker.py writes it): while the router is down Envoy refuses every
    request, and routing resumes when it is back."""
    times = {}

    def during(results):
        wait_until(lambda: len(results) >= 500, "load")
        fleet.kill("inferrail")
        times["killed"] = time.monotonic()
        wait_until(lambda: sum(1 for t, s in list(results) if t > times["killed"] and s != 200) >= 100,
                   "requests refused without the picker", timeout=60)
        fleet.start_router()
        times["decided"] = decisions(fleet)
        times["back"] = time.monotonic()
        wait_until(lambda: sum(1 for t, s in list(results) if t > times["back"] and ok(s)) >= 1000, "the picker routing again", timeout=60)

    # The picker sets no response header of its own: a 200 is served, its decisions are counted.
    def ok(s):
        return s in (200, "200 unrouted")

    results = under_load(fleet, 8, during)
    down = [s for t, s in results if times["killed"] < t < times["back"]]
    after = [s for t, s in results if t > times["back"]]
    refused = [s for s in down if not ok(s)]
    hung = [s for s in down + after if not str(s)[:3].isdigit()]
    late = [s for s in after if not ok(s)]
    decided = decisions(fleet) - times["decided"]
    row("faults: the router killed and restarted under load (picker protocol, FULL_DUPLEX_STREAMED, fail-closed)",
        "every request answered; while it is down Envoy refuses requests itself (what fail-closed loses); after its restart, every request routed",
        f"{len(refused):,} of {len(down):,} requests sent while it was down refused ({sorted({str(s) for s in refused})[:3]}); "
        f"{len(late)} errors in {len(after):,} sent after its restart, {decided:.0f} decided by it; {len(hung)} connection errors",
        refused and not late and not hung and decided >= len(after) * 0.9,
        fault=f"{len(refused):,} refused by Envoy without its picker")


def scenario_slow_readers(fleet, total_mib=640, max_tokens=32000):
    """Clients that ask for long streams and stop reading: Envoy's flow
    control must hold the engines back rather than buffer what they send.
    The streams together would carry `total_mib` MiB."""
    body = json.dumps({"model": "sim", "prompt": "tell me", "max_tokens": max_tokens, "stream": True, "ignore_eos": True})
    status, text = raw(fleet, "POST", "/v1/completions", body.encode(), timeout=120)
    assert status == 200 and text.endswith(b"data: [DONE]\n\n"), (status, text[-100:])
    n = -(-total_mib * 2**20 // len(text))
    envoy, router = fleet.procs["envoy"].pid, fleet.procs["inferrail"].pid
    before = {"envoy": rss_mb(envoy), "router": rss_mb(router)}
    paused_before = fleet.replicas_stat("upstream_flow_control_paused_reading_total")
    request = (f"POST /v1/completions HTTP/1.1\r\nhost: stress\r\ncontent-type: application/json\r\n"
               f"content-length: {len(body)}\r\n\r\n{body}").encode()
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            # A reader that takes nothing: the kernel's receive buffer is all it holds.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", fleet.listen))
            s.sendall(request)
            socks.append(s)
        # Each stream's upstream read paused by Envoy at least once (the fault), or every stream buffered whole.
        # Bounded: with buffers larger than a stream, Envoy takes every stream whole and pauses none.
        try:
            wait_until(lambda: fleet.replicas_stat("upstream_flow_control_paused_reading_total") - paused_before >= n,
                       "every stream's upstream read paused", timeout=60)
        except AssertionError:
            pass
        time.sleep(1)  # more output would have arrived by now, were it not held back
        peak = {"envoy": rss_mb(envoy), "router": rss_mb(router)}
        paused = fleet.replicas_stat("upstream_flow_control_paused_reading_total") - paused_before
    finally:
        for s in socks:
            s.close()
    wait_until(lambda: "inferrail_leases 0\n" in fleet.metrics(), "every stream over once its client left", timeout=120)
    assert fleet.chat().status == 200
    grew = {k: peak[k] - before[k] for k in peak}
    row(f"clients: {n} clients stop reading {total_mib} MiB of streamed output ({len(text) / 2**20:.1f} MiB a stream)",
        "Envoy holds the engines back: its memory grows by under 3 MB a stream (its 1 MiB buffers), not by the output; "
        "the router's by under 20 MB; every stream ends when its client leaves",
        f"Envoy RSS +{grew['envoy']:.0f} MB ({grew['envoy'] / n:.1f} MB a stream), router +{grew['router']:.1f} MB; "
        f"upstream reads paused {paused:.0f} times; leases 0 after the clients left",
        grew["envoy"] < 3 * n and grew["router"] < 20 and paused >= n, fault=f"{paused:.0f} upstream reads paused by Envoy")


CLIENTS = ROOT / ".venv-clients" / "bin"
TOKENIZER = ROOT / ".cache" / "tokenizers" / "qwen3"
# Where the real clients' reports go: set by main, beside the table.
REPORTS = {}



def run_client(name, cmd):
    """Runs a real client to its end; its output goes to the reports' logs."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    logs = REPORTS["dir"] / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / f"{name}.log", "wb") as log:
        done = subprocess.run([str(c) for c in cmd], stdout=log, stderr=log, env=env, timeout=600, cwd=REPORTS["dir"])
    if done.returncode != 0:
        raise RuntimeError(f"{name} exited {done.returncode}: {(logs / f'{name}.log').read_text(errors='replace')[-300:]}")


def scenario_inference_perf(fleet, rate=10, seconds=30):
    """inference-perf, the Inference Extension's benchmark client, through
    Envoy with Inferrail: its shared-prefix workload (8 system prompts of
    1,000 tokens, 16 questions of 50 each), Poisson arrivals, streamed
    completions naming the model's alias."""
    out = REPORTS["dir"] / "inference-perf"
    config = {
        "api": {"type": "completion", "streaming": True},
        "data": {"type": "shared_prefix", "shared_prefix": {"num_groups": 8, "num_prompts_per_group": 16, "system_prompt_len": 1000,
                                                            "question_len": 50, "output_len": 50, "seed": 54}},
        "load": {"type": "poisson", "stages": [{"rate": rate, "duration": seconds}], "num_workers": 2},
        "server": {"type": "vllm", "model_name": "sim", "base_url": fleet.url, "ignore_eos": True},
        "tokenizer": {"pretrained_model_name_or_path": str(TOKENIZER)},
        "report": {"request_lifecycle": {"summary": True, "per_stage": True, "per_request": False}},
        "storage": {"local_storage": {"path": str(out)}},
    }
    path = REPORTS["dir"] / "logs" / "inference-perf.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2) + "\n")  # JSON is YAML
    before = decisions(fleet)
    run_client("inference-perf", [CLIENTS / "inference-perf", "-c", path])
    summary = json.loads((out / "summary_lifecycle_metrics.json").read_text())
    ok, failed = summary["successes"]["count"], summary["failures"]["count"]
    ttft = summary["successes"]["latency"]["time_to_first_token"]
    prompt = summary["successes"]["prompt_tokens"]
    cached = prompt.get("cached", 0) / max(prompt.get("total", 0), 1)
    lag = summary["load_summary"]["schedule_delay"]["p99"]
    decided = decisions(fleet) - before
    row(f"real clients: inference-perf 0.7.0, shared prefixes, Poisson {rate} req/s for {seconds} s, streamed",
        "zero failures; every request decided by Inferrail; its report committed",
        f"{ok} succeeded, {failed} failed; {decided:.0f} decided by Inferrail; TTFT p50 {ttft['median'] * 1e3:.0f} ms, "
        f"p99 {ttft['p99'] * 1e3:.0f} ms; {cached:.0%} of prompt tokens cached (engine usage); sent {lag * 1e3:.1f} ms behind its "
        f"schedule at p99; report: {os.path.relpath(out, ROOT)}",
        failed == 0 and ok > 0 and decided >= ok)


def scenario_guidellm(fleet, rate=10, count=300):
    """GuideLLM through Envoy with Inferrail: synthetic 512-token prompts and
    64-token answers, Poisson arrivals, streamed chat completions."""
    out = REPORTS["dir"] / "guidellm.json"
    before = decisions(fleet)
    run_client("guidellm", [CLIENTS / "guidellm", "run", "--backend", f"kind=openai_http,target={fleet.url},model=sim",
                            "--data", "kind=synthetic_text,prompt_tokens=512,output_tokens=64",
                            "--tokenizer", f"kind=hf_auto,model={TOKENIZER}", "--profile", f"kind=poisson,rate={rate}",
                            "--constraint", f"kind=max_requests,count={count}", "--output", f"kind=json,path={out}",
                            "--disable-console-interactive"])
    report = json.loads(out.read_text())
    # The per-request records (prompts and answers) stay in the run's logs; the committed report keeps the statistics.
    (REPORTS["dir"] / "logs" / "guidellm-requests.json").write_text(json.dumps([b.get("requests") for b in report["benchmarks"]]))
    for b in report["benchmarks"]:
        b.pop("requests", None)
    out.write_text(json.dumps(report, indent=1) + "\n")
    metrics = report["benchmarks"][0]["metrics"]
    totals = metrics["request_totals"]
    ttft = metrics["time_to_first_token_ms"]["successful"]["percentiles"]
    # GuideLLM's Poisson schedule falls behind on a busy machine and then sends what it owes at once: say how many were in flight.
    concurrency = metrics["request_concurrency"]["successful"]["percentiles"]
    decided = decisions(fleet) - before
    row(f"real clients: GuideLLM 0.8.1, 512-token prompts, Poisson {rate} req/s, {count} requests, streamed",
        "zero errored or incomplete requests; every request decided by Inferrail; its report committed",
        f"{totals['successful']} succeeded, {totals['errored']} errored, {totals['incomplete']} incomplete; {decided:.0f} decided by Inferrail; "
        f"TTFT p50 {ttft['p50']:.0f} ms, p99 {ttft['p99']:.0f} ms with {concurrency['p50']:.0f} requests in flight at p50 "
        f"({report['benchmarks'][0]['duration']:.1f} s in all); report: {os.path.relpath(out, ROOT)}",
        totals["errored"] == 0 and totals["incomplete"] == 0 and totals["successful"] == count and decided >= count)


def scenario_reload_storm(fleet, rewrites=10):
    config = fleet.config
    original = config.read_text()
    ok_before = fleet.metric("inferrail_config_reloads_total", 'result="ok"') or 0
    # Every request before this one's has its outcome counted.
    wait_until(lambda: "inferrail_leases 0\n" in fleet.metrics(), "no request in flight", timeout=30)

    def counted():
        return sum(float(line.split()[-1]) for line in fleet.metrics().splitlines() if line.startswith("inferrail_requests_total{"))

    counted_before = counted()

    def during(results):
        wait_until(lambda: len(results) >= 200, "load")
        for k in range(rewrites):
            # A replica limit changes each time: the replicas are kept, with what was learned of them.
            config.write_text(original.replace("{id: sim-1, ", f"{{id: sim-1, max_concurrency: {300 + k}, "))
            target = ok_before + k + 1
            wait_until(lambda: (fleet.metric("inferrail_config_reloads_total", 'result="ok"') or 0) >= target, f"reload {k + 1}", timeout=30)
        config.write_text(original)
        wait_until(lambda: (fleet.metric("inferrail_config_reloads_total", 'result="ok"') or 0) >= ok_before + rewrites + 1, "the last reload")

    results = under_load(fleet, 8, during)
    wait_until(lambda: "inferrail_leases 0\n" in fleet.metrics(), "every request over", timeout=30)
    # The outcomes of the last requests are counted once their grace is over.
    wait_until(lambda: counted() - counted_before >= len(results), "every outcome counted", timeout=30)
    errors = [s for _, s in results if s != 200]
    reloaded = (fleet.metric("inferrail_config_reloads_total", 'result="ok"') or 0) - ok_before
    outcomes = counted() - counted_before
    row(f"churn: the routing YAML rewritten {rewrites + 1} times under load",
        "zero errors; every rewrite reloaded once; every request's outcome counted once",
        f"{len(errors)} errors in {len(results):,} requests; {reloaded:.0f} reloads; {outcomes:.0f} outcomes counted for {len(results):,} requests",
        not errors and reloaded == rewrites + 1 and outcomes == len(results), fault=f"{reloaded:.0f} reloads")


def scenario_hanging(fleet):
    times = {}

    def during(results):
        wait_until(lambda: len(results) >= 500, "load")
        http("POST", fleet.sim_url(0) + "/_sim/fault", {"mode": "hang"})
        hung = time.monotonic()
        wait_until(lambda: fleet.metric("inferrail_replica_healthy", 'replica="sim-1"') == 0.0, "sim-1 marked down", timeout=30)
        times["down"] = time.monotonic() - hung
        times["marked"] = time.monotonic()
        wait_until(lambda: sum(1 for t, s in list(results) if t > times["marked"] and s == 200) >= 1000, "load around sim-1", timeout=60)
        http("POST", fleet.sim_url(0) + "/_sim/fault", {"mode": "none"})
        wait_until(lambda: fleet.metric("inferrail_replica_healthy", 'replica="sim-1"') == 1.0, "sim-1 back", timeout=30)

    results = under_load(fleet, 8, during)
    after = [s for t, s in results if t > times["marked"]]
    errors = [s for _, s in results if s != 200]
    row("faults: a replica that hangs, under load",
        "zero client errors; routed around once its probe times out; the requests it held are answered when it wakes",
        f"{len(errors)} errors in {len(results):,} requests; {len(after):,} sent after it was marked down; "
        f"marked down {times['down'] * 1e3:.0f} ms after it hung",
        not errors and after, fault=f"its probe timed out after {times['down'] * 1e3:.0f} ms")


def scenario_all_failing(fleet):
    ejected_max, refusals, stop = [0], [], threading.Event()

    def refused():
        return sum(float(line.split()[-1]) for line in fleet.metrics().splitlines()
                   if line.startswith("inferrail_router_errors_total{") and 'reason="all_' in line)

    refused_before = refused()

    def watch():
        while not stop.is_set():
            m = fleet.metrics()
            ejected_max[0] = max(ejected_max[0], sum(f'inferrail_replica_ejected{{replica="sim-{i}"}} 1\n' in m for i in (1, 2, 3)))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()

    def during(results):
        wait_until(lambda: len(results) >= 200, "load")
        for i in range(3):
            http("POST", fleet.sim_url(i) + "/_sim/fault", {"mode": "error", "status": 503, "for_ms": 3000})
        times["failing"] = time.monotonic()
        wait_until(lambda: all(fleet.metric("inferrail_replica_healthy", f'replica="sim-{i}"') == 1.0 for i in (1, 2, 3))
                   and time.monotonic() - times["failing"] > 3.5, "every engine back", timeout=60)
        times["back"] = time.monotonic()
        wait_until(lambda: sum(1 for t, _ in list(results) if t > times["back"]) >= 500, "load after")

    times = {}
    results = under_load(fleet, 8, during)
    stop.set()
    watcher.join()
    during_fault = [s for t, s in results if times["failing"] < t < times["failing"] + 3]
    after = [s for t, s in results if t > times["back"]]
    refusals = refused() - refused_before
    answered_503 = sum(1 for s in during_fault if s in (503, "503 unrouted"))
    row("faults: every engine failing with 503 for 3 s, under load",
        "never more than half the replicas ejected; the router never refuses for want of a replica; zero errors once they recover",
        f"at most {ejected_max[0]} of 3 ejected at once; {refusals:.0f} requests refused by the router itself (no replica left: "
        f"every probe failed); {len([s for s in after if s != 200])} errors in {len(after):,} requests after recovery",
        ejected_max[0] <= 1 and refusals == 0 and all(s == 200 for s in after),
        fault=f"{answered_503} answers of 503 while failing")


def churn_sims(fleet, ips, port):
    """Starts a zero-latency simulator on each of `ips` at `port`, owned by `fleet`."""
    for k, ip in enumerate(ips):
        fleet.procs[f"member-{ip}"] = fleet._spawn(f"member-{ip}", [
            TARGET / "inferrail-sim", "--host", ip, "--port", str(port), "--served-model-name", MODEL, "sim",
            "--zero-latency", "--seed", str(10 + k)])
        wait_until(lambda ip=ip: http("GET", f"http://{ip}:{port}/health").status == 200, f"the simulator on {ip}")


def churn_row(source, result, fault):
    errors, wrong, departures, left_on_page, left_in_envoy, sent, to_members, served = result
    row(f"churn: replicas joining and leaving through {source} under load (Envoy reaching them by the router's EDS file)",
        f"zero errors; every request routed to a {source} member served by it; no request sent after the router dropped a "
        f"member is routed to it unless {source} named it again before the answer; once settled, no departed member on the "
        "router's metrics page or in Envoy's cluster",
        f"{len(errors)} errors in {sent:,} requests; {to_members:,} routed to {source} members, which served {served:,}; "
        f"{len(wrong)} to a departed member {wrong[:3]}; "
        f"{departures} departures seen by the router; left on the page {left_on_page}, in Envoy {left_in_envoy}",
        not errors and not wrong and not left_on_page and not left_in_envoy and departures >= 10 and served == to_members,
        fault=f"{departures} departures, {fault()}")


def scenario_dns_churn(_fleet, members=4, seconds=12, every=0.3):
    """Replicas joining and leaving through DNS under load. Four more
    simulators listen on 127.0.0.2-5 at one port; a DNS server (dnslib)
    answers `churn.test.` with a random set of them, changed every 300 ms;
    the router's group looks it up every 100 ms there (`nameserver`) and
    hands the members to Envoy in its EDS file. No request sent after the
    router dropped a member may be routed to it before DNS names it again,
    and once the set settles no series of a departed member is left on the
    router's page, nor a host of one in Envoy's cluster."""
    from dnslib import A, QTYPE, RR
    from dnslib.server import BaseResolver, DNSLogger, DNSServer
    from test_drain import eds_cluster

    dns_port, port = free_ports(2)
    ips = [f"127.0.0.{k + 2}" for k in range(members)]
    answer = {"ips": ips[:2], "asked": 0}

    class Members(BaseResolver):
        def resolve(self, request, handler):
            reply = request.reply()
            answer["asked"] += 1
            if str(request.q.qname) == "churn.test." and request.q.qtype == QTYPE.A:
                for ip in answer["ips"]:
                    reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(ip), ttl=0))
            return reply

    server = DNSServer(Members(), port=dns_port, address="127.0.0.1", logger=DNSLogger("-request,-reply,-truncated,-data"))
    server.start_thread()
    with tempfile.TemporaryDirectory(prefix="inferrail-stress-dns-") as tmp:
        eds = Path(tmp) / "replicas.json"
        fleet = Fleet(Path(tmp), policy="cost_model", sim_flags=["--zero-latency"],
                      config_extra=f"eds: {{path: '{eds}'}}\n"
                                   f"discovery: [{{group: pool, host: churn.test., port: {port}, interval_ms: 100, "
                                   f"nameserver: '127.0.0.1:{dns_port}', models: [{MODEL}]}}]\n",
                      envoy_edit=eds_cluster(eds))
        try:
            churn_sims(fleet, ips, port)
            fleet.start()

            def name(members):
                answer["ips"] = members

            ids = {ip: f"pool-{ip}-{port}" for ip in ips}
            result = churn_under_load(fleet, ids, name, port, seconds, every)
        finally:
            fleet.stop()
            server.stop()
    churn_row("DNS", result, lambda: f"{answer['asked']} DNS questions")


def scenario_k8s_churn(_fleet, members=4, seconds=12, every=0.3):
    """Replicas joining and leaving through Kubernetes discovery under load:
    the router follows an InferencePool through a kubeconfig naming a fake
    API server (bench/kube_fake.py) whose four pods, on 127.0.0.2-5 at one
    port, turn ready and not ready at random every 300 ms, and are now and
    then deleted and created again under a new uid (a new replica, cold).
    The same checks as the DNS churn."""
    from kube_fake import KubeFake
    from test_drain import eds_cluster

    port = free_ports(1)[0]
    ips = [f"127.0.0.{k + 2}" for k in range(members)]
    names = {ip: f"engine-{k}" for k, ip in enumerate(ips)}
    api = KubeFake("llm", "churn", port, {names[ip]: ip for ip in ips})
    api.set_ready({names[ip] for ip in ips[:2]})
    rng = random.Random(55)
    recreated = [0]
    with tempfile.TemporaryDirectory(prefix="inferrail-stress-k8s-") as tmp:
        eds = Path(tmp) / "replicas.json"
        os.environ["KUBECONFIG"] = str(api.kubeconfig(Path(tmp) / "kubeconfig"))
        fleet = None
        try:
            fleet = Fleet(Path(tmp), policy="cost_model", sim_flags=["--zero-latency"],
                          config_extra=f"eds: {{path: '{eds}'}}\nkubernetes: {{pool: llm, namespace: churn, models: [{MODEL}]}}\n",
                          envoy_edit=eds_cluster(eds))
            churn_sims(fleet, ips, port)
            fleet.start()

            def ready(members):
                renewed = []
                if rng.random() < 0.2:
                    renewed.append(rng.choice(members))
                    api.recreate(names[renewed[0]])
                    recreated[0] += 1
                api.set_ready({names[ip] for ip in members})
                return renewed

            result = churn_under_load(fleet, names, ready, port, seconds, every)
        finally:
            if fleet is not None:
                fleet.stop()
            api.stop()
            os.environ.pop("KUBECONFIG", None)
    churn_row("Kubernetes", result, lambda: f"{api.version} pod versions, {recreated[0]} pods recreated")


def churn_under_load(fleet, ids, set_members, port, seconds, every):
    """Drives a churn scenario: `ids` names each member's replica by its IP;
    `set_members` makes the source name a set of IPs. Six clients send
    completions while the set changes at random every `every` seconds for
    `seconds`, then settles on the first; `set_members` returns the IPs it
    took away and named again at once, if any. Returns (errors, requests routed to a
    departed member, departures the router showed, members left on its page,
    hosts left in Envoy's cluster, requests sent, requests routed to the
    members, requests the members' simulators served)."""
    ips = list(ids)
    named = {ip: [] for ip in ips}  # when the source began to name each member again (a rejoin may be routed from then)
    unnamed = {ip: [] for ip in ips}  # when the source stopped naming each member
    dropped = {ip: [] for ip in ips}  # when the router's page first showed each member gone
    rng = random.Random(54)
    seen = []
    current = [ips[:2]]

    def on_page():
        page = fleet.metrics()
        return {ip for ip in ips if f'inferrail_replica_healthy{{replica="{ids[ip]}"}}' in page}

    def during(results):
        now_on = on_page()
        end = time.monotonic() + seconds
        next_change = time.monotonic()
        while time.monotonic() < end:
            if time.monotonic() >= next_change:
                new = rng.sample(ips, rng.randint(1, len(ips)))
                for ip in set(new) - set(current[0]):
                    named[ip].append(time.monotonic())
                for ip in set(current[0]) - set(new):
                    unnamed[ip].append(time.monotonic())
                # A member the source took away and named again at once (a pod recreated) may leave and rejoin.
                for ip in set_members(new) or ():
                    unnamed[ip].append(time.monotonic())
                    named[ip].append(time.monotonic() + 1e-6)
                current[0] = new
                next_change += every
            shown = on_page()
            for ip in now_on - shown:
                dropped[ip].append(time.monotonic())
            now_on = shown
            time.sleep(0.01)
        for ip in set(current[0]) - {ips[0]}:
            unnamed[ip].append(time.monotonic())
        set_members(ips[:1])
        wait_until(lambda: on_page() == {ips[0]}, "the router to settle on one member", timeout=30)

    def served():
        pages = [http("GET", f"http://{ip}:{port}/metrics").body.decode() for ip in ips]
        return sum(float(line.split()[-1]) for page in pages for line in page.splitlines() if line.startswith("vllm:request_success_total"))

    # The fleet's own first requests (it waits for one to be served) are not the load's.
    before = served()
    results = under_load(fleet, 6, during, seen)
    errors = [s for _, s in results if s != 200]
    wrong = []
    for t, done, replica in seen:
        ip = next((ip for ip in ips if ids[ip] == replica), None)
        if ip is None:
            continue
        gone = [d for d in dropped[ip] if d < t]
        if not gone:
            continue
        # The drop the router showed last before the request was sent, and the change of the source that caused it.
        cause = max((u for u in unnamed[ip] if u <= gone[-1]), default=gone[-1])
        # Decided between sending and the answer: a member named again by then may have rejoined.
        if not any(cause < n <= done for n in named[ip]):
            wrong.append(replica)
    page = fleet.metrics()
    left_on_page = [ids[ip] for ip in ips[1:] if f'replica="{ids[ip]}"' in page]

    def in_envoy():
        clusters = http("GET", f"http://127.0.0.1:{fleet.envoy_admin}/clusters").body.decode()
        return [ip for ip in ips[1:] if f"replicas::{ip}:{port}::" in clusters]

    try:
        wait_until(lambda: not in_envoy(), "Envoy to drop the departed members", timeout=10)
    except AssertionError:
        pass  # reported below
    left_in_envoy = in_envoy()
    departures = sum(len(d) for d in dropped.values())
    to_members = sum(1 for _, _, replica in seen if replica in ids.values())
    return errors, wrong, departures, left_on_page, left_in_envoy, len(results), to_members, int(served() - before)


def scenario_peer_killed(fleet):
    times = {}

    def during(results):
        wait_until(lambda: len(results) >= 500, "load")
        fleet.kill("inferrail-2")
        times["killed"] = time.monotonic()
        wait_until(lambda: fleet.metric("inferrail_peers") == 0, "the surviving router to see its peer go", timeout=30)
        after = time.monotonic()
        wait_until(lambda: sum(1 for t, _ in list(results) if t > after) >= 1000, "load after")

    results = under_load(fleet, 8, during)
    after = [s for t, s in results if t > times["killed"]]
    errors = [s for s in after if s not in (200, "200 unrouted")]
    forgotten = fleet.metric("inferrail_peer_mirrors_forgotten_total") or 0
    unrouted = sum(1 for s in after if s == "200 unrouted")
    row("faults: one of two peer routers killed under load",
        "zero client errors; the survivor forgets the dead one's requests and routes alone",
        f"{len(errors)} errors in {len(after):,} requests after the kill; {unrouted} served unrouted; "
        f"{forgotten:.0f} of its mirrors forgotten; peers linked 0",
        not errors, fault="the survivor's peer gauge went to 0")


def scenario_load(_fleet, rate=1000, seconds=11):
    """The overhead ladder's open loop (`inferrail-bench overhead`) at `rate`
    for `seconds`, plain Envoy against Envoy with Inferrail in the same run:
    2,000-word prompts tokenized with Qwen3's tokenizer, the index on, the
    engines scraped, zero-latency simulators."""
    with tempfile.TemporaryDirectory(prefix="inferrail-load-") as tmp:
        out = Path(tmp) / "load.json"
        profile = os.environ.get("INFERRAIL_PROFILE", "release")
        cmd = [ROOT / "target" / profile / "inferrail-bench", "overhead", "--rungs", "envoy,inferrail", "--rate", str(rate),
               "--duration-s", str(seconds), "--rounds", "2", "--long-prompt-kb", "0", "--bin-dir", f"target/{profile}",
               "--setup", "just stress", "--out", out]
        done = subprocess.run([str(c) for c in cmd], cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-400:])
        rungs = {r["rung"]: r for r in json.loads(out.read_text())["rungs"]}
    envoy, ours = rungs["envoy"], rungs["inferrail"]
    errors = envoy["errors"] + ours["errors"]
    lag = ours["send_lag"]["p99_ms"]
    row(f"load: open loop at {rate:,} req/s for {seconds} s through Envoy with Inferrail",
        "at least 10,000 requests, zero errors, every one routed; added p50 and p99 over plain Envoy in the same run",
        f"{ours['ok']:,} ok, {errors} errors; Inferrail adds {ours['added_p50_ms'] - envoy['added_p50_ms']:.2f} ms at p50 and "
        f"{ours['added_p99_ms'] - envoy['added_p99_ms']:.2f} ms at p99 over plain Envoy; router CPU "
        f"{ours['cpu_us_per_request'].get('inferrail', 0):.0f} us a request; the sender lagged its schedule by {lag:.1f} ms at p99",
        # Poisson arrivals: about rate x seconds of them, at least 10,000 here.
        errors == 0 and ours["ok"] >= 10_000 and ours["named"] == ours["ok"], fault=f"{ours['named']:,} routed by Inferrail")


def scenario_admission(fleet, clients=48, seconds=10):
    """Admission bands full under overload: a fleet that runs six requests at
    once, 48 clients in two bands. Every request is served, or shed with its
    503 (the band's wait ran out) or 429 and a Retry-After; none hangs."""
    answers, stop = [], threading.Event()

    def client(k):
        band = "interactive" if k % 2 else "batch"
        c = httpc.HTTPConnection("127.0.0.1", fleet.listen, timeout=30)
        body = json.dumps({"model": "sim", "messages": [{"role": "user", "content": f"hi {k}"}], "max_tokens": 50})
        while not stop.is_set():
            try:
                c.request("POST", "/v1/chat/completions", body=body,
                          headers={"content-type": "application/json", "x-inferrail-band": band})
                r = c.getresponse()
                text = r.read()
                answers.append((r.status, r.getheader("retry-after"), openai_error(text) if r.status >= 400 else True))
            except (OSError, httpc.HTTPException) as e:
                answers.append((repr(e)[:60], None, False))
                c.close()
                c = httpc.HTTPConnection("127.0.0.1", fleet.listen, timeout=30)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    time.sleep(seconds)  # the load runs for a fixed time; every answer is checked, none is timed
    stop.set()
    for t in threads:
        t.join()
    served = sum(1 for s, _, _ in answers if s == 200)
    shed = [(s, ra, shaped) for s, ra, shaped in answers if s in (429, 503)]
    bad = [a for a in answers if a[0] not in (200, 429, 503) or (a[0] in (429, 503) and (not a[1] or not a[2]))]
    wait_until(lambda: "inferrail_leases 0\n" in fleet.metrics(), "every request over", timeout=60)
    row(f"admission: two bands full under overload ({clients} clients, 6 slots)",
        "every request served or shed with 503/429, a Retry-After and the OpenAI shape; none hangs; nothing held after",
        f"{served:,} served, {len(shed):,} shed ({sorted({s for s, _, _ in shed})}), {len(bad)} other "
        f"{sorted({str(a[0]) for a in bad})[:3]}; leases 0",
        not bad and served > 0, fault=f"{len(shed):,} shed")


def scenario_disconnects(fleet, n=1000):
    rng = random.Random(11)

    def aborted_in(i):
        page = http("GET", fleet.sim_url(i) + "/metrics").body.decode()
        return sum(float(line.split()[-1]) for line in page.splitlines()
                   if line.startswith("vllm:request_success_total") and 'finished_reason="abort"' in line)

    aborted_before = sum(aborted_in(i) for i in range(3))

    def client(seed):
        """Whether it left mid-stream, and its stream's length in tokens."""
        r = random.Random(seed)
        c = httpc.HTTPConnection("127.0.0.1", fleet.listen, timeout=30)
        tokens = r.choice([5, 50, 200])
        try:
            body = {"model": "sim", "prompt": "tell me", "max_tokens": tokens, "stream": True}
            c.request("POST", "/v1/completions", body=json.dumps(body), headers={"content-type": "application/json"})
            resp = c.getresponse()
            if r.random() < 0.5:
                resp.read(r.randint(1, 64))
                return True, tokens  # gone mid-stream
            resp.read()
            return False, tokens
        except (OSError, httpc.HTTPException):
            return True, tokens
        finally:
            c.close()

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        outcomes = list(pool.map(client, [rng.random() for _ in range(n)]))
    left = sum(gone for gone, _ in outcomes)
    # A 200-token stream takes 400 ms in the engine, far longer than a client reading its first chunk and
    # closing: each of those must be aborted (a short one may finish before the engine hears of the close).
    must_abort = sum(gone and tokens == 200 for gone, tokens in outcomes)

    def settled():
        m = fleet.metrics()
        return "inferrail_leases 0\n" in m and all(f'inferrail_replica_in_flight{{replica="sim-{i}"}} 0\n' in m for i in (1, 2, 3))

    wait_until(settled, "leases and counters back to zero", timeout=60)
    aborted = sum(aborted_in(i) for i in range(3)) - aborted_before
    row(f"clients: {n:,} streams with random disconnects",
        "leases and in-flight counts back to zero; at least as many aborts in the engines as disconnects from streams that "
        "outlive them (200 tokens, 400 ms)",
        f"{left} clients left mid-stream, {must_abort} of them from 200-token streams; engines aborted {aborted:.0f}; "
        "leases and in-flight 0",
        must_abort > 0 and aborted >= must_abort, fault=f"{left} disconnects")


# Each scenario and the fleet it runs on: `zero`, zero-latency engines (the
# router and Envoy are what is stressed); `paced`, engines that take 2 ms a
# token, so that streams stay open long enough to overlap and be cut;
# `sidecar`, engine load read by the inferrail-scraper sidecar; `picker`,
# Envoy's ext_proc filter written as Istio writes an endpoint picker's.
SCENARIOS = {
    "hostile": ("zero", scenario_hostile),
    "trickle": ("zero", scenario_trickle),
    "flapping": ("zero", scenario_flapping),
    "killed": ("zero", scenario_killed),
    "soak": ("zero", scenario_soak),
    "reloads": ("zero", scenario_reload_storm),
    "router-restart": ("zero", scenario_router_restart),
    "hanging": ("zero", scenario_hanging),
    "all-failing": ("zero", scenario_all_failing),
    "peer-killed": ("peers", scenario_peer_killed),
    "load": ("none", scenario_load),
    "admission": ("admission", scenario_admission),
    "disconnects": ("paced", scenario_disconnects),
    "streams": ("paced", scenario_concurrent_streams),
    "streams-exact": ("paced-exact", scenario_exact_streams),
    "slow-readers": ("zero", scenario_slow_readers),
    "scraper-killed": ("sidecar", scenario_scraper_killed),
    "picker-restart": ("picker", scenario_picker_restart),
    "inference-perf": ("paced", scenario_inference_perf),
    "guidellm": ("paced", scenario_guidellm),
    "dns-churn": ("none", scenario_dns_churn),
    "k8s-churn": ("none", scenario_k8s_churn),
    # The same faults and input with the router inside Envoy, as its dynamic module (ADR 0060).
    "module-hostile": ("module", scenario_hostile),
    "module-soak": ("module", scenario_soak),
    "module-killed": ("module", scenario_killed),
    "module-hanging": ("module", scenario_hanging),
}

# The engines' flags, the router's limits for each replica and more of its
# configuration. `paced` has room for every stream the engines take (with
# the default 256 a replica, the router answers the 769th concurrent stream
# with a 429, as it should).
SIDECAR = free_ports(1)[0]
FLEETS = {
    "zero": {"sim_flags": ["--zero-latency", "--max-num-seqs", "4096"]},
    "paced": {"sim_flags": ["--decode-token-ms", "2", "--prefill-fixed-ms", "1", "--max-num-seqs", "4096"],
              "replica_extra": ", max_concurrency: 4096, max_pending: 4096"},
    # The same, the router following the engines' KV events (exact mode).
    "paced-exact": {"sim_flags": ["--decode-token-ms", "2", "--prefill-fixed-ms", "1", "--max-num-seqs", "4096"],
                    "replica_extra": ", max_concurrency: 4096, max_pending: 4096", "kv_events": {}},
    "peers": {"sim_flags": ["--zero-latency"], "routers": 2},
    # Two slots a replica and two bands: the fleet is full, requests wait their band's turn or are shed.
    "admission": {"sim_flags": ["--decode-token-ms", "2", "--prefill-fixed-ms", "1"], "replica_extra": ", max_concurrency: 2, max_pending: 2",
                  "config_extra": "admission:\n  bands:\n    - {name: interactive, max_wait_ms: 2000}\n    - {name: batch, max_wait_ms: 200}\n"},
    "sidecar": {"sim_flags": ["--zero-latency"], "config_extra": f"load: {{sidecar: http://127.0.0.1:{SIDECAR}}}\n"},
    "picker": {"sim_flags": ["--zero-latency"], "filters": ISTIO},
    "module": {"sim_flags": ["--zero-latency", "--max-num-seqs", "4096"], "module": True},
}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", help="comma-separated scenarios: " + ",".join(SCENARIOS))
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "stress"))
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(SCENARIOS)
    commit = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=8"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    started = time.monotonic()
    REPORTS["dir"] = Path(args.out) / "clients" / commit
    with tempfile.TemporaryDirectory(prefix="inferrail-stress-") as tmp:
        for name in [n for n in names if SCENARIOS[n][0] == "none"]:
            # Scenarios that start their own processes.
            t = time.monotonic()
            try:
                SCENARIOS[name][1](None)
            except Exception as e:
                row(name, "completes", f"raised {e!r}"[:300], False)
            ROWS[-1]["seconds"] = round(time.monotonic() - t, 1)
        for kind, fleet_args in FLEETS.items():
            mine = [n for n in names if SCENARIOS[n][0] == kind]
            if not mine:
                continue
            fleet = Fleet(Path(tmp) / kind, policy="cost_model", **fleet_args)
            PREFIX[0] = "inside Envoy: " if fleet.module else ""
            fleet.start()
            try:
                for name in mine:
                    t = time.monotonic()
                    try:
                        SCENARIOS[name][1](fleet)
                    except Exception as e:  # a scenario that broke is a failed row, and the next one still runs
                        row(name, "completes", f"raised {e!r}"[:300], False)
                    ROWS[-1]["seconds"] = round(time.monotonic() - t, 1)
            finally:
                fleet.stop()
    wall = time.monotonic() - started
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# Stress suite at {commit}", "",
             f"`just stress` on {os.cpu_count()} cores shared by the client, Envoy, the router and three simulators "
             f"(zero-latency, or 2 ms a token where streams must overlap); {wall / 60:.1f} minutes in all.", "",
             "| scenario | pass if | measured | fault fired | result | s |", "|---|---|---|---|---|---|"]
    for r in ROWS:
        lines.append(f"| {r['scenario']} | {r['pass_if']} | {r['measured']} | {r['fault_fired'] or ''} | "
                     f"{'pass' if r['pass'] else 'FAIL'} | {r.get('seconds', '')} |")
    (out / f"{commit}.md").write_text("\n".join(lines) + "\n")
    (out / f"{commit}.json").write_text(json.dumps({"commit": commit, "minutes": round(wall / 60, 1), "rows": ROWS}, indent=2) + "\n")
    print("\n".join(lines))
    sys.exit(0 if all(r["pass"] for r in ROWS) else 1)


if __name__ == "__main__":
    main()
