"""The DRA kubelet plugin with kubelet's part played by a real grpcio client on its unix sockets, and
the claims read through the real kubernetes client from the fake API server: registration, v1 and
v1beta1, idempotence, a claim made again under its name, other drivers' results, unknown claims,
concurrent calls and a restart between prepare and container creation."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from crihook.base import dra
from crihook.dra import driver as drv
from crihook.hooks.grant import HamiCore
from crihook.proto import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from crihook.proto import pluginregistration_v1_pb2 as reg_pb
from crihook.proto import pluginregistration_v1_pb2_grpc as reg_grpc
from tests.support.draclaims import claim, pod, result
from tests.support.fakekube import FakeKube
from tests.support.gpu_fixtures import Inventory, gpus

NODE = "node-a"
BOX = gpus(4, minor_offset=2)  # minors 2..5, bus order reversed


@dataclass
class Kubelet:
    """The plugin's sockets as kubelet reaches them, and what stands behind them."""

    kube: FakeKube
    driver: drv.Driver
    plugin: drv.Plugin
    paths: drv.Paths
    fetches: list[tuple[str, str]]

    def channel(self, socket: Path) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(f"unix://{socket}")

    def v1(self) -> dra_v1_pb2_grpc.DRAPluginStub:
        return dra_v1_pb2_grpc.DRAPluginStub(self.channel(self.paths.service_socket))

    def v1beta1(self) -> dra_v1beta1_pb2_grpc.DRAPluginStub:
        return dra_v1beta1_pb2_grpc.DRAPluginStub(self.channel(self.paths.service_socket))

    def create(self, doc: dict[str, Any]) -> str:
        """The claim in the API server; its UID."""
        made = self.kube.create("resourceclaims", doc, namespace=doc["metadata"]["namespace"])
        return str(made["metadata"]["uid"])

    async def restart(self) -> None:
        """The driver process ends and a new one starts on the same files."""
        await self.plugin.stop()
        self.driver = make_driver(self.kube, self.paths, self.fetches)
        self.driver.start()
        self.plugin = drv.Plugin(self.driver)
        await self.plugin.start()


