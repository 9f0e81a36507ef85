"""`helm upgrade` and `helm uninstall` of the release on the real cluster, in both node modes.
This module runs last in each mode: it uninstalls the release the others use."""

from __future__ import annotations

import pytest
from kubernetes.client import AdmissionregistrationV1Api, ApiextensionsV1Api, AppsV1Api

from tests.support.cluster import NODE_NAME, Cluster, eventually
from tests.support.clusterchart import NAMESPACE, RELEASE, uninstall, upgrade, user_values

pytestmark = pytest.mark.cluster


def pod_uids(cluster: Cluster) -> dict[str, set[str]]:
    """The release's pods' UIDs, by component."""
    found: dict[str, set[str]] = {}
    for pod in cluster.core().list_namespaced_pod(NAMESPACE).items:
        if pod.metadata.deletion_timestamp is None:
            found.setdefault(pod.metadata.labels["app.kubernetes.io/component"], set()).add(pod.metadata.uid)
    return found


def test_an_upgrade_restarts_only_what_its_value_changes(installed: Cluster) -> None:
    before = pod_uids(installed)
    values = user_values(installed)
    values["scheduler"]["logLevel"] = "debug"
    upgrade(installed, values)
    after = eventually(lambda: pod_uids(installed), None, compare=lambda got, _: len(got.get("scheduler", ())) == 1)
    assert after.keys() == before.keys()
    assert after["scheduler"] != before["scheduler"]  # the value it changed
    assert {k: v for k, v in after.items() if k != "scheduler"} == {k: v for k, v in before.items() if k != "scheduler"}


def test_uninstall_leaves_what_the_docs_say(installed: Cluster) -> None:
    uninstall(installed)
    assert eventually(lambda: pod_uids(installed), {}) == {}
    apps = AppsV1Api(installed.api())
    assert apps.list_namespaced_deployment(NAMESPACE).items == []
    assert apps.list_namespaced_daemon_set(NAMESPACE).items == []
    hooks = AdmissionregistrationV1Api(installed.api())
    names = [w.metadata.name for w in hooks.list_mutating_webhook_configuration().items]
    names += [w.metadata.name for w in hooks.list_validating_webhook_configuration().items]
    assert not [n for n in names if n.startswith(RELEASE)]
    # what stays (docs/helm.md, "Uninstall"): the CRD and the Device, the node's labels and resources
    crds = [c.metadata.name for c in ApiextensionsV1Api(installed.api()).list_custom_resource_definition().items]
    assert "devices.scheduling.koordinator.sh" in crds
    assert installed.device(NODE_NAME) is not None
    node = installed.core().read_node(NODE_NAME)
    assert "node.koordinator.sh/gpu-model" in node.metadata.labels
    assert node.status.allocatable.get("koordinator.sh/gpu-core") == "800"
