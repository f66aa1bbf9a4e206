"""The Kubernetes manifests under k8s/: `kubectl kustomize` builds the base
and every overlay (no cluster needed); every object it emits passes
kubernetes-validate (strict) for built-in kinds or, for custom resources,
the JSON schema in schemas/ for its apiVersion and kind. A kind that neither
knows fails. Then what the objects must say to one another: the Service
exposes the ext_proc port alone, the InferencePool's picker is that Service
and port, RBAC only reads (and holds a lease), the routing file in the
ConfigMap passes `inferrail --check` and agrees with the Deployment, and the
Istio EnvoyFilter's patches, applied to a gateway-shaped bootstrap, pass
`envoy --mode validate` and match envoy/filters/http-filters.yaml."""

import copy
import functools
import json
import os
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
VENV = ROOT / ".venv" / "bin"
KUBECTL = VENV / "kubectl"
ENVOY = VENV / "envoy"
INFERRAIL = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "debug" / "inferrail"
# The Kubernetes release whose schemas kubernetes-validate checks against (its own version).
KUBERNETES = "1.37.0"
NAMESPACE = "inference"
CONFIG_PATH = "/etc/inferrail/inferrail.yaml"

# Every kustomization here that builds on its own (components only build inside one).
BUILDS = sorted(str(p.parent.relative_to(K8S)) for p in K8S.rglob("kustomization.yaml")
                if yaml.safe_load(p.read_text())["kind"] == "Kustomization")
EXPECTED = ["base", "overlays/envoy-gateway", "overlays/envoy-gateway/without-ai-gateway", "overlays/istio",
            "overlays/istio/without-inferencepool", "overlays/kgateway"]
# Inferrail inside the gateway's Envoy, as its dynamic module (ADR 0060): no router Deployment.
MODULE = ["overlays/envoy-gateway/module", "overlays/istio/module"]
# Behind these the gateway's cluster takes the destination header's first ip:port only.
SINGLE_DESTINATION = {"overlays/envoy-gateway", "overlays/kgateway"}


def load_schemas():
    schemas = {}
    for path in sorted((K8S / "tests" / "schemas").glob("*.json")):
        schema = json.loads(path.read_text())
        jsonschema.Draft202012Validator.check_schema(schema)
        key = (schema["properties"]["apiVersion"]["const"], schema["properties"]["kind"]["const"])
        assert key not in schemas, f"{path.name}: a second schema for {key}"
        schemas[key] = schema
    return schemas


SCHEMAS = load_schemas()


class UnknownKind(Exception):
    pass


def validate(obj):
    """Raises unless `obj` passes its kind's schema; UnknownKind when no schema knows it."""
    key = (obj.get("apiVersion"), obj.get("kind"))
    if key in SCHEMAS:
        jsonschema.Draft202012Validator(SCHEMAS[key], format_checker=jsonschema.FormatChecker()).validate(obj)
        return
    try:
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)
    except kubernetes_validate.SchemaNotFoundError as e:
        raise UnknownKind(f"{key}: neither Kubernetes {KUBERNETES} nor k8s/tests/schemas knows it ({e.message})") from None


@functools.cache
def build(name):
    r = subprocess.run([KUBECTL, "kustomize", K8S / name], capture_output=True, text=True)
    assert r.returncode == 0, (name, r.stderr)
    objs = [o for o in yaml.safe_load_all(r.stdout) if o]
    assert objs, name
    return objs


def of_kind(objs, kind):
    return [o for o in objs if o["kind"] == kind]