@pytest.fixture
def root() -> Iterator[Path]:
    """A short directory: a unix socket path has at most 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="dra", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def make_driver(kube: FakeKube, paths: drv.Paths, fetches: list[tuple[str, str]]) -> drv.Driver:
    fetch = drv.api_fetch(kube.api_client())

    def counted(namespace: str, name: str) -> Any:
        fetches.append((namespace, name))
        return fetch(namespace, name)

    hami = HamiCore(
        cache_root=str(paths.state_dir / "hami" / "containers"), lock_dir=str(paths.state_dir / "hami" / "lock")
    )
    pods = drv.api_fetch(kube.api_client(), "pod")
    return drv.Driver(NODE, Inventory(BOX), counted, paths, hami, fetch_pod=pods)


@pytest.fixture
async def kubelet(root: Path) -> AsyncIterator[Kubelet]:
    dev = root / "dev"
    dev.mkdir()
    for name in [f"nvidia{g.minor}" for g in BOX] + ["nvidiactl", "nvidia-uvm"]:
        (dev / name).touch()
    paths = drv.Paths(kubelet_root=root / "kubelet", state_dir=root / "state", cdi_dir=root / "cdi", dev_root=str(dev))
    with FakeKube() as kube:
        fetches: list[tuple[str, str]] = []
        driver = make_driver(kube, paths, fetches)
        driver.start()
        plugin = drv.Plugin(driver)
        await plugin.start()
        k = Kubelet(kube, driver, plugin, paths, fetches)
        try:
            yield k
        finally:
            await k.plugin.stop()


def v1_claims(*items: tuple[str, str, str]) -> dra_v1_pb2.NodePrepareResourcesRequest:
    return dra_v1_pb2.NodePrepareResourcesRequest(
        claims=[dra_v1_pb2.Claim(namespace=ns, uid=uid, name=name) for ns, uid, name in items]
    )


def spec(k: Kubelet, uid: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(k.paths.spec_file(uid).read_text())
    return doc


async def test_registration_handshake(kubelet: Kubelet) -> None:
    socket = kubelet.paths.registration_socket
    assert socket == kubelet.paths.kubelet_root / "plugins_registry" / "gpu.crihook.io-reg.sock"
    stub = reg_grpc.RegistrationStub(kubelet.channel(socket))
    info = await stub.GetInfo(reg_pb.InfoRequest())
    assert info.type == "DRAPlugin" and info.name == dra.DRIVER
    assert info.endpoint == str(kubelet.paths.kubelet_root / "plugins" / "gpu.crihook.io" / "dra.sock")
    assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
    await stub.NotifyRegistrationStatus(reg_pb.RegistrationStatus(plugin_registered=False, error="version"))
    assert not kubelet.driver.registered.is_set() and kubelet.driver.registration_error == "version"
    await stub.NotifyRegistrationStatus(reg_pb.RegistrationStatus(plugin_registered=True))
    assert kubelet.driver.registered.is_set()


async def test_v1_prepare_writes_the_claims_cdi_spec_and_unprepare_removes_it(kubelet: Kubelet) -> None:
    uid = kubelet.create(claim("pair", [result("gpu-2"), result("gpu-5", request="other")]))
    answer = await kubelet.v1().NodePrepareResources(v1_claims(("default", uid, "pair")))
    prepared = answer.claims[uid]
    assert prepared.error == ""
    assert [(list(d.request_names), d.pool_name, d.device_name, list(d.cdi_device_ids)) for d in prepared.devices] == [
        (["gpu"], NODE, "gpu-2", [f"gpu.crihook.io/claim={uid}-gpu-2"]),
        (["other"], NODE, "gpu-5", [f"gpu.crihook.io/claim={uid}-gpu-5"]),
    ]
    doc = spec(kubelet, uid)
    assert doc["kind"] == "gpu.crihook.io/claim"
    assert [d["name"] for d in doc["devices"]] == [f"{uid}-gpu-2", f"{uid}-gpu-5"]
    dev = kubelet.paths.dev_root
    assert doc["devices"][0]["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/nvidia2", "hostPath": f"{dev}/nvidia2", "permissions": "rw"}
    ]
    # CUDA's order is the PCI bus order: minor 5 sits lower on the bus than minor 2
    assert doc["containerEdits"]["env"] == [f"NVIDIA_VISIBLE_DEVICES={BOX[3].uuid},{BOX[0].uuid}"]
    assert [n["path"] for n in doc["containerEdits"]["deviceNodes"]] == ["/dev/nvidiactl", "/dev/nvidia-uvm"]
    gone = await kubelet.v1().NodeUnprepareResources(
        dra_v1_pb2.NodeUnprepareResourcesRequest(claims=[dra_v1_pb2.Claim(namespace="default", uid=uid, name="pair")])
    )
    assert gone.claims[uid].error == ""
    assert not kubelet.paths.spec_file(uid).exists()
    assert uid not in kubelet.driver.state.claims


async def test_v1beta1_serves_the_same_claims(kubelet: Kubelet) -> None:
    uid = kubelet.create(claim("one", [result("gpu-3")]))
    request = dra_v1beta1_pb2.NodePrepareResourcesRequest(
        claims=[dra_v1beta1_pb2.Claim(namespace="default", uid=uid, name="one")]
    )
    answer = await kubelet.v1beta1().NodePrepareResources(request)
    assert [d.device_name for d in answer.claims[uid].devices] == ["gpu-3"]
    assert kubelet.paths.spec_file(uid).exists()
    gone = await kubelet.v1beta1().NodeUnprepareResources(
        dra_v1beta1_pb2.NodeUnprepareResourcesRequest(claims=list(request.claims))
    )
    assert gone.claims[uid].error == "" and not kubelet.paths.spec_file(uid).exists()


async def test_the_same_claim_prepared_twice_is_read_once(kubelet: Kubelet) -> None:
    uid = kubelet.create(claim("twice", [result("gpu-4")]))
    first = await kubelet.v1().NodePrepareResources(v1_claims(("default", uid, "twice")))
    second = await kubelet.v1().NodePrepareResources(v1_claims(("default", uid, "twice")))
    assert first == second and first.claims[uid].devices
    assert kubelet.fetches == [("default", "twice")]


async def test_a_claim_made_again_under_its_name_fails_alone(kubelet: Kubelet) -> None:
    old = kubelet.create(claim("again", [result("gpu-2")]))
    kubelet.kube.delete("resourceclaims", "again", namespace="default")
    new = kubelet.create(claim("again", [result("gpu-3")]))
    fine = kubelet.create(claim("fine", [result("gpu-4")]))
    answer = await kubelet.v1().NodePrepareResources(v1_claims(("default", old, "again"), ("default", fine, "fine")))
    assert f"has UID '{new}', not '{old}'" in answer.claims[old].error
    assert not answer.claims[old].devices and not kubelet.paths.spec_file(old).exists()
    assert answer.claims[fine].error == "" and [d.device_name for d in answer.claims[fine].devices] == ["gpu-4"]


async def test_errors_are_per_claim_and_name_it(kubelet: Kubelet) -> None:
    unallocated = kubelet.create(claim("pending", None))
    foreign = kubelet.create(claim("far", [result("gpu-99")]))
    answer = await kubelet.v1().NodePrepareResources(
        v1_claims(("default", unallocated, "pending"), ("default", foreign, "far"), ("default", "u-1", "missing"))
    )
    assert "claim default/pending is not allocated" in answer.claims[unallocated].error
    assert "gpu-99: no GPU minor 99 on this node" in answer.claims[foreign].error
    assert answer.claims["u-1"].error == "claim default/missing not found"


async def test_results_of_other_drivers_and_pools_are_ignored(kubelet: Kubelet) -> None:
    mixed = kubelet.create(
        claim(
            "mixed",
            [
                result("gpu-0", driver="gpu.nvidia.com"),
                result("gpu-3"),
                result("gpu-4", pool="node-b"),
                result("nic-0", driver="rdma.example.com"),
            ],
        )
    )
    theirs = kubelet.create(claim("theirs", [result("gpu-0", driver="gpu.nvidia.com")]))
    answer = await kubelet.v1().NodePrepareResources(
        v1_claims(("default", mixed, "mixed"), ("default", theirs, "theirs"))
    )
    assert [d.device_name for d in answer.claims[mixed].devices] == ["gpu-3"]
    assert answer.claims[theirs].error == "" and not answer.claims[theirs].devices
    assert not kubelet.paths.spec_file(theirs).exists()


async def test_an_unknown_claim_unprepares_without_error(kubelet: Kubelet) -> None:
    gone = await kubelet.v1().NodeUnprepareResources(
        dra_v1_pb2.NodeUnprepareResourcesRequest(claims=[dra_v1_pb2.Claim(namespace="ns", uid="nope", name="x")])
    )
    assert gone.claims["nope"].error == ""


async def test_concurrent_calls_prepare_each_claim_once(kubelet: Kubelet) -> None:
    uids = [kubelet.create(claim(f"c{i}", [result(f"gpu-{2 + i % 4}", consumed={"cores": "25"})])) for i in range(12)]
    stub = kubelet.v1()
    calls = [stub.NodePrepareResources(v1_claims(("default", uid, f"c{i}"))) for i, uid in enumerate(uids)] * 3
    answers = await asyncio.gather(*calls)
    for i, uid in enumerate(uids):
        devices = {tuple(d.cdi_device_ids) for a in answers if uid in a.claims for d in a.claims[uid].devices}
        assert devices == {(f"gpu.crihook.io/claim={uid}-gpu-{2 + i % 4}",)}
    assert sorted(kubelet.fetches) == sorted(("default", f"c{i}") for i in range(12))
    assert set(kubelet.driver.state.claims) == set(uids)
    unprepared = [
        stub.NodeUnprepareResources(
            dra_v1_pb2.NodeUnprepareResourcesRequest(
                claims=[dra_v1_pb2.Claim(namespace="default", uid=uid, name=f"c{i}")]
            )
        )
        for i, uid in enumerate(uids)
    ] * 2
    await asyncio.gather(*unprepared)
    assert kubelet.driver.state.claims == {} and not list(kubelet.paths.cdi_dir.glob("*.json"))


async def test_a_restart_between_prepare_and_container_creation(kubelet: Kubelet) -> None:
    uid = kubelet.create(claim("kept", [result("gpu-5")]))
    first = await kubelet.v1().NodePrepareResources(v1_claims(("default", uid, "kept")))
    written = spec(kubelet, uid)
    orphan = kubelet.paths.spec_file("orphan")
    orphan.write_text("{}")  # a spec whose claim never reached the checkpoint
    await kubelet.restart()
    kubelet.kube.delete("resourceclaims", "kept", namespace="default")  # kubelet may ask after the claim is gone
    again = await kubelet.v1().NodePrepareResources(v1_claims(("default", uid, "kept")))
    assert again == first and spec(kubelet, uid) == written
    assert kubelet.fetches == [("default", "kept")]
    assert not orphan.exists()
    kubelet.paths.spec_file(uid).unlink()  # lost with the rest of /var/run at a reboot
    await kubelet.v1().NodePrepareResources(v1_claims(("default", uid, "kept")))
    assert spec(kubelet, uid) == written


async def test_shares_get_hami_core_limits_numbered_in_cuda_order(kubelet: Kubelet) -> None:
    uid = kubelet.create(
        claim(
            "half",
            [
                result("gpu-2", consumed={"memory": "8Gi", "cores": "50"}, share_id="s1"),
                result("gpu-5", request="b", consumed={"memory": "4Gi", "cores": "30"}),
            ],
        )
    )
    answer = await kubelet.v1().NodePrepareResources(v1_claims(("default", uid, "half")))
    assert answer.claims[uid].devices[0].share_id == "s1"
    edits = spec(kubelet, uid)["containerEdits"]
    env = dict(e.split("=", 1) for e in edits["env"])
    assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "4096m"  # gpu-5 comes first on the bus
    assert env["CUDA_DEVICE_MEMORY_LIMIT_1"] == "8192m"
    assert env["CUDA_DEVICE_SM_LIMIT"] == "30" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    hami = kubelet.driver.hami
    assert {
        "hostPath": f"{hami.cache_root}/dra-{uid}",
        "containerPath": "/tmp/vgpu",
        "options": ["rw", "nosuid", "nodev", "bind"],
    } in edits["mounts"]
    assert {m["containerPath"] for m in edits["mounts"]} >= {hami.library, "/etc/ld.so.preload", "/tmp/vgpulock"}
    for made in (f"{hami.cache_root}/dra-{uid}", hami.lock_dir):  # writable by any user of the container
        assert os.stat(made).st_mode & 0o777 == 0o777


async def test_a_bad_share_fails_its_claim(kubelet: Kubelet) -> None:
    uid = kubelet.create(claim("odd", [result("gpu-2", consumed={"memory": "1.5"})]))
    answer = await kubelet.v1().NodePrepareResources(v1_claims(("default", uid, "odd")))
    assert "consumedCapacity.memory: '1.5' is not a whole non-negative amount" in answer.claims[uid].error


def env_of(doc: dict[str, Any]) -> dict[str, str]:
    return dict(e.split("=", 1) for e in doc["containerEdits"]["env"])


async def test_claims_a_container_holds_together_are_numbered_together(kubelet: Kubelet) -> None:
    made = kubelet.kube.create(
        "pods", pod("trainer", {"main": ["a", "b"]}, {"a": "trainer-a", "b": "trainer-b"}), namespace="default"
    )
    owner = ("trainer", made["metadata"]["uid"])
    a = kubelet.create(claim("trainer-a", [result("gpu-2", consumed={"memory": "8Gi", "cores": "50"})], pod=owner))
    b = kubelet.create(claim("trainer-b", [result("gpu-5", consumed={"memory": "4Gi", "cores": "30"})], pod=owner))
    answer = await kubelet.v1().NodePrepareResources(
        v1_claims(("default", a, "trainer-a"), ("default", b, "trainer-b"))
    )
    assert answer.claims[a].error == answer.claims[b].error == ""
    first, second = spec(kubelet, a), spec(kubelet, b)
    # one numbering over both claims' GPUs in CUDA's order (minor 5 first on the bus), in both specs
    want = {"CUDA_DEVICE_MEMORY_LIMIT_0": "4096m", "CUDA_DEVICE_MEMORY_LIMIT_1": "8192m", "CUDA_DEVICE_SM_LIMIT": "30"}
    for doc in (first, second):
        assert env_of(doc).items() >= want.items()
        assert env_of(doc)["NVIDIA_VISIBLE_DEVICES"] == f"{BOX[3].uuid},{BOX[0].uuid}"
    assert first["containerEdits"]["mounts"] == second["containerEdits"]["mounts"]
    assert [d["containerEdits"]["deviceNodes"][0]["path"] for d in first["devices"]] == ["/dev/nvidia2"]
    assert [d["containerEdits"]["deviceNodes"][0]["path"] for d in second["devices"]] == ["/dev/nvidia5"]
    # kubelet asking again for one of them changes nothing
    await kubelet.v1().NodePrepareResources(v1_claims(("default", b, "trainer-b")))
    assert spec(kubelet, b) == second
    await kubelet.restart()
    kubelet.paths.spec_file(a).unlink()
    await kubelet.v1().NodePrepareResources(v1_claims(("default", a, "trainer-a")))
    assert spec(kubelet, a) == first


async def test_claims_of_a_pod_that_can_not_be_read_are_numbered_alone(kubelet: Kubelet) -> None:
    owner = ("gone", "0000-gone")
    a = kubelet.create(claim("gone-a", [result("gpu-2", consumed={"cores": "50"})], pod=owner))
    b = kubelet.create(claim("gone-b", [result("gpu-5", consumed={"cores": "30"})], pod=owner))
    answer = await kubelet.v1().NodePrepareResources(v1_claims(("default", a, "gone-a"), ("default", b, "gone-b")))
    assert answer.claims[a].error == answer.claims[b].error == ""
    assert env_of(spec(kubelet, a))["NVIDIA_VISIBLE_DEVICES"] == BOX[0].uuid
    assert "CUDA_DEVICE_MEMORY_LIMIT_1" not in env_of(spec(kubelet, a))


def character_devices(dev: Path) -> int:
    """Each plain file the fixture put in `dev` made a link to /dev/null; /dev/null's st_rdev."""
    for node in dev.iterdir():
        node.unlink()
        node.symlink_to("/dev/null")
    return os.stat("/dev/null").st_rdev


