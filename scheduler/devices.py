"""A node's devices as the allocator sees them, parsed from Koordinator's `Device` custom resource.

The Device object (`scheduling.koordinator.sh/v1alpha1`, name = node name) lists GPUs and RDMA NICs
with their capacity, health and PCIe placement. Two annotations on it add what the allocator needs
for multi-GPU choices: our pairwise link matrix `gpu.crihook.io/topology` and Koordinator's
partition table `scheduling.koordinator.sh/gpu-partitions`. Parsing is strict; errors name the
Device and the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from crihook.base import quantity
from crihook.base.allocation import (
    GPU,
    GPU_CORE,
    GPU_MEMORY,
    GPU_MEMORY_RATIO,
    MIG_ENABLED,
    MIG_MODE_LABEL,
    PCI_ADDRESS,
    RDMA,
    RDMA_TYPE,
)
from crihook.base.errors import InputError
from crihook.devices.sysfs import pci_address

TOPOLOGY = "gpu.crihook.io/topology"
PARTITIONS = "scheduling.koordinator.sh/gpu-partitions"
PARTITION_POLICY = "node.koordinator.sh/gpu-partition-policy"
GPU_MODEL = "node.koordinator.sh/gpu-model"
# GPUs held through the device plugin by pods the scheduler did not place (the node reporter's)
PLUGIN_HELD = "node.koordinator.sh/devices-checkpoints"

# PCIe common-ancestor levels, NVML's names (nvmlGpuTopologyLevel_t): smaller is closer.
PCIE_LEVELS = {"internal": 0, "single": 10, "multiple": 20, "hostbridge": 30, "node": 40, "system": 50}
WORST_PCIE = PCIE_LEVELS["system"]
_LEVEL_VALUES = frozenset(PCIE_LEVELS.values())
_LEVEL_TEXT = ", ".join(f"{v} {k}" for k, v in PCIE_LEVELS.items())
MAX_MINOR = 1 << 20  # /dev/nvidiaN minors are small; this only rejects garbage


class DeviceError(InputError):
    """A malformed Device object; names the Device and the field."""

    def __init__(self, device: str, where: str, reason: str) -> None:
        self.device = device
        super().__init__(f"Device {device or '<unnamed>'}", where, reason)


@dataclass(frozen=True, slots=True)
class Gpu:
    minor: int
    uuid: str = ""
    model: str = ""
    memory: int = 0  # bytes
    healthy: bool = True
    numa: int = -1
    pcie: str = ""  # PCIe switch id: GPUs and NICs sharing it can do GPUDirect RDMA
    mig: bool = False  # in MIG mode (never healthy): CUDA runs only in its MIG devices, the device plugin's
    bus: str = ""  # PCI bus id, sysfs spelling (0000:1b:00.0): how a DRA slice may name the GPU


@dataclass(frozen=True, slots=True)
class Nic:
    minor: int
    id: str  # PCI address of the physical function
    healthy: bool = True
    pcie: str = ""


@dataclass(frozen=True, slots=True)
class Partition:
    minors: frozenset[int]
    link_type: str = ""
    bandwidth: int = 0  # ringBusBandwidth in bytes per second, 0 when not given
    score: int = 0  # allocationScore: higher leaves the node in better shape


@dataclass(frozen=True, slots=True)
class Links:
    """Pairwise GPU interconnect, keyed by minor: NVLink lane count and PCIe common-ancestor level."""

    nvlink: Mapping[tuple[int, int], int] = field(default_factory=dict)
    pcie: Mapping[tuple[int, int], int] = field(default_factory=dict)

    def lanes(self, a: int, b: int) -> int:
        return self.nvlink.get((min(a, b), max(a, b)), 0)

    def level(self, a: int, b: int) -> int:
        return self.pcie.get((min(a, b), max(a, b)), WORST_PCIE)

    def __bool__(self) -> bool:
        return bool(self.nvlink or self.pcie)


@dataclass(frozen=True, slots=True)
class NodeDevices:
    name: str
    gpus: tuple[Gpu, ...] = ()
    nics: tuple[Nic, ...] = ()
    links: Links = field(default_factory=Links)
    partitions: Mapping[int, tuple[Partition, ...]] = field(default_factory=dict)  # size -> partitions
    partition_policy: str = ""  # "Honor", "Prefer" or "" (no table)
    labels: Mapping[str, str] = field(default_factory=dict)
    cpu_milli: int = 0  # allocatable host CPU and memory; 0 = not known, not checked
    memory: int = 0
    plugin_held: Mapping[str, frozenset[int]] = field(default_factory=dict)  # pod UID -> GPU minors


def _int(value: Any, dev: str, where: str, lo: int = 0, hi: int = 2**63 - 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise DeviceError(dev, where, f"expected an integer in {lo}..{hi}, got {json.dumps(value)[:40]}")
    return value


def _quantity(value: Any, dev: str, where: str) -> int:
    try:
        n = quantity.to_int(value)
    except quantity.QuantityError as e:
        raise DeviceError(dev, where, str(e)) from None
    if n < 0:
        raise DeviceError(dev, where, f"negative quantity {value!r}")
    return n


def _json(text: str, dev: str, where: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise DeviceError(dev, where, f"not valid JSON ({e})") from None


def node_from_device(
    device_obj: Mapping[str, Any],
    node_labels: Mapping[str, str] | None = None,
    allocatable: Mapping[str, Any] | None = None,
) -> NodeDevices:
    """NodeDevices from a Device object's JSON plus the Node's labels (model, partition policy) and,
    optionally, the Node's allocatable (host `cpu` and `memory`, for the fragmentation score)."""
    if not isinstance(device_obj, Mapping):
        raise DeviceError("", "", "expected a JSON object")
    meta = device_obj.get("metadata") or {}
    spec = device_obj.get("spec") or {}
    if not isinstance(meta, dict) or not isinstance(spec, dict):
        raise DeviceError("", "", "metadata and spec must be objects")
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise DeviceError("", "metadata.name", "missing")
    labels = {**(meta.get("labels") or {}), **(node_labels or {})}
    annotations = meta.get("annotations") or {}
    if not isinstance(annotations, dict):
        raise DeviceError(name, "metadata.annotations", "expected an object")
    model = labels.get(GPU_MODEL, "")
    entries = spec.get("devices") or []
    if not isinstance(entries, list):
        raise DeviceError(name, "spec.devices", "expected a list")
    gpus: dict[int, Gpu] = {}
    nics: dict[int, Nic] = {}
    for i, d in enumerate(entries):
        at = f"spec.devices[{i}]"
        if not isinstance(d, dict):
            raise DeviceError(name, at, "expected an object")
        dtype = d.get("type", d.get("deviceType"))
        if dtype not in (GPU, RDMA_TYPE):
            continue  # fpga and future types are not ours to allocate
        minor = _int(d.get("minor", 0), name, f"{at}.minor", hi=MAX_MINOR)
        dev_id = d.get("id", "")
        if not isinstance(dev_id, str):
            raise DeviceError(name, f"{at}.id", "expected a string")
        health = d.get("health", False)
        if not isinstance(health, bool):
            raise DeviceError(name, f"{at}.health", "expected true or false")
        res = d.get("resources") or d.get("resource") or {}
        if not isinstance(res, dict):
            raise DeviceError(name, f"{at}.resources", "expected an object")
        topo = d.get("topology") or {}
        if not isinstance(topo, dict):
            raise DeviceError(name, f"{at}.topology", "expected an object")
        pcie = str(topo.get("pcieID", "") or "")
        numa = topo.get("nodeID", -1)
        numa = numa if isinstance(numa, int) and not isinstance(numa, bool) else -1
        if dtype == GPU:
            if minor in gpus:
                raise DeviceError(name, f"{at}.minor", f"GPU minor {minor} is listed twice")
            mem = _quantity(res.get(GPU_MEMORY, 0), name, f"{at}.resources[{GPU_MEMORY!r}]")
            for key in (GPU_CORE, GPU_MEMORY_RATIO):
                if key in res and _quantity(res[key], name, f"{at}.resources[{key!r}]") != 100:
                    raise DeviceError(name, f"{at}.resources[{key!r}]", "a GPU reports 100")
            dev_labels = d.get("labels") or {}
            if not isinstance(dev_labels, dict):
                raise DeviceError(name, f"{at}.labels", "expected an object")
            mig = dev_labels.get(MIG_MODE_LABEL) == MIG_ENABLED
            bus = topo.get("busID", "") or ""
            if not isinstance(bus, str) or (bus and not PCI_ADDRESS.fullmatch(bus)):
                raise DeviceError(name, f"{at}.topology.busID", f"{str(bus)[:40]!r} is not a PCI address")
            healthy = health and mem > 0 and not mig
            gpus[minor] = Gpu(minor, dev_id, model, mem, healthy, numa, pcie, mig, pci_address(bus) if bus else "")
        else:
            if minor in nics:
                raise DeviceError(name, f"{at}.minor", f"RDMA minor {minor} is listed twice")
            if dev_id and not PCI_ADDRESS.fullmatch(dev_id):
                raise DeviceError(name, f"{at}.id", f"{dev_id[:40]!r} is not a PCI address")
            if RDMA in res and _quantity(res[RDMA], name, f"{at}.resources[{RDMA!r}]") != 100:
                raise DeviceError(name, f"{at}.resources[{RDMA!r}]", "a NIC reports 100")
            nics[minor] = Nic(minor, dev_id, health, pcie)
    links = Links()
    if TOPOLOGY in annotations:
        links = parse_topology(annotations[TOPOLOGY], name, set(gpus))
    partitions: dict[int, tuple[Partition, ...]] = {}
    policy = ""
    if PARTITIONS in annotations:
        partitions = parse_partitions(annotations[PARTITIONS], name, set(gpus))
        policy = labels.get(PARTITION_POLICY, "Honor")
        if policy not in ("Honor", "Prefer"):
            raise DeviceError(name, f"labels[{PARTITION_POLICY!r}]", f"{policy!r} is not Honor or Prefer")
    plugin_held = parse_plugin_held(annotations[PLUGIN_HELD], name, set(gpus)) if PLUGIN_HELD in annotations else {}
    cpu = mem_host = 0
    if allocatable:
        if "cpu" in allocatable:
            cpu = int(quantity.parse(allocatable["cpu"]) * 1000)
        if "memory" in allocatable:
            mem_host = _quantity(allocatable["memory"], name, "allocatable.memory")
    return NodeDevices(
        name=name,
        gpus=tuple(gpus[m] for m in sorted(gpus)),
        nics=tuple(nics[m] for m in sorted(nics)),
        links=links,
        partitions=partitions,
        partition_policy=policy,
        labels=dict(labels),
        cpu_milli=cpu,
        memory=mem_host,
        plugin_held=plugin_held,
    )


