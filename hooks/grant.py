"""What a container gets for the GPUs it is given, whichever path gave them: the scheduler's
annotation (hooks/gpu_edit.py) or a DRA claim of crihook's driver (its CDI spec). One place decides
the CUDA numbering (PCI bus order), the device nodes, NVIDIA_VISIBLE_DEVICES and, for a share of a
GPU, HAMi-core's limits and mounts, so both paths give a container the same thing. Pure: the caller
says which device nodes exist.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from crihook.base.config import absolute_path, absolute_path_or_empty
from crihook.base.spec import Device, Mount

VISIBLE = "NVIDIA_VISIBLE_DEVICES"
CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
DEVICE_PERMISSIONS = "rw"  # what NVIDIA's device plugin grants
FULL_CORES = 100
HAMI_CACHE_MOUNT = "/tmp/vgpu"
HAMI_LOCK_MOUNT = "/tmp/vgpulock"  # where HAMi-core's library takes its locks
HAMI_PRELOAD_MOUNT = "/etc/ld.so.preload"
MiB = 1 << 20


class GpuFacts(Protocol):
    """What the grant needs of a GPU (devices.nvml.GpuInfo)."""

    @property
    def minor(self) -> int: ...
    @property
    def uuid(self) -> str: ...
    @property
    def pci_bus_id(self) -> str: ...
    @property
    def memory_total(self) -> int: ...


@dataclass(frozen=True, slots=True)
class HamiCore:
    """The `[hooks.gpu.hami_core]` table: host paths for HAMi-core isolation, allowed as configured
    (GpuHook.host_paths) beside hooks.allowed_host_paths. crihook makes the cache and lock
    directories itself (hooks/gpu.py), so by default they are under its state directory, the one
    place the shipped unit and the chart let it write on the host."""

    library: str = field(default="/usr/local/vgpu/libvgpu.so", metadata={"check": absolute_path})
    """the HAMi-core library"""
    preload_file: str = field(default="/usr/local/vgpu/ld.so.preload", metadata={"check": absolute_path})
    """holds the library's path, one line; mounted as the container's /etc/ld.so.preload"""
    cache_root: str = field(default="/var/lib/crihook/hami-core/containers", metadata={"check": absolute_path})
    """a directory per container below it, mounted at /tmp/vgpu"""
    lock_dir: str = field(default="/var/lib/crihook/hami-core/lock", metadata={"check": absolute_path_or_empty})
    """shared by every container of a GPU, mounted at /tmp/vgpulock; empty: not mounted"""
    host_root: str = field(default="", metadata={"check": absolute_path_or_empty})
    """where crihook sees the host's / when it runs in a container (the chart's node pod); empty:
    its own /. Only the check that the library and preload file exist looks there."""


@dataclass(frozen=True, slots=True)
class Share:
    """One GPU given to a container, with what of it the container may use."""

    gpu: GpuFacts
    memory: int  # bytes
    cores: int = FULL_CORES  # percent of the SMs

    @property
    def shared(self) -> bool:
        return self.cores < FULL_CORES or self.memory < self.gpu.memory_total


class MissingDeviceNode(Exception):
    """A GPU's device node is not on the node; the message names it."""


def cuda_key(g: GpuFacts) -> str:
    """Where a GPU comes in the order CUDA numbers the visible GPUs: PCI bus order, which
    CUDA_DEVICE_ORDER=PCI_BUS_ID pins."""
    return g.pci_bus_id.lower()


def cuda_order(shares: Iterable[Share]) -> tuple[Share, ...]:
    """The shares in CUDA's order (`cuda_key`)."""
    return tuple(sorted(shares, key=lambda s: cuda_key(s.gpu)))


def visible(gpus: Iterable[GpuFacts]) -> str:
    """NVIDIA_VISIBLE_DEVICES for these GPUs: their UUIDs, in the order given."""
    return ",".join(g.uuid for g in gpus)


def device_nodes(gpus: Sequence[GpuFacts], exists: Callable[[str], bool], dev_root: str) -> tuple[Device, ...]:
    """The GPUs' device nodes, then the control nodes the node has. Raises MissingDeviceNode."""
    for g in gpus:
        if not exists(f"{dev_root}/nvidia{g.minor}"):
            raise MissingDeviceNode(
                f"device node {dev_root}/nvidia{g.minor} of minor {g.minor} is missing on this node"
            )
    nodes = [f"nvidia{g.minor}" for g in gpus]
    nodes += [n for n in CONTROL_NODES if exists(f"{dev_root}/{n}")]
    return tuple(Device(f"/dev/{n}", f"{dev_root}/{n}", DEVICE_PERMISSIONS) for n in nodes)


def hami_env(shares: Sequence[Share]) -> dict[str, str]:
    """HAMi-core's limits for a container holding `shares` (in CUDA order): per-GPU memory limits
    numbered as CUDA numbers the container's GPUs, the smallest SM share, the order pinned."""
    env = {f"CUDA_DEVICE_MEMORY_LIMIT_{i}": f"{max(1, s.memory // MiB)}m" for i, s in enumerate(shares)}
    env["CUDA_DEVICE_SM_LIMIT"] = str(min((s.cores for s in shares), default=FULL_CORES))
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = f"{HAMI_CACHE_MOUNT}/cudevshr.cache"
    return env


def hami_mounts(paths: HamiCore, cache_dir: str) -> list[Mount]:
    """The library preloaded, a cache of the container's own (`cache_dir` below paths.cache_root),
    the lock directory the containers of a GPU share."""
    mounts = [
        Mount(paths.library, paths.library, readonly=True),
        Mount(HAMI_PRELOAD_MOUNT, paths.preload_file, readonly=True),
        Mount(HAMI_CACHE_MOUNT, f"{paths.cache_root}/{cache_dir}"),
    ]
    if paths.lock_dir:
        mounts.append(Mount(HAMI_LOCK_MOUNT, paths.lock_dir))
    return mounts


def hami_files(paths: HamiCore) -> tuple[tuple[str, str], ...]:
    """The library and the preload file: each host path with the path crihook sees it at."""
    root = paths.host_root.rstrip("/")
    return tuple((p, f"{root}{p}") for p in (paths.library, paths.preload_file))


def hami_dirs(mounts: Iterable[Mount]) -> list[str]:
    """The host directories of HAMi-core's cache and lock mounts among `mounts`: every process of
    the container, whatever its user, writes there, and nothing else makes them where they go."""
    return [m.host_path for m in mounts if m.container_path in (HAMI_CACHE_MOUNT, HAMI_LOCK_MOUNT)]


def make_hami_dir(path: str) -> None:
    """One of HAMi-core's cache and lock directories, made before the runtime mounts it (NRI's runc
    mounts a missing source as an error, CRI makes it root's 0755) and writable by every user, as
    HAMi's own device plugin makes them: the container's processes run as whatever user the image
    says. Raises OSError."""
    os.makedirs(path, exist_ok=True)
    if stat.S_IMODE(os.stat(path).st_mode) != 0o777:
        os.chmod(path, 0o777)
