"""What crihook knows about the node's pods and containers, kept across restarts.

The runtime is the source of truth for which pods and containers exist; the store adds what only
crihook knows (what each hook did) and lets post hooks of Stop/Remove calls, which carry only an
id, see the pod. At start it is reconciled against ListPodSandbox/ListContainers before crihook serves.

Two files in the state dir, so that a write costs what changed, not what is stored:
- `store.json`, the snapshot: written atomically (temporary file, fsync, rename) with a checksum over
  its body, which names its generation; a file cut short or damaged is set aside, never trusted.
- `store.journal`, what changed since: one line per write, `<sha256 of the rest> <JSON>`, the JSON
  holding the generation and each changed record as it now is (null: removed), appended and fsynced.
  Lines of another generation predate the snapshot (it holds them already) and are skipped; a torn
  last line (a crash mid-append) is dropped; a line failing its checksum ends what is applied, and
  the journal is set aside. Once the journal outgrows the snapshot `COMPACT_RATIO` times, the next
  write is a new snapshot (a new generation), which empties it.
Version 1 (a snapshot rewritten on every write, no generation, no journal) is still read, so an
upgraded node keeps its records; the first write after it is a version 2 snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
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

from google.protobuf import json_format

from crihook.base.metrics import STORE_OBJECTS
from crihook.hooks.base import ContainerInfo, PodInfo
from crihook.hooks.criview import resources_from_record, resources_record, resources_view
from crihook.proto import runtime_v1_pb2 as cri

log = logging.getLogger("crihook.store")

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
FLUSH_DELAY = 0.05  # seconds: lifecycle bursts coalesce into one write
COMPACT_RATIO = 4  # a new snapshot once the journal is this many times the snapshot's size,
COMPACT_FLOOR = 64 << 10  # the snapshot counted as at least this many bytes (a journal of 256 KiB at least)
_HASH_HEX = 64  # a journal line's checksum: sha256, hex


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


def _verbose_config(info: Mapping[str, str]) -> dict[str, Any]:
    """The config a sandbox or container was created with, from its verbose status `info`: the JSON
    under "info" holds it as "config" (containerd 1.6, 1.7 and 2.x alike, Go's field names, edits of
    any proxy included). {} when it is not there or not readable."""
    try:
        config = json.loads(info.get("info") or "{}").get("config")
    except (ValueError, AttributeError):
        return {}
    return config if isinstance(config, dict) else {}


def _section(doc: dict[str, Any], key: str) -> dict[str, Any]:
    value = doc.get(key)
    return value if isinstance(value, dict) else {}


def sandbox_cgroup_parent(info: Mapping[str, str]) -> str:
    """The cgroup parent a sandbox was created with (linux.cgroup_parent of its verbose
    PodSandboxStatus's config); "" when it is not there."""
    parent = _section(_verbose_config(info), "linux").get("cgroup_parent", "")
    return parent if isinstance(parent, str) else ""


def container_created_with(status: cri.ContainerStatusResponse) -> tuple[dict[str, str], dict[str, Any]]:
    """The envs and resources of a container crihook did not see created, for its store record,
    from its verbose ContainerStatus: the envs from the config the runtime got, the resources as
    they are now from the status's own `resources` when the runtime fills it (the config keeps
    those it was created with, not those UpdateContainerResources set). Empty for what is not there
    or not readable: a record as before, never an error."""
    config = _verbose_config(status.info)
    try:
        envs = {str(e["key"]): str(e.get("value", "")) for e in config.get("envs") or ()}
    except (AttributeError, KeyError, TypeError):
        envs = {}
    now = status.status.resources
    if status.status.HasField("resources") and now.HasField("linux"):
        return envs, resources_record(resources_view(now.linux, True))
    created = _section(config, "linux").get("resources")
    if not isinstance(created, dict):
        return envs, {}
    try:
        linux = json_format.ParseDict(created, cri.LinuxContainerResources(), ignore_unknown_fields=True)
    except json_format.ParseError:
        return envs, {}
    return envs, resources_record(resources_view(linux, True))


_POD_FIELDS = tuple(f.name for f in fields(PodRecord))
_CONTAINER_FIELDS = tuple(f.name for f in fields(ContainerRecord))


def _row(rec: Any, names: tuple[str, ...]) -> dict[str, Any]:
    return {name: getattr(rec, name) for name in names}


class StoreFileError(Exception):
    pass


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _canonical(body: Any) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _checksum(body: dict[str, Any]) -> str:
    return "sha256:" + hashlib.sha256(_canonical(body)).hexdigest()


@dataclass(slots=True)
class Contents:
    """What the two files hold, verified: the snapshot with its journal applied."""

    body: dict[str, Any]  # "pods" and "containers": lists of records as JSON objects
    generation: int
    version: int
    dropped: str = ""  # why part of the journal was not applied; "" when all of it was
    damaged: bool = False  # the dropped part was more than a torn last append


def journal_path(path: Path) -> Path:
    return path.with_suffix(".journal")


def read_file(path: Path) -> dict[str, Any]:
    """The verified body of a store (the snapshot `path` and its journal beside it).
    Raises FileNotFoundError or StoreFileError."""
    return read_store(path).body


def read_store(path: Path) -> Contents:
    """The snapshot and its journal, verified. Raises FileNotFoundError (no snapshot: a journal
    without one is never used) or StoreFileError (the snapshot is damaged)."""
    raw = path.read_bytes()
    try:
        doc = json.loads(raw)
        body, version = doc["body"], doc.get("version")
        ok = version in READABLE_VERSIONS and doc.get("checksum") == _checksum(body)
    except (ValueError, KeyError, TypeError, AttributeError):
        raise StoreFileError(f"{path} is not a crihook store file (truncated or damaged)") from None
    if not ok:
        raise StoreFileError(f"{path} failed its checksum (half-written or edited by hand)")
    if not isinstance(body, dict):
        raise StoreFileError(f"{path} holds a {type(body).__name__}, not a store body (edited by hand)")
    generation = body.pop("generation", None) if version > 1 else 0
    if not isinstance(generation, int) or isinstance(generation, bool) or generation < 0:
        raise StoreFileError(f"{path}: generation {generation!r} (edited by hand)")
    contents = Contents(body, generation, version)
    if version > 1:
        kept = {kind: _by_id(body.get(kind, []), f"{path}: {kind}") for kind in ("pods", "containers")}
        _apply_journal(journal_path(path), contents, kept)
        body.update((kind, list(rows.values())) for kind, rows in kept.items())
    return contents


def _by_id(raw: Any, where: str) -> dict[str, Any]:
    if not isinstance(raw, list) or not all(isinstance(r, dict) and isinstance(r.get("id"), str) for r in raw):
        raise StoreFileError(f"{where}: expected a list of records with an id")
    return {r["id"]: r for r in raw}


def _journal_line(line: bytes) -> dict[str, Any] | None:
    """One verified journal line, or None: a checksum that fails, or a shape crihook never writes."""
    payload = line[_HASH_HEX + 1 :]
    if line[_HASH_HEX : _HASH_HEX + 1] != b" " or hashlib.sha256(payload).hexdigest().encode() != line[:_HASH_HEX]:
        return None
    try:
        batch = json.loads(payload)
    except ValueError:
        return None
    ok = isinstance(batch, dict) and isinstance(batch.get("generation"), int)
    for kind in ("pods", "containers"):
        rows = batch.get(kind) if ok else None
        ok = (
            ok
            and isinstance(rows, dict)
            and all(r is None or (isinstance(r, dict) and r.get("id") == i) for i, r in rows.items())
        )
    return batch if ok else None


def _apply_journal(path: Path, contents: Contents, kept: dict[str, dict[str, Any]]) -> None:
    """Apply the journal's lines of the snapshot's generation, in order, up to the first bad one."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return
    start = number = 0
    while start < len(raw):
        end = raw.find(b"\n", start)
        if end < 0:
            contents.dropped = f"a torn last append ({len(raw) - start} bytes) was dropped"
            return
        number += 1
        batch = _journal_line(raw[start:end])
        if batch is None:
            contents.dropped = (
                f"line {number} failed its checksum; it and the {len(raw) - end - 1} bytes after it were dropped"
            )
            contents.damaged = True
            return
        start = end + 1
        if batch["generation"] != contents.generation:
            continue  # written before the snapshot, which holds it
        for kind in ("pods", "containers"):
            rows = kept[kind]
            for rid, row in batch[kind].items():
                if row is None:
                    rows.pop(rid, None)
                else:
                    rows[rid] = row


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


@dataclass(slots=True)
class _Write:
    """An encoding for the writer thread: a whole snapshot, or the payload of one journal line."""

    seq: int  # encodings are numbered so that an older one never lands after a newer snapshot
    pieces: list[bytes]  # joined by the writer, off the event loop
    snapshot: bool


class Store:
    def __init__(self, state_dir: str | Path) -> None:
        self.path = Path(state_dir) / "store.json"
        self.journal = journal_path(self.path)
        self.pods: dict[str, PodRecord] = {}
        self.containers: dict[str, ContainerRecord] = {}
        self._dirty = False
        self._flush_task: asyncio.Task[None] | None = None
        self._write_lock = threading.Lock()
        self._encoded = 0  # encodings made
        self._rows: dict[tuple[str, str], bytes] = {}  # ("pods" | "containers", id) -> encoded record
        self._pending: set[tuple[str, str]] = set()  # records changed since the last encoding
        self._written = 0  # the newest encoding on disk
        self._generation = 0  # the snapshot's; journal lines carry it
        self._snapshot_due = True  # no snapshot of this generation on disk to append to yet
        self._snapshot_bytes = 0
        self._journal_bytes = 0

    # -- persistence -------------------------------------------------------------------------

    def load(self) -> str:
        """Read the files: 'ok', 'missing', 'partial' (a damaged journal line and what followed it
        were not applied; the journal is set aside) or 'corrupt' (the snapshot is damaged: both are
        set aside and nothing is used)."""
        aside = f".corrupt-{int(time.time())}"
        try:
            contents = read_store(self.path)
            self.pods = _records(PodRecord, contents.body.get("pods", []), "pods")
            self.containers = _records(ContainerRecord, contents.body.get("containers", []), "containers")
        except FileNotFoundError:
            with contextlib.suppress(FileNotFoundError):  # of a snapshot removed by hand: never of use, and
                self.journal.unlink()  # its generation could match the next snapshot's
                log.warning("store journal without its snapshot removed", extra={"path": str(self.journal)})
            return "missing"
        except StoreFileError as e:
            log.error("store file ignored", extra={"error": str(e), "moved_to": str(self.path.with_suffix(aside))})
            self.path.replace(self.path.with_suffix(aside))
            with contextlib.suppress(FileNotFoundError):
                self.journal.replace(self.journal.with_name(self.journal.name + aside))
            self.pods, self.containers = {}, {}
            return "corrupt"
        self._generation = contents.generation
        # appending after a dropped line would hide the new lines too; a version 1 file is rewritten
        self._snapshot_due = bool(contents.dropped) or contents.version < FORMAT_VERSION
        if contents.damaged:
            moved = self.journal.with_name(self.journal.name + aside)
            log.error("store journal cut short", extra={"error": contents.dropped, "moved_to": str(moved)})
            self.journal.replace(moved)
            return "partial"
        if contents.dropped:
            log.warning("store journal cut short", extra={"error": contents.dropped})
        return "ok"

    def _encode(self, reuse: bool = False) -> _Write:
        """A snapshot: the body in canonical JSON (what the checksum covers: json.dumps of
        {"containers": [...], "generation": N, "pods": [...]} with sorted keys, compact), as pieces
        that join into it byte for byte, of a new generation. Marks the store clean.
        `reuse`: records not changed through this class's methods since the last encoding keep
        their encoded row (a node's hundred pods are not encoded again for each one that starts);
        otherwise all are encoded."""
        rows = self._rows if reuse else {}
        self._generation += 1
        pieces = [b'{"containers":[']
        for kind, records, names in (
            ("containers", self.containers, _CONTAINER_FIELDS),
            ("pods", self.pods, _POD_FIELDS),
        ):
            if kind == "pods":
                pieces.append(b'],"generation":%d,"pods":[' % self._generation)
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
        self._snapshot_due = False
        self._snapshot_bytes = sum(map(len, pieces))
        self._journal_bytes = 0
        return self._encoded_now(pieces, snapshot=True)

    def _encode_changes(self) -> _Write:
        """A journal line's JSON: each record changed since the last encoding as it is now, null
        for one removed. Costs what changed, whatever the store holds. Marks the store clean."""
        pieces = [b'{"containers":{']
        for kind, records, names in (
            ("containers", self.containers, _CONTAINER_FIELDS),
            ("pods", self.pods, _POD_FIELDS),
        ):
            if kind == "pods":
                pieces.append(b'},"generation":%d,"pods":{' % self._generation)
            comma = False
            for key in self._pending:
                if key[0] != kind:
                    continue
                rec = records.get(key[1])
                row = b"null" if rec is None else self._rows.get(key)
                if row is None:
                    row = self._rows[key] = _canonical(_row(rec, names))
                pieces += (b"," if comma else b"", _canonical(key[1]), b":", row)
                comma = True
        pieces.append(b"}}")
        self._journal_bytes += sum(map(len, pieces)) + _HASH_HEX + 2
        return self._encoded_now(pieces, snapshot=False)

    def _encoded_now(self, pieces: list[bytes], snapshot: bool) -> _Write:
        self._pending.clear()
        self._encoded += 1
        self._dirty = False
        return _Write(self._encoded, pieces, snapshot)

    def _next_write(self) -> _Write:
        """A journal line, or a snapshot when one is due: none yet, a write failed, or the journal
        has outgrown the snapshot."""
        limit = COMPACT_RATIO * max(self._snapshot_bytes, COMPACT_FLOOR)
        if self._snapshot_due or self._journal_bytes > limit:
            return self._encode(reuse=True)
        return self._encode_changes()

    def _write(self, write: _Write) -> None:
        """Put an encoding on disk: may block on the disk, so the event loop calls it through a
        worker thread."""
        with self._write_lock:
            if write.seq <= self._written:
                return
            if write.snapshot:
                self._write_snapshot(write.pieces)
            else:
                self._append(write.pieces)
            self._written = write.seq

    def _write_snapshot(self, pieces: list[bytes]) -> None:
        """Atomically replace the snapshot, then empty the journal (its lines are in the snapshot now,
        and of an older generation: were the emptying lost, they would be skipped)."""
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
        _fsync_dir(self.path.parent)  # the rename is on disk before the journal is emptied
        try:
            os.close(os.open(self.journal, os.O_WRONLY | os.O_TRUNC))
        except FileNotFoundError:
            os.close(os.open(self.journal, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            _fsync_dir(self.path.parent)  # appends are fsynced to a file whose name is on disk

    def _append(self, pieces: list[bytes]) -> None:
        """Append one checksummed line to the journal and fsync it."""
        payload = b"".join(pieces)
        line = hashlib.sha256(payload).hexdigest().encode() + b" " + payload + b"\n"
        fd = os.open(self.journal, os.O_WRONLY | os.O_APPEND)  # no O_CREAT: a journal gone means a snapshot
        try:
            if os.write(fd, line) != len(line):
                raise OSError(errno.EIO, "short write", str(self.journal))
            os.fsync(fd)
        finally:
            os.close(fd)

    def save(self) -> None:
        """Write a snapshot now, on this thread (start, reconciliation, shutdown)."""
        self._write(self._encode())

    def changed(self, row: tuple[str, str]) -> None:
        """Schedule a write (calls in one burst share it); `row`'s encoding is stale."""
        self._rows.pop(row, None)
        self._pending.add(row)
        self._dirty = True
        STORE_OBJECTS.set(len(self.pods), "pods")
        STORE_OBJECTS.set(len(self.containers), "containers")
        if self._flush_task is None or self._flush_task.done():
            self._flush_task = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        """Encode on the event loop (a consistent state, no copies), write and fsync on a worker
        thread: a slow or stalled disk must not hold up CRI calls. Changes made meanwhile go in the
        next round."""
        while self._dirty:
            await asyncio.sleep(FLUSH_DELAY)
            write = self._next_write()
            try:
                await asyncio.to_thread(self._write, write)
            except OSError as e:
                self._dirty = self._snapshot_due = True  # the journal may end in a torn line now
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
            self._pending.add(("containers", cid))
        if pod is not None:
            self.changed(("pods", pod_id))
        return pod

    def remove_container(self, container_id: str) -> ContainerRecord | None:
        c = self.containers.pop(container_id, None)
        if c is not None:
            self.changed(("containers", container_id))
        return c
