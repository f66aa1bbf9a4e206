"""A real vLLM 0.32.0 on the CPU, serving a tiny Qwen3 with random weights
(see setup.sh), started once for the session on a free port and stopped at the
end. It answers with the real tokenizer, chat template, usage accounting and
prefix cache; the text it generates is nonsense. Optional: `just test-vllm`.

The server holds about 5 GB of RAM and a core, and takes a minute or more to
start; VLLM_STARTUP_TIMEOUT (seconds, default 900) bounds the wait."""

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]
VLLM = ROOT / ".venv-vllm" / "bin" / "vllm"
MODEL_DIR = ROOT / ".cache" / "tiny-qwen3"
SERVED = "tiny-qwen3"
BLOCK_SIZE = 32
MAX_MODEL_LEN = 2048

# What the session measured, for the summary at the end.
STATS = {}
_server = None


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Reply:
    def __init__(self, status, body):
        self.status, self.body = status, body

    def json(self):
        return json.loads(self.body)


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
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.proc = None
        # Every flag a golden record asks for ("server_flags"): requests with
        # tools (tool_choice "auto") need a parser, as in a Qwen3 deployment (it
        # reads the output and leaves the prompt alone), and a request's own
        # chat_template needs the server's trust.
        self.flags = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--trust-request-chat-template"]

    def start(self, timeout):
        if not VLLM.exists() or not (MODEL_DIR / "config.json").exists():
            pytest.fail(f"no vLLM in {VLLM.parent.parent} or no model in {MODEL_DIR}: run crates/inferrail/tests/vllm/setup.sh")
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_WORKER_MULTIPROC_METHOD="fork")
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
        if self.proc.poll() is None:
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
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method, headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return Reply(r.status, r.read())
        except urllib.error.HTTPError as e:
            return Reply(e.code, e.read())

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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test carries the end of vLLM's log."""
    outcome = yield
    rep = outcome.get_result()
    if rep.failed and _server is not None and _server.proc is not None:
        rep.sections.append(("vLLM log (last 60 lines)", _server.log_tail(60)))


def pytest_terminal_summary(terminalreporter):
    if not STATS:
        return
    parts = []
    if "startup_s" in STATS:
        parts.append(f"ready in {STATS['startup_s']:.0f} s")
    if "rss_kib" in STATS:
        parts.append(f"RSS at the end {STATS['rss_kib'] / 1024:.0f} MiB (peak {STATS['peak_rss_kib'] / 1024:.0f} MiB, summed over its processes)")
    terminalreporter.write_line("vLLM 0.32.0 (CPU): " + ", ".join(parts))
