"""crihook's DRA driver with a real containerd (1.7.24 and 2.1.9), crihook in front of it in either
mode: a claim prepared by the driver (its CDI spec in the runtime's spec dir, kubelet's DRA checkpoint
naming its CDI devices) reaches the container as the runtime applies the spec: exactly the claimed
GPUs' device nodes, NVIDIA_VISIBLE_DEVICES in CUDA's order, HAMi-core's limits for a share; two
claims in one container bring both. What other pods get of a claim is the gpu hook's decision
(tests/e2e/test_gpu_dra.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from crihook.base import dra
from crihook.devices.draclaims import STATE_FILE
from crihook.dra import driver as drv
from crihook.hooks.grant import HamiCore
from tests.e2e import test_gpu_containerd as proxy_mode
from tests.e2e import test_gpu_dra
from tests.e2e.test_gpu_containerd import GpuNode, MiB, env_of, gpu_devices, gpu_nodes, spec_of
from tests.e2e.test_gpu_dra import create
from tests.support.cri import Cri, container_config, pod_config
from tests.support.draclaims import claim, pod, result
from tests.support.fakekube import FakeKube
from tests.support.gpu_fixtures import Gpu, Inventory

pytestmark = [pytest.mark.containerd, pytest.mark.runtimes("1.7", "2")]
gpu_node = test_gpu_dra.gpu_node  # crihook in either mode, reading the runtime's CDI spec dir
cri = proxy_mode.cri
NODE = "node-a"


class Prepared:
    """Claims prepared by the driver on the simulated node, and kubelet's DRA checkpoint naming them."""

    def __init__(self, node: GpuNode, cdi_spec_dir: Path, kube: FakeKube) -> None:
        sim = node.node
        self.sim = sim
        self.kube = kube
        gpus = [
            Gpu(i, g["minor"], g["uuid"], g["pci_bus_id"], g["memory_total"], g["name"])
            for i, g in enumerate(sim.doc["gpus"])
        ]
        paths = drv.Paths(sim.root / "dra-kubelet", sim.root / "dra-state", cdi_spec_dir, str(sim.dev_root))
        hami = HamiCore(str(sim.hami / "libvgpu.so"), str(sim.hami / "ld.so.preload"), str(sim.hami / "containers"),
                        str(sim.hami / "lock"))  # fmt: skip
        fetch, pods = drv.api_fetch(kube.api_client()), drv.api_fetch(kube.api_client(), "pod")
        self.driver = drv.Driver(NODE, Inventory(gpus), fetch, paths, hami, fetch_pod=pods)
        self.driver.start()
        self.held: dict[str, dict[str, list[str]]] = {}  # pod uid -> claim uid -> CDI ids

    def prepare(self, pod_uid: str, name: str, *results: dict[str, object]) -> list[str]:
        return self.prepare_together(pod_uid, {name: list(results)})

    def prepare_together(self, pod_uid: str, claims: dict[str, list[dict[str, object]]]) -> list[str]:
        """The pod's claims in one call, as kubelet makes it; one container of the pod holds them all."""
        owner = self.kube.create("pods", pod("owner", {"main": list(claims)}, {n: n for n in claims}), "default")
        reserved = ("owner", owner["metadata"]["uid"])
        made = {n: self.kube.create("resourceclaims", claim(n, r, pod=reserved), "default") for n, r in claims.items()}
        asked = [drv.Claim("default", m["metadata"]["uid"], n) for n, m in made.items()]
        answers = asyncio.run(self.driver.prepare(asked))
        ids = []
        for c in asked:
            answer = answers[c.uid]
            assert not isinstance(answer, str), answer
            self.held.setdefault(pod_uid, {})[c.uid] = [i for d in answer.devices for i in answer.cdi_ids(d)]
            ids += self.held[pod_uid][c.uid]
        self.kube.delete("pods", "owner", "default")
        self._write_checkpoint()
        return ids

    def _write_checkpoint(self) -> None:
        """kubelet's DRA checkpoint (pkg/kubelet/cm/dra/state), one entry per claim."""
        entries = [
            {
                "ClaimUID": uid,
                "ClaimName": uid,
                "Namespace": "default",
                "PodUIDs": {pod: {}},
                "DriverState": {dra.DRIVER: {"Devices": [{"PoolName": NODE, "DeviceName": "d", "CDIDeviceIDs": ids}]}},
            }
            for pod, claims in self.held.items()
            for uid, ids in claims.items()
        ]
        state = {
            "kind": "DRACheckpoint",
            "apiVersion": "checkpoint.dra.kubelet.k8s.io/v1",
            "ClaimInfoStateList": entries,
        }
        (self.sim.kubelet / STATE_FILE).write_text(json.dumps({"Data": json.dumps(state), "Checksum": 0}))


