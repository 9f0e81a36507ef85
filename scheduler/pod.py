"""Pods as the allocator sees them, built from the Kubernetes pod JSON that kube-scheduler sends.

Only what device scheduling needs is kept: identity, labels, annotations, the node (for live pods)
and each container's resource requests and limits. Quantities stay as the strings or numbers the
API server gave; request.py reads them, so a bad value is reported against its pod and field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from crihook.base.errors import InputError


class PodError(InputError):
    """The pod JSON is not a pod; names the pod (when known) and the field."""

    def __init__(self, pod: str, where: str, reason: str) -> None:
        self.pod = pod
        super().__init__(f"pod {pod or '<unnamed>'}", where, reason)


@dataclass(frozen=True, slots=True)
class Container:
    name: str
    requests: Mapping[str, Any] = field(default_factory=dict)
    limits: Mapping[str, Any] = field(default_factory=dict)
    init: bool = False
    # An init container with restartPolicy Always runs beside the app containers (a sidecar).
    sidecar: bool = False


@dataclass(frozen=True, slots=True)
class Pod:
    uid: str
    namespace: str
    name: str
    containers: tuple[Container, ...] = ()
    init_containers: tuple[Container, ...] = ()
    annotations: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    node_name: str = ""
    phase: str = ""

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def finished(self) -> bool:
        """Succeeded and Failed pods hold no devices."""
        return self.phase in ("Succeeded", "Failed")


def _str_map(value: Any, pod: str, where: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise PodError(pod, where, "expected an object of strings")
    return dict(value)


def _resources(value: Any, pod: str, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise PodError(pod, where, "expected an object of resource quantities")
    return dict(value)


def _containers(value: Any, pod: str, where: str, init: bool) -> tuple[Container, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise PodError(pod, where, "expected a list of containers")
    out = []
    for i, c in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(c, dict):
            raise PodError(pod, at, "expected an object")
        name = c.get("name")
        if not isinstance(name, str) or not name:
            raise PodError(pod, f"{at}.name", "missing")
        res = c.get("resources") or {}
        if not isinstance(res, dict):
            raise PodError(pod, f"{at}.resources", "expected an object")
        out.append(
            Container(
                name=name,
                requests=_resources(res.get("requests"), pod, f"{at}.resources.requests"),
                limits=_resources(res.get("limits"), pod, f"{at}.resources.limits"),
                init=init,
                sidecar=init and c.get("restartPolicy") == "Always",
            )
        )
    return tuple(out)


def pod_from_json(obj: Mapping[str, Any]) -> Pod:
    """A Pod from the Kubernetes JSON shape (`metadata`, `spec`, `status`), as kube-scheduler and the
    API server send it. Raises PodError naming the field that is wrong."""
    if not isinstance(obj, Mapping):
        raise PodError("", "", "expected a JSON object")
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    if not isinstance(meta, dict) or not isinstance(spec, dict) or not isinstance(status, dict):
        raise PodError("", "", "metadata, spec and status must be objects")
    namespace = meta.get("namespace") or "default"
    name = meta.get("name") or meta.get("generateName") or ""
    if not isinstance(namespace, str) or not isinstance(name, str):
        raise PodError("", "metadata", "namespace and name must be strings")
    key = f"{namespace}/{name}"
    uid = meta.get("uid") or ""
    node = spec.get("nodeName") or ""
    phase = status.get("phase") or ""
    if not isinstance(uid, str) or not isinstance(node, str) or not isinstance(phase, str):
        raise PodError(key, "metadata.uid/spec.nodeName/status.phase", "expected strings")
    return Pod(
        uid=uid,
        namespace=namespace,
        name=name,
        containers=_containers(spec.get("containers"), key, "spec.containers", init=False),
        init_containers=_containers(spec.get("initContainers"), key, "spec.initContainers", init=True),
        annotations=_str_map(meta.get("annotations"), key, "metadata.annotations"),
        labels=_str_map(meta.get("labels"), key, "metadata.labels"),
        node_name=node,
        phase=phase,
    )
