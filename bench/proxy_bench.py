"""What crihook costs kubelet: the same client, in the same process, against the same containerd,
straight and through crihook, beside the anchors (a byte relay that parses nothing, the bare grpc-aio
forwarder crihook did not pick, and with `--socat` Debian's socat), targets interleaved call by call
so machine noise hits all of them alike.

    TMPDIR=/dev/shm python bench/proxy_bench.py [--runtime 1.6|1.7|2] [--node gpu|cpu] [--rounds 2000]
        [--creates 400] [--pods 20] [--seconds 2] [--gap 0] [--socat] [--targets byte-relay,socat]
        [--baseline PYTHON] [--profile crihook.pstats]

Needs root, containerd and runc (the test suite's private containerd is started and stopped here,
its root in TMPDIR like everything the bench writes); `--runtime 1.7` or `2` runs Debian trixie's or
sid's containerd as fetched by tests/runtimes.sh. containerd syncs its metadata database on every
change, so on a disk its CreateContainer varies by milliseconds; `TMPDIR=/dev/shm` narrows the
intervals about tenfold, and the proxies' work is the same either way.

The node crihook runs on (`--node`):
- gpu (default): a simulated 8-GPU node (the fake NVML library with the dgx-h100 topology, device
  nodes made with mknod); every pod is given all 8 GPUs, so the gpu hook does its whole job.
- cpu: a node without NVML (the library path names no file) where kubelet's device-plugins
  directory does not exist (kubelet not started yet, or a machine without kubelet); the pods ask
  for no GPU, and the gpu hook hides the node's GPUs from their containers.
The other targets are sent the request crihook forwards (worked out in this process by the same
hooks, outside the timing), so containerd does the same work for every target.

Prints p50/p99 latency added per method over direct (in brackets, the 95 % bootstrap interval:
a p50 of a hundred calls moves by a fraction of a millisecond from run to run), CreateContainer
into a running pod, pod start in kubelet's order (RunPodSandbox, the pod's CreateContainer at
once, StartContainer) and that CreateContainer alone, throughput at 1/16/64 concurrent callers
as a ratio of direct, the proxies' CPU per call and crihook's resident memory.

`--baseline PYTHON`: the interpreter of another crihook install (a checkout of the code before a
change, with its own venv) runs `crihook serve` with the same configuration as the target
"baseline", sent kubelet's own requests as crihook is: before and after, side by side in one run.
`--profile` runs crihook under cProfile and writes its stats there on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from crihook.base import allocation as al  # noqa: E402
from crihook.base import config as cfgmod  # noqa: E402
from crihook.hooks.registry import build_chain  # noqa: E402
from crihook.node.lifecycle import Lifecycle  # noqa: E402
from crihook.node.store import Store  # noqa: E402
from crihook.proto import runtime_v1_pb2 as api  # noqa: E402
from crihook.proxy.intercept import HANDLERS, Interceptor  # noqa: E402
from crihook.simnode import fakenvml  # noqa: E402
from crihook.simnode.node import SimNode, make_sim_node  # noqa: E402
from tests.support.containerd import RUNTIMES, running_containerd, runtime  # noqa: E402
from tests.support.cri import container_config, pod_config  # noqa: E402

RUNTIME = "/runtime.v1.RuntimeService/"
IMAGE = "/runtime.v1.ImageService/"
LIMITS = [("grpc.max_receive_message_length", 16 << 20), ("grpc.max_send_message_length", 16 << 20)]


def ident(b: bytes) -> bytes:
    return b


def wait_socket(path: str, proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{proc.args} did not start (exit {proc.poll()})")
        time.sleep(0.05)


TOPOLOGY = "dgx-h100"  # 8 GPUs on NVSwitch
OPTIONAL = ("aio-forwarder", "byte-relay", "socat")  # anchors beside direct and crihook
KUBELETS = ("crihook", "baseline")  # the targets sent kubelet's own CreateContainer


def crihook_config(work: Path, node: str, state: str) -> str:
    """What `crihook serve` is given: a state dir of its own in the bench's work dir and the node's
    [node] (and [hooks]) tables."""
    return f'[proxy]\nstate_dir = "{work}/{state}"\nmetrics_listen = ""\nlog_level = "warning"\n' + node


def cpu_node(work: Path) -> str:
    """The [node] table of a node without NVML and without kubelet's device-plugins directory;
    everything else as crihook's defaults have it."""
    root = work / "cpu-node"
    return (
        f'[node]\nnvml_library = "{root}/libnvidia-ml.so.1"\n'
        f'kubelet_checkpoint = "{root}/kubelet/device-plugins/kubelet_internal_checkpoint"\n'
    )


