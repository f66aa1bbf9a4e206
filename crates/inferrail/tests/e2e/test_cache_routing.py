"""Routing on the cache through a real Envoy: three simulators whose caches
hold about a third of the shared system prompts each, the same seeded
traffic for every policy, and the share of shared-prompt tokens the engines
report as cached (usage.prompt_tokens_details.cached_tokens).

A cache-blind policy scatters each system prompt over every replica, so each
cache churns through all of them; a cache-aware one gives each prompt a
home. Two regimes: one client at a time on simulators that take no time
(placement alone decides), and two clients on simulators with the default
latency model (queues and the load guards take part). Sessions: with
affinity on, a conversation stays on its replica until that replica is past
the bounded-load cap, then follows the new one.
"""
import json
import random
import threading
import urllib.request

import pytest

from conftest import http, wait_until

PROMPTS, PROMPT_WORDS = 6, 300
BLOCKS = 48  # 768 tokens of 16: about two of the six system prompts (about 330 tokens each)


def system_prompts():
    rng = random.Random(11)
    words = "river stone cloud lantern garden silver copper window mountain ocean forest delta".split()
    return [f"You are assistant {i}. " + " ".join(rng.choice(words) for _ in range(PROMPT_WORDS)) for i in range(PROMPTS)]


def run(fleet, requests=120, warmup=40, clients=1, seed=5):
    """Sends the same seeded W1-like traffic; returns (cached share of shared-prompt tokens after warmup, replicas used)."""
    prompts = system_prompts()
    rng = random.Random(seed)
    plan = [(rng.randrange(PROMPTS), rng.randrange(10**6)) for _ in range(requests)]
    results = [None] * requests
    lock = threading.Lock()
    next_index = [0]

    def client():
        while True:
            with lock:
                i = next_index[0]
                next_index[0] += 1
            if i >= requests:
                return
            p, q = plan[i]
            body = {"model": "sim", "max_tokens": 2, "messages": [
                {"role": "system", "content": prompts[p]}, {"role": "user", "content": f"Question {q}: why?"}]}
            r = http("POST", f"{fleet.url}/v1/chat/completions", body)
            assert r.status == 200, r.body[:300]
            usage = json.loads(r.body)["usage"]
            results[i] = (p, usage["prompt_tokens_details"]["cached_tokens"], r.headers.get("x-inferrail-replica"))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # A system prompt's cacheable tokens: the most of it any request found cached (its full blocks).
    cacheable = {}
    for p, c, _ in results:
        cacheable[p] = max(cacheable.get(p, 0), c)
    measured = results[warmup:]
    share = sum(min(c, cacheable[p]) for p, c, _ in measured) / sum(cacheable[p] for p, _, _ in measured)
    return share, {rep for _, _, rep in results}


def make(fleet_factory, policy, latency=False, **extra):
    flags = ["--block-size", "16", "--num-gpu-blocks-override", str(BLOCKS), "--max-model-len", "768"]
    return fleet_factory(policy=policy, sim_flags=flags if latency else ["--zero-latency", *flags],
                         replica_extra=f", block_size: 16, kv_blocks: {BLOCKS}", **extra)


@pytest.mark.parametrize("policy", ["cost_model", "kv_aware", "prefix_hash", "round_robin"])
def test_one_client_at_a_time_cache_aware_policies_keep_the_shared_prompts_cached(fleet_factory, policy):
    fleet = make(fleet_factory, policy)
    share, used = run(fleet)
    if policy == "round_robin":
        assert share < 0.45, f"round robin kept {share:.0%} cached"
    else:
        assert share >= 0.80, f"{policy} kept {share:.0%} of shared-prompt tokens cached"
    assert len(used) == 3, f"{policy} used only {used}"
    # The index's blocks, per replica, add up to its total, and every replica that served holds some.
    per_replica = {r: fleet.metric("inferrail_kv_index_blocks", f'replica="{r}"') for r in used}
    assert all(v and v > 0 for v in per_replica.values()), per_replica
    assert sum(per_replica.values()) == fleet.metric("inferrail_kv_index_entries")


@pytest.mark.parametrize("policy", ["cost_model", "round_robin"])
def test_two_clients_on_timed_engines_cost_model_keeps_the_shared_prompts_cached(fleet_factory, policy):
    share, _ = run(make(fleet_factory, policy, latency=True), clients=2)
    if policy == "round_robin":
        # Which of two clients' requests reaches Envoy first decides which
        # replica round robin gives it, so its share varies from run to run:
        # 28-40% over twelve runs, 47% once. The bound only has to stay clear of cost_model's.
        assert share < 0.55, f"round robin kept {share:.0%} cached"
    else:
        assert share >= 0.80, f"{policy} kept {share:.0%} of shared-prompt tokens cached"


def test_a_session_sticks_to_its_replica_until_it_is_overloaded_then_follows_the_new_one(fleet_factory):
    fleet = make(fleet_factory, "cost_model", latency=True, routing=", policies: {cost_model: {session_affinity: true, epsilon: 1.0}}")
    prompts = system_prompts()

    def ask(session, content, prompt=0):
        body = {"model": "sim", "max_tokens": 2, "messages": [{"role": "system", "content": prompts[prompt]}, {"role": "user", "content": content}]}
        r = http("POST", f"{fleet.url}/v1/chat/completions", body, {"x-session-id": session})
        assert r.status == 200, r.body[:300]
        return r.headers["x-inferrail-replica"]

    home = ask("chat-1", "first turn")
    # Other prompts' caches elsewhere would attract it; affinity keeps it home.
    for i in range(1, 4):
        ask(f"other-{i}", "warm another replica", prompt=i)
    turns = [ask("chat-1", f"turn {t}", prompt=t % 3 + 1) for t in range(6)]
    # On a failure, say what the router set aside and which replicas were healthy (it failed once in CI and
    # did not again in 17 runs, some under a busy loop).
    why = [line for line in fleet.metrics().splitlines()
           if line.startswith(("inferrail_set_aside_total", "inferrail_replica_healthy", "inferrail_probe_misses_total"))]
    assert all(t == home for t in turns), (home, turns, why)
    assert fleet.metric("inferrail_steered_total", 'policy="cost_model",reason="session"') >= 6

    # Two long streams of the conversation hold its home (2 of 2 in flight);
    # a third request would put it past ceil((1 + epsilon) * 3 / 3) = 2: it moves.
    def open_stream():
        body = {"model": "sim", "max_tokens": 400, "stream": True, "messages": [{"role": "user", "content": "a long answer"}]}
        req = urllib.request.Request(f"{fleet.url}/v1/chat/completions", json.dumps(body).encode(), method="POST",
                                     headers={"content-type": "application/json", "x-session-id": "chat-1"})
        return urllib.request.urlopen(req, timeout=30)

    streams = [open_stream(), open_stream()]
    assert [s.headers["x-inferrail-replica"] for s in streams] == [home, home]
    moved = ask("chat-1", "while home is busy")
    assert moved != home
    assert fleet.metric("inferrail_set_aside_total", 'policy="cost_model",reason="bounded_load"') >= 1
    for s in streams:
        s.close()
    wait_until(lambda: fleet.metric("inferrail_leases") == 0, "the streams' leases to end")
    assert ask("chat-1", "home is free again") == moved, "the conversation follows its new replica"

