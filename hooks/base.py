"""The in-process hook contract: what a hook sees at each CRI stage, what it may change, how it says no.

Hooks never touch protobuf messages. They read plain views of the pod and container and return an
`Edit`; the chain applies edits to the views in order, and the proxy writes only the difference back
into the request, so everything a hook did not touch (unknown fields included) reaches the runtime as
kubelet sent it.
"""

from __future__ import annotations

import enum
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import grpc

from crihook.base.config import NodeConfig, NoOptions
from crihook.base.spec import Device, Mount

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from crihook.devices.nvml import GpuIndex
    from crihook.hooks.reach import Reach, Verdict


class Stage(enum.StrEnum):
    """CRI lifecycle points at which hooks run; names match Koordinator's hook stages."""

    PRE_RUN_POD_SANDBOX = "PreRunPodSandbox"
    PRE_CREATE_CONTAINER = "PreCreateContainer"
    PRE_START_CONTAINER = "PreStartContainer"
    POST_START_CONTAINER = "PostStartContainer"
    PRE_UPDATE_CONTAINER_RESOURCES = "PreUpdateContainerResources"
    POST_STOP_CONTAINER = "PostStopContainer"
    POST_STOP_POD_SANDBOX = "PostStopPodSandbox"
    POST_REMOVE_CONTAINER = "PostRemoveContainer"
    POST_REMOVE_POD_SANDBOX = "PostRemovePodSandbox"

    @property
    def is_post(self) -> bool:
        """Post hooks observe; they can neither change nor fail the call."""
        return self.value.startswith("Post")

    @property
    def is_container(self) -> bool:
        return "Container" in self.value


@dataclass(frozen=True, slots=True)
class LinuxResources:
    """runtime.v1.LinuxContainerResources; 0 / empty means unset, as in proto3."""

    cpu_period: int = 0
    cpu_quota: int = 0
    cpu_shares: int = 0
    memory_limit_in_bytes: int = 0
    oom_score_adj: int = 0
    cpuset_cpus: str = ""
    cpuset_mems: str = ""
    memory_swap_limit_in_bytes: int = 0
    unified: Mapping[str, str] = field(default_factory=dict)


# LinuxResources' scalar fields: the same names in runtime.v1's and the hook service's
# LinuxContainerResources, and in ResourcesPatch
RESOURCE_FIELDS: tuple[str, ...] = (
    "cpu_period",
    "cpu_quota",
    "cpu_shares",
    "memory_limit_in_bytes",
    "oom_score_adj",
    "cpuset_cpus",
    "cpuset_mems",
    "memory_swap_limit_in_bytes",
)


def resource_values(res: LinuxResources) -> dict[str, Any]:
    """Every field by its proto name: what a LinuxContainerResources message (either protocol's)
    is built from, and what the store keeps."""
    return {**{f: getattr(res, f) for f in RESOURCE_FIELDS}, "unified": dict(res.unified)}


@dataclass(frozen=True, slots=True)
class ResourcesPatch:
    """Field-by-field change to LinuxResources: None leaves a field alone."""

    cpu_period: int | None = None
    cpu_quota: int | None = None
    cpu_shares: int | None = None
    memory_limit_in_bytes: int | None = None
    oom_score_adj: int | None = None
    cpuset_cpus: str | None = None
    cpuset_mems: str | None = None
    memory_swap_limit_in_bytes: int | None = None
    unified: Mapping[str, str] | None = None  # merged key by key

    def apply(self, base: LinuxResources | None) -> LinuxResources:
        out = base or LinuxResources()
        changes: dict[str, Any] = {}
        for name in RESOURCE_FIELDS:
            value = getattr(self, name)
            if value is not None:
                changes[name] = value
        if self.unified:
            changes["unified"] = {**out.unified, **self.unified}
        return replace(out, **changes) if changes else out


@dataclass(frozen=True, slots=True)
class PodInfo:
    """The pod as kubelet described it in PodSandboxConfig (sandbox id empty before RunPodSandbox)."""

    name: str
    namespace: str
    uid: str
    attempt: int = 0
    id: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    cgroup_parent: str = ""
    runtime_handler: str = ""
    resources: LinuxResources | None = None  # LinuxPodSandboxConfig.resources, when kubelet sends them
    overhead: LinuxResources | None = None  # LinuxPodSandboxConfig.overhead (RuntimeClass overhead)

    @property
    def ref(self) -> str:
        """How a pod is named in logs and errors."""
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class ContainerInfo:
    """The container as CreateContainer describes it (id empty before the runtime assigns one).

    Env values are str decoded with surrogateescape: CRI KeyValue is bytes at cri-api head, and a
    value that is not UTF-8 must survive the round trip unchanged.
    """

    name: str
    attempt: int = 0
    id: str = ""
    image: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    envs: tuple[tuple[str, str], ...] = ()
    mounts: tuple[Mount, ...] = ()
    devices: tuple[Device, ...] = ()
    cdi_devices: tuple[str, ...] = ()
    resources: LinuxResources | None = None

    def env(self, key: str) -> str | None:
        """Last value wins, as in the OCI runtime."""
        found = None
        for k, v in self.envs:
            if k == key:
                found = v
        return found


