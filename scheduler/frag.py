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


def node_frag(typ: Typical, cpu_left: np.ndarray, left: np.ndarray) -> np.ndarray:
    """Expected unusable idle GPU percent of K node states: cpu_left (K,), left (K, G) percent per GPU
    (0 for absent or unhealthy GPUs). Returns (K,) floats."""
    if typ.weight.size == 0:
        return np.zeros(left.shape[0])
    total = left.sum(axis=1, dtype=np.int64).astype(np.float64)  # (K,)
    gpu = typ.pct > 0  # CPU-only shapes can use no GPU: all idle GPU is fragment to them
    fits = left[:, :, None] >= typ.pct[None, None, :]  # (K, G, M)
    room = fits.sum(axis=1) >= typ.count[None, :]
    cpu_ok = cpu_left[:, None] >= typ.cpu[None, :]
    usable = room & cpu_ok & gpu[None, :]  # (K, M)
    small = np.einsum("kg,kgm->km", left.astype(np.float64), ~fits)  # idle on GPUs too small for one share
    per_shape = np.where(usable, small, total[:, None])
    return per_shape @ typ.weight
