"""Many concurrent binds through the extender, the way kube-scheduler drives it (filter, prioritize,
bind to the best node; several binds in flight), against the fake API server, with the scheduler
restarted in the middle. What the API server ends up holding is then checked GPU by GPU.

Used by tests/reliability/test_binds.py (a few hundred binds) and bench/scheduler_binds.py (1,000+).
"""

from __future__ import annotations

import copy
import itertools
import json
import random
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from crihook.base import quantity
from crihook.base.allocation import DEVICE_ALLOCATED, GPU, GPU_CORE, GPU_MEMORY, parse_device_allocated
from crihook.scheduler.cache import ClusterCache, KubeApi
from crihook.scheduler.extender import Extender
from crihook.scheduler.plugin import DeviceShare
from tests.support.extender import FIXTURES
from tests.support.fakekube import FakeKube

NAMESPACE = "load"
RETRIES = 3
SHAPES: tuple[dict[str, str], ...] = (
    {"nvidia.com/gpu": "1"},
    {"nvidia.com/gpu": "2"},
    {"koordinator.sh/gpu-core": "50", "koordinator.sh/gpu-memory-ratio": "50", "koordinator.sh/gpu.shared": "1"},
    {"koordinator.sh/gpu-core": "25", "koordinator.sh/gpu-memory-ratio": "25", "koordinator.sh/gpu.shared": "1"},
    {"koordinator.sh/gpu-core": "10", "koordinator.sh/gpu-memory": "8Gi", "koordinator.sh/gpu.shared": "1"},
)


@dataclass
class Scheduler:
    ext: Extender
    cache: ClusterCache

    @property
    def plugin(self) -> DeviceShare:
        return self.ext.plugin

    def stop(self) -> None:
        self.cache.stop()

    def state(self) -> dict[str, tuple[str, list[Any]]]:
        """What the allocator holds, per pod uid: node and (minor, core, memory) charges."""
        with self.ext.lock:
            return {uid: (h.node, sorted(h.gpus)) for uid, h in self.ext.plugin.held.items()}


def start_scheduler(kube: FakeKube) -> Scheduler:
    api_client = kube.api_client()
    plugin = DeviceShare()
    box: list[ClusterCache] = []
    ext = Extender(plugin, KubeApi(api_client), ready=lambda: bool(box) and box[0].ready())
    cache = ClusterCache(api_client, plugin, ext.lock)
    ext.resync_claims = cache.resync_claims
    ext.claim_asks = cache.claim_asks
    box.append(cache)
    cache.start()
    if not cache.wait_ready(30):
        raise RuntimeError("scheduler cache not ready")
    return Scheduler(ext, cache)


@contextmanager
def cluster(nodes: int) -> Iterator[FakeKube]:
    """A fake API server with `nodes` 8-GPU nodes (copies of the extender fixtures' first node)."""
    node = json.loads((FIXTURES / "cluster_nodes.json").read_text())["items"][0]
    device = json.loads((FIXTURES / "cluster_devices.json").read_text())["items"][0]
    with FakeKube() as kube:
        for i in range(nodes):
            name = f"gpu-node-{i:02d}"
            n, d = copy.deepcopy(node), copy.deepcopy(device)
            n["metadata"] = {**n["metadata"], "name": name, "uid": f"uid-{name}"}
            n["metadata"].pop("resourceVersion", None)
            d["metadata"] = {**d["metadata"], "name": name, "uid": f"dev-{name}"}
            d["metadata"].pop("resourceVersion", None)
            d["metadata"]["ownerReferences"] = [
                {"apiVersion": "v1", "kind": "Node", "name": name, "uid": f"uid-{name}"}
            ]
            kube.create("nodes", n)
            kube.create("devices", d)
        yield kube


@dataclass
class Result:
    pods: int = 0
    bound: int = 0
    refused: int = 0  # no node fits the pod
    lost_races: list[str] = field(default_factory=list)  # still lost after RETRIES tries
    retries: int = 0  # binds that lost a race to a concurrent bind and were tried again
    errors: list[str] = field(default_factory=list)  # anything else
    restart_seconds: float = 0.0
    state_before_restart: int = 0  # pods the allocator held when it was stopped
    rebuilt_same: bool = False
    seconds: float = 0.0
    gpus_checked: int = 0
    over_committed: list[str] = field(default_factory=list)
    shared_whole: list[str] = field(default_factory=list)
    unannotated_bound: list[str] = field(default_factory=list)
    held_mismatch: int = 0


def _pod(kube: FakeKube, i: int, rng: random.Random) -> dict[str, Any]:
    resources = dict(rng.choice(SHAPES))
    return kube.create(
        "pods",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"p{i:05d}", "namespace": NAMESPACE},
            "spec": {
                "schedulerName": "crihook",
                "containers": [
                    {"name": "main", "image": "x", "resources": {"limits": resources, "requests": resources}}
                ],
            },
        },
    )


def _schedule(sched: Scheduler, pod: dict[str, Any], nodes: list[str]) -> str:
    """One scheduling cycle of kube-scheduler with our extender; returns 'bound', 'refused' or an error."""
    ext = sched.ext
    filtered = ext.filter({"Pod": pod, "Nodes": None, "NodeNames": nodes})
    if filtered.get("Error"):
        return f"filter: {filtered['Error']}"
    fit = filtered.get("NodeNames") or []
    if not fit:
        return "refused"
    scores = {h["Host"]: h["Score"] for h in ext.prioritize({"Pod": pod, "Nodes": None, "NodeNames": fit})}
    best = max(fit, key=lambda n: (scores.get(n, 0), n))
    m = pod["metadata"]
    bound = ext.bind({"PodName": m["name"], "PodNamespace": m["namespace"], "PodUID": m["uid"], "Node": best})
    if not bound.get("Error"):
        return "bound"
    return f"lost race: {bound['Error']}"


