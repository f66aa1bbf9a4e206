"""Predicted cached tokens against what the engines report, request by request.

Three simulators with a real Qwen3 tokenizer and small caches (64 blocks of
16 tokens, so prompts evict each other), Envoy and inferrail in front, round
robin. Conversations share system prompts and grow turn by turn; completions
share prefixes. Every response's x-inferrail-prompt-tokens and
x-inferrail-cached-tokens must equal the engine's usage.prompt_tokens and
cached_tokens, streaming and not, chat and completions. That workload's
clients keep replies of their own in the history (a replayed conversation),
so its router is told they do not resend the engine's (`resent_replies:
false`). Agents that resend the replies as they came, to a router that
expects it, get the reply's blocks predicted where the engine cached them.
"""
import json
import random

import pytest

from conftest import ROOT, Fleet, http, wait_until

QWEN3 = ROOT / ".cache" / "tokenizers" / "qwen3"
WORDS = ("river stone cloud lantern garden silver copper window mountain ocean forest delta "
         "的 数据 模型 😀 naïve café — «quotes» <think> tabs\tand\nnewlines").split(" ")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    assert (QWEN3 / "tokenizer.json").is_file(), "run `just setup` for the tokenizer files"
    f = Fleet(tmp_path_factory.mktemp("prediction"), tokenizer=QWEN3,
              sim_flags=["--block-size", "16", "--num-gpu-blocks-override", "64", "--max-model-len", "1024"],
              replica_extra=", block_size: 16, kv_blocks: 64", config_extra="kv: {resent_replies: false}\n")
    yield f.start()
    f.stop()


@pytest.fixture(scope="module")
def agents_fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("resent"),
              sim_flags=["--block-size", "16", "--num-gpu-blocks-override", "512", "--max-model-len", "4096"],
              replica_extra=", block_size: 16, kv_blocks: 512")
    yield f.start()
    f.stop()


def text(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def send(fleet, path, body):
    """Sends one request; returns (engine prompt tokens, engine cached tokens, response headers)."""
    r = http("POST", f"{fleet.url}{path}", body)
    assert r.status == 200, r.body[:300]
    if body.get("stream"):
        events = [json.loads(line[6:]) for line in r.body.decode().splitlines() if line.startswith("data: {")]
        usage = events[-1]["usage"]
    else:
        usage = json.loads(r.body)["usage"]
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], r.headers


def test_what_an_engine_refused_is_taken_back(fleet):
    prompt = "A prompt the first engine refuses, long enough to fill a few blocks of sixteen tokens each. " * 3
    refused = http("POST", f"{fleet.url}/v1/completions", {"model": "sim", "prompt": prompt, "max_tokens": 2, "n": 2, "cache_salt": "refused"})
    assert refused.status == 400 and refused.headers["x-inferrail-cached-tokens"] == "0"
    # The observe filter reports the 400 asynchronously; the router then takes the record back.
    wait_until(lambda: fleet.metric("inferrail_kv_take_backs_total") == 1, "the take-back")
    # Round robin: these reach the two other engines, then the one that refused.
    for _ in range(3):
        prompt_tokens, cached, headers = send(fleet, "/v1/completions", {"model": "sim", "prompt": prompt, "max_tokens": 2, "cache_salt": "refused"})
        assert headers["x-inferrail-cached-tokens"] == str(cached) == "0", headers


def test_predicted_cached_tokens_equal_the_engines_on_every_request(fleet):
    rng = random.Random(11)
    systems = [text(rng, n) for n in (60, 150, 240)]
    conversations = [[{"role": "system", "content": rng.choice(systems)}] for _ in range(12)]
    prefixes = [text(rng, n) for n in (40, 120)]
    hits, replicas = 0, set()
    for i in range(300):
        stream = rng.random() < 0.5
        extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
        max_tokens = rng.randint(1, 12)
        if rng.random() < 0.7:
            conv = rng.choice(conversations)
            conv.append({"role": "user", "content": text(rng, rng.randint(3, 40))})
            body = {"model": "sim", "messages": conv, "max_tokens": max_tokens, **extra}
            path = "/v1/chat/completions"
            # The client keeps its own reply in the history, as a replayed conversation does.
            conv.append({"role": "assistant", "content": text(rng, rng.randint(3, 20))})
            if len(conv) > 9:
                del conv[1:3]
        else:
            body = {"model": "sim", "prompt": rng.choice(prefixes) + " " + text(rng, rng.randint(1, 60)),
                    "max_tokens": max_tokens, **extra}
            path = "/v1/completions"
        prompt, cached, headers = send(fleet, path, body)
        assert headers.get("x-inferrail-prompt-tokens") == str(prompt), (i, path, stream, headers)
        assert headers.get("x-inferrail-cached-tokens") == str(cached), (i, path, stream, prompt, headers)
        hits += cached > 0
        replicas.add(headers["x-inferrail-replica"])
    assert replicas == {"sim-1", "sim-2", "sim-3"}
    assert hits > 50, f"the workload should hit the cache often, got {hits}"
    # The index's gauges: blocks held, and at least a node's 24 bytes for each.
    wait_until(lambda: (fleet.metric("inferrail_kv_index_entries") or 0) > 0, "the index entries gauge")
    assert fleet.metric("inferrail_kv_index_bytes") >= 24 * fleet.metric("inferrail_kv_index_entries")


def test_a_request_the_tokenizer_cannot_follow_is_still_served(fleet):
    body = {"model": "sim", "prompt": ["one prompt", "another"], "max_tokens": 1}
    r = http("POST", f"{fleet.url}/v1/completions", body)
    # The simulator refuses batches as it refuses every unsupported parameter; routing did not stop it.
    assert r.headers.get("x-inferrail-replica") and "x-inferrail-prompt-tokens" not in r.headers
    assert 'outcome="batch"' in fleet.metrics()


def test_a_reply_resent_as_it_came_is_predicted_cached_where_it_was_generated(agents_fleet):
    """Three agent loops, each resending its history (the model's replies as they came, then a tool's output); round
    robin keeps each agent on one engine. From the second step on, the engine holds the previous reply's blocks."""
    rng = random.Random(5)
    agents = [[{"role": "system", "content": f"You are agent {a}. " + text(rng, 30)}] for a in range(3)]
    previous = [0, 0, 0]
    beyond_the_prompt = 0
    for step in range(6):
        for a, conv in enumerate(agents):
            conv.append({"role": "user", "content": "Tool output: " + text(rng, rng.randint(5, 30))})
            r = http("POST", f"{agents_fleet.url}/v1/chat/completions", {"model": "sim", "messages": conv, "max_tokens": rng.randint(8, 40)})
            assert r.status == 200, r.body[:300]
            out = json.loads(r.body)
            prompt, cached = out["usage"]["prompt_tokens"], out["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert r.headers.get("x-inferrail-prompt-tokens") == str(prompt), (step, a, r.headers)
            assert r.headers.get("x-inferrail-cached-tokens") == str(cached), (step, a, prompt, cached, r.headers)
            # The previous prompt's full blocks were cached before; more means the reply's were too.
            beyond_the_prompt += cached > previous[a] // 16 * 16
            previous[a] = prompt
            conv.append({"role": "assistant", "content": out["choices"][0]["message"]["content"]})
    assert beyond_the_prompt >= 10, f"replies' blocks should be cached on most later steps, were on {beyond_the_prompt} of 15"
