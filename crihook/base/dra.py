"""crihook's DRA driver, by name: what its ResourceSlices, DeviceClass and CDI specs call things.

The node side (the kubelet plugin and the slice publisher) writes these names and the scheduler side
(counting claims, the allocator model of `crihook simulate`) reads them, so both import them from
here. Attribute and capacity names are unqualified: Kubernetes qualifies them with the driver's
name, so a CEL selector spells them `device.attributes["gpu.crihook.io"].uuid`.
"""

from __future__ import annotations

import re

DRIVER = "gpu.crihook.io"
DEVICE_CLASS = DRIVER  # the DeviceClass selecting every device of the driver
CDI_VENDOR = DRIVER
CDI_CLASS = "claim"
CDI_KIND = f"{CDI_VENDOR}/{CDI_CLASS}"  # one CDI spec per prepared claim, devices <claim UID>-<device>

# Device attributes, one per GPU (values: uuid, model, pciBusID, nvlinkPartitionN strings; minor,
# index, numaNode ints; driverVersion, cudaComputeCapability semantic versions).
ATTR_UUID = "uuid"
ATTR_MODEL = "model"  # NVML's product name, e.g. "NVIDIA H100 80GB HBM3"
ATTR_MINOR = "minor"  # /dev/nvidia<minor>
ATTR_INDEX = "index"  # NVML's index (PCI order)
ATTR_DRIVER_VERSION = "driverVersion"
ATTR_CUDA_CAPABILITY = "cudaComputeCapability"
ATTR_PCI_BUS_ID = "pciBusID"  # sysfs spelling, 0000:1b:00.0
ATTR_NUMA_NODE = "numaNode"  # -1: not known
ATTR_PCIE_ROOT = "resource.kubernetes.io/pcieRoot"  # Kubernetes' standard attribute, qualified
ATTR_PARTITION_PREFIX = "nvlinkPartition"  # + GPU count: the id of the partition of that size holding the GPU

# Capacities of a GPU: `cores` in percent of its SMs, `memory` in bytes.
CAPACITY_CORES = "cores"
CAPACITY_MEMORY = "memory"
FULL_CORES = 100

# Device taint keys (KEP-5055).
TAINT_UNHEALTHY = f"{DRIVER}/unhealthy"

_DEVICE_NAME = re.compile(r"gpu-(0|[1-9][0-9]{0,5})")


def pool_name(node: str) -> str:
    """The driver's one pool on a node is named after the node."""
    return node


def device_name(minor: int) -> str:
    """A GPU's device name in the slice: a DNS label, stable across reboots (the minor)."""
    return f"gpu-{minor}"


def device_minor(name: str) -> int | None:
    """The minor a device name of this driver stands for; None for any other name."""
    m = _DEVICE_NAME.fullmatch(name)
    return int(m.group(1)) if m else None


def partition_attribute(size: int) -> str:
    """The attribute saying which partition of `size` GPUs holds a GPU."""
    return f"{ATTR_PARTITION_PREFIX}{size}"


def cdi_device(claim_uid: str, device: str) -> str:
    """The fully qualified CDI device kubelet passes to the runtime for one device of a claim."""
    return f"{CDI_KIND}={claim_uid}-{device}"
