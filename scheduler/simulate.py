"""`crihook simulate`: replay a cluster trace through DeviceShare, as Weng et al. (ATC '23) do.

Trace format (Alibaba openb): nodes `sn,cpu_milli,memory_mib,gpu,model`; pods
`name,cpu_milli,memory_mib,num_gpu,gpu_milli[,gpu_spec,…]`. Per seed: pods sorted by name and
shuffled; the list tuned to 130 % of the cluster's GPUs (random pods appended, or removed); nodes
renamed in a random order, which is the tie-break order. Pods arrive one by one and never leave;
a pod that fits nowhere fails. After each pod the unallocated GPU share is recorded against the
arrived GPU request; the figure is its mean over the events whose arrival rounds to 100 %.

Every policy runs through the same plugin API the extender uses (pre_filter, score_nodes, which
scores exactly the nodes that pass Filter, and reserve); `default` is the allocator's own score,
the others are baselines, and `dra-*` the pods as ResourceClaims under Kubernetes' structured
allocator (scheduler/simulate_dra.py).
"""

from __future__ import annotations

import csv
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from crihook.scheduler import baselines, simulate_dra
from crihook.scheduler.devices import Gpu, NodeDevices
from crihook.scheduler.frag import Shape, Typical
from crihook.scheduler.outlook import model_set, types_of
from crihook.scheduler.plugin import DeviceShare, PluginConfig
from crihook.scheduler.pod import Container, Pod
from crihook.scheduler.request import parse_request
from crihook.scheduler.score import DefaultPolicy

POLICIES = ("default", "fgd", "bestfit", "dotprod", "random", *simulate_dra.VARIANTS)
TUNE = 1.3
GPU_MEMORY = 100 << 30  # any size works: trace shares are ratios of a GPU


class TraceError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class TraceNode:
    name: str
    cpu: int
    memory_mib: int
    gpus: int
    model: str


@dataclass(frozen=True, slots=True)
class TracePod:
    name: str
    cpu: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    gpu_spec: str = ""

    @property
    def gpu(self) -> int:
        """GPU request in milli-GPU."""
        return self.num_gpu * self.gpu_milli


def _rows(path: Path, required: Sequence[str]) -> Iterable[tuple[int, dict[str, str]]]:
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in required if c not in (reader.fieldnames or ())]
        if missing:
            raise TraceError(f"{path}: missing columns {', '.join(missing)}")
        yield from enumerate(reader, start=2)


def _int(row: dict[str, str], col: str, path: Path, line: int) -> int:
    try:
        v = int(row[col])
    except (TypeError, ValueError):
        raise TraceError(f"{path}:{line}: {col} must be an integer, got {row[col]!r}") from None
    if v < 0:
        raise TraceError(f"{path}:{line}: {col} must not be negative")
    return v


def read_nodes(path: Path) -> list[TraceNode]:
    out = []
    for line, r in _rows(path, ("sn", "cpu_milli", "memory_mib", "gpu", "model")):
        cpu, memory, gpus = (_int(r, c, path, line) for c in ("cpu_milli", "memory_mib", "gpu"))
        n = TraceNode(r["sn"], cpu, memory, gpus, r["model"] or "")
        if n.gpus:
            out.append(n)
    if not out:
        raise TraceError(f"{path}: no node with GPUs")
    return out


