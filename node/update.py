"""What an UpdateContainerResources does to a container's resources, as containerd applies it.

containerd's CRI plugin applies an update onto the container's current spec field by field: a
field the update sets (non-zero, non-empty) replaces the container's value, a field it leaves unset
keeps it, and `unified` is merged key by key (its WithResources option, the same in 1.6, 1.7 and
2.x). `oom_score_adj` belongs to the container's process, fixed at creation: an update carrying one
changes nothing. So the store applies an update the same way, and hooks at
PreUpdateContainerResources see the container as it will be once the update is in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from crihook.hooks.base import LinuxResources

# the LinuxContainerResources fields an update changes when set (hugepage_limits: crihook's
# resource view has none)
UPDATED = ("cpu_period", "cpu_quota", "cpu_shares", "memory_limit_in_bytes", "cpuset_cpus", "cpuset_mems",
           "memory_swap_limit_in_bytes")  # fmt: skip


def apply_update(current: LinuxResources | None, update: LinuxResources | None) -> LinuxResources | None:
    """The container's resources after `update`; None stays None only when both are."""
    if update is None:
        return current
    base = current if current is not None else LinuxResources()
    changed = {f: value for f in UPDATED if (value := getattr(update, f))}
    if not changed and not update.unified:
        return base
    return replace(base, **changed, unified={**base.unified, **update.unified})


def changed_keys(before: Mapping[str, str], after: Mapping[str, str]) -> dict[str, str]:
    """The keys of `after` that are new or hold another value than in `before`. An update can
    only add or overwrite (the runtime merges what it is sent), so keys gone from `after` are
    not a change it can carry."""
    return {k: v for k, v in after.items() if before.get(k) != v}


def changed_fields(before: LinuxResources | None, after: LinuxResources | None) -> dict[str, int | str]:
    """The scalar fields that differ between two views of the container's resources."""
    if after is None or before == after:
        return {}
    base = before if before is not None else LinuxResources()
    return {f: getattr(after, f) for f in (*UPDATED, "oom_score_adj") if getattr(after, f) != getattr(base, f)}
