"""How soon `crihook nri`, started as a pre-registered plugin, registers and answers Configure: the
runtime starts it with its end of a socket pair on fd 3 and waits 5 s for RegisterPlugin, then 2 s
for Configure's answer (NRI's pkg/adaptation/plugin.go, `start`); on NRI v0.6.1 (containerd 1.7) a
plugin that misses either makes containerd's CRI plugin fail to start.

    python bench/nri_prestart.py [--runs 10] [--config FILE]

Each run starts the command afresh (a cold interpreter, imports included) and plays the runtime's
side on the socket pair with the tests' fake runtime. Prints, per run and as median and max, the
seconds from the process's start to RegisterPlugin and to Configure's answer.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from crihook.proto import nri_v1alpha1_pb2 as api
from tests.nri.fakeruntime import Peer


async def one(config: str, state: str) -> tuple[float, float]:
    ours, theirs = socket.socketpair()
    env = {**os.environ, "NRI_PLUGIN_SOCKET": "3", "NRI_PLUGIN_NAME": "crihook", "NRI_PLUGIN_IDX": "10"}
    command = [sys.executable, "-m", "crihook.cli", "nri", "--config", config, "--state-dir", state]
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *command,
        pass_fds=(3,),
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=lambda: os.dup2(theirs.fileno(), 3),
    )
    theirs.close()
    try:
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        peer = Peer(reader, writer)
        peer.start()
        await peer.register()
        registered = time.monotonic() - started
        configure = api.ConfigureRequest(runtime_name="containerd", runtime_version="v1.7.24")
        await peer.call("Configure", configure, api.ConfigureResponse)
        configured = time.monotonic() - started
        await peer.close()
    finally:
        try:
            await asyncio.wait_for(proc.wait(), 15)
        except TimeoutError:
            proc.kill()
            await proc.wait()
    return registered, configured


async def measure(runs: int, config: str) -> list[tuple[float, float]]:
    out = []
    with tempfile.TemporaryDirectory(prefix="crihook-prestart-") as state:
        for _ in range(runs):
            out.append(await one(config, state))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--config", default=os.devnull, help="crihook's config file (default: none, all defaults)")
    args = ap.parse_args()
    samples = asyncio.run(measure(args.runs, args.config))
    for i, (reg, conf) in enumerate(samples):
        print(f"run {i}: registered {reg:.3f} s, configured {conf:.3f} s")
    regs, confs = [r for r, _ in samples], [c for _, c in samples]
    print(f"registered: median {statistics.median(regs):.3f} s, max {max(regs):.3f} s (the runtime waits 5 s)")
    print(f"configured: median {statistics.median(confs):.3f} s, max {max(confs):.3f} s")
    print(f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
