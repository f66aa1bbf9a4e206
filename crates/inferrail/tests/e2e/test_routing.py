"""Routing through a real Envoy: every policy's choices, the decision Envoy
enforces, errors the router answers, and the OpenAI SDK end to end."""

import asyncio
import json
import re
import collections

import openai
import pytest

from conftest import MODEL, http, wait_until


def served(fleet, n, **kw):
    """(chosen replica, replica Envoy really used) for n sequential requests."""
    out = []
    for _ in range(n):
        r = fleet.chat(**kw)
        assert r.status == 200, r.body
        out.append((r.headers["x-inferrail-replica"], r.headers["x-inferrail-upstream"]))
    return out


def assert_enforced(fleet, picks):
    """Envoy sent every request to the replica inferrail chose."""
    addr = {f"sim-{i + 1}": f"127.0.0.1:{p}" for i, p in enumerate(fleet.sim_ports)}
    for chosen, upstream in picks:
        assert addr[chosen] == upstream, (chosen, upstream)


def test_round_robin_takes_turns_and_envoy_follows(fleet_factory):
    fleet = fleet_factory(policy="round_robin")
    picks = served(fleet, 9)
    assert_enforced(fleet, picks)
    chosen = [c for c, _ in picks]
    assert chosen[:3] == chosen[3:6] == chosen[6:9]
    assert sorted(chosen[:3]) == ["sim-1", "sim-2", "sim-3"]


def test_a_shadow_policy_changes_nothing_and_counts_its_agreement(fleet_factory):
    # The model's YAML mapping gets `shadow_policy` after its policy.
    fleet = fleet_factory(policy="round_robin, shadow_policy: cost_model")
    picks = served(fleet, 9)
    assert_enforced(fleet, picks)
    chosen = [c for c, _ in picks]
    assert chosen[:3] == chosen[3:6] == chosen[6:9], "round robin's turns, as without a shadow"
    page = fleet.metrics()

    def total(name, *labels):
        lines = re.findall(rf"^{name}\{{([^}}]*)\}} (\S+)$", page, re.M)
        return sum(float(v) for ls, v in lines if all(label in ls for label in labels))

    shadowed = total("inferrail_shadow_decisions_total", 'policy="round_robin"', 'shadow="cost_model"')
    decisions = total("inferrail_decisions_total", 'policy="round_robin"')
    assert shadowed == decisions >= 9, (shadowed, decisions)
    assert total("inferrail_shadow_decisions_total", 'agreed="false"') > 0, "cost_model keeps a prompt where it is cached"


def test_random_and_p2c_spread_over_every_replica(fleet_factory):
    for policy in ("random", "p2c"):
        fleet = fleet_factory(policy=policy)
        picks = served(fleet, 45)
        assert_enforced(fleet, picks)
        counts = collections.Counter(c for c, _ in picks)
        assert set(counts) == {"sim-1", "sim-2", "sim-3"}, (policy, counts)


def test_least_request_avoids_a_busy_replica(fleet_factory):
    fleet = fleet_factory(policy="least_request", sim_flags=["--decode-token-ms", "20"])
    # Hold two long streams open; least_request puts them on two replicas and
    # every short request that follows on the third.
    import http.client
    held = []
    for _ in range(2):
        c = http.client.HTTPConnection("127.0.0.1", fleet.listen, timeout=30)
        c.request("POST", "/v1/completions", body=b'{"model":"sim","prompt":"long","max_tokens":2000,"stream":true}',
                  headers={"content-type": "application/json"})
        r = c.getresponse()
        assert r.status == 200
        r.read(1)
        held.append((c, r.getheader("x-inferrail-replica")))
    busy = {name for _, name in held}
    assert len(busy) == 2
    # The router hears a request end when Envoy closes its stream, which on a loaded machine can come after
    # the client has its answer and has sent the next request: until then the third replica counts it, is
    # as busy as the other two, and the tie may go to either of them. Each request waits until the router
    # has heard the one before it end.
    def in_flight():
        return sum(fleet.metric("inferrail_replica_in_flight", f'replica="sim-{i}"') or 0 for i in (1, 2, 3))
    picks = []
    for _ in range(10):
        wait_until(lambda: in_flight() == 2, "the router to hear the previous request end")
        picks += served(fleet, 1)
    assert_enforced(fleet, picks)
    # On a failure, say what the router set aside and saw of each replica (it sent one of ten to a busy
    # replica once, in the sixth of ten runs under a busy loop, before each request waited).
    why = [line for line in fleet.metrics().splitlines()
           if line.startswith(("inferrail_set_aside_total", "inferrail_replica_healthy", "inferrail_replica_in_flight",
                               "inferrail_probe_misses_total"))]
    assert {c for c, _ in picks}.isdisjoint(busy), (picks, busy, why)
    for c, _ in held:
        c.close()


