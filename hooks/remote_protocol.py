"""Translation between crihook's hook views and Koordinator's hook-server messages, with no I/O.

Hook servers answer with state, not changes: koordlet, for one, echoes the whole request back with
its own changes applied. So an answer is read as "these values should hold", and only the values
that differ from what crihook sent become the edit. That one rule gives the merge its safety: a
variable, annotation or label the server left out is kept, never dropped, and a resource field the
server left at 0 or "" (proto3's "not set") keeps the container's value.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from crihook.hooks.base import (
    RESOURCE_FIELDS,
    ContainerInfo,
    Edit,
    HookContext,
    LinuxResources,
    PodInfo,
    ResourcesPatch,
    Stage,
    resource_values,
)
from crihook.proto import hookservice_v1alpha1_pb2 as pb

# Every stage the protocol has an RPC for, and the RPC's name.
RPCS: dict[Stage, str] = {
    Stage.PRE_RUN_POD_SANDBOX: "PreRunPodSandboxHook",
    Stage.POST_STOP_POD_SANDBOX: "PostStopPodSandboxHook",
    Stage.PRE_CREATE_CONTAINER: "PreCreateContainerHook",
    Stage.PRE_START_CONTAINER: "PreStartContainerHook",
    Stage.POST_START_CONTAINER: "PostStartContainerHook",
    Stage.POST_STOP_CONTAINER: "PostStopContainerHook",
    Stage.PRE_UPDATE_CONTAINER_RESOURCES: "PreUpdateContainerResourcesHook",
}
SERVICE = "runtime.v1alpha1.RuntimeHookService"

# What an answer may change at each stage: the parts of the CRI request the proxy writes back.
# StartContainer carries nothing to rewrite and post stages never change a call, so answers there are
# read for their status only.
_APPLIES: dict[Stage, frozenset[str]] = {
    Stage.PRE_RUN_POD_SANDBOX: frozenset({"labels", "annotations", "cgroup_parent", "resources"}),
    Stage.PRE_CREATE_CONTAINER: frozenset({"annotations", "resources", "envs"}),
    Stage.PRE_UPDATE_CONTAINER_RESOURCES: frozenset({"annotations", "resources"}),
}

# Koordinator's opt-out: hook servers deployed as pods must not wait on themselves.
SKIP_LABEL = "runtimeproxy.koordinator.sh/skip-hookserver"


class InvalidAnswer(ValueError):
    """A hook server's answer that crihook will not apply; the server's failure policy decides."""


def skips_hook_servers(pod: PodInfo) -> bool:
    return pod.labels.get(SKIP_LABEL) == "true"


def answer_applies(stage: Stage) -> bool:
    """False where a server's answer can change nothing and only its status counts."""
    return stage in _APPLIES


def request_for(ctx: HookContext) -> pb.PodSandboxHookRequest | pb.ContainerResourceHookRequest:
    if ctx.container is None:
        return pod_request(ctx.pod)
    return container_request(ctx.pod, ctx.container)


def pod_request(pod: PodInfo) -> pb.PodSandboxHookRequest:
    return pb.PodSandboxHookRequest(
        pod_meta=_pod_meta(pod),
        runtime_handler=pod.runtime_handler,
        labels=pod.labels,
        annotations=pod.annotations,
        cgroup_parent=pod.cgroup_parent,
        overhead=resources_message(pod.overhead),
        resources=resources_message(pod.resources),
    )


def container_request(pod: PodInfo, container: ContainerInfo) -> pb.ContainerResourceHookRequest:
    return pb.ContainerResourceHookRequest(
        pod_meta=_pod_meta(pod),
        container_meta=pb.ContainerMetadata(name=container.name, attempt=container.attempt, id=container.id),
        container_annotations=container.annotations,
        container_resources=resources_message(container.resources),
        pod_resources=resources_message(pod.resources),
        pod_annotations=pod.annotations,
        pod_labels=pod.labels,
        pod_cgroup_parent=pod.cgroup_parent,
        container_envs=sendable_envs(container),
    )


def sendable_envs(container: ContainerInfo) -> dict[str, str]:
    """The environment as the protocol's map carries it: last value per name, and only the
    variables that are valid UTF-8 (protobuf strings must be). The rest stay in the container
    untouched; a server simply does not see them."""
    out: dict[str, str] = {}
    for key, value in container.envs:
        if _utf8(key) and _utf8(value):
            out[key] = value
        else:
            out.pop(key, None)  # a later unsendable value hides an earlier sendable one
    return out


