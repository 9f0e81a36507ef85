"""The default node score: FGD's fragmentation bucket, ties ordered by CPU-bound stranding.

For every node that fits, the pod is placed hypothetically (on each GPU that can take a share, or
on the best-fitting whole GPUs) and two growths are measured against the pod shapes seen so far
(scheduler/frag.py): FGD's fragmentation growth d (idle GPU the next pod can not use) and the
CPU-bound growth c (the same, with each shape's usable GPU also capped by the CPU left for as many
pods of that shape). In percent of one GPU, with s(x) = 1 / (1 + exp(x / 100)):

    score = (floor(100 * s(d)) + 0.9 * s(c)) * 100 / 100.9        (0..100, higher is better)

The integer bucket is FGD's score (growths within about 4 % of a GPU tie); the fraction, always
below 1, only orders the nodes the bucket ties, which FGD leaves to the node order. It sends a pod
to the node whose CPU it strands least: CPU-heavy pods to CPU-rich nodes, CPU-only pods away from
nodes whose GPUs still need their CPU. Remaining ties go to the first node in the scheduler's
order. Minimising d exactly was measured no better on the Alibaba trace than the bucket: the bucket
keeps FGD's good placements and the fraction refines them.

Results are cached per request shape and node version: a pod changes one node, so the next pod of
the same shape recomputes one row, not the cluster.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from crihook.scheduler.frag import Shape, Stats, Typical, frag_of, option_stats, set_stats

if TYPE_CHECKING:
    from crihook.scheduler.plugin import Cluster
    from crihook.scheduler.request import PodRequest

TIE = 0.9  # weight of the CPU-aware tie-break: below 1, so it only orders nodes FGD's bucket ties
NO_HOST = 2**62  # CPU left on nodes whose allocatable is not known: never the limit


def share_pct(req: PodRequest) -> int:
    """One share of the request in percent of a GPU (memory in bytes counts by its core)."""
    return max(req.core, req.ratio, 1)


def shape_of(req: PodRequest) -> Shape:
    return Shape(req.cpu_milli, share_pct(req) if req.count else 0, req.count)


def host_cpu(st: Cluster, rows: np.ndarray) -> np.ndarray:
    return np.where(st.host_known[rows], st.cpu_free[rows], NO_HOST)


def placements(
    typ: Typical, st: Cluster, req: PodRequest, rows: np.ndarray, fits: np.ndarray
) -> tuple[Stats, Stats, np.ndarray]:
    """Node stats before (K,) and after each option (K, O), and which options are valid (K, O). A
    one-GPU share has one option per GPU slot (option o = slot o); anything else has one option:
    the best-fitting slots (least idle first, then lowest slot)."""
    left = st.left(rows)
    cpu = host_cpu(st, rows)
    pct = share_pct(req) if req.count else 0
    if req.count == 1 and req.shared:
        before, after = option_stats(typ, cpu, left, req.cpu_milli, pct)
        return before, after, fits
    chosen = np.zeros(left.shape, bool)
    if req.count:
        np.put_along_axis(chosen, best_fit_cols(left, fits, req.count), True, axis=1)
    before, after = set_stats(typ, cpu, left, req.cpu_milli, pct, chosen)
    return (
        before,
        Stats(after.nfit[:, None], after.small[:, None], after.total[:, None], after.cpu[:, None]),
        (np.ones((left.shape[0], 1), bool)),
    )


def growth(typ: Typical, before: Stats, after: Stats, cpu_bound: bool = False) -> np.ndarray:
    """Fragmentation growth of each option (K, O), in percent of a GPU."""
    return frag_of(typ, after, cpu_bound) - frag_of(typ, before, cpu_bound)[:, None]


def bucket(growth: np.ndarray) -> np.ndarray:
    """Score buckets 0..100 of fragmentation growth (percent of a GPU): floor(100 * sigmoid(-growth / 100))."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.floor(100.0 / (1.0 + np.exp(np.clip(growth / 100.0, -50, 50))))


