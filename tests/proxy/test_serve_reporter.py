"""`crihook serve` with reporter.kubeconfig set publishes the node's devices from its own thread while
it serves CRI, and a reporter that can not start never keeps the proxy from serving."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from crihook.simnode.fakenvml import CONFIG_ENV
from tests.support.containerd import Containerd
from tests.support.cri import Cri
from tests.support.daemon import running_crihook
from tests.support.fakekube import ApiError, FakeKube

pytestmark = pytest.mark.containerd
NODE = "gpu-node-7"


def node_config(fake: Any, tmp_path: Path, kubeconfig: str) -> str:
    return (
        f'[node]\nname = "{NODE}"\nsys_root = "{fake.sys_root}"\nnvml_library = "{fake.library}"\n'
        f'kubelet_checkpoint = "{tmp_path}/kubelet/device-plugins/kubelet_internal_checkpoint"\n'
        f'[reporter]\nkubeconfig = "{kubeconfig}"\ninterval_seconds = 1.0\n'
    )


def wait_for(check: Callable[[], Any], seconds: float = 20) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            value = check()
        except (KeyError, ApiError):
            value = None
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


def test_serve_publishes_the_device_while_serving(containerd: Containerd, fake_nvml: Any, tmp_path: Path) -> None:
    fake = fake_nvml("dgx-h100")
    with FakeKube() as kube:
        kube.create("nodes", {"metadata": {"name": NODE}, "status": {"capacity": {}, "allocatable": {}}})
        kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig")
        config = node_config(fake, tmp_path, str(kubeconfig))
        with running_crihook(containerd.address, tmp_path / "crihook", config, {CONFIG_ENV: str(fake.config)}) as p:
            device = wait_for(lambda: kube.get("devices", NODE))
            assert wait_for(lambda: kube.get("devices", NODE).get("status", {}).get("gpuCount")) == 8
            assert [d["type"] for d in device["spec"]["devices"]].count("gpu") == 8
            allocatable = wait_for(
                lambda: kube.get("nodes", NODE)["status"]["allocatable"].get("koordinator.sh/gpu-core")
            )
            assert str(allocatable) == "800"
            with Cri(p.address) as cri:
                assert cri.version().runtime_name == "containerd"
            assert p.log_text().count("device reporter started") == 1


def test_a_reporter_that_can_not_start_does_not_stop_the_proxy(
    containerd: Containerd, fake_nvml: Any, tmp_path: Path
) -> None:
    fake = fake_nvml("pcie-l40s")
    config = node_config(fake, tmp_path, str(tmp_path / "no-such-kubeconfig"))
    with running_crihook(containerd.address, tmp_path / "crihook", config, {CONFIG_ENV: str(fake.config)}) as p:
        with Cri(p.address) as cri:
            assert cri.version().runtime_name == "containerd"
        assert "device reporter not started" in p.log_text() and "no-such-kubeconfig" in p.log_text()
