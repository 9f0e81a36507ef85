"""The DRA driver's names: device names round-trip to minors and are DNS labels; CDI ids are qualified."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from crihook.base import dra

DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
ATTRIBUTE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,31}")  # an unqualified attribute or capacity name


@given(st.integers(min_value=0, max_value=999_999))
def test_device_names_round_trip_to_minors(minor: int) -> None:
    name = dra.device_name(minor)
    assert DNS_LABEL.fullmatch(name) and len(name) <= 63
    assert dra.device_minor(name) == minor


def test_other_names_stand_for_no_minor() -> None:
    for name in ("gpu-", "gpu-01", "gpu-x", "mig-0", "gpu-0-1", "GPU-0"):
        assert dra.device_minor(name) is None


def test_attribute_and_capacity_names_are_valid_identifiers() -> None:
    names = [
        dra.ATTR_UUID,
        dra.ATTR_MODEL,
        dra.ATTR_MINOR,
        dra.ATTR_INDEX,
        dra.ATTR_DRIVER_VERSION,
        dra.ATTR_CUDA_CAPABILITY,
        dra.ATTR_PCI_BUS_ID,
        dra.ATTR_NUMA_NODE,
        dra.partition_attribute(8),
        dra.CAPACITY_CORES,
        dra.CAPACITY_MEMORY,
    ]
    assert all(ATTRIBUTE.fullmatch(n) for n in names)
    assert dra.ATTR_PCIE_ROOT.split("/")[1] == "pcieRoot"


def test_cdi_device_is_kind_and_claim_device() -> None:
    assert dra.cdi_device("1234-ab", "gpu-3") == "gpu.crihook.io/claim=1234-ab-gpu-3"
    assert dra.pool_name("node-a") == "node-a"
