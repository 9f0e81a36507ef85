"""GPUs that allocated ResourceClaims hold, whatever their driver, matched to the Device objects' GPUs.

A claim's allocation names each device as (driver, pool, device) (`status.allocation.devices.results`
of `resource.k8s.io/v1`); what that device is lives in the ResourceSlice that published it, as
attributes. The GPU drivers publish the GPU's UUID as `uuid` (NVIDIA's `gpu.nvidia.com`, HAMi's
`hami-core-gpu.project-hami.io`, crihook's `gpu.crihook.io`), a MIG device its parent's as
`parentUUID`, and the PCI bus id as `pcieBusID` (NVIDIA, HAMi), `pciBusID` or the standard
`resource.kubernetes.io/pciBusID`. An attribute name without a domain is in the driver's own
(`uuid` and `gpu.nvidia.com/uuid` are one attribute). A device matches a GPU of a Device object by
UUID, else by PCI bus id on the slice's node; such a GPU is the claim's, so the annotation path
never hands it out (a GPU is held by one path at a time).

Only the newest generation of a pool counts (older slices are being replaced); results with
`adminAccess` hold nothing. Everything here is pure: `ClaimIndex` takes objects as the watches
deliver them and answers which minors of each node are held, and which nodes changed; `held_on`
answers the same for one node from objects read from the API server at a bind (`claim_refs` names
the claims the node's pods use), so the watches' view and the bind's re-check match GPUs one way.

A claim not yet allocated is also read for what it asks (`claim_ask`): that many GPUs of a GPU
DeviceClass, whole or a share of `cores` and `memory`, so the extender scores the nodes for a pod
with claims as it scores one asking the same through the annotation path (`dra_request`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from crihook.base import dra, quantity
from crihook.devices.sysfs import pci_address
from crihook.scheduler.devices import Gpu
from crihook.scheduler.request import PodRequest

UUID_ATTRS = (dra.ATTR_UUID, "parentUUID")
# the DeviceClasses whose requests are GPUs: crihook's (the chart's, and its extended-resource class)
# and NVIDIA's driver's
GPU_CLASSES = (dra.DEVICE_CLASS, f"extended.{dra.DEVICE_CLASS}", "gpu.nvidia.com")
BUS_ATTRS = ("pcieBusID", dra.ATTR_PCI_BUS_ID, "resource.kubernetes.io/pciBusID")

DeviceKey = tuple[str, str, str]  # driver, pool, device
Place = tuple[str, int]  # node, GPU minor


def normal_bus(text: str) -> str:
    """A PCI address in the sysfs spelling (`0000:1b:00.0`, as the Device object has it) from NVML's
    (`00000000:1B:00.0`) or sysfs'; "" for anything else."""
    try:
        return pci_address(text)
    except ValueError:
        return ""


@dataclass(frozen=True, slots=True)
class DeviceIds:
    """What identifies a published device as a GPU: its slice's node ("" for a slice not bound to
    one node), the UUIDs it names (lower case) and its PCI bus id (sysfs spelling)."""

    node: str
    uuids: tuple[str, ...] = ()
    bus: str = ""


def _attr(attrs: Mapping[str, Any], driver: str, name: str) -> str:
    """A string attribute under its name or qualified with the driver's domain; "" if absent."""
    for key in (name, f"{driver}/{name}") if "/" not in name else (name,):
        value = attrs.get(key)
        if isinstance(value, Mapping) and isinstance(value.get("string"), str):
            return str(value["string"])
    return ""


def device_ids(node: str, driver: str, device: Mapping[str, Any]) -> DeviceIds:
    """The ids of one slice device (v1 has the fields on the device, v1beta1 under `basic`)."""
    body = device.get("basic") if isinstance(device.get("basic"), Mapping) else device
    attrs = body.get("attributes") if isinstance(body, Mapping) else None
    if not isinstance(attrs, Mapping):
        return DeviceIds(node)
    uuids = tuple(u.lower() for u in (_attr(attrs, driver, a) for a in UUID_ATTRS) if u)
    bus = next((b for b in (normal_bus(_attr(attrs, driver, a)) for a in BUS_ATTRS) if b), "")
    return DeviceIds(node, uuids, bus)


