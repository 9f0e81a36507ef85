"""What the gpu hook adds to one CreateContainer, with the NVML cache warm.

    .venv/bin/python bench/gpu_hook_bench.py [--calls 5000] [--checkpoint-pods 200] [--beside-plugin]

The node: the fake NVML library with the 8-GPU NVSwitch topology (crihook/simnode/topologies/dgx-h100.json),
device nodes and a kubelet checkpoint in a temporary directory, the checkpoint holding
`--checkpoint-pods` other pods' device-plugin GPUs (none of them a GPU the pods below ask for, so the
conflict check reads every entry). The hook is the registered entry point, built as `crihook serve`
builds it. Three containers: one given all 8 GPUs by the scheduler, one given a shared GPU under
HAMi-core, and one given none (it gets NVIDIA_VISIBLE_DEVICES=void).

`--beside-plugin`: as on a node running NVIDIA's device plugin, crihook's store is attached (the
other pods started, each with a container) and every GPU the pods below ask for is also the plugin
GPU of another pod the scheduler placed (a phantom the conflict rule has to see through).

Prints µs per call (p50, p99) two ways: `handle()` called directly, and a whole hook-chain run of
the installed hooks (gpu, rdma, remote with no servers) as the proxy runs it: inline on the event
loop while the hooks' cached node state answers (`handle_cached`), on a worker thread when a hook
must read the file system. Each as wall time and as CPU time of the process: on a busy machine the
wall-time tail is mostly waiting for a CPU, the CPU time is what the hook itself costs. Also counts
NVML calls during the timed runs (expected: 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from crihook.base import allocation as al
from crihook.base.config import HooksConfig, NodeConfig
from crihook.base.spec import Device
from crihook.hooks.base import ContainerInfo, HookContext, PodInfo, Stage
from crihook.hooks.gpu_edit import GpuOptions
from crihook.hooks.grant import HamiCore
from crihook.hooks.registry import build_chain, discover_factories
from crihook.node.daemon import attach_store
from crihook.node.records import ContainerRecord, PodRecord
from crihook.node.store import Store
from crihook.simnode import fakenvml
from crihook.simnode.node import make_dev_root
from tests.support.gpu_fixtures import Entry, write_checkpoint

TOPOLOGY = "dgx-h100"


Samples = list[tuple[float, float]]  # (wall, CPU of this process) seconds per call


def percentiles(samples: Samples) -> str:
    out = []
    for name, values in (("wall", [w for w, _ in samples]), ("cpu", [c for _, c in samples])):
        q = statistics.quantiles(values, n=100)
        out.append(f"{name} p50 {q[49] * 1e6:6.1f} p99 {q[98] * 1e6:7.1f}")
    return "   ".join(out) + " µs"


def timed(fn: Callable[[], Any], calls: int) -> Samples:
    out = []
    for _ in range(calls):
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        out.append((time.perf_counter() - wall, time.process_time() - cpu))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--checkpoint-pods", type=int, default=200)
    ap.add_argument("--beside-plugin", action="store_true", help="store attached, chosen GPUs held by phantoms")
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="gpu-hook-bench-"))
    doc = fakenvml.topology(TOPOLOGY)
    config = root / "topology.json"
    config.write_text(json.dumps(doc))
    os.environ[fakenvml.CONFIG_ENV] = str(config)
    fakenvml.make_sys_tree(root / "sys", doc)
    gpus = doc["gpus"]
    dev = make_dev_root(root / "dev", [g["minor"] for g in gpus])
    checkpoint = root / "kubelet" / "device-plugins" / "kubelet_internal_checkpoint"
    (root / "kubelet" / "pods").mkdir(parents=True)
    others = [Entry(f"pod-{i:04d}", "main", [f"GPU-elsewhere-{i}"]) for i in range(args.checkpoint_pods)]
    if args.beside_plugin:
        others += [Entry(f"placed-{g['minor']}", "main", [g["uuid"]]) for g in gpus]
    write_checkpoint(checkpoint, others)
    node = NodeConfig(
        dev_root=str(dev),
        sys_root=str(root / "sys"),
        kubelet_checkpoint=str(checkpoint),
        nvml_library=str(fakenvml.build()),
    )
    # HAMi-core's directories, which the hook makes, under the bench's own root
    hami = HamiCore(cache_root=f"{root}/hami-core/containers", lock_dir=f"{root}/hami-core/lock")
    hook = discover_factories()["gpu"](GpuOptions(hami_core=hami), node)
    library = fakenvml.FakeNvml(fakenvml.build(), config, root / "sys", doc)

    whole = al.format_device_allocated(
        {"gpu": tuple(al.DeviceAllocation(g["minor"], g["uuid"], {al.GPU_CORE: 100}) for g in gpus)}
    )
    shared = json.dumps({"gpu": [{"minor": gpus[3]["minor"], "resources": {al.GPU_MEMORY_RATIO: "25"}}]})
    image_like = ContainerInfo(
        "cuda",
        envs=(("NVIDIA_VISIBLE_DEVICES", "all"), ("PATH", "/usr/bin")),
        devices=(Device("/dev/nvidia0", "/dev/nvidia0"),),
        labels={"io.kubernetes.container.name": "cuda"},
    )
    cases = {
        "8 GPUs, scheduler's choice": PodInfo("train", "ml", "uid-train", annotations={al.DEVICE_ALLOCATED: whole}),
        "1 shared GPU, HAMi-core": PodInfo(
            "infer",
            "ml",
            "uid-infer",
            labels={"koordinator.sh/gpu-isolation-provider": "HAMi-core"},
            annotations={al.DEVICE_ALLOCATED: shared},
        ),
        "no GPU (void)": PodInfo("web", "default", "uid-web"),
    }
    allowed = ("{dev_root}/*", "/usr/local/vgpu/*", f"{root}/hami-core/*")
    table = {"cache_root": hami.cache_root, "lock_dir": hami.lock_dir}
    chain = build_chain(HooksConfig(allowed_host_paths=allowed, options={"gpu": {"hami_core": table}}), node)
    if args.beside_plugin:
        store = Store(root / "state")
        started = [(e.pod_uid, {}) for e in others if e.pod_uid.startswith("pod-")]
        started += [(f"placed-{g['minor']}", {al.DEVICE_ALLOCATED: whole}) for g in gpus]
        for i, (uid, annotations) in enumerate(started):
            store.pods[f"s{i}"] = PodRecord(f"s{i}", uid, "default", uid, annotations=annotations)
            store.containers[f"c{i}"] = ContainerRecord(f"c{i}", f"s{i}", "main")
        hook.attach_store(store)
        attach_store(chain, store)

    beside = ", beside the device plugin (store attached, chosen GPUs held by phantoms)" if args.beside_plugin else ""
    print(f"node: fake NVML {TOPOLOGY} ({len(gpus)} GPUs), checkpoint with {args.checkpoint_pods} other pods{beside}")
    print(f"hooks in the chain: {', '.join(r.hook.name for r in chain.hooks)}; {args.calls} calls per row\n")
    for label, pod in cases.items():
        ctx = HookContext(Stage.PRE_CREATE_CONTAINER, pod, image_like)
        assert hook.handle(ctx) is not None, label  # fills this hook's NVML cache

        async def once(ctx: HookContext = ctx) -> None:
            out = await chain.run(ctx)
            assert out.error is None, out.error

        async def through_chain() -> Samples:
            samples = []
            for _ in range(args.calls):
                wall, cpu = time.perf_counter(), time.process_time()
                await once()
                samples.append((time.perf_counter() - wall, time.process_time() - cpu))
            return samples

        asyncio.run(once())  # the chain's own gpu hook fills its cache
        before = library.call_count()
        direct = timed(lambda ctx=ctx: hook.handle(ctx), args.calls)
        in_chain = asyncio.run(through_chain())
        nvml_calls = library.call_count() - before
        print(f"{label}")
        print(f"  gpu hook handle():  {percentiles(direct)}")
        print(f"  whole hook chain:   {percentiles(in_chain)}")
        print(f"  NVML calls while timed: {nvml_calls}")


if __name__ == "__main__":
    main()
