"""GPU fragmentation of nodes against a workload, vectorised (Weng et al., ATC '23, "FGD").

A node's fragmentation for one pod shape is the idle GPU capacity that shape can not use: all of
it when the shape does not fit the node at all (too little CPU, too few GPUs with enough room),
else the idle capacity of the GPUs too small for one share of it. Weighted by how common each
shape is in the workload, that is the expected amount of idle GPU the next pod can not use.
Units: GPU capacity in percent of one GPU, CPU in millicores.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True, order=True)
class Shape:
    """One kind of pod: CPU, GPU percent per GPU (0 for CPU-only pods) and GPU count."""

    cpu: int
    pct: int
    count: int


@dataclass(frozen=True, slots=True)
class Typical:
    """The shapes that make up most of a workload, with their weights (summing to 1)."""

    cpu: np.ndarray
    pct: np.ndarray
    count: np.ndarray
    weight: np.ndarray

    @classmethod
    def of(cls, shapes: Counter[Shape] | dict[Shape, float], coverage: float = 0.95) -> Typical:
        """The most frequent shapes until `coverage` of all pods is covered (FGD's "typical pods");
        ties in frequency are ordered by shape so the result does not depend on arrival order."""
        total = float(sum(shapes.values()))
        ranked = sorted(shapes.items(), key=lambda kv: (-kv[1], kv[0]))
        chosen: list[tuple[Shape, float]] = []
        covered = 0.0
        for shape, n in ranked:
            if total and covered >= coverage * total:
                break
            chosen.append((shape, n))
            covered += n
        w = np.array([n for _, n in chosen], dtype=np.float64)
        w = w / w.sum() if w.size and w.sum() > 0 else w
        return cls(
            cpu=np.array([s.cpu for s, _ in chosen], dtype=np.int64),
            pct=np.array([s.pct for s, _ in chosen], dtype=np.int64),
            count=np.array([s.count for s, _ in chosen], dtype=np.int64),
            weight=w,
        )


@dataclass(frozen=True, slots=True)
class Stats:
    """What fragmentation needs of K node states, per typical shape: GPUs with room for one share
    (K, M), idle capacity on GPUs too small for one share (K, M), all idle capacity (K,), CPU left (K,).
    A placement changes a few GPUs, so its effect is a delta on these, not a recount of the node."""

    nfit: np.ndarray
    small: np.ndarray
    total: np.ndarray
    cpu: np.ndarray


def stats(typ: Typical, cpu_left: np.ndarray, left: np.ndarray) -> Stats:
    fits = left[:, :, None] >= typ.pct  # (K, G, M)
    small = np.einsum("kg,kgm->km", left.astype(np.float64), ~fits)
    return Stats(fits.sum(axis=1), small, left.sum(axis=1).astype(np.float64), cpu_left)


def frag_of(typ: Typical, s: Stats) -> np.ndarray:
    """Expected unusable idle GPU percent; works on any leading shape (K,) or (K, O): for each shape,
    all idle GPU when the next pod of it does not fit (too little CPU, too few GPUs with room), else
    the idle GPU on the GPUs too small for one share."""
    usable = (s.nfit >= typ.count) & (s.cpu[..., None] >= typ.cpu) & (typ.pct > 0)  # CPU-only shapes use no GPU
    return np.where(usable, s.small, s.total[..., None]) @ typ.weight


def node_frag(typ: Typical, cpu_left: np.ndarray, left: np.ndarray) -> np.ndarray:
    """Expected unusable idle GPU percent of K node states: cpu_left (K,), left (K, G) percent per GPU
    (0 for absent or unhealthy GPUs). Returns (K,) floats."""
    return frag_of(typ, stats(typ, cpu_left, left))


def slot_deltas(typ: Typical, left: np.ndarray, pct: int) -> tuple[np.ndarray, np.ndarray]:
    """(K, G, M) changes of nfit and small when one share of `pct` is taken from each slot."""
    fit0 = left[:, :, None] >= typ.pct
    new = left - pct
    fit1 = new[:, :, None] >= typ.pct
    dsmall = np.where(fit1, 0, new[:, :, None]) - np.where(fit0, 0, left[:, :, None])
    return fit1.astype(np.int64) - fit0, dsmall.astype(np.float64)


def option_stats(typ: Typical, cpu_left: np.ndarray, left: np.ndarray, cpu: int, pct: int) -> tuple[Stats, Stats]:
    """Stats before (K,) and after (K, G) placing a one-GPU share of `pct` (with `cpu` millicores)
    on each slot; invalid slots are the caller's to mask."""
    s = stats(typ, cpu_left, left)
    dn, ds = slot_deltas(typ, left, pct)
    after = Stats(s.nfit[:, None, :] + dn, s.small[:, None, :] + ds, s.total[:, None] - pct, (cpu_left - cpu)[:, None])
    return s, after


def set_stats(
    typ: Typical, cpu_left: np.ndarray, left: np.ndarray, cpu: int, pct: int, chosen: np.ndarray
) -> tuple[Stats, Stats]:
    """Stats before and after (both (K,)) taking `pct` from every slot where `chosen` (K, G)."""
    s = stats(typ, cpu_left, left)
    dn, ds = slot_deltas(typ, left, pct)
    c = chosen.astype(np.int64)
    after = Stats(
        s.nfit + np.einsum("kg,kgm->km", c, dn),
        s.small + np.einsum("kg,kgm->km", c.astype(np.float64), ds),
        s.total - pct * c.sum(axis=1),
        cpu_left - cpu,
    )
    return s, after
