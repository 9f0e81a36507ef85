"""The part of an API server that `helm template --dry-run=server` reads, on loopback: enough to
run the chart's `lookup` against objects a test puts there, the way `helm upgrade` runs it.

Helm asks for, in order: `/version` (its capabilities), discovery (`/api`, `/apis`, then each
group version's resource list, to map every kind it rendered to a resource), and a GET of each
rendered object, both the ones `lookup` names and the ones it checks for ownership before an
install; it creates nothing. The answers follow the API server's wire format
(k8s.io/apimachinery/pkg/apis/meta/v1/types.go: `APIVersions`, `APIGroupList`, `APIResourceList`,
and `Status` with reason `NotFound` and code 404 for an object that is not there, as
apiserver/pkg/endpoints/handlers/responsewriters/status.go writes it). client-go asks for the
aggregated discovery form first (`Accept: application/json;g=apidiscovery.k8s.io;v=v2;...,
application/json`) and reads the answer by its Content-Type; the plain `application/json` lists are
what an API server without aggregated discovery sends (client-go discovery/discovery_client.go,
`downloadAPIs`).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any

from tests.support.fakekube import send_json

# (group, resource, kind, namespaced) of every kind the chart renders with its defaults
RESOURCES = [
    ("", "secrets", "Secret", True),
    ("", "services", "Service", True),
    ("", "serviceaccounts", "ServiceAccount", True),
    ("", "configmaps", "ConfigMap", True),
    ("apps", "deployments", "Deployment", True),
    ("apps", "daemonsets", "DaemonSet", True),
    ("policy", "poddisruptionbudgets", "PodDisruptionBudget", True),
    ("rbac.authorization.k8s.io", "clusterroles", "ClusterRole", False),
    ("rbac.authorization.k8s.io", "clusterrolebindings", "ClusterRoleBinding", False),
    ("rbac.authorization.k8s.io", "roles", "Role", True),
    ("rbac.authorization.k8s.io", "rolebindings", "RoleBinding", True),
    ("admissionregistration.k8s.io", "mutatingwebhookconfigurations", "MutatingWebhookConfiguration", False),
    ("admissionregistration.k8s.io", "validatingwebhookconfigurations", "ValidatingWebhookConfiguration", False),
    ("apiextensions.k8s.io", "customresourcedefinitions", "CustomResourceDefinition", False),
]


def object_path(obj: dict[str, Any]) -> str:
    """The URL path the API server serves an object at."""
    group_version = obj["apiVersion"]
    ((resource, namespaced),) = [
        (r, ns) for g, r, k, ns in RESOURCES if k == obj["kind"] and (f"{g}/v1" if g else "v1") == group_version
    ]
    prefix = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    meta = obj["metadata"]
    where = f"/namespaces/{meta['namespace']}" if namespaced else ""
    return f"{prefix}{where}/{resource}/{meta['name']}"


class HelmKube:
    """The server, with `objects` stored; `kubeconfig` is the file helm's --kubeconfig takes."""

    def __init__(self, objects: list[dict[str, Any]], work: Path, version: str) -> None:
        self.objects = {object_path(o): o for o in objects}
        self.version = version
        self.kubeconfig = work / "kubeconfig"
        self.gets: list[str] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _answer(self, path: str) -> dict[str, Any] | None:
        major, minor, _ = self.version.split(".")
        groups = sorted({g for g, *_ in RESOURCES if g})
        if path == "/version":
            return {"major": major, "minor": minor, "gitVersion": f"v{self.version}"}
        if path == "/api":
            return {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}
        if path == "/apis":
            version = [{"groupVersion": f"{g}/v1", "version": "v1"} for g in groups]
            return {
                "kind": "APIGroupList",
                "apiVersion": "v1",
                "groups": [
                    {"name": g, "versions": [v], "preferredVersion": v} for g, v in zip(groups, version, strict=True)
                ],
            }
        for group in ["", *groups]:
            group_version = f"{group}/v1" if group else "v1"
            if path == ("/api/v1" if not group else f"/apis/{group_version}"):
                return {
                    "kind": "APIResourceList",
                    "apiVersion": "v1",
                    "groupVersion": group_version,
                    "resources": [
                        {"name": r, "singularName": "", "namespaced": ns, "kind": k, "verbs": ["get", "list"]}
                        for g, r, k, ns in RESOURCES
                        if g == group
                    ],
                }
        return self.objects.get(path)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        kube = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                kube.gets.append(path)
                body = kube._answer(path)
                code = 200 if body is not None else 404
                if body is None:
                    body = {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "metadata": {},
                        "status": "Failure",
                        "message": f"{path} not found",
                        "reason": "NotFound",
                        "code": 404,
                    }
                send_json(self, code, body)

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

        return Handler

    def __enter__(self) -> HelmKube:
        self._thread.start()
        host, port = self._server.server_address[:2]
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": f"http://{host!s}:{port}"}}],
            "users": [{"name": "test", "user": {"token": "test"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "test"}}],
            "current-context": "fake",
        }
        self.kubeconfig.write_text(json.dumps(config))
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
