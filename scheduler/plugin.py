"""DeviceShare: the cluster's device state and the scheduling-framework steps over it.

One class serves the extender, the simulator and the tests. State is a set of numpy arrays (one row
per node, one column per GPU slot) so that Filter and Score over thousands of nodes are a few
vectorised operations; per-pod bookkeeping (what each pod holds) makes Unreserve an exact rollback.
Pure: no I/O, no clock, no randomness except through a policy's own seeded generator.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import compress, repeat
from typing import Protocol, runtime_checkable

import numpy as np

from crihook.base import allocation
from crihook.base.allocation import (
    CONTAINER_DEVICES,
    DEVICE_ALLOCATED,
    GPU,
    GPU_CORE,
    GPU_MEMORY,
    GPU_MEMORY_RATIO,
    RDMA,
    RDMA_TYPE,
    DeviceAllocation,
)
from crihook.scheduler import topology
from crihook.scheduler.arrays import same_rows
from crihook.scheduler.devices import Gpu, Nic, NodeDevices
from crihook.scheduler.pod import Pod
from crihook.scheduler.request import STRATEGIES, PodRequest, RequestError, Selectors, parse_request

LEARNED_MAX = 1 << 16  # pod uids remembered as observed; far more than wait for a place at once
CPU_SHORT, MEM_SHORT, NO_GPUS, TOO_FEW, NO_NICS, NO_PARTITION, NO_CHOICE = range(7)  # why a node fails, as checked
TailKey = tuple[
    int, int, int, int, int, int, int, tuple[tuple[str, int], ...]
]  # GPU counts and refusals of a failing node


class Unschedulable(Exception):
    """The pod does not fit the node (any more); str() is the reason."""


@dataclass(frozen=True, slots=True)
class Allocation:
    uid: str
    node: str
    gpus: tuple[DeviceAllocation, ...] = ()
    nics: tuple[DeviceAllocation, ...] = ()


@dataclass(slots=True)
class _Held:
    """What one pod holds, in minors, so the charge can be undone or replayed on a new Device."""

    node: str
    gpus: list[tuple[int, int, int]]  # (minor, core, memory bytes)
    nics: list[tuple[int, int]]  # (minor, percent)
    cpu: int
    memory: int
    alloc: Allocation | None = None  # set for pods this plugin reserved (not for live pods)


class Policy(Protocol):
    """How nodes are scored and GPUs picked inside a node. `rows` are node rows that passed Filter,
    `fits` (len(rows), G) the GPU slots that can take one share of the request."""

    def observe(self, req: PodRequest) -> None: ...

    def scores(self, st: Cluster, req: PodRequest, rows: np.ndarray, fits: np.ndarray) -> np.ndarray: ...

    def pick(self, st: Cluster, req: PodRequest, row: int, fits: np.ndarray) -> list[int]: ...


@runtime_checkable
class Refreshes(Protocol):
    """A policy whose periodic re-derivation can run off the request path (DefaultPolicy.outlook_job)."""

    def outlook_job(self, st: Cluster) -> Callable[[], Callable[[], None]] | None: ...


@dataclass(frozen=True, slots=True)
class PluginConfig:
    strategy: str = "fragmentation"  # cluster default: fragmentation | binpack | spread
    policy: Policy | None = None  # replaces the node/GPU scoring (the simulator's baselines)
    background_outlook: bool = False  # the default policy's outlook re-derived by outlook_job (the extender)


class Cluster:
    """The arrays. Rows are reused when nodes go; columns grow to the largest GPU count."""

    def __init__(self) -> None:
        self.rows: dict[str, int] = {}
        self.nodes: list[NodeDevices | None] = []
        self.slots: list[dict[int, int]] = []  # per row: minor -> column
        self.free_rows: list[int] = []
        self.width = 0
        self.core_free = np.zeros((0, 0), np.int64)
        self.mem_free = np.zeros((0, 0), np.int64)
        self.mem_total = np.ones((0, 0), np.int64)
        self.usable = np.zeros((0, 0), bool)  # present, healthy and not held by a DRA claim
        self.claimed = np.zeros((0, 0), bool)  # held by an allocated ResourceClaim (scheduler/claims.py)
        self.cpu_free = np.zeros(0, np.int64)
        self.hmem_free = np.zeros(0, np.int64)
        self.host_cap = np.zeros((0, 2), np.int64)  # allocatable CPU (milli) and memory (bytes); 0 unknown
        self.host_known = np.zeros(0, bool)
        self.live = np.zeros(0, bool)
        self.version = np.zeros(0, np.int64)  # bumped on every change of a row
        self.idle = np.zeros((0, 0), np.int64)  # left() of every slot, kept current by touch()
        self.ngpus = np.zeros(0, np.int64)  # GPU slots present per row
        self.nmig = np.zeros(0, np.int64)  # of which in MIG mode (not usable), for Filter's reasons
        self.model = np.zeros((0, 0), np.int64)  # per slot: index into model_names (0 for absent slots)
        self.model_names: list[str] = []  # every GPU model seen, in order of appearance
        self.model_ids: dict[str, int] = {}
        self.special = np.zeros(0, bool)  # rows that need a per-node GPU choice in Filter (partitions)
        self.generation = 0  # bumped on every change of any row
        self.epoch = 0  # bumped when rows or columns are re-laid out
        self.nic_free: list[dict[int, int]] = []

    def _grow(self, rows: int, width: int) -> None:
        n0, w0 = self.core_free.shape
        n1, w1 = max(rows, n0), max(width, w0)
        if (n1, w1) == (n0, w0):
            return
        if n1 > n0:
            n1 = max(n1, 2 * n0, 16)

        def grow2(a: np.ndarray, fill: int | bool) -> np.ndarray:
            b = np.full((n1, w1), fill, a.dtype)
            b[:n0, :w0] = a
            return b

        def grow1(a: np.ndarray, fill: int | bool) -> np.ndarray:
            b = np.full(n1, fill, a.dtype)
            b[:n0] = a
            return b

        self.core_free, self.mem_free = grow2(self.core_free, 0), grow2(self.mem_free, 0)
        self.mem_total, self.usable = grow2(self.mem_total, 1), grow2(self.usable, False)
        self.claimed = grow2(self.claimed, False)
        self.cpu_free, self.hmem_free = grow1(self.cpu_free, 0), grow1(self.hmem_free, 0)
        if n1 > n0:
            self.host_cap = np.concatenate([self.host_cap, np.zeros((n1 - n0, 2), np.int64)])
        self.host_known, self.live = grow1(self.host_known, False), grow1(self.live, False)
        self.version = grow1(self.version, 0)
        self.idle, self.special, self.ngpus = grow2(self.idle, 0), grow1(self.special, False), grow1(self.ngpus, 0)
        self.model, self.nmig = grow2(self.model, 0), grow1(self.nmig, 0)
        self.width = w1
        self.epoch += 1

    def snapshot(self) -> Cluster:
        """A copy that later changes do not touch: what a job reads without the lock."""
        out = copy.copy(self)
        for name, value in vars(self).items():
            if isinstance(value, np.ndarray | list | dict):
                setattr(out, name, value.copy())
        return out

    def left(self, rows: np.ndarray | slice) -> np.ndarray:
        """Idle capacity of each GPU slot in percent: the smaller of compute and memory."""
        return self.idle[rows]

    def model_id(self, name: str) -> int:
        i = self.model_ids.get(name)
        if i is None:
            i = self.model_ids[name] = len(self.model_names)
            self.model_names.append(name)
        return i

    def touch(self, row: int) -> None:
        """Record a change of one row: its idle capacity, its version, the cluster's generation."""
        mem_pct = (100 * (self.mem_free[row] + 1) - 1) // self.mem_total[row]
        self.idle[row] = np.where(self.usable[row], np.clip(np.minimum(self.core_free[row], mem_pct), 0, 100), 0)
        self.version[row] += 1
        self.generation += 1


