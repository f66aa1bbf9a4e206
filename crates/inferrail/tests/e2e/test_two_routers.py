"""Several routers, one truth: two inferrail processes behind one Envoy
ext_proc cluster (each stream to a router drawn at random), listed to each other as
peers (ADR 0034), each following every engine's KV events in exact mode.
The engines bind `tcp://*:port` (vLLM binds for `*`) and each router
connects: an engine that connects reaches one subscriber.

A W1-like workload (six long system prompts, many questions, one client at
a time, seeded) on three simulators whose caches hold about two of the
prompts each, cache-aware routing (kv_aware). Measured: the share of prompt
tokens served from cache (usage cached_tokens / prompt_tokens) after a
warm-up and how often the predicted cached tokens were the engine's, for
one and two routers in exact and in approximate mode.

The same runs with each router inside its own Envoy as the dynamic module
(ADR 0060): one, and two Envoys taking requests in turn as peers, against
the ext_proc router's figures.

Envoy opens two ext_proc streams a request (route, then observe) and
balances each on its own (at random here), so the observe stream, which carries the status,
often reaches the router that did not decide. That router forwards what it
hears to the decider (named in the decision's `inferrail` metadata, which
the observe filter forwards), and each router mirrors the other's
decisions: both hold every record, every request counts in flight in both,
and each outcome is counted once, where it was decided. So two routers make
the decisions one makes, in approximate mode as in exact mode, and no
record of a request that succeeded is taken back.

`INFERRAIL_TWO_ROUTERS_OUT=path` writes the figures as JSON
(bench/results/prediction/two-routers.json).
"""
import json
import os
import random
import re
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from conftest import ENVOY, MODEL, ROOT, TARGET, free_ports, http, wait_until
from test_cache_routing import BLOCKS, PROMPTS, system_prompts
from test_kv_events import Checker

REQUESTS, WARMUP, SEED = 300, 30, 5


def measure(fleet_factory, routers, exact, envoys=1, module=False):
    """Returns (cached share of prompt tokens after the warm-up, share of
    predictions equal to the engine's cached tokens after the warm-up,
    records taken back over the routers). With two `envoys`, requests
    alternate between them. With `module`, each router runs inside its own
    Envoy (ADR 0060), so there are as many Envoys as routers."""
    events = {"bind": "engine", "replay": True} if exact else None
    flags = ["--zero-latency", "--block-size", "16", "--num-gpu-blocks-override", str(BLOCKS), "--max-model-len", "768"]
    fleet = fleet_factory(policy="kv_aware", sim_flags=flags, replica_extra=f", block_size: 16, kv_blocks: {BLOCKS}",
                          kv_events=events, routers=routers, module=module)
    if exact:
        fleet.until_exact()
    urls = fleet.urls if module else [fleet.url] + ([second_envoy(fleet)] if envoys == 2 else [])
    check = Checker(fleet)
    prompts = system_prompts()
    rng = random.Random(SEED)
    prompt_tokens = cached_tokens = claims = exact_predictions = 0
    served = len(urls)  # each Envoy's first request, at its start
    for i in range(REQUESTS):
        # Both modes at the same pace: one request at a time, each after the last is over in every router.
        wait_until(check.caught_up, "every router to apply every batch the engines sent, nothing in flight")
        before = [fleet.kv_modes(k) for k in range(routers)]
        body = {"model": "sim", "max_tokens": 2, "messages": [
            {"role": "system", "content": prompts[rng.randrange(PROMPTS)]},
            {"role": "user", "content": f"Question {rng.randrange(10**6)}: why?"}]}
        r = http("POST", f"{urls[i % len(urls)]}/v1/chat/completions", body)
        assert r.status == 200, (i, r.status, r.body[:300], "ext_proc fell open:", fleet.envoy_stat("failure_mode_allowed"))
        served += 1
        usage = json.loads(r.body)["usage"]
        predicted = r.headers.get("x-inferrail-cached-tokens") == str(usage["prompt_tokens_details"]["cached_tokens"])
        if exact:
            # Whichever router decided, it was exact for the replica: the prediction is the engine's.
            rep = int(r.headers["x-inferrail-replica"].removeprefix("sim-")) - 1
            if all(m[rep] == "exact" for m in before + [fleet.kv_modes(k) for k in range(routers)]):
                assert predicted, (i, r.headers, usage)
                claims += 1
        if i >= WARMUP:
            prompt_tokens += usage["prompt_tokens"]
            cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
            exact_predictions += predicted
    if exact:
        assert claims == REQUESTS and all(fleet.kv_modes(k) == ["exact"] * 3 for k in range(routers))
        # Each router follows every engine.
        for k in range(routers):
            for i in range(3):
                assert fleet.metric("inferrail_kv_events_messages_total", f'replica="sim-{i + 1}"', router=k) > 0
    # Every request's outcome was counted once, by the router that decided it, and every lease was given back.
    wait_until(lambda: all(fleet.metric("inferrail_leases", router=k) == 0 for k in range(routers)), "every lease given back")
    outcomes = [sum(float(v) for v in re.findall(r'^inferrail_requests_total\{[^}]*outcome="ok"[^}]*\} (\S+)$', fleet.metrics(k), re.M))
                for k in range(routers)]
    assert sum(outcomes) == served, (outcomes, served)
    if routers > 1:
        assert all(n > 0 for n in outcomes), f"each router decided some: {outcomes}"
    take_backs = sum(fleet.metric("inferrail_kv_take_backs_total", router=k) or 0 for k in range(routers))
    fleet.stop()
    measured = REQUESTS - WARMUP
    return cached_tokens / prompt_tokens, exact_predictions / measured, int(take_backs)


