"""What crihook knows about the node's pods and containers, kept across restarts.

The runtime is the source of truth for which pods and containers exist; the store adds what only
crihook knows (what each hook did) and lets post hooks of Stop/Remove calls, which carry only an
id, see the pod. It is written atomically (temporary file, fsync, rename) with a checksum over the
body, so a file cut short or damaged is detected and ignored, never trusted; at start it is
reconciled against ListPodSandbox/ListContainers before crihook serves.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from crihook.base.metrics import STORE_OBJECTS
from crihook.hooks.base import ContainerInfo, PodInfo
from crihook.hooks.criview import resources_from_record

log = logging.getLogger("crihook.store")

FORMAT_VERSION = 1
FLUSH_DELAY = 0.05  # seconds: lifecycle bursts coalesce into one write


@dataclass(slots=True)
class PodRecord:
    id: str
    name: str
    namespace: str
    uid: str
    attempt: int = 0
    state: str = "ready"  # ready | notready
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    cgroup_parent: str = ""
    hooks: list[dict[str, Any]] = field(default_factory=list)
    created: float = 0.0
    runtime_handler: str = ""
    resources: dict[str, Any] = field(default_factory=dict)  # LinuxContainerResources fields; {} unknown
    overhead: dict[str, Any] = field(default_factory=dict)

    def view(self) -> PodInfo:
        """The pod as hooks see it, for a call that names it only by id."""
        return PodInfo(
            name=self.name,
            namespace=self.namespace,
            uid=self.uid,
            attempt=self.attempt,
            id=self.id,
            labels=self.labels,
            annotations=self.annotations,
            cgroup_parent=self.cgroup_parent,
            runtime_handler=self.runtime_handler,
            resources=resources_from_record(self.resources),
            overhead=resources_from_record(self.overhead),
        )


@dataclass(slots=True)
class ContainerRecord:
    id: str
    pod_id: str
    name: str
    attempt: int = 0
    state: str = "created"  # created | running | exited | unknown
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    hooks: list[dict[str, Any]] = field(default_factory=list)
    created: float = 0.0
    # what the container was created with, after the hooks (later stages' hooks are told)
    envs: dict[str, str] = field(default_factory=dict)
    resources: dict[str, Any] = field(default_factory=dict)  # LinuxContainerResources fields; {} unknown

    def view(self) -> ContainerInfo:
        """The container as hooks see it, for a call that names it only by id."""
        return ContainerInfo(
            name=self.name,
            attempt=self.attempt,
            id=self.id,
            labels=self.labels,
            annotations=self.annotations,
            envs=tuple(self.envs.items()),
            resources=resources_from_record(self.resources),
        )


def sandbox_cgroup_parent(info: Mapping[str, str]) -> str:
    """The cgroup parent a sandbox was created with, from its verbose PodSandboxStatus `info`: the
    JSON under "info" holds the PodSandboxConfig as "config" (containerd 1.6, 1.7 and 2.x alike,
    encoded with Go's field names: linux.cgroup_parent). "" when it is not there."""
    try:
        config = json.loads(info.get("info") or "{}").get("config") or {}
        parent = (config.get("linux") or {}).get("cgroup_parent", "")
    except (ValueError, AttributeError):
        return ""
    return parent if isinstance(parent, str) else ""


_POD_FIELDS = tuple(f.name for f in fields(PodRecord))
_CONTAINER_FIELDS = tuple(f.name for f in fields(ContainerRecord))


def _row(rec: Any, names: tuple[str, ...]) -> dict[str, Any]:
    return {name: getattr(rec, name) for name in names}


class StoreFileError(Exception):
    pass


def _canonical(body: Any) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _checksum(body: dict[str, Any]) -> str:
    return "sha256:" + hashlib.sha256(_canonical(body)).hexdigest()


def read_file(path: Path) -> dict[str, Any]:
    """The verified body of a store file. Raises FileNotFoundError or StoreFileError."""
    raw = path.read_bytes()
    try:
        doc = json.loads(raw)
        body = doc["body"]
        ok = doc.get("version") == FORMAT_VERSION and doc.get("checksum") == _checksum(body)
    except (ValueError, KeyError, TypeError, AttributeError):
        raise StoreFileError(f"{path} is not a crihook store file (truncated or damaged)") from None
    if not ok:
        raise StoreFileError(f"{path} failed its checksum (half-written or edited by hand)")
    if not isinstance(body, dict):
        raise StoreFileError(f"{path} holds a {type(body).__name__}, not a store body (edited by hand)")
    return body


def _record(cls: type, raw: Any, where: str) -> Any:
    """A record from its JSON, with every field of the type the dataclass declares: a store file
    edited by hand must fail here, at load, not later inside a CRI call."""
    if not isinstance(raw, dict):
        raise StoreFileError(f"{where}: expected an object")
    try:
        rec = cls(**raw)
    except TypeError as e:
        raise StoreFileError(f"{where}: {e}") from None
    for f in fields(cls):
        value = getattr(rec, f.name)
        kind = str(f.type)
        if kind == "str":
            ok = isinstance(value, str)
        elif kind == "int":
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif kind == "float":
            ok = isinstance(value, int | float) and not isinstance(value, bool)
        elif kind.startswith("dict[str, str]"):
            ok = isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
        elif kind.startswith("dict[str, Any]"):
            ok = isinstance(value, dict) and all(isinstance(k, str) for k in value)
        else:  # the hook records: a list of objects
            ok = isinstance(value, list) and all(isinstance(h, dict) for h in value)
        if not ok:
            raise StoreFileError(f"{where}.{f.name}: expected {kind}, got {type(value).__name__}")
    return rec


def _records(cls: type, raw: Any, where: str) -> dict[str, Any]:
    if not isinstance(raw, list):
        raise StoreFileError(f"{where}: expected a list")
    return {r.id: r for r in (_record(cls, item, f"{where}[{i}]") for i, item in enumerate(raw))}


class Store:
    def __init__(self, state_dir: str | Path) -> None:
        self.path = Path(state_dir) / "store.json"
        self.pods: dict[str, PodRecord] = {}
        self.containers: dict[str, ContainerRecord] = {}
        self._dirty = False
        self._flush_task: asyncio.Task[None] | None = None
        self._write_lock = threading.Lock()
        self._encoded = 0  # encodings made
        self._rows: dict[tuple[str, str], bytes] = {}  # ("pods" | "containers", id) -> encoded record
        self._written = 0  # the newest encoding on disk

    # -- persistence -------------------------------------------------------------------------

    def load(self) -> str:
        """Read the file: 'ok', 'missing' or 'corrupt' (the damaged file is set aside)."""
        try:
            body = read_file(self.path)
            self.pods = _records(PodRecord, body.get("pods", []), "pods")
            self.containers = _records(ContainerRecord, body.get("containers", []), "containers")
            return "ok"
        except FileNotFoundError:
            return "missing"
        except StoreFileError as e:
            aside = self.path.with_suffix(f".corrupt-{int(time.time())}")
            log.error("store file ignored", extra={"error": str(e), "moved_to": str(aside)})
            self.path.replace(aside)
            self.pods, self.containers = {}, {}
            return "corrupt"

    def _encode(self, reuse: bool = False) -> tuple[int, list[bytes]]:
        """The body in canonical JSON (what the checksum covers: json.dumps of {"containers": [...],
        "pods": [...]} with sorted keys, compact), as pieces that join into it byte for byte, numbered
        so that an older encoding never replaces a newer one on disk. Marks the store clean.
        `reuse`: records not changed through this class's methods since the last encoding keep
        their encoded row (a node's hundred pods are not encoded again for each one that starts);
        otherwise all are encoded. The pieces are joined by the writer, off the event loop."""
        rows = self._rows if reuse else {}
        pieces = [b'{"containers":[']
        for kind, records, names in (
            ("containers", self.containers, _CONTAINER_FIELDS),
            ("pods", self.pods, _POD_FIELDS),
        ):
            if kind == "pods":
                pieces.append(b'],"pods":[')
            comma = False
            for rid, rec in records.items():
                row = rows.get((kind, rid))
                if row is None:
                    row = rows[(kind, rid)] = _canonical(_row(rec, names))
                if comma:
                    pieces.append(b",")
                pieces.append(row)
                comma = True
        pieces.append(b"]}")
        self._rows = rows
        self._encoded += 1
        self._dirty = False
        return self._encoded, pieces

    def _write(self, seq: int, pieces: list[bytes]) -> None:
        """Write an encoding atomically: may block on the disk, so the event loop calls it through a
        worker thread. The body is encoded once; the file's "body" is those very bytes."""
        with self._write_lock:
            if seq <= self._written:
                return
            canonical = b"".join(pieces)
            checksum = "sha256:" + hashlib.sha256(canonical).hexdigest()
            head = json.dumps({"version": FORMAT_VERSION, "checksum": checksum})[:-1] + ', "body": '
            data = [head.encode(), canonical, b"}"]
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = self.path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.writev(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
            dfd = os.open(self.path.parent, os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
            self._written = seq

    def save(self) -> None:
        """Write now, on this thread (start, reconciliation, shutdown)."""
        self._write(*self._encode())

    def changed(self, row: tuple[str, str]) -> None:
        """Schedule a write (calls in one burst share it); `row`'s encoding is stale."""
        self._rows.pop(row, None)
        self._dirty = True
        STORE_OBJECTS.set(len(self.pods), "pods")
        STORE_OBJECTS.set(len(self.containers), "containers")
        if self._flush_task is None or self._flush_task.done():
            self._flush_task = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        """Encode on the event loop (a consistent snapshot, no copies), write and fsync on a worker
        thread: a slow or stalled disk must not hold up CRI calls. Changes made meanwhile go in the
        next round."""
        while self._dirty:
            await asyncio.sleep(FLUSH_DELAY)
            seq, pieces = self._encode(reuse=True)
            try:
                await asyncio.to_thread(self._write, seq, pieces)
            except OSError as e:
                self._dirty = True
                log.error("store write failed", extra={"path": str(self.path), "error": str(e)})
                return

    async def close(self) -> None:
        if self._flush_task is not None:
            self._flush_task.cancel()
        if self._dirty or self._written < self._encoded:  # a write still on its thread is redone here
            self.save()

    # -- reconciliation ----------------------------------------------------------------------

    def reconcile(self, live_pods: list[PodRecord], live_containers: list[ContainerRecord]) -> dict[str, int]:
        """Make the store match the runtime: keep what crihook recorded for objects that still
        exist, drop the rest, adopt objects created while crihook was away."""
        pods: dict[str, PodRecord] = {}
        for live in live_pods:
            known = self.pods.get(live.id)
            if known is not None:
                live.hooks, live.created = known.hooks, known.created or live.created
                live.resources, live.overhead = known.resources, known.overhead
                # the runtime's word where it gave one (a verbose sandbox status), else what was recorded
                live.runtime_handler = live.runtime_handler or known.runtime_handler
                live.cgroup_parent = live.cgroup_parent or known.cgroup_parent
            pods[live.id] = live
        containers: dict[str, ContainerRecord] = {}
        for live_c in live_containers:
            known_c = self.containers.get(live_c.id)
            if known_c is not None:
                live_c.hooks, live_c.created = known_c.hooks, known_c.created or live_c.created
                live_c.envs, live_c.resources = known_c.envs, known_c.resources
            containers[live_c.id] = live_c
        stats = {
            "pods": len(pods),
            "containers": len(containers),
            "dropped": len(set(self.pods) - set(pods)) + len(set(self.containers) - set(containers)),
            "adopted": len(set(pods) - set(self.pods)) + len(set(containers) - set(self.containers)),
        }
        self.pods, self.containers = pods, containers
        self.save()
        return stats

    # -- updates from intercepted calls ------------------------------------------------------

    def put_pod(self, pod: PodRecord) -> None:
        self.pods[pod.id] = pod
        self.changed(("pods", pod.id))

    def put_container(self, container: ContainerRecord) -> None:
        self.containers[container.id] = container
        self.changed(("containers", container.id))

    def set_pod_state(self, pod_id: str, state: str) -> PodRecord | None:
        pod = self.pods.get(pod_id)
        if pod is not None and pod.state != state:
            pod.state = state
            self.changed(("pods", pod_id))
        return pod

    def set_container_state(self, container_id: str, state: str) -> ContainerRecord | None:
        c = self.containers.get(container_id)
        if c is not None and c.state != state:
            c.state = state
            self.changed(("containers", container_id))
        return c

    def set_container_resources(self, container_id: str, resources: dict[str, Any]) -> None:
        c = self.containers.get(container_id)
        if c is not None and c.resources != resources:
            c.resources = resources
            self.changed(("containers", container_id))

    def add_hook_records(self, container_id: str, records: list[dict[str, Any]]) -> None:
        c = self.containers.get(container_id)
        if c is not None and records:
            c.hooks.extend(records)
            self.changed(("containers", container_id))

    def remove_pod(self, pod_id: str) -> PodRecord | None:
        pod = self.pods.pop(pod_id, None)
        for cid in [cid for cid, c in self.containers.items() if c.pod_id == pod_id]:
            del self.containers[cid]
            self._rows.pop(("containers", cid), None)
        if pod is not None:
            self.changed(("pods", pod_id))
        return pod

    def remove_container(self, container_id: str) -> ContainerRecord | None:
        c = self.containers.pop(container_id, None)
        if c is not None:
            self.changed(("containers", container_id))
        return c
