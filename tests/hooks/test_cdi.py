"""`[hooks.gpu] inject = "cdi"` for real: `crihook serve` in front of containerd 1.7 and 2.x with CDI on,
the simulated 4-GPU node's CDI spec (as `nvidia-ctk cdi generate --device-name-strategy=uuid` would
write it, pointed at the node's mknod'ed device nodes) in the runtime's spec dir. The running
container is read back: its device nodes from the OCI spec containerd applied, its env through exec.
Also: the refusal when no spec declares a chosen GPU, and the spec index on its own."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from crihook.base import allocation as al
from crihook.base.config import ConfigError, HooksConfig, NodeConfig
from crihook.cli.doctor import gpu, parse
from crihook.cli.doctor.cri import cri_version
from crihook.cli.doctor.finding import Level
from crihook.devices.nvml import GpuInfo, NodeGpus
from crihook.hooks.cdi import CdiIndex, declared
from crihook.hooks.gpu import factory
from crihook.hooks.gpu_edit import GpuOptions
from crihook.simnode import fakenvml
from crihook.simnode.node import NVIDIA_MAJOR, SimNode, make_sim_node
from tests.support.containerd import Containerd
from tests.support.cri import Cri, CriError, container_config, pod_config
from tests.support.daemon import Crihook, running_crihook
from tests.support.gpu_fixtures import write_checkpoint

TOPOLOGY = "pcie-l40s"  # minors 2, 3, 0, 1 in NVML index (bus) order
MINORS = (0, 1, 2, 3)


def node_spec(node: SimNode, minors: tuple[int, ...] = MINORS) -> dict[str, Any]:
    """A CDI spec (cncf-tags/container-device-interface SPEC.md) in the shape nvidia-ctk generates:
    one device per GPU named by UUID with its /dev/nvidiaN, the control nodes for every device at
    spec level. Each device also sets an env the test can look for."""
    return {
        "cdiVersion": "0.6.0",
        "kind": "nvidia.com/gpu",
        "devices": [
            {
                "name": node.uuid(m),
                "containerEdits": {
                    "deviceNodes": [{"path": f"/dev/nvidia{m}", "hostPath": f"{node.dev_root}/nvidia{m}"}],
                    "env": [f"CDI_GPU_{m}={node.uuid(m)}"],
                },
            }
            for m in minors
        ],
        "containerEdits": {
            "deviceNodes": [
                {"path": f"/dev/{n}", "hostPath": f"{node.dev_root}/{n}"}
                for n in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
            ]
        },
    }


@dataclass
class CdiNode:
    node: SimNode
    proxy: Crihook
    spec_dir: Path


@pytest.fixture(scope="module")
def cdi_node(containerd: Containerd, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CdiNode]:
    """crihook with inject = "cdi", looking at the runtime's own spec dir."""
    if not containerd.runtime.has_cdi:
        pytest.skip(f"containerd {containerd.runtime.name} has no CDI")
    node = make_sim_node(tmp_path_factory.mktemp("cdi-node"), TOPOLOGY, char_devices=True)
    config = node.proxy_config(fakenvml.build()).replace(
        "[hooks.gpu]\n", f'[hooks.gpu]\ninject = "cdi"\ncdi_spec_dirs = ["{containerd.cdi_spec_dir}"]\n'
    )
    env = {fakenvml.CONFIG_ENV: str(node.config)}
    with running_crihook(containerd.address, node.root / "crihook", config, env) as proxy:
        yield CdiNode(node, proxy, containerd.cdi_spec_dir)


@pytest.fixture
def cri(cdi_node: CdiNode, cdi_spec_dir: Path) -> Iterator[Cri]:
    write_checkpoint(cdi_node.node.checkpoint, [])
    with Cri(cdi_node.proxy.address) as client:
        yield client
        client.remove_all()


def allocated(*minors: int) -> dict[str, str]:
    return {al.DEVICE_ALLOCATED: json.dumps({"gpu": [{"minor": m} for m in minors]})}


