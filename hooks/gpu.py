"""The gpu hook: on CreateContainer, the container gets exactly the GPUs the scheduler chose for it.

This is the I/O edge around `gpu_edit`: it reads the kubelet checkpoint (parsed again only when the
file changed), asks the node's GPU index (NVML, cached) about minors and UUIDs, looks for device
nodes under the node's dev_root, tells live pods from gone ones by kubelet's pod directories and
asks crihook's store which of the node's pods the scheduler placed.
Every refusal is a HookError; the chain adds the pod and container to the message, and nothing a
refused call did stays behind, so one bad pod can not affect another.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from crihook.base import allocation as al
from crihook.base.config import NodeConfig
from crihook.devices import kubelet
from crihook.devices.checkpoint import Checkpoint, CheckpointError, CheckpointReader, base_device_id, gpu_device_ids
from crihook.devices.draclaims import STATE_FILE, ClaimsError, ClaimsReader
from crihook.hooks.base import (
    MISS,
    ContainerInfo,
    Edit,
    HookContext,
    HookError,
    Miss,
    PodInfo,
    PodRecordView,
    RecordStore,
    Stage,
)
from crihook.hooks.cdi import GENERATE_FIX, CdiIndex
from crihook.hooks.fscache import FsMemo, NotCached
from crihook.hooks.gpu_edit import (
    GpuLookup,
    GpuOptions,
    NodeView,
    Placements,
    SeenPod,
    brings_devices,
    by_path,
    gpu_edit,
    place,
    plain_grant,
)
from crihook.hooks.grant import hami_dirs, hami_files, make_hami_dir
from crihook.hooks.reach import DeviceNode, Gpu, Grants, Reach, Undecided, Verdict, gpu_minor, judge
from crihook.hooks.scheduled import prime, scheduled

log = logging.getLogger("crihook.hooks.gpu")

PRIORITY = 200  # before rdma (210): the GPU decision is the one most likely to refuse a call
_POD_UID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")


class PodDirs:
    """Whether a pod is still on this node: kubelet keeps <root dir>/pods/<uid> from admission
    until it has cleaned the pod up, which covers every moment the pod can hold a device.

    The pods directory is the configured one, else the running kubelet's (its --root-dir, read
    from its command line the first time a question comes: crihook starts before kubelet). It does
    not follow the checkpoint, which stays in /var/lib/kubelet/device-plugins whatever the root
    dir. Anything uncertain (an odd UID, an unreadable or missing pods directory) counts as live,
    so a conflict is never missed; a missing pods directory is logged once.
    """

    def __init__(self, pods_dir: str | None, proc_root: str = "/proc") -> None:
        self.pods_dir = pods_dir
        self.proc_root = proc_root
        self._missing_said = False

    def directory(self) -> str:
        if self.pods_dir is not None:
            return self.pods_dir
        argv = kubelet.kubelet_argv(self.proc_root)
        if argv is None:  # not running (yet): kubelet's default, asked again next time
            return kubelet.pods_dir(())
        self.pods_dir = kubelet.pods_dir(argv)
        log.info("kubelet pods dir found", extra={"dir": self.pods_dir, "from": "kubelet's command line"})
        return self.pods_dir

    def __call__(self, pod_uid: str) -> bool:
        if not _POD_UID.fullmatch(pod_uid):
            return True
        pods = self.directory()
        try:
            os.stat(f"{pods}/{pod_uid}")
        except FileNotFoundError:
            if os.path.isdir(pods):
                self._missing_said = False
                return False
            if not self._missing_said:
                self._missing_said = True
                log.warning(
                    "kubelet pods dir missing: device-plugin holders count as live",
                    extra={"dir": pods, "fix": "set [hooks.gpu] kubelet_pods_dir to <kubelet --root-dir>/pods"},
                )
            return True
        except OSError:
            return True
        return True


CLAIM_SECONDS = 30.0  # a container the hook let through is in the store long before this


# not frozen: one is made per CreateContainer, and a frozen dataclass sets each field through
# object.__setattr__ (seven times the cost of a plain one, on kubelet's wait)
@dataclass(slots=True)
class Claim:
    """A container the hook let through, which the store shows only once the runtime has created
    it: kubelet creates containers of different pods at the same time."""

    at: float
    pod_uid: str
    container: str
    allocated: bool
    minors: frozenset[int]


class StorePods:
    """The gpu hook's view of crihook's store (node.store.Store, duck-typed: hooks sit below the
    node package) and of the containers it let through that the store does not show yet: pod records
    carry the annotations kubelet sent at RunPodSandbox, container records their sandbox id and
    name. Built once per CreateContainer, on the first question; the store's dicts are copied in
    one step each, so the event loop changing them meanwhile does no harm."""

    _parsed: dict[str, tuple[bool, frozenset[int]]] = {}  # annotation text -> allocation, shared

    def __init__(self, store: RecordStore, claims: Iterable[Claim] = ()) -> None:
        self.store = store
        self.claims = claims
        self._index: tuple[dict[str, list[PodRecordView]], dict[str, set[str]], dict[str, list[Claim]]] | None = None
        self._seen: dict[str, SeenPod | None] = {}

    def _indexed(self) -> tuple[dict[str, list[PodRecordView]], dict[str, set[str]], dict[str, list[Claim]]]:
        """Pod records by UID, container names by sandbox id, claims by UID: one pass each."""
        if self._index is None:
            pods: dict[str, list[PodRecordView]] = {}
            for p in list(self.store.pods.values()):
                pods.setdefault(p.uid, []).append(p)  # a pod whose sandbox was recreated has several
            names: dict[str, set[str]] = {}
            for c in list(self.store.containers.values()):
                names.setdefault(c.pod_id, set()).add(c.name)
            claims: dict[str, list[Claim]] = {}
            for claim in self.claims:
                claims.setdefault(claim.pod_uid, []).append(claim)
            self._index = pods, names, claims
        return self._index

    def get(self, uid: str) -> SeenPod | None:
        if uid not in self._seen:
            pods, names, claims = self._indexed()
            records: Sequence[PodRecordView] = pods.get(uid, ())
            lets: Sequence[Claim] = claims.get(uid, ())
            if not records and not lets:
                self._seen[uid] = None
            else:
                text = records[0].annotations.get(al.DEVICE_ALLOCATED) if records else None
                allocated, minors = self._allocation(text) if records else (lets[0].allocated, lets[0].minors)
                containers = {n for r in records for n in names.get(r.id, ())} | {c.container for c in lets}
                self._seen[uid] = SeenPod(allocated, minors, frozenset(containers))
        return self._seen[uid]

    @classmethod
    def _allocation(cls, text: str | None) -> tuple[bool, frozenset[int]]:
        if text is None:
            return False, frozenset()
        hit = cls._parsed.get(text)
        if hit is None:
            try:
                gpus = al.parse_device_allocated(text, (al.GPU,)).get(al.GPU, ())
                hit = bool(gpus), frozenset(a.minor for a in gpus)
            except al.AnnotationError:
                hit = True, frozenset()  # the hook refuses its containers: it never holds a plugin GPU
            if len(cls._parsed) >= 4096:
                cls._parsed.clear()
            cls._parsed[text] = hit
        return hit

    def allocated(self) -> Iterable[tuple[str, SeenPod]]:
        pods, _, claims = self._indexed()
        seen = ((uid, self.get(uid)) for uid in {*pods, *claims})
        return [(uid, p) for uid, p in seen if p is not None and p.allocated]


class GpuHook:
    name = "gpu"
    stages = frozenset({Stage.PRE_CREATE_CONTAINER})
    priority = PRIORITY

    def __init__(
        self,
        opts: GpuOptions,
        gpus: GpuLookup,
        checkpoint: CheckpointReader,
        pod_live: Callable[[str], bool],
        exists: Callable[[str], bool] = os.path.exists,
        cdi: CdiIndex | None = None,
        dev_root: str = "/dev",
        claims: ClaimsReader | None = None,
        specs: CdiIndex | None = None,
    ) -> None:
        self.opts = opts
        self.dev_root = dev_root
        self.cdi = cdi  # with inject = "cdi": the node's spec dirs, checked before a device is named
        self.claims = claims  # kubelet's DRA checkpoint: the claims each pod holds (None: no DRA)
        self.specs = specs or cdi  # the node's CDI specs: which nodes a claim's CDI device brings
        self.gpus = gpus
        self.checkpoint = checkpoint
        self.pod_live = pod_live
        self.exists = exists
        self.store: RecordStore | None = None  # crihook's store, once the daemon has it (attach_store)
        self.clock: Callable[[], float] = time.monotonic
        self._claims: dict[tuple[str, str], Claim] = {}  # (pod uid, container); guarded by _lock
        self._lock = threading.Lock()
        # the file-system answers above, for handle_cached (None: every call reads, on a worker thread)
        self.memo: FsMemo | None = None
        # each allocation's GPUs resolved and turned into device nodes, while the memo and the GPU
        # index say nothing they came from changed (see stamp)
        self.placements = Placements()
        self._dev_dir = os.path.dirname(f"{dev_root}/nvidia0")  # the directory the memo watches for them
        # where a call's facts come from, made once: they hold nothing of a call's own
        self._reads = _Facts(self, cached=False)
        self._recalls = _Facts(self, cached=True)

    def host_paths(self) -> tuple[str, ...]:
        """Patterns of what `[hooks.gpu.hami_core]` names (NamesHostPaths): what hami_mounts hands out."""
        paths = self.opts.hami_core
        return (paths.library, paths.preload_file, f"{paths.cache_root}/*") + (
            (paths.lock_dir,) if paths.lock_dir else ()
        )

    def close(self) -> None:
        """The memo's inotify descriptor goes with the hook (a reload builds a new one)."""
        if self.memo is not None:
            self.memo.close()

    def attach_store(self, store: RecordStore) -> None:
        self.store = store

    def plugin_holds(self, pod_uid: str) -> bool:
        """Whether a pod in the checkpoint may be using its device-plugin GPU, for the reporter:
        kubelet still has the pod, and crihook's store does not show the scheduler placed it (a
        pod it has not seen yet counts)."""
        seen = StorePods(self.store).get(pod_uid) if self.store is not None else None
        return not (seen is not None and seen.allocated) and self.pod_live(pod_uid)

    def prepare_pod(self, pod: PodInfo) -> None:
        """The pod's annotation parsed and, when the memo and the GPU index hold what it needs, its
        containers' placements made: its CreateContainers find them (this runs on the event loop,
        after kubelet has RunPodSandbox's answer, and reads nothing)."""
        devices = prime(pod, al.GPU)
        if devices is None or not devices.allocs or self.memo is None:
            return
        self.memo.sync()
        stamp = self.stamp()
        if stamp is None:
            return
        gpus = self._recalls.gpus
        for name in devices.per_container or (None,):  # without a split, every container gets them all
            try:
                allocs = devices.allocs if name is None else devices.for_container(name)
                if allocs and self.placements.get(allocs, stamp) is None:
                    placed = place(allocs, gpus, self.memo.recall, self.dev_root, self.opts)
                    self.placements.put(allocs, stamp, placed)
            except (NotCached, HookError, al.AnnotationError):
                pass  # the CreateContainer finds out again, and answers with what it finds

    # -- the decision about what a container reaches (hooks.reach), for the NRI plugin -------------

    def verdict(self, pod: PodInfo, container: ContainerInfo, reach: Reach) -> Verdict:
        """hooks.base.JudgesGpus: the GPUs `reach` gives that none of the three grants names. Reads
        the GPU index, then, only when something is reached, the checkpoints. Raises Undecided."""
        gpus = self.node_gpus()
        seen = judge(reach, Grants(), gpus)
        if not seen.ungranted:
            return seen
        return judge(reach, self.grants(pod, container, gpus), gpus)

    def node_gpus(self) -> tuple[Gpu, ...]:
        listed = self.gpus.all()
        if not listed:
            raise Undecided("NVML lists no GPU on this node")
        return tuple(Gpu(g.minor, g.index, g.uuid, tuple(g.mig_devices)) for g in listed)

    def grants(self, pod: PodInfo, container: ContainerInfo, gpus: Sequence[Gpu]) -> Grants:
        """What the scheduler's annotation (a malformed one grants nothing), kubelet's device-plugin
        checkpoint (the plugin resources' devices) and the pod's DRA claims grant the container."""
        try:
            scheduler = frozenset(a.minor for a in scheduled(pod, container, al.GPU) or ())
        except HookError:
            scheduler = frozenset()
        try:
            entries = self.checkpoint.read().for_container(pod.uid, container.name)
        except CheckpointError as e:
            raise Undecided(f"{e} ({self.checkpoint.path})") from None
        ids = {
            base_device_id(i) for e in entries if self.opts.is_plugin_resource(e.resource_name) for i in e.device_ids
        }
        plugin = frozenset(g.minor for g in gpus if ids & set(gpu_device_ids(g.index, g.uuid, g.mig)))
        claimed, names = self.claimed(pod.uid)
        return Grants(scheduler, plugin, claimed, names)

    def claimed(self, pod_uid: str, *, strict: bool = True) -> tuple[frozenset[int], frozenset[str]]:
        """The GPU minors the pod's DRA claims bring (their CDI specs' nodes, by number) and the
        claims' CDI device names, from kubelet's DRA checkpoint: a CDI device in a request is no
        claim by itself (a device plugin's, or one a container must not have, looks the same).
        Raises Undecided: the checkpoint unreadable; with `strict`, a claim device whose nodes can
        not be told (without: it is taken to bring no GPU, so a GPU node it does bring is not kept)."""
        try:
            names = self.claims.read().cdi_devices(pod_uid) if self.claims is not None else frozenset()
        except ClaimsError as e:
            raise Undecided(str(e)) from None
        if not names:
            return frozenset(), names
        assert self.specs is not None
        minors: set[int] = set()
        for name in sorted(names):
            try:
                nodes = self.specs.device_nodes(name, node_number)
                if nodes is None:
                    raise OSError(f"no CDI spec in {self.specs.describe_dirs()} declares it")
            except OSError as e:
                if strict:
                    raise Undecided(f"the pod's claim device {name}: {e}") from None
                log.debug("a claim device's nodes can not be told", extra={"device": name, "why": str(e)})
                continue
            minors |= {m for n in nodes if (m := gpu_minor(n.kind, n.major, n.minor)) is not None}
        return frozenset(minors), names

    def stamp(self) -> tuple[int, int] | None:
        """What placements depend on, as it is now: the memo's count of changes to the device
        directory and the GPU index's generation; None when either can not tell (nothing kept)."""
        memo = self.memo
        generation = getattr(self.gpus, "generation", None)
        if memo is None or generation is None:
            return None
        seen = memo.version(self._dev_dir)
        return None if seen is None else (seen, generation)

    def handle(self, ctx: HookContext) -> Edit | None:
        edit = self._handle(ctx, self._reads)
        if edit is not None and (dirs := hami_dirs(edit.add_mounts)):
            self._check_hami_files()
            make_hami_dirs(ctx, dirs)
        return edit

    def handle_cached(self, ctx: HookContext) -> Edit | Miss | None:
        """handle() on the event loop from the memo's answers (hooks.base.Recalls): MISS, and so a
        worker thread, for anything that needs a read, or while a decision is running there."""
        if self.memo is None:
            return MISS
        self.memo.sync()
        try:
            edit = self._handle(ctx, self._recalls)
        except NotCached:  # a fact the memo does not hold, from deep in the decision
            return MISS
        if edit is not None and hami_dirs(edit.add_mounts):
            return MISS  # HAMi-core's directories are made on a worker thread
        return edit

    def _handle(self, ctx: HookContext, facts: _Facts) -> Edit | None:
        assert ctx.container is not None
        stamp = self.stamp()  # before any fact is read
        try:
            cp = facts.checkpoint()
        except CheckpointError as e:
            # Without it neither the device plugin's injections nor a conflicting holder can be seen.
            raise HookError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{e} ({self.checkpoint.path}); can not tell which GPUs the device plugin handed out",
            ) from None
        # the common case needs no view of the node's pods (building one costs a tenth of a cold
        # CreateContainer's hook time); a CDI grant still goes to _decide's check
        plain = plain_grant(ctx.pod, ctx.container, cp, self.placements, stamp)
        if plain is not None and plain.add_cdi_devices and self.cdi is not None:
            plain = None
        if self.store is None:
            if plain is not None:
                return plain
            node = self._node(ctx, cp, facts, None, stamp)
            return self._decide(ctx, node, facts)
        # One decision at a time, each seeing the containers the ones before it let through: two
        # containers created at once can not both be given one GPU (a placed pod's and a plugin pod's).
        # On the event loop the lock is only taken when free (a worker may be waiting on a read).
        if not self._lock.acquire(blocking=not facts.cached):
            raise NotCached("a decision is running on a worker thread")
        try:
            now = self.clock()
            self._expire_claims(now)
            edit = plain
            if edit is None:
                pods = StorePods(self.store, self._claims.values())
                node = self._node(ctx, cp, facts, pods, stamp)
                edit = self._decide(ctx, node, facts)
            allocated, minors = StorePods._allocation(ctx.pod.annotations.get(al.DEVICE_ALLOCATED))
            key = (ctx.pod.uid, ctx.container.name)
            self._claims.pop(key, None)  # re-inserted last: the dict stays in the order of `at`
            self._claims[key] = Claim(now, *key, allocated, minors)
        finally:
            self._lock.release()
        return edit

    def _node(self, ctx: HookContext, cp: Checkpoint, facts: _Facts, pods: StorePods | None, stamp: object) -> NodeView:
        """The node facts for gpu_edit; the pod's DRA claims only for a container that brings devices
        of its own (a claim's come as CDI devices, or as nodes in NRI's finished spec)."""
        assert ctx.container is not None
        node = NodeView(cp, facts.exists, facts.pod_live, pods, self.dev_root, self.placements, stamp)
        if brings_devices(ctx.container):
            if facts.cached:
                raise NotCached("a container's own devices are looked at on a worker thread")
            try:
                node.claimed, node.claim_cdi = self.claimed(ctx.pod.uid, strict=False)
            except Undecided as e:
                raise HookError(grpc.StatusCode.FAILED_PRECONDITION, f"the pod's DRA claims: {e}") from None
            node.number_of = host_number
            node.cdi_nodes = self._cdi_nodes
        return node

    def _cdi_nodes(self, name: str) -> tuple[DeviceNode, ...] | None:
        """What a CDI device brings, by its spec; None when no spec declares it or a node of it can
        not be read (the runtime then fails the container on it)."""
        if self.specs is None:
            return None
        try:
            return self.specs.device_nodes(name, node_number)
        except OSError:
            return None

    def forget(self, pod_uid: str, container: str) -> None:
        """hooks.base.ForgetsContainers: the container was not created, or is gone; what the hook
        let through for it no longer counts."""
        with self._lock:
            self._claims.pop((pod_uid, container), None)

    def _expire_claims(self, now: float) -> None:
        """Drop claims older than CLAIM_SECONDS: the oldest come first, so this stops at the first
        still young (a busy node holds a claim per container created in the last 30 s)."""
        old = []
        for key, claim in self._claims.items():
            if now - claim.at < CLAIM_SECONDS:
                break
            old.append(key)
        for key in old:
            del self._claims[key]

    def _decide(self, ctx: HookContext, node: NodeView, facts: _Facts) -> Edit | None:
        assert ctx.container is not None
        edit = gpu_edit(ctx.pod, ctx.container, facts.gpus, node, self.opts)
        if edit is not None and edit.add_cdi_devices and self.cdi is not None:
            if facts.cached:
                raise NotCached("CDI specs are read on every check")
            self._check_cdi(edit.add_cdi_devices)
        return edit

    def _check_cdi(self, names: Iterable[str]) -> None:
        """Refuse, naming the GPU, the dirs and the fix, a CDI device no spec declares: the runtime
        would fail the create with less to go on (1.7+), or start the container without it (1.6)."""
        assert self.cdi is not None
        scan = self.cdi.scan()
        missing = [n for n in names if n not in scan.devices]
        if not missing:
            return
        gpus = ", ".join(n.partition("=")[2] for n in missing)
        skipped = f"; files skipped: {'; '.join(scan.problems)}" if scan.problems else ""
        raise HookError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"GPU {gpus}: no CDI spec in {self.cdi.describe_dirs()} declares {', '.join(missing)} "
            f"({len(scan.specs)} spec file(s) read{skipped}); generate the node's specs with `{GENERATE_FIX}`, "
            "or set [hooks.gpu] cdi_spec_dirs to the runtime's cdi_spec_dirs",
        )

    def _check_hami_files(self) -> None:
        """Refuse a HAMi-core container whose library or preload file is missing on the node: the
        runtime would run it unlimited (CRI makes a missing mount source a directory) or fail it with
        runc's error. One that can not be looked at (hami_core.host_root unseen, a permission) is
        let through: the check must not refuse what it can not see. Worker thread; the answers
        are remembered in the memo until the kernel reports a change (the chain names the pod)."""
        paths = self.opts.hami_core
        missing = []
        for host, seen in hami_files(paths):
            look = functools.partial(presence, seen, paths.host_root)
            there = look() if self.memo is None else self.memo.answer(seen, look)
            if there is False:
                missing.append(host)
            elif there is None:
                log.debug("HAMi-core's file can not be looked at", extra={"path": seen})
        if missing:
            raise HookError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"HAMi-core isolation needs"
                f" {' and '.join(missing)}, missing on this node; install HAMi-core there, or set"
                " [hooks.gpu.hami_core] library and preload_file (the chart's node.hamiCore) to where it is",
            )