@dataclass(frozen=True, slots=True)
class Slice:
    driver: str
    pool: str
    generation: int
    devices: Mapping[str, DeviceIds]  # device name -> ids


def parse_slice(obj: Mapping[str, Any]) -> Slice | None:
    """A ResourceSlice's devices; None when it names no driver or pool (nothing can refer to it)."""
    spec = obj.get("spec")
    if not isinstance(spec, Mapping):
        return None
    driver, pool = spec.get("driver"), spec.get("pool")
    if not isinstance(driver, str) or not driver or not isinstance(pool, Mapping):
        return None
    name, generation = pool.get("name"), pool.get("generation", 0)
    if not isinstance(name, str) or not name:
        return None
    if isinstance(generation, bool) or not isinstance(generation, int):
        generation = 0
    node = spec.get("nodeName") if isinstance(spec.get("nodeName"), str) else ""
    devices: dict[str, DeviceIds] = {}
    for d in spec.get("devices") or ():
        if isinstance(d, Mapping) and isinstance(d.get("name"), str):
            devices[d["name"]] = device_ids(str(node), driver, d)
    return Slice(driver, name, generation, devices)


def claim_devices(obj: Mapping[str, Any]) -> tuple[DeviceKey, ...]:
    """The devices an allocated claim holds: its results without admin access."""
    status = obj.get("status")
    alloc = status.get("allocation") if isinstance(status, Mapping) else None
    devices = alloc.get("devices") if isinstance(alloc, Mapping) else None
    results = devices.get("results") if isinstance(devices, Mapping) else None
    out: list[DeviceKey] = []
    for r in results if isinstance(results, list) else ():
        if not isinstance(r, Mapping) or r.get("adminAccess") is True:
            continue
        key = (r.get("driver"), r.get("pool"), r.get("device"))
        if all(isinstance(k, str) and k for k in key):
            out.append((str(key[0]), str(key[1]), str(key[2])))
    return tuple(out)


def claim_key(obj: Mapping[str, Any]) -> str:
    """A claim's identity in the index: its uid, else namespace/name."""
    return str(_field(obj, "metadata").get("uid") or namespaced(obj))


