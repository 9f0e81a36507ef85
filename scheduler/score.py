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
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from crihook.scheduler.arrays import same_rows
from crihook.scheduler.frag import Shape, Stats, Typical, frag_of, option_stats, set_stats, stats
from crihook.scheduler.request import Selectors

if TYPE_CHECKING:
    from crihook.scheduler.plugin import Cluster
    from crihook.scheduler.request import PodRequest

TIE = 0.9  # weight of the tie-break: below 1, so it only orders nodes FGD's bucket ties
TAU = 8_000  # millicores over which a CPU deficit is smoothed
LAM = 6.0  # rarity in the tie-break
KAPPA = 0.5  # CPU surplus growth in the bucket
MU = 6.0  # rarity against the bucket
PRIOR = 1.0  # pseudo-pods per kind of node, each as large as the node
POOL = 1.0  # weight of the pinned pools' shortfall in scarcity
MIN_SCARCE = 0.1  # GPU percent per place: scarcer shapes are weighed
MIN_RARE = 0.001  # rarer shapes are weighed
MAX_SHAPES = 512  # the most frequent shapes the outlook looks at (a real cluster's requests vary without end)
# the most pods between two derivations of the typical shapes. They are counted over every pod seen
# and derived as that count doubles (each derivation adds as many pods as it had, and drops every FGD
# growth kept); this bounds how far a long-lived scheduler's shapes lag its workload
REFRESH = 1 << 16
OUTLOOK = 64  # the least pods between outlook updates, once past the first OUTLOOK
FILL = 0.125  # then an update once a pool's idle GPU moved by more than this share of it (`Drift`)
GROW = 0.125  # or once the pods since the last one are this share of the pods seen before it
# FGD growths kept, over all request shapes: 8 bytes per GPU slot and node and 16 per node for each
# shape (390 KiB at 5,000 8-GPU nodes); openb brings a new shape every 15 pods or so, and the
# 512 shapes kept before held 80 shapes, 22 MiB, after 1,500 pods there, up to 180 MiB in all
GROWTH_BYTES = 32 << 20
NO_HOST = 2**62  # CPU left on nodes whose allocatable is not known: never the limit


def share_pct(req: PodRequest) -> int:
    """One share of the request in percent of a GPU (memory in bytes counts by its core); 0 for a
    pod that asks no GPU."""
    return max(req.core, req.ratio, 1) if req.count else 0


def host_cpu(st: Cluster, rows: np.ndarray) -> np.ndarray:
    return np.where(st.host_known[rows], st.cpu_free[rows], NO_HOST)


Options = tuple[np.ndarray, np.ndarray]  # option i is slot [1][i] of node [0][i] (slot 0 for a set of slots)


def share_options(left: np.ndarray, fits: np.ndarray, model: np.ndarray) -> Options:
    """The slots that can take a one-GPU share, less those equal (idle, model) to a lower slot of the
    same node: a placement there measures the same, and ties go to the lowest slot anyway."""
    same = (left[:, :, None] == left[:, None, :]) & (model[:, :, None] == model[:, None, :]) & fits[:, None, :]
    dup = np.tril(same, k=-1).any(axis=2)  # an equal fitting slot before it
    nodes, slots = np.nonzero(fits & ~dup)
    return nodes, slots


@dataclass(frozen=True, slots=True)
class Nodes:
    """The columns of the rows a pass reads, gathered from the cluster once: each step of a pass
    (options, FGD's stats and growth, the outlook's costs) read them again, a dozen gathers a pass."""

    rows: np.ndarray  # (K,) row ids
    left: np.ndarray  # (K, G) idle percent per slot
    model: np.ndarray  # (K, G) model id per slot
    cpu: np.ndarray  # (K,) CPU left (`host_cpu`)
    hmem: np.ndarray  # (K,) host memory left

    @classmethod
    def of(cls, st: Cluster, rows: np.ndarray) -> Nodes:
        return cls(rows, st.left(rows), st.model[rows], host_cpu(st, rows), st.hmem_free[rows])

    def at(self, pos: np.ndarray) -> Nodes:
        """The rows at positions `pos` (ascending); these nodes when that is all of them."""
        if pos.size == self.rows.size:
            return self
        return Nodes(self.rows[pos], self.left[pos], self.model[pos], self.cpu[pos], self.hmem[pos])


