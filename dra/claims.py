"""A prepared claim of crihook's DRA driver, as a pure function of the claim and the node's GPUs.

From the ResourceClaim the API server holds (JSON, as `resource.k8s.io/v1` writes it) this takes the
allocation results of this driver on this node's pool, checks the claim is the one kubelet named (its
UID: a claim deleted and made again under the same name is another claim), resolves each device to a
GPU and its share (`consumedCapacity` of cores and memory, whole when absent), and builds the claim's
CDI spec from hooks.grant, the module that decides what a container gets for its GPUs whichever path
gave them. No I/O here: dra/driver.py fetches, writes and answers.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
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
from crihook.hooks.reach import DeviceNode

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
    # the claims (UIDs, this one among them) whose GPUs the containers using this claim hold, numbered
    # together in its spec; () for this claim alone
    group: tuple[str, ...] = ()

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


def resolve(claim: Mapping[str, Any], uid: str, node: str, gpus: GpuLookup, taken: Collection[int] = ()) -> Prepared:
    """The claim's devices on this node, with their shares; no spec yet (`with_spec`). `taken`: the
    minors crihook's allocator gave pods of this node (kube-scheduler may have allocated one before
    the slices left it out). Raises ClaimError."""
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
        if minor in taken:
            raise ClaimError(
                f"{where}.device {device}: GPU minor {minor} is a pod's on this node through crihook's scheduler"
                " (device-allocated annotation); the claim must be allocated again"
            )
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
    return Prepared(uid, namespace, name, tuple(by_device.values()))


def with_spec(
    prepared: Prepared,
    group: Sequence[Prepared],
    gpus: GpuLookup,
    exists: Callable[[str], bool],
    dev_root: str,
    hami: HamiCore,
) -> Prepared:
    """The claim with its CDI spec, numbered with the claims of `group` (this one among them; empty:
    alone). Raises ClaimError."""
    if not prepared.devices:
        return prepared
    members = tuple(group) or (prepared,)
    spec = cdi_spec(prepared, members, gpus, exists, dev_root, hami)
    uids = tuple(sorted(p.uid for p in members)) if len(members) > 1 else ()
    return Prepared(prepared.uid, prepared.namespace, prepared.name, prepared.devices, spec, uids)


def cdi_spec(
    prepared: Prepared,
    group: Sequence[Prepared],
    gpus: GpuLookup,
    exists: Callable[[str], bool],
    dev_root: str,
    hami: HamiCore,
) -> dict[str, Any]:
    """The claim's CDI spec: a device per GPU of the claim (`<claim UID>-<device>`, its device node)
    and common edits for the GPUs of every claim of `group` (this one among them), the claims a
    container using this one holds: control nodes, NVIDIA_VISIBLE_DEVICES, and where one is a share,
    HAMi-core's limits numbered in CUDA's order over all of them, its library and a cache. Every
    spec of the group sets the same values, so a container holding them all gets no conflicting
    ones, whichever spec the runtime applies last. Raises ClaimError."""
    what = f"claim {prepared.namespace}/{prepared.name}"
    shares = []
    for p in group:
        for d in p.devices:
            g = gpus.by_minor(d.minor)
            if g is None:
                raise ClaimError(f"{what}: GPU minor {d.minor} is gone from this node")
            shares.append(Share(g, d.memory, d.cores))
    ordered = cuda_order(shares)
    own = [s.gpu for s in ordered if s.gpu.minor in {d.minor for d in prepared.devices}]
    try:
        nodes = device_nodes(own, exists, dev_root)
    except MissingDeviceNode as e:
        raise ClaimError(f"{what}: {e}") from None
    gpu_nodes, control = nodes[: len(own)], nodes[len(own) :]
    node_of = {g.minor: n for g, n in zip(own, gpu_nodes, strict=True)}
    env = {VISIBLE: visible(s.gpu for s in ordered)}
    mounts = []
    if any(s.shared for s in ordered):
        env |= hami_env(ordered)
        mounts = hami_mounts(hami, f"dra-{min(p.uid for p in group)}")
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
            for d in sorted(prepared.devices, key=lambda d: d.device)
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


def pod_groups(pod: Mapping[str, Any], claims: Mapping[str, str]) -> tuple[dict[str, tuple[str, ...]], list[str]]:
    """Which of `claims` (claim name -> UID, those of one pod prepared together) each claim's
    containers hold with it, from the pod (JSON): a claim's UID -> the UIDs its containers hold
    (itself among them), and the problems. A claim whose containers hold different sets of them can
    not be numbered for all: it stays alone, and the problem says so."""
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    generated = {s.get("name"): s.get("resourceClaimName") for s in status.get("resourceClaimStatuses") or ()}
    actual = {
        c.get("name"): c.get("resourceClaimName") or generated.get(c.get("name"))
        for c in spec.get("resourceClaims") or ()
    }
    seen: dict[str, set[tuple[str, ...]]] = {}
    for c in [*(spec.get("initContainers") or ()), *(spec.get("containers") or ())]:
        names = {actual.get(r.get("name")) for r in (c.get("resources") or {}).get("claims") or ()}
        held = tuple(sorted(claims[n] for n in names if isinstance(n, str) and n in claims))
        for uid in held:
            seen.setdefault(uid, set()).add(held)
    groups: dict[str, tuple[str, ...]] = {}
    problems = []
    for name, uid in claims.items():
        sets = seen.get(uid, set())
        if len(sets) == 1:
            groups[uid] = next(iter(sets))
        else:
            groups[uid] = (uid,)
            if len(sets) > 1:
                problems.append(f"claim {name}: its containers hold it with different claims; numbered alone")
    return groups, problems


def numbered(spec: Mapping[str, Any], number: Callable[[str], DeviceNode | None]) -> dict[str, Any]:
    """The spec with each device node's type and numbers, where `number(host path)` knows them: the
    runtime then makes the node from them and never looks for the host path, which is this
    plugin's view of the node's /dev (its pod's mount), not necessarily the runtime's."""

    def node(n: Mapping[str, Any]) -> dict[str, Any]:
        found = number(str(n.get("hostPath") or n.get("path", "")))
        extra = {} if found is None else {"type": found.kind, "major": found.major, "minor": found.minor}
        return {**n, **extra}

    def edits(e: Mapping[str, Any]) -> dict[str, Any]:
        return {**e, "deviceNodes": [node(n) for n in e["deviceNodes"]]} if e.get("deviceNodes") else dict(e)

    out = dict(spec)
    out["devices"] = [{**d, "containerEdits": edits(d.get("containerEdits") or {})} for d in spec.get("devices") or ()]
    out["containerEdits"] = edits(spec.get("containerEdits") or {})
    return out
