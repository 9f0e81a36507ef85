"""The scheduler's view of the cluster, kept from the API server with the `kubernetes` client.

Five list+watch loops (Devices, Nodes, assigned Pods, ResourceSlices, ResourceClaims) feed the
DeviceShare allocator under the extender's lock. Each loop lists first and replaces what it had
(objects gone from the list are removed), then watches from the list's resourceVersion; a 410 Gone,
an error or a broken stream leads to a fresh list, so nothing is missed and a restart rebuilds the
same state from the API server alone (Device objects, the allocation annotations of live pods, and
the GPUs allocated ResourceClaims hold). `ready` turns true once every initial list is in; a cluster
that does not serve `resource.k8s.io/v1` (404) has no claims, and is asked again every minute.

Responses are read raw (`_preload_content=False`): the allocator wants the JSON as the API server
sent it, and decoding thousands of pods into client models would cost more than the scheduling.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any
from urllib.parse import quote, urlencode

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from crihook.base.allocation import CONTAINER_DEVICES, DEVICE_ALLOCATED, AnnotationError
from crihook.scheduler.apijson import MERGE_PATCH, ApiJson
from crihook.scheduler.claims import ClaimAsk, ClaimIndex, claim_ask, claim_key, namespaced
from crihook.scheduler.devices import DeviceError, node_from_device
from crihook.scheduler.extender import ApiFailure
from crihook.scheduler.fence import CLAIM_LABEL, claim_value
from crihook.scheduler.plugin import DeviceShare
from crihook.scheduler.pod import PodError, pod_from_json

log = logging.getLogger("crihook.scheduler")

DEVICE_GROUP = "scheduling.koordinator.sh"
DEVICE_VERSION = "v1alpha1"
DEVICE_PLURAL = "devices"
# as kube-scheduler's own pod informer: finished pods hold nothing and drop out of the watch
POD_SELECTOR = "status.phase!=Succeeded,status.phase!=Failed"
WATCH_SECONDS = 300  # server-side timeout of one watch; the stream then restarts from its version
READ_TIMEOUT = WATCH_SECONDS + 30  # the socket gives up only after the server should have ended it
READ_CHUNK = 1 << 16
BACKOFF = (0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
NOT_SERVED_RETRY = 60.0  # seconds before an optional API that answered 404 is listed again
DRA_PATH = "/apis/resource.k8s.io/v1"


class Expired(Exception):
    """The watch's resourceVersion is too old (410): list again."""


def json_body(resp: Any) -> dict[str, Any]:
    """The JSON object a call made with _preload_content=False answered: the client then returns
    urllib3's response, not the model its annotations name."""
    doc: dict[str, Any] = json.loads(resp.data)
    return doc


