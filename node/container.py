"""Every conversion of a container: CRI's ContainerConfig (and a listed Container) and NRI's Container
to the hooks' ContainerInfo, an edited ContainerInfo written back into the config or turned into an
NRI ContainerAdjustment, and ContainerInfo <-> the store's ContainerRecord.

Only fields a hook changed are written back; every message a hook left alone is reused as decoded,
so unknown fields (a newer kubelet's) reach containerd intact. The fields ContainerInfo and
ContainerRecord share carry the same names, and are copied by that list (`_SHARED`), never one by one.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict, deque
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import fields
from typing import Any, TypeVar

from google.protobuf.internal.containers import RepeatedCompositeFieldContainer
from google.protobuf.message import Message

from crihook.base.spec import Device, Mount
from crihook.hooks.base import ContainerInfo
from crihook.hooks.cdi import ANNOTATION_PREFIX
from crihook.hooks.reach import GPU_MAJOR, VISIBLE, DeviceNode, DeviceRule, Reach
from crihook.node.records import ContainerRecord
from crihook.node.resources import (
    nri_resources_view,
    plain,
    resources_from_record,
    resources_record,
    resources_view,
    set_map,
    write_nri_resources,
    write_resources,
)
from crihook.node.status import container_created_with, runtime_spec
from crihook.node.update import changed_keys
from crihook.proto import nri_v1alpha1_pb2 as nri
from crihook.proto import runtime_v1_pb2 as cri

_V = TypeVar("_V")
_M = TypeVar("_M", bound=Message)
_SHARED = tuple(
    f.name
    for f in fields(ContainerInfo)
    if f.name in ContainerRecord.__dataclass_fields__ and f.name not in ("envs", "resources")
)
_STATES = {
    cri.CONTAINER_CREATED: "created",
    cri.CONTAINER_RUNNING: "running",
    cri.CONTAINER_EXITED: "exited",
    cri.CONTAINER_UNKNOWN: "unknown",
}


def _text(b: bytes) -> str:
    return b.decode("utf-8", "surrogateescape")


def _raw(s: str) -> bytes:
    return s.encode("utf-8", "surrogateescape")


# -- protobuf -> views ---------------------------------------------------------------------------


def container_view(cfg: cri.ContainerConfig, container_id: str = "") -> ContainerInfo:
    # most containers have no envs, mounts, devices or CDI devices of their own: an empty field
    # costs no generator
    meta, linux = cfg.metadata, cfg.linux
    envs, mounts, devices, cdi = cfg.envs, cfg.mounts, cfg.devices, cfg.CDI_devices
    return ContainerInfo(
        name=meta.name,
        attempt=meta.attempt,
        id=container_id,
        image=cfg.image.image,
        labels=plain(cfg.labels),
        annotations=plain(cfg.annotations),
        envs=tuple((_text(kv.key), _text(kv.value)) for kv in envs) if envs else (),
        mounts=tuple(Mount(m.container_path, m.host_path, m.readonly, m.selinux_relabel, m.propagation) for m in mounts)
        if mounts
        else (),
        devices=tuple(Device(d.container_path, d.host_path, d.permissions) for d in devices) if devices else (),
        cdi_devices=tuple(c.name for c in cdi) if cdi else (),
        resources=resources_view(linux.resources, linux.HasField("resources")),
    )


# -- views -> protobuf ---------------------------------------------------------------------------


def _rebuild(
    repeated: RepeatedCompositeFieldContainer[_M],
    before: Sequence[_V],
    after: Sequence[_V],
    make: Callable[[Callable[..., _M], _V], _M],
) -> None:
    """Set a repeated message field to `after`, reusing the decoded message of every item that did
    not change so its unknown fields survive. `make(new, view)` returns `new(**fields of view)`:
    `new` is `repeated.add`, which builds the item in place (half the cost of a message built and
    then copied in by `extend`)."""
    n = len(before)
    if tuple(after[:n]) == tuple(before):  # unchanged, or only added to (the common edit)
        for view in after[n:]:
            make(repeated.add, view)
        return
    originals: dict[_V, deque[_M]] = defaultdict(deque)
    for view, msg in zip(before, repeated, strict=True):
        originals[view].append(msg)
    copies: list[_M | None] = []
    for view in after:
        kept = originals.get(view)
        copy = None
        if kept:
            msg = kept.popleft()
            copy = type(msg)()
            copy.CopyFrom(msg)
        copies.append(copy)
    del repeated[:]
    for view, copy in zip(after, copies, strict=True):
        if copy is None:
            make(repeated.add, view)
        else:
            repeated.add().CopyFrom(copy)


def _new_env(new: Callable[..., cri.KeyValue], kv: tuple[str, str]) -> cri.KeyValue:
    return new(key=_raw(kv[0]), value=_raw(kv[1]))


def _new_mount(new: Callable[..., cri.Mount], m: Mount) -> cri.Mount:
    return new(
        container_path=m.container_path,
        host_path=m.host_path,
        readonly=m.readonly,
        selinux_relabel=m.selinux_relabel,
        propagation=m.propagation,
    )


def _new_device(new: Callable[..., cri.Device], d: Device) -> cri.Device:
    return new(container_path=d.container_path, host_path=d.host_path, permissions=d.permissions)


def _new_cdi(new: Callable[..., cri.CDIDevice], name: str) -> cri.CDIDevice:
    return new(name=name)


def write_container(cfg: cri.ContainerConfig, before: ContainerInfo, after: ContainerInfo) -> None:
    _rebuild(cfg.envs, before.envs, after.envs, _new_env)
    _rebuild(cfg.mounts, before.mounts, after.mounts, _new_mount)
    _rebuild(cfg.devices, before.devices, after.devices, _new_device)
    _rebuild(cfg.CDI_devices, before.cdi_devices, after.cdi_devices, _new_cdi)
    set_map(cfg.annotations, before.annotations, after.annotations)
    write_resources(cfg.linux.resources, before.resources, after.resources)


# -- views <-> records ---------------------------------------------------------------------------


def container_info(rec: ContainerRecord) -> ContainerInfo:
    """The container as hooks see it, for a call that names it only by id."""
    return ContainerInfo(
        **{name: getattr(rec, name) for name in _SHARED},
        envs=tuple(rec.envs.items()),
        resources=resources_from_record(rec.resources),
    )


def container_record(pod_id: str, c: ContainerInfo, hooks: list[dict[str, Any]]) -> ContainerRecord:
    """The store's record of a container as created (after its hooks)."""
    values: dict[str, Any] = {name: getattr(c, name) for name in _SHARED}
    for name in ("labels", "annotations"):
        values[name] = dict(values[name])
    return ContainerRecord(
        **values,
        pod_id=pod_id,
        hooks=hooks,
        created=time.time(),
        envs=dict(c.envs),
        resources=resources_record(c.resources),
    )


