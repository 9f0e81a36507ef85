"""Every conversion of a pod sandbox: CRI's PodSandboxConfig (and a listed PodSandbox) and NRI's
PodSandbox to the hooks' PodInfo, an edited PodInfo written back into the config, and PodInfo <->
the store's PodRecord.

The fields PodInfo and PodRecord share carry the same names, and are copied by that list
(`_SHARED`), never one by one.
"""

from __future__ import annotations

import time
from dataclasses import fields
from typing import Any

from crihook.hooks.base import PodInfo, PodRecordView
from crihook.node.records import PodRecord
from crihook.node.resources import (
    nri_resources_view,
    plain,
    resources_from_record,
    resources_record,
    resources_view,
    set_map,
    write_resources,
)
from crihook.node.status import sandbox_cgroup_parent
from crihook.proto import nri_v1alpha1_pb2 as nri
from crihook.proto import runtime_v1_pb2 as cri

_RESOURCES = ("resources", "overhead")  # LinuxResources in the view, plain mappings in the record
_SHARED = tuple(
    f.name for f in fields(PodInfo) if f.name in PodRecord.__dataclass_fields__ and f.name not in _RESOURCES
)
_STATES = {cri.SANDBOX_READY: "ready", cri.SANDBOX_NOTREADY: "notready"}


def _named(meta: cri.PodSandboxMetadata) -> dict[str, Any]:
    return {"name": meta.name, "namespace": meta.namespace, "uid": meta.uid, "attempt": meta.attempt}


def pod_view(
    cfg: cri.PodSandboxConfig, pod_id: str = "", runtime_handler: str = "", stored: PodRecordView | None = None
) -> PodInfo:
    """`stored`: what the hooks made of the pod at RunPodSandbox (its labels, annotations and
    cgroup parent are taken from it, not converted again from kubelet's copy of the config)."""
    linux = cfg.linux
    return PodInfo(
        **_named(cfg.metadata),
        id=pod_id,
        labels=plain(cfg.labels) if stored is None else stored.labels,
        annotations=plain(cfg.annotations) if stored is None else stored.annotations,
        cgroup_parent=stored.cgroup_parent if stored is not None and stored.cgroup_parent else linux.cgroup_parent,
        runtime_handler=runtime_handler,
        resources=resources_view(linux.resources, linux.HasField("resources")),
        overhead=resources_view(linux.overhead, linux.HasField("overhead")),
    )


def write_pod(cfg: cri.PodSandboxConfig, before: PodInfo, after: PodInfo) -> None:
    """What the hooks changed of the pod, written into the config; the rest is left as decoded."""
    set_map(cfg.labels, before.labels, after.labels)
    set_map(cfg.annotations, before.annotations, after.annotations)
    if after.cgroup_parent != before.cgroup_parent:
        cfg.linux.cgroup_parent = after.cgroup_parent
    write_resources(cfg.linux.resources, before.resources, after.resources)


def pod_info(rec: PodRecord) -> PodInfo:
    """The pod as hooks see it, for a call that names it only by id."""
    return PodInfo(
        **{name: getattr(rec, name) for name in _SHARED},
        resources=resources_from_record(rec.resources),
        overhead=resources_from_record(rec.overhead),
    )


def pod_record(pod: PodInfo, hooks: list[dict[str, Any]], **rest: Any) -> PodRecord:
    """The store's record of a pod the hooks saw start (`rest`: the record's own fields, its state)."""
    values: dict[str, Any] = {name: getattr(pod, name) for name in _SHARED}
    for name in ("labels", "annotations"):
        values[name] = dict(values[name])
    return PodRecord(
        **values,
        hooks=hooks,
        created=time.time(),
        resources=resources_record(pod.resources),
        overhead=resources_record(pod.overhead),
        **rest,
    )


def listed_pod(s: cri.PodSandbox, status: cri.PodSandboxStatusResponse | None) -> PodRecord:
    """The record of a sandbox as ListPodSandbox lists it, with what only its verbose status says
    (cgroup parent, runtime handler) when there is one."""
    return PodRecord(
        **_named(s.metadata),
        id=s.id,
        state=_STATES.get(s.state, "notready"),
        labels=plain(s.labels),
        annotations=plain(s.annotations),
        created=s.created_at / 1e9,
        cgroup_parent=sandbox_cgroup_parent(status.info) if status is not None else "",
        runtime_handler=status.status.runtime_handler if status is not None else "",
    )


def unknown_pod(pod_id: str = "") -> PodInfo:
    """The view of a pod crihook has no record of (created before it knew it, and not reconciled)."""
    return PodInfo(name="", namespace="", uid="", id=pod_id)


def nri_pod_view(p: nri.PodSandbox) -> PodInfo:
    """The pod as NRI describes it: kubelet's labels and annotations as RunPodSandbox got them. NRI
    does not say the attempt; 0, as for a pod the store never saw start."""
    linux = p.linux
    return PodInfo(
        name=p.name,
        namespace=p.namespace,
        uid=p.uid,
        id=p.id,
        labels=plain(p.labels),
        annotations=plain(p.annotations),
        cgroup_parent=linux.cgroup_parent,
        runtime_handler=p.runtime_handler,
        resources=nri_resources_view(linux.pod_resources, linux.HasField("pod_resources")),
        overhead=nri_resources_view(linux.pod_overhead, linux.HasField("pod_overhead")),
    )


def nri_listed_pod(p: nri.PodSandbox) -> PodRecord:
    """The store's record of a pod Synchronize lists (the runtime lists live sandboxes only)."""
    view = nri_pod_view(p)
    return PodRecord(
        **{name: getattr(view, name) for name in _SHARED},
        state="ready",
        resources=resources_record(view.resources),
        overhead=resources_record(view.overhead),
    )


def listed_nri_pod(s: cri.PodSandbox) -> nri.PodSandbox:
    """A sandbox as NRI would show it, from CRI's listing (for what a Synchronize can miss)."""
    meta = s.metadata
    out = nri.PodSandbox(id=s.id, name=meta.name, uid=meta.uid, namespace=meta.namespace)
    out.labels.update(plain(s.labels))
    out.annotations.update(plain(s.annotations))
    return out