def nvidia_nodes(cri: Cri, container_id: str) -> dict[str, tuple[int, int]]:
    spec = json.loads(cri.container_status(container_id, verbose=True).info["info"])["runtimeSpec"]
    return {d["path"]: (d["major"], d["minor"]) for d in spec["linux"].get("devices", []) if "nvidia" in d["path"]}


@pytest.mark.runtimes("1.7", "2")
def test_cdi_devices_reach_the_container(cdi_node: CdiNode, cri: Cri) -> None:
    node = cdi_node.node
    (cdi_node.spec_dir / "nvidia.json").write_text(json.dumps(node_spec(node)))
    pod = pod_config("cdi-trainer", annotations=allocated(0, 3))
    # as a CUDA image would come: every GPU asked for
    config = container_config("cuda", pod, envs={"NVIDIA_VISIBLE_DEVICES": "all"})
    with cri.pod(pod) as pod_id, cri.container(pod_id, config, pod) as cid:
        ctl = os.stat(node.dev_root / "nvidiactl").st_rdev
        assert nvidia_nodes(cri, cid) == {
            "/dev/nvidia0": (NVIDIA_MAJOR, 0),
            "/dev/nvidia3": (NVIDIA_MAJOR, 3),
            "/dev/nvidiactl": (os.major(ctl), os.minor(ctl)),
            "/dev/nvidia-uvm": (os.major(os.stat(node.dev_root / "nvidia-uvm").st_rdev), 0),
            "/dev/nvidia-uvm-tools": (os.major(os.stat(node.dev_root / "nvidia-uvm-tools").st_rdev), 1),
        }
        env = dict(line.split("=", 1) for line in cri.output(cid, "env").splitlines() if "=" in line)
        assert env["NVIDIA_VISIBLE_DEVICES"] == "void"
        assert {k: v for k, v in env.items() if k.startswith("CDI_GPU_")} == {
            "CDI_GPU_0": node.uuid(0),
            "CDI_GPU_3": node.uuid(3),
        }
        listing = cri.output(cid, "ls", "/dev").split()
        assert {n for n in listing if n.startswith("nvidia") and n[6:].isdigit()} == {"nvidia0", "nvidia3"}


@pytest.mark.runtimes("1.7", "2")
def test_a_gpu_no_spec_declares_is_refused_until_one_does(cdi_node: CdiNode, cri: Cri) -> None:
    node = cdi_node.node
    (cdi_node.spec_dir / "nvidia.yaml").write_text(json.dumps(node_spec(node, (0, 1, 2))))  # JSON is YAML
    (cdi_node.spec_dir / "broken.json").write_text("{not json")
    pod = pod_config("cdi-missing", annotations=allocated(3))
    with cri.pod(pod) as pod_id:
        with pytest.raises(CriError) as refused:
            cri.create_container(pod_id, container_config("main", pod), pod)
        message = refused.value.details
        assert f"GPU {node.uuid(3)}" in message and f"nvidia.com/gpu={node.uuid(3)}" in message
        assert str(cdi_node.spec_dir) in message and "nvidia-ctk cdi generate" in message
        assert "broken.json" in message  # the file that could not be read is named
        assert cri.list_containers(pod_id) == []
        # the spec appears (nvidia-ctk run meanwhile): the next create sees it, no restart needed
        (cdi_node.spec_dir / "nvidia.yaml").write_text(json.dumps(node_spec(node)))
        cid = cri.create_container(pod_id, container_config("main", pod), pod)
        cri.start_container(cid)
        assert set(nvidia_nodes(cri, cid)) >= {"/dev/nvidia3"}


# -- the index and the option, without a runtime


