"""Draining a replica through a real Envoy, by the admin gRPC `Drain` call
(real grpcurl, server reflection): it finishes the stream it has, gets no
new request, shows as draining in `Replicas` and the metrics, and takes
requests again once resumed."""
import http.client as httpc
import json

from conftest import http, wait_until
from test_explain import SERVICE, grpcurl


def drain(fleet, replica, draining=True):
    code, out = grpcurl(fleet, f"{SERVICE}/Drain", data={"id": replica, "draining": draining})
    assert code == 0, out
    return json.loads(out)


def test_a_drained_replica_finishes_its_stream_and_gets_no_new_request(fleet_factory):
    fleet = fleet_factory(policy="round_robin", sim_flags=["--decode-token-ms", "10"])
    c = httpc.HTTPConnection("127.0.0.1", fleet.listen, timeout=30)
    c.request("POST", "/v1/completions", body=json.dumps({"model": "sim", "prompt": "x", "max_tokens": 100, "stream": True}),
              headers={"content-type": "application/json"})
    streaming = c.getresponse()
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
