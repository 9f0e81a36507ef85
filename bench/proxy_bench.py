"""What crihook costs kubelet: the same client, in the same process, against the same containerd,
straight and through crihook (and through a bare grpc-aio forwarder, the design we did not pick, and a
byte relay that parses nothing, the floor of any Python proxy), with targets interleaved call by call so
machine noise hits all of them alike.

    python bench/proxy_bench.py [--runtime 1.6|1.7|2] [--rounds 2000] [--creates 400] [--seconds 2]
                                [--pods 20] [--gap 0] [--profile crihook.pstats] [--socat] [--floor]
                                [--targets floor,least]

Needs root, containerd and runc (the test suite's private containerd is started and stopped here,
its root in TMPDIR like everything the bench writes);
`--runtime 1.7` or `2` runs Debian trixie's or sid's containerd as fetched by tests/runtimes.sh.
crihook runs on a simulated 8-GPU node (the fake NVML library with the dgx-h100 topology, device
nodes made with mknod): every CreateContainer, alone or in a pod start, is for a pod the scheduler
gave all 8 GPUs, so the gpu hook does its whole job. The other targets are sent the request crihook
forwards (worked out in this process by the same hooks, outside the timing), so containerd does the
same work for every target and the difference is the proxy's.
Prints p50/p99 latency added per method (after each, in brackets, its 95 % bootstrap interval: a
p50 of a hundred calls moves by a fraction of a millisecond from run to run, a p99 by far more), pod
start latency, throughput at 1/16/64 concurrent callers as a ratio of direct, crihook's and the byte
relay's CPU per call, and crihook's resident
memory. `--profile` runs crihook under cProfile and writes its stats there on exit.

containerd keeps its metadata in a database it syncs to disk on every change, so on a disk its
CreateContainer varies by milliseconds and a p50 of 1,000 calls by ±0.3 ms; with TMPDIR on a tmpfs
(`TMPDIR=/dev/shm`) the same run resolves ±0.03 ms. The proxies' work is the same either way: the
tmpfs run is the one to compare them by, the disk run the one closer to a node's.

`--floor` adds a second crihook whose CreateContainer, past a pod's first, does only what any
interception in Python must: decode the request, merge in the answer its pod's first call got,
encode (the least `pre` of bench/intercept_instructions.py, in the daemon). No hook runs and nothing
is checked, so it is not something crihook could ship: it is the least an intercepted call can cost
kubelet through this relay, end to end, beside crihook's real cost in the same run. With it runs
bench/least_intercept.py ("least"): the same answer merged by the least interception written from
nothing, none of crihook's relay around it.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import inspect
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
from dataclasses import dataclass
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from crihook.base import allocation as al  # noqa: E402
from crihook.base import config as cfgmod  # noqa: E402
from crihook.hooks.chain import build_chain  # noqa: E402
from crihook.node.store import Store  # noqa: E402
from crihook.proto import runtime_v1_pb2 as api  # noqa: E402
from crihook.proxy.intercept import HANDLERS, Interceptor  # noqa: E402
from crihook.simnode import fakenvml  # noqa: E402
from crihook.simnode.node import SimNode, make_sim_node  # noqa: E402
from tests.support.containerd import RUNTIMES, Runtime, running_containerd, runtime  # noqa: E402
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
OPTIONAL = ("aio-forwarder", "byte-relay", "socat", "floor", "least")  # targets beside direct and crihook
LEAST = "least-answer.pb"  # in the work dir: what bench/least_intercept.py merges into each CreateContainer


def added_config(before: api.ContainerConfig, after: api.ContainerConfig) -> bytes:
    """What a rewrite added to a container's config (appended to its repeated fields, keys new to its
    annotations), as a ContainerConfig to merge into the next one: the floor's and the least
    interception's answer."""
    grant = api.ContainerConfig()
    for name in ("envs", "mounts", "devices", "CDI_devices"):
        getattr(grant, name).extend(getattr(after, name)[len(getattr(before, name)) :])
    for k, v in after.annotations.items():
        if k not in before.annotations:
            grant.annotations[k] = v
    return grant.SerializeToString()