def all_gpus(node: SimNode) -> dict[str, str]:
    """The pod annotation of a pod the scheduler gave every GPU of the node."""
    gpus = node.doc["gpus"]
    allocs = tuple(al.DeviceAllocation(g["minor"], g["uuid"], {al.GPU_CORE: 100}) for g in gpus)
    return {al.DEVICE_ALLOCATED: al.format_device_allocated({"gpu": allocs})}


class Rewriter:
    """crihook's hooks in this process, over the same node: the CreateContainer request crihook would
    forward, which the other targets are sent so that containerd does the same work for all."""

    def __init__(self, config_text: str, state: Path) -> None:
        cfg = cfgmod.parse(__import__("tomllib").loads(config_text))
        self.interceptor = Interceptor(Lifecycle(build_chain(cfg.hooks, cfg.node), Store(state)))
        self.loop = asyncio.new_event_loop()

    def __call__(self, request: bytes) -> bytes:
        call = self.interceptor.classify(b"/runtime.v1.RuntimeService/CreateContainer")
        assert call is not None and call.handler is HANDLERS[b"/runtime.v1.RuntimeService/CreateContainer"]
        return self.loop.run_until_complete(self.interceptor.rewrite(call, request))

    def close(self) -> None:
        """The hooks' threads, inotify descriptor and the store's pending write, then the loop."""
        self.loop.run_until_complete(self.interceptor.chain.close())
        self.loop.run_until_complete(self.interceptor.store.close())
        self.loop.close()


def serve(
    config: Path, sock: str, backend: str, env: dict[str, str], profile: str | None = None, python: str | None = None
) -> subprocess.Popen[bytes]:
    """`crihook serve` with this config in front of `backend`, run by `python` (default: this
    interpreter), in the config's directory: a baseline's install must not see this checkout."""
    profiler = ["-m", "cProfile", "-o", profile] if profile else []
    return subprocess.Popen(
        [
            python or sys.executable,
            *profiler,
            "-m",
            "crihook.cli",
            "serve",
            "--config",
            str(config),
            "--listen",
            f"unix://{sock}",
            "--runtime-endpoint",
            f"unix://{backend}",
        ],
        env={**os.environ, **env},
        cwd=config.parent,
    )


@contextlib.contextmanager
def daemons(
    work: Path,
    backend: str,
    node: str,
    env: dict[str, str],
    profile: str | None,
    socat: bool = False,
    baseline: str | None = None,
) -> Iterator[dict[str, tuple[str, int | None]]]:
    """crihook, the aio forwarder and the byte relay in front of `backend`; with `socat` Debian's
    socat relaying the same socket (a hop through a process in C: what any proxy costs, in whatever
    language); with `baseline` (an interpreter) another crihook install on the same node, with a
    state dir of its own. Yields target -> (socket, pid)."""
    socks = {name: str(work / f"{name}.sock") for name in (*KUBELETS, *OPTIONAL)}
    configs = {name: work / f"{name}.toml" for name in KUBELETS}
    for name, path in configs.items():
        path.write_text(crihook_config(work, node, f"{name}-state"))
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        procs["crihook"] = serve(configs["crihook"], socks["crihook"], backend, env, profile)
        for name, script in (("aio-forwarder", "aio_forwarder.py"), ("byte-relay", "byte_relay.py")):
            procs[name] = subprocess.Popen(
                [sys.executable, str(ROOT / "bench" / script), socks[name], backend], stdout=subprocess.DEVNULL
            )
        if baseline is not None:
            procs["baseline"] = serve(configs["baseline"], socks["baseline"], backend, env, python=baseline)
        if socat:
            # one process per connection (fork); the bench keeps one connection per target
            procs["socat"] = subprocess.Popen(
                ["socat", f"UNIX-LISTEN:{socks['socat']},fork", f"UNIX-CONNECT:{backend}"]
            )
        for name, proc in procs.items():
            wait_socket(socks[name], proc)
        yield {"direct": (backend, None)} | {
            name: (socks[name], None if name == "socat" else proc.pid) for name, proc in procs.items()
        }
    finally:
        for name, p in procs.items():
            if name in KUBELETS:
                p.send_signal(signal.SIGINT)  # crihook stops as on SIGTERM, and cProfile writes its stats
            else:
                p.terminate()
        for p in procs.values():
            p.wait(30)


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


