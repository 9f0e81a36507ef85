"""GPU pods created while crihook is away from the node, on the one-node cluster.

NRI mode: the node pod is deleted and, while it is gone, pods are created that the runtime makes
without crihook. Legitimate ones: a pod crihook's scheduler granted all 8 GPUs whose CUDA image
asks for `all`, and a pod without GPUs. Ones that reach GPUs nobody granted them: a pod whose env
says `NVIDIA_VISIBLE_DEVICES=all` (restarted by kubelet), a CUDA image's `all` and an env naming
NVML index 3, neither restarted; none of them asks for a GPU. The DaemonSet makes the node pod
again; its plugin synchronizes with containerd and stops (CRI StopContainer) every container that
reaches an ungranted GPU, and no other. The gap is held open by stopping kube-controller-manager
(the DaemonSet's controller) for it, so the pods are made while no plugin is connected, every time.

Proxy mode: kubelet reaches the runtime only through `crihook serve`, so with it down no container
is made at all (the node goes NotReady). What applies is that every pod created meanwhile is made
through crihook once it is back: the ungranted ones get no GPU, the granted one its 8.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from tests.support.cluster import NODE_NAME, Cluster, ClusterError, eventually
from tests.support.clusterchart import CUDA_ALL_IMAGE, NAMESPACE, cuda_all_archive, wait_node_plugin
from tests.support.clusterpods import reported, reporter, reporting_pod

pytestmark = pytest.mark.cluster

NS = "default"
NODE_PODS = "app.kubernetes.io/component=node"
GRANTED = ["granted-all", "no-gpu"]  # (a): must keep running, never restarted
UNGRANTED = ["env-all", "image-all", "env-index"]  # (b): must not keep reaching a GPU


def outage_pods() -> dict[str, dict[str, Any]]:
    def pod(name: str, container: dict[str, Any], restart: str = "Always") -> dict[str, Any]:
        made = reporting_pod(name, container)
        made["spec"]["restartPolicy"] = restart
        return made

    def env(value: str) -> dict[str, Any]:
        container = reporter()
        container["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": value}]
        return container

    return {
        "granted-all": pod("granted-all", reporter({"nvidia.com/gpu": "8"}, image=CUDA_ALL_IMAGE)),
        "no-gpu": pod("no-gpu", reporter()),
        "env-all": pod("env-all", env("all")),
        "image-all": pod("image-all", reporter(image=CUDA_ALL_IMAGE), restart="Never"),
        "env-index": pod("env-index", env("3"), restart="Never"),
    }


@pytest.fixture
def outage(installed: Cluster) -> Iterator[Cluster]:
    assert installed.containerd is not None
    installed.containerd.import_image(cuda_all_archive())
    yield installed
    for name in GRANTED + UNGRANTED:
        installed.delete_pod(NS, name)


def status(cluster: Cluster, name: str) -> Any:
    """The pod's one container status (None before kubelet reported one)."""
    statuses = cluster.core().read_namespaced_pod(name, NS).status.container_statuses or []
    return statuses[0] if statuses else None


def wait_running(cluster: Cluster, names: list[str], timeout: float = 120.0) -> None:
    for name in names:
        cluster.wait_pod_running(NS, name, timeout=timeout)


def delete_node_pod(cluster: Cluster, timeout: float = 60.0) -> str:
    """Delete the node pod and wait until kubelet has stopped its containers and removed it (it
    removes the object only then): the plugin is gone from containerd. Its name."""
    core = cluster.core()
    (pod,) = core.list_namespaced_pod(NAMESPACE, label_selector=NODE_PODS).items
    name = pod.metadata.name
    core.delete_namespaced_pod(name, NAMESPACE)

    def gone() -> bool:
        try:
            core.read_namespaced_pod(name, NAMESPACE)
        except ApiException as e:
            if e.status == 404:
                return True
            raise
        return False

    if not eventually(gone, True, timeout):
        raise ClusterError(f"node pod {name} still there {timeout}s after its deletion")
    return name