def claim_refs(pod: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(namespace, name) of the ResourceClaims a pod uses: named in `spec.resourceClaims`, made from a
    template (`status.resourceClaimStatuses`), or made by kube-scheduler for its extended resources
    (`status.extendedResourceClaimStatus`, KEP-5004)."""
    spec, status = _field(pod, "spec"), _field(pod, "status")
    entries = [*(spec.get("resourceClaims") or ()), *(status.get("resourceClaimStatuses") or ())]
    entries.append(_field(status, "extendedResourceClaimStatus"))
    namespace = str(_field(pod, "metadata").get("namespace") or "")
    names = {e["resourceClaimName"] for e in entries if isinstance(e, Mapping) and e.get("resourceClaimName")}
    return sorted((namespace, str(n)) for n in names)


@dataclass(frozen=True, slots=True)
class ClaimAsk:
    """What a claim asks of GPU DeviceClasses: `count` GPUs, each whole (cores 100, memory 0) or a
    share of `cores` percent and `memory` bytes (0: all of it)."""

    count: int
    cores: int = 100
    memory: int = 0


def _ask(request: Mapping[str, Any]) -> ClaimAsk | None:
    """One request's GPUs: `exactly`, or the first choice of `firstAvailable` (the one the allocator
    tries first); None for another class, `All`, or what does not parse."""
    first = request.get("firstAvailable")
    body = request.get("exactly") if "exactly" in request else (first[0] if isinstance(first, list) and first else None)
    if not isinstance(body, Mapping) or body.get("deviceClassName") not in GPU_CLASSES:
        return None
    count = body.get("count", 1)
    if body.get("allocationMode", "ExactCount") != "ExactCount" or not isinstance(count, int) or count < 1:
        return None
    wanted = _field(_field(body, "capacity"), "requests")
    try:
        cores = int(quantity.parse(wanted[dra.CAPACITY_CORES])) if dra.CAPACITY_CORES in wanted else 100
        memory = int(quantity.parse(wanted[dra.CAPACITY_MEMORY])) if dra.CAPACITY_MEMORY in wanted else 0
    except (quantity.QuantityError, ValueError, TypeError):
        return None
    return ClaimAsk(count, min(max(cores, 1), 100), max(memory, 0))


def _merge(asks: Sequence[ClaimAsk]) -> ClaimAsk:
    """Several asks as one: their GPUs summed, whole if any is, else the largest share asked."""
    count = sum(a.count for a in asks)
    if any(a.cores == 100 and not a.memory for a in asks):
        return ClaimAsk(count)
    return ClaimAsk(count, max(a.cores for a in asks), max(a.memory for a in asks))


def claim_ask(obj: Mapping[str, Any]) -> ClaimAsk | None:
    """The GPUs a claim asks for over its requests, or None when it asks for none."""
    requests = _field(_field(obj, "spec"), "devices").get("requests") or ()
    asks = [a for r in requests if isinstance(r, Mapping) and (a := _ask(r)) is not None]
    return _merge(asks) if asks else None


def dra_request(req: PodRequest, asks: Sequence[ClaimAsk]) -> PodRequest:
    """The annotation path's request for a pod whose claims ask `asks`: the same GPUs, so the
    allocator scores nodes for it as for a pod asking them by annotation. Its host requests stay."""
    if not asks:
        return req
    a = _merge(asks)
    return replace(req, count=a.count, core=a.cores, ratio=0 if a.memory else 100, memory=a.memory)


def held_on(
    node: str, gpus: Sequence[Gpu], slices: Iterable[Mapping[str, Any]], claims: Iterable[Mapping[str, Any]]
) -> dict[int, list[str]]:
    """The minors of `node` these claims hold, each with its holders (`namespace/name`)."""
    index = ClaimIndex()
    index.set_gpus(node, gpus)
    index.replace_slices((str((s.get("metadata") or {}).get("name") or ""), s) for s in slices)
    index.replace_claims((namespaced(c), c) for c in claims)
    return {minor: index.holders(node, minor) for minor in sorted(index.held(node))}


def _field(obj: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = obj.get(key)
    return value if isinstance(value, Mapping) else {}


def namespaced(obj: Mapping[str, Any]) -> str:
    meta = _field(obj, "metadata")
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


class ClaimIndex:
    """Nodes' GPUs, slices and claims in; the minors each node's claims hold out. Every mutation
    returns the nodes whose held minors changed."""

    def __init__(self) -> None:
        self.gpus: dict[str, tuple[Gpu, ...]] = {}
        self.slices: dict[str, Slice] = {}
        self.claims: dict[str, tuple[DeviceKey, ...]] = {}
        self._by_uuid: dict[str, Place] = {}
        self._by_bus: dict[tuple[str, str], int] = {}
        self._devices: dict[DeviceKey, DeviceIds] = {}
        self._where: dict[str, frozenset[Place]] = {}  # claim -> the GPUs it holds
        self._held: dict[str, dict[int, int]] = {}  # node -> minor -> claims holding it

    def held(self, node: str) -> frozenset[int]:
        return frozenset(self._held.get(node, ()))

    def holders(self, node: str, minor: int) -> list[str]:
        """The claims that hold one GPU (for messages and tests)."""
        return sorted(c for c, where in self._where.items() if (node, minor) in where)

    # --- inputs ---

    def set_gpus(self, node: str, gpus: Sequence[Gpu]) -> set[str]:
        if self.gpus.get(node) == tuple(gpus):
            return set()
        self.gpus[node] = tuple(gpus)
        return self._reindex()

    def remove_node(self, node: str) -> set[str]:
        if self.gpus.pop(node, None) is None:
            return set()
        return self._reindex()

    def set_slice(self, name: str, obj: Mapping[str, Any]) -> set[str]:
        parsed = parse_slice(obj)
        if parsed is None:
            return self.remove_slice(name)
        if self.slices.get(name) == parsed:
            return set()
        self.slices[name] = parsed
        return self._relocate()

    def remove_slice(self, name: str) -> set[str]:
        if self.slices.pop(name, None) is None:
            return set()
        return self._relocate()

    def replace_slices(self, items: Iterable[tuple[str, Mapping[str, Any]]]) -> set[str]:
        self.slices = {n: s for n, s in ((n, parse_slice(o)) for n, o in items) if s is not None}
        return self._relocate()

    def set_claim(self, key: str, obj: Mapping[str, Any]) -> set[str]:
        devices = claim_devices(obj)
        if not devices:
            return self.remove_claim(key)
        self.claims[key] = devices
        return self._place(key, self._locate(devices))

    def remove_claim(self, key: str) -> set[str]:
        self.claims.pop(key, None)
        return self._place(key, frozenset())

    def replace_claims(self, items: Iterable[tuple[str, Mapping[str, Any]]]) -> set[str]:
        fresh = {k: d for k, d in ((k, claim_devices(o)) for k, o in items) if d}
        before = self._snapshot()
        for key in set(self.claims) - set(fresh):
            self.remove_claim(key)
        self.claims.update(fresh)
        for key, devices in fresh.items():
            self._place(key, self._locate(devices))
        return self._changed_since(before)

    # --- internals ---

    def _locate(self, devices: Iterable[DeviceKey]) -> frozenset[Place]:
        out: set[Place] = set()
        for key in devices:
            ids = self._devices.get(key)
            if ids is None:
                continue
            place = next((self._by_uuid[u] for u in ids.uuids if u in self._by_uuid), None)
            if place is None and ids.bus and ids.node:
                minor = self._by_bus.get((ids.node, ids.bus))
                place = None if minor is None else (ids.node, minor)
            if place is not None:
                out.add(place)
        return frozenset(out)

    def _place(self, key: str, where: frozenset[Place]) -> set[str]:
        old = self._where.pop(key, frozenset())
        if where:
            self._where[key] = where
        changed: set[str] = set()
        for node, minor in old - where:
            count = self._held[node]
            count[minor] -= 1
            if not count[minor]:
                del count[minor]
                changed.add(node)
        for node, minor in where - old:
            count = self._held.setdefault(node, {})
            count[minor] = count.get(minor, 0) + 1
            if count[minor] == 1:
                changed.add(node)
        return changed

    def _reindex(self) -> set[str]:
        self._by_uuid = {g.uuid.lower(): (n, g.minor) for n, gs in self.gpus.items() for g in gs if g.uuid}
        self._by_bus = {(n, g.bus): g.minor for n, gs in self.gpus.items() for g in gs if g.bus}
        return self._relocate()

    def _relocate(self) -> set[str]:
        newest: dict[tuple[str, str], int] = {}
        for s in self.slices.values():
            pool = (s.driver, s.pool)
            newest[pool] = max(newest.get(pool, s.generation), s.generation)
        self._devices = {
            (s.driver, s.pool, name): ids
            for s in self.slices.values()
            if s.generation == newest[(s.driver, s.pool)]
            for name, ids in s.devices.items()
        }
        before = self._snapshot()
        for key, devices in self.claims.items():
            self._place(key, self._locate(devices))
        return self._changed_since(before)

    def _snapshot(self) -> dict[str, frozenset[int]]:
        return {node: frozenset(count) for node, count in self._held.items()}

    def _changed_since(self, before: Mapping[str, frozenset[int]]) -> set[str]:
        nodes = set(before) | set(self._held)
        return {n for n in nodes if before.get(n, frozenset()) != frozenset(self._held.get(n, ()))}
