"""`crihook demo`: the whole path on a machine with no GPU and no kubelet, in seconds.

A simulated 8-GPU node (crihook.simnode: the fake NVML library, built here with gcc, so the real
`pynvml` and the real discovery code run), its Device object as the reporter builds it, the
allocator placing pods of every request form, and `crihook serve` with the gpu hook in front of a
runtime: a private containerd (crihook.simnode.containerd) when this machine can run one (root,
containerd, runc, busybox-static and gcc), else the embedded in-process CRI runtime. kubelet's part
is played by a CRI client that sends the calls kubelet would send. It prints what each container got
and removes everything it made. `crihook demo --runtime embedded` needs only gcc.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from crihook.simnode.fakenvml import TOPOLOGIES

NODE = "demo-node"
GiB = 1 << 30
DEMO_USAGE = "\n[usage]\ninterval_seconds = 0.25\n"  # the demo waits for a collection: make it soon
T = TypeVar("T")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--topology", choices=TOPOLOGIES, default="dgx1-v100", help="simulated node (default %(default)s)")
    p.add_argument(
        "--runtime",
        choices=("auto", "containerd", "embedded"),
        default="auto",
        help="auto: a private containerd when this machine can run one, else the embedded runtime",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object per pod instead of the table")
    p.add_argument("--keep", action="store_true", help="keep the work directory (node tree, logs) and say where")


# -- the pods: every request form of the seed proposals -------------------------------------------


def _pod(
    name: str,
    containers: dict[str, dict[str, Any]],
    annotations: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "demo",
            "uid": f"demo-{name}",
            "annotations": annotations or {},
            "labels": labels or {},
        },
        "spec": {
            "containers": [
                {"name": c, "image": "cuda", "resources": {"requests": dict(r), "limits": dict(r)}}
                for c, r in containers.items()
            ]
        },
    }


def demo_pods(model_hint: str) -> list[tuple[str, dict[str, Any]]]:
    """(what it shows, pod JSON as a user writes it) for every request form."""
    one = {"nvidia.com/gpu": "1"}
    return [
        ("4 whole GPUs: the best NVLink-connected group", _pod("train-4", {"main": {"nvidia.com/gpu": "4"}})),
        ("one whole GPU per container", _pod("split", {"a": one, "b": one})),
        (
            "half a GPU (core + memory ratio)",
            _pod("share-half", {"main": {"koordinator.sh/gpu-core": "50", "koordinator.sh/gpu-memory-ratio": "50"}}),
        ),
        ("koordinator.sh/gpu: 30 (the webhook converts it)", _pod("koord-gpu", {"main": {"koordinator.sh/gpu": "30"}})),
        (
            "25% core and 4Gi, HAMi-core isolation",
            _pod(
                "share-hami",
                {
                    "main": {
                        "koordinator.sh/gpu.shared": "1",
                        "koordinator.sh/gpu-core": "25",
                        "koordinator.sh/gpu-memory": "4Gi",
                    }
                },
                labels={"koordinator.sh/gpu-isolation-provider": "HAMi-core"},
            ),
        ),
        (
            f"20% of a GPU of type {model_hint}",
            _pod("by-type", {"main": {"koordinator.sh/gpu": "20"}}, annotations={"nvidia.com/use-gputype": model_hint}),
        ),
        (
            "a GPU type this node lacks",
            _pod("wrong-type", {"main": one}, annotations={"nvidia.com/use-gputype": "MI300"}),
        ),
        ("more GPUs than are left", _pod("too-big", {"main": {"nvidia.com/gpu": "4"}})),
        ("no GPU asked, image says NVIDIA_VISIBLE_DEVICES=all", _pod("cpu-only", {"main": {}})),
    ]


# -- the simulated node ---------------------------------------------------------------------------


def device_object(node: Any, library: Path) -> dict[str, Any]:
    """Discovery through the real pynvml and the reporter's object, as the API server would hold it."""
    from crihook.devices import report
    from crihook.devices.nvml import Nvml

    nvml = Nvml(str(library), str(node.sys_root))
    try:
        gpus = nvml.snapshot()
    finally:
        nvml.close()
    if gpus.reason:
        raise SystemExit(f"crihook demo: the simulated node's NVML failed: {gpus.reason}")
    want = report.desired(report.Observed(gpus))
    obj = report.device_object(NODE, "demo-node-uid", want, None)
    assert obj is not None
    obj["status"] = want.status
    return obj


# -- runtimes -------------------------------------------------------------------------------------


@dataclass
class Runtime:
    """Where the demo's pods run, and what kubelet would put in their configs there."""

    address: str
    image: str = "busybox"  # the embedded runtime starts nothing, so any name does
    cgroup_root: str = "/kubepods/besteffort"


