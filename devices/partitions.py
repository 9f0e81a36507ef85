"""GPU partition tables (Koordinator's `scheduling.koordinator.sh/gpu-partitions`): which GPU sets a
pod may be given on nodes whose NVSwitch fabric only allows certain combinations.

Built in: the 8-GPU NVSwitch baseboards (HGX/DGX H100, H800, H20, A100) in Fabric Manager's shared
NVSwitch layout: all eight, the two halves of four, the four neighbouring pairs, and each GPU alone.
Positions are GPU module order, which is NVML index order on these boards; the table names the
minors at those positions. Any other node gets no table unless the operator supplies one
(config `reporter.partition_table`, a JSON file in the annotation's own format). Pure: no I/O here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict

from crihook.base import quantity

ANNOTATION = "scheduling.koordinator.sh/gpu-partitions"
NVLINK = "NVLink"


@dataclass(frozen=True, slots=True)
class Model:
    pattern: re.Pattern[str]
    ring_bandwidth: str  # NVLink bandwidth per GPU and direction, what an all-reduce ring can reach


# "H20" must not match "H200": the patterns are whole words of NVML's product name.
BUILTIN_MODELS: tuple[Model, ...] = (
    Model(re.compile(r"\bH100\b"), "450Gi"),
    Model(re.compile(r"\bH800\b"), "200Gi"),
    Model(re.compile(r"\bH20\b"), "450Gi"),
    Model(re.compile(r"\bA100\b"), "300Gi"),
)
_LAYOUT: dict[int, tuple[tuple[int, ...], ...]] = {
    1: tuple((i,) for i in range(8)),
    2: ((0, 1), (2, 3), (4, 5), (6, 7)),
    4: ((0, 1, 2, 3), (4, 5, 6, 7)),
    8: ((0, 1, 2, 3, 4, 5, 6, 7),),
}


class Partition(TypedDict):
    """One GPU set a pod may be given, in the annotation's JSON shape."""

    minors: list[int]
    gpuLinkType: NotRequired[str]
    ringBusBandwidth: NotRequired[str]  # a quantity
    allocationScore: NotRequired[int]


# GPU count (as a decimal string, the annotation's key) -> the sets of that many GPUs
PartitionTable = dict[str, list[Partition]]


class PartitionTableError(ValueError):
    """A partition table that can not be used; str() names the field."""


def builtin_table(model_name: str, minors_by_index: Sequence[int], nvswitch: bool) -> PartitionTable | None:
    """The table for a node of 8 GPUs of one built-in model on NVSwitches; None for any other node."""
    if len(minors_by_index) != 8 or not nvswitch:
        return None
    model = next((m for m in BUILTIN_MODELS if m.pattern.search(model_name)), None)
    if model is None:
        return None
    return {
        str(size): [
            {
                "minors": [minors_by_index[p] for p in positions],
                "gpuLinkType": NVLINK,
                "ringBusBandwidth": model.ring_bandwidth,
                "allocationScore": 1,
            }
            for positions in groups
        ]
        for size, groups in _LAYOUT.items()
    }


def parse_table(data: str | bytes, where: str) -> PartitionTable:
    """A table from JSON, checked field by field. Raises PartitionTableError naming `where` and the field."""
    try:
        doc = json.loads(data)
    except ValueError as e:
        raise PartitionTableError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(doc, dict) or not doc:
        raise PartitionTableError(f"{where}: expected a non-empty object of GPU count -> partitions")
    table: PartitionTable = {}
    for key, parts in doc.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) > 0):
            raise PartitionTableError(f"{where}: key {key!r} is not a positive GPU count")
        if not isinstance(parts, list) or not parts:
            raise PartitionTableError(f"{where}[{key!r}]: expected a non-empty list of partitions")
        table[str(int(key))] = [_partition(p, int(key), f"{where}[{key!r}][{i}]") for i, p in enumerate(parts)]
    return dict(sorted(table.items(), key=lambda kv: int(kv[0])))


def _partition(p: Any, size: int, where: str) -> Partition:
    if not isinstance(p, dict):
        raise PartitionTableError(f"{where}: expected an object")
    unknown = set(p) - {"minors", "gpuLinkType", "ringBusBandwidth", "allocationScore"}
    if unknown:
        raise PartitionTableError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    minors = p.get("minors")
    if (
        not isinstance(minors, list)
        or not all(isinstance(m, int) and not isinstance(m, bool) and 0 <= m < 1 << 20 for m in minors)
        or len(set(minors)) != len(minors)
    ):
        raise PartitionTableError(f"{where}.minors: expected a list of distinct GPU minors")
    if len(minors) != size:
        raise PartitionTableError(f"{where}.minors: {len(minors)} GPUs under the key for {size}")
    out: Partition = {"minors": minors}
    if "gpuLinkType" in p:
        if not isinstance(p["gpuLinkType"], str):
            raise PartitionTableError(f"{where}.gpuLinkType: expected a string")
        out["gpuLinkType"] = p["gpuLinkType"]
    if "ringBusBandwidth" in p:
        try:
            if quantity.parse(p["ringBusBandwidth"]) < 0:
                raise quantity.QuantityError("negative")
        except quantity.QuantityError as e:
            raise PartitionTableError(f"{where}.ringBusBandwidth: {e}") from None
        out["ringBusBandwidth"] = str(p["ringBusBandwidth"])
    if "allocationScore" in p:
        score = p["allocationScore"]
        if not isinstance(score, int) or isinstance(score, bool):
            raise PartitionTableError(f"{where}.allocationScore: expected an integer")
        out["allocationScore"] = score
    return out


def table_for_node(
    configured: Mapping[str, list[Partition]] | None, model_name: str, minors_by_index: Sequence[int], nvswitch: bool
) -> PartitionTable | None:
    """The operator's table when there is one and it names only GPUs of this node, else the
    built-in one for the node's model. Raises PartitionTableError for a configured table naming a
    minor the node does not have."""
    if configured is not None:
        present = set(minors_by_index)
        for key, parts in configured.items():
            for i, p in enumerate(parts):
                missing = sorted(set(p["minors"]) - present)
                if missing:
                    raise PartitionTableError(f"partition table [{key!r}][{i}]: no GPU minor {missing} on this node")
        return dict(configured)
    return builtin_table(model_name, minors_by_index, nvswitch)
