"""A pod's device request, normalised and validated (seeds 000 and 001, HAMi selectors, partitions).

Every accepted form ends up as one shape: `count` GPUs, each with `core` percent of compute and
either `ratio` percent or `memory` bytes of GPU memory. Invalid combinations raise RequestError with
a sentence a user can act on; the admission webhook shows the same sentences.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal

from crihook.base import quantity
from crihook.base.allocation import GPU_CORE, GPU_MEMORY, GPU_MEMORY_RATIO, GPU_SHARED, KOORD_GPU, NVIDIA_GPU, RDMA
from crihook.base.errors import InputError
from crihook.scheduler.pod import Container, Pod

USE_GPUTYPE = "nvidia.com/use-gputype"
NOUSE_GPUTYPE = "nvidia.com/nouse-gputype"
USE_GPUUUID = "nvidia.com/use-gpuuuid"
NOUSE_GPUUUID = "nvidia.com/nouse-gpuuuid"
PARTITION_SPEC = "scheduling.koordinator.sh/gpu-partition-spec"
JOINT_ALLOCATE = "scheduling.koordinator.sh/device-joint-allocate"
STRATEGY = "gpu.crihook.io/allocate-strategy"  # per pod: binpack | spread | fragmentation
STRATEGIES = ("fragmentation", "binpack", "spread")

DEVICE_RESOURCES = (NVIDIA_GPU, KOORD_GPU, GPU_CORE, GPU_MEMORY, GPU_MEMORY_RATIO, GPU_SHARED, RDMA)
MAX_GPUS = 1024


class RequestError(InputError):
    """The pod's device request is invalid; says which pod and why."""

    def __init__(self, pod: str, reason: str) -> None:
        self.pod = pod
        super().__init__(f"pod {pod}", "", reason)


@dataclass(frozen=True, slots=True)
class PartitionSpec:
    restricted: bool = False  # Restricted: only the best-scored partitions; BestEffort: prefer them
    bandwidth: int = 0  # minimum ringBusBandwidth, bytes per second


@dataclass(frozen=True, slots=True)
class Selectors:
    """HAMi's GPU selection: type lists match case-insensitively as substrings of the model,
    UUID lists match exactly."""

    use_types: tuple[str, ...] = ()
    nouse_types: tuple[str, ...] = ()
    use_uuids: frozenset[str] = frozenset()
    nouse_uuids: frozenset[str] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.use_types or self.nouse_types or self.use_uuids or self.nouse_uuids)

    def refuses(self, model: str, uuid: str) -> str | None:
        """Why a GPU is excluded, or None."""
        m = model.upper()
        if self.use_types and not any(t in m for t in self.use_types):
            return f"model {model or '<unknown>'} is not in {USE_GPUTYPE}"
        if any(t in m for t in self.nouse_types):
            return f"model {model} is excluded by {NOUSE_GPUTYPE}"
        if self.use_uuids and uuid not in self.use_uuids:
            return f"{uuid or 'the GPU'} is not in {USE_GPUUUID}"
        if uuid in self.nouse_uuids:
            return f"{uuid} is excluded by {NOUSE_GPUUUID}"
        return None


@dataclass(frozen=True, slots=True)
class PodRequest:
    uid: str
    key: str  # namespace/name, for messages
    count: int = 0  # GPUs
    core: int = 0  # percent of one GPU's compute, per GPU
    ratio: int = 0  # percent of one GPU's memory, per GPU (0 when `memory` is given)
    memory: int = 0  # bytes per GPU (0 when `ratio` is given)
    rdma: int = 0  # NICs wanted (whole) or 1 for a share
    rdma_share: int = 0  # percent of each NIC
    cpu_milli: int = 0  # host requests, charged where the node's allocatable is known
    host_memory: int = 0
    selectors: Selectors = Selectors()
    partition: PartitionSpec | None = None
    joint: bool = False  # GPUs and NICs under the same PCIe switch
    strategy: str = ""  # per-pod override of the cluster strategy
    gpu_containers: tuple[tuple[str, int], ...] = ()  # (container, whole GPUs it asked for; 0 = shares all)

    @property
    def wants_devices(self) -> bool:
        return self.count > 0 or self.rdma > 0

    @property
    def shared(self) -> bool:
        """Shares a GPU with other pods (less than a whole GPU each)."""
        return self.count > 0 and not (self.core == 100 and self.ratio == 100)

    def memory_on(self, gpu_memory: int) -> int:
        """Bytes this request takes on one GPU with `gpu_memory` bytes. Ratios round down, so shares
        that add up to 100 % always fit together."""
        if self.memory:
            return self.memory
        return self.ratio * gpu_memory // 100