# Loaded into the floor target at start-up (a `sitecustomize` module): a pod's first CreateContainer
# runs crihook's own pre, and what that added to the config is that pod's answer; the pod's later
# CreateContainers only merge it in.
FLOOR_PROBE = (
    """
from crihook.proto import runtime_v1_pb2 as api
from crihook.proxy import intercept

_pre = intercept.Interceptor.pre
_answers = {}
"""
    + inspect.getsource(added_config)
    + """
def pre(self, call, request, deadline=None):
    if call.handler.name != "CreateContainer":
        return _pre(self, call, request, deadline)
    msg = api.CreateContainerRequest.FromString(request)
    answer = _answers.get(msg.pod_sandbox_id)
    if answer is None:
        out = _pre(self, call, request, deadline)
        if isinstance(out, bytes):
            _answers[msg.pod_sandbox_id] = added_config(msg.config, api.CreateContainerRequest.FromString(out).config)
        return out
    msg.config.MergeFromString(answer)
    return msg.SerializeToString()

intercept.Interceptor.pre = pre
"""
)


def crihook_config(work: Path, node: SimNode, state: str = "state") -> str:
    """What `crihook serve` is given: a state dir in the bench's work dir and the simulated node's
    [node] and [hooks]."""
    proxy = f'[proxy]\nstate_dir = "{work}/{state}"\nmetrics_listen = ""\nlog_level = "warning"\n'
    return proxy + node.proxy_config(fakenvml.build())


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
        self.interceptor = Interceptor(build_chain(cfg.hooks, cfg.node), Store(state))
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
    config: Path, sock: str, backend: str, env: dict[str, str], profile: str | None = None
) -> subprocess.Popen[bytes]:
    """`crihook serve` with this config in front of `backend`."""
    profiler = ["-m", "cProfile", "-o", profile] if profile else []
    return subprocess.Popen(
        [
            sys.executable,
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
    )


@contextlib.contextmanager
def daemons(
    work: Path,
    backend: str,
    config_text: str,
    env: dict[str, str],
    profile: str | None,
    socat: bool = False,
    floor_config: str | None = None,
) -> Iterator[dict[str, tuple[str, int | None]]]:
    """crihook, the aio forwarder and the byte relay in front of `backend`, and with `socat` Debian's
    socat relaying the same socket (a hop through a process in C: what any proxy costs, in whatever
    language); with `floor_config` (a state dir of its own), crihook with FLOOR_PROBE loaded and
    bench/least_intercept.py, whose answer the caller writes to work/LEAST. Yields target -> (socket,
    pid)."""
    cfg = work / "crihook.toml"
    cfg.write_text(config_text)
    names = ("crihook", "aio-forwarder", "byte-relay", "socat", "floor", "least")
    socks = {name: str(work / f"{name}.sock") for name in names}
    procs = {
        "crihook": serve(cfg, socks["crihook"], backend, env, profile),
        "aio-forwarder": subprocess.Popen(
            [sys.executable, str(ROOT / "bench" / "aio_forwarder.py"), socks["aio-forwarder"], backend],
            stdout=subprocess.DEVNULL,
        ),
        "byte-relay": subprocess.Popen(
            [sys.executable, str(ROOT / "bench" / "byte_relay.py"), socks["byte-relay"], backend],
            stdout=subprocess.DEVNULL,
        ),
    }
    if socat:
        # one process per connection (fork); the bench keeps one connection per target
        procs["socat"] = subprocess.Popen(["socat", f"UNIX-LISTEN:{socks['socat']},fork", f"UNIX-CONNECT:{backend}"])
    if floor_config is not None:
        (work / "floor.toml").write_text(floor_config)
        (work / "floor-probe").mkdir(exist_ok=True)
        (work / "floor-probe" / "sitecustomize.py").write_text(FLOOR_PROBE)
        probe = {"PYTHONPATH": os.pathsep.join(filter(None, (str(work / "floor-probe"), env.get("PYTHONPATH"))))}
        procs["floor"] = serve(work / "floor.toml", socks["floor"], backend, {**env, **probe})
        procs["least"] = subprocess.Popen(
            [sys.executable, str(ROOT / "bench" / "least_intercept.py"), socks["least"], backend, str(work / LEAST)],
            stdout=subprocess.DEVNULL,
        )
    try:
        for name, proc in procs.items():
            wait_socket(socks[name], proc)
        yield {"direct": (backend, None)} | {
            name: (socks[name], None if name == "socat" else proc.pid) for name, proc in procs.items()
        }
    finally:
        for name, p in procs.items():
            if name in ("crihook", "floor"):
                p.send_signal(signal.SIGINT)  # crihook stops as on SIGTERM, and cProfile writes its stats
            else:
                p.terminate()
        for p in procs.values():
            p.wait(30)


@dataclass
class Alone:
    """crihook alone in front of the suite's containerd, on the simulated 8-GPU node: what
    call_spacing and loop_phases measure."""

    runtime: Runtime
    sock: str
    backend: str
    pid: int
    node: SimNode
    work: Path  # removed afterwards

    def gpu_pod(self, name: str) -> Callable[[str], bytes]:
        """Start a pod the scheduler gave all 8 GPUs, through crihook; returns create(container),
        which makes a container in it through crihook and answers containerd's response."""
        ch = grpc.insecure_channel(f"unix://{self.sock}", options=LIMITS)
        run = ch.unary_unary(RUNTIME + "RunPodSandbox", request_serializer=ident, response_deserializer=ident)
        create = ch.unary_unary(RUNTIME + "CreateContainer", request_serializer=ident, response_deserializer=ident)
        cfg = pod_config(name, annotations=all_gpus(self.node))
        raw = run(api.RunPodSandboxRequest(config=cfg).SerializeToString(), timeout=60)
        pod_id = api.RunPodSandboxResponse.FromString(raw).pod_sandbox_id

        def create_one(container: str) -> bytes:
            req = api.CreateContainerRequest(
                pod_sandbox_id=pod_id, config=container_config(container, cfg), sandbox_config=cfg
            )
            return bytes(create(req.SerializeToString(), timeout=60))

        return create_one


@contextlib.contextmanager
def crihook_alone(
    runtime_name: str, prefix: str, extra_env: Callable[[Path], dict[str, str]] | None = None
) -> Iterator[Alone]:
    """`extra_env(work dir)`: more environment for crihook's process. Exits with the reason when the
    containerd release is not here."""
    rt = runtime(runtime_name)
    if (why := rt.unavailable()) is not None:
        raise SystemExit(why)
    work = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        node = make_sim_node(work / "node", TOPOLOGY, char_devices=True)
        env = {fakenvml.CONFIG_ENV: str(node.config), **(extra_env(work) if extra_env else {})}
        with (
            running_containerd(runtime=rt) as ctrd,
            daemons(work, str(ctrd.socket), crihook_config(work, node), env, None) as targets,
        ):
            sock, pid = targets["crihook"]
            assert pid is not None
            yield Alone(rt, sock, str(ctrd.socket), pid, node, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


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
    import numpy as np  # here: intercept_instructions imports this module, and numpy's BLAS threads would count

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
                f" (+{(p50 - base50) * 1e3:.3f} [{lo * 1e3:+.3f}, {hi * 1e3:+.3f}]"
                f" / +{(p99 - base99) * 1e3:.3f} [{lo99 * 1e3:+.3f}, {hi99 * 1e3:+.3f}])"
            )
        cells.append(f"{name} {p50 * 1e3:.3f}/{p99 * 1e3:.3f}{extra}")
    per_call = ""
    for name, (total0, loop0) in (before or {}).items():
        assert pids is not None
        n = len(samples[name]) / 1e3
        total, loop = cpu_seconds(pids[name])
        per_call += f" | {name} CPU {(total - total0) / n:.3f} ms/call (event loop {(loop - loop0) / n:.3f})"
    print(f"{title:<34} p50/p99 ms: " + " | ".join(cells) + per_call, flush=True)


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
    ap.add_argument("--rounds", type=int, default=2000)
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
    ap.add_argument("--profile", help="run crihook under cProfile, stats to this file")
    ap.add_argument(
        "--socat", action="store_true", help="also measure Debian's socat relaying the socket (apt-get install socat)"
    )
    ap.add_argument(
        "--floor", action="store_true", help="also measure crihook with its CreateContainer answered as at the least"
    )
    args = ap.parse_args()
    measure = set(args.targets.split(",")) if args.targets else set(OPTIONAL)
    if unknown := measure - set(OPTIONAL):
        raise SystemExit(f"--targets: no target {', '.join(sorted(unknown))} (one of {', '.join(OPTIONAL)})")
    if args.targets and not args.floor and measure & {"floor", "least"}:
        raise SystemExit("--targets: floor and least run with --floor")
    if args.targets and not args.socat and "socat" in measure:
        raise SystemExit("--targets: socat runs with --socat")
    if args.socat and shutil.which("socat") is None:
        raise SystemExit("--socat: socat is not installed (apt-get install socat)")
    rt = runtime(args.runtime)
    if (why := rt.unavailable()) is not None:
        raise SystemExit(why)
    tmp = tempfile.mkdtemp(prefix="proxy-bench-")
    print(f"containerd {rt.name}: {rt.package_version()} (Debian {rt.suite}), in {fs_type(tmp)}", flush=True)
    atexit.register(shutil.rmtree, tmp, True)
    node = make_sim_node(Path(tmp) / "node", TOPOLOGY, char_devices=True)
    config_text = crihook_config(Path(tmp), node)
    env = {fakenvml.CONFIG_ENV: str(node.config)}
    os.environ.update(env)  # the rewriter's hooks read the same fake NVML
    rewrite = Rewriter(config_text, Path(tmp) / "rewriter")
    atexit.register(rewrite.close)
    gpu_pod = all_gpus(node)
    profile = str(Path(args.profile).resolve()) if args.profile else None
    floor_config = crihook_config(Path(tmp), node, "floor-state") if args.floor else None
    kubelets = ("crihook", "floor", "least")  # the targets sent kubelet's own CreateContainer
    with (
        running_containerd(runtime=rt) as ctrd,
        daemons(Path(tmp), str(ctrd.socket), config_text, env, profile, args.socat, floor_config) as started_all,
    ):
        t = {name: v for name, v in started_all.items() if name in ("direct", "crihook") or name in measure}
        chans = {name: grpc.insecure_channel(f"unix://{sock}", options=LIMITS) for name, (sock, _) in t.items()}
        crihook_pid = t["crihook"][1]
        assert crihook_pid is not None
        profiled = ("crihook", "floor", "least", "byte-relay")
        measured = {name: pid for name, (_, pid) in t.items() if name in profiled and pid}

        def caller(service: str, method: str, request: object) -> dict[str, Callable[[], object]]:
            body = request.SerializeToString()  # type: ignore[attr-defined]

            def bound(ch: grpc.Channel) -> Callable[[], object]:
                call = ch.unary_unary(service + method, request_serializer=ident, response_deserializer=ident)
                return lambda: call(body, timeout=30)

            return {name: bound(ch) for name, ch in chans.items()}

        print(
            f"crihook proxy benchmark: {args.rounds} rounds, targets interleaved call by call;"
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
        direct = chans["direct"]
        run_pod = direct.unary_unary(RUNTIME + "RunPodSandbox", request_serializer=ident, response_deserializer=ident)
        pod_cfg = pod_config("bench-list")
        pod_id = api.RunPodSandboxResponse.FromString(
            run_pod(api.RunPodSandboxRequest(config=pod_cfg).SerializeToString(), timeout=60)
        ).pod_sandbox_id
        create = {
            name: ch.unary_unary(RUNTIME + "CreateContainer", request_serializer=ident, response_deserializer=ident)
            for name, ch in chans.items()
        }
        remove = direct.unary_unary(RUNTIME + "RemoveContainer", request_serializer=ident, response_deserializer=ident)
        for i in range(200):
            req = api.CreateContainerRequest(
                pod_sandbox_id=pod_id, config=container_config(f"c{i}", pod_cfg), sandbox_config=pod_cfg
            )
            create["direct"](req.SerializeToString(), timeout=60)
        fns = caller(RUNTIME, "ListContainers", api.ListContainersRequest())
        interleaved(fns, 50)
        report_latency("ListContainers (200 containers)", interleaved(fns, max(200, args.rounds // 4)))

        # CreateContainer in a pod given all 8 GPUs: each target creates a container, removed untimed after the
        # round. The pod is started through crihook, as kubelet starts every pod: crihook knows it, as on a node
        # (the floor's, for its containers, through the floor: it knows its pod as crihook does).
        def run_gpu_pod(through: str) -> tuple[str, api.PodSandboxConfig]:
            cfg = pod_config("bench-gpu" if through == "crihook" else f"bench-gpu-{through}", annotations=gpu_pod)
            run = chans[through].unary_unary(
                RUNTIME + "RunPodSandbox", request_serializer=ident, response_deserializer=ident
            )
            raw = run(api.RunPodSandboxRequest(config=cfg).SerializeToString(), timeout=60)
            return api.RunPodSandboxResponse.FromString(raw).pod_sandbox_id, cfg

        gpu_pods = {name: run_gpu_pod(name) for name in kubelets if name in chans}
        if "least" in chans:  # its answer: what crihook adds to a container of a pod given every GPU
            least_pod, least_cfg = gpu_pods["least"]
            sent = api.CreateContainerRequest(
                pod_sandbox_id=least_pod, config=container_config("least", least_cfg), sandbox_config=least_cfg
            )
            rewritten = api.CreateContainerRequest.FromString(rewrite(sent.SerializeToString()))
            (Path(tmp) / LEAST).write_bytes(added_config(sent.config, rewritten.config))
        created: list[bytes] = []
        counter = iter(range(10**9))

        def create_request(name: str, pod_id: str, cfg: api.PodSandboxConfig, container: str) -> bytes:
            """kubelet's request for crihook; for the others, what crihook forwards."""
            req = api.CreateContainerRequest(
                pod_sandbox_id=pod_id, config=container_config(container, cfg), sandbox_config=cfg
            ).SerializeToString()
            return req if name in kubelets else rewrite(req)

        def create_one(name: str) -> Callable[[], object]:
            pod_id, cfg = gpu_pods.get(name, gpu_pods["crihook"])

            def fn() -> None:
                body = create_request(name, pod_id, cfg, f"{name}-{next(counter)}")
                start = time.perf_counter()
                created.append(create[name](body, timeout=60))
                return time.perf_counter() - start

            return fn

        def remove_created() -> None:
            """Each round's containers go before the next round (straight to containerd): a sandbox
            holding thousands of containers makes every create slower, 2.x's most."""
            for raw in created:
                cid = api.CreateContainerResponse.FromString(raw).container_id
                remove(api.RemoveContainerRequest(container_id=cid).SerializeToString(), timeout=60)
            created.clear()

        cpu = cpu_now(measured)
        samples = interleaved({name: create_one(name) for name in chans}, args.creates, remove_created, args.gap)
        report_latency("CreateContainer", samples, cpu, measured)
        if "floor" in samples:  # what the hooks' work adds, the relay's own cost set aside
            lo, hi = added_interval(samples["crihook"], samples["floor"], 0.5)
            over = pct(samples["crihook"], 0.5) - pct(samples["floor"], 0.5)
            print(
                f"CreateContainer p50, crihook over the floor: {over * 1e3:+.3f} ms [{lo * 1e3:+.3f}, {hi * 1e3:+.3f}]"
            )

        # pod start: RunPodSandbox -> CreateContainer -> StartContainer, torn down untimed
        def pod_start(name: str) -> Callable[[], object]:
            ch = chans[name]
            run = ch.unary_unary(RUNTIME + "RunPodSandbox", request_serializer=ident, response_deserializer=ident)
            start = ch.unary_unary(RUNTIME + "StartContainer", request_serializer=ident, response_deserializer=ident)

            def fn() -> float:
                cfg = pod_config(f"bench-{name}-{next(counter)}", annotations=gpu_pod)
                run_body = api.RunPodSandboxRequest(config=cfg).SerializeToString()
                began = time.perf_counter()
                pid = api.RunPodSandboxResponse.FromString(run(run_body, timeout=60)).pod_sandbox_id
                ran = time.perf_counter()
                body = create_request(name, pid, cfg, "app")  # untimed for all: see create_request
                resumed = time.perf_counter()
                cid = api.CreateContainerResponse.FromString(create[name](body, timeout=60)).container_id
                start(api.StartContainerRequest(container_id=cid).SerializeToString(), timeout=60)
                started.append(pid)
                return (ran - began) + (time.perf_counter() - resumed)

            return fn

        started: list[str] = []
        cpu = cpu_now(measured)
        samples = interleaved({name: pod_start(name) for name in chans}, args.pods, gap=args.gap)
        report_latency("pod start (run+create+start)", samples, cpu, measured)
        for name in ("direct",):
            ch = chans[name]
            stop = ch.unary_unary(RUNTIME + "StopPodSandbox", request_serializer=ident, response_deserializer=ident)
            rm = ch.unary_unary(RUNTIME + "RemovePodSandbox", request_serializer=ident, response_deserializer=ident)
            for pid in [*started, pod_id, *(p for p, _ in gpu_pods.values())]:
                stop(api.StopPodSandboxRequest(pod_sandbox_id=pid).SerializeToString(), timeout=60)
                rm(api.RemovePodSandboxRequest(pod_sandbox_id=pid).SerializeToString(), timeout=60)
        d50 = statistics.median(samples["direct"])
        c50 = statistics.median(samples["crihook"])
        lo, hi = added_interval(samples["crihook"], samples["direct"], 0.5)
        print(
            f"pod start through crihook: {(c50 / d50 - 1) * 100:+.1f} % vs direct (median;"
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
