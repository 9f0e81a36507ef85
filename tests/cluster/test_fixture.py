"""The cluster fixture itself: a pod runs on the node in each mode, and a closed cluster leaves
nothing on the host. This module runs before the others (pytest collects it first), so the
teardown check below starts its cluster while no session cluster runs."""

from __future__ import annotations

import ipaddress
import subprocess

import pytest

from tests.support.cluster import NODE_NAME, Cluster, missing_requirements, running_cluster
from tests.support.containerd import BUSYBOX_IMAGE

pytestmark = pytest.mark.cluster


def sleeper(name: str) -> dict[str, object]:
    """A pod of the busybox test image that sleeps until deleted."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {"name": "main", "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never", "command": ["sleep", "3600"]}
            ],
        },
    }


def test_closed_cluster_leaves_nothing_behind() -> None:
    reason = missing_requirements()
    if reason is not None:
        pytest.skip(reason)
    with running_cluster("nri") as cluster:
        cluster.create_pod("default", sleeper("leftover"))
        cluster.wait_pod_running("default", "leftover")
        assert cluster.leftovers() != []  # the check sees a running cluster
    assert cluster.leftovers() == []


def test_pod_runs_with_its_own_address(cluster: Cluster) -> None:
    cluster.create_pod("default", sleeper("smoke"))
    try:
        pod = cluster.wait_pod_running("default", "smoke")
        assert pod.spec.node_name == NODE_NAME
        assert ipaddress.ip_address(pod.status.pod_ip) in cluster.network.pods
        assert cluster.started_in > 0
    finally:
        cluster.delete_pod("default", "smoke")


def test_the_nodes_address_keeps_its_mac_as_pods_come_and_go(cluster: Cluster) -> None:
    """A port with a lower MAC than the bridge's joins and leaves: the bridge keeps its own, so the
    pods' ARP entries for the node stay right (else webhook calls and probes time out)."""
    before = cluster.network.mac()
    port = f"crihook-t{cluster.network.index}"
    subprocess.run(
        ["ip", "link", "add", port, "address", "02:00:00:00:00:01", "type", "veth", "peer", "name", f"{port}p"],
        check=True,
    )
    try:
        subprocess.run(["ip", "link", "set", port, "master", cluster.network.bridge], check=True)
        assert cluster.network.mac() == before
    finally:
        subprocess.run(["ip", "link", "del", port], check=True)
    assert cluster.network.mac() == before
