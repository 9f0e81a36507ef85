"""The ResourceSlice publisher against the fake API server, over the fake NVML library: the pool as
discovery finds it, written only when it changes, the generation one higher each time, an unhealthy
GPU or one crihook's allocator gave out republished at the next round."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import kubernetes_validate
import pytest

from crihook.base import dra
from crihook.devices import slices
from crihook.devices.nvml import GpuIndex, Nvml
from crihook.dra.publisher import Publisher, features_for
from crihook.simnode.fakenvml import FakeNvml
from tests.support.fakekube import FakeKube

NODE = "node-a"
FEATURES = slices.Features(consumable_capacity=True, device_taints=True)


@pytest.fixture
def cluster(fake_nvml: Callable[[str], FakeNvml]) -> Iterator[tuple[FakeKube, FakeNvml, Publisher]]:
    fake = fake_nvml("dgx-h100")
    nvml = Nvml(str(fake.library), str(fake.sys_root))
    with FakeKube() as kube:
        kube.create("nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        yield kube, fake, Publisher(NODE, kube.api_client(), nvml, GpuIndex(nvml), features=FEATURES)
    nvml.close()


def pool(kube: FakeKube) -> list[dict[str, Any]]:
    return sorted(kube.list("resourceslices"), key=lambda s: s["metadata"]["name"])


def devices(kube: FakeKube) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for s in pool(kube) for d in s["spec"]["devices"]}


def test_the_pool_is_published_once_and_kept(cluster: tuple[FakeKube, FakeNvml, Publisher]) -> None:
    kube, fake, pub = cluster
    first = pub.run_once()
    assert first.writes == [f"create {NODE}-{dra.DRIVER}-0"] and first.generation == 1
    (s,) = pool(kube)
    assert s["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
    assert s["metadata"]["ownerReferences"][0]["uid"] == kube.get("nodes", NODE)["metadata"]["uid"]
    found = devices(kube)
    assert len(found) == len(fake.doc["gpus"])
    g0 = found[dra.device_name(fake.doc["gpus"][0]["minor"])]
    assert g0["attributes"]["uuid"] == {"string": fake.doc["gpus"][0]["uuid"]}
    assert g0["attributes"]["cudaComputeCapability"] == {"version": "9.0.0"}
    assert g0["attributes"]["resource.kubernetes.io/pcieRoot"]["string"].startswith("pci0000:")
    assert {d["attributes"]["nvlinkPartition8"]["string"] for d in found.values()} == {"8-0"}
    assert len({d["attributes"]["nvlinkPartition2"]["string"] for d in found.values()}) == 4
    kubernetes_validate.validate(s, "1.36.0", strict=True)
    again = pub.run_once()
    assert again.writes == [] and again.generation == 1
    assert pool(kube)[0]["metadata"]["resourceVersion"] == s["metadata"]["resourceVersion"]


def test_an_unhealthy_gpu_is_tainted_at_the_next_round(cluster: tuple[FakeKube, FakeNvml, Publisher]) -> None:
    kube, fake, pub = cluster
    pub.run_once()
    fake.doc["gpus"][3]["row_remap_failure"] = True
    fake.write()
    fake.reload()
    done = pub.run_once()
    assert done.writes == [f"update {NODE}-{dra.DRIVER}-0"] and done.generation == 2
    sick = devices(kube)[dra.device_name(fake.doc["gpus"][3]["minor"])]
    assert sick["taints"] == [{"key": dra.TAINT_UNHEALTHY, "value": "true", "effect": "NoSchedule"}]
    assert pool(kube)[0]["spec"]["pool"]["generation"] == 2


def test_a_gpu_crihooks_allocator_gave_out_leaves_the_pool(cluster: tuple[FakeKube, FakeNvml, Publisher]) -> None:
    kube, fake, pub = cluster
    pub.run_once()
    minor = fake.doc["gpus"][5]["minor"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "annotated",
            "namespace": "default",
            "annotations": {"scheduling.koordinator.sh/device-allocated": f'{{"gpu": [{{"minor": {minor}}}]}}'},
        },
        "spec": {"nodeName": NODE, "containers": [{"name": "c", "image": "x"}]},
    }
    kube.create("pods", pod, namespace="default")
    done = pub.run_once()
    assert done.generation == 2
    assert dra.device_name(minor) not in devices(kube) and len(devices(kube)) == len(fake.doc["gpus"]) - 1
    kube.delete("pods", "annotated", namespace="default")
    assert pub.run_once().generation == 3 and dra.device_name(minor) in devices(kube)


def test_slices_of_another_pool_size_are_removed(cluster: tuple[FakeKube, FakeNvml, Publisher]) -> None:
    kube, _, pub = cluster
    stale = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{NODE}-{dra.DRIVER}-1"},
        "spec": {
            "driver": dra.DRIVER,
            "nodeName": NODE,
            "pool": {"name": NODE, "generation": 4, "resourceSliceCount": 2},
            "devices": [],
        },
    }
    kube.create("resourceslices", stale)
    done = pub.run_once()
    assert done.generation == 5
    assert done.writes == [f"create {NODE}-{dra.DRIVER}-0", f"delete {NODE}-{dra.DRIVER}-1"]


def test_no_nvml_keeps_what_was_published(cluster: tuple[FakeKube, FakeNvml, Publisher]) -> None:
    kube, fake, pub = cluster
    pub.run_once()
    pub.nvml = Nvml("/nonexistent/libnvidia-ml.so.1", str(fake.sys_root))
    done = pub.run_once()
    assert done.reason.startswith("NVML:") and done.writes == []
    assert len(devices(kube)) == len(fake.doc["gpus"])


@pytest.mark.parametrize(
    ("version", "recent"),
    [
        ({"major": "1", "minor": "34"}, False),
        ({"major": "1", "minor": "36+"}, True),
        ({"major": "1", "minor": "37"}, True),
    ],
)
def test_features_follow_the_cluster_version(version: dict[str, str], recent: bool) -> None:
    assert features_for(version) == slices.Features(consumable_capacity=recent, device_taints=recent)


def test_a_server_that_drops_taints_turns_them_off(
    cluster: tuple[FakeKube, FakeNvml, Publisher], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An API server with DRADeviceTaints off drops `taints` without an error: the publisher sees
    it in what was stored, leaves unhealthy GPUs out instead, and does not write at every round."""
    kube, fake, pub = cluster
    fake.doc["gpus"][1]["row_remap_failure"] = True
    fake.write()
    resource = pub._resource

    def strip(body: dict[str, Any]) -> dict[str, Any]:
        for d in body["spec"]["devices"]:
            d.pop("taints", None)
        return body

    monkeypatch.setattr(pub, "_resource", _Dropping(resource, strip))
    first = pub.run_once()
    assert first.writes and pub.features == slices.Features(consumable_capacity=True, device_taints=False)
    second = pub.run_once()  # unhealthy GPU left out now: one write
    sick = dra.device_name(fake.doc["gpus"][1]["minor"])
    assert second.writes and sick not in devices(kube)
    assert pub.run_once().writes == []


class _Dropping:
    """The kubernetes client's ResourceV1Api, with the bodies it sends passed through `strip` (as an
    API server drops the fields of a feature gate that is off)."""

    def __init__(self, api: Any, strip: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        self.api, self.strip = api, strip

    def create_resource_slice(self, body: dict[str, Any], **kw: Any) -> Any:
        return self.api.create_resource_slice(self.strip(copy.deepcopy(body)), **kw)

    def replace_resource_slice(self, name: str, body: dict[str, Any], **kw: Any) -> Any:
        return self.api.replace_resource_slice(name, self.strip(copy.deepcopy(body)), **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.api, name)


def test_the_first_round_reads_the_features_from_the_version(fake_nvml: Callable[[str], FakeNvml]) -> None:
    fake = fake_nvml("dgx-h100")
    nvml = Nvml(str(fake.library), str(fake.sys_root))
    try:
        with FakeKube() as kube:
            kube.create("nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
            pub = Publisher(NODE, kube.api_client(), nvml, GpuIndex(nvml), force={"device_taints": False})
            first = pub.run_once()
            assert first.generation == 1 and first.devices == len(fake.doc["gpus"])
            assert pub.features == slices.Features(consumable_capacity=True, device_taints=False)
    finally:
        nvml.close()
