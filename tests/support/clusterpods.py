"""Workloads of the cluster tests: a container that reports what GPUs it was given, and reading
that report back from its log."""

from __future__ import annotations

import re
from typing import Any

from kubernetes.client.exceptions import ApiException

from tests.support.cluster import Cluster, ClusterError, eventually
from tests.support.containerd import BUSYBOX_IMAGE

# what each container prints at start (its NVIDIA_VISIBLE_DEVICES and its /dev/nvidiaN), then it sleeps
REPORT = (
    'echo "visible=$NVIDIA_VISIBLE_DEVICES"; echo "dev=$(ls /dev | grep "^nvidia[0-9]" | tr "\\n" " ")"; sleep 3600'
)


def reporter(resources: dict[str, str] | None = None, image: str = BUSYBOX_IMAGE) -> dict[str, Any]:
    """The reporting container, with these resource limits."""
    container: dict[str, Any] = {"name": "main", "image": image, "imagePullPolicy": "Never"}
    container["command"] = ["sh", "-c", REPORT]
    if resources:
        container["resources"] = {"limits": resources}
    return container


def reporting_pod(name: str, container: dict[str, Any], annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": annotations or {}},
        "spec": {"terminationGracePeriodSeconds": 1, "containers": [container]},
    }


def reported(cluster: Cluster, name: str, namespace: str = "default") -> tuple[str, list[int]]:
    """What a running reporting container printed: its NVIDIA_VISIBLE_DEVICES and the minors of its
    /dev/nvidiaN."""

    def log() -> str:
        try:
            return str(cluster.core().read_namespaced_pod_log(name, namespace))
        except ApiException:  # a kubelet just restarted answers 404 until it knows its pods again
            return ""

    text = eventually(log, None, compare=lambda got, _: "dev=" in got)
    visible = re.search(r"^visible=(.*)$", text, re.M)
    dev = re.search(r"^dev=(.*)$", text, re.M)
    if visible is None or dev is None:
        raise ClusterError(f"the container of {namespace}/{name} did not report: {text!r}")
    return visible.group(1), sorted(int(d.removeprefix("nvidia")) for d in dev.group(1).split())
