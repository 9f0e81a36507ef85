"""The cluster side fails safe, on the one-node cluster with the chart installed: with no scheduler
replica answering, pods that ask for no GPU are still created (the webhooks never see them) while a
GPU pod is refused, not admitted unconverted; a `/bind` from a caller without kube-scheduler's client
certificate is refused and binds nothing; the chart installs as a subchart of an umbrella chart
that sets Helm's `global` values; the node DaemonSet runs on a node labelled only the way
NVIDIA's device plugin charts find GPU nodes (node feature discovery's PCI vendor label); the node
pods' metrics are scraped over HTTPS on the chart's port, as its scrape annotations say, with a token
of its metrics-reader role, every series labelled with the node, and refused without one or over
plain HTTP."""

from __future__ import annotations

import json
import socket
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client import AppsV1Api, RbacAuthorizationV1Api
from kubernetes.client.exceptions import ApiException

from tests.support.cluster import NODE_NAME, Cluster, ClusterError, eventually
from tests.support.clusterchart import NAMESPACE, RELEASE, run_helm
from tests.support.containerd import BUSYBOX_IMAGE
from tests.support.helm import CHART

pytestmark = pytest.mark.cluster

NS = "default"
SCHEDULER = f"{RELEASE}-scheduler"
NODE_DS = f"{RELEASE}-node"
GPU_LABEL = "nvidia.com/gpu.present"
NFD_LABEL = "feature.node.kubernetes.io/pci-10de.present"  # node feature discovery: NVIDIA's PCI vendor id


def sleeper(name: str, gpus: int = 0) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "main",
        "image": BUSYBOX_IMAGE,
        "imagePullPolicy": "Never",
        "command": ["sleep", "3600"],
    }
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"terminationGracePeriodSeconds": 1, "containers": [container]},
    }


def scale(cluster: Cluster, replicas: int) -> None:
    """The scheduler Deployment to `replicas`, waiting until that many pods of it exist and run."""
    AppsV1Api(cluster.api()).patch_namespaced_deployment_scale(SCHEDULER, NAMESPACE, {"spec": {"replicas": replicas}})
    selector = "app.kubernetes.io/component=scheduler"
    if replicas == 0:
        cluster.wait_pods_gone(NAMESPACE, selector)
    else:
        cluster.wait_selected_pod_running(NAMESPACE, selector, timeout=120)


@pytest.fixture
def no_scheduler(installed: Cluster) -> Iterator[Cluster]:
    scale(installed, 0)
    try:
        yield installed
    finally:
        scale(installed, 1)


def test_pods_without_gpus_are_created_while_no_scheduler_replica_answers(no_scheduler: Cluster) -> None:
    cluster = no_scheduler
    try:
        cluster.create_pod(NS, sleeper("plain"))
        assert cluster.wait_pod_running(NS, "plain").spec.node_name == NODE_NAME
        with pytest.raises(ApiException) as refused:
            cluster.create_pod(NS, sleeper("wants-gpu", gpus=1))
        assert refused.value.status == 500 and "crihook" in str(refused.value.body)
    finally:
        cluster.delete_pod(NS, "plain")
        cluster.delete_pod(NS, "wants-gpu")


def scheduler_url(cluster: Cluster, path: str) -> str:
    service = cluster.core().read_namespaced_service(f"{RELEASE}-scheduler-leader", NAMESPACE)
    return f"https://{service.spec.cluster_ip}:443{path}"


def test_a_bind_without_kube_schedulers_certificate_is_refused(installed: Cluster) -> None:
    cluster = installed
    pending = sleeper("unbound")
    pending["spec"]["schedulerName"] = "nobody"  # no scheduler binds it: only the call below could
    cluster.create_pod(NS, pending)
    try:
        uid = cluster.core().read_namespaced_pod("unbound", NS).metadata.uid
        args = {"podName": "unbound", "podNamespace": NS, "podUID": uid, "node": NODE_NAME}
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE  # the caller trusts anything; the server must not
        request = urllib.request.Request(
            scheduler_url(cluster, "/bind"),
            data=json.dumps(args).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )

        def answer() -> int | str:
            """The HTTP status, or why there was none: the leader's Service has no endpoint until
            a replica is elected (after the test before, up to a lease's duration)."""
            try:
                with urllib.request.urlopen(request, context=context, timeout=10) as reply:
                    return int(reply.status)
            except urllib.error.HTTPError as e:
                return int(e.code)
            except OSError as e:
                return repr(e)

        assert eventually(answer, 403, timeout=60) == 403
        assert cluster.core().read_namespaced_pod("unbound", NS).spec.node_name is None
    finally:
        cluster.delete_pod(NS, "unbound")


@pytest.fixture
def nfd_labelled(installed: Cluster) -> Iterator[Cluster]:
    """The node labelled only as node feature discovery labels a GPU node, then as before."""
    if installed.mode != "nri":
        pytest.skip("proxy mode runs no node DaemonSet")
    core = installed.core()
    core.patch_node(NODE_NAME, {"metadata": {"labels": {GPU_LABEL: None, NFD_LABEL: "true"}}})
    try:
        yield installed
    finally:
        core.patch_node(NODE_NAME, {"metadata": {"labels": {GPU_LABEL: "true", NFD_LABEL: None}}})


