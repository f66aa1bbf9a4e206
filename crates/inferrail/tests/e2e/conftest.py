"""A real fleet for end-to-end tests: three inferrail-sim processes, the
inferrail binary and Envoy (from the project's .venv) running the shipped
envoy/local.yaml, all on free ports so tests never collide with `just up`.

With `kv_events` the simulators publish vLLM's KV events and the router
follows them (exact mode, ADR 0012); with `routers=2` two inferrail
processes share Envoy's ext_proc cluster (round robin), each following
every engine."""

import json
import http.client as httpc
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import ENVOY, ROOT, TARGET, free_ports, http, wait_until  # noqa: E402

MODEL = "inferrail/sim-8b"


def without_access_log(envoy):
    """`envoy/local.yaml`'s text without inferrail's access log."""
    envoy, n = re.subn(r"          # What happened upstream.*?(?=          route_config:)", "", envoy, flags=re.S)
    assert n == 1, "envoy/local.yaml's access log should stand before its route_config"
    return envoy


def observe_filter(envoy):
    """`envoy/local.yaml`'s text with the observe filter (`envoy/filters/observe.yaml`)
    in place of the access log, as a gateway that cannot add one runs it."""
    observe = (ROOT / "envoy" / "filters" / "observe.yaml").read_text()
    observe = "\n".join(" " * 10 + line for line in observe.splitlines() if not line.startswith("#")) + "\n"
    envoy, n = re.subn(r"(?=          - name: envoy\.filters\.http\.router)", lambda _: observe, without_access_log(envoy), count=1)
    assert n == 1, "envoy/local.yaml's filters should end with the router filter"
    return envoy


