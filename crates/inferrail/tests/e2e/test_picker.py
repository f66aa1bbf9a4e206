"""Inferrail as an Inference Extension gateway's endpoint picker, through a
real Envoy whose ext_proc filter is written as the gateway writes it: one
FULL_DUPLEX_STREAMED stream a request, bodies both ways, headers and
trailers sent, fail-closed, a long message timeout, `envoy.lb` received and
forwarded.

The settings are Istio's for an InferencePool: the listener's ext_proc
placeholder in `pilot/pkg/xds/filters/filters.go`, with the per-route
override that `pilot/pkg/networking/core/route/route.go` writes (full-duplex
bodies, SEND headers and trailers, message_timeout 1000s; failure_mode_allow
true only for a FailOpen pool). Here they sit on the filter itself, which is
the same configuration for every route. The replica cluster is the
override-host one of envoy/local.yaml, reading `envoy.lb`, as Istio's is.

Envoy AI Gateway's InferencePool support
(`internal/extensionserver/inferencepool.go`) writes the same modes with
message_timeout 300s, fail-closed, and no metadata options, so the
`envoy.lb` metadata never arrives: it routes with an ORIGINAL_DST cluster
that reads the `x-gateway-destination-endpoint` header. That cluster takes
one `ip:port`: with a fallback in the header (`a,b`) Envoy answered 503 ("no
original_dst") to every request, measured here. Behind it Inferrail runs
with `retry: {fallbacks: 0}`.

kgateway's endpoint-picker plugin
(`internal/kgateway/extensions2/plugins/inferenceextension/endpointpicker/plugin.go`)
writes the same modes with message_timeout 5s, fail-closed, `envoy.lb`
received and `envoy.lb.subset_hint` forwarded. It reaches the picker over
TLS, which Inferrail does not serve yet: only its filter's settings are
tested here, on a plaintext ext_proc cluster.
"""
import http.client as httpc
import json

import pytest

from conftest import http, wait_until
from test_cache_routing import make, run

ISTIO = """\
          - name: inferrail.picker
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service: {envoy_grpc: {cluster_name: inferrail}}
              failure_mode_allow: false
              message_timeout: 1000s
              processing_mode:
                request_header_mode: SEND
                response_header_mode: SEND
                request_body_mode: FULL_DUPLEX_STREAMED
                response_body_mode: FULL_DUPLEX_STREAMED
                request_trailer_mode: SEND
                response_trailer_mode: SEND
              metadata_options:
                receiving_namespaces: {untyped: [envoy.lb]}
                forwarding_namespaces: {untyped: [envoy.lb]}
"""

AI_GATEWAY = ISTIO.replace("message_timeout: 1000s", "message_timeout: 300s").split("              metadata_options:")[0]


def original_dst(envoy):
    """The route goes to an ORIGINAL_DST cluster keyed on the destination header, as AI Gateway's does."""
    envoy = envoy.replace("cluster: replicas", "cluster: original_dst", 1)
    return envoy.replace("  clusters:\n", """  clusters:
  - name: original_dst
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 0.5s
    original_dst_lb_config: {use_http_header: true, http_header_name: x-gateway-destination-endpoint}
""", 1)


KGATEWAY = ISTIO.replace("message_timeout: 1000s", "message_timeout: 5s").replace(
    "forwarding_namespaces: {untyped: [envoy.lb]}", "forwarding_namespaces: {untyped: [envoy.lb.subset_hint]}")

GATEWAYS = {
    "own": {},
    "istio": {"filters": ISTIO},
    "envoy-ai-gateway": {"filters": AI_GATEWAY, "envoy_edit": original_dst, "config_extra": "retry: {fallbacks: 0}\n"},
    "kgateway": {"filters": KGATEWAY},
}


