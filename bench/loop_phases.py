"""Where crihook's event loop spends its CPU on a CreateContainer, phase by phase: which part of it
kubelet waits for, and which comes after the answer.

    python bench/loop_phases.py [--runtime 1.6|1.7|2] [--calls 200] [--gap 0.02] [--floor]

Needs root (it starts the test suite's containerd, like bench/proxy_bench.py, on the same simulated
8-GPU node). CreateContainers for a pod given all 8 GPUs go through crihook alone, `--gap` seconds
apart (proxy_bench's targets take turns, so there crihook's calls come ~20 ms apart and run with
cold caches). crihook runs with a probe loaded at start-up (a `sitecustomize` module this script
writes) that wraps the relay's and the interceptor's entry points and adds up the event-loop
thread's CPU time (thread_time) inside each; nested phases are shown indented and are part of
their parent's time. The probe's own wrapping costs a microsecond or two per phase.

On the critical path (kubelet waits for it): the request's frames read (`down_data`, the HEADERS
claimed and the DATA held), `request_complete` (decode, the hooks, write-back, encode, the
rewritten DATA written), and the answer's frames written (`up_data` without `learn`). After the
answer: `learn` (its header blocks read, the call's metrics), `post` (the store's records) and
the store's encode. `--floor`: crihook with bench/proxy_bench.py's floor loaded too (a pod's
CreateContainers past its first only merge in the answer its first got: no hook, no check), so the
phases show what the relay itself costs an intercepted call.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from proxy_bench import FLOOR_PROBE, Alone, crihook_alone

from tests.support.containerd import RUNTIMES

# (module, class, method, label, parent label or ""): what the probe wraps, outermost first
PHASES = [
    ("crihook.proxy.relay", "Link", "down_data", "down_data: kubelet's frames", ""),
    ("crihook.proxy.intercept", "Interceptor", "classify", "Interceptor.classify", "down_data: kubelet's frames"),
    ("crihook.proxy.relay", "Link", "claim", "Link.claim", "down_data: kubelet's frames"),
    ("crihook.proxy.relay", "Link", "request_complete", "request_complete", "down_data: kubelet's frames"),
    ("crihook.proxy.intercept", "Interceptor", "pre", "Interceptor.pre", "request_complete"),
    ("crihook.hooks.chain", "HookChain", "run_express", "HookChain.run_express (the express lane)", "Interceptor.pre"),
    ("crihook.hooks.chain", "HookChain", "run_now", "HookChain.run_now (the full lane)", "Interceptor.pre"),
    ("crihook.hooks.gpu", "GpuHook", "handle_cached", "GpuHook.handle_cached (in either)", "Interceptor.pre"),
    ("crihook.proxy.intercept", "Interceptor", "_written", "Interceptor._written (write back)", "Interceptor.pre"),
    ("crihook.proxy.relay", "Link", "forward", "Link.forward (DATA out)", "request_complete"),
    ("crihook.proxy.relay", "Link", "run_pre", "Link.run_pre (a task: a hook that waits)", ""),
    ("crihook.proxy.relay", "Link", "up_data", "up_data: containerd's frames", ""),
    ("crihook.proxy.relay", "Link", "learn", "learn (after the write)", "up_data: containerd's frames"),
    ("crihook.proxy.intercept", "Interceptor", "post", "Interceptor.post", ""),
    ("crihook.proxy.store", "Store", "_next_write", "store encode", ""),
    ("crihook.proxy.relay", "HeaderBlocks", "feed", "HeaderBlocks.feed (HPACK, either side)", ""),
]

PROBE = """
import importlib, inspect, json, os, signal, threading, time

_cpu = time.thread_time_ns
_main = threading.main_thread()
_totals = {}

def _add(label, began):
    if threading.current_thread() is _main:
        t = _totals.setdefault(label, [0, 0])
        t[0] += _cpu() - began
        t[1] += 1

