"""The scorer's caches, all keyed by node version (a pod changes one node): `RowMemo`, values per
node; `ShapeCache`, scores and chosen slots per request shape; `States`, an id per distinct node
state, by which `distinct` evaluates alike nodes once. Their owners drop them when what the
values depend on beyond the node changes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from crihook.scheduler.placement import host_cpu
from crihook.scheduler.request import Selectors

if TYPE_CHECKING:
    from crihook.scheduler.plugin import Cluster
    from crihook.scheduler.request import PodRequest


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
