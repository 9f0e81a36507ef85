"""Where a policy loses GPU on a trace: one seeded run up to 100 % arrival, then the failed pods by
kind and arrival, and per node type the idle GPUs, the free CPU and the nodes nearly out of CPU.

    .venv/bin/python bench/simulate_where.py ../shared/traces/openb default fgd --seed 1
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from crihook.scheduler import simulate

LOW_CPU = 4000  # millicores: a node with less left can host almost no GPU pod of the trace


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace", type=Path, help="folder with openb_node_list_gpu_node.csv and the pod lists")
    ap.add_argument("workload", help="default, gpushare40, multigpu50, ...")
    ap.add_argument("policy", help=", ".join(simulate.POLICIES))
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    nodes = simulate.read_nodes(args.trace / "openb_node_list_gpu_node.csv")
    pods = simulate.read_pods(args.trace / f"openb_pod_list_{args.workload}.csv")
    capacity = 1000 * sum(n.gpus for n in nodes)
    failed: Counter[str] = Counter()
    failed_gpu: Counter[str] = Counter()
    big: list[str] = []
    ds = None
    allocated = 0
    for ev, state in simulate.replay(nodes, pods, args.policy, args.seed):
        ds = state  # the state after the first pod past 100 %, when the loop stops
        if ev.arrived > capacity:
            break
        p = ev.pod
        if ev.node:
            allocated += p.gpu
            continue
        kind = "cpu-only" if not p.num_gpu else f"{p.num_gpu} GPU" + (" share" if p.gpu_milli < 1000 else "")
        failed[kind] += 1
        failed_gpu[kind] += p.gpu
        if p.num_gpu > 1:
            big.append(f"{p.num_gpu}x{p.cpu // 1000}c@{100 * ev.arrived // capacity}%")
    unallocated = 100 - 100 * allocated / capacity
    print(f"{args.policy}, {args.workload}, seed {args.seed}: unallocated at 100 % {unallocated:.2f} %")
    for kind in sorted(failed):
        print(f"  failed {kind}: {failed[kind]} pods, {failed_gpu[kind] / 1000:.1f} GPUs")
    print(f"  failed multi-GPU pods (GPUs x cores @ arrival): {' '.join(big) or 'none'}")
    assert ds is not None
    st = ds.st
    by_type: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0, 0])
    for name, row in st.rows.items():
        n = next(t for t in nodes if name.endswith("-" + t.name))
        agg = by_type[f"{n.model} {n.gpus} GPU {n.cpu // 1000} cores"]
        agg[0] += 1
        agg[1] += float(np.sum(st.idle[row][: n.gpus])) / 100
        agg[2] += int(st.cpu_free[row]) // 1000
        agg[3] += int(st.cpu_free[row] < LOW_CPU)
    print("  node type: nodes, idle GPUs, free cores, nodes under 4 cores free")
    for kind, (count, idle, cores, low) in sorted(by_type.items(), key=lambda kv: -kv[1][1]):
        print(f"  {kind}: {count}, {idle:.1f}, {cores}, {low}")


if __name__ == "__main__":
    main()
