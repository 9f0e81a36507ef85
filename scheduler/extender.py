"""kube-scheduler extender verbs over the DeviceShare allocator: filter, prioritize, preempt, bind.

The wire format is kube-scheduler's (k8s.io/kube-scheduler/extender/v1), Go field names without
JSON tags: ExtenderArgs {Pod, Nodes, NodeNames}, ExtenderFilterResult {Nodes, NodeNames, FailedNodes,
FailedAndUnresolvableNodes, Error}, HostPriorityList [{Host, Score}] with scores 0..MaxExtenderPriority,
ExtenderPreemptionArgs {Pod, NodeNameToVictims, NodeNameToMetaVictims} with Victims {Pods,
NumPDBViolations} or MetaVictims {Pods [{UID}], NumPDBViolations}, ExtenderPreemptionResult
{NodeNameToMetaVictims}, ExtenderBindingArgs {PodName, PodNamespace, PodUID, Node},
ExtenderBindingResult {Error}.

Nodes whose GPUs are busy are FailedNodes (evicting pods could help, so kube-scheduler may try
preemption and asks the preempt verb which victims free a GPU); nodes that could not take the pod
even empty are FailedAndUnresolvableNodes.

One lock serialises every use of the allocator, so two binds to one node can never be handed the
same GPU; the API writes of a bind happen outside it. Binds of one pod are serialised by pod uid,
which makes a kube-scheduler retry of a bind that in fact went through a no-op. With several
replicas, a bind writes only while `may_write()` (this replica holds the leader Lease), re-checks
its GPUs against the node's pods on the API server, and writes with the pod's resourceVersion as a
precondition (scheduler/leader.py, scheduler/fence.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import repeat
from typing import Any, Protocol, overload

import numpy as np

from crihook.base import metrics
from crihook.base.allocation import DeviceAllocation
from crihook.scheduler import claims, fence, preempt
from crihook.scheduler.devices import Gpu
from crihook.scheduler.plugin import DeviceShare, Unschedulable
from crihook.scheduler.pod import PodError, pod_from_json
from crihook.scheduler.preempt import Victim
from crihook.scheduler.request import PodRequest, RequestError
from crihook.scheduler.webhook import DEFAULT_SCHEDULER

log = logging.getLogger("crihook.scheduler")

MAX_EXTENDER_PRIORITY = 10  # k8s.io/kube-scheduler/extender/v1.MaxExtenderPriority
MAX_PLUGIN_SCORE = 100
NOT_LEADER = "crihook scheduler: this replica does not hold the leader Lease (any more); not binding"
# prioritize's hold on a pod's devices whose bind never came (the cycle failed after scoring, in
# another plugin's Reserve, Permit or PreBind) is let go after this long
TENTATIVE_SECONDS = 30.0


class ApiFailure(Exception):
    """An API server call failed; `code` is the HTTP status (0 when none came back)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class PodApi(Protocol):
    """The API server calls a bind makes (cache.KubeApi implements it with the kubernetes client)."""

    def get_pod(self, namespace: str, name: str) -> dict[str, Any]: ...

    def claims(self, node: str) -> list[dict[str, Any]]: ...

    def annotate_pod(
        self,
        namespace: str,
        name: str,
        uid: str,
        annotations: Mapping[str, str],
        resource_version: str,
        labels: Mapping[str, str] | None = None,
    ) -> str: ...

    def clear_claim(self, namespace: str, name: str, resource_version: str) -> None: ...

    def resource_claims(self, refs: Iterable[tuple[str, str]]) -> list[dict[str, Any]]: ...

    def node_slices(self, node: str) -> list[dict[str, Any]]: ...

    def bind_pod(self, namespace: str, name: str, uid: str, node: str, resource_version: str) -> None: ...


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
        if not isinstance(names, list) or not set(map(type, names)) <= {str}:  # map: 5,000 names in 0.1 ms
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


def filter_result(
    c: Candidates,
    fit: list[str],
    failed: Mapping[str, str],
    error: str = "",
    resolvable: Mapping[str, str] | None = None,
) -> dict[str, Any]:
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
        "FailedNodes": dict(resolvable or {}),
        "FailedAndUnresolvableNodes": dict(failed),
        "Error": error,
    }


