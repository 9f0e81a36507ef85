"""The ResourceSlices of crihook's DRA driver, as a pure function of what discovery found.

One pool per node, named after it (`crihook.base.dra`), cut into slices within the API's limits;
one device per GPU with the attributes a claim selects and constrains by (UUID, model, minor, index,
driver version, CUDA compute capability, PCI bus id, NUMA node, PCIe root, and the id of the NVLink
partition of each size that holds it, so `matchAttribute: gpu.crihook.io/nvlinkPartition4` keeps
four GPUs in one partition). Capacities `cores` (percent of the SMs) and `memory` (bytes); where the
cluster serves consumable capacity (KEP-5075) a device takes several allocations, each consuming
what its request asks (whole by default), else every allocation is of a whole GPU.

Left out, with the reason: GPUs in MIG mode (their MIG devices are the device plugin's) and GPUs
crihook's own allocator gave out through the `device-allocated` annotation: a device the scheduler
can not see is one it can not allocate, whatever the cluster's feature gates (a taint is ignored
where DRADeviceTaints is off). Unhealthy GPUs stay listed with a NoSchedule taint where the cluster
serves device taints, else they are left out too.

`check` is the project's own validator of the limits the OpenAPI schemas do not state. No I/O here.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from crihook.base import allocation as al
from crihook.base import dra
from crihook.devices import partitions
from crihook.devices.nvml import GpuInfo, NodeGpus

API_VERSION = "resource.k8s.io/v1"
KIND = "ResourceSlice"
MAX_DEVICES = 128  # ResourceSliceMaxDevices
MAX_DEVICES_ADVANCED = 64  # ... when any device has taints, consumes counters or has list attributes
MAX_ATTRIBUTES_AND_CAPACITIES = 32  # per device
MAX_VALUE_LENGTH = 64  # a string or version attribute
MAX_TAINTS = 16  # per device
MAX_NAME_LENGTH = 253  # an object's name
MEMORY_STEP = 1 << 20  # the smallest memory share a request may ask for
UNHEALTHY_EFFECT = "NoSchedule"  # keeps new claims off; running pods stay (NoExecute would evict them)

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,31}")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_SEMVER = re.compile(
    r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[A-Za-z-][0-9A-Za-z-]*)(?:\.(?:0|[1-9]\d*|\d*[A-Za-z-][0-9A-Za-z-]*))*))?"
    r"(?:\+([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?"
)


@dataclass(frozen=True, slots=True)
class Features:
    """What the cluster's API serves, which decides how devices are described."""

    consumable_capacity: bool = False  # KEP-5075: allowMultipleAllocations, requestPolicy
    device_taints: bool = False  # KEP-5055: Device.taints


@dataclass(frozen=True)
class Pool:
    """The slices for one node, and what was left out of them and why (to log)."""

    slices: list[dict[str, Any]]
    left_out: list[tuple[str, str]] = field(default_factory=list)  # (device name, reason)
    problems: list[str] = field(default_factory=list)  # what was published differently from the facts


def semantic_version(text: str) -> str:
    """A driver or capability version as a semantic version: "535.129.03" -> "535.129.3",
    "9.0" -> "9.0.0"; "" when it has no leading numbers."""
    parts = re.findall(r"\d+", text.split("-")[0])[:3]
    if not parts:
        return ""
    return ".".join(str(int(p)) for p in [*parts, "0", "0"][:3])


def partition_ids(table: partitions.PartitionTable | None) -> tuple[dict[int, dict[str, str]], list[str]]:
    """minor -> {attribute: partition id} from a partition table, and the problems: a GPU in two
    partitions of one size keeps the first (one attribute holds one value)."""
    out: dict[int, dict[str, str]] = {}
    problems = []
    for size, parts in (table or {}).items():
        attr = dra.partition_attribute(int(size))
        for i, part in enumerate(parts):
            for minor in part["minors"]:
                held = out.setdefault(minor, {})
                if attr in held:
                    problems.append(f"GPU minor {minor} is in several partitions of {size}: kept {held[attr]}")
                    continue
                held[attr] = f"{size}-{i}"
    return out, problems