async def test_device_nodes_carry_their_numbers(kubelet: Kubelet) -> None:
    """The runtime makes each node from its type and numbers: the host path is the plugin's view of
    /dev (its pod's mount), not necessarily the runtime's."""
    null = character_devices(Path(kubelet.paths.dev_root))
    uid = kubelet.create(claim("numbered", [result("gpu-2")]))
    answer = await kubelet.v1().NodePrepareResources(v1_claims(("default", uid, "numbered")))
    assert answer.claims[uid].error == ""
    doc = spec(kubelet, uid)
    nodes = [*doc["devices"][0]["containerEdits"]["deviceNodes"], *doc["containerEdits"]["deviceNodes"]]
    assert [n["path"] for n in nodes] == ["/dev/nvidia2", "/dev/nvidiactl", "/dev/nvidia-uvm"]
    assert {(n["type"], n["major"], n["minor"]) for n in nodes} == {("c", os.major(null), os.minor(null))}


def test_a_path_that_is_no_device_node_has_no_numbers(root: Path) -> None:
    (root / "plain").touch()
    assert drv.device_number(str(root / "plain")) is None
    assert drv.device_number(str(root / "missing")) is None
    assert drv.device_number("/dev/null") is not None


async def test_a_gpu_crihooks_allocator_gave_out_is_refused_to_a_claim(root: Path) -> None:
    """kube-scheduler may allocate a GPU in the moments before the slices leave it out."""
    paths = drv.Paths(kubelet_root=root / "k", state_dir=root / "s", cdi_dir=root / "c", dev_root=str(root))
    with FakeKube() as kube:
        made = kube.create("resourceclaims", claim("late", [result("gpu-3")]), namespace="default")
        driver = drv.Driver(NODE, Inventory(BOX), drv.api_fetch(kube.api_client()), paths, taken=lambda: {3})
        driver.start()
        uid = made["metadata"]["uid"]
        (answer,) = (await driver.prepare([drv.Claim("default", uid, "late")])).values()
    assert isinstance(answer, str) and "GPU minor 3 is a pod's on this node through crihook's scheduler" in answer
    assert not paths.spec_file(uid).exists() and uid not in driver.state.claims
