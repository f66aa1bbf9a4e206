"""Every shipped configuration is valid: Envoy's own validation of the
bootstraps, and `inferrail --check` of the routing files."""

import os
import subprocess

from conftest import ENVOY, ROOT, TARGET


def test_envoy_configs_validate():
    configs = sorted((ROOT / "envoy").glob("**/*.yaml")) + sorted((ROOT / "bench" / "envoy").glob("*.yaml"))
    bootstraps = [c for c in configs if "static_resources" in c.read_text()]
    assert bootstraps
    # envoy/module.yaml loads libinferrail_module.so, which reads its routing file from the project's root.
    env = {**os.environ, "ENVOY_DYNAMIC_MODULES_SEARCH_PATH": str(TARGET)}
    for c in bootstraps:
        r = subprocess.run([ENVOY, "--mode", "validate", "-c", c, "--disable-hot-restart"], capture_output=True, text=True, env=env, cwd=ROOT)
        assert r.returncode == 0, (c, r.stdout[-2000:], r.stderr[-2000:])


SKELETON = """static_resources:
  listeners:
  - name: clients
    address: {{socket_address: {{address: 127.0.0.1, port_value: 10000}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: clients
{access_log}
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
{route}
          http_filters:
{filters}
          - name: envoy.filters.http.router
            typed_config: {{"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}
  clusters:
{clusters}
"""


def indent(path, n):
    return "\n".join(" " * n + line for line in path.read_text().splitlines())


def body(path, n):
    """A snippet's YAML without its opening comment, indented `n`."""
    lines = path.read_text().splitlines()
    while lines[0].startswith("#"):
        lines.pop(0)
    return "\n".join(" " * n + line for line in lines)


def test_filter_snippets_validate_inside_a_minimal_bootstrap_and_are_what_local_yaml_runs(tmp_path):
    snippets = ROOT / "envoy" / "filters"
    # observe.yaml stands in for access-log.yaml where no access log can be added; both validate.
    filters = indent(snippets / "http-filters.yaml", 10) + "\n" + indent(snippets / "observe.yaml", 10)
    bootstrap = SKELETON.format(route=indent(snippets / "route.yaml", 14), filters=filters,
                                clusters=indent(snippets / "clusters.yaml", 2), access_log=indent(snippets / "access-log.yaml", 10))
    local = (ROOT / "envoy" / "local.yaml").read_text()
    for snippet in ["http-filters.yaml", "access-log.yaml"]:
        assert body(snippets / snippet, 10) in local, f"envoy/local.yaml should run filters/{snippet} as it is"
    path = tmp_path / "assembled.yaml"
    path.write_text(bootstrap)
    r = subprocess.run([ENVOY, "--mode", "validate", "-c", path, "--disable-hot-restart"], capture_output=True, text=True)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])


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
