"""Who uses which GPU, and how much, against what the scheduler granted: pure logic, no I/O.

NVML lists the processes on each GPU (or MIG device) with the memory each holds and, where the driver
samples it, each one's SM utilisation. A process is mapped to its container through its cgroup (the
text of /proc/<pid>/cgroup): containerd puts a CRI container in a cgroup named after the container id,
`<parent>/<id>` with the cgroupfs driver, the unit `cri-containerd-<id>.scope` under the pod's slice
with the systemd driver (its cgroupsPath `<slice>:cri-containerd:<id>`), on cgroup v1 and v2 alike.
The container leads to its pod, namespace and grant through crihook's store; a process in no
container is the host's, one in a container crihook does not know is an unknown container's, and
one that ended before its cgroup was read has exited: none of them is dropped.

A GPU can also come through a DRA claim: kubelet's DRA checkpoint names the claims each pod holds
and the CDI devices prepared for them (devices/draclaims.py). A device named `<claim UID>-gpu-<minor>`
(crihook's driver, and NVIDIA's) is that GPU; the use of it is shown against the claim, by
namespace/name and the request the device serves. The claim's share (its allocation's
`consumedCapacity`, or the whole GPU) is its grant where crihook's driver recorded it in its
checkpoint (devices/drashares.py); another driver's claim has no core or memory figure.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from crihook.base import allocation as alloc
from crihook.base import dra
from crihook.devices.draclaims import Claim
from crihook.devices.drashares import ClaimShare

CONTAINER = "container"
HOST = "host"  # a process in no container
UNKNOWN = "unknown_container"  # in a container cgroup, of a container the store does not hold
EXITED = "exited"  # NVML listed it, but it was gone before its cgroup could be read
OWNER_KINDS = (CONTAINER, HOST, UNKNOWN, EXITED)

# containerd, CRI-O and Docker name containers by 64 hex digits
_CONTAINER_ID = re.compile(r"[0-9a-f]{64}\Z")
# the systemd units runtimes make for a container: <prefix>-<id>.scope
_SCOPE_PREFIXES = ("cri-containerd-", "crio-", "docker-", "containerd-", "libpod-")
# CRI-O's monitor process sits in a scope of its own beside the container's: it is not the container
_NOT_CONTAINER_SCOPES = ("crio-conmon-",)


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """One process NVML listed on one device."""

    pid: int
    gpu: str  # UUID of the physical GPU
    device: str  # UUID of the device it was listed on: the GPU's own, or a MIG device's
    used_memory: int = 0  # bytes; 0 when NVML could not say
    sm_util: float | None = None  # percent of the device's SMs; None: the driver gave no sample


@dataclass(frozen=True, slots=True)
class GpuState:
    """One GPU as a usage collection saw it."""

    uuid: str
    minor: int
    memory_total: int  # bytes
    memory_used: int  # bytes, all processes and the driver's own
    index: int = -1  # NVML's (PCI order), as dcgm-exporter's gpu label; -1: not known (a state file)


@dataclass(frozen=True, slots=True)
class Grant:
    """What the scheduler gave one container on one GPU."""

    gpu: str  # UUID
    core: int  # percent of the GPU's SMs; 0 for a claim whose share is not known here
    memory: int  # bytes; 0 when not known
    claim: str = ""  # namespace/name[/request] of the DRA claim that brought the GPU; "" for the scheduler's

    @property
    def sized(self) -> bool:
        """The grant's core and memory are known: the scheduler's always, a claim's from its share."""
        return not self.claim or self.core > 0


@dataclass(frozen=True, slots=True)
class KnownContainer:
    """A container as crihook's store has it."""

    id: str
    namespace: str
    pod: str
    name: str
    grants: tuple[Grant, ...] = ()


@dataclass(frozen=True, slots=True, order=True)
class Owner:
    """Whose a process is: a container the store knows, or one of the other OWNER_KINDS."""

    kind: str
    namespace: str = ""
    pod: str = ""
    container: str = ""
    container_id: str = ""


