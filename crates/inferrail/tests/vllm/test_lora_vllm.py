"""LoRA adapters on a real vLLM 0.32.0 against the simulator: both serve the
same tiny adapters (built here: random weights in PEFT's layout for the tiny
Qwen3's q_proj and v_proj), started with the same flags, and both are asked
the same things in the same order. What each answers must be the same:
`/v1/models` (ids, parents, roots, lengths), the cached tokens of adapter and
base requests (each adapter's cache apart), runtime loading and unloading
(status and body), `vllm:lora_requests_info` (the series and which is the
newest), the replay service's frames and the KV events of adapter requests (every field but the hash
values, whose links are compared instead). Then Inferrail, following vLLM's
KV events in front of it, predicts vLLM's cached tokens exactly for adapter
requests."""

import json
import random
import re
import struct
import time
from array import array

import msgpack
import pytest
import zmq

from conftest import MODEL_DIR, QWEN3, SERVED, TARGET, Front, Helper, Server, free_ports, http
from harness import wait_until
from test_kv_events_vllm import settled

BLOCK_SIZE = 32
RANK = 8
FLAGS = ["--enable-lora", "--max-loras", "1", "--max-lora-rank", str(RANK)]


def build_adapter(dest, config, seed):
    """A PEFT LoRA adapter of rank RANK on every layer's q_proj and v_proj,
    with random weights, written as adapter_config.json and
    adapter_model.safetensors (the safetensors layout by hand: an 8-byte
    little-endian header length, the JSON header, the raw float32 data)."""
    dest.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    hidden, head = config["hidden_size"], config["head_dim"]
    outs = {"q_proj": config["num_attention_heads"] * head, "v_proj": config["num_key_value_heads"] * head}
    header, blobs, offset = {}, [], 0
    for layer in range(config["num_hidden_layers"]):
        for module, out in outs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            for part, shape in (("lora_A", (RANK, hidden)), ("lora_B", (out, RANK))):
                data = array("f", (rng.gauss(0.0, 0.02) for _ in range(shape[0] * shape[1]))).tobytes()
                header[f"{prefix}.{part}.weight"] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
                blobs.append(data)
                offset += len(data)
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    (dest / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    (dest / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": SERVED, "r": RANK,
        "lora_alpha": 2 * RANK, "lora_dropout": 0.0, "target_modules": list(outs), "bias": "none",
        "fan_in_fan_out": False, "inference_mode": True}))
    return dest


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    config = json.loads((MODEL_DIR / "config.json").read_text())
    return {name: build_adapter(root / name, config, seed) for seed, name in enumerate(("ada", "adb", "adc"))}


def events_config(port, replay):
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
                       "replay_endpoint": f"tcp://*:{replay}", "topic": "kv-events"})


@pytest.fixture(scope="module")
def lora_vllm(adapters, tmp_path_factory):
    events, replay = free_ports(2)
    server = Server(tmp_path_factory.mktemp("vllm-lora") / "vllm.log")
    server.env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    server.flags = [*FLAGS, "--lora-modules", f"ada={adapters['ada']}", f"adb={adapters['adb']}",
                    "--kv-events-config", events_config(events, replay)]
    server.events, server.replay = events, replay
    try:
        yield server.start(900)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def lora_sim(adapters, tmp_path_factory):
    port, events, replay = free_ports(3)
    sim = Helper("inferrail-sim", [TARGET / "inferrail-sim", "--tokenizer", QWEN3, "--served-model-name", SERVED,
                                   "--model", MODEL_DIR, "--block-size", str(BLOCK_SIZE), "--max-model-len", "2048",
                                   "--enable-prompt-tokens-details", "--port", str(port),
                                   "--allow-runtime-lora-updating", *FLAGS,
                                   "--lora-modules", f"ada={adapters['ada']}", f"adb={adapters['adb']}",
                                   "--kv-events-config", events_config(events, replay)],
                 tmp_path_factory.mktemp("sim-lora") / "sim.log")
    sim.url = f"http://127.0.0.1:{port}"
    sim.replay = replay
    try:
        sim.wait_until(lambda: http("GET", sim.url + "/health", timeout=5).status == 200, "/health")
        yield sim
    finally:
        sim.stop()


def lora_info(metrics):
    """vllm:lora_requests_info's series as {(max_lora, running, waiting): value}."""
    series = {}
    for labels, value in re.findall(r"^vllm:lora_requests_info\{(.*)\} (\S+)$", metrics, re.M):
        d = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        series[(d["max_lora"], d["running_lora_adapters"], d["waiting_lora_adapters"])] = float(value)
    return series


