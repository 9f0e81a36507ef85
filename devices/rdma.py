"""RDMA NICs from sysfs: /sys/class/infiniband/<dev>, its PCI function, verbs devices, netdevs and
SR-IOV virtual functions.

The link names and operational state of the netdevs come from the kernel through pyroute2 (rtnetlink)
when they live in our network namespace; a netdev moved into a pod's namespace is no longer visible
there, so sysfs answers for it. Everything else is sysfs, rooted at `sys_root` so tests can build a
tree.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from crihook.devices import sysfs

log = logging.getLogger("crihook.devices.rdma")

_VIRTFN = re.compile(r"virtfn([0-9]+)\Z")
_UVERBS = re.compile(r"uverbs[0-9]+\Z")
ACTIVE = "ACTIVE"


@dataclass(frozen=True, slots=True)
class Netdev:
    name: str
    state: str  # operstate, upper case as rtnetlink names it: UP, DOWN, UNKNOWN, ...
    in_netns: bool  # seen through rtnetlink in our network namespace


@dataclass(frozen=True, slots=True)
class VirtualFunction:
    index: int  # N of the PF's virtfnN link
    pci_address: str
    uverbs: tuple[str, ...]
    netdevs: tuple[Netdev, ...]


@dataclass(frozen=True, slots=True)
class RdmaNic:
    name: str  # the RDMA device, e.g. mlx5_0
    pci_address: str  # of the physical function
    numa_node: int
    socket: int
    pcie_root: str
    uverbs: tuple[str, ...]  # /dev/infiniband/<name>
    netdevs: tuple[Netdev, ...]
    port_states: tuple[str, ...]  # per port, e.g. ("ACTIVE",); empty when sysfs shows no ports
    link_layer: str  # InfiniBand or Ethernet (RoCE), of the first port
    vfs: tuple[VirtualFunction, ...]

    @property
    def healthy(self) -> bool:
        """A NIC with ports is usable when one of them is ACTIVE."""
        return not self.port_states or ACTIVE in self.port_states


def netns_links() -> dict[str, str]:
    """ifname -> operstate for every link in this network namespace, through rtnetlink; empty when
    rtnetlink can not be asked (a sandbox without netlink)."""
    from pyroute2 import IPRoute  # loaded only when a node has RDMA devices

    try:
        with IPRoute() as ipr:
            return {
                link.get_attr("IFLA_IFNAME"): str(link.get_attr("IFLA_OPERSTATE") or "UNKNOWN")
                for link in ipr.get_links()
            }
    except OSError as e:
        log.warning("rtnetlink unavailable; netdev state from sysfs", extra={"error": str(e)})
        return {}


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _uverbs(fn_dir: str) -> tuple[str, ...]:
    return tuple(v for v in _listdir(os.path.join(fn_dir, "infiniband_verbs")) if _UVERBS.fullmatch(v))


def _netdevs(fn_dir: str, links: Mapping[str, str]) -> tuple[Netdev, ...]:
    out = []
    for name in _listdir(os.path.join(fn_dir, "net")):
        if name in links:
            out.append(Netdev(name, links[name].upper(), True))
        else:
            state = _read(os.path.join(fn_dir, "net", name, "operstate")) or "unknown"
            out.append(Netdev(name, state.upper(), False))
    return tuple(out)


def _port_states(dev_dir: str) -> tuple[tuple[str, ...], str]:
    ports = sorted(_listdir(os.path.join(dev_dir, "ports")), key=lambda p: int(p) if p.isdigit() else 0)
    states = []
    for p in ports:
        raw = _read(os.path.join(dev_dir, "ports", p, "state"))  # "4: ACTIVE"
        states.append(raw.split(":", 1)[-1].strip().upper() or "UNKNOWN")
    layer = _read(os.path.join(dev_dir, "ports", ports[0], "link_layer")) if ports else ""
    return tuple(states), layer


def _function_address(path: str) -> str:
    """The PCI address a sysfs link (device, virtfnN) points to; "" when it does not name one."""
    try:
        return sysfs.pci_address(os.path.basename(os.path.realpath(path)))
    except ValueError:
        return ""


def discover(sys_root: str = "/sys", links: Callable[[], Mapping[str, str]] = netns_links) -> list[RdmaNic]:
    """Every RDMA physical function, sorted by PCI address (that order gives the minors). A virtual
    function's own RDMA device is listed under its PF, not as a NIC."""
    class_dir = os.path.join(sys_root, "class", "infiniband")
    names = _listdir(class_dir)
    if not names:
        return []
    netns = links()
    nics = []
    for name in names:
        dev_dir = os.path.join(class_dir, name)
        fn_dir = os.path.join(dev_dir, "device")
        address = _function_address(fn_dir)
        if not address:
            log.warning("RDMA device skipped: no PCI function behind it", extra={"device": name})
            continue
        if os.path.exists(os.path.join(fn_dir, "physfn")):
            continue
        vfs = []
        for entry in _listdir(fn_dir):
            m = _VIRTFN.fullmatch(entry)
            vf_address = _function_address(os.path.join(fn_dir, entry)) if m else ""
            if m and vf_address:
                vf_dir = os.path.join(sys_root, "bus", "pci", "devices", vf_address)
                vfs.append(VirtualFunction(int(m.group(1)), vf_address, _uverbs(vf_dir), _netdevs(vf_dir, netns)))
        states, layer = _port_states(dev_dir)
        numa = sysfs.numa_node(sys_root, address)
        nics.append(
            RdmaNic(
                name=name,
                pci_address=address,
                numa_node=numa,
                socket=sysfs.socket_of_node(sys_root, numa),
                pcie_root=sysfs.root_port(sys_root, address),
                uverbs=_uverbs(fn_dir),
                netdevs=_netdevs(fn_dir, netns),
                port_states=states,
                link_layer=layer,
                vfs=tuple(sorted(vfs, key=lambda v: v.index)),
            )
        )
    return sorted(nics, key=lambda n: n.pci_address)
