"""A small fake kube-apiserver on loopback for tests that talk through the real `kubernetes` client.

It serves exactly what crihook uses, the way the API server does it on the wire:
- core/v1 `nodes` (+ `/status`) and `pods` (+ `/status`, `/binding`; `namespaces/{ns}/bindings` too),
- the cluster-scoped custom resource `devices.scheduling.koordinator.sh/v1alpha1` (+ `/status`);
- `coordination.k8s.io/v1` `leases` (leader election);
- TokenReview and SubjectAccessReview (POST only), answered from `tokens` and `allowed`;
- `/version` (the `version` field);
- `resource.k8s.io/v1` `resourceslices`, `resourceclaims` (+ `/status`) and
  `resourceclaimtemplates`, or none (`FakeKube(dra=False)`: a cluster that does not serve DRA
  answers 404);
- GET, LIST (with a list `resourceVersion`, label and field selectors), POST, PUT, PATCH (merge,
  strategic merge for maps and keyed lists, JSON patch), DELETE (with preconditions), `Status`
  bodies for every error;
- `?watch=true` streams: chunked JSON lines of ADDED/MODIFIED/DELETED from a resourceVersion, or the
  current state as ADDED first when none is given.
Status subresources behave as on the API server: a PUT or PATCH of the object ignores `status`, and
one of `/status` changes only `status`. A resource in `no_status` is served as a custom resource
whose definition declares no status subresource (Koordinator's Device CRD): `/status` is 404 and a
write of the object writes its `status` too.

Where each rule comes from (kubernetes/kubernetes, paths under staging/src/k8s.io/ for apiserver and
apimachinery):
- 409 Conflict on a stale resourceVersion: a PUT carrying `metadata.resourceVersion` is a
  precondition of `GuaranteedUpdate` (apiserver/pkg/registry/generic/registry/store.go, `Update`),
  failing with `OptimisticLockErrorMsg` ("the object has been modified; please apply your changes to
  the latest version and try again"). A PATCH whose result carries a resourceVersion other than the
  current one fails the same way (apiserver/pkg/endpoints/handlers/patch.go applies the patch to the
  current object, then updates with the patched object's resourceVersion); a patch without one
  applies to the latest. A Binding checks `metadata.uid` and `metadata.resourceVersion` as
  preconditions and merges its annotations into the pod (pkg/registry/core/pod/storage/storage.go,
  `BindingREST.setPodHostAndAnnotations`): "Precondition failed: ResourceVersion in precondition: …".
  A write that changes nothing keeps the resourceVersion (store.go skips the etcd write).
- Leases: the fields of `LeaseSpec` (k8s.io/api/coordination/v1/types.go: holderIdentity,
  leaseDurationSeconds, acquireTime, renewTime, leaseTransitions); acquireTime and renewTime are
  `MicroTime`, decoded with the layout "2006-01-02T15:04:05.000000Z07:00"
  (apimachinery/pkg/apis/meta/v1/micro_time.go), so another form is a 400 decoding error;
  leaseDurationSeconds must be greater than 0 and leaseTransitions not negative (422,
  pkg/apis/coordination/validation/validation.go, `ValidateLeaseSpec`). The API server does not
  judge expiry: holders do, from the renewTime they observe (client-go tools/leaderelection).
- LISTs of pods whose field selector names one `spec.nodeName` (kubelet's, and the scheduler's
  claims) read an index on that field, as the API server's watch cache does
  (pkg/registry/core/pod/strategy.go: `Indexers` and the `IndexFields` of `PodToSelectableFields`'
  predicate), so one costs the pods of that node, not every pod: a bench against this fake measures
  its client, not a full scan the real server does not do.
- Watches: a resourceVersion in the event history resumes after it; one older than the history
  answers 200 with a single `ERROR` event holding a 410 `Expired` Status, "too old resource
  version" (apiserver/pkg/storage/cacher/watch_cache.go, `getAllEventsSinceLocked`, sent through an
  error watcher by cacher.go); `compact()` plays etcd's compaction. The docs: "Efficient detection
  of changes" in https://kubernetes.io/docs/reference/using-api/api-concepts/. An event is encoded
  once for every watcher that sees it, as the cacher does (apiserver/pkg/storage/cacher/
  caching_object.go).

Fault knobs for tests: `fail_next(n, code)` answers the next n matching requests with an error
Status, `delay` slows every request, `compact()` forgets the event history (a later resume gets 410)
and `close_watches()` ends every open watch the way an API server restart or timeout does.

    with FakeKube() as kube:
        api = kubernetes.client.CoreV1Api(kube.api_client())
"""

from __future__ import annotations

import bisect
import json
import re
import socket
import ssl
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

JSON = dict[str, Any]

DEVICE_GROUP = "scheduling.koordinator.sh"
DEVICE_VERSION = "v1alpha1"


@dataclass(frozen=True)
class Resource:
    plural: str
    kind: str
    group: str  # "" for core
    version: str
    namespaced: bool

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        """How the API server names the resource in messages: `pods`, `devices.scheduling.koordinator.sh`."""
        return f"{self.plural}.{self.group}" if self.group else self.plural