def test_two_routers_serve_as_much_from_cache_as_one_and_count_each_outcome_once(fleet_factory):
    # (routers, envoys, exact, module): the routers inside their Envoys too, one and two of them as peers.
    runs = {(routers, envoys, exact, module): measure(fleet_factory, routers, exact, envoys, module)
            for exact in (True, False) for routers, envoys, module in ((1, 1, False), (2, 1, False), (2, 2, False), (1, 1, True), (2, 2, True))}
    for (routers, envoys, exact, module), (share, exact_share, take_backs) in runs.items():
        mode, (one, one_exact, _) = "exact" if exact else "approximate", runs[1, 1, exact, False]
        what = f"{mode} mode, {routers} routers {'inside' if module else 'behind'} {envoys} Envoys"
        assert abs(one - share) <= 0.02, f"{what}: cached share {share:.1%} against one router's {one:.1%}"
        assert abs(one_exact - exact_share) <= 0.02, f"{what}: exact predictions {exact_share:.1%} against one router's {one_exact:.1%}"
        assert take_backs == 0, f"{what}: {take_backs} records of requests that succeeded were taken back"
    out = os.environ.get("INFERRAIL_TWO_ROUTERS_OUT")
    if out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        ordered = sorted(runs.items(), key=lambda kv: (not kv[0][2], kv[0][3], kv[0][0], kv[0][1]))
        name = lambda routers, envoys, exact, module: (f"{'one_router' if routers == 1 else 'two_routers'}"
                                                       f"{'_two_envoys' if envoys == 2 else ''}{'_inside_envoy' if module else ''}"
                                                       f"_{'exact' if exact else 'approximate'}")
        result = {
            "benchmark": "two-routers-cached-share",
            "setup": f"3 inferrail-sim --zero-latency ({BLOCKS} blocks of 16 tokens), Envoy (x1, or x2 taking requests in turn), inferrail (debug build) x1 or x2 "
                     f"behind one ext_proc cluster (streams drawn at random), peers listed, kv_aware; {PROMPTS} system prompts of ~330 tokens, {REQUESTS} requests one at a time "
                     f"(seed {SEED}), the first {WARMUP} not measured; exact: engines bind, routers connect, replay on; commit {commit}",
            "command": "INFERRAIL_TWO_ROUTERS_OUT=bench/results/prediction/two-routers.json .venv/bin/pytest -q "
                       "crates/inferrail/tests/e2e/test_two_routers.py",
            "cached_share_of_prompt_tokens": {name(*k): round(v[0], 4) for k, v in ordered},
            "predictions_equal_to_the_engines_cached_tokens": {name(*k): round(v[1], 4) for k, v in ordered},
            "records_taken_back": {name(*k): v[2] for k, v in ordered},
            "note": "Envoy balances the route and the observe ext_proc streams of a request independently; the routers are "
                    "each other's peers (ADR 0034): what one hears of a request the other decided goes to the decider, and each "
                    "mirrors the other's decisions. Before peers (commit 55907e1) two approximate routers kept 85.95% cached "
                    "against one router's 92.22%, and took back 294 records.",
        }
        (ROOT / out).parent.mkdir(parents=True, exist_ok=True)
        (ROOT / out).write_text(json.dumps(result, indent=1) + "\n")


