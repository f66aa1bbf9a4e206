"""Exact mode through a real Envoy: the simulators publish vLLM's KV events,
the router follows them (ADR 0012), and faults are injected on the way.

Every check of a prediction follows one rule: whenever the serving replica
was exact in the router before and after a request, the router's
x-inferrail-cached-tokens equals the engine's cached_tokens; a replica that
is not exact makes no such claim. Before each checked request the router has
applied every batch the engines sent (their `/_sim/kv_events` counters
against the router's `inferrail_kv_events_messages_total`): exact is a claim
about every message the router has had word of, so a request sent while an
engine's latest batch is one the fault dropped (no later batch has shown
the gap yet) is not checked on that engine. Each fault test proves its
fault fired (the simulator's `skipped`, the router's garbage and replay
counters) and that the mode fell back and came back as ADR 0012's table says.
"""
import json
import random
import signal
import socket

import pytest
import zmq

from conftest import ROOT, Fleet, http, wait_until

QWEN3 = ROOT / ".cache" / "tokenizers" / "qwen3"
WORDS = "river stone cloud lantern garden silver copper window mountain ocean forest delta".split()
TOPIC = b"kv-events"


def text(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def events_fleet(fleet_factory, blocks=64, **kv_events):
    flags = ["--zero-latency", "--block-size", "16", "--num-gpu-blocks-override", str(blocks), "--max-model-len", "1024"]
    f = fleet_factory(sim_flags=flags, replica_extra=f", block_size: 16, kv_blocks: {blocks}", kv_events=kv_events)
    f.until_exact()
    return f


class Checker:
    """Sends requests one at a time, each after the router caught up with the engines' events, and checks every exact claim."""

    def __init__(self, fleet, seed=3):
        self.fleet = fleet
        self.rng = random.Random(seed)
        self.systems = [text(self.rng, n) for n in (60, 150, 240)]
        # Messages a router counted before an engine's current process started.
        self.base = {(k, i): 0 for k in range(len(fleet.routers)) for i in range(3)}
        self.claimed = self.checked = 0

    def received(self, k, i):
        return self.fleet.metric("inferrail_kv_events_messages_total", f'replica="sim-{i + 1}"', router=k) or 0

    def caught_up(self):
        """Every batch each engine sent has been applied by every router, and no request is in flight in any."""
        # Engines that publish no events (approximate mode) count nothing.
        keys = ("published", "sent", "skipped", "dropped")
        counts = [{k: c.get(k, 0) for k in keys} for c in (self.fleet.sim_events(i) for i in range(3))]
        # The engines publish a step's batch before its tokens go out; all that was published has left.
        if any(c["published"] != c["sent"] + c["skipped"] + c["dropped"] for c in counts):
            return False
        sent = [c["sent"] for c in counts]
        if not all(self.received(k, i) - self.base[k, i] >= sent[i] for (k, i) in self.base):
            return False
        # Every request is over in every router: its claims ended before its slot was given back.
        return all(self.fleet.metric("inferrail_replica_in_flight", f'replica="sim-{i + 1}"', router=k) == 0 for (k, i) in self.base)

    def restart(self, i, sig, skip=None):
        """Stops engine i with `sig` and starts it again on the same ports
        (`--kv-events-skip` `skip`), then waits until the router hears of
        the restart through the engine's counters: until then a restarted
        engine is unknown (ADR 0012)."""
        self.fleet.kill(f"sim-{i + 1}", sig)
        self.fleet.kv_events["skip"] = {i: skip} if skip else {}
        # Its sent counter starts again.
        for k in range(len(self.fleet.routers)):
            self.base[k, i] = self.received(k, i)
        self.fleet.start_sim(i)
        wait_until(lambda: self.fleet.kv_mode(f"sim-{i + 1}") == "engine-restarted", f"sim-{i + 1} engine-restarted")

    def unheard(self, i):
        """Engine i's latest batch is one its `--kv-events-skip` (`seq:N,...`)
        dropped: no router has had word of it until the next batch shows the
        gap, so no claim about engine i can be checked now."""
        spec = (self.fleet.kv_events or {}).get("skip", {}).get(i, "")
        skipped = {int(s) for s in spec.removeprefix("seq:").split(",")} if spec.startswith("seq:") else set()
        return self.fleet.sim_events(i).get("published", 0) - 1 in skipped

    def send(self, n=1):
        """n requests; returns how many were checked as exact claims."""
        claimed = 0
        for _ in range(n):
            wait_until(self.caught_up, "the routers to apply every batch the engines sent")
            unheard = [self.unheard(i) for i in range(3)]
            before = [self.fleet.kv_modes(k) for k in range(len(self.fleet.routers))]
            body = {"model": "sim", "max_tokens": self.rng.randint(1, 12), "messages": [
                {"role": "system", "content": self.rng.choice(self.systems)},
                {"role": "user", "content": text(self.rng, self.rng.randint(3, 40))}]}
            r = http("POST", f"{self.fleet.url}/v1/chat/completions", body)
            assert r.status == 200, r.body[:300]
            cached = json.loads(r.body)["usage"]["prompt_tokens_details"]["cached_tokens"]
            i = int(r.headers["x-inferrail-replica"].removeprefix("sim-")) - 1
            after = [self.fleet.kv_modes(k) for k in range(len(self.fleet.routers))]
            self.checked += 1
            # With several routers the one that decided is unknown: it must hold for each that says exact.
            if not unheard[i] and all(b[i] == "exact" and a[i] == "exact" for b, a in zip(before, after)):
                assert r.headers.get("x-inferrail-cached-tokens") == str(cached), (r.headers, cached, before, after)
                claimed += 1
        self.claimed += claimed
        return claimed

    def until(self, check, what, most=80):
        """Sends requests until `check` holds (at most `most`)."""
        for _ in range(most):
            if check():
                return
            self.send()
        assert check(), f"{what} after {most} requests"


def test_a_batch_skipped_is_replayed_and_a_killed_engine_is_exact_again_from_its_sequence_0(fleet_factory):
    fleet = events_fleet(fleet_factory, replay=True, skip={0: "seq:10,11"})
    c = Checker(fleet)
    c.until(lambda: fleet.sim_events(0)["skipped"] == 2 and fleet.sim_events(0)["sent"] >= 11, "sim-1 skipped two batches and sent the next")
    assert c.send(12) == 12, "the replayed gap keeps every replica exact"
    assert fleet.metric("inferrail_kv_events_replays_total", 'replica="sim-1",result="answered"') >= 1
    assert fleet.kv_modes() == ["exact"] * 3

    # Killed and started again on the same ports: the scraper sees its counters go back, then its sequence 0 makes it exact.
    c.restart(0, signal.SIGKILL)
    c.until(lambda: fleet.kv_mode("sim-1") == "exact", "sim-1 exact again")
    assert fleet.sim_events(0)["sent"] >= 1
    c.send(12)
    assert fleet.kv_modes() == ["exact"] * 3 and c.claimed >= c.checked - 8, (c.claimed, c.checked)


def test_without_a_replay_a_gap_falls_back_until_a_reset_or_an_engine_restart(fleet_factory):
    fleet = events_fleet(fleet_factory, replay=False, skip={0: "seq:10"})
    c = Checker(fleet)
    c.until(lambda: fleet.sim_events(0)["skipped"] == 1 and fleet.sim_events(0)["sent"] >= 11, "sim-1 skipped a batch")
    wait_until(lambda: fleet.kv_mode("sim-1") == "sequence-gap", "sim-1 sequence-gap")
    c.send(9)
    assert fleet.kv_mode("sim-1") == "sequence-gap", "only a moment the cache is known empty makes it exact again"

    # A reset: its AllBlocksCleared leads sim-1's next batch.
    assert http("POST", f"{fleet.sim_url(0)}/reset_prefix_cache").status == 200
    c.until(lambda: fleet.kv_mode("sim-1") == "exact", "sim-1 exact after the reset")
    c.send(9)

    # Lose another, then restart the engine: its sequence 0 makes it exact.
    c.restart(0, signal.SIGTERM, skip="seq:3")
    c.until(lambda: fleet.kv_mode("sim-1") == "sequence-gap", "sim-1 sequence-gap again")
    c.restart(0, signal.SIGKILL)
    c.until(lambda: fleet.kv_mode("sim-1") == "exact", "sim-1 exact from the new engine's sequence 0")
    c.send(9)
    assert fleet.kv_modes() == ["exact"] * 3


def test_garbage_frames_are_counted_and_a_readable_sequence_ends_the_exact_claim(fleet_factory):
    fleet = events_fleet(fleet_factory, replay=True)
    c = Checker(fleet)
    c.send(6)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    try:
        # The router binds sim-1's endpoint; anyone may connect to it, as the engine does.
        pub.connect(f"tcp://127.0.0.1:{fleet.event_ports[0]}")

        def sent_until(frames, check, what):
            def attempt():
                pub.send_multipart(frames)
                return check()
            wait_until(attempt, what)

        garbage = lambda: fleet.metric("inferrail_kv_events_garbage_total", 'replica="sim-1"') or 0
        # No readable sequence number: counted, and it proves no loss.
        sent_until([TOPIC, b"seq?", b"\xc1 not msgpack"], lambda: garbage() >= 1, "a garbage frame counted")
        assert fleet.kv_mode("sim-1") == "exact"
        c.send(6)
        # A readable sequence at or past the expected one: a message may be lost, the replica is not claimed exact.
        seen = garbage()
        sent_until([TOPIC, (1 << 40).to_bytes(8, "big"), b"\xc1 not msgpack"], lambda: garbage() > seen, "a garbage frame with a sequence")
        wait_until(lambda: fleet.kv_mode("sim-1") == "garbage-frames", "sim-1 garbage-frames")
        c.send(6)
        assert fleet.kv_mode("sim-1") == "garbage-frames"
    finally:
        pub.close(linger=0)
        ctx.term()
    assert http("POST", f"{fleet.sim_url(0)}/reset_prefix_cache").status == 200
    c.until(lambda: fleet.kv_mode("sim-1") == "exact", "sim-1 exact after the reset")
    c.send(6)
    assert fleet.kv_modes() == ["exact"] * 3


def test_a_replay_endpoint_that_does_not_answer_leaves_the_gap_approximate(fleet_factory):
    # sim-1's replay endpoint is a port nobody listens on; sim-2's a socket that accepts and never answers.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    nobody = socket.socket()
    nobody.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    try:
        replay = {0: f"tcp://127.0.0.1:{nobody.getsockname()[1]}", 1: f"tcp://127.0.0.1:{silent.getsockname()[1]}"}
        fleet = events_fleet(fleet_factory, replay=replay, skip={0: "seq:8", 1: "seq:8"}, template="replay_timeout_ms: 300")
        c = Checker(fleet)
        c.until(lambda: all(fleet.sim_events(i)["skipped"] == 1 and fleet.sim_events(i)["sent"] >= 9 for i in (0, 1)),
                "sim-1 and sim-2 skipped a batch")
        wait_until(lambda: fleet.kv_modes()[:2] == ["sequence-gap"] * 2, "sim-1 and sim-2 sequence-gap")
        for i in (0, 1):
            assert fleet.metric("inferrail_kv_events_replays_total", f'replica="sim-{i + 1}",result="failed"') >= 1
        c.send(9)
        assert fleet.kv_modes() == ["sequence-gap", "sequence-gap", "exact"]
    finally:
        silent.close()
        nobody.close()


def test_after_concurrent_bursts_every_exact_claim_holds(fleet_factory):
    """16 users at once on 64-block caches (admission order, preemption and
    eviction under pressure), then requests one at a time, each checked by
    the rule. During a burst a request's cached tokens are what the engine
    holds when it admits it, later than the decision: no index predicts
    those exactly, approximate or exact (bench/results/prediction/accuracy.md).
    Two users computing the same prefix in one step each cache a copy, as
    vLLM does, so no block is removed while blocks after it are held: the
    replicas stay exact throughout."""
    assert (QWEN3 / "tokenizer.json").is_file(), "run `just setup` for the tokenizer files"
    import sys
    from concurrent.futures import ThreadPoolExecutor

    sys.path.insert(0, str(ROOT / "bench"))
    from prediction_accuracy import user

    fleet = fleet_factory(tokenizer=QWEN3, sim_flags=["--block-size", "16", "--num-gpu-blocks-override", "64", "--max-model-len", "1024"],
                          replica_extra=", block_size: 16, kv_blocks: 64", kv_events={"bind": "router", "replay": True})
    fleet.until_exact()
    rng = random.Random(11)
    systems = [text(rng, n) for n in (60, 150, 240)]
    c = Checker(fleet)
    c.systems = systems
    for burst in range(3):
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda u: user(fleet, 1000 * burst + u, 4, systems), range(16)))
        c.send(20)
    assert fleet.kv_modes() == ["exact"] * 3
    assert c.claimed == c.checked == 60
    for i in range(3):
        assert fleet.metric("inferrail_kv_events_messages_total", f'replica="sim-{i + 1}"') > 0
