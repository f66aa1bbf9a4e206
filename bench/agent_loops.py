"""Agent loops: what a policy keeps cached, predicts and waits for when every step resends the model's last reply.

Agents run in a closed loop, `--agents` at a time: each starts from a
framework prompt all share and a task of its own, then takes `--steps`
steps; a step sends the whole history (streamed; TTFT is the first body
byte), appends the model's reply as it came and a tool's output, and
thinks 0.2-1 s. A finished agent is replaced by a new one. The fleet is the
end-to-end suite's (three simulators with the default latency model and
small caches, Envoy, inferrail), run once per variant:

- `cost_model`: as shipped (`kv.resent_replies: true`, ADR 0037);
- `cost_model-no-replies`: `kv.resent_replies: false`, as before ADR 0037;
- `cost_model-exact`: the simulators publish their KV events and the
  router follows them (exact mode, ADR 0012);
- `round_robin`;
- `sglang`, `smg`, `vllm-router`: the peer routers (PyPI `sglang-router`
  0.3.2, `smg` 1.13.0, `vllm-router` 0.1.17; `just setup-sglang
  setup-peers`) with their default `cache_aware` policy in front of the
  same simulators, no Envoy.

Each step's x-inferrail-cached-tokens is compared with the engine's
cached_tokens. Steps sent in the first `--warmup-s` are not counted. With
`--reps N` every variant runs N times, the variants in turn each
repetition (this machine's speed drifts between minutes); the agents are
the same each time, so the spread is the runs' noise.

Run with `just bench-agents` (it builds the release binaries).
"""

import argparse
import socket
import http.client as httpc
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "crates" / "inferrail" / "tests" / "e2e"))
from conftest import MODEL, Fleet  # noqa: E402  (the end-to-end suite's fleet)
from harness import free_ports, http, wait_until  # noqa: E402

WORDS = ("the of and to in is that river stone cloud lantern garden silver copper window mountain ocean forest "
         "delta build test file error result value function return list table query index status").split(" ")
# Each variant's policy (None: a peer router), routing YAML added, and KV events (the e2e fleet's `kv_events`).
VARIANTS = {
    "cost_model": ("cost_model", "", None),
    "cost_model-no-replies": ("cost_model", "kv: {resent_replies: false}\n", None),
    "cost_model-exact": ("cost_model", "", {"bind": "router", "replay": True}),
    "round_robin": ("round_robin", "", None),
    "sglang": (None, "", None),
    "smg": (None, "", None),
    "vllm-router": (None, "", None),
}
# Each peer's command and log level; the rest of their flags are SGLang's router's.
PEERS = {
    "sglang": [ROOT / ".venv-sglang" / "bin" / "python", "-m", "sglang_router.launch_router", "--log-level", "warn"],
    "smg": [ROOT / ".venv-smg" / "bin" / "smg", "launch", "--log-level", "warn"],
    "vllm-router": [ROOT / ".venv-vllm-router" / "bin" / "vllm-router", "--log-level", "warning"],
}


def text(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def step(port, conv, max_tokens):
    """One streamed step; returns (TTFT s, reply text, engine prompt tokens, engine cached tokens, predicted cached)."""
    c = httpc.HTTPConnection("127.0.0.1", port, timeout=120)
    body = {"model": MODEL, "messages": conv, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.monotonic()
    c.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"content-type": "application/json"})
    r = c.getresponse()
    first = r.read(1)
    ttft = time.monotonic() - sent
    raw = (first + r.read()).decode()
    assert r.status == 200, raw[:300]
    predicted = r.getheader("x-inferrail-cached-tokens")
    c.close()
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    reply = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e.get("choices"))
    usage = events[-1]["usage"]
    return ttft, reply, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], predicted and int(predicted)


