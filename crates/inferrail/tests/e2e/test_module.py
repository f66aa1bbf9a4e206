"""Inferrail inside Envoy (ADR 0060): the dynamic module built as
libinferrail_module.so, loaded by a real Envoy 1.40 from envoy/module.yaml,
with the router's listeners up inside Envoy's process and no inferrail
process at all.

A request is routed with its prefix's replica, predicted exactly, with
the model alias rewritten in its body; the router answers its own paths;
the response is heard in-process (the lease ends, a limited tenant's
usage is charged); a
body too large to tokenize inline and a request queued by admission are
decided on the router's runtime and resume the paused stream through
Envoy's scheduler, and a client that leaves the queue takes its request
out of it; a panic inside a callback lets the request through to the
cluster's own balancing with Envoy alive; and a process without Envoy's
callbacks cannot load the module at all."""

import ctypes
import hashlib
import http.client as httpc
import json
import re
import subprocess
import threading

import pytest
from conftest import MODEL
from harness import ENVOY, TARGET, http, wait_until
import test_admission
from test_admission import ADMISSION, KEY, fill

MODULE = TARGET / "libinferrail_module.so"
SYSTEM = "You are a careful assistant. " * 40


def ask(fleet, user, model="sim", **extra):
    body = {"model": model, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}], "max_tokens": 4, **extra}
    return http("POST", f"{fleet.url}/v1/chat/completions", body)


def test_the_module_routes_by_prefix_predicts_exactly_and_hears_each_response(fleet_factory):
    fleet = fleet_factory(policy="cost_model", module=True)
    envoy_log = (fleet.tmp / "envoy.log").read_text()
    assert "Dynamic module ABI version v0.2.0 matched" in envoy_log
    first = ask(fleet, "first question")
    assert first.status == 200, first.body
    replica = first.headers["x-inferrail-replica"]
    for n in range(3):
        r = ask(fleet, f"question {n}")
        assert r.status == 200, r.body
        assert r.headers["x-inferrail-replica"] == replica, "the shared prefix's replica"
        # The alias `sim` reached the engine as its own name: the module rewrote the body.
        assert r.json()["model"] == "inferrail/sim-8b"
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0 and int(r.headers["x-inferrail-cached-tokens"]) == cached, "the prediction is the engine's count"
    # Every request was decided on Envoy's worker, and every response heard to its end.
    assert fleet.metric("inferrail_module_decisions_total", 'path="inline"') == 5
    assert fleet.metric("inferrail_module_decisions_total", 'path="runtime"') is None
    wait_until(lambda: fleet.metric("inferrail_leases") == 0, "every lease ended")
    assert fleet.metric("inferrail_requests_total", f'model="inferrail/sim-8b",replica="{replica}",outcome="ok"') >= 4
    # A stream's first byte and end are heard in-process too.
    streamed = ask(fleet, "a stream", stream=True, stream_options={"include_usage": True})
    assert streamed.status == 200 and b"[DONE]" in streamed.body
    wait_until(lambda: fleet.metric("inferrail_leases") == 0, "the stream's lease ended")
    # The router's own answers, in the OpenAI error shape.
    models = http("GET", f"{fleet.url}/v1/models")
    assert models.status == 200 and [m["id"] for m in models.json()["data"]][0] == "inferrail/sim-8b"
    missing = http("POST", f"{fleet.url}/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    assert missing.status == 404 and missing.json()["error"]["type"] == "NotFoundError", missing.body
    bad = http("POST", f"{fleet.url}/v1/chat/completions", b"{not json")
    assert bad.status == 400 and bad.json()["error"]["type"] == "BadRequestError", bad.body
    # Explain, over the admin gRPC listener the module started inside Envoy.
    assert http("GET", f"http://127.0.0.1:{fleet.admin}/readyz").status == 200


def test_a_body_for_the_tokenizer_workers_is_decided_and_predicted_exactly(fleet_factory):
    fleet = fleet_factory(policy="cost_model", module=True, config_extra="tokenizer: {inline_below_bytes: 1024}\n")
    for n in range(3):
        r = ask(fleet, f"long {n}")
        assert r.status == 200, r.body
        assert r.headers.get("x-inferrail-replica") in {"sim-1", "sim-2", "sim-3"}, "routed by the router"
        # Tokenized on a worker thread, and predicted as the engine counts.
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == int(r.headers["x-inferrail-cached-tokens"])
    assert int(r.headers["x-inferrail-cached-tokens"]) > 0
    # Whether a worker's answer is in before the first poll is a race: the
    # decision went inline or resumed from the runtime, never both, never lost.
    paths = [fleet.metric("inferrail_module_decisions_total", f'path="{p}"') or 0 for p in ("inline", "runtime")]
    assert sum(paths) == 4, paths
    wait_until(lambda: fleet.metric("inferrail_leases") == 0, "every lease ended")


@pytest.fixture
def admitting(fleet_factory):
    sha = hashlib.sha256(KEY.encode()).hexdigest()
    return fleet_factory(policy="least_request", replica_extra=", max_concurrency: 1", config_extra=ADMISSION % sha, module=True)


def test_a_queued_request_waits_paused_and_is_routed_when_a_slot_comes_back(admitting):
    fleet = admitting
    streams = fill(fleet)
    result = {}
    waiter = threading.Thread(target=lambda: result.update(r=fleet.chat(headers={"x-inferrail-band": "interactive"})))
    waiter.start()
    wait_until(lambda: fleet.metric("inferrail_admission_queued_total", 'band="interactive"') == 1, "the request queued")
    # Meanwhile a batch request's wait runs out: shed with 503 in the OpenAI shape, from the runtime.
    shed = fleet.chat(headers={"x-inferrail-band": "batch"})
    assert shed.status == 503 and shed.headers.get("retry-after") == "1", shed.body
    assert shed.json()["error"]["type"] == "ServiceUnavailableError"
    assert waiter.is_alive(), "the queued request was answered while the fleet was full"
    streams[0].close()
    waiter.join(30)
    r = result["r"]
    assert r.status == 200, r.body
    assert r.headers.get("x-inferrail-replica") in {"sim-1", "sim-2", "sim-3"}, "routed by the router"
    assert fleet.metric("inferrail_module_decisions_total", 'path="runtime"') == 2
    for s in streams[1:]:
        s.close()


def trailers_on(envoy):
    """The bootstrap with HTTP/1.1 request trailers let through (Envoy drops them by default)."""
    out, n = re.subn(r"(          stat_prefix: openai\n)", r"\1          http_protocol_options: {enable_trailers: true}\n", envoy)
    assert n == 1
    return out


def test_a_body_ended_by_trailers_is_decided_on_the_body_envoy_buffered(fleet_factory):
    fleet = fleet_factory(policy="cost_model", module=True, envoy_edit=trailers_on)
    body = json.dumps({"model": "sim", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "trailers"}],
                       "max_tokens": 2}).encode()
    for _ in range(2):
        c = httpc.HTTPConnection("127.0.0.1", fleet.listen, timeout=30)
        c.putrequest("POST", "/v1/chat/completions")
        for k, v in [("content-type", "application/json"), ("transfer-encoding", "chunked"), ("trailer", "x-checksum")]:
            c.putheader(k, v)
        c.endheaders()
        for part in (body[:100], body[100:]):
            c.send(b"%x\r\n%s\r\n" % (len(part), part))
        c.send(b"0\r\nx-checksum: 1\r\n\r\n")
        r = c.getresponse()
        answer = json.loads(r.read())
        assert r.status == 200, answer
        # Routed, with the alias rewritten (the engines know only their own name), and predicted as the engine counts.
        assert r.getheader("x-inferrail-replica") in {"sim-1", "sim-2", "sim-3"}
        assert int(r.getheader("x-inferrail-cached-tokens")) == answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        c.close()
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, "the second found the first's prompt"


