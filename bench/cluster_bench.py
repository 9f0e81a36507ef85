"""Scheduling at cluster scale: openb pods through a real `crihook scheduler` on thousands of GPU nodes,
driven over HTTP the way kube-scheduler drives its extender, against the suite's fake API server.

    .venv/bin/python bench/cluster_bench.py --pods openb_pod_list_default.csv [--nodes 1000] [--count 5000]
        [--form names|nodes] [--percentage-of-nodes-to-score 0] [--binders 16] [--seed 42] [--rate 0]
        [--api-nice 0]

(the pod list is the openb trace's, github.com/alibaba/clusterdata, cluster-trace-gpu-v2023)

What kube-scheduler does, and so this script (pkg/scheduler/schedule_one.go, extender.go):
- one scheduling cycle at a time: its own filter (NodeResourcesFit on CPU and memory, against the
  pods it has assumed; the GPU resources are `ignoredByScheduler`) runs from where the last cycle
  stopped until it has numFeasibleNodesToFind nodes (adaptive percentageOfNodesToScore: 50 -
  nodes/125 %, at least 5 % and 100 nodes: 420 of 1,000, 500 of 5,000);
- a pod that asks for a GPU (`managedResources`) goes to the extender: filter on those nodes
  (`nodeCacheCapable: true`: NodeNames; false: the full Node objects), prioritize on the nodes that
  passed, the highest score wins, ties broken at random (selectHost), bound by the extender; any
  other pod never reaches the extender: the least allocated node wins (NodeResourcesFit's default
  score), bound through the API server;
- binding runs beside the next cycles (its own goroutine), here on `--binders` threads; a pod
  whose bind fails, or that fits no node, is tried again after the others.
Pods are created in the API server by another thread while cycles run, so binds land, and the
scheduler's watches see them, all along: back to back (the cycles then run as fast as the extender
answers, its saturation), or `--rate` pods a second.

Printed: pods/s, extender time per pod (filter + prioritize, as kube-scheduler waits for it),
the scheduler's own time per verb (from its /metrics), memory, a GPU-by-GPU check of the pods'
annotations, and the unallocated GPU share against `crihook simulate`'s replay of the same pods in
the same order on the same nodes.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import multiprocessing
import os
import queue
import random
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from extender_bench import pct

from crihook.scheduler import simulate
from crihook.scheduler.devices import GPU_MODEL
from tests.support.bindrun import audit_objects
from tests.support.fakekube import FakeKube

NAMESPACE = "openb"
# 8-GPU node kinds after the openb node list (model, CPU milli, memory MiB), share of the cluster,
# and a topology: GPUs per PCIe switch and per NUMA node
KINDS = (
    ("G2", 96000, 393216, 0.6, 2, 4),
    ("G3", 128000, 786432, 0.1, 4, 4),
    ("V100M32", 96000, 786432, 0.1, 4, 8),
    ("V100M16", 64000, 262144, 0.1, 2, 4),
    ("T4", 96000, 393216, 0.1, 1, 4),
)
GPU_MEMORY_GIB = {"G2": 32, "G3": 24, "V100M32": 32, "V100M16": 16, "T4": 16}


def trace_nodes(n: int) -> list[simulate.TraceNode]:
    out = []
    for model, cpu, mem, share, _, _ in KINDS:
        out += [simulate.TraceNode("", cpu, mem, 8, model)] * round(n * share)
    out = out[:n] + [out[0]] * (n - len(out))
    random.Random(1).shuffle(out)
    return [simulate.TraceNode(f"node-{i:05d}", t.cpu, t.memory_mib, 8, t.model) for i, t in enumerate(out)]


def node_objects(t: simulate.TraceNode) -> tuple[dict[str, Any], dict[str, Any]]:
    """The Node kubelet registers and the Device crihook's reporter writes for it."""
    _, _, _, _, per_pcie, per_numa = next(k for k in KINDS if k[0] == t.model)
    alloc = {"cpu": f"{t.cpu}m", "memory": f"{t.memory_mib}Mi", "pods": "110"}
    node = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": t.name, "labels": {"kubernetes.io/hostname": t.name, GPU_MODEL: t.model}},
        "status": {"capacity": alloc, "allocatable": alloc, "conditions": [{"type": "Ready", "status": "True"}]},
    }
    gpus = [
        {
            "type": "gpu",
            "id": f"GPU-{t.name}-{g}",
            "minor": g,
            "health": True,
            "resources": {
                "koordinator.sh/gpu-core": "100",
                "koordinator.sh/gpu-memory": f"{GPU_MEMORY_GIB[t.model]}Gi",
                "koordinator.sh/gpu-memory-ratio": "100",
            },
            "topology": {"pcieID": f"pci{g // per_pcie}", "nodeID": g // per_numa, "socketID": g // per_numa},
        }
        for g in range(t.gpus)
    ]
    device = {
        "apiVersion": "scheduling.koordinator.sh/v1alpha1",
        "kind": "Device",
        "metadata": {"name": t.name},
        "spec": {"devices": gpus},
    }
    return node, device


def pod_object(p: simulate.TracePod, i: int) -> dict[str, Any]:
    """The pod `crihook simulate` makes of a trace row (simulate.to_pod), as a Pod object."""
    sim = simulate.to_pod(p, i)
    (c,) = sim.containers
    resources = {k: str(v) for k, v in c.requests.items()}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": sim.name, "namespace": NAMESPACE, "annotations": dict(sim.annotations)},
        "spec": {
            "schedulerName": "crihook",
            "containers": [{"name": c.name, "image": "x", "resources": {"requests": resources, "limits": resources}}],
        },
    }


