"""Inferrail in front of the real vLLM: Envoy (envoy/local.yaml, its replica
cluster trimmed to vLLM alone) asks the router, which tokenizes each request
with the Qwen3 tokenizer and predicts its cached tokens on vLLM from the
block size and capacity it learned from vLLM's /metrics; Envoy hands both
back as x-inferrail-prompt-tokens and x-inferrail-cached-tokens. Each must
equal what vLLM itself reports in the response's usage.

Every golden the router tokenizes (not a request with its own chat_template,
which the router declines by design, nor a list of several prompts) goes
through Envoy twice under a fresh cache salt, so that it is its own chain:
nothing cached the first time, every whole block but the one holding the
last token the second time."""

import re
import uuid

import pytest

from conftest import STATS, vllm_cache_config
from test_goldens import BLOCK_SIZE, PATHS, body_for, fully_cached, is_batch, need, params


def routable(rec):
    return "chat_template" not in rec["request"] and not is_batch(rec)


def test_router_learned_vllms_cache_shape(front, vllm):
    info = vllm_cache_config(vllm)
    STATS["num_gpu_blocks"] = int(info["num_gpu_blocks"])
    assert front.shape == (BLOCK_SIZE, int(info["num_gpu_blocks"])), (
        f"the router logged block_size and blocks {front.shape}; vLLM's cache_config_info says {info}")


@pytest.mark.parametrize("rec", params(routable))
def test_router_headers_match_vllm_usage(front, vllm, rec):
    need(rec, vllm)
    salt = uuid.uuid4().hex
    n = len(rec["ids"])
    problems = []
    for attempt, cached in (("first", 0), ("second", fully_cached(n))):
        r = front.post(PATHS[rec["endpoint"]], body_for(rec, salt))
        assert r.status == 200, f"{rec['id']} ({attempt}): {r.status} through Envoy: {r.body[:2000]!r}"
        usage = r.json()["usage"]
        engine = (usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"])
        h = r.headers
        router = (h.get("x-inferrail-prompt-tokens"), h.get("x-inferrail-cached-tokens"))
        where = (h.get("x-inferrail-replica"), h.get("x-inferrail-upstream"))
        if router != tuple(str(v) for v in engine):
            problems.append(f"{attempt}: router prompt/cached tokens {router}, vLLM usage {engine}")
        if engine != (n, cached):
            problems.append(f"{attempt}: vLLM usage {engine}, golden expects ({n}, {cached})")
        if where != ("vllm", front.upstream):
            problems.append(f"{attempt}: x-inferrail-replica/upstream {where}, expected ('vllm', {front.upstream!r})")
    assert not problems, f"{rec['id']} ({rec['endpoint']}, {n} golden tokens, salt {salt}):\n" + "\n".join(problems)


def test_router_tokenized_every_request(front):
    """Runs last: every decision had its tokens (none timed out, was declined
    or fell back), and no decision failed."""
    metrics = front.metrics()
    outcomes = {m.group(1): float(m.group(2)) for m in re.finditer(r'^inferrail_tokenize_total\{outcome="([^"]+)"\} (\S+)$', metrics, re.M)}
    errors = re.findall(r"^inferrail_router_errors_total\{.*$", metrics, re.M)
    STATS["router_tokenize"] = outcomes
    assert set(outcomes) <= {"ok"}, f"tokenizer outcomes {outcomes}"
    assert not errors, errors
