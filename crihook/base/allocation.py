"""The device-allocation annotations: names, model, strict parsing and canonical formatting.

The scheduler writes them and the node hooks read them, so both sides go through this module.
`scheduling.koordinator.sh/device-allocated` is Koordinator's JSON, kept compatible both ways;
`gpu.crihook.io/container-devices` is ours and says which allocated minors each container gets.
Parsing is strict: anything off fails with an AnnotationError that names the field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from crihook.base import quantity
from crihook.base.errors import InputError

DEVICE_ALLOCATED = "scheduling.koordinator.sh/device-allocated"
CONTAINER_DEVICES = "gpu.crihook.io/container-devices"

NVIDIA_GPU = "nvidia.com/gpu"
KOORD_GPU = "koordinator.sh/gpu"
GPU_CORE = "koordinator.sh/gpu-core"
GPU_MEMORY = "koordinator.sh/gpu-memory"
GPU_MEMORY_RATIO = "koordinator.sh/gpu-memory-ratio"
GPU_SHARED = "koordinator.sh/gpu.shared"
RDMA = "koordinator.sh/rdma"

GPU = "gpu"  # device types, as keys of the annotation
RDMA_TYPE = "rdma"
# A label of a GPU entry of the Device resource (Koordinator's DeviceInfo.labels), "enabled" on a GPU
# in MIG mode: the reporter writes it, the extender reads it to say why the GPU can not be given
MIG_MODE_LABEL = "gpu.crihook.io/mig-mode"
MIG_ENABLED = "enabled"

MAX_DEVICES = 1024  # per type in one annotation; more is not a real allocation
MAX_ANNOTATION_BYTES = 256 * 1024  # the API server caps all annotations of an object at 256 KiB
# domain:bus:device.function, as sysfs names PCI devices; nothing else may reach a sysfs path
PCI_ADDRESS = re.compile(r"[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]", re.ASCII)


class AnnotationError(InputError):
    """A malformed allocation annotation."""

    def __init__(self, annotation: str, where: str, reason: str) -> None:
        self.annotation = annotation
        super().__init__(f"annotation {annotation}", where, reason)


@dataclass(frozen=True, slots=True)
class DeviceAllocation:
    """One device given to the pod. `resources` are integers: core and ratio in percent of a
    device, memory in bytes, rdma in percent."""

    minor: int
    id: str = ""
    resources: Mapping[str, int] = field(default_factory=dict)
    vfs: tuple[str, ...] = ()  # VF PCI addresses (RDMA), from extension.vfs[].busID
    extension: Mapping[str, Any] = field(default_factory=dict)  # kept verbatim for re-encode


DeviceAllocations = Mapping[str, tuple[DeviceAllocation, ...]]  # device type -> allocations


def _int(value: Any, ann: str, where: str, lo: int = 0, hi: int = 2**31 - 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise AnnotationError(ann, where, f"expected an integer, got {json.dumps(value)[:40]}")
    if not lo <= value <= hi:
        raise AnnotationError(ann, where, f"{str(value)[:24]} is out of range {lo}..{hi}")
    return value


def _load(text: str | bytes, ann: str) -> Any:
    if len(text) > MAX_ANNOTATION_BYTES:
        raise AnnotationError(ann, "", f"{len(text)} bytes is larger than any annotation can be")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise AnnotationError(ann, "", f"not valid JSON ({e})") from None


def parse_device_allocated(
    text: str | bytes, types: Collection[str] | None = None
) -> dict[str, tuple[DeviceAllocation, ...]]:
    """The allocations by device type. `types` limits which types are read and checked, so a hook
    is not failed by a malformed entry of a type it does not handle."""
    ann = DEVICE_ALLOCATED
    doc = _load(text, ann)
    if not isinstance(doc, dict):
        raise AnnotationError(ann, "", f"expected a JSON object of device types, got {type(doc).__name__}")
    out: dict[str, tuple[DeviceAllocation, ...]] = {}
    for dtype, entries in doc.items():
        if entries is None or (types is not None and dtype not in types):
            continue
        where = field_path(dtype)  # a type named "" or "a.b" still names one place
        if not isinstance(entries, list):
            raise AnnotationError(ann, where, "expected a list of allocations")
        if len(entries) > MAX_DEVICES:
            raise AnnotationError(ann, where, f"{len(entries)} allocations is more than {MAX_DEVICES}")
        allocs = tuple(_allocation(e, dtype, f"{where}[{i}]") for i, e in enumerate(entries))
        if dtype == GPU and len({a.minor for a in allocs}) != len(allocs):
            raise AnnotationError(ann, where, "the same minor is allocated twice")
        out[dtype] = allocs
    return out


def _allocation(e: Any, dtype: str, where: str) -> DeviceAllocation:
    ann = DEVICE_ALLOCATED
    if not isinstance(e, dict):
        raise AnnotationError(ann, where, "expected an object")
    if "minor" not in e:
        raise AnnotationError(ann, f"{where}.minor", "missing")
    minor = _int(e["minor"], ann, f"{where}.minor")
    dev_id = e.get("id", "")
    if not isinstance(dev_id, str):
        raise AnnotationError(ann, f"{where}.id", "expected a string")
    if dtype == RDMA_TYPE and dev_id and not PCI_ADDRESS.fullmatch(dev_id):
        raise AnnotationError(ann, f"{where}.id", f"{dev_id[:40]!r} is not a PCI address")
    res_in = _object(e.get("resources"), f"{where}.resources")
    resources = {}
    for rname, rvalue in res_in.items():
        try:
            v = quantity.to_int(rvalue)
        except quantity.QuantityError as err:
            raise AnnotationError(ann, f"{where}.resources[{rname!r}]", str(err)) from None
        if v < 0:
            raise AnnotationError(ann, f"{where}.resources[{rname!r}]", f"negative quantity {rvalue!r}")
        resources[rname] = v
    ext = _object(e.get("extension"), f"{where}.extension")
    vfs_in = ext.get("vfs")
    if vfs_in is None:
        vfs_in = []
    elif not isinstance(vfs_in, list) or len(vfs_in) > MAX_DEVICES:
        raise AnnotationError(ann, f"{where}.extension.vfs", "expected a list")
    vfs = []
    for j, vf in enumerate(vfs_in):
        at = f"{where}.extension.vfs[{j}]"
        if not isinstance(vf, dict):
            raise AnnotationError(ann, at, "expected an object")
        if "busID" not in vf:
            raise AnnotationError(ann, f"{at}.busID", "missing")
        bus = vf["busID"]
        if not isinstance(bus, str) or not PCI_ADDRESS.fullmatch(bus):
            raise AnnotationError(ann, f"{at}.busID", "expected a PCI address")
        vfs.append(bus)
    return DeviceAllocation(minor, dev_id, resources, tuple(vfs), ext)


def _object(value: Any, where: str) -> dict[str, Any]:
    """A JSON object that may be absent or null (Go writes a nil map as null)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise AnnotationError(DEVICE_ALLOCATED, where, "expected an object")
    return value


