"""Instructions crihook executes per intercepted call, counted by valgrind's callgrind: repeatable on
a machine too loaded for wall-clock figures to mean much.

    .venv/bin/python bench/intercept_instructions.py [--calls 200]      # needs valgrind
    .venv/bin/python bench/intercept_instructions.py --cpu [--calls 200] [--again] [--floor]   # event-loop CPU per step

Runs this script twice under `valgrind --tool=callgrind`, once doing nothing after start-up and once
doing `--calls` pod starts the way the daemon sees them, and prints the difference divided by the
calls. A pod start here is what crihook does for kubelet's RunPodSandbox, CreateContainer,
StartContainer (and the RemovePodSandbox that keeps the node at `--resident` pods) apart from
relaying bytes: `Interceptor.pre` and `Interceptor.post` (the hooks, the store's bookkeeping, its
writes to disk) for a pod the scheduler gave all 8 GPUs of the simulated
node that bench/proxy_bench.py uses, the runtime's answers made up. All threads count (the hook
worker thread and the store's writer too); time spent waiting does not.

With `--cpu` each step waits for the store's write before the next (as kubelet's calls are spaced
by containerd's work), so each runs after the loop idled ~50 ms: with the caches and the clock of
an idle CPU. `--again` times each CreateContainer's pre a second time right after the first, warm.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

from proxy_bench import TOPOLOGY, all_gpus, crihook_config

from crihook.base import config as cfgmod
from crihook.hooks.chain import build_chain
from crihook.proto import runtime_v1_pb2 as api
from crihook.proxy.intercept import Interceptor
from crihook.proxy.store import Store
from crihook.simnode import fakenvml
from crihook.simnode.cri import container_config, pod_config
from crihook.simnode.node import make_sim_node

SERVICE = b"/runtime.v1.RuntimeService/"


async def pod_starts(
    work: Path,
    calls: int,
    resident: int,
    timings: dict[str, list[float]] | None = None,
    again: bool = False,
    floor: bool = False,
) -> None:
    """`timings`: filled with the event-loop thread's CPU seconds per step of each counted start.
    `again`: each CreateContainer's pre is run a second time at once, timed apart: the same work
    with the caches it just warmed, where the first ran after the loop had idled. `floor`: every
    other CreateContainer times, after the same idle and instead of pre, the least any interception
    in Python does (`least_pre`); pre then runs untimed."""
    node = make_sim_node(work / "node", TOPOLOGY, char_devices=False)
    os.environ[fakenvml.CONFIG_ENV] = str(node.config)
    # valgrind runs 50 times slower: the first call (NVML loading) must not hit the hooks' timeout
    text = crihook_config(work, node).replace("[hooks]\n", "[hooks]\ndefault_timeout_ms = 600000\n", 1)
    cfg = cfgmod.parse(__import__("tomllib").loads(text))
    store = Store(work / "state")
    chain = build_chain(cfg.hooks, cfg.node)
    for reg in chain.hooks:
        if hasattr(reg.hook, "attach_store"):
            reg.hook.attach_store(store)
    icpt = Interceptor(chain, store)
    annotations = all_gpus(node)
    # least_pre's answer: the config fields the gpu hook adds for the bench's pod, encoded beforehand
    grant = api.ContainerConfig(envs=[api.KeyValue(key=b"NVIDIA_VISIBLE_DEVICES", value=b"all")])
    grant.devices.extend(api.Device(container_path=f"/dev/nvidia{i}", host_path=f"/dev/nvidia{i}") for i in range(11))
    answers: dict[str, bytes] = {}
    clock = {"on": False}

    def timed(step: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        if timings is None:
            return fn

        def run(*args: Any, **kwargs: Any) -> Any:
            began = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                if clock["on"]:
                    timings.setdefault(step, []).append(time.thread_time() - began)

        return run

    async def pre(step: str, call: Any, body: bytes) -> bytes:
        began = time.thread_time()
        out = await icpt.rewrite(call, body)
        if timings is not None and clock["on"]:
            timings.setdefault(step, []).append(time.thread_time() - began)
        return out

    store._next_write = timed("store: encode on the event loop", store._next_write)  # type: ignore[method-assign]
    store._write = timed("store: write (its thread; fsync waits not counted)", store._write)  # type: ignore[method-assign]
    post = {
        name: timed(f"{name} post (bookkeeping)", icpt.post)
        for name in ("RunPodSandbox", "CreateContainer", "StartContainer")
    }

    async def settle() -> None:
        """Let the store write, as it does between kubelet's calls (each takes longer than its delay)."""
        if store._flush_task is not None:
            await store._flush_task

    async def one(n: int, resident: bool) -> None:
        pod = pod_config(f"p{n}", annotations=annotations)
        run = api.RunPodSandboxRequest(config=pod).SerializeToString()
        pod_id = f"{n:064x}"
        call = icpt.classify(SERVICE + b"RunPodSandbox")
        assert call is not None
        if call.modifies:
            run = await pre("RunPodSandbox pre", call, run)
        post["RunPodSandbox"](
            call, run, api.RunPodSandboxResponse(pod_sandbox_id=pod_id).SerializeToString(), grpc.StatusCode.OK, None
        )
        await settle()
        answers[pod_id] = grant.SerializeToString()  # the floor's answer, made with the sandbox (prepare_pod)
        create = api.CreateContainerRequest(
            pod_sandbox_id=pod_id, config=container_config("app", pod), sandbox_config=pod
        ).SerializeToString()
        call = icpt.classify(SERVICE + b"CreateContainer")
        assert call is not None and call.modifies
        if floor and n % 2 == 0:
            least = timed("CreateContainer: the least pre, every other", least_pre)
            least(create, grant, answers)
            forwarded = await icpt.rewrite(call, create)
        else:
            forwarded = await pre("CreateContainer pre (decode, hooks, re-encode)", call, create)
        assert forwarded != create  # the gpu hook did its job
        if again:
            repeat = icpt.classify(SERVICE + b"CreateContainer")
            assert repeat is not None
            await pre("CreateContainer pre, run again at once", repeat, create)
        cid = f"c{n:063x}"
        post["CreateContainer"](
            call, forwarded, api.CreateContainerResponse(container_id=cid).SerializeToString(), grpc.StatusCode.OK, None
        )
        await settle()
        start = api.StartContainerRequest(container_id=cid).SerializeToString()
        call = icpt.classify(SERVICE + b"StartContainer")
        assert call is not None
        if call.modifies:
            start = await pre("StartContainer pre", call, start)
        post["StartContainer"](call, start, b"", grpc.StatusCode.OK, None)
        await settle()
        if not resident:  # counted pods go again, so every counted start sees the same store
            remove = api.RemovePodSandboxRequest(pod_sandbox_id=pod_id).SerializeToString()
            call = icpt.classify(SERVICE + b"RemovePodSandbox")
            assert call is not None
            icpt.post(call, remove, b"", grpc.StatusCode.OK, None)
            await settle()

    for n in range(resident):
        await one(n, True)
    clock["on"] = True
    for n in range(resident, resident + calls):
        await one(n, False)
    await icpt.close()
    await store.close()
    await chain.close()


