"""The usage collector: every interval, the GPUs' processes (NVML) attributed to the containers in
crihook's store through their cgroups (/proc), published as metrics and written to the state dir,
where `crihook top` reads them.

It runs on a thread of its own, off every CRI or NRI call's path, and is the same component in both
modes: the front door hands it the store once it is rebuilt (containers adopted at start included)
and starts it. It reads the store without a lock: it copies the container table in one step and
reads each record's fields, which the daemon replaces or sets whole. It only reports: a container
above its memory grant is counted and logged, never stopped. The GPUs a pod's DRA claims brought come
from kubelet's DRA checkpoint, read again only when it changed, and their shares from crihook dra's
checkpoint in the same state dir.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from crihook.base import metrics
from crihook.base.config import Config
from crihook.base.errors import InputError
from crihook.devices import drashares, kubelet, usage
from crihook.devices.draclaims import STATE_FILE as CLAIMS_FILE
from crihook.devices.draclaims import Claims, ClaimsError, ClaimsReader
from crihook.devices.drashares import ClaimShare, SharesReader, SharesUnreadable
from crihook.devices.nvml import Nvml, ProcessRead

log = logging.getLogger("crihook.usage")

DEFAULT_INTERVAL = 10.0


class PodView(Protocol):
    """What the collector reads of a pod in the store (node.store.PodRecord)."""

    @property
    def name(self) -> str: ...
    @property
    def namespace(self) -> str: ...
    @property
    def uid(self) -> str: ...
    @property
    def annotations(self) -> Mapping[str, str]: ...


class ContainerView(Protocol):
    """What the collector reads of a container in the store (node.store.ContainerRecord)."""

    @property
    def pod_id(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def state(self) -> str: ...


class StoreView(Protocol):
    """crihook's store as the collector reads it (the devices layer sits below the store's)."""

    @property
    def pods(self) -> Mapping[str, PodView]: ...
    @property
    def containers(self) -> Mapping[str, ContainerView]: ...


def read_cgroups(proc_root: str, pids: Iterable[int]) -> dict[int, str | None]:
    """/proc/<pid>/cgroup of each process; None for one that has exited (or can not be read)."""
    found: dict[int, str | None] = {}
    for pid in pids:
        try:
            with open(f"{proc_root}/{pid}/cgroup", encoding="utf-8", errors="replace") as f:
                found[pid] = f.read()
        except OSError:
            found[pid] = None
    return found


def write_state(state_dir: str, doc: dict[str, object]) -> None:
    """The state file, replaced whole: a reader sees the last collection or the one before."""
    path = Path(state_dir) / usage.STATE_FILE
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(doc, separators=(",", ":")))
    os.replace(tmp, path)


@dataclass
class Collection:
    """One round's result."""

    read: ProcessRead
    rows: tuple[usage.Usage, ...]
    seconds: float  # what the round cost, in CPU time of the collecting thread


@dataclass
class _GrantMemo:
    """Grants by container, parsed again only when the pod's annotations or the GPUs change."""

    gpus: Mapping[int, tuple[str, int]] = field(default_factory=dict)
    by_container: dict[str, tuple[Mapping[str, str], tuple[usage.Grant, ...]]] = field(default_factory=dict)