def resources_message(r: LinuxResources | None) -> pb.LinuxContainerResources | None:
    if r is None:
        return None
    return pb.LinuxContainerResources(**resource_values(r))


@dataclass(slots=True)
class Reading:
    """One answer read against the view it answered: what to change, and what the server asked
    for that crihook does not apply at this stage (reported, never silently dropped)."""

    edit: Edit
    not_applied: list[str]


def read_answer(ctx: HookContext, answer: Any) -> Reading:
    """Raises InvalidAnswer for an environment variable no runtime could set as given."""
    applies = _APPLIES.get(ctx.stage, frozenset())
    edit = Edit()
    asked: dict[str, bool] = {}
    if ctx.container is None:
        pod = ctx.pod
        asked["labels"] = bool(edit_labels := _changed(pod.labels, answer.labels))
        asked["annotations"] = bool(edit_annotations := _changed(pod.annotations, answer.annotations))
        cgroup = answer.cgroup_parent
        asked["cgroup_parent"] = bool(cgroup) and cgroup != pod.cgroup_parent
        patch, hugepages = _resources(pod.resources, answer, "resources")
        if "labels" in applies:
            edit.labels = edit_labels
        if "cgroup_parent" in applies and asked["cgroup_parent"]:
            edit.cgroup_parent = cgroup
    else:
        c = ctx.container
        asked["annotations"] = bool(edit_annotations := _changed(c.annotations, answer.container_annotations))
        envs = _changed(sendable_envs(c), answer.container_envs)
        asked["envs"] = bool(envs)
        # A container's cgroup lives under its pod's: moving it there at a container stage would
        # take it out of the pod's accounting, so pod_cgroup_parent is read but never applied.
        cgroup = answer.pod_cgroup_parent
        asked["pod_cgroup_parent"] = bool(cgroup) and cgroup != ctx.pod.cgroup_parent
        patch, hugepages = _resources(c.resources, answer, "container_resources")
        if "envs" in applies:
            _check_envs(envs)
            edit.env = envs
    asked["resources"] = patch is not None
    asked["hugepage_limits"] = hugepages
    if "annotations" in applies:
        edit.annotations = edit_annotations
    if "resources" in applies:
        edit.resources = patch
    not_applied = [name for name, wanted in asked.items() if wanted and name not in applies]
    return Reading(edit, not_applied)


def merge(into: Edit, later: Edit) -> None:
    """Fold the edit of a later server into the total; where both set a key, the later one wins."""
    into.env.update(later.env)
    into.annotations.update(later.annotations)
    into.labels.update(later.labels)
    if later.cgroup_parent is not None:
        into.cgroup_parent = later.cgroup_parent
    if later.resources is not None:
        into.resources = _merge_patches(into.resources, later.resources)


def _merge_patches(first: ResourcesPatch | None, later: ResourcesPatch) -> ResourcesPatch:
    if first is None:
        return later
    values = {n: v if (v := getattr(later, n)) is not None else getattr(first, n) for n in RESOURCE_FIELDS}
    unified = {**(first.unified or {}), **(later.unified or {})}
    return ResourcesPatch(**values, unified=unified or None)


def _pod_meta(pod: PodInfo) -> pb.PodSandboxMetadata:
    return pb.PodSandboxMetadata(name=pod.name, uid=pod.uid, namespace=pod.namespace, attempt=pod.attempt)


def _changed(current: Mapping[str, str], answer: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in answer.items() if current.get(k) != v}


def _resources(current: LinuxResources | None, answer: Any, name: str) -> tuple[ResourcesPatch | None, bool]:
    """Field by field, only where the server set a value (non-zero, non-empty) that differs."""
    if not answer.HasField(name):
        return None, False
    msg = getattr(answer, name)
    base = current or LinuxResources()
    changes: dict[str, Any] = {n: v for n in RESOURCE_FIELDS if (v := getattr(msg, n)) and v != getattr(base, n)}
    unified = {k: v for k, v in msg.unified.items() if v and base.unified.get(k) != v}
    if unified:
        changes["unified"] = unified
    return (ResourcesPatch(**changes) if changes else None), bool(msg.hugepage_limits)


def _check_envs(envs: Mapping[str, str]) -> None:
    for key, value in envs.items():
        if not key or "=" in key or "\0" in key:
            raise InvalidAnswer(f"environment variable name {key!r} is empty or contains '=' or NUL")
        if "\0" in value:
            raise InvalidAnswer(f"environment variable {key} has a NUL byte in its value")


def _utf8(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