@pytest.fixture
def prepared(gpu_node: GpuNode, cdi_spec_dir: Path) -> Iterator[Prepared]:
    with FakeKube() as kube:
        p = Prepared(gpu_node, cdi_spec_dir, kube)
        try:
            yield p
        finally:
            (gpu_node.node.kubelet / STATE_FILE).unlink(missing_ok=True)


def with_devices(pod: object, ids: list[str]) -> object:
    config = container_config("cuda", pod)  # type: ignore[arg-type]
    for i in ids:
        config.CDI_devices.add(name=i)
    return config


def test_a_claim_brings_exactly_its_gpus(gpu_node: GpuNode, cri: Cri, prepared: Prepared) -> None:
    sim = gpu_node.node
    pod = pod_config("dra-pair")
    # minors 2 and 0: 0 comes later on the bus (pcie-l40s: minors 2, 3, 0, 1 in bus order)
    ids = prepared.prepare(pod.metadata.uid, "pair", result("gpu-0", pool=NODE), result("gpu-2", pool=NODE))
    with cri.pod(pod) as pod_id:
        cid = create(cri, pod_id, with_devices(pod, ids), pod)
        cri.start_container(cid)
        assert gpu_devices(spec_of(cri, cid)) == gpu_nodes(0, 2)
        assert env_of(cri, cid)["NVIDIA_VISIBLE_DEVICES"] == f"{sim.uuid(2)},{sim.uuid(0)}"


def test_two_claims_in_one_container_bring_both(gpu_node: GpuNode, cri: Cri, prepared: Prepared) -> None:
    pod = pod_config("dra-two-claims")
    first = prepared.prepare(pod.metadata.uid, "first", result("gpu-1", pool=NODE))
    second = prepared.prepare(pod.metadata.uid, "second", result("gpu-3", pool=NODE))
    with cri.pod(pod) as pod_id:
        cid = create(cri, pod_id, with_devices(pod, first + second), pod)
        cri.start_container(cid)
        assert gpu_devices(spec_of(cri, cid)) == gpu_nodes(1, 3)


def test_a_share_runs_under_hami_core_limits(gpu_node: GpuNode, cri: Cri, prepared: Prepared) -> None:
    sim = gpu_node.node
    pod = pod_config("dra-share")
    consumed = {"cores": "30", "memory": str(sim.memory(3) // 4)}
    ids = prepared.prepare(pod.metadata.uid, "share", result("gpu-3", pool=NODE, consumed=consumed))
    with cri.pod(pod) as pod_id:
        cid = create(cri, pod_id, with_devices(pod, ids), pod)
        cri.start_container(cid)
        env = env_of(cri, cid)
        assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == f"{sim.memory(3) // 4 // MiB}m"
        assert env["CUDA_DEVICE_SM_LIMIT"] == "30"
        assert cri.output(cid, "cat", "/etc/ld.so.preload").strip() == f"{sim.hami}/libvgpu.so"
        cri.output(cid, "touch", "/tmp/vgpu/cudevshr.cache")  # the claim's cache, writable
        assert gpu_devices(spec_of(cri, cid)) == gpu_nodes(3)


def test_two_shared_claims_in_one_container_are_numbered_together(
    gpu_node: GpuNode, cri: Cri, prepared: Prepared
) -> None:
    sim = gpu_node.node
    p = pod_config("dra-two-shares")
    claims = {
        "share-a": [result("gpu-1", pool=NODE, consumed={"cores": "30", "memory": str(sim.memory(1) // 2)})],
        "share-b": [result("gpu-2", pool=NODE, consumed={"cores": "40", "memory": str(sim.memory(2) // 4)})],
    }
    ids = prepared.prepare_together(p.metadata.uid, claims)
    with cri.pod(p) as pod_id:
        cid = create(cri, pod_id, with_devices(p, ids), p)
        cri.start_container(cid)
        env = env_of(cri, cid)
        # minor 2 comes first on the bus (pcie-l40s: minors 2, 3, 0, 1 in bus order)
        assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == f"{sim.memory(2) // 4 // MiB}m"
        assert env["CUDA_DEVICE_MEMORY_LIMIT_1"] == f"{sim.memory(1) // 2 // MiB}m"
        assert env["CUDA_DEVICE_SM_LIMIT"] == "30"
        assert env["NVIDIA_VISIBLE_DEVICES"] == f"{sim.uuid(2)},{sim.uuid(1)}"
        assert gpu_devices(spec_of(cri, cid)) == gpu_nodes(1, 2)