class Fleet:
    def __init__(self, tmp, policy="round_robin", sim_flags=(), config_extra="", tokenizer="builtin:sim", replica_extra="", routing="",
                 kv_events=None, routers=1, filters=None, envoy_edit=None, peers=True, max_body_bytes=1 << 20, roles=None,
                 health="probe_interval_ms: 100, probe_timeout_ms: 300", transfer=None, client_headers=None, sidecars=False,
                 adapters=(), module=False, module_env=None):
        """`kv_events`, to publish and follow KV events: a dict with `bind`
        ("router": the router binds and the engines connect, vLLM's way with
        an IP endpoint; "engine": the engines bind `tcp://*:port` and the
        routers connect, the way for several routers), `replay` (True: the
        engines serve replays and the routers ask them; False: no replay; an
        endpoint string: the routers ask there, the engines serve none; or
        a dict of these by sim index),
        `skip` ({sim index: `--kv-events-skip` value}) and `template` (more
        fields of the router's `kv_events`, YAML flow text). `filters`, YAML
        text of http filters that stand in for envoy/local.yaml's inferrail
        filter and its access log (as a gateway would write them); `envoy_edit`, a
        function that changes the rest of the bootstrap's text. With
        several `routers`, `peers` lists them to one another (ADR 0034).
        `roles`, each replica's role in disaggregated serving (`prefill`,
        `decode`, `both`), its simulator then started with NixlConnector's
        matching `kv_role` and the `transfer` fields (a dict) of its
        `--kv-transfer-config`. `health`, the router's `health` fields (YAML
        flow text). `client_headers`, sent with `chat()` (an engine's API key).
        With `sidecars`, an inferrail-sidecar stands in front of each
        simulator on the replica's address (the simulator moves to another
        port; `sim_url` still reaches it directly). `adapters`, LoRA adapter
        names the model lists (the simulators must serve them). With
        `module`, the router runs inside Envoy as its dynamic module
        (envoy/module.yaml, libinferrail_module.so), not as a process of its
        own; `module_env`, more of Envoy's environment (a failpoint)."""
        self.tmp = tmp
        tmp.mkdir(parents=True, exist_ok=True)
        self.procs = {}
        ports = free_ports(8 + 6 + 3 * (routers - 1))
        self.sim_ports = ports[:3]
        self.sidecars = sidecars
        self.inner_ports = free_ports(3) if sidecars else self.sim_ports
        self.sim_flags = ["--tokenizer", tokenizer, *sim_flags]
        self.grpc, self.admin, self.listen, self.envoy_admin, self.admin_grpc = ports[3:8]
        self.event_ports, self.replay_ports = ports[8:11], ports[11:14]
        # (ext_proc, admin HTTP, admin gRPC) of each router; the first is self.grpc, self.admin, self.admin_grpc.
        self.routers = [(self.grpc, self.admin, self.admin_grpc)] + [tuple(ports[14 + 3 * k:17 + 3 * k]) for k in range(routers - 1)]
        self.kv_events = kv_events
        self.roles = roles
        self.transfer = transfer or {}
        self.client_headers = client_headers or {}
        self.url = f"http://127.0.0.1:{self.listen}"
        role = lambda i: f", role: {roles[i]}" if roles else ""
        replicas = "\n".join(
            f"  - {{id: sim-{i + 1}, address: 127.0.0.1:{p}, models: [{MODEL}]{replica_extra}{role(i)}{self._replica_events(i)}}}"
            for i, p in enumerate(self.sim_ports))
        if kv_events is not None:
            config_extra += f"kv_events: {{{kv_events.get('template', '')}}}\n"
        self.peers = peers and routers > 1
        if self.peers:
            config_extra += f"peers: {{addresses: [{', '.join(f'127.0.0.1:{g}' for g, _, _ in self.routers)}], resolve_interval_ms: 100}}\n"
        self.configs = []
        for k, (grpc, admin, admin_grpc) in enumerate(self.routers):
            config = tmp / ("inferrail.yaml" if k == 0 else f"inferrail-{k + 1}.yaml")
            config.write_text(
                f"server: {{listen: 127.0.0.1:{grpc}, max_body_bytes: {max_body_bytes}, shutdown_grace_ms: 2000}}\n"
                f"admin: {{listen: 127.0.0.1:{admin}, grpc_listen: 127.0.0.1:{admin_grpc}}}\n"
                f"routing: {{seed: 7{routing}}}\n"
                f"health: {{{health}}}\n"
                f"{config_extra}"
                f"models:\n  - {{name: {MODEL}, aliases: [sim], adapters: [{', '.join(adapters)}], policy: {policy}, tokenizer: {tokenizer}}}\n"
                f"replicas:\n{replicas}\n")
            self.configs.append(config)
        self.config = self.configs[0]
        self.module, self.module_env = module, module_env or {}
        envoy = (ROOT / "envoy" / ("module.yaml" if module else "local.yaml")).read_text()
        ports = [(8080, self.listen), (9901, self.envoy_admin)] + ([] if module else [(9002, self.grpc)])
        for old, new in ports + list(zip((8001, 8002, 8003), self.sim_ports)):
            envoy, n = re.subn(rf"port_value: {old}\b", f"port_value: {new}", envoy)
            assert n == 1, f"the Envoy bootstrap should name port {old} once"
        if module:
            envoy, n = re.subn(r"value: envoy/local-inferrail\.yaml", f"value: {self.config}", envoy)
            assert n == 1, "envoy/module.yaml should name its routing file once"
        # Each router inside its own Envoy, with the module: (listen, admin) of the others.
        self.more_envoys = [tuple(free_ports(2)) for _ in range(routers - 1)] if module else []
        self.urls = [self.url] + [f"http://127.0.0.1:{listen}" for listen, _ in self.more_envoys]
        if filters is not None:
            envoy, n = re.subn(r"          # The decision.*?(?=          - name: envoy\.filters\.http\.router)", lambda _: filters, envoy,
                               flags=re.S)
            assert n == 1, "envoy/local.yaml's inferrail filters should stand before the router filter"
            envoy = without_access_log(envoy)
        if envoy_edit is not None:
            envoy = envoy_edit(envoy)
        if routers > 1 and not module:
            # The ext_proc cluster gets every router, stream by stream.
            one = f"{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {self.grpc}}}}}}}}}"
            assert envoy.count(one) == 1, "envoy/local.yaml's inferrail cluster should have one endpoint"
            envoy = envoy.replace(one, ", ".join(one.replace(str(self.grpc), str(g)) for g, _, _ in self.routers))
            # Each stream to a router drawn at random: with round robin, one client's requests alternate their route
            # and observe streams, so one router would decide them all.
            envoy, n = re.subn(r"(  - name: inferrail\n    type: STATIC\n)", r"\1    lb_policy: RANDOM\n", envoy)
            assert n == 1
        self.envoy_config = tmp / "envoy.yaml"
        self.envoy_config.write_text(envoy)
        for k, (listen, admin) in enumerate(self.more_envoys, start=1):
            more = envoy.replace(f"value: {self.config}", f"value: {self.configs[k]}")
            for old, new in [(self.listen, listen), (self.envoy_admin, admin)]:
                more, n = re.subn(rf"port_value: {old}\b", f"port_value: {new}", more)
                assert n == 1
            (tmp / f"envoy-{k + 1}.yaml").write_text(more)

    def _replica_events(self, i):
        """Replica i's own `kv_events` in the router's config: each engine has its own ports."""
        e = self.kv_events
        if e is None:
            return ""
        bind = e.get("bind", "router") == "router"
        fields = [f"endpoint: 'tcp://127.0.0.1:{self.event_ports[i]}'", f"bind: {str(bind).lower()}"]
        replay = self._replay(i)
        if replay is True:
            fields.append(f"replay_endpoint: 'tcp://127.0.0.1:{self.replay_ports[i]}'")
        elif replay:
            fields.append(f"replay_endpoint: '{replay}'")
        return f", kv_events: {{{', '.join(fields)}}}"

    def _replay(self, i):
        replay = self.kv_events.get("replay", True)
        return replay.get(i, True) if isinstance(replay, dict) else replay

    def _sim_events_flags(self, i):
        """The simulator's vLLM flag: it connects to a binding router, or binds for connecting routers."""
        e = self.kv_events
        if e is None:
            return []
        host = "127.0.0.1" if e.get("bind", "router") == "router" else "*"
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://{host}:{self.event_ports[i]}", "topic": "kv-events"}
        if self._replay(i) is True:
            config["replay_endpoint"] = f"tcp://*:{self.replay_ports[i]}"
        flags = ["--kv-events-config", json.dumps(config)]
        if i in e.get("skip", {}):
            flags += ["--kv-events-skip", e["skip"][i]]
        return flags

    def _sim_transfer_flags(self, i):
        """The simulator's NixlConnector, in the role its replica has."""
        if not self.roles:
            return []
        kv_role = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}[self.roles[i]]
        return ["--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": kv_role, **self.transfer})]

    def start_sim(self, i):
        port = self.inner_ports[i]
        self.procs[f"sim-{i + 1}"] = self._spawn(
            f"sim-{i + 1}", [TARGET / "inferrail-sim", "--port", str(port), "--served-model-name", MODEL, "sim", "--enable-prompt-tokens-details",
                             "--seed", str(i + 1), *self.sim_flags, *self._sim_events_flags(i), *self._sim_transfer_flags(i)])
        wait_until(lambda: http("GET", f"http://127.0.0.1:{port}/health").status == 200, f"sim-{i + 1}")
        if self.sidecars:
            front = self.sim_ports[i]
            self.procs[f"sidecar-{i + 1}"] = self._spawn(
                f"sidecar-{i + 1}", [TARGET / "inferrail-sidecar", "--listen", f"127.0.0.1:{front}", "--decoder", f"http://127.0.0.1:{port}"])
            wait_until(lambda: http("GET", f"http://127.0.0.1:{front}/health").status == 200, f"sidecar-{i + 1}")

    def start_router(self, k=0):
        name = "inferrail" if k == 0 else f"inferrail-{k + 1}"
        self.procs[name] = self._spawn(name, [TARGET / "inferrail", "--config", self.configs[k]])
        admin = self.routers[k][1]
        wait_until(lambda: http("GET", f"http://127.0.0.1:{admin}/readyz").status == 200, name)

    def start(self):
        for i in range(3):
            self.start_sim(i)
        if not self.module:
            for k in range(len(self.routers)):
                self.start_router(k)
            if self.peers:
                self.until_linked()
        env = {"ENVOY_DYNAMIC_MODULES_SEARCH_PATH": str(TARGET), **self.module_env} if self.module else None
        logs = ["--component-log-level", "dynamic_modules:info"] if self.module else []
        self.procs["envoy"] = self._spawn(
            "envoy", [ENVOY, "-c", self.envoy_config, "--disable-hot-restart", "--log-level", "warn", "--concurrency", "2", *logs], env)
        for k in range(1, len(self.more_envoys) + 1):
            self.procs[f"envoy-{k + 1}"] = self._spawn(
                f"envoy-{k + 1}", [ENVOY, "-c", self.tmp / f"envoy-{k + 1}.yaml", "--disable-hot-restart", "--log-level", "warn",
                                   "--concurrency", "2", "--base-id", str(k), *logs], env)
        if self.module:
            for _, admin, _ in self.routers:
                wait_until(lambda: http("GET", f"http://127.0.0.1:{admin}/readyz").status == 200, "the router inside Envoy")
            if self.peers:
                self.until_linked()
        try:
            wait_until(lambda: self.chat().status == 200, "a request through Envoy")
            for url in self.urls[1:]:
                body = {"model": "sim", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 2}
                wait_until(lambda: http("POST", f"{url}/v1/chat/completions", body).status == 200, f"a request through {url}")
        except AssertionError:
            logs = {p.name: p.read_text(errors="replace")[-1500:] for p in self.tmp.glob("*.log")}
            raise AssertionError(f"the fleet never served a request; logs: {logs}")
        return self

    def until_linked(self, routers=None):
        """Waits until each of `routers` (all by default) has a stream to every other."""
        routers = range(len(self.routers)) if routers is None else routers
        wait_until(lambda: all(self.metric("inferrail_peers", router=k) == len(routers) - 1 for k in routers), "the routers linked")

    def _spawn(self, name, cmd, env=None):
        log = open(self.tmp / f"{name}.log", "ab")
        env = {**os.environ, **env} if env else None
        return subprocess.Popen([str(c) for c in cmd], stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=env)

    def kill(self, name, sig=signal.SIGKILL):
        p = self.procs.pop(name)
        p.send_signal(sig)
        p.wait(timeout=10)

    def stop(self):
        for name in list(self.procs):
            self.kill(name, signal.SIGTERM)

    def chat(self, max_tokens=2, headers=None, timeout=30, **extra):
        body = {"model": "sim", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": max_tokens, **extra}
        return http("POST", f"{self.url}/v1/chat/completions", body, {**self.client_headers, **(headers or {})}, timeout=timeout)

    def open_stream(self, max_tokens=100, timeout=30):
        """Starts a streamed completion of `max_tokens` tokens through Envoy;
        returns its response, headers read, body still to come."""
        c = httpc.HTTPConnection("127.0.0.1", self.listen, timeout=timeout)
        body = {"model": "sim", "prompt": "x", "max_tokens": max_tokens, "stream": True}
        c.request("POST", "/v1/completions", body=json.dumps(body), headers={"content-type": "application/json"})
        return c.getresponse()

    def send_part(self, body, first, timeout=15):
        """POSTs a completion's headers and `first` bytes of `body` and waits
        until Envoy has opened the router's stream for it; returns the
        connection, for the rest of the body and the response."""
        started = self.envoy_stat("streams_started")
        c = httpc.HTTPConnection("127.0.0.1", self.listen, timeout=timeout)
        c.putrequest("POST", "/v1/completions")
        c.putheader("content-type", "application/json")
        c.putheader("content-length", str(len(body)))
        c.endheaders()
        c.send(body[:first])
        wait_until(lambda: self.envoy_stat("streams_started") > started, "the router's stream for the request")
        return c

    def metrics(self, router=0):
        return http("GET", f"http://127.0.0.1:{self.routers[router][1]}/metrics").body.decode()

    def metric(self, name, labels="", router=0):
        pattern = re.compile(rf"^{re.escape(name)}{re.escape('{' + labels + '}') if labels else ''} (\S+)$", re.M)
        m = pattern.search(self.metrics(router))
        return float(m.group(1)) if m else None

    def kv_mode(self, replica, router=0):
        """The replica's KV index mode in a router (`exact`, or the reason it is approximate), from its metrics."""
        for m in re.finditer(r"^inferrail_kv_mode\{([^}]*)\} 1$", self.metrics(router), re.M):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            if labels.get("replica") == replica:
                return labels.get("mode")
        return None

    def kv_modes(self, router=0):
        return [self.kv_mode(f"sim-{i + 1}", router) for i in range(3)]

    def sim_events(self, i):
        """Simulator i's KV event counters (`published`, `sent`, `skipped`, `dropped`)."""
        return http("GET", f"{self.sim_url(i)}/_sim/kv_events").json()

    def until_exact(self, replicas=range(3), timeout=30):
        """Brings replicas to exact mode in every router: a prefix cache reset,
        whose AllBlocksCleared leads the batch of the next request sent
        straight to the engine, is a moment the cache is known empty. Repeated
        until each router says exact (a subscriber still joining loses a batch)."""
        for i in replicas:
            rid = f"sim-{i + 1}"

            def exact():
                if all(self.kv_mode(rid, k) == "exact" for k in range(len(self.routers))):
                    return True
                assert http("POST", f"{self.sim_url(i)}/reset_prefix_cache").status == 200
                body = {"model": MODEL, "prompt": "warm up", "max_tokens": 1}
                assert http("POST", f"{self.sim_url(i)}/v1/completions", body).status == 200
                return False

            wait_until(exact, f"{rid} exact in every router", timeout)

    def envoy_stat(self, name):
        """An ext_proc counter of Envoy's, summed over its ext_proc filters."""
        text = http("GET", f"http://127.0.0.1:{self.envoy_admin}/stats?filter=ext_proc").body.decode()
        return sum(int(line.split(": ")[1]) for line in text.splitlines() if line.split(": ")[0].endswith("." + name))

    def replicas_stat(self, name):
        """A counter of Envoy's replica cluster (`upstream_rq_retry`, ...)."""
        text = http("GET", f"http://127.0.0.1:{self.envoy_admin}/stats?filter=^cluster\\.replicas\\.").body.decode()
        return sum(int(line.split(": ")[1]) for line in text.splitlines() if line.split(": ")[0] == f"cluster.replicas.{name}")

    def sim_url(self, i):
        return f"http://127.0.0.1:{self.inner_ports[i]}"


@pytest.fixture
def fleet_factory(tmp_path):
    fleets = []

    def make(**kw):
        f = Fleet(tmp_path / f"fleet{len(fleets)}", **kw)
        fleets.append(f)
        return f.start()

    yield make
    for f in fleets:
        f.stop()
