"""The fake NVML library: build it, point the real `pynvml` at it, describe a node.

`fakenvml.c` is compiled with the machine's C compiler once per source version into the user's
cache directory (`$XDG_CACHE_HOME/crihook`, else `~/.cache/crihook`) as `libnvidia-ml.so.1`. The
production loader in `crihook.devices.nvml` takes a library path (config `node.nvml_library`), so
the demo or a test hands it `FakeNvml.library` and nothing in pynvml is patched. The library reads
the node it models from the JSON file named by CRIHOOK_FAKE_NVML_CONFIG at every nvmlInit.

Topology file (see the three shipped ones):

    {"driver_version": "550.54.15",
     "init_error": 9,                       # optional: nvmlInit fails with this NVML code
     "gpus": [{"minor": 0, "uuid": "GPU-…", "name": "NVIDIA H100 80GB HBM3",
               "memory_total": 85520809984, "memory_used": 0,
               "pci_bus_id": "0000:1b:00.0", "pci_device_id": 590352606, "pci_subsystem_id": 381751518,
               "numa_node": 0,              # not NVML: written to the sysfs tree by make_sys_tree
               "mig_mode": 0,               # optional, absent = NOT_SUPPORTED (same for the two below)
               "mig_devices": ["MIG-…", null],  # optional: MIG device UUIDs by slot (up to 7), null = empty
               "retired_pages_pending": false, "row_remap_failure": false,
               "cuda_capability": [9, 0],   # optional: [major, minor], absent = NOT_SUPPORTED
               "lost": false,               # optional: live queries answer GPU_IS_LOST
               "processes": [{"pid": 4242, "used_memory": 1073741824,  # bytes, null = not available
                              "type": "compute" | "graphics" | "both",  # optional, compute
                              "sm_util": 35, "mem_util": 10,  # optional: one utilisation sample per read
                              "mig": 0}],                 # optional: the MIG slot it runs on
               "nvlink_version": 4,         # needed when nvlinks is given
               "nvlinks": [{"remote": "0000:a5:00.0", "type": "switch" | "gpu", "count": 5,
                            "active": true}]}],
     "pcie_levels": [[0, 40, …], …]}         # nvmlDeviceGetTopologyCommonAncestor, NxN by NVML index

GPUs are listed in NVML index order (topologies/ holds the shipped ones). The process queries re-read
the file when it changed, so a test or the demo starts and ends GPU processes under a running daemon
by rewriting it (`FakeNvml.write`). The test fixture
`fake_nvml` (tests/support/fakenvml.py) gives each test its own copy of a topology, its sysfs tree and the
environment variable.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "fakenvml.c"
CONFIG_ENV = "CRIHOOK_FAKE_NVML_CONFIG"
TOPOLOGIES = ("dgx1-v100", "dgx-h100", "pcie-l40s")
CPUS_PER_NODE = 4  # the made-up CPU layout of make_sys_tree: node N holds CPUs 4N..4N+3, on socket N


class NoCompiler(RuntimeError):
    """No C compiler on this machine to build the fake library with."""


def compiler() -> str | None:
    return shutil.which("gcc") or shutil.which("cc")


def cache_dir() -> Path:
    """Where built libraries go: outside the package, which may be installed read-only."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "crihook"