def presence(path: str, root: str = "") -> bool | None:
    """Whether `path` exists; None when that can not be told: a search or permission error, or
    `root` (where the host's / is mounted) itself missing."""
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None if root and not os.path.isdir(root) else False
    except OSError:
        return None
    return True


class _Facts:
    """Where a call's node facts come from: read (worker thread; remembered in the hook's memo
    when it has one) or `cached`, from the memo alone (event loop; a miss raises NotCached). The
    hook makes one of each; nothing here belongs to one call."""

    def __init__(self, hook: GpuHook, cached: bool) -> None:
        self.hook = hook
        self.cached = cached
        self.gpus: GpuLookup = _KnownGpus(hook.gpus) if cached else hook.gpus

    def checkpoint(self) -> Checkpoint:
        memo, reader = self.hook.memo, self.hook.checkpoint
        if memo is None:
            return reader.read()
        return memo.recall(reader.path) if self.cached else memo.answer(reader.path, reader.read, contents=True)

    def exists(self, path: str) -> bool:
        memo = self.hook.memo
        if memo is None:
            return self.hook.exists(path)
        return memo.recall(path) if self.cached else memo.answer(path, lambda: self.hook.exists(path))

    def pod_live(self, pod_uid: str) -> bool:
        hook = self.hook
        if hook.memo is None or not _POD_UID.fullmatch(pod_uid):
            return hook.pod_live(pod_uid)  # nothing remembered, or an odd UID (live, no read)
        pods = getattr(hook.pod_live, "pods_dir", None)  # PodDirs: the answer is an entry of that dir
        if pods is None:  # kubelet's root dir not found yet (or a pod_live that is no PodDirs)
            if self.cached:
                raise NotCached("kubelet's pods dir is not known yet")
            return hook.pod_live(pod_uid)
        path = f"{pods}/{pod_uid}"
        return hook.memo.recall(path) if self.cached else hook.memo.answer(path, lambda: hook.pod_live(pod_uid))