def _wrap(module, cls, method, label):
    owner = getattr(importlib.import_module(module), cls)
    inner = getattr(owner, method, None)
    if inner is None:  # an older crihook, laid out otherwise
        return

    if inspect.iscoroutinefunction(inner):
        async def timed(*args, **kwargs):  # counts what runs meanwhile if it really waits
            began = _cpu()
            try:
                return await inner(*args, **kwargs)
            finally:
                _add(label, began)
    else:
        def timed(*args, **kwargs):
            began = _cpu()
            try:
                return inner(*args, **kwargs)
            finally:
                _add(label, began)

    setattr(owner, method, timed)

for _module, _cls, _method, _label, _parent in json.loads(os.environ["LOOP_PHASES"]):
    _wrap(_module, _cls, _method, _label)
_start = [_cpu()]

def _reset(*_):
    _totals.clear()
    _start[0] = _cpu()

def _dump():
    with open(os.environ["LOOP_PHASES_OUT"], "w") as f:
        json.dump({"loop": _cpu() - _start[0], "phases": _totals}, f)

signal.signal(signal.SIGUSR2, _reset)
signal.signal(signal.SIGUSR1, lambda *_: _dump())
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runtime", choices=RUNTIMES, default="1.6")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--gap", type=float, default=0.02, help="seconds between calls (default %(default)s)")
    ap.add_argument("--floor", action="store_true", help="CreateContainer answered as at the least (see above)")
    args = ap.parse_args()

    def probed(work: Path) -> dict[str, str]:
        (work / "probe").mkdir()
        # the floor first: the probe then times its pre as it would crihook's
        (work / "probe" / "sitecustomize.py").write_text(FLOOR_PROBE + PROBE if args.floor else PROBE)
        return {
            "PYTHONPATH": str(work / "probe"),
            "LOOP_PHASES": json.dumps(PHASES),
            "LOOP_PHASES_OUT": str(work / "phases.json"),
        }

    with crihook_alone(args.runtime, "loop-phases-", probed) as alone:
        rt = alone.runtime
        print(
            f"containerd {rt.name} ({rt.package_version()}): {args.calls} CreateContainers "
            f"{args.gap * 1e3:.0f} ms apart through crihook" + (" with the floor's pre" if args.floor else ""),
            flush=True,
        )
        run(alone, args, alone.work / "phases.json")


def run(alone: Alone, args: argparse.Namespace, out: Path) -> None:
    pid = alone.pid
    create = alone.gpu_pod("phases")

    def call(i: int) -> None:
        create(f"c{i}")

    for i in range(10):  # warm: NVML loaded, caches filled
        call(i)
    time.sleep(0.3)
    os.kill(pid, 12)  # SIGUSR2: the probe starts counting
    time.sleep(0.05)
    for i in range(10, 10 + args.calls):
        call(i)
        time.sleep(args.gap)
    time.sleep(0.2)  # the last store write
    os.kill(pid, 10)  # SIGUSR1: the probe writes its totals
    deadline = time.monotonic() + 5
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    report(json.loads(out.read_text()), args.calls)


def report(data: dict[str, object], calls: int) -> None:
    phases: dict[str, list[int]] = data["phases"]  # type: ignore[assignment]
    loop = int(data["loop"])  # type: ignore[call-overload]
    print(f"event loop CPU per CreateContainer: {loop / calls / 1e3:7.1f} µs (all of it, probe included)")
    depth: dict[str, int] = {}
    for _module, _cls, _method, label, parent in PHASES:
        depth[label] = depth[parent] + 1 if parent else 0
        ns, n = phases.get(label, [0, 0])
        name = "  " * depth[label] + label
        print(f"  {name:<46} {ns / calls / 1e3:7.1f} µs per call ({n / calls:.1f} entries)")
    down, task, up, learn = (
        phases.get(label, [0, 0])[0]
        for label in (
            "down_data: kubelet's frames",
            "Link.run_pre (a task: a hook that waits)",
            "up_data: containerd's frames",
            "learn (after the write)",
        )
    )
    waited = (down + task + up - learn) / calls / 1e3
    print(f"what kubelet waits for, at most (down_data + run_pre + up_data - learn): {waited:.1f} µs")


if __name__ == "__main__":
    main()
