"""Reloading the routing YAML under load through a real Envoy: the file is
rewritten while clients keep sending (a drain, a replica removed, one put
back, a file that does not validate, one that changes what does not
reload (the seed), a model's policy changed and changed back, a model
added ahead of the one in use and taken away, and a SIGHUP with nothing
changed). Not one request fails, each
version takes effect, and the refused ones change nothing."""
import http.client as httpc
import json
import os
import signal
import threading
import time

from conftest import wait_until
from test_explain import SERVICE, grpcurl

# `just bench-reload` sends more (INFERRAIL_RELOAD_REQUESTS) on release builds and records the rate.
CLIENTS, REQUESTS = 8, int(os.environ.get("INFERRAIL_RELOAD_REQUESTS", 1200))


def replicas(fleet):
    code, out = grpcurl(fleet, f"{SERVICE}/Replicas")
    assert code == 0, out
    return [r["id"] for r in json.loads(out)["replicas"]]


def reloads(fleet, result):
    return fleet.metric("inferrail_config_reloads_total", f'result="{result}"') or 0


def test_a_reload_under_load_fails_no_request_and_a_bad_one_changes_nothing(fleet_factory):
    fleet = fleet_factory(policy="round_robin", sim_flags=["--zero-latency"])
    original = fleet.config.read_text()
    sim3 = next(line for line in original.splitlines() if "{id: sim-3," in line)
    versions = [
        ("ok", original.replace("{id: sim-2, ", "{id: sim-2, drain: true, ")),
        ("invalid", original.replace("address: 127.0.0.1", "address: nowhere", 1)),
        ("ok", original.replace(sim3 + "\n", "")),
        ("refused", original.replace("seed: 7", "seed: 8")),
        ("ok", original.replace("policy: round_robin", "policy: least_request")),
        # A model added ahead of the one the clients ask for, with its own tokenizer and replica: theirs stays where it was.
        ("ok", original.replace("models:\n", "models:\n  - {name: other, tokenizer: builtin:sim}\n").replace(
            sim3 + "\n", sim3 + "\n  - {id: spare, address: 127.0.0.1:9, models: [other]}\n")),
        ("ok", original),
    ]
    statuses, lock, sent, rewritten = [], threading.Lock(), [0], threading.Event()

    body = json.dumps({"model": "sim", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 1})

    def client():
        # One keep-alive connection per client, as a load generator keeps them: the rate is Envoy's and the router's, not connection setup's.
        c = httpc.HTTPConnection("127.0.0.1", fleet.listen, timeout=10)
        while True:
            with lock:
                # At least REQUESTS, and on until the last rewrite has taken effect: every reload happens under load.
                if sent[0] >= REQUESTS and rewritten.is_set():
                    return
                sent[0] += 1
            try:
                c.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"})
                r = c.getresponse()
                r.read()
                status = r.status
            except OSError as e:
                status = repr(e)
                c.close()
            with lock:
                statuses.append(status)

    threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for result, text in versions:
        before = reloads(fleet, result)
        fleet.config.write_text(text)
        wait_until(lambda: reloads(fleet, result) > before, f"a reload counted as {result}")
        if result == "ok" and "drain: true" in text:
            wait_until(lambda: fleet.metric("inferrail_replica_draining", 'replica="sim-2"') == 1, "sim-2 to drain")
        if "spare" in text:
            wait_until(lambda: "spare" in replicas(fleet), "the new model's replica to join")
        if result == "ok" and sim3 not in text:
            wait_until(lambda: replicas(fleet) == ["sim-1", "sim-2"], "sim-3 to leave")
    before = reloads(fleet, "ok")
    fleet.procs["inferrail"].send_signal(signal.SIGHUP)
    wait_until(lambda: reloads(fleet, "ok") > before, "SIGHUP to reload the unchanged file")
    rewritten.set()
    with lock:
        during = len(statuses)
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started
    failed = [s for s in statuses if s != 200]
    assert len(statuses) >= REQUESTS and not failed, f"{len(failed)} of {len(statuses)} failed in {elapsed:.1f} s: {failed[:5]}"
    print(f"{len(statuses)} requests through {len(versions)} rewrites and a SIGHUP in {elapsed:.1f} s: "
          f"{len(statuses) / elapsed:.0f} req/s, none failed ({during} of them done by the last reload)")
    # Back where it started: every replica serves, none drains.
    served = {fleet.chat().headers.get("x-inferrail-replica") for _ in range(9)}
    assert served == {"sim-1", "sim-2", "sim-3"}, served
    assert fleet.metric("inferrail_config_last_reload_ok") == 1
