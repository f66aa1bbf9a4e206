"""Draining a replica through a real Envoy, by the admin gRPC `Drain` call
(real grpcurl, server reflection): it finishes the stream it has, gets no
new request, shows as draining in `Replicas` and the metrics, and takes
requests again once resumed."""
import json
import re

from conftest import MODEL, ROOT, http, wait_until
from test_explain import SERVICE, grpcurl


def drain(fleet, replica, draining=True):
    code, out = grpcurl(fleet, f"{SERVICE}/Drain", data={"id": replica, "draining": draining})
    assert code == 0, out
    return json.loads(out)


def test_a_drained_replica_finishes_its_stream_and_gets_no_new_request(fleet_factory):
    fleet = fleet_factory(policy="round_robin", sim_flags=["--decode-token-ms", "10"])
    streaming = fleet.open_stream()
    replica = streaming.getheader("x-inferrail-replica")
    shown = drain(fleet, replica)
    assert shown["draining"] and shown["inFlight"] == 1, shown
    served = [fleet.chat().headers.get("x-inferrail-replica") for _ in range(30)]
    assert replica not in served and len(set(served)) == 2, served
    body = streaming.read().decode()
    assert body.endswith("data: [DONE]\n\n") and body.count("data: ") == 101, "its stream finished whole"
    wait_until(lambda: drain(fleet, replica)["inFlight"] == 0, "the drained replica to be empty")
    assert fleet.metric("inferrail_replica_draining", f'replica="{replica}"') == 1
    assert not drain(fleet, replica, draining=False)["draining"]
    served = [fleet.chat().headers.get("x-inferrail-replica") for _ in range(6)]
    assert replica in served, served
    code, out = grpcurl(fleet, f"{SERVICE}/Drain", data={"id": "nope", "draining": True})
    assert code != 0 and "NotFound" in out and "no replica `nope`" in out, out


def eds_cluster(path):
    """An edit of the bootstrap: the replica cluster's endpoints from the router's EDS file, as envoy/filters/replicas-eds.yaml says."""
    snippet = [line for line in (ROOT / "envoy" / "filters" / "replicas-eds.yaml").read_text().splitlines() if not line.startswith("#")]
    lines = "\n".join("    " + line for line in snippet).replace("/run/inferrail/replicas.json", str(path)) + "\n"

    def edit(envoy):
        head, cluster = envoy.split("\n  - name: replicas\n")
        cluster = cluster.replace("    type: STATIC\n", lines, 1)
        cluster, n = re.subn(r"    load_assignment:\n      cluster_name: replicas\n.*", "", cluster, flags=re.S)
        assert n == 1, "the replica cluster's static endpoints should close envoy/local.yaml"
        return head + "\n  - name: replicas\n" + cluster

    return edit


def served_by_sims(fleet):
    def count(i):
        page = http("GET", fleet.sim_url(i) + "/metrics").body.decode()
        return sum(float(line.split()[-1]) for line in page.splitlines() if line.startswith("vllm:request_success_total"))

    return [count(i) for i in range(3)]


def with_the_router_down(fleet, n=9):
    """Kills the router, sends `n` requests through Envoy, which serves them
    by its own balancing (failure_mode_allow), and starts the router again;
    returns how many each simulator served."""
    before = served_by_sims(fleet)
    fleet.kill("inferrail")
    responses = [fleet.chat(model=MODEL) for _ in range(n)]  # no router to rewrite an alias
    assert [r.status for r in responses] == [200] * n
    assert not any(r.headers.get("x-inferrail-replica") for r in responses), "the router decided none of them"
    after = served_by_sims(fleet)
    fleet.start_router()
    return [a - b for a, b in zip(after, before)]


def test_with_the_eds_file_envoy_skips_a_drained_replica_even_with_the_router_down(fleet_factory, tmp_path):
    path = tmp_path / "replicas.json"
    fleet = fleet_factory(policy="round_robin", config_extra=f"eds: {{path: '{path}'}}\n", envoy_edit=eds_cluster(path))
    # Envoy knows the replicas only from the file; with nothing drained its own balancing reaches all three.
    spread = with_the_router_down(fleet)
    assert all(s > 0 for s in spread) and sum(spread) == 9, spread
    drain(fleet, "sim-2")
    clusters = lambda: http("GET", f"http://127.0.0.1:{fleet.envoy_admin}/clusters").body.decode()  # noqa: E731
    flags = f"replicas::127.0.0.1:{fleet.sim_ports[1]}::health_flags::"
    wait_until(lambda: f"{flags}/eds_status_draining" in clusters(), "Envoy to see sim-2 draining")
    # The router is gone; the file it left still stands: none of the nine goes to sim-2.
    spread = with_the_router_down(fleet)
    assert spread[1] == 0 and sum(spread) == 9, spread
    # The new router, which was told of no drain, says so: sim-2 serves again.
    wait_until(lambda: f"{flags}healthy" in clusters(), "Envoy to see sim-2 healthy again")