def listed_container(c: cri.Container, status: cri.ContainerStatusResponse | None) -> ContainerRecord:
    """The record of a container as ListContainers lists it, with the envs and resources its verbose
    status says it was created with when there is one."""
    envs, resources = ({}, {}) if status is None else container_created_with(status)
    return ContainerRecord(
        id=c.id,
        pod_id=c.pod_sandbox_id,
        name=c.metadata.name,
        attempt=c.metadata.attempt,
        state=_STATES.get(c.state, "unknown"),
        labels=plain(c.labels),
        annotations=plain(c.annotations),
        created=c.created_at / 1e9,
        envs=envs,
        resources=resources,
    )


def unknown_container(container_id: str) -> ContainerInfo:
    """The view of a container crihook has no record of: hooks still see its id."""
    return ContainerInfo(name="", id=container_id)


# -- NRI -------------------------------------------------------------------------------------------

RESTART_COUNT = "io.kubernetes.container.restartCount"  # kubelet's container annotation: the attempt
IMAGE_NAME = "io.kubernetes.cri.image-name"  # containerd's spec annotation, for runtimes before NRI v0.10
_NRI_STATES = {
    nri.CONTAINER_CREATED: "created",
    nri.CONTAINER_PAUSED: "running",
    nri.CONTAINER_RUNNING: "running",
    nri.CONTAINER_STOPPED: "exited",
}
# CRI's MountPropagation <-> the OCI mount option containerd's CRI writes for it
_PROPAGATION = {0: "rprivate", 1: "rslave", 2: "rshared"}
_PROPAGATION_OF = {opt: p for p, opt in _PROPAGATION.items()} | {"private": 0, "slave": 1, "shared": 2}
DeviceNumber = tuple[str, int, int]  # type ("c", "b"), major, minor


