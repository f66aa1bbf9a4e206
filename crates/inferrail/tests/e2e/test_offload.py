"""KV offloaded to host memory, through a real Envoy: simulators with small
GPU caches and a host tier (vLLM's native OffloadingConnector) publish their
KV events, and the router follows both tiers (ADR 0059). A prompt the GPU
evicted is still in host memory; the engine loads it back and reports it
cached, and the router, in exact mode, predicts exactly that, from either
form of the tier's events: vLLM's default placeholders (a block's hash
alone) or self-describing ones. Explain shows each candidate's GPU and host
tokens and cost_model's price for loading them.
"""
import json
import random

import pytest

from conftest import http, wait_until
from test_explain import explain
from test_kv_events import WORDS, Checker, text

# Host tier: 256 blocks of 16 tokens at 1,024 bytes a token (16 KiB a block).
HOST_GIB = 256 * 16 * 1024 / 2**30


def offload_fleet(fleet_factory, self_describing):
    flags = ["--zero-latency", "--block-size", "16", "--num-gpu-blocks-override", "48", "--max-model-len", "768",
             "--kv-cache-bytes-per-token", "1024", "--kv-offloading-size", repr(HOST_GIB)]
    if self_describing:
        flags += ["--kv-transfer-config", json.dumps({"kv_connector_extra_config": {"self_describing_kv_events": True}})]
    f = fleet_factory(policy="cost_model", sim_flags=flags, replica_extra=", block_size: 16, kv_blocks: 48", kv_events={})
    f.until_exact()
    return f


def host_hits(fleet, i):
    page = http("GET", f"{fleet.sim_url(i)}/metrics").body.decode()
    name = "vllm:prompt_tokens_cached_by_source_total{"
    return float(next(line.split()[-1] for line in page.splitlines() if line.startswith(name) and 'source="host"' in line))


@pytest.mark.parametrize("self_describing", [False, True], ids=["placeholders", "self-describing"])
def test_exact_predictions_count_what_the_engine_loads_from_host_memory(fleet_factory, self_describing):
    fleet = offload_fleet(fleet_factory, self_describing)
    checker = Checker(fleet, seed=11)
    # Eight system prompts of 200-400 tokens over three GPU caches of 768
    # tokens: most are evicted between their uses, none from host memory.
    rng = random.Random(5)
    checker.systems = [text(rng, rng.randint(160, 320)) for _ in range(8)]
    claimed = checker.send(60)
    hits = [host_hits(fleet, i) for i in range(3)]
    assert sum(hits) > 0, f"no request found its prompt in host memory: {hits}"
    # Every request whose replica stayed exact was predicted exactly,
    # host tokens included.
    assert claimed >= 50, (claimed, checker.checked)
    assert all(fleet.kv_mode(f"sim-{i + 1}") == "exact" for i in range(3)), fleet.kv_modes()


def test_explain_shows_each_tier_and_the_price_of_loading(fleet_factory):
    fleet = offload_fleet(fleet_factory, self_describing=False)
    rng = random.Random(9)
    system = text(rng, 300)
    body = {"model": "sim", "max_tokens": 1, "messages": [{"role": "system", "content": system}, {"role": "user", "content": "first"}]}
    r = http("POST", f"{fleet.url}/v1/chat/completions", body)
    assert r.status == 200, r.body[:300]
    home = r.headers["x-inferrail-replica"]
    # Other prompts push it out of every GPU cache; it stays in host memory.
    for k in range(12):
        other = {"model": "sim", "max_tokens": 1, "messages": [{"role": "system", "content": text(rng, 300)}, {"role": "user", "content": str(k)}]}
        assert http("POST", f"{fleet.url}/v1/chat/completions", other).status == 200
    again = dict(body, messages=[body["messages"][0], {"role": "user", "content": "second"}])

    def held_in_host():
        out = explain(fleet, "/v1/chat/completions", again)
        return next((c for c in out["candidates"] if c["id"] == home and int(c["hostCachedTokens"]) > 0), None)

    wait_until(held_in_host, f"{home} to hold the prompt in host memory alone")
    c = held_in_host()
    gpu, host = int(c["gpuCachedTokens"]), int(c["hostCachedTokens"])
    assert int(c["predictedCachedTokens"]) == gpu + host + int(c["diskCachedTokens"])
    terms = {t["name"]: t["value"] for t in c["terms"]}
    # cost_model's default: 5.24 us a token from host memory.
    assert terms["offload"] == pytest.approx(host * 5.24e-6, rel=1e-9), terms
    r = http("POST", f"{fleet.url}/v1/chat/completions", again)
    assert r.status == 200
    cached = json.loads(r.body)["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert r.headers["x-inferrail-replica"] == home, "the prompt held in host memory wins on idle replicas"
    assert cached == gpu + host == int(r.headers["x-inferrail-cached-tokens"]), (cached, c)