def normalized(events, names):
    """KV events with each block hash replaced by the order it was first
    seen in (`names`, shared across calls), so that two engines' events
    compare by their links and not by their hash values."""
    def name(h):
        return None if h is None else names.setdefault(h, len(names))
    out = []
    for e in events:
        e = dict(e)
        e["block_hashes"] = [name(h) for h in e["block_hashes"]]
        if "parent_block_hash" in e:
            e["parent_block_hash"] = name(e["parent_block_hash"])
        out.append(e)
    return out


def replay(port, start):
    """Every message the engine's replay service sends from sequence
    `start` on, up to and with its end marker, as frames after the empty
    delimiter. The engine buffers every batch it published, so this reads
    them all, in order, with no subscription racing the first ones."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        while True:
            assert sock.poll(10_000), f"no replay from {start} within 10 s: {got}"
            frames = sock.recv_multipart()
            got.append(frames)
            if len(frames) > 2 and frames[-2] == b"\xff" * 8:
                return got
    finally:
        sock.close(linger=0)
        ctx.term()


def events_of(messages):
    """The events of replayed messages `[topic, seq, payload]`, and the
    sequence number after the last."""
    batches = [m for m in messages if m[-2] != b"\xff" * 8]
    events = [e for m in batches for e in msgpack.unpackb(m[-1])[1]]
    return events, int.from_bytes(batches[-1][-2], "big") + 1 if batches else None


def script(url, replay_port, adapter_path):
    """What the engine at `url` answers to one fixed sequence of requests;
    its KV events are read back from its replay service."""
    seen = {}

    def post(path, body):
        r = http("POST", url + path, body, timeout=120)
        return r.status, r.body.decode(errors="replace")

    def complete(model, prompt, max_tokens=2):
        r = http("POST", url + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}, timeout=120)
        assert r.status == 200, (model, r.status, r.body[:300])
        body = r.json()
        return body["model"], body["usage"]["prompt_tokens"], body["usage"]["prompt_tokens_details"]["cached_tokens"]

    cards = http("GET", url + "/v1/models").json()["data"]
    seen["models"] = [{k: m[k] for k in ("id", "object", "owned_by", "root", "parent", "max_model_len")} for m in cards]
    system = "You are the archivist of the lantern garden. " + " ".join(f"entry{i}" for i in range(150))
    names, answers = {}, []
    for model in ("ada", "ada", "adb", SERVED, "adb"):
        answers.append(complete(model, system + f" Question for {model}?"))
    events, after = events_of(replay(replay_port, 0))
    seen["events"] = normalized(events, names)
    seen["load"] = post("/v1/load_lora_adapter", {"lora_name": "adc", "lora_path": str(adapter_path)})
    seen["load_again"] = post("/v1/load_lora_adapter", {"lora_name": "adc", "lora_path": str(adapter_path)})
    seen["models_loaded"] = [m["id"] for m in http("GET", url + "/v1/models").json()["data"]]
    answers.append(complete("adc", system + " Question for adc?"))
    answers.append(complete("adc", system + " Another question for adc?"))
    seen["events_adc"] = normalized(events_of(replay(replay_port, after))[0], names)
    seen["unload"] = post("/v1/unload_lora_adapter", {"lora_name": "adc"})
    seen["unload_again"] = post("/v1/unload_lora_adapter", {"lora_name": "adc"})
    seen["answers"] = answers
    # The frames as sent, each payload by its length.
    seen["replay"] = [[*m[:-1], len(m[-1])] for m in replay(replay_port, 1)]
    info = lora_info(http("GET", url + "/metrics").body.decode())
    seen["lora_info_series"] = sorted(info)
    seen["lora_info_newest"] = max(info, key=info.get) if info else None
    return seen


def test_adapters_are_served_as_vllm_serves_them(lora_vllm, lora_sim, adapters):
    vllm = script(lora_vllm.url, lora_vllm.replay, adapters["adc"])
    sim = script(lora_sim.url, lora_sim.replay, adapters["adc"])
    # The run shows something: adapters cached apart, events carrying them, the newest info idle.
    models, prompts, cached = zip(*vllm["answers"])
    assert models == ("ada", "ada", "adb", SERVED, "adb", "adc", "adc"), models
    assert cached[0] == 0 and cached[1] > 0 and cached[2] == 0 and cached[3] == 0 and cached[4] > 0, cached
    assert {e.get("lora_name") for e in vllm["events"]} == {"ada", "adb", None}, vllm["events"]
    assert vllm["lora_info_newest"] == ("1", "", ""), vllm["lora_info_series"]
    assert len(vllm["replay"]) > 2 and vllm["replay"][-1][-2] == b"\xff" * 8, vllm["replay"]
    for key in vllm:
        assert sim[key] == vllm[key], f"{key}: simulator {sim[key]!r}\nvLLM {vllm[key]!r}"


def deferred_together(url, tag):
    """Adapter `ada` runs a long answer in the one slot; three requests of
    `adb` with one 1,500-token prefix arrive meanwhile and wait for the slot
    (deferred), then are admitted together. Returns the adb requests'
    cached tokens, in increasing order (the one admitted first finds none),
    and whether each ended after ada's answer."""
    import threading
    done, got = {}, {}

    def send(name, body):
        r = http("POST", url + "/v1/completions", dict(body, temperature=0), timeout=300)
        assert r.status == 200, (name, r.status, r.body[:300])
        got[name] = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        done[name] = time.monotonic()

    busy = threading.Thread(target=send, args=("ada", {"model": "ada", "prompt": f"Busy {tag} " + "b " * 50, "max_tokens": 200, "ignore_eos": True}))
    busy.start()
    # adb's requests go once ada runs: the engine's newest adapter info says so.
    wait_until(lambda: (lambda i: bool(i) and max(i, key=i.get)[1] == "ada")(lora_info(http("GET", url + "/metrics").body.decode())),
               "the engine to run adapter ada", timeout=60)
    prefix = f"The lantern archive, volume {tag}. " + " ".join(f"w{i}" for i in range(400))
    waiting = [threading.Thread(target=send, args=(f"b{k}", {"model": "adb", "prompt": prefix + f" question {k}?", "max_tokens": 2}))
               for k in range(3)]
    for t in waiting:
        t.start()
    for t in [*waiting, busy]:
        t.join()
    return sorted((got[f"b{k}"], done[f"b{k}"] > done["ada"]) for k in range(3))


