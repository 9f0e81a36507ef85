"""Cost of the per-container GPU usage collection on a busy node: the simulated 8-GPU H100 node
(the fake NVML through the real pynvml), 64 containers in crihook's store (8 shares per GPU, each
with one process, the cgroup paths containerd's systemd driver makes), plus a host process per GPU.

    .venv/bin/python bench/usage_collection.py [--rounds 200] [--interval 10]

Prints the CPU time of one collection (NVML, /proc, attribution, metrics, the state file; best and
median of the rounds), what that is, at the interval, as a share of one core, and what one scrape of
the endpoint costs with these series in it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import timeit
from pathlib import Path

from crihook.base import metrics
from crihook.base.allocation import DEVICE_ALLOCATED
from crihook.devices.collector import UsageCollector
from crihook.devices.nvml import Nvml
from crihook.node.records import ContainerRecord, PodRecord
from crihook.node.store import Store
from crihook.simnode.fakenvml import CONFIG_ENV, build, make_sys_tree, topology

GiB = 1 << 30
PER_GPU = 8


def node(root: Path) -> tuple[Nvml, Store, Path]:
    """The fake node, its /proc and a store holding the 64 containers (its tables filled directly:
    nothing is written)."""
    import os

    doc = topology("dgx-h100")
    store = Store(root / "state")
    proc = root / "proc"
    pid = 1000
    for g in doc["gpus"]:
        g["processes"] = []
        for k in range(PER_GPU):
            name = f"job-{g['minor']}-{k}"
            cid = f"{pid:064x}"
            alloc = {
                "gpu": [
                    {
                        "minor": g["minor"],
                        "id": g["uuid"],
                        "resources": {"koordinator.sh/gpu-core": 12, "koordinator.sh/gpu-memory": str(10 * GiB)},
                    }
                ]
            }
            store.pods[f"sandbox-{name}"] = PodRecord(
                id=f"sandbox-{name}",
                name=name,
                namespace="bench",
                uid=name,
                annotations={DEVICE_ALLOCATED: json.dumps(alloc)},
            )
            store.containers[cid] = ContainerRecord(id=cid, pod_id=f"sandbox-{name}", name="main", state="running")
            g["processes"].append({"pid": pid, "used_memory": (k + 2) * GiB, "sm_util": 10 + k})
            (proc / str(pid)).mkdir(parents=True)
            (proc / str(pid) / "cgroup").write_text(
                f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{name}.slice/cri-containerd-{cid}.scope\n"
            )
            pid += 1
        g["processes"].append({"pid": pid, "used_memory": GiB})  # the host's
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cgroup").write_text("0::/system.slice/nvidia-persistenced.service\n")
        pid += 1
    config = root / "topology.json"
    config.write_text(json.dumps(doc))
    os.environ[CONFIG_ENV] = str(config)
    make_sys_tree(root / "sys", doc)
    return Nvml(str(build()), str(root / "sys")), store, proc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--interval", type=float, default=10.0, help="collection interval to price (seconds)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="crihook-usage-bench-") as tmp:
        root = Path(tmp)
        nvml, store, proc = node(root)
        (root / "state").mkdir(exist_ok=True)
        collector = UsageCollector(
            nvml, store, interval=args.interval, proc_root=str(proc), state_dir=str(root / "state")
        )
        first = collector.collect_once()
        containers = {u.owner.container_id for u in first.rows if u.owner.kind == "container"}
        assert len(first.read.gpus) == 8 and len(containers) == 64, (len(first.read.gpus), len(containers))
        times = [collector.collect_once().seconds for _ in range(args.rounds)]
        nvml.close()
    scrape = min(timeit.repeat(metrics.REGISTRY.render, number=20, repeat=5)) / 20
    best, median = min(times), statistics.median(times)
    print(f"8 GPUs, {len(containers)} containers, {len(first.read.processes)} processes, {args.rounds} rounds")
    print(f"CPU per collection: best {best * 1e3:.2f} ms, median {median * 1e3:.2f} ms")
    print(f"share of one core at a {args.interval:g} s interval: {median / args.interval * 100:.3f} % (median)")
    print(f"a scrape of every crihook series, these included: {scrape * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
