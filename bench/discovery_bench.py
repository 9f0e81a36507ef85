"""Device discovery and reporting cost on the fake 8-GPU NVSwitch node (crihook.simnode's dgx-h100)
against the fake API server (tests/support/fakekube.py), through the real pynvml and kubernetes client.

Prints, per step, the median and 95th percentile over the rounds:
  - discovery: Nvml.snapshot with the pairwise topology (and how many NVML calls it makes),
  - identity refresh: the hot-path GpuIndex refresh (no topology),
  - diff: building the desired objects and comparing them with what the API server holds,
  - one API GET against the fake server, for scale: the no-change round is two of them plus discovery,
  - a reporting round with no change (API reads only; the writes it made are counted: must be 0).

    .venv/bin/python bench/discovery_bench.py [--rounds 200]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from crihook.base import config as cfg
from crihook.devices import report
from crihook.devices.nvml import Nvml
from crihook.devices.reporter import Reporter
from crihook.simnode import fakenvml
from tests.support.fakekube import FakeKube

NODE = "bench-node"


def timed(fn: Callable[[], object], rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def line(name: str, samples: list[float], extra: str = "") -> None:
    q = statistics.quantiles(samples, n=20)
    print(f"{name:<28} median {statistics.median(samples) * 1e3:8.3f} ms   p95 {q[18] * 1e3:8.3f} ms  {extra}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="discovery-bench-"))
    doc = fakenvml.topology("dgx-h100")
    (tmp / "topology.json").write_text(json.dumps(doc))
    fakenvml.make_sys_tree(tmp / "sys", doc)
    os.environ[fakenvml.CONFIG_ENV] = str(tmp / "topology.json")
    library = fakenvml.build()
    fake = fakenvml.FakeNvml(library, tmp / "topology.json", tmp / "sys", doc)

    conf = cfg.Config(
        node=cfg.NodeConfig(
            name=NODE, sys_root=str(tmp / "sys"), nvml_library=str(library), kubelet_checkpoint=str(tmp / "none")
        ),
        reporter=cfg.ReporterConfig(kubeconfig="bench"),
    )
    nvml = Nvml(str(library), str(tmp / "sys"))
    nvml.snapshot()  # initialise
    before = fake.call_count()
    snap = nvml.snapshot()
    full_calls = fake.call_count() - before
    before = fake.call_count()
    nvml.snapshot(topology=False)
    identity_calls = fake.call_count() - before
    print(f"fake node: {len(snap.gpus)} x {snap.gpus[0].name}, nvswitch={snap.topology.nvswitch}")
    line("discovery (with topology)", timed(nvml.snapshot, args.rounds), f"{full_calls} NVML calls")
    line("identity refresh", timed(lambda: nvml.snapshot(topology=False), args.rounds), f"{identity_calls} NVML calls")

    with FakeKube() as kube:
        kube.create("nodes", {"metadata": {"name": NODE}, "status": {"capacity": {"cpu": "64"}}})
        reporter = Reporter(conf, kube.api_client(), nvml=nvml, rdma_links=dict)
        t0 = time.perf_counter()
        first = reporter.run_once()
        print(f"initial report: {(time.perf_counter() - t0) * 1e3:.1f} ms, wrote {', '.join(first.writes)}")
        obs = reporter.observe()
        node = kube.get("nodes", NODE)
        device = kube.get("devices", NODE)
        uid = node["metadata"]["uid"]

        def diff() -> None:
            want = report.desired(obs)
            assert report.device_object(NODE, uid, want, device) is None
            assert not report.status_changed(device, want)
            assert report.node_label_patch(node, want) is None
            assert report.node_status_patch(node, want) is None

        line("diff (no change)", timed(diff, args.rounds))
        line("one API GET (fake server)", timed(lambda: reporter._get_device(), max(args.rounds // 4, 20)))
        since = len(kube.requests)
        rounds = max(args.rounds // 4, 20)
        samples = timed(reporter.run_once, rounds)
        wrote = [r for r in kube.requests[since:] if r.method != "GET"]
        gets = len(kube.requests) - since
        line("round, no change", samples, f"{gets / rounds:.0f} GETs/round, {len(wrote)} writes in {rounds} rounds")
    nvml.close()
    return 1 if wrote else 0


if __name__ == "__main__":
    sys.exit(main())