class UsageCollector:
    """Collects every `interval` seconds on its own thread once started; `collect_once` is one round."""

    def __init__(
        self,
        nvml: Nvml,
        store: StoreView,
        *,
        interval: float = DEFAULT_INTERVAL,
        proc_root: str = "/proc",
        state_dir: str = "",
        claims: ClaimsReader | None = None,
        shares: SharesReader | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.nvml = nvml
        self.claims = claims  # kubelet's DRA checkpoint; None: no DRA
        self.shares = shares  # crihook dra's checkpoint: the claims' shares; None: not shown
        self.store = store
        self.interval = interval
        self.proc_root = proc_root
        self.state_dir = state_dir
        self._clock = clock
        self._since: Mapping[str, int] = {}
        self._over: frozenset[tuple[str, str]] = frozenset()
        self._memo = _GrantMemo()
        self._bad: dict[str, str] = {}  # container id -> why its grant is unreadable, once logged
        self._claims_bad = ""  # why the DRA checkpoint is unreadable, once logged
        self._shares_bad = ""  # why claims' shares are unreadable, once logged
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- one round ---------------------------------------------------------------------------

    def known(self, gpus: Iterable[usage.GpuState]) -> dict[str, usage.KnownContainer]:
        """The store's live containers with their grants."""
        by_minor = {g.minor: (g.uuid, g.memory_total) for g in gpus}
        if by_minor != self._memo.gpus:
            self._memo = _GrantMemo(by_minor)
        pods = self.store.pods
        held = self._claims()
        shares = self._shares(held)
        found: dict[str, usage.KnownContainer] = {}
        memo: dict[str, tuple[Mapping[str, str], tuple[usage.Grant, ...]]] = {}
        for cid, c in list(self.store.containers.items()):
            pod = pods.get(c.pod_id)
            if pod is None or c.state == "exited":
                continue
            cached = self._memo.by_container.get(cid)
            if cached is not None and cached[0] is pod.annotations:
                grants = cached[1]
            else:
                grants = self._grants(cid, pod, c.name)
            memo[cid] = (pod.annotations, grants)
            claimed = usage.claim_grants(held.for_pod(pod.uid), self._memo.gpus, shares) if held.claims else ()
            found[cid] = usage.KnownContainer(cid, pod.namespace, pod.name, c.name, grants + claimed)
        self._memo.by_container = memo
        if self._bad:  # containers gone since their grant was found unreadable
            self._bad = {cid: why for cid, why in self._bad.items() if cid in memo}
        return found

    def _claims(self) -> Claims:
        """The DRA checkpoint's claims; none when it can not be read (said once per reason)."""
        if self.claims is None:
            return Claims()
        try:
            got = self.claims.read()
        except ClaimsError as e:
            if self._claims_bad != str(e):
                log.warning("DRA claims unreadable", extra={"error": str(e)})
                self._claims_bad = str(e)
            return Claims()
        self._claims_bad = ""
        return got

    def _shares(self, held: Claims) -> Mapping[str, Mapping[int, ClaimShare]]:
        """The held claims' shares that crihook's driver recorded; a file that can not be read leaves
        its claim without one (said once per reason)."""
        if self.shares is None or not held.claims:
            return {}
        try:
            found = self.shares.read(c.uid for c in held.claims)
        except SharesUnreadable as e:
            if self._shares_bad != str(e):
                log.warning("DRA claim shares unreadable", extra={"error": str(e)})
                self._shares_bad = str(e)
            return e.found
        self._shares_bad = ""
        return found

    def _grants(self, cid: str, pod: PodView, container: str) -> tuple[usage.Grant, ...]:
        try:
            grants = usage.grants_of(pod.annotations, container, self._memo.gpus)
        except InputError as e:
            # that container is reported without its grant; the others are not affected
            if self._bad.get(cid) != str(e):
                log.warning(
                    "GPU grant unreadable",
                    extra={"pod": f"{pod.namespace}/{pod.name}", "container": container, "error": str(e)},
                )
                self._bad[cid] = str(e)
            return ()
        self._bad.pop(cid, None)
        return grants

    def collect_once(self) -> Collection:
        """Read, attribute, publish: one round."""
        started = time.thread_time()
        read = self.nvml.processes(self._since)
        self._since = read.last_seen
        cgroups = read_cgroups(self.proc_root, {p.pid for p in read.processes})
        rows = usage.attribute(read.processes, cgroups, self.known(read.gpus))
        if self.state_dir:
            try:
                write_state(self.state_dir, usage.encode(read.gpus, rows, self._clock(), self.interval, read.reason))
            except OSError as e:
                log.warning("usage state not written", extra={"dir": self.state_dir, "error": str(e)})
        collection = Collection(read, rows, 0.0)
        self.publish(collection)
        collection.seconds = time.thread_time() - started
        metrics.USAGE_SECONDS.observe(collection.seconds)
        return collection

    def publish(self, collection: Collection) -> None:
        """The round's figures as the metrics' whole series tables (a container gone is gone from
        them), and each container that went above its memory grant, counted and logged once."""
        used: dict[tuple[str, ...], float] = {}
        sm: dict[tuple[str, ...], float] = {}
        core: dict[tuple[str, ...], float] = {}
        memory: dict[tuple[str, ...], float] = {}
        claims: dict[tuple[str, ...], float] = {}
        others: dict[tuple[str, ...], float] = {}
        # the gpu label is the physical GPU's NVML index, as dcgm-exporter's (a MIG device's is its GPU's)
        index = {g.uuid: str(g.index) if g.index >= 0 else "" for g in collection.read.gpus}
        for u in collection.rows:
            o = u.owner
            gpu = index.get(u.gpu, "")
            if o.kind != usage.CONTAINER:
                other = (gpu, u.device, o.kind)
                others[other] = others.get(other, 0) + u.used_memory
                continue
            key = (o.namespace, o.pod, o.container, gpu, u.device)
            used[key] = used.get(key, 0) + u.used_memory
            if u.sm_util is not None:
                sm[key] = u.sm_util / 100
            if u.granted_core is not None:
                core[key] = u.granted_core / 100
            if u.granted_memory is not None:
                memory[key] = u.granted_memory
            if u.claim:
                claims[(*key, u.claim)] = 1
        metrics.USAGE_MEMORY.replace(used)
        metrics.USAGE_SM.replace(sm)
        metrics.GRANT_CORE.replace(core)
        metrics.GRANT_MEMORY.replace(memory)
        metrics.GRANT_CLAIM.replace(claims)
        metrics.USAGE_OTHERS.replace(others)
        self._over, went_over = usage.newly_over(self._over, collection.rows)
        for u in went_over:
            metrics.OVER_GRANT.inc(u.owner.namespace)
            log.warning(
                "container above its GPU memory grant",
                extra={
                    "pod": f"{u.owner.namespace}/{u.owner.pod}",
                    "container": u.owner.container,
                    "gpu": u.device,
                    "used_bytes": u.used_memory,
                    "granted_bytes": u.granted_memory,
                },
            )

    # -- the thread --------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="crihook-usage", daemon=True)
        self._thread.start()
        log.info("usage collector started", extra={"interval": self.interval, "state_dir": self.state_dir})

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                self.collect_once()
            except Exception:  # a round that fails is logged; the next one tries again
                log.exception("usage collection failed")
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - began)))

    def stop(self, timeout: float = 5.0) -> None:
        """Stop after the round in progress (a stuck NVML call is left behind: the thread is a daemon)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return  # its NVML call still holds the library
        self.nvml.close()


def start_usage(cfg: Config, store: StoreView, state_dir: str, pods_dir: str | None = None) -> UsageCollector | None:
    """The collector of a node daemon (`crihook serve`, `crihook nri`), started with the store it
    reads, once that is rebuilt; None when `[usage] enabled` is off. It loads NVML itself: a node
    without the driver reports no processes and says why once. kubelet's DRA checkpoint is beside
    its pods dir: `pods_dir` as configured for the gpu hook, else found from kubelet's command line."""
    if not cfg.usage.enabled:
        return None
    nvml = Nvml(cfg.node.nvml_library, cfg.node.sys_root)
    if pods_dir is None:
        pods_dir = kubelet.pods_dir(kubelet.kubelet_argv(cfg.node.proc_root) or ())
    claims = ClaimsReader(os.path.join(os.path.dirname(pods_dir), CLAIMS_FILE))
    collector = UsageCollector(
        nvml,
        store,
        interval=cfg.usage.interval_seconds,
        proc_root=cfg.node.proc_root,
        state_dir=state_dir,
        claims=claims,
        shares=SharesReader(os.path.join(state_dir, drashares.DIR)),
    )
    collector.start()
    return collector