class _KnownGpus:
    """The GPU index's answers without asking NVML: a GPU it does not hold sends the call to a
    worker thread, where the index may refresh. A lookup with no such split (no I/O) is used as is."""

    def __init__(self, gpus: GpuLookup) -> None:
        self.gpus = gpus
        self.peek = getattr(gpus, "known", None)

    def by_minor(self, minor: int) -> Any:
        return self._known(self.gpus.by_minor, "minor", minor)

    def by_uuid(self, uuid: str) -> Any:
        return self._known(self.gpus.by_uuid, "uuid", uuid)

    def all(self) -> Any:
        if self.peek is not None:
            raise NotCached("the whole GPU list may need NVML")
        return self.gpus.all()

    def _known(self, lookup: Callable[[Any], Any], kind: str, key: Any) -> Any:
        if self.peek is None:
            return lookup(key)
        g = self.peek(kind, key)
        if g is None:
            raise NotCached(f"GPU {kind} {key} not in the index")
        return g


def node_number(path: str) -> DeviceNode:
    """The device node at a host path, by its numbers. OSError when it is none."""
    st = os.stat(path)
    if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
        return DeviceNode("c" if stat.S_ISCHR(st.st_mode) else "b", os.major(st.st_rdev), os.minor(st.st_rdev), path)
    raise OSError(f"{path} is not a device node")


