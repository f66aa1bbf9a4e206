"""LoRA adapters through Envoy and the router: a request names an adapter in
`model`, the engine gets that name (the body is not rewritten to the base
model), and the router predicts each adapter's cache apart from the base
model's and the other adapters', as the engine hashes them, in approximate
mode and when it follows the engines' KV events."""

import json

import pytest

from conftest import MODEL, Fleet, http, wait_until
from test_prediction import send


def lora_fleet(tmp, **kw):
    flags = ["--block-size", "16", "--num-gpu-blocks-override", "256", "--max-model-len", "2048",
             "--enable-lora", "--max-loras", "2", "--lora-modules", f"sql={tmp}", f"chat={tmp}"]
    return Fleet(tmp, policy="cost_model", sim_flags=flags, replica_extra=", block_size: 16, kv_blocks: 256",
                 adapters=("sql", "chat"), **kw)


@pytest.fixture(scope="module", params=["approximate", "events"])
def fleet(request, tmp_path_factory):
    events = {"bind": "router", "replay": True} if request.param == "events" else None
    f = lora_fleet(tmp_path_factory.mktemp(f"lora-{request.param}"), kv_events=events)
    yield f.start()
    f.stop()


def test_each_adapters_cache_is_predicted_apart(fleet):
    system = "You answer questions about the river, the stone and the lantern in the garden. " * 8
    seen = []
    for i in range(24):
        model = ["sql", "chat", MODEL][i % 3]
        body = {"model": model, "prompt": system + f" Question {i // 3}: where is the copper window?", "max_tokens": 3}
        r = http("POST", f"{fleet.url}/v1/completions", body)
        assert r.status == 200, r.body[:300]
        assert r.json()["model"] == model, "the engine served the adapter asked for"
        usage = r.json()["usage"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert r.headers["x-inferrail-cached-tokens"] == str(cached), (i, model, r.headers)
        seen.append((model, cached))
    # Every adapter and the base model find the shared prefix cached, each its own copy.
    for model in ("sql", "chat", MODEL):
        assert any(c > 0 for m, c in seen if m == model), seen


def test_the_model_list_names_the_adapters_under_their_model(fleet):
    data = http("GET", f"{fleet.url}/v1/models").json()["data"]
    adapters = {m["id"]: m for m in data if m["id"] in ("sql", "chat")}
    assert set(adapters) == {"sql", "chat"}
    assert all(m["parent"] == MODEL and m["max_model_len"] is None for m in adapters.values())


def test_explain_shows_each_replicas_adapters_and_the_slots_the_engine_reports(fleet):
    from test_explain import SERVICE, explain, grpcurl

    for model in ("sql", "chat"):
        body = {"model": model, "prompt": f"A short question for {model}.", "max_tokens": 2}
        assert http("POST", f"{fleet.url}/v1/completions", body).status == 200

    # The configuration names no max_loras: the two slots are the engines' own word (vllm:lora_requests_info),
    # which an engine publishes once it has run a step: one that the router sent nothing yet gets a request of its own.
    for i in range(3):
        assert http("POST", f"{fleet.sim_url(i)}/v1/completions", {"model": MODEL, "prompt": "warm", "max_tokens": 1}).status == 200

    def shown():
        code, out = grpcurl(fleet, f"{SERVICE}/Replicas", data={})
        assert code == 0, out
        return {r["id"]: r.get("adapters") for r in json.loads(out)["replicas"]}

    wait_until(lambda: all(a and a["maxLoras"] == 2 for a in shown().values()), "every replica's slots learned")
    # Nothing runs now; each adapter whose request ended still holds the slot where it ran.
    replicas = shown()
    assert {name for a in replicas.values() for name in a["idle"]} == {"chat", "sql"}, replicas
    assert not any(a["running"] for a in replicas.values()), replicas
    out = explain(fleet, "/v1/completions", {"model": "sql", "prompt": "Which slot?", "max_tokens": 1})
    fits = {c["id"]: c["adapter"] for c in out["candidates"]}
    assert all(f["name"] == "sql" and f["maxLoras"] == 2 and not f["mustWait"] for f in fits.values()), fits
    # Resident exactly where sql holds a slot.
    assert {i for i, f in fits.items() if f["resident"]} == {i for i, a in replicas.items() if "sql" in a["idle"]}, (fits, replicas)