@dataclass(frozen=True, slots=True)
class HookContext:
    stage: Stage
    pod: PodInfo
    container: ContainerInfo | None = None
    # time.monotonic() by which kubelet wants the CRI call answered (its grpc-timeout); None when
    # the call set none or the stage runs after the call
    deadline: float | None = None

    def log_fields(self) -> dict[str, str]:
        return log_fields(self.pod, self.container)


def log_fields(pod: PodInfo, container: ContainerInfo | None = None) -> dict[str, str]:
    """The pod, and the container if there is one, as log records name them."""
    fields = {"pod": pod.ref}
    if container is not None:
        fields["container"] = container.name
    return fields


@dataclass(slots=True)
class Edit:
    """What one hook wants changed. Additions replace an existing entry with the same key
    (env name, container path, CDI name); removals happen before additions."""

    env: dict[str, str] = field(default_factory=dict)
    remove_env: set[str] = field(default_factory=set)
    add_mounts: list[Mount] = field(default_factory=list)
    remove_mounts: set[str] = field(default_factory=set)  # container paths
    add_devices: list[Device] = field(default_factory=list)
    remove_devices: set[str] = field(default_factory=set)  # container paths
    add_cdi_devices: list[str] = field(default_factory=list)
    remove_cdi_devices: set[str] = field(default_factory=set)
    annotations: dict[str, str] = field(default_factory=dict)
    remove_annotations: set[str] = field(default_factory=set)
    labels: dict[str, str] = field(default_factory=dict)  # pod stages only
    resources: ResourcesPatch | None = None
    cgroup_parent: str | None = None  # pod stages only

    def is_empty(self) -> bool:
        return not (
            self.env
            or self.remove_env
            or self.add_mounts
            or self.remove_mounts
            or self.add_devices
            or self.remove_devices
            or self.add_cdi_devices
            or self.remove_cdi_devices
            or self.annotations
            or self.remove_annotations
            or self.labels
            or self.resources
            or self.cgroup_parent
        )

    def summary(self) -> dict[str, Any]:
        """Compact record of the edit for the store and `crihook inspect`."""
        out: dict[str, Any] = {}
        if self.env:
            out["env"] = dict(self.env)
        if self.remove_env:
            out["remove_env"] = sorted(self.remove_env)
        if self.add_devices:
            out["devices"] = [d.host_path for d in self.add_devices]
        if self.remove_devices:
            out["remove_devices"] = sorted(self.remove_devices)
        if self.add_mounts:
            out["mounts"] = [f"{m.host_path}:{m.container_path}" for m in self.add_mounts]
        if self.remove_mounts:
            out["remove_mounts"] = sorted(self.remove_mounts)
        if self.add_cdi_devices:
            out["cdi_devices"] = list(self.add_cdi_devices)
        if self.remove_cdi_devices:
            out["remove_cdi_devices"] = sorted(self.remove_cdi_devices)
        if self.annotations:
            out["annotations"] = dict(self.annotations)
        if self.remove_annotations:
            out["remove_annotations"] = sorted(self.remove_annotations)
        if self.labels:
            out["labels"] = dict(self.labels)
        if self.resources is not None:
            out["resources"] = {k: v for k in ResourcesPatch.__slots__ if (v := getattr(self.resources, k)) is not None}
        if self.cgroup_parent:
            out["cgroup_parent"] = self.cgroup_parent
        return out


