"""What NRI's wire costs crihook per call: a CreateContainer round trip through the plugin stub
(multiplexer, ttrpc, protobuf, dispatch) with a handler that answers at once, over a unix socket in
one process, the runtime's side played by the tests' fake runtime.

    python bench/nri_wire.py [--calls 2000] [--env 40] [--uvloop]

The request is a container like kubelet's (`--env` variables, a pod with labels and annotations),
the answer an adjustment setting one variable. Prints median, 95th percentile and max in µs, and
the sizes of the request and answer. The runtime's side is Python here too (containerd's is Go), so
the figure is an upper bound for the wire's share of what NRI mode adds to CreateContainer; the
hooks' own time and containerd's spec adjustment are not in it.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from crihook.nri.stub import Plugin
from crihook.proto import nri_v1alpha1_pb2 as api
from tests.nri.fakeruntime import FakeRuntime
from tests.support.nriplugin import NoChange


class Answering(NoChange):
    async def create_container(self, request: api.CreateContainerRequest) -> api.CreateContainerResponse:
        return api.CreateContainerResponse(
            adjust=api.ContainerAdjustment(env=[api.KeyValue(key="NVIDIA_VISIBLE_DEVICES", value="void")])
        )


def request(env: int) -> api.CreateContainerRequest:
    pod = api.PodSandbox(id="p" * 64, name="trainer-0", uid="u" * 36, namespace="team-a")
    pod.labels.update({f"label-{i}": f"value-{i}" for i in range(8)})
    pod.annotations.update({"scheduling.koordinator.sh/device-allocated": '{"gpu":[{"minor":0}]}'})
    ctr = api.Container(id="c" * 64, pod_sandbox_id=pod.id, name="main", state=api.CONTAINER_CREATED)
    ctr.args.extend(["/bin/train", "--epochs", "10"])
    ctr.env.extend(f"VAR_{i}=value-{i}" for i in range(env))
    ctr.mounts.extend(api.Mount(destination=f"/m{i}", source=f"/s{i}", type="bind") for i in range(6))
    return api.CreateContainerRequest(pod=pod, container=ctr)


async def measure(calls: int, env: int) -> tuple[list[float], int, int]:
    with tempfile.TemporaryDirectory(prefix="crihook-nri-bench-") as tmp:
        sock = Path(tmp) / "nri.sock"
        plugin = Plugin(Answering(), "bench", "10", str(sock))
        async with FakeRuntime(sock) as rt:
            task = asyncio.create_task(plugin.run())
            peer = await rt.accept()
            await peer.handshake()
            payload = request(env).SerializeToString()
            samples = []
            for _ in range(calls):
                start = time.perf_counter()
                response = await peer.call_raw("CreateContainer", payload)
                samples.append((time.perf_counter() - start) * 1e6)
            plugin.stop()
            await task
    return samples, len(payload), len(response.payload)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--env", type=int, default=40, help="environment variables in the container (default: 40)")
    ap.add_argument("--uvloop", action="store_true", help="run on uvloop, as `crihook nri` does")
    args = ap.parse_args()
    if args.uvloop:
        import uvloop

        samples, sent, answered = uvloop.run(measure(args.calls, args.env))
    else:
        samples, sent, answered = asyncio.run(measure(args.calls, args.env))
    warm = sorted(samples[len(samples) // 10 :])  # the first tenth warms the caches
    p95 = warm[int(len(warm) * 0.95) - 1]
    print(f"CreateContainer round trip, {len(warm)} calls, request {sent} B, answer {answered} B")
    print(f"  p50 {statistics.median(warm):7.1f} µs   p95 {p95:7.1f} µs   max {warm[-1]:7.1f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
