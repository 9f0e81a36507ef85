"""A simulated GPU node on disk: device nodes (/dev/nvidia*, /dev/infiniband/*), the sysfs tree
the discovery reads, kubelet's directories and stand-in HAMi-core files, for `crihook demo` and
the tests. Nothing here needs a GPU, a driver or a kubelet."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crihook.simnode import fakenvml

NVIDIA_MAJOR = 195
NVIDIACTL_MINOR = 255
UVM_MAJOR = 510  # dynamic on a real node (/proc/devices); any free number does for a simulation
UVERBS_MAJOR = 231  # /dev/infiniband/uverbsN is 231:(UVERBS_BASE + N)
UVERBS_BASE = 192
MISC_MAJOR = 10
RDMA_CM_MINOR = 58  # rdma_cm is a dynamic misc device; any minor does for a simulation


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
    nodes, kubelet's pods directory and device checkpoint path, and stand-in HAMi-core files. Shared by
    `crihook demo` and the gpu hook's containerd tests."""

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
    def proc_root(self) -> Path:
        """A /proc holding only the processes the simulated GPUs run (their cgroup files)."""
        return self.root / "proc"

    @property
    def hami(self) -> Path:
        return self.root / "hami"

    def uuid(self, minor: int) -> str:
        return str(next(g["uuid"] for g in self.doc["gpus"] if g["minor"] == minor))

    def memory(self, minor: int) -> int:
        return int(next(g["memory_total"] for g in self.doc["gpus"] if g["minor"] == minor))

    def proxy_config(
        self,
        nvml_library: Path,
        node_name: str = "",
        proc_root: Path | None = None,
        kubelet_in_proc: bool = True,
        cdi_spec_dirs: Sequence[Path] = (),
    ) -> str:
        """crihook's [node] and [hooks] configuration for this node (TOML). Without a `proc_root`
        whose kubelet names its --root-dir (`kubelet_in_proc`), the pods dir is configured; with
        `cdi_spec_dirs`, the runtime's CDI dirs where they are not the default ones."""
        name = f'name = "{node_name}"\n' if node_name else ""
        proc = f'proc_root = "{proc_root}"\n' if proc_root else ""
        pods = f'kubelet_pods_dir = "{self.kubelet}/pods"  # no kubelet to tell its root dir'
        if proc_root and kubelet_in_proc:
            pods = ""
        if cdi_spec_dirs:
            pods += f"\ncdi_spec_dirs = {json.dumps([str(d) for d in cdi_spec_dirs])}"
        return f"""
[node]
{name}{proc}dev_root = "{self.dev_root}"
sys_root = "{self.sys_root}"
kubelet_checkpoint = "{self.checkpoint}"
nvml_library = "{nvml_library}"

[hooks]
allowed_host_paths = ["{{dev_root}}/nvidia*", "{{dev_root}}/infiniband/*", "{self.hami}/*"]

[hooks.gpu]
{pods}

[hooks.gpu.hami_core]
library = "{self.hami}/libvgpu.so"
preload_file = "{self.hami}/ld.so.preload"
cache_root = "{self.hami}/containers"
lock_dir = "{self.hami}/lock"
"""


def make_sim_node(root: Path, topology: str, *, char_devices: bool) -> SimNode:
    """One of the fake NVML's shipped topologies as a node under `root` (device nodes made with
    mknod when `char_devices`, which a real container runtime needs; plain files otherwise)."""
    node = SimNode(root, fakenvml.topology(topology))
    root.mkdir(parents=True, exist_ok=True)
    node.config.write_text(json.dumps(node.doc))
    fakenvml.make_sys_tree(node.sys_root, node.doc)
    make_dev_root(node.dev_root, [g["minor"] for g in node.doc["gpus"]], char_devices=char_devices)
    # kubelet makes device-plugins/ at start but writes the checkpoint only once a device plugin
    # registers, so a node without plugins has none (the hook reads that as no allocations)
    node.checkpoint.parent.mkdir(parents=True)
    (node.kubelet / "pods").mkdir(parents=True)
    node.hami.mkdir()
    (node.hami / "libvgpu.so").write_bytes(b"\x7fELF stand-in for HAMi-core\n")
    (node.hami / "ld.so.preload").write_text(f"{node.hami}/libvgpu.so\n")
    return node