def _container_total(c: Container, pod: str) -> dict[str, Decimal]:
    out: dict[str, Decimal] = {}
    for name in (*DEVICE_RESOURCES, "cpu", "memory"):
        value = c.requests.get(name, c.limits.get(name))
        if value is None:
            continue
        try:
            v = quantity.parse(value)
        except quantity.QuantityError as e:
            raise RequestError(pod, f"container {c.name}: {name}: {e}") from None
        if v < 0:
            raise RequestError(pod, f"container {c.name}: {name} must not be negative")
        out[name] = v
    return out


def _whole(v: Decimal, pod: str, name: str) -> int:
    if v != v.to_integral_value():
        raise RequestError(pod, f"{name} must be a whole number, got {v}")
    return int(v)


def _list(text: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in text.split(",") if s.strip())


def parse_request(pod: Pod) -> PodRequest:
    """Normalise a pod's device request. Raises RequestError with a reason a user understands."""
    key = pod.key
    uid = pod.uid or key
    app = [c for c in pod.containers] + [c for c in pod.init_containers if c.sidecar]
    init = [c for c in pod.init_containers if not c.sidecar]
    per_container = {c.name: _container_total(c, key) for c in (*app, *init)}
    total: dict[str, Decimal] = {}
    for c in app:
        for k, v in per_container[c.name].items():
            total[k] = total.get(k, Decimal(0)) + v
    for c in init:  # init containers run one at a time, before the app: the pod needs the largest
        for k, v in per_container[c.name].items():
            total[k] = max(total.get(k, Decimal(0)), v)
    cpu_milli = int((total.get("cpu", Decimal(0)) * 1000).to_integral_value(rounding="ROUND_CEILING"))
    host_memory = int(total.get("memory", Decimal(0)).to_integral_value(rounding="ROUND_CEILING"))
    got = {k: v for k, v in total.items() if k in DEVICE_RESOURCES and v > 0}
    vendor = NVIDIA_GPU in got
    share_names = [n for n in (KOORD_GPU, GPU_CORE, GPU_MEMORY, GPU_MEMORY_RATIO, GPU_SHARED) if n in got]
    if vendor and share_names:
        raise RequestError(
            key, f"{NVIDIA_GPU} can not be combined with {', '.join(share_names)}: use either whole GPUs or shares"
        )
    if GPU_MEMORY in got and GPU_MEMORY_RATIO in got:
        raise RequestError(key, f"request either {GPU_MEMORY} or {GPU_MEMORY_RATIO}, not both")
    if KOORD_GPU in got and (GPU_CORE in got or GPU_MEMORY_RATIO in got or GPU_MEMORY in got):
        raise RequestError(key, f"{KOORD_GPU} already sets core and memory ratio; do not add {GPU_CORE} or memory")
    count = core = ratio = memory = 0
    if vendor:
        count = _whole(got[NVIDIA_GPU], key, NVIDIA_GPU)
        core = ratio = 100
    elif KOORD_GPU in got or GPU_CORE in got or GPU_MEMORY in got or GPU_MEMORY_RATIO in got or GPU_SHARED in got:
        if GPU_CORE in got and GPU_MEMORY not in got and GPU_MEMORY_RATIO not in got:
            raise RequestError(key, f"{GPU_CORE} needs {GPU_MEMORY} or {GPU_MEMORY_RATIO} beside it")
        if KOORD_GPU in got:
            core_total = ratio_total = _percent(got[KOORD_GPU], key, KOORD_GPU)
            # the webhook's rule for the deprecated name: whole GPUs when a multiple of 100, else one
            shared = core_total // 100 if core_total % 100 == 0 else 1
            if GPU_SHARED in got:
                shared = _whole(got[GPU_SHARED], key, GPU_SHARED)
        else:
            if GPU_SHARED not in got:
                raise RequestError(
                    key, f"GPU shares need {GPU_SHARED} (how many GPUs to spread the request over, at least 1)"
                )
            if GPU_MEMORY not in got and GPU_MEMORY_RATIO not in got:
                raise RequestError(key, f"{GPU_SHARED} needs {GPU_MEMORY} or {GPU_MEMORY_RATIO} beside it")
            shared = _whole(got[GPU_SHARED], key, GPU_SHARED)
            core_total = _percent(got[GPU_CORE], key, GPU_CORE) if GPU_CORE in got else 0
            ratio_total = _percent(got[GPU_MEMORY_RATIO], key, GPU_MEMORY_RATIO) if GPU_MEMORY_RATIO in got else 0
        if shared < 1 or shared > MAX_GPUS:
            raise RequestError(key, f"{GPU_SHARED} must be between 1 and {MAX_GPUS}")
        count = shared
        core = _split(core_total, shared, key, GPU_CORE)
        ratio = _split(ratio_total, shared, key, GPU_MEMORY_RATIO)
        if GPU_MEMORY in got:
            mem_total = _whole(got[GPU_MEMORY].to_integral_value(rounding="ROUND_CEILING"), key, GPU_MEMORY)
            if mem_total % shared:
                raise RequestError(key, f"{GPU_MEMORY} {mem_total} bytes does not split evenly over {shared} GPUs")
            memory = mem_total // shared
    if count > MAX_GPUS:
        raise RequestError(key, f"{count} GPUs is more than any node has")
    rdma = rdma_share = 0
    if RDMA in got:
        r = _percent(got[RDMA], key, RDMA)
        rdma, rdma_share = (r // 100, 100) if r >= 100 else (1, r)
    gpu_containers = []
    for c in (*app, *init):
        res = per_container[c.name]
        if any(res.get(n, 0) > 0 for n in (NVIDIA_GPU, KOORD_GPU, GPU_CORE, GPU_MEMORY, GPU_MEMORY_RATIO, GPU_SHARED)):
            gpu_containers.append((c.name, _whole(res[NVIDIA_GPU], key, NVIDIA_GPU) if vendor else 0))
    strategy = pod.annotations.get(STRATEGY, "")
    if strategy and strategy not in STRATEGIES:
        raise RequestError(key, f"annotation {STRATEGY}: {strategy!r} is not one of {', '.join(STRATEGIES)}")
    return PodRequest(
        uid=uid,
        key=key,
        count=count,
        core=core,
        ratio=ratio if not memory else 0,
        memory=memory,
        rdma=rdma,
        rdma_share=rdma_share,
        cpu_milli=cpu_milli,
        host_memory=host_memory,
        selectors=_selectors(pod.annotations),
        partition=_partition_spec(pod.annotations, key),
        joint=_joint(pod.annotations, key),
        strategy=strategy,
        gpu_containers=tuple(gpu_containers),
    )


def _percent(v: Decimal, pod: str, name: str) -> int:
    n = _whole(v, pod, name)
    if n > 100 and n % 100:
        raise RequestError(pod, f"{name} {n} is over 100, so it must be a multiple of 100 (whole GPUs)")
    return n


def _split(total: int, k: int, pod: str, name: str) -> int:
    if total % k:
        raise RequestError(pod, f"{name} {total} does not split evenly over {k} GPUs")
    each = total // k
    if each > 100:
        raise RequestError(pod, f"{name} {total} over {k} GPUs is {each} per GPU; one GPU has 100")
    return each


def _selectors(ann: Mapping[str, str]) -> Selectors:
    return Selectors(
        use_types=tuple(t.upper() for t in _list(ann.get(USE_GPUTYPE, ""))),
        nouse_types=tuple(t.upper() for t in _list(ann.get(NOUSE_GPUTYPE, ""))),
        use_uuids=frozenset(_list(ann.get(USE_GPUUUID, ""))),
        nouse_uuids=frozenset(_list(ann.get(NOUSE_GPUUUID, ""))),
    )


def _partition_spec(ann: Mapping[str, str], pod: str) -> PartitionSpec | None:
    text = ann.get(PARTITION_SPEC)
    if text is None:
        return None
    where = f"annotation {PARTITION_SPEC}"
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise RequestError(pod, f"{where}: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise RequestError(pod, f"{where}: expected an object")
    policy = doc.get("allocatePolicy", "BestEffort")
    if policy not in ("Restricted", "BestEffort"):
        raise RequestError(pod, f"{where}: allocatePolicy {policy!r} is not Restricted or BestEffort")
    bw = doc.get("ringBusBandwidth")
    bandwidth = 0
    if bw is not None:
        try:
            bandwidth = quantity.to_int(bw)
        except quantity.QuantityError as e:
            raise RequestError(pod, f"{where}: ringBusBandwidth: {e}") from None
    return PartitionSpec(restricted=policy == "Restricted", bandwidth=bandwidth)


def _joint(ann: Mapping[str, str], pod: str) -> bool:
    text = ann.get(JOINT_ALLOCATE)
    if text is None:
        return False
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise RequestError(pod, f"annotation {JOINT_ALLOCATE}: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise RequestError(pod, f"annotation {JOINT_ALLOCATE}: expected an object")
    types = doc.get("deviceTypes", ["gpu", "rdma"])
    if not isinstance(types, list) or not set(types) <= {"gpu", "rdma"}:
        raise RequestError(pod, f"annotation {JOINT_ALLOCATE}: deviceTypes must list gpu and rdma")
    scope = doc.get("requiredScope", "SamePCIe")
    if scope != "SamePCIe":
        raise RequestError(pod, f"annotation {JOINT_ALLOCATE}: requiredScope {scope!r} is not SamePCIe")
    return {"gpu", "rdma"} <= set(types)
