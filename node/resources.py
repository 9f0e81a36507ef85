"""Linux resources in their four forms: runtime.v1's LinuxContainerResources (a container's, and a
pod's resources and overhead), NRI's LinuxResources, the hooks' LinuxResources, and the plain
mapping the store keeps. Also the protobuf map helpers every conversion here uses."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

from crihook.hooks.base import RESOURCE_FIELDS, LinuxResources, resource_values
from crihook.proto import nri_v1alpha1_pb2 as nri
from crihook.proto import runtime_v1_pb2 as cri


def plain(m: Mapping[str, str]) -> dict[str, str]:
    """A protobuf map as a dict. `dict(m)` goes through collections.abc's Python-level keys view
    (protobuf's maps take their mixin methods from it): code a call touches only for that, and
    runs cold after the event loop idled."""
    return {k: m[k] for k in m}


def set_map(target: MutableMapping[str, str], before: Mapping[str, str], after: Mapping[str, str]) -> None:
    """Make a decoded map go from `before` to `after`, touching only the entries that changed."""
    if before == after:
        return
    for k in set(before) - set(after):
        del target[k]
    for k, v in after.items():
        if before.get(k) != v:
            target[k] = v


def resources_view(msg: cri.LinuxContainerResources, present: bool) -> LinuxResources | None:
    if not present:
        return None
    return LinuxResources(**{f: getattr(msg, f) for f in RESOURCE_FIELDS}, unified=plain(msg.unified))


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
    set_map(msg.unified, dict(base.unified), dict(after.unified))


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


# NRI's LinuxResources: the hooks' field -> (group, field) of an Optional* wrapper, or of a plain string
_NRI_RESOURCES = {
    "cpu_period": ("cpu", "period"),
    "cpu_quota": ("cpu", "quota"),
    "cpu_shares": ("cpu", "shares"),
    "memory_limit_in_bytes": ("memory", "limit"),
    "memory_swap_limit_in_bytes": ("memory", "swap"),
}
_NRI_STRINGS = {"cpuset_cpus": "cpus", "cpuset_mems": "mems"}


def nri_resources_view(msg: nri.LinuxResources, present: bool, oom_score_adj: int = 0) -> LinuxResources | None:
    """NRI's resources as the hooks see CRI's: unset wrappers read 0, as proto3 scalars do."""
    if not present:
        return None
    values: dict[str, Any] = {f: getattr(getattr(msg, g), n).value for f, (g, n) in _NRI_RESOURCES.items()}
    values.update({f: getattr(msg.cpu, n) for f, n in _NRI_STRINGS.items()})
    return LinuxResources(**values, oom_score_adj=oom_score_adj, unified=plain(msg.unified))


def write_nri_resources(msg: nri.LinuxResources, before: LinuxResources | None, after: LinuxResources) -> None:
    """What changed of the resources (oom_score_adj aside: the adjustment carries it elsewhere)."""
    base = before or LinuxResources()
    for f, (g, n) in _NRI_RESOURCES.items():
        if getattr(after, f) != getattr(base, f):
            getattr(getattr(msg, g), n).value = getattr(after, f)
    for f, n in _NRI_STRINGS.items():
        if getattr(after, f) != getattr(base, f):
            setattr(msg.cpu, n, getattr(after, f))
    for k, v in after.unified.items():
        if base.unified.get(k) != v:
            msg.unified[k] = v


def nri_container_update(
    container_id: str, before: LinuxResources | None, after: LinuxResources | None
) -> nri.ContainerUpdate | None:
    """What the hooks changed of a container's resources at UpdateContainerResources (before → after),
    as the update of that container NRI merges into the runtime's request; None when nothing changed."""
    if after is None or after == before:
        return None
    update = nri.ContainerUpdate(container_id=container_id)
    write_nri_resources(update.linux.resources, before, after)
    return update if update.linux.resources.ByteSize() else None
