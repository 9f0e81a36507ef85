"""The store's records: what crihook keeps of each pod sandbox and container, as plain data that
the store file holds field by field (node/storefile.py) and the conversions make views of
(node/pod.py, node/container.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# What the store file keeps of a container's environment: the values crihook itself reads back (the
# GPUs granted, HAMi-core's limits). Every other variable, a Secret's value among them, stays in
# memory only: after a restart the hooks of later stages see these alone.
STORED_ENV = frozenset({"NVIDIA_VISIBLE_DEVICES", "CUDA_DEVICE_SM_LIMIT", "CUDA_DEVICE_ORDER"})
STORED_ENV_PREFIXES = ("CUDA_DEVICE_MEMORY_LIMIT_",)


def stored_env(envs: Mapping[str, str]) -> dict[str, str]:
    """The part of an environment the store file holds."""
    return {k: v for k, v in envs.items() if k in STORED_ENV or k.startswith(STORED_ENV_PREFIXES)}


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