def test_a_limited_tenants_output_tokens_are_charged_from_the_usage_heard_inside_envoy(admitting):
    test_admission.test_a_limited_tenants_output_tokens_are_counted_from_its_responses_usage(admitting)


def waiting(fleet, band):
    """Requests waiting in `band`'s queue, every tenant's."""
    return sum(float(v) for v in re.findall(rf'^inferrail_admission_waiting{{band="{band}",[^}}]*}} (\S+)$', fleet.metrics(), re.M))


def test_a_client_that_leaves_the_queue_takes_its_request_out(admitting):
    fleet = admitting
    streams = fill(fleet)
    c = httpc.HTTPConnection("127.0.0.1", fleet.listen, timeout=30)
    c.request("POST", "/v1/completions", body=json.dumps({"model": "sim", "prompt": "x", "max_tokens": 2}),
              headers={"content-type": "application/json", "x-inferrail-band": "interactive"})
    wait_until(lambda: waiting(fleet, "interactive") == 1, "the request waiting")
    c.close()
    wait_until(lambda: waiting(fleet, "interactive") == 0, "the request out of the queue")
    assert fleet.metric("inferrail_admission_queued_total", 'band="interactive"') == 1
    for s in streams:
        s.close()
    wait_until(lambda: fleet.metric("inferrail_leases") == 0, "no lease left behind")


def test_a_panic_in_a_callback_lets_the_request_through_and_envoy_lives(fleet_factory):
    fleet = fleet_factory(policy="cost_model", module=True, module_env={"INFERRAIL_MODULE_FAILPOINT": "request_body"})
    served = set()
    for n in range(6):
        # The body goes on as the client sent it: the engines answer to the alias too.
        r = ask(fleet, f"panic {n}")
        assert r.status == 200, r.body
        assert "x-inferrail-replica" not in r.headers, "the router named no replica"
        served.add(r.headers["x-inferrail-upstream"])
    # The failpoint fired on every request (and the start-up request), each caught at the boundary.
    assert fleet.metric("inferrail_module_panics_total") >= 6
    assert len(served) == 3, "the cluster's own round robin served them"
    assert http("GET", f"http://127.0.0.1:{fleet.envoy_admin}/ready").status == 200
    assert fleet.metric("inferrail_leases") == 0