NODES = Resource("nodes", "Node", "", "v1", namespaced=False)
PODS = Resource("pods", "Pod", "", "v1", namespaced=True)
DEVICES = Resource("devices", "Device", DEVICE_GROUP, DEVICE_VERSION, namespaced=False)
LEASES = Resource("leases", "Lease", "coordination.k8s.io", "v1", namespaced=True)
# DRA (k8s.io/api/resource/v1): slices are cluster-scoped, claims namespaced with a status subresource
RESOURCE_SLICES = Resource("resourceslices", "ResourceSlice", "resource.k8s.io", "v1", namespaced=False)
RESOURCE_CLAIMS = Resource("resourceclaims", "ResourceClaim", "resource.k8s.io", "v1", namespaced=True)
RESOURCE_CLAIM_TEMPLATES = Resource(
    "resourceclaimtemplates", "ResourceClaimTemplate", "resource.k8s.io", "v1", namespaced=True
)
DRA = (RESOURCE_SLICES, RESOURCE_CLAIMS, RESOURCE_CLAIM_TEMPLATES)
RESOURCES = {r.plural: r for r in (NODES, PODS, DEVICES, LEASES, *DRA)}

# metav1.MicroTime's wire form (RFC3339Micro): exactly six fractional digits
MICRO_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}(Z|[+-]\d\d:\d\d)$")

# Strategic merge patch: list fields merged by key rather than replaced (the ones our objects carry).
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
    "conditions": "type",
    "addresses": "type",
    "containerStatuses": "name",
    "initContainerStatuses": "name",
    "ownerReferences": "uid",
}


