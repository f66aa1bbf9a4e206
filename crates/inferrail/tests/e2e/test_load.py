"""Engine load through the inferrail-scraper sidecar: the router follows its
gRPC stream of load reports, uses them while they are fresh, falls back to
its own counters (and counts it) when the sidecar dies, and picks the stream
up again when the sidecar comes back on the same address."""
import json
import re

from conftest import TARGET, http, wait_until
from harness import Process, free_ports


def ages(fleet):
    """Each replica's engine report age in seconds, as the router publishes it."""
    text = fleet.metrics()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r'^inferrail_engine_report_age_seconds\{replica="([^"]+)"\} (\S+)$', text, re.M)}


def stale(fleet):
    return fleet.metric("inferrail_stale_reports_total", 'policy="cost_model"') or 0.0


def test_the_router_follows_the_sidecar_falls_back_when_it_dies_and_resumes(fleet_factory, tmp_path):
    (port,) = free_ports(1)
    fleet = fleet_factory(policy="cost_model", config_extra=f"load: {{sidecar: http://127.0.0.1:{port}}}\n")
    scraper_cmd = [TARGET / "inferrail-scraper", "--config", fleet.config, "--listen", f"127.0.0.1:{port}"]
    scraper = Process("inferrail-scraper", scraper_cmd, tmp_path / "scraper.log")
    fresh = lambda: len(ages(fleet)) == 3 and max(ages(fleet).values()) < 0.25  # noqa: E731
    try:
        scraper.wait_until(fresh, "fresh reports of all three replicas at the router")
        before = stale(fleet)
        for _ in range(5):
            assert fleet.chat().status == 200
        # Decided on the reports while they come (a report may age past 250 ms
        # between two reads on a busy machine, so not every one need be fresh).
        assert stale(fleet) - before < 15
        scraper.stop()
        wait_until(lambda: min(ages(fleet).values()) > 0.3, "the reports to go stale")
        before = stale(fleet)
        for _ in range(5):
            assert fleet.chat().status == 200, "a dead sidecar costs no request"
        assert stale(fleet) - before == 15, "every decision counts its three stale reports"
        scraper = Process("inferrail-scraper", scraper_cmd, tmp_path / "scraper2.log")
        scraper.wait_until(fresh, "fresh reports again after the sidecar restarted")
    finally:
        scraper.stop()


def test_the_embedded_scraper_keeps_reports_fresh_and_learns_the_cache_shape(fleet_factory):
    fleet = fleet_factory(policy="cost_model", sim_flags=["--block-size", "32", "--num-gpu-blocks-override", "1024"])
    wait_until(lambda: len(ages(fleet)) == 3 and max(ages(fleet).values()) < 0.25, "fresh reports of all three replicas")
    # No block size configured: the router's default is 16, the engines' 32.
    # A prompt whose last full 32-token block ends 16 or more tokens early
    # is predicted right only with the learned size.
    for words in range(100, 140):
        body = {"model": "sim", "max_tokens": 1, "prompt": " ".join(f"w{i}" for i in range(words))}
        first = http("POST", f"{fleet.url}/v1/completions", body)
        assert first.status == 200
        n = int(first.headers["x-inferrail-prompt-tokens"])
        if (n - 1) % 32 >= 16:
            break
    second = http("POST", f"{fleet.url}/v1/completions", body)
    assert second.status == 200
    engine = json.loads(second.body)["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert engine == (n - 1) // 32 * 32 > 0
    assert int(second.headers["x-inferrail-cached-tokens"]) == engine
