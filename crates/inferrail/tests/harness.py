"""What the end-to-end suites (e2e/, and vllm/ behind `just test-vllm`) share:
the built binaries, free ports, polling, a small HTTP client, and processes
run with their output in a log file."""

import json
import os
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
# Debug builds for the suite; `just bench-reload` runs a test on release builds (INFERRAIL_PROFILE=release).
TARGET = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / os.environ.get("INFERRAIL_PROFILE", "debug")
ENVOY = ROOT / ".venv" / "bin" / "envoy"


def free_ports(n):
    """n distinct free ports: all sockets stay bound until every port is picked,
    so the kernel cannot hand out the same one twice."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_until(check, what, timeout=20.0, proc=None, log=None):
    """Polls `check` until it holds; fails at the timeout, or at once if `proc` exits (with the tail of `log`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"exited with {proc.returncode} before {what}:\n{log() if log else ''}")
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}:\n{log() if log else ''}")


class Response:
    def __init__(self, status, headers, body):
        self.status, self.headers, self.body = status, headers, body

    def json(self):
        return json.loads(self.body)


def http(method, url, body=None, headers=None, timeout=30):
    """One request; the response's header names are in lower case."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return Response(r.status, {k.lower(): v for k, v in r.headers.items()}, r.read())
    except urllib.error.HTTPError as e:
        return Response(e.code, {k.lower(): v for k, v in e.headers.items()}, e.read())


class Process:
    """A process with its output in a log file."""

    def __init__(self, name, cmd, log_path, env=None, new_session=False):
        if not Path(cmd[0]).exists():
            raise AssertionError(f"{cmd[0]} is missing: build it (cargo build) or run `just setup`")
        self.name, self.log_path = name, log_path
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen([str(c) for c in cmd], stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, start_new_session=new_session)

    def wait_until(self, check, what, timeout=60):
        wait_until(check, f"{self.name}: {what}", timeout, self.proc, self.log_tail)

    def stop(self, sig_timeout=15):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=sig_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def log(self):
        try:
            # Without colours: tracing writes ANSI escapes even to a file.
            return re.sub(r"\x1b\[[0-9;]*m", "", self.log_path.read_text(errors="replace"))
        except OSError as e:
            return f"(no log: {e})"

    def log_tail(self, lines=60):
        return "\n".join(self.log().splitlines()[-lines:])
