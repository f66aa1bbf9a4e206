"""Every shipped configuration is valid: Envoy's own validation of the
bootstraps, and `inferrail --check` of the routing files."""

import subprocess
from pathlib import Path

from conftest import ENVOY, ROOT, TARGET


def test_envoy_configs_validate():
    configs = sorted((ROOT / "envoy").glob("**/*.yaml")) + sorted((ROOT / "bench" / "envoy").glob("*.yaml"))
    bootstraps = [c for c in configs if "static_resources" in c.read_text()]
    assert bootstraps
    for c in bootstraps:
        r = subprocess.run([ENVOY, "--mode", "validate", "-c", c, "--disable-hot-restart"], capture_output=True, text=True)
        assert r.returncode == 0, (c, r.stdout[-2000:], r.stderr[-2000:])


def test_inferrail_check_accepts_the_shipped_files_and_lists_every_problem(tmp_path):
    for c in [ROOT / "envoy" / "local-inferrail.yaml", ROOT / "crates" / "inferrail-config" / "example.yaml"]:
        r = subprocess.run([TARGET / "inferrail", "--check", "--config", c], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [{name: m}]\nreplicas: [{id: a, address: nowhere, models: [m, x]}]\nextra: 1\n")
    r = subprocess.run([TARGET / "inferrail", "--check", "--config", bad], capture_output=True, text=True)
    assert r.returncode == 2
    for problem in ["extra: unknown key", "replicas[0].address", "replicas[0].models[1]"]:
        assert problem in r.stderr, r.stderr
