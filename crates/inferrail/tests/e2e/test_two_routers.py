"""Several routers, one truth: two inferrail processes behind one Envoy
ext_proc cluster (round robin, stream by stream), each following every
engine's KV events. The engines bind `tcp://*:port` (vLLM binds for `*`)
and each router connects: an engine that connects reaches one subscriber.

A W1-like workload (six long system prompts, many questions, one client at
a time, seeded) on three simulators whose caches hold about two of the
prompts each, cache-aware routing (kv_aware). Measured: the share of prompt
tokens served from cache (usage cached_tokens / prompt_tokens) after a
warm-up, for one and two routers in exact and in approximate mode. In exact
mode both routers see what the engines hold, whoever routed it, and break
ties by the prompt rather than by a draw of their own, so two make the
decisions one makes: the same cached share (within 2 points, allowing for
a view that differs while events are in flight) and every exact claim
holds; in approximate mode each router knows only its own decisions.

Envoy opens two ext_proc streams a request (route, then observe) and
balances each on its own: with two routers the observe stream, which
carries the status, goes to the router that did not decide. An exact
replica's claim ends with the route stream whatever the status; an
approximate record without a status is taken back after the observe grace,
so in approximate mode each router also forgets its own decisions. The
take-backs are counted in the results.

`INFERRAIL_TWO_ROUTERS_OUT=path` writes the four figures as JSON
(bench/results/prediction/two-routers.json).
"""
import json
import os
import random
import subprocess

from conftest import ROOT, http, wait_until
from test_cache_routing import BLOCKS, PROMPTS, system_prompts
from test_kv_events import Checker

REQUESTS, WARMUP, SEED = 300, 30, 5


def measure(fleet_factory, routers, exact):
    """Returns (cached share of prompt tokens after the warm-up, records taken back over the routers)."""
    events = {"bind": "engine", "replay": True} if exact else None
    flags = ["--zero-latency", "--block-size", "16", "--num-gpu-blocks-override", str(BLOCKS), "--max-model-len", "768"]
    fleet = fleet_factory(policy="kv_aware", sim_flags=flags, replica_extra=f", block_size: 16, kv_blocks: {BLOCKS}",
                          kv_events=events, routers=routers)
    if exact:
        fleet.until_exact()
    check = Checker(fleet)
    prompts = system_prompts()
    rng = random.Random(SEED)
    prompt_tokens = cached_tokens = claims = 0
    for i in range(REQUESTS):
        # Both modes at the same pace: one request at a time, each after the last is over in every router.
        wait_until(check.caught_up, "every router to apply every batch the engines sent, nothing in flight")
        before = [fleet.kv_modes(k) for k in range(routers)]
        body = {"model": "sim", "max_tokens": 2, "messages": [
            {"role": "system", "content": prompts[rng.randrange(PROMPTS)]},
            {"role": "user", "content": f"Question {rng.randrange(10**6)}: why?"}]}
        r = http("POST", f"{fleet.url}/v1/chat/completions", body)
        assert r.status == 200, (i, r.status, r.body[:300], "ext_proc fell open:", fleet.envoy_stat("failure_mode_allowed"))
        usage = json.loads(r.body)["usage"]
        if exact:
            # Whichever router decided, it was exact for the replica: the prediction is the engine's.
            rep = int(r.headers["x-inferrail-replica"].removeprefix("sim-")) - 1
            if all(m[rep] == "exact" for m in before + [fleet.kv_modes(k) for k in range(routers)]):
                assert r.headers.get("x-inferrail-cached-tokens") == str(usage["prompt_tokens_details"]["cached_tokens"]), (i, r.headers, usage)
                claims += 1
        if i >= WARMUP:
            prompt_tokens += usage["prompt_tokens"]
            cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
    if exact:
        assert claims == REQUESTS and all(fleet.kv_modes(k) == ["exact"] * 3 for k in range(routers))
        # Each router follows every engine.
        for k in range(routers):
            for i in range(3):
                assert fleet.metric("inferrail_kv_events_messages_total", f'replica="sim-{i + 1}"', router=k) > 0
    take_backs = sum(fleet.metric("inferrail_kv_take_backs_total", router=k) or 0 for k in range(routers))
    fleet.stop()
    return cached_tokens / prompt_tokens, int(take_backs)


def test_two_routers_in_exact_mode_serve_as_much_from_cache_as_one(fleet_factory):
    runs = {(routers, exact): measure(fleet_factory, routers, exact) for exact in (True, False) for routers in (1, 2)}
    shares = {k: share for k, (share, _) in runs.items()}
    one, two = shares[1, True], shares[2, True]
    assert abs(one - two) <= 0.02, f"exact mode: one router {one:.1%}, two {two:.1%}"
    out = os.environ.get("INFERRAIL_TWO_ROUTERS_OUT")
    if out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        name = lambda routers, exact: f"{'one_router' if routers == 1 else 'two_routers'}_{'exact' if exact else 'approximate'}"
        result = {
            "benchmark": "two-routers-cached-share",
            "setup": f"3 inferrail-sim --zero-latency ({BLOCKS} blocks of 16 tokens), Envoy, inferrail (debug build) x1 or x2 "
                     f"behind one ext_proc cluster, kv_aware; {PROMPTS} system prompts of ~330 tokens, {REQUESTS} requests one at a time "
                     f"(seed {SEED}), the first {WARMUP} not measured; exact: engines bind, routers connect, replay on; commit {commit}",
            "command": "INFERRAIL_TWO_ROUTERS_OUT=bench/results/prediction/two-routers.json .venv/bin/pytest -q "
                       "crates/inferrail/tests/e2e/test_two_routers.py",
            "cached_share_of_prompt_tokens": {name(*k): round(v, 4) for k, v in sorted(shares.items(), key=lambda kv: (not kv[0][1], kv[0][0]))},
            "records_taken_back": {name(*k): tb for k, (_, tb) in sorted(runs.items(), key=lambda kv: (not kv[0][1], kv[0][0]))},
            "note": "Envoy balances the route and the observe ext_proc streams of a request independently; with two routers the "
                    "status reaches the router that did not decide. Exact mode ends the claim when the route stream closes; an "
                    "approximate record without a status is taken back after the 500 ms observe grace, so each approximate router "
                    "forgets its own decisions as well as not seeing the other's.",
        }
        (ROOT / out).parent.mkdir(parents=True, exist_ok=True)
        (ROOT / out).write_text(json.dumps(result, indent=1) + "\n")
