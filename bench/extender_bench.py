"""Extender cost: filter+prioritize per scheduling cycle with N nodes x G GPUs in the cache, and binds/s.

    .venv/bin/python bench/extender_bench.py [--nodes 1000] [--gpus 8] [--requests 300] [--binds 200]

Filter+prioritize is timed three ways: the verbs on dicts (the allocator and the extender logic),
with the JSON encoding and decoding kube-scheduler's bodies need, and over HTTP on loopback through
`crihook scheduler`'s server (one kept-alive connection, as kube-scheduler holds one); then, over
HTTP, the scoring-only entry's prioritize-claims for a plain pod and for a pod with a claim. The cluster is
half used: about half of the GPUs carry shares of earlier pods, so nodes differ. Binds go through
the bind path's API client against the fake API server in tests/ (GET pod, PATCH claim, LIST the
node's claims twice, POST binding): binds/s is bounded by that fake, not by a real API server; the
CPU per bind is the bind path's own.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from crihook.scheduler import server, webhook
from crihook.scheduler.claims import ClaimAsk
from crihook.scheduler.devices import node_from_device
from crihook.scheduler.extender import Extender
from crihook.scheduler.plugin import DeviceShare
from crihook.scheduler.pod import pod_from_json

GiB = 1 << 30


def device(name: str, gpus: int) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {
            "devices": [
                {
                    "type": "gpu",
                    "id": f"GPU-{name}-{i}",
                    "minor": i,
                    "health": True,
                    "resources": {
                        "koordinator.sh/gpu-core": "100",
                        "koordinator.sh/gpu-memory": "80Gi",
                        "koordinator.sh/gpu-memory-ratio": "100",
                    },
                    "topology": {"pcieID": f"pci{i // 4}", "nodeID": i // 4},
                }
                for i in range(gpus)
            ]
        },
    }


def pod(uid: str, resources: dict[str, str]) -> dict[str, Any]:
    return {
        "metadata": {"name": uid, "namespace": "bench", "uid": uid},
        "spec": {
            "containers": [{"name": "main", "image": "x", "resources": {"limits": resources, "requests": resources}}],
            "schedulerName": "default-scheduler",
        },
        "status": {"phase": "Pending"},
    }


SHAPES = [
    {"nvidia.com/gpu": "1"},
    {"nvidia.com/gpu": "4"},
    {"koordinator.sh/gpu-core": "50", "koordinator.sh/gpu-memory-ratio": "50", "koordinator.sh/gpu.shared": "1"},
    {"koordinator.sh/gpu-memory": "20Gi", "koordinator.sh/gpu-core": "25", "koordinator.sh/gpu.shared": "1"},
]


def loaded_cluster(nodes: int, gpus: int, seed: int = 1) -> tuple[DeviceShare, list[str]]:
    rng = random.Random(seed)
    plugin = DeviceShare()
    names = [f"node-{i:05d}" for i in range(nodes)]
    for n in names:
        plugin.set_node(node_from_device(device(n, gpus), {"node.koordinator.sh/gpu-model": "NVIDIA-A100"}))
    for i in range(nodes * gpus // 2):  # about half of the GPUs get work
        req = plugin.pre_filter(pod_from_json(pod(f"old-{i}", rng.choice(SHAPES[::2]))))
        fit, _ = plugin.filter_nodes(req, [rng.choice(names)])
        if fit:
            plugin.reserve(req, fit[0])
    return plugin, names


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


def report(label: str, samples: list[float]) -> None:
    ms = [x * 1000 for x in samples]
    print(
        f"  {label:<38} p50 {pct(ms, 0.5):7.2f} ms   p99 {pct(ms, 0.99):7.2f} ms   mean {statistics.mean(ms):7.2f} ms"
    )


def bench_filter_prioritize(nodes: int, gpus: int, requests: int) -> None:
    plugin, names = loaded_cluster(nodes, gpus)
    ext = Extender(plugin)
    rng = random.Random(2)
    shapes = [rng.choice(SHAPES) for _ in range(requests)]

    def bodies(prefix: str) -> list[dict[str, Any]]:
        """Pods new to the scheduler, as each cycle brings one: the policy learns each uid once."""
        return [{"Pod": pod(f"{prefix}-{i}", r), "Nodes": None, "NodeNames": names} for i, r in enumerate(shapes)]

    for b in bodies("warm")[:5]:
        ext.filter(b)
        ext.prioritize(b)
    print(f"filter+prioritize, {nodes} nodes x {gpus} GPUs, {requests} pods (nodeCacheCapable: names only)")
    verbs, with_json = [], []
    for b, j in zip(bodies("dicts"), bodies("json"), strict=True):
        t0 = time.perf_counter()
        fit = ext.filter(b)
        ext.prioritize({**b, "NodeNames": fit["NodeNames"]})
        verbs.append(time.perf_counter() - t0)
        raw = json.dumps(j).encode()
        t0 = time.perf_counter()
        fit = json.dumps(ext.filter(json.loads(raw))).encode()
        names_fit = json.loads(fit)["NodeNames"]
        ext.prioritize(json.loads(json.dumps({**j, "NodeNames": names_fit}))).json()
        with_json.append(time.perf_counter() - t0)
    report("verbs on dicts", verbs)
    report("with JSON bodies", with_json)
    app = server.App(ext, webhook.WebhookConfig(), lambda: True)
    srv = server.make_server(app, "127.0.0.1", 0, None)
    threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True).start()
    conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1])

    def call(path: str, body: dict[str, Any]) -> Any:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        return json.loads(conn.getresponse().read())

    over_http = []
    for b in bodies("http"):
        t0 = time.perf_counter()
        fit = call("/filter", b)
        call("/prioritize", {**b, "NodeNames": fit["NodeNames"]})
        over_http.append(time.perf_counter() - t0)
    report("over HTTP (loopback, kept alive)", over_http)
    # the scoring-only entry (kubeScheduler.scoreClaimPods), which kube-scheduler sends every pod
    ext.claim_asks = {f"bench/gpus-{i}": ClaimAsk(1 + i % 2) for i in range(requests)}
    for label, body in (("plain pod", plain_pod), ("claim pod", claim_pod)):
        verbs, samples = [], []
        for i in range(requests):
            args = {"Pod": body(i), "Nodes": None, "NodeNames": names}
            t0 = time.perf_counter()
            ext.prioritize_claims(args).json()
            verbs.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            call("/prioritize-claims", args)
            samples.append(time.perf_counter() - t0)
        report(f"prioritize-claims, {label}: verb", verbs)
        report("  the same over HTTP", samples)
    srv.shutdown()


def plain_pod(i: int) -> dict[str, Any]:
    """A pod with neither our resources nor claims: what most of a cluster's pods are."""
    return pod(f"plain-{i}", {"cpu": "1"})


