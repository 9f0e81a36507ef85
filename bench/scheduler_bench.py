"""Allocator benchmark: Filter+Score latency for one pod over N nodes x 8 GPUs, and the simulator's
wall time for one seed of the default openb trace.

    .venv/bin/python bench/scheduler_bench.py [--nodes 1000,5000] [--pods 300] [--trace DIR | --no-simulate]
        [--pinned 0.33] [--clock cpu]

--trace names the openb trace's directory (openb_node_list_gpu_node.csv, openb_pod_list_default.csv)
for the simulator's seed.

Each measured pod is a fresh request (its own uid) of a shape drawn from a realistic mix, and is
reserved on the best node afterwards, as the extender does, so every round changes one node and the
score cache sees the same churn as in production. With --pinned F the nodes alternate between two
GPU models and a share F of the pods names one of them (`nvidia.com/use-gputype`). --clock cpu
times with the process's CPU time, which a machine shared with other jobs does not inflate.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from crihook.scheduler.devices import Gpu, NodeDevices
from crihook.scheduler.plugin import DeviceShare
from crihook.scheduler.pod import Container, Pod

SHAPES = [
    {"nvidia.com/gpu": "1"},
    {"nvidia.com/gpu": "2"},
    {"nvidia.com/gpu": "8"},
    {"koordinator.sh/gpu-core": "50", "koordinator.sh/gpu-memory-ratio": "50", "koordinator.sh/gpu.shared": "1"},
    {"koordinator.sh/gpu-core": "25", "koordinator.sh/gpu-memory-ratio": "25", "koordinator.sh/gpu.shared": "1"},
    {"koordinator.sh/gpu-core": "80", "koordinator.sh/gpu-memory": "20Gi", "koordinator.sh/gpu.shared": "1"},
]


MODELS = ("A100", "H100")


def cluster(n: int, rng: random.Random, pinned: float) -> DeviceShare:
    ds = DeviceShare()
    for i in range(n):
        model = MODELS[i % 2] if pinned else MODELS[0]
        gpus = tuple(Gpu(minor=g, uuid=f"GPU-{i}-{g}", model=model, memory=80 << 30) for g in range(8))
        ds.set_node(NodeDevices(f"node-{i:05d}", gpus, cpu_milli=128_000, memory=1 << 40))
    for j in range(n * 3):  # a cluster about a third full
        req = ds.pre_filter(pod(f"warm-{j}", rng, pinned))
        fit, _ = ds.filter_nodes(req, [f"node-{rng.randrange(n):05d}"], reasons=False)
        if fit:
            ds.reserve(req, fit[0])
    return ds


def pod(uid: str, rng: random.Random, pinned: float) -> Pod:
    res = {"cpu": "4", "memory": "16Gi", **rng.choice(SHAPES)}
    ann = {"nvidia.com/use-gputype": rng.choice(MODELS)} if rng.random() < pinned else {}
    return Pod(uid=uid, namespace="bench", name=uid, containers=(Container("main", res),), annotations=ann)


def measure(n: int, pods: int, pinned: float, clock: Callable[[], float]) -> tuple[float, float]:
    rng = random.Random(1)
    ds = cluster(n, rng, pinned)
    names = sorted(ds.st.rows)
    times = []
    for k in range(pods):
        p = pod(f"p-{k}", rng, pinned)
        t0 = clock()
        req = ds.pre_filter(p)
        fit, _failed = ds.filter_nodes(req, names)
        scores = ds.score_nodes(req, fit)
        times.append(clock() - t0)
        if scores:
            ds.reserve(req, max(scores, key=scores.__getitem__))
    times.sort()
    return 1000 * statistics.median(times), 1000 * times[int(0.99 * (len(times) - 1))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", default="1000,5000")
    ap.add_argument("--pods", type=int, default=300)
    ap.add_argument("--trace", type=Path, help="the openb trace's directory, for the simulator's seed")
    ap.add_argument("--pinned", type=float, default=0.0, help="share of pods pinned to one of two GPU models")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--no-simulate", action="store_true", help="skip the simulator's seed")
    args = ap.parse_args()
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    for n in (int(x) for x in args.nodes.split(",")):
        p50, p99 = measure(n, args.pods, args.pinned, clock)
        print(
            f"filter+score, {n} nodes x 8 GPUs, {args.pods} pods, {100 * args.pinned:.0f} % pinned, {args.clock}"
            f" time: p50 {p50:.2f} ms, p99 {p99:.2f} ms",
            flush=True,
        )
    if args.no_simulate or args.trace is None:
        return
    if (args.trace / "openb_pod_list_default.csv").exists():
        from crihook.scheduler import simulate

        nodes = simulate.read_nodes(args.trace / "openb_node_list_gpu_node.csv")
        pods = simulate.read_pods(args.trace / "openb_pod_list_default.csv")
        took = {}
        for policy in ("default", "fgd"):
            t0 = clock()
            v = simulate.at_100(simulate.run_once(nodes, pods, policy, 42))
            took[policy] = clock() - t0
            print(
                f"simulate {policy}, default trace, seed 42: {took[policy]:.1f} s {args.clock} (unallocated {v:.2f} %)"
            )
        print(f"default / FGD: {took['default'] / took['fgd']:.2f}")


if __name__ == "__main__":
    main()
