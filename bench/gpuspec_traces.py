"""Pinned-model workloads like the paper's "gpuspec" sweeps: the default openb trace with a share of
its GPU pods pinned to one GPU model or a set of models (`gpu_spec`, which `crihook simulate` turns
into `nvidia.com/use-gputype`). Seeded, so a figure can be re-made; the output stays out of git.

    .venv/bin/python bench/gpuspec_traces.py TRACE_DIR OUT_DIR [--shares 10,20,25,33] [--seed 14]

writes OUT_DIR/openb_pod_list_gpuspecNN.csv per share. Pins are mostly single models, the fleet's
common ones (T4, G2 and P100 about 80 %), then the V100 pair, G3, and sets of three to five models,
as in the paper's traces. A pod is only pinned to models with a node that could host it alone
(enough GPUs, CPU and memory), so every pinned pod can run on an empty cluster.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np

PINS: dict[str, float] = {  # gpu_spec -> weight
    "T4": 0.30,
    "G2": 0.30,
    "P100": 0.20,
    "V100M16|V100M32": 0.10,
    "G3": 0.04,
    "P100|V100M16|V100M32": 0.02,
    "P100|T4|V100M16|V100M32": 0.02,
    "G2|P100|T4|V100M16|V100M32": 0.02,
}


def hosts(nodes: list[dict[str, str]]) -> dict[str, list[tuple[int, int, int]]]:
    """Per pin: the (GPUs, CPU, memory) of every kind of node of its models."""
    out: dict[str, list[tuple[int, int, int]]] = {}
    for spec in PINS:
        models = set(spec.split("|"))
        out[spec] = sorted(
            {(int(n["gpu"]), int(n["cpu_milli"]), int(n["memory_mib"])) for n in nodes if n["model"] in models}
        )
    return out


def pin(rows: list[dict[str, str]], nodes: list[dict[str, str]], share: float, seed: int) -> list[dict[str, str]]:
    """A copy of `rows` with `share` of the GPU pods (by count) pinned, chosen and pinned at random."""
    rng = np.random.default_rng(seed)
    kinds = hosts(nodes)
    gpu_pods = [i for i, r in enumerate(rows) if int(r["num_gpu"])]
    chosen = rng.choice(gpu_pods, size=round(share * len(gpu_pods)), replace=False)
    out = [dict(r) for r in rows]
    specs = list(PINS)
    for i in sorted(chosen):
        r = out[i]
        need = (int(r["num_gpu"]), int(r["cpu_milli"]), int(r["memory_mib"]))
        ok = [s for s in specs if any(g >= need[0] and c >= need[1] and m >= need[2] for g, c, m in kinds[s])]
        if not ok:
            continue
        w = np.array([PINS[s] for s in ok])
        r["gpu_spec"] = ok[int(rng.choice(len(ok), p=w / w.sum()))]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path, help="folder with openb_pod_list_default.csv and openb_node_list_gpu_node.csv")
    ap.add_argument("out", type=Path, help="folder for the generated traces (outside the repository)")
    ap.add_argument("--shares", default="10,20,25,33", help="percent of GPU pods pinned, comma list")
    ap.add_argument("--seed", type=int, default=14)
    args = ap.parse_args()
    with (args.trace / "openb_pod_list_default.csv").open(newline="") as f:
        reader = csv.DictReader(f)
        fields = list(reader.fieldnames or ())
        rows = list(reader)
    with (args.trace / "openb_node_list_gpu_node.csv").open(newline="") as f:
        nodes = list(csv.DictReader(f))
    args.out.mkdir(parents=True, exist_ok=True)
    for share in (int(s) for s in args.shares.split(",")):
        pinned = pin(rows, nodes, share / 100, args.seed + share)
        path = args.out / f"openb_pod_list_gpuspec{share}.csv"
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields, lineterminator="\n")
            w.writeheader()
            w.writerows(pinned)
        specs: dict[str, int] = {}
        for r in pinned:
            if r["gpu_spec"]:
                specs[r["gpu_spec"]] = specs.get(r["gpu_spec"], 0) + 1
        n = sum(specs.values())
        gpu = sum(1 for r in pinned if int(r["num_gpu"]))
        mix = ", ".join(f"{s} {100 * k / n:.0f} %" for s, k in sorted(specs.items(), key=lambda kv: -kv[1]))
        print(f"{path}: {n} of {gpu} GPU pods pinned ({100 * n / gpu:.1f} %): {mix}")


if __name__ == "__main__":
    main()