def agent(port, seed, args, framework, start, stop_at, out, lock):
    rng = random.Random(seed)
    conv = [{"role": "system", "content": framework}, {"role": "user", "content": f"Task {seed}: " + text(rng, rng.randint(20, 60))}]
    for _ in range(args.steps):
        if time.monotonic() >= stop_at:
            return
        sent_at = time.monotonic() - start
        ttft, reply, prompt, cached, predicted = step(port, conv, rng.randint(20, 120))
        with lock:
            out.append({"at": sent_at, "ttft": ttft, "prompt": prompt, "cached": cached, "predicted": predicted})
        conv.append({"role": "assistant", "content": reply})
        conv.append({"role": "user", "content": "Tool output: " + text(rng, rng.randint(60, 200))})
        time.sleep(rng.uniform(0.2, 1.0))


def launch(variant, tmp, args):
    """The variant's fleet, started, and the port its clients send to."""
    policy, extra, kv_events = VARIANTS[variant]
    fleet = Fleet(tmp, policy=policy or "round_robin", config_extra=extra, kv_events=kv_events,
                  sim_flags=["--block-size", "16", "--num-gpu-blocks-override", str(args.blocks), "--max-model-len", "16384"],
                  replica_extra=f", block_size: 16, kv_blocks: {args.blocks}")
    if policy is not None:
        return fleet.start(), fleet.listen
    for i in range(3):
        fleet.start_sim(i)
    port, prometheus = free_ports(2)
    fleet.procs[variant] = fleet._spawn(variant, [
        *PEERS[variant], "--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware",
        "--worker-urls", *[f"http://127.0.0.1:{p}" for p in fleet.sim_ports],
        "--prometheus-port", str(prometheus)])
    wait_until(lambda: up(port) and http("POST", f"http://127.0.0.1:{port}/v1/chat/completions",
                                         {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).status == 200,
               variant, timeout=60)
    return fleet, port


def up(port):
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def run(variant, args):
    framework = text(random.Random(1), args.framework_words)
    with tempfile.TemporaryDirectory() as tmp:
        fleet, port = launch(variant, Path(tmp), args)
        try:
            out, lock = [], threading.Lock()
            start = time.monotonic()
            stop_at = start + args.warmup_s + args.duration_s
            seeds = iter(range(1000, 10**6))
            seeds_lock = threading.Lock()

            def slot():
                while time.monotonic() < stop_at:
                    with seeds_lock:
                        seed = next(seeds)
                    agent(port, seed, args, framework, start, stop_at, out, lock)

            threads = [threading.Thread(target=slot) for _ in range(args.agents)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            fleet.stop()
    steps = [s for s in out if s["at"] >= args.warmup_s]
    ttfts = sorted(s["ttft"] * 1e3 for s in steps)
    pct = lambda q: round(ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))], 1)  # noqa: E731
    result = {
        "variant": variant,
        "steps": len(steps),
        "steps_per_s": round(len(steps) / args.duration_s, 2),
        "ttft_p50_ms": pct(0.5),
        "ttft_p99_ms": pct(0.99),
        "cached_fraction": round(sum(s["cached"] for s in steps) / sum(s["prompt"] for s in steps), 4),
    }
    if steps[0]["predicted"] is not None:
        result["predictions_exact"] = round(sum(s["predicted"] == s["cached"] for s in steps) / len(steps), 4)
        result["over_predicted"] = sum(s["predicted"] > s["cached"] for s in steps)
        result["under_predicted"] = sum(s["predicted"] < s["cached"] for s in steps)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--agents", type=int, default=15)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--framework-words", type=int, default=400)
    ap.add_argument("--blocks", type=int, default=1500, help="KV cache blocks of each simulator")
    ap.add_argument("--warmup-s", type=float, default=20)
    ap.add_argument("--duration-s", type=float, default=60)
    ap.add_argument("--reps", type=int, default=1, help="runs of each variant, the variants in turn")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    results = []
    for rep in range(args.reps):
        for variant in args.variants.split(","):
            result = {**run(variant, args), "rep": rep}
            print(json.dumps(result), flush=True)
            results.append(result)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        doc = {"benchmark": "agent-loops", "commit": commit, "profile": os.environ.get("INFERRAIL_PROFILE", "debug"),
               "command": " ".join(sys.argv), "settings": {k: v for k, v in vars(args).items() if k not in ("out", "variants")},
               "results": results}
        args.out.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