def interleaved(
    targets: dict[str, Callable[[], object]],
    rounds: int,
    between: Callable[[], None] | None = None,
    gap: float = 0.0,
) -> dict[str, list[float]]:
    """Seconds per call; a target that times itself (preparing its request untimed) returns them.
    Each round calls every target once, in an order drawn afresh (seeded): a target's work after it
    answers (crihook's records) runs while the next call is timed, and no target may always be the
    one that pays for it, as it would in a fixed order, rotated or not. `gap`: seconds of idle before
    each call, which that work fits in, so no call pays for another's. `between`: run after each
    round, untimed."""
    out: dict[str, list[float]] = {name: [] for name in targets}
    order = list(targets.items())
    draw = random.Random(0)
    for _ in range(rounds):
        draw.shuffle(order)
        for name, fn in order:
            if gap:
                time.sleep(gap)
            start = time.perf_counter()
            took = fn()
            out[name].append(took if isinstance(took, float) else time.perf_counter() - start)
        if between is not None:
            between()
    return out


def added_interval(target: list[float], direct: list[float], q: float, resamples: int = 2000) -> tuple[float, float]:
    """95 % bootstrap interval of the q-quantile of `target` minus that of `direct`, resampling whole
    rounds so each pair measured side by side stays together: how far the printed difference can be
    from the truth with this many calls."""
    import numpy as np  # here: only the report needs it, and numpy's BLAS threads would count in the run

    rng = np.random.default_rng(0)
    t, d = np.asarray(target), np.asarray(direct)
    picks = rng.integers(0, len(t), size=(resamples, len(t)))
    diffs = np.quantile(t[picks], q, axis=1) - np.quantile(d[picks], q, axis=1)
    lo, hi = np.quantile(diffs, [0.025, 0.975])
    return float(lo), float(hi)


def cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU time the process has used (user + system), all threads and the event loop's thread alone:
    unlike latency, hardly moved by the machine's load. From schedstat (nanoseconds): the clock
    ticks of /proc/PID/stat are too coarse for a hundred calls of a millisecond. crihook's threads
    (hook pool, store writer) live as long as it does, so none is lost between two readings."""
    total = loop = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            ns = int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue
        total += ns
        if task.name == str(pid):
            loop = ns
    return total / 1e9, loop / 1e9


def cpu_now(pids: dict[str, int]) -> dict[str, tuple[float, float]]:
    return {name: cpu_seconds(pid) for name, pid in pids.items()}


def report_latency(
    title: str,
    samples: dict[str, list[float]],
    before: dict[str, tuple[float, float]] | None = None,
    pids: dict[str, int] | None = None,
) -> None:
    """`before`: cpu_now(pids) when the timed calls began; each process's CPU is printed per call."""
    base50, base99 = pct(samples["direct"], 0.5), pct(samples["direct"], 0.99)
    cells = []
    for name, s in samples.items():
        p50, p99 = pct(s, 0.5), pct(s, 0.99)
        extra = ""
        if name != "direct":
            (lo, hi), (lo99, hi99) = (added_interval(s, samples["direct"], q) for q in (0.5, 0.99))
            extra = (
                f" ({(p50 - base50) * 1e3:+.3f} [{lo * 1e3:+.3f}, {hi * 1e3:+.3f}]"
                f" / {(p99 - base99) * 1e3:+.3f} [{lo99 * 1e3:+.3f}, {hi99 * 1e3:+.3f}])"
            )
        cells.append(f"{name} {p50 * 1e3:.3f}/{p99 * 1e3:.3f}{extra}")
    per_call = ""
    for name, (total0, loop0) in (before or {}).items():
        assert pids is not None
        n = len(samples[name]) / 1e3
        total, loop = cpu_seconds(pids[name])
        per_call += f" | {name} CPU {(total - total0) / n:.3f} ms/call (event loop {(loop - loop0) / n:.3f})"
    print(f"{title:<34} p50/p99 ms: " + " | ".join(cells) + per_call, flush=True)