def _attempt(annotations: dict[str, str]) -> int:
    value = annotations.get(RESTART_COUNT, "0")
    return int(value) if value.isdigit() else 0


def nri_container_view(c: nri.Container) -> ContainerInfo:
    """The container as NRI shows it: the runtime's finished spec, so envs hold the image's too, and
    devices, mounts and env a CDI device or the device plugin brought are already in (docs/nri.md).
    NRI gives a device node's container path only: it stands for the host path too."""
    annotations = plain(c.annotations)
    linux = c.linux
    return ContainerInfo(
        name=c.name,
        attempt=_attempt(annotations),
        id=c.id,
        image=c.image.name or annotations.get(IMAGE_NAME, ""),
        labels=plain(c.labels),
        annotations=annotations,
        envs=tuple((k, v) for k, _, v in (e.partition("=") for e in c.env)),
        mounts=tuple(map(_nri_mount, c.mounts)),
        devices=tuple(Device(d.path, d.path, _access(d), (d.type, d.major, d.minor)) for d in linux.devices),
        cdi_devices=tuple(d.name for d in c.CDI_devices),
        resources=nri_resources_view(linux.resources, linux.HasField("resources"), linux.oom_score_adj.value),
    )


# the mounts of NRI's messages, each made once: containerd gives every container the same /proc,
# /dev, /sys..., and a pod's containers share kubelet's; a frozen dataclass costs more to make
# than to look up
_mount = functools.lru_cache(maxsize=4096)(Mount)


def _nri_mount(m: nri.Mount) -> Mount:
    """A mount of the spec: read-only with option "ro", its propagation the first option that names
    one (private when none). The options are read once, as a list: iterating protobuf's repeated
    field itself costs twice as much, a dozen mounts a container."""
    readonly, propagation = False, None
    for option in m.options[:]:
        if option == "ro":
            readonly = True
        elif propagation is None and option in _PROPAGATION_OF:
            propagation = _PROPAGATION_OF[option]
    return _mount(m.destination, m.source, readonly, False, propagation or 0)


def _access(d: nri.LinuxDevice) -> str:
    """The node's access as containerd derives it from the file mode (NRI's AccessString): rw, and m
    never; rwm when the mode is not given."""
    if not d.HasField("file_mode"):
        return "rwm"
    mode = d.file_mode.value
    return ("r" if mode & 0o444 else "") + ("w" if mode & 0o222 else "")


def nri_listed_container(c: nri.Container) -> ContainerRecord:
    """The store's record of a container Synchronize lists (one created while crihook was away, or
    before it last started)."""
    view = nri_container_view(c)
    return ContainerRecord(
        **{name: getattr(view, name) for name in _SHARED},
        pod_id=c.pod_sandbox_id,
        state=_NRI_STATES.get(c.state, "unknown"),
        created=c.created_at / 1e9,
        envs=dict(view.envs),
        resources=resources_record(view.resources),
    )


def nri_rules(c: nri.Container) -> tuple[DeviceRule, ...]:
    """The device-cgroup rules the runtime put in the spec, in order, wildcards included."""
    return _rules(c.linux.resources.devices)


# the rules of NRI's messages, each made once: containerd gives every container the same dozen
# (deny all, its default devices), and a frozen dataclass costs more to make than to look up
_rule = functools.lru_cache(maxsize=1024)(DeviceRule)


def _rules(rules: Iterable[nri.LinuxDeviceCgroup]) -> tuple[DeviceRule, ...]:
    return tuple(
        [
            _rule(
                r.allow,
                r.type or "a",
                r.major.value if r.HasField("major") else None,
                r.minor.value if r.HasField("minor") else None,
                r.access,
            )
            for r in rules
        ]
    )


