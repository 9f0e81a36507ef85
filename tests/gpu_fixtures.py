"""Test helpers for the GPU and RDMA hooks: kubelet checkpoints as kubelet writes them, a GPU
inventory, and node trees (device nodes, sysfs) in a temporary directory."""

from __future__ import annotations

import base64
import json
import os
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crihook.proto import deviceplugin_v1beta1_pb2 as dp

NVIDIA_MAJOR = 195
NVIDIACTL_MINOR = 255
UVM_MAJOR = 510  # dynamic on a real node (/proc/devices); any free number does for a test
UVERBS_MAJOR = 231  # /dev/infiniband/uverbsN is 231:(UVERBS_BASE + N)
UVERBS_BASE = 192
MISC_MAJOR = 10
RDMA_CM_MINOR = 58  # rdma_cm is a dynamic misc device; any minor does for a test


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


def checkpoint_doc(entries: Iterable[Entry], *, layout: str = "numa", extra: Mapping[str, Any] | None = None) -> dict:
    """The JSON kubelet writes: `layout` "numa" (1.20+) or "list" (1.19 and older)."""
    pod_entries = []
    registered: dict[str, list[str]] = {}
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
        registered.setdefault(e.resource, []).extend(e.device_ids)
    doc: dict[str, Any] = {"Data": {"PodDeviceEntries": pod_entries, "RegisteredDevices": registered}}
    doc["Checksum"] = 1234567890
    doc.update(extra or {})
    return doc


def write_checkpoint(path: Path, entries: Iterable[Entry], **kwargs: Any) -> None:
    """Atomically, as kubelet does (write a temporary file, then rename over the old one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(json.dumps(checkpoint_doc(entries, **kwargs)).encode())
    os.replace(tmp, path)


# -- node trees ------------------------------------------------------------------------------------


def make_dev_root(root: Path, minors: Iterable[int], *, uvm: bool = True, char_devices: bool = False) -> Path:
    """A /dev with nvidiaN, nvidiactl and (optionally) nvidia-uvm{,-tools}. With `char_devices` they
    are real character devices (mknod, major 195; uvm takes a made-up dynamic major), which a
    container runtime needs; else plain files, which is all the hooks look at."""
    root.mkdir(parents=True, exist_ok=True)
    nodes = {f"nvidia{m}": (NVIDIA_MAJOR, m) for m in minors}
    nodes["nvidiactl"] = (NVIDIA_MAJOR, NVIDIACTL_MINOR)
    if uvm:
        nodes["nvidia-uvm"] = (UVM_MAJOR, 0)
        nodes["nvidia-uvm-tools"] = (UVM_MAJOR, 1)
    for name, (major, minor) in nodes.items():
        _node(root / name, major, minor, char_devices)
    return root


def make_rdma_sys(
    sys_root: Path, dev_root: Path, functions: Mapping[str, Sequence[str]], *, char_devices: bool = False
) -> None:
    """sysfs PCI functions with their `infiniband_verbs/uverbsN` entries, the matching
    /dev/infiniband/uverbsN nodes, and rdma_cm; real character devices with `char_devices`."""
    ib = dev_root / "infiniband"
    ib.mkdir(parents=True, exist_ok=True)
    nodes = {"rdma_cm": (MISC_MAJOR, RDMA_CM_MINOR)}
    for address, verbs in functions.items():
        fn = sys_root / "bus" / "pci" / "devices" / address
        (fn / "infiniband_verbs").mkdir(parents=True, exist_ok=True)
        for v in verbs:
            (fn / "infiniband_verbs" / v).mkdir(exist_ok=True)
            nodes[v] = (UVERBS_MAJOR, UVERBS_BASE + int(v.removeprefix("uverbs")))
    for name, (major, minor) in nodes.items():
        _node(ib / name, major, minor, char_devices)


def _node(path: Path, major: int, minor: int, char_device: bool) -> None:
    if path.exists():
        return
    if char_device:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
    else:
        path.touch()


@dataclass
class SimNode:
    """A simulated GPU node on disk: the fake NVML's topology file, a sysfs tree, /dev with the GPUs'
    nodes, kubelet's pods directory and device checkpoint, and stand-in HAMi-core files. Shared by
    the gpu hook's containerd tests and `crihook demo`."""

    root: Path
    doc: dict[str, Any]

    @property
    def config(self) -> Path:  # what CRIHOOK_FAKE_NVML_CONFIG names
        return self.root / "topology.json"

    @property
    def sys_root(self) -> Path:
        return self.root / "sys"

    @property
    def dev_root(self) -> Path:
        return self.root / "dev"

    @property
    def kubelet(self) -> Path:
        return self.root / "kubelet"

    @property
    def checkpoint(self) -> Path:
        return self.kubelet / "device-plugins" / "kubelet_internal_checkpoint"

    @property
    def hami(self) -> Path:
        return self.root / "hami"

    def uuid(self, minor: int) -> str:
        return next(g["uuid"] for g in self.doc["gpus"] if g["minor"] == minor)

    def memory(self, minor: int) -> int:
        return next(g["memory_total"] for g in self.doc["gpus"] if g["minor"] == minor)

    def proxy_config(self, nvml_library: Path, node_name: str = "") -> str:
        """crihook's [node] and [hooks] configuration for this node (TOML)."""
        name = f'name = "{node_name}"\n' if node_name else ""
        return f"""
[node]
{name}dev_root = "{self.dev_root}"
sys_root = "{self.sys_root}"
kubelet_checkpoint = "{self.checkpoint}"
nvml_library = "{nvml_library}"

[hooks]
allowed_host_paths = ["{{dev_root}}/nvidia*", "{{dev_root}}/infiniband/*", "{self.hami}/*"]

[hooks.gpu.hami_core]
library = "{self.hami}/libvgpu.so"
preload_file = "{self.hami}/ld.so.preload"
cache_root = "{self.hami}/containers"
lock_dir = "{self.hami}/lock"
"""


def make_sim_node(root: Path, topology: str, *, char_devices: bool) -> SimNode:
    """One of the fake NVML's shipped topologies as a node under `root` (device nodes made with
    mknod when `char_devices`, which a real container runtime needs; plain files otherwise)."""
    import fakenvml

    node = SimNode(root, fakenvml.topology(topology))
    root.mkdir(parents=True, exist_ok=True)
    node.config.write_text(json.dumps(node.doc))
    fakenvml.make_sys_tree(node.sys_root, node.doc)
    make_dev_root(node.dev_root, [g["minor"] for g in node.doc["gpus"]], char_devices=char_devices)
    (node.kubelet / "pods").mkdir(parents=True)
    write_checkpoint(node.checkpoint, [])
    node.hami.mkdir()
    (node.hami / "libvgpu.so").write_bytes(b"\x7fELF stand-in for HAMi-core\n")
    (node.hami / "ld.so.preload").write_text(f"{node.hami}/libvgpu.so\n")
    return node
