"""What the GPU hook does to one container, as a pure function of what it knows.

Inputs: the pod and container as kubelet described them, the scheduler's annotations (on the pod),
the kubelet device-plugin checkpoint, the node's GPUs, which device nodes exist, which pods are
alive and what crihook's store knows of the node's other pods. Output: an Edit, or a HookError whose
reason names the annotation and the cause (the chain adds the pod and container). All I/O stays
with the caller, behind the small protocols below.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import grpc

from crihook.base import allocation as al
from crihook.base.config import absolute_path, not_empty
from crihook.base.spec import Device
from crihook.devices.checkpoint import Checkpoint, PodDeviceEntry, base_device_id, gpu_device_ids
from crihook.hooks.base import ContainerInfo, Edit, HookError, PodInfo
from crihook.hooks.cdi import ANNOTATION_PREFIX, DEFAULT_SPEC_DIRS
from crihook.hooks.grant import (
    VISIBLE,
    GpuFacts,
    HamiCore,
    MissingDeviceNode,
    Share,
    cuda_key,
    device_nodes,
    hami_env,
    hami_mounts,
)
from crihook.hooks.reach import DeviceNode, Gpu, gpu_cdi_name, gpu_minor, named, visible_names
from crihook.hooks.scheduled import refuse, scheduled

VOID = "void"  # the NVIDIA runtime injects nothing, whatever the image says
CDI_KIND = "nvidia.com/gpu"
ISOLATION_LABEL = "koordinator.sh/gpu-isolation-provider"
HAMI_CORE = "hami-core"  # compared case-insensitively: Koordinator's docs spell it both ways
# what a container the scheduler gave no GPU gets when it brings nothing to strip; shared by all of
# them, so never changed (see Placement.grant)
DENIED = Edit(env={VISIBLE: VOID})
_GPU_NODE = re.compile(r"(?:.*/)?nvidia([0-9]+)")  # /dev/nvidiaN, as a container or host path

_PATH_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")


class GpuLike(GpuFacts, Protocol):
    @property
    def index(self) -> int: ...
    @property
    def mig_enabled(self) -> bool: ...
    @property
    def mig_devices(self) -> Sequence[tuple[int, str]]: ...


class GpuLookup(Protocol):
    """The node's GPUs; devices.nvml.GpuIndex in the daemon (cached, refreshed on a miss)."""

    def by_minor(self, minor: int) -> GpuLike | None: ...
    def by_uuid(self, uuid: str) -> GpuLike | None: ...
    def all(self) -> Sequence[GpuLike]: ...


@dataclass(frozen=True, slots=True)
class SeenPod:
    """A pod crihook saw start on this node (its store): whether the scheduler placed its GPUs
    (the gpu part of the device-allocated annotation), which minors, and which containers exist."""

    allocated: bool
    minors: frozenset[int] = frozenset()
    containers: frozenset[str] = frozenset()


class SeenPods(Protocol):
    """crihook's store, by pod UID; hooks.gpu.StorePods in the daemon."""

    def get(self, uid: str) -> SeenPod | None: ...
    def allocated(self) -> Iterable[tuple[str, SeenPod]]: ...


@dataclass(frozen=True, slots=True)
class GpuOptions:
    """The `[hooks.gpu]` table (docs/gpu-hook.md)."""

    inject: Literal["env+devices", "cdi"] = "env+devices"
    """env+devices: NVIDIA_VISIBLE_DEVICES and device nodes; cdi: nvidia.com/gpu=<uuid> CDI devices"""
    deny_unallocated: bool = True
    """containers without a GPU get NVIDIA_VISIBLE_DEVICES=void"""
    plugin_resources: tuple[str, ...] = field(
        default=("nvidia.com/gpu", "nvidia.com/gpu.shared", "nvidia.com/mig-*"), metadata={"each": not_empty}
    )
    """checkpoint resources (globs) whose device-plugin injections the scheduler's choice replaces"""
    hami_core: HamiCore = field(default_factory=HamiCore)
    """host paths for HAMi-core isolation"""
    kubelet_pods_dir: str | None = field(default=None, metadata={"check": absolute_path})
    """kubelet's pods directory; None: <the running kubelet's --root-dir>/pods"""
    cdi_spec_dirs: tuple[str, ...] = field(
        default=DEFAULT_SPEC_DIRS, metadata={"check": not_empty, "each": absolute_path}
    )
    """where the runtime's CDI specs are: what a container's CDI devices bring, and with inject = "cdi" the GPUs' own"""

    def is_plugin_resource(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self.plugin_resources)


