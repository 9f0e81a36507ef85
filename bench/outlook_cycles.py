"""The extender's cycles while the default policy re-derives what it learned: filter + prioritize of
openb's GPU pods through `Extender` in process, on the nodes `cluster_bench` makes, with the outlook
re-derived in the verb that finds it due (as the simulator does) and on the extender's thread
(`background_outlook`, as `crihook scheduler` runs), taking turns.

    .venv/bin/python bench/outlook_cycles.py --pods openb_pod_list_default.csv [--nodes 5000]
        [--count 2000] [--window 500] [--rounds 2]

Each cycle sends filter on a window of nodes drawn at random (kube-scheduler's numFeasibleNodesToFind
at 5,000 nodes is 500), waits 0.5 ms (kube-scheduler between the two calls), sends prioritize, whose
top node holds the pod's devices, then waits 2 ms (its next cycle's own filter). Printed per mode: the
cycle's wall time and its thread's CPU (p50, p99, max), the cycles over 5 ms, and for the in-line mode
the CPU of the cycles that re-derived the outlook against the others. No HTTP, no API server: what the
allocator's schedule costs the verbs, apart from everything else `cluster_bench` measures.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster_bench import node_objects, pod_object, trace_nodes
from extender_bench import pct

from crihook.scheduler import simulate
from crihook.scheduler.devices import node_from_device
from crihook.scheduler.extender import Extender
from crihook.scheduler.plugin import DeviceShare, PluginConfig
from crihook.scheduler.score import DefaultPolicy


def run(args: argparse.Namespace, background: bool) -> None:
    nodes = trace_nodes(args.nodes)
    plugin = DeviceShare(PluginConfig(background_outlook=background))
    for t in nodes:
        node, device = node_objects(t)
        plugin.set_node(node_from_device(device, node["metadata"]["labels"], node["status"]["allocatable"]))
    ext = Extender(plugin)
    policy = plugin.policy
    assert isinstance(policy, DefaultPolicy)
    pods = simulate.workload(simulate.read_pods(args.pods), 1000 * 8 * args.nodes, args.seed)[: args.count]
    names = [t.name for t in nodes]
    rng = random.Random(args.seed)
    wall: list[float] = []
    cpu: list[float] = []
    rederived: list[bool] = []  # the cycle's filter made the outlook due
    for i, tp in enumerate(pods):
        if not tp.gpu:
            continue  # kube-scheduler sends the extender only the pods asking for its resources
        pod = pod_object(tp, i)
        pod["metadata"]["uid"] = f"uid-{i}"
        window = sorted(rng.sample(names, min(args.window, len(names))))
        t0, c0 = time.perf_counter(), time.thread_time()
        fit = ext.filter({"Pod": pod, "NodeNames": window})["NodeNames"]
        due = policy.due
        t1, c1 = time.perf_counter(), time.thread_time()
        time.sleep(0.0005)
        t2, c2 = time.perf_counter(), time.thread_time()
        if fit:
            ext.prioritize({"Pod": pod, "NodeNames": fit})
        t3, c3 = time.perf_counter(), time.thread_time()
        wall.append((t1 - t0 + t3 - t2) * 1000)
        cpu.append((c1 - c0 + c3 - c2) * 1000)
        rederived.append(due)
        time.sleep(0.002)
    mode = "on a thread" if background else "in line"
    for what, ms in (("wall", wall), ("CPU", cpu)):
        print(
            f"{mode:12} {what:4} per cycle ({len(ms)}): p50 {pct(ms, 0.5):.2f} p99 {pct(ms, 0.99):.2f} "
            f"max {max(ms):.2f} ms, over 5 ms {sum(x > 5 for x in ms)}",
            flush=True,
        )
    due = [c for c, d in zip(cpu, rederived, strict=True) if d]
    rest = [c for c, d in zip(cpu, rederived, strict=True) if not d]
    if not background and due and rest:
        print(
            f"{mode:12} CPU of the {len(due)} cycles that re-derived: p50 {pct(due, 0.5):.2f} ms, "
            f"the others p50 {pct(rest, 0.5):.2f} ms",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pods", type=Path, required=True, help="openb pod list CSV")
    ap.add_argument("--nodes", type=int, default=5000)
    ap.add_argument("--count", type=int, default=2000, help="pods of the trace, in simulate's order for --seed")
    ap.add_argument("--window", type=int, default=500, help="nodes per filter")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--rounds", type=int, default=2, help="in line, then on a thread, this many times")
    args = ap.parse_args()
    for _ in range(args.rounds):
        for background in (False, True):
            run(args, background)


if __name__ == "__main__":
    main()