class DeviceShare:
    """In-memory cluster device state + the scheduling-framework steps. Pure: no I/O, deterministic.
    Not thread-safe by itself: callers serialise (the extender holds a lock)."""

    def __init__(self, config: PluginConfig | None = None) -> None:
        self.config = config or PluginConfig()
        if self.config.strategy not in STRATEGIES:
            raise ValueError(f"strategy {self.config.strategy!r} is not one of {', '.join(STRATEGIES)}")
        if self.config.policy is None:
            from crihook.scheduler.score import DefaultPolicy

            self.policy: Policy = DefaultPolicy(background=self.config.background_outlook)
        else:
            self.policy = self.config.policy
        self.st = Cluster()
        self.held: dict[str, _Held] = {}
        self.by_node: dict[str, set[str]] = {}
        self.claimed: dict[str, frozenset[int]] = {}  # node -> GPU minors DRA claims hold
        self.learned: dict[str, None] = {}  # uids the policy has observed, oldest first
        self._all: tuple[list[str], np.ndarray] | None = None  # every node in name order
        # the last feasibility answer: (request, generation, rows, ok, fits, row -> position)
        self._memo: tuple[PodRequest, int, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        self._allowed: dict[tuple[tuple[str, ...], tuple[str, ...]], np.ndarray] = {}

    # ----- cluster state -----------------------------------------------------------------------
    def set_node(self, node: NodeDevices) -> None:
        st = self.st
        row = st.rows.get(node.name)
        if row is None:
            row = st.free_rows.pop() if st.free_rows else len(st.nodes)
            if row == len(st.nodes):
                st.nodes.append(None)
                st.slots.append({})
                st.nic_free.append({})
            st.rows[node.name] = row
            self._all = None
        st._grow(row + 1, len(node.gpus))
        st.nodes[row] = node
        st.slots[row] = {g.minor: i for i, g in enumerate(node.gpus)}
        st.core_free[row] = 0
        st.mem_free[row] = 0
        st.mem_total[row] = 1
        st.usable[row] = False
        st.model[row] = 0
        for i, g in enumerate(node.gpus):
            st.model[row, i] = st.model_id(g.model)
            st.core_free[row, i] = 100
            st.mem_free[row, i] = g.memory
            st.mem_total[row, i] = max(g.memory, 1)
        self._mark_claimed(row, node)
        st.host_known[row] = node.cpu_milli > 0
        st.cpu_free[row] = node.cpu_milli
        st.host_cap[row] = (node.cpu_milli, node.memory)
        st.hmem_free[row] = node.memory if node.memory > 0 else 2**62
        st.nic_free[row] = {n.minor: 100 if n.healthy else 0 for n in node.nics}
        st.live[row] = True
        st.special[row] = bool(node.partitions)
        st.ngpus[row] = len(node.gpus)
        st.nmig[row] = sum(1 for g in node.gpus if g.mig)
        st.touch(row)
        for uid in self.by_node.get(node.name, ()):
            self._charge(self.held[uid], +1)
        # GPUs the device plugin handed to pods this scheduler did not place (spec.nodeName, other
        # schedulers) are in use too; a pod it placed has a phantom plugin entry, not counted.
        for uid, minors in node.plugin_held.items():
            placed = self.held.get(uid)
            if placed is None or not placed.gpus:
                for m in minors:
                    col = st.slots[row][m]
                    st.core_free[row, col] = min(st.core_free[row, col], 0)
                    st.mem_free[row, col] = min(st.mem_free[row, col], 0)

    def set_claimed(self, node: str, minors: Iterable[int]) -> None:
        """The GPU minors of `node` that allocated ResourceClaims hold: never given to a pod here
        (a GPU is held by one path at a time). Kept across Device updates."""
        held = frozenset(minors)
        if self.claimed.get(node, frozenset()) == held:
            return
        if held:
            self.claimed[node] = held
        else:
            self.claimed.pop(node, None)
        row = self.st.rows.get(node)
        nd = None if row is None else self.st.nodes[row]
        if row is not None and nd is not None:
            self._mark_claimed(row, nd)
            self.st.touch(row)

    def _mark_claimed(self, row: int, node: NodeDevices) -> None:
        st = self.st
        held = self.claimed.get(node.name, frozenset())
        st.claimed[row] = st.usable[row] = False
        for i, g in enumerate(node.gpus):  # an unhealthy GPU is counted as such, claimed or not
            st.claimed[row, i] = g.healthy and g.minor in held
            st.usable[row, i] = g.healthy and g.minor not in held

    def remove_node(self, name: str) -> None:
        st = self.st
        row = st.rows.pop(name, None)
        if row is None:
            return
        self._all = None
        st.nodes[row] = None
        st.slots[row] = {}
        st.nic_free[row] = {}
        st.live[row] = False
        st.usable[row] = st.claimed[row] = False
        st.special[row] = False
        st.ngpus[row] = st.nmig[row] = 0
        st.touch(row)
        st.free_rows.append(row)

    def add_pod(self, pod: Pod, node: str) -> None:
        """Charge a live pod: its allocation annotation, and its host requests; a pod new to this
        plugin is also observed by the policy. Finished pods and pods already known (reserved here)
        are left alone."""
        if pod.finished:
            self.remove_pod(pod.uid)
            return
        uid = pod.uid or pod.key
        old = self.held.get(uid)
        if old is not None and old.node == node:
            return
        self.remove_pod(uid)
        gpus: list[tuple[int, int, int]] = []
        nics: list[tuple[int, int]] = []
        text = pod.annotations.get(DEVICE_ALLOCATED)
        if text:
            allocs = allocation.parse_device_allocated(text, (GPU, RDMA_TYPE))
            for a in allocs.get(GPU, ()):
                mem = a.resources.get(GPU_MEMORY)
                if mem is None:
                    mem = a.resources.get(GPU_MEMORY_RATIO, 100) * self._gpu_memory(node, a.minor) // 100
                gpus.append((a.minor, a.resources.get(GPU_CORE, 100), mem))
            nics = [(a.minor, a.resources.get(RDMA, 100)) for a in allocs.get(RDMA_TYPE, ())]
        try:
            req = parse_request(pod)
            cpu, mem_host = req.cpu_milli, req.host_memory
        except RequestError:
            cpu = mem_host = 0  # it runs already; charge what its annotation says
        else:
            if old is None and req.wants_devices:
                # placed before a restart or by another scheduler: still the workload the policy learns
                self.learn(uid, req)
        held = _Held(node, gpus, nics, cpu, mem_host)
        self._hold(uid, held)
        row = self.st.rows.get(node)
        nd = self.st.nodes[row] if row is not None else None
        if nd is not None and uid in nd.plugin_held:
            self.set_node(nd)  # the reporter listed its phantom plugin entry before its allocation was known

    def remove_pod(self, uid: str) -> None:
        held = self.held.pop(uid, None)
        if held is None:
            return
        self.by_node.get(held.node, set()).discard(uid)
        self._charge(held, -1)

    def node_gpus(self, node: str) -> tuple[Gpu, ...]:
        """The GPUs of `node`'s Device object (none for a node without one)."""
        row = self.st.rows.get(node)
        nd = None if row is None else self.st.nodes[row]
        return () if nd is None else tuple(nd.gpus)

    def _gpu_memory(self, node: str, minor: int) -> int:
        row = self.st.rows.get(node)
        if row is None:
            return 0
        col = self.st.slots[row].get(minor)
        return 0 if col is None else int(self.st.mem_total[row, col])

    def _hold(self, uid: str, held: _Held) -> None:
        self.held[uid] = held
        self.by_node.setdefault(held.node, set()).add(uid)
        self._charge(held, +1)

    def _charge(self, held: _Held, sign: int) -> None:
        """Apply (+1) or undo (-1) a pod's charge on its node, if the node is known."""
        st = self.st
        row = st.rows.get(held.node)
        if row is None:
            return
        slots = st.slots[row]
        for minor, core, mem in held.gpus:
            col = slots.get(minor)
            if col is not None:
                st.core_free[row, col] -= sign * core
                st.mem_free[row, col] -= sign * mem
        for minor, pct in held.nics:
            if minor in st.nic_free[row]:
                st.nic_free[row][minor] -= sign * pct
        st.cpu_free[row] -= sign * held.cpu
        st.hmem_free[row] -= sign * held.memory
        st.touch(row)

    # ----- framework steps ---------------------------------------------------------------------
    def pre_filter(self, pod: Pod) -> PodRequest:
        req = parse_request(pod)
        if req.wants_devices:
            self.learn(pod.uid, req)
        return req

    def learn(self, uid: str, req: PodRequest) -> None:
        """The policy observes each pod once: kube-scheduler sends the same pod to filter and to
        prioritize, and again at every retry, and a pod that waits long must not weigh more."""
        if uid:
            if uid in self.learned:
                return
            self.learned[uid] = None
            if len(self.learned) > LEARNED_MAX:
                del self.learned[next(iter(self.learned))]
        self.policy.observe(req)

    def filter(self, req: PodRequest, node: str) -> str | None:
        return self.filter_nodes(req, [node])[1].get(node)

    def filter_nodes(
        self, req: PodRequest, nodes: Iterable[str] | None = None, reasons: bool = True
    ) -> tuple[list[str], dict[str, str]]:
        """(names that fit, {name: reason} for those that do not), in the order given; all known
        nodes in name order when `nodes` is None. `reasons=False` skips the messages."""
        names, rows, missing = self._rows(nodes)
        ok, fits = self._feasible(req, rows)
        failed = {n: "node has no Device object (no GPUs known)" for n in missing}
        if reasons and not ok.all():
            bad = np.flatnonzero(~ok)
            failed.update(self._reasons(req, [names[i] for i in bad], rows[bad], fits[bad]))
        return list(compress(names, ok.tolist())), failed

    def score(self, req: PodRequest, node: str) -> int:
        return round(self.score_nodes(req, [node]).get(node, 0.0))

    def score_nodes(self, req: PodRequest, nodes: Iterable[str] | None = None) -> dict[str, float]:
        """Scores in 0..100 (higher is better) for the nodes that fit; floats keep the ordering
        exact for callers that pick the best node themselves."""
        names, rows, _ = self._rows(nodes)
        ok, fits = self._feasible(req, rows)
        idx = np.flatnonzero(ok)
        fit_names = list(compress(names, ok.tolist()))
        strategy = req.strategy or self.config.strategy
        custom = self.config.policy is not None
        if idx.size == 0 or (not req.count and not custom and not self.st.host_known[rows[idx]].any()):
            return dict.fromkeys(fit_names, 100.0)
        if strategy == "fragmentation" or custom or not req.count:
            s = self.policy.scores(self.st, req, rows[idx], fits[idx])
        else:
            used = 100 * (self.st.usable[rows[idx]].sum(axis=1)) - self.st.left(rows[idx]).sum(axis=1)
            cap = np.maximum(100 * self.st.usable[rows[idx]].sum(axis=1), 1)
            s = 100.0 * used / cap if strategy == "binpack" else 100.0 - 100.0 * used / cap
        return dict(zip(fit_names, np.asarray(s, np.float64).tolist(), strict=True))

    def outlook_job(self) -> Callable[[], Callable[[], None]] | None:
        """The policy's due re-derivation as a job to run without the lock (Refreshes), if any."""
        return self.policy.outlook_job(self.st) if isinstance(self.policy, Refreshes) else None

    def reserve(self, req: PodRequest, node: str) -> Allocation:
        held = self.held.get(req.uid)
        if held is not None:
            if held.node == node and held.alloc is not None:
                return held.alloc
            raise Unschedulable(f"pod {req.key} already holds devices on node {held.node}")
        row = self.st.rows.get(node)
        if row is None:
            raise Unschedulable(f"node {node} has no Device object (no GPUs known)")
        rows = np.array([row])
        ok, fits = self._feasible(req, rows)
        if not ok[0]:
            raise Unschedulable(self._reason(req, row, fits[0]))
        cols = self._choose(req, row, fits[0])
        if cols is None:
            raise Unschedulable(self._reason(req, row, fits[0]))
        nd = self.st.nodes[row]
        assert nd is not None
        gpus = []
        charge = []
        for col in sorted(cols, key=lambda c: nd.gpus[c].minor):
            g = nd.gpus[col]
            mem = req.memory_on(g.memory)
            res = {GPU_CORE: req.core, GPU_MEMORY: mem, GPU_MEMORY_RATIO: mem * 100 // max(g.memory, 1)}
            gpus.append(DeviceAllocation(minor=g.minor, id=g.uuid, resources=res))
            charge.append((g.minor, req.core, mem))
        nic_minors = self._pick_nics(req, row, [nd.gpus[c] for c in cols])
        if nic_minors is None:
            raise Unschedulable(f"node {node}: no free RDMA NIC for pod {req.key}")
        nics = tuple(
            DeviceAllocation(minor=m, id=next(n.id for n in nd.nics if n.minor == m), resources={RDMA: req.rdma_share})
            for m in nic_minors
        )
        alloc = Allocation(req.uid, node, tuple(gpus), nics)
        held = _Held(node, charge, [(m, req.rdma_share) for m in nic_minors], req.cpu_milli, req.host_memory, alloc)
        self._hold(req.uid, held)
        return alloc

    def unreserve(self, uid: str) -> None:
        held = self.held.get(uid)
        if held is not None and held.alloc is not None:
            self.remove_pod(uid)

    def pre_bind(self, req: PodRequest, alloc: Allocation) -> dict[str, str]:
        allocs: dict[str, tuple[DeviceAllocation, ...]] = {}
        if alloc.gpus:
            allocs[GPU] = alloc.gpus
        if alloc.nics:
            allocs[RDMA_TYPE] = alloc.nics
        if not allocs:
            return {}
        out = {DEVICE_ALLOCATED: allocation.format_device_allocated(allocs)}
        if alloc.gpus and req.gpu_containers:
            minors = [g.minor for g in alloc.gpus]
            per: dict[str, dict[str, list[int]]] = {}
            if all(n > 0 for _, n in req.gpu_containers):  # whole GPUs per container: split them
                at = 0
                for name, n in req.gpu_containers:
                    per[name] = {GPU: minors[at : at + n]} if name not in per else per[name]
                    at += n if at + n <= len(minors) else 0
            else:  # shares: every GPU container sees the pod's GPUs
                per = {name: {GPU: minors} for name, _ in req.gpu_containers}
            out[CONTAINER_DEVICES] = allocation.format_container_devices(per)
        return out

    # ----- internals ---------------------------------------------------------------------------
    def _rows(self, nodes: Iterable[str] | None) -> tuple[list[str], np.ndarray, list[str]]:
        st = self.st
        if nodes is None:
            if self._all is None:
                names = sorted(st.rows)
                self._all = (names, np.array([st.rows[n] for n in names], dtype=np.int64))
            return self._all[0], self._all[1], []
        names = list(nodes)
        rows = np.fromiter(map(st.rows.get, names, repeat(-1)), np.int64, len(names))  # C loop, not Python's
        if rows.size and rows.min() < 0:
            keep = (rows >= 0).tolist()
            missing = [n for n, k in zip(names, keep, strict=True) if not k]
            return list(compress(names, keep)), rows[rows >= 0], missing
        return names, rows, []

    def gpu_fits(self, req: PodRequest, rows: np.ndarray) -> np.ndarray:
        """(len(rows), G): GPU slots with room for one share of the request."""
        st = self.st
        fits = st.usable[rows] & (st.core_free[rows] >= req.core)
        need = req.memory if req.memory else req.ratio * st.mem_total[rows] // 100
        fits &= st.mem_free[rows] >= need
        return self._selected(req, rows, fits)

    def _selected(self, req: PodRequest, rows: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """`mask` with the GPU slots the pod's model/uuid selectors refuse cleared (in place)."""
        st = self.st
        sel = req.selectors
        if sel.use_types or sel.nouse_types:
            mask &= self._models_allowed(sel)[st.model[rows]]
        if sel.use_uuids or sel.nouse_uuids:
            for i, r in enumerate(rows):
                nd = st.nodes[r]
                assert nd is not None
                for col, g in enumerate(nd.gpus):
                    if mask[i, col] and sel.refuses(g.model, g.uuid):
                        mask[i, col] = False
        return mask

    def could_fit_empty(self, req: PodRequest, nodes: Iterable[str]) -> set[str]:
        """The nodes that would take the pod's GPUs with no pod on them: where evicting pods could
        help (kube-scheduler's preemption), as opposed to too few, too small or refused GPUs."""
        names, rows, _ = self._rows(nodes)
        st = self.st
        need = req.memory if req.memory else req.ratio * st.mem_total[rows] // 100
        cap = self._selected(req, rows, st.usable[rows] & (st.mem_total[rows] >= need) & (req.core <= 100))
        return set(compress(names, (cap.sum(axis=1) >= req.count).tolist()))

    def fits_without(self, req: PodRequest, node: str, uids: Iterable[str]) -> bool:
        """Whether the pod would fit `node` if the pods `uids` were gone (preemption's question);
        the state is the same afterwards."""
        row = self.st.rows.get(node)
        if row is None:
            return False
        gone = [self.held[u] for u in dict.fromkeys(uids) if u in self.held and self.held[u].node == node]
        for h in gone:
            self._charge(h, -1)
        try:
            return bool(self._feasible(req, np.array([row]))[0][0])
        finally:
            for h in gone:
                self._charge(h, +1)

    def _models_allowed(self, sel: Selectors) -> np.ndarray:
        """(models,): the GPU models the selectors' type lists allow, remembered per type lists."""
        names = self.st.model_names
        key = (sel.use_types, sel.nouse_types)
        got = self._allowed.get(key)
        if got is None or got.size != len(names):
            types = Selectors(sel.use_types, sel.nouse_types)
            got = np.array([types.refuses(n, "") is None for n in names], bool)
            if len(self._allowed) > LEARNED_MAX:
                self._allowed.clear()
            self._allowed[key] = got
        return got

    def _feasible(self, req: PodRequest, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(ok (K,), fits (K, G)) for the rows. Filter, Score and Reserve of one pod ask about the
        same state, so the last answer is reused while no row has changed."""
        st = self.st
        memo = self._memo
        if memo is not None and memo[0] is req and memo[1] == st.generation:
            at = memo[5][np.minimum(rows, memo[5].size - 1)] if rows.size else rows
            if rows.size == 0 or (at.min() >= 0 and (memo[2][at] == rows).all()):
                return memo[3][at], memo[4][at]
        fits = self.gpu_fits(req, rows)
        ok = fits.sum(axis=1) >= req.count
        host = ~st.host_known[rows] | ((st.cpu_free[rows] >= req.cpu_milli) & (st.hmem_free[rows] >= req.host_memory))
        ok &= host
        check = ok.copy() if req.rdma else ok & st.special[rows] if req.count and not req.shared else None
        for i in () if check is None else np.flatnonzero(check):
            r = int(rows[i])
            ok[i] = self._choose(req, r, fits[i]) is not None and (
                not req.rdma or self._pick_nics(req, r, self._gpus_for_nics(req, r, fits[i])) is not None
            )
        if rows.size:
            where = np.full(int(rows.max()) + 1, -1, np.int64)
            where[rows] = np.arange(rows.size)
            self._memo = (req, st.generation, rows, ok, fits, where)
        return ok, fits

    def _gpus_for_nics(self, req: PodRequest, row: int, fits: np.ndarray) -> list[Gpu]:
        nd = self.st.nodes[row]
        assert nd is not None
        cols = self._choose(req, row, fits) or []
        return [nd.gpus[c] for c in cols]

    def _choose(self, req: PodRequest, row: int, fits: np.ndarray) -> list[int] | None:
        """The GPU slots for the request on one node, or None when no valid choice exists."""
        if req.count == 0:
            return []
        st = self.st
        nd = st.nodes[row]
        assert nd is not None
        cand = [int(c) for c in np.flatnonzero(fits)]
        if len(cand) < req.count:
            return None
        if req.joint and req.rdma:
            nic_pcie = {n.pcie for n in nd.nics if st.nic_free[row].get(n.minor, 0) >= req.rdma_share}
            cand = [c for c in cand if nd.gpus[c].pcie in nic_pcie]
            if len(cand) < req.count:
                return None
        if nd.partitions and not req.shared:
            minors = {nd.gpus[c].minor: c for c in cand}
            part = topology.pick_partition(nd, set(minors), req.count, req.partition, self._busy_minors(row))
            if part is not None:
                return [minors[m] for m in sorted(part.minors)]
            if nd.partition_policy == "Honor" or (req.partition is not None and req.partition.restricted):
                return None
        if req.count > 1 and nd.links:
            left = st.left(np.array([row]))[0]
            load = {nd.gpus[c].minor: 100 - int(left[c]) for c in cand}
            chosen = topology.best_set(nd.links, sorted(load), req.count, load if req.shared else None)
            by_minor = {nd.gpus[c].minor: c for c in cand}
            return [by_minor[m] for m in chosen]
        mask = np.zeros_like(fits)
        mask[cand] = True
        return self.policy.pick(st, req, row, mask)

    def _busy_minors(self, row: int) -> set[int]:
        nd = self.st.nodes[row]
        assert nd is not None
        left = self.st.left(np.array([row]))[0]
        return {g.minor for i, g in enumerate(nd.gpus) if left[i] < 100 or not g.healthy}

    def _pick_nics(self, req: PodRequest, row: int, gpus: Sequence[Gpu]) -> list[int] | None:
        if not req.rdma:
            return []
        nd = self.st.nodes[row]
        assert nd is not None
        free = self.st.nic_free[row]
        nics = [n for n in nd.nics if n.healthy and free.get(n.minor, 0) >= req.rdma_share]
        if req.joint and gpus:
            out = []
            for pcie in sorted({g.pcie for g in gpus}):
                near = [n for n in nics if n.pcie == pcie and n.minor not in out]
                if not near:
                    return None
                # the fullest NIC that still fits: keeps whole NICs for whole-NIC pods
                out.append(min(near, key=lambda n: (free[n.minor], n.minor)).minor)
            if len(out) >= req.rdma:
                return out
            more = self._more_nics(nics, out, req.rdma - len(out), free)
            return None if more is None else out + more
        return self._more_nics(nics, [], req.rdma, free)

    @staticmethod
    def _more_nics(nics: Sequence[Nic], taken: list[int], k: int, free: dict[int, int]) -> list[int] | None:
        rest = sorted((n for n in nics if n.minor not in taken), key=lambda n: (free[n.minor], n.minor))
        return [n.minor for n in rest[:k]] if len(rest) >= k else None

    def _reason(self, req: PodRequest, row: int, fits: np.ndarray) -> str:
        nd = self.st.nodes[row]
        assert nd is not None
        return self._reasons(req, [nd.name], np.array([row]), fits[None, :])[nd.name]

    def _reasons(self, req: PodRequest, names: Sequence[str], rows: np.ndarray, fits: np.ndarray) -> dict[str, str]:
        """Why each of these (failing) nodes can not take the pod. Counted with array operations;
        nodes in the same situation share one message tail, so thousands of nodes cost little."""
        st = self.st
        present = np.arange(st.width) < st.ngpus[rows][:, None]
        usable = st.usable[rows] & present
        sel = req.selectors
        refused = np.zeros(fits.shape, bool)
        by_model: list[tuple[str, np.ndarray]] = []  # (reason, slots it refuses per node)
        if sel.use_types or sel.nouse_types:  # per model, as Filter decides them
            model = st.model[rows]
            refused = usable & ~fits & ~self._models_allowed(sel)[model]
            types = Selectors(sel.use_types, sel.nouse_types)
            for m in np.unique(model[refused]).tolist():
                why = str(types.refuses(st.model_names[m], ""))
                by_model.append((why, (refused & (model == m)).sum(axis=1)))
        texts: list[dict[str, int]] = [{} for _ in names] if sel.use_uuids or sel.nouse_uuids else []
        for i, r in enumerate(rows.tolist() if texts else ()):
            nd = st.nodes[r]
            assert nd is not None
            for col, g in enumerate(nd.gpus):
                refusal = sel.refuses(g.model, g.uuid) if usable[i, col] and not fits[i, col] else None
                if refusal and not refused[i, col]:
                    refused[i, col] = True
                    texts[i][str(refusal)] = texts[i].get(str(refusal), 0) + 1
        rest = usable & ~refused & ~fits
        core_short = rest & (st.core_free[rows] < req.core)
        n_fit = fits.sum(axis=1)
        cause = np.select(  # the first that holds, in this order
            [
                st.host_known[rows] & (st.cpu_free[rows] < req.cpu_milli),
                st.host_known[rows] & (st.hmem_free[rows] < req.host_memory),
                np.full(rows.size, req.count > 0) & (st.ngpus[rows] == 0),
                n_fit < req.count,
                np.full(rows.size, bool(req.rdma)),
                st.special[rows],
            ],
            [CPU_SHORT, MEM_SHORT, NO_GPUS, TOO_FEW, NO_NICS, NO_PARTITION],
            NO_CHOICE,
        )
        few = np.flatnonzero(cause == TOO_FEW)
        # too few GPUs: fitting, all, unhealthy, short of core, of memory, in MIG mode, refused per model
        mig = st.nmig[rows]
        claimed = st.claimed[rows] & present
        counts = np.stack(
            [
                n_fit,
                st.ngpus[rows],
                (present & ~st.usable[rows] & ~claimed).sum(axis=1) - mig,  # a GPU in MIG mode is never usable
                core_short.sum(axis=1),
                (rest & ~core_short).sum(axis=1),
                mig,
                claimed.sum(axis=1),
                *(per for _, per in by_model),
            ],
            axis=1,
        )[few]
        share = "whole GPU" if not req.shared else f"{req.core}% core and {req.ratio or req.memory}"
        share += "" if not req.shared else ("% memory" if req.ratio else " bytes memory")

        def tail(c: list[int], text: dict[str, int]) -> tuple[TailKey, str]:
            whys = dict(text)
            for (why, _), n in zip(by_model, c[7:], strict=True):
                if n:
                    whys[why] = whys.get(why, 0) + n
            key = (c[0], c[1], c[2], c[3], c[4], c[5], c[6], tuple(sorted(whys.items())))
            causes = {
                "unhealthy": c[2],
                "not enough free GPU core": c[3],
                "not enough free GPU memory": c[4],
                "in MIG mode (given as nvidia.com/mig-*)": c[5],
                "held by a DRA claim": c[6],
            }
            causes.update(key[7])
            detail = "; ".join(f"{n} {r}" for r, n in sorted(causes.items()) if n)
            return key, f"{c[0]} of {c[1]} GPUs can take a {share}, {req.count} needed ({detail})"

        if texts:  # refused UUIDs are counted per node
            seen: dict[TailKey, str] = {}
            tails = [seen.setdefault(*tail(c, texts[i])) for c, i in zip(counts.tolist(), few.tolist(), strict=True)]
        else:  # nodes in the same situation share one tail
            first, inverse = same_rows(counts)
            distinct = [tail(c, {})[1] for c in counts[first].tolist()]
            tails = [distinct[j] for j in inverse.tolist()]
        next_tail = iter(tails)
        cpu_free, hmem_free = st.cpu_free[rows].tolist(), st.hmem_free[rows].tolist()
        out: dict[str, str] = {}
        for i, (name, c) in enumerate(zip(names, cause.tolist(), strict=True)):
            if c == TOO_FEW:
                out[name] = f"node {name}: {next(next_tail)}"
            elif c == CPU_SHORT:
                out[name] = f"node {name}: not enough CPU ({cpu_free[i]}m free, {req.cpu_milli}m asked)"
            elif c == MEM_SHORT:
                out[name] = f"node {name}: not enough memory ({hmem_free[i]} bytes free, {req.host_memory} asked)"
            elif c == NO_GPUS:
                out[name] = f"node {name} has no GPUs"
            elif c == NO_NICS:
                out[name] = f"node {name}: not enough free RDMA NICs{' on the GPUs PCIe switches' if req.joint else ''}"
            elif c == NO_PARTITION:
                out[name] = f"node {name}: no free GPU partition of size {req.count} matches the pod's partition spec"
            else:
                out[name] = f"node {name}: no valid GPU choice"
        return out