class KubeApi:
    """The calls a bind makes, as extender.PodApi, through ApiJson (scheduler/apijson.py)."""

    def __init__(self, api_client: client.ApiClient, timeout: float = 10.0) -> None:
        self.api = ApiJson(api_client, timeout)

    @staticmethod
    def _pod_path(namespace: str, name: str, sub: str = "") -> str:
        path = f"/api/v1/namespaces/{quote(namespace, safe='')}/pods/{quote(name, safe='')}"
        return f"{path}/{sub}" if sub else path

    def claims(self, node: str) -> list[dict[str, Any]]:
        """The live pods claiming `node`, read from the API server now (a LIST without
        resourceVersion is a consistent read): first the unbound ones carrying its claim label,
        then the ones bound to it. In that order a pod bound in between is not missed (a pod goes
        from unbound to bound, never back). Both lists are served from the API
        server's index on spec.nodeName (unbound pods are its "" entry), so neither scans every pod
        of the cluster as a label-only list would."""
        pending = self._pods(f"spec.nodeName=,{POD_SELECTOR}", f"{CLAIM_LABEL}={claim_value(node)}")
        bound = self._pods(f"spec.nodeName={node},{POD_SELECTOR}", "")
        # a pod bound between the two lists is in both: its bound self counts, once
        by_uid = {str((p.get("metadata") or {}).get("uid")): p for p in pending + bound}
        return list(by_uid.values())

    def _pods(self, fields: str, labels: str) -> list[dict[str, Any]]:
        query = {"fieldSelector": fields, **({"labelSelector": labels} if labels else {})}
        items: list[dict[str, Any]] = self.api.call("GET", f"/api/v1/pods?{urlencode(query)}").get("items") or []
        return items

    def resource_claims(self, refs: Iterable[tuple[str, str]]) -> list[dict[str, Any]]:
        """The ResourceClaims (namespace, name) as the API server has them now; gone ones left out."""
        out = []
        for namespace, name in refs:
            path = f"{DRA_PATH}/namespaces/{quote(namespace, safe='')}/resourceclaims/{quote(name, safe='')}"
            try:
                out.append(self.api.call("GET", path))
            except ApiFailure as e:
                if e.code != 404:
                    raise
        return out

    def node_slices(self, node: str) -> list[dict[str, Any]]:
        """The ResourceSlices published for `node`, read now (none where DRA is not served)."""
        try:
            query = urlencode({"fieldSelector": f"spec.nodeName={node}"})
            doc = self.api.call("GET", f"{DRA_PATH}/resourceslices?{query}")
        except ApiFailure as e:
            if e.code != 404:
                raise
            return []
        items: list[dict[str, Any]] = doc.get("items") or []
        return items

    def get_pod(self, namespace: str, name: str) -> dict[str, Any]:
        return self.api.call("GET", self._pod_path(namespace, name))

    def _patch_pod(self, namespace: str, name: str, meta: dict[str, Any]) -> dict[str, Any]:
        return self.api.call("PATCH", self._pod_path(namespace, name), {"metadata": meta}, MERGE_PATCH)

    def annotate_pod(
        self,
        namespace: str,
        name: str,
        uid: str,
        annotations: Mapping[str, str],
        resource_version: str,
        labels: Mapping[str, str] | None = None,
    ) -> str:
        """Returns the pod's new resourceVersion. metadata.uid is immutable, so naming it makes the
        patch fail (422) on a pod created again under the same name; a resourceVersion in a patch is
        a precondition (409 when the pod changed since it was read)."""
        meta: dict[str, Any] = {"uid": uid, "annotations": dict(annotations)}
        if labels:
            meta["labels"] = dict(labels)
        if resource_version:
            meta["resourceVersion"] = resource_version
        return str((self._patch_pod(namespace, name, meta).get("metadata") or {}).get("resourceVersion") or "")

    def clear_claim(self, namespace: str, name: str, resource_version: str) -> None:
        """Take the claim label and the allocation annotations off an unbound pod, if it has not
        changed since `resource_version` (409 otherwise: it may have been bound meanwhile)."""
        self._patch_pod(
            namespace,
            name,
            {
                "resourceVersion": resource_version,
                "labels": {CLAIM_LABEL: None},
                "annotations": {DEVICE_ALLOCATED: None, CONTAINER_DEVICES: None},
            },
        )

    def create_template(self, template: Mapping[str, Any]) -> None:
        """Write a ResourceClaimTemplate (the webhook's DRA conversion); one already there is the same,
        since templates are named after their content."""
        meta = template.get("metadata") or {}
        namespace = quote(str(meta.get("namespace", "")), safe="")
        path = f"{DRA_PATH}/namespaces/{namespace}/resourceclaimtemplates"
        try:
            self.api.call("POST", path, dict(template))
        except ApiFailure as e:
            if e.code != 409:
                raise

    def bind_pod(self, namespace: str, name: str, uid: str, node: str, resource_version: str = "") -> None:
        # uid and resourceVersion are preconditions of the Binding (BindingREST in the API server)
        meta = {"name": name, "namespace": namespace, "uid": uid}
        if resource_version:
            meta["resourceVersion"] = resource_version
        binding = {"apiVersion": "v1", "kind": "Binding", "metadata": meta, "target": {"kind": "Node", "name": node}}
        self.api.call("POST", self._pod_path(namespace, name, "binding"), binding)