@dataclass(frozen=True, slots=True)
class Usage:
    """One owner's processes on one device, beside its grant on that GPU."""

    owner: Owner
    gpu: str
    device: str
    used_memory: int = 0
    sm_util: float | None = None
    pids: tuple[int, ...] = ()
    granted_core: int | None = None  # None: no grant on this GPU (or a claim's share not known here)
    granted_memory: int | None = None
    claim: str = ""  # namespace/name of the DRA claim the GPU came through

    @property
    def over_grant(self) -> bool:
        """Holds more memory than granted (a grant of unknown size is never exceeded)."""
        return bool(self.granted_memory) and self.used_memory > (self.granted_memory or 0)


# -- cgroups --------------------------------------------------------------------------------------


def cgroup_paths(text: str) -> tuple[str, ...]:
    """The paths of a /proc/<pid>/cgroup, the most telling first: the unified hierarchy's (cgroup v2,
    `0::<path>`), then the memory controller's, then the others (cgroup v1, `<n>:<controllers>:<path>`)."""
    ranked: list[tuple[int, str]] = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3 or not parts[2].startswith("/"):
            continue
        hierarchy, controllers, path = parts
        rank = 0 if hierarchy == "0" and not controllers else 1 if "memory" in controllers.split(",") else 2
        ranked.append((rank, path))
    seen: dict[str, None] = {}
    for _, path in sorted(ranked, key=lambda r: r[0]):
        seen.setdefault(path, None)
    return tuple(seen)


def _candidates(segment: str) -> Iterable[str]:
    """The container ids a cgroup path segment may name."""
    if segment.endswith(".scope"):
        unit = segment[: -len(".scope")]
        if unit.startswith(_NOT_CONTAINER_SCOPES):
            return
        for prefix in _SCOPE_PREFIXES:
            if unit.startswith(prefix):
                yield unit[len(prefix) :]
        return
    yield segment


def container_in(paths: Sequence[str], known: Container[str]) -> tuple[str, bool] | None:
    """The container whose cgroup holds a process with these cgroup paths, and whether the store
    knows it; None for a process in no container. The deepest segment naming a container wins, so a
    process in a cgroup nested inside a container's (an init sub-cgroup, a cgroup namespace's view)
    is still that container's."""
    unknown: str | None = None
    for path in paths:
        for segment in reversed(path.split("/")):
            for cid in _candidates(segment):
                if cid in known:
                    return cid, True
                if unknown is None and _CONTAINER_ID.match(cid):
                    unknown = cid
    return (unknown, False) if unknown is not None else None


def expand_slice(slice_name: str) -> str:
    """A systemd slice's cgroup directory: `a-b-c.slice` is /a.slice/a-b.slice/a-b-c.slice, as
    systemd (and runc for containerd's systemd driver) lays slices out; `-.slice` is the root."""
    if slice_name in ("", "-.slice"):
        return ""
    name = slice_name.removesuffix(".slice")
    parts = name.split("-")
    return "".join("/" + "-".join(parts[: i + 1]) + ".slice" for i in range(len(parts)))


def cgroup_dir(cgroups_path: str) -> str:
    """The cgroup directory of a container from the cgroupsPath containerd gives runc (OCI spec
    `linux.cgroupsPath`): `<slice>:<prefix>:<id>` with the systemd driver, a path with cgroupfs."""
    parts = cgroups_path.split(":")
    if len(parts) == 3 and not cgroups_path.startswith("/"):
        slice_name, prefix, name = parts
        return f"{expand_slice(slice_name)}/{prefix}-{name}.scope"
    return cgroups_path


# -- grants ---------------------------------------------------------------------------------------


def grants_of(annotations: Mapping[str, str], container: str, gpus: Mapping[int, tuple[str, int]]) -> tuple[Grant, ...]:
    """One container's GPU grants from its pod's allocation annotation; `gpus`: minor -> (UUID,
    memory in bytes) of the node's GPUs. A grant without core or memory figures is a whole GPU.
    Raises AnnotationError for an annotation that can not be read."""
    given = alloc.allocated_to(annotations, container, alloc.GPU)
    grants = []
    for a in given or ():
        uuid, total = gpus.get(a.minor, ("", 0))
        uuid = a.id or uuid
        if not uuid:
            continue  # a minor this node does not have: the gpu hook refused the container
        core = a.resources.get(alloc.GPU_CORE, 100)
        memory = a.resources.get(alloc.GPU_MEMORY)
        if memory is None:
            memory = total * a.resources.get(alloc.GPU_MEMORY_RATIO, 100) // 100
        grants.append(Grant(uuid, core, memory))
    return tuple(grants)