def host_number(path: str) -> tuple[str, int, int] | None:
    """What a container's device at this host path is, by number; by its name when it can not be
    read (the runtime then fails the container on it anyway)."""
    try:
        n = node_number(path)
    except OSError:
        return by_path(path)
    return n.kind, n.major, n.minor


def make_hami_dirs(ctx: HookContext, dirs: Iterable[str]) -> None:
    """HAMi-core's cache and lock directories (hooks.grant.make_hami_dir); one that can not be made
    refuses the container."""
    for d in dirs:
        try:
            make_hami_dir(d)
        except OSError as e:
            assert ctx.container is not None
            raise HookError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"pod {ctx.pod.ref} container {ctx.container.name}: HAMi-core directory {d} can not be made"
                f" ({e.strerror or e}); crihook must be able to write there ([hooks.gpu.hami_core], docs/gpu-hook.md)",
            ) from None


def factory(options: GpuOptions, node: NodeConfig) -> GpuHook:
    """Entry point `gpu`: the `[hooks.gpu]` options and the node's paths."""
    from crihook.devices.nvml import GpuIndex, Nvml  # NVML is loaded on the first lookup, not here

    gpus = GpuIndex(Nvml(node.nvml_library, directory(node.sys_root)))
    pods_dir = None if options.kubelet_pods_dir is None else directory(options.kubelet_pods_dir)
    pod_dirs = PodDirs(pods_dir, directory(node.proc_root))
    specs = CdiIndex(tuple(map(directory, options.cdi_spec_dirs)))
    reader = CheckpointReader(node.kubelet_checkpoint)
    claims = ClaimsReader(os.path.join(os.path.dirname(pod_dirs.directory()), STATE_FILE))
    cdi = specs if options.inject == "cdi" else None
    dev_root = node.dev_root.rstrip("/")
    hook = GpuHook(options, gpus, reader, pod_dirs, cdi=cdi, dev_root=dev_root, claims=claims, specs=specs)
    hook.memo = FsMemo()
    return hook


def directory(path: str) -> str:
    """A configured directory as the hook names it: no trailing slash, except the root's."""
    return path.rstrip("/") or "/"
