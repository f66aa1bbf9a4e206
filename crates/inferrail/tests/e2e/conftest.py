"""A real fleet for end-to-end tests: three inferrail-sim processes, the
inferrail binary and Envoy (from the project's .venv) running the shipped
envoy/local.yaml, all on free ports so tests never collide with `just up`."""

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import ENVOY, ROOT, TARGET, free_ports, http, wait_until  # noqa: E402

MODEL = "inferrail/sim-8b"


class Fleet:
    def __init__(self, tmp, policy="round_robin", sim_flags=(), config_extra="", tokenizer="builtin:sim", replica_extra="", routing=""):
        self.tmp = tmp
        tmp.mkdir(parents=True, exist_ok=True)
        self.procs = {}
        ports = free_ports(8)
        self.sim_ports = ports[:3]
        self.sim_flags = ["--tokenizer", tokenizer, *sim_flags]
        self.grpc, self.admin, self.listen, self.envoy_admin, self.admin_grpc = ports[3:]
        self.url = f"http://127.0.0.1:{self.listen}"
        replicas = "\n".join(
            f"  - {{id: sim-{i + 1}, address: 127.0.0.1:{p}, models: [{MODEL}]{replica_extra}}}" for i, p in enumerate(self.sim_ports))
        self.config = tmp / "inferrail.yaml"
        self.config.write_text(
            f"server: {{listen: 127.0.0.1:{self.grpc}, max_body_bytes: 1048576, shutdown_grace_ms: 2000}}\n"
            f"admin: {{listen: 127.0.0.1:{self.admin}, grpc_listen: 127.0.0.1:{self.admin_grpc}}}\n"
            f"routing: {{seed: 7{routing}}}\n"
            f"health: {{probe_interval_ms: 100, probe_timeout_ms: 300}}\n"
            f"{config_extra}"
            f"models:\n  - {{name: {MODEL}, aliases: [sim], policy: {policy}, tokenizer: {tokenizer}}}\n"
            f"replicas:\n{replicas}\n")
        envoy = (ROOT / "envoy" / "local.yaml").read_text()
        for old, new in [(8080, self.listen), (9901, self.envoy_admin), (9002, self.grpc)] + list(zip((8001, 8002, 8003), self.sim_ports)):
            envoy, n = re.subn(rf"port_value: {old}\b", f"port_value: {new}", envoy)
            assert n == 1, f"envoy/local.yaml should name port {old} once"
        self.envoy_config = tmp / "envoy.yaml"
        self.envoy_config.write_text(envoy)

    def start_sim(self, i):
        port = self.sim_ports[i]
        self.procs[f"sim-{i + 1}"] = self._spawn(
            f"sim-{i + 1}", [TARGET / "inferrail-sim", "--port", str(port), "--served-model-name", MODEL,
                             "--enable-prompt-tokens-details", "--seed", str(i + 1), *self.sim_flags])
        wait_until(lambda: http("GET", f"http://127.0.0.1:{port}/health").status == 200, f"sim-{i + 1}")

    def start_router(self):
        self.procs["inferrail"] = self._spawn("inferrail", [TARGET / "inferrail", "--config", self.config])
        wait_until(lambda: http("GET", f"http://127.0.0.1:{self.admin}/readyz").status == 200, "inferrail")

    def start(self):
        for i in range(3):
            self.start_sim(i)
        self.start_router()
        self.procs["envoy"] = self._spawn(
            "envoy", [ENVOY, "-c", self.envoy_config, "--disable-hot-restart", "--log-level", "warn", "--concurrency", "2"])
        try:
            wait_until(lambda: self.chat().status == 200, "a request through Envoy")
        except AssertionError:
            logs = {p.name: p.read_text(errors="replace")[-1500:] for p in self.tmp.glob("*.log")}
            raise AssertionError(f"the fleet never served a request; logs: {logs}")
        return self

    def _spawn(self, name, cmd):
        log = open(self.tmp / f"{name}.log", "ab")
        return subprocess.Popen([str(c) for c in cmd], stdout=log, stderr=log, stdin=subprocess.DEVNULL)

    def kill(self, name, sig=signal.SIGKILL):
        p = self.procs.pop(name)
        p.send_signal(sig)
        p.wait(timeout=10)

    def stop(self):
        for name in list(self.procs):
            self.kill(name, signal.SIGTERM)

    def chat(self, max_tokens=2, headers=None, timeout=30, **extra):
        body = {"model": "sim", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": max_tokens, **extra}
        return http("POST", f"{self.url}/v1/chat/completions", body, headers, timeout=timeout)

    def metrics(self):
        return http("GET", f"http://127.0.0.1:{self.admin}/metrics").body.decode()

    def metric(self, name, labels=""):
        pattern = re.compile(rf"^{re.escape(name)}{re.escape('{' + labels + '}') if labels else ''} (\S+)$", re.M)
        m = pattern.search(self.metrics())
        return float(m.group(1)) if m else None

    def envoy_stat(self, name):
        """An ext_proc counter of Envoy's, summed over both filters."""
        text = http("GET", f"http://127.0.0.1:{self.envoy_admin}/stats?filter=ext_proc").body.decode()
        return sum(int(line.split(": ")[1]) for line in text.splitlines() if line.split(": ")[0].endswith("." + name))

    def sim_url(self, i):
        return f"http://127.0.0.1:{self.sim_ports[i]}"


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
