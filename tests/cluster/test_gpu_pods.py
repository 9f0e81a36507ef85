"""GPU pods scheduled through crihook on the one-node cluster, in both node modes: a Deployment asking
`nvidia.com/gpu: 2` gets exactly the two GPUs crihook allocated, an NVLink pair, in its environment
and its /dev, whether the chart's second kube-scheduler placed it (deployment mode) or the cluster's
own kube-scheduler with crihook as its extender (extender mode)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes.client import AppsV1Api

from tests.support.cluster import Cluster
from tests.support.clusterchart import use_extender, use_second_scheduler
from tests.support.clusterpods import reported, reporter

pytestmark = pytest.mark.cluster

ALLOCATED = "scheduling.koordinator.sh/device-allocated"


def gpu_deployment(name: str, resources: dict[str, str]) -> dict[str, Any]:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"terminationGracePeriodSeconds": 1, "containers": [reporter(resources)]},
            },
        },
    }


@pytest.fixture
def deployments(installed: Cluster) -> Iterator[list[str]]:
    """Names of Deployments a test makes in `default`; deleted, with their pods, after it."""
    made: list[str] = []
    yield made
    apps = AppsV1Api(installed.api())
    for name in made:
        apps.delete_namespaced_deployment(name, "default")
    for name in made:
        installed.wait_pods_gone("default", f"app={name}")


def run_deployment(cluster: Cluster, made: list[str], name: str, resources: dict[str, str]) -> Any:
    """Create it, wait for its pod to run; the pod."""
    AppsV1Api(cluster.api()).create_namespaced_deployment("default", gpu_deployment(name, resources))
    made.append(name)
    return cluster.wait_selected_pod_running("default", f"app={name}")


def nvlinked(cluster: Cluster, a: str, b: str) -> bool:
    """Whether the GPUs with these UUIDs share an NVLink in the simulated node's topology."""
    assert cluster.sim is not None
    by_uuid = {g["uuid"]: g for g in cluster.sim.doc["gpus"]}
    return any(link["remote"].lower() == by_uuid[b]["pci_bus_id"].lower() for link in by_uuid[a].get("nvlinks", []))


def check_an_nvlink_pair(cluster: Cluster, pod: Any) -> None:
    assert cluster.sim is not None
    assert ALLOCATED in (pod.metadata.annotations or {})
    visible, minors = reported(cluster, pod.metadata.name)
    uuids = visible.split(",")
    assert len(uuids) == 2 and len(set(uuids)) == 2
    minor_of = {g["uuid"]: g["minor"] for g in cluster.sim.doc["gpus"]}
    assert minors == sorted(minor_of[u] for u in uuids)
    assert nvlinked(cluster, *uuids)


def test_two_gpus_through_the_second_scheduler(installed: Cluster, deployments: list[str]) -> None:
    pod = run_deployment(installed, deployments, "pair", {"nvidia.com/gpu": "2"})
    assert pod.spec.scheduler_name == "crihook"  # the webhook handed it to the chart's kube-scheduler
    check_an_nvlink_pair(installed, pod)


@pytest.fixture
def extender(installed: Cluster) -> Iterator[Cluster]:
    """The release in extender mode for one test, then back to deployment mode."""
    use_extender(installed)
    try:
        yield installed
    finally:
        use_second_scheduler(installed)


def test_two_gpus_through_the_extender(extender: Cluster, deployments: list[str]) -> None:
    pod = run_deployment(extender, deployments, "pair-extended", {"nvidia.com/gpu": "2"})
    assert pod.spec.scheduler_name == "default-scheduler"
    check_an_nvlink_pair(extender, pod)