def outcomes(fleet, outcome):
    """inferrail_requests_total over every model and replica, for one outcome."""
    lines = [line for line in fleet.metrics().splitlines() if line.startswith("inferrail_requests_total{") and f'outcome="{outcome}"' in line]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def test_as_each_gateways_picker_cost_model_keeps_the_shared_prompts_cached_as_with_its_own_filters(fleet_factory):
    shares = {}
    for name, gateway in GATEWAYS.items():
        fleet = make(fleet_factory, "cost_model", **gateway)
        before = outcomes(fleet, "ok")
        shares[name], _ = run(fleet)
        if name != "own":
            # Every request's status, first byte and end came on its one stream: counted as served, nothing held.
            wait_until(lambda: outcomes(fleet, "ok") == before + 120, "every request counted once as served")
            assert fleet.metric("inferrail_leases") == 0
            assert fleet.envoy_stat("failure_mode_allowed") == 0
        fleet.stop()
    for name in ["istio", "envoy-ai-gateway", "kgateway"]:
        assert shares[name] >= 0.80, shares
        assert abs(shares[name] - shares["own"]) <= 0.02, shares


def test_as_a_gateways_picker_bodies_pass_unchanged_both_ways(fleet_factory):
    fleet = make(fleet_factory, "cost_model", filters=ISTIO)
    before = outcomes(fleet, "ok")
    # A body over three of the 62,000-byte chunks it goes back to Envoy in: any byte lost or moved breaks the JSON.
    body = b'{"model": "sim", "max_tokens": 3, "messages": [{"role": "user", "content": "Hello there"}]' + b" " * 200_000 + b"}"
    r = http("POST", f"{fleet.url}/v1/chat/completions", body)
    assert r.status == 200, r.body[:300]
    assert json.loads(r.body)["usage"]["completion_tokens"] == 3
    # A stream, token by token: every chunk reaches the client, the usage chunk and [DONE] last.
    r = fleet.chat(max_tokens=5, stream=True, stream_options={"include_usage": True})
    assert r.status == 200, r.body[:300]
    events = [line.removeprefix("data: ") for line in r.body.decode().split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0].get("delta", {}).get("content")) == 5
    # The router answers what it refuses, in the OpenAI error shape, on the same stream.
    r = http("POST", f"{fleet.url}/v1/chat/completions", {"model": "huge", "messages": []})
    assert r.status == 404 and json.loads(r.body)["error"]["type"] == "NotFoundError", r.body
    wait_until(lambda: outcomes(fleet, "ok") == before + 2, "both served requests counted")
    assert fleet.metric("inferrail_leases") == 0


def sim_prompt_tokens(fleet):
    """Prompt tokens the engines have taken in, all three together."""
    pages = [http("GET", fleet.sim_url(i) + "/metrics").body.decode() for i in range(3)]
    return sum(float(line.split()[-1]) for page in pages for line in page.splitlines() if line.startswith("vllm:prompt_tokens_total"))


def test_as_a_gateways_picker_a_router_killed_mid_body_fails_the_request_but_never_forwards_a_piece(fleet_factory):
    # Fail-closed, and FailOpen too: Envoy fails a full-duplex stream closed once a body chunk went to the picker (ADR 0030).
    for filters in [ISTIO, ISTIO.replace("failure_mode_allow: false", "failure_mode_allow: true")]:
        fleet = make(fleet_factory, "cost_model", filters=filters)
        body = json.dumps({"model": "sim", "prompt": "".join(f"w{i:05d} " for i in range(600)), "max_tokens": 1}).encode()
        before = sim_prompt_tokens(fleet)
        c = fleet.send_part(body, 2000)
        fleet.kill("inferrail")
        wait_until(lambda: fleet.envoy_stat("streams_failed") > 0, "Envoy to see the picker gone")
        c.send(body[2000:])
        r = c.getresponse()
        assert r.status == 500, (r.status, r.read()[:200])
        assert sim_prompt_tokens(fleet) == before, "no engine got any of it"
        fleet.stop()


def test_as_a_gateways_picker_a_router_killed_mid_response_cuts_the_stream(fleet_factory):
    # Every response byte passes through the picker: its death ends the response where it was (ADR 0030).
    fleet = make(fleet_factory, "cost_model", latency=True, filters=ISTIO)
    r = fleet.open_stream(timeout=15)
    assert r.status == 200
    first = r.read1(100)
    fleet.kill("inferrail")
    with pytest.raises(httpc.IncompleteRead) as cut:
        r.read()
    assert b"[DONE]" not in first + cut.value.partial
