"""DRA in `crihook simulate`: the trace's pods as ResourceClaims, allocated by the model of
Kubernetes' structured allocator (scheduler/structured.py) from the slices a driver publishes.

Three drivers, as they publish GPUs:
- `dra-nvidia`, NVIDIA's `gpu.nvidia.com`: one exclusive device per GPU (`uuid`, `productName`,
  `index`). A claim asks for whole GPUs, so a pod that wants part of a GPU gets a whole one.
- `dra-hami`, HAMi's `hami-core-gpu.project-hami.io`: one device per GPU with the capacities `cores`
  (100) and `memory`, allocatable many times (consumable capacity); a share asks for its cores and
  memory, a whole GPU for nothing (all of both).
- `dra-crihook`, crihook's `gpu.crihook.io` (names from crihook/base/dra.py): as HAMi's, plus
  `numaNode` and the NVLink partition ids `nvlinkPartition2/4/8` of an 8-GPU board (pairs, quads,
  the board: the trace has no topology); a multi-GPU claim is crihook's template, `firstAvailable`
  of the same partition, the same NUMA node, then any.

kube-scheduler picks the node and the allocator the devices in it. For NVIDIA's and HAMi's drivers
the node is kube-scheduler's default choice (NodeResourcesFit's LeastAllocated plus
NodeResourcesBalancedAllocation over CPU and memory, pkg/scheduler/framework/plugins/noderesources:
integer scores, ties to the first node in the run's random node order); with crihook's driver
crihook's default policy scores the nodes, as the extender does for annotation pods (it does not
score DRA pods yet). Either way the devices inside the node are the allocator's first solution:
first fit in published order.

Filter stays the allocator's array check (DeviceShare): for these claims a node has a solution
exactly when enough GPUs have the room (the `any` fallback makes the constraints never refuse a
node), and `pick` asserts it: a node that passed Filter and has no solution is a model error.
"""

from __future__ import annotations

import numpy as np

from crihook.base import dra
from crihook.scheduler.devices import NodeDevices
from crihook.scheduler.plugin import Cluster, Policy
from crihook.scheduler.request import PodRequest
from crihook.scheduler.structured import (
    Capacity,
    Claim,
    Device,
    InUse,
    MatchAttribute,
    Request,
    RequestPolicy,
    Slice,
    Sub,
    allocate,
    lookup,
)

NVIDIA, HAMI, CRIHOOK = "dra-nvidia", "dra-hami", "dra-crihook"
VARIANTS = (NVIDIA, HAMI, CRIHOOK)
DRIVERS = {NVIDIA: "gpu.nvidia.com", HAMI: "hami-core-gpu.project-hami.io", CRIHOOK: dra.DRIVER}
MODEL_ATTR = {NVIDIA: "productName", HAMI: "productName", CRIHOOK: dra.ATTR_MODEL}
CORES = RequestPolicy(default=100, min=1, max=100, step=1)


class ModelError(AssertionError):
    """The allocator found no devices on a node Filter passed: the simulation's model is wrong."""