class HookError(Exception):
    """A hook refusing a call. The code is what kubelet sees; the reason must name the cause."""

    def __init__(self, code: grpc.StatusCode, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


@runtime_checkable
class Hook(Protocol):
    """An in-process hook, made by its `Factory`.

    `handle` may be a coroutine function (it must then never block) or a plain function (it is run
    in a worker thread so a slow one cannot stall the proxy). Returning None means no change.
    """

    name: str
    stages: frozenset[Stage]
    priority: int  # lower runs first; ties broken by name

    def handle(self, ctx: HookContext) -> Edit | None: ...


class Miss(enum.Enum):
    """A `Recalls` hook's answer when it holds too little to answer without a read."""

    MISS = "miss"


MISS = Miss.MISS


@runtime_checkable
class Recalls(Protocol):
    """A blocking hook that can often answer from what it remembers (the gpu hook from its
    file-system memo, the rdma hook for a container with no RDMA device). The chain calls
    `handle_cached` on the event loop first, which must never block; when it answers MISS, `handle`
    runs on a worker thread as for any blocking hook. What a hook remembers is its own affair
    (hooks/fscache.py for files): the chain sees only the answer."""

    def handle_cached(self, ctx: HookContext) -> Edit | Miss | None: ...


Factory = Callable[[Any, NodeConfig], Hook]
"""What an entry point of group `crihook.hooks` names: `factory(options: O, node: NodeConfig) -> Hook`,
where O, the annotation of `options`, is the frozen dataclass declaring the hook's `[hooks.<name>]`
keys (crihook.base.config.check_table says which types and checks it may use). The chain checks
the table against O and hands the factory the result: a factory never sees an unchecked option."""


def options_type(factory: Factory) -> type[DataclassInstance]:
    """The options `factory` declares; NoOptions when it annotates none (a test's lambda)."""
    declared: type[DataclassInstance] = typing.get_type_hints(factory).get("options", NoOptions)
    return declared


class PodRecordView(Protocol):
    """What hooks and their views read of a pod crihook's store recorded (node.records.PodRecord):
    the gpu hook its placement, the CreateContainer view what the hooks made of it at RunPodSandbox."""

    @property
    def id(self) -> str: ...
    @property
    def uid(self) -> str: ...
    @property
    def labels(self) -> Mapping[str, str]: ...
    @property
    def annotations(self) -> Mapping[str, str]: ...
    @property
    def cgroup_parent(self) -> str: ...


class ContainerRecordView(Protocol):
    """What a hook reads of a container crihook's store recorded (node.records.ContainerRecord)."""

    @property
    def pod_id(self) -> str: ...
    @property
    def name(self) -> str: ...


class RecordStore(Protocol):
    """What a hook reads of crihook's store (node.store.Store: hooks sit below it)."""

    @property
    def pods(self) -> Mapping[str, PodRecordView]: ...
    @property
    def containers(self) -> Mapping[str, ContainerRecordView]: ...


@runtime_checkable
class NeedsStore(Protocol):
    """A hook that asks about the node's other pods and containers (the gpu hook: which pods the
    scheduler placed, which containers exist). The daemon hands it crihook's store once rebuilt."""

    def attach_store(self, store: RecordStore) -> None: ...


@runtime_checkable
class NamesHostPaths(Protocol):
    """A hook whose own configuration names host paths it mounts (the gpu hook: HAMi-core's library,
    preload file, cache and lock directories). The operator wrote them in crihook's config, so the
    chain's allowlist takes them as it takes hooks.allowed_host_paths: a shared GPU works as shipped."""

    def host_paths(self) -> tuple[str, ...]: ...


@runtime_checkable
class PreparesPods(Protocol):
    """A hook with per-pod work it can do before the pod's first CreateContainer (the gpu and rdma
    hooks: parsing the allocation annotation). The chain calls it once the pod's sandbox has started,
    after kubelet has its answer, so that work is on no call's path."""

    def prepare_pod(self, pod: PodInfo) -> None: ...


@runtime_checkable
class OwnsGpus(Protocol):
    """A hook that keeps the node's GPU index. The daemon's device reporter refreshes the index each
    round and publishes a device-plugin GPU only when `plugin_holds` says its holder really uses it."""

    gpus: GpuIndex

    def plugin_holds(self, pod_uid: str) -> bool: ...


@runtime_checkable
class JudgesGpus(Protocol):
    """A hook that can say which GPUs a container reaches that nobody granted (the gpu hook,
    through hooks.reach.judge): the NRI plugin asks it about containers made without the chain
    (Synchronize, the CRI catch-up, StartContainer) and about what an adjustment leaves. `verdict`
    reads the node (blocking: call it on a worker thread) and raises hooks.reach.Undecided when a
    fact it needs can not be had: never a finding."""

    def verdict(self, pod: PodInfo, container: ContainerInfo, reach: Reach) -> Verdict: ...


@runtime_checkable
class ForgetsContainers(Protocol):
    """A hook that keeps something of a container from its CreateContainer on (the gpu hook: the
    GPUs it let through, so two containers created at once can not share one). `forget` is called
    when the runtime did not create the container after all, and when it is removed: nothing of it
    outlives it."""

    def forget(self, pod_uid: str, container: str) -> None: ...
