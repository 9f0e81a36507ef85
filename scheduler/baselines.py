"""Baseline policies from Weng et al., ATC '23, re-implemented from the paper's definitions and its
simulator's scoring, for side-by-side comparison in `crihook simulate`. They plug into DeviceShare
as a Policy, so feasibility, reservation and bookkeeping are the allocator's own.

Integer scores and ties are kept as the paper's simulator has them (kube-scheduler scores are
integers; ties go to the first node in the run's node order), since ties decide many placements.
CPU is normalised by 128 cores and GPU by 8 GPUs, as there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from crihook.scheduler.frag import Typical
from crihook.scheduler.memo import ShapeCache
from crihook.scheduler.placement import (
    Nodes,
    best_fit_cols,
    bucket,
    growth,
    host_cpu,
    options,
    per_node,
    placements,
    share_pct,
)

if TYPE_CHECKING:
    from crihook.scheduler.plugin import Cluster
    from crihook.scheduler.request import PodRequest

MAX_CPU = 128_000.0  # millicores
MAX_GPU = 800.0  # percent (8 GPUs)


def _pick_best_fit(st: Cluster, req: PodRequest, row: int, fits: np.ndarray) -> list[int]:
    return [int(c) for c in best_fit_cols(st.left(np.array([row])), fits[None, :], req.count)[0]]


def _vectors(st: Cluster, req: PodRequest, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, float, float]:
    cpu_left = host_cpu(st, rows).astype(np.float64)
    gpu_left = st.left(rows).sum(axis=1).astype(np.float64)
    return cpu_left, gpu_left, float(req.cpu_milli), float(req.count * share_pct(req))


class FGD:
    """Fragmentation gradient descent: the node (and GPU) whose fragmentation against the workload's
    typical pods grows least; score int(100 * sigmoid(-growth / 1 GPU)). A typical pod pinned to GPU
    models finds a node of another model all fragment, as the paper's simulator has it."""

    def __init__(self, typical: Typical) -> None:
        self.typical = typical
        self.typ = typical
        self.models = -1  # GPU models of the cluster `typ` is bound to
        self.cache = ShapeCache()

    def observe(self, req: PodRequest) -> None:
        return None

    def _best(self, st: Cluster, req: PodRequest, rows: np.ndarray, fits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if len(st.model_names) != self.models:
            self.typ, self.models = self.typical.bind(st.model_names), len(st.model_names)
            self.cache.clear()
        nodes = Nodes.of(st, rows)
        opts = options(req, nodes, fits)
        q = bucket(growth(self.typ, *placements(self.typ, req, nodes, fits, opts), opts))
        return per_node(q, opts, fits.shape if req.count == 1 and req.shared else (rows.size, 1))  # first top GPU

    def scores(self, st: Cluster, req: PodRequest, rows: np.ndarray, fits: np.ndarray) -> np.ndarray:
        return self.cache.get(st, req, rows, fits, lambda r, f: self._best(st, req, r, f))[0]

    def pick(self, st: Cluster, req: PodRequest, row: int, fits: np.ndarray) -> list[int]:
        if req.count == 1 and req.shared:  # the slot Score chose, unless the node changed since
            _, choice = self.cache.get(st, req, np.array([row]), fits[None, :], lambda r, f: self._best(st, req, r, f))
            return [int(choice[0])]
        return _pick_best_fit(st, req, row, fits)


class BestFit:
    """The node left with the least free resources: 1 - mean over (CPU, GPU) of (free - request) / max."""

    def observe(self, req: PodRequest) -> None:
        return None

    def scores(self, st: Cluster, req: PodRequest, rows: np.ndarray, fits: np.ndarray) -> np.ndarray:
        cpu_left, gpu_left, cpu, gpu = _vectors(st, req, rows)
        waste = 0.5 * (cpu_left - cpu) / MAX_CPU + 0.5 * (gpu_left - gpu) / MAX_GPU
        return np.floor((1.0 - waste) * 100.0)

    pick = staticmethod(lambda st, req, row, fits: _pick_best_fit(st, req, row, fits))


class DotProd:
    """Tetris' alignment: the node whose free vector has the smallest dot product with the pod's
    request (both normalised by the maxima); GPUs by best fit."""

    def observe(self, req: PodRequest) -> None:
        return None

    def scores(self, st: Cluster, req: PodRequest, rows: np.ndarray, fits: np.ndarray) -> np.ndarray:
        cpu_left, gpu_left, cpu, gpu = _vectors(st, req, rows)
        dot = (cpu_left / MAX_CPU * cpu / MAX_CPU + gpu_left / MAX_GPU * gpu / MAX_GPU) / 2.0
        return np.floor((1.0 - dot) * 100.0)

    pick = staticmethod(lambda st, req, row, fits: _pick_best_fit(st, req, row, fits))


class Random:
    """A uniformly random feasible node and GPU, from a seeded generator."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def observe(self, req: PodRequest) -> None:
        return None

    def scores(self, st: Cluster, req: PodRequest, rows: np.ndarray, fits: np.ndarray) -> np.ndarray:
        return self.rng.random(len(rows))

    def pick(self, st: Cluster, req: PodRequest, row: int, fits: np.ndarray) -> list[int]:
        cand = np.flatnonzero(fits)
        return sorted(int(c) for c in self.rng.choice(cand, size=req.count, replace=False))