def publish(variant: str, node: NodeDevices) -> Slice:
    """The node's GPUs as the variant's driver publishes them: one slice, one pool per node."""
    devices = []
    for g in node.gpus:
        attrs: dict[str, str | int | bool] = {"uuid": g.uuid, MODEL_ATTR[variant]: g.model, "index": g.minor}
        if variant == NVIDIA:
            devices.append(Device(f"gpu-{g.minor}", attrs))
            continue
        caps = {dra.CAPACITY_CORES: Capacity(100, CORES), dra.CAPACITY_MEMORY: Capacity(g.memory)}
        if variant == CRIHOOK:
            attrs[dra.ATTR_NUMA_NODE] = g.numa if g.numa >= 0 else g.minor * 2 // max(len(node.gpus), 1)
            for size in (2, 4, 8):
                if len(node.gpus) >= size:
                    attrs[dra.partition_attribute(size)] = str(g.minor // size)
        devices.append(Device(f"gpu-{g.minor}", attrs, caps, multiple=True))
    return Slice(DRIVERS[variant], node.name, tuple(devices))


def claim_for(variant: str, req: PodRequest, gpu_memory: int) -> Claim:
    """The pod's GPUs as the ResourceClaim a user of the variant's driver writes."""
    driver = DRIVERS[variant]
    sel = req.selectors
    model = f"{driver}/{MODEL_ATTR[variant]}"

    def selector(drv: str, dev: Device) -> bool:
        return (
            drv == driver
            and sel.refuses(str(lookup(dev, drv, model) or ""), str(dev.attributes.get("uuid", ""))) is None
        )

    capacity: dict[str, int] = {}
    if req.shared and variant != NVIDIA:
        capacity = {dra.CAPACITY_CORES: req.core, dra.CAPACITY_MEMORY: req.memory_on(gpu_memory)}
    count = req.count
    if variant == CRIHOOK and count > 1 and not req.shared:
        part = dra.partition_attribute(next((s for s in (2, 4, 8) if s >= count), 8))
        subs = tuple(Sub(name, count, selector) for name in ("nvlink", "numa", "any"))
        return Claim(
            (Request("gpus", first_available=subs),),
            (
                MatchAttribute(f"{driver}/{part}", ("gpus/nvlink",)),
                MatchAttribute(f"{driver}/{dra.ATTR_NUMA_NODE}", ("gpus/numa",)),
            ),
        )
    return Claim((Request("gpus", exactly=Sub("gpus", count, selector, capacity)),))


def in_use(variant: str, st: Cluster, row: int, node: NodeDevices) -> InUse:
    """What the claims already allocated on the node hold, from the allocator's arrays."""
    driver = DRIVERS[variant]
    out = InUse()
    for col, g in enumerate(node.gpus):
        did = (driver, node.name, f"gpu-{g.minor}")
        cores = 100 - int(st.core_free[row, col])
        memory = int(st.mem_total[row, col] - st.mem_free[row, col])
        if variant == NVIDIA:
            if cores or memory:
                out.devices.add(did)
        elif cores or memory:
            out.consumed[did] = {f"{driver}/cores": cores, f"{driver}/memory": memory}
    return out


class DraPolicy:
    """Nodes scored by `scorer` (crihook's policy) or by kube-scheduler's defaults (None); the GPUs
    inside the node chosen by the structured allocator."""

    def __init__(self, variant: str, scorer: Policy | None = None) -> None:
        self.variant = variant
        self.scorer = scorer

    def observe(self, req: PodRequest) -> None:
        if self.scorer is not None:
            self.scorer.observe(req)

    def scores(self, st: Cluster, req: PodRequest, rows: np.ndarray, fits: np.ndarray) -> np.ndarray:
        if self.scorer is not None:
            return self.scorer.scores(st, req, rows, fits)
        return kube_default_scores(st, req, rows)

    def pick(self, st: Cluster, req: PodRequest, row: int, fits: np.ndarray) -> list[int]:
        node = st.nodes[row]
        assert node is not None
        res = allocate(
            [publish(self.variant, node)],
            [claim_for(self.variant, req, int(st.mem_total[row, 0]))],
            in_use(self.variant, st, row, node),
        )
        if res is None:
            raise ModelError(f"node {node.name}: Filter passed {req.key}, the allocator found no devices")
        cols = {f"gpu-{g.minor}": col for col, g in enumerate(node.gpus)}
        return [cols[r.device[2]] for r in res[0]]


def kube_default_scores(st: Cluster, req: PodRequest, rows: np.ndarray) -> np.ndarray:
    """kube-scheduler's default scoring of CPU and memory: LeastAllocated (the free share after the
    pod, per resource, in integer percent, averaged) plus BalancedAllocation (100 * (1 - the
    standard deviation of the requested shares), two resources: |a - b| / 2)."""
    cap = st.host_cap[rows]
    free = np.stack([st.cpu_free[rows], st.hmem_free[rows]], axis=1)
    used = cap - free + np.array([req.cpu_milli, req.host_memory], np.int64)
    ok = (cap > 0) & (used <= cap)
    least = np.where(ok, (cap - used) * 100 // np.maximum(cap, 1), 0).sum(axis=1) // 2
    share = np.minimum(np.where(cap > 0, used / np.maximum(cap, 1), 1.0), 1.0)
    balanced = ((1.0 - np.abs(share[:, 0] - share[:, 1]) / 2) * 100).astype(np.int64)
    out: np.ndarray = (least + balanced).astype(np.float64)
    return out
