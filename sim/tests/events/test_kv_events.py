"""The simulator's KV events read as a user's tool would read vLLM's: pyzmq
and msgpack, nothing of this project's.

The decoded structure (keys, their order, the types of values) must be that
of the batches recorded from a real vLLM 0.32.0, and the raw payload must
start as vLLM's does. A subscriber that binds receives from the simulator,
which connects (vLLM's rule for an IP endpoint), and vLLM's replay protocol
answers a DEALER.
"""

import json
import os
import pathlib
import re
import subprocess
import urllib.request

import msgpack
import pytest
import zmq

ROOT = pathlib.Path(__file__).resolve().parents[3]
RECORDED = ROOT / "crates/inferrail-kv-events/tests/fixtures/vllm-0.32.0"
TOPIC = b"kv-events"


def shape(value):
    """Keys in order and value types, recursively; lists by their first item."""
    if isinstance(value, dict):
        return [(k, shape(v)) for k, v in value.items()]
    if isinstance(value, list):
        return ["list", shape(value[0]) if value else None]
    return type(value).__name__


def recorded_shapes():
    """Shape of each event type, and of the batch, in the real recordings."""
    events, batches = {}, set()
    for path in RECORDED.glob("kvevents*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            ts, evs, rank = record["decoded"]
            batches.add((type(ts).__name__, type(evs).__name__, type(rank).__name__))
            for e in evs:
                events.setdefault(e["type"], set()).add(repr(shape(e)))
            assert record["payload_hex_head"].startswith("93cb"), record["seq"]
    return events, batches


@pytest.fixture()
def sim_and_subscriber():
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
    binary = os.environ.get("INFERRAIL_SIM", str(ROOT / "target/debug/inferrail-sim"))
    # The replay service's port is found free here and bound by the simulator
    # a moment later; another process can take it in between, and the
    # simulator then exits before listening. It is started again on another.
    for _ in range(5):
        replay = ctx.socket(zmq.ROUTER)
        replay_port = replay.bind_to_random_port("tcp://127.0.0.1")
        replay.close(linger=0)
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}",
                  "replay_endpoint": f"tcp://127.0.0.1:{replay_port}", "topic": TOPIC.decode()}
        proc = subprocess.Popen(
            [binary, "--port", "0", "--zero-latency", "--enable-prompt-tokens-details", "--block-size", "16",
             "--num-gpu-blocks-override", "24", "--max-model-len", "384", "--kv-events-config", json.dumps(config)],
            stdout=subprocess.PIPE, text=True,
        )
        line = proc.stdout.readline()
        if line or proc.wait(timeout=10) == 0:
            break
    try:
        match = re.search(r"listening on (http://\S+)", line)
        assert match, f"unexpected first line from the simulator: {line!r}"
        yield match.group(1), sub, ctx, f"tcp://127.0.0.1:{replay_port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        sub.close(linger=0)
        ctx.term()


def post(url, path, body):
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as r:
        return r.read()


def complete(url, prompt):
    return json.loads(post(url, "/v1/completions", {"model": "inferrail/sim-8b", "prompt": prompt, "max_tokens": 20}))


def published(url):
    with urllib.request.urlopen(url + "/_sim/kv_events", timeout=30) as r:
        return json.loads(r.read())["published"]


def receive_until(sub, last_seq):
    """Messages up to and including sequence number `last_seq`."""
    messages = []
    while not messages or messages[-1][1] < last_seq:
        assert sub.poll(10_000), f"no message for seq {last_seq}"
        topic, seq, payload = sub.recv_multipart()
        messages.append((topic, int.from_bytes(seq, "big"), payload))
    return messages


def test_the_stream_has_the_shape_of_vllms(sim_and_subscriber):
    url, sub, ctx, replay_endpoint = sim_and_subscriber
    # A PUB socket drops what it sends before our subscription reaches it:
    # send small requests until one batch arrives.
    for i in range(400):
        complete(url, f"warm up {i} " * 8)
        if sub.poll(50):
            break
    else:
        pytest.fail("no KV event batch arrived")
    # Long prompts on a 24-block cache: stores, then evictions; then a reset.
    for i in range(6):
        complete(url, f"a long prompt about topic {i} " * 20)
    post(url, "/reset_prefix_cache", {})
    complete(url, "after the reset " * 20)
    messages = receive_until(sub, published(url) - 1)

    seqs = [seq for _, seq, _ in messages]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "consecutive sequence numbers"
    assert {topic for topic, _, _ in messages} == {TOPIC}

    events, batches = recorded_shapes()
    seen = set()
    for _, seq, payload in messages:
        assert payload[:2] == bytes.fromhex("93cb"), f"seq {seq}: a 3-array starting with a float64"
        ts, evs, rank = msgpack.unpackb(payload)
        assert (type(ts).__name__, type(evs).__name__, type(rank).__name__) in batches
        for e in evs:
            assert repr(shape(e)) in events[e["type"]], f"seq {seq}: {e['type']} shaped {shape(e)}, vLLM's {events[e['type']]}"
            seen.add(e["type"])
    assert seen == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}

    # vLLM 0.32's replay protocol: [empty, start seq] in; [empty, topic, seq,
    # payload]... then [empty, "", -1, ""] (as a real vLLM sends them, test_lora_vllm.py).
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(replay_endpoint)
    dealer.send_multipart([b"", seqs[0].to_bytes(8, "big")])
    replayed = []
    while True:
        assert dealer.poll(10_000), "no replay reply"
        empty, topic, seq, payload = dealer.recv_multipart()
        assert empty == b""
        if int.from_bytes(seq, "big", signed=True) == -1:
            assert (topic, payload) == (b"", b"")
            break
        assert topic == TOPIC
        replayed.append((int.from_bytes(seq, "big"), payload))
    dealer.close(linger=0)
    assert replayed[: len(messages)] == [(seq, payload) for _, seq, payload in messages]
