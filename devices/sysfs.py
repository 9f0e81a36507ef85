"""Where a PCI function sits on the node, from sysfs: NUMA node, CPU socket and PCIe root port.

GPUs and NICs both need it, and the scheduler matches them by it (a GPU and a NIC under one root
port or one socket talk without crossing the inter-socket link). Every read tolerates a missing or
odd file: sysfs layouts differ between kernels and virtual machines, and an unknown locality
(-1, "") is better than no report.
"""

from __future__ import annotations

import os
import re

from crihook.base.allocation import PCI_ADDRESS

UNKNOWN = -1
_HOST_BRIDGE = re.compile(r"pci[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}\Z")


def pci_address(address: str) -> str:
    """The sysfs spelling of a PCI address (NVML writes "00000000:1B:00.0", sysfs "0000:1b:00.0").
    Raises ValueError for anything that is not domain:bus:device.function."""
    if not PCI_ADDRESS.fullmatch(address):
        raise ValueError(f"{address[:40]!r} is not a PCI address (domain:bus:device.function)")
    domain, rest = address.split(":", 1)
    return f"{int(domain, 16):04x}:{rest.lower()}"


def pci_device_dir(sys_root: str, address: str) -> str:
    return os.path.join(sys_root, "bus", "pci", "devices", pci_address(address))


def read_int(path: str, default: int = UNKNOWN) -> int:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return default


def numa_node(sys_root: str, address: str) -> int:
    """The function's NUMA node; -1 when the platform does not say (sysfs writes -1 itself then)."""
    node = read_int(os.path.join(pci_device_dir(sys_root, address), "numa_node"))
    return node if node >= 0 else UNKNOWN


def first_cpu(cpulist: str) -> int:
    """The lowest CPU of a kernel cpulist ("0-3,8-11"); -1 for an empty or malformed list."""
    try:
        return min(int(part.split("-")[0]) for part in cpulist.strip().split(",") if part)
    except ValueError:
        return UNKNOWN


def socket_of_node(sys_root: str, node: int) -> int:
    """The CPU package (socket) of a NUMA node, through the node's first CPU."""
    if node < 0:
        return UNKNOWN
    try:
        with open(os.path.join(sys_root, "devices", "system", "node", f"node{node}", "cpulist")) as f:
            cpu = first_cpu(f.read())
    except OSError:
        return UNKNOWN
    if cpu < 0:
        return UNKNOWN
    return read_int(os.path.join(sys_root, "devices", "system", "cpu", f"cpu{cpu}", "topology", "physical_package_id"))


def root_port(sys_root: str, address: str) -> str:
    """The PCIe root port above the function (its address), or the host bridge ("pci0000:17") for a
    function on the root bus; "" when sysfs does not show the hierarchy. The device link resolves to
    /sys/devices/pci<domain>:<bus>/<root port>/.../<function>."""
    path = os.path.realpath(pci_device_dir(sys_root, address))
    parts = path.split(os.sep)
    for i, part in enumerate(parts):
        if _HOST_BRIDGE.fullmatch(part) and i + 1 < len(parts):
            below = parts[i + 1]
            if PCI_ADDRESS.fullmatch(below) and below != pci_address(address):
                return below
            return part
    return ""


def host_bridge(sys_root: str, address: str) -> str:
    """The PCIe root complex (host bridge) above the function, "pci<domain>:<bus>", as Kubernetes'
    `resource.kubernetes.io/pcieRoot` attribute spells it; "" when sysfs does not show it."""
    path = os.path.realpath(pci_device_dir(sys_root, address))
    return next((part for part in path.split(os.sep) if _HOST_BRIDGE.fullmatch(part)), "")