def options(req: PodRequest, nodes: Nodes, fits: np.ndarray) -> Options:
    """A one-GPU share has one option per GPU slot that can take it (equal slots of a node once);
    anything else has one option per node: the best-fitting slots (least idle first, then lowest)."""
    if req.count == 1 and req.shared:
        return share_options(nodes.left, fits, nodes.model)
    return np.arange(nodes.rows.size), np.zeros(nodes.rows.size, np.int64)


def sub_options(opts: Options, at: np.ndarray, k: int) -> Options:
    """The options of rows `at` (ascending positions among k rows) out of `opts` of all k rows,
    numbered as rows[at]: a node's options do not depend on the other nodes."""
    if at.size == k:
        return opts
    where = np.full(k, -1, np.int64)
    where[at] = np.arange(at.size)
    node = where[opts[0]]
    keep = node >= 0
    return node[keep], opts[1][keep]


def placements(
    typ: Typical, req: PodRequest, nodes: Nodes, fits: np.ndarray, opts: Options, known: Stats | None = None
) -> tuple[Stats, Stats]:
    """Node stats before (K,) and after each option (N,) of `options`; `known`: those before, when
    the caller keeps them."""
    left, cpu = nodes.left, nodes.cpu
    pct = share_pct(req)
    model = nodes.model if typ.acc is not None else None
    if req.count == 1 and req.shared:
        return option_stats(typ, cpu, left, req.cpu_milli, pct, opts, model, known)
    return set_stats(typ, cpu, left, req.cpu_milli, pct, best_fit_cols(left, fits, req.count), model, known)


