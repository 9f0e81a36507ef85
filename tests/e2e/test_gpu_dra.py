"""GPUs that reach a container through a CDI device, in both modes on containerd 1.7 and 2.x: a
DRA claim's device (NVIDIA's driver's kind, `k8s.gpu.nvidia.com/claim`, node c 195:0) is its pod's,
kept as its driver made it, and reaches no other pod; a GPU node under another name
(`/dev/nvidia-fake0` that is c 195:0) is that GPU, and reaches nobody it was not granted to."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from crihook.devices.draclaims import STATE_FILE
from crihook.simnode import fakenvml
from crihook.simnode.node import make_sim_node
from tests.e2e import test_gpu_containerd as proxy_mode
from tests.e2e.test_gpu_containerd import TOPOLOGY, GpuNode, env_of, gpu_devices, spec_of
from tests.support.containerd import Containerd
from tests.support.cri import Cri, CriError, container_config, pod_config
from tests.support.daemon import running_crihook

pytestmark = [pytest.mark.containerd, pytest.mark.runtimes("1.7", "2")]
cri = proxy_mode.cri  # the proxy tests' client fixture, here on this module's gpu_node
CLAIM_KIND = "k8s.gpu.nvidia.com/claim"
PICK_UP = 15.0  # seconds containerd may take to read a new CDI spec (about one); not a speed target


@pytest.fixture(scope="module", params=["proxy", "nri"])
def gpu_node(
    containerd: Containerd, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[GpuNode]:
    """crihook in either mode, its gpu hook reading the runtime's CDI spec dir and the node's
    kubelet root (where kubelet keeps its DRA checkpoint)."""
    if request.param == "nri" and not containerd.nri:
        pytest.skip(f"containerd {containerd.runtime.name} has no NRI")
    node = make_sim_node(tmp_path_factory.mktemp("dra-node"), TOPOLOGY, char_devices=True)
    env = {fakenvml.CONFIG_ENV: str(node.config)}
    config = node.proxy_config(fakenvml.build()).replace(
        "[hooks.gpu]\n", f'[hooks.gpu]\ncdi_spec_dirs = ["{containerd.cdi_spec_dir}"]\n'
    )
    socket = containerd.nri_socket if request.param == "nri" else None
    with running_crihook(containerd.address, node.root / "crihook", config, env, socket) as plugin:
        yield GpuNode(node, plugin)


def write_spec(spec_dir: Path, kind: str, name: str, path: str, host: Path, env: list[str]) -> str:
    spec = {
        "cdiVersion": "0.5.0",
        "kind": kind,
        "devices": [
            {"name": name, "containerEdits": {"deviceNodes": [{"path": path, "hostPath": str(host)}], "env": env}}
        ],
    }
    (spec_dir / f"{name}.json").write_text(json.dumps(spec))
    return f"{kind}={name}"


def write_claims(kubelet: Path, pod_uid: str, claim_uid: str, cdi: str) -> None:
    """kubelet's DRA checkpoint as pkg/kubelet/cm/dra/state writes it, one claim prepared for the pod."""
    state = {
        "kind": "DRACheckpoint",
        "apiVersion": "checkpoint.dra.kubelet.k8s.io/v1",
        "ClaimInfoStateList": [
            {
                "ClaimUID": claim_uid,
                "ClaimName": "gpu",
                "Namespace": "default",
                "PodUIDs": {pod_uid: {}},
                "DriverState": {
                    "gpu.nvidia.com": {"Devices": [{"PoolName": "node", "DeviceName": "gpu-0", "CDIDeviceIDs": [cdi]}]}
                },
            }
        ],
    }
    (kubelet / STATE_FILE).write_text(json.dumps({"Data": json.dumps(state), "Checksum": 0}))


def create(cri: Cri, pod_id: str, config: object, pod: object) -> str:
    """CreateContainer once containerd has read the spec just written (it refuses the device as
    unresolvable until then)."""
    deadline = time.monotonic() + PICK_UP
    while True:
        try:
            return cri.create_container(pod_id, config, pod)  # type: ignore[arg-type]
        except CriError as e:
            if "unresolvable CDI devices" not in e.details or time.monotonic() > deadline:
                raise


def test_a_claims_gpu_is_its_pods_and_no_other_pods(gpu_node: GpuNode, cri: Cri, cdi_spec_dir: Path) -> None:
    node = gpu_node.node
    claimed, other = pod_config("claimed"), pod_config("other")
    claim_uid = "3c8337ad-f366-4541-883d-30b9e99fd6be"
    cdi = write_spec(
        cdi_spec_dir, CLAIM_KIND, f"{claim_uid}-gpu0", "/dev/nvidia0", node.dev_root / "nvidia0",
        [f"NVIDIA_VISIBLE_DEVICES={node.uuid(0)}"],
    )  # fmt: skip
    write_claims(node.kubelet, claimed.metadata.uid, claim_uid, cdi)
    try:
        with cri.pod(claimed) as claimed_id, cri.pod(other) as other_id:
            config = container_config("cuda", claimed)
            config.CDI_devices.add(name=cdi)
            cid = create(cri, claimed_id, config, claimed)
            cri.start_container(cid)
            assert gpu_devices(spec_of(cri, cid)) == {"/dev/nvidia0": ("c", 195, 0)}
            assert env_of(cri, cid)["NVIDIA_VISIBLE_DEVICES"] == node.uuid(0)  # the driver's, not rewritten
            sneaky = container_config("cuda", other)
            sneaky.CDI_devices.add(name=cdi)
            if gpu_node.proxy.mode == "nri":  # the runtime has put the node in; NRI can not take it away
                with pytest.raises(CriError) as err:
                    create(cri, other_id, sneaky, other)
                assert "removing device /dev/nvidia0" in err.value.details
            else:  # the device is taken out of the request
                oid = create(cri, other_id, sneaky, other)
                cri.start_container(oid)
                assert gpu_devices(spec_of(cri, oid)) == {}
                assert env_of(cri, oid)["NVIDIA_VISIBLE_DEVICES"] == "void"
    finally:
        (node.kubelet / STATE_FILE).unlink(missing_ok=True)


def test_a_gpu_node_under_another_name_is_that_gpu(gpu_node: GpuNode, cri: Cri, cdi_spec_dir: Path) -> None:
    """c 195:0 named /dev/nvidia-fake0, by CDI_devices or a cdi.k8s.io annotation alike."""
    node = gpu_node.node
    cdi = write_spec(cdi_spec_dir, "vendor.example/fake", "gpu0", "/dev/nvidia-fake0", node.dev_root / "nvidia0", [])
    pod = pod_config("nothing-granted")
    by_field = container_config("field", pod)
    by_field.CDI_devices.add(name=cdi)
    by_annotation = container_config("annotation", pod, annotations={"cdi.k8s.io/fake": cdi})
    with cri.pod(pod) as pod_id:
        for config in (by_field, by_annotation):
            if gpu_node.proxy.mode == "nri":
                with pytest.raises(CriError) as err:
                    create(cri, pod_id, config, pod)
                assert "removing device /dev/nvidia-fake0" in err.value.details
            else:
                cid = create(cri, pod_id, config, pod)
                assert gpu_devices(spec_of(cri, cid)) == {}