def report_change(title: str, samples: dict[str, list[float]]) -> None:
    """With a baseline: crihook's p50 over the baseline's, measured side by side (before and after)."""
    if "baseline" not in samples:
        return
    lo, hi = added_interval(samples["crihook"], samples["baseline"], 0.5)
    over = pct(samples["crihook"], 0.5) - pct(samples["baseline"], 0.5)
    print(f"{title} p50, crihook over baseline: {over * 1e3:+.3f} ms [{lo * 1e3:+.3f}, {hi * 1e3:+.3f}]", flush=True)


async def throughput(sock: str, concurrency: int, seconds: float) -> float:
    async with grpc.aio.insecure_channel(f"unix://{sock}", options=LIMITS) as ch:
        call = ch.unary_unary(RUNTIME + "Version", request_serializer=ident, response_deserializer=ident)
        req = api.VersionRequest(version="v1").SerializeToString()
        for _ in range(50):
            await call(req)
        stop = time.perf_counter() + seconds
        done = 0

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < stop:
                await call(req)
                done += 1

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done / (time.perf_counter() - start)


def fs_type(path: str) -> str:
    """The file system `path` is on (the longest mount point that holds it), from /proc/mounts."""
    best, kind = "", "?"
    for line in Path("/proc/mounts").read_text().splitlines():
        _, point, fstype, *_ = line.split()
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
            best, kind = point, fstype
    return f"{kind} ({best})"