def run(pods: int, nodes: int, workers: int, seed: int = 7) -> Result:
    result = Result(pods=pods)
    rng = random.Random(seed)
    started = time.monotonic()
    with cluster(nodes) as kube:
        names = [f"gpu-node-{i:02d}" for i in range(nodes)]
        objs = [_pod(kube, i, rng) for i in range(pods)]
        sched = start_scheduler(kube)
        holder = {"sched": sched}
        lock = threading.Lock()
        counter = itertools.count()
        restart_at = pods // 2
        gate = threading.Event()
        gate.set()

        in_flight = [0]
        idle = threading.Condition(lock)

        def one(pod: dict[str, Any]) -> str:
            n = next(counter)
            with lock:
                if n == restart_at:
                    gate.clear()
                    idle.wait_for(lambda: in_flight[0] == 0, 60)  # binds already running land first
                    old = holder["sched"]
                    before = old.state()
                    old.stop()
                    t = time.monotonic()
                    fresh = start_scheduler(kube)
                    _wait_for(lambda: fresh.state() == before, 30)
                    result.restart_seconds = time.monotonic() - t
                    result.state_before_restart = len(before)
                    result.rebuilt_same = fresh.state() == before
                    holder["sched"] = fresh
                    gate.set()
            gate.wait()
            with lock:
                in_flight[0] += 1
                sched = holder["sched"]
            try:
                outcome = _schedule(sched, pod, names)
                for _ in range(RETRIES):  # kube-scheduler requeues a pod whose bind lost a race
                    if not outcome.startswith("lost race: "):
                        break
                    result.retries += 1
                    outcome = _schedule(sched, pod, names)
                return outcome
            finally:
                with lock:
                    in_flight[0] -= 1
                    idle.notify_all()

        with ThreadPoolExecutor(workers) as pool:
            outcomes = list(pool.map(one, objs))
        result.bound = outcomes.count("bound")
        result.refused = outcomes.count("refused")
        result.lost_races = [o for o in outcomes if o.startswith("lost race: ")]
        result.errors = [o for o in outcomes if o not in ("bound", "refused") and not o.startswith("lost race: ")]
        final = holder["sched"]
        _wait_for(lambda: len(final.state()) == result.bound, 30)
        _check(kube, final, result)
        final.stop()
    result.seconds = time.monotonic() - started
    return result


def _wait_for(check: Any, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not check() and time.monotonic() < deadline:
        time.sleep(0.05)


@dataclass
class Audit:
    """What the API server's pods hold, GPU by GPU."""

    gpus_checked: int = 0
    over_committed: list[str] = field(default_factory=list)
    shared_whole: list[str] = field(default_factory=list)
    unannotated_bound: list[str] = field(default_factory=list)
    held: dict[str, tuple[str, list[Any]]] = field(default_factory=dict)  # uid -> (node, charges)

    @property
    def clean(self) -> bool:
        return not (self.over_committed or self.shared_whole or self.unannotated_bound)


def audit(kube: FakeKube) -> Audit:
    return audit_objects(kube.list("devices"), kube.list("pods"))


def audit_objects(device_list: list[dict[str, Any]], pods: list[dict[str, Any]]) -> Audit:
    """Every GPU, from what the API server holds: never over 100 % core or its memory, a whole GPU
    never shared with any other pod, every bound pod annotated."""
    out = Audit()
    devices = {d["metadata"]["name"]: d for d in device_list}
    memory = {
        (node, g["minor"]): g["resources"][GPU_MEMORY]
        for node, d in devices.items()
        for g in d["spec"]["devices"]
        if g["type"] == "gpu"
    }
    core: dict[tuple[str, int], int] = defaultdict(int)
    mem: dict[tuple[str, int], int] = defaultdict(int)
    users: dict[tuple[str, int], list[int]] = defaultdict(list)
    for pod in pods:
        node = pod["spec"].get("nodeName")
        if not node:
            continue
        text = (pod["metadata"].get("annotations") or {}).get(DEVICE_ALLOCATED)
        if text is None:
            out.unannotated_bound.append(pod["metadata"]["name"])
            continue
        charges = []
        for a in parse_device_allocated(text)[GPU]:
            key = (node, a.minor)
            core[key] += a.resources[GPU_CORE]
            mem[key] += a.resources[GPU_MEMORY]
            users[key].append(a.resources[GPU_CORE])
            charges.append((a.minor, a.resources[GPU_CORE], a.resources[GPU_MEMORY]))
        out.held[pod["metadata"]["uid"]] = (node, sorted(charges))
    for key in memory:
        out.gpus_checked += 1
        total = quantity.to_int(memory[key])
        if core[key] > 100 or mem[key] > total:
            out.over_committed.append(f"{key}: core {core[key]}, memory {mem[key]} of {total}")
        if 100 in users[key] and len(users[key]) > 1:
            out.shared_whole.append(f"{key}: {users[key]}")
    return out


def _check(kube: FakeKube, sched: Scheduler, result: Result) -> None:
    """The audit, and the allocator's view equal to the pods'."""
    a = audit(kube)
    result.gpus_checked, result.over_committed = a.gpus_checked, a.over_committed
    result.shared_whole, result.unannotated_bound = a.shared_whole, a.unannotated_bound
    held = sched.state()
    result.held_mismatch = sum(1 for uid in set(held) | set(a.held) if held.get(uid) != a.held.get(uid))
