"""The simulator with the real Qwen3 tokenizer against the goldens that
test_goldens.py holds vLLM to: for every golden it accepts (all but the lists
of several prompts, which it refuses) it must report vLLM's prompt tokens, its
exact prompt ids (`return_token_ids`, per choice for completions, at the top
level for chat, as vLLM answers), and vLLM's cached tokens on a repeat. It
needs no vLLM: the simulator runs with vLLM's block size, context length and
served name (conftest.py, qwen3_sim)."""

import uuid

import pytest

from conftest import http
from test_goldens import PATHS, body_for, first_difference, fully_cached, is_batch, need, params


def single(rec):
    return not is_batch(rec)


def post(sim, rec, body):
    r = http("POST", sim.url + PATHS[rec["endpoint"]], body)
    assert r.status == 200, f"{rec['id']}: the simulator answered {r.status}: {r.body[:2000]!r}"
    return r.json()


@pytest.mark.parametrize("rec", params(single))
def test_sim_prompt_tokens_match_goldens(qwen3_sim, rec):
    need(rec)
    got = post(qwen3_sim, rec, body_for(rec))["usage"]["prompt_tokens"]
    assert got == len(rec["ids"]), f"{rec['id']}: simulator prompt_tokens {got}, golden {len(rec['ids'])}"


@pytest.mark.parametrize("rec", params(single))
def test_sim_prompt_ids_match_goldens(qwen3_sim, rec):
    need(rec)
    reply = post(qwen3_sim, rec, dict(body_for(rec), return_token_ids=True))
    got = reply["prompt_token_ids"] if rec["endpoint"] == "chat" else reply["choices"][0]["prompt_token_ids"]
    assert got == rec["ids"], f"{rec['id']}: {first_difference(rec['ids'], got or [])}"


@pytest.mark.parametrize("rec", params(single))
def test_sim_cached_tokens_on_repeat(qwen3_sim, rec):
    need(rec)
    salt = uuid.uuid4().hex
    first = post(qwen3_sim, rec, body_for(rec, salt))["usage"]["prompt_tokens_details"]["cached_tokens"]
    second = post(qwen3_sim, rec, body_for(rec, salt))["usage"]["prompt_tokens_details"]["cached_tokens"]
    want = fully_cached(len(rec["ids"]))
    assert (first, second) == (0, want), f"{rec['id']}: simulator cached_tokens {first} then {second}, vLLM reports 0 then {want}"