def rss_mib(pid: int) -> tuple[float, float]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2000, help="calls per target of Version and ImageStatus")
    ap.add_argument("--seconds", type=float, default=2.0, help="per throughput slice")
    ap.add_argument("--creates", type=int, default=400, help="CreateContainers per target (default %(default)s)")
    ap.add_argument("--pods", type=int, default=20, help="pod starts per target")
    ap.add_argument(
        "--gap",
        type=float,
        default=0.0,
        help="idle seconds before each CreateContainer and pod start, for the previous call's afterwork"
        " (default %(default)s: the calls back to back, their afterwork spread over the targets)",
    )
    ap.add_argument(
        "--targets",
        help=f"which of {', '.join(OPTIONAL)} to measure beside direct and crihook, comma-separated"
        " (default: every one started)",
    )
    ap.add_argument("--runtime", choices=RUNTIMES, default="1.6", help="containerd release (default %(default)s)")
    ap.add_argument(
        "--node", choices=("gpu", "cpu"), default="gpu", help="the node crihook runs on (default %(default)s)"
    )
    ap.add_argument("--baseline", metavar="PYTHON", help="another crihook install's interpreter, run as 'baseline'")
    ap.add_argument("--profile", help="run crihook under cProfile, stats to this file")
    ap.add_argument(
        "--socat", action="store_true", help="also measure Debian's socat relaying the socket (apt-get install socat)"
    )
    args = ap.parse_args()
    measure = set(args.targets.split(",")) if args.targets else set(OPTIONAL)
    if unknown := measure - set(OPTIONAL):
        raise SystemExit(f"--targets: no target {', '.join(sorted(unknown))} (one of {', '.join(OPTIONAL)})")
    if args.targets and not args.socat and "socat" in measure:
        raise SystemExit("--targets: socat runs with --socat")
    if args.socat and shutil.which("socat") is None:
        raise SystemExit("--socat: socat is not installed (apt-get install socat)")
    baseline = shutil.which(args.baseline) if args.baseline is not None else None
    if args.baseline is not None and baseline is None:
        raise SystemExit(f"--baseline: no interpreter {args.baseline}")
    rt = runtime(args.runtime)
    if (why := rt.unavailable()) is not None:
        raise SystemExit(why)
    tmp = Path(tempfile.mkdtemp(prefix="proxy-bench-"))
    print(f"containerd {rt.name}: {rt.package_version()} (Debian {rt.suite}), in {fs_type(str(tmp))}", flush=True)
    atexit.register(shutil.rmtree, tmp, True)
    if args.node == "gpu":
        sim = make_sim_node(tmp / "node", TOPOLOGY, char_devices=True)
        node, pod_annotations = sim.proxy_config(fakenvml.build()), all_gpus(sim)
        env = {fakenvml.CONFIG_ENV: str(sim.config)}
    else:
        node, pod_annotations, env = cpu_node(tmp), {}, {}
    os.environ.update(env)  # the rewriter's hooks read the same node
    rewrite = Rewriter(crihook_config(tmp, node, "rewriter-state"), tmp / "rewriter")
    atexit.register(rewrite.close)
    profile = str(Path(args.profile).resolve()) if args.profile else None
    with (
        running_containerd(runtime=rt) as ctrd,
        daemons(
            tmp, str(ctrd.socket), node, env, profile, args.socat, baseline and os.path.abspath(baseline)
        ) as started_all,
    ):
        t = {name: v for name, v in started_all.items() if name in ("direct", *KUBELETS) or name in measure}
        chans = {name: grpc.insecure_channel(f"unix://{sock}", options=LIMITS) for name, (sock, _) in t.items()}
        crihook_pid = t["crihook"][1]
        assert crihook_pid is not None
        measured = {name: pid for name, (_, pid) in t.items() if name in (*KUBELETS, "byte-relay") and pid}

        def method(name: str, path: str) -> Callable[[bytes], bytes]:
            call = chans[name].unary_unary(path, request_serializer=ident, response_deserializer=ident)
            return lambda body: bytes(call(body, timeout=60))

        def caller(service: str, name: str, request: object) -> dict[str, Callable[[], object]]:
            body = request.SerializeToString()  # type: ignore[attr-defined]
            return {target: partial(method(target, service + name), body) for target in chans}

        print(
            f"crihook proxy benchmark, {args.node} node: targets interleaved call by call;"
            f" load average {os.getloadavg()[0]:.1f} at start",
            flush=True,
        )
        for title, fns in (
            ("Version", caller(RUNTIME, "Version", api.VersionRequest(version="v1"))),
            ("ImageStatus", caller(IMAGE, "ImageStatus", api.ImageStatusRequest(image=api.ImageSpec(image="x")))),
        ):
            interleaved(fns, 100)
            cpu = cpu_now(measured)
            samples = interleaved(fns, args.rounds)
            report_latency(title, samples, cpu, measured)

        # ListContainers over 200 containers (created, not started: the list is what matters)
        run_pod = {name: method(name, RUNTIME + "RunPodSandbox") for name in chans}
        create = {name: method(name, RUNTIME + "CreateContainer") for name in chans}
        start = {name: method(name, RUNTIME + "StartContainer") for name in chans}
        remove = method("direct", RUNTIME + "RemoveContainer")
        stop_pod = method("direct", RUNTIME + "StopPodSandbox")
        remove_pod = method("direct", RUNTIME + "RemovePodSandbox")

        def new_pod(through: str, name: str) -> tuple[str, api.PodSandboxConfig]:
            cfg = pod_config(name, annotations=pod_annotations)
            raw = run_pod[through](api.RunPodSandboxRequest(config=cfg).SerializeToString())
            return api.RunPodSandboxResponse.FromString(raw).pod_sandbox_id, cfg

        list_pod, list_cfg = new_pod("direct", "bench-list")
        for i in range(200):
            req = api.CreateContainerRequest(
                pod_sandbox_id=list_pod, config=container_config(f"c{i}", list_cfg), sandbox_config=list_cfg
            )
            create["direct"](req.SerializeToString())
        fns = caller(RUNTIME, "ListContainers", api.ListContainersRequest())
        interleaved(fns, 50)
        report_latency("ListContainers (200 containers)", interleaved(fns, max(200, args.rounds // 4)))

        # CreateContainer into a running pod: each target creates a container, removed untimed after
        # the round. The pod is started through crihook (and the baseline, for its own containers), as
        # kubelet starts every pod: it knows the pod, as on a node.
        pods = {name: new_pod(name, f"bench-{name}") for name in KUBELETS if name in chans}
        created: list[bytes] = []
        counter = iter(range(10**9))

        def create_request(name: str, pod_id: str, cfg: api.PodSandboxConfig, container: str) -> bytes:
            """kubelet's request for crihook and the baseline; for the others, what crihook forwards."""
            req = api.CreateContainerRequest(
                pod_sandbox_id=pod_id, config=container_config(container, cfg), sandbox_config=cfg
            ).SerializeToString()
            return req if name in KUBELETS else rewrite(req)

        def create_one(name: str) -> Callable[[], object]:
            pod_id, cfg = pods.get(name, pods["crihook"])

            def fn() -> float:
                body = create_request(name, pod_id, cfg, f"{name}-{next(counter)}")
                began = time.perf_counter()
                created.append(create[name](body))
                return time.perf_counter() - began

            return fn

        def remove_created() -> None:
            """Each round's containers go before the next round (straight to containerd): a sandbox
            holding thousands of containers makes every create slower, 2.x's most."""
            for raw in created:
                cid = api.CreateContainerResponse.FromString(raw).container_id
                remove(api.RemoveContainerRequest(container_id=cid).SerializeToString())
            created.clear()

        cpu = cpu_now(measured)
        samples = interleaved({name: create_one(name) for name in chans}, args.creates, remove_created, args.gap)
        report_latency("CreateContainer", samples, cpu, measured)
        report_change("CreateContainer", samples)

        # pod start in kubelet's order: RunPodSandbox, the pod's CreateContainer as soon as it is
        # answered (its image is on the node), StartContainer; torn down untimed
        started: list[str] = []
        creates_in_start: dict[str, list[float]] = {name: [] for name in chans}

        def pod_start(name: str) -> Callable[[], object]:
            def fn() -> float:
                cfg = pod_config(f"bench-{name}-{next(counter)}", annotations=pod_annotations)
                run_body = api.RunPodSandboxRequest(config=cfg).SerializeToString()
                began = time.perf_counter()
                pod_id = api.RunPodSandboxResponse.FromString(run_pod[name](run_body)).pod_sandbox_id
                ran = time.perf_counter()
                body = create_request(name, pod_id, cfg, "app")  # untimed for all: see create_request
                resumed = time.perf_counter()
                cid = api.CreateContainerResponse.FromString(create[name](body)).container_id
                made = time.perf_counter()
                start[name](api.StartContainerRequest(container_id=cid).SerializeToString())
                started.append(pod_id)
                creates_in_start[name].append(made - resumed)
                return (ran - began) + (time.perf_counter() - resumed)

            return fn

        cpu = cpu_now(measured)
        samples = interleaved({name: pod_start(name) for name in chans}, args.pods, gap=args.gap)
        report_latency("pod start (run+create+start)", samples, cpu, measured)
        report_latency("CreateContainer in pod start", creates_in_start)
        report_change("pod start", samples)
        report_change("CreateContainer in pod start", creates_in_start)
        for pod_id in [*started, list_pod, *(p for p, _ in pods.values())]:
            stop_pod(api.StopPodSandboxRequest(pod_sandbox_id=pod_id).SerializeToString())
            remove_pod(api.RemovePodSandboxRequest(pod_sandbox_id=pod_id).SerializeToString())
        d50 = statistics.median(samples["direct"])
        for name in (n for n in KUBELETS if n in samples):
            c50 = statistics.median(samples[name])
            lo, hi = added_interval(samples[name], samples["direct"], 0.5)
            print(
                f"pod start through {name}: {(c50 / d50 - 1) * 100:+.1f} % vs direct (median;"
                f" 95 % interval {lo / d50 * 100:+.1f} to {hi / d50 * 100:+.1f} %)",
                flush=True,
            )

        for concurrency in (1, 16, 64):
            totals = {name: 0.0 for name in t}
            for _ in range(3):
                for name, (sock, _pid) in t.items():
                    totals[name] += asyncio.run(throughput(sock, concurrency, args.seconds))
            base = totals["direct"]
            print(
                f"throughput Version x{concurrency:<3} calls/s: "
                + " | ".join(f"{n} {v / 3:,.0f} ({v / base:.2f}x)" for n, v in totals.items()),
                flush=True,
            )
        rss, peak = rss_mib(crihook_pid)
        print(f"crihook RSS {rss:.1f} MiB (peak {peak:.1f} MiB)", flush=True)
        for ch in chans.values():
            ch.close()


if __name__ == "__main__":
    main()
