"""The store: what crihook knows about the node's pods and containers, kept across restarts.

The runtime is the source of truth for which pods and containers exist; the store adds what only
crihook knows (what each hook did) and lets post hooks of Stop/Remove calls, which carry only an
id, see the pod. At start it is reconciled against ListPodSandbox/ListContainers before crihook
serves. It owns the records in memory, when they are written (the changes of a burst are encoded
on the event loop FLUSH_DELAY after its first, and written by the store's writer thread, which puts
the lines queued meanwhile in one append) and whether a write is a journal line or a new snapshot;
the bytes of both files are node/storefile.py's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from crihook.base.metrics import STORE_OBJECTS
from crihook.node import storefile
from crihook.node.records import ContainerRecord, PodRecord, stored_env
from crihook.node.storefile import StoreFileError

log = logging.getLogger("crihook.store")

# seconds: the changes of a burst (a pod's start, its teardown) are encoded and written together,
# after the calls that made them
FLUSH_DELAY = 0.05
COMPACT_RATIO = 4  # a new snapshot once the journal is this many times the snapshot's size,
COMPACT_FLOOR = 64 << 10  # the snapshot counted as at least this many bytes (a journal of 256 KiB at least)


@dataclass(slots=True)
class _Write:
    """An encoding for the writer thread: a whole snapshot, or the payload of one journal line."""

    seq: int  # encodings are numbered so that an older one never lands after a newer snapshot
    pieces: list[bytes]  # joined by the writer, off the event loop
    snapshot: bool


class _Writer:
    """The store's writer thread. The event loop hands it encodings and hears back only of a
    failure: a write wakes the loop for nothing, and a slow or stalled disk never holds it up. The
    encodings queued while a write is under way are written together next (one append, one fsync)."""

    def __init__(self, store: Store, loop: asyncio.AbstractEventLoop) -> None:
        self._store = store
        self._loop = loop
        self._queue: queue.SimpleQueue[_Write | concurrent.futures.Future[None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="crihook-store-writer", daemon=True)
        self._thread.start()

    def put(self, item: _Write | concurrent.futures.Future[None] | None) -> None:
        """An encoding to write, a future set once what was put before it is written (or failed),
        or None: the thread ends after what was put before."""
        self._queue.put(item)

    def _run(self) -> None:
        while True:
            items = [self._queue.get()]
            with contextlib.suppress(queue.Empty):
                while True:
                    items.append(self._queue.get_nowait())
            writes = [i for i in items if isinstance(i, _Write)]
            if writes:
                try:
                    self._store._put(writes)
                except Exception as e:  # the thread goes on: the next write is a snapshot
                    log.error(
                        "store write failed",
                        extra={"path": str(self._store.path), "error": str(e)},
                        exc_info=not isinstance(e, OSError),
                    )
                    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: close() saves
                        self._loop.call_soon_threadsafe(self._store._write_failed)
            for item in items:
                if isinstance(item, concurrent.futures.Future):
                    item.set_result(None)
            if any(item is None for item in items):
                return


class Store:
    """The records, in memory and on disk; every change goes through its methods."""

    def __init__(self, state_dir: str | Path) -> None:
        self.path = Path(state_dir) / "store.json"
        self.journal = storefile.journal_path(self.path)
        self.pods: dict[str, PodRecord] = {}
        self.containers: dict[str, ContainerRecord] = {}
        self._dirty = False
        self._hand_over_at: asyncio.TimerHandle | None = None  # when the changes go to the writer
        self._writer: _Writer | None = None  # started with the first hand-over
        self._failed = False  # a write failed: journal lines wait for the next snapshot
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
            contents = storefile.read_store(self.path)
            self.pods = storefile.records(PodRecord, contents.body.get("pods", []), "pods")
            self.containers = storefile.records(ContainerRecord, contents.body.get("containers", []), "containers")
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
        self._snapshot_due = bool(contents.dropped) or contents.version < storefile.FORMAT_VERSION
        if contents.damaged:
            moved = self.journal.with_name(self.journal.name + aside)
            log.error("store journal cut short", extra={"error": contents.dropped, "moved_to": str(moved)})
            self.journal.replace(moved)
            return "partial"
        if contents.dropped:
            log.warning("store journal cut short", extra={"error": contents.dropped})
        return "ok"

    def _row(self, kind: str, rid: str, rec: PodRecord | ContainerRecord) -> bytes:
        row = self._rows.get((kind, rid))
        if row is None:
            on_file = replace(rec, envs=stored_env(rec.envs)) if isinstance(rec, ContainerRecord) else rec
            row = self._rows[(kind, rid)] = storefile.row(on_file)
        return row

    def _encode(self, reuse: bool = False) -> _Write:
        """A snapshot of a new generation. Marks the store clean. `reuse`: records not changed
        through this class's methods since the last encoding keep their encoded row (a node's
        hundred pods are not encoded again for each one that starts); otherwise all are encoded."""
        if not reuse:
            self._rows = {}
        self._generation += 1
        pieces = storefile.snapshot_pieces(
            self._generation,
            [self._row("containers", rid, rec) for rid, rec in self.containers.items()],
            [self._row("pods", rid, rec) for rid, rec in self.pods.items()],
        )
        self._snapshot_due = False
        self._snapshot_bytes = sum(map(len, pieces))
        self._journal_bytes = 0
        return self._encoded_now(pieces, snapshot=True)

    def _changes(self, kind: str, records: dict[str, Any]) -> list[tuple[str, bytes | None]]:
        out: list[tuple[str, bytes | None]] = []
        for key in self._pending:
            if key[0] == kind:
                rec = records.get(key[1])
                out.append((key[1], None if rec is None else self._row(kind, key[1], rec)))
        return out

    def _encode_changes(self) -> _Write:
        """A journal line: the records changed since the last encoding. Costs what changed, whatever
        the store holds. Marks the store clean."""
        pieces = storefile.journal_pieces(
            self._generation, self._changes("containers", self.containers), self._changes("pods", self.pods)
        )
        self._journal_bytes += storefile.journal_line_size(pieces)
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

    def _put(self, writes: list[_Write]) -> None:
        """Put encodings on disk, in order: the newest snapshot among them and the journal lines
        after it (what it holds is not written again), the lines in one append. Blocks on the disk:
        the writer thread's, or this thread's at start and stop. Raises OSError; after a failure
        the journal may end in a torn line, so lines wait for the next snapshot."""
        with self._write_lock:
            writes = [w for w in writes if w.seq > self._written]
            newest = max((i for i, w in enumerate(writes) if w.snapshot), default=None)
            if newest is not None:
                writes = writes[newest:]
            if not writes or (self._failed and not writes[0].snapshot):
                return
            try:
                if writes[0].snapshot:
                    storefile.write_snapshot(self.path, writes[0].pieces)
                    self._written, writes = writes[0].seq, writes[1:]
                if writes:
                    storefile.append(self.journal, [w.pieces for w in writes])
                    self._written = writes[-1].seq
            except BaseException:
                self._failed = True
                raise
            self._failed = False

    def _write_failed(self) -> None:
        """On the event loop: the next write is a snapshot of everything (made with the next change)."""
        self._dirty = self._snapshot_due = True

    def save(self) -> None:
        """Write a snapshot now, on this thread (start, reconciliation, shutdown)."""
        self._put([self._encode()])

    def changed(self, row: tuple[str, str]) -> None:
        """`row`'s encoding is stale; it goes to the writer FLUSH_DELAY after the first change not
        handed over yet, with every change made meanwhile."""
        self._rows.pop(row, None)
        self._pending.add(row)
        self._dirty = True
        STORE_OBJECTS.set(len(self.pods), "pods")
        STORE_OBJECTS.set(len(self.containers), "containers")
        if self._hand_over_at is None:
            self._hand_over_at = asyncio.get_running_loop().call_later(FLUSH_DELAY, self._hand_over)

    def _hand_over(self) -> None:
        """Encode on the event loop (a consistent state, no copies) and queue it for the writer."""
        if self._hand_over_at is not None:
            self._hand_over_at.cancel()
            self._hand_over_at = None
        if not self._dirty:
            return
        if self._writer is None:
            self._writer = _Writer(self, asyncio.get_running_loop())
        self._writer.put(self._next_write())

    async def flushed(self) -> None:
        """Once every change made so far is on disk, or its write failed."""
        self._hand_over()
        if self._writer is not None:
            done: concurrent.futures.Future[None] = concurrent.futures.Future()
            self._writer.put(done)
            await asyncio.wrap_future(done)

    async def close(self) -> None:
        """The writer ends after what it was handed; what it has not written yet is written here, a
        snapshot (waiting for a write under way)."""
        if self._hand_over_at is not None:
            self._hand_over_at.cancel()
            self._hand_over_at = None
        if self._writer is not None:
            self._writer.put(None)
            self._writer = None
        if self._dirty or self._written < self._encoded:
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
            self.changed(("containers", cid))
        if pod is not None:
            self.changed(("pods", pod_id))
        return pod

    def remove_container(self, container_id: str) -> ContainerRecord | None:
        c = self.containers.pop(container_id, None)
        if c is not None:
            self.changed(("containers", container_id))
        return c
