"""Where a pod could go on a node and what FGD says that costs: the options of a request (the GPU
slots a one-GPU share could take, or a node's best-fitting whole GPUs), the node state before and
after each, FGD's fragmentation growth and its score bucket. Pure array functions over the rows of
a pass (`Nodes`), shared by the default policy and the baselines."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from crihook.scheduler.frag import Stats, Typical, frag_of, option_stats, set_stats

if TYPE_CHECKING:
    from crihook.scheduler.plugin import Cluster
    from crihook.scheduler.request import PodRequest


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
