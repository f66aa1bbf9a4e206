"""A real vLLM 0.32.0 on the CPU, serving a tiny Qwen3 with random weights
(see setup.sh), started once for the session on a free port and stopped at the
end. It answers with the real tokenizer, chat template, usage accounting and
prefix cache; the text it generates is nonsense. Optional: `just test-vllm`.

The server holds about 5 GB of RAM and a core, and takes a minute or more to
start; VLLM_STARTUP_TIMEOUT (seconds, default 900) bounds the wait."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import ENVOY, ROOT, TARGET, Process, free_ports, http  # noqa: E402

VLLM = ROOT / ".venv-vllm" / "bin" / "vllm"
MODEL_DIR = ROOT / ".cache" / "tiny-qwen3"
SERVED = "tiny-qwen3"
BLOCK_SIZE = 32
MAX_MODEL_LEN = 2048

# What the session measured, for the summary at the end.
STATS = {}
_server = None


def group_members(pgid):
    """/proc entries of the live (not zombie) processes in a process group."""
    members = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            state, _ppid, group = stat[stat.rindex(")") + 2:].split()[:3]
            if int(group) == pgid and state != "Z":
                members.append(d)
        except (OSError, ValueError):
            continue
    return members


def group_rss_kib(pgid):
    """Resident and peak resident memory (KiB) summed over a process group."""
    rss = hwm = 0
    for d in group_members(pgid):
        try:
            for line in (d / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss += int(line.split()[1])
                elif line.startswith("VmHWM:"):
                    hwm += int(line.split()[1])
        except (OSError, ValueError):
            continue
    return rss, hwm


class Server:
    def __init__(self, log_path):
        [self.port] = free_ports(1)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.proc = None
        # Every flag a golden record asks for ("server_flags"): requests with
        # tools (tool_choice "auto") need a parser, as in a Qwen3 deployment (it
        # reads the output and leaves the prompt alone), and a request's own
        # chat_template needs the server's trust.
        self.flags = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--trust-request-chat-template"]
        # Environment variables a test's server needs besides the usual ones.
        self.env = {}

    def start(self, timeout):
        if not VLLM.exists() or not (MODEL_DIR / "config.json").exists():
            pytest.fail(f"no vLLM in {VLLM.parent.parent} or no model in {MODEL_DIR}: run crates/inferrail/tests/vllm/setup.sh")
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_WORKER_MULTIPROC_METHOD="fork", **self.env)
        cmd = [VLLM, "serve", MODEL_DIR, "--served-model-name", SERVED, "--load-format", "dummy", "--enforce-eager",
               "--enable-prefix-caching", "--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN),
               "--enable-prompt-tokens-details", "--host", "127.0.0.1", "--port", str(self.port),
               "--disable-uvicorn-access-log", *self.flags]
        log = open(self.log_path, "wb")
        started = time.monotonic()
        # Its own process group: vLLM forks an engine core and a worker, and all go together.
        self.proc = subprocess.Popen([str(c) for c in cmd], stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        deadline = started + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"vLLM exited with {self.proc.returncode} while starting:\n{self.log_tail()}")
            try:
                if self.get("/health", timeout=5).status == 200:
                    if self is _server:  # the session's server: others start beside it
                        STATS["startup_s"] = time.monotonic() - started
                    return self
            except OSError:
                pass
            time.sleep(1)
        self.stop()
        raise AssertionError(f"vLLM did not answer /health within {timeout} s:\n{self.log_tail()}")

    def stop(self):
        if self.proc is None:
            return
        pgid = self.proc.pid
        if self.proc.poll() is None and self is _server:
            STATS["rss_kib"], STATS["peak_rss_kib"] = group_rss_kib(pgid)
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                return
            # The engine core and the worker may outlive the API server a moment.
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                self.proc.poll()
                if self.proc.returncode is not None and not group_members(pgid):
                    return
                time.sleep(0.2)

    def log_tail(self, lines=200):
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as e:
            return f"(no log: {e})"

    def request(self, method, path, body=None, timeout=120):
        return http(method, self.url + path, body, timeout=timeout)

    def get(self, path, timeout=120):
        return self.request("GET", path, timeout=timeout)

    def post(self, path, body, timeout=120):
        return self.request("POST", path, body, timeout=timeout)


@pytest.fixture(scope="session")
def vllm(tmp_path_factory):
    global _server
    server = Server(tmp_path_factory.mktemp("vllm") / "vllm.log")
    _server = server
    try:
        yield server.start(float(os.environ.get("VLLM_STARTUP_TIMEOUT", "900")))
    finally:
        server.stop()


# The processes some tests start besides vLLM: Inferrail's router and Envoy in
# front of it (test_router_vllm.py), and the simulator with the real Qwen3
# tokenizer (test_sim_goldens.py). Each is stopped when its module ends.
QWEN3 = ROOT / ".cache" / "tokenizers" / "qwen3"
_helpers = []


class Helper(Process):
    """A process started for some tests; a failing test shows its log."""

    def __init__(self, name, cmd, log_path, env=None):
        super().__init__(name, cmd, log_path, env)
        _helpers.append(self)

    def stop(self):
        super().stop()
        if self in _helpers:
            _helpers.remove(self)


def vllm_cache_config(vllm):
    """The labels of vLLM's vllm:cache_config_info, as a dict."""
    metrics = vllm.get("/metrics").body.decode()
    info = re.search(r"^vllm:cache_config_info\{(.*)\} ", metrics, re.M)
    assert info, "vLLM's /metrics has no vllm:cache_config_info"
    return dict(re.findall(r'(\w+)="([^"]*)"', info.group(1)))


