"""Which victims to evict on a node so a pod's GPUs fit: the extender's preempt verb.

kube-scheduler's DefaultPreemption picks victims per node from resource counts, and node
allocatable can not say which GPU a pod holds; it then asks the extender (ProcessPreemption in
pkg/scheduler/framework/extender.go) with its candidate nodes and victims. We answer, per node, the
fewest victims whose GPUs make room for the pod, and among as few, the ones of lowest priority.
Victims that hold no GPU we know of stay in the answer: kube-scheduler chose them for resources we
do not judge (CPU, memory, ports). A node where no allowed set of victims makes room is dropped.

The victims may go beyond kube-scheduler's list: `extra` are pods on the node that hold GPUs and
have a lower priority than the preemptor (kube-scheduler maps any pod of the node's back from its
UID, convertPodUIDToPod). This matters where kube-scheduler's in-tree dry run found the node fit
for everything it counts and so offers it with no victims at all (GPU resources are
ignoredByScheduler): such a placeholder candidate is what newer kube-schedulers send to preemption
extenders. A set with fewer extras wins among sets of one size, so kube-scheduler's own choice
(which has PodDisruptionBudgets weighed in) is preferred.

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


def choose(
    plugin: DeviceShare, req: PodRequest, node: str, victims: Sequence[Victim], extra: Sequence[Victim] = ()
) -> list[Victim] | None:
    """The victims to evict on `node` (kube-scheduler's in the order given, then extras), or None
    when evicting every allowed one would still leave the pod's GPUs without room."""
    held = plugin.by_node.get(node, set())
    given = {v.uid for v in victims}
    extras = {v.uid for v in extra if v.uid in held and v.uid not in given}
    gpu = sorted(
        [v for v in victims if v.uid in held] + [v for v in extra if v.uid in extras],
        key=lambda v: (v.uid in extras, v.priority, v.uid),
    )
    kept = [v for v in victims if v.uid not in held]
    if not plugin.fits_without(req, node, [v.uid for v in gpu]):
        return None
    chosen = _fewest(plugin, req, node, gpu, extras)
    if chosen is None:
        chosen = _reprieve(plugin, req, node, gpu, extras)
    pick = {v.uid for v in chosen} | {v.uid for v in kept}
    out = [v for v in victims if v.uid in pick] + [v for v in chosen if v.uid in extras]
    # no GPU victim needed: kube-scheduler's own victims stand (an empty list keeps a placeholder)
    return out or list(victims)


def _fewest(
    plugin: DeviceShare, req: PodRequest, node: str, gpu: list[Victim], extras: set[str]
) -> list[Victim] | None:
    """Smallest set first; within a size the fewest extras, then the lowest highest priority, then
    the lowest sum. None when the check budget runs out before an answer."""
    checks = 0
    for k in range(len(gpu) + 1):
        best: tuple[tuple[int, int, int], tuple[Victim, ...]] | None = None
        for combo in combinations(gpu, k):
            checks += 1
            if checks > EXACT_CHECKS:
                return None if best is None else list(best[1])
            if plugin.fits_without(req, node, [v.uid for v in combo]):
                key = (
                    sum(v.uid in extras for v in combo),
                    max((v.priority for v in combo), default=0),
                    sum(v.priority for v in combo),
                )
                if best is None or key < best[0]:
                    best = (key, combo)
        if best is not None:
            return list(best[1])
    return None


def _reprieve(plugin: DeviceShare, req: PodRequest, node: str, gpu: list[Victim], extras: set[str]) -> list[Victim]:
    """kube-scheduler's way: evict all, then spare victims while the pod still fits, extras and
    higher priorities first."""
    evict = list(gpu)
    for v in sorted(gpu, key=lambda v: (v.uid not in extras, -v.priority, v.uid)):
        rest = [u.uid for u in evict if u is not v]
        if plugin.fits_without(req, node, rest):
            evict.remove(v)
    return evict