def build() -> Path:
    """The compiled library, built on first use; the path names the source's hash, so an edit to
    fakenvml.c gives a new build and a stale one is never loaded."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    out = cache_dir() / f"fakenvml-{digest}" / "libnvidia-ml.so.1"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".lock", "w") as lock:  # parallel test processes build it once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            cc = compiler()
            if cc is None:
                raise NoCompiler("no C compiler (gcc) to build the fake NVML library: apt-get install gcc")
            tmp = out.with_name(f".{out.name}.{os.getpid()}")
            subprocess.run(
                [cc, "-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-pthread", "-o", str(tmp), str(SOURCE)],
                check=True,
                capture_output=True,
                text=True,
            )
            os.replace(tmp, out)
    return out


def topology(name: str) -> dict[str, Any]:
    """A fresh copy of a shipped topology."""
    if name not in TOPOLOGIES:
        raise ValueError(f"unknown fake NVML topology {name!r} (known: {', '.join(TOPOLOGIES)})")
    doc: dict[str, Any] = json.loads((HERE / "topologies" / f"{name}.json").read_text())
    return doc


def make_sys_tree(sys_root: Path, doc: dict[str, Any]) -> None:
    """What the discovery reads from sysfs beside NVML, laid out as the kernel does: each GPU's PCI
    function under /sys/devices/pci<host bridge>/<root port>/ (one host bridge per NUMA node; GPUs
    whose pcie_levels say they share a PCIe switch share a root port) with its numa_node, linked
    from /sys/bus/pci/devices; and the NUMA nodes' CPUs with their sockets."""
    gpus = doc["gpus"]
    levels = doc["pcie_levels"]
    port_of: dict[int, int] = {}
    for i in range(len(gpus)):  # SINGLE (10) or MULTIPLE (20) switches: one root port above both
        port_of[i] = next((port_of[j] for j in range(i) if levels[i][j] <= 20), i)
    nodes = set()
    bus_devices = sys_root / "bus" / "pci" / "devices"
    bus_devices.mkdir(parents=True, exist_ok=True)
    for i, g in enumerate(gpus):
        numa = g.get("numa_node", -1)
        bridge_bus = 0x80 * max(numa, 0)
        address = g["pci_bus_id"].lower()
        fn = (
            sys_root / "devices" / f"pci0000:{bridge_bus:02x}" / f"0000:{bridge_bus:02x}:{port_of[i] + 1:02x}.0"
        ) / address
        fn.mkdir(parents=True, exist_ok=True)
        (fn / "numa_node").write_text(f"{numa}\n")
        (bus_devices / address).symlink_to(os.path.relpath(fn, bus_devices))
        if numa >= 0:
            nodes.add(numa)
    for n in nodes:
        first = n * CPUS_PER_NODE
        node_dir = sys_root / "devices" / "system" / "node" / f"node{n}"
        node_dir.mkdir(parents=True, exist_ok=True)
        (node_dir / "cpulist").write_text(f"{first}-{first + CPUS_PER_NODE - 1}\n")
        for cpu in range(first, first + CPUS_PER_NODE):
            topo = sys_root / "devices" / "system" / "cpu" / f"cpu{cpu}" / "topology"
            topo.mkdir(parents=True, exist_ok=True)
            (topo / "physical_package_id").write_text(f"{n}\n")


def root_port(doc: dict[str, Any], sys_root: Path, index: int) -> str:
    """The root port make_sys_tree put GPU `index` under."""
    address = doc["gpus"][index]["pci_bus_id"].lower()
    return Path(os.path.realpath(sys_root / "bus" / "pci" / "devices" / address)).parent.name


@dataclass
class FakeNvml:
    """One test's fake node: the library to load, its topology file and a sysfs root."""

    library: Path
    config: Path
    sys_root: Path
    doc: dict[str, Any]

    def write(self) -> None:
        """Save `doc` (after a test changed it); the library sees it at the next init or reload()."""
        tmp = self.config.with_name(self.config.name + ".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1))
        os.replace(tmp, self.config)

    def _lib(self) -> ctypes.CDLL:
        # dlopen of the same path returns the handle pynvml holds, so this sees the same state.
        return ctypes.CDLL(str(self.library))

    def reload(self) -> None:
        """Make an initialised library re-read the file (a GPU's health changed under a running reporter)."""
        rc = self._lib().fakeNvmlReload()
        if rc != 0:
            raise RuntimeError(f"fake NVML reload of {self.config} failed with NVML code {rc}")

    def call_count(self) -> int:
        """NVML calls made so far by the whole process, to show that a cache answered alone."""
        fn = self._lib().fakeNvmlCallCount
        fn.restype = ctypes.c_ulong
        return int(fn())
