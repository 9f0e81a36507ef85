"""The default node score: FGD's fragmentation bucket, refined by what the placement costs the pods
still to come.

For every node that fits, the pod is placed hypothetically (on each GPU that can take a share, or
on the best-fitting whole GPUs) and measured against the pods seen so far, in percent of one GPU:

- d, FGD's fragmentation growth (scheduler/frag.py): idle GPU the typical next pod can not use;
- s, CPU deficit growth: a node has `cpu - rho * gpu` CPU beyond what its idle GPUs will need
  (rho: CPU per GPU of the GPU pods seen); a deficit strands GPU. s is the growth of the soft
  deficit TAU * log(1 + exp(-surplus / TAU)), in GPU: CPU-heavy pods go where CPU is plentiful,
  light pods and CPU-only pods where it is not needed, well before any node runs short;
- p, scarcity: the GPU expected to be lost because the node can take fewer pods of a shape whose
  places are running out (places left against a Poisson forecast of the shape's arrivals until the
  cluster is full), plus the GPU taken from a set of GPU models that the pods pinned to it are
  expected to run short of (shapes are keyed by the models they accept);
- r, rarity: the shapes the node could host and no longer can, each weighted by its frequency
  times nodes / nodes that can still host it. It keeps the few nodes with the CPU and memory for
  the largest pods for those pods, long before their places run short. Until such pods are seen,
  one pod as large as each kind of node stands in for them (PRIOR, diluted by every pod seen): a
  fresh scheduler does not hand its most capable nodes to the first small pods.

    raw   = floor(100 * sig(d + p + KAPPA * s)) - MU * r + TIE * sig(s + p + 100 * LAM * r)
    score = softplus(raw) * 100 / (100 + TIE)          (0..100, in the order of raw)

with sig(x) = 1 / (1 + exp(x / 100)). The integer bucket is FGD's score (growths within about 4 %
of a GPU tie) with the cost to come added; the fraction orders what it ties. Remaining ties go to
the first node in the scheduler's order.

Results are cached per request shape and node version: a pod changes one node, so the next pod of
the same shape recomputes one row, not the cluster. The typical shapes are re-derived at 1, 2, 4 …
pods (and at least every REFRESH); the outlook (rho, scarcity, rarity) at 1, 2, 4 … OUTLOOK pods,
then when the pods seen since have moved the cluster or the mix enough (`Drift`); each time every
row is rescored.

This module is the policy: the formula above, what it learns from each pod and when it derives
its inputs again. The parts live beside it: placement (options, FGD's growth and bucket), memo
(the caches), places (counting places, fixed-point weights), outlook (p and r) and drift (when).
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from crihook.scheduler.drift import OUTLOOK, Drift
from crihook.scheduler.frag import Shape, Stats, Typical, stats
from crihook.scheduler.memo import RowMemo, ShapeCache, ShapeKey, fit_tag, size_key
from crihook.scheduler.outlook import Outlook, model_set
from crihook.scheduler.placement import (
    Nodes,
    Options,
    best_fit_cols,
    bucket,
    growth,
    options,
    per_node,
    placements,
    share_pct,
    sub_options,
)
from crihook.scheduler.places import fixed

if TYPE_CHECKING:
    from crihook.scheduler.plugin import Cluster
    from crihook.scheduler.request import PodRequest


TIE = 0.9  # weight of the tie-break: below 1, so it only orders nodes FGD's bucket ties
TAU = 8_000  # millicores over which a CPU deficit is smoothed
LAM = 6.0  # rarity in the tie-break
KAPPA = 0.5  # CPU surplus growth in the bucket
MU = 6.0  # rarity against the bucket
# the most pods between two derivations of the typical shapes. They are counted over every pod seen
# and derived as that count doubles (each derivation adds as many pods as it had, and drops every FGD
# growth kept); this bounds how far a long-lived scheduler's shapes lag its workload
REFRESH = 1 << 16
# FGD growths kept, over all request shapes: 8 bytes per GPU slot and node and 16 per node for each
# shape (390 KiB at 5,000 8-GPU nodes); openb brings a new shape every 15 pods or so, and the
# 512 shapes kept before held 80 shapes, 22 MiB, after 1,500 pods there, up to 180 MiB in all
GROWTH_BYTES = 32 << 20


def soft_deficit(cpu: np.ndarray, gpu: np.ndarray, rho: float) -> np.ndarray:
    """The CPU a node lacks for its idle GPUs (rho per GPU percent), smoothed over TAU, in GPU
    percent: about 0 with a surplus of several TAU, about the deficit once it is large, and exactly
    0 with no idle GPU (nothing left to strand, however little CPU is left)."""
    r = max(rho, 1.0)
    deficit: np.ndarray = TAU * (np.logaddexp(0.0, (r * gpu - cpu) / TAU) - np.logaddexp(0.0, -cpu / TAU)) / r
    return deficit


class DefaultPolicy:
    """FGD's bucket, then the cost to the pods still to come; workload learned from the pods seen.

    With `background`, what is due is not re-derived by the evaluation that finds it due:
    `outlook_job` hands it to whoever runs it off the request path (the extender, on a thread of
    its own), and evaluations use the outlook they have until it is installed. The simulator keeps
    it in line, so that placements do not depend on timing."""

    def __init__(
        self, coverage: float = 0.95, refresh: int = REFRESH, outlook: int = OUTLOOK, background: bool = False
    ) -> None:
        self.coverage = coverage
        self.refresh = refresh
        self.background = background
        self.drift = Drift(outlook)
        self.pins = np.ones((1, 0))  # (pools, model ids): the models each pool of `drift` holds
        self.looked = 0  # pods seen when `drift` last looked at the pools
        self.typ = Typical.of({}, coverage)
        self.outlook = Outlook()
        self.due = False  # the outlook needs the cluster: updated at the next evaluation
        self.retype = False  # the typical shapes too
        self.models = 0  # GPU models the cluster had when the shapes were resolved
        self.cache = ShapeCache(size_key)
        self.growths: dict[ShapeKey, RowMemo] = {}  # FGD growth per request size, while `typ` holds
        self.stats = RowMemo(0)  # FGD's stats of each node, while `typ` holds: see `_stats`

    def observe(self, req: PodRequest) -> None:
        """Learn the workload: the typical shapes at 1, 2, 4 … pods, and at least every `refresh`
        (each one drops every FGD growth kept, so not more often than they move); the outlook at 1,
        2, 4 … `outlook` pods, then as the workload drifts (`Drift`)."""
        self.outlook.observe(req)
        n = self.outlook.seen
        early = (n & (n - 1)) == 0
        if early or n % self.refresh == 0:
            self.retype = self.due = True
        if early and n <= self.drift.every:
            self.due = True

    def _drifted(self, st: Cluster) -> bool:
        """Whether the outlook is due: asked for, or the workload drifted since it was derived
        (`Drift`; the pools' idle GPU is summed every `look` pods once `every` have been seen)."""
        n = self.outlook.seen
        if not self.due and n != self.looked and self.drift.waited(n):
            self.looked = n  # once per pod: Score and Reserve both ask
            self.due = self.drift.due(n, self._idle(st))
        return self.due

    def _idle(self, st: Cluster) -> list[int]:
        """GPU percent idle in each pool of `pins`: the whole cluster, then each set of pins."""
        rows = np.flatnonzero(st.live)
        width = self.pins.shape[1]
        by_model = np.bincount(st.model[rows].ravel(), st.left(rows).ravel(), width)[:width]
        idle: list[int] = np.rint(self.pins @ by_model).astype(np.int64).tolist()
        return idle

    def _mark(self, st: Cluster) -> None:
        """The outlook is derived now: `drift` counts from here, over the model sets pinned so far."""
        names = st.model_names
        sets = {model_set(types, names) for types in {key[-1] for key in self.outlook.shapes}}  # few type lists
        pins = [[True] * len(names)] + [[n in m for n in names] for m in sets if m is not None]
        self.pins = np.array(pins, np.float64).reshape(len(pins), len(names))
        self.drift.mark(self.outlook.seen, self._idle(st))

    def _typical(self, names: Sequence[str]) -> Typical:
        """FGD's typical shapes from the shapes seen: host memory left out, models kept."""
        typical: Counter[Shape] = Counter()
        for (cpu, _, pct, count, models), k in self.outlook.resolved(names).items():
            typical[Shape(cpu, pct, count, models)] += k
        typ = Typical.of(typical, self.coverage).bind(names)
        return replace(typ, weight=fixed(typ.weight))  # growths exact, as the outlook's costs

    def _evaluate(
        self, st: Cluster, req: PodRequest, rows: np.ndarray, fits: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(score (K,), chosen slot (K,)): the best option's score, the first option that has it."""
        nodes = Nodes.of(st, rows)
        opts = options(req, nodes, fits)
        d = self._growth(st, req, nodes, fits, opts)[opts]
        p, r = self.outlook.costs(st, req, nodes, fits, opts)
        # the soft deficit after (row 0) and before (row 1) in one call: elementwise, the same values
        cpu = np.empty((2, rows.size))
        gpu = np.empty((2, rows.size))
        cpu[1], gpu[1] = nodes.cpu, nodes.left.sum(axis=1)
        np.subtract(cpu[1], req.cpu_milli, out=cpu[0])
        np.subtract(gpu[1], req.count * share_pct(req), out=gpu[0])
        both = soft_deficit(cpu, gpu, self.outlook.rho)
        s = (both[0] - both[1])[opts[0]]
        with np.errstate(over="ignore"):  # an overflow is a tie-break of 0, as it should be
            tie = 1.0 / (1.0 + np.exp((s + p + 100.0 * LAM * r) / 100.0))
        raw = bucket(d + p + KAPPA * s) - MU * r + TIE * tie  # below 100 + TIE, unbounded below
        q = np.logaddexp(0.0, raw) * (100.0 / (100.0 + TIE))  # softplus: 0..100, same order
        if req.count == 1 and req.shared:
            return per_node(q, opts, fits.shape)
        return q, opts[1]  # one option per node, in node order (slot 0)

    def _growth(self, st: Cluster, req: PodRequest, nodes: Nodes, fits: np.ndarray, opts: Options) -> np.ndarray:
        """(K, G) FGD growth of each option `opts` of the nodes, by slot (slot 0 for a set of slots).
        It depends on the typical shapes only, which change far less often than the outlook: kept
        per node."""
        key = size_key(req)
        memo = self.growths.pop(key, None)  # and put back last: the least recently used go first
        if memo is None or memo.width != st.width:  # a node with more GPUs than any before
            keep = max(1, GROWTH_BYTES // (8 * (st.width + 2) * max(st.version.size, 1)) - 1)
            for old in list(self.growths)[: max(0, len(self.growths) - keep)]:
                del self.growths[old]
            memo = RowMemo(st.width)
        self.growths[key] = memo

        def compute(at: np.ndarray) -> np.ndarray:
            sub = nodes.at(at)
            mine = sub_options(opts, at, nodes.rows.size)
            out = np.zeros((at.size, st.width))
            out[mine] = growth(self.typ, *placements(self.typ, req, sub, fits[at], mine, self._stats(st, sub)), mine)
            return out

        return memo.get(st, nodes.rows, compute, fit_tag(fits) if self.cache.tagged else None)

    def _stats(self, st: Cluster, nodes: Nodes) -> Stats | None:
        """FGD's stats of the nodes as they are (GPUs with room and idle too small, per typical
        shape): they do not depend on the request, so all request shapes share them. Exact
        integers, kept as floats as `frag_of` reads them (the counts compare the same); None when
        they would take more than GROWTH_BYTES (a budget of their own beside the growths')."""
        m = self.typ.weight.size
        if 16 * m * st.version.size > GROWTH_BYTES:
            return None
        if self.stats.width != 2 * m:
            self.stats = RowMemo(2 * m)
        cpu, left = nodes.cpu, nodes.left

        def compute(at: np.ndarray) -> np.ndarray:
            sub = nodes.at(at)
            s = stats(self.typ, sub.cpu, sub.left, sub.model if self.typ.acc is not None else None)
            return np.concatenate((s.nfit, s.small), axis=1)

        both = self.stats.get(st, nodes.rows, compute)
        return Stats(both[:, :m], both[:, m:], left.sum(axis=1).astype(np.float64), cpu)

    def _fresh(self, st: Cluster, req: PodRequest) -> None:
        if self.cache.meet(req):  # the growths are shared by requests of one size too
            self.growths.clear()
        self._models(st)
        if not self.background and self._drifted(st):  # in the background, outlook_job's
            self._retype(st)
            self._mark(st)
            self.outlook.update(st)
            self.cache.clear()
            self.due = False

    def _models(self, st: Cluster) -> None:
        if len(st.model_names) != self.models:  # a new GPU model: shapes pinned to it resolve anew
            self.models = len(st.model_names)
            self.retype = self.due = True

    def _retype(self, st: Cluster) -> None:
        """FGD's typical shapes, when due; the growths and scores that depended on them go."""
        if self.retype:
            self.typ = self._typical(st.model_names)
            self.growths.clear()
            self.stats = RowMemo(0)
            self.cache.clear()
            self.retype = False

    def outlook_job(self, st: Cluster) -> Callable[[], Callable[[], None]] | None:
        """The due re-derivation as a job that needs no lock, or None when none is due. The
        typical shapes, when due, are derived at once (a small table); the job derives the
        outlook from the workload and the cluster as they are now (copies) and returns what
        installs it, with the pods observed meanwhile, to be called under the lock. Taking the
        job clears `due`: a pod observed meanwhile that makes it due again asks for another. None
        without `background`: then the evaluations re-derive in line, and nothing else may."""
        if not self.background:
            return None
        self._models(st)
        if not self._drifted(st):
            return None
        self._retype(st)
        self._mark(st)
        live, cluster = self.outlook, st.snapshot()
        fresh = copy.copy(live)  # counters are ints; what update replaces it may share
        fresh.shapes, fresh.kinds = Counter(live.shapes), copy.deepcopy(live.kinds)
        self.due = False

        def job() -> Callable[[], None]:
            fresh.update(cluster)

            def install() -> None:
                now = self.outlook
                if now is not live:  # another job's outlook is in: this one is older
                    return
                fresh.shapes, fresh.seen, fresh.gpu = now.shapes, now.seen, now.gpu
                fresh.gpu_cpu, fresh.gpu_pct = now.gpu_cpu, now.gpu_pct
                self.outlook = fresh
                self.cache.clear()

            return install

        return job

    def scores(self, st: Cluster, req: PodRequest, rows: np.ndarray, fits: np.ndarray) -> np.ndarray:
        self._fresh(st, req)
        return self.cache.get(st, req, rows, fits, lambda r, f: self._evaluate(st, req, r, f))[0]

    def pick(self, st: Cluster, req: PodRequest, row: int, fits: np.ndarray) -> list[int]:
        rows = np.array([row])
        if req.count == 1 and req.shared:  # the slot Score chose, unless the node changed since
            self._fresh(st, req)
            _, choice = self.cache.get(st, req, rows, fits[None, :], lambda r, f: self._evaluate(st, req, r, f))
            return [int(choice[0])]
        return [int(c) for c in best_fit_cols(st.left(rows), fits[None, :], req.count)[0]]
