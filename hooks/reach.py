"""Which GPUs a container reaches, and which of those nobody granted it: the one decision that
refuses, bars or evicts a container for its GPUs, whichever path asked (the gpu hook's check at
CreateContainer in NRI mode, Synchronize, the CRI catch-up, StartContainer, the DRA driver).

A device node is a GPU by its type and numbers, never by its path: `c 195:N` with N < 254 is the
GPU whose NVML minor is N (254 and 255 are nvidia-modeset and nvidiactl), whatever the node is
called. A container reaches a GPU
- through a device node the device cgroup does not deny,
- through a device-cgroup rule that allows it (with CAP_MKNOD, which containerd grants by default, a
  rule alone is enough), a wildcard rule (`c 195:*`, `c *:*`, `a`) included,
- through a CDI device of a GPU kind (`nvidia.com/gpu` and its sub-domains) naming it,
- through NVIDIA_VISIBLE_DEVICES naming it (UUIDs, NVML indexes, MIG devices, `all`), which the
  NVIDIA runtime hook honours at start whatever the spec says.

Grants come from exactly three places: the scheduler's allocation annotation, kubelet's
device-plugin checkpoint and the pod's DRA claims. A container whose device cgroup allows every
device (privileged: containerd gives it every host node) reaches every GPU by its privilege, which
the cluster's admission granted; nothing it reaches counts as ungranted. A name that names no GPU of
this node reaches nothing (the runtime fails on it) and is reported as unknown, never as ungranted:
so a finding is always a GPU of this node, reached by a path above, that no grant names.

Pure: the caller reads the node (the GPU list, the checkpoints, the CDI specs) and hands facts in.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

GPU_MAJOR = 195
GPU_MINORS = range(254)  # 254: nvidia-modeset, 255: nvidiactl
VISIBLE = "NVIDIA_VISIBLE_DEVICES"
_NO_GPU = frozenset({"", "void", "none"})  # NVIDIA_VISIBLE_DEVICES values that name no GPU
# CDI kinds whose device names name GPUs: nvidia-ctk's nvidia.com/gpu, NVIDIA's device plugin's
# k8s.device-plugin.nvidia.com/gpu, the management spec's management.nvidia.com/gpu. Their device
# names are an NVML index, a UUID, "all" or a MIG device ("0:1", "MIG-<uuid>").
_GPU_CDI_KIND = re.compile(r"(?:[A-Za-z0-9_.-]+\.)?nvidia\.com/gpu")

# the ways a GPU is reached, as findings name them
BY_NODE = "device node"
BY_RULE = "device-cgroup rule"
BY_CDI = "CDI device"
BY_ENV = VISIBLE


class Undecided(Exception):
    """A fact the decision needs can not be had now (a checkpoint unreadable, NVML failing, a
    claim's CDI spec missing): no verdict, so never a finding; the caller asks again later."""


@dataclass(frozen=True, slots=True)
class DeviceNode:
    """A device node in the container's spec: type ("c" or "b"), numbers, and its path (words only)."""

    kind: str
    major: int
    minor: int
    path: str = ""


@dataclass(frozen=True, slots=True)
class DeviceRule:
    """One device-cgroup rule, in spec order: kind "a" (or empty) for every type, None numbers for any."""

    allow: bool
    kind: str = "a"
    major: int | None = None
    minor: int | None = None
    access: str = "rwm"

    def matches(self, kind: str, major: int, minor: int) -> bool:
        return (
            self.kind in ("", "a", kind)
            and (self.major is None or self.major == major)
            and (self.minor is None or self.minor == minor)
        )

    @property
    def opens(self) -> bool:
        """Whether an allow rule lets the device be read or written (mknod alone opens nothing)."""
        access = self.access or "rwm"
        return self.allow and ("r" in access or "w" in access)


@dataclass(frozen=True, slots=True)
class Gpu:
    """A GPU of the node, by every name it goes by."""

    minor: int
    index: int
    uuid: str
    mig: tuple[tuple[int, str], ...] = ()  # (NVML index under the GPU, MIG UUID) of each MIG device


@dataclass(frozen=True, slots=True)
class Reach:
    """What a container has that can give it GPUs. `rules` None: no device cgroup known yet (a CRI
    request, before the runtime adds a rule for each node), so every node counts."""

    nodes: tuple[DeviceNode, ...] = ()
    rules: tuple[DeviceRule, ...] | None = None
    cdi_devices: tuple[str, ...] = ()  # qualified names, from CDI_devices and cdi.k8s.io/* annotations
    visible: str | None = None  # NVIDIA_VISIBLE_DEVICES as set (last value), None when unset


@dataclass(frozen=True, slots=True)
class Grants:
    """The GPUs (NVML minors) granted to one container, by source. `claim_cdi`: the CDI devices of
    its pod's DRA claims: a GPU one of them names is the claim's (its nodes' numbers, which the
    caller reads from the CDI specs, are in `claims`)."""

    scheduler: frozenset[int] = frozenset()
    plugin: frozenset[int] = frozenset()
    claims: frozenset[int] = frozenset()
    claim_cdi: frozenset[str] = frozenset()

    @property
    def minors(self) -> frozenset[int]:
        return self.scheduler | self.plugin | self.claims


@dataclass(frozen=True, slots=True)
class Verdict:
    """Which GPUs the container reaches (minor -> the ways), which of them no grant names, and the
    names that name no GPU of this node."""

    reached: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    ungranted: tuple[int, ...] = ()
    privileged: bool = False
    unknown: tuple[str, ...] = ()

    def describe(self) -> str:
        """The ungranted GPUs in words, each with the ways it is reached."""
        return "; ".join(f"GPU minor {m} (by {', '.join(self.reached[m])})" for m in self.ungranted)


def gpu_minor(kind: str, major: int, minor: int) -> int | None:
    """The NVML minor a device node of these numbers gives access to, if it is a GPU's."""
    return minor if kind == "c" and major == GPU_MAJOR and minor in GPU_MINORS else None


def every_device(rules: Iterable[DeviceRule]) -> bool:
    """Whether the device cgroup lets every device be read and written: the last rule for all
    devices (no type, or "a", and no numbers) allows it. containerd's CRI gives a privileged
    container one such rule; an unprivileged one starts with the same wildcard as a deny."""
    every = False
    for r in rules:
        if r.kind in ("", "a") and r.major is None and r.minor is None:
            every = r.allow and {"r", "w"} <= set(r.access or "rwm")
    return every


def _allowed(rules: Sequence[DeviceRule], minor: int) -> bool | None:
    """The last rule matching `c 195:minor` decides; None when none does."""
    for r in reversed(rules):
        if r.matches("c", GPU_MAJOR, minor):
            return r.opens
    return None


def visible_names(value: str | None) -> tuple[str, ...]:
    """NVIDIA_VISIBLE_DEVICES' entries: () for unset, empty, `void` and `none`."""
    if value is None or value.strip() in _NO_GPU:
        return ()
    return tuple(n for n in (v.strip() for v in value.split(",")) if n)


def gpu_cdi_name(name: str) -> str | None:
    """The device part of a CDI name of a GPU kind ("nvidia.com/gpu=GPU-…" -> "GPU-…"), else None."""
    kind, sep, device = name.strip().partition("=")
    return device if sep and _GPU_CDI_KIND.fullmatch(kind) else None


def named(name: str, gpus: Sequence[Gpu]) -> tuple[Gpu, ...] | None:
    """The GPUs one name stands for: "all", an NVML index, a GPU or MIG UUID, `<index>:<mig>`, or
    a qualified CDI name of a GPU kind; None when it names no GPU of this node."""
    device = gpu_cdi_name(name)
    if device is not None:
        name = device
    if name == "all":
        return tuple(gpus)
    for g in gpus:
        if name in (g.uuid, str(g.index)) or any(name in (u, f"{g.index}:{i}") for i, u in g.mig):
            return (g,)
    return None


def reached(reach: Reach, gpus: Sequence[Gpu]) -> tuple[dict[int, list[str]], list[str]]:
    """The GPUs of this node `reach` gives (minor -> ways, in the order found), and the names that
    name none of them. A node or rule for a minor no GPU of this node has reaches nothing."""
    ways: dict[int, list[str]] = {}
    unknown: list[str] = []
    minors = {g.minor for g in gpus}

    def add(minor: int, way: str) -> None:
        seen = ways.setdefault(minor, [])
        if way not in seen:
            seen.append(way)

    rules = reach.rules
    for n in reach.nodes:
        m = gpu_minor(n.kind, n.major, n.minor)
        if m in minors and (rules is None or _allowed(rules, m) is not False):
            add(m, f"{BY_NODE} {n.path} (c {n.major}:{n.minor})" if n.path else f"{BY_NODE} c {n.major}:{n.minor}")
    if rules:
        for m in sorted(minors):
            if _allowed(rules, m):
                add(m, BY_RULE)
    for name in reach.cdi_devices:
        if gpu_cdi_name(name) is not None:
            hit = named(name, gpus)
            if hit is None:
                unknown.append(name)
            for g in hit or ():
                add(g.minor, f"{BY_CDI} {name}")
    for name in visible_names(reach.visible):
        hit = named(name, gpus)
        if hit is None:
            unknown.append(f"{VISIBLE}={name}")
        for g in hit or ():
            add(g.minor, f"{BY_ENV}={name}")
    return ways, unknown


def judge(reach: Reach, grants: Grants, gpus: Sequence[Gpu]) -> Verdict:
    """The decision: the GPUs `reach` gives on a node of `gpus`, and those `grants` does not name.
    A GPU named by one of the pod's claim CDI devices is the claim's."""
    ways, unknown = reached(reach, gpus)
    privileged = reach.rules is not None and every_device(reach.rules)
    granted = set(grants.minors)
    for name in reach.cdi_devices:
        if name in grants.claim_cdi and gpu_cdi_name(name) is not None:
            granted |= {g.minor for g in named(name, gpus) or ()}
    ungranted = () if privileged else tuple(sorted(set(ways) - granted))
    return Verdict({m: tuple(w) for m, w in sorted(ways.items())}, ungranted, privileged, tuple(unknown))
