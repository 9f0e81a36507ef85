"""What the DRA driver takes to prepare a claim, as kubelet sees it, and to publish the node's slices.

    .venv/bin/python bench/dra_bench.py [--claims 300] [--per-call 1] [--concurrency 1]

Kubelet's part is a real grpcio client on the plugin's unix socket; the driver is `crihook dra`'s
(crihook.dra.driver) with its checkpoint on the local disk and its CDI specs in /dev/shm
when there is one (the runtime's /var/run/cdi is a tmpfs), the claims read through the real
kubernetes client from the fake API server on loopback, in a process of its own, the GPUs those of
the 8-GPU NVSwitch box of the fake NVML library. Each claim is new (the API server is asked, a spec
and the checkpoint written); half hold a whole GPU, half a share (HAMi-core's limits).

Prints ms per claim for NodePrepareResources and NodeUnprepareResources (p50, p90, p99 of wall time,
and with one call at a time of this process's CPU time: the driver and kubelet's client, not the API
server; on a busy machine the wall-time tail is mostly waiting for a CPU), and for the publisher: one round from
nothing published to the pool written, one unchanged round, and one round after a GPU turned
unhealthy (its taint written).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc
from kubernetes.client import CoreV1Api, ResourceV1Api

from crihook.base import dra
from crihook.devices import slices
from crihook.devices.nvml import GpuIndex, Nvml
from crihook.devices.reporter import api_client_from
from crihook.dra.driver import Driver, Paths, Plugin, api_fetch
from crihook.dra.publisher import Publisher
from crihook.hooks.grant import HamiCore
from crihook.proto import dra_v1_pb2, dra_v1_pb2_grpc
from crihook.simnode import fakenvml
from tests.support.draclaims import claim, result
from tests.support.fakekube import FakeKube

NODE = "bench-node"


Samples = list[tuple[float, float]]  # (wall, CPU of this process) seconds per claim


def ms(samples: Samples, cpu: bool) -> str:
    """Wall and, with one call at a time (`cpu`), CPU percentiles: calls in flight together share
    the process's CPU time."""
    out = []
    columns = [("wall", [w for w, _ in samples])] + ([("cpu", [c for _, c in samples])] if cpu else [])
    for name, values in columns:
        q = statistics.quantiles(values, n=100) if len(values) > 1 else values * 99
        out.append(f"{name} p50 {statistics.median(values) * 1e3:.2f} p90 {q[89] * 1e3:.2f} p99 {q[98] * 1e3:.2f}")
    return "  ".join(out) + " ms"


def serve_api(conn: Connection, kubeconfig: Path) -> None:
    """The fake API server in a process of its own, until the parent says stop."""
    with FakeKube() as kube:
        kube.write_kubeconfig(kubeconfig)
        conn.send("ready")
        conn.recv()


async def prepare_all(paths: Paths, api: Any, nvml: Nvml, args: argparse.Namespace) -> tuple[Samples, Samples]:
    index = GpuIndex(nvml)
    minors = [g.minor for g in index.all()]
    uids = []
    for i in range(args.claims):
        consumed = {"cores": "50", "memory": "20Gi"} if i % 2 else None
        devices = [result(dra.device_name(minors[i % len(minors)]), pool=NODE, consumed=consumed)]
        doc = claim(f"c{i}", devices, namespace="bench")
        made = ResourceV1Api(api).create_namespaced_resource_claim("bench", doc, _preload_content=False)
        uids.append((json.loads(made.data)["metadata"]["uid"], f"c{i}"))
    hami = HamiCore(cache_root=str(paths.state_dir / "hami"), lock_dir=str(paths.state_dir / "lock"))
    driver = Driver(NODE, index, api_fetch(api), paths, hami)
    driver.start()
    plugin = Plugin(driver)
    await plugin.start()
    prepare_times: Samples = []
    unprepare_times: Samples = []
    try:
        async with grpc.aio.insecure_channel(f"unix://{paths.service_socket}") as ch:
            stub = dra_v1_pb2_grpc.DRAPluginStub(ch)
            groups = [uids[i : i + args.per_call] for i in range(0, len(uids), args.per_call)]
            claims = [[dra_v1_pb2.Claim(namespace="bench", uid=u, name=n) for u, n in g] for g in groups]
            await stub.NodeUnprepareResources(dra_v1_pb2.NodeUnprepareResourcesRequest())  # connect first
            for method, out, request in (
                (stub.NodePrepareResources, prepare_times, dra_v1_pb2.NodePrepareResourcesRequest),
                (stub.NodeUnprepareResources, unprepare_times, dra_v1_pb2.NodeUnprepareResourcesRequest),
            ):
                sem = asyncio.Semaphore(args.concurrency)

                async def one(group: list[dra_v1_pb2.Claim], method=method, out=out, request=request, sem=sem) -> None:
                    async with sem:
                        t0, c0 = time.perf_counter(), time.process_time()
                        answer = await method(request(claims=group))
                        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                    assert all(not a.error for a in answer.claims.values()), answer
                    out.extend([(wall / len(group), cpu / len(group))] * len(group))

                await asyncio.gather(*(one(g) for g in claims))
    finally:
        await plugin.stop()
    return prepare_times, unprepare_times