LIMIT, CLIENTS, PER_CLIENT = 3, 16, 25


def second_envoy(fleet):
    """Starts a second Envoy like the fleet's, on its own ports, in front of
    the same routers and engines; returns its URL once it serves."""
    listen, admin = free_ports(2)
    second = fleet.envoy_config.read_text()
    for old, new in [(fleet.listen, listen), (fleet.envoy_admin, admin)]:
        second, n = re.subn(rf"port_value: {old}\b", f"port_value: {new}", second)
        assert n == 1
    (fleet.tmp / "envoy-2.yaml").write_text(second)
    fleet.procs["envoy-2"] = fleet._spawn("envoy-2", [ENVOY, "-c", fleet.tmp / "envoy-2.yaml", "--disable-hot-restart",
                                                      "--log-level", "warn", "--concurrency", "2", "--base-id", "1"])
    url = f"http://127.0.0.1:{listen}"
    wait_until(lambda: http("POST", f"{url}/v1/completions", {"model": "sim", "prompt": "x", "max_tokens": 1}).status == 200,
               "a request through the second Envoy")
    return url


def test_two_envoys_and_two_routers_never_exceed_a_replicas_max_concurrency(fleet_factory):
    """Each router admits within its part of every replica's limit (the
    parts add up to it), so two routers deciding at once, for two Envoys,
    never put more than `max_concurrency` requests on an engine: the
    engines' own peak says so. More clients than the fleet has slots, so
    the limit is reached (some requests are shed with 429)."""
    fleet = fleet_factory(policy="least_request", sim_flags=["--decode-token-ms", "4"],
                          replica_extra=f", max_concurrency: {LIMIT}, max_pending: {LIMIT}", routers=2)
    urls = [fleet.url, second_envoy(fleet)]

    def client(c):
        codes = []
        for n in range(PER_CLIENT):
            body = {"model": "sim", "prompt": f"client {c} request {n}", "max_tokens": 20}
            codes.append(http("POST", f"{urls[c % 2]}/v1/completions", body, timeout=60).status)
        return codes

    with ThreadPoolExecutor(CLIENTS) as pool:
        codes = [code for codes in pool.map(client, range(CLIENTS)) for code in codes]
    peaks = [http("GET", f"{fleet.sim_url(i)}/_sim/requests").json()["peak_in_flight"] for i in range(3)]
    fell_open = fleet.envoy_stat("failure_mode_allowed")
    assert fell_open == 0, f"Envoy routed {fell_open} requests without the routers: the limit is not theirs to keep then"
    assert set(codes) <= {200, 429}, sorted(set(codes))
    assert codes.count(429) > 0 and max(peaks) == LIMIT, f"the limit was reached: {codes.count(429)} shed, peaks {peaks}"
    assert all(p <= LIMIT for p in peaks), f"an engine had more than {LIMIT} requests at once: {peaks}"
    fleet.stop()


