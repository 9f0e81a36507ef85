"""The store's records: what crihook keeps of each pod sandbox and container, as plain data that
the store file holds field by field (node/storefile.py) and the conversions make views of
(node/pod.py, node/container.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class PodRecord:
    id: str
    name: str
    namespace: str
    uid: str
    attempt: int = 0
    state: str = "ready"  # ready | notready
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    cgroup_parent: str = ""
    hooks: list[dict[str, Any]] = field(default_factory=list)
    created: float = 0.0
    runtime_handler: str = ""
    resources: dict[str, Any] = field(default_factory=dict)  # LinuxContainerResources fields; {} unknown
    overhead: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class ContainerRecord:
    id: str
    pod_id: str
    name: str
    attempt: int = 0
    state: str = "created"  # created | running | exited | unknown
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    hooks: list[dict[str, Any]] = field(default_factory=list)
    created: float = 0.0
    # what the container was created with, after the hooks (later stages' hooks are told)
    envs: dict[str, str] = field(default_factory=dict)
    resources: dict[str, Any] = field(default_factory=dict)  # LinuxContainerResources fields; {} unknown
