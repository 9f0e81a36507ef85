"""Counting places: how many pods of each shape fit node states (`Places`), the summed weight of
the shapes that still have a place on a node (`Reach`), and the fixed-point weights that keep
those sums exact whichever nodes they are computed with (`fixed`). The outlook's arithmetic."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

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
