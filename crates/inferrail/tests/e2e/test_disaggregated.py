"""Disaggregated prefill and decode through a real Envoy, the router running
each split request's prefill leg itself: sim-1 (and sim-2 where said) only
prefills, the others decode, speaking vLLM 0.32's NixlConnector protocol."""

import concurrent.futures
import json
import re

from harness import http, wait_until
from test_explain import explain
from test_picker import ISTIO

MODEL = "inferrail/sim-8b"


def page_value(text, name):
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def sim_metric(fleet, i, name):
    return page_value(http("GET", f"{fleet.sim_url(i)}/metrics").body.decode(), name)


def long_chat(n, max_tokens=4, **extra):
    words = " ".join(f"w{n}x{k}" for k in range(300))
    return {"model": "sim", "messages": [{"role": "user", "content": words}], "max_tokens": max_tokens, **extra}


def settled(fleet):
    m = fleet.metrics()
    return "inferrail_leases 0\n" in m and all(f'inferrail_replica_in_flight{{replica="sim-{i}"}} 0\n' in m for i in (1, 2, 3))


def test_a_split_request_is_prefilled_on_one_replica_and_decoded_on_another(fleet_factory, tmp_path):
    log = tmp_path / "decisions.jsonl"
    fleet = fleet_factory(policy="round_robin", roles=["prefill", "decode", "decode"],
                          config_extra=f"observability: {{decision_log: {{path: '{log}', sample_rate: 1.0}}}}\n")
    # The fleet's first request (its start) was split too.
    assert fleet.metric("inferrail_prefill_legs_total", 'outcome="split"') == 1
    for n in range(4):
        r = http("POST", f"{fleet.url}/v1/chat/completions", long_chat(n))
        assert r.status == 200, r.body
        assert r.headers.get("x-inferrail-prefill-replica") == "sim-1"
        assert r.headers["x-inferrail-replica"] in ("sim-2", "sim-3")
        body = r.json()
        assert body["usage"]["completion_tokens"] == 4, "the decoder generates every token"
        assert body["kv_transfer_params"] is None
    # Streamed: the prefill leg is not, the client's stream is.
    r = http("POST", f"{fleet.url}/v1/chat/completions", long_chat(9, stream=True, stream_options={"include_usage": True}))
    assert r.status == 200 and r.headers.get("x-inferrail-prefill-replica") == "sim-1"
    events = [json.loads(e) for e in re.findall(rb"^data: (\{.*\})$", r.body, re.M)]
    assert events[-1]["usage"]["completion_tokens"] == 4
    # The decoders read the prompts from sim-1, which kept nothing once read.
    reads = sum(sim_metric(fleet, i, "vllm:nixl_xfer_time_seconds_count") for i in (1, 2))
    assert reads == 6
    wait_until(lambda: sim_metric(fleet, 0, "vllm:kv_cache_usage_perc") == 0.0, "sim-1's kept blocks freed")
    assert fleet.metric("inferrail_prefill_legs_total", 'outcome="split"') == 6
    wait_until(lambda: settled(fleet), "both legs' leases released")
    # The decision log names both legs.
    decisions = [json.loads(line) for line in log.read_text().splitlines() if '"kind":"decision"' in line]
    assert len(decisions) == 6
    assert all(d["pd"]["split"] and d["pd"]["why"] == "always" and d["pd"]["prefill_winner"] == "sim-1" for d in decisions), decisions[-1]["pd"]