def evicted(cluster: Cluster, name: str, first: str) -> bool:
    """Whether the container `first` of the pod is no longer running (stopped, maybe restarted)."""
    now = status(cluster, name)
    if now is None:
        return False
    if now.container_id != first:
        return True
    return now.state.running is None


def test_ungranted_containers_made_while_the_node_pod_is_gone_are_stopped(outage: Cluster) -> None:
    cluster = outage
    if cluster.mode != "nri":
        pytest.skip("proxy mode has no node pod; test_pods_made_while_crihook_serve_is_down covers it")
    pods = outage_pods()
    with cluster.paused("kube-controller-manager"):
        old = delete_node_pod(cluster)
        for made in pods.values():
            cluster.create_pod(NS, made)
        wait_running(cluster, list(pods))
        # made without crihook: the env reaches the runtime as the pod and image said
        before = {name: status(cluster, name).container_id for name in pods}
        assert reported(cluster, "granted-all") == ("all", [])
        assert reported(cluster, "env-all")[0] == "all" and reported(cluster, "env-index")[0] == "3"
    new = cluster.wait_selected_pod_running(NAMESPACE, NODE_PODS, timeout=120)
    assert new.metadata.name != old
    wait_node_plugin(cluster)
    for name in UNGRANTED:
        assert eventually(lambda n=name: evicted(cluster, n, before[n]), True, timeout=90), name
    # kubelet made env-all's container again, through crihook: no GPU left to reach
    cluster.wait_pod_running(NS, "env-all", timeout=120)
    assert reported(cluster, "env-all") == ("void", [])
    for name in ("image-all", "env-index"):  # restartPolicy Never: stopped for good
        assert status(cluster, name).state.running is None
    # the legitimate containers: the same ones, running, never restarted
    for name in GRANTED:
        now = status(cluster, name)
        assert (now.container_id, now.restart_count, now.state.running is not None) == (before[name], 0, True)


def node_ready(cluster: Cluster) -> bool:
    node = cluster.core().read_node(NODE_NAME)
    return any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])


@contextlib.contextmanager
def serve_down(cluster: Cluster, timeout: float = 120.0) -> Iterator[None]:
    """`crihook serve` stopped (SIGTERM, by pid) until kubelet reports the node NotReady (it can
    not reach its runtime); started again after the block, and the node Ready again."""
    assert cluster.crihook is not None
    cluster.crihook.stop()
    try:
        if eventually(lambda: node_ready(cluster), False, timeout):
            raise ClusterError(f"the node still Ready {timeout}s after crihook serve stopped")
        yield
    finally:
        cluster.crihook.start()
    if not eventually(lambda: node_ready(cluster), True, timeout):
        raise ClusterError(f"the node not Ready {timeout}s after crihook serve started again")


def test_pods_made_while_crihook_serve_is_down(outage: Cluster) -> None:
    cluster = outage
    if cluster.mode != "proxy":
        pytest.skip("NRI mode: kubelet reaches containerd without crihook (the test above)")
    assert cluster.sim is not None
    pods = outage_pods()
    began = time.monotonic()
    with serve_down(cluster):
        for made in pods.values():
            cluster.create_pod(NS, made)
        for name in pods:  # nothing runs while kubelet has no runtime
            assert status(cluster, name) is None or status(cluster, name).state.running is None
    wait_running(cluster, list(pods), timeout=max(60.0, 240.0 - (time.monotonic() - began)))
    every = sorted(g["minor"] for g in cluster.sim.doc["gpus"])
    visible, minors = reported(cluster, "granted-all")
    assert minors == every and len(visible.split(",")) == len(every)
    for name in UNGRANTED:
        assert reported(cluster, name) == ("void", []), name
    for name in pods:
        assert status(cluster, name).restart_count == 0, name
