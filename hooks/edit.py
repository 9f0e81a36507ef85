"""An `Edit` applied to the hooks' views (`apply_edit`): what the next hook sees, and what the front
door writes back into the call."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, TypeVar

from crihook.hooks.base import (
    Edit,
    HookContext,
    Stage,
)

_T = TypeVar("_T")


def apply_edit(ctx: HookContext, edit: Edit) -> HookContext:
    """The view after `edit`; the chain feeds it to the next hook. Raises ValueError for an edit
    that does not fit the stage (a hook bug, handled by its failure policy)."""
    pod = ctx.pod
    if edit.labels or edit.cgroup_parent is not None:
        if ctx.stage is not Stage.PRE_RUN_POD_SANDBOX:
            raise ValueError(f"labels and cgroup_parent can only change at {Stage.PRE_RUN_POD_SANDBOX}")
        pod = replace(
            pod,
            labels={**pod.labels, **edit.labels},
            cgroup_parent=edit.cgroup_parent if edit.cgroup_parent is not None else pod.cgroup_parent,
        )
    if ctx.container is None:
        container_only = (
            edit.env,
            edit.remove_env,
            edit.add_mounts,
            edit.remove_mounts,
            edit.add_devices,
            edit.remove_devices,
            edit.add_cdi_devices,
            edit.remove_cdi_devices,
        )
        if any(container_only):
            raise ValueError(f"envs, mounts and devices can not change at {ctx.stage}")
        if edit.annotations or edit.remove_annotations:
            pod = replace(pod, annotations=_edit_map(pod.annotations, edit))
        if edit.resources is not None:
            pod = replace(pod, resources=edit.resources.apply(pod.resources))
        return replace(ctx, pod=pod)

    c = ctx.container
    envs = [(k, v) for k, v in c.envs if k not in edit.remove_env and k not in edit.env]
    envs.extend(edit.env.items())
    mounts = _replace_keyed(c.mounts, edit.remove_mounts, edit.add_mounts, lambda m: m.container_path)
    devices = _replace_keyed(c.devices, edit.remove_devices, edit.add_devices, lambda d: d.container_path)
    cdi = _replace_keyed(c.cdi_devices, edit.remove_cdi_devices, edit.add_cdi_devices, lambda n: n)
    container = replace(
        c,
        envs=tuple(envs),
        mounts=mounts,
        devices=devices,
        cdi_devices=cdi,
        annotations=_edit_map(c.annotations, edit) if edit.annotations or edit.remove_annotations else c.annotations,
        resources=edit.resources.apply(c.resources) if edit.resources is not None else c.resources,
    )
    return replace(ctx, pod=pod, container=container)


def _edit_map(annotations: Mapping[str, str], edit: Edit) -> dict[str, str]:
    kept = {k: v for k, v in annotations.items() if k not in edit.remove_annotations}
    return {**kept, **edit.annotations}


def _replace_keyed(items: tuple[_T, ...], remove: set[str], add: list[_T], key: Any) -> tuple[_T, ...]:
    """`items` itself when the edit leaves them as they are: the front door skips what is unchanged."""
    if not (remove or add):
        return items
    if not items:  # most containers bring no devices of their own: no keys needed
        return (*add,)
    added = {key(a) for a in add}
    kept = [i for i in items if key(i) not in remove and key(i) not in added]
    return (*kept, *add)