def test_the_node_daemonset_runs_on_a_node_nvidia_charts_would_use(nfd_labelled: Cluster) -> None:
    cluster = nfd_labelled
    labels = cluster.core().read_node(NODE_NAME).metadata.labels
    assert GPU_LABEL not in labels and labels[NFD_LABEL] == "true"

    def scheduled() -> tuple[int, int]:
        status = AppsV1Api(cluster.api()).read_namespaced_daemon_set(NODE_DS, NAMESPACE).status
        return status.desired_number_scheduled, status.number_ready

    assert eventually(scheduled, (1, 1), timeout=60) == (1, 1)
    pod = cluster.wait_selected_pod_running(NAMESPACE, "app.kubernetes.io/component=node", timeout=60)
    if pod.spec.node_name != NODE_NAME:
        raise ClusterError(f"the node pod runs on {pod.spec.node_name}")


def test_the_chart_installs_as_a_subchart_of_an_umbrella_chart(installed: Cluster, tmp_path: Path) -> None:
    """An umbrella chart depending on charts/crihook, with Helm's `global` values, installed beside
    the suite's release: its own scheduler only (the Device CRD and the node pods are the first
    release's; extender mode, so no second kube-scheduler named like the first one's)."""
    cluster = installed
    umbrella = tmp_path / "umbrella"
    umbrella.mkdir()
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["version"]
    chart = {
        "apiVersion": "v2",
        "name": "umbrella",
        "version": "0.1.0",
        "dependencies": [{"name": "crihook", "version": version, "repository": f"file://{CHART}"}],
    }
    (umbrella / "Chart.yaml").write_text(yaml.safe_dump(chart))
    values = {
        "global": {"imageRegistry": "registry.example"},
        "crihook": {
            "crd": {"install": False},
            "node": {"enabled": False},
            "scheduler": {"replicas": 1},
            "kubeScheduler": {"mode": "extender"},
        },
    }
    (umbrella / "values.yaml").write_text(yaml.safe_dump(values))
    run_helm(cluster, "dependency", "update", str(umbrella))
    namespace = "umbrella"
    run_helm(
        cluster, "install", "umbrella", str(umbrella), "--namespace", namespace, "--create-namespace",
        "--wait", "--timeout=240s",
    )  # fmt: skip
    try:
        pods = cluster.core().list_namespaced_pod(namespace).items
        assert [p.metadata.labels.get("app.kubernetes.io/component") for p in pods] == ["scheduler"]
        assert all(s.ready for p in pods for s in p.status.container_statuses or [])
    finally:
        run_helm(cluster, "uninstall", "umbrella", "--namespace", namespace, "--wait", "--timeout=120s")
        cluster.core().delete_namespace(namespace)


@pytest.fixture
def scraper(installed: Cluster) -> Iterator[str]:
    """A bearer token of a service account bound to the chart's metrics-reader ClusterRole, as the
    PodMonitor's scrape uses."""
    if installed.mode != "nri":
        pytest.skip("proxy mode runs no node pods")
    core, rbac = installed.core(), RbacAuthorizationV1Api(installed.api())
    core.create_namespaced_service_account(NS, {"metadata": {"name": "scraper"}})
    binding = {
        "metadata": {"name": "crihook-test-scraper"},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": f"{RELEASE}-metrics-reader",
        },
        "subjects": [{"kind": "ServiceAccount", "name": "scraper", "namespace": NS}],
    }
    rbac.create_cluster_role_binding(binding)
    try:
        token = core.create_namespaced_service_account_token("scraper", NS, {"spec": {"expirationSeconds": 600}})
        yield str(token.status.token)
    finally:
        rbac.delete_cluster_role_binding("crihook-test-scraper")
        core.delete_namespaced_service_account("scraper", NS)


def scrape(url: str, token: str | None) -> tuple[int, str]:
    """(HTTP status, body); 0 and the error when no answer came. HTTPS as the chart's scrape
    configurations go: without verification, the node pods' certificates being self-signed."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        request = urllib.request.Request(url, headers=headers)
        with urllib.request.urlopen(request, timeout=10, context=context) as reply:
            return int(reply.status), reply.read().decode()
    except urllib.error.HTTPError as e:
        return int(e.code), ""
    except OSError as e:
        return 0, repr(e)


def test_node_metrics_are_scraped_through_the_charts_port_with_a_node_label(installed: Cluster, scraper: str) -> None:
    cluster = installed
    pod = cluster.wait_selected_pod_running(NAMESPACE, "app.kubernetes.io/component=node")
    annotations = pod.metadata.annotations
    assert annotations["prometheus.io/scrape"] == "true"
    scheme, port, path = (annotations[f"prometheus.io/{k}"] for k in ("scheme", "port", "path"))
    assert scheme == "https"
    assert [p.container_port for c in pod.spec.containers for p in c.ports or [] if p.name == "metrics"] == [int(port)]
    url = f"{scheme}://{pod.status.pod_ip}:{port}{path}"  # the node pods use the host's network
    status, text = eventually(lambda: scrape(url, scraper), None, compare=lambda got, _: got[0] == 200)
    assert status == 200, text
    series = [line for line in text.splitlines() if line.startswith("crihook_")]
    assert series and all(f'node="{NODE_NAME}"' in line for line in series)
    assert scrape(url, None)[0] == 401
    # the certificate each node pod made for itself names its node
    served = ssl.get_server_certificate((pod.status.pod_ip, int(port)), timeout=10)
    context = ssl.create_default_context(cadata=served)
    with (
        socket.create_connection((pod.status.pod_ip, int(port)), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=NODE_NAME) as tls,
    ):
        assert tls.version() in ("TLSv1.2", "TLSv1.3")
    # plain HTTP on that port is never answered: a token sent so would have crossed in the clear
    status, error = scrape(url.replace("https://", "http://", 1), scraper)
    assert status == 0, error