def device(
    g: GpuInfo, driver_version: str, partition: Mapping[str, str], features: Features
) -> tuple[dict[str, Any], list[str]]:
    """One GPU as a ResourceSlice device, and what of it could not be published."""
    problems: list[str] = []
    attrs: dict[str, dict[str, Any]] = {
        dra.ATTR_UUID: {"string": g.uuid},
        dra.ATTR_MODEL: {"string": g.name},
        dra.ATTR_MINOR: {"int": g.minor},
        dra.ATTR_INDEX: {"int": g.index},
        dra.ATTR_PCI_BUS_ID: {"string": g.pci_bus_id},
        dra.ATTR_NUMA_NODE: {"int": g.numa_node},
    }
    for attr, raw in ((dra.ATTR_DRIVER_VERSION, driver_version), (dra.ATTR_CUDA_CAPABILITY, g.cuda_capability)):
        version = semantic_version(raw)
        if version:
            attrs[attr] = {"version": version}
    if g.pcie_root_complex:
        attrs[dra.ATTR_PCIE_ROOT] = {"string": g.pcie_root_complex}
    for attr, part_id in sorted(partition.items(), key=lambda kv: int(kv[0].removeprefix(dra.ATTR_PARTITION_PREFIX))):
        if len(attrs) + 2 >= MAX_ATTRIBUTES_AND_CAPACITIES:  # 2: the capacities
            problems.append(f"{dra.device_name(g.minor)}: {attr} left out (at most 32 attributes and capacities)")
            continue
        attrs[attr] = {"string": part_id}
    for attr, typed in attrs.items():
        text = typed.get("string")
        if text is not None and len(text) > MAX_VALUE_LENGTH:
            typed["string"] = text[:MAX_VALUE_LENGTH]
            problems.append(f"{dra.device_name(g.minor)}: {attr} cut to {MAX_VALUE_LENGTH} characters")
    cores: dict[str, Any] = {"value": str(dra.FULL_CORES)}
    memory: dict[str, Any] = {"value": str(g.memory_total)}
    out: dict[str, Any] = {"name": dra.device_name(g.minor), "attributes": attrs}
    if features.consumable_capacity:
        full = str(dra.FULL_CORES)
        cores["requestPolicy"] = {"default": full, "validRange": {"min": "1", "max": full, "step": "1"}}
        low = min(MEMORY_STEP, g.memory_total)
        memory["requestPolicy"] = {"default": str(g.memory_total), "validRange": {"min": str(low)}}
        out["allowMultipleAllocations"] = True
    out["capacity"] = {dra.CAPACITY_CORES: cores, dra.CAPACITY_MEMORY: memory}
    if not g.healthy and features.device_taints:
        out["taints"] = [{"key": dra.TAINT_UNHEALTHY, "value": "true", "effect": UNHEALTHY_EFFECT}]
    return out, problems


def left_out_reason(g: GpuInfo, taken: Collection[int], features: Features) -> str:
    """Why a GPU gets no device in the slice; "" when it gets one."""
    if g.mig_enabled:
        return "in MIG mode: its MIG devices are the device plugin's"
    if g.minor in taken:
        return "given out by crihook's scheduler (device-allocated annotation)"
    if g.memory_total <= 0:
        return "its memory could not be read"
    if not g.healthy and not features.device_taints:
        return f"unhealthy ({g.health_reason}) and the cluster serves no device taints"
    return ""


def slice_name(node: str, index: int) -> str:
    """The name of the pool's slice `index`: stable, so a republish updates rather than recreates."""
    suffix = f"-{dra.DRIVER}-{index}"
    return f"{node[: MAX_NAME_LENGTH - len(suffix)]}{suffix}"


