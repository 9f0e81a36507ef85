"""CRI messages <-> the hooks' views: a decoded runtime.v1 request read into PodInfo/ContainerInfo, and
the views the hooks left written back into it.

Only fields a hook changed are written back; every message a hook left alone is reused as decoded,
so unknown fields (a newer kubelet's) reach containerd intact. Resources also convert to and from
the plain mappings the proxy's store keeps and the hook-server protocol sends (`resource_values`).
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any, TypeVar

from google.protobuf.internal.containers import RepeatedCompositeFieldContainer
from google.protobuf.message import Message

from crihook.base.spec import Device, Mount
from crihook.hooks.base import RESOURCE_FIELDS, ContainerInfo, LinuxResources, PodInfo, PodRecordView
from crihook.proto import runtime_v1_pb2 as cri

_V = TypeVar("_V")
_M = TypeVar("_M", bound=Message)


def _text(b: bytes) -> str:
    return b.decode("utf-8", "surrogateescape")


def _raw(s: str) -> bytes:
    return s.encode("utf-8", "surrogateescape")


def _plain(m: Mapping[str, str]) -> dict[str, str]:
    """A protobuf map as a dict. `dict(m)` goes through collections.abc's Python-level keys view
    (protobuf's maps take their mixin methods from it): code a call touches only for that, and
    runs cold after the event loop idled."""
    return {k: m[k] for k in m}


# -- protobuf -> views ---------------------------------------------------------------------------


def resources_view(msg: cri.LinuxContainerResources, present: bool) -> LinuxResources | None:
    if not present:
        return None
    return LinuxResources(**{f: getattr(msg, f) for f in RESOURCE_FIELDS}, unified=_plain(msg.unified))


def pod_view(
    cfg: cri.PodSandboxConfig, pod_id: str = "", runtime_handler: str = "", stored: PodRecordView | None = None
) -> PodInfo:
    """`stored`: what the hooks made of the pod at RunPodSandbox (its labels, annotations and
    cgroup parent are taken from it, not converted again from kubelet's copy of the config)."""
    linux = cfg.linux
    meta = cfg.metadata
    return PodInfo(
        name=meta.name,
        namespace=meta.namespace,
        uid=meta.uid,
        attempt=meta.attempt,
        id=pod_id,
        labels=_plain(cfg.labels) if stored is None else stored.labels,
        annotations=_plain(cfg.annotations) if stored is None else stored.annotations,
        cgroup_parent=stored.cgroup_parent if stored is not None and stored.cgroup_parent else linux.cgroup_parent,
        runtime_handler=runtime_handler,
        resources=resources_view(linux.resources, linux.HasField("resources")),
        overhead=resources_view(linux.overhead, linux.HasField("overhead")),
    )


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
        labels=_plain(cfg.labels),
        annotations=_plain(cfg.annotations),
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


def _set_map(target: MutableMapping[str, str], before: Mapping[str, str], after: Mapping[str, str]) -> None:
    if before == after:
        return
    for k in set(before) - set(after):
        del target[k]
    for k, v in after.items():
        if before.get(k) != v:
            target[k] = v


def write_resources(
    msg: cri.LinuxContainerResources, before: LinuxResources | None, after: LinuxResources | None
) -> None:
    if after is None or before == after:
        return
    base = before or LinuxResources()
    for f in RESOURCE_FIELDS:
        value = getattr(after, f)
        if getattr(base, f) != value:
            setattr(msg, f, value)
    _set_map(msg.unified, dict(base.unified), dict(after.unified))


def write_container(cfg: cri.ContainerConfig, before: ContainerInfo, after: ContainerInfo) -> None:
    _rebuild(cfg.envs, before.envs, after.envs, lambda new, kv: new(key=_raw(kv[0]), value=_raw(kv[1])))
    _rebuild(
        cfg.mounts,
        before.mounts,
        after.mounts,
        lambda new, m: new(
            container_path=m.container_path,
            host_path=m.host_path,
            readonly=m.readonly,
            selinux_relabel=m.selinux_relabel,
            propagation=m.propagation,
        ),
    )
    _rebuild(
        cfg.devices,
        before.devices,
        after.devices,
        lambda new, d: new(container_path=d.container_path, host_path=d.host_path, permissions=d.permissions),
    )
    _rebuild(cfg.CDI_devices, before.cdi_devices, after.cdi_devices, lambda new, name: new(name=name))
    _set_map(cfg.annotations, before.annotations, after.annotations)
    write_resources(cfg.linux.resources, before.resources, after.resources)


def write_pod(cfg: cri.PodSandboxConfig, before: PodInfo, after: PodInfo) -> None:
    _set_map(cfg.labels, before.labels, after.labels)
    _set_map(cfg.annotations, before.annotations, after.annotations)
    if after.cgroup_parent != before.cgroup_parent:
        cfg.linux.cgroup_parent = after.cgroup_parent
    write_resources(cfg.linux.resources, before.resources, after.resources)


# -- views <-> plain values ----------------------------------------------------------------------


def resource_values(res: LinuxResources) -> dict[str, Any]:
    """Every field by its proto name: what a LinuxContainerResources message (either protocol's)
    is built from, and what the store keeps."""
    return {**{f: getattr(res, f) for f in RESOURCE_FIELDS}, "unified": dict(res.unified)}


def resources_record(res: LinuxResources | None) -> dict[str, Any]:
    """Resources as the store keeps them: plain JSON, {} for none."""
    return {} if res is None else resource_values(res)


def resources_from_record(raw: Mapping[str, Any]) -> LinuxResources | None:
    """The stored resources, or None when absent or not what crihook writes (a hand-edited store)."""
    if not raw:
        return None
    try:
        res = LinuxResources(**{**raw, "unified": dict(raw.get("unified") or {})})
    except (TypeError, ValueError):
        return None
    defaults = LinuxResources()
    if any(type(getattr(res, f)) is not type(getattr(defaults, f)) for f in RESOURCE_FIELDS):
        return None
    return res
