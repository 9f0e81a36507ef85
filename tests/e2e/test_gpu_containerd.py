"""The gpu and rdma hooks through the real daemon and a real containerd: `crihook serve` (as a process)
in front of the test containerd, NVML answered by the fake library with the shipped 4-GPU PCIe
topology, device nodes made with mknod under a private dev_root, the kubelet checkpoint and pod
directories in a private kubelet root. What the container ends up with is read back from containerd:
env through ExecSync, devices from the runtime spec in ContainerStatus's verbose info."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from crihook.base import allocation as al
from crihook.simnode import fakenvml
from crihook.simnode.node import (
    NVIDIA_MAJOR,
    NVIDIACTL_MINOR,
    RDMA_CM_MINOR,
    UVERBS_BASE,
    UVERBS_MAJOR,
    UVM_MAJOR,
    SimNode,
    make_rdma_sys,
    make_sim_node,
)
from tests.support.containerd import Containerd
from tests.support.cri import Cri, CriError, DeviceSpec, container_config, pod_config
from tests.support.daemon import Crihook, running_crihook
from tests.support.gpu_fixtures import Entry, write_checkpoint

pytestmark = pytest.mark.containerd

TOPOLOGY = "pcie-l40s"  # minors 2, 3, 0, 1 in NVML index (bus) order
NIC = "0000:4b:00.0"
VF = "0000:4b:00.2"
MiB = 1 << 20


@dataclass
class GpuNode:
    node: SimNode
    proxy: Crihook


@pytest.fixture(scope="module", params=["proxy", "nri"])
def gpu_node(
    containerd: Containerd, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[GpuNode]:
    """crihook in each mode: `crihook serve` in front of containerd, or `crihook nri` registered with
    it (containerd 1.7 and 2.x; tests/e2e/test_gpu_nri.py has NRI mode's own cases)."""
    nri = request.param == "nri"
    if nri and not containerd.nri:
        pytest.skip(f"containerd {containerd.runtime.name} has no NRI")
    node = make_sim_node(tmp_path_factory.mktemp("gpu-node"), TOPOLOGY, char_devices=True)
    make_rdma_sys(node.sys_root, node.dev_root, {NIC: ["uverbs0"], VF: ["uverbs3"]}, char_devices=True)
    env = {fakenvml.CONFIG_ENV: str(node.config)}
    config = node.proxy_config(fakenvml.build())
    socket = containerd.nri_socket if nri else None
    with running_crihook(containerd.address, node.root / "crihook", config, env, socket) as proxy:
        yield GpuNode(node, proxy)


LEAKY = "its container brings a device-plugin GPU node, which NRI can not take away: NRI mode refuses it"
WORDED = "containerd words an NRI refusal (its own prefix, code Unknown)"


def proxy_only(gpu_node: GpuNode, why: str) -> None:
    """Skip a case in NRI mode, saying why; tests/e2e/test_gpu_nri.py checks NRI mode's side of it."""
    if gpu_node.proxy.mode == "nri":
        pytest.skip(f"proxy mode only: {why} (tests/e2e/test_gpu_nri.py)")


@pytest.fixture
def cri(gpu_node: GpuNode) -> Iterator[Cri]:
    write_checkpoint(gpu_node.node.checkpoint, [])
    with Cri(gpu_node.proxy.address) as client:
        yield client
        client.remove_all()


def allocated(*gpus: dict[str, Any], rdma: list[dict[str, Any]] | None = None) -> dict[str, str]:
    doc: dict[str, Any] = {"gpu": list(gpus)}
    if rdma:
        doc["rdma"] = rdma
    return {al.DEVICE_ALLOCATED: json.dumps(doc)}


def spec_of(cri: Cri, container_id: str) -> dict[str, Any]:
    return json.loads(cri.container_status(container_id, verbose=True).info["info"])["runtimeSpec"]


def gpu_devices(spec: dict[str, Any]) -> dict[str, tuple[str, int, int]]:
    """container path -> (type, major, minor) of every NVIDIA or RDMA node in the OCI spec."""
    return {
        d["path"]: (d["type"], d["major"], d["minor"])
        for d in spec["linux"].get("devices", [])
        if re.match(r"/dev/(nvidia|infiniband/)", d["path"])
    }


def gpu_nodes(*minors: int) -> dict[str, tuple[str, int, int]]:
    """What `gpu_devices` reads for a container given the GPUs `minors`: theirs, the control device
    and UVM's two."""
    return {
        **{f"/dev/nvidia{m}": ("c", NVIDIA_MAJOR, m) for m in minors},
        "/dev/nvidiactl": ("c", NVIDIA_MAJOR, NVIDIACTL_MINOR),
        "/dev/nvidia-uvm": ("c", UVM_MAJOR, 0),
        "/dev/nvidia-uvm-tools": ("c", UVM_MAJOR, 1),
    }


def allowed(spec: dict[str, Any]) -> set[tuple[int, int, str]]:
    """Device-cgroup allow rules (major, minor, access) for the nodes above."""
    majors = {NVIDIA_MAJOR, UVM_MAJOR, UVERBS_MAJOR}
    return {
        (r["major"], r["minor"], r["access"])
        for r in spec["linux"]["resources"].get("devices", [])
        if r.get("allow") and r.get("type") == "c" and r.get("major") in majors
    }


def env_of(cri: Cri, container_id: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in cri.output(container_id, "env").splitlines() if "=" in line)


def leaky(name: str, pod: Any, dev: Path) -> Any:
    """A container as a CUDA image and a device plugin would leave it: every GPU asked for, one
    GPU node injected."""
    devices = [DeviceSpec("/dev/nvidia1", f"{dev}/nvidia1", "rw")]
    return container_config(name, pod, envs={"NVIDIA_VISIBLE_DEVICES": "all"}, devices=devices)


def privileged_pod(name: str) -> Any:
    """A pod whose containers may be privileged (containerd refuses one in an unprivileged sandbox)."""
    pod = pod_config(name)
    pod.linux.security_context.privileged = True
    return pod


def privileged(name: str, pod: Any, dev: Path) -> Any:
    """`leaky`, privileged: containerd's CRI then adds every host device node and replaces the
    device-cgroup rules with one wildcard allow (oci.WithHostDevices, oci.WithAllDevicesAllowed in its
    container spec), as for kube-proxy, CNI agents or crihook's own node pods."""
    config = leaky(name, pod, dev)
    config.linux.security_context.privileged = True
    return config


def every_device(spec: dict[str, Any]) -> bool:
    """The spec's device cgroup lets the container reach every device (a wildcard allow rule)."""
    return any(
        r.get("allow") and r.get("type", "a") == "a" and "major" not in r and "minor" not in r
        for r in spec["linux"]["resources"].get("devices", [])
    )


def check_privileged(gpu_node: GpuNode, cri: Cri) -> None:
    """A privileged container brings a GPU node the scheduler did not choose: it is created in either
    mode (its privilege gives it every device whatever crihook decides; docs/nri.md) and its
    NVIDIA_VISIBLE_DEVICES is still overwritten, as for any container; NRI mode logs it once."""
    pod = privileged_pod("node-agent")
    agent = privileged("agent", pod, gpu_node.node.dev_root)
    with cri.pod(pod) as pod_id, cri.container(pod_id, agent, pod) as cid:
        assert cri.container_status(cid).status.state == 1  # CONTAINER_RUNNING
        assert env_of(cri, cid)["NVIDIA_VISIBLE_DEVICES"] == "void"
        assert every_device(spec_of(cri, cid))
    if gpu_node.proxy.mode == "nri":
        noted = [line for line in gpu_node.proxy.log_text().splitlines() if "privileged container" in line]
        assert len([line for line in noted if f"id={cid[:13]}" in line]) == 1
        assert "pod=default/node-agent" in noted[-1] and "container=agent" in noted[-1]


def test_a_privileged_container_is_created_in_either_mode(gpu_node: GpuNode, cri: Cri) -> None:
    check_privileged(gpu_node, cri)


def test_scheduled_gpus_and_nics_reach_the_container(gpu_node: GpuNode, cri: Cri) -> None:
    proxy_only(gpu_node, LEAKY)
    annotations = allocated(
        {"minor": 0, "id": gpu_node.node.uuid(0)},
        {"minor": 3},
        rdma=[{"minor": 0, "id": NIC, "extension": {"vfs": [{"busID": VF}]}}],
    )
    pod = pod_config("trainer", annotations=annotations)
    with cri.pod(pod) as pod_id, cri.container(pod_id, leaky("cuda", pod, gpu_node.node.dev_root), pod) as cid:
        # minor 3 (0000:31:00.0) comes before minor 0 (0000:b1:00.0) on the bus, as CUDA counts them
        assert env_of(cri, cid)["NVIDIA_VISIBLE_DEVICES"] == f"{gpu_node.node.uuid(3)},{gpu_node.node.uuid(0)}"
        spec = spec_of(cri, cid)
        assert gpu_devices(spec) == {
            **gpu_nodes(3, 0),
            "/dev/infiniband/rdma_cm": ("c", 10, RDMA_CM_MINOR),
            "/dev/infiniband/uverbs3": ("c", UVERBS_MAJOR, UVERBS_BASE + 3),  # the VF's, not the PF's
        }
        assert allowed(spec) == {
            (NVIDIA_MAJOR, 3, "rw"),
            (NVIDIA_MAJOR, 0, "rw"),
            (NVIDIA_MAJOR, NVIDIACTL_MINOR, "rw"),
            (UVM_MAJOR, 0, "rw"),
            (UVM_MAJOR, 1, "rw"),
            (UVERBS_MAJOR, UVERBS_BASE + 3, "rw"),
        }
        inside = cri.output(cid, "ls", "/dev", "/dev/infiniband").split()
        assert {"nvidia0", "nvidia3", "nvidiactl", "uverbs3"} <= set(inside)
        assert "nvidia1" not in inside and "uverbs0" not in inside


def test_pod_without_allocation_gets_void(gpu_node: GpuNode, cri: Cri) -> None:
    proxy_only(gpu_node, LEAKY)
    pod = pod_config("web")
    with cri.pod(pod) as pod_id, cri.container(pod_id, leaky("app", pod, gpu_node.node.dev_root), pod) as cid:
        assert env_of(cri, cid)["NVIDIA_VISIBLE_DEVICES"] == "void"
        spec = spec_of(cri, cid)
        assert gpu_devices(spec) == {}
        assert allowed(spec) == set()
        assert "nvidia1" not in cri.output(cid, "ls", "/dev").split()


def test_per_container_assignment(gpu_node: GpuNode, cri: Cri) -> None:
    annotations = allocated({"minor": 1}, {"minor": 2}) | {
        al.CONTAINER_DEVICES: al.format_container_devices({"a": {"gpu": [2]}, "b": {"gpu": [1]}})
    }
    pod = pod_config("split", annotations=annotations)
    with cri.pod(pod) as pod_id:
        with cri.container(pod_id, container_config("a", pod), pod) as a:
            assert env_of(cri, a)["NVIDIA_VISIBLE_DEVICES"] == gpu_node.node.uuid(2)
            assert "/dev/nvidia2" in gpu_devices(spec_of(cri, a)) and "/dev/nvidia1" not in gpu_devices(spec_of(cri, a))
        with cri.container(pod_id, container_config("sidecar", pod), pod) as s:
            assert env_of(cri, s)["NVIDIA_VISIBLE_DEVICES"] == "void"


def test_hami_core_shared_gpu(gpu_node: GpuNode, cri: Cri) -> None:
    share = {al.GPU_CORE: "30", al.GPU_MEMORY_RATIO: "25"}
    pod = pod_config(
        "shared",
        labels={"koordinator.sh/gpu-isolation-provider": "HAMi-core"},
        annotations=allocated({"minor": 2, "resources": share}),
    )
    with cri.pod(pod) as pod_id, cri.container(pod_id, container_config("cuda", pod), pod) as cid:
        env = env_of(cri, cid)
        assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == f"{gpu_node.node.memory(2) // 4 // MiB}m"
        assert env["CUDA_DEVICE_SM_LIMIT"] == "30"
        assert env["NVIDIA_VISIBLE_DEVICES"] == gpu_node.node.uuid(2)
        assert cri.output(cid, "cat", "/etc/ld.so.preload").strip() == f"{gpu_node.node.hami}/libvgpu.so"
        probe = cri.exec_sync(cid, "sh", "-c", f"echo x > {gpu_node.node.hami}/libvgpu.so")
        assert probe.exit_code != 0  # the library is read-only inside
        cri.output(cid, "touch", "/tmp/vgpu/cudevshr.cache")
        uid = pod.metadata.uid
        assert (gpu_node.node.hami / "containers" / f"{uid}_cuda" / "cudevshr.cache").exists()


def test_forged_and_conflicting_allocations_fail_create(gpu_node: GpuNode, cri: Cri) -> None:
    proxy_only(gpu_node, WORDED)
    other_uid = "7d0c5f8e-1111-4222-8333-944445555666"
    write_checkpoint(gpu_node.node.checkpoint, [Entry(other_uid, "trainer", [gpu_node.node.uuid(1)])])
    (gpu_node.node.kubelet / "pods" / other_uid).mkdir(exist_ok=True)
    # the holder: a device-plugin pod (no allocation annotation) whose container runs
    holder = pod_config("holder", uid=other_uid)
    with cri.pod(holder) as holder_id, cri.container(holder_id, container_config("trainer", holder), holder):
        refuse_all(gpu_node, cri, other_uid)


def refuse_all(gpu_node: GpuNode, cri: Cri, other_uid: str) -> None:
    ann = al.DEVICE_ALLOCATED
    uuid = gpu_node.node.uuid
    cases = [
        (
            allocated({"minor": 2, "id": uuid(3)}),
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{ann}: gpu minor 2 is {uuid(2)} on this node, not {uuid(3)} (that is minor 3)",
        ),
        (
            allocated({"minor": 0, "id": "GPU-00000000-0000-0000-0000-000000000000"}),
            grpc.StatusCode.FAILED_PRECONDITION,
            f"{ann}: gpu minor 0: no GPU GPU-00000000-0000-0000-0000-000000000000 on this node",
        ),
        (allocated({"minor": 7}), grpc.StatusCode.FAILED_PRECONDITION, f"{ann}: gpu minor 7: no such GPU on this node"),
        (
            {ann: '{"gpu": [{"minor": "0"}]}'},
            grpc.StatusCode.INVALID_ARGUMENT,
            f'{ann}: gpu[0].minor: expected an integer, got "0"',
        ),
        (
            allocated({"minor": 1}),
            grpc.StatusCode.FAILED_PRECONDITION,
            f"{ann}: GPU minor 1 ({gpu_node.node.uuid(1)}) is held by live pod {other_uid} container trainer"
            " through the device plugin (nvidia.com/gpu, kubelet checkpoint)",
        ),
    ]
    for i, (bad, code, cause) in enumerate(cases):
        pod = pod_config(f"bad-{i}", annotations=bad)
        with cri.pod(pod) as pod_id:
            with pytest.raises(CriError) as err:
                cri.create_container(pod_id, container_config("main", pod), pod)
            assert err.value.code == code, err.value.details
            assert err.value.details == f"hook gpu: pod default/bad-{i} container main: annotation {cause}"
            assert cri.list_containers(pod_id) == []  # nothing reached containerd
    # the bad pods changed nothing for a good one, on the same daemon
    pod = pod_config("good", annotations=allocated({"minor": 0}))
    with cri.pod(pod) as pod_id, cri.container(pod_id, container_config("main", pod), pod) as cid:
        assert env_of(cri, cid)["NVIDIA_VISIBLE_DEVICES"] == gpu_node.node.uuid(0)
    # the holder is gone (kubelet removed its pod directory): its GPU is free again
    os.rmdir(gpu_node.node.kubelet / "pods" / other_uid)
    pod = pod_config("after", annotations=allocated({"minor": 1}))
    with cri.pod(pod) as pod_id, cri.container(pod_id, container_config("main", pod), pod) as cid:
        assert env_of(cri, cid)["NVIDIA_VISIBLE_DEVICES"] == gpu_node.node.uuid(1)