# not frozen: one is made per CreateContainer (see hooks.gpu.Claim)
@dataclass(slots=True)
class NodeView:
    """The node facts the edit depends on, read by the caller."""

    checkpoint: Checkpoint
    exists: Callable[[str], bool]  # host path -> present
    pod_live: Callable[[str], bool]  # pod UID -> still running on this node
    # None (no store): every live holder in the checkpoint counts, as if it were a device-plugin pod
    pods: SeenPods | None = None
    dev_root: str = "/dev"  # where the node's device nodes are (a container sees them under /dev)
    # placements made before, and what the node facts they depend on are now (None: not known, so
    # nothing is reused): see Placements
    placements: Placements | None = None
    stamp: object = None
    # what the pod's DRA claims grant: GPU minors (their CDI specs' nodes, by number) and the claims'
    # CDI device names; a GPU a claim brings is the claim's, kept as it came
    claimed: frozenset[int] = frozenset()
    claim_cdi: frozenset[str] = frozenset()
    # (type, major, minor) of the node at a host path, for a device whose view gives no numbers (a
    # CRI request); None when it is not a device node
    number_of: Callable[[str], tuple[str, int, int] | None] = lambda path: by_path(path)
    # the device nodes a CDI device brings, by its spec (None: no spec declares it, or not known)
    cdi_nodes: Callable[[str], tuple[DeviceNode, ...] | None] = lambda name: None


@dataclass(frozen=True, slots=True)
class Placement:
    """The scheduler's GPUs for a container resolved on this node, and what the container gets for
    them: the part of the edit that depends on the allocation and the node only, not on the
    container as kubelet sent it or on the node's other pods. Worked out once per allocation
    (`Placements`), so a CreateContainer only looks it up."""

    chosen: tuple[tuple[al.DeviceAllocation, GpuLike], ...]  # in PCI bus order (CUDA's numbering)
    gpus: tuple[GpuLike, ...]  # the same GPUs, alone
    shares: tuple[Share, ...]  # what of each the container may use
    visible: str  # NVIDIA_VISIBLE_DEVICES
    names: frozenset[str]  # the chosen GPUs' UUIDs and NVML indexes: the GPU CDI names that may stay
    devices: tuple[Device, ...]  # env+devices: the device nodes to add
    cdi_devices: tuple[str, ...]  # cdi: the CDI devices to add
    shared: bool  # a GPU is shared: HAMi-core isolation applies if the pod asks for it
    # what a container that brings nothing to strip gets: one Edit every container of the
    # allocation shares, so never changed (`_granted` puts it into another Edit when there is more)
    grant: Edit = field(default_factory=Edit)

    def __post_init__(self) -> None:
        grant = Edit(env={VISIBLE: self.visible}, add_devices=[*self.devices], add_cdi_devices=[*self.cdi_devices])
        object.__setattr__(self, "grant", grant)


def place(
    allocs: Sequence[al.DeviceAllocation],
    gpus: GpuLookup,
    exists: Callable[[str], bool],
    dev_root: str,
    opts: GpuOptions,
) -> Placement:
    """The placement of `allocs` on this node. Raises HookError (a GPU or device node it lacks)."""
    chosen = tuple(sorted(_resolve(allocs, gpus), key=lambda pair: cuda_key(pair[1])))
    shares = tuple(Share(g, _memory_bytes(a, g), a.resources.get(al.GPU_CORE, 100)) for a, g in chosen)
    gs = tuple(g for _, g in chosen)
    uuids = [g.uuid for g in gs]
    names = frozenset(n for g in gs for n in (g.uuid, str(g.index)))
    shared = any(s.shared for s in shares)
    if opts.inject == "cdi":
        return Placement(chosen, gs, shares, VOID, names, (), tuple(f"{CDI_KIND}={u}" for u in uuids), shared)
    try:
        devices = device_nodes(gs, exists, dev_root)
    except MissingDeviceNode as e:
        raise refuse(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
    return Placement(chosen, gs, shares, ",".join(uuids), names, devices, (), shared)


class Placements:
    """Placements by allocation, each with the stamp of the node facts it was made from (which
    device nodes exist, the GPU index); one is reused only under the same stamp. Keyed by the
    parsed allocation itself (hooks.scheduled parses a pod's annotation once for all its
    containers), held here so its identity can not pass to another."""

    MAX = 4096  # allocations kept (cleared when full: pods come and go)

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[Sequence[al.DeviceAllocation], object, Placement]] = {}

    def get(self, allocs: Sequence[al.DeviceAllocation], stamp: object) -> Placement | None:
        hit = self._by_id.get(id(allocs))
        if hit is None or hit[0] is not allocs or stamp is None or hit[1] != stamp:
            return None
        return hit[2]

    def put(self, allocs: Sequence[al.DeviceAllocation], stamp: object, placement: Placement) -> None:
        """`stamp`: taken before the facts `placement` came from were read (None: keep nothing)."""
        if stamp is None:
            return
        if len(self._by_id) >= self.MAX:
            self._by_id.clear()
        self._by_id[id(allocs)] = (allocs, stamp, placement)