def reach_of(c: ContainerInfo, rules: tuple[DeviceRule, ...] | None, number_of: Callable[[str], DeviceNumber]) -> Reach:
    """What can give `c` GPUs, for hooks.reach.judge: its device nodes by number (the view's, else
    `number_of(host path)`), `rules`, its CDI devices (CDI_devices and cdi.k8s.io/* annotations) and
    NVIDIA_VISIBLE_DEVICES."""
    nodes = tuple(DeviceNode(*(d.number or number_of(d.host_path)), d.container_path) for d in c.devices)
    cdi = [
        n.strip()
        for k, v in c.annotations.items()
        if k.startswith(ANNOTATION_PREFIX)
        for n in v.split(",")
        if n.strip()
    ]
    return Reach(nodes, rules, (*c.cdi_devices, *cdi), c.env(VISIBLE))


def nri_reach(c: nri.Container) -> Reach:
    """What can give the container NRI shows GPUs: its finished spec, CDI devices resolved into it."""
    return reach_of(nri_container_view(c), nri_rules(c), _no_number)


def _no_number(path: str) -> DeviceNumber:
    raise AssertionError(f"NRI gives every device node's numbers ({path})")


def nri_adjustment(
    before: ContainerInfo,
    after: ContainerInfo,
    node_of: Callable[[str], tuple[DeviceNumber, int]],
    *,
    device_rules: bool = False,
    deny_gpus: Iterable[int] = (),
) -> nri.ContainerAdjustment:
    """What changed from `before` (as NRI showed it) to `after` (as the hooks left it), as the
    adjustment that makes the runtime build `after`: entries set by key (env name, mount and device
    path, annotation), mount and annotation removals marked "-". Env and device removals, and what
    else the runtime would drop, are not written: the caller refuses those first
    (nriruntime.unapplied). `node_of(host path)`: ((type, major, minor), permission bits) of a device
    node to add. The runtime allows a node it adds "rw" ("rwm" for a block device). With
    `device_rules` (NRI v0.10+ appends an adjustment's device-cgroup rules to the spec's, after those)
    the access the hooks asked for is made exact by a rule allowing what is missing and one denying
    the rest, a device node removed is denied by its numbers (the node stays, unusable), and so is
    each GPU minor of `deny_gpus`."""
    adj = nri.ContainerAdjustment()
    if after.annotations is not before.annotations:  # else no hook touched them (hooks.edit keeps them)
        adj.annotations.update(changed_keys(before.annotations, after.annotations))
        for k in before.annotations.keys() - after.annotations.keys():
            adj.annotations["-" + k] = ""
    old_env = dict(before.envs)
    for k, v in dict(after.envs).items():
        if old_env.get(k) != v:
            adj.env.add(key=k, value=v)
    if after.mounts is not before.mounts:
        old_mounts = {m.container_path: m for m in before.mounts}
        new_mounts = {m.container_path: m for m in after.mounts}
        for path, m in new_mounts.items():
            if old_mounts.get(path) != m:
                options = ["rbind", _PROPAGATION.get(m.propagation, "rprivate"), "ro" if m.readonly else "rw"]
                adj.mounts.add(destination=path, type="bind", source=m.host_path, options=options)
        for path in old_mounts.keys() - new_mounts.keys():
            adj.mounts.add(destination="-" + path)
    old_devices = {d.container_path: d for d in before.devices}
    kept: set[DeviceNumber] = set()  # the numbers of the nodes `after` keeps or is given
    for d in after.devices:
        old = old_devices.get(d.container_path)
        if old is None or old != d:  # None first: comparing it with a dataclass takes three calls
            (kind, major, minor), mode = node_of(d.host_path)
            dev = adj.linux.devices.add(path=d.container_path, type=kind, major=major, minor=minor)
            dev.file_mode.value = mode
            if device_rules:
                _exact_access(adj.linux.resources, (kind, major, minor), d.permissions)
            kept.add((kind, major, minor))
        elif d.number is not None:
            kept.add(d.number)
    if device_rules:
        for d in before.devices:  # removed, or replaced by another node at its path
            if d.number is not None and d.number not in kept:
                _deny(adj.linux.resources, d.number)
                kept.add(d.number)
        for minor in deny_gpus:
            _deny(adj.linux.resources, ("c", GPU_MAJOR, minor))
    for name in after.cdi_devices:
        if name not in before.cdi_devices:
            adj.CDI_devices.add(name=name)
    if after.resources is not None and after.resources != before.resources:
        write_nri_resources(adj.linux.resources, before.resources, after.resources)
        if after.resources.oom_score_adj != (before.resources.oom_score_adj if before.resources else 0):
            adj.linux.oom_score_adj.value = after.resources.oom_score_adj
    return adj