def test_a_client_header_never_picks_the_replica(fleet_factory):
    fleet = fleet_factory(policy="round_robin")
    sim1 = f"127.0.0.1:{fleet.sim_ports[0]}"
    picks = served(fleet, 6, headers={"x-gateway-destination-endpoint": sim1})
    assert_enforced(fleet, picks)
    assert {c for c, _ in picks} == {"sim-1", "sim-2", "sim-3"}


def test_aliases_are_rewritten_for_the_engine(fleet_factory):
    fleet = fleet_factory()
    r = fleet.chat()
    assert r.json()["model"] == MODEL
    r = http("POST", f"{fleet.url}/v1/completions", {"prompt": "no model named", "max_tokens": 1})
    assert r.status == 200 and r.json()["model"] == MODEL
    listed = http("GET", f"{fleet.url}/v1/models").json()
    assert [m["id"] for m in listed["data"]] == [MODEL, "sim"]


def test_a_slow_body_still_gets_the_decision(fleet_factory):
    # The body comes in three parts 1.2 s apart, each pause longer than
    # Envoy's 1 s message timeout: Envoy buffers it and sends it whole,
    # so the router still decides, and rewrites the body (the model is an
    # alias). The engine must count exactly the prompt the router tokenized.
    import http.client
    import time
    fleet = fleet_factory(policy="round_robin")
    body = json.dumps({"model": "sim", "prompt": "slow " * 2000, "max_tokens": 1}).encode()
    c = http.client.HTTPConnection("127.0.0.1", fleet.listen, timeout=10)
    c.putrequest("POST", "/v1/completions")
    c.putheader("content-type", "application/json")
    c.putheader("content-length", str(len(body)))
    c.endheaders()
    # The pauses are the slow client, not a wait for anything.
    c.send(body[:4000])
    for part in (body[4000:8000], body[8000:]):
        time.sleep(1.2)
        c.send(part)
    r = c.getresponse()
    reply = json.loads(r.read())
    assert r.status == 200, reply
    assert reply["model"] == MODEL
    assert r.getheader("x-inferrail-prompt-tokens") == str(reply["usage"]["prompt_tokens"])
    assert_enforced(fleet, [(r.getheader("x-inferrail-replica"), r.getheader("x-inferrail-upstream"))])
    assert fleet.envoy_stat("message_timeouts") == 0 and fleet.envoy_stat("failure_mode_allowed") == 0


@pytest.mark.parametrize("method,path,body,status", [
    ("POST", "/v1/chat/completions", b'{"model": "sim", "messages": [', 400),
    ("POST", "/v1/chat/completions", b'[1, 2]', 400),
    ("POST", "/v1/chat/completions", b'{"model": 42}', 400),
    ("POST", "/v1/chat/completions", b'{"model": "nope", "messages": []}', 404),
    ("POST", "/v1/completions", b'', 400),
    ("GET", "/v1/chat/completions", None, 405),
    ("DELETE", "/v1/models", None, 405),
    ("GET", "/v1/unknown", None, 404),
    ("POST", "/v1/completions", b'{"model": "sim", "prompt": "' + b"x" * (2 << 20) + b'"}', 413),
])
def test_bad_requests_get_openai_errors_from_the_router(fleet_factory, method, path, body, status):
    fleet = fleet_factory()
    r = http(method, fleet.url + path, body)
    assert r.status == status, r.body[:300]
    err = r.json()["error"]
    assert err["code"] == status and err["message"] and err["type"]
    if status == 405:
        assert r.headers["allow"] in ("GET", "POST")
    # Still serving.
    assert fleet.chat().status == 200


