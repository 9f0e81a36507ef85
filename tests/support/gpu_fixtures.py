"""Test helpers for the GPU and RDMA hooks: kubelet checkpoints as kubelet writes them and a GPU
inventory. Node trees (device nodes, sysfs) are crihook.simnode.node's."""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crihook.proto import deviceplugin_v1beta1_pb2 as dp


@dataclass(frozen=True)
class Gpu:
    """The fields of devices.nvml.GpuInfo the hooks read."""

    index: int
    minor: int
    uuid: str
    pci_bus_id: str
    memory_total: int = 16 << 30
    name: str = "Tesla V100-SXM2-16GB"
    numa_node: int = 0
    healthy: bool = True
    mig_enabled: bool = False
    mig_devices: tuple[tuple[int, str], ...] = ()


def gpus(count: int, *, minor_offset: int = 0) -> list[Gpu]:
    """A box whose NVML minors differ from the indices (minor = index + offset, reversed order on the
    bus), so a hook that mixes them up is caught."""
    return [
        Gpu(
            index=i,
            minor=i + minor_offset,
            uuid=f"GPU-{i:08x}-aaaa-bbbb-cccc-{i + minor_offset:012x}",
            pci_bus_id=f"00000000:{0x80 - 0x10 * i:02X}:00.0",
        )
        for i in range(count)
    ]


class Inventory:
    """A GpuIndex stand-in over a fixed list, counting lookups so tests can see refreshes."""

    def __init__(self, items: Iterable[Gpu]) -> None:
        self.items = list(items)
        self.lookups = 0
        self.generation = 0  # GpuIndex's: the list never changes

    def by_minor(self, minor: int) -> Gpu | None:
        self.lookups += 1
        return next((g for g in self.items if g.minor == minor), None)

    def by_uuid(self, uuid: str) -> Gpu | None:
        self.lookups += 1
        return next((g for g in self.items if g.uuid == uuid), None)

    def all(self) -> list[Gpu]:
        return list(self.items)


# -- kubelet checkpoint ----------------------------------------------------------------------------


def alloc_resp(
    envs: Mapping[str, str] | None = None,
    devices: Sequence[tuple[str, str]] = (),
    mounts: Sequence[tuple[str, str]] = (),
    annotations: Mapping[str, str] | None = None,
    cdi: Sequence[str] = (),
) -> dp.ContainerAllocateResponse:
    return dp.ContainerAllocateResponse(
        envs=dict(envs or {}),
        devices=[dp.DeviceSpec(container_path=c, host_path=h, permissions="rw") for c, h in devices],
        mounts=[dp.Mount(container_path=c, host_path=h, read_only=True) for c, h in mounts],
        annotations=dict(annotations or {}),
        cdi_devices=[dp.CDIDevice(name=n) for n in cdi],
    )


def nvidia_plugin_resp(gpu_list: Sequence[Gpu]) -> dp.ContainerAllocateResponse:
    """What NVIDIA's device plugin answers in its default (envvar) mode."""
    return alloc_resp(envs={"NVIDIA_VISIBLE_DEVICES": ",".join(g.uuid for g in gpu_list)})


@dataclass
class Entry:
    pod_uid: str
    container: str
    device_ids: Sequence[str]
    resource: str = "nvidia.com/gpu"
    resp: dp.ContainerAllocateResponse | None = field(default=None)
    numa: int = -1


def checkpoint_doc(
    entries: Iterable[Entry],
    *,
    layout: str = "numa",
    extra: Mapping[str, Any] | None = None,
    registered: Mapping[str, Sequence[str]] | None = None,
) -> dict:
    """The JSON kubelet writes: `layout` "numa" (1.20+) or "list" (1.19 and older). RegisteredDevices
    is each registered plugin's healthy devices, allocated or not: `registered`, else the devices
    the entries hold."""
    pod_entries = []
    held: dict[str, list[str]] = {}
    for e in entries:
        ids: Any = {str(e.numa): list(e.device_ids)} if layout == "numa" else list(e.device_ids)
        resp = base64.b64encode((e.resp or dp.ContainerAllocateResponse()).SerializeToString()).decode()
        pod_entries.append(
            {
                "PodUID": e.pod_uid,
                "ContainerName": e.container,
                "ResourceName": e.resource,
                "DeviceIDs": ids,
                "AllocResp": resp,
            }
        )
        held.setdefault(e.resource, []).extend(e.device_ids)
    devices = {k: list(v) for k, v in registered.items()} if registered is not None else held
    doc: dict[str, Any] = {"Data": {"PodDeviceEntries": pod_entries, "RegisteredDevices": devices}}
    doc["Checksum"] = 1234567890
    doc.update(extra or {})
    return doc


def write_checkpoint(path: Path, entries: Iterable[Entry], **kwargs: Any) -> None:
    """Atomically, as kubelet does (write a temporary file, then rename over the old one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(json.dumps(checkpoint_doc(entries, **kwargs)).encode())
    os.replace(tmp, path)


def fake_proc(root: Path, argv: list[str] | None) -> Path:
    """A /proc under `root` with init and, when `argv` is given, a kubelet with that command line:
    `comm` and the NUL-separated `cmdline` are what crihook reads (proc(5))."""
    proc = root / "proc"
    (proc / "1").mkdir(parents=True, exist_ok=True)
    (proc / "1/comm").write_text("systemd\n")
    (proc / "1/cmdline").write_bytes(b"/sbin/init\0")
    (proc / "self").mkdir(exist_ok=True)
    if argv is not None:
        (proc / "4242").mkdir(exist_ok=True)
        (proc / "4242/comm").write_text("kubelet\n")
        (proc / "4242/cmdline").write_bytes("\0".join(argv).encode() + b"\0")
    return proc
