"""What the webhook and the hooks decide for pods on the real cluster, in both node modes: a GPU-model
annotation places only on that model; a forged allocation annotation is refused with a message
kubectl shows; an image that asks every GPU through NVIDIA_VISIBLE_DEVICES=all gets none."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import yaml

from tests.support.cluster import Cluster, eventually
from tests.support.clusterchart import CUDA_ALL_IMAGE, cuda_all_archive, kubectl
from tests.support.clusterpods import reported, reporter, reporting_pod

pytestmark = pytest.mark.cluster

ALLOCATED = "scheduling.koordinator.sh/device-allocated"


@pytest.fixture
def pods(installed: Cluster) -> Iterator[list[str]]:
    """Names of the pods a test makes in `default`; deleted after it."""
    made: list[str] = []
    yield made
    for name in made:
        installed.delete_pod("default", name)


def test_a_model_annotation_places_only_on_that_model(installed: Cluster, pods: list[str]) -> None:
    for name, model in (("v100", "V100"), ("h100", "H100")):
        gpu = reporter({"nvidia.com/gpu": "1"})
        installed.create_pod("default", reporting_pod(name, gpu, {"nvidia.com/use-gputype": model}))
        pods.append(name)
    assert installed.wait_pod_running("default", "v100").spec.node_name
    events = installed.core().list_namespaced_event

    def refused() -> list[str]:
        found = events("default", field_selector="involvedObject.name=h100,reason=FailedScheduling").items
        return [e.message for e in found]

    said = eventually(refused, None, compare=lambda got, _: bool(got))
    assert said, "the H100 pod was neither placed nor refused"
    assert installed.core().read_namespaced_pod("h100", "default").spec.node_name is None


def test_a_forged_allocation_is_refused_with_a_message_kubectl_shows(installed: Cluster) -> None:
    forged = reporting_pod("forged", reporter({"nvidia.com/gpu": "1"}), {ALLOCATED: '{"gpu":[{"minor":0}]}'})
    done = kubectl(installed, "create", "-f", "-", stdin=yaml.safe_dump(forged))
    assert done.returncode != 0
    assert "denied the request" in done.stderr
    assert (
        "annotation scheduling.koordinator.sh/device-allocated is written by the crihook scheduler only" in done.stderr
    )
    assert installed.core().list_namespaced_pod("default", field_selector="metadata.name=forged").items == []


def test_an_image_asking_every_gpu_gets_none(installed: Cluster, pods: list[str]) -> None:
    assert installed.containerd is not None
    installed.containerd.import_image(cuda_all_archive())
    installed.create_pod("default", reporting_pod("cuda-all", reporter(image=CUDA_ALL_IMAGE)))
    pods.append("cuda-all")
    installed.wait_pod_running("default", "cuda-all")
    assert reported(installed, "cuda-all") == ("void", [])