def per_node(q: np.ndarray, opts: Options, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(best value (K,), its option's slot (K,)) of option values q (N,); -1 for a node without one."""
    out = np.full(shape, -1.0)
    out[opts] = q
    return out.max(axis=1), np.argmax(out, axis=1)


def growth(typ: Typical, before: Stats, after: Stats, opts: Options) -> np.ndarray:
    """FGD's fragmentation growth of each option (N,), in percent of a GPU."""
    grown: np.ndarray = frag_of(typ, after) - frag_of(typ, before)[opts[0]]
    return grown


def bucket(growth: np.ndarray) -> np.ndarray:
    """Score buckets 0..100 of fragmentation growth (percent of a GPU): floor(100 * sigmoid(-growth / 100)).
    An exponent that overflows gives 0 and one that underflows 100, as they should: no clipping."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.floor(100.0 / (1.0 + np.exp(growth / 100.0)))


def best_fit_cols(left: np.ndarray, fits: np.ndarray, count: int) -> np.ndarray:
    order = np.argsort(np.where(fits, left, 10_000), axis=1, kind="stable")
    return order[:, :count]


class RowMemo:
    """Values (`width` per node) kept while the node's version is unchanged; the owner drops the
    memo when what the values depend on beyond the node changes."""

    def __init__(self, width: int, dtype: type = np.float64) -> None:
        self.width, self.dtype = width, dtype
        self.epoch = -1
        self.version = np.zeros(0, np.int64)
        self.tag = np.zeros(0, np.int64)
        self.value: np.ndarray = np.zeros((0, width), dtype)

    def _fit(self, st: Cluster) -> None:
        n = st.version.size
        if self.epoch != st.epoch or self.version.size != n:
            self.epoch, self.version, self.tag, self.value = (
                st.epoch,
                np.full(n, -1, np.int64),
                np.zeros(n, np.int64),
                np.zeros((n, self.width), self.dtype),
            )

    def seed(self, st: Cluster, rows: np.ndarray, *blocks: np.ndarray) -> None:
        """Values the owner has computed anyway, for the rows as they are now: blocks of columns,
        side by side."""
        self._fit(st)
        at = 0
        for block in blocks:
            self.value[rows, at : at + block.shape[1]] = block
            at += block.shape[1]
        self.version[rows] = st.version[rows]

    def get(
        self,
        st: Cluster,
        rows: np.ndarray,
        compute: Callable[[np.ndarray], np.ndarray],
        tag: np.ndarray | None = None,
        pick: np.ndarray | None = None,
    ) -> np.ndarray:
        """(K, width) for the rows; compute(positions in rows) gives the stale ones. `tag` (K,):
        what else a row's value depends on; a row computed under another tag is stale too.
        `pick`: the rows' positions (N,) to answer for instead, one gather where the caller would
        gather again (wide rows, several options per node)."""
        self._fit(st)
        now = st.version[rows]
        old = self.version[rows] != now
        if tag is not None:
            old |= self.tag[rows] != tag
        if rows.size and old.all():  # nodes that changed (most passes on a few rows): what compute gave is the answer
            fresh: np.ndarray = compute(np.arange(rows.size)).astype(self.dtype, copy=False)
            self.value[rows], self.version[rows] = fresh, now
            if tag is not None:
                self.tag[rows] = tag
            return fresh if pick is None else fresh.take(pick, axis=0)
        pos = np.flatnonzero(old)
        if pos.size:
            stale = rows[pos]
            self.value[stale] = compute(pos)
            self.version[stale] = now[pos]
            if tag is not None:
                self.tag[stale] = tag[pos]
        value: np.ndarray = self.value.take(rows if pick is None else rows[pick], axis=0)
        return value


ShapeKey = tuple[int, int, int, int, int, int, Selectors] | tuple[int, int, int, int, int, int]


def shape_key(req: PodRequest) -> ShapeKey:
    """What a request's scores depend on besides the nodes."""
    return (req.count, req.core, req.ratio, req.memory, req.cpu_milli, req.host_memory, req.selectors)


def size_key(req: PodRequest) -> ShapeKey:
    """What a request's scores depend on besides the nodes and which of their GPUs fit it (which
    is all its selectors change): for caches that check each node's fitting GPUs (`fit_tag`)."""
    return (req.count, req.core, req.ratio, req.memory, req.cpu_milli, req.host_memory)


_BITS = 2.0 ** np.arange(53)  # a sum of distinct ones below 2**53 is exact in a double


def fit_tag(fits: np.ndarray) -> np.ndarray:
    """(K,): the fitting slots (K, G) of each node as one number, G < 63. A float product where
    it is exact (G <= 53): twice as fast as an integer one on hundreds of nodes, and Score tags
    every node that fits at every request once pinned pods are seen."""
    g = fits.shape[1]
    if g > _BITS.size:
        wide: np.ndarray = fits @ (1 << np.arange(g, dtype=np.int64))
        return wide
    tag: np.ndarray = (fits @ _BITS[:g]).astype(np.int64)
    return tag


@dataclass(slots=True)
class _Entry:
    epoch: int
    version: np.ndarray
    tag: np.ndarray  # `fit_tag` of the slots that fitted when the row was scored, once checked
    value: np.ndarray
    choice: np.ndarray


Evaluate = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


class ShapeCache:
    """Per-node results (score, chosen slot) by request shape, valid while the node's version is
    unchanged: a pod changes one node, so the next pod of the same shape recomputes one row, not
    the cluster. `key`: what tells request shapes apart; one that leaves the selectors out shares
    rows between requests that may differ in the slots that fit them (see `meet`)."""

    def __init__(self, key: Callable[[PodRequest], ShapeKey] = shape_key) -> None:
        self.key = key
        self.by_size = key is not shape_key
        self.tagged = False  # each row is checked against the slots that fitted it
        self.entries: dict[ShapeKey, _Entry] = {}
        self.states = States()  # of the nodes, for `distinct`

    def clear(self) -> None:
        self.entries.clear()

    def meet(self, req: PodRequest) -> bool:
        """Whether `req` starts the checks of the slots that fit (the first request with
        selectors, when requests of one key share rows): the rows kept so far have no record of
        them and are dropped. Until then all requests of a key have the same fitting slots on a
        node that has not changed, and no check is needed."""
        if not self.by_size or self.tagged or not req.selectors:
            return False
        self.tagged = True
        self.entries.clear()
        return True

    def get(
        self, st: Cluster, req: PodRequest, rows: np.ndarray, fits: np.ndarray, evaluate: Evaluate
    ) -> tuple[np.ndarray, np.ndarray]:
        key = self.key(req)
        ent = self.entries.get(key)
        n = st.version.size
        if ent is None or ent.epoch != st.epoch or ent.version.size != n:
            n64 = np.zeros(n, np.int64)
            ent = _Entry(st.epoch, np.full(n, -1, np.int64), n64, np.zeros(n), n64.copy())
            self.entries[key] = ent
        old = ent.version[rows] != st.version[rows]
        if self.tagged:
            tag = fit_tag(fits)
            old |= ent.tag[rows] != tag
        pos = np.flatnonzero(old)
        if pos.size:
            stale = rows[pos]
            ent.value[stale], ent.choice[stale] = distinct(st, stale, fits[pos], evaluate, self.states)
            ent.version[stale] = st.version[stale]
            if self.tagged:
                ent.tag[stale] = tag[pos]
        return ent.value[rows], ent.choice[rows]


DISTINCT = 64  # rows from which evaluating each distinct node state once pays for finding them
WIDEST = 24  # GPU slots a node may have for `distinct`: a state id, then one bit per slot, in an int64


class States:
    """An id per distinct node state (CPU and memory left, idle and model per slot), kept while the
    node is unchanged: equal ids are equal states, exactly, for the cost of a lookup per node that
    changed, not a pass over every node's state at every evaluation."""

    def __init__(self) -> None:
        self.ids = RowMemo(1, np.int64)
        self.known: dict[bytes, int] = {}

    def of(self, st: Cluster, rows: np.ndarray) -> np.ndarray:
        """(K,) the rows' state ids."""
        if len(self.known) > 8 * max(st.version.size, 1024):  # mostly states long gone: start afresh
            self.known.clear()
            self.ids = RowMemo(1, np.int64)

        def compute(at: np.ndarray) -> np.ndarray:
            sub = rows[at]
            host = (host_cpu(st, sub)[:, None], st.hmem_free[sub, None])
            state = np.concatenate((*host, st.left(sub), st.model[sub]), axis=1)
            known = self.known
            return np.array([known.setdefault(b, len(known)) for b in map(bytes, state)], np.int64)[:, None]

        ids: np.ndarray = self.ids.get(st, rows, compute)[:, 0]
        return ids


def distinct(
    st: Cluster, rows: np.ndarray, fits: np.ndarray, evaluate: Evaluate, states: States
) -> tuple[np.ndarray, np.ndarray]:
    """`evaluate` once per distinct node state (`states`, and the slots that fit): the scores are
    per node, and many nodes are alike (all empty ones of a kind, at first)."""
    if rows.size < DISTINCT or fits.shape[1] > WIDEST:
        return evaluate(rows, fits)
    key = (states.of(st, rows) << fits.shape[1]) | fit_tag(fits)
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    value, choice = evaluate(rows[first], fits[first])
    return value[inverse], choice[inverse]


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


BIG = 2**30  # places of a shape on a node when nothing limits it (CPU-free, memory-free, GPU-free)
PLACE = np.int32  # places are counted in int32: the (options x shapes) arrays are most of the outlook's cost


class Places:
    """How many pods of each shape (table (4, M): CPU, host memory, GPU percent, GPU count; and the
    GPU models each accepts) fit node states together. Many shapes share a GPU part (percent, count,
    models), so GPU room is counted once per distinct part, by table lookup rather than division.
    Exact for whole GPUs and one-GPU shares; for shares spread over several GPUs it counts shares,
    not distinct GPUs (an upper bound)."""

    def __init__(
        self, table: np.ndarray, models: Sequence[tuple[str, ...] | None] = (), names: Sequence[str] = ()
    ) -> None:
        self.table = table
        self.models = tuple(models) or (None,) * table.shape[1]
        self.names = tuple(names)
        gpu = table[2] > 0
        keys = [(int(p), int(c), m) for p, c, m, g in zip(table[2], table[3], self.models, gpu, strict=True) if g]
        parts = sorted(set(keys), key=lambda k: (k[0], k[1], k[2] is not None, k[2] or ()))
        self.parts = parts
        at = {k: i for i, k in enumerate(parts)}
        self.cnt = np.array([max(c, 1) for _, c, _ in parts], np.int64)
        self.cnt_f = self.cnt.astype(np.float64)
        self.part = np.zeros(table.shape[1], np.int64)
        self.part[gpu] = [at[k] for k in keys]
        self.cpu_only = np.flatnonzero(~gpu)  # BIG places by GPU
        pcts, self.pct_at = np.unique(np.array([p for p, _, _ in parts], np.int64), return_inverse=True)
        # (101, P): percent idle // share; shares are counted in floats (exact), as the room is read
        self.div = (np.arange(101)[:, None] // np.maximum(pcts, 1)).astype(np.float64)
        self.div_part = self.div[:, self.pct_at]  # (101, U): the same per part
        self.loss: dict[int, np.ndarray] = {}  # per percent taken: (101, U) shares lost by idle percent
        cpus, self.cpu_at = np.unique(table[0], return_inverse=True)
        mems, mem_at = np.unique(table[1], return_inverse=True)
        self.ncpu = cpus.size  # the distinct CPU sizes, then the memory sizes, each divided once
        self.mem_at = mem_at + cpus.size
        sizes = np.concatenate((cpus, mems))
        self.sizes = np.maximum(sizes, 1).astype(np.float64)[:, None]
        self.free = np.flatnonzero(sizes <= 0)  # a size of 0 leaves BIG places
        self.acc: np.ndarray | None = None  # (model id, U): the part's shapes accept the model
        if any(m is not None for _, _, m in parts) and self.names:
            self.acc = np.array([[m is None or n in m for _, _, m in parts] for n in self.names], np.float64)

    @classmethod
    def of(cls, shapes: Sequence[tuple[int, int, int, int, tuple[str, ...] | None]], names: Sequence[str]) -> Places:
        table = np.array([s[:4] for s in shapes], dtype=np.int64).reshape(-1, 4).T
        return cls(table, [s[4] for s in shapes], names)

    def subset(self, keep: np.ndarray) -> Places:
        return Places(self.table[:, keep], [m for m, k in zip(self.models, keep, strict=True) if k], self.names)

    def part_columns(self, sub: Places) -> np.ndarray:
        """Where the GPU parts of `sub`, a subset of these shapes, are among these parts."""
        at = {part: i for i, part in enumerate(self.parts)}
        return np.array([at[part] for part in sub.parts], np.int64)

    # Places per shape are gathered shape-major, (M, K): numpy gathers whole rows several times
    # faster than single elements of each row; the (K, M) callers get is written once at the end.

    def _host(self, cpu: np.ndarray, hmem: np.ndarray) -> np.ndarray:
        """(M, K) places by CPU and memory; shapes share few distinct sizes, so each is divided once.
        In floats, several times faster than integers, and exact: the floor of a correctly rounded
        a / b is a // b for 0 <= a < 2**52 (a quotient below an integer n stays 1 / b from it)."""
        by = np.empty((self.sizes.size, cpu.size))
        # cast first: an int64 operand broadcast into float rows takes numpy's slow casting loop
        np.divide(np.maximum(cpu, 0).astype(np.float64), self.sizes[: self.ncpu], out=by[: self.ncpu])
        np.divide(np.maximum(hmem, 0).astype(np.float64), self.sizes[self.ncpu :], out=by[self.ncpu :])
        np.floor(by, out=by)
        by[self.free] = BIG
        small = np.minimum(by, BIG, out=by).astype(PLACE)
        host = small.take(self.cpu_at, axis=0)
        out: np.ndarray = np.minimum(host, small.take(self.mem_at, axis=0), out=host)
        return out

    def _by_shape(self, gpu: np.ndarray) -> np.ndarray:
        """GPU room per distinct part (K, U) -> per shape (M, K); BIG for CPU-only shapes. Room in
        whole pods of the part, or their quotient in floats (cast to integers here: the floor)."""
        if not gpu.shape[1]:  # CPU-only shapes alone
            return np.full((self.part.size, gpu.shape[0]), BIG, PLACE)
        out: np.ndarray = np.ascontiguousarray(gpu.T, dtype=PLACE).take(self.part, axis=0)
        out[self.cpu_only] = BIG
        return out

    def _lost(self, slots: np.ndarray, model: np.ndarray | None, pct: int) -> np.ndarray:
        """(N, U) shares of each part that slots (N, C) lose when `pct` is taken from each, 0 on
        models the part refuses. Idle percent is 0..100 (`Cluster.touch` keeps it so): an index."""
        lost = self.loss.get(pct)
        if lost is None:
            lost = self.loss[pct] = self.div_part - self.div_part[np.maximum(np.arange(101) - pct, 0)]
        per = lost[slots]
        if self.acc is not None and model is not None:
            per *= self.acc[model]
        out: np.ndarray = per[:, 0] if per.shape[1] == 1 else per.sum(axis=1)
        return out

    def room(self, left: np.ndarray, model: np.ndarray | None) -> np.ndarray:
        """(K, U) shares of each part the nodes' slots (K, G) hold together. Shares are counted
        once per distinct percent; a node of one model takes or refuses all of its slots at once,
        only nodes that mix models are counted slot by slot. `left`: 0..100, an index (see `_lost`)."""
        if self.acc is not None and model is not None:
            mixed = ((model != model[:, :1]) & (left > 0)).any(axis=1)
            if mixed.any():
                by_slot: np.ndarray = (np.take(self.div[left], self.pct_at, axis=-1) * self.acc[model]).sum(axis=1)
                return by_slot
        room = np.take(self.div[left].sum(axis=1), self.pct_at, axis=-1)
        if self.acc is not None and model is not None:
            room = room * self.acc[model[:, 0]]
        return room

    def from_room(self, cpu: np.ndarray, hmem: np.ndarray, room: np.ndarray) -> np.ndarray:
        """(K, M) of nodes with this CPU and memory left (K,) and shares per part (K, U): a float
        quotient, cast to an integer, is the floor `_host` has."""
        host = self._host(cpu, hmem)
        places: np.ndarray = np.minimum(host, self._by_shape(room / self.cnt_f), out=host)
        return np.ascontiguousarray(places.T)

    def lose(self, room: np.ndarray, pct: int, slots: np.ndarray, model: np.ndarray | None) -> np.ndarray:
        """(N, U): the `room` (N, U) of each option's node less the shares its slots (idle percent
        `slots` (N, C), model ids `model`) lose when `pct` is taken from each: a delta on the room,
        not a recount of every slot."""
        out: np.ndarray = room - self._lost(slots, model, pct)
        return out

    def after(self, cpu: np.ndarray, hmem: np.ndarray, room: np.ndarray, k: np.ndarray | None = None) -> np.ndarray:
        """(N, M): the places of option i, whose node k[i] (i when k is None) has this CPU and memory
        (K,) and whose room per part is `room` (N, U)."""
        if k is None:
            return self.from_room(cpu, hmem, room)
        spread = np.ascontiguousarray(self._host(cpu, hmem).T)[k]  # divided per node, then spread over its options
        by_part = np.ascontiguousarray(self._by_shape(room / self.cnt_f).T)
        places: np.ndarray = np.minimum(spread, by_part, out=spread)
        return places


FIX = 20  # bits after the binary point of the outlook's weights


def fixed(x: np.ndarray) -> np.ndarray:
    """x rounded to a multiple of 2**-FIX. Sums of such numbers are exact in float64 while below
    2**(53 - FIX) (places lost times scarcity stay below 2**22 per shape up to 16 GPUs a node, so
    below 2**32 over 1,024 shapes), so they do not depend on the order of the additions, which BLAS
    picks by the rows it computes together: a node's score is the same in any pass."""
    out: np.ndarray = np.ldexp(np.rint(np.ldexp(x, FIX)), -FIX)
    return out


class Reach:
    """The summed weight of the shapes that have a place on each node, by table lookup. A place
    needs the shape's CPU, its memory and one pod's shares of its GPU part (any of them may be
    nothing), so the weights are summed once per (CPU rank, memory rank, part): a node's CPU and
    memory pick a row of U + 1 sums, its room decides which of them count. (N, U) work per pass
    instead of (N, M), the outlook's shapes being several times its GPU parts."""

    def __init__(self, places: Places, weight: np.ndarray) -> None:
        w = weight > 0
        cpu, mem, gpu = places.table[0], places.table[1], places.table[2] > 0
        self.cpus = np.unique(cpu[w & (cpu > 0)])  # sizes of 0 leave a place whatever is left
        self.mems = np.unique(mem[w & (mem > 0)])
        self.parts = np.unique(places.part[w & gpu])  # among places' parts
        self.every = self.parts.size == places.cnt.size  # all of them: no columns to pick
        self.cnt = places.cnt[self.parts]
        col = np.full(weight.size, self.parts.size)  # CPU-only shapes: a column with a place always
        col[gpu] = np.searchsorted(self.parts, places.part[gpu])
        ci = np.where(cpu > 0, np.searchsorted(self.cpus, cpu) + 1, 0)
        hi = np.where(mem > 0, np.searchsorted(self.mems, mem) + 1, 0)
        shape = (self.cpus.size + 1, self.mems.size + 1, self.parts.size + 1)
        at = np.ravel_multi_index((ci[w], hi[w], col[w]), shape)
        table = np.bincount(at, weight[w], minlength=math.prod(shape)).reshape(shape)
        for i in range(1, shape[0]):  # row by row: np.cumsum along a leading axis is 4x slower here
            table[i] += table[i - 1]
        for j in range(1, shape[1]):
            table[:, j] += table[:, j - 1]
        # [i * (memory sizes + 1) + j, u]: the weight of the shapes of part u that need at most the
        # i-th CPU size and the j-th memory size; one index per node, so a lookup takes whole rows
        self.rows = table.reshape(-1, shape[2])

    def __call__(self, cpu: np.ndarray, hmem: np.ndarray, room: np.ndarray, k: np.ndarray | None = None) -> np.ndarray:
        """(N,): the weight with a place on option i, whose node k[i] (i when k is None) has this
        CPU and memory left (K,) and whose shares of places' parts are `room` (N, U)."""
        ci, hi = np.searchsorted(self.cpus, cpu, side="right"), np.searchsorted(self.mems, hmem, side="right")
        at = ci * (self.mems.size + 1) + hi
        w = self.rows.take(at if k is None else at[k], axis=0)
        w[:, :-1] *= (room if self.every else room.take(self.parts, axis=1)) >= self.cnt  # take: C order, fast
        out: np.ndarray = w.sum(axis=1)
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


def soft_deficit(cpu: np.ndarray, gpu: np.ndarray, rho: float) -> np.ndarray:
    """The CPU a node lacks for its idle GPUs (rho per GPU percent), smoothed over TAU, in GPU
    percent: about 0 with a surplus of several TAU, about the deficit once it is large, and exactly
    0 with no idle GPU (nothing left to strand, however little CPU is left)."""
    r = max(rho, 1.0)
    deficit: np.ndarray = TAU * (np.logaddexp(0.0, (r * gpu - cpu) / TAU) - np.logaddexp(0.0, -cpu / TAU)) / r
    return deficit


@dataclass(slots=True)
class Drift:
    """When the outlook is re-derived, past its first `every` pods: once `every` pods have been seen
    since the last derivation and either the idle GPU of a pool (the whole cluster, and the GPU
    models each set of pins accepts) has moved by more than `fill` of what it was then (places run
    short and the forecast's horizon shrinks, fastest as the pool fills up) or the pods since are
    `grow` of the pods seen before it (the mix moved: its estimate settles as pods add up). On a
    steady workload that is often early and near full, rarely in between, and seldom once the
    cluster is full; fill = grow = 0 is every `every` pods."""

    every: int = OUTLOOK
    fill: float = FILL
    grow: float = GROW
    look: int = 8  # pods between looks at the pools (a sum over every GPU), once `every` have been seen
    seen: int = 0  # pods seen at the last derivation
    idle: tuple[int, ...] = ()  # GPU percent idle in each pool then

    def mark(self, seen: int, idle: Sequence[int]) -> None:
        """A derivation from `seen` pods, with `idle` GPU percent idle in each pool."""
        self.seen, self.idle = seen, tuple(idle)

    def waited(self, seen: int) -> bool:
        """Whether to look at the pools now (`due` may say yes): `every` pods have been seen since
        the last derivation, and a multiple of `look` since."""
        since = seen - self.seen
        return since >= self.every and since % self.look == 0

    def due(self, seen: int, idle: Sequence[int]) -> bool:
        """Whether the workload (`seen` pods, `idle` GPU percent in the pools `mark` was given) has
        drifted from the one of the last derivation."""
        since = seen - self.seen
        if since < self.every:
            return False
        moved = any(abs(now - then) > self.fill * then for now, then in zip(idle, self.idle, strict=True))
        return moved or since >= self.grow * self.seen


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
