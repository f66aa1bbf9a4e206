"""How well the approximate KV index predicts cached tokens when requests overlap.

The end-to-end suite proves predictions exact for requests one at a time.
This measures what concurrency does to them: the same fleet as that test
(three simulators with the real Qwen3 tokenizer and small caches, Envoy
and inferrail, round robin), with U users each holding a conversation that
shares one of three system prompts, all talking at once. Every response's
x-inferrail-cached-tokens is compared with the engine's cached_tokens.

Two modes of the index: `approximate` learns only from the router's own
decisions; `events` follows the simulators' KV events (vLLM's wire, the
router binding one endpoint per engine, replay endpoints on) and is exact
(ADR 0012). Each run starts with every replica exact in events mode.

Run with `just bench-accuracy` (it builds the debug binaries the suite uses).
"""

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "crates" / "inferrail" / "tests" / "e2e"))
from conftest import Fleet, http  # noqa: E402  (the end-to-end suite's fleet)

QWEN3 = ROOT / ".cache" / "tokenizers" / "qwen3"
WORDS = ("river stone cloud lantern garden silver copper window mountain ocean forest delta "
         "的 数据 模型 naïve café").split(" ")


def text(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def user(fleet, seed, turns, systems):
    """One user's conversation, turn after turn; returns (predicted, engine) cached tokens per turn."""
    rng = random.Random(seed)
    conv = [{"role": "system", "content": rng.choice(systems)}]
    out = []
    for _ in range(turns):
        conv.append({"role": "user", "content": text(rng, rng.randint(3, 40))})
        body = {"model": "sim", "messages": conv, "max_tokens": rng.randint(1, 12)}
        r = http("POST", f"{fleet.url}/v1/chat/completions", body, timeout=60)
        assert r.status == 200, r.body[:300]
        predicted = int(r.headers.get("x-inferrail-cached-tokens", -1))
        out.append((predicted, r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]))
        conv.append({"role": "assistant", "content": text(rng, rng.randint(3, 20))})
        if len(conv) > 9:
            del conv[1:3]
    return out


def fleet(tmp, blocks, mode):
    """The fleet of a run, started; in events mode with every replica exact."""
    events = {"bind": "router", "replay": True} if mode == "events" else None
    f = Fleet(tmp, tokenizer=QWEN3,
              sim_flags=["--block-size", "16", "--num-gpu-blocks-override", str(blocks), "--max-model-len", "1024"],
              replica_extra=f", block_size: 16, kv_blocks: {blocks}", kv_events=events,
              # The users keep replies of their own in their histories, not the engine's.
              config_extra="kv: {resent_replies: false}\n").start()
    if events:
        f.until_exact()
    return f


def measure(users, requests, blocks, mode="approximate"):
    rng = random.Random(11)
    systems = [text(rng, n) for n in (60, 150, 240)]
    with tempfile.TemporaryDirectory() as tmp:
        fleet_ = fleet(Path(tmp), blocks, mode)
        try:
            start = time.monotonic()
            with ThreadPoolExecutor(users) as pool:
                runs = list(pool.map(lambda u: user(fleet_, 100 + u, requests // users, systems), range(users)))
            secs = time.monotonic() - start
            modes = fleet_.kv_modes() if mode == "events" else None
        finally:
            fleet_.stop()
    pairs = [p for run in runs for p in run]
    errors = [p - e for p, e in pairs]
    point = {
        "mode": mode,
        "users": users,
        "blocks": blocks,
        "requests": len(pairs),
        "seconds": round(secs, 2),
        "exact": sum(e == 0 for e in errors),
        "over_predicted": sum(e > 0 for e in errors),
        "under_predicted": sum(e < 0 for e in errors),
        "mean_abs_error_tokens": round(sum(abs(e) for e in errors) / len(pairs), 2),
        "predicted_cached_tokens": sum(p for p, _ in pairs),
        "engine_cached_tokens": sum(e for _, e in pairs),
        "requests_with_cache_hits": sum(e > 0 for _, e in pairs),
    }
    if modes is not None:
        point["kv_modes_after"] = modes
    return point


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", default="1,4,16", help="concurrent users, one run each")
    ap.add_argument("--requests", type=int, default=320, help="requests a run")
    ap.add_argument("--blocks", default="64,256", help="KV cache blocks of each simulator, one run each")
    ap.add_argument("--modes", default="approximate,events", help="index modes, one run each: approximate, events")
    ap.add_argument("--out", type=Path, help="where to write the JSON result")
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    points = []
    for mode in args.modes.split(","):
        for blocks in [int(b) for b in args.blocks.split(",")]:
            for users in [int(u) for u in args.users.split(",")]:
                point = measure(users, args.requests, blocks, mode)
                print(json.dumps(point), flush=True)
                points.append(point)
    result = {
        "benchmark": "prediction-accuracy-under-concurrency",
        "setup": f"3 simulators (Qwen3 tokenizer, 16-token blocks, default latency model), Envoy, inferrail (debug build), "
                 f"round robin; chat conversations sharing 3 system prompts; index modes {args.modes.replace(',', ' and ')} "
                 f"(approximate: the router learns from its own decisions; events: the simulators publish KV events and "
                 f"the router follows them with replay endpoints); commit {commit}",
        "command": "just bench-accuracy " + " ".join(sys.argv[1:]),
        "points": points,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
