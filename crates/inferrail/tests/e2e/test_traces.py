"""OpenTelemetry traces through a real Envoy: the router exports a span per
decision over OTLP/HTTP to a receiver run by the test, continuing the
client's `traceparent`, and the engine (a small recording server standing in
for each replica) receives the decision span's `traceparent`. A dead
collector costs no request."""
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import MODEL, Fleet, free_ports, wait_until

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


def serve(handler):
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def quiet(cls):
    cls.log_message = lambda *a: None
    return cls


class Collector:
    """An OTLP/HTTP receiver: keeps every POST /v1/traces body."""

    def __init__(self):
        self.bodies = []
        outer = self

        @quiet
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.path == "/v1/traces" and self.headers.get("content-type") == "application/x-protobuf":
                    outer.bodies.append(body)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

        self.server = serve(Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def spans(self):
        return [s for body in list(self.bodies) for s in otlp_spans(body)]


def fields(buf):
    """A protobuf message's fields as (number, value): bytes for length-delimited, int otherwise."""
    i = 0
    while i < len(buf):
        key, i = varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = varint(buf, i)
        elif wire == 1:
            value, i = int.from_bytes(buf[i:i + 8], "little"), i + 8
        elif wire == 5:
            value, i = int.from_bytes(buf[i:i + 4], "little"), i + 4
        elif wire == 2:
            n, i = varint(buf, i)
            value, i = buf[i:i + n], i + n
        else:
            raise ValueError(f"wire type {wire}")
        yield number, value


def varint(buf, i):
    shift = value = 0
    while True:
        b = buf[i]
        value |= (b & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if b < 0x80:
            return value, i


def otlp_spans(body):
    """Spans of an ExportTraceServiceRequest (resource_spans=1 > scope_spans=2 > spans=2):
    trace id, span id, parent span id (hex) and name."""
    spans = []
    for n, resource_spans in fields(body):
        for m, scope_spans in fields(resource_spans) if n == 1 else []:
            for k, span in fields(scope_spans) if m == 2 else []:
                if k == 2:
                    f = dict(fields(span))
                    spans.append({"trace_id": f.get(1, b"").hex(), "span_id": f.get(2, b"").hex(),
                                  "parent_span_id": f.get(4, b"").hex(), "name": f.get(5, b"").decode()})
    return spans


class EngineFleet(Fleet):
    """The fleet with each replica a small server that records the headers of every generation request."""

    def start_sim(self, i):
        self.seen = getattr(self, "seen", [])
        self.servers = getattr(self, "servers", [])
        seen = self.seen

        @quiet
        class Engine(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def answer(self, status, body, content_type="application/json"):
                data = body.encode()
                self.send_response(status)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    self.answer(200, json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": 4096}]}))
                elif self.path == "/health":
                    self.answer(200, "")
                else:
                    self.answer(404, "")

            def do_POST(self):
                self.rfile.read(int(self.headers.get("content-length", 0)))
                seen.append({k.lower(): v for k, v in self.headers.items()})
                self.answer(200, json.dumps({
                    "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": MODEL,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}))

        server = ThreadingHTTPServer(("127.0.0.1", self.sim_ports[i]), Engine)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self.servers.append(server)

    def stop(self):
        super().stop()
        for s in getattr(self, "servers", []):
            s.shutdown()
            s.server_close()


@pytest.fixture
def fleet_with(tmp_path, monkeypatch):
    # Batches every 100 ms, so spans arrive while the test waits.
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    fleets = []

    def make(endpoint):
        f = EngineFleet(tmp_path / f"fleet{len(fleets)}", config_extra=f"observability: {{otlp_endpoint: '{endpoint}'}}\n")
        fleets.append(f)
        return f.start()

    yield make
    for f in fleets:
        f.stop()


def test_the_decision_span_continues_the_clients_trace_and_the_engine_continues_the_decision(fleet_with):
    collector = Collector()
    fleet = fleet_with(collector.endpoint)
    fleet.seen.clear()
    r = fleet.chat(headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    assert r.status == 200, r.body
    engine = [h for h in fleet.seen if h.get("traceparent", "").startswith(f"00-{CLIENT_TRACE}-")]
    assert len(engine) == 1, fleet.seen
    version, trace, decision_span, flags = engine[0]["traceparent"].split("-")
    assert (trace, flags) == (CLIENT_TRACE, "01") and decision_span != CLIENT_SPAN and len(decision_span) == 16

    # A request without traceparent: the decision starts a trace, and the engine continues it.
    assert fleet.chat().status == 200
    _, new_trace, new_span, _ = fleet.seen[-1]["traceparent"].split("-")
    assert new_trace != CLIENT_TRACE

    def exported(trace_id):
        return [s for s in collector.spans() if s["trace_id"] == trace_id]

    wait_until(lambda: exported(CLIENT_TRACE) and exported(new_trace), "both decision spans at the collector", timeout=15)
    [span] = exported(CLIENT_TRACE)
    assert span == {"trace_id": CLIENT_TRACE, "span_id": decision_span, "parent_span_id": CLIENT_SPAN, "name": "inferrail.route"}
    [root] = exported(new_trace)
    assert (root["span_id"], root["parent_span_id"]) == (new_span, "")
    assert fleet.metric("inferrail_trace_spans_exported_total") >= 2


def test_a_dead_collector_costs_no_request_and_is_reported_once(fleet_with):
    [closed] = free_ports(1)
    fleet = fleet_with(f"http://127.0.0.1:{closed}")
    statuses = [fleet.chat(headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}).status for _ in range(50)]
    assert statuses == [200] * 50
    assert all(h["traceparent"].startswith(f"00-{CLIENT_TRACE}-") for h in fleet.seen[-50:])
    wait_until(lambda: (fleet.metric("inferrail_trace_export_errors_total") or 0) >= 2, "several failed exports", timeout=15)
    log = (fleet.tmp / "inferrail.log").read_text(errors="replace")
    assert log.count("exporting traces failed") == 1, log[-3000:]