def least_pre(body: bytes, grant: api.ContainerConfig, answers: dict[str, bytes]) -> bytes:
    """What any interception of CreateContainer in Python must do at the least, with its decision
    made beforehand: decode the request, look its pod's answer up, merge it in, encode. No checks,
    no hooks, no record: a floor for `pre` on this machine, not something crihook could ship."""
    msg = api.CreateContainerRequest.FromString(body)
    msg.config.MergeFromString(answers.get(msg.pod_sandbox_id) or grant.SerializeToString())
    return msg.SerializeToString()


def cpu_per_step(calls: int, resident: int, again: bool, floor: bool = False) -> None:
    """What each step costs the thread it runs on (CPU time: hardly moved by other load; the event
    loop's, but the store's writer thread for its writes) and every garbage collection pause meanwhile."""
    timings: dict[str, list[float]] = {}
    pauses: dict[int, list[float]] = {}
    began = [0.0]

    def gc_watch(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            pauses.setdefault(info["generation"], []).append(time.perf_counter() - began[0])

    gc.callbacks.append(gc_watch)
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(pod_starts(Path(tmp), calls, resident, timings, again, floor))
    gc.callbacks.remove(gc_watch)
    print(f"CPU per step, {calls} pod starts with {resident} pods on the node (µs p50 / p99):")
    for step, samples in timings.items():
        q = statistics.quantiles(samples, n=100)
        print(f"  {step:<48} {q[49] * 1e6:8.1f} / {q[98] * 1e6:8.1f}")
    for gen, p in sorted(pauses.items()):
        print(f"  GC generation {gen}: {len(p)} collections, longest {max(p) * 1e3:.2f} ms")


def counted(calls: int, resident: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        proc = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={out}",
                sys.executable,
                __file__,
                "--inner",
                "--calls",
                str(calls),
                "--resident",
                str(resident),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        if proc.returncode != 0:
            raise SystemExit(f"callgrind run failed:\n{proc.stderr[-3000:]}")
        match = re.search(r"^(?:totals|summary): (\d+)", out.read_text(), re.M)
        assert match, "no totals in callgrind's output"
        return int(match.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--resident", type=int, default=100, help="pods already on the node (uncounted)")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cpu", action="store_true", help="no valgrind: the event loop's CPU time per step, and GC pauses")
    ap.add_argument(
        "--again", action="store_true", help="with --cpu: each CreateContainer's pre once more at once (warm caches)"
    )
    ap.add_argument(
        "--floor", action="store_true", help="with --cpu: every other CreateContainer times least_pre instead of pre"
    )
    args = ap.parse_args()
    if args.cpu:
        cpu_per_step(args.calls, args.resident, args.again, args.floor)
        return
    if args.inner:
        with tempfile.TemporaryDirectory() as tmp:
            asyncio.run(pod_starts(Path(tmp), args.calls, args.resident))
        return
    base = counted(0, args.resident)
    total = counted(args.calls, args.resident)
    print("instructions per pod start (RunPodSandbox, CreateContainer with 8 GPUs, StartContainer,")
    print(f"RemovePodSandbox), interception only, {args.resident} pods on the node, {args.calls} starts:")
    print(f"{(total - base) / args.calls:,.0f}")


if __name__ == "__main__":
    main()
