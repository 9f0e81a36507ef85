"""What a container gets for its GPUs: CUDA's numbering, device nodes, HAMi-core's limits."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crihook.base.spec import Device, Mount
from crihook.hooks import grant

GiB = 1 << 30


@dataclass(frozen=True)
class Gpu:
    minor: int
    uuid: str
    pci_bus_id: str
    memory_total: int = 16 * GiB


def gpu(minor: int, bus: int) -> Gpu:
    return Gpu(minor, f"GPU-{minor}", f"0000:{bus:02X}:00.0")


def test_cuda_order_is_pci_bus_order_whatever_the_minors() -> None:
    shares = [grant.Share(gpu(0, 0xB1), 4 * GiB), grant.Share(gpu(7, 0x1A), 8 * GiB, 50)]
    ordered = grant.cuda_order(shares)
    assert [s.gpu.minor for s in ordered] == [7, 0]
    assert grant.hami_env(ordered) == {
        "CUDA_DEVICE_MEMORY_LIMIT_0": "8192m",
        "CUDA_DEVICE_MEMORY_LIMIT_1": "4096m",
        "CUDA_DEVICE_SM_LIMIT": "50",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": "/tmp/vgpu/cudevshr.cache",
    }


@given(st.lists(st.integers(min_value=0, max_value=255), unique=True, max_size=16))
def test_limits_are_numbered_once_each_in_pci_order(buses: list[int]) -> None:
    shares = grant.cuda_order(grant.Share(gpu(i, b), (i + 1) << 20) for i, b in enumerate(buses))
    env = grant.hami_env(shares)
    limits = [env[f"CUDA_DEVICE_MEMORY_LIMIT_{i}"] for i in range(len(buses))]
    assert limits == [f"{s.memory >> 20}m" for s in sorted(shares, key=lambda s: s.gpu.pci_bus_id)]
    assert sum(k.startswith("CUDA_DEVICE_MEMORY_LIMIT_") for k in env) == len(buses)


def test_a_share_is_less_than_the_whole_gpu() -> None:
    g = gpu(0, 1)
    assert not grant.Share(g, g.memory_total).shared
    assert grant.Share(g, g.memory_total, 50).shared
    assert grant.Share(g, g.memory_total - 1).shared


def test_device_nodes_then_the_control_nodes_present() -> None:
    present = {"/host/dev/nvidia3", "/host/dev/nvidiactl", "/host/dev/nvidia-uvm"}
    nodes = grant.device_nodes([gpu(3, 1)], present.__contains__, "/host/dev")
    assert nodes == (
        Device("/dev/nvidia3", "/host/dev/nvidia3", "rw"),
        Device("/dev/nvidiactl", "/host/dev/nvidiactl", "rw"),
        Device("/dev/nvidia-uvm", "/host/dev/nvidia-uvm", "rw"),
    )
    with pytest.raises(grant.MissingDeviceNode, match="/host/dev/nvidia4 of minor 4"):
        grant.device_nodes([gpu(4, 2)], present.__contains__, "/host/dev")


def test_hami_mounts() -> None:
    paths = grant.HamiCore(lock_dir="")
    assert grant.hami_mounts(paths, "claim-1") == [
        Mount(paths.library, paths.library, readonly=True),
        Mount("/etc/ld.so.preload", paths.preload_file, readonly=True),
        Mount("/tmp/vgpu", f"{paths.cache_root}/claim-1"),
    ]
    mounts = grant.hami_mounts(grant.HamiCore(), "x")
    assert mounts[-1] == Mount("/tmp/vgpulock", "/var/lib/crihook/hami-core/lock")
    assert grant.hami_dirs(mounts) == ["/var/lib/crihook/hami-core/containers/x", "/var/lib/crihook/hami-core/lock"]
    assert grant.hami_dirs(grant.hami_mounts(paths, "y")) == [f"{paths.cache_root}/y"]