class Reflector:
    """One list+watch loop in a thread. `replace(items)` gets every list, `event(type, obj)` every
    watch event, `listed()` is called after each list is in; all run on this thread. `relist()` ends
    the watch and lists again at once, for a view found to be behind the API server."""

    def __init__(
        self,
        name: str,
        list_call: Callable[..., Any],
        replace: Callable[[list[dict[str, Any]]], None],
        event: Callable[[str, dict[str, Any]], None],
        listed: Callable[[], None] | None = None,
        optional: bool = False,
        **selector: str,
    ) -> None:
        self.name = name
        self.optional = optional  # a 404 (the API is not served) counts as an empty list
        self.list_call = list_call
        self.replace = replace
        self.event = event
        self.listed = listed
        self.selector = selector
        self.synced = threading.Event()
        self._stop = threading.Event()
        self._relist = threading.Event()
        self._resp: Any = None
        self._thread = threading.Thread(target=self._run, name=f"watch-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._end_watch()
        self._thread.join(5)

    def relist(self) -> None:
        self._relist.set()
        self._end_watch()

    def _end_watch(self) -> None:
        resp = self._resp
        sock = getattr(getattr(resp, "connection", None), "sock", None)
        if sock is not None:
            # ends the read of a quiet watch; close() would wait for the reading thread's buffer lock
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                rv = self._list()
                failures = 0
                while not self._stop.is_set() and not self._relist.is_set():
                    rv = self._watch(rv)
            except Expired:
                log.info("watch expired, listing again", extra={"resource": self.name})
            except Exception as e:
                if self._stop.is_set():
                    return
                if self._relist.is_set():  # the watch was ended on purpose
                    continue
                if self.optional and isinstance(e, ApiException) and e.status == 404:
                    self._not_served()
                    continue
                delay = BACKOFF[min(failures, len(BACKOFF) - 1)]
                failures += 1
                log.warning("list/watch failed", extra={"resource": self.name, "error": str(e), "retry_in": delay})
                self._stop.wait(delay)

    def _not_served(self) -> None:
        """An optional API answered 404: nothing of it exists (a served API that goes away too)."""
        self.replace([])
        if not self.synced.is_set():
            log.info("API not served, taken as empty", extra={"resource": self.name})
            self.synced.set()
            if self.listed is not None:
                self.listed()
        self._stop.wait(NOT_SERVED_RETRY)

    def _list(self) -> str:
        if self._relist.is_set():
            log.info("view behind the API server, listing again", extra={"resource": self.name})
            self._relist.clear()
        resp = self.list_call(_preload_content=False, _request_timeout=READ_TIMEOUT, **self.selector)
        doc = json_body(resp)
        self.replace(doc.get("items") or [])
        self.synced.set()
        if self.listed is not None:
            self.listed()
        return str((doc.get("metadata") or {}).get("resourceVersion") or "")

    def _watch(self, rv: str) -> str:
        resp = self.list_call(
            watch=True,
            resource_version=rv,
            allow_watch_bookmarks=True,
            timeout_seconds=WATCH_SECONDS,
            _preload_content=False,
            _request_timeout=READ_TIMEOUT,
            **self.selector,
        )
        self._resp = resp
        try:
            if self._stop.is_set() or self._relist.is_set():  # stop() or relist() came before the stream
                return rv
            for ev in _events(resp):
                kind, obj = ev.get("type") or "", ev.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise Expired()
                    raise ApiFailure(int(obj.get("code") or 0), str(obj.get("message")))
                rv = str((obj.get("metadata") or {}).get("resourceVersion") or rv)
                if self._stop.is_set() or self._relist.is_set():
                    break
                if kind != "BOOKMARK":
                    self.event(kind, obj)
        finally:
            self._resp = None
            # closed, never handed back to the pool open: a watch left before its end (stop() or
            # relist() as its request was under way) goes on streaming, and the next request given
            # that connection would wait behind it until its read timeout
            resp.close()
            resp.release_conn()
        return rv


def _events(resp: Any) -> Iterator[dict[str, Any]]:
    """The JSON events of a watch response, one per line. Read by HTTP chunk: readline() on the raw
    response reads a byte at a time, which costs more CPU than the events themselves."""
    buf = b""
    for chunk in resp.stream(READ_CHUNK, decode_content=True):
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line.strip():
                yield json.loads(line)
    if buf.strip():
        yield json.loads(buf)


class ClusterCache:
    """Devices, Nodes, assigned Pods, ResourceSlices and ResourceClaims from the API server into
    `plugin`, under `lock`; `settled()` is called on a watch thread whenever a list completes with
    all of them in."""

    def __init__(
        self,
        api_client: client.ApiClient,
        plugin: DeviceShare,
        lock: threading.Lock,
        settled: Callable[[], None] | None = None,
    ) -> None:
        self.plugin = plugin
        self.lock = lock
        self.settled = settled
        self.devices: dict[str, dict[str, Any]] = {}
        self.nodes: dict[str, tuple[dict[str, str], dict[str, Any]]] = {}  # name -> (labels, allocatable)
        self.pods: dict[str, str] = {}  # uid -> node, pods charged to the allocator
        self.priorities: dict[str, int] = {}  # uid -> spec.priority of those pods (for preemption)
        self.claims = ClaimIndex()  # the GPUs allocated ResourceClaims hold
        self.claim_asks: dict[str, ClaimAsk] = {}  # namespace/name -> the GPUs a claim asks (for prioritize)
        core = client.CoreV1Api(api_client)
        custom = client.CustomObjectsApi(api_client)
        dra = client.ResourceV1Api(api_client)

        def list_devices(**kw: Any) -> Any:
            return custom.list_cluster_custom_object(DEVICE_GROUP, DEVICE_VERSION, DEVICE_PLURAL, **kw)

        self.reflectors = [
            Reflector("devices", list_devices, self._replace_devices, self._device_event, self._listed),
            Reflector("nodes", core.list_node, self._replace_nodes, self._node_event, self._listed),
            Reflector(
                "pods",
                core.list_pod_for_all_namespaces,
                self._replace_pods,
                self._pod_event,
                self._listed,
                field_selector=POD_SELECTOR,
            ),
            Reflector(
                "resourceslices",
                dra.list_resource_slice,
                self._replace_slices,
                self._slice_event,
                self._listed,
                optional=True,
            ),
            Reflector(
                "resourceclaims",
                dra.list_resource_claim_for_all_namespaces,
                self._replace_claims,
                self._claim_event,
                self._listed,
                optional=True,
            ),
        ]

    def start(self) -> None:
        for r in self.reflectors:
            r.start()

    def stop(self) -> None:
        for r in self.reflectors:
            r.stop()

    def ready(self) -> bool:
        return all(r.synced.is_set() for r in self.reflectors)

    def wait_ready(self, timeout: float | None = None) -> bool:
        return all(r.synced.wait(timeout) for r in self.reflectors)

    def _listed(self) -> None:
        if self.settled is not None and self.ready():
            self.settled()

    def resync_claims(self) -> None:
        """List the ResourceSlices and ResourceClaims again: a bind found them behind the API server."""
        for r in self.reflectors:
            if r.name in ("resourceslices", "resourceclaims"):
                r.relist()

    # --- nodes and devices: a node is schedulable for devices when both objects are known ---

    def _refresh(self, name: str) -> None:
        """Caller holds self.lock."""
        dev, node = self.devices.get(name), self.nodes.get(name)
        if dev is None or node is None:
            self.plugin.remove_node(name)
            self._claimed(self.claims.remove_node(name))
            return
        try:
            nd = node_from_device(dev, node[0], node[1])
        except DeviceError as e:
            log.warning("Device ignored", extra={"node": name, "error": str(e)})
            self.plugin.remove_node(name)
            self._claimed(self.claims.remove_node(name))
            return
        self.plugin.set_node(nd)
        self._claimed(self.claims.set_gpus(name, nd.gpus))

    def _claimed(self, nodes: set[str]) -> None:
        """Caller holds self.lock: tell the allocator which GPUs claims now hold on `nodes`."""
        for name in nodes:
            self.plugin.set_claimed(name, self.claims.held(name))

    @staticmethod
    def _name(obj: Mapping[str, Any]) -> str:
        return str((obj.get("metadata") or {}).get("name") or "")

    def _replace_devices(self, items: list[dict[str, Any]]) -> None:
        with self.lock:
            gone = set(self.devices) - {self._name(d) for d in items}
            self.devices = {self._name(d): d for d in items}
            for name in gone | set(self.devices):
                self._refresh(name)

    def _device_event(self, kind: str, obj: dict[str, Any]) -> None:
        name = self._name(obj)
        with self.lock:
            if kind == "DELETED":
                self.devices.pop(name, None)
            else:
                self.devices[name] = obj
            self._refresh(name)

    @staticmethod
    def _node_facts(obj: Mapping[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        allocatable = (obj.get("status") or {}).get("allocatable") or {}
        return dict(labels), dict(allocatable)

    def _replace_nodes(self, items: list[dict[str, Any]]) -> None:
        with self.lock:
            before = self.nodes
            self.nodes = {self._name(n): self._node_facts(n) for n in items}
            for name in set(before) | set(self.nodes):
                if before.get(name) != self.nodes.get(name):
                    self._refresh(name)

    def _node_event(self, kind: str, obj: dict[str, Any]) -> None:
        name = self._name(obj)
        with self.lock:
            old = self.nodes.get(name)
            if kind == "DELETED":
                self.nodes.pop(name, None)
            else:
                self.nodes[name] = self._node_facts(obj)
            if old != self.nodes.get(name):  # status heartbeats change nothing we use
                self._refresh(name)

    # --- pods ---

    def _charge(self, obj: dict[str, Any]) -> None:
        """Caller holds self.lock."""
        try:
            pod = pod_from_json(obj)
        except PodError as e:
            log.warning("pod ignored", extra={"error": str(e)})
            return
        uid = pod.uid or pod.key
        if not pod.node_name or pod.finished:
            if uid in self.pods:
                self._drop(uid)
            return
        try:
            self.plugin.add_pod(pod, pod.node_name)
        except AnnotationError as e:
            # the node hook refuses such a pod too; it holds nothing we could account for
            log.warning("pod allocation annotation ignored", extra={"pod": pod.key, "error": str(e)})
            return
        self.pods[uid] = pod.node_name
        priority = (obj.get("spec") or {}).get("priority")
        self.priorities[uid] = priority if isinstance(priority, int) else 0

    def _drop(self, uid: str) -> None:
        """Caller holds self.lock."""
        self.pods.pop(uid, None)
        self.priorities.pop(uid, None)
        self.plugin.remove_pod(uid)  # also frees a reservation of a pod deleted while pending

    def _replace_pods(self, items: list[dict[str, Any]]) -> None:
        with self.lock:
            listed = {str((p.get("metadata") or {}).get("uid") or "") for p in items}
            for uid in set(self.pods) - listed:
                self._drop(uid)
            for p in items:
                self._charge(p)

    def _pod_event(self, kind: str, obj: dict[str, Any]) -> None:
        with self.lock:
            if kind == "DELETED":
                self._drop(str((obj.get("metadata") or {}).get("uid") or ""))
            else:
                self._charge(obj)

    # --- DRA: the GPUs allocated claims hold, matched through the slices that published them ---

    def _replace_slices(self, items: list[dict[str, Any]]) -> None:
        with self.lock:
            self._claimed(self.claims.replace_slices((self._name(o), o) for o in items))

    def _slice_event(self, kind: str, obj: dict[str, Any]) -> None:
        with self.lock:
            if kind == "DELETED":
                self._claimed(self.claims.remove_slice(self._name(obj)))
            else:
                self._claimed(self.claims.set_slice(self._name(obj), obj))

    def _replace_claims(self, items: list[dict[str, Any]]) -> None:
        with self.lock:
            self._claimed(self.claims.replace_claims((claim_key(o), o) for o in items))
            self.claim_asks.clear()
            self.claim_asks.update((namespaced(o), a) for o in items if (a := claim_ask(o)) is not None)

    def _claim_event(self, kind: str, obj: dict[str, Any]) -> None:
        ask = None if kind == "DELETED" else claim_ask(obj)
        with self.lock:
            if kind == "DELETED":
                self._claimed(self.claims.remove_claim(claim_key(obj)))
            else:
                self._claimed(self.claims.set_claim(claim_key(obj), obj))
            if ask is None:
                self.claim_asks.pop(namespaced(obj), None)
            else:
                self.claim_asks[namespaced(obj)] = ask