class ApiError(Exception):
    """Answered as a `Status` body with `code`."""

    def __init__(self, code: int, reason: str, message: str, details: JSON | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details

    def status(self) -> JSON:
        body: JSON = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details is not None:
            body["details"] = self.details
        return body


def _details(res: Resource, name: str) -> JSON:
    d: JSON = {"name": name, "kind": res.plural}
    if res.group:
        d["group"] = res.group
    return d


def not_found(res: Resource, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{res.qualified} "{name}" not found', _details(res, name))


def conflict(res: Resource, name: str, why: str) -> ApiError:
    return ApiError(
        409, "Conflict", f'Operation cannot be fulfilled on {res.qualified} "{name}": {why}', _details(res, name)
    )


STALE = "the object has been modified; please apply your changes to the latest version and try again"


def _clone(doc: Any) -> Any:
    """A deep copy of a JSON document: several times cheaper than copy.deepcopy, which keeps a memo
    for shared and cyclic references that JSON cannot have."""
    if type(doc) is dict:
        return {k: _clone(v) for k, v in doc.items()}
    if type(doc) is list:
        return [_clone(v) for v in doc]
    return doc


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# --- patches ------------------------------------------------------------------------------------


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return _clone(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """Kubernetes strategic merge patch for the cases our objects have: maps merge, `null` deletes,
    keyed lists (MERGE_KEYS) merge element-wise, `$patch: replace|delete` on a map; other lists replace."""
    if not isinstance(patch, dict):
        return _clone(patch)
    directive = patch.get("$patch")
    if directive == "replace":
        return {k: _clone(v) for k, v in patch.items() if k != "$patch"}
    if directive == "delete":
        return None
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if k.startswith("$"):
            continue
        if v is None:
            out.pop(k, None)
        elif isinstance(v, list) and k in MERGE_KEYS and isinstance(out.get(k), list):
            out[k] = _merge_list(out[k], v, MERGE_KEYS[k])
        else:
            merged = strategic_merge_patch(out.get(k), v)
            if merged is None:
                out.pop(k, None)
            else:
                out[k] = merged
    return out


def _merge_list(current: list[Any], patch: list[Any], key: str) -> list[Any]:
    out = [_clone(x) for x in current]
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise ApiError(422, "Invalid", f"strategic merge patch: list item without merge key {key!r}")
        at = next((i for i, x in enumerate(out) if isinstance(x, dict) and x.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if at is not None:
                del out[at]
        elif at is None:
            out.append({k: v for k, v in item.items() if not k.startswith("$")})
        else:
            out[at] = strategic_merge_patch(out[at], item)
    return out


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise ApiError(422, "Invalid", f"json patch: path {path!r} must start with '/'")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _walk(doc: Any, parts: list[str]) -> Any:
    for p in parts:
        if isinstance(doc, dict) and p in doc:
            doc = doc[p]
        elif isinstance(doc, list) and p.isdigit() and int(p) < len(doc):
            doc = doc[int(p)]
        else:
            raise ApiError(422, "Invalid", f"json patch: path /{'/'.join(parts)} does not exist")
    return doc


def json_patch(doc: Any, ops: Any) -> Any:
    """RFC 6902 JSON patch: add, remove, replace, move, copy, test."""
    if not isinstance(ops, list):
        raise ApiError(400, "BadRequest", "json patch: expected a list of operations")
    doc = _clone(doc)
    for op in ops:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise ApiError(400, "BadRequest", f"json patch: malformed operation {op!r}")
        kind, parts = op["op"], _pointer(op["path"])
        if kind == "test":
            if _walk(doc, parts) != op.get("value"):
                raise ApiError(422, "Invalid", f"json patch: test failed at {op['path']}")
            continue
        if kind in ("move", "copy"):
            src = _pointer(op.get("from", ""))
            value = _clone(_walk(doc, src))
            if kind == "move":
                doc = _remove(doc, src)
            doc = _add(doc, parts, value)
        elif kind == "add":
            doc = _add(doc, parts, _clone(op.get("value")))
        elif kind == "remove":
            doc = _remove(doc, parts)
        elif kind == "replace":
            _walk(doc, parts)
            doc = _add(_remove(doc, parts), parts, _clone(op.get("value")))
        else:
            raise ApiError(400, "BadRequest", f"json patch: unknown op {kind!r}")
    return doc


def _add(doc: Any, parts: list[str], value: Any) -> Any:
    if not parts:
        return value
    parent, last = _walk(doc, parts[:-1]), parts[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list) and (last == "-" or (last.isdigit() and int(last) <= len(parent))):
        parent.insert(len(parent) if last == "-" else int(last), value)
    else:
        raise ApiError(422, "Invalid", f"json patch: can not add at /{'/'.join(parts)}")
    return doc


def _remove(doc: Any, parts: list[str]) -> Any:
    if not parts:
        return None
    parent, last = _walk(doc, parts[:-1]), parts[-1]
    _walk(parent, [last])
    if isinstance(parent, dict):
        del parent[last]
    else:
        del parent[int(last)]
    return doc


# --- selectors ----------------------------------------------------------------------------------

_SET_RE = re.compile(r"^\s*([^\s!=]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def _split_selector(text: str) -> list[str]:
    """Split on commas outside parentheses (`a in (x,y),b=c`)."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def label_matcher(text: str) -> Callable[[Mapping[str, str]], bool]:
    """A label selector: `k=v`, `k==v`, `k!=v`, `k in (a,b)`, `k notin (a)`, `k`, `!k`."""
    tests: list[Callable[[Mapping[str, str]], bool]] = []
    for term in _split_selector(text):
        if m := _SET_RE.match(term):
            key, op, vals = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",")}
            if op == "in":
                tests.append(lambda lb, k=key, vs=vals: lb.get(k) in vs)
            else:
                tests.append(lambda lb, k=key, vs=vals: lb.get(k) not in vs)
        elif "!=" in term:
            k, v = (s.strip() for s in term.split("!=", 1))
            tests.append(lambda lb, k=k, v=v: lb.get(k) != v)
        elif "=" in term:
            k, v = (s.strip() for s in term.replace("==", "=").split("=", 1))
            tests.append(lambda lb, k=k, v=v: lb.get(k) == v)
        elif term.startswith("!"):
            absent = term[1:].strip()
            tests.append(lambda lb, k=absent: k not in lb)
        else:
            tests.append(lambda lb, k=term: k in lb)
    return lambda labels: all(t(labels) for t in tests)


FIELDS: dict[str, Callable[[JSON], str]] = {
    "metadata.name": lambda o: o.get("metadata", {}).get("name", ""),
    "metadata.namespace": lambda o: o.get("metadata", {}).get("namespace", ""),
    "spec.nodeName": lambda o: (o.get("spec") or {}).get("nodeName", ""),
    "spec.driver": lambda o: (o.get("spec") or {}).get("driver", ""),
    "status.phase": lambda o: (o.get("status") or {}).get("phase", ""),
}


def field_matcher(text: str) -> Callable[[JSON], bool]:
    tests: list[Callable[[JSON], bool]] = []
    for term in _split_selector(text):
        neg = "!=" in term
        k, v = (s.strip() for s in term.replace("!=", "=").replace("==", "=").split("=", 1))
        if k not in FIELDS:
            raise ApiError(400, "BadRequest", f'"{k}" is not a known field selector: only "{", ".join(FIELDS)}"')
        get = FIELDS[k]
        tests.append(lambda o, get=get, v=v, neg=neg: (get(o) == v) != neg)
    return lambda obj: all(t(obj) for t in tests)


# --- the store ----------------------------------------------------------------------------------


@dataclass
class Event:
    rv: int
    res: Resource
    type: str  # ADDED, MODIFIED, DELETED
    obj: JSON
    old: JSON | None = None
    lines: dict[str, bytes] = field(default_factory=dict)  # the event as a watch line, by type

    def line(self, kind: str) -> bytes:
        """`{"type": kind, "object": obj}` as one JSON line, encoded once for every watcher."""
        out = self.lines.get(kind)
        if out is None:
            out = self.lines[kind] = _line(kind, self.obj)
        return out


@dataclass
class Fault:
    count: int
    code: int
    method: str | None
    path: str | None
    reason: str


@dataclass
class Request:
    method: str
    path: str
    query: str
    content_type: str
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class FakeKube:
    """The fake API server. Start with `with FakeKube() as kube:` or start()/stop()."""

    host: str = "127.0.0.1"
    delay: float = 0.0  # seconds added to every request
    history: int = 10_000  # events kept for watch resume
    requests: list[Request] = field(default_factory=list)
    tls: ssl.SSLContext | None = None  # serve HTTPS with this server context
    no_status: frozenset[str] = frozenset()  # plurals without a status subresource
    # TokenReview and SubjectAccessReview: bearer token -> the user it names ({"username", "groups"}),
    # and the (username, non-resource path, verb) the authorizer allows
    tokens: dict[str, JSON] = field(default_factory=dict)
    allowed: set[tuple[str, str, str]] = field(default_factory=set)
    dra: bool = True  # serve resource.k8s.io/v1 (a cluster before 1.34 does not)
    version: tuple[str, str] = ("1", "36")  # what /version answers: major, minor

    def __post_init__(self) -> None:
        self._cond = threading.Condition()
        self._objects: dict[str, dict[tuple[str, str], JSON]] = {r: {} for r in RESOURCES}
        self._on_node: dict[str, set[tuple[str, str]]] = {}  # pods by spec.nodeName ("" unbound)
        self._events: list[Event] = []
        self._rv = 1000
        self._oldest_rv = self._rv  # a watch from below this is too old
        self._faults: list[Fault] = []
        self._watch_gen = 0  # bumped by close_watches()
        self._paused = False  # pause_watches(): open watches deliver nothing until resumed
        self._stopped = False
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle ---

    def start(self) -> FakeKube:
        kube = self

        class Handler(_Handler):
            fake = kube

        self._server = _Server((self.host, 0), Handler)
        if self.tls is not None:
            self._server.socket = self.tls.wrap_socket(self._server.socket, server_side=True)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name="fakekube", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FakeKube:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._server is not None, "not started"
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://{self.host}:{self._server.server_address[1]}"

    def configuration(self) -> Any:
        """A `kubernetes.client.Configuration` pointing at this server."""
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.url
        return cfg

    def api_client(self) -> Any:
        from kubernetes import client

        return client.ApiClient(self.configuration())

    def write_kubeconfig(self, path: Path) -> Path:
        """A kubeconfig file for this server, for code that takes one (crihook's `kubeconfig` settings)."""
        import yaml

        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u"}}],
            "current-context": "fake",
        }
        path.write_text(yaml.safe_dump(doc))
        return path

    # --- fault knobs ---

    def fail_next(self, n: int = 1, code: int = 500, method: str | None = None, path: str | None = None) -> None:
        """Answer the next n requests (optionally only this HTTP method / with this substring in the
        path) with an error Status of this code."""
        reason = {409: "Conflict", 404: "NotFound", 429: "TooManyRequests", 503: "ServiceUnavailable"}.get(
            code, "InternalError"
        )
        with self._cond:
            self._faults.append(Fault(n, code, method.upper() if method else None, path, reason))

    def compact(self) -> None:
        """Forget the event history, as etcd compaction does: resuming a watch from before now gets 410."""
        with self._cond:
            self._events.clear()
            self._oldest_rv = self._rv

    def close_watches(self) -> None:
        """End every open watch stream (the client sees the response end, as on an API server restart)."""
        with self._cond:
            self._watch_gen += 1
            self._cond.notify_all()

    def pause_watches(self, paused: bool = True) -> None:
        """Hold back every watch event (a slow or partitioned API server); False delivers again."""
        with self._cond:
            self._paused = paused
            self._cond.notify_all()

    def _take_fault(self, method: str, path: str) -> Fault | None:
        with self._cond:
            for f in self._faults:
                if (f.method is None or f.method == method) and (f.path is None or f.path in path):
                    f.count -= 1
                    if f.count <= 0:
                        self._faults.remove(f)
                    return f
        return None

    # --- direct access for tests (same rules as the HTTP API) ---

    @property
    def resource_version(self) -> int:
        with self._cond:
            return self._rv

    def get(self, plural: str, name: str, namespace: str = "") -> JSON:
        res = RESOURCES[plural]
        with self._cond:
            obj = self._objects[plural].get((namespace if res.namespaced else "", name))
            if obj is None:
                raise not_found(res, name)
            return _clone(obj)

    def list(self, plural: str) -> list[JSON]:
        with self._cond:
            return [_clone(o) for o in self._objects[plural].values()]

    def create(self, plural: str, obj: JSON, namespace: str | None = None) -> JSON:
        res = RESOURCES[plural]
        ns = namespace if namespace is not None else obj.get("metadata", {}).get("namespace", "default")
        return self._create(res, ns if res.namespaced else "", _clone(obj))

    def put(self, plural: str, obj: JSON, subresource: str = "") -> JSON:
        res = RESOURCES[plural]
        meta = obj.get("metadata", {})
        ns = meta.get("namespace", "default") if res.namespaced else ""
        return self._update(res, ns, meta.get("name", ""), _clone(obj), subresource)

    def patch(
        self,
        plural: str,
        name: str,
        body: Any,
        namespace: str = "",
        content_type: str = "application/merge-patch+json",
        subresource: str = "",
    ) -> JSON:
        res = RESOURCES[plural]
        return self._patch(res, namespace if res.namespaced else "", name, body, content_type, subresource)

    def delete(self, plural: str, name: str, namespace: str = "") -> JSON:
        res = RESOURCES[plural]
        return self._delete(res, namespace if res.namespaced else "", name, None)

    # --- the rules ---

    def _record(self, res: Resource, kind: str, obj: JSON, old: JSON | None) -> None:
        self._events.append(Event(self._rv, res, kind, _clone(obj), old))
        if len(self._events) > self.history:
            dropped = self._events.pop(0)
            self._oldest_rv = dropped.rv
        self._cond.notify_all()

    @staticmethod
    def _validate(res: Resource, obj: JSON) -> None:
        """What the API server checks on the kinds that have rules here (see the module docstring)."""
        if res is not LEASES:
            return
        spec = obj.get("spec") or {}
        name = (obj.get("metadata") or {}).get("name", "")
        for key in ("acquireTime", "renewTime"):
            value = spec.get(key)
            if value is not None and (not isinstance(value, str) or not MICRO_TIME.match(value)):
                raise ApiError(
                    400,
                    "BadRequest",
                    f'Lease in version "v1" cannot be handled as a Lease: parsing time "{value}" as '
                    '"2006-01-02T15:04:05.000000Z07:00": cannot parse as RFC3339Micro',
                )
        for key, low, words in (
            ("leaseDurationSeconds", 1, "greater than 0"),
            ("leaseTransitions", 0, "greater than or equal to 0"),
        ):
            value = spec.get(key)
            if value is not None and (not isinstance(value, int) or value < low):
                raise ApiError(
                    422,
                    "Invalid",
                    f'Lease.coordination.k8s.io "{name}" is invalid: '
                    f"spec.{key}: Invalid value: {value}: must be {words}",
                    {"name": name, "group": "coordination.k8s.io", "kind": "Lease"},
                )

    def _keep(self, res: Resource, key: tuple[str, str], obj: JSON | None) -> None:
        """Stores (or with None drops) an object, keeping the pods' spec.nodeName index."""
        objects = self._objects[res.plural]
        if res is PODS:
            old = objects.get(key)
            if old is not None:
                self._on_node[_node_name(old)].discard(key)
            if obj is not None:
                self._on_node.setdefault(_node_name(obj), set()).add(key)
        if obj is None:
            del objects[key]
        else:
            objects[key] = obj

    def _typed(self, res: Resource, obj: JSON) -> JSON:
        obj["apiVersion"] = res.api_version
        obj["kind"] = res.kind
        return obj

    def _create(self, res: Resource, ns: str, obj: JSON) -> JSON:
        if not isinstance(obj, dict) or not isinstance(obj.get("metadata", {}), dict):
            raise ApiError(400, "BadRequest", f"the body of the request was not a {res.kind}")
        meta = obj.setdefault("metadata", {})
        name = meta.get("name") or ""
        if not name and meta.get("generateName"):
            name = meta["generateName"] + uuid.uuid4().hex[:5]
        if not name:
            raise ApiError(
                422,
                "Invalid",
                f'{res.kind} in version "{res.version}" is invalid: '
                "metadata.name: Required value: name or generateName is required",
                {"kind": res.kind, "causes": [{"reason": "FieldValueRequired", "field": "metadata.name"}]},
            )
        if res.namespaced and meta.get("namespace") not in (None, "", ns):
            raise ApiError(
                400,
                "BadRequest",
                "the namespace of the provided object does not match the namespace sent on the request",
            )
        self._validate(res, obj)
        with self._cond:
            if (ns, name) in self._objects[res.plural]:
                raise ApiError(409, "AlreadyExists", f'{res.qualified} "{name}" already exists', _details(res, name))
            self._rv += 1
            meta.update(name=name, uid=str(uuid.uuid4()), resourceVersion=str(self._rv), creationTimestamp=_now())
            meta.pop("deletionTimestamp", None)
            if res.namespaced:
                meta["namespace"] = ns
            else:
                meta.pop("namespace", None)
            if res is PODS:
                obj.setdefault("status", {}).setdefault("phase", "Pending")
            self._typed(res, obj)
            self._keep(res, (ns, name), obj)
            self._record(res, "ADDED", obj, None)
            return _clone(obj)

    def _update(self, res: Resource, ns: str, name: str, obj: JSON, sub: str, want_rv: str | None = None) -> JSON:
        if not isinstance(obj, dict) or not isinstance(obj.get("metadata"), dict):
            raise ApiError(400, "BadRequest", f"the body of the request was not a {res.kind}")
        meta = obj["metadata"]
        if meta.get("name", name) != name:
            raise ApiError(
                400,
                "BadRequest",
                f"the name of the object ({meta.get('name')}) does not match the name on the URL ({name})",
            )
        with self._cond:
            cur = self._objects[res.plural].get((ns, name))
            if cur is None:
                raise not_found(res, name)
            rv = meta.get("resourceVersion") if want_rv is None else want_rv
            if rv and rv != cur["metadata"]["resourceVersion"]:
                raise conflict(res, name, STALE)
            if meta.get("uid") and meta["uid"] != cur["metadata"]["uid"] and want_rv is not None:
                # a patch: metadata.uid is immutable (a PUT checks it as a precondition, below)
                raise ApiError(
                    422,
                    "Invalid",
                    f'{res.kind} "{name}" is invalid: metadata.uid: Invalid value: "{meta["uid"]}": field is immutable',
                    {"name": name, "kind": res.kind},
                )
            if meta.get("uid") and meta["uid"] != cur["metadata"]["uid"]:
                raise conflict(
                    res,
                    name,
                    f"Precondition failed: UID in precondition: {meta['uid']}, "
                    f"UID in object meta: {cur['metadata']['uid']}",
                )
            new = _clone(cur)
            if sub == "status":
                new["status"] = obj.get("status", {})
            elif res.plural in self.no_status:
                new = {**obj}
                keep = ("uid", "creationTimestamp", "namespace", "name")
                new["metadata"] = {**meta, **{k: cur["metadata"][k] for k in keep if k in cur["metadata"]}}
            else:
                new = {k: v for k, v in obj.items() if k != "status"}
                if "status" in cur:
                    new["status"] = cur["status"]
                if res is PODS:
                    self._check_pod_update(cur, new, name)
                keep = ("uid", "creationTimestamp", "namespace", "name")
                new["metadata"] = {**meta, **{k: cur["metadata"][k] for k in keep if k in cur["metadata"]}}
            self._validate(res, new)
            if _same(cur, new):
                return _clone(cur)  # a no-op write does not bump resourceVersion
            self._rv += 1
            new["metadata"]["resourceVersion"] = str(self._rv)
            self._typed(res, new)
            self._keep(res, (ns, name), new)
            self._record(res, "MODIFIED", new, cur)
            return _clone(new)

    def _review(self, path: str, body: Any) -> JSON:
        """A TokenReview or SubjectAccessReview answered from `tokens` and `allowed`."""
        spec = (body or {}).get("spec") or {}
        out = {**body, "status": {}}
        if path == _REVIEWS[0]:
            user = self.tokens.get(spec.get("token", ""))
            out["status"] = {"authenticated": True, "user": user} if user else {"authenticated": False}
        else:
            attrs = spec.get("nonResourceAttributes") or {}
            ok = (spec.get("user", ""), attrs.get("path", ""), attrs.get("verb", "")) in self.allowed
            out["status"] = {"allowed": ok}
        return out

    def _check_pod_update(self, cur: JSON, new: JSON, name: str) -> None:
        """Pod spec is immutable apart from a few fields; spec.nodeName only changes through binding."""
        old_spec, new_spec = cur.get("spec", {}), new.get("spec", {})
        if old_spec.get("nodeName", "") != new_spec.get("nodeName", ""):
            raise ApiError(
                422,
                "Invalid",
                f'Pod "{name}" is invalid: spec: Forbidden: pod updates may not '
                "change fields other than `spec.containers[*].image`, ... (spec.nodeName)",
                {"name": name, "kind": "Pod"},
            )

    def _patch(self, res: Resource, ns: str, name: str, body: Any, ctype: str, sub: str) -> JSON:
        ctype = ctype.split(";")[0].strip()
        with self._cond:
            cur = self._objects[res.plural].get((ns, name))
            if cur is None:
                raise not_found(res, name)
            if ctype == "application/merge-patch+json":
                new = merge_patch(cur, body)
            elif ctype == "application/strategic-merge-patch+json":
                if res.group:
                    raise ApiError(
                        415,
                        "UnsupportedMediaType",
                        "strategic merge patch is not supported for custom resources: use application/merge-patch+json",
                    )
                new = strategic_merge_patch(cur, body)
            elif ctype == "application/json-patch+json":
                new = json_patch(cur, body)
            else:
                raise ApiError(
                    415,
                    "UnsupportedMediaType",
                    f"the body of the request was in an unknown format - "
                    f"accepted media types include: application/json-patch+json, "
                    f"application/merge-patch+json, application/apply-patch+yaml, "
                    f'application/strategic-merge-patch+json (got "{ctype}")',
                )
            if not isinstance(new, dict):
                raise ApiError(422, "Invalid", "the patch did not result in an object")
            # A resourceVersion in the patch is a precondition; otherwise the patch applies to the latest.
            patched_rv = (new.get("metadata") or {}).get("resourceVersion")
            want = patched_rv if patched_rv != cur["metadata"]["resourceVersion"] else ""
            new.setdefault("metadata", {})["resourceVersion"] = want or cur["metadata"]["resourceVersion"]
            return self._update(res, ns, name, new, sub, want_rv=want or cur["metadata"]["resourceVersion"])

    def _delete(self, res: Resource, ns: str, name: str, options: JSON | None) -> JSON:
        with self._cond:
            cur = self._objects[res.plural].get((ns, name))
            if cur is None:
                raise not_found(res, name)
            pre = (options or {}).get("preconditions") or {}
            if pre.get("uid") and pre["uid"] != cur["metadata"]["uid"]:
                raise conflict(
                    res,
                    name,
                    f"Precondition failed: UID in precondition: {pre['uid']}, "
                    f"UID in object meta: {cur['metadata']['uid']}",
                )
            if pre.get("resourceVersion") and pre["resourceVersion"] != cur["metadata"]["resourceVersion"]:
                raise conflict(res, name, STALE)
            self._keep(res, (ns, name), None)
            self._rv += 1
            gone = _clone(cur)
            gone["metadata"]["resourceVersion"] = str(self._rv)
            self._record(res, "DELETED", gone, cur)
            return _clone(gone)

    def _bind(self, ns: str, name: str, binding: JSON) -> JSON:
        if not isinstance(binding, dict) or not isinstance(binding.get("target"), dict):
            raise ApiError(400, "BadRequest", "the body of the request was not a Binding")
        node = binding["target"].get("name") or ""
        if not node:
            raise ApiError(
                422,
                "Invalid",
                f'Binding "{name}" is invalid: target.name: Required value',
                {"name": name, "kind": "Binding"},
            )
        with self._cond:
            cur = self._objects["pods"].get((ns, name))
            if cur is None:
                raise not_found(PODS, name)
            for label, key in (("UID", "uid"), ("ResourceVersion", "resourceVersion")):
                want = (binding.get("metadata") or {}).get(key)
                if want and want != cur["metadata"][key]:
                    raise conflict(
                        PODS,
                        name,
                        f"Precondition failed: {label} in precondition: {want}, "
                        f"{label} in object meta: {cur['metadata'][key]}",
                    )
            if cur.get("spec", {}).get("nodeName"):
                raise conflict(PODS, name, f'pod {name} is already assigned to node "{cur["spec"]["nodeName"]}"')
            new = _clone(cur)
            new.setdefault("spec", {})["nodeName"] = node
            anns = (binding.get("metadata") or {}).get("annotations") or {}
            if anns:
                new["metadata"].setdefault("annotations", {}).update(anns)
            conds = new.setdefault("status", {}).setdefault("conditions", [])
            conds[:] = [c for c in conds if c.get("type") != "PodScheduled"]
            conds.append({"type": "PodScheduled", "status": "True", "lastTransitionTime": _now()})
            self._rv += 1
            new["metadata"]["resourceVersion"] = str(self._rv)
            self._keep(PODS, (ns, name), new)
            self._record(PODS, "MODIFIED", new, cur)
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}

    def _list(self, res: Resource, ns: str | None, labels: str, fields: str) -> JSON:
        match = _matcher(labels, fields)
        node = _indexed_node(fields) if res is PODS else None
        with self._cond:
            objects = self._objects[res.plural]
            keys = objects.keys() if node is None else self._on_node.get(node, ())
            items = [
                _clone(objects[key]) for key in sorted(keys) if (ns is None or key[0] == ns) and match(objects[key])
            ]
            rv = self._rv
        if not res.group:  # core lists carry no kind/apiVersion on items; custom resources do
            for o in items:
                o.pop("kind", None)
                o.pop("apiVersion", None)
        return {
            "kind": f"{res.kind}List",
            "apiVersion": res.api_version,
            "metadata": {"resourceVersion": str(rv)},
            "items": items,
        }

    def watch(
        self,
        res: Resource,
        ns: str | None,
        rv_text: str,
        labels: str,
        fields: str,
        timeout: float | None,
        bookmarks: bool,
    ) -> Iterator[bytes]:
        """The events of a watch, as JSON lines; ends on timeout, close_watches() or stop()."""
        match = _matcher(labels, fields)

        def visible(o: JSON | None) -> bool:
            return o is not None and (ns is None or o["metadata"].get("namespace", "") == ns) and match(o)

        deadline = time.monotonic() + timeout if timeout else None
        with self._cond:
            gen = self._watch_gen
            if rv_text in ("", "0"):
                start = self._rv
                snapshot = [_clone(o) for o in self._objects[res.plural].values() if visible(o)]
            else:
                start = int(rv_text)
                snapshot = []
                if start < self._oldest_rv:
                    yield _line("ERROR", _expired(start, self._oldest_rv))
                    return
        for o in snapshot:
            yield _line("ADDED", o)
        last = start
        while True:
            with self._cond:
                while True:
                    if self._stopped or gen != self._watch_gen:
                        return
                    if last < self._oldest_rv:  # compacted under an open watch
                        yield _line("ERROR", _expired(last, self._oldest_rv))
                        return
                    newer = bisect.bisect_right(self._events, last, key=_event_rv)
                    pending = [] if self._paused else [e for e in self._events[newer:] if e.res is res]
                    if pending or (self._rv > last and not self._paused):
                        break
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return
                    self._cond.wait(timeout=min(left, 0.5) if left is not None else 0.5)
                last = self._rv
            for e in pending:
                now, before = visible(e.obj), visible(e.old)
                if e.type == "DELETED":
                    if before or now:
                        yield e.line("DELETED")
                elif now:
                    yield e.line("ADDED" if e.type == "ADDED" or not before else "MODIFIED")
                elif before:  # stopped matching the selector: the watcher sees it go
                    yield e.line("DELETED")
            if bookmarks and not pending:
                bookmark = {"kind": res.kind, "apiVersion": res.api_version, "metadata": {"resourceVersion": str(last)}}
                yield _line("BOOKMARK", bookmark)


def _line(kind: str, obj: JSON) -> bytes:
    """One event of a watch stream: a JSON object on a line of its own."""
    return json.dumps({"type": kind, "object": obj}).encode() + b"\n"


def _expired(rv: int, oldest: int) -> JSON:
    return ApiError(410, "Expired", f"too old resource version: {rv} ({oldest})").status()


def _event_rv(e: Event) -> int:
    return e.rv


def _same(a: JSON, b: JSON) -> bool:
    strip = ("resourceVersion",)
    a2 = {**a, "metadata": {k: v for k, v in a.get("metadata", {}).items() if k not in strip}}
    b2 = {**b, "metadata": {k: v for k, v in b.get("metadata", {}).items() if k not in strip}}
    a2.pop("kind", None), a2.pop("apiVersion", None), b2.pop("kind", None), b2.pop("apiVersion", None)
    return a2 == b2


def _node_name(pod: JSON) -> str:
    return str((pod.get("spec") or {}).get("nodeName") or "")


def _indexed_node(fields: str) -> str | None:
    """The node a field selector pins spec.nodeName to (the index's key), or None."""
    for term in _split_selector(fields) if fields else ():
        if "!=" not in term:
            k, v = (t.strip() for t in term.replace("==", "=").split("=", 1))
            if k == "spec.nodeName":
                return v
    return None


def _matcher(labels: str, fields: str) -> Callable[[JSON], bool]:
    lm = label_matcher(labels) if labels else None
    fm = field_matcher(fields) if fields else None

    def match(o: JSON) -> bool:
        if lm is not None and not lm(o.get("metadata", {}).get("labels") or {}):
            return False
        return fm is None or fm(o)

    return match


# --- HTTP ---------------------------------------------------------------------------------------

_REVIEWS = ("/apis/authentication.k8s.io/v1/tokenreviews", "/apis/authorization.k8s.io/v1/subjectaccessreviews")

_CORE = re.compile(
    r"^/api/v1(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[^/]+)"
    r"(?:/(?P<name>[^/]+))?(?:/(?P<sub>[^/]+))?$"
)
_GROUP = re.compile(
    r"^/apis/(?P<group>[^/]+)/(?P<version>[^/]+)(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[^/]+)"
    r"(?:/(?P<name>[^/]+))?(?:/(?P<sub>[^/]+))?$"
)


def send_json(handler: BaseHTTPRequestHandler, code: int, body: JSON) -> None:
    """One JSON answer, as the API server sends it (Content-Type application/json, a length)."""
    data = json.dumps(body).encode()
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


class _Server(ThreadingHTTPServer):
    # socketserver's default listen backlog of 5 reset connections when a bench opened many at
    # once; the real API server listens with Go's default, the kernel's somaxconn
    request_queue_size = 4096

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up is normal (closed watches, pools); anything else is printed."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    fake: FakeKube
    protocol_version = "HTTP/1.1"
    # headers and body go out as two writes; without TCP_NODELAY the second waits for the client's
    # delayed ACK (about 40 ms), which would dwarf every timing taken through the fake
    disable_nagle_algorithm = True

    def setup(self) -> None:
        super().setup()
        # headers and body go out as two writes: without this, Nagle and the peer's delayed ACK
        # add about 40 ms to every answer
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:  # quiet: tests read fake.requests instead
        pass

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def do_PATCH(self) -> None:
        self._serve("PATCH")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    def _send_json(self, code: int, body: JSON) -> None:
        send_json(self, code, body)

    def _body(self) -> Any:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            raise ApiError(400, "BadRequest", "the body of the request could not be decoded as JSON") from None

    def _serve(self, method: str) -> None:
        fake = self.fake
        url = urlsplit(self.path)
        path = unquote(url.path)
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        try:
            body = self._body()
            ctype = self.headers.get("Content-Type", "")
            fake.requests.append(Request(method, path, url.query, ctype, body, dict(self.headers.items())))
            if fake.delay:
                time.sleep(fake.delay)
            if (fault := fake._take_fault(method, path)) is not None:
                raise ApiError(fault.code, fault.reason, f"injected fault: {fault.code} {fault.reason}")
            self._route(method, path, query, body)
        except ApiError as e:
            self._send_json(e.code, e.status())
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _route(self, method: str, path: str, query: dict[str, str], body: Any) -> None:
        fake = self.fake
        if path in ("/version", "/version/") and method == "GET":
            major, minor = fake.version
            self._send_json(200, {"major": major, "minor": minor, "gitVersion": f"v{major}.{minor}.0"})
            return
        if method == "POST" and path in _REVIEWS:
            self._send_json(201, fake._review(path, body))
            return
        m = _CORE.match(path) or _GROUP.match(path)
        if m is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        gd = m.groupdict()
        plural, name, sub, ns = gd["plural"], gd["name"], gd["sub"] or "", gd["ns"]
        if plural == "bindings" and ns and method == "POST" and name is None and not gd.get("group"):
            pod = ((body or {}).get("metadata") or {}).get("name", "")
            self._send_json(201, fake._bind(ns, pod, body))
            return
        res = RESOURCES.get(plural)
        if res in DRA and not fake.dra:
            res = None
        if res is None or (res.group or None) != gd.get("group") or (gd.get("version") or "v1") != res.version:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if res.namespaced and ns is None and (name is not None or method != "GET"):
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if not res.namespaced and ns is not None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        key_ns = ns or ""
        if sub not in ("", "status") and not (res is PODS and sub == "binding"):
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if sub == "status" and res.plural in fake.no_status:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if name is None:
            if method == "GET" and query.get("watch") in ("true", "1"):
                rv = query.get("resourceVersion", "")
                if rv and not rv.isdigit():
                    raise ApiError(400, "BadRequest", f'resourceVersion: Invalid value: "{rv}"')
                self._stream(
                    fake.watch(
                        res,
                        ns,
                        query.get("resourceVersion", ""),
                        query.get("labelSelector", ""),
                        query.get("fieldSelector", ""),
                        float(query["timeoutSeconds"]) if query.get("timeoutSeconds") else None,
                        query.get("allowWatchBookmarks") in ("true", "1"),
                    )
                )
            elif method == "GET":
                self._send_json(
                    200, fake._list(res, ns, query.get("labelSelector", ""), query.get("fieldSelector", ""))
                )
            elif method == "POST":
                self._send_json(201, fake._create(res, key_ns, body))
            else:
                raise ApiError(405, "MethodNotAllowed", f"the server does not allow this method on {res.plural}")
            return
        if sub == "binding":
            if method != "POST":
                raise ApiError(405, "MethodNotAllowed", "the server does not allow this method on pods/binding")
            self._send_json(201, fake._bind(key_ns, name, body))
        elif method == "GET":
            self._send_json(200, fake.get(res.plural, name, key_ns))
        elif method == "PUT":
            self._send_json(200, fake._update(res, key_ns, name, body, sub))
        elif method == "PATCH":
            self._send_json(200, fake._patch(res, key_ns, name, body, self.headers.get("Content-Type", ""), sub))
        elif method == "DELETE" and not sub:
            self._send_json(200, fake._delete(res, key_ns, name, body))
        else:
            raise ApiError(405, "MethodNotAllowed", f"the server does not allow this method on {res.plural}")

    def _stream(self, events: Iterator[bytes]) -> None:
        """A watch response: 200 at once, then chunked, one JSON event per line."""
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()
        try:
            for ev in events:
                self._chunk(ev)
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass
        self.close_connection = True

    def _chunk(self, line: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
        self.wfile.flush()