def claim_minor(claim_uid: str, cdi_device: str) -> int | None:
    """The GPU minor a claim's CDI device stands for: its name is `<claim UID>-gpu-<minor>` with
    crihook's driver and NVIDIA's; None for any other device."""
    name = cdi_device.partition("=")[2]
    prefix = f"{claim_uid}-"
    return dra.device_minor(name[len(prefix) :]) if claim_uid and name.startswith(prefix) else None


def claim_grants(
    claims: Iterable[Claim],
    gpus: Mapping[int, tuple[str, int]],
    shares: Mapping[str, Mapping[int, ClaimShare]] | None = None,
) -> tuple[Grant, ...]:
    """The GPUs of this node a pod's DRA claims brought, each named after its claim and the
    request it serves (`namespace/name/request`), with the claim's share of it where `shares` (claim
    UID -> minor -> share) has it; `gpus`: minor -> (UUID, memory in bytes)."""
    out = []
    for c in claims:
        held = (shares or {}).get(c.uid, {})
        for device in c.cdi_devices:
            minor = claim_minor(c.uid, device)
            if minor is not None and minor in gpus:
                name = "/".join((c.namespace, c.name, ",".join(c.requests_of(device)))).rstrip("/")
                share = held.get(minor)
                core, memory = (share.cores, share.memory) if share is not None else (0, 0)
                out.append(Grant(gpus[minor][0], core, memory, name))
    return tuple(dict.fromkeys(out))


# -- attribution ----------------------------------------------------------------------------------


def sm_by_pid(samples: Iterable[tuple[int, int]]) -> dict[int, float]:
    """The mean SM utilisation of each process over its samples (pid, percent)."""
    sums: dict[int, list[int]] = {}
    for pid, sm in samples:
        if pid <= 0:
            continue  # an unfilled entry of the driver's buffer
        s = sums.setdefault(pid, [0, 0])
        s[0] += sm
        s[1] += 1
    return {pid: total / n for pid, (total, n) in sums.items()}


def owner_of(cgroup: str | None, containers: Mapping[str, KnownContainer]) -> Owner:
    """Whose the process with this /proc/<pid>/cgroup text is; None: it exited before it was read."""
    if cgroup is None:
        return Owner(EXITED)
    found = container_in(cgroup_paths(cgroup), containers)
    if found is None:
        return Owner(HOST)
    cid, known = found
    if not known:
        return Owner(UNKNOWN, container_id=cid)
    c = containers[cid]
    return Owner(CONTAINER, c.namespace, c.pod, c.name, c.id)


def _merge(processes: Iterable[GpuProcess]) -> dict[tuple[int, str], GpuProcess]:
    """One entry per process and device: a process with both a compute and a graphics context is
    listed twice by NVML with the same memory, which counts once."""
    merged: dict[tuple[int, str], GpuProcess] = {}
    for p in processes:
        key = (p.pid, p.device)
        seen = merged.get(key)
        if seen is None:
            merged[key] = p
            continue
        sm = seen.sm_util if p.sm_util is None else p.sm_util if seen.sm_util is None else max(seen.sm_util, p.sm_util)
        merged[key] = GpuProcess(p.pid, p.gpu, p.device, max(seen.used_memory, p.used_memory), sm)
    return merged


@dataclass(slots=True)
class _Row:
    used: int = 0
    sm: float | None = None
    pids: list[int] = field(default_factory=list)


