"""GPU fragmentation of nodes against a workload, vectorised (Weng et al., ATC '23, "FGD").

A node's fragmentation for one pod shape is the idle GPU capacity that shape can not use: all of
it when the shape does not fit the node at all (too little CPU, too few GPUs with enough room, or
none of the GPU models it accepts), else the idle capacity of the GPUs too small for one share of
it or of a model it refuses. As in the paper's simulator, a shape pinned to GPU models finds every
idle GPU of any other model a fragment. Weighted by how common each
shape is in the workload, that is the expected amount of idle GPU the next pod can not use.
Units: GPU capacity in percent of one GPU, CPU in millicores.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True, slots=True)
class Shape:
    """One kind of pod: CPU, GPU percent per GPU (0 for CPU-only pods), GPU count and the GPU
    models it accepts (None: any model)."""

    cpu: int
    pct: int
    count: int
    models: tuple[str, ...] | None = None

    def key(self) -> tuple[int, int, int, bool, tuple[str, ...]]:
        return (self.cpu, self.pct, self.count, self.models is not None, self.models or ())


@dataclass(frozen=True, slots=True)
class Typical:
    """The shapes that make up most of a workload, with their weights (summing to 1)."""

    cpu: np.ndarray
    pct: np.ndarray
    count: np.ndarray
    weight: np.ndarray
    models: tuple[tuple[str, ...] | None, ...] = ()
    acc: np.ndarray | None = None  # (model id, shape): the shape accepts the model; None: all accept all

    def bind(self, names: Sequence[str]) -> Typical:
        """The same shapes with `acc` for a cluster whose model ids index `names`."""
        if all(m is None for m in self.models):
            return self if self.acc is None else replace(self, acc=None)
        acc = np.array([[m is None or name in m for m in self.models] for name in names], bool).reshape(len(names), -1)
        return replace(self, acc=acc)

    @classmethod
    def of(cls, shapes: Counter[Shape] | dict[Shape, float], coverage: float = 0.95) -> Typical:
        """The most frequent shapes until `coverage` of all pods is covered (FGD's "typical pods");
        ties in frequency are ordered by shape so the result does not depend on arrival order."""
        total = float(sum(shapes.values()))
        ranked = sorted(shapes.items(), key=lambda kv: (-kv[1], kv[0].key()))
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
            models=tuple(s.models for s, _ in chosen),
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


def _fits(typ: Typical, left: np.ndarray, model: np.ndarray | None) -> np.ndarray:
    """(..., M): the slots (idle percent `left`, model ids `model`) with room for one share of each
    shape, of a model it accepts."""
    fits = left[..., None] >= typ.pct
    if typ.acc is not None and model is not None:
        fits &= typ.acc[model]
    return fits


def stats(typ: Typical, cpu_left: np.ndarray, left: np.ndarray, model: np.ndarray | None = None) -> Stats:
    """Stats of K node states: CPU left (K,), idle percent per slot (K, G), model id per slot (K, G)
    (None: every shape accepts every slot)."""
    fits = _fits(typ, left, model)  # (K, G, M)
    small = np.einsum("kg,kgm->km", left.astype(np.float64), ~fits)
    return Stats(fits.sum(axis=1), small, left.sum(axis=1).astype(np.float64), cpu_left)


def frag_of(typ: Typical, s: Stats) -> np.ndarray:
    """Expected unusable idle GPU percent; works on any leading shape (K,) or (K, O): for each shape,
    all idle GPU when the next pod of it does not fit (too little CPU, too few GPUs with room of a
    model it accepts), else the idle GPU on the GPUs too small for one share or of a refused model."""
    usable = (s.nfit >= typ.count) & (s.cpu[..., None] >= typ.cpu) & (typ.pct > 0)  # CPU-only shapes use no GPU
    frag: np.ndarray = np.where(usable, s.small, s.total[..., None]) @ typ.weight
    return frag


def node_frag(typ: Typical, cpu_left: np.ndarray, left: np.ndarray, model: np.ndarray | None = None) -> np.ndarray:
    """Expected unusable idle GPU percent of K node states: cpu_left (K,), left (K, G) percent per GPU
    (0 for absent or unhealthy GPUs), model ids (K, G). Returns (K,) floats."""
    return frag_of(typ, stats(typ, cpu_left, left, model))


def _deltas(typ: Typical, left: np.ndarray, model: np.ndarray | None, pct: int) -> tuple[np.ndarray, np.ndarray]:
    """(..., M) changes of nfit and small when one share of `pct` is taken from slots with idle
    percent `left` and model ids `model`."""
    fit0 = _fits(typ, left, model)
    new = left - pct
    fit1 = _fits(typ, new, model)
    dsmall = np.where(fit1, 0, new[..., None]) - np.where(fit0, 0, left[..., None])
    return fit1.astype(np.int64) - fit0, dsmall.astype(np.float64)


def option_stats(
    typ: Typical,
    cpu_left: np.ndarray,
    left: np.ndarray,
    cpu: int,
    pct: int,
    opts: tuple[np.ndarray, np.ndarray],
    model: np.ndarray | None = None,
    known: Stats | None = None,
) -> tuple[Stats, Stats]:
    """Stats before (K,) and after (N,) placing a one-GPU share of `pct` (with `cpu` millicores) on
    each option, option i being slot opts[1][i] of node opts[0][i]. `known`: the stats before,
    when the caller keeps them."""
    s = stats(typ, cpu_left, left, model) if known is None else known
    k, g = opts
    dn, ds = _deltas(typ, left[k, g], None if model is None else model[k, g], pct)
    return s, Stats(s.nfit[k] + dn, s.small[k] + ds, s.total[k] - pct, cpu_left[k] - cpu)


def set_stats(
    typ: Typical,
    cpu_left: np.ndarray,
    left: np.ndarray,
    cpu: int,
    pct: int,
    cols: np.ndarray,
    model: np.ndarray | None = None,
    known: Stats | None = None,
) -> tuple[Stats, Stats]:
    """Stats before and after (both (K,)) taking `pct` from the slots `cols` (K, C) of each node."""
    s = stats(typ, cpu_left, left, model) if known is None else known
    at = (np.arange(cols.shape[0])[:, None], cols)  # indexing, not take_along_axis: a third of the cost on few rows
    dn, ds = _deltas(typ, left[at], None if model is None else model[at], pct)
    after = Stats(s.nfit + dn.sum(axis=1), s.small + ds.sum(axis=1), s.total - pct * cols.shape[1], cpu_left - cpu)
    return s, after