@contextlib.contextmanager
def embedded_runtime(work: Path) -> Iterator[Runtime]:
    """The in-process runtime on its own event loop thread."""
    from crihook.simnode import runtime as er

    sock = str(work / "runtime.sock")
    loop = asyncio.new_event_loop()
    holder: dict[str, Any] = {}

    async def start() -> None:
        holder["server"], _ = await er.serve(sock)

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        yield Runtime(f"unix://{sock}")
    finally:
        asyncio.run_coroutine_threadsafe(holder["server"].stop(0), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@contextlib.contextmanager
def containerd_runtime() -> Iterator[Runtime]:
    from crihook.simnode.containerd import BUSYBOX_IMAGE, CGROUP_ROOT, running_containerd

    with running_containerd() as daemon:
        yield Runtime(daemon.address, BUSYBOX_IMAGE, CGROUP_ROOT)


def choose_runtime(wanted: str) -> str:
    """`auto` takes containerd where it can run; an explicit `containerd` that cannot is an error."""
    if wanted == "embedded":
        return wanted
    from crihook.simnode.containerd import missing_requirements

    reason = missing_requirements()
    if reason is None:
        return "containerd"
    if wanted == "containerd":
        raise SystemExit(f"crihook demo: {reason}")
    return "embedded"


# -- kubelet's part -------------------------------------------------------------------------------


@dataclass
class Outcome:
    pod: str
    shows: str
    scheduled: str = ""  # what the allocator chose, or why not
    containers: dict[str, dict[str, Any]] = field(default_factory=dict)
    refused: str = ""  # the runtime call that failed, with crihook's message


def schedule(plugin: Any, pod_json: dict[str, Any]) -> tuple[dict[str, str], str]:
    """Webhook, then PreFilter / Filter / Score / Reserve / PreBind on the one node: the annotations
    to add and a one-line account of the decision."""
    from crihook.scheduler.plugin import Unschedulable
    from crihook.scheduler.pod import PodError, pod_from_json
    from crihook.scheduler.request import RequestError
    from crihook.scheduler.webhook import WebhookConfig, mutate_pod

    mutated, _ = mutate_pod(pod_json, WebhookConfig())
    try:
        req = plugin.pre_filter(pod_from_json(mutated))
    except (PodError, RequestError) as e:
        return {}, f"rejected: {e}"
    if not req.wants_devices:
        return {}, "no device request: passed through"
    reason = plugin.filter(req, NODE)
    if reason is not None:
        return {}, f"unschedulable: {reason}"
    try:
        alloc = plugin.reserve(req, NODE)
    except Unschedulable as e:
        return {}, f"unschedulable: {e}"
    annotations = plugin.pre_bind(req, alloc)
    parts = []
    for g in alloc.gpus:
        core = g.resources.get("koordinator.sh/gpu-core", 100)
        mem = int(g.resources.get("koordinator.sh/gpu-memory", 0))
        parts.append(f"minor {g.minor}" + ("" if int(core) >= 100 else f" ({core}% core, {mem / GiB:.0f}Gi)"))
    return annotations, ", ".join(parts)


@dataclass
class Started:
    """A container the demo started, as its GPU processes are placed: its cgroup as the runtime
    reports it (the OCI spec's linux.cgroupsPath) and the GPUs crihook made visible to it."""

    pod: str
    container: str
    cgroups_path: str
    gpus: list[str]


def container_view(cri: Any, cid: str) -> tuple[dict[str, Any], str]:
    """What the container got (env, device nodes, mounts), and its cgroupsPath."""
    spec = json.loads(cri.container_status(cid, verbose=True).info["info"])["runtimeSpec"]
    env = dict(e.split("=", 1) for e in spec["process"]["env"])
    shown = {k: v for k, v in sorted(env.items()) if k.startswith(("NVIDIA_", "CUDA_", "LD_PRELOAD"))}
    devices = sorted(d["path"] for d in spec["linux"].get("devices", []) if d["path"].startswith("/dev/nvidia"))
    mounts = sorted(m["destination"] for m in spec.get("mounts", []) if "vgpu" in m["destination"])
    return {"env": shown, "devices": devices, "mounts": mounts}, str(spec["linux"].get("cgroupsPath", ""))


def run_pods(
    address: str,
    runtime: Runtime,
    plugin: Any,
    pods: list[tuple[str, dict[str, Any]]],
    forged: str,
    observe: Callable[[list[Started]], T],
) -> tuple[list[Outcome], T]:
    """Every pod through the scheduler and crihook; `observe` sees the started containers before
    everything is removed."""
    from crihook.simnode.cri import Cri

    out: list[Outcome] = []
    started: list[Started] = []
    with Cri(address) as cri:
        try:
            for shows, pod_json in pods:
                meta = pod_json["metadata"]
                outcome = Outcome(meta["name"], shows)
                annotations, outcome.scheduled = schedule(plugin, pod_json)
                if outcome.scheduled.startswith(("rejected", "unschedulable")):
                    out.append(outcome)
                    continue
                run_one(cri, runtime, pod_json, annotations, outcome, started)
                out.append(outcome)
            outcome = Outcome("forged", "an allocation the scheduler never made (minor 99)")
            outcome.scheduled = "not scheduled by crihook: annotation written by hand"
            forged_pod = _pod("forged", {"main": {}})
            run_one(cri, runtime, forged_pod, {"scheduling.koordinator.sh/device-allocated": forged}, outcome, started)
            out.append(outcome)
            seen = observe(started)
        finally:
            cri.remove_all()
    return out, seen


def run_one(
    cri: Any,
    runtime: Runtime,
    pod_json: dict[str, Any],
    annotations: dict[str, str],
    outcome: Outcome,
    started: list[Started],
) -> None:
    from crihook.simnode.cri import CriError, container_config, pod_config

    meta = pod_json["metadata"]
    cfg = pod_config(
        meta["name"],
        namespace=meta["namespace"],
        uid=meta["uid"],
        labels=meta["labels"],
        annotations={**meta["annotations"], **annotations},
        cgroup_root=runtime.cgroup_root,
    )
    try:
        pod_id = cri.run_pod(cfg)
        for c in pod_json["spec"]["containers"]:
            # CUDA base images set NVIDIA_VISIBLE_DEVICES=all; crihook decides what it really is
            cc = container_config(c["name"], cfg, image=runtime.image, envs={"NVIDIA_VISIBLE_DEVICES": "all"})
            cid = cri.create_container(pod_id, cc, cfg)
            cri.start_container(cid)
            view, cgroups_path = container_view(cri, cid)
            outcome.containers[c["name"]] = view
            visible = view["env"].get("NVIDIA_VISIBLE_DEVICES", "")
            gpus = [u for u in visible.split(",") if u.startswith("GPU-")]
            started.append(Started(meta["name"], c["name"], cgroups_path, gpus))
    except CriError as e:
        outcome.refused = str(e)


# -- what the containers do on their GPUs ---------------------------------------------------------

# (pod, container) -> memory each of its processes holds on each of its GPUs (a share of the GPU's
# memory, or bytes), and its SM utilisation in percent
GPU_USE: dict[tuple[str, str], tuple[float | int, int]] = {
    ("train-4", "main"): (0.75, 90),
    ("split", "a"): (0.5, 60),
    ("split", "b"): (0.25, 30),
    ("share-half", "main"): (0.3, 40),
    ("koord-gpu", "main"): (0.2, 25),
    ("share-hami", "main"): (5 * GiB, 20),  # above its 4Gi grant: reported, nothing stopped
    ("by-type", "main"): (0.1, 15),
}
FIRST_PID = 40000
HOST_PROCESS = {"pid": 39999, "used_memory": 256 << 20}  # a host daemon holding a context on the first GPU
HOST_CGROUP = "0::/system.slice/nvidia-persistenced.service\n"
USAGE_TIMEOUT = 30.0


def run_gpu_processes(node: Any, started: list[Started]) -> set[int]:
    """Each started GPU container gets a process on each of its GPUs, as the fake NVML lists them
    (the library re-reads its file), with a /proc/<pid>/cgroup in the container's cgroup as the
    runtime made it; plus one host process. Returns the pids."""
    from crihook.devices.usage import cgroup_dir

    gpus = {g["uuid"]: g for g in node.doc["gpus"]}
    pids = {int(HOST_PROCESS["pid"])}
    procs: dict[str, list[dict[str, Any]]] = {node.doc["gpus"][0]["uuid"]: [dict(HOST_PROCESS)]}
    _cgroup_file(node.proc_root, int(HOST_PROCESS["pid"]), HOST_CGROUP)
    for pid, s in enumerate((s for s in started if (s.pod, s.container) in GPU_USE), FIRST_PID):
        memory, sm = GPU_USE[(s.pod, s.container)]
        _cgroup_file(node.proc_root, pid, f"0::{cgroup_dir(s.cgroups_path)}\n")
        pids.add(pid)
        for uuid in s.gpus:
            used = int(gpus[uuid]["memory_total"] * memory) if isinstance(memory, float) else memory
            procs.setdefault(uuid, []).append({"pid": pid, "used_memory": used, "sm_util": sm})
    for uuid, g in gpus.items():
        g["processes"] = procs.get(uuid, [])
    tmp = node.config.with_name(node.config.name + ".tmp")
    tmp.write_text(json.dumps(node.doc))
    os.replace(tmp, node.config)
    return pids


def _cgroup_file(proc_root: Path, pid: int, text: str) -> None:
    (proc_root / str(pid)).mkdir(parents=True, exist_ok=True)
    (proc_root / str(pid) / "cgroup").write_text(text)


def collected_usage(state_dir: Path, pids: set[int]) -> Any:
    """The daemon's first usage collection that saw every process: what `crihook top` reads."""
    from crihook.cli.top import read_state
    from crihook.devices.usage import StateError

    deadline = time.monotonic() + USAGE_TIMEOUT
    while True:
        try:
            state = read_state(str(state_dir))
            if pids <= {p for r in state.rows for p in r.pids}:
                return state
        except (OSError, StateError):
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"crihook demo: crihook reported no GPU usage within {USAGE_TIMEOUT:.0f}s")
        time.sleep(0.1)