def test_declared_names() -> None:
    spec = {"kind": "nvidia.com/gpu", "devices": [{"name": "GPU-a"}, {"name": "0"}, {"name": ""}, {}, "x"]}
    assert declared(spec) == {"nvidia.com/gpu=GPU-a", "nvidia.com/gpu=0"}
    for bad in (None, [], {"kind": "gpu", "devices": [{"name": "a"}]}, {"kind": "a/b", "devices": {}}):
        assert declared(bad) == frozenset()


def test_index_rereads_only_when_the_dirs_change(tmp_path: Path) -> None:
    etc, run = tmp_path / "etc", tmp_path / "run"
    etc.mkdir()
    index = CdiIndex([str(etc), str(run)])  # run/ missing: no devices from it, no error
    assert index.scan().devices == frozenset()
    (etc / "a.yaml").write_text("kind: example.com/dev\ndevices:\n  - name: one\n")
    (etc / "ignored.txt").write_text("kind: example.com/dev\ndevices: [{name: two}]\n")
    first = index.scan()
    assert first.devices == {"example.com/dev=one"} and first.specs == (str(etc / "a.yaml"),)
    assert index.scan() is first  # nothing changed: nothing parsed again
    run.mkdir()
    (run / "b.json").write_text(json.dumps({"kind": "example.com/dev", "devices": [{"name": "two"}]}))
    assert index.scan().devices == {"example.com/dev=one", "example.com/dev=two"}
    time.sleep(0.01)
    (etc / "a.yaml").write_text("kind: example.com/dev\ndevices:\n  - name: three\n")  # rewritten in place
    assert index.scan().devices == {"example.com/dev=three", "example.com/dev=two"}
    (run / "b.json").write_text("[1, 2")
    scan = index.scan()
    assert scan.devices == {"example.com/dev=three"} and len(scan.problems) == 1 and "b.json" in scan.problems[0]


def test_cdi_spec_dirs_option() -> None:
    def cdi_dirs(values: dict[str, Any]) -> tuple[str, ...]:
        hook = factory(HooksConfig(options={"gpu": values}).table("gpu", GpuOptions)[1], NodeConfig())
        hook.close()
        assert hook.cdi is not None
        return hook.cdi.dirs

    assert cdi_dirs({"inject": "cdi"}) == ("/etc/cdi", "/var/run/cdi")
    assert cdi_dirs({"inject": "cdi", "cdi_spec_dirs": ["/opt/cdi/"]}) == ("/opt/cdi",)
    for bad in ([], "/etc/cdi", ["relative"], [1]):
        with pytest.raises(ConfigError, match=r"\[hooks.gpu\].cdi_spec_dirs"):
            cdi_dirs({"cdi_spec_dirs": bad})


# -- crihook doctor's CDI finding


def _gpus(*uuids: str) -> NodeGpus:
    return NodeGpus(
        driver_version="550.54.15",
        gpus=tuple(
            GpuInfo(index=i, minor=i, uuid=u, name="L40S", memory_total=48 << 30, pci_bus_id=f"0000:{i + 1:02x}:00.0")
            for i, u in enumerate(uuids)
        ),
    )


@pytest.mark.parametrize(
    ("config", "version", "enabled", "where"),
    [
        ({}, (2, 1, 9), True, "io.containerd.cri.v1.runtime"),  # no file: 2.x's defaults
        ({"version": 3}, (2, 1, 9), True, "io.containerd.cri.v1.runtime"),
        ({"version": 3, "plugins": {"io.containerd.cri.v1.runtime": {"enable_cdi": False}}}, (2, 0), False, ""),
        ({"version": 2}, (1, 7, 24), False, "io.containerd.grpc.v1.cri"),  # off by default in 1.7
        ({"version": 2, "plugins": {"io.containerd.grpc.v1.cri": {"enable_cdi": True}}}, (1, 7, 24), True, ""),
        ({"version": 2, "plugins": {"io.containerd.grpc.v1.cri": {"enable_cdi": True}}}, (1, 6, 20), False, ""),
    ],
)
def test_containerd_cdi_settings(config: dict[str, Any], version: tuple[int, ...], enabled: bool, where: str) -> None:
    cdi = parse.containerd_cdi(config, version)
    assert cdi.enabled is enabled
    assert where in cdi.where
    if enabled:
        assert cdi.spec_dirs == ("/etc/cdi", "/var/run/cdi")


