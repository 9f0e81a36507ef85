"""NRI mode beside direct and proxy mode and beside NRI's own floor, on a simulated 8-GPU node where
every pod is given all 8 GPUs, so the gpu hook does its whole job.

    TMPDIR=/dev/shm python bench/nri_bench.py [--runtime 1.7|2] [--rounds 300] [--creates 100] [--pods 50]
                                              [--samples FILE]
    python bench/nri_bench.py --pool FILE [FILE ...]
    TMPDIR=/dev/shm python bench/nri_bench.py --handler-only [--creates 1000] [--gap 0.01] [--profile FILE]

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
(RunPodSandbox, the pod's CreateContainer, StartContainer; each round's pods stopped and removed
after it, untimed), with the CPU each containerd and plugin used per round; then crihook's added
p50 beside the Go plugin's (their ratio, and crihook's p50 over the Go plugin's in ms and %, with
95 % intervals), and the daemons' resident memory. A CRI call that fails, or gets no answer within
a minute, ends the bench naming the call and the target. `--samples FILE` writes every timed
call's seconds there; `--pool` reports such files of several sittings together (each figure worked
out per sitting and averaged, weighted by rounds), for what one sitting can not resolve.

`--handler-only`: no containerd; `crihook nri`'s plugin side in this process, on the same node, made
as the daemon makes it (its store in TMPDIR), sent containerd's CreateContainer for a kubelet
container over the plugin's socket, with `--gap` seconds of idle event loop between calls as the
daemon has between the runtime's calls (the store's writes run there). Prints p50/p99 of the round
trip and of each phase inside it (ttrpc, the views, the hooks, the spec's device rules, what the
runtime can not apply, the adjustment, the GPU check), and of the store's record, made once the
answer is written (the round trip holds it: the runtime's end here shares the plugin's event loop,
which runs it before reading the answer; containerd reads it at once): crihook's own share of what
NRI mode adds, without containerd's side of NRI. `--gap 0` runs the calls back to back, on
caches the last call left warm; `--profile FILE` writes cProfile's stats of the timed calls there
and prints the top of them.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import cProfile
import json
import os
import pstats
import shutil
import signal
import socket
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
from crihook.base import log
from crihook.hooks.registry import build_chain
from crihook.node.daemon import attach_store
from crihook.node.lifecycle import Lifecycle
from crihook.node.store import Store
from crihook.nri import handler as nri_handler
from crihook.nri import mux, stub, ttrpc
from crihook.nri.serve import hook_handler
from crihook.proto import nri_v1alpha1_pb2 as nri
from crihook.proto import runtime_v1_pb2 as api
from crihook.proto import ttrpc_pb2
from crihook.simnode import fakenvml
from crihook.simnode.daemon import Crihook
from crihook.simnode.node import make_sim_node
from tests.support.containerd import RUNTIMES, running_containerd, runtime
from tests.support.cri import container_config, pod_config

R = "/runtime.v1.RuntimeService/"
CALL_TIMEOUT = 60.0  # seconds a CRI call may take before the bench gives up


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
    ap.add_argument("--gap", type=float, default=0.01, help="--handler-only: seconds idle between calls")
    ap.add_argument("--profile", default="", help="--handler-only: cProfile the creates into this file")
    ap.add_argument("--no-go", action="store_true", help="leave out the Go plugin and its containerd")
    ap.add_argument("--samples", default="", help="write every timed call's seconds to this JSON file")
    ap.add_argument("--pool", nargs="+", default=[], metavar="FILE", help="report --samples files together")
    args = ap.parse_args()
    if args.pool:
        pooled(args.pool)
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # the containerds and daemons stop on the way out
    tmp = Path(tempfile.mkdtemp(prefix="nri-bench-"))
    atexit.register(shutil.rmtree, tmp, True)
    print(f"load average {os.getloadavg()[0]:.1f} at start", flush=True)
    sim = make_sim_node(tmp / "node", pb.TOPOLOGY, char_devices=True)
    node, annotations = sim.proxy_config(fakenvml.build()), pb.all_gpus(sim)
    env = {fakenvml.CONFIG_ENV: str(sim.config)}
    os.environ.update(env)  # the rewriter's hooks read the same node
    if args.handler_only:
        config = pb.crihook_config(tmp, node, "handler-state")
        asyncio.run(handler_alone(config, annotations, args.creates, args.gap, args.profile))
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
        stack.callback(proxy.stop)  # before the start: a daemon that fails to start is stopped too
        proxy.start()
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
            """One call; a failed or unanswered one ends the bench naming the target (the finally
            blocks stop the containerds): a containerd that stopped answering must not be waited on
            for every pod left to remove."""
            fn = chans[target].unary_unary(R + method, request_serializer=pb.ident, response_deserializer=pb.ident)
            try:
                return bytes(fn(body, timeout=CALL_TIMEOUT))
            except grpc.RpcError as e:
                raise SystemExit(f"{method} to {target} failed: {e.code().name}: {e.details()}") from None

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

        def measure(targets: dict[str, bool], pids: dict[str, int]) -> dict[str, dict[str, list[float]]]:
            """`targets`: target -> whether it is sent the rewritten request. `pids`: the processes
            whose CPU per round (its removals included) is printed after each measure."""
            out: dict[str, dict[str, list[float]]] = {}

            def timed(title: str, rounds: int, run: Callable[[], dict[str, list[float]]]) -> None:
                before = pb.cpu_now(pids)
                out[title] = run()
                used = ", ".join(
                    f"{name} {(pb.cpu_seconds(pid)[0] - before[name][0]) / rounds * 1000:.3f}"
                    for name, pid in pids.items()
                )
                print(f"  CPU per {title} round, ms (removal included): {used}", flush=True)

            version = api.VersionRequest(version="v1").SerializeToString()
            timed(
                "Version",
                args.rounds,
                lambda: pb.interleaved({t: partial(call, t, "Version", version) for t in targets}, args.rounds),
            )
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

            timed(
                "CreateContainer (8 GPUs)",
                args.creates,
                lambda: pb.interleaved({t: create(t) for t in targets}, args.creates, remove),
            )

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

            def remove_pods() -> None:
                """The pods started so far, stopped and removed untimed after each round: hundreds
                left running hold a shim each and starve the containerds."""
                for target, ids in pods.items():
                    t = "direct" if target == "proxy" else target
                    for p in ids:
                        call(t, "StopPodSandbox", api.StopPodSandboxRequest(pod_sandbox_id=p).SerializeToString())
                        call(t, "RemovePodSandbox", api.RemovePodSandboxRequest(pod_sandbox_id=p).SerializeToString())
                    ids.clear()

            timed(
                "pod start (run+create+start)",
                args.pods,
                lambda: pb.interleaved({t: start(t) for t in targets}, args.pods, remove_pods),
            )
            remove_pods()
            return out

        straight = {"direct": True, "nri": True} | ({"go": True} if c is not None else {})
        print("A/A, no plugin: B (and C) straight beside A straight, all sent the rewritten request", flush=True)
        runtimes = {"containerd B": b.pid} | ({"containerd C": c.pid} if c is not None else {})
        calibration = measure(straight, {k: v for k, v in runtimes.items() if v is not None})
        report(calibration, {"direct": "A", "nri": "B", "go": "C"})
        stack.callback(plugin.stop)
        plugin.start()  # registered with B and synchronized
        plugins = {"crihook nri": plugin.pid}
        if c is not None and go is not None:
            plugins["Go plugin"] = stack.enter_context(go_registered(go, c)).pid
        print("direct (A) | proxy (crihook serve in front of A) | nri (B, crihook nri) | go (C, Go plugin)", flush=True)
        attached = measure(
            {"direct": True, "proxy": False, "nri": False} | ({"go": True} if c is not None else {}),
            {k: v for k, v in (runtimes | plugins).items() if v is not None},
        )
        report(attached, {})
        if c is not None:
            against_floor([(attached, calibration)])
        if args.samples:
            Path(args.samples).write_text(json.dumps({"calibration": calibration, "attached": attached}))
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
def go_registered(binary: Path, c: Any) -> Iterator[subprocess.Popen[bytes]]:
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
        yield proc
    finally:
        proc.terminate()
        proc.wait(10)


def pooled(files: list[str]) -> None:
    """Sittings written by --samples reported as one (against_floor over all of them), for what one
    sitting can not resolve (pod start)."""
    runs = [json.loads(Path(f).read_text()) for f in files]
    print(f"{len(files)} sittings pooled: {', '.join(files)}", flush=True)
    against_floor([(run["attached"], run["calibration"]) for run in runs])


Samples = dict[str, dict[str, list[float]]]  # measure -> target -> seconds per call, round by round


def against_floor(sittings: list[tuple[Samples, Samples]]) -> None:
    """crihook's added p50 over direct beside the Go plugin's, and their ratio; crihook's p50 over
    the Go plugin's, in ms and as a share of the Go plugin's (the pod start target's terms); the
    added p50s less each containerd's own offset over A in the A/A run. `sittings`: (attached,
    calibration) of one run or several; each figure is worked out in each sitting and averaged,
    weighted by its rounds (a sitting's machine is not another's, so their calls are not mixed),
    with a 95 % bootstrap interval that resamples whole rounds within each sitting."""
    import numpy as np  # here: only the report needs it

    rng = np.random.default_rng(0)
    for title in sittings[0][0]:
        weights = np.array([len(attached[title]["direct"]) for attached, _ in sittings], dtype=float)
        weights /= weights.sum()
        point = {k: 0.0 for k in ("nri", "go", "go50", "nri_aa", "go_aa")}
        draws = {k: np.zeros(BOOTSTRAP) for k in ("nri", "go", "go50")}
        for w, (attached, calibration) in zip(weights, sittings, strict=True):
            n, g, d = (np.asarray(attached[title][t]) for t in ("nri", "go", "direct"))
            med = {t: float(np.median(a)) for t, a in (("nri", n), ("go", g), ("direct", d))}
            aa = {
                t: float(np.median(calibration[title][t]) - np.median(calibration[title]["direct"]))
                for t in ("nri", "go")
            }
            point["nri"] += w * (med["nri"] - med["direct"])
            point["go"] += w * (med["go"] - med["direct"])
            point["go50"] += w * med["go"]
            point["nri_aa"] += w * (med["nri"] - med["direct"] - aa["nri"])
            point["go_aa"] += w * (med["go"] - med["direct"] - aa["go"])
            picks = rng.integers(0, len(d), size=(BOOTSTRAP, len(d)))
            base = np.median(d[picks], axis=1)
            draws["nri"] += w * (np.median(n[picks], axis=1) - base)
            go50 = np.median(g[picks], axis=1)
            draws["go"] += w * (go50 - base)
            draws["go50"] += w * go50
        lo, hi = np.quantile(draws["nri"] / draws["go"], [0.025, 0.975])
        over = point["nri"] - point["go"]
        olo, ohi = np.quantile(draws["nri"] - draws["go"], [0.025, 0.975])
        plo, phi = np.quantile((draws["nri"] - draws["go"]) / draws["go50"] * 100, [0.025, 0.975])
        print(
            f"{title}: added p50 crihook nri {point['nri'] * 1000:+.3f} ms, Go plugin {point['go'] * 1000:+.3f} ms,"
            f" ratio {ratio(point['nri'], point['go'])} [{lo:.2f}, {hi:.2f}];"
            f" nri over go {over * 1000:+.3f} ms [{olo * 1000:+.3f}, {ohi * 1000:+.3f}]"
            f" ({over / point['go50'] * 100:+.2f} % [{plo:+.2f}, {phi:+.2f}]);"
            f" less A/A {point['nri_aa'] * 1000:+.3f} ms, {point['go_aa'] * 1000:+.3f} ms,"
            f" ratio {ratio(point['nri_aa'], point['go_aa'])}",
            flush=True,
        )


BOOTSTRAP = 2000  # resamples for against_floor's intervals


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 else "n/a (the Go plugin added nothing measurable)"


# the mounts of containerd's default spec and kubelet's, as NRI shows them: (destination, type, source, options)
MOUNTS = (
    ("/proc", "proc", "proc", ("nosuid", "noexec", "nodev")),
    ("/dev", "tmpfs", "tmpfs", ("nosuid", "strictatime", "mode=755", "size=65536k")),
    ("/dev/pts", "devpts", "devpts", ("nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5")),
    ("/dev/mqueue", "mqueue", "mqueue", ("nosuid", "noexec", "nodev")),
    ("/sys", "sysfs", "sysfs", ("nosuid", "noexec", "nodev", "ro")),
    ("/sys/fs/cgroup", "cgroup", "cgroup", ("nosuid", "noexec", "nodev", "relatime", "ro")),
    ("/etc/hosts", "bind", "/var/lib/kubelet/pods/u/etc-hosts", ("rbind", "rprivate", "rw")),
    ("/dev/termination-log", "bind", "/var/lib/kubelet/pods/u/containers/app/0", ("rbind", "rprivate", "rw")),
    ("/etc/hostname", "bind", "/var/lib/containerd/sandboxes/s/hostname", ("rbind", "rprivate", "rw")),
    ("/etc/resolv.conf", "bind", "/var/lib/containerd/sandboxes/s/resolv.conf", ("rbind", "rprivate", "rw")),
    ("/dev/shm", "bind", "/run/containerd/sandboxes/s/shm", ("rbind", "rprivate", "rw")),
    (
        "/var/run/secrets/kubernetes.io/serviceaccount",
        "bind",
        "/var/lib/kubelet/pods/u/sa",
        ("rbind", "rprivate", "ro"),
    ),
)


def spec_container(cid: str, pod: nri.PodSandbox) -> nri.Container:
    """A container as containerd's NRI shows a kubelet container's finished spec: the image's and
    kubelet's env, containerd's and kubelet's mounts, containerd's default device-cgroup rules and
    the CRI annotations; no device node of its own (the gpu hook adds them)."""
    env = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", f"HOSTNAME={pod.name}"]
    env += [f"ENV_{j}=value{j}" for j in range(8)]
    for svc in ("KUBERNETES", "DNS"):
        env += [f"{svc}_SERVICE_HOST=10.96.0.1", f"{svc}_SERVICE_PORT=443", f"{svc}_PORT=tcp://10.96.0.1:443"]
    c = nri.Container(id=cid, pod_sandbox_id=pod.id, name="app", env=env, pid=4242)
    c.labels.update({"io.kubernetes.container.name": "app", "io.kubernetes.pod.name": pod.name})
    c.annotations.update(
        {
            "io.kubernetes.container.hash": "5d3ac2b1",
            "io.kubernetes.container.restartCount": "0",
            "io.kubernetes.container.terminationMessagePath": "/dev/termination-log",
            "io.kubernetes.container.terminationMessagePolicy": "File",
            "io.kubernetes.cri.container-name": "app",
            "io.kubernetes.cri.container-type": "container",
            "io.kubernetes.cri.image-name": "registry.example/train:1",
            "io.kubernetes.cri.sandbox-id": pod.id,
            "io.kubernetes.cri.sandbox-name": pod.name,
            "io.kubernetes.cri.sandbox-namespace": pod.namespace,
            "io.kubernetes.cri.sandbox-uid": pod.uid,
        }
    )
    for dest, kind, source, options in MOUNTS:
        c.mounts.add(destination=dest, type=kind, source=source, options=options)
    devices = c.linux.resources.devices
    devices.add(allow=False, access="rwm")
    for kind in ("c", "b"):
        devices.add(allow=True, type=kind, access="m")
    for major, minor in ((1, 3), (1, 8), (1, 7), (5, 0), (1, 5), (1, 9), (5, 1), (136, None), (5, 2), (10, 200)):
        rule = devices.add(allow=True, type="c", access="rwm")
        rule.major.value = major
        if minor is not None:
            rule.minor.value = minor
    c.linux.resources.memory.limit.value = 8 << 30
    c.linux.resources.cpu.shares.value, c.linux.resources.cpu.quota.value = 2048, 200000
    c.linux.resources.cpu.period.value = 100000
    c.linux.cgroups_path = f"kubepods-pod{pod.uid}.slice:cri-containerd:{cid}"
    return c


class Phases:
    """Nanoseconds spent in wrapped calls, summed per phase over one CreateContainer: what the bench
    wraps in this process (nothing shipped is instrumented)."""

    def __init__(self) -> None:
        self.now: dict[str, int] = {}
        self.calls: list[dict[str, int]] = []

    def wrap(self, owner: Any, attr: str, phase: str) -> None:
        fn = getattr(owner, attr)
        add = self._add
        if asyncio.iscoroutinefunction(fn):

            async def timed_async(*args: Any, **kwargs: Any) -> Any:
                began = time.perf_counter_ns()
                try:
                    return await fn(*args, **kwargs)
                finally:
                    add(phase, time.perf_counter_ns() - began)

            setattr(owner, attr, timed_async)
        else:

            def timed(*args: Any, **kwargs: Any) -> Any:
                began = time.perf_counter_ns()
                try:
                    return fn(*args, **kwargs)
                finally:
                    add(phase, time.perf_counter_ns() - began)

            setattr(owner, attr, timed)

    def _add(self, phase: str, ns: int) -> None:
        self.now[phase] = self.now.get(phase, 0) + ns

    def done(self) -> None:
        self.calls.append(self.now)
        self.now = {}


# what the handler's phases are, in the order printed: (phase, what it holds)
PHASES = (
    ("round trip", "the request written to the plugin's socket to its answer read back, both ends in this process"),
    ("call", "ttrpc request decoded, the deadline, the handler, the answer encoded (nri.stub)"),
    ("handler", "HookHandler.create_container"),
    ("pod view", "the pod's view of NRI's message, made at its first CreateContainer"),
    ("container view", "the container's view of NRI's message"),
    ("hooks", "the hook chain (Lifecycle.create_container)"),
    ("device rules", "the spec's device-cgroup rules"),
    ("unapplied", "what the runtime can not apply"),
    ("adjustment", "the ContainerAdjustment"),
    ("gpu check", "what GPU the adjusted container would still reach"),
)
# timed within the call but after the answer is written: the runtime no longer waits for it
AFTER = (("record", "the store's record (Lifecycle.container_created), once the answer is written"),)


async def handler_alone(config_text: str, annotations: dict[str, str], creates: int, gap: float, profile: str) -> None:
    """`crihook nri`'s plugin side in this process as the daemon runs it, without containerd: the
    handler made as `crihook nri` makes it (its gpu hook attached to the store, the store in TMPDIR,
    the daemon's log setup), the runtime's ttrpc frames (kubelet-shaped: a pod given every GPU, a
    container with a service account's mounts, some env and containerd's default device rules)
    written to the plugin's socket and read back, `gap` seconds of idle event loop between calls
    (the store's writes run there, as between the runtime's calls) and each container removed again
    after its answer, untimed. Prints the round trip and the phases inside it, p50 and p99."""
    cfg = cfgmod.parse(tomllib.loads(config_text))
    log.setup(cfg.proxy.log_level)
    store = Store(cfg.proxy.state_dir)
    chain = build_chain(cfg.hooks, cfg.node)
    attach_store(chain, store)
    handler = hook_handler(cfg, Lifecycle(chain, store))
    ours, theirs = socket.socketpair()
    reader, writer = await asyncio.open_unix_connection(sock=ours)
    conn = stub.Connection(reader, writer, stub._Service(handler, lambda _: None))
    serving = asyncio.create_task(conn.serve())
    runtime_reader, runtime_writer = await asyncio.open_unix_connection(sock=theirs)
    demux, frames = mux.Decoder(), ttrpc.Decoder()
    streams = iter(range(1, 10**9, 2))

    async def call(method: str, message: Any) -> bytes:
        """`method` of the plugin called as the runtime calls it; the answer's payload."""
        request = ttrpc_pb2.Request(
            service=stub.PLUGIN_SERVICE, method=method, payload=message.SerializeToString(), timeout_nano=2 * 10**9
        )
        frame = ttrpc.Frame(next(streams), ttrpc.MessageType.REQUEST, request.SerializeToString())
        runtime_writer.write(mux.encode(mux.PLUGIN_CONN, ttrpc.encode(frame)))
        while True:
            for _, data in demux.feed(await runtime_reader.read(stub.READ_SIZE)):
                for answer in frames.feed(data):
                    response = ttrpc_pb2.Response.FromString(answer.payload)
                    if response.status.code:
                        raise SystemExit(f"{method} failed: {response.status.message}")
                    return bytes(response.payload)

    configured = nri.ConfigureResponse.FromString(
        await call("Configure", nri.ConfigureRequest(runtime_name="containerd", runtime_version="1.7.24"))
    )
    await call("Synchronize", nri.SynchronizeRequest())
    pod = nri.PodSandbox(id="b" * 64, name="bench-0", uid="bench-uid", namespace="default", runtime_handler="runc")
    pod.labels.update({"app": "bench", "io.kubernetes.pod.name": pod.name, "io.kubernetes.pod.namespace": "default"})
    pod.annotations.update(annotations | {"kubernetes.io/config.source": "api", "kubernetes.io/config.seen": "now"})
    pod.linux.cgroup_parent = f"kubepods-pod{pod.uid}.slice"
    if configured.events & stub.event_mask(nri.RUN_POD_SANDBOX):  # as the runtime: only when subscribed
        await call("StateChange", nri.StateChangeEvent(event=nri.RUN_POD_SANDBOX, pod=pod))
    phases = Phases()
    phases.wrap(conn.service, "respond", "call")
    phases.wrap(handler, "create_container", "handler")
    phases.wrap(handler, "_left", "gpu check")
    phases.wrap(handler, "_pod_view", "pod view")
    phases.wrap(handler.lifecycle, "create_container", "hooks")
    phases.wrap(handler.lifecycle, "container_created", "record")
    for fn, phase in (
        ("nri_container_view", "container view"),
        ("nri_rules", "device rules"),
        ("unapplied", "unapplied"),
        ("nri_adjustment", "adjustment"),
    ):
        phases.wrap(nri_handler, fn, phase)
    profiler = cProfile.Profile() if profile else None
    warm = creates // 5  # the first ones warm the caches
    for i in range(creates + warm):
        c = spec_container(f"{i:064x}", pod)
        request = nri.CreateContainerRequest(pod=pod, container=c)
        await asyncio.sleep(gap)
        if profiler is not None and i >= warm:
            profiler.enable()
        began = time.perf_counter_ns()
        await call("CreateContainer", request)
        phases.now["round trip"] = time.perf_counter_ns() - began
        if profiler is not None:
            profiler.disable()
        phases.done()
        await call("StateChange", nri.StateChangeEvent(event=nri.REMOVE_CONTAINER, pod=pod, container=c))
    runtime_writer.close()
    with contextlib.suppress(stub.ConnectionLost):
        await serving
    await conn.close()
    await handler.close()
    print(f"crihook nri handler in this process, CreateContainer with 8 GPUs [n={creates}], gap {gap * 1000:g} ms:")
    calls = phases.calls[warm:]
    handler_ns = [c.get("handler", 0) for c in calls]
    for phase, what in (*PHASES, ("rest of the handler", "the handler less the phases above"), *AFTER):
        if phase == "rest of the handler":
            named = [p for p, _ in PHASES[3:]]
            ns = [h - sum(c.get(p, 0) for p in named) for h, c in zip(handler_ns, calls, strict=True)]
        else:
            ns = [c.get(phase, 0) for c in calls]
        print(
            f"  {phase}: p50 {statistics.median(ns) / 1e6:.3f} ms p99 {pb.pct(ns, 0.99) / 1e6:.3f} ms ({what})",
            flush=True,
        )
    if profiler is not None:
        profiler.dump_stats(profile)
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)


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
