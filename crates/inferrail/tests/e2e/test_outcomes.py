"""How the router learns what happened upstream (ADR 0035): the route
stream carries the response's status; the first body byte comes from
Envoy's access log (`envoy/local.yaml`) or, where no access log can be
added, from the observe filter (`envoy/filters/observe.yaml`). Either way
the time to first byte the router records is the first byte's, not the
end's, and every request is counted once, answered, with no record taken
back."""

import re
import time

from conftest import observe_filter, wait_until

STREAMS = 4
TOKENS = 40


def total(fleet, name):
    """A metric summed over its labels."""
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", fleet.metrics(), re.M))


def ttft_and_counts(fleet):
    """The router's TTFT sum and count, requests counted, and access-log records."""
    return tuple(total(fleet, name) for name in ("inferrail_ttft_seconds_sum", "inferrail_ttft_seconds_count",
                                                  "inferrail_requests_total", "inferrail_access_log_records_total"))


def stream_and_measure(fleet):
    """Streams completions of TOKENS tokens one at a time; returns their
    mean duration, client-side, and what the router recorded meanwhile."""
    # The fleet's start-up requests are counted first (their first bytes come later, in the log).
    wait_until(lambda: total(fleet, "inferrail_requests_total") == total(fleet, "inferrail_decisions_total"), "the earlier requests counted")
    before = ttft_and_counts(fleet)
    durations = []
    for _ in range(STREAMS):
        started = time.monotonic()
        response = fleet.open_stream(max_tokens=TOKENS)
        assert response.status == 200
        body = response.read()
        durations.append(time.monotonic() - started)
        assert body.rstrip().endswith(b"data: [DONE]")
    wait_until(lambda: ttft_and_counts(fleet)[2] - before[2] >= STREAMS, "every stream's outcome counted")
    after = ttft_and_counts(fleet)
    ttft_sum, ttft_count, counted, records = (a - b for a, b in zip(after, before))
    return sum(durations) / STREAMS, ttft_sum, ttft_count, counted, records


def check(fleet, records_expected):
    mean_duration, ttft_sum, ttft_count, counted, records = stream_and_measure(fleet)
    assert counted == STREAMS, f"{counted} of {STREAMS} requests counted"
    assert not re.search(r'^inferrail_requests_total\{[^}]*outcome="(no_response|expired|5xx|4xx)"\}', fleet.metrics(), re.M)
    assert ttft_count == STREAMS, f"{ttft_count} first bytes heard of {STREAMS}"
    # The simulator streams TOKENS tokens after its prefill: the end comes
    # many times later than the first byte (a first byte heard at the end
    # would make the mean TTFT about the mean duration).
    assert 0 < ttft_sum / ttft_count < mean_duration / 4, (ttft_sum / ttft_count, mean_duration)
    assert records == records_expected, f"{records} access-log records"
    assert fleet.metric("inferrail_kv_take_backs_total") in (None, 0.0), "a request that succeeded was taken back"


def test_the_access_log_tells_the_first_byte_and_the_route_stream_the_status(fleet_factory):
    check(fleet_factory(policy="cost_model"), STREAMS)


def test_the_observe_filter_tells_them_where_no_access_log_is_added(fleet_factory):
    check(fleet_factory(policy="cost_model", envoy_edit=observe_filter), 0)


def test_the_route_stream_holds_the_request_until_its_response_ends(fleet_factory):
    # Envoy closes an ext_proc stream after the last answer it expects; with
    # the response's headers sent and its body not, a future Envoy could
    # count the headers' answer as the last and end the request at its
    # headers. Half-way through a 100-token stream (the simulator's default
    # latency) the request still holds its slot, and gives it back after.
    fleet = fleet_factory(policy="cost_model")
    in_flight = lambda: sum(float(v) for v in re.findall(r"^inferrail_replica_in_flight\{[^}]*\} (\S+)$", fleet.metrics(), re.M))
    response = fleet.open_stream(max_tokens=100)
    events = 0
    while events < 50:
        events += response.readline().startswith(b"data: ")
    # The gauge is refreshed every probe (100 ms here): a slot given back at
    # the headers, half a stream ago, would read 0 by now.
    assert in_flight() == 1
    assert response.read().rstrip().endswith(b"data: [DONE]")
    wait_until(lambda: in_flight() == 0, "the slot given back at the end")