def best_fit_cols(left: np.ndarray, fits: np.ndarray, count: int) -> np.ndarray:
    order = np.argsort(np.where(fits, left, 10_000), axis=1, kind="stable")
    return order[:, :count]


@dataclass(slots=True)
class _Entry:
    epoch: int
    version: np.ndarray
    value: np.ndarray
    choice: np.ndarray


Evaluate = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


class ShapeCache:
    """Per-node results by request shape, valid while the node's version is unchanged: a pod
    changes one node, so the next pod of the same shape recomputes one row, not the cluster."""

    def __init__(self) -> None:
        self.entries: dict[tuple, _Entry] = {}

    def clear(self) -> None:
        self.entries.clear()

    def get(
        self, st: Cluster, req: PodRequest, rows: np.ndarray, fits: np.ndarray, evaluate: Evaluate
    ) -> tuple[np.ndarray, np.ndarray]:
        if req.selectors:  # the selection changes which GPUs count: not a shape of its own
            return evaluate(rows, fits)
        key = (req.count, req.core, req.ratio, req.memory, req.cpu_milli)
        ent = self.entries.get(key)
        n = st.version.size
        if ent is None or ent.epoch != st.epoch or ent.version.size != n:
            ent = _Entry(st.epoch, np.full(n, -1, np.int64), np.zeros(n), np.zeros(n, np.int64))
            self.entries[key] = ent
        pos = np.flatnonzero(ent.version[rows] != st.version[rows])
        if pos.size:
            stale = rows[pos]
            ent.value[stale], ent.choice[stale] = evaluate(stale, fits[pos])
            ent.version[stale] = st.version[stale]
        return ent.value[rows], ent.choice[rows]


class DefaultPolicy:
    """FGD's bucket, then the least CPU-bound stranding; workload learned from the pods that arrive."""

    def __init__(self, coverage: float = 0.95, refresh: int = 1024) -> None:
        self.coverage = coverage
        self.refresh = refresh
        self.shapes: Counter[Shape] = Counter()
        self.seen = 0
        self.typ = Typical.of({}, coverage)
        self.cache = ShapeCache()

    def observe(self, req: PodRequest) -> None:
        """Learn the workload: re-derive the typical shapes at 1, 2, 4 … pods, then every `refresh`."""
        self.shapes[shape_of(req)] += 1
        self.seen += 1
        n = self.seen
        if ((n & (n - 1)) == 0 and n < self.refresh) or n % self.refresh == 0:
            self.typ = Typical.of(self.shapes, self.coverage)
            self.cache.clear()

    def _evaluate(
        self, st: Cluster, req: PodRequest, rows: np.ndarray, fits: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(score (K,), chosen option (K,)): the best option's score, the first option that has it."""
        before, after, valid = placements(self.typ, st, req, rows, fits)
        fgd = bucket(growth(self.typ, before, after))
        stranded = growth(self.typ, before, after, cpu_bound=True)
        with np.errstate(over="ignore"):
            tie = 1.0 / (1.0 + np.exp(np.clip(stranded / 100.0, -50, 50)))
        q = np.where(valid, (fgd + TIE * tie) * (100.0 / (100.0 + TIE)), -1.0)
        return q.max(axis=1), np.argmax(q, axis=1)

    def scores(self, st: Cluster, req: PodRequest, rows: np.ndarray, fits: np.ndarray) -> np.ndarray:
        return self.cache.get(st, req, rows, fits, lambda r, f: self._evaluate(st, req, r, f))[0]

    def pick(self, st: Cluster, req: PodRequest, row: int, fits: np.ndarray) -> list[int]:
        rows = np.array([row])
        if req.count == 1 and req.shared:
            _, choice = self._evaluate(st, req, rows, fits[None, :])
            return [int(choice[0])]
        return [int(c) for c in best_fit_cols(st.left(rows), fits[None, :], req.count)[0]]