def gpu_edit(pod: PodInfo, container: ContainerInfo, gpus: GpuLookup, node: NodeView, opts: GpuOptions) -> Edit | None:
    """The edit for one CreateContainer. Raises HookError."""
    allocs = scheduled(pod, container, al.GPU)
    entries = node.checkpoint.for_container(pod.uid, container.name)
    plugin = tuple(e for e in entries if opts.is_plugin_resource(e.resource_name)) if entries else ()
    if allocs is None and plugin:
        _check_taken(pod.uid, plugin, gpus, node)
        return None  # no word from the scheduler: the device plugin's allocation stands
    if not allocs:
        if not opts.deny_unallocated:
            return None
        stripped = _strip(container, plugin, node.claim_cdi, node, node.claimed)
        if node.claim_cdi and _names_only(container.env(VISIBLE), gpus, node.claimed):
            return stripped  # a claim's GPUs and env, kept as its driver made them
        return _granted(stripped, DENIED)
    placed = node.placements.get(allocs, node.stamp) if node.placements is not None else None
    if placed is None:
        placed = place(allocs, gpus, node.exists, node.dev_root, opts)
        if node.placements is not None:
            node.placements.put(allocs, node.stamp, placed)
    _check_conflicts(pod.uid, placed.gpus, node)
    # a chosen GPU's node the container brings stays where the grant adds nodes (cdi: the CDI device)
    keep = (frozenset(g.minor for g in placed.gpus) if placed.devices else frozenset()) | node.claimed
    stripped = _strip(container, plugin, placed.names | node.claim_cdi, node, keep)
    if placed.shared and pod.labels.get(ISOLATION_LABEL, "").lower() == HAMI_CORE:
        edit = _granted(stripped or Edit(), placed.grant)
        _isolate(edit, pod, container, placed.shares, opts.hami_core)
        return edit
    return _granted(stripped, placed.grant)


def plain_grant(
    pod: PodInfo, container: ContainerInfo, checkpoint: Checkpoint, placements: Placements, stamp: object
) -> Edit | None:
    """gpu_edit's answer for the common case, without a NodeView: a container that brings no
    devices of its own, on a node where no device plugin has handed anything out (no holder to
    check, nothing to strip), of an allocation placed before under `stamp` that shares no GPU (no
    HAMi-core isolation to add). None: not that case, ask gpu_edit. Raises HookError."""
    if checkpoint.entries or brings_devices(container):
        return None
    allocs = scheduled(pod, container, al.GPU)
    placed = placements.get(allocs, stamp) if allocs else None
    return None if placed is None or placed.shared else placed.grant


def brings_devices(container: ContainerInfo) -> bool:
    """Whether the container asks for devices of its own, by any path: devices, CDI devices or CDI
    annotations (a device plugin's, an image's, a webhook's)."""
    return bool(
        container.devices
        or container.cdi_devices
        or any(k.startswith(ANNOTATION_PREFIX) for k in container.annotations)
    )


def _granted(stripped: Edit | None, grant: Edit) -> Edit:
    """The grant alone (the same object every time) when nothing was stripped, else both in a new
    Edit: removals happen before additions."""
    if stripped is None:
        return grant
    stripped.env.update(grant.env)
    stripped.add_devices = list(grant.add_devices)
    stripped.add_cdi_devices = list(grant.add_cdi_devices)
    return stripped


def _resolve(allocs: Iterable[al.DeviceAllocation], gpus: GpuLookup) -> list[tuple[al.DeviceAllocation, GpuLike]]:
    out = []
    for a in allocs:
        g = gpus.by_minor(a.minor)
        if g is None:
            raise refuse(grpc.StatusCode.FAILED_PRECONDITION, f"gpu minor {a.minor}: no such GPU on this node")
        if a.id and a.id != g.uuid:
            other = gpus.by_uuid(a.id)
            if other is None:
                raise refuse(grpc.StatusCode.FAILED_PRECONDITION, f"gpu minor {a.minor}: no GPU {a.id} on this node")
            raise refuse(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"gpu minor {a.minor} is {g.uuid} on this node, not {a.id} (that is minor {other.minor})",
            )
        if g.mig_enabled:  # CUDA would find no device in it: only its MIG devices run work
            raise refuse(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"gpu minor {a.minor} ({g.uuid}) is in MIG mode on this node: it can not be given whole,"
                " its MIG devices are the device plugin's (nvidia.com/mig-*)",
            )
        out.append((a, g))
    return out