def test_a_router_killed_under_load_loses_no_request_and_the_other_routes_on(fleet_factory):
    """Two routers with peers, clients sending without pause; one router is
    killed (SIGKILL). No request fails: streams to the dead router fall
    open (Envoy's failure_mode_allow) until Envoy leaves it out (a failed
    connection, then its gRPC health). Then every request is decided by
    the survivor, which already holds the dead router's KV records.
    `INFERRAIL_FAILOVER_OUT=path` writes the figures as JSON."""
    fleet = fleet_factory(policy="cost_model", sim_flags=["--decode-token-ms", "2"], routers=2)
    prompts = system_prompts()
    stop, log, lock = [], [], threading.Lock()
    start = time.monotonic()

    def client(c):
        rng = random.Random(c)
        while not stop:
            # The engines' own name: a request that falls open reaches an engine as sent.
            body = {"model": MODEL, "max_tokens": 4, "messages": [
                {"role": "system", "content": prompts[rng.randrange(PROMPTS)]},
                {"role": "user", "content": f"Question {rng.randrange(10**6)}: why?"}]}
            r = http("POST", f"{fleet.url}/v1/chat/completions", body, timeout=60)
            usage = json.loads(r.body).get("usage", {}) if r.status == 200 else {}
            with lock:
                log.append((time.monotonic() - start, r.status, "x-inferrail-replica" in r.headers,
                            usage.get("prompt_tokens", 0), (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)))

    def decided_since(t):
        after = [decided for at, _, decided, _, _ in log if at > t]
        return len(after) >= 50 and all(after[-50:])

    n = int(os.environ.get("INFERRAIL_FAILOVER_CLIENTS", "4"))
    with ThreadPoolExecutor(n) as pool:
        clients = [pool.submit(client, c) for c in range(n)]
        wait_until(lambda: log and log[-1][0] > 3, "three seconds of requests before the kill", timeout=60)
        killed = time.monotonic() - start
        fleet.kill("inferrail-2")
        wait_until(lambda: decided_since(killed), "50 requests in a row decided by the survivor", timeout=60)
        wait_until(lambda: log[-1][0] > killed + 10, "ten seconds of requests after the kill", timeout=60)
        stop.append(True)
        for c in clients:
            c.result()
    statuses = sorted({status for _, status, _, _, _ in log})
    assert statuses == [200], f"every request served: {statuses}"
    # Envoy left the dead router out: its health or a failed connection.
    clusters = http("GET", f"http://127.0.0.1:{fleet.envoy_admin}/clusters").body.decode()
    dead = f"inferrail::127.0.0.1:{fleet.routers[1][0]}::health_flags::"
    assert re.search(rf"^{re.escape(dead)}.*failed_(active_hc|outlier_check)", clusters, re.M), "Envoy still offers the dead router"
    # The survivor decided 50 requests in a row after the kill (the wait above); the streams that fell open before:
    fell_open = [at for at, _, decided, _, _ in log if at > killed and not decided]
    last_open = max(fell_open, default=killed)
    window = [(p, c) for at, _, _, p, c in log if killed < at <= killed + 10]
    before = [(p, c) for at, _, _, p, c in log if at <= killed]
    share = lambda rows: sum(c for _, c in rows) / max(1, sum(p for p, _ in rows))
    figures = {
        "requests": len(log), "failed": 0, "after_kill_fell_open": len(fell_open),
        "ms_from_kill_to_last_fell_open": round((last_open - killed) * 1e3),
        "cached_share_before_kill": round(share(before), 4), "cached_share_10s_after_kill": round(share(window), 4),
        "rate_rps": round(len(log) / log[-1][0], 1),
    }
    print(figures)
    out = os.environ.get("INFERRAIL_FAILOVER_OUT")
    if out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        result = {"benchmark": "router-failover", "commit": commit,
                  "setup": "3 inferrail-sim (--decode-token-ms 2), Envoy (envoy/local.yaml's inferrail cluster: gRPC health every 0.5 s, "
                           f"outlier detection on local-origin failures), two inferrail {TARGET.name} builds with peers, cost_model; {n} closed-loop "
                           f"clients, {PROMPTS} system prompts; router 2 killed with SIGKILL after 3 s of load (cold caches), 10 s more after it",
                  "command": f"INFERRAIL_PROFILE={TARGET.name} INFERRAIL_FAILOVER_CLIENTS={n} INFERRAIL_FAILOVER_OUT={out} .venv/bin/pytest -q crates/inferrail/tests/e2e/test_two_routers.py -k killed",
                  **figures}
        (ROOT / out).parent.mkdir(parents=True, exist_ok=True)
        (ROOT / out).write_text(json.dumps(result, indent=1) + "\n")
    fleet.stop()