# -- output ---------------------------------------------------------------------------------------


def render(outcomes: list[Outcome], runtime: str, topology: str, seconds: float) -> str:
    lines = [f"crihook demo: simulated {topology} node, runtime {runtime}, crihook serve with the gpu hook", ""]
    for o in outcomes:
        lines.append(f"pod demo/{o.pod}: {o.shows}")
        lines.append(f"  scheduler: {o.scheduled}")
        if o.refused:
            lines.append(f"  refused:   {o.refused}")
        for name, view in o.containers.items():
            env = " ".join(f"{k}={v}" for k, v in view["env"].items())
            lines.append(f"  container {name}: {env}")
            lines.append(f"    devices: {' '.join(view['devices']) or '(no GPU device)'}")
            if view["mounts"]:
                lines.append(f"    mounts:  {' '.join(view['mounts'])}")
        lines.append("")
    lines.append(f"done in {seconds:.1f}s; everything the demo made is removed")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from crihook.simnode.fakenvml import compiler

    if compiler() is None:
        print("crihook demo: needs gcc to build the fake NVML library (apt-get install gcc)", file=sys.stderr)
        return 2
    started = time.monotonic()
    runtime = choose_runtime(args.runtime)
    work = Path(tempfile.mkdtemp(prefix="crihook-demo-"))
    try:
        outcomes, usage_state = demo(work, args.topology, runtime)
    finally:
        if args.keep:
            print(f"crihook demo: work directory kept at {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    from crihook.cli import top

    now = time.time()
    if args.json:
        for o in outcomes:
            print(json.dumps(o.__dict__, sort_keys=True))
        print(json.dumps({"top": top.rows_json(usage_state, now)["rows"]}, sort_keys=True))
    else:
        print(render(outcomes, runtime, args.topology, time.monotonic() - started))
        print("\nwhat the containers' GPU processes used, as `crihook top --once` showed it before the removal:\n")
        print(top.render(usage_state, usage_state.taken_at), end="")
    return 0


def demo(work: Path, topology: str, runtime: str) -> tuple[list[Outcome], Any]:
    from crihook.scheduler.devices import node_from_device
    from crihook.scheduler.plugin import DeviceShare
    from crihook.simnode.daemon import running_crihook
    from crihook.simnode.fakenvml import CONFIG_ENV, build
    from crihook.simnode.node import make_sim_node

    node = make_sim_node(work / "node", topology, char_devices=runtime == "containerd")
    library = build()
    os.environ[CONFIG_ENV] = str(node.config)  # the fake NVML reads its node from here at nvmlInit
    device = device_object(node, library)
    plugin = DeviceShare()
    plugin.set_node(node_from_device(device, device["metadata"].get("labels", {})))
    # "Tesla V100-SXM2-32GB" -> V100, "NVIDIA H100 80GB HBM3" -> H100: what a user writes in use-gputype
    model = next(w for w in node.doc["gpus"][0]["name"].split() if any(c.isdigit() for c in w)).split("-")[0]
    forged = json.dumps({"gpu": [{"minor": 99, "resources": {"koordinator.sh/gpu-core": "100"}}]})
    backend = containerd_runtime() if runtime == "containerd" else embedded_runtime(work)
    with (
        backend as where,
        running_crihook(
            where.address,
            work / "crihook",
            node.proxy_config(library, NODE, proc_root=node.proc_root, kubelet_in_proc=False) + DEMO_USAGE,
            {CONFIG_ENV: str(node.config)},
        ) as proxy,
    ):

        def observe(started: list[Started]) -> Any:
            return collected_usage(proxy.state_dir, run_gpu_processes(node, started))

        try:
            return run_pods(proxy.address, where, plugin, demo_pods(model), forged, observe)
        except Exception:
            print(proxy.log_tail(), file=sys.stderr)
            raise
