"""`crihook dra` as a process: it registers with kubelet's plugin registry, serves the DRAPlugin,
publishes the node's slices (the cluster's version deciding the features), and on SIGTERM takes its
sockets away so kubelet unregisters it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from crihook.base import dra
from crihook.proto import dra_v1_pb2, dra_v1_pb2_grpc
from crihook.proto import pluginregistration_v1_pb2 as reg_pb
from crihook.proto import pluginregistration_v1_pb2_grpc as reg_grpc
from crihook.simnode.fakenvml import CONFIG_ENV, FakeNvml
from tests.support.draclaims import claim, result
from tests.support.fakekube import FakeKube

NODE = "node-a"


@pytest.fixture
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dracli", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def wait_for(check: Callable[[], object], what: str, timeout: float = 90.0) -> None:
    """The kubernetes client alone takes seconds to import on a busy machine."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_the_command_serves_kubelet_and_publishes(root: Path, fake_nvml: Callable[[str], FakeNvml]) -> None:
    fake = fake_nvml("pcie-l40s")
    dev = root / "dev"
    dev.mkdir()
    for g in fake.doc["gpus"]:
        (dev / f"nvidia{g['minor']}").touch()
    with FakeKube(version=("1", "34")) as kube:
        kube.create("nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        config = root / "config.toml"
        config.write_text(
            f'[node]\nname = "{NODE}"\nnvml_library = "{fake.library}"\nsys_root = "{fake.sys_root}"\n'
            f'dev_root = "{dev}"\n[reporter]\nkubeconfig = "{kube.write_kubeconfig(root / "kubeconfig")}"\n'
        )
        args = ["--config", str(config), "--kubelet-root", str(root / "kubelet"), "--state-dir", str(root / "state")]
        args += ["--cdi-dir", str(root / "cdi"), "--interval", "0.2"]
        env = {**os.environ, CONFIG_ENV: str(fake.config)}
        proc = subprocess.Popen([sys.executable, "-m", "crihook.cli", "dra", *args], env=env, stderr=subprocess.PIPE)
        try:
            registration = root / "kubelet" / "plugins_registry" / f"{dra.DRIVER}-reg.sock"
            wait_for(registration.exists, "the registration socket")
            with grpc.insecure_channel(f"unix://{registration}") as ch:
                info = reg_grpc.RegistrationStub(ch).GetInfo(reg_pb.InfoRequest(), timeout=10)
            wait_for(lambda: kube.list("resourceslices"), "the node's slices")
            (published,) = kube.list("resourceslices")
            devices = published["spec"]["devices"]
            assert len(devices) == len(fake.doc["gpus"])
            assert "allowMultipleAllocations" not in devices[0]  # 1.34: no consumable capacity by default
            minor = fake.doc["gpus"][0]["minor"]
            made = kube.create("resourceclaims", claim("c", [result(dra.device_name(minor), pool=NODE)]), "default")
            uid = made["metadata"]["uid"]
            with grpc.insecure_channel(f"unix://{info.endpoint}") as ch:
                answer = dra_v1_pb2_grpc.DRAPluginStub(ch).NodePrepareResources(
                    dra_v1_pb2.NodePrepareResourcesRequest(
                        claims=[dra_v1_pb2.Claim(namespace="default", uid=uid, name="c")]
                    ),
                    timeout=10,
                )
            assert answer.claims[uid].error == ""
            assert (root / "cdi" / f"{dra.CDI_VENDOR}-{dra.CDI_CLASS}_{uid}.json").exists()
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err.decode()
        assert not registration.exists() and not Path(info.endpoint).exists()