def _check_conflicts(pod_uid: str, chosen: Sequence[GpuLike], node: NodeView) -> None:
    """Fail when the checkpoint shows a chosen GPU in use through the device plugin by another pod.
    Device ids are compared as text, so this costs no NVML call. A chosen GPU is never in MIG mode
    (`_resolve`), so of `gpu_device_ids` only its UUID and index apply; spelled out, as this runs
    for every CreateContainer beside the plugin (half the time of building the ids)."""
    if not node.checkpoint.entries:  # no device plugin has handed anything out
        return
    for g in chosen:
        for e in (*node.checkpoint.holders(g.uuid), *node.checkpoint.holders(str(g.index))):
            if e.pod_uid != pod_uid and _plugin_uses(e, node):
                raise refuse(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"GPU minor {g.minor} ({g.uuid}) is held by live pod {e.pod_uid} container {e.container_name}"
                    f" through the device plugin ({e.resource_name}, kubelet checkpoint)",
                )


def _plugin_uses(e: PodDeviceEntry, node: NodeView) -> bool:
    """Whether a checkpoint entry is a GPU its container really uses. Kubelet hands a plugin device
    to every pod that asks for the plugin's resource, also to the pods crihook's scheduler placed:
    for those the entry is a phantom (the hook stripped it). A holder counts when crihook saw its
    container created (not removed), its pod has no gpu allocation of the scheduler's, and kubelet
    still has the pod. A holder whose container crihook has not seen created uses nothing yet;
    when it is created, `_check_taken` refuses it if the GPU is in use by then."""
    if node.pods is not None:
        seen = node.pods.get(e.pod_uid)
        if seen is None or seen.allocated or e.container_name not in seen.containers:
            return False
    return node.pod_live(e.pod_uid)


def _check_taken(pod_uid: str, plugin: Sequence[PodDeviceEntry], gpus: GpuLookup, node: NodeView) -> None:
    """A device-plugin container (no word from the scheduler) must not start on a GPU a pod the
    scheduler placed is using: kubelet believes that GPU free, since it counts only the phantom
    devices it gave the scheduler's pods."""
    if node.pods is None:
        return
    given: dict[int, GpuLike] = {}
    for e in plugin:
        for dev_id in e.device_ids:
            g = _plugin_gpu(base_device_id(dev_id), gpus)
            if g is not None:
                given[g.minor] = g
    if not given:
        return
    for uid, seen in node.pods.allocated():
        taken = sorted(seen.minors & given.keys())
        if uid != pod_uid and taken and seen.containers and node.pod_live(uid):
            g = given[taken[0]]
            raise HookError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the device plugin gave this container GPU minor {g.minor} ({g.uuid}), which live pod {uid}"
                " uses as the scheduler placed it; it can start once that pod is gone",
            )


def _plugin_gpu(dev_id: str, gpus: GpuLookup) -> GpuLike | None:
    """The GPU a device-plugin id names, or whose MIG device it names (`gpu_device_ids`)."""
    if dev_id.startswith("GPU-"):
        return gpus.by_uuid(dev_id)  # a miss refreshes the index
    return next((g for g in gpus.all() if dev_id in gpu_device_ids(g.index, g.uuid, g.mig_devices)), None)


def by_path(path: str) -> tuple[str, int, int] | None:
    """A node's numbers as its name says (`/dev/nvidiaN` is c 195:N), when nothing better is known."""
    m = _GPU_NODE.fullmatch(path)
    return ("c", 195, int(m[1])) if m else None


def _names_only(value: str | None, gpus: GpuLookup, minors: frozenset[int]) -> bool:
    """Whether NVIDIA_VISIBLE_DEVICES names no GPU outside `minors`."""
    names = visible_names(value)
    if not names:
        return True
    node = [Gpu(g.minor, g.index, g.uuid, tuple(g.mig_devices)) for g in gpus.all()]
    return all((hit := named(n, node)) is not None and {g.minor for g in hit} <= minors for n in names)