def claim_pod(i: int) -> dict[str, Any]:
    """A pod whose one ResourceClaim asks for GPUs (ext.claim_asks holds what it asks)."""
    out = pod(f"claim-{i}", {"cpu": "1"})
    out["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": f"gpus-{i}"}]
    return out


def bench_binds(binds: int, threads: int) -> None:
    from crihook.scheduler.cache import ClusterCache, KubeApi
    from tests.support.fakekube import FakeKube

    with FakeKube() as kube:
        nodes = max(1, binds // 8 + 1)
        for i in range(nodes):
            kube.create("nodes", {"metadata": {"name": f"node-{i:05d}"}})
            kube.create("devices", device(f"node-{i:05d}", 8))
        api_client = kube.api_client()
        api_client.rest_client.pool_manager.connection_pool_kw["maxsize"] = threads
        api_client.rest_client.pool_manager.clear()
        plugin = DeviceShare()
        ext = Extender(plugin, KubeApi(api_client))
        cache = ClusterCache(api_client, plugin, ext.lock)
        cache.start()
        cache.wait_ready(30)
        ext.ready = cache.ready
        pods = [
            kube.create(
                "pods", pod(f"b{i}", {"nvidia.com/gpu": "1"}) | {"metadata": {"name": f"b{i}", "namespace": "bench"}}
            )
            for i in range(binds)
        ]
        args = [
            {
                "PodName": p["metadata"]["name"],
                "PodNamespace": "bench",
                "PodUID": p["metadata"]["uid"],
                "Node": f"node-{i // 8:05d}",
            }
            for i, p in enumerate(pods)
        ]
        cpu: list[float] = []

        def bind(a: dict[str, str]) -> dict[str, str]:
            c0 = time.thread_time()  # this thread's CPU: the bind path's, not the fake API server's
            try:
                return ext.bind(a)
            finally:
                cpu.append(time.thread_time() - c0)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            results = list(pool.map(bind, args))
        elapsed = time.perf_counter() - t0
        cache.stop()
    errors = [r["Error"] for r in results if r["Error"]]
    print(f"binds: {binds} pods, {threads} threads, against the fake API server")
    print(f"  {binds / elapsed:8.0f} binds/s   ({elapsed * 1000 / binds:.2f} ms each on average, {len(errors)} errors)")
    print(f"  bind path CPU per bind {sum(cpu) * 1000 / binds:.3f} ms (its threads; GET, PATCH, 2 LISTs, POST)")
    if errors:
        print("  first error:", errors[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--binds", type=int, default=200)
    p.add_argument("--threads", type=int, default=8)
    a = p.parse_args()
    if a.requests:  # --requests 0: binds only
        bench_filter_prioritize(a.nodes, a.gpus, a.requests)
    if a.binds:  # --binds 0: no binds (they need the kubernetes client)
        bench_binds(a.binds, 1)
        bench_binds(a.binds, a.threads)


if __name__ == "__main__":
    main()