def parse_plugin_held(text: Any, dev: str, minors: set[int]) -> dict[str, frozenset[int]]:
    """The reporter's list of device-plugin holders, `[{"podUID": …, "minors": [3], …}]`, as pod UID
    -> the minors of this node it holds (ids it could not resolve to a minor are left out)."""
    where = f"metadata.annotations[{PLUGIN_HELD!r}]"
    try:
        doc = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        doc = None
    if not isinstance(doc, list):
        raise DeviceError(dev, where, "expected a JSON list")
    held: dict[str, frozenset[int]] = {}
    for i, entry in enumerate(doc):
        uid = entry.get("podUID") if isinstance(entry, dict) else None
        got = entry.get("minors", []) if isinstance(entry, dict) else None
        if not isinstance(uid, str) or not isinstance(got, list):
            raise DeviceError(dev, f"{where}[{i}]", "expected an object with podUID and a minors list")
        found = {_int(m, dev, f"{where}[{i}].minors", hi=MAX_MINOR) for m in got}
        held[uid] = held.get(uid, frozenset()) | frozenset(found & minors)
    return held


def parse_topology(text: str, dev: str, minors: set[int]) -> Links:
    """The reporter's link matrix (devices/report.py, docs/devices.md): `{"minors": [0, 1, …],
    "nvlinks": [[…]], "pcie": [[…]], …}`, square matrices in the order of `minors` with NVLink counts
    and NVML's PCIe common-ancestor levels (0 internal, 10 single switch, …, 50 system); the diagonal
    is ignored, as are keys the allocator does not use (nvlinkVersions, nvswitch)."""
    where = f"annotations[{TOPOLOGY!r}]"
    doc = _json(text, dev, where)
    if not isinstance(doc, dict):
        raise DeviceError(dev, where, "expected an object")
    order = doc.get("minors")
    if not isinstance(order, list) or len(set(map(str, order))) != len(order):
        raise DeviceError(dev, f"{where}.minors", "expected a list of distinct minors")
    order = [_int(m, dev, f"{where}.minors", hi=MAX_MINOR) for m in order]
    unknown = set(order) - minors
    if unknown:
        raise DeviceError(dev, f"{where}.minors", f"minors {sorted(unknown)} are not GPUs of this node")
    n = len(order)
    nvlink: dict[tuple[int, int], int] = {}
    pcie: dict[tuple[int, int], int] = {}
    for key, out in (("nvlinks", nvlink), ("pcie", pcie)):
        rows = doc.get(key)
        if rows is None:
            continue
        if not isinstance(rows, list) or len(rows) != n or not all(isinstance(r, list) and len(r) == n for r in rows):
            raise DeviceError(dev, f"{where}.{key}", f"expected a {n}x{n} matrix")
        for i in range(n):
            for j in range(i + 1, n):
                v = rows[i][j]
                if key == "nvlinks":
                    val = _int(v, dev, f"{where}.nvlinks[{i}][{j}]", hi=64)
                elif isinstance(v, int) and not isinstance(v, bool) and v in _LEVEL_VALUES:
                    val = v
                else:
                    raise DeviceError(
                        dev, f"{where}.pcie[{i}][{j}]", f"{v!r} is not an NVML topology level ({_LEVEL_TEXT})"
                    )
                a, b = order[i], order[j]
                out[(min(a, b), max(a, b))] = val
    return Links(nvlink, pcie)