def test_doctor_cdi_finding(tmp_path: Path) -> None:
    spec_dir, conf = tmp_path / "cdi", tmp_path / "config.toml"
    spec_dir.mkdir()
    (spec_dir / "nvidia.json").write_text(
        json.dumps({"kind": "nvidia.com/gpu", "devices": [{"name": "GPU-a"}, {"name": "GPU-b"}]})
    )
    conf.write_text(f'version = 3\n[plugins."io.containerd.cri.v1.runtime"]\ncdi_spec_dirs = ["{spec_dir}"]\n')
    cdi = {"inject": "cdi", "cdi_spec_dirs": [str(spec_dir)]}
    two = SimpleNamespace(runtime_name="containerd", runtime_version="2.1.9+unknown")

    f = gpu.check_cdi(cdi, two, _gpus("GPU-a", "GPU-b"), str(conf))
    assert f.level is Level.OK and "2 of 2 GPU(s) have a CDI device" in f.found and "CDI enabled" in f.found

    f = gpu.check_cdi(cdi, two, _gpus("GPU-a", "GPU-b", "GPU-c"), str(conf))
    assert f.level is Level.FAIL and "no nvidia.com/gpu device for GPU-c" in f.found
    assert "nvidia-ctk cdi generate" in f.fix

    f = gpu.check_cdi({}, two, _gpus("GPU-a", "GPU-b", "GPU-c"), str(conf))  # env injection: said, not failed
    assert f.level is Level.OK and "CDI not used" in f.found and "GPU-c" in f.found

    seven = SimpleNamespace(runtime_name="containerd", runtime_version="1.7.24")
    conf.write_text("version = 2\n")
    f = gpu.check_cdi({"inject": "cdi"}, seven, _gpus(), str(conf))
    assert f.level is Level.FAIL and "CDI disabled" in f.found
    assert 'enable_cdi = true under [plugins."io.containerd.grpc.v1.cri"]' in f.fix

    six = SimpleNamespace(runtime_name="containerd", runtime_version="1.6.20~ds1")
    f = gpu.check_cdi({"inject": "cdi"}, six, _gpus(), str(tmp_path / "none.toml"))
    assert f.level is Level.FAIL and "has no CDI" in f.found and "1.7 or newer" in f.fix

    f = gpu.check_cdi(cdi, two, _gpus("GPU-a"), str(tmp_path / "none.toml"))  # defaults: /etc/cdi, /var/run/cdi
    assert f.level is Level.FAIL and f"crihook checks {spec_dir}, containerd reads /etc/cdi" in f.found


@pytest.mark.runtimes("1.6", "2")
def test_doctor_reads_the_real_runtime_and_its_config(containerd: Containerd) -> None:
    """Against the test containerd itself: its Version answer and the config file it runs with."""
    runtime = cri_version(containerd.address, 5.0)
    options = {"inject": "cdi"}
    if containerd.runtime.has_cdi:
        options["cdi_spec_dirs"] = [str(containerd.cdi_spec_dir)]
        (containerd.cdi_spec_dir / "gpus.json").write_text(
            json.dumps({"kind": "nvidia.com/gpu", "devices": [{"name": "GPU-a"}]})
        )
    try:
        f = gpu.check_cdi(options, runtime, _gpus("GPU-a"), str(containerd.config_path))
    finally:
        if containerd.runtime.has_cdi:
            (containerd.cdi_spec_dir / "gpus.json").unlink()
    if containerd.runtime.has_cdi:
        assert f.level is Level.OK and f"spec dirs {containerd.cdi_spec_dir}" in f.found, f
    else:
        assert f.level is Level.FAIL and "has no CDI" in f.found, f
