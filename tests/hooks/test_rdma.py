"""The rdma hook over a sysfs and /dev made in a temporary directory."""

from __future__ import annotations

import json
import re
from pathlib import Path

import grpc
import pytest

from crihook.base import allocation as al
from crihook.base.config import ConfigError, HooksConfig, NodeConfig, NoOptions
from crihook.base.spec import Device
from crihook.hooks.base import ContainerInfo, HookContext, HookError, PodInfo, Stage
from crihook.hooks.rdma import canonical_pci, factory
from crihook.hooks.registry import build_chain
from crihook.simnode.node import make_rdma_sys

PF = "0000:09:00.0"
VF1 = "0000:09:00.2"
VF2 = "0000:09:00.3"


@pytest.fixture
def roots(tmp_path: Path) -> tuple[Path, Path]:
    sys_root, dev_root = tmp_path / "sys", tmp_path / "dev"
    functions = {PF: ["uverbs0"], VF1: ["uverbs2"], VF2: ["uverbs3"], "0000:af:00.1": ["uverbs1"]}
    make_rdma_sys(sys_root, dev_root, functions)
    return sys_root, dev_root


def handle(roots: tuple[Path, Path], annotations: dict[str, str], container: str = "c") -> list[Device] | None:
    sys_root, dev_root = roots
    hook = factory(NoOptions(), NodeConfig(sys_root=str(sys_root), dev_root=str(dev_root)))
    pod = PodInfo("p", "ns", "uid-1", annotations=annotations)
    edit = hook.handle(HookContext(Stage.PRE_CREATE_CONTAINER, pod, ContainerInfo(container)))
    return None if edit is None else edit.add_devices


def rdma(*entries: dict) -> dict[str, str]:
    return {al.DEVICE_ALLOCATED: json.dumps({"rdma": list(entries)})}


def test_pf(roots: tuple[Path, Path]) -> None:
    dev = roots[1]
    assert handle(roots, rdma({"minor": 0, "id": PF})) == [
        Device("/dev/infiniband/rdma_cm", f"{dev}/infiniband/rdma_cm", "rw"),
        Device("/dev/infiniband/uverbs0", f"{dev}/infiniband/uverbs0", "rw"),
    ]


def test_vfs_instead_of_the_pf(roots: tuple[Path, Path]) -> None:
    devices = handle(roots, rdma({"minor": 0, "id": PF, "extension": {"vfs": [{"busID": VF1}, {"busID": VF2}]}}))
    assert devices is not None
    assert [d.container_path for d in devices] == [
        "/dev/infiniband/rdma_cm",
        "/dev/infiniband/uverbs2",
        "/dev/infiniband/uverbs3",
    ]


def test_two_nics_and_nvml_spelling(roots: tuple[Path, Path]) -> None:
    devices = handle(roots, rdma({"minor": 0, "id": PF}, {"minor": 1, "id": "00000000:AF:00.1"}))
    assert devices is not None
    assert [d.container_path for d in devices] == [
        "/dev/infiniband/rdma_cm",
        "/dev/infiniband/uverbs0",
        "/dev/infiniband/uverbs1",
    ]


def test_no_rdma_allocation(roots: tuple[Path, Path]) -> None:
    assert handle(roots, {}) is None
    assert handle(roots, {al.DEVICE_ALLOCATED: '{"gpu":[{"minor":1}]}'}) is None


def test_per_container(roots: tuple[Path, Path]) -> None:
    ann = rdma({"minor": 0, "id": PF}) | {al.CONTAINER_DEVICES: '{"a":{"rdma":[0]},"b":{"gpu":[]}}'}
    assert handle(roots, ann, "a") is not None
    assert handle(roots, ann, "b") is None


def test_rdma_cm_only_where_present(roots: tuple[Path, Path]) -> None:
    (roots[1] / "infiniband" / "rdma_cm").unlink()
    devices = handle(roots, rdma({"minor": 0, "id": PF}))
    assert devices is not None and [d.container_path for d in devices] == ["/dev/infiniband/uverbs0"]


@pytest.mark.parametrize(
    ("annotations", "code", "pattern"),
    [
        (
            rdma({"minor": 0, "id": "../../x"}),
            grpc.StatusCode.INVALID_ARGUMENT,
            r"rdma\[0\]\.id: .* is not a PCI address",
        ),
        (rdma({"minor": 3}), grpc.StatusCode.INVALID_ARGUMENT, r"rdma minor 3: neither id nor extension.vfs"),
        (
            rdma({"minor": 0, "id": "0000:3b:00.0"}),
            grpc.StatusCode.FAILED_PRECONDITION,
            r"rdma minor 0: PCI function 0000:3b:00.0 has no RDMA verbs device on this node",
        ),
        ({al.DEVICE_ALLOCATED: "{"}, grpc.StatusCode.INVALID_ARGUMENT, r"device-allocated: not valid JSON"),
    ],
)
def test_refusals(roots: tuple[Path, Path], annotations: dict[str, str], code: grpc.StatusCode, pattern: str) -> None:
    with pytest.raises(HookError) as info:
        handle(roots, annotations)
    assert info.value.code == code
    assert re.search(pattern, info.value.reason), info.value.reason
    assert info.value.reason.startswith(f"annotation {al.DEVICE_ALLOCATED}: ")


def test_missing_device_node(roots: tuple[Path, Path]) -> None:
    (roots[1] / "infiniband" / "uverbs0").unlink()
    with pytest.raises(HookError, match=r"device node .*/infiniband/uverbs0 is missing on this node"):
        handle(roots, rdma({"minor": 0, "id": PF}))


def test_canonical_pci() -> None:
    assert canonical_pci("00000000:AF:00.1") == "0000:af:00.1"
    assert canonical_pci("0000:09:00.0") == "0000:09:00.0"
    assert canonical_pci("10000:01:00.0") == "10000:01:00.0"


def test_unknown_options_are_refused() -> None:
    hooks = HooksConfig(options={"rdma": {"timeout_ms": 50, "verbose": True}}, source="c.toml")
    with pytest.raises(ConfigError, match=r"^c.toml \[hooks.rdma\].verbose: unknown key \(known: none\)$"):
        build_chain(hooks, NodeConfig(), {"rdma": factory})


def test_registered_entry_point() -> None:
    from crihook.hooks.registry import discover_factories

    hook = discover_factories()["rdma"](NoOptions(), NodeConfig())
    assert (hook.name, hook.priority, hook.stages) == ("rdma", 210, frozenset({Stage.PRE_CREATE_CONTAINER}))
