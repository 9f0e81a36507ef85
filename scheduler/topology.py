"""Choosing GPUs inside a node by interconnect (seed 003) and by partition table (seed 002).

- Whole GPUs: the set with the most NVLink lanes over its pairs, then the smallest summed PCIe
  level (closest common ancestors); among equals, the one that leaves the remaining GPUs best
  connected by the same measure, so later multi-GPU pods still find good groups; then the lowest
  minors.
- Pair affinity a(i, j) = NVLink lanes(i, j) + (50 - PCIe level(i, j)) / 50 (a lane outweighs any
  PCIe difference between one pair) is used for shared GPUs:
  with gpu.shared = k and shares, one score, S = mean pair affinity - LOAD_WEIGHT * mean
  load of the chosen GPUs (load = percent used / 100). With LOAD_WEIGHT = 1 an idle GPU over a PCIe
  hop beats a fully loaded NVLink peer, a half-loaded NVLink peer beats an idle PCIe one.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

from crihook.scheduler.devices import WORST_PCIE, Links, NodeDevices, Partition
from crihook.scheduler.request import PartitionSpec

LOAD_WEIGHT = 1.0
MAX_EXACT = 20_000  # subsets searched exhaustively; above that a greedy search from every seed GPU


def affinity(links: Links, a: int, b: int) -> float:
    return links.lanes(a, b) + (WORST_PCIE - links.level(a, b)) / WORST_PCIE


def set_affinity(links: Links, gpus: Sequence[int]) -> float:
    return sum(affinity(links, a, b) for a, b in itertools.combinations(gpus, 2))


def best_set(links: Links, free: Sequence[int], k: int, load: Mapping[int, int] | None = None) -> list[int]:
    """k minors out of `free` (see the module text for the rule). `load` (percent used per minor)
    switches to the shared-GPU score."""
    free = sorted(free)
    if k >= len(free):
        return free
    if _count(len(free), k) <= MAX_EXACT:
        sets: Sequence[tuple[int, ...]] = list(itertools.combinations(free, k))
    else:
        sets = _greedy(links, free, k)
    pairs = max(1, k * (k - 1) // 2)
    if load is not None:
        shared = max(
            sets,
            key=lambda s: (
                set_affinity(links, s) / pairs - LOAD_WEIGHT * sum(load[m] for m in s) / 100 / k,
                [-m for m in s],
            ),
        )
        return list(shared)
    rest_cache: dict[tuple[int, ...], tuple[int, int]] = {}

    def key(s: tuple[int, ...]) -> tuple[tuple[int, int], tuple[int, int], list[int]]:
        rest = tuple(m for m in free if m not in s)
        if rest not in rest_cache:
            rest_cache[rest] = link_key(links, rest)
        return (link_key(links, s), rest_cache[rest], [-m for m in s])

    best = max(sets, key=key)
    return list(best)


def link_key(links: Links, gpus: Sequence[int]) -> tuple[int, int]:
    """(total NVLink lanes, minus the summed PCIe levels) over all pairs: compared in that order."""
    pairs = list(itertools.combinations(gpus, 2))
    return sum(links.lanes(a, b) for a, b in pairs), -sum(links.level(a, b) for a, b in pairs)


def _count(n: int, k: int) -> int:
    from math import comb

    return comb(n, k)


def _greedy(links: Links, free: list[int], k: int) -> list[tuple[int, ...]]:
    out = []
    for seed in free:
        chosen = [seed]
        while len(chosen) < k:
            nxt = max(
                (m for m in free if m not in chosen), key=lambda m: (sum(affinity(links, m, c) for c in chosen), -m)
            )
            chosen.append(nxt)
        out.append(tuple(sorted(chosen)))
    return out


def pick_partition(
    node: NodeDevices, free: set[int], k: int, spec: PartitionSpec | None, busy: set[int]
) -> Partition | None:
    """A partition of size k whose GPUs are all free, or None.

    Restricted pods consider only the partitions with the table's best allocationScore for that size;
    BestEffort pods (and pods without a spec) prefer higher scores. A ringBusBandwidth in the spec is a
    minimum. Among equals the least fragmenting one wins: the one after which the most GPUs remain
    coverable by still-free partitions of the largest size (then of smaller sizes), then lowest minors.
    """
    table = node.partitions.get(k, ())
    cands = [p for p in table if p.minors <= free]
    if spec is not None and spec.bandwidth:
        cands = [p for p in cands if p.bandwidth >= spec.bandwidth]
    if spec is not None and spec.restricted and table:
        top = max(p.score for p in table)
        cands = [p for p in cands if p.score == top]
    if not cands:
        return None
    sizes = sorted(node.partitions, reverse=True)

    def remaining(p: Partition) -> tuple[int, ...]:
        taken = busy | p.minors
        return tuple(sum(1 for q in node.partitions[s] if not (q.minors & taken)) for s in sizes)

    return max(cands, key=lambda p: (p.score, remaining(p), [-m for m in sorted(p.minors)]))