def build(
    node: str,
    node_uid: str,
    gpus: NodeGpus,
    table: partitions.PartitionTable | None,
    taken: Collection[int],
    features: Features,
    generation: int,
) -> Pool:
    """The pool's slices at `generation`. `taken`: minors crihook's allocator gave out; `node_uid`:
    the Node's, so the slices go when the node does ("" for none)."""
    ids, problems = partition_ids(table)
    devices: list[dict[str, Any]] = []
    left: list[tuple[str, str]] = []
    for g in sorted(gpus.gpus, key=lambda g: g.index):
        reason = left_out_reason(g, taken, features)
        if reason:
            left.append((dra.device_name(g.minor), reason))
            continue
        d, trouble = device(g, gpus.driver_version, ids.get(g.minor, {}), features)
        devices.append(d)
        problems += trouble
    per_slice = MAX_DEVICES_ADVANCED if any("taints" in d for d in devices) else MAX_DEVICES
    chunks = [devices[i : i + per_slice] for i in range(0, len(devices), per_slice)] or [[]]
    owner = [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid}] if node_uid else []
    slices = []
    for i, chunk in enumerate(chunks):
        meta: dict[str, Any] = {"name": slice_name(node, i)}
        if owner:
            meta["ownerReferences"] = owner
        spec = {
            "driver": dra.DRIVER,
            "nodeName": node,
            "pool": {"name": dra.pool_name(node), "generation": generation, "resourceSliceCount": len(chunks)},
            "devices": chunk,
        }
        slices.append({"apiVersion": API_VERSION, "kind": KIND, "metadata": meta, "spec": spec})
    return Pool(slices, left, problems)


def comparable(spec: Mapping[str, Any]) -> Any:
    """A slice's spec without what the API server adds or what moves on every publish (the pool's
    generation, a taint's timeAdded): equal for the same devices."""
    devices = []
    for d in spec.get("devices") or ():
        d = dict(d)
        if d.get("taints"):
            d["taints"] = [{k: v for k, v in t.items() if k != "timeAdded"} for t in d["taints"]]
        devices.append(d)
    pool = {k: v for k, v in (spec.get("pool") or {}).items() if k != "generation"}
    return {**spec, "pool": pool, "devices": devices}


def check(slice_: Mapping[str, Any]) -> list[str]:
    """The limits and formats of a ResourceSlice the API server enforces beyond its OpenAPI schema
    (k8s.io/api/resource/v1 and its validation), for the slices this driver writes: one problem per
    line, empty when the API server would take it."""
    out: list[str] = []
    name = slice_.get("metadata", {}).get("name", "")
    if not (0 < len(name) <= MAX_NAME_LENGTH and _DNS_SUBDOMAIN.fullmatch(name)):
        out.append(f"metadata.name {name!r}: not a DNS subdomain of at most {MAX_NAME_LENGTH} characters")
    spec = slice_.get("spec", {})
    driver = spec.get("driver", "")
    if not (len(driver) <= 63 and _DNS_SUBDOMAIN.fullmatch(driver)):
        out.append(f"spec.driver {driver!r}: not a DNS subdomain of at most 63 characters")
    pool = spec.get("pool", {})
    if not (0 < len(pool.get("name", "")) <= MAX_NAME_LENGTH):
        out.append("spec.pool.name: empty or too long")
    if not (pool.get("generation", -1) >= 0 and pool.get("resourceSliceCount", 0) > 0):
        out.append("spec.pool: generation must be >= 0 and resourceSliceCount > 0")
    devices: Sequence[Mapping[str, Any]] = spec.get("devices") or ()
    advanced = any(d.get("taints") or d.get("consumesCounters") for d in devices)
    limit = MAX_DEVICES_ADVANCED if advanced else MAX_DEVICES
    if len(devices) > limit:
        out.append(f"spec.devices: {len(devices)} devices, at most {limit}")
    names = [d.get("name", "") for d in devices]
    if len(set(names)) != len(names):
        out.append("spec.devices: device names repeat")
    for i, d in enumerate(devices):
        out += _check_device(d, f"spec.devices[{i}]")
    return out


