"""`helm install` of charts/crihook on the one-node cluster, in both node modes: every pod Ready,
the node's GPUs published as its Device object and as node resources."""

from __future__ import annotations

import pytest

from tests.support.cluster import NODE_NAME, Cluster, eventually
from tests.support.clusterchart import NAMESPACE

pytestmark = pytest.mark.cluster


def test_every_pod_of_the_release_is_ready(installed: Cluster) -> None:
    pods = installed.core().list_namespaced_pod(NAMESPACE).items
    assert pods, "helm install made no pods"
    not_ready = [p.metadata.name for p in pods if not all(s.ready for s in p.status.container_statuses or [])]
    assert not_ready == []
    made = {p.metadata.labels.get("app.kubernetes.io/component") for p in pods}
    expected = {"scheduler", "kube-scheduler"} | ({"node"} if installed.mode == "nri" else set())
    assert made == expected


def test_the_device_object_lists_the_eight_gpus(installed: Cluster) -> None:
    assert installed.sim is not None
    want = sorted(g["uuid"] for g in installed.sim.doc["gpus"])

    def gpus() -> list[str]:
        device = installed.device(NODE_NAME)
        return sorted(d["id"] for d in (device or {}).get("spec", {}).get("devices", []) if d["type"] == "gpu")

    assert eventually(gpus, want) == want


def test_the_node_advertises_the_gpus_as_resources(installed: Cluster) -> None:
    def allocatable() -> dict[str, str]:
        node = installed.core().read_node(NODE_NAME)
        return {k: v for k, v in node.status.allocatable.items() if k.startswith(("nvidia.com/", "koordinator.sh/"))}

    want = {"nvidia.com/gpu": "8", "koordinator.sh/gpu-core": "800", "koordinator.sh/gpu-memory-ratio": "800"}
    got = eventually(allocatable, want, compare=lambda got, want: want.items() <= got.items())
    assert want.items() <= got.items()
