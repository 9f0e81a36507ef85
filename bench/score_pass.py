"""The default policy's Score passes, timed on one state of a simulated run: what a request costs
when every node is scored afresh (a cold pass: the first pod of a shape after the outlook is
re-derived, as the workload drifts) and when one node changed since its shape was last scored (a
warm pass). A whole run's CPU moves by about 10 % on a loaded machine; one pass, timed many times,
far less.

    .venv/bin/python bench/score_pass.py --pods PODS.csv [--nodes NODES.csv] [--at 6000] [--seed 42]
        [--times 40] [--repeat 3]

Replays the trace as `crihook simulate` does up to pod --at, then, for a request of each kind among
the last 300 pods (GPU count, shared or not, pinned to a model or not), times `score_nodes` over
every node, least of --repeat runs of --times calls, CPU time. The sum of the scores is printed with
each line, so two versions of the code can be checked to score alike.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from crihook.scheduler.plugin import DeviceShare
from crihook.scheduler.request import PodRequest
from crihook.scheduler.score import DefaultPolicy
from crihook.scheduler.simulate import read_nodes, read_pods, replay, to_pod


def least(call: Callable[[], object], times: int, repeat: int) -> float:
    """Least CPU seconds per call over `repeat` runs of `times` calls."""
    best = float("inf")
    for _ in range(repeat):
        t = time.process_time()
        for _ in range(times):
            call()
        best = min(best, (time.process_time() - t) / times)
    return best


def state(nodes: Path, pods: Path, at: int, seed: int) -> tuple[DeviceShare, dict[str, PodRequest]]:
    """The allocator after pod `at`, and a request of each kind among the 300 pods before it."""
    reqs: dict[str, PodRequest] = {}
    ds: DeviceShare | None = None
    for i, (ev, ds) in enumerate(replay(read_nodes(nodes), read_pods(pods), "default", seed)):
        if i >= at - 300:
            req = ds.pre_filter(to_pod(ev.pod, 10**6 + i))  # a uid of its own: not learnt twice
            kind = f"{req.count}{' shared' if req.shared else ''} GPU{' pinned' if req.selectors.use_types else ''}"
            reqs.setdefault(kind, req)
        if i == at:
            break
    assert ds is not None
    return ds, reqs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=Path, default=Path("../shared/traces/openb/openb_node_list_gpu_node.csv"))
    ap.add_argument("--pods", type=Path, required=True)
    ap.add_argument("--at", type=int, default=6000, help="pods replayed before the passes are timed")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--times", type=int, default=40)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    ds, reqs = state(args.nodes, args.pods, args.at, args.seed)
    pol = ds.policy
    assert isinstance(pol, DefaultPolicy)
    print(f"{args.pods.name} at pod {args.at}, seed {args.seed}: {pol.outlook.places.table.shape[1]} outlook shapes")
    for kind, req in sorted(reqs.items()):
        scores = ds.score_nodes(req)
        if not scores:
            continue
        row = ds.st.rows[next(iter(scores))]

        def cold(req: PodRequest = req) -> dict[str, float]:
            pol.cache.clear()
            return ds.score_nodes(req)

        def warm(req: PodRequest = req, row: int = row) -> dict[str, float]:
            ds.st.touch(row)  # a new version of one node, as a reservation makes
            return ds.score_nodes(req)

        total = float(np.sum(list(cold().values())))
        print(
            f"{kind:>20}: {len(scores):5d} nodes, cold {least(cold, args.times, args.repeat) * 1e6:7.0f} us,"
            f" warm {least(warm, args.times * 4, args.repeat) * 1e6:5.0f} us, score sum {total!r}"
        )


if __name__ == "__main__":
    main()
