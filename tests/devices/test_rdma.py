"""RDMA NIC discovery over sysfs trees laid out as the kernel does (class links into /sys/devices,
device and virtfn links), with netdev state from the real rtnetlink where the netdev is in our
namespace."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from crihook.devices import rdma


def link(at: Path, target: Path) -> None:
    at.parent.mkdir(parents=True, exist_ok=True)
    at.symlink_to(os.path.relpath(target, at.parent))


class SysTree:
    """A /sys with PCI functions under a host bridge and root port, and RDMA devices on them."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def function(self, address: str, root_port: str = "0000:00:02.0", numa: int = 0) -> Path:
        fn = self.root / "devices" / "pci0000:00" / root_port / address
        fn.mkdir(parents=True, exist_ok=True)
        (fn / "numa_node").write_text(f"{numa}\n")
        if not (self.root / "bus" / "pci" / "devices" / address).is_symlink():
            link(self.root / "bus" / "pci" / "devices" / address, fn)
        return fn

    def rdma(
        self,
        fn: Path,
        name: str,
        uverbs: str,
        netdevs: dict[str, str] | None = None,
        ports: tuple[str, ...] = ("4: ACTIVE",),
        link_layer: str = "InfiniBand",
    ) -> None:
        dev = fn / "infiniband" / name
        for i, state in enumerate(ports, start=1):
            (dev / "ports" / str(i)).mkdir(parents=True)
            (dev / "ports" / str(i) / "state").write_text(state + "\n")
            (dev / "ports" / str(i) / "link_layer").write_text(link_layer + "\n")
        link(dev / "device", fn)
        (fn / "infiniband_verbs" / uverbs).mkdir(parents=True)
        for nd, state in (netdevs or {}).items():
            (fn / "net" / nd).mkdir(parents=True)
            (fn / "net" / nd / "operstate").write_text(state + "\n")
        link(self.root / "class" / "infiniband" / name, dev)

    def vf(self, pf: Path, n: int, address: str) -> Path:
        fn = self.function(address, root_port=pf.parent.name)
        link(pf / f"virtfn{n}", fn)
        link(fn / "physfn", pf)
        return fn

    def cpus(self, node: int, socket: int) -> None:
        (self.root / "devices" / "system" / "node" / f"node{node}").mkdir(parents=True, exist_ok=True)
        (self.root / "devices" / "system" / "node" / f"node{node}" / "cpulist").write_text(
            f"{node * 2}-{node * 2 + 1}\n"
        )
        topo = self.root / "devices" / "system" / "cpu" / f"cpu{node * 2}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text(f"{socket}\n")


@pytest.fixture
def tree(tmp_path: Path) -> SysTree:
    return SysTree(tmp_path / "sys")


def no_links() -> dict[str, str]:
    return {}


def test_pf_with_vfs_netdevs_and_locality(tree: SysTree) -> None:
    tree.cpus(1, 1)
    pf = tree.function("0000:09:00.0", root_port="0000:00:03.0", numa=1)
    tree.rdma(pf, "mlx5_0", "uverbs0", {"ib0": "up"})
    for n, addr in enumerate(["0000:09:00.2", "0000:09:00.3"]):
        vf = tree.vf(pf, n, addr)
        tree.rdma(vf, f"mlx5_{n + 2}", f"uverbs{n + 2}", {f"ib0v{n}": "down"})
    nics = rdma.discover(str(tree.root), links=no_links)
    assert len(nics) == 1  # the VFs' own RDMA devices are listed under the PF
    nic = nics[0]
    assert (nic.name, nic.pci_address, nic.numa_node, nic.socket, nic.pcie_root) == (
        "mlx5_0",
        "0000:09:00.0",
        1,
        1,
        "0000:00:03.0",
    )
    assert nic.uverbs == ("uverbs0",)
    assert nic.netdevs == (rdma.Netdev("ib0", "UP", False),)
    assert nic.port_states == ("ACTIVE",) and nic.link_layer == "InfiniBand" and nic.healthy
    assert [(v.index, v.pci_address, v.uverbs) for v in nic.vfs] == [
        (0, "0000:09:00.2", ("uverbs2",)),
        (1, "0000:09:00.3", ("uverbs3",)),
    ]
    assert nic.vfs[1].netdevs == (rdma.Netdev("ib0v1", "DOWN", False),)


def test_netdev_state_comes_from_rtnetlink_in_our_namespace(tree: SysTree) -> None:
    """`lo` exists in every network namespace: its state must come from the kernel (UNKNOWN for a
    loopback), not from the sysfs file, which here says otherwise."""
    pf = tree.function("0000:3b:00.0")
    tree.rdma(pf, "mlx5_0", "uverbs0", {"lo": "dormant", "not-in-this-netns0": "up"})
    nic = rdma.discover(str(tree.root))[0]
    by_name = {n.name: n for n in nic.netdevs}
    assert by_name["lo"] == rdma.Netdev("lo", "UNKNOWN", True)
    assert by_name["not-in-this-netns0"] == rdma.Netdev("not-in-this-netns0", "UP", False)


def test_several_nics_sorted_by_pci_and_port_health(tree: SysTree) -> None:
    for name, addr, ports in [
        ("mlx5_1", "0000:af:00.0", ("1: DOWN",)),
        ("mlx5_0", "0000:1a:00.0", ("4: ACTIVE", "1: DOWN")),
        ("mlx5_2", "0000:5e:00.0", ()),
    ]:
        tree.rdma(tree.function(addr), name, f"uverbs{name[-1]}", ports=ports, link_layer="Ethernet")
    nics = rdma.discover(str(tree.root), links=no_links)
    assert [n.pci_address for n in nics] == ["0000:1a:00.0", "0000:5e:00.0", "0000:af:00.0"]
    assert [n.healthy for n in nics] == [True, True, False]
    assert nics[0].port_states == ("ACTIVE", "DOWN") and nics[0].link_layer == "Ethernet"
    assert nics[1].port_states == () and nics[1].link_layer == ""
    assert all(n.numa_node == 0 and n.socket == -1 for n in nics)  # no CPU topology in this tree


def test_no_infiniband_class_means_no_nics_and_no_netlink(tree: SysTree) -> None:
    def boom() -> dict[str, str]:
        raise AssertionError("rtnetlink asked on a node without RDMA devices")

    assert rdma.discover(str(tree.root), links=boom) == []


def test_a_device_without_a_pci_function_is_skipped(tree: SysTree) -> None:
    (tree.root / "class" / "infiniband" / "rxe0").mkdir(parents=True)  # soft RoCE: no PCI device
    tree.rdma(tree.function("0000:09:00.0"), "mlx5_0", "uverbs0")
    assert [n.name for n in rdma.discover(str(tree.root), links=no_links)] == ["mlx5_0"]