def parse_partitions(text: str, dev: str, minors: set[int]) -> dict[int, tuple[Partition, ...]]:
    """Koordinator's GPUPartitionTable: `{"<size>": [{"minors": […], "gpuLinkType", "ringBusBandwidth",
    "allocationScore"}, …]}`."""
    where = f"annotations[{PARTITIONS!r}]"
    doc = _json(text, dev, where)
    if not isinstance(doc, dict):
        raise DeviceError(dev, where, "expected an object of partition sizes")
    table: dict[int, tuple[Partition, ...]] = {}
    for size_text, parts in doc.items():
        if not str(size_text).isdigit() or int(size_text) < 1:
            raise DeviceError(dev, f"{where}[{size_text!r}]", "partition sizes are positive integers")
        size = int(size_text)
        if not isinstance(parts, list):
            raise DeviceError(dev, f"{where}[{size_text!r}]", "expected a list of partitions")
        out = []
        for i, p in enumerate(parts):
            at = f"{where}[{size_text!r}][{i}]"
            if not isinstance(p, dict) or not isinstance(p.get("minors"), list):
                raise DeviceError(dev, at, "expected an object with a list of minors")
            ms = frozenset(_int(m, dev, f"{at}.minors", hi=MAX_MINOR) for m in p["minors"])
            if len(ms) != size or len(p["minors"]) != size:
                raise DeviceError(dev, f"{at}.minors", f"a partition of size {size} lists {size} distinct minors")
            if not ms <= minors:
                raise DeviceError(dev, f"{at}.minors", f"minors {sorted(ms - minors)} are not GPUs of this node")
            bw = p.get("ringBusBandwidth")
            bandwidth = 0 if bw is None else _quantity(bw, dev, f"{at}.ringBusBandwidth")
            score = p.get("allocationScore", 0)
            if isinstance(score, str) and score.lstrip("-").isdigit():
                score = int(score)
            score = _int(score, dev, f"{at}.allocationScore", lo=-(2**31), hi=2**31)
            out.append(Partition(ms, str(p.get("gpuLinkType", "") or ""), bandwidth, score))
        table[size] = tuple(out)
    return table
