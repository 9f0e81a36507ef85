"""`crihook dra` as a process: it registers with kubelet's plugin registry, serves the DRAPlugin,
publishes the node's slices (the cluster's version deciding the features), and on SIGTERM takes its
sockets away so kubelet unregisters it. Also as systemd/crihook-dra.service runs it: inside the
unit's file-system sandbox, telling systemd when it is ready."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from crihook.base import dra
from crihook.dra.driver import Paths
from crihook.hooks.grant import HamiCore
from crihook.proto import dra_v1_pb2, dra_v1_pb2_grpc
from crihook.proto import pluginregistration_v1_pb2 as reg_pb
from crihook.proto import pluginregistration_v1_pb2_grpc as reg_grpc
from crihook.simnode.fakenvml import CONFIG_ENV, FakeNvml
from tests.support.draclaims import claim, result
from tests.support.fakekube import FakeKube
from tests.support.sandbox import sandboxed, unit_service

DRA_UNIT = Path(__file__).resolve().parents[2] / "systemd" / "crihook-dra.service"

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


def node_config(root: Path, fake: FakeNvml, kube: FakeKube, extra: str = "") -> Path:
    """The configuration file of a node with the fake's GPUs (device nodes as plain files) and the
    fake API server's kubeconfig."""
    dev = root / "dev"
    dev.mkdir()
    for g in fake.doc["gpus"]:
        (dev / f"nvidia{g['minor']}").touch()
    kube.create("nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
    config = root / "config.toml"
    config.write_text(
        f'[node]\nname = "{NODE}"\nnvml_library = "{fake.library}"\nsys_root = "{fake.sys_root}"\n'
        f'dev_root = "{dev}"\n[reporter]\nkubeconfig = "{kube.write_kubeconfig(root / "kubeconfig")}"\n{extra}'
    )
    return config


def test_the_command_serves_kubelet_and_publishes(root: Path, fake_nvml: Callable[[str], FakeNvml]) -> None:
    fake = fake_nvml("pcie-l40s")
    with FakeKube(version=("1", "34")) as kube:
        config = node_config(root, fake, kube)
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


def on_host(path: Path) -> str:
    """Where a default path is once links are followed: /var/run is a link to /run."""
    return str(Path("/run") / path.relative_to("/var/run")) if path.is_relative_to("/var/run") else str(path)


def test_the_units_sandbox_lets_the_driver_register_and_write_its_specs_and_checkpoint(
    root: Path, fake_nvml: Callable[[str], FakeNvml]
) -> None:
    """systemd/crihook-dra.service as shipped: the paths the driver writes at its defaults are the
    ones the unit makes writable (ReadWritePaths=), and those its ExecStartPre= makes; inside that
    sandbox (ProtectSystem=strict, every path moved under the test's directory; tests/support/
    sandbox.py) the driver tells systemd READY=1, registers, prepares a claim with a share (its CDI
    spec, its checkpoint, HAMi-core's directories) and unprepares it."""
    if os.geteuid() != 0:
        pytest.skip("the sandbox needs root (a mount namespace)")
    service = unit_service(DRA_UNIT)
    assert service["ProtectSystem"] == "strict" and service["Type"] == "notify"
    assert service["ExecStart"] == "/opt/crihook/venv/bin/crihook dra --config /etc/crihook/config.toml"
    defaults = Paths()
    written = [defaults.registration_socket.parent, defaults.service_socket.parent, defaults.cdi_dir]
    state = str(defaults.state_dir)
    assert f"/var/lib/{service['StateDirectory']}" == state
    assert HamiCore().cache_root.startswith(state + "/") and HamiCore().lock_dir.startswith(state + "/")
    writable = service["ReadWritePaths"].split()
    assert sorted(writable) == sorted([state, *map(on_host, written)])
    made = service["ExecStartPre"].split()
    assert made[:2] == ["+/bin/mkdir", "-p"] and sorted(made[2:]) == sorted(map(on_host, written))

    host = root / "host"

    def moved(path: str) -> Path:
        return host / path.lstrip("/")

    for path in writable:  # ExecStartPre= and StateDirectory= make them
        moved(path).mkdir(parents=True)
    hami = root / "hami"
    hami.mkdir()
    (hami / "libvgpu.so").touch()
    (hami / "ld.so.preload").write_text(f"{hami}/libvgpu.so\n")
    gpu = HamiCore(
        library=str(hami / "libvgpu.so"),
        preload_file=str(hami / "ld.so.preload"),
        cache_root=str(moved(HamiCore().cache_root)),
        lock_dir=str(moved(HamiCore().lock_dir)),
    )
    table = "".join(f'{f} = "{getattr(gpu, f)}"\n' for f in ("library", "preload_file", "cache_root", "lock_dir"))
    fake = fake_nvml("pcie-l40s")
    with FakeKube(version=("1", "34")) as kube, socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        config = node_config(root, fake, kube, f"[hooks.gpu.hami_core]\n{table}")
        notify.bind(str(root / "notify.sock"))
        notify.settimeout(0.2)
        env = {**os.environ, CONFIG_ENV: str(fake.config), "NOTIFY_SOCKET": str(root / "notify.sock")}
        args = ["--config", str(config), "--kubelet-root", str(moved("/var/lib/kubelet"))]
        args += ["--state-dir", str(moved(state)), "--cdi-dir", str(moved(on_host(defaults.cdi_dir)))]
        command = [*sandboxed([moved(p) for p in writable]), sys.executable, "-m", "crihook.cli", "dra", *args]
        proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE)
        try:
            ready = ""
            deadline = time.monotonic() + 90
            while "READY=1" not in ready.split("\n"):
                assert proc.poll() is None and time.monotonic() < deadline, "no READY=1"
                with contextlib.suppress(TimeoutError):
                    ready = notify.recv(4096).decode()
            mounts = Path(f"/proc/{proc.pid}/mountinfo").read_text().splitlines()
            assert "ro" in next(m for m in mounts if m.split()[4] == "/").split()[5].split(",")
            registration = moved(on_host(defaults.registration_socket.parent)) / defaults.registration_socket.name
            with grpc.insecure_channel(f"unix://{registration}") as ch:
                info = reg_grpc.RegistrationStub(ch).GetInfo(reg_pb.InfoRequest(), timeout=10)
            minor = fake.doc["gpus"][0]["minor"]
            share = {dra.CAPACITY_CORES: "50", dra.CAPACITY_MEMORY: "1Gi"}
            doc = claim("c", [result(dra.device_name(minor), pool=NODE, consumed=share)])
            uid = kube.create("resourceclaims", doc, "default")["metadata"]["uid"]
            wanted = [dra_v1_pb2.Claim(namespace="default", uid=uid, name="c")]
            with grpc.insecure_channel(f"unix://{info.endpoint}") as ch:
                stub = dra_v1_pb2_grpc.DRAPluginStub(ch)
                answer = stub.NodePrepareResources(dra_v1_pb2.NodePrepareResourcesRequest(claims=wanted), timeout=10)
                assert answer.claims[uid].error == ""
                spec = moved(on_host(defaults.cdi_dir)) / f"{dra.CDI_VENDOR}-{dra.CDI_CLASS}_{uid}.json"
                checkpoint = moved(state) / "dra" / f"{uid}.json"
                assert spec.exists() and checkpoint.exists()
                assert [p.name for p in Path(gpu.cache_root).iterdir()] and Path(gpu.lock_dir).is_dir()
                gone = stub.NodeUnprepareResources(dra_v1_pb2.NodeUnprepareResourcesRequest(claims=wanted), timeout=10)
                assert gone.claims[uid].error == ""
                assert not spec.exists() and not checkpoint.exists()
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err.decode()
        assert not registration.exists()