def read_pods(path: Path) -> list[TracePod]:
    out = []
    for line, r in _rows(path, ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")):
        cpu, memory, num_gpu, gpu_milli = (
            _int(r, c, path, line) for c in ("cpu_milli", "memory_mib", "num_gpu", "gpu_milli")
        )
        p = TracePod(r["name"], cpu, memory, num_gpu, gpu_milli, gpu_spec=r.get("gpu_spec") or "")
        if (p.num_gpu and not 0 < p.gpu_milli <= 1000) or p.gpu_milli % 10:
            raise TraceError(f"{path}:{line}: gpu_milli {p.gpu_milli} is not a multiple of 10 in 10..1000")
        if p.num_gpu > 1 and p.gpu_milli != 1000:
            raise TraceError(f"{path}:{line}: multi-GPU pods take whole GPUs")
        out.append(p)
    return sorted(out, key=lambda p: p.name)


def workload(pods: Sequence[TracePod], capacity_milli: int, seed: int) -> list[TracePod]:
    """Shuffle, then tune the list to TUNE x capacity (append random pods, or remove random ones)."""
    rng = np.random.default_rng(seed)
    order = [pods[i] for i in rng.permutation(len(pods))]
    target = TUNE * capacity_milli
    total = sum(p.gpu for p in order)
    if total < target:
        while total < target:
            p = pods[int(rng.integers(len(pods)))]
            order.append(p)
            total += p.gpu
    else:
        while total >= target:
            i = int(rng.integers(len(order)))
            total -= order.pop(i).gpu
    return order


def to_pod(p: TracePod, i: int, whole: bool = False) -> Pod:
    """The trace pod as a Pod; `whole`: its GPUs whole even when it wants part of one (a driver
    that shares nothing)."""
    req: dict[str, str] = {"cpu": f"{p.cpu}m", "memory": f"{p.memory_mib}Mi"}
    if p.num_gpu and (p.gpu_milli == 1000 or whole):
        req["nvidia.com/gpu"] = str(p.num_gpu)
    elif p.num_gpu:
        pct = str(p.gpu_milli // 10)
        req.update(
            {"koordinator.sh/gpu-core": pct, "koordinator.sh/gpu-memory-ratio": pct, "koordinator.sh/gpu.shared": "1"}
        )
    ann = {"nvidia.com/use-gputype": p.gpu_spec.replace("|", ",")} if p.gpu_spec else {}
    uid = f"{p.name}-{i}"
    return Pod(uid=uid, namespace="trace", name=uid, containers=(Container("main", req),), annotations=ann)


def typical_of(pods: Sequence[TracePod], models: Sequence[str]) -> Typical:
    """FGD's typical pods of the whole arrival list, keyed as the paper's simulator keys them: CPU,
    GPU share, GPU count and the GPU models the pod accepts (of the cluster's `models`)."""
    resolved: dict[str, tuple[str, ...] | None] = {}
    shapes: Counter[Shape] = Counter()
    for p in pods:
        spec = p.gpu_spec if p.num_gpu else ""
        if spec not in resolved:
            resolved[spec] = model_set(types_of(parse_request(to_pod(p, 0))), models)
        shapes[Shape(p.cpu, p.gpu_milli // 10, p.num_gpu, resolved[spec])] += 1
    return Typical.of(shapes)


def make_policy(name: str, pods: Sequence[TracePod], seed: int, models: Sequence[str] = ()) -> PluginConfig:
    if name == "default":
        return PluginConfig()
    if name == "fgd":
        return PluginConfig(policy=baselines.FGD(typical_of(pods, models)))
    if name == "bestfit":
        return PluginConfig(policy=baselines.BestFit())
    if name == "dotprod":
        return PluginConfig(policy=baselines.DotProd())
    if name == "random":
        return PluginConfig(policy=baselines.Random(seed))
    if name == simulate_dra.CRIHOOK:
        return PluginConfig(policy=simulate_dra.DraPolicy(name, DefaultPolicy()))
    if name in simulate_dra.VARIANTS:
        return PluginConfig(policy=simulate_dra.DraPolicy(name))
    raise TraceError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")


@dataclass(frozen=True, slots=True)
class Event:
    """One arrival: the pod, the node it went to (None: it failed) and the GPU arrived so far."""

    pod: TracePod
    node: TraceNode | None
    arrived: int  # milli-GPU


def replay(
    nodes: Sequence[TraceNode], pods: Sequence[TracePod], policy: str, seed: int
) -> Iterator[tuple[Event, DeviceShare]]:
    """Every arrival of one seeded run, with the allocator's state right after it."""
    capacity = 1000 * sum(n.gpus for n in nodes)
    arrivals = workload(pods, capacity, seed)
    ds = DeviceShare(make_policy(policy, arrivals, seed, sorted({n.model for n in nodes})))
    perm = np.random.default_rng(seed).permutation(len(nodes))
    by_name = {}
    for n, k in zip(nodes, perm, strict=True):
        gpus = tuple(Gpu(minor=g, uuid=f"{n.name}-gpu{g}", model=n.model, memory=GPU_MEMORY) for g in range(n.gpus))
        by_name[f"{k:04d}-{n.name}"] = n
        ds.set_node(NodeDevices(f"{k:04d}-{n.name}", gpus, cpu_milli=n.cpu, memory=n.memory_mib << 20))
    arrived = 0
    for i, tp in enumerate(arrivals):
        req = ds.pre_filter(to_pod(tp, i, whole=policy == simulate_dra.NVIDIA))
        arrived += tp.gpu
        scores = ds.score_nodes(req)  # the nodes that pass Filter, in name order, as Filter then Score
        best = None
        if scores:
            best = max(scores, key=scores.__getitem__)  # first in node order among equals
            ds.reserve(req, best)
        yield Event(tp, by_name[best] if best else None, arrived), ds


def run_once(nodes: Sequence[TraceNode], pods: Sequence[TracePod], policy: str, seed: int) -> dict[int, float]:
    """Unallocated GPU % by arrived GPU % (rounded), averaged over the events sharing it."""
    capacity = 1000 * sum(n.gpus for n in nodes)
    allocated = 0
    sums: dict[int, float] = {}
    counts: dict[int, int] = {}
    for ev, _ in replay(nodes, pods, policy, seed):
        allocated += ev.pod.gpu if ev.node else 0
        x = round(100 * ev.arrived / capacity)
        sums[x] = sums.get(x, 0.0) + 100.0 - 100.0 * allocated / capacity
        counts[x] = counts.get(x, 0) + 1
    return {x: sums[x] / counts[x] for x in sums}


def parse_seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        try:
            out.extend(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise TraceError(f"--seeds: {part!r} is not N or N-M") from None
    return out


def at_100(curve: dict[int, float]) -> float:
    """The curve at 100 % arrival; small traces jump over it, then the two neighbours interpolate."""
    if 100 in curve:
        return curve[100]
    lo, hi = max((x for x in curve if x < 100), default=None), min((x for x in curve if x > 100), default=None)
    if lo is None or hi is None:
        raise TraceError("the trace never reaches 100 % arrival")
    return curve[lo] + (curve[hi] - curve[lo]) * (100 - lo) / (hi - lo)
