"""The rdma hook: hands a container the RDMA verbs devices of the NIC functions the scheduler gave
its pod (`rdma` entries of scheduling.koordinator.sh/device-allocated), plus the RDMA connection
manager. An entry names its PF by PCI address (`id`), or its VFs in `extension.vfs`; sysfs says
which `uverbsN` belongs to each function.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from typing import NoReturn

import grpc

from crihook.base import allocation as al
from crihook.base.config import NodeConfig, NoOptions
from crihook.base.spec import Device
from crihook.hooks.base import MISS, ContainerInfo, Edit, HookContext, Miss, PodInfo, Stage
from crihook.hooks.fscache import NotCached
from crihook.hooks.scheduled import prime, refuse, scheduled

PRIORITY = 210  # after the gpu hook
RDMA_CM = "infiniband/rdma_cm"
_UVERBS = re.compile(r"uverbs[0-9]+")


def canonical_pci(address: str) -> str:
    """sysfs spelling of a PCI address: lower case, a domain of at least four digits (NVML and some
    tools write eight)."""
    domain, rest = address.split(":", 1)
    return f"{int(domain, 16):04x}:{rest.lower()}"


def rdma_edit(
    pod: PodInfo,
    container: ContainerInfo,
    verbs_of: Callable[[str], Sequence[str]],
    exists: Callable[[str], bool],
    dev_root: str,
) -> Edit | None:
    """The devices for one CreateContainer; None when the scheduler gave the container no RDMA
    device. `verbs_of` maps a canonical PCI address to its uverbs names. Raises HookError."""
    allocs = scheduled(pod, container, al.RDMA_TYPE)
    if not allocs:
        return None
    names: list[str] = []
    for a in allocs:
        functions = a.vfs or ((a.id,) if a.id else ())
        if not functions:
            raise refuse(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"rdma minor {a.minor}: neither id nor extension.vfs names a PCI function",
            )
        for fn in functions:
            verbs = sorted(v for v in verbs_of(canonical_pci(fn)) if _UVERBS.fullmatch(v))
            if not verbs:
                raise refuse(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"rdma minor {a.minor}: PCI function {fn} has no RDMA verbs device on this node",
                )
            names += [f"infiniband/{v}" for v in verbs if f"infiniband/{v}" not in names]
    missing = [f"{dev_root}/{n}" for n in names if not exists(f"{dev_root}/{n}")]
    if missing:
        raise refuse(grpc.StatusCode.FAILED_PRECONDITION, f"device node {missing[0]} is missing on this node")
    if exists(f"{dev_root}/{RDMA_CM}"):
        names.insert(0, RDMA_CM)
    return Edit(add_devices=[Device(f"/dev/{n}", f"{dev_root}/{n}", "rw") for n in names])


def sysfs_verbs(sys_root: str) -> Callable[[str], list[str]]:
    """PCI address -> the entries of its infiniband_verbs directory (none if it has none)."""

    def verbs_of(address: str) -> list[str]:
        try:
            return os.listdir(f"{sys_root}/bus/pci/devices/{address}/infiniband_verbs")
        except OSError:
            return []

    return verbs_of


class RdmaHook:
    name = "rdma"
    stages = frozenset({Stage.PRE_CREATE_CONTAINER})
    priority = PRIORITY

    def __init__(self, node: NodeConfig) -> None:
        self.dev_root = node.dev_root.rstrip("/")
        self.verbs_of = sysfs_verbs(node.sys_root.rstrip("/"))

    def prepare_pod(self, pod: PodInfo) -> None:
        prime(pod, al.RDMA_TYPE)

    def handle(self, ctx: HookContext) -> Edit | None:
        assert ctx.container is not None
        return rdma_edit(ctx.pod, ctx.container, self.verbs_of, os.path.exists, self.dev_root)

    def handle_cached(self, ctx: HookContext) -> Edit | Miss | None:
        """handle() on the event loop for a container the scheduler gave no RDMA device (no read
        needed). One that has some goes to a worker thread (MISS): sysfs sends no inotify events,
        so its answers can not be remembered safely (see hooks.fscache)."""
        assert ctx.container is not None
        try:
            return rdma_edit(ctx.pod, ctx.container, _needs_read, _needs_read, self.dev_root)
        except NotCached:
            return MISS


def _needs_read(path: str) -> NoReturn:
    raise NotCached(path)


def factory(options: NoOptions, node: NodeConfig) -> RdmaHook:
    """Entry point `rdma`: no options of its own, the node's paths."""
    return RdmaHook(node)
