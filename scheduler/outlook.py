"""What the pods still to come are expected to need (`Outlook`): the shapes seen, each one's
scarcity (places running out against a Poisson forecast of its arrivals) and rarity (nodes that
can still host it), the pinned pools' shortfall (`pools`), and what they cost a placement."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from crihook.scheduler.arrays import same_rows
from crihook.scheduler.memo import RowMemo
from crihook.scheduler.placement import Nodes, Options, best_fit_cols, host_cpu, share_pct
from crihook.scheduler.places import Places, Reach, fixed
from crihook.scheduler.request import Selectors

if TYPE_CHECKING:
    from crihook.scheduler.plugin import Cluster
    from crihook.scheduler.request import PodRequest


PRIOR = 1.0  # pseudo-pods per kind of node, each as large as the node
POOL = 1.0  # weight of the pinned pools' shortfall in scarcity
MIN_SCARCE = 0.1  # GPU percent per place: scarcer shapes are weighed
MIN_RARE = 0.001  # rarer shapes are weighed
MAX_SHAPES = 512  # the most frequent shapes the outlook looks at (a real cluster's requests vary without end)

Types = tuple[tuple[str, ...], tuple[str, ...]] | None  # a pod's GPU type lists (use, nouse); None: none


def types_of(req: PodRequest) -> Types:
    sel = req.selectors
    return (sel.use_types, sel.nouse_types) if sel.use_types or sel.nouse_types else None


def model_set(types: Types, names: Sequence[str]) -> tuple[str, ...] | None:
    """The GPU models among `names` that a pod with these type lists accepts, as its selectors
    decide (scheduler/request.py); None when that is every model, so such a pod is a plain one."""
    if types is None:
        return None
    sel = Selectors(*types)
    ok = tuple(sorted(n for n in set(names) if sel.refuses(n, "") is None))
    return None if len(ok) == len(set(names)) else ok


class Outlook:
    """What the pods still to come are expected to need, from the pods seen so far and the cluster
    as it is. Shapes are (CPU, host memory, GPU percent, GPU count, GPU models accepted); per shape:
    `scarce`, the GPU percent expected to be lost per place of it a placement takes away, and `rare`,
    its frequency times nodes / nodes that can host it. A shape pinned to models has places only on
    GPUs of those models, so scarcity and rarity are per model set. Shapes that weigh next to
    nothing in both are left out. Both weights are fixed-point (`fixed`): a node's costs are exact
    sums, the same whichever nodes they are computed with."""

    def __init__(self) -> None:
        self.shapes: Counter[tuple[int, int, int, int, Types]] = Counter()
        self.seen = 0
        self.gpu = 0  # GPU percent asked by all pods seen
        self.gpu_cpu = 0  # CPU asked by the GPU pods seen
        self.gpu_pct = 0  # GPU percent asked by the GPU pods seen
        self.places = Places(np.zeros((4, 0), np.int64))  # the shapes weighed
        self.hot = self.places  # those of them with a scarcity, whose places are counted
        self.hot_parts = np.zeros(0, np.int64)  # where the GPU parts of `hot` are among `places`'
        self.scarce = np.zeros(0)  # per shape of `hot`
        self.reach = Reach(self.places, np.zeros(0))  # rarity, per shape of `places`
        # on each node as it is: places per shape of `hot`, shares per GPU part, the weight `reach` finds
        self.before = RowMemo(1)
        self.kinds = RowMemo(3, np.int64)  # CPU, memory and GPUs of each node, for `node_shapes`
        self.pool: np.ndarray | None = None  # per model id: GPU lost per GPU percent taken from it

    @property
    def rho(self) -> float:
        """CPU (millicores) per GPU percent of the GPU pods seen."""
        return self.gpu_cpu / self.gpu_pct if self.gpu_pct else 0.0

    def observe(self, req: PodRequest) -> None:
        pct = share_pct(req)
        self.shapes[(req.cpu_milli, req.host_memory, pct, req.count, types_of(req) if req.count else None)] += 1
        self.seen += 1
        self.gpu += pct * req.count
        if req.count:
            self.gpu_cpu += req.cpu_milli
            self.gpu_pct += pct * req.count

    def resolved(self, names: Sequence[str]) -> Counter[tuple[int, int, int, int, tuple[str, ...] | None]]:
        """The shapes seen (the MAX_SHAPES most frequent), type lists resolved to model sets."""
        seen = self.shapes if len(self.shapes) <= MAX_SHAPES else dict(self.shapes.most_common(MAX_SHAPES))
        out: Counter[tuple[int, int, int, int, tuple[str, ...] | None]] = Counter()
        sets: dict[Types, tuple[str, ...] | None] = {}  # few type lists among many shapes
        for (cpu, hmem, pct, count, types), n in seen.items():
            if types not in sets:
                sets[types] = model_set(types, names)
            out[(cpu, hmem, pct, count, sets[types])] += n
        return out

    def update(self, st: Cluster) -> None:
        rows = np.flatnonzero(st.live)
        if not self.seen or not rows.size:
            return
        seen = self.resolved(st.model_names)
        counts: dict[tuple[int, int, int, int, tuple[str, ...] | None], float] = dict(seen)
        prior = node_shapes(st, rows, self.kinds) if PRIOR else set()
        for shape in prior:
            counts[shape] = counts.get(shape, 0) + PRIOR
        every = Places.of(list(counts), st.model_names)
        shares = every.room(st.left(rows), st.model[rows])
        places = every.from_room(host_cpu(st, rows), st.hmem_free[rows], shares)
        freq = np.array(list(counts.values()), dtype=np.float64) / (self.seen + PRIOR * len(prior))
        arrivals = np.array([seen.get(k, 0) for k in counts], dtype=np.float64) / self.seen  # forecast: real pods only
        future = st.left(rows).sum() / max(self.gpu / self.seen, 1.0)  # pods until the cluster is full
        room = places.sum(axis=0)
        tails = np.array([poisson_tail(float(f * future), int(c)) for f, c in zip(arrivals, room, strict=True)])
        hosts = (places > 0).sum(axis=0)
        scarce = tails * every.table[2] * every.table[3]
        rare = np.where(hosts > 0, freq * rows.size / np.maximum(hosts, 1), 0.0)
        keep = (scarce >= MIN_SCARCE) | (rare >= MIN_RARE)
        self.places = every.subset(keep)
        scarce = fixed(scarce[keep])
        hot = scarce > 0  # rarity alone weighs the others: whether a place is left, not how many
        self.hot = self.places.subset(hot)
        self.hot_parts = self.places.part_columns(self.hot)
        self.scarce = scarce[hot]
        self.reach = Reach(self.places, fixed(rare[keep]))
        self.before = RowMemo(self.scarce.size + self.places.cnt.size + 1)
        # a shape's places do not depend on the others, nor a part's room: both are kept as counted
        room = shares.take(every.part_columns(self.places), axis=1)
        reach = self.reach(host_cpu(st, rows), st.hmem_free[rows], room)
        self.before.seed(st, rows, places.take(np.flatnonzero(keep)[hot], axis=1), room, reach[:, None])
        self.pool = pools(seen, self.seen, future, st, rows) if POOL else None

    def _count(self, cpu: np.ndarray, hmem: np.ndarray, left: np.ndarray, model: np.ndarray) -> np.ndarray:
        """(K, S + U + 1) of K node states, as `costs` keeps them: the places of the S scarce
        shapes, the shares of each of the U GPU parts, the weight with a place (`reach`)."""
        room = self.places.room(left, model)
        hot = self.hot.from_room(cpu, hmem, room.take(self.hot_parts, axis=1))
        return np.concatenate((hot, room, self.reach(cpu, hmem, room)[:, None]), axis=1, dtype=np.float64)

    def costs(
        self, st: Cluster, req: PodRequest, nodes: Nodes, fits: np.ndarray, opts: Options
    ) -> tuple[np.ndarray, np.ndarray]:
        """(scarcity p, rarity r), both (N,), of each option `placements` makes. Both are sums of
        fixed-point weights, exact: an option's costs do not depend on the options computed with it."""
        cpu, hmem, left, model = nodes.cpu, nodes.hmem, nodes.left, nodes.model

        def count(at: np.ndarray) -> np.ndarray:
            sub = nodes.at(at)
            return self._count(sub.cpu, sub.hmem, sub.left, sub.model)

        hot = self.scarce.size
        k: np.ndarray | None = None
        if req.count == 1 and req.shared:
            k, g = opts
            slots, slot_model = left[k, g, None], model[k, g, None]
        else:  # one option per node, in node order: the best-fitting slots
            at = (np.arange(nodes.rows.size)[:, None], best_fit_cols(left, fits, req.count))
            slots, slot_model = left[at], model[at]
        known = self.before.get(st, nodes.rows, count, pick=k)  # the row of each option's node
        pct = share_pct(req)
        cpu_after, hmem_after = cpu - req.cpu_milli, hmem - req.host_memory
        room_after = self.places.lose(known[:, hot:-1], pct, slots, slot_model)
        # the weight of the shapes whose last place goes: taking a pod's resources never adds a place
        r = known[:, -1] - self.reach(cpu_after, hmem_after, room_after, k)
        if hot:
            before = known[:, :hot]
            after = self.hot.after(cpu_after, hmem_after, room_after.take(self.hot_parts, axis=1), k)
            p = (before - after) @ self.scarce
        else:
            p = np.zeros(slots.shape[0])
        if self.pool is not None:  # GPU of a pinned pool taken away, at the rate it is to be missed
            p = p + POOL * pct * self.pool[slot_model].sum(axis=1)
        return p, r