def format_device_allocated(allocs: DeviceAllocations) -> str:
    """Koordinator's JSON: memory as a canonical byte quantity, percentages as plain numbers in
    strings, as Go's resource.Quantity marshals them."""
    doc: dict[str, list[dict[str, Any]]] = {}
    for dtype, entries in allocs.items():
        out = []
        for a in entries:
            item: dict[str, Any] = {"minor": a.minor}
            if a.resources:
                item["resources"] = {
                    k: quantity.format_bytes(v) if k == GPU_MEMORY else str(v) for k, v in sorted(a.resources.items())
                }
            if a.id:
                item["id"] = a.id
            ext = dict(a.extension)
            # `vfs` is authoritative; the extension's own list is kept (with any VF minors) when it agrees.
            if tuple(_vf_buses(ext.get("vfs"))) != a.vfs:
                ext.pop("vfs", None)
                if a.vfs:
                    ext["vfs"] = [{"busID": b} for b in a.vfs]
            if ext:
                item["extension"] = ext
            out.append(item)
        doc[dtype] = out
    return json.dumps(doc, separators=(",", ":"))


def _vf_buses(vfs: Any) -> list[Any]:
    return [vf.get("busID") if isinstance(vf, dict) else None for vf in vfs] if isinstance(vfs, list) else []


_PLAIN_KEY = re.compile(r"[A-Za-z0-9_-]+\Z")


