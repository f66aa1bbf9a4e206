"""Admission through a real Envoy (ADR 0042): three simulators that take one
request each, so that three long streams fill the fleet. A request that
waits at the router past the filter's 1 s message_timeout is routed when a
slot comes back, never let through unrouted; one whose band's wait runs out
is shed with 503 and Retry-After; a wrong API key gets 401 and appears in
no log, and no prompt reaches the router's or Envoy's; a tenant past its
token limit gets 429 with Retry-After; a limited tenant's output tokens are
counted from its response's usage, which Envoy sends the router for that
tenant only."""

import json
import threading
import time

import pytest
from harness import wait_until

KEY = "sk-e2e-secret-key"

ADMISSION = """admission:
  bands:
    - {name: interactive, max_wait_ms: 20000}
    - {name: batch, max_wait_ms: 300}
  keys:
    - {sha256: %s, tenant: team-a}
  tenants:
    - name: capped
      limits: [{tokens: 20, window_ms: 60000}]
    - name: metered
      limits: [{tokens: 1000000, window_ms: 60000}]
"""


@pytest.fixture(scope="module")
def key_sha256():
    import hashlib
    return hashlib.sha256(KEY.encode()).hexdigest()


@pytest.fixture
def fleet(fleet_factory, key_sha256):
    return fleet_factory(policy="least_request", replica_extra=", max_concurrency: 1", config_extra=ADMISSION % key_sha256)


def fill(fleet):
    """Three long streams, one on each simulator: the fleet is full."""
    streams = [fleet.open_stream(max_tokens=2000) for _ in range(3)]
    assert all(s.status == 200 for s in streams)
    assert sorted(s.getheader("x-inferrail-replica") for s in streams) == ["sim-1", "sim-2", "sim-3"]
    return streams


def test_a_queued_request_outlasts_the_message_timeout_and_is_routed_when_a_slot_comes_back(fleet):
    streams = fill(fleet)
    timeouts = fleet.envoy_stat("message_timeouts")
    result = {}
    waiter = threading.Thread(target=lambda: result.update(r=fleet.chat(headers={"x-inferrail-band": "interactive"})))
    waiter.start()
    # It waits at the router: queued, and still waiting after Envoy's 1 s message_timeout.
    wait_until(lambda: fleet.metric("inferrail_admission_queued_total", 'band="interactive"') == 1, "the request queued")
    time.sleep(1.5)
    assert waiter.is_alive(), "the queued request was answered while the fleet was full"
    # A slot comes back: the client of one stream leaves.
    streams[0].close()
    waiter.join(30)
    r = result["r"]
    assert r.status == 200, r.body
    assert r.headers.get("x-inferrail-replica") in {"sim-1", "sim-2", "sim-3"}, "routed by the router"
    assert fleet.envoy_stat("message_timeouts") == timeouts, "Envoy timed the queued request out"
    for s in streams[1:]:
        s.close()


def test_a_wait_that_runs_out_is_shed_with_503_and_retry_after_never_forwarded(fleet):
    streams = fill(fleet)
    r = fleet.chat(headers={"x-inferrail-band": "batch"})
    assert r.status == 503, r.body
    assert r.headers.get("retry-after") == "1"
    error = r.json()["error"]
    assert error["type"] == "ServiceUnavailableError" and error["code"] == 503, error
    assert "x-inferrail-replica" not in r.headers
    assert fleet.metric("inferrail_admission_shed_total", 'reason="waited",band="batch"') == 1
    for s in streams:
        s.close()


def test_a_wrong_key_gets_401_and_no_key_or_prompt_reaches_a_log(fleet):
    prompt = [{"role": "user", "content": "the words zanzibar quokka marmalade"}]
    r = fleet.chat(headers={"authorization": "Bearer sk-not-a-key"}, messages=prompt)
    assert r.status == 401, r.body
    assert r.json()["error"]["type"] == "AuthenticationError"
    ok = fleet.chat(headers={"authorization": f"Bearer {KEY}"}, messages=prompt)
    assert ok.status == 200, ok.body
    # Keys are optional here: no key is the anonymous tenant.
    assert fleet.chat().status == 200
    fleet.stop()
    logs = list(fleet.tmp.glob("*.log"))
    assert {"inferrail.log", "envoy.log"} <= {log.name for log in logs}
    for log in logs:
        text = log.read_text(errors="replace")
        assert KEY not in text and "sk-not-a-key" not in text, f"a key in {log.name}"
        # The simulators stand in for engines, whose logs are not ours to keep clean.
        if not log.name.startswith("sim-"):
            assert "quokka" not in text, f"the prompt in {log.name}"


def test_a_tenant_past_its_token_limit_gets_429_with_retry_after(fleet):
    capped = {"x-inferrail-tenant": "capped"}
    statuses = [fleet.chat(headers=capped) for _ in range(4)]
    assert statuses[0].status == 200
    limited = [r for r in statuses if r.status == 429]
    assert limited, [r.status for r in statuses]
    r = limited[0]
    assert r.json()["error"]["type"] == "RateLimitError"
    assert 1 <= int(r.headers["retry-after"]) <= 60
    # Another tenant is not limited.
    assert fleet.chat(headers={"x-inferrail-tenant": "other"}).status == 200


def test_a_limited_tenants_output_tokens_are_counted_from_its_responses_usage(fleet):
    charged = lambda tenant, kind: fleet.metric("inferrail_admission_charged_tokens_total", f'tenant="{tenant}",kind="{kind}"')  # noqa: E731
    metered = {"x-inferrail-tenant": "metered"}
    r = fleet.chat(max_tokens=7, headers=metered)
    assert r.status == 200, r.body
    usage = r.json()["usage"]
    assert usage["completion_tokens"] > 0
    wait_until(lambda: charged("metered", "output") == usage["completion_tokens"], "the answer's output tokens charged")
    assert charged("metered", "prompt") == usage["prompt_tokens"]
    # Streamed: the usage is in the last chunk, and every chunk still reaches the client.
    s = fleet.chat(max_tokens=5, headers=metered, stream=True, stream_options={"include_usage": True})
    assert s.status == 200, s.body
    events = [json.loads(line[6:]) for line in s.body.decode().splitlines() if line.startswith("data: {")]
    streamed = events[-1]["usage"]
    assert sum(1 for e in events if e.get("choices") and e["choices"][0]["delta"].get("content")) == streamed["completion_tokens"]
    assert s.body.decode().rstrip().endswith("data: [DONE]")
    total = usage["completion_tokens"] + streamed["completion_tokens"]
    wait_until(lambda: charged("metered", "output") == total, "the stream's output tokens charged")
    # A tenant without limits is not asked for: nothing is charged to it.
    assert fleet.chat(max_tokens=3, headers={"x-inferrail-tenant": "free"}).status == 200
    assert charged("free", "output") is None and charged("free", "prompt") is None