def host_api(nodes: list[simulate.TraceNode], conn: Any, kubeconfig: Path, nice: int) -> None:
    """The fake API server, in a process of its own so its threads do not share a GIL with ours."""
    os.nice(nice)
    with FakeKube() as kube:
        for t in nodes:
            node, device = node_objects(t)
            kube.create("nodes", node)
            kube.create("devices", device)
        kube.write_kubeconfig(kubeconfig)
        conn.send(kube.url)
        conn.recv()  # until told to stop


class Client:
    """One kept-alive HTTP connection, as Go's client keeps one per host."""

    def __init__(self, host: str, port: int) -> None:
        self.conn = http.client.HTTPConnection(host, port, timeout=60)

    def call(self, method: str, path: str, body: Any = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        self.conn.request(method, path, data, {"Content-Type": "application/json"})
        r = self.conn.getresponse()
        raw = r.read()
        if r.status >= 300:
            raise RuntimeError(f"{method} {path}: HTTP {r.status} {raw[:200]!r}")
        return json.loads(raw) if raw[:1] in (b"{", b"[") else raw


def num_feasible_nodes_to_find(percentage: int, nodes: int) -> int:
    """kube-scheduler's numFeasibleNodesToFind (pkg/scheduler/schedule_one.go)."""
    if nodes < 100:
        return nodes
    if percentage == 0:
        percentage = max(50 - nodes // 125, 5)
    return max(nodes * percentage // 100, 100)


@dataclass(frozen=True)
class VerbTime:
    """One verb's time as the scheduler itself measured it (its /metrics histogram): from the
    request read to the answer written, so without the client's or the network's share."""

    total: float
    count: int
    within: dict[float, int]  # bucket bound (seconds) -> calls answered within it


def metrics_seconds(text: str, name: str = "crihook_scheduler_request_duration_seconds") -> dict[str, VerbTime]:
    """A histogram of the scheduler's /metrics by path: its time per call, or with
    crihook_scheduler_request_cpu_seconds the CPU the answering thread spent on it."""
    sums: dict[str, list[float]] = {}
    within: dict[str, dict[float, int]] = {}
    for m in re.finditer(name + r'_(sum|count)\{path="([^"]+)"\} (\S+)', text):
        sums.setdefault(m[2], [0.0, 0])[0 if m[1] == "sum" else 1] = float(m[3])
    for m in re.finditer(name + r'_bucket\{path="([^"]+)",le="([^"]+)"\} (\S+)', text):
        within.setdefault(m[1], {})[float(m[2])] = int(float(m[3]))
    return {k: VerbTime(v[0], int(v[1]), within.get(k, {})) for k, v in sums.items()}


def proc_status(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def proc_cpu(pid: int) -> float:
    """User + system CPU seconds of a process so far: a cost that does not grow with the load."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_cpu() -> float:
    """CPU seconds every process of the machine has used so far (/proc/stat: user, nice, system, irq, softirq)."""
    user, nice, system, _, _, irq, softirq = map(int, Path("/proc/stat").read_text().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def runnable_wait(pid: int) -> float:
    """Seconds the threads of a process have spent runnable but waiting for a core (schedstat)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            total += int((task / "schedstat").read_text().split()[1])
    return total / 1e9


@dataclass(frozen=True)
class Usage:
    """CPU seconds so far of the scheduler, the fake API server, this bench and the whole machine,
    and the scheduler's wait for a core."""

    scheduler: float
    api: float
    bench: float
    machine: float
    waited: float

    @classmethod
    def now(cls, sched: int, api: int) -> Usage:
        return cls(proc_cpu(sched), proc_cpu(api), proc_cpu(os.getpid()), machine_cpu(), runnable_wait(sched))

    def __sub__(self, o: Usage) -> Usage:
        return Usage(
            self.scheduler - o.scheduler, self.api - o.api, self.bench - o.bench, self.machine - o.machine,
            self.waited - o.waited,
        )  # fmt: skip


def simulate_same(
    nodes: list[simulate.TraceNode], trace: list[simulate.TracePod], seed: int, count: int
) -> tuple[float, int]:
    """Unallocated GPU % and failed pods after `crihook simulate`'s first `count` arrivals for `seed`:
    the same pods in the same order as `workload(trace, capacity, seed)[:count]`, which we sent."""
    capacity = 1000 * sum(n.gpus for n in nodes)
    allocated = failed = 0
    for n, (ev, _) in enumerate(simulate.replay(nodes, trace, "default", seed)):
        if n == count:
            break
        allocated += ev.pod.gpu if ev.node else 0
        failed += ev.node is None
    return 100 - 100 * allocated / capacity, failed


def run(args: argparse.Namespace) -> None:
    nodes = trace_nodes(args.nodes)
    capacity = 1000 * 8 * args.nodes
    trace = simulate.read_pods(args.pods)
    arrivals = simulate.workload(trace, capacity, args.seed)[: args.count]  # simulate's order for this seed
    with tempfile.TemporaryDirectory() as d:
        kubeconfig = Path(d) / "kubeconfig"
        parent, child = multiprocessing.get_context("fork").Pipe()
        api = multiprocessing.get_context("fork").Process(
            target=host_api, args=(nodes, child, kubeconfig, args.api_nice), daemon=True
        )
        api.start()
        api_host, api_port = parent.recv().removeprefix("http://").rsplit(":", 1)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        sched = subprocess.Popen(
            [sys.executable, "-m", "crihook.cli", "scheduler", "--listen", f"127.0.0.1:{port}",
             "--kubeconfig", str(kubeconfig), "--log-level", "error"],
        )  # fmt: skip
        try:
            t0 = time.monotonic()
            while True:
                try:
                    if Client("127.0.0.1", port).call("GET", "/readyz") == b"ok\n":
                        break
                except (OSError, RuntimeError):
                    pass
                if time.monotonic() - t0 > 600:
                    raise RuntimeError("scheduler not ready")
                time.sleep(0.2)
            loaded, rss0 = time.monotonic() - t0, proc_status(sched.pid, "VmRSS")
            kinds = ", ".join(k[0] for k in KINDS)
            print(f"{args.nodes} nodes x 8 GPUs ({kinds}), cache loaded in {loaded:.1f} s; RSS {rss0:.0f} MiB")
            assert api.pid is not None
            use0 = Usage.now(sched.pid, api.pid)
            result = schedule(args, nodes, arrivals, api_host, int(api_port), port)
            result["use"] = Usage.now(sched.pid, api.pid) - use0
            rss = proc_status(sched.pid, "VmHWM"), proc_status(sched.pid, "VmRSS")
            text = Client("127.0.0.1", port).call("GET", "/metrics").decode()
            server_time = metrics_seconds(text)
            server_cpu = metrics_seconds(text, "crihook_scheduler_request_cpu_seconds")
            api_client = Client(api_host, int(api_port))
            devices = api_client.call("GET", "/apis/scheduling.koordinator.sh/v1alpha1/devices")["items"]
            pods = api_client.call("GET", f"/api/v1/namespaces/{NAMESPACE}/pods")["items"]
        finally:
            sched.terminate()
            sched.wait()
            parent.send("stop")
            api.join(10)
    report(args, result, rss, server_time, server_cpu)
    check = audit_objects(devices, pods)
    gpu_pods = {f"{a.name}-{i}" for i, a in enumerate(arrivals) if a.gpu}
    unannotated = [n for n in check.unannotated_bound if n in gpu_pods]  # pods without GPUs carry none
    placed = {p["metadata"]["name"]: p["spec"].get("nodeName") for p in pods}
    allocated = sum(a.gpu for i, a in enumerate(arrivals) if placed.get(f"{a.name}-{i}"))
    print(
        f"GPUs checked {check.gpus_checked}: over-committed {len(check.over_committed)}, whole GPU handed out twice "
        f"{len(check.shared_whole)}, GPU pods bound without annotation {len(unannotated)}"
    )
    ours = 100 - 100 * allocated / capacity
    sim, sim_failed = simulate_same(nodes, trace, args.seed, len(arrivals))
    print(
        f"unallocated GPU: extender {ours:.2f} % ({len(arrivals) - sum(1 for v in placed.values() if v)} pods "
        f"unplaced), crihook simulate {sim:.2f} % ({sim_failed} failed): difference {ours - sim:+.2f} points"
    )


@dataclass(slots=True)
class OwnCache:
    """kube-scheduler's own part: NodeResourcesFit on CPU and memory against what it has assumed
    (a pod counts on its node from the moment its bind is sent until that bind fails), and
    NodeResourcesFit's default LeastAllocated score for the pods the extender does not manage."""

    nodes: list[simulate.TraceNode]
    used: dict[str, list[int]] = field(default_factory=dict)  # node -> [CPU milli, memory MiB] assumed
    start: int = 0  # nextStartNodeIndex

    def fits(self, n: simulate.TraceNode, p: simulate.TracePod) -> bool:
        cpu, mem = self.used.get(n.name, (0, 0))
        return cpu + p.cpu <= n.cpu and mem + p.memory_mib <= n.memory_mib

    def feasible(self, p: simulate.TracePod, want: int) -> list[str]:
        """findNodesThatPassFilters: from where the last cycle stopped, nodes that fit until `want`
        are found; the next cycle starts after the last node looked at."""
        out: list[str] = []
        k = 0
        while k < len(self.nodes) and len(out) < want:
            n = self.nodes[(self.start + k) % len(self.nodes)]
            if self.fits(n, p):
                out.append(n.name)
            k += 1
        self.start = (self.start + k) % len(self.nodes)
        return out

    def least_allocated(self, p: simulate.TracePod, names: list[str]) -> dict[str, int]:
        by_name = {n.name: n for n in self.nodes}
        out = {}
        for name in names:
            n, (cpu, mem) = by_name[name], self.used.get(name, (0, 0))
            out[name] = (
                100 * (n.cpu - cpu - p.cpu) // n.cpu + 100 * (n.memory_mib - mem - p.memory_mib) // n.memory_mib
            ) // 2
        return out

    def assume(self, p: simulate.TracePod, node: str, sign: int = 1) -> None:
        u = self.used.setdefault(node, [0, 0])
        u[0] += sign * p.cpu
        u[1] += sign * p.memory_mib


def schedule(
    args: argparse.Namespace, nodes: list[simulate.TraceNode], arrivals: list[simulate.TracePod], api_host: str,
    api_port: int, port: int,
) -> dict[str, Any]:  # fmt: skip
    full = {n.name: node_objects(n)[0] for n in nodes} if args.form == "nodes" else {}

    def args_for(pod: dict[str, Any], chosen: list[str]) -> dict[str, Any]:
        """ExtenderArgs (k8s.io/kube-scheduler/extender/v1) in the form nodeCacheCapable picks."""
        if full:
            return {"Pod": pod, "Nodes": {"items": [full[n] for n in chosen]}, "NodeNames": None}
        return {"Pod": pod, "Nodes": None, "NodeNames": chosen}

    def passed(res: dict[str, Any]) -> list[str]:
        if full:
            return [n["metadata"]["name"] for n in (res.get("Nodes") or {}).get("items") or []]
        return res.get("NodeNames") or []

    window = num_feasible_nodes_to_find(args.percentage_of_nodes_to_score, len(nodes))
    arrived: queue.Queue[tuple[simulate.TracePod, dict[str, Any]] | None] = queue.Queue()

    def create() -> None:
        """The pods, created back to back, or with --rate paced at that many a second (a controller
        creating them as a workload arrives)."""
        api = Client(api_host, api_port)
        start = time.monotonic()
        for i, p in enumerate(arrivals):
            if args.rate and (ahead := start + i / args.rate - time.monotonic()) > 0:
                time.sleep(ahead)
            arrived.put((p, api.call("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", pod_object(p, i))))
        arrived.put(None)

    local = threading.local()

    def bind(pod: dict[str, Any], node: str, managed: bool) -> str:
        """The extender's bindVerb for the pods it manages, the API's binding for the others."""
        m = pod["metadata"]
        if managed:
            if not hasattr(local, "client"):
                local.client = Client("127.0.0.1", port)
            args_ = {"PodName": m["name"], "PodNamespace": m["namespace"], "PodUID": m["uid"], "Node": node}
            return str(local.client.call("POST", "/bind", args_).get("Error", ""))
        if not hasattr(local, "api"):
            local.api = Client(api_host, api_port)
        binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": m["name"]}, "target": {"name": node}}
        try:
            local.api.call("POST", f"/api/v1/namespaces/{NAMESPACE}/pods/{m['name']}/binding", binding)
        except RuntimeError as e:
            return str(e)
        return ""

    ext = Client("127.0.0.1", port)
    own = OwnCache(nodes)
    rng = random.Random(args.seed)
    times: list[float] = []
    retry: list[tuple[simulate.TracePod, dict[str, Any]]] = []
    bound = unschedulable = 0
    failed_binds: list[str] = []
    creator = threading.Thread(target=create)
    t0 = time.monotonic()
    creator.start()

    def pending() -> Iterator[tuple[simulate.TracePod, dict[str, Any]]]:
        while (p := arrived.get()) is not None:
            yield p

    def settle(item: tuple[simulate.TracePod, dict[str, Any], str], err: str) -> int:
        if not err:
            return 1
        failed_binds.append(err)
        own.assume(item[0], item[2], -1)
        retry.append(item[:2])
        return 0

    with ThreadPoolExecutor(args.binders) as binders:
        in_flight: list[tuple[tuple[simulate.TracePod, dict[str, Any], str], Future[str]]] = []
        for attempt in range(3):  # the pods that fit no node, or lost a bind, go round again
            source = pending() if attempt == 0 else iter(retry)
            retry = []
            for tp, pod in source:
                chosen = own.feasible(tp, window)
                scores: dict[str, int] = {}
                managed = tp.gpu > 0  # managedResources: the extender sees only pods asking for a GPU
                if managed and chosen:
                    c0 = time.perf_counter()
                    fit = passed(ext.call("POST", "/filter", args_for(pod, chosen)))
                    if fit:
                        scores = {h["Host"]: h["Score"] for h in ext.call("POST", "/prioritize", args_for(pod, fit))}
                    times.append(time.perf_counter() - c0)
                elif chosen:
                    scores = own.least_allocated(tp, chosen)
                if not scores:
                    unschedulable += 1
                    retry.append((tp, pod))
                    continue
                top = max(scores.values())
                node = rng.choice([n for n, s in scores.items() if s == top])  # selectHost
                own.assume(tp, node)
                in_flight.append(((tp, pod, node), binders.submit(bind, pod, node, managed)))
                for done in [f for f in in_flight if f[1].done()]:
                    in_flight.remove(done)
                    bound += settle(done[0], done[1].result())
            for item, f in in_flight:
                bound += settle(item, f.result())
            in_flight = []
            if not retry:
                break
    elapsed = time.monotonic() - t0
    creator.join()
    return {
        "elapsed": elapsed, "times": times, "bound": bound, "pods": len(arrivals), "window": window,
        "unschedulable_cycles": unschedulable, "failed_binds": failed_binds, "left": len(retry),
    }  # fmt: skip


def report(
    args: argparse.Namespace, r: dict[str, Any], rss: tuple[float, float], server: dict[str, VerbTime],
    cpu: dict[str, VerbTime],
) -> None:  # fmt: skip
    times = r["times"]
    ms = [t * 1000 for t in times]
    pcts = args.percentage_of_nodes_to_score
    paced = f", created at {args.rate:g} pods/s" if args.rate else ", created back to back"
    print(
        f"form {args.form}, {r['window']} nodes per cycle (percentageOfNodesToScore {pcts}), "
        f"{args.binders} binders{paced}"
    )
    print(
        f"pods {r['pods']}: bound {r['bound']} in {r['elapsed']:.1f} s = {r['bound'] / r['elapsed']:.1f} pods/s; "
        f"cycles that fit no node {r['unschedulable_cycles']}, failed binds {len(r['failed_binds'])}, "
        f"never placed {r['left']}"
    )
    if r["failed_binds"]:
        print("  first failed bind:", r["failed_binds"][0][:200])
    print(
        f"extender filter+prioritize per pod (client side, {len(ms)} cycles): p50 {pct(ms, 0.5):.2f} ms, "
        f"p99 {pct(ms, 0.99):.2f} ms, max {max(ms):.2f} ms"
    )
    for what, h in (("time", server), ("CPU", cpu)):
        verbs = ", ".join(f"{p} {v.total / v.count * 1000:.2f} ms x {v.count}" for p, v in sorted(h.items()) if v.count)
        shares = ", ".join(
            f"{p} {v.within.get(0.005, 0) / v.count:.1%} / {v.within.get(0.01, 0) / v.count:.1%}"
            for p, v in sorted(h.items())
            if v.count and p in ("/filter", "/prioritize")
        )
        print(f"scheduler's own {what} per call: mean {verbs}; share within 5 / 10 ms: {shares}")
    u: Usage = r["use"]
    print(
        f"scheduler CPU {u.scheduler:.1f} s: {u.scheduler / r['pods'] * 1000:.2f} ms per pod "
        f"(every verb, its watches and API calls); its threads waited {u.waited:.1f} s for a core"
    )
    others = u.machine - u.scheduler - u.api - u.bench
    print(
        f"CPU over the run ({os.cpu_count()} cores x {r['elapsed']:.1f} s): fake API server {u.api:.1f} s"
        f"{f' (nice {args.api_nice})' if args.api_nice else ''}, this bench {u.bench:.1f} s, "
        f"other processes {others:.1f} s"
    )
    print(f"scheduler RSS peak {rss[0]:.0f} MiB, at the end {rss[1]:.0f} MiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pods", type=Path, required=True, help="openb pod list CSV")
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--count", type=int, default=5000, help="pods, in the order crihook simulate uses for --seed")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--form", choices=("names", "nodes"), default="names", help="nodeCacheCapable true / false")
    ap.add_argument("--percentage-of-nodes-to-score", type=int, default=0, help="kube-scheduler's; 0: adaptive")
    ap.add_argument("--binders", type=int, default=16)
    ap.add_argument("--rate", type=float, default=0, help="create the pods at this many a second (0: back to back)")
    ap.add_argument(
        "--api-nice", type=int, default=0, help="run the fake API server at this nice value (it stands for a "
        "kube-apiserver, which a cluster runs on other cores)"
    )  # fmt: skip
    run(ap.parse_args())


if __name__ == "__main__":
    main()