def pools(
    seen: Mapping[tuple[int, int, int, int, tuple[str, ...] | None], int],
    n: int,
    future: float,
    st: Cluster,
    rows: np.ndarray,
) -> np.ndarray | None:
    """Per GPU model, the chance summed over the model sets pinned pods ask for that contain it that
    the set's idle GPU runs out before its pods stop coming: the pods pinned to a set share its GPU,
    which no one shape's places show (each sees all of them as its own). A Poisson forecast of the
    set's pods, `future` pods ahead, against its idle GPU in pods of the set's mean size. None when
    no pod seen is pinned."""
    demand: dict[tuple[str, ...], list[float]] = {}
    for (_, _, pct, count, models), k in seen.items():
        if models is not None and count:
            d = demand.setdefault(models, [0.0, 0.0])
            d[0] += k
            d[1] += k * pct * count
    if not demand:
        return None
    names = st.model_names
    idle = np.bincount(st.model[rows].ravel(), weights=st.left(rows).ravel(), minlength=len(names))
    out = np.zeros(len(names))
    for models, (pods, gpu) in demand.items():
        acc = np.array([m in models for m in names])
        places = int(idle[acc].sum() * pods / gpu)
        out[acc] += poisson_tail(future * pods / n, places)
    return out


def node_shapes(st: Cluster, rows: np.ndarray, memo: RowMemo) -> set[tuple[int, int, int, int, None]]:
    """One pod as large as each kind of node (all its CPU, memory and GPUs), in the order the rows
    first show them. `memo` keeps each node's size while the node is unchanged: reading them from
    thousands of node objects at every outlook update was most of the update."""

    def size(at: np.ndarray) -> np.ndarray:
        out = np.zeros((at.size, 3), np.int64)
        for i, r in enumerate(rows[at].tolist()):
            nd = st.nodes[r]
            if nd is not None:
                out[i] = (nd.cpu_milli, nd.memory, st.ngpus[r])
        return out

    kinds = memo.get(st, rows, size)
    kinds = kinds[(kinds > 0).all(axis=1)]
    first = np.sort(same_rows(kinds)[0])  # by one-column sorts: np.unique by rows was a third of an update
    return {(cpu, mem, 100, gpus, None) for cpu, mem, gpus in kinds[first].tolist()}


def poisson_tail(mean: float, k: int) -> float:
    """P(X >= k) for X ~ Poisson(mean): the chance that the k-th place left is wanted."""
    if k <= 0:
        return 1.0
    if mean <= 0 or k > mean + 12 * math.sqrt(mean) + 20:
        return 0.0
    term = math.exp(-mean)
    below = term
    for i in range(1, k):
        term *= mean / i
        below += term
    return max(0.0, 1.0 - below)
