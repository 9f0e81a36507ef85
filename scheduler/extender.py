"""kube-scheduler extender verbs over the DeviceShare allocator: filter, prioritize, bind.

The wire format is kube-scheduler's (k8s.io/kube-scheduler/extender/v1), Go field names without
JSON tags: ExtenderArgs {Pod, Nodes, NodeNames}, ExtenderFilterResult {Nodes, NodeNames, FailedNodes,
FailedAndUnresolvableNodes, Error}, HostPriorityList [{Host, Score}] with scores 0..MaxExtenderPriority,
ExtenderBindingArgs {PodName, PodNamespace, PodUID, Node}, ExtenderBindingResult {Error}.

Nodes that can not take the pod's devices are reported as FailedAndUnresolvableNodes: this extender
has no preempt verb, so kube-scheduler's preemption could not see which victims would free a GPU
and would evict pods for nothing.

One lock serialises every use of the allocator, so two binds to one node can never be handed the
same GPU; the API writes of a bind happen outside it. Binds of one pod are serialised by pod uid,
which makes a kube-scheduler retry of a bind that in fact went through a no-op.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from crihook.scheduler.plugin import DeviceShare, Unschedulable
from crihook.scheduler.pod import PodError, pod_from_json
from crihook.scheduler.request import PodRequest, RequestError

log = logging.getLogger("crihook.scheduler")

MAX_EXTENDER_PRIORITY = 10  # k8s.io/kube-scheduler/extender/v1.MaxExtenderPriority
MAX_PLUGIN_SCORE = 100


class ApiFailure(Exception):
    """An API server call failed; `code` is the HTTP status (0 when none came back)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class PodApi(Protocol):
    """The API server calls a bind makes (cache.KubeApi implements it with the kubernetes client)."""

    def get_pod(self, namespace: str, name: str) -> dict[str, Any]: ...

    def annotate_pod(self, namespace: str, name: str, uid: str, annotations: Mapping[str, str]) -> None: ...

    def bind_pod(self, namespace: str, name: str, uid: str, node: str) -> None: ...


class BadRequest(ValueError):
    """The request body is not what kube-scheduler sends (answered with HTTP 400)."""


@dataclass(frozen=True, slots=True)
class Candidates:
    """The candidate nodes of ExtenderArgs, in the form they came (names only, or full Node objects)."""

    names: list[str]
    nodes: list[dict[str, Any]] | None  # None when kube-scheduler sent NodeNames (nodeCacheCapable)


def candidates(args: Mapping[str, Any]) -> Candidates:
    names = args.get("NodeNames")
    if names is not None:
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise BadRequest("ExtenderArgs.NodeNames must be a list of node names")
        return Candidates(list(names), None)
    node_list = args.get("Nodes")
    if node_list is None:
        return Candidates([], None)
    items = node_list.get("items") if isinstance(node_list, dict) else None
    if not isinstance(items, list):
        raise BadRequest("ExtenderArgs.Nodes must be a NodeList with items")
    out = []
    for i, n in enumerate(items):
        name = ((n or {}).get("metadata") or {}).get("name") if isinstance(n, dict) else None
        if not isinstance(name, str) or not name:
            raise BadRequest(f"ExtenderArgs.Nodes.items[{i}].metadata.name is missing")
        out.append(name)
    return Candidates(out, items)


def filter_result(c: Candidates, fit: list[str], failed: Mapping[str, str], error: str = "") -> dict[str, Any]:
    """ExtenderFilterResult in the form of the request: NodeNames back for NodeNames, Nodes for Nodes."""
    if c.nodes is None:
        nodes, names = None, fit
    else:
        keep = set(fit)
        nodes = {"metadata": {}, "items": [n for n, name in zip(c.nodes, c.names, strict=True) if name in keep]}
        names = None
    return {
        "Nodes": nodes,
        "NodeNames": names,
        "FailedNodes": {},
        "FailedAndUnresolvableNodes": dict(failed),
        "Error": error,
    }


def to_extender_score(score: float) -> int:
    """The allocator's 0..100 to kube-scheduler's 0..10, rounded half up, clamped."""
    s = int(score * MAX_EXTENDER_PRIORITY / MAX_PLUGIN_SCORE + 0.5)
    return max(0, min(MAX_EXTENDER_PRIORITY, s))