def envoy_config_for(port, listen, envoy_admin, grpc):
    """envoy/local.yaml for one upstream: its replica cluster trimmed to the
    endpoint on :8001, then every port rewritten in one pass."""
    text = (ROOT / "envoy" / "local.yaml").read_text()
    text, n = re.subn(r"\n[ \t]*- endpoint: \{address: \{socket_address: \{address: 127\.0\.0\.1, port_value: 800[23]\}\}\}", "", text)
    assert n == 2, f"envoy/local.yaml should list the replicas on :8002 and :8003 once each (removed {n})"
    ports = {8080: listen, 9901: envoy_admin, 9002: grpc, 8001: port}
    seen = []

    def swap(m):
        seen.append(int(m.group(1)))
        return f"port_value: {ports.get(int(m.group(1)), m.group(1))}"

    text = re.sub(r"port_value: (\d+)\b", swap, text)
    assert sorted(seen) == sorted(ports), f"envoy/local.yaml should name ports {sorted(ports)} once each after the trim, names {sorted(seen)}"
    cluster = text[text.index("- name: replicas"):]
    assert cluster.count("- endpoint:") == 1 and f"port_value: {port}}}" in cluster, f"the replica cluster should hold only :{port}:\n{cluster}"
    return text


class Front:
    """Envoy (envoy/local.yaml, trimmed to one replica) and Inferrail's router in
    front of one OpenAI server; the router tokenizes with the Qwen3 tokenizer
    and learns the replica's block size and capacity from its /metrics."""

    def __init__(self, tmp, upstream_port, served, tokenizer=QWEN3):
        if not (Path(tokenizer) / "tokenizer.json").is_file():
            pytest.fail(f"no tokenizer in {tokenizer}: run `just setup`")
        self.tmp = tmp
        self.listen, self.envoy_admin, self.grpc, self.admin, self.admin_grpc = free_ports(5)
        self.url = f"http://127.0.0.1:{self.listen}"
        self.upstream = f"127.0.0.1:{upstream_port}"
        self.config = tmp / "inferrail.yaml"
        self.config.write_text(
            f"server: {{listen: 127.0.0.1:{self.grpc}}}\n"
            f"admin: {{listen: 127.0.0.1:{self.admin}, grpc_listen: 127.0.0.1:{self.admin_grpc}}}\n"
            f"models:\n  - {{name: {served}, tokenizer: {Path(tokenizer).resolve()}}}\n"
            f"replicas:\n  - {{id: vllm, address: {self.upstream}, models: [{served}]}}\n")
        self.envoy_config = tmp / "envoy.yaml"
        self.envoy_config.write_text(envoy_config_for(upstream_port, self.listen, self.envoy_admin, self.grpc))
        self.router = self.envoy = None
        self.shape = None

    def start(self):
        env = dict(os.environ, RUST_LOG="info")
        self.router = Helper("inferrail", [TARGET / "inferrail", "--config", self.config], self.tmp / "inferrail.log", env)
        self.router.wait_until(lambda: http("GET", f"http://127.0.0.1:{self.admin}/readyz", timeout=5).status == 200, "/readyz")
        # The probe that found the replica healthy read its /metrics too.
        self.router.wait_until(lambda: "KV cache shape learned" in self.router.log(), "KV cache shape learned (log)", timeout=30)
        m = re.search(r"KV cache shape learned.*?block_size=(\d+) blocks=(\d+)", self.router.log())
        self.shape = (int(m.group(1)), int(m.group(2))) if m else None
        self.envoy = Helper("envoy", [ENVOY, "-c", self.envoy_config, "--disable-hot-restart", "--log-level", "warn",
                                      "--concurrency", "1"], self.tmp / "envoy.log")
        self.envoy.wait_until(lambda: http("GET", f"http://127.0.0.1:{self.envoy_admin}/ready", timeout=5).status == 200, "Envoy /ready")
        return self

    def stop(self):
        for h in (self.envoy, self.router):
            if h is not None:
                h.stop()

    def post(self, path, body, timeout=120):
        return http("POST", self.url + path, body, timeout=timeout)

    def metrics(self):
        return http("GET", f"http://127.0.0.1:{self.admin}/metrics", timeout=10).body.decode()