def test_a_prefill_replica_that_fails_is_followed_by_the_next_or_the_decoder_computes_alone(fleet_factory):
    # Probes rare: the faults meet the prefill legs, not the health checks.
    fleet = fleet_factory(policy="round_robin", roles=["prefill", "prefill", "decode"], health="probe_interval_ms: 600000")
    # The first prefill replica answers 503: the leg moves to the second.
    http("POST", f"{fleet.sim_url(0)}/_sim/fault", {"mode": "error", "status": 503})
    served = set()
    for n in range(4):
        r = http("POST", f"{fleet.url}/v1/chat/completions", long_chat(n))
        assert r.status == 200, r.body
        assert r.headers["x-inferrail-replica"] == "sim-3"
        served.add(r.headers.get("x-inferrail-prefill-replica"))
    assert served == {"sim-2"}, served
    assert fleet.metric("inferrail_prefill_leg_failures_total", 'reason="answer"') == 2, "the fault fired on sim-1's turns"
    # Both prefill replicas gone: the decoder computes the prompt itself.
    fleet.kill("sim-2")
    http("POST", f"{fleet.sim_url(0)}/_sim/fault", {"mode": "refuse"})
    for n in range(10, 13):
        r = http("POST", f"{fleet.url}/v1/chat/completions", long_chat(n))
        assert r.status == 200, r.body
        assert "x-inferrail-prefill-replica" not in r.headers
        assert r.json()["usage"]["completion_tokens"] == 4
    assert fleet.metric("inferrail_prefill_legs_total", 'outcome="whole"') == 3
    assert fleet.metric("inferrail_prefill_leg_failures_total", 'reason="no_answer"') == 6, "each leg tried both"
    assert sim_metric(fleet, 2, "vllm:nixl_num_failed_transfers_total") == 0, "no decoder was sent a leg it could not read"
    wait_until(lambda: settled(fleet), "every lease released")


def test_cost_model_keeps_a_request_whole_on_an_idle_decoder(fleet_factory):
    fleet = fleet_factory(policy="cost_model", roles=["prefill", "decode", "decode"])
    r = http("POST", f"{fleet.url}/v1/chat/completions", long_chat(0))
    assert r.status == 200
    assert "x-inferrail-prefill-replica" not in r.headers, "moving the prompt only adds the transfer on an idle decoder"
    assert r.headers["x-inferrail-replica"] in ("sim-2", "sim-3")
    assert fleet.metric("inferrail_prefill_legs_total", 'outcome="split"') is None
    # Explain names both legs and prices both ways.
    e = explain(fleet, "/v1/chat/completions", long_chat(0))
    pd = e["disaggregation"]
    assert (pd["split"], pd["why"], pd["prefillWinner"]) == (False, "dearer", "sim-1"), pd
    assert e["winner"] in ("sim-2", "sim-3")
    assert [c["setAside"] for c in pd["prefillCandidates"]][1:] == ["role", "role"], "decoders never prefill"
    assert next(c for c in e["candidates"] if c["id"] == "sim-1")["setAside"] == "role", "a prefill replica never runs a request whole"
    assert int(pd["transferBlocks"]) == 1, "the winner holds the prompt it just served but its last block (the last token's)"
    assert pd["prefillTtftMs"] > 0 and pd["wholeStallMs"] == 0


def test_a_prefill_replica_killed_while_the_decoder_reads_costs_a_recompute_not_a_request(fleet_factory):
    # Reads take 2 s a block: the prefill replica dies while its blocks are read.
    # Decoders recompute what they cannot read (kv_load_failure_policy), as they should be run.
    fleet = fleet_factory(policy="round_robin", roles=["prefill", "decode", "decode"], health="probe_interval_ms: 600000",
                          sim_flags=["--kv-transfer-block-us", "2000000"], transfer={"kv_load_failure_policy": "recompute"})
    split = fleet.metric("inferrail_prefill_legs_total", 'outcome="split"')
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        sent = pool.submit(http, "POST", f"{fleet.url}/v1/chat/completions", long_chat(1), None, 60)
        wait_until(lambda: fleet.metric("inferrail_prefill_legs_total", 'outcome="split"') == split + 1, "the prefill leg answered")
        fleet.kill("sim-1")
        r = sent.result()
    assert r.status == 200, r.body
    assert r.json()["usage"]["completion_tokens"] == 4
    failed = sum(sim_metric(fleet, i, "vllm:nixl_num_failed_transfers_total") for i in (1, 2))
    assert failed == 1, "the read failed: the fault fired"
    wait_until(lambda: settled(fleet), "every lease released")


