"""`crihook simulate`: replay a cluster trace through the GPU allocator and print the share of GPU
left unallocated at full arrival, per policy. The replay is crihook.scheduler.simulate."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from crihook.scheduler.simulate import POLICIES, TraceError, at_100, parse_seeds, read_nodes, read_pods, run_once


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=Path, required=True, help="node list CSV (sn,cpu_milli,memory_mib,gpu,model)")
    p.add_argument(
        "--pods", type=Path, required=True, help="pod list CSV (name,cpu_milli,memory_mib,num_gpu,gpu_milli)"
    )
    p.add_argument("--policy", default="default", help=f"comma list of {', '.join(POLICIES)}")
    p.add_argument("--seeds", default="42-51", help="seeds, e.g. 42-51 or 42,45")
    p.add_argument("--json", action="store_true", help="one JSON object per policy per line")
    p.add_argument("--curve", action="store_true", help="with --json: add the mean curve by arrived %%")


def run(args: argparse.Namespace) -> int:
    try:
        nodes, pods = read_nodes(args.nodes), read_pods(args.pods)
        policies = [s.strip() for s in args.policy.split(",") if s.strip()]
        for name in policies:
            if name not in POLICIES:
                raise TraceError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
        seeds = parse_seeds(args.seeds)
        for name in policies:
            t0, c0 = time.monotonic(), time.process_time()
            curves = [run_once(nodes, pods, name, s) for s in seeds]
            vals = [at_100(c) for c in curves]
            out = {
                "policy": name,
                "trace": args.pods.name,
                "seeds": seeds,
                "unallocated_pct_at_100": round(statistics.fmean(vals), 3),
                "sd": round(statistics.stdev(vals), 3) if len(vals) > 1 else 0.0,
                "per_seed": [round(v, 3) for v in vals],
                "wall_s": round(time.monotonic() - t0, 1),
                "cpu_s": round(time.process_time() - c0, 1),  # what a shared machine's load leaves out
            }
            if args.curve:
                xs = sorted(set().union(*curves))
                out["curve"] = {x: round(statistics.fmean(c[x] for c in curves if x in c), 3) for x in xs}
            if args.json:
                print(json.dumps(out), flush=True)
            else:
                print(
                    f"{name:8} unallocated GPU at 100% arrival: {out['unallocated_pct_at_100']:.2f} % "
                    f"(sd {out['sd']:.2f}, {len(seeds)} seeds, {out['wall_s']} s)",
                    flush=True,
                )
    except (OSError, TraceError) as e:
        print(f"crihook simulate: {e}", file=sys.stderr)
        return 2
    return 0