def _strip(
    container: ContainerInfo,
    plugin: Sequence[PodDeviceEntry],
    names: frozenset[str],
    node: NodeView,
    keep: frozenset[int],
) -> Edit | None:
    """Remove every GPU the container would get some other way: what the device plugin injected
    for it, any device node that is a GPU (by its numbers, whatever its name) not in `keep`, and
    every CDI device naming a GPU not chosen, whether in CDI_devices or in a `cdi.k8s.io/*`
    annotation (the plugin's, an image's, a webhook's); None when there is nothing to remove. CDI
    devices that name no GPU (gds, mofed, imex channels, a DRA claim's) stay; `names`: the chosen
    GPUs' (Placement.names) and the pod's claims' CDI devices. Only what the container has is
    looked at: most containers bring nothing of their own, and a pod the scheduler placed has no
    plugin injections."""
    if not (plugin or brings_devices(container)):
        return None  # nothing to look at
    remove_env: set[str] = set()
    remove_mounts: set[str] = set()
    remove_devices: set[str] = set()
    device_paths: set[str] = set()
    plugin_annotations: set[str] = set()
    if plugin:
        for e in plugin:
            if e.alloc_resp is None and e.alloc_error:
                raise HookError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"can not tell what the device plugin injected for {e.resource_name}: {e.alloc_error}",
                )
        injected = [e.alloc_resp for e in plugin if e.alloc_resp is not None]
        env_keys = {k for r in injected for k in r.envs} - {VISIBLE}
        mount_paths = {m.container_path for r in injected for m in r.mounts}
        device_paths = {d.container_path for r in injected for d in r.devices}
        plugin_annotations = {k for r in injected for k in r.annotations}
        remove_env = {k for k, _ in container.envs if k in env_keys}
        remove_mounts = {m.container_path for m in container.mounts if m.container_path in mount_paths}
    if container.devices:
        remove_devices = {
            d.container_path
            for d in container.devices
            if d.container_path in device_paths or _gpu_not_kept(d, node, keep)
        }
    remove_cdi = (
        {n for n in container.cdi_devices if not _cdi_kept(n, names, node, keep)} if container.cdi_devices else set()
    )
    annotations: dict[str, str] = {}
    remove_annotations: set[str] = set()
    for key, value in container.annotations.items():
        if key.startswith(ANNOTATION_PREFIX) or key in plugin_annotations:
            kept = [n for n in value.split(",") if _cdi_kept(n, names, node, keep)]
            if len(kept) == len(value.split(",")):
                continue
            if kept:
                annotations[key] = ",".join(kept)
            else:
                remove_annotations.add(key)
    if not (remove_env or remove_mounts or remove_devices or remove_cdi or annotations or remove_annotations):
        return None  # the common case: no Edit made
    return Edit(
        remove_env=remove_env,
        remove_mounts=remove_mounts,
        remove_devices=remove_devices,
        remove_cdi_devices=remove_cdi,
        annotations=annotations,
        remove_annotations=remove_annotations,
    )


def _gpu_not_kept(d: Device, node: NodeView, keep: frozenset[int]) -> bool:
    number = d.number or node.number_of(d.host_path)
    minor = gpu_minor(*number) if number is not None else None
    return minor is not None and minor not in keep


def _cdi_kept(name: str, chosen: frozenset[str], node: NodeView, keep: frozenset[int]) -> bool:
    """Whether a CDI device may stay: one of the pod's DRA claims' (`chosen` holds those by their
    full names); of a GPU kind, naming one of the chosen (by UUID or index); of another kind, when
    no device node its spec brings is a GPU outside `keep` (by number: `/dev/nvidia-fake0` that is
    c 195:0 is GPU 0). A device no spec declares brings nothing (the runtime refuses it)."""
    name = name.strip()
    device = gpu_cdi_name(name)
    if name in chosen or device is not None:
        return name in chosen or device in chosen
    nodes = node.cdi_nodes(name)
    return nodes is None or all(gpu_minor(n.kind, n.major, n.minor) in keep | {None} for n in nodes)


def _memory_bytes(a: al.DeviceAllocation, g: GpuLike) -> int:
    if al.GPU_MEMORY in a.resources:
        return a.resources[al.GPU_MEMORY]
    if al.GPU_MEMORY_RATIO in a.resources:
        return g.memory_total * a.resources[al.GPU_MEMORY_RATIO] // 100
    return g.memory_total


def _isolate(edit: Edit, pod: PodInfo, container: ContainerInfo, shares: Sequence[Share], paths: HamiCore) -> None:
    """HAMi-core: the limits and mounts of hooks.grant, with a cache directory per container."""
    for part, what in ((pod.uid, "pod UID"), (container.name, "container name")):
        if not _PATH_PART.fullmatch(part):
            raise HookError(grpc.StatusCode.INVALID_ARGUMENT, f"{what} {part[:64]!r} can not name a cache directory")
    edit.env.update(hami_env(shares))
    edit.add_mounts.extend(hami_mounts(paths, f"{pod.uid}_{container.name}"))
