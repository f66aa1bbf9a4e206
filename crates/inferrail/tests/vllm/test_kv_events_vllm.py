"""Exact mode against the real vLLM 0.32.0: a second vLLM, with an 80-block
cache so that a handful of prompts evict each other, publishes its KV events
(it binds `tcp://*:port`, as vLLM does for a wildcard, and keeps a replay
endpoint); the router follows them. One request at a time, each sent once
the router has applied everything the engine published, the router's
predicted cached tokens must equal vLLM's usage on every request while the
replica is exact, and it must stay exact throughout, evictions included."""

import json
import re
import time

import pytest

from conftest import SERVED, STATS, Front, Server, free_ports

BLOCKS = 80
BLOCK_SIZE = 32


@pytest.fixture(scope="module")
def events_vllm(tmp_path_factory):
    events, replay = free_ports(2)
    server = Server(tmp_path_factory.mktemp("vllm-events") / "vllm.log")
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events}",
              "replay_endpoint": f"tcp://*:{replay}", "topic": "kv-events"}
    server.flags = ["--num-gpu-blocks-override", str(BLOCKS), "--kv-events-config", json.dumps(config)]
    server.events = (events, replay)
    try:
        yield server.start(900)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def events_front(events_vllm, tmp_path_factory):
    events, replay = events_vllm.events
    f = Front(tmp_path_factory.mktemp("front-events"), events_vllm.port, SERVED)
    f.config.write_text(f.config.read_text() + (
        f"kv_events: {{endpoint: 'tcp://127.0.0.1:{events}', replay_endpoint: 'tcp://127.0.0.1:{replay}', topic: kv-events}}\n"))
    try:
        yield f.start()
    finally:
        f.stop()


def metric(front, name, labels):
    m = re.search(rf"^{name}\{{{labels}\}} (\S+)$", front.metrics(), re.M)
    return float(m.group(1)) if m else 0.0


def mode(front):
    m = re.search(r'^inferrail_kv_mode\{[^}]*mode="([^"]+)"[^}]*\} 1$', front.metrics(), re.M)
    return m.group(1) if m else None


def settled(front, deadline_s=30):
    """Waits until the router has taken no new message from the engine for two
    reads in a row: everything published so far is applied."""
    end = time.monotonic() + deadline_s
    last = None
    while time.monotonic() < end:
        seen = metric(front, "inferrail_kv_events_messages_total", '[^}]*replica="vllm"[^}]*')
        if seen == last:
            return
        last = seen
        time.sleep(0.3)
    raise AssertionError("the router kept receiving events for 30 s")


def test_predictions_equal_vllms_cached_tokens_through_evictions(events_front):
    front = events_front
    # The engine publishes nothing until it stores a block: a first request starts the stream.
    warm = {"model": SERVED, "prompt": "warm up " * 40, "max_tokens": 1, "temperature": 0}
    assert front.post("/v1/completions", warm).status == 200
    end = time.monotonic() + 60
    while mode(front) != "exact" and time.monotonic() < end:
        time.sleep(0.2)
    assert mode(front) == "exact", front.metrics()
    # Five prompts of about 20 blocks each: four fit in 80 blocks, five do not.
    prompts = [f"Prompt {p}: " + " ".join(f"w{p}x{i}" for i in range(260)) for p in range(5)]
    wrong, evicted, checked = [], 0, 0
    for turn in range(4):
        for p, text in enumerate(prompts):
            settled(front)
            body = {"model": SERVED, "prompt": f"{text} turn {turn}", "max_tokens": 2, "temperature": 0}
            r = front.post("/v1/completions", body)
            assert r.status == 200, r.body[:500]
            usage = r.json()["usage"]
            engine = usage["prompt_tokens_details"]["cached_tokens"]
            predicted = int(r.headers["x-inferrail-cached-tokens"])
            full = (usage["prompt_tokens"] - 1) // BLOCK_SIZE * BLOCK_SIZE
            if turn > 0 and engine < full - 2 * BLOCK_SIZE:
                evicted += 1  # the prompt was cached before and lost blocks since
            checked += 1
            if predicted != engine:
                wrong.append((turn, p, predicted, engine))
            assert mode(front) == "exact", f"turn {turn} prompt {p}: {front.metrics()}"
    STATS["kv_events"] = (checked, evicted, checked - len(wrong))
    assert evicted > 0, "no repeated prompt lost blocks: the cache never evicted, the test shows nothing"
    assert not wrong, f"{len(wrong)} of {checked} predictions differ (turn, prompt, predicted, vLLM): {wrong}"
    assert metric(front, "inferrail_kv_events_garbage_total", '[^}]*replica="vllm"[^}]*') == 0