def test_a_body_over_a_mebibyte_is_buffered_whole_and_routed(fleet_factory):
    # Envoy's listener keeps its 1 MiB buffer (a client that stops reading a
    # stream holds that much of it in Envoy, not the whole stream); the
    # route's request_body_buffer_limit lets a request body up to 16 MiB be
    # buffered for the decision.
    fleet = fleet_factory(max_body_bytes=16 << 20)
    body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "user": "u" * (6 << 20)}
    r = http("POST", fleet.url + "/v1/chat/completions", body)
    assert r.status == 200, r.body[:300]
    assert r.headers.get("x-inferrail-replica", "").startswith("sim-"), "decided by the router, not sent on unrouted"


def test_openai_sdk_sync_and_async_through_envoy(fleet_factory):
    fleet = fleet_factory()
    c = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="unused", max_retries=0)
    whole = c.chat.completions.create(model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert whole.model == MODEL and whole.usage.completion_tokens == 4
    chunks = list(c.chat.completions.create(model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 3
    comp = c.completions.create(model="sim", prompt="Once", max_tokens=2)
    assert comp.usage.completion_tokens == 2
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])

    async def run():
        a = openai.AsyncOpenAI(base_url=f"{fleet.url}/v1", api_key="unused", max_retries=0)

        async def one(i):
            s = await a.chat.completions.create(model="sim", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=3, stream=True)
            return [x async for x in s]

        out = await asyncio.gather(*(one(i) for i in range(12)))
        whole = await a.completions.create(model="sim", prompt="x", max_tokens=2)
        await a.close()
        return out, whole

    streams, whole = asyncio.run(run())
    assert all(s[-1].choices[0].finish_reason == "length" for s in streams)
    assert whole.usage.completion_tokens == 2


def hostile_bodies(rng, n):
    valid = b'{"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'
    for i in range(n):
        kind = i % 9
        if kind == 0:
            yield bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300)))
        elif kind == 1:
            yield valid[: rng.randrange(1, len(valid))]
        elif kind == 2:
            yield b"[" * rng.randrange(100, 20000)
        elif kind == 3:
            yield b'{"model": ' + rng.choice([b"1", b"[]", b"{}", b"true", b'"\\ud800"', b'"' + b"a" * 5000 + b'"']) + b"}"
        elif kind == 4:
            yield b'{"model": "sim", "model": "sim"}'
        elif kind == 5:
            yield valid.replace(b"sim", rng.choice([b"", b"../../etc/passwd", b"sim\\u0000", b"SIM"]))
        elif kind == 6:
            yield b'\xef\xbb\xbf' + valid
        elif kind == 7:
            # More output than any cache holds: refused by the engine, recorded and taken back by the router.
            yield valid.replace(b'"max_tokens": 1', b'"max_tokens": 18446744073709551615')
        else:
            yield b'{"model": "sim", "prompt": "' + b"\\" * rng.randrange(1, 4) + b'"}'


def test_hostile_bodies_never_take_the_router_down(fleet_factory):
    import random
    fleet = fleet_factory()
    rng = random.Random(5)
    for body in hostile_bodies(rng, 240):
        path = rng.choice(["/v1/chat/completions", "/v1/completions"])
        r = http("POST", fleet.url + path, body)
        assert r.status in (200, 400, 404, 413), (r.status, body[:80], r.body[:200])
        if r.status != 200:
            err = json.loads(r.body)
            assert "error" in err or "detail" in err, r.body[:200]
    assert fleet.procs["inferrail"].poll() is None, "inferrail is still running"
    assert fleet.chat().headers.get("x-inferrail-replica"), "and still routing"
    # A panic in a request's task would be served by Envoy all the same: the log says whether one happened.
    assert "panicked" not in (fleet.tmp / "inferrail.log").read_text(errors="replace")
