"""Two half-GPU pods (`koordinator.sh/gpu-core: 50`, `koordinator.sh/gpu-memory-ratio: 50`, HAMi-core
isolation) share one GPU on the one-node cluster, in both node modes, each with HAMi-core's limits:
its memory limit half the GPU's memory and an SM limit of 50, /etc/ld.so.preload naming HAMi-core's
library mounted where the node has it (`node.hamiCore` in NRI mode, `[hooks.gpu.hami_core]` of
`crihook serve` in proxy mode), and a cache directory at /tmp/vgpu of its own. What the container
sees it prints itself, read from its log, and a process `kubectl exec` starts in it sees the same."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes.client.exceptions import ApiException

from tests.support.cluster import Cluster, ClusterError, eventually
from tests.support.clusterchart import kubectl
from tests.support.containerd import BUSYBOX_IMAGE

pytestmark = pytest.mark.cluster

NS = "default"
ALLOCATED = "scheduling.koordinator.sh/device-allocated"
ISOLATION = {"koordinator.sh/gpu-isolation-provider": "HAMi-core"}
HALF = {"koordinator.sh/gpu-core": "50", "koordinator.sh/gpu-memory-ratio": "50"}
MiB = 1 << 20
# what the container prints: its limits, its preload file and a digest of the library it names, and
# the cache directory's note it wrote there itself
REPORT = (
    'echo "visible=$NVIDIA_VISIBLE_DEVICES"; echo "sm=$CUDA_DEVICE_SM_LIMIT"; echo "mem=$CUDA_DEVICE_MEMORY_LIMIT_0";'
    ' echo "limits=$(env | grep -c "^CUDA_DEVICE_MEMORY_LIMIT_")"; lib=$(cat /etc/ld.so.preload);'
    ' echo "preload=$lib"; echo "lib=$(sha256sum < "$lib" | cut -d" " -f1)";'
    ' hostname > /tmp/vgpu/owner && echo "cache=$(cat /tmp/vgpu/owner)"; echo end; sleep 3600'
)


def half_pod(name: str) -> dict[str, object]:
    container = {
        "name": "main",
        "image": BUSYBOX_IMAGE,
        "imagePullPolicy": "Never",
        "command": ["sh", "-c", REPORT],
        "resources": {"limits": HALF},
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": ISOLATION},
        "spec": {"terminationGracePeriodSeconds": 1, "containers": [container]},
    }


def report(cluster: Cluster, name: str) -> dict[str, str]:
    """What the container printed, by key."""

    def log() -> str:
        try:
            return str(cluster.core().read_namespaced_pod_log(name, NS))
        except ApiException:
            return ""

    text = eventually(log, None, compare=lambda got, _: "end" in got.splitlines())
    if "end" not in text.splitlines():
        raise ClusterError(f"the container of {NS}/{name} did not report: {text!r}")
    return dict(m.groups() for m in re.finditer(r"^(\w+)=(.*)$", text, re.M))


def hami_paths(cluster: Cluster) -> tuple[Path, Path]:
    """(the library, the cache root) on the host as the node's crihook is configured."""
    assert cluster.sim is not None
    if cluster.mode == "proxy":  # crihook serve's [hooks.gpu.hami_core] (SimNode.proxy_config)
        return cluster.sim.hami / "libvgpu.so", cluster.sim.hami / "containers"
    return cluster.sim.hami / "libvgpu.so", cluster.base / "crihook-state" / "hami-core" / "containers"


@pytest.fixture
def halves(installed: Cluster) -> Iterator[list[str]]:
    names = ["half-a", "half-b"]
    yield names
    for name in names:
        installed.delete_pod(NS, name)


def test_two_half_gpu_pods_share_one_gpu_each_with_its_hami_core_limits(installed: Cluster, halves: list[str]) -> None:
    cluster = installed
    assert cluster.sim is not None
    for name in halves:
        cluster.create_pod(NS, half_pod(name))
    pods = [cluster.wait_pod_running(NS, name, timeout=120) for name in halves]
    allocations = [json.loads(p.metadata.annotations[ALLOCATED])["gpu"] for p in pods]
    assert [len(a) for a in allocations] == [1, 1]
    minors = {a[0]["minor"] for a in allocations}
    assert len(minors) == 1, allocations  # one GPU, shared
    (minor,) = minors
    library, cache_root = hami_paths(cluster)
    digest = hashlib.sha256(library.read_bytes()).hexdigest()
    for pod in pods:
        seen = report(cluster, pod.metadata.name)
        assert seen["visible"] == cluster.sim.uuid(minor)
        assert seen["sm"] == "50"
        assert seen["mem"] == f"{cluster.sim.memory(minor) // 2 // MiB}m" and seen["limits"] == "1"
        assert seen["preload"] == str(library) and seen["lib"] == digest
        assert seen["cache"] == pod.metadata.name
        # the container's /tmp/vgpu is its own directory on the host, by pod uid and container
        own = cache_root / f"{pod.metadata.uid}_main" / "owner"
        assert own.read_text().strip() == pod.metadata.name
        # a process kubectl exec starts in the container sees the same (the spec's env and mounts)
        script = 'echo "$CUDA_DEVICE_SM_LIMIT $CUDA_DEVICE_MEMORY_LIMIT_0"; cat /etc/ld.so.preload /tmp/vgpu/owner'
        done = kubectl(cluster, "exec", "-n", NS, pod.metadata.name, "--", "sh", "-c", script)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["50", seen["mem"], str(library), pod.metadata.name]


def test_a_share_is_refused_while_hami_core_is_missing_and_starts_once_installed(
    installed: Cluster, halves: list[str]
) -> None:
    """Without HAMi-core's library on the node the share would run unlimited (CRI mounts an empty
    directory in its place) or fail on runc's mount error: crihook refuses it, naming the path, and
    kubelet's next try after the library is back starts it."""
    cluster = installed
    name = halves[0]
    library, _ = hami_paths(cluster)
    away = library.with_name(f"{library.name}.away")
    library.rename(away)
    try:
        cluster.create_pod(NS, half_pod(name))

        def waiting() -> str:
            pod = cluster.core().read_namespaced_pod(name, NS)
            states = [s.state.waiting for s in pod.status.container_statuses or [] if s.state and s.state.waiting]
            return " ".join(w.message or "" for w in states)

        message = eventually(waiting, None, timeout=120, compare=lambda got, _: "missing on this node" in got)
        assert f"pod {NS}/{name} container main: HAMi-core isolation needs {library}, missing" in message
        assert not library.exists()  # nothing made in its place on the host
    finally:
        away.rename(library)
    cluster.wait_pod_running(NS, name, timeout=180)
    assert report(cluster, name)["preload"] == str(library)