class Extender:
    """The verbs. `ready` says whether the cluster state is complete (the cache's initial lists are
    in); before that filter and bind answer an error so kube-scheduler retries the pod later."""

    def __init__(self, plugin: DeviceShare, api: PodApi | None = None, ready: Callable[[], bool] = lambda: True):
        self.plugin = plugin
        self.api = api
        self.ready = ready
        self.lock = threading.Lock()  # guards self.plugin
        self._pod_locks: dict[str, tuple[threading.Lock, int]] = {}
        self._pod_locks_guard = threading.Lock()

    # --- filter / prioritize ---

    def _request(self, pod_json: Any) -> PodRequest:
        pod = pod_from_json(pod_json)
        with self.lock:
            return self.plugin.pre_filter(pod)

    def filter(self, args: Any) -> dict[str, Any]:
        if not isinstance(args, dict):
            raise BadRequest("expected ExtenderArgs (a JSON object)")
        c = candidates(args)
        if not self.ready():
            return filter_result(c, [], {}, "crihook scheduler is not ready: the cluster cache is still loading")
        try:
            req = self._request(args.get("Pod"))
        except (PodError, RequestError) as e:
            # the same answer for every node: the pod stays Pending with the reason in its events
            return filter_result(c, [], {n: str(e) for n in c.names})
        if not req.wants_devices:
            return filter_result(c, c.names, {})
        with self.lock:
            fit, failed = self.plugin.filter_nodes(req, c.names)
        return filter_result(c, fit, failed)

    def prioritize(self, args: Any) -> list[dict[str, Any]]:
        if not isinstance(args, dict):
            raise BadRequest("expected ExtenderArgs (a JSON object)")
        c = candidates(args)
        scores: Mapping[str, float] = {}
        if self.ready():
            try:
                req = self._request(args.get("Pod"))
            except (PodError, RequestError):
                req = None  # filter has said why; every node scores 0
            if req is not None and req.wants_devices:
                with self.lock:
                    scores = self.plugin.score_nodes(req, c.names)
        return [{"Host": n, "Score": to_extender_score(scores.get(n, 0.0))} for n in c.names]

    # --- bind ---

    @contextmanager
    def _pod_lock(self, uid: str):  # type: ignore[no-untyped-def]
        with self._pod_locks_guard:
            lock, users = self._pod_locks.get(uid, (threading.Lock(), 0))
            self._pod_locks[uid] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._pod_locks_guard:
                lock, users = self._pod_locks[uid]
                if users == 1:
                    del self._pod_locks[uid]
                else:
                    self._pod_locks[uid] = (lock, users - 1)

    def bind(self, args: Any) -> dict[str, str]:
        """ExtenderBindingResult: {"Error": ""} when the pod is bound to the node."""
        if not isinstance(args, dict):
            raise BadRequest("expected ExtenderBindingArgs (a JSON object)")
        fields = {k: args.get(k) for k in ("PodName", "PodNamespace", "PodUID", "Node")}
        for k, v in fields.items():
            if not isinstance(v, str) or not v:
                raise BadRequest(f"ExtenderBindingArgs.{k} is missing")
        name, ns, uid, node = fields["PodName"], fields["PodNamespace"], fields["PodUID"], fields["Node"]
        if self.api is None:
            return {"Error": "crihook scheduler has no API server connection to bind with"}
        if not self.ready():
            return {"Error": "crihook scheduler is not ready: the cluster cache is still loading"}
        with self._pod_lock(uid):
            error = self._bind(ns, name, uid, node)
        if error:
            log.warning("bind failed", extra={"pod": f"{ns}/{name}", "node": node, "error": error})
        else:
            log.info("bound", extra={"pod": f"{ns}/{name}", "node": node})
        return {"Error": error}

    def _bind(self, ns: str, name: str, uid: str, node: str) -> str:
        assert self.api is not None
        key = f"{ns}/{name}"
        try:
            pod_json = self.api.get_pod(ns, name)
        except ApiFailure as e:
            return f"pod {key}: {e}"
        meta = pod_json.get("metadata") or {}
        if meta.get("uid") != uid:
            return f"pod {key}: uid is {meta.get('uid')}, not {uid}: the pod was deleted and created again"
        bound = (pod_json.get("spec") or {}).get("nodeName") or ""
        if bound:
            # a retry of a bind that went through, or a pod someone else bound
            return "" if bound == node else f"pod {key} is already bound to node {bound}"
        try:
            pod = pod_from_json(pod_json)
            with self.lock:
                req = self.plugin.pre_filter(pod)
                if req.wants_devices:
                    alloc = self.plugin.reserve(req, node)
                    annotations = self.plugin.pre_bind(req, alloc)
                else:
                    annotations = {}
        except (PodError, RequestError, Unschedulable) as e:
            return str(e)
        reserved = req.wants_devices
        try:
            if annotations:
                self.api.annotate_pod(ns, name, uid, annotations)
            self.api.bind_pod(ns, name, uid, node)
        except ApiFailure as e:
            if e.code == 409 and self._bound_to(ns, name, uid, node):
                return ""  # a concurrent duplicate of this bind won
            if reserved:
                with self.lock:
                    self.plugin.unreserve(req.uid)
            return f"pod {key} on node {node}: {e}"
        except Exception as e:  # the reservation must not outlive a failed bind, whatever failed
            if reserved:
                with self.lock:
                    self.plugin.unreserve(req.uid)
            return f"pod {key} on node {node}: {type(e).__name__}: {e}"
        return ""

    def _bound_to(self, ns: str, name: str, uid: str, node: str) -> bool:
        assert self.api is not None
        try:
            pod = self.api.get_pod(ns, name)
        except ApiFailure:
            return False
        return (pod.get("metadata") or {}).get("uid") == uid and (pod.get("spec") or {}).get("nodeName") == node
