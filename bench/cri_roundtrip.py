"""Latency of each CRI step of a pod's life, against a private containerd or any CRI endpoint.

    python bench/cri_roundtrip.py [--pods 30] [--address unix:///path/to/cri.sock]

Without --address it starts the test suite's private containerd (root, containerd and runc needed),
so the figures are the baseline a CRI proxy in front of it is compared with: run it again with
--address pointing at the proxy. Prints one line per step: median, 95th percentile and max in ms.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.containerd import running_containerd
from tests.support.cri import Cri, container_config, pod_config

T = TypeVar("T")
STEPS = (
    "RunPodSandbox",
    "CreateContainer",
    "StartContainer",
    "ExecSync",
    "StopContainer",
    "RemoveContainer",
    "StopPodSandbox",
    "RemovePodSandbox",
)


def timed(samples: dict[str, list[float]], step: str, call: Callable[[], T]) -> T:
    start = time.perf_counter()
    result = call()
    samples[step].append((time.perf_counter() - start) * 1000)
    return result


def one_pod(cri: Cri, index: int, samples: dict[str, list[float]]) -> None:
    pod = pod_config(f"bench-{index}")
    config = container_config("main", pod)
    pod_id = timed(samples, "RunPodSandbox", lambda: cri.run_pod(pod))
    container_id = timed(samples, "CreateContainer", lambda: cri.create_container(pod_id, config, pod))
    timed(samples, "StartContainer", lambda: cri.start_container(container_id))
    timed(samples, "ExecSync", lambda: cri.exec_sync(container_id, "true"))
    timed(samples, "StopContainer", lambda: cri.stop_container(container_id))
    timed(samples, "RemoveContainer", lambda: cri.remove_container(container_id))
    timed(samples, "StopPodSandbox", lambda: cri.stop_pod(pod_id))
    timed(samples, "RemovePodSandbox", lambda: cri.remove_pod(pod_id))


@contextlib.contextmanager
def endpoint(address: str | None) -> Iterator[str]:
    if address:
        yield address
        return
    with running_containerd() as daemon:
        yield daemon.address


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=30, help="pod lifecycles to time (default 30)")
    parser.add_argument("--address", help="CRI endpoint to measure instead of a private containerd")
    args = parser.parse_args()

    samples: dict[str, list[float]] = {step: [] for step in STEPS}
    with endpoint(args.address) as address, Cri(address) as cri:
        version = cri.version()
        one_pod(cri, -1, {step: [] for step in STEPS})  # warm-up: first exec, page cache, shim binary
        for index in range(args.pods):
            one_pod(cri, index, samples)

    print(
        f"# {version.runtime_name} {version.runtime_version} at {args.address or 'private containerd'}, "
        f"{args.pods} pods, ms"
    )
    print(f"{'step':<18}{'p50':>8}{'p95':>8}{'max':>8}")
    for step in (*STEPS, "total"):
        values = samples[step] if step != "total" else [sum(v) for v in zip(*samples.values(), strict=True)]
        p95 = statistics.quantiles(values, n=20)[-1] if len(values) > 1 else values[0]
        print(f"{step:<18}{statistics.median(values):8.1f}{p95:8.1f}{max(values):8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
