"""A prepared claim of crihook's DRA driver, as a pure function of the claim and the node's GPUs.

From the ResourceClaim the API server holds (JSON, as `resource.k8s.io/v1` writes it) this takes the
allocation results of this driver on this node's pool, checks the claim is the one kubelet named (its
UID: a claim deleted and made again under the same name is another claim), resolves each device to a
GPU and its share (`consumedCapacity` of cores and memory, whole when absent), and builds the claim's
CDI spec from hooks.grant, the module that decides what a container gets for its GPUs whichever path
gave them. No I/O here: dra/driver.py fetches, writes and answers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from crihook.base import dra, quantity
from crihook.base.spec import Mount
from crihook.hooks.gpu_edit import GpuLookup
from crihook.hooks.grant import (
    VISIBLE,
    HamiCore,
    MissingDeviceNode,
    Share,
    cuda_order,
    device_nodes,
    hami_dirs,
    hami_env,
    hami_mounts,
    visible,
)

CDI_VERSION = "0.6.0"  # what containerd 1.7.24 and 2.1 read; nothing newer is used


class ClaimError(Exception):
    """The claim can not be prepared; the message names the claim and the field."""


@dataclass(frozen=True, slots=True)
class PreparedDevice:
    """One device of a prepared claim: what kubelet is told, and the share behind it."""

    requests: tuple[str, ...]
    pool: str
    device: str
    minor: int
    uuid: str
    memory: int  # bytes the claim may use
    cores: int  # percent of the SMs
    share_id: str = ""


@dataclass(frozen=True, slots=True)
class Prepared:
    """A claim prepared on this node."""

    uid: str
    namespace: str
    name: str
    devices: tuple[PreparedDevice, ...] = ()
    spec: Mapping[str, Any] = field(default_factory=dict)  # the CDI spec; empty when no devices

    def cdi_ids(self, d: PreparedDevice) -> list[str]:
        return [dra.cdi_device(self.uid, d.device)]


def _share(value: Any, where: str) -> int:
    try:
        n = quantity.parse(value)
    except quantity.QuantityError as e:
        raise ClaimError(f"{where}: {e}") from None
    if n < 0 or n != int(n):
        raise ClaimError(f"{where}: {value!r} is not a whole non-negative amount")
    return int(n)


def results(claim: Mapping[str, Any], uid: str, node: str, what: str) -> list[Mapping[str, Any]]:
    """This driver's allocation results on this node's pool; raises ClaimError for a claim that is
    another than kubelet named or that is not allocated. `what`: namespace/name, for messages."""
    meta = claim.get("metadata") or {}
    if meta.get("uid") != uid:
        raise ClaimError(f"claim {what} has UID {meta.get('uid')!r}, not {uid!r}: it was deleted and made again")
    allocation = (claim.get("status") or {}).get("allocation")
    if not allocation:
        raise ClaimError(f"claim {what} is not allocated (status.allocation is empty)")
    found = ((allocation.get("devices") or {}).get("results")) or []
    pool = dra.pool_name(node)
    return [r for r in found if r.get("driver") == dra.DRIVER and r.get("pool") == pool]


def prepare(
    claim: Mapping[str, Any],
    uid: str,
    node: str,
    gpus: GpuLookup,
    exists: Callable[[str], bool],
    dev_root: str,
    hami: HamiCore,
) -> Prepared:
    """The claim prepared: its devices and CDI spec. Raises ClaimError."""
    meta = claim.get("metadata") or {}
    namespace, name = str(meta.get("namespace", "")), str(meta.get("name", ""))
    what = f"{namespace}/{name}"
    by_device: dict[str, PreparedDevice] = {}
    for i, r in enumerate(results(claim, uid, node, what)):
        where = f"claim {what} status.allocation.devices.results[{i}]"
        device = str(r.get("device", ""))
        minor = dra.device_minor(device)
        if minor is None:
            raise ClaimError(f"{where}.device {device!r} is no device of {dra.DRIVER}")
        g = gpus.by_minor(minor)
        if g is None:
            raise ClaimError(f"{where}.device {device}: no GPU minor {minor} on this node")
        consumed = r.get("consumedCapacity") or {}
        memory = _share(consumed.get(dra.CAPACITY_MEMORY, g.memory_total), f"{where}.consumedCapacity.memory")
        cores = _share(consumed.get(dra.CAPACITY_CORES, dra.FULL_CORES), f"{where}.consumedCapacity.cores")
        request = str(r.get("request", ""))
        held = by_device.get(device)
        if held is not None:  # one device for two requests of the claim (consumable capacity): the shares add up
            memory, cores = min(g.memory_total, held.memory + memory), min(dra.FULL_CORES, held.cores + cores)
            request_names = (*held.requests, request)
        else:
            request_names = (request,)
        share_id = str(r.get("shareID") or "")
        by_device[device] = PreparedDevice(
            request_names, dra.pool_name(node), device, g.minor, g.uuid, memory, cores, share_id
        )
    devices = tuple(by_device.values())
    prepared = Prepared(uid, namespace, name, devices)
    if not devices:
        return prepared
    return Prepared(uid, namespace, name, devices, cdi_spec(prepared, gpus, exists, dev_root, hami))


def cdi_spec(
    prepared: Prepared, gpus: GpuLookup, exists: Callable[[str], bool], dev_root: str, hami: HamiCore
) -> dict[str, Any]:
    """The claim's CDI spec: a device per GPU (`<claim UID>-<device>`, its device node) and the
    claim's common edits (control nodes, NVIDIA_VISIBLE_DEVICES, and for a share HAMi-core's limits
    numbered in CUDA's order, its library and a cache per claim). Raises ClaimError."""
    shares = []
    for d in prepared.devices:
        g = gpus.by_minor(d.minor)
        if g is None:
            raise ClaimError(f"claim {prepared.namespace}/{prepared.name}: GPU minor {d.minor} is gone from this node")
        shares.append((d, Share(g, d.memory, d.cores)))
    ordered = cuda_order(s for _, s in shares)
    try:
        nodes = device_nodes([s.gpu for s in ordered], exists, dev_root)
    except MissingDeviceNode as e:
        raise ClaimError(f"claim {prepared.namespace}/{prepared.name}: {e}") from None
    gpu_nodes, control = nodes[: len(ordered)], nodes[len(ordered) :]
    node_of = {s.gpu.minor: n for s, n in zip(ordered, gpu_nodes, strict=True)}
    env = {VISIBLE: visible(s.gpu for s in ordered)}
    mounts = []
    if any(s.shared for s in ordered):
        env |= hami_env(ordered)
        mounts = hami_mounts(hami, f"dra-{prepared.uid}")
    edits: dict[str, Any] = {
        "env": [f"{k}={v}" for k, v in env.items()],
        "deviceNodes": [_node(n) for n in control],
    }
    if mounts:
        edits["mounts"] = [
            {
                "hostPath": m.host_path,
                "containerPath": m.container_path,
                "options": ["ro", "nosuid", "nodev", "bind"] if m.readonly else ["rw", "nosuid", "nodev", "bind"],
            }
            for m in mounts
        ]
    return {
        "cdiVersion": CDI_VERSION,
        "kind": dra.CDI_KIND,
        "devices": [
            {
                "name": f"{prepared.uid}-{d.device}",
                "containerEdits": {"deviceNodes": [_node(node_of[d.minor])]},
            }
            for d, _ in sorted(shares, key=lambda pair: pair[0].device)
        ],
        "containerEdits": edits,
    }


def _node(n: Any) -> dict[str, str]:
    return {"path": n.container_path, "hostPath": n.host_path, "permissions": n.permissions}


def spec_dirs(spec: Mapping[str, Any]) -> list[str]:
    """The host directories of HAMi-core's cache and lock a claim's spec mounts: made by the driver,
    writable by every user, before a container can mount them (hooks.grant.hami_dirs)."""
    mounts = (spec.get("containerEdits") or {}).get("mounts") or ()
    return hami_dirs(Mount(m["containerPath"], m["hostPath"]) for m in mounts)
