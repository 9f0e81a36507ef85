"""crihook's CPU per call as a function of how often calls come, thread by thread: the same calls
back to back and spaced apart, against one containerd release.

    python bench/call_spacing.py [--runtime 1.6|1.7|2] [--calls 100] [--gaps 0,0.1] [--method CreateContainer]

Needs root (it starts the test suite's containerd, like bench/proxy_bench.py, on the same simulated
8-GPU node). Each CreateContainer is for a pod given all 8 GPUs and goes through crihook alone, one
after the other with `--gaps` seconds between them; the containers are removed afterwards, untimed.
Prints crihook's CPU per call (schedstat, nanoseconds) for the event loop's thread and for the
others (the store's writer, the hook pool), and how many times per call each was scheduled.

Why it exists: `proxy_bench` interleaves direct, crihook and the other targets call by call, so
crihook's calls come one round apart, and a round lasts as long as three of containerd's calls. What
crihook's CPU per call depends on besides its own work (store writes shared by the calls of one
flush window, caches gone cold while it waited) shows here with everything else held still.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

from proxy_bench import LIMITS, RUNTIME, Alone, crihook_alone, ident

from crihook.proto import runtime_v1_pb2 as api
from tests.support.containerd import RUNTIMES


def threads(pid: int) -> dict[str, tuple[int, int]]:
    """Thread id -> (CPU nanoseconds, times scheduled), from schedstat."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            ns, _, slices = (task / "schedstat").read_text().split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        out[task.name] = (int(ns), int(slices))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runtime", choices=RUNTIMES, default="1.6")
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--gaps", default="0,0.1", help="seconds between calls, comma-separated")
    ap.add_argument("--method", choices=("CreateContainer", "Version"), default="CreateContainer")
    args = ap.parse_args()
    with crihook_alone(args.runtime, "call-spacing-") as alone:
        rt = alone.runtime
        print(f"containerd {rt.name} ({rt.package_version()}), {args.method} through crihook alone", flush=True)
        measure(alone, args)


def measure(alone: Alone, args: argparse.Namespace) -> None:
    pid = alone.pid
    ch = grpc.insecure_channel(f"unix://{alone.sock}", options=LIMITS)
    direct = grpc.insecure_channel(f"unix://{alone.backend}", options=LIMITS)

    def method(channel: grpc.Channel, name: str) -> grpc.UnaryUnaryMultiCallable:
        return channel.unary_unary(RUNTIME + name, request_serializer=ident, response_deserializer=ident)

    create = alone.gpu_pod("spacing")
    version, remove = method(ch, "Version"), method(direct, "RemoveContainer")
    names = iter(range(10**9))

    def call() -> bytes | None:
        if args.method == "Version":
            version(api.VersionRequest(version="v1").SerializeToString(), timeout=60)
            return None
        return create(f"c{next(names)}")

    for _ in range(10):  # warm: NVML loaded, caches filled, threads started
        call()
    for gap in (float(g) for g in args.gaps.split(",")):
        made = []
        time.sleep(0.5)
        before, began = threads(pid), time.perf_counter()
        for _ in range(args.calls):
            made.append(call())
            time.sleep(gap)
        time.sleep(0.2)  # the last store write
        after, wall = threads(pid), time.perf_counter() - began
        loop = other = slices_loop = slices_other = 0
        for tid, (ns, slices) in after.items():
            ns0, slices0 = before.get(tid, (0, 0))
            if tid == str(pid):
                loop, slices_loop = ns - ns0, slices - slices0
            else:
                other, slices_other = other + ns - ns0, slices_other + slices - slices0
        n = args.calls
        print(
            f"gap {gap * 1e3:5.0f} ms ({wall:.1f} s): CPU per call {(loop + other) / n / 1e6:.3f} ms = event loop "
            f"{loop / n / 1e6:.3f} ({slices_loop / n:.1f} runs) + other threads {other / n / 1e6:.3f} "
            f"({slices_other / n:.1f} runs)",
            flush=True,
        )
        for raw in made:
            if raw is not None:
                cid = api.CreateContainerResponse.FromString(raw).container_id
                remove(api.RemoveContainerRequest(container_id=cid).SerializeToString(), timeout=60)


if __name__ == "__main__":
    main()
