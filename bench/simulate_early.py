"""Which nodes the first pods break: seeded runs up to PCT % arrival, then per node type the mean
number of nodes left partly used (some GPU taken, some idle), over the seeds. A node only a rare
large pod can fill is lost to that pod once broken; this shows whether a policy spends such nodes
before it has seen what they are for. `--set NAME=VALUE` changes a constant of the default score
(scheduler/score.py) for the run, to compare a variant with the default in one command.

    .venv/bin/python bench/simulate_early.py ../shared/traces/openb multigpu50 --seeds 1-20 --until 5
    .venv/bin/python bench/simulate_early.py ../shared/traces/openb multigpu50 --seeds 1-20 --until 5 --set PRIOR=0
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path

from crihook.scheduler import score, simulate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace", type=Path, help="folder with openb_node_list_gpu_node.csv and the pod lists")
    ap.add_argument("workload", help="default, gpushare40, multigpu50, ...")
    ap.add_argument("--policy", default="default", help=", ".join(simulate.POLICIES))
    ap.add_argument("--seeds", default="1-20")
    ap.add_argument("--until", type=float, default=5.0, help="arrived GPU, percent of capacity")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a score constant")
    args = ap.parse_args()
    for item in args.set:
        name, value = item.split("=", 1)
        if not hasattr(score, name):
            ap.error(f"scheduler/score.py has no {name}")
        setattr(score, name, type(getattr(score, name))(float(value)))
    nodes = simulate.read_nodes(args.trace / "openb_node_list_gpu_node.csv")
    pods = simulate.read_pods(args.trace / f"openb_pod_list_{args.workload}.csv")
    stop = sum(n.gpus for n in nodes) * 10 * args.until  # milli-GPU
    seeds = simulate.parse_seeds(args.seeds)
    broken: dict[str, list[int]] = defaultdict(lambda: [0] * len(seeds))
    for i, seed in enumerate(seeds):
        st = next(state for ev, state in simulate.replay(nodes, pods, args.policy, seed) if ev.arrived >= stop).st
        for name, row in st.rows.items():
            n = next(t for t in nodes if name.endswith("-" + t.name))
            idle = st.idle[row][: n.gpus]
            if 0 < idle.sum() < 100 * n.gpus:
                broken[f"{n.model} {n.gpus} GPU {n.cpu // 1000} cores"][i] += 1
    variant = " ".join([args.policy, *args.set])
    print(f"{variant}, {args.workload}, seeds {args.seeds}: nodes partly used at {args.until:g} % arrival")
    for kind, per_seed in sorted(broken.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {kind}: mean {statistics.fmean(per_seed):.2f}, per seed {per_seed}")


if __name__ == "__main__":
    main()