def attribute(
    processes: Iterable[GpuProcess],
    cgroups: Mapping[int, str | None],
    containers: Mapping[str, KnownContainer],
) -> tuple[Usage, ...]:
    """Each owner's use of each device, with the grant beside it: one Usage per (owner, device) with
    processes, plus one with nothing used for every grant whose container runs nothing on that GPU.
    `cgroups`: pid -> /proc/<pid>/cgroup text, None (or absent) for a process that has exited.
    Utilisation adds up over an owner's processes, capped at 100 %."""
    rows: dict[tuple[Owner, str, str], _Row] = {}
    owners: dict[int, Owner] = {}
    for (pid, device), p in sorted(_merge(processes).items()):
        owner = owners.get(pid)
        if owner is None:
            owner = owners[pid] = owner_of(cgroups.get(pid), containers)
        row = rows.setdefault((owner, p.gpu, device), _Row())
        row.used += p.used_memory
        if p.sm_util is not None:
            row.sm = min(100.0, (row.sm or 0.0) + p.sm_util)
        row.pids.append(pid)
    grants = {(c.id, g.gpu): g for c in containers.values() for g in c.grants}
    out = []
    for (owner, gpu, device), row in rows.items():
        # a grant is on a whole GPU: a MIG device's row is never the grant's
        g = grants.pop((owner.container_id, device), None) if owner.kind == CONTAINER else None
        out.append(_usage(owner, gpu, device, row, g))
    for (cid, gpu), g in grants.items():
        c = containers[cid]
        out.append(_usage(Owner(CONTAINER, c.namespace, c.pod, c.name, c.id), gpu, gpu, _Row(), g))
    return tuple(sorted(out, key=lambda u: (u.owner, u.gpu, u.device)))


def _usage(owner: Owner, gpu: str, device: str, row: _Row, grant: Grant | None) -> Usage:
    return Usage(
        owner,
        gpu,
        device,
        row.used,
        row.sm,
        tuple(sorted(row.pids)),
        grant.core if grant and grant.sized else None,
        grant.memory if grant and grant.sized else None,
        grant.claim if grant else "",
    )


def newly_over(
    before: frozenset[tuple[str, str]], rows: Iterable[Usage]
) -> tuple[frozenset[tuple[str, str]], list[Usage]]:
    """The (container id, device) pairs over their memory grant now, and the rows that went over
    since `before` (each episode is told once, however long it lasts)."""
    now = {(u.owner.container_id, u.device): u for u in rows if u.over_grant}
    return frozenset(now), [u for k, u in now.items() if k not in before]


# -- the state file `crihook top` reads -----------------------------------------------------------

STATE_FILE = "usage.json"
FORMAT_VERSION = 1


def encode(
    gpus: Iterable[GpuState], rows: Iterable[Usage], taken_at: float, interval: float, reason: str = ""
) -> dict[str, Any]:
    """The collection as `crihook top` reads it from the state dir."""
    return {
        "version": FORMAT_VERSION,
        "taken_at": taken_at,
        "interval_seconds": interval,
        "reason": reason,
        "gpus": [
            {"uuid": g.uuid, "minor": g.minor, "memory_total": g.memory_total, "memory_used": g.memory_used}
            for g in gpus
        ],
        "rows": [
            {
                "kind": u.owner.kind,
                "namespace": u.owner.namespace,
                "pod": u.owner.pod,
                "container": u.owner.container,
                "container_id": u.owner.container_id,
                "gpu": u.gpu,
                "device": u.device,
                "used_memory": u.used_memory,
                "sm_util": u.sm_util,
                "pids": list(u.pids),
                "granted_core": u.granted_core,
                "granted_memory": u.granted_memory,
                "claim": u.claim,
            }
            for u in rows
        ],
    }


class StateError(ValueError):
    """The usage state file is not what crihook writes."""


def _typed(row: Mapping[str, Any], key: str, check: Callable[[Any], bool]) -> Any:
    value = row.get(key)
    if not check(value):
        raise StateError(f"row field {key!r} is {value!r}")
    return value


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _is_number_or_none(v: Any) -> bool:
    return v is None or _is_number(v)


@dataclass(frozen=True, slots=True)
class State:
    """A usage state file as read back."""

    taken_at: float
    interval: float
    reason: str
    gpus: tuple[GpuState, ...]
    rows: tuple[Usage, ...]