def test_a_decision_the_stuck_runtime_never_makes_lets_the_request_go_on_unrouted(fleet_factory):
    """The failpoint holds the router runtime's one thread from the first
    decision that needs it: a batch request queued on a full fleet, whose
    300 ms wait would end in a 503 from that runtime. That never comes:
    the paused stream goes on by the cluster's round robin at its deadline
    (its wait plus 1 s, as the ext_proc filter's max_message_timeout),
    resumed by the watchdog's own thread."""
    sha = hashlib.sha256(KEY.encode()).hexdigest()
    # The body goes on as the client sent it: the engines answer to the alias too.
    fleet = fleet_factory(policy="least_request", replica_extra=", max_concurrency: 1", config_extra=ADMISSION % sha, module=True,
                          module_env={"INFERRAIL_MODULE_FAILPOINT": "stall_runtime"})
    streams = fill(fleet)
    r = fleet.chat(headers={"x-inferrail-band": "batch"})
    assert r.status == 200, r.body
    assert "x-inferrail-replica" not in r.headers, "the router named no replica"
    wait_until(lambda: "no decision within the deadline" in (fleet.tmp / "envoy.log").read_text(), "the fall-open logged")
    for s in streams:
        s.close()


def test_a_process_without_envoys_callbacks_cannot_load_the_module():
    with pytest.raises(OSError, match="undefined symbol: envoy_dynamic_module_callback_"):
        ctypes.CDLL(str(MODULE))


@pytest.mark.parametrize("quoted", [False, True])
def test_envoy_validates_the_module_bootstrap_without_starting_the_router(tmp_path, quoted):
    """`envoy --mode validate` builds the router from the routing file and
    starts nothing; the file's path may come as a JSON string, as Envoy
    Gateway writes a policy's config."""
    root = TARGET.parents[1]
    bootstrap = (root / "envoy" / "module.yaml").read_text()
    if quoted:
        bootstrap = bootstrap.replace("value: envoy/local-inferrail.yaml", """value: '"envoy/local-inferrail.yaml"'""")
    (tmp_path / "module.yaml").write_text(bootstrap)
    out = subprocess.run([str(ENVOY), "--mode", "validate", "-c", str(tmp_path / "module.yaml")], capture_output=True, text=True, timeout=60,
                         env={"ENVOY_DYNAMIC_MODULES_SEARCH_PATH": str(TARGET)}, cwd=root)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "inferrail serving inside Envoy" not in out.stderr
    # A routing file that does not load: Envoy refuses the configuration and says why.
    (tmp_path / "broken.yaml").write_text(bootstrap.replace("envoy/local-inferrail.yaml", str(tmp_path / "missing.yaml")))
    out = subprocess.run([str(ENVOY), "--mode", "validate", "-c", str(tmp_path / "broken.yaml")], capture_output=True, text=True, timeout=60,
                         env={"ENVOY_DYNAMIC_MODULES_SEARCH_PATH": str(TARGET)}, cwd=root)
    assert out.returncode != 0 and "missing.yaml" in out.stderr, out.stderr[-2000:]


def test_explain_answers_the_same_inside_envoy_as_from_the_ext_proc_router(fleet_factory):
    """The same requests through both deployments, then the same question to
    each one's Explain over gRPC (reflection only): the replica that took
    the shared prompt wins, with the same prediction, every other replica
    predicted the same, the same prompt. Which replica of a cold fleet
    takes the first prompt rests on load reports and first-byte timings,
    which differ between the two: the answers are compared by role, not by
    name."""
    from test_explain import explain
    answers = []
    for module in (False, True):
        fleet = fleet_factory(policy="cost_model", module=module)
        for n in range(3):
            r = ask(fleet, f"warm {n}")
            assert r.status == 200
        holder = r.headers["x-inferrail-replica"]
        wait_until(lambda: fleet.metric("inferrail_leases") == 0, "every lease ended")
        body = {"model": "sim", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "why?"}], "max_tokens": 4}
        e = explain(fleet, "/v1/chat/completions", body)
        held = {c["id"]: int(c.get("predictedCachedTokens", 0)) for c in e["candidates"]}
        assert e["winner"] == holder, (e["winner"], holder)
        answers.append((e["model"], e["policy"], e["promptTokens"], e["promptBlocks"], held.pop(holder), sorted(held.values())))
        fleet.stop()
    assert answers[0] == answers[1]
    assert answers[1][4] > 0, "the winner holds the shared prompt"