_SAFE_NAMES = re.compile(r"[A-Za-z0-9._:-]*")  # node names are DNS subdomains: nothing to escape in JSON
_HOST = '{"Host":"'
_SCORE_AND_NEXT = [f'","Score":{s}}},{_HOST}' for s in range(MAX_EXTENDER_PRIORITY + 1)]


class HostPriorityList(Sequence[dict[str, Any]]):
    """prioritize's answer, [{Host, Score}] read lazily. `json()` writes the bytes with no dict per
    node: at 5,000 nodes building the dicts and encoding them was 2 ms of a 7 ms cycle."""

    def __init__(self, hosts: Sequence[str], scores: list[int]) -> None:
        self.hosts = hosts
        self.scores = scores

    def __len__(self) -> int:
        return len(self.hosts)

    @overload
    def __getitem__(self, i: int) -> dict[str, Any]: ...

    @overload
    def __getitem__(self, i: slice) -> list[dict[str, Any]]: ...

    def __getitem__(self, i: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(i, slice):
            return [{"Host": h, "Score": s} for h, s in zip(self.hosts[i], self.scores[i], strict=True)]
        return {"Host": self.hosts[i], "Score": self.scores[i]}

    def json(self) -> bytes:
        if not self.hosts:
            return b"[]"
        hosts = self.hosts
        if not _SAFE_NAMES.fullmatch("".join(hosts)):
            hosts = [json.dumps(h)[1:-1] for h in hosts]
        parts: list[str] = [""] * (2 * len(hosts))
        parts[0::2] = hosts
        parts[1::2] = map(_SCORE_AND_NEXT.__getitem__, self.scores)
        text = "".join(parts)
        return f"[{_HOST}{text[: -len(_HOST) - 1]}]".encode()


def to_extender_scores(scores: np.ndarray) -> np.ndarray:
    """The allocator's 0..100 to kube-scheduler's 0..10, rounded half up, clamped; -inf (no score) to 0."""
    scaled = np.floor(scores * MAX_EXTENDER_PRIORITY / MAX_PLUGIN_SCORE + 0.5)
    return np.clip(scaled, 0, MAX_EXTENDER_PRIORITY).astype(np.int64)


def no_scores(names: Sequence[str]) -> HostPriorityList:
    """Every node 0: what a pod crihook does not score gets, without the arrays of host_priorities."""
    return HostPriorityList(names, [0] * len(names))


def host_priorities(names: Sequence[str], scores: Mapping[str, float]) -> HostPriorityList:
    """HostPriorityList in `names` order. The allocator's best node (the first among equals, as
    `crihook simulate` picks) alone gets MaxExtenderPriority, every other node at most one less:
    rounded to 0..10 the top nodes tie, and kube-scheduler's selectHost picks among ties at random,
    which left 1.4 points more GPU unallocated in a filled cluster (docs/scheduler.md, "Scale").
    On arrays: a Python call per node was a third of prioritize's time at 5,000 nodes."""
    values = np.fromiter(map(scores.get, names, repeat(-math.inf)), np.float64, len(names))
    out: list[int] = np.minimum(to_extender_scores(values), MAX_EXTENDER_PRIORITY - 1).tolist()
    if len(values) and values[best := int(np.argmax(values))] > -math.inf:  # argmax: the first among equals
        out[best] = MAX_EXTENDER_PRIORITY
    return HostPriorityList(names, out)


class Extender:
    """The verbs. `ready` says whether the cluster state is complete (the cache's initial lists are
    in); before that filter and bind answer an error so kube-scheduler retries the pod later."""

    def __init__(
        self,
        plugin: DeviceShare,
        api: PodApi | None = None,
        ready: Callable[[], bool] = lambda: True,
        may_write: Callable[[], bool] = lambda: True,
    ):
        self.plugin = plugin
        self.api = api
        self.ready = ready
        self.may_write = may_write  # False on a replica that does not hold the leader Lease (now)
        # called when a bind finds the watches behind on the DRA claims: the cache lists them again
        self.resync_claims: Callable[[], None] = lambda: None
        # the schedulerNames whose pods this extender filters and binds; empty: any
        self.scheduler_names: frozenset[str] = frozenset()
        self.priorities: Mapping[str, int] = {}  # pod uid -> priority, from the cluster cache
        self.claim_asks: Mapping[str, claims.ClaimAsk] = {}  # namespace/name -> a claim's GPUs, from the cache
        self.lock = threading.Lock()  # guards self.plugin
        self._pod_locks: dict[str, tuple[threading.Lock, int]] = {}
        self._pod_locks_guard = threading.Lock()
        # pod uid -> (the allocator, when): devices held from prioritize until the bind; guarded by self.lock
        self._tentative: dict[str, tuple[DeviceShare, float]] = {}
        self._refreshing = False  # an outlook job runs (guarded by self.lock)

    def _refresh(self) -> None:
        """Start the allocator's due re-derivation on a thread of its own, if one is due and none
        runs: computed from copies without the lock, installed under it, while the verbs go on
        with the outlook they have (at 5,000 nodes an update is about 5 ms of CPU, which the
        prioritize that found it due used to spend, up to every 64 pods). Caller holds self.lock."""
        if self._refreshing:
            return
        plugin = self.plugin
        job = plugin.outlook_job()
        if job is None:
            return
        self._refreshing = True

        def run() -> None:
            install: Callable[[], None] | None = None
            try:
                install = job()
            except Exception:  # a bug: the outlook stays as it is until the next one is due
                log.exception("re-deriving the allocator's outlook failed")
            with self.lock:
                self._refreshing = False
                if install is not None and self.plugin is plugin:  # a new term's allocator has its own
                    install()

        threading.Thread(target=run, name="outlook", daemon=True).start()

    # --- filter / prioritize ---

    def _request(self, pod_json: Any) -> PodRequest:
        pod = pod_from_json(pod_json)
        with self.lock:
            return self.plugin.pre_filter(pod)

    def _not_served(self, pod: Any) -> str:
        """Why this extender refuses the pod ("" when it serves it): a scheduler it does not serve."""
        spec = pod.get("spec") if isinstance(pod, dict) else None
        name = (spec.get("schedulerName") if isinstance(spec, dict) else None) or DEFAULT_SCHEDULER
        if not self.scheduler_names or name in self.scheduler_names:
            return ""
        return (
            f"schedulerName {name} is not served by this crihook scheduler ({', '.join(sorted(self.scheduler_names))})"
        )

    def _hold(self, req: PodRequest, node: str) -> None:
        """Hold the pod's devices on the node prioritize ranked first until its bind comes, as
        kube-scheduler assumes a pod at Reserve before its bind completes: the cycles that run while
        the bind is on its way must not see those GPUs free. Caller holds self.lock."""
        now = time.monotonic()
        for uid, (_, since) in list(self._tentative.items()):
            if now - since > TENTATIVE_SECONDS:
                self._let_go(uid)
        with contextlib.suppress(Unschedulable):
            self.plugin.reserve(req, node)
            self._tentative[req.uid] = (self.plugin, now)

    def _let_go(self, uid: str, keep_on: str = "") -> None:
        """End uid's tentative hold, unless it is on `keep_on` (the node its bind names). A new
        filter or prioritize of the pod means the cycle that made it is over. Caller holds self.lock."""
        plugin, _ = self._tentative.pop(uid, (None, 0.0))
        if plugin is not None and plugin is self.plugin:  # a new term's allocator never saw it
            held = plugin.held.get(uid)
            if held is not None and held.node != keep_on:
                plugin.unreserve(uid)

    def filter(self, args: Any) -> dict[str, Any]:
        if not isinstance(args, dict):
            raise BadRequest("expected ExtenderArgs (a JSON object)")
        c = candidates(args)
        if not self.ready():
            return filter_result(c, [], {}, "crihook scheduler is not ready: the cluster cache is still loading")
        if why := self._not_served(args.get("Pod")):
            return filter_result(c, [], {n: why for n in c.names})
        try:
            req = self._request(args.get("Pod"))
        except (PodError, RequestError) as e:
            # the same answer for every node: the pod stays Pending with the reason in its events
            return filter_result(c, [], {n: str(e) for n in c.names})
        if not req.wants_devices:
            return filter_result(c, c.names, {})
        with self.lock:
            self._let_go(req.uid)
            fit, failed = self.plugin.filter_nodes(req, c.names)
            helped = self.plugin.could_fit_empty(req, failed) if failed else set()
            self._refresh()  # the pod was first seen here: an outlook due now may be in by prioritize
        resolvable = {n: why for n, why in failed.items() if n in helped}
        return filter_result(c, fit, {n: why for n, why in failed.items() if n not in helped}, "", resolvable)

    def prioritize(self, args: Any) -> HostPriorityList:
        """The binding entry's scores: the pods that ask crihook for devices (kube-scheduler sends
        only those to an entry with managedResources), and any pod with claims sent to it."""
        return self._prioritize(args, claims_only=False)

    def prioritize_claims(self, args: Any) -> HostPriorityList:
        """The scores of the scoring-only entry (the chart's `kubeScheduler.scoreClaimPods`), which has
        no managedResources, so kube-scheduler sends it every pod it scores: a pod's ResourceClaims
        are scored as prioritize scores them. Every other pod gets zeros: a pod without claims at once,
        before the pod is parsed or the allocator's lock taken, and a pod asking for devices through
        our resources too, because the binding entry scores it and kube-scheduler adds the scores of
        every entry interested in a pod (prioritizeNodes)."""
        return self._prioritize(args, claims_only=True)

    def _prioritize(self, args: Any, claims_only: bool) -> HostPriorityList:
        if not isinstance(args, dict):
            raise BadRequest("expected ExtenderArgs (a JSON object)")
        c = candidates(args)
        pod = args.get("Pod")
        if claims_only and not (isinstance(pod, dict) and claims.claim_refs(pod)):
            return no_scores(c.names)
        if not self.ready():
            return no_scores(c.names)
        try:
            req = self._request(pod)
        except (PodError, RequestError):
            return no_scores(c.names)  # filter has said why; every node scores 0
        dra = not req.wants_devices
        if claims_only and not dra:
            return no_scores(c.names)
        with self.lock:
            if dra:  # a pod with claims: kube-scheduler's DRA allocator picks its GPUs, crihook its node
                refs = claims.claim_refs(args["Pod"])
                asks = [a for ns, name in refs if (a := self.claim_asks.get(f"{ns}/{name}")) is not None]
                req = claims.dra_request(req, asks)
                if not req.wants_devices:
                    return no_scores(c.names)
                self.plugin.learn(req.uid, req)  # part of the workload the policy scores for
            self._let_go(req.uid)
            out = host_priorities(c.names, self.plugin.score_nodes(req, c.names))
            if MAX_EXTENDER_PRIORITY in out.scores and not dra:
                self._hold(req, out.hosts[out.scores.index(MAX_EXTENDER_PRIORITY)])
                self._refresh()
        return out

    # --- preempt ---

    def preempt(self, args: Any) -> dict[str, Any]:
        """ExtenderPreemptionResult {NodeNameToMetaVictims}: per candidate node the victims that
        free enough GPU (scheduler/preempt.py). kube-scheduler always reads the answer as
        MetaVictims, whichever form it sent (HTTPExtender.ProcessPreemption, convertToVictims). A
        node where no allowed victims make room is left out; one offered without victims that needs
        none is answered without victims (newer kube-schedulers keep such placeholders for other
        extenders; older ones never send them)."""
        if not isinstance(args, dict):
            raise BadRequest("expected ExtenderPreemptionArgs (a JSON object)")
        meta = args.get("NodeNameToMetaVictims")
        full = args.get("NodeNameToVictims")
        given = meta if meta is not None else full
        if given is None:
            given = {}
        if not isinstance(given, dict):
            raise BadRequest("ExtenderPreemptionArgs.NodeNameToVictims must be an object of nodes")
        victims = {node: self._victims(node, v, meta is not None) for node, v in given.items()}
        if not self.ready():
            return {"NodeNameToMetaVictims": {}}  # no preemption this cycle; kube-scheduler tries again
        try:
            req = self._request(args.get("Pod"))
        except (PodError, RequestError):
            return {"NodeNameToMetaVictims": {}}  # filter has said why
        pod = args.get("Pod")
        if not isinstance(pod, dict):
            pod = {}
        priority = (pod.get("spec") or {}).get("priority") or 0
        out: dict[str, Any] = {}
        with self.lock:
            for node, (vs, pdb) in victims.items():
                if not req.wants_devices:
                    chosen: list[Victim] | None = vs
                else:
                    chosen = preempt.choose(self.plugin, req, node, vs, self._lower(node, priority))
                if chosen is not None:
                    # which victims break a PodDisruptionBudget is kube-scheduler's knowledge: those it
                    # sent that we keep break at most as many as it counted, at most one each
                    ours = sum(1 for v in chosen if v in vs)
                    out[node] = {"Pods": [{"UID": v.uid} for v in chosen], "NumPDBViolations": min(pdb, ours)}
        return {"NodeNameToMetaVictims": out}

    def _lower(self, node: str, priority: int) -> list[Victim]:
        """Pods on `node` holding GPUs with a lower priority than the preemptor's. Caller holds the lock."""
        held = self.plugin.held
        return [
            Victim(uid, self.priorities.get(uid, 0))
            for uid in self.plugin.by_node.get(node, ())
            if held[uid].gpus and self.priorities.get(uid, 0) < priority
        ]

    def _victims(self, node: str, v: Any, meta: bool) -> tuple[list[Victim], int]:
        where = f"ExtenderPreemptionArgs.{'NodeNameToMetaVictims' if meta else 'NodeNameToVictims'}[{node}]"
        if not isinstance(v, dict) or not isinstance(v.get("Pods") or [], list):
            raise BadRequest(f"{where} must be an object with a Pods list")
        pdb = v.get("NumPDBViolations") or 0
        if not isinstance(pdb, int):
            raise BadRequest(f"{where}.NumPDBViolations must be an integer")
        out = []
        for i, p in enumerate(v.get("Pods") or []):
            if meta:
                uid = p.get("UID") if isinstance(p, dict) else None
                priority = self.priorities.get(uid or "", 0)
            else:
                m, spec = (p.get("metadata") or {}, p.get("spec") or {}) if isinstance(p, dict) else ({}, {})
                uid, priority = m.get("uid"), spec.get("priority") or 0
            if not isinstance(uid, str) or not uid or not isinstance(priority, int):
                raise BadRequest(f"{where}.Pods[{i}] has no UID" + ("" if meta else " (metadata.uid) or priority"))
            out.append(Victim(uid, priority))
        return out, pdb

    # --- bind ---

    @contextmanager
    def _pod_lock(self, uid: str) -> Iterator[None]:
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
        fields: dict[str, str] = {}
        for k in ("PodName", "PodNamespace", "PodUID", "Node"):
            v = args.get(k)
            if not isinstance(v, str) or not v:
                raise BadRequest(f"ExtenderBindingArgs.{k} is missing")
            fields[k] = v
        name, ns, uid, node = fields["PodName"], fields["PodNamespace"], fields["PodUID"], fields["Node"]
        if self.api is None:
            return {"Error": "crihook scheduler has no API server connection to bind with"}
        if not self.may_write():
            metrics.SCHEDULER_BINDS_REFUSED.inc("not_leader")
            return {"Error": NOT_LEADER}
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
        api = self.api
        assert api is not None
        key = f"{ns}/{name}"
        try:
            pod_json = api.get_pod(ns, name)
        except ApiFailure as e:
            return f"pod {key}: {e}"
        meta = pod_json.get("metadata") or {}
        if meta.get("uid") != uid:
            return f"pod {key}: uid is {meta.get('uid')}, not {uid}: the pod was deleted and created again"
        if refused := self._not_served(pod_json):
            return f"pod {key}: {refused}"
        bound = (pod_json.get("spec") or {}).get("nodeName") or ""
        if bound:
            # a retry of a bind that went through, or a pod someone else bound
            return "" if bound == node else f"pod {key} is already bound to node {bound}"
        if not self.may_write():
            metrics.SCHEDULER_BINDS_REFUSED.inc("not_leader")
            return NOT_LEADER
        try:
            pod = pod_from_json(pod_json)
            with self.lock:
                plugin = self.plugin  # this term's allocator: a new term brings a new one
                self._let_go(uid, keep_on=node)  # held on this node: reserve below returns it
                req = plugin.pre_filter(pod)
                if req.wants_devices:
                    alloc = plugin.reserve(req, node)
                    annotations = plugin.pre_bind(req, alloc)
                    gpus = plugin.node_gpus(node)
                    self._refresh()
                else:
                    annotations = {}
        except (PodError, RequestError, Unschedulable) as e:
            return str(e)

        fenced = req.wants_devices and bool(alloc.gpus)
        claimed = ""  # the resourceVersion of this pod's claim, once written

        def undo(error: str) -> str:
            if req.wants_devices:
                with self.lock:
                    plugin.unreserve(req.uid)
            if claimed:
                # withdrawn so it stands in no other bind's way (best effort: a claim left in the way
                # is cleared by the next bind that meets it)
                with contextlib.suppress(ApiFailure):
                    api.clear_claim(ns, name, claimed)
            return error

        def leading() -> bool:
            # the Lease may be lost, or lost and won again: a new term's allocator knows nothing of
            # this reservation and may hand its GPUs to another pod
            return self.may_write() and self.plugin is plugin

        try:
            if not leading():
                metrics.SCHEDULER_BINDS_REFUSED.inc("not_leader")
                return undo(NOT_LEADER)
            rv = str(meta.get("resourceVersion") or "")
            if annotations:
                labels = {fence.CLAIM_LABEL: fence.claim_value(node)} if fenced else None
                rv = api.annotate_pod(ns, name, uid, annotations, rv, labels)
                claimed = rv if fenced else ""
            if fenced:
                # this replica's memory may be behind the API server (a failover, a pause, a slow
                # watch): the claims on the node as the API server has them decide (scheduler/fence.py)
                memory = {g.minor: g.memory for g in gpus}
                node_pods = api.claims(node)
                why, in_way = fence.judge(uid, alloc.gpus, node_pods, lambda m: memory.get(m, 0))
                if not why and (why := self._held_by_claims(node, node_pods, alloc.gpus, gpus)):
                    self.resync_claims()
                if why:
                    metrics.SCHEDULER_BINDS_REFUSED.inc("stale_view")
                    return undo(f"pod {key} on node {node}: {why}; not binding on a stale view")
                for other in in_way:
                    m = other.get("metadata") or {}
                    log.warning(
                        "clearing an unbound claim on the same GPUs",
                        extra={"pod": key, "node": node, "claim": f"{m.get('namespace')}/{m.get('name')}"},
                    )
                    api.clear_claim(str(m.get("namespace")), str(m.get("name")), str(m.get("resourceVersion")))
            if not leading():
                metrics.SCHEDULER_BINDS_REFUSED.inc("not_leader")
                return undo(NOT_LEADER)
            api.bind_pod(ns, name, uid, node, rv)
        except ApiFailure as e:
            if e.code == 409 and self._bound_to(ns, name, uid, node):
                return ""  # a concurrent duplicate of this bind won
            return undo(f"pod {key} on node {node}: {e}")
        except Exception as e:  # the reservation must not outlive a failed bind, whatever failed
            return undo(f"pod {key} on node {node}: {type(e).__name__}: {e}")
        return ""

    def _held_by_claims(
        self, node: str, node_pods: Sequence[Mapping[str, Any]], given: Sequence[DeviceAllocation], gpus: Sequence[Gpu]
    ) -> str | None:
        """Why `given` collides with GPUs that ResourceClaims of the node's pods hold, read now: the
        claim and slice watches may be behind (a stalled connection is noticed only at its read
        timeout). A claim whose pod is not bound yet is left to the DRA driver's check at prepare."""
        assert self.api is not None
        refs = sorted({ref for p in node_pods for ref in claims.claim_refs(p)})
        if not refs:
            return None
        held = claims.held_on(node, gpus, self.api.node_slices(node), self.api.resource_claims(refs))
        return fence.held_by_claims(given, held)

    def _bound_to(self, ns: str, name: str, uid: str, node: str) -> bool:
        assert self.api is not None
        try:
            pod = self.api.get_pod(ns, name)
        except ApiFailure:
            return False
        return (pod.get("metadata") or {}).get("uid") == uid and (pod.get("spec") or {}).get("nodeName") == node
