"""NRI mode beside direct and proxy mode and beside NRI's own floor, on a simulated 8-GPU node where
every pod is given all 8 GPUs, so the gpu hook does its whole job.

    TMPDIR=/dev/shm python bench/nri_bench.py [--runtime 1.7|2] [--rounds 300] [--creates 100] [--pods 50]
    python bench/nri_bench.py --handler-only [--creates 1000]

Needs root, containerd and runc, as bench/proxy_bench.py does, and Go for the Go plugin (built on
first use from bench/nriplugin, the `github.com/containerd/nri` module at the version its go.mod
names, into ~/.cache/crihook/bench; `--no-go` leaves it out). A registered plugin sees every
CreateContainer of its containerd, so each plugin gets a containerd of its own: three private
containerds of the same release (NRI on) run side by side, A with no plugin, B with `crihook nri`
and C with the Go plugin (containerd's own stub library, answering every CreateContainer with one
env adjustment: what any NRI plugin costs at the least). Targets, interleaved call by call in an
order drawn afresh each round so machine noise hits all alike: direct (A, sent the request
crihook's hooks would make, worked out in this process untimed, so containerd does the same work),
proxy (`crihook serve` in front of A, sent kubelet's request), nri (B, sent kubelet's request) and
go (C, sent the rewritten request). Before the plugins register, the same calls go to A, B and C
straight: the A/A lines, what B and C cost over A by themselves, printed first. Prints p50/p99 per
target and what each adds over direct, for Version, CreateContainer into a running pod and pod start
(RunPodSandbox, the pod's CreateContainer, StartContainer), then crihook's added p50 over the Go
plugin's, and the daemons' resident memory.

`--handler-only`: no containerd; crihook's NRI handler in this process, on the same node, for a
kubelet-shaped CreateContainer request (decoded, hooks run, the adjustment encoded): crihook's own
share of what NRI mode adds, without the socket hops and containerd's side of NRI.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import proxy_bench as pb

from crihook.base import config as cfgmod
from crihook.hooks.registry import build_chain
from crihook.node.lifecycle import Lifecycle
from crihook.node.store import Store
from crihook.nri.handler import HookHandler
from crihook.proto import nri_v1alpha1_pb2 as nri
from crihook.proto import runtime_v1_pb2 as api
from crihook.simnode import fakenvml
from crihook.simnode.daemon import Crihook
from crihook.simnode.node import make_sim_node
from tests.support.containerd import RUNTIMES, running_containerd, runtime
from tests.support.cri import container_config, pod_config

R = "/runtime.v1.RuntimeService/"


def quiet(d: Crihook) -> Crihook:
    d.write_config()
    d.config_path.write_text(d.config_path.read_text().replace('log_level = "debug"', 'log_level = "warning"'))
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runtime", choices=[r for r in RUNTIMES if r != "1.6"], default="2")
    ap.add_argument("--rounds", type=int, default=300, help="Version calls per target")
    ap.add_argument("--creates", type=int, default=100, help="CreateContainers per target")
    ap.add_argument("--pods", type=int, default=50, help="pod starts per target")
    ap.add_argument("--handler-only", action="store_true", help="time crihook's NRI handler in this process")
    ap.add_argument("--no-go", action="store_true", help="leave out the Go plugin and its containerd")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # the containerds and daemons stop on the way out
    tmp = Path(tempfile.mkdtemp(prefix="nri-bench-"))
    atexit.register(shutil.rmtree, tmp, True)
    print(f"load average {os.getloadavg()[0]:.1f} at start", flush=True)
    sim = make_sim_node(tmp / "node", pb.TOPOLOGY, char_devices=True)
    node, annotations = sim.proxy_config(fakenvml.build()), pb.all_gpus(sim)
    env = {fakenvml.CONFIG_ENV: str(sim.config)}
    os.environ.update(env)  # the rewriter's hooks read the same node
    if args.handler_only:
        asyncio.run(handler_alone(pb.crihook_config(tmp, node, "handler-state"), annotations, args.creates))
        return
    rt = runtime(args.runtime)
    if (why := rt.unavailable()) is not None:
        raise SystemExit(why)
    print(f"containerd {rt.name}: {rt.package_version()} (Debian {rt.suite}), in {pb.fs_type(str(tmp))}", flush=True)
    rewrite = pb.Rewriter(pb.crihook_config(tmp, node, "rewriter-state"), tmp / "rewriter")
    atexit.register(rewrite.close)
    go = None if args.no_go else go_plugin(tmp)
    with contextlib.ExitStack() as stack:
        a = stack.enter_context(running_containerd(runtime=rt, nri=True))
        b = stack.enter_context(running_containerd(runtime=rt, nri=True))
        c = stack.enter_context(running_containerd(runtime=rt, nri=True)) if go is not None else None
        proxy = quiet(Crihook(tmp / "proxy", a.address, node, env))
        plugin = quiet(Crihook(tmp / "nri", b.address, node, env, b.nri_socket))
        proxy.start()
        stack.callback(proxy.stop)
        chans = {
            "direct": grpc.insecure_channel(a.address),
            "proxy": grpc.insecure_channel(proxy.address),
            "nri": grpc.insecure_channel(b.address),
        }
        if c is not None:
            chans["go"] = grpc.insecure_channel(c.address)
        for ch in chans.values():
            stack.callback(ch.close)

        def call(target: str, method: str, body: bytes) -> bytes:
            fn = chans[target].unary_unary(R + method, request_serializer=pb.ident, response_deserializer=pb.ident)
            return bytes(fn(body, timeout=60))

        counter = iter(range(10**9))
        pods: dict[str, list[str]] = {t: [] for t in chans}

        def run_pod(target: str) -> tuple[str, api.PodSandboxConfig]:
            cfg = pod_config(f"bench-{target}-{next(counter)}", annotations=annotations)
            raw = call(target, "RunPodSandbox", api.RunPodSandboxRequest(config=cfg).SerializeToString())
            pod_id = api.RunPodSandboxResponse.FromString(raw).pod_sandbox_id
            pods[target].append(pod_id)
            return pod_id, cfg

        def body_for(target: str, rewritten: bool, pod_id: str, cfg: api.PodSandboxConfig) -> bytes:
            req = api.CreateContainerRequest(
                pod_sandbox_id=pod_id, config=container_config(f"c{next(counter)}", cfg), sandbox_config=cfg
            ).SerializeToString()
            return rewrite(req) if rewritten else req

        def measure(targets: dict[str, bool]) -> dict[str, dict[str, list[float]]]:
            """`targets`: target -> whether it is sent the rewritten request."""
            version = api.VersionRequest(version="v1").SerializeToString()
            out = {"Version": pb.interleaved({t: partial(call, t, "Version", version) for t in targets}, args.rounds)}
            running = {t: run_pod(t) for t in targets}
            made: list[tuple[str, str]] = []

            def create(target: str) -> Callable[[], float]:
                def fn() -> float:
                    body = body_for(target, targets[target], *running[target])
                    began = time.perf_counter()
                    raw = call(target, "CreateContainer", body)
                    took = time.perf_counter() - began
                    made.append((target, api.CreateContainerResponse.FromString(raw).container_id))
                    return took

                return fn

            def remove() -> None:
                for target, cid in made:
                    t = "direct" if target == "proxy" else target
                    call(t, "RemoveContainer", api.RemoveContainerRequest(container_id=cid).SerializeToString())
                made.clear()

            out["CreateContainer (8 GPUs)"] = pb.interleaved({t: create(t) for t in targets}, args.creates, remove)

            def start(target: str) -> Callable[[], float]:
                def fn() -> float:
                    cfg = pod_config(f"bench-{target}-{next(counter)}", annotations=annotations)
                    run_body = api.RunPodSandboxRequest(config=cfg).SerializeToString()
                    began = time.perf_counter()
                    raw = call(target, "RunPodSandbox", run_body)
                    ran = time.perf_counter()
                    pod_id = api.RunPodSandboxResponse.FromString(raw).pod_sandbox_id
                    pods[target].append(pod_id)
                    body = body_for(target, targets[target], pod_id, cfg)  # untimed for every target
                    resumed = time.perf_counter()
                    cid = api.CreateContainerResponse.FromString(call(target, "CreateContainer", body)).container_id
                    call(target, "StartContainer", api.StartContainerRequest(container_id=cid).SerializeToString())
                    return (ran - began) + (time.perf_counter() - resumed)

                return fn

            out["pod start (run+create+start)"] = pb.interleaved({t: start(t) for t in targets}, args.pods)
            for target, ids in pods.items():
                t = "direct" if target == "proxy" else target
                for p in ids:
                    call(t, "StopPodSandbox", api.StopPodSandboxRequest(pod_sandbox_id=p).SerializeToString())
                    call(t, "RemovePodSandbox", api.RemovePodSandboxRequest(pod_sandbox_id=p).SerializeToString())
                ids.clear()
            return out

        straight = {"direct": True, "nri": True} | ({"go": True} if c is not None else {})
        print("A/A, no plugin: B (and C) straight beside A straight, all sent the rewritten request", flush=True)
        calibration = measure(straight)
        report(calibration, {"direct": "A", "nri": "B", "go": "C"})
        plugin.start()  # registered with B and synchronized
        stack.callback(plugin.stop)
        if c is not None and go is not None:
            stack.enter_context(go_registered(go, c))
        print("direct (A) | proxy (crihook serve in front of A) | nri (B, crihook nri) | go (C, Go plugin)", flush=True)
        attached = measure({"direct": True, "proxy": False, "nri": False} | ({"go": True} if c is not None else {}))
        report(attached, {})
        if c is not None:
            against_floor(attached, calibration)
        print(
            f"resident memory: crihook nri {plugin.rss_bytes() / 2**20:.1f} MiB,"
            f" crihook serve {proxy.rss_bytes() / 2**20:.1f} MiB",
            flush=True,
        )


GO_MODULE = Path(__file__).resolve().parent / "nriplugin"


def go_plugin(tmp: Path) -> Path:
    """The Go plugin's binary, built from bench/nriplugin into the cache unless its sources' build
    is there already (the file is named by a hash of go.mod, go.sum and main.go)."""
    import hashlib

    digest = hashlib.sha256(b"".join((GO_MODULE / f).read_bytes() for f in ("go.mod", "go.sum", "main.go")))
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "crihook" / "bench"
    binary = cache / f"nri-goplugin-{digest.hexdigest()[:16]}"
    if not binary.exists():
        go = shutil.which("go") or "/usr/local/go/bin/go"
        print(f"building the Go NRI plugin with {go} (once; minutes on a cold Go cache)", flush=True)
        cache.mkdir(parents=True, exist_ok=True)
        built = tmp / "nri-goplugin"
        subprocess.run([go, "build", "-o", str(built), "."], cwd=GO_MODULE, check=True)
        shutil.move(built, binary)
    return binary


@contextlib.contextmanager
def go_registered(binary: Path, c: Any) -> Iterator[None]:
    """The Go plugin running against containerd `c`, until it has registered there."""
    proc = subprocess.Popen(
        [str(binary), "-socket", str(c.nri_socket), "-name", "gobench", "-idx", "10"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while 'plugin \\"10-gobench\\" connected' not in c.log_path.read_text(errors="replace"):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("the Go NRI plugin did not register")
            time.sleep(0.05)
        yield
    finally:
        proc.terminate()
        proc.wait(10)


def against_floor(attached: dict[str, dict[str, list[float]]], calibration: dict[str, dict[str, list[float]]]) -> None:
    """crihook's added p50 beside the Go plugin's, both over direct, and the same less each
    containerd's own offset over A in the A/A run (noisier: two runs' medians)."""
    for title, samples in attached.items():
        d50, base = statistics.median(samples["direct"]), statistics.median(calibration[title]["direct"])
        raw = {t: statistics.median(samples[t]) - d50 for t in ("nri", "go")}
        less = {t: raw[t] - (statistics.median(calibration[title][t]) - base) for t in ("nri", "go")}
        print(
            f"{title}: added p50 crihook nri {raw['nri'] * 1000:+.3f} ms, Go plugin {raw['go'] * 1000:+.3f} ms,"
            f" ratio {ratio(raw['nri'], raw['go'])}; less A/A {less['nri'] * 1000:+.3f} ms,"
            f" {less['go'] * 1000:+.3f} ms, ratio {ratio(less['nri'], less['go'])}",
            flush=True,
        )


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 else "n/a (the Go plugin added nothing measurable)"


async def handler_alone(config_text: str, annotations: dict[str, str], creates: int) -> None:
    """HookHandler.create_container on kubelet-shaped NRI messages: a pod given every GPU, a
    container with a service account's mounts, some env and containerd's default device rules."""
    cfg = cfgmod.parse(tomllib.loads(config_text))
    handler = HookHandler(Lifecycle(build_chain(cfg.hooks, cfg.node), Store(cfg.proxy.state_dir)))
    await handler.configure(nri.ConfigureRequest(runtime_name="containerd", runtime_version="1.7.24"))
    pod = nri.PodSandbox(id="bench-pod", name="bench", uid="bench-uid", namespace="default")
    pod.annotations.update(annotations)
    await handler.state_change(nri.StateChangeEvent(event=nri.RUN_POD_SANDBOX, pod=pod))
    requests = []
    for i in range(creates + creates // 5):
        c = nri.Container(id=f"c{i}", pod_sandbox_id=pod.id, name="app", env=[f"ENV_{j}=value{j}" for j in range(15)])
        c.annotations["io.kubernetes.container.restartCount"] = "0"
        for dest in ("/etc/hosts", "/dev/termination-log", "/etc/hostname", "/dev/shm", "/var/run/secrets/sa"):
            c.mounts.add(destination=dest, source=f"/var/lib/kubelet{dest}", type="bind", options=["rbind", "rw"])
        for minor in (3, 5, 7, 8, 9):  # /dev/null, zero, full, random, urandom
            rule = c.linux.resources.devices.add(allow=True, type="c", access="rwm")
            rule.major.value, rule.minor.value = 1, minor
        requests.append(nri.CreateContainerRequest(pod=pod, container=c).SerializeToString())
    took = []
    for raw in requests:
        began = time.perf_counter()
        (await handler.create_container(nri.CreateContainerRequest.FromString(raw))).SerializeToString()
        took.append(time.perf_counter() - began)
    took = took[creates // 5 :]  # the first ones warm the caches
    print(
        f"crihook nri handler in this process, CreateContainer with 8 GPUs [n={len(took)}]:"
        f" p50 {statistics.median(took) * 1000:.3f} ms p99 {pb.pct(took, 0.99) * 1000:.3f} ms",
        flush=True,
    )


def report(results: dict[str, dict[str, list[float]]], names: dict[str, str]) -> None:
    for title, samples in results.items():
        direct = samples["direct"]
        d50 = statistics.median(direct)
        cells = [f"{names.get('direct', 'direct')} p50 {d50 * 1000:.3f} ms p99 {pb.pct(direct, 0.99) * 1000:.3f} ms"]
        for target, s in samples.items():
            if target == "direct":
                continue
            p50 = statistics.median(s)
            lo, hi = pb.added_interval(s, direct, 0.5)
            cells.append(
                f"{names.get(target, target)} p50 {p50 * 1000:.3f} ms p99 {pb.pct(s, 0.99) * 1000:.3f} ms,"
                f" added {(p50 - d50) * 1000:+.3f} ms [{lo * 1000:+.3f}, {hi * 1000:+.3f}]"
                f" ({(p50 / d50 - 1) * 100:+.1f} %)"
            )
        print(f"{title} [n={len(direct)} each]: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