def _exact_access(res: nri.LinuxResources, node: DeviceNumber, asked: str) -> None:
    kind, major, minor = node
    given = "rw" + ("m" if kind == "b" else "")  # NRI's LinuxDevice.AccessString
    for allow, letters in (
        (True, [c for c in "rwm" if c in asked and c not in given]),
        (False, [c for c in given if c not in asked]),
    ):
        if letters:
            rule = res.devices.add(allow=allow, type=kind, access="".join(letters))
            rule.major.value, rule.minor.value = major, minor


def _deny(res: nri.LinuxResources, node: DeviceNumber) -> None:
    kind, major, minor = node
    rule = res.devices.add(allow=False, type=kind, access="rwm")
    rule.major.value, rule.minor.value = major, minor


def adjusted_rules(adj: nri.ContainerAdjustment, unless: Container[DeviceNumber] = ()) -> tuple[DeviceRule, ...]:
    """The device-cgroup rules the runtime adds to the spec's for an adjustment, in its order
    (generate.go, Adjust): an allow rule for each device node added (AccessString: rw, rwm for a block
    device), but those of the nodes `unless` holds, then the adjustment's own rules (NRI v0.10+)."""
    nodes = (
        DeviceRule(True, d.type, d.major, d.minor, "rwm" if d.type == "b" else "rw")
        for d in adj.linux.devices
        if (d.type, d.major, d.minor) not in unless
    )
    return (*nodes, *_rules(adj.linux.resources.devices))


# CRI's container states as NRI names them; the escape check looks only at the live ones
_NRI_STATE = {
    cri.CONTAINER_CREATED: nri.CONTAINER_CREATED,
    cri.CONTAINER_RUNNING: nri.CONTAINER_RUNNING,
    cri.CONTAINER_EXITED: nri.CONTAINER_STOPPED,
}


def spec_container(c: cri.Container, status: cri.ContainerStatusResponse) -> nri.Container:
    """A container as NRI would show it, from CRI's listing and the OCI spec in its verbose status:
    for the containers a Synchronize can miss (containerd 1.7 lets a creation race the plugin's
    Synchronize; 2.x blocks it). What the spec does not say is left empty."""
    spec = runtime_spec(status.info)
    process, linux = _dict(spec.get("process")), _dict(spec.get("linux"))
    out = nri.Container(
        id=c.id,
        pod_sandbox_id=c.pod_sandbox_id,
        name=c.metadata.name,
        state=_NRI_STATE.get(c.state, nri.CONTAINER_UNKNOWN),
        env=[e for e in process.get("env") or () if isinstance(e, str)],
        created_at=c.created_at,
    )
    out.labels.update(plain(c.labels))
    out.annotations.update({**plain(c.annotations), RESTART_COUNT: str(c.metadata.attempt)})
    for d in linux.get("devices") or ():
        if isinstance(d, dict) and isinstance(d.get("path"), str):
            out.linux.devices.add(
                path=d["path"], type=str(d.get("type", "")), major=int(d.get("major", 0)), minor=int(d.get("minor", 0))
            )
    for r in _dict(linux.get("resources")).get("devices") or ():
        if isinstance(r, dict):  # wildcards too: a privileged container's allow-all is one
            rule = out.linux.resources.devices.add(
                allow=bool(r.get("allow")), type=str(r.get("type") or ""), access=str(r.get("access") or "")
            )
            if isinstance(r.get("major"), int):
                rule.major.value = r["major"]
            if isinstance(r.get("minor"), int):
                rule.minor.value = r["minor"]
    return out


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}
