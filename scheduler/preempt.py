"""Which victims to evict on a node so a pod's GPUs fit: the extender's preempt verb.

kube-scheduler's DefaultPreemption picks victims per node from resource counts, and node
allocatable can not say which GPU a pod holds; it then asks the extender (ProcessPreemption in
pkg/scheduler/framework/extender.go) with its candidate nodes and victims. We answer, per node, the
fewest of those victims whose GPUs make room for the pod, and among as few, the ones of lowest
priority. Victims that hold no GPU we know of stay in the answer: kube-scheduler chose them for
resources we do not judge (CPU, memory, ports). A node where even all its victims leave the pod
without GPUs is dropped.

The search is exact (every set of k victims before any of k + 1) for up to `EXACT_CHECKS` fits
checks per node; beyond that it falls back to kube-scheduler's own procedure: evict all, then
reprieve victims from the highest priority down while the pod still fits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations

from crihook.scheduler.plugin import DeviceShare
from crihook.scheduler.request import PodRequest

EXACT_CHECKS = 256


@dataclass(frozen=True, slots=True)
class Victim:
    uid: str
    priority: int = 0


def choose(plugin: DeviceShare, req: PodRequest, node: str, victims: Sequence[Victim]) -> list[Victim] | None:
    """The victims to evict on `node` (a subset of `victims`, in the order given), or None when
    evicting all of them would still leave the pod's GPUs without room."""
    held = plugin.by_node.get(node, set())
    gpu = sorted((v for v in victims if v.uid in held), key=lambda v: (v.priority, v.uid))
    kept = [v for v in victims if v.uid not in held]
    if not plugin.fits_without(req, node, [v.uid for v in gpu]):
        return None
    chosen = _fewest(plugin, req, node, gpu)
    if chosen is None:
        chosen = _reprieve(plugin, req, node, gpu)
    pick = {v.uid for v in chosen} | {v.uid for v in kept}
    out = [v for v in victims if v.uid in pick]
    # kube-scheduler refuses a candidate without victims; with none needed for GPUs its own stand
    return out or list(victims)


def _fewest(plugin: DeviceShare, req: PodRequest, node: str, gpu: list[Victim]) -> list[Victim] | None:
    """Smallest set first; within a size the lowest highest priority, then the lowest sum. None
    when the check budget runs out before an answer."""
    checks = 0
    for k in range(len(gpu) + 1):
        best: tuple[tuple[int, int], tuple[Victim, ...]] | None = None
        for combo in combinations(gpu, k):
            checks += 1
            if checks > EXACT_CHECKS:
                return None if best is None else list(best[1])
            if plugin.fits_without(req, node, [v.uid for v in combo]):
                key = (max((v.priority for v in combo), default=0), sum(v.priority for v in combo))
                if best is None or key < best[0]:
                    best = (key, combo)
        if best is not None:
            return list(best[1])
    return None


def _reprieve(plugin: DeviceShare, req: PodRequest, node: str, gpu: list[Victim]) -> list[Victim]:
    evict = list(gpu)
    for v in sorted(gpu, key=lambda v: (-v.priority, v.uid)):
        rest = [u.uid for u in evict if u is not v]
        if plugin.fits_without(req, node, rest):
            evict.remove(v)
    return evict