def test_requests_admitted_together_find_the_first_ones_prompt_blocks(lora_vllm, lora_sim):
    # vLLM caches a prompt's full blocks when it schedules them: the second
    # and third of one step find the first's (allocate_slots, cache_blocks).
    vllm = deferred_together(lora_vllm.url, "v")
    sim = deferred_together(lora_sim.url, "v")
    assert all(after for _, after in vllm), f"adb did not wait for the slot on vLLM: {vllm}"
    assert vllm[0][0] == 0 and vllm[1][0] > 0 and vllm[2][0] == vllm[1][0], vllm
    assert sim == vllm, f"simulator {sim}, vLLM {vllm}"


@pytest.fixture(scope="module")
def lora_front(lora_vllm, tmp_path_factory):
    """Envoy and the router in front of the LoRA vLLM, following its KV events
    (the replay endpoint brings the history the first test's requests made)."""
    f = Front(tmp_path_factory.mktemp("front-lora"), lora_vllm.port, SERVED)
    text = f.config.read_text().replace(f"tokenizer: {QWEN3.resolve()}}}", f"tokenizer: {QWEN3.resolve()}, adapters: [ada, adb]}}")
    assert "adapters: [ada, adb]" in text, text
    f.config.write_text(text + f"kv_events: {{endpoint: 'tcp://127.0.0.1:{lora_vllm.events}', "
                               f"replay_endpoint: 'tcp://127.0.0.1:{lora_vllm.replay}', topic: kv-events}}\n")
    try:
        yield f.start()
    finally:
        f.stop()


def test_inferrail_predicts_vllms_cached_tokens_for_adapter_requests(lora_front):
    front = lora_front
    system = "The river keeper's log, kept for the lantern garden. " + " ".join(f"line{i}" for i in range(170))
    wrong, checked, hits = [], 0, 0
    for turn in range(3):
        for model in ("ada", "adb", SERVED):
            settled(front)  # every event of the last request is applied before the next decision
            body = {"model": model, "prompt": system + f" Turn {turn}, for {model}.", "max_tokens": 2, "temperature": 0}
            r = front.post("/v1/completions", body)
            assert r.status == 200, r.body[:500]
            assert r.json()["model"] == model
            engine = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            predicted = int(r.headers["x-inferrail-cached-tokens"])
            checked += 1
            hits += engine > 0
            if predicted != engine:
                wrong.append((turn, model, predicted, engine))
    # After the first turn each of the three finds its own copy of the prefix.
    assert hits == 6, f"{hits} of {checked} requests found cached tokens"
    assert not wrong, f"{len(wrong)} of {checked} predictions differ (turn, model, predicted, vLLM): {wrong}"
    mode = re.search(r'^inferrail_kv_mode\{[^}]*mode="([^"]+)"[^}]*\} 1$', front.metrics(), re.M)
    assert mode and mode.group(1) == "exact", front.metrics()