def test_a_split_request_through_a_gateways_full_duplex_stream(fleet_factory):
    # The picker's stream (Istio's settings): the decision's body, with the
    # prefill's kv_transfer_params, goes back in chunks.
    fleet = fleet_factory(policy="round_robin", roles=["prefill", "decode", "decode"], filters=ISTIO)
    split = fleet.metric("inferrail_prefill_legs_total", 'outcome="split"')
    for n, stream in enumerate([False, True, False, True]):
        r = http("POST", f"{fleet.url}/v1/chat/completions", long_chat(n, stream=stream))
        assert r.status == 200, r.body
        if not stream:
            assert r.json()["usage"]["completion_tokens"] == 4
    assert fleet.metric("inferrail_prefill_legs_total", 'outcome="split"') == split + 4
    reads = sum(sim_metric(fleet, i, "vllm:nixl_xfer_time_seconds_count") for i in (1, 2))
    assert reads == split + 4, "every decode leg read its prompt from the prefill replica"
    wait_until(lambda: settled(fleet), "every lease released")


def test_engines_behind_an_api_key_get_it_on_both_legs(fleet_factory):
    key = {"authorization": "Bearer sk-pd"}
    fleet = fleet_factory(policy="round_robin", roles=["prefill", "decode", "decode"], sim_flags=["--api-key", "sk-pd"], client_headers=key)
    r = http("POST", f"{fleet.url}/v1/chat/completions", long_chat(0), key)
    assert r.status == 200, r.body
    assert r.headers.get("x-inferrail-prefill-replica") == "sim-1", "the prefill replica took the client's key"
    assert fleet.metric("inferrail_prefill_legs_total", 'outcome="whole"') is None
    # Without the key the engines refuse it, as vLLM does, and the router's leg does not hide that.
    r = http("POST", f"{fleet.url}/v1/chat/completions", long_chat(1))
    assert r.status == 401 and r.json() == {"error": "Unauthorized"}


def test_a_sidecar_in_front_of_the_decoder_runs_the_legs_the_router_names(fleet_factory):
    # llm-d's way: the decision names the decoder, and the prefill replica in
    # x-prefiller-host-port; inferrail-sidecar in front of each engine runs both legs.
    fleet = fleet_factory(policy="round_robin", roles=["prefill", "decode", "decode"], routing=", prefill_legs: sidecar", sidecars=True)
    reads = lambda: sum(sim_metric(fleet, i, "vllm:nixl_xfer_time_seconds_count") for i in (1, 2))
    before = reads()
    for n, stream in enumerate([False, True, False, True]):
        r = http("POST", f"{fleet.url}/v1/chat/completions", long_chat(n, stream=stream))
        assert r.status == 200, r.body
        assert r.headers.get("x-inferrail-prefill-replica") == "sim-1"
        if not stream:
            assert r.json()["usage"]["completion_tokens"] == 4
    assert reads() == before + 4, "every decode leg read its prompt from the prefill replica"
    assert fleet.metric("inferrail_prefill_legs_total", 'outcome="split"') is None, "the router ran no leg"
    wait_until(lambda: sim_metric(fleet, 0, "vllm:kv_cache_usage_perc") == 0.0, "sim-1's kept blocks freed")
    wait_until(lambda: settled(fleet), "both legs' leases released")
    # The prefill replica gone: the sidecar lets the decoder compute the request whole.
    http("POST", f"{fleet.sim_url(0)}/_sim/fault", {"mode": "refuse"})
    r = http("POST", f"{fleet.url}/v1/chat/completions", long_chat(7))
    assert r.status == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert reads() == before + 4, "nothing was read for it"