def publish_rounds(api: Any, fake: fakenvml.FakeNvml, nvml: Nvml) -> list[tuple[str, float, int]]:
    CoreV1Api(api).create_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
    pub = Publisher(NODE, api, nvml, features=slices.Features(True, True))
    out = []
    for what in ("first round: pool written", "unchanged round", "a GPU turned unhealthy"):
        if what.startswith("a GPU"):
            fake.doc["gpus"][2]["row_remap_failure"] = True
            fake.write()
            fake.reload()
        t0 = time.perf_counter()
        done = pub.run_once()
        out.append((what, time.perf_counter() - t0, len(done.writes)))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--claims", type=int, default=300)
    p.add_argument("--per-call", type=int, default=1, help="claims in one NodePrepareResources")
    p.add_argument("--concurrency", type=int, default=1, help="calls in flight at once")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="drabench", dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
        root = Path(tmp)
        doc = fakenvml.topology("dgx-h100")
        config = root / "nvml.json"
        config.write_text(json.dumps(doc))
        os.environ[fakenvml.CONFIG_ENV] = str(config)
        sys_root = root / "sys"
        fakenvml.make_sys_tree(sys_root, doc)
        fake = fakenvml.FakeNvml(fakenvml.build(), config, sys_root, doc)
        dev = root / "dev"
        dev.mkdir()
        for name in [f"nvidia{g['minor']}" for g in doc["gpus"]] + ["nvidiactl", "nvidia-uvm"]:
            (dev / name).touch()
        shm = Path("/dev/shm")
        cdi = Path(tempfile.mkdtemp(prefix="drabench", dir=shm)) if shm.is_dir() else root / "cdi"
        paths = Paths(root / "kubelet", root / "state", cdi, str(dev))
        nvml = Nvml(str(fake.library), str(sys_root))
        parent, child = multiprocessing.Pipe()
        server = multiprocessing.get_context("spawn").Process(target=serve_api, args=(child, root / "kubeconfig"))
        server.start()
        try:
            parent.recv()
            api = api_client_from(str(root / "kubeconfig"))
            prepared, unprepared = asyncio.run(prepare_all(paths, api, nvml, args))
            rounds = publish_rounds(api, fake, nvml)
        finally:
            parent.send("stop")
            server.join(timeout=30)
            nvml.close()
            if cdi.parent == shm:
                shutil.rmtree(cdi, ignore_errors=True)
    print(f"load average {os.getloadavg()[0]:.1f}")
    print(f"{args.claims} claims, {args.per_call} per call, {args.concurrency} call(s) at once; per claim:")
    alone = args.concurrency == 1
    print(f"  NodePrepareResources    {ms(prepared, alone)}")
    print(f"  NodeUnprepareResources  {ms(unprepared, alone)}")
    print("publisher:")
    for what, seconds, writes in rounds:
        print(f"  {what:28s} {seconds * 1e3:8.1f} ms  ({writes} write(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