def one(objs, kind, name=None):
    found = [o for o in of_kind(objs, kind) if name is None or o["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name, [o["metadata"]["name"] for o in found])
    return found[0]


def routing_file(objs):
    """The routing YAML the Deployment mounts, parsed, with its text."""
    cm = one(objs, "ConfigMap")
    assert cm["metadata"]["name"].startswith("inferrail-config-"), "the generator's hash suffix rolls the pods on a change"
    text = cm["data"]["inferrail.yaml"]
    return yaml.safe_load(text), text


def port_of(address):
    return int(address.rsplit(":", 1)[1])


def container(objs, name):
    pod = one(objs, "Deployment", "inferrail")["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == name)


def test_every_kustomization_is_built_here():
    assert BUILDS == sorted(EXPECTED + MODULE)


@pytest.mark.parametrize("name", EXPECTED)
def test_every_object_passes_its_schema(name):
    objs = build(name)
    for obj in objs:
        validate(obj)
        assert obj["metadata"]["namespace"] == NAMESPACE, (obj["kind"], obj["metadata"]["name"])
    kinds = {o["kind"] for o in objs}
    assert {"Deployment", "Service", "ConfigMap", "ServiceAccount", "Role", "RoleBinding", "PodDisruptionBudget",
            "NetworkPolicy"} <= kinds, kinds
    # Least privilege stays in the namespace.
    assert not kinds & {"ClusterRole", "ClusterRoleBinding", "Namespace", "CustomResourceDefinition"}, kinds


def test_validation_rejects_unknown_kinds_and_wrong_fields():
    with pytest.raises(UnknownKind):
        validate({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}})
    pool = copy.deepcopy(one(build("base"), "InferencePool"))
    validate(pool)
    for change in [lambda p: p["spec"].update(targetPortNumber=8000),                   # v1alpha2's field, gone in v1
                   lambda p: p["spec"]["endpointPickerRef"].update(failureMode="Close"),
                   lambda p: p["spec"].update(targetPorts=[]),
                   lambda p: p["spec"]["selector"].update(matchLabels={})]:
        bad = copy.deepcopy(pool)
        change(bad)
        with pytest.raises(jsonschema.ValidationError):
            validate(bad)
    deployment = copy.deepcopy(one(build("base"), "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(jsonschema.ValidationError):
        validate(deployment)
    route = copy.deepcopy(one(build("overlays/istio"), "HTTPRoute"))
    route["spec"]["rules"][0]["timeouts"]["request"] = "five minutes"
    with pytest.raises(jsonschema.ValidationError):
        validate(route)


def test_every_schema_field_names_its_upstream_source():
    def walk(schema, path):
        for key, sub in schema.get("properties", {}).items():
            assert sub.get("description"), f"{path}.{key}: no description naming its upstream file"
            assert any(ext in sub["description"] for ext in (".go", ".proto")), (f"{path}.{key}", sub["description"])
            walk(sub, f"{path}.{key}")
        if isinstance(schema.get("items"), dict):
            walk(schema["items"], f"{path}[]")

    for (api, kind), schema in SCHEMAS.items():
        walk(schema, f"{kind}.{api}")


@pytest.mark.parametrize("name", EXPECTED)
def test_the_service_exposes_the_ext_proc_port_alone(name):
    objs = build(name)
    config, _ = routing_file(objs)
    ext_proc = port_of(config["server"]["listen"])
    admin = {port_of(config["admin"]["listen"]), port_of(config["admin"]["grpc_listen"])}
    service = one(objs, "Service", "inferrail")
    assert [(p["port"], p.get("appProtocol")) for p in service["spec"]["ports"]] == [(ext_proc, "http2")]
    assert service["spec"]["selector"] == one(objs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    named = {p["name"]: p["containerPort"] for p in container(objs, "inferrail")["ports"]}
    assert named[service["spec"]["ports"][0]["targetPort"]] == ext_proc
    for svc in of_kind(objs, "Service"):
        for p in svc["spec"]["ports"]:
            assert p["port"] not in admin and named.get(p.get("targetPort"), p.get("targetPort")) not in admin, (svc, p)
    # The admin gRPC listener stays on loopback; the NetworkPolicy admits anyone to ext_proc, chosen pods to admin.
    assert config["admin"]["grpc_listen"].startswith("127.0.0.1:")
    policy = one(objs, "NetworkPolicy")["spec"]
    assert policy["podSelector"]["matchLabels"] == service["spec"]["selector"]
    open_ports = {p["port"] for rule in policy["ingress"] if "from" not in rule for p in rule["ports"]}
    assert open_ports == {ext_proc}
    limited = {p["port"] for rule in policy["ingress"] if rule.get("from") for p in rule["ports"]}
    assert limited == {port_of(config["admin"]["listen"])}


@pytest.mark.parametrize("name", EXPECTED)
def test_the_routers_find_one_another_through_a_headless_service(name):
    objs = build(name)
    config, _ = routing_file(objs)
    assert one(objs, "Deployment")["spec"]["replicas"] >= 2
    host, port = config["peers"]["dns"].rsplit(":", 1)
    service, namespace, rest = host.split(".", 2)
    assert (namespace, rest) == (NAMESPACE, "svc.cluster.local")
    peers = one(objs, "Service", service)["spec"]
    assert peers["clusterIP"] == "None" and peers["publishNotReadyAddresses"] is True
    assert peers["selector"] == one(objs, "Service", "inferrail")["spec"]["selector"]
    named = {p["name"]: p["containerPort"] for p in container(objs, "inferrail")["ports"]}
    assert [(p["port"], named[p["targetPort"]]) for p in peers["ports"]] == [(int(port), port_of(config["server"]["listen"]))]


@pytest.mark.parametrize("name", EXPECTED)
def test_the_pools_picker_is_the_service_and_the_routes_name_what_exists(name):
    objs = build(name)
    config, _ = routing_file(objs)
    pools = of_kind(objs, "InferencePool")
    if "without-" in name:
        assert not pools, "without InferencePool support the pool is left out"
    else:
        pool = one(objs, "InferencePool")["spec"]
        ref = pool["endpointPickerRef"]
        service = one(objs, "Service", ref["name"])
        assert ref.get("kind", "Service") == "Service" and ref.get("group", "") == ""
        assert ref["port"]["number"] == service["spec"]["ports"][0]["port"] == port_of(config["server"]["listen"])
        assert ref["failureMode"] == "FailClose"
        assert pool["targetPorts"] == [{"number": 8000}]
        # The router discovers the replicas from this pool, in its own namespace.
        assert config["kubernetes"]["pool"] == one(objs, "InferencePool")["metadata"]["name"] and not config.get("replicas")
        assert config["kubernetes"].get("namespace") in (None, NAMESPACE)
    routes = of_kind(objs, "HTTPRoute")
    assert len(routes) == (0 if name == "base" else 1)
    for route in routes:
        for rule in route["spec"]["rules"]:
            assert rule["timeouts"]["request"] == "300s"
            for ref in rule["backendRefs"]:
                if ref.get("kind") == "InferencePool":
                    assert ref["group"] == "inference.networking.k8s.io"
                    one(objs, "InferencePool", ref["name"])
                else:
                    assert ref.get("kind", "Service") == "Service"
                    svc = one(objs, "Service", ref["name"])
                    assert ref["port"] in [p["port"] for p in svc["spec"]["ports"]]
                    assert svc["spec"]["selector"] == one(build("base"), "InferencePool")["spec"]["selector"]["matchLabels"]


def test_rbac_only_reads_and_holds_a_lease():
    objs = build("base")
    role = one(objs, "Role", "inferrail")
    rules = {(g, r): sorted(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    read = ["get", "list", "watch"]
    assert rules == {("", "pods"): read, ("discovery.k8s.io", "endpointslices"): read,
                     ("inference.networking.k8s.io", "inferencepools"): read,
                     ("inference.networking.x-k8s.io", "inferenceobjectives"): read,
                     ("coordination.k8s.io", "leases"): ["create", "get", "update"]}
    binding = one(objs, "RoleBinding", "inferrail")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "inferrail"}
    account = one(objs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}]
    one(objs, "ServiceAccount", account)


@pytest.mark.parametrize("name", EXPECTED)
def test_the_deployment_runs_the_routing_file_it_mounts(name):
    objs = build(name)
    config, _ = routing_file(objs)
    deployment = one(objs, "Deployment", "inferrail")
    pod = deployment["spec"]["template"]["spec"]
    cm = one(objs, "ConfigMap")["metadata"]["name"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    router, scraper = container(objs, "inferrail"), container(objs, "scraper")
    assert [c["name"] for c in pod["containers"]] == ["inferrail", "scraper"]
    for c in (router, scraper):
        assert c["image"] == "ghcr.io/inferrail/inferrail:0.1.0"
        mount = next(m for m in c["volumeMounts"] if volumes[m["name"]].get("configMap"))
        assert volumes[mount["name"]]["configMap"]["name"] == cm and mount["readOnly"]
        assert CONFIG_PATH.startswith(mount["mountPath"] + "/")
        args = c["args"]
        assert args[args.index("--config") + 1] == CONFIG_PATH
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"] and sc["capabilities"]["drop"] == ["ALL"]
        assert set(c["resources"]["requests"]) == set(c["resources"]["limits"]) == {"cpu", "memory"}
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
    # The sidecar listens where load.sidecar points, and follows the router's fleet on its admin gRPC listener.
    assert scraper["args"][scraper["args"].index("--listen") + 1] == config["load"]["sidecar"].removeprefix("http://")
    assert scraper["args"][scraper["args"].index("--router") + 1] == "http://" + config["admin"]["grpc_listen"]
    # The router reads the API server: the account's token is mounted.
    account = one(objs, "ServiceAccount", pod["serviceAccountName"])
    assert pod.get("automountServiceAccountToken", account.get("automountServiceAccountToken", True))
    # Probes on the admin HTTP port.
    admin = port_of(config["admin"]["listen"])
    named = {p["name"]: p["containerPort"] for p in router["ports"]}
    for probe, path in [("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")]:
        get = router[probe]["httpGet"]
        assert get["path"] == path and named[get["port"]] == admin
    # Open streams finish on SIGTERM before the kubelet's kill.
    assert pod["terminationGracePeriodSeconds"] * 1000 > config["server"]["shutdown_grace_ms"]
    # Two pickers at least, and a drain never takes the last.
    pdb = one(objs, "PodDisruptionBudget")["spec"]
    assert pdb["selector"] == deployment["spec"]["selector"]
    assert deployment["spec"]["replicas"] >= 2 and 1 <= pdb["minAvailable"] < deployment["spec"]["replicas"]


@pytest.mark.parametrize("name", EXPECTED)
def test_the_routing_file_passes_inferrail_check_and_differs_from_the_bases_only_in_fallbacks(name, tmp_path):
    objs = build(name)
    config, text = routing_file(objs)
    base, _ = routing_file(build("base"))
    expected = copy.deepcopy(base)
    expected["retry"]["fallbacks"] = 0 if name in SINGLE_DESTINATION else base["retry"]["fallbacks"]
    assert config == expected
    assert base["retry"]["fallbacks"] >= 1
    if not INFERRAIL.exists():
        pytest.skip(f"{INFERRAIL} is not built (cargo build -p inferrail; `just test` builds it first)")
    path = tmp_path / "inferrail.yaml"
    path.write_text(text)
    r = subprocess.run([INFERRAIL, "--check", "--config", path], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def merge(into, value):
    """An EnvoyFilter MERGE as Istio applies it: maps merge, lists append, scalars replace."""
    for k, v in value.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            merge(into[k], v)
        elif isinstance(v, list) and isinstance(into.get(k), list):
            into[k].extend(copy.deepcopy(v))
        else:
            into[k] = copy.deepcopy(v)


def istio_cluster(name):
    """Istio's name of a Service port's outbound cluster: outbound|port||service.namespace.svc.cluster.local."""
    direction, port, subset, host = name.split("|")
    service, namespace, rest = host.split(".", 2)
    assert (direction, subset, rest) == ("outbound", "", "svc.cluster.local"), name
    return service, namespace, int(port)


def gateway(objs):
    """A gateway-shaped Envoy bootstrap with the EnvoyFilter's patches applied
    as Istio applies them: (listener, clusters by name, http filters, the
    vLLM cluster's name)."""
    spec = one(objs, "EnvoyFilter", "inferrail")["spec"]
    route = one(objs, "HTTPRoute")
    assert spec["workloadSelector"]["labels"] == {"gateway.networking.k8s.io/gateway-name": route["spec"]["parentRefs"][0]["name"]}
    backend = route["spec"]["rules"][0]["backendRefs"][0]
    vllm = f"outbound|{backend['port']}||{backend['name']}.{NAMESPACE}.svc.cluster.local"
    router = {"name": "envoy.filters.http.router",
              "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}
    http_filters = [router]
    listener = {
        "name": "gateway",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": 10000}},
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": "gateway",
                "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"],
                                                    "routes": [{"match": {"prefix": "/"}, "route": {"cluster": vllm}}]}]},
                "http_filters": http_filters}}]}],
    }
    # The vLLM cluster as Istio writes a Service's (EDS there, STATIC here; LEAST_REQUEST is its default).
    clusters = {vllm: {"name": vllm, "type": "STATIC", "connect_timeout": "10s", "lb_policy": "LEAST_REQUEST",
                       "load_assignment": {"cluster_name": vllm, "endpoints": [{"lb_endpoints": [
                           {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 8000}}}}]}]}}}
    for patch in spec["configPatches"]:
        match, op, value = patch["match"], patch["patch"]["operation"], patch["patch"]["value"]
        assert match["context"] == "GATEWAY"
        if patch["applyTo"] == "HTTP_FILTER":
            f = match["listener"]["filterChain"]["filter"]
            assert f["name"] == "envoy.filters.network.http_connection_manager" and f["subFilter"]["name"] == router["name"]
            assert op == "INSERT_BEFORE"
            http_filters.insert(http_filters.index(router), copy.deepcopy(value))
        elif patch["applyTo"] == "CLUSTER":
            name = f"outbound|{match['cluster']['portNumber']}||{match['cluster']['service']}"
            assert op == "MERGE" and name in clusters, (name, list(clusters))
            merge(clusters[name], value)
        elif patch["applyTo"] == "VIRTUAL_HOST":
            assert op == "MERGE"
            hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
            for vhost in hcm["route_config"]["virtual_hosts"]:
                merge(vhost, value)
        else:
            pytest.fail(f"the test does not apply {patch['applyTo']} patches yet")
    # Request bodies up to the router's limit are buffered; the listener's own buffers stay at Envoy's 1 MiB.
    assert listener["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]["virtual_hosts"][0]["request_body_buffer_limit"] >= 16 << 20
    assert "per_connection_buffer_limit_bytes" not in listener
    assert "override_host" in json.dumps(clusters[vllm]["load_balancing_policy"])
    assert [f["name"] for f in http_filters][-1] == router["name"]
    return listener, clusters, http_filters, vllm


def validates(tmp_path, listener, clusters, env=None):
    """Whether Envoy validates the bootstrap; its output when not."""
    bootstrap = tmp_path / "gateway.yaml"
    bootstrap.write_text(yaml.safe_dump({"static_resources": {"listeners": [listener], "clusters": list(clusters.values())}}))
    r = subprocess.run([ENVOY, "--mode", "validate", "-c", bootstrap, "--disable-hot-restart"], capture_output=True, text=True,
                       env={**os.environ, **(env or {})})
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])


