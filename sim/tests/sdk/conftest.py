"""Starts one inferrail-sim binary for the SDK tests and stops it after."""

import os
import re
import subprocess

import pytest


@pytest.fixture(scope="session")
def sim_url():
    binary = os.environ.get("INFERRAIL_SIM", "target/debug/inferrail-sim")
    proc = subprocess.Popen(
        [binary, "--port", "0", "--served-model-name", "sim", "--max-model-len", "4096",
         "--enable-prompt-tokens-details", "--zero-latency", "--block-size", "16"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stdout.readline()
        match = re.search(r"listening on (http://\S+)", line)
        assert match, f"unexpected first line from the simulator: {line!r}"
        yield match.group(1)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
