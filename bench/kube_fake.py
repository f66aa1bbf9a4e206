"""A Kubernetes API server for the stress suite's churn: just enough of the
list and watch protocol for Inferrail's pool discovery (one InferencePool,
no InferenceObjectives, the pool's pods), over plain HTTP, for a router
pointed at it by a kubeconfig. Pods change through `set_ready` and
`recreate`; every change is a new resourceVersion, told to the open pod
watches and kept, so a watch from an older version gets what it missed,
as the real server sends it."""

import json
import queue
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

POOLS = "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools"
OBJECTIVES = "/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/{ns}/inferenceobjectives"
PODS = "/api/v1/namespaces/{ns}/pods"


class KubeFake:
    def __init__(self, pool, namespace, port, pods):
        """`pods`: {name: ip}; each starts ready, its engine on `port`."""
        self.pool, self.ns, self.port = pool, namespace, port
        self.lock = threading.Lock()
        self.version = 1
        self.pods = {}  # name -> pod object
        self.told = []  # (version, event line)
        self.watches = []  # queues of open pod watches
        self.uids = 0
        self.requests = 0
        for name, ip in pods.items():
            self._put(self._pod(name, ip, True))
        handler = type("Handler", (_Handler,), {"fake": self})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def kubeconfig(self, path):
        """Writes a kubeconfig naming this server; returns its path."""
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": self.ns}}]}))
        return path

    def _pod(self, name, ip, ready):
        self.uids += 1
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": self.ns, "uid": f"{name}-{self.uids}", "labels": {"app": "engine"}},
                "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}

    def _put(self, pod, kind=None):
        """Stores `pod` as the next version and tells the watches (caller holds no lock)."""
        with self.lock:
            self.version += 1
            pod["metadata"]["resourceVersion"] = str(self.version)
            name = pod["metadata"]["name"]
            kind = kind or ("MODIFIED" if name in self.pods else "ADDED")
            if kind == "DELETED":
                self.pods.pop(name, None)
            else:
                self.pods[name] = pod
            line = json.dumps({"type": kind, "object": pod}) + "\n"
            self.told.append((self.version, line))
            for w in self.watches:
                w.put(line)

    def set_ready(self, ready):
        """Marks the pods named in `ready` ready and the others not, each that changes as a new version."""
        for name, pod in list(self.pods.items()):
            now = pod["status"]["conditions"][0]["status"] == "True"
            if now != (name in ready):
                changed = json.loads(json.dumps(pod))
                changed["status"]["conditions"][0]["status"] = "True" if name in ready else "False"
                self._put(changed)

    def recreate(self, name):
        """Deletes pod `name` and creates it again under a new uid, ready, at the same IP."""
        pod = self.pods[name]
        self._put(json.loads(json.dumps(pod)), "DELETED")
        self._put(self._pod(name, pod["status"]["podIP"], True))

    def stop(self):
        with self.lock:
            for w in self.watches:
                w.put(None)
        self.server.shutdown()
        self.server.server_close()

    def answer(self, path, query):
        """(status, JSON body) for a list, or a queue of event lines for a watch."""
        self.requests += 1
        watch = query.get("watch") in ("true", "1")
        ns = self.ns
        if watch:
            q = queue.Queue()
            if path == PODS.format(ns=ns):
                since = int(query.get("resourceVersion") or 0)
                with self.lock:
                    for version, line in self.told:
                        if version > since:
                            q.put(line)
                    self.watches.append(q)
            return 200, q  # the pool and the objectives never change: open and silent
        if path == POOLS.format(ns=ns):
            pool = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
                    "metadata": {"name": self.pool, "namespace": ns, "uid": "pool-1", "resourceVersion": "1"},
                    "spec": {"selector": {"matchLabels": {"app": "engine"}}, "targetPorts": [{"number": self.port}],
                             "endpointPickerRef": {"name": "inferrail", "port": {"number": 9002}}}}
            return 200, {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePoolList",
                         "metadata": {"resourceVersion": "1"}, "items": [pool]}
        if path == OBJECTIVES.format(ns=ns):
            return 200, {"apiVersion": "inference.networking.x-k8s.io/v1alpha2", "kind": "InferenceObjectiveList",
                         "metadata": {"resourceVersion": str(self.version)}, "items": []}
        if path == PODS.format(ns=ns):
            with self.lock:
                return 200, {"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": str(self.version)},
                             "items": list(self.pods.values())}
        return 404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    fake = None

    def log_message(self, *args):
        pass

    def do_GET(self):
        path, _, qs = self.path.partition("?")
        query = dict(kv.split("=", 1) if "=" in kv else (kv, "") for kv in qs.split("&") if kv)
        status, body = self.fake.answer(path, query)
        if isinstance(body, queue.Queue):
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            try:
                while (line := body.get()) is not None:
                    data = line.encode()
                    self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                    self.wfile.flush()
            except OSError:
                pass  # the watcher went away
            finally:
                with self.fake.lock:
                    if body in self.fake.watches:
                        self.fake.watches.remove(body)
            self.close_connection = True
            return
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