def test_the_envoyfilter_applied_to_a_gateway_bootstrap_passes_envoy_validate(tmp_path):
    objs = build("overlays/istio/without-inferencepool")
    config, _ = routing_file(objs)
    listener, clusters, http_filters, vllm = gateway(objs)
    # Every ext_proc filter's cluster is the Inferrail Service's ext_proc port.
    names = [f["name"] for f in http_filters]
    assert names == ["inferrail.route", "inferrail.observe", "envoy.filters.http.router"]
    for f in http_filters[:-1]:
        grpc = f["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"]
        service, namespace, port = istio_cluster(grpc)
        assert namespace == NAMESPACE and port == port_of(config["server"]["listen"])
        assert port in [p["port"] for p in one(objs, "Service", service)["spec"]["ports"]]
        clusters.setdefault(grpc, {
            "name": grpc, "type": "STATIC", "connect_timeout": "1s",
            "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}}},
            "load_assignment": {"cluster_name": grpc, "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}]}})
    # The same filters as the project's own, but for the cluster's name.
    own = own_filters()
    for f in http_filters[:-1]:
        mine = copy.deepcopy(f)
        mine["typed_config"]["grpc_service"] = own[f["name"]]["typed_config"]["grpc_service"]
        assert mine == own[f["name"]], f["name"]
    validates(tmp_path, listener, clusters)


def needs_the_module():
    """Skips, and says so, when the router or the module is not built."""
    for path in (INFERRAIL, INFERRAIL.parent / "libinferrail_module.so"):
        if not path.exists():
            pytest.skip(f"{path} is not built (cargo build -p inferrail -p inferrail-module; `just test` builds them first)")


def module_overlay(name, kinds, tmp_path):
    """A module overlay's objects, each past its schema and in the namespace,
    with `kinds` among them and none of the router's own pods or cluster
    rights; its routing ConfigMap, and that file (written to `tmp_path`),
    which passes `inferrail --check`."""
    needs_the_module()
    objs = build(name)
    for obj in objs:
        validate(obj)
        assert obj["metadata"]["namespace"] == NAMESPACE, (obj["kind"], obj["metadata"]["name"])
    found = {o["kind"] for o in objs}
    assert kinds | {"ConfigMap", "Role", "RoleBinding"} <= found, found
    assert not found & {"Deployment", "ServiceAccount", "PodDisruptionBudget", "NetworkPolicy", "ClusterRole", "ClusterRoleBinding"}, found
    routing = one(objs, "ConfigMap", "inferrail-config")
    path = tmp_path / "inferrail.yaml"
    path.write_text(routing["data"]["inferrail.yaml"])
    r = subprocess.run([INFERRAIL, "--check", "--config", path], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return objs, routing, path


def test_the_module_overlay_loads_the_module_into_the_gateway_and_envoy_validates_it(tmp_path):
    """overlays/istio/module: every object passes its schema, no router runs
    beside the gateway, the gateway's options mount the routing file the
    filter names and the module where Envoy looks for it, the peers'
    Service selects the gateway's pods on the router's listener, the RBAC
    binds the gateway's service account; the EnvoyFilter applied to a
    gateway bootstrap passes `envoy --mode validate` with the real module,
    which builds the router from the routing file."""
    objs, routing, path = module_overlay("overlays/istio/module", {"EnvoyFilter", "HTTPRoute", "Service"}, tmp_path)
    config = yaml.safe_load(routing["data"]["inferrail.yaml"])
    assert "sidecar" not in config.get("load", {}), "no scraper sidecar runs in the gateway's pods"
    # The gateway's pods: the Gateway of the route, its pods' label, its service account (<gateway>-istio).
    gateway_name = one(objs, "HTTPRoute")["spec"]["parentRefs"][0]["name"]
    pods = {"gateway.networking.k8s.io/gateway-name": gateway_name}
    deployment = yaml.safe_load(one(objs, "ConfigMap", "inference-gateway-options")["data"]["deployment"])
    pod = deployment["spec"]["template"]["spec"]
    proxy = pod["containers"][0]
    assert proxy["name"] == "istio-proxy" and len(pod["containers"]) == 1
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in proxy["volumeMounts"]}
    env = {e["name"]: e["value"] for e in proxy["env"]}
    assert volumes["inferrail-config"]["configMap"]["name"] == routing["metadata"]["name"]
    assert env["ENVOY_DYNAMIC_MODULES_SEARCH_PATH"] == mounts["inferrail-module"] and "image" in volumes["inferrail-module"]
    # The filter names the mounted routing file and the module by its library name.
    listener, clusters, http_filters, _ = gateway(objs)
    assert [f["name"] for f in http_filters] == ["inferrail.module", "envoy.filters.http.router"]
    module = http_filters[0]["typed_config"]
    assert module["filter_config"]["value"] == f"{mounts['inferrail-config']}/inferrail.yaml"
    assert module["dynamic_module_config"]["name"] == "inferrail_module"
    # The same filter as envoy/module.yaml, but for the routing file's path.
    own = next(f for f in yaml.safe_load((ROOT / "envoy" / "module.yaml").read_text())["static_resources"]["listeners"][0]
               ["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"] if f["name"] == "inferrail.module")
    mine = copy.deepcopy(http_filters[0])
    mine["typed_config"]["filter_config"]["value"] = own["typed_config"]["filter_config"]["value"]
    assert mine == own
    # The peers' Service is the gateway's pods on the router's listener.
    port = port_of(config["server"]["listen"])
    service = one(objs, "Service", "inferrail-peers")["spec"]
    assert service["selector"] == pods and [p["targetPort"] for p in service["ports"]] == [port], service
    assert {"name": "inferrail-grpc", "containerPort": port, "protocol": "TCP"} in proxy["ports"]
    assert config["peers"]["dns"] == f"inferrail-peers.{NAMESPACE}.svc.cluster.local:{port}"
    binding = one(objs, "RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": f"{gateway_name}-istio"}]
    assert binding["roleRef"]["name"] == one(objs, "Role")["metadata"]["name"]
    # Envoy loads the module and the router reads the routing file, starting nothing (validate mode).
    module["filter_config"]["value"] = str(path)
    validates(tmp_path, listener, clusters, env={"ENVOY_DYNAMIC_MODULES_SEARCH_PATH": str(INFERRAIL.parent)})


def test_the_envoy_gateway_module_overlay_registers_the_module_and_envoy_loads_what_it_writes(tmp_path):
    """overlays/envoy-gateway/module: the EnvoyProxy registers the module
    from the volume it mounts, on Envoy 1.40, with the routing file the
    EnvoyExtensionPolicy names; the peers' Service selects the proxies and
    the RoleBinding names their service account; and the filter Envoy
    Gateway writes from them (the module by its path, the config as a
    JSON string) passes `envoy --mode validate` with the real module."""
    objs, routing, path = module_overlay("overlays/envoy-gateway/module", {"EnvoyProxy", "EnvoyExtensionPolicy", "BackendTrafficPolicy"}, tmp_path)
    proxy = one(objs, "EnvoyProxy")["spec"]
    deployment = proxy["provider"]["kubernetes"]["envoyDeployment"]
    assert deployment["container"]["image"].endswith(":distroless-v1.40.0"), "the module's ABI is Envoy 1.40's"
    mounts = {m["name"]: m["mountPath"] for m in deployment["container"]["volumeMounts"]}
    volumes = {v["name"]: v for v in deployment["pod"]["volumes"]}
    assert volumes["inferrail-config"]["configMap"]["name"] == routing["metadata"]["name"]
    (entry,) = proxy["dynamicModules"]
    assert entry["source"]["local"]["path"] == f"{mounts['inferrail-module']}/libinferrail_module.so" and "image" in volumes["inferrail-module"]
    (module,) = one(objs, "EnvoyExtensionPolicy")["spec"]["dynamicModule"]
    assert module["name"] == entry["name"] and module["config"] == f"{mounts['inferrail-config']}/inferrail.yaml"
    assert "extProc" not in one(objs, "EnvoyExtensionPolicy")["spec"]
    # Each request to the pod the module named, by the header it sets.
    override = one(objs, "BackendTrafficPolicy")["spec"]["loadBalancer"]["endpointOverride"]["extractFrom"]
    assert override == [{"header": "x-gateway-destination-endpoint"}]
    gateway_name = one(objs, "HTTPRoute")["spec"]["parentRefs"][0]["name"]
    assert one(objs, "Service", "inferrail-peers")["spec"]["selector"] == {"gateway.envoyproxy.io/owning-gateway-name": gateway_name}
    account = proxy["provider"]["kubernetes"]["envoyServiceAccount"]["name"]
    assert one(objs, "RoleBinding")["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    # The filter as Envoy Gateway writes it (internal/xds/translator/dynamicmodule.go), in envoy/module.yaml's place.
    bootstrap = yaml.safe_load((ROOT / "envoy" / "module.yaml").read_text())
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    written = {"@type": "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter",
               "dynamic_module_config": {"module": {"local": {"filename": str(INFERRAIL.parent / "libinferrail_module.so")}},
                                         "do_not_close": entry["doNotClose"]},
               "filter_name": module["filterName"],
               "filter_config": {"@type": "type.googleapis.com/google.protobuf.StringValue", "value": json.dumps(str(path))}}
    (at,) = [i for i, f in enumerate(hcm["http_filters"]) if f["name"] == "inferrail.module"]
    hcm["http_filters"][at]["typed_config"] = written
    (tmp_path / "gateway.yaml").write_text(yaml.safe_dump(bootstrap))
    r = subprocess.run([ENVOY, "--mode", "validate", "-c", tmp_path / "gateway.yaml", "--disable-hot-restart"], capture_output=True, text=True)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])


def own_filters():
    """The project's own ext_proc filters by name: the route filter and the
    observe filter gateways use where no access log is added."""
    snippets = ROOT / "envoy" / "filters"
    return {f["name"]: f for s in ("http-filters.yaml", "observe.yaml") for f in yaml.safe_load((snippets / s).read_text())}


def test_the_envoy_gateway_policies_write_the_same_filters_and_pick_the_named_pod():
    objs = build("overlays/envoy-gateway/without-ai-gateway")
    config, _ = routing_file(objs)
    route = one(objs, "HTTPRoute")
    to_route = [{"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "name": route["metadata"]["name"]}]
    eep = one(objs, "EnvoyExtensionPolicy")["spec"]
    btp = one(objs, "BackendTrafficPolicy")["spec"]
    ctp = one(objs, "ClientTrafficPolicy")["spec"]
    assert eep["targetRefs"] == to_route and btp["targetRefs"] == to_route
    assert ctp["targetRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": route["spec"]["parentRefs"][0]["name"]}]
    ext_proc = port_of(config["server"]["listen"])
    for f in eep["extProc"]:
        assert f["backendRefs"] == [{"group": "", "kind": "Service", "name": "inferrail", "port": ext_proc}]
        assert f["failOpen"] is True
        assert f["backendSettings"]["circuitBreaker"]["maxParallelRequests"] >= 100000
    decide, observe = eep["extProc"]
    own = {name: f["typed_config"] for name, f in own_filters().items()}
    route_mode = own["inferrail.route"]["processing_mode"]
    assert (route_mode["request_body_mode"], route_mode["response_header_mode"]) == ("BUFFERED", "SEND")
    # Headers SEND, body BUFFERED; response headers SEND (present) with the same attributes.
    assert decide["processingMode"] == {"request": {"body": "Buffered"}, "response": {"attributes": own["inferrail.route"]["response_attributes"]}}
    assert decide["messageTimeout"] == own["inferrail.route"]["message_timeout"]
    assert observe["shadowMode"] is True and own["inferrail.observe"]["observability_mode"] is True
    assert observe["processingMode"] == {"response": {"body": "Streamed", "attributes": own["inferrail.observe"]["response_attributes"]}}
    # The pod Inferrail named, then its fallbacks, as many retries as fallbacks.
    assert btp["loadBalancer"]["endpointOverride"]["extractFrom"] == [{"header": "x-gateway-destination-endpoint"}]
    assert btp["retry"]["numRetries"] == config["retry"]["fallbacks"] >= 1
    assert ctp["headers"]["earlyRequestHeaders"]["remove"] == ["x-gateway-destination-endpoint"]
    assert ctp["connection"]["bufferLimit"] == "16Mi"