def _check_device(d: Mapping[str, Any], where: str) -> list[str]:
    out = []
    if not _DNS_LABEL.fullmatch(d.get("name", "")) or len(d.get("name", "")) > 63:
        out.append(f"{where}.name {d.get('name')!r}: not a DNS label")
    attrs: Mapping[str, Mapping[str, Any]] = d.get("attributes") or {}
    capacity: Mapping[str, Mapping[str, Any]] = d.get("capacity") or {}
    if len(attrs) + len(capacity) > MAX_ATTRIBUTES_AND_CAPACITIES:
        out.append(f"{where}: {len(attrs) + len(capacity)} attributes and capacities, at most 32")
    for key, value in attrs.items():
        if not _qualified_name(key):
            out.append(f"{where}.attributes[{key!r}]: not an identifier or domain/identifier")
        if len(value) != 1:
            out.append(f"{where}.attributes[{key!r}]: exactly one of int, bool, string, version")
        text = value.get("string", value.get("version"))
        if isinstance(text, str) and len(text) > MAX_VALUE_LENGTH:
            out.append(f"{where}.attributes[{key!r}]: longer than {MAX_VALUE_LENGTH} characters")
        if "version" in value and not _SEMVER.fullmatch(value["version"]):
            out.append(f"{where}.attributes[{key!r}].version {value['version']!r}: not a semantic version")
    for key, value in capacity.items():
        if not _qualified_name(key):
            out.append(f"{where}.capacity[{key!r}]: not an identifier or domain/identifier")
        out += _check_policy(value, f"{where}.capacity[{key!r}]")
    if any("requestPolicy" in c for c in capacity.values()) and not d.get("allowMultipleAllocations"):
        out.append(f"{where}: a requestPolicy needs allowMultipleAllocations")
    taints = d.get("taints") or ()
    if len(taints) > MAX_TAINTS:
        out.append(f"{where}.taints: {len(taints)}, at most {MAX_TAINTS}")
    for j, t in enumerate(taints):
        if t.get("effect") not in ("NoSchedule", "NoExecute", "None"):
            out.append(f"{where}.taints[{j}].effect {t.get('effect')!r}: not NoSchedule, NoExecute or None")
    return out


def _check_policy(capacity: Mapping[str, Any], where: str) -> list[str]:
    """A capacity's request policy: the default within the range, on the step, and the range
    within the capacity (integers: the driver writes plain numbers)."""
    policy = capacity.get("requestPolicy")
    if policy is None:
        return []
    value = int(capacity["value"])
    default = int(policy.get("default", -1))
    rng = policy.get("validRange")
    if rng is None:
        return [] if 0 <= default <= value else [f"{where}.requestPolicy.default outside 0..value"]
    low, high = int(rng["min"]), int(rng.get("max", value))
    step = int(rng.get("step", 0))
    out = []
    if not (0 <= low <= default <= high <= value):
        out.append(f"{where}.requestPolicy: needs 0 <= min <= default <= max <= value")
    if step and ((default % step) or ("max" in rng and high % step) or low + step > value):
        out.append(f"{where}.requestPolicy.validRange.step: default and max must be multiples, min + step <= value")
    return out


def _qualified_name(key: str) -> bool:
    domain, sep, ident = key.rpartition("/")
    if not sep:
        return bool(_IDENTIFIER.fullmatch(key))
    return len(domain) <= 63 and bool(_DNS_SUBDOMAIN.fullmatch(domain)) and bool(_IDENTIFIER.fullmatch(ident))


def taken_minors(pods: Sequence[Mapping[str, Any]]) -> tuple[frozenset[int], list[str]]:
    """The GPU minors crihook's allocator gave the node's pods that may still run (JSON pods, as the
    API server lists them), and a problem per annotation that can not be read (its GPUs can not be
    told; the scheduler refuses such a pod's containers, so it holds none)."""
    taken: set[int] = set()
    problems = []
    for pod in pods:
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        meta = pod.get("metadata") or {}
        text = (meta.get("annotations") or {}).get(al.DEVICE_ALLOCATED)
        if text is None:
            continue
        try:
            gpus = al.parse_device_allocated(text, (al.GPU,)).get(al.GPU, ())
        except al.AnnotationError as e:
            problems.append(f"pod {meta.get('namespace')}/{meta.get('name')}: {e}")
            continue
        taken.update(a.minor for a in gpus)
    return frozenset(taken), problems


def dropped(sent: Mapping[str, Any], stored: Mapping[str, Any]) -> frozenset[str]:
    """The Features fields the API server does not serve, from a slice's spec as sent and as it was
    stored: a field of a feature gate that is off is dropped without an error."""
    kept = {d.get("name"): d for d in stored.get("devices") or ()}
    out = set()
    for d in sent.get("devices") or ():
        mine = kept.get(d.get("name"), {})
        if d.get("taints") and not mine.get("taints"):
            out.add("device_taints")
        if d.get("allowMultipleAllocations") and not mine.get("allowMultipleAllocations"):
            out.add("consumable_capacity")
    return frozenset(out)