def field_path(*keys: str) -> str:
    """Where in a JSON object: `trainer.gpu` for plain keys, `['a.b'].gpu` for others, so a key
    holding dots or brackets still names one place."""
    out = ""
    for key in keys:
        if _PLAIN_KEY.match(key):
            out += f".{key}" if out else key
        else:
            out += f"[{key!r}]"
    return out


def parse_container_devices(text: str | bytes) -> dict[str, dict[str, tuple[int, ...]]]:
    """{"<container>": {"gpu": [minor, ...], "rdma": [...]}} -> same, validated."""
    ann = CONTAINER_DEVICES
    doc = _load(text, ann)
    if not isinstance(doc, dict):
        raise AnnotationError(ann, "", "expected a JSON object of container names")
    out: dict[str, dict[str, tuple[int, ...]]] = {}
    for cname, per_type in doc.items():
        if not isinstance(per_type, dict):
            raise AnnotationError(ann, field_path(cname), "expected an object of device types")
        types: dict[str, tuple[int, ...]] = {}
        for dtype, minors in per_type.items():
            where = field_path(cname, dtype)
            if not isinstance(minors, list) or len(minors) > MAX_DEVICES:
                raise AnnotationError(ann, where, "expected a list of minors")
            listed = tuple(_int(m, ann, f"{where}[{i}]") for i, m in enumerate(minors))
            if len(set(listed)) != len(listed):
                raise AnnotationError(ann, where, "the same minor is listed twice")
            types[dtype] = listed
        out[cname] = types
    return out


def format_container_devices(assignment: Mapping[str, Mapping[str, tuple[int, ...] | list[int]]]) -> str:
    return json.dumps(
        {c: {t: list(m) for t, m in sorted(types.items())} for c, types in sorted(assignment.items())},
        separators=(",", ":"),
    )


@dataclass(frozen=True, slots=True)
class PodDevices:
    """One device type's part of a pod's annotations, parsed once for all of its containers."""

    dtype: str
    allocs: tuple[DeviceAllocation, ...]  # empty: the scheduler gave the pod none of this type
    # the container-devices annotation, when the pod has one: container -> type -> minors
    per_container: Mapping[str, Mapping[str, tuple[int, ...]]] | None = None
    # for_container's answers: the same tuple for every call, which callers may key on (the gpu hook)
    _split: dict[str, tuple[DeviceAllocation, ...]] = field(default_factory=dict, compare=False, repr=False)

    def for_container(self, container: str) -> tuple[DeviceAllocation, ...] | None:
        """See allocated_to. Raises AnnotationError for a minor the pod was not given."""
        if not self.allocs:
            return None
        if self.per_container is None:
            return self.allocs
        split = self._split.get(container)
        if split is not None:
            return split
        wanted = self.per_container.get(container, {}).get(self.dtype, ())
        allocated = {a.minor for a in self.allocs}
        for i, minor in enumerate(wanted):
            if minor not in allocated:
                raise AnnotationError(
                    CONTAINER_DEVICES,
                    f"{field_path(container, self.dtype)}[{i}]",
                    f"minor {minor} is not among the pod's allocated {self.dtype} minors {sorted(allocated)}",
                )
        split = self._split[container] = tuple(a for a in self.allocs if a.minor in wanted)
        return split


def pod_devices(annotations: Mapping[str, str], dtype: str) -> PodDevices:
    """The pod's `dtype` allocation and how it is split among containers. Raises AnnotationError."""
    text = annotations.get(DEVICE_ALLOCATED)
    if text is None:
        return PodDevices(dtype, ())
    allocs = parse_device_allocated(text, (dtype,)).get(dtype, ())
    per_container = annotations.get(CONTAINER_DEVICES)
    if not allocs or per_container is None:
        return PodDevices(dtype, allocs)
    return PodDevices(dtype, allocs, parse_container_devices(per_container))


def allocated_to(annotations: Mapping[str, str], container: str, dtype: str) -> tuple[DeviceAllocation, ...] | None:
    """The `dtype` devices the scheduler gave to one container of a pod, or None when it gave the
    pod none of that type (then the scheduler has no say over the pod's containers).

    With the per-container annotation a container gets exactly the minors listed for it; without
    it every container gets all of the pod's devices, as Koordinator does. Raises AnnotationError.
    """
    return pod_devices(annotations, dtype).for_container(container)