@pytest.fixture(scope="module")
def front(vllm, tmp_path_factory):
    """Envoy and the router in front of the session's vLLM."""
    f = Front(tmp_path_factory.mktemp("front"), vllm.port, SERVED)
    try:
        yield f.start()
    finally:
        f.stop()


@pytest.fixture(scope="module")
def qwen3_sim(tmp_path_factory):
    """inferrail-sim with the real Qwen3 tokenizer, vLLM's block size, context
    length and served name, at zero latency."""
    if not (QWEN3 / "tokenizer.json").is_file():
        pytest.fail(f"no tokenizer in {QWEN3}: run `just setup`")
    [port] = free_ports(1)
    sim = Helper("inferrail-sim", [TARGET / "inferrail-sim", "--tokenizer", QWEN3, "--served-model-name", SERVED,
                                   "--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN),
                                   "--enable-prompt-tokens-details", "--zero-latency", "--port", str(port)],
                 tmp_path_factory.mktemp("sim") / "sim.log")
    sim.url = f"http://127.0.0.1:{port}"
    try:
        sim.wait_until(lambda: http("GET", sim.url + "/health", timeout=5).status == 200, "/health")
        yield sim
    finally:
        sim.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test carries the end of vLLM's log, and of the router's, Envoy's
    and the simulator's where they run."""
    outcome = yield
    rep = outcome.get_result()
    if not rep.failed:
        return
    if _server is not None and _server.proc is not None and "vllm" in item.fixturenames:
        rep.sections.append(("vLLM log (last 60 lines)", _server.log_tail(60)))
    for h in _helpers:
        rep.sections.append((f"{h.name} log (last 40 lines)", h.log_tail(40)))


def pytest_terminal_summary(terminalreporter):
    if not STATS:
        return
    parts = []
    if "startup_s" in STATS:
        parts.append(f"ready in {STATS['startup_s']:.0f} s")
    if "rss_kib" in STATS:
        parts.append(f"RSS at the end {STATS['rss_kib'] / 1024:.0f} MiB (peak {STATS['peak_rss_kib'] / 1024:.0f} MiB, summed over its processes)")
    if "num_gpu_blocks" in STATS:
        parts.append(f"{STATS['num_gpu_blocks']} KV blocks of {BLOCK_SIZE} tokens")
    terminalreporter.write_line("vLLM 0.32.0 (CPU): " + ", ".join(parts))
    if "kv_events" in STATS:
        checked, evicted, exact = STATS["kv_events"]
        terminalreporter.write_line(f"exact mode on vLLM's KV events: {exact} of {checked} predictions equal vLLM's cached tokens; "
                                    f"{evicted} repeated prompts had lost blocks to eviction")
    if "router_tokenize" in STATS:
        terminalreporter.write_line(f"Inferrail in front of vLLM: tokenizer outcomes {STATS['router_tokenize']}")
