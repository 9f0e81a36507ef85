"""kubelet and containerd restarted under a running GPU pod, in both node modes: the pod keeps its
container and its GPUs, nothing is created again, and crihook hooked the container once."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.cluster import Cluster, eventually
from tests.support.clusterchart import NAMESPACE
from tests.support.clusterpods import reported, reporter, reporting_pod

pytestmark = pytest.mark.cluster


@pytest.fixture
def gpu_pod(installed: Cluster) -> Iterator[str]:
    installed.create_pod("default", reporting_pod("survivor", reporter({"nvidia.com/gpu": "2"})))
    installed.wait_pod_running("default", "survivor")
    yield "survivor"
    installed.delete_pod("default", "survivor")


def hooked(cluster: Cluster, container_id: str) -> int:
    """How many times crihook logged creating this container (its first 13 characters)."""
    short = container_id.removeprefix("containerd://")[:13]
    if cluster.crihook is not None:
        text = cluster.crihook.log_text()
    else:
        core = cluster.core()
        pods = core.list_namespaced_pod(NAMESPACE, label_selector="app.kubernetes.io/component=node").items
        text = "".join(core.read_namespaced_pod_log(p.metadata.name, NAMESPACE, container="nri") for p in pods)
    return sum(1 for line in text.splitlines() if "container created" in line and f"id={short}" in line)


@pytest.mark.parametrize("restart", ["kubelet", "containerd"])
def test_a_restart_loses_nothing_and_hooks_nothing_twice(installed: Cluster, gpu_pod: str, restart: str) -> None:
    before = installed.core().read_namespaced_pod(gpu_pod, "default")
    (status,) = before.status.container_statuses
    seen = reported(installed, gpu_pod)
    assert len(seen[1]) == 2
    if restart == "kubelet":
        installed.restart_kubelet()
    else:
        installed.restart_containerd()

    def container() -> tuple[str, int, bool]:
        (now,) = installed.core().read_namespaced_pod(gpu_pod, "default").status.container_statuses
        return now.container_id, now.restart_count, bool(now.ready)

    assert eventually(container, (status.container_id, 0, True)) == (status.container_id, 0, True)
    assert reported(installed, gpu_pod) == seen
    assert hooked(installed, status.container_id) == 1
