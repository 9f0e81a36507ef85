"""What Koordinator-protocol hook servers add to one CreateContainer.

    .venv/bin/python bench/remote_hook_bench.py [--calls 2000]

The `remote` hook runs in a hook chain on uvloop, as `crihook serve` runs it, against 0, 1 and 2
hook servers (each its own process, the test server of tests/support/hookserver.py answering like koordlet:
the request echoed back, plus one variable of its own). The container is kubelet-sized: 30
variables, 5 annotations, resources set. Prints µs per chain run (p50, p99, max). The servers are
Python too, so the figures bound crihook's side from above: a Go server answers faster.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import uvloop

from crihook.base.config import HooksConfig, NodeConfig
from crihook.hooks.base import ContainerInfo, HookContext, LinuxResources, PodInfo, Stage
from crihook.hooks.registry import build_chain
from crihook.hooks.remote import RemoteHook, factory
from tests.support.hookserver import HookServer, short_dir, write_config

POD = PodInfo(
    name="bench",
    namespace="default",
    uid="0c2b4e8e-3f4a-4a57-9a53-0d0c7c0e4c11",
    labels={"app": "bench", "io.kubernetes.pod.name": "bench"},
    annotations={f"example.com/a{i}": "x" * 40 for i in range(5)},
    cgroup_parent="/kubepods/burstable/pod0c2b4e8e",
)
CONTAINER = ContainerInfo(
    name="main",
    annotations={f"example.com/c{i}": "y" * 40 for i in range(5)},
    envs=tuple((f"VAR_{i}", "v" * 30) for i in range(30)),
    resources=LinuxResources(cpu_period=100000, cpu_quota=200000, cpu_shares=2048, memory_limit_in_bytes=4 << 30),
)


def serve(socket: str, name: str) -> None:
    async def run() -> None:
        server = await HookServer(Path(socket)).start()
        server.on("PreCreateContainerHook", change=lambda a: a.container_envs.update({f"FROM_{name}": "1"}))
        server.calls = _Discard()  # keep no history: the bench makes thousands of calls
        await asyncio.Event().wait()

    uvloop.run(run())


class _Discard(list):  # type: ignore[type-arg]
    def append(self, item: Any) -> None:
        pass


def percentiles(samples: list[float]) -> str:
    q = statistics.quantiles(samples, n=100)
    return f"p50 {q[49] * 1e6:7.1f} µs   p99 {q[98] * 1e6:7.1f} µs   max {max(samples) * 1e6:8.1f} µs"


async def measure(confdir: Path, calls: int) -> list[float]:
    chain = build_chain(
        HooksConfig(options={"remote": {"config_dir": str(confdir)}}), NodeConfig(), {"remote": factory}
    )
    ctx = HookContext(Stage.PRE_CREATE_CONTAINER, POD, CONTAINER)
    for _ in range(50):  # connect, warm up
        out = await chain.run(ctx)
        assert out.error is None, out.error.reason
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        await chain.run(ctx)
        samples.append(time.perf_counter() - start)
    remote = chain.hooks[0].hook
    assert isinstance(remote, RemoteHook)
    await remote.close()
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--serve", nargs=2, metavar=("SOCKET", "NAME"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(*args.serve)
        return
    confdir = short_dir("crihook-bench-")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for n in range(3):
            if n:
                socket = confdir / f"s{n}.sock"
                procs.append(subprocess.Popen([sys.executable, __file__, "--serve", str(socket), f"S{n}"]))
                while not socket.exists():
                    time.sleep(0.05)
                write_config(confdir, f"{n}.json", str(socket), "Fail", ["PreCreateContainer"])
            samples = uvloop.run(measure(confdir, args.calls))
            print(f"{n} server(s): {percentiles(samples)}   ({args.calls} CreateContainer chain runs)")
    finally:
        for p in procs:
            os.kill(p.pid, signal.SIGTERM)
            p.wait()
        shutil.rmtree(confdir, ignore_errors=True)


if __name__ == "__main__":
    main()