def decode(doc: Any) -> State:
    """A state file's contents; raises StateError for one crihook did not write."""
    if not isinstance(doc, dict) or doc.get("version") != FORMAT_VERSION:
        raise StateError(f"not a version {FORMAT_VERSION} usage file")
    for key in ("rows", "gpus"):
        if not isinstance(doc.get(key), list):
            raise StateError(f"{key!r} is not a list")
    gpus = []
    for raw in doc["gpus"]:
        if not isinstance(raw, dict):
            raise StateError(f"GPU {raw!r} is not an object")
        uuid = _typed(raw, "uuid", lambda v: isinstance(v, str))
        gpus.append(GpuState(uuid, *(_typed(raw, k, _is_int) for k in ("minor", "memory_total", "memory_used"))))
    rows = []
    for raw in doc["rows"]:
        if not isinstance(raw, dict):
            raise StateError(f"row {raw!r} is not an object")
        text = {
            k: _typed(raw, k, lambda v: isinstance(v, str))
            for k in ("namespace", "pod", "container", "container_id", "gpu", "device")
        }
        kind = _typed(raw, "kind", lambda v: v in OWNER_KINDS)
        pids = _typed(raw, "pids", lambda v: isinstance(v, list) and all(map(_is_int, v)))
        core = _typed(raw, "granted_core", lambda v: v is None or _is_int(v))
        memory = _typed(raw, "granted_memory", lambda v: v is None or _is_int(v))
        claim = raw.get("claim", "")  # absent in files of versions before claims were shown
        if not isinstance(claim, str):
            raise StateError(f"'claim' of row {raw!r} is not a string")
        rows.append(
            Usage(
                Owner(kind, text["namespace"], text["pod"], text["container"], text["container_id"]),
                text["gpu"],
                text["device"],
                _typed(raw, "used_memory", _is_int),
                _typed(raw, "sm_util", _is_number_or_none),
                tuple(pids),
                core,
                memory,
                claim,
            )
        )
    return State(
        _typed(doc, "taken_at", _is_number),
        _typed(doc, "interval_seconds", _is_number),
        _typed(doc, "reason", lambda v: isinstance(v, str)),
        tuple(gpus),
        tuple(rows),
    )


# -- one row per container, as `crihook top` shows it ---------------------------------------------


@dataclass(frozen=True, slots=True)
class ContainerTotals:
    """One owner's use over all its devices: what a row of `crihook top` says."""

    owner: Owner
    devices: tuple[Usage, ...]  # by device, in the order of the node's GPUs
    used_memory: int
    granted_core: int | None  # summed over its GPUs: 200 is two whole GPUs; None: no grant
    granted_memory: int | None
    sm_util: float | None  # mean over the devices the driver sampled
    over_grant: bool
    claims: tuple[str, ...] = ()  # the DRA claims its GPUs came through


def per_container(state: State) -> tuple[ContainerTotals, ...]:
    """The state's rows grouped by owner: containers by namespace, pod and name, then the host's,
    unknown containers' and exited processes' use."""
    order = {g.uuid: i for i, g in enumerate(state.gpus)}
    groups: dict[Owner, list[Usage]] = {}
    for u in state.rows:
        groups.setdefault(u.owner, []).append(u)
    out = []
    for owner, rows in groups.items():
        rows.sort(key=lambda u: (order.get(u.gpu, len(order)), u.device))
        cores = [u.granted_core for u in rows if u.granted_core is not None]
        memories = [u.granted_memory for u in rows if u.granted_memory is not None]
        sms = [u.sm_util for u in rows if u.sm_util is not None]
        out.append(
            ContainerTotals(
                owner,
                tuple(rows),
                sum(u.used_memory for u in rows),
                sum(cores) if cores else None,
                sum(memories) if memories else None,
                sum(sms) / len(sms) if sms else None,
                any(u.over_grant for u in rows),
                tuple(dict.fromkeys(u.claim for u in rows if u.claim)),
            )
        )
    kinds = {k: i for i, k in enumerate(OWNER_KINDS)}
    return tuple(sorted(out, key=lambda t: (kinds[t.owner.kind], t.owner)))
