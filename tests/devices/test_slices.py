"""The DRA driver's ResourceSlices: what each GPU publishes, what is left out and why, the API's
limits (the project's own check, and Kubernetes' strict schemas of every supported release)."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crihook.base import dra
from crihook.devices import partitions, slices
from crihook.devices.nvml import GpuInfo, NodeGpus

H100 = "NVIDIA H100 80GB HBM3"
MEMORY = 85520809984
SUPPORTED = ("1.34.0", "1.35.0", "1.36.0", "1.37.0")
BOTH = slices.Features(consumable_capacity=True, device_taints=True)


def gpu(minor: int, **kw: Any) -> GpuInfo:
    fields: dict[str, Any] = {
        "index": minor,
        "minor": minor,
        "uuid": f"GPU-{minor:08x}-0000-0000-0000-000000000000",
        "name": H100,
        "memory_total": MEMORY,
        "pci_bus_id": f"0000:{0x1B + minor:02x}:00.0",
        "numa_node": minor // 4,
        "pcie_root_complex": f"pci0000:{minor // 2:02x}",
        "cuda_capability": "9.0",
    }
    return GpuInfo(**(fields | kw))


def node(*gpus: GpuInfo, driver: str = "550.54.15") -> NodeGpus:
    return NodeGpus(driver_version=driver, gpus=gpus)


def dgx() -> tuple[NodeGpus, partitions.PartitionTable]:
    found = node(*(gpu(i) for i in range(8)))
    table = partitions.builtin_table(H100, list(range(8)), nvswitch=True)
    assert table is not None
    return found, table


def devices(pool: slices.Pool) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for s in pool.slices for d in s["spec"]["devices"]}


def schema_valid(obj: dict[str, Any], version: str) -> None:
    kubernetes_validate.validate(obj, version, strict=True)


def test_every_gpu_has_its_attributes_and_capacities() -> None:
    found, table = dgx()
    pool = slices.build("node-a", "uid-1", found, table, (), BOTH, generation=3)
    (one,) = pool.slices
    assert one["spec"]["pool"] == {"name": "node-a", "generation": 3, "resourceSliceCount": 1}
    assert one["spec"]["driver"] == dra.DRIVER and one["spec"]["nodeName"] == "node-a"
    owner = {"apiVersion": "v1", "kind": "Node", "name": "node-a", "uid": "uid-1"}
    assert one["metadata"]["ownerReferences"] == [owner]
    d = devices(pool)["gpu-5"]
    assert d["attributes"] == {
        "uuid": {"string": gpu(5).uuid},
        "model": {"string": H100},
        "minor": {"int": 5},
        "index": {"int": 5},
        "pciBusID": {"string": "0000:20:00.0"},
        "numaNode": {"int": 1},
        "driverVersion": {"version": "550.54.15"},
        "cudaComputeCapability": {"version": "9.0.0"},
        "resource.kubernetes.io/pcieRoot": {"string": "pci0000:02"},
        "nvlinkPartition1": {"string": "1-5"},
        "nvlinkPartition2": {"string": "2-2"},
        "nvlinkPartition4": {"string": "4-1"},
        "nvlinkPartition8": {"string": "8-0"},
    }
    assert d["capacity"]["cores"]["value"] == "100" and d["capacity"]["memory"]["value"] == str(MEMORY)
    assert d["allowMultipleAllocations"] is True
    assert pool.left_out == [] and pool.problems == []


def test_gpus_share_a_partition_id_exactly_when_the_table_groups_them() -> None:
    found, table = dgx()
    published = devices(slices.build("n", "", found, table, (), BOTH, 1))
    for size, parts in table.items():
        attr = dra.partition_attribute(int(size))
        by_id: dict[str, set[int]] = {}
        for d in published.values():
            by_id.setdefault(d["attributes"][attr]["string"], set()).add(d["attributes"]["minor"]["int"])
        assert sorted(map(sorted, by_id.values())) == sorted(sorted(p["minors"]) for p in parts)


def test_without_consumable_capacity_a_device_is_allocated_whole() -> None:
    found, table = dgx()
    d = devices(slices.build("n", "", found, table, (), slices.Features(), 1))["gpu-0"]
    assert "allowMultipleAllocations" not in d
    assert all("requestPolicy" not in c for c in d["capacity"].values())


def test_consumable_capacity_request_policies() -> None:
    d = devices(slices.build("n", "", node(gpu(0)), None, (), BOTH, 1))["gpu-0"]
    assert d["capacity"]["cores"]["requestPolicy"] == {
        "default": "100",
        "validRange": {"min": "1", "max": "100", "step": "1"},
    }
    assert d["capacity"]["memory"]["requestPolicy"] == {"default": str(MEMORY), "validRange": {"min": "1048576"}}


def test_mig_taken_and_unreadable_gpus_are_left_out_with_the_reason() -> None:
    found = node(gpu(0, mig_enabled=True), gpu(1), gpu(2), gpu(3, memory_total=0))
    pool = slices.build("n", "", found, None, {1}, BOTH, 1)
    assert set(devices(pool)) == {"gpu-2"}
    reasons = dict(pool.left_out)
    assert "MIG" in reasons["gpu-0"] and "device-allocated" in reasons["gpu-1"] and "memory" in reasons["gpu-3"]


def test_an_unhealthy_gpu_is_tainted_where_taints_are_served_else_left_out() -> None:
    found = node(gpu(0, healthy=False, health_reason="row remapping failed"), gpu(1))
    tainted = devices(slices.build("n", "", found, None, (), BOTH, 1))
    assert tainted["gpu-0"]["taints"] == [{"key": "gpu.crihook.io/unhealthy", "value": "true", "effect": "NoSchedule"}]
    assert "taints" not in tainted["gpu-1"]
    pool = slices.build("n", "", found, None, (), slices.Features(consumable_capacity=True), 1)
    assert set(devices(pool)) == {"gpu-1"}
    assert "row remapping failed" in dict(pool.left_out)["gpu-0"]


@pytest.mark.parametrize(("unhealthy", "per_slice"), [(False, 128), (True, 64)])
def test_a_large_pool_is_cut_into_slices_within_the_limit(unhealthy: bool, per_slice: int) -> None:
    found = node(*(gpu(i, healthy=not (unhealthy and i == 0)) for i in range(200)))
    pool = slices.build("n", "", found, None, (), BOTH, 7)
    sizes = [len(s["spec"]["devices"]) for s in pool.slices]
    assert sizes == [per_slice] * (200 // per_slice) + [200 % per_slice]
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in pool.slices} == {len(sizes)}
    assert len({s["metadata"]["name"] for s in pool.slices}) == len(sizes)
    assert all(slices.check(s) == [] for s in pool.slices)


def test_a_node_without_gpus_publishes_an_empty_pool() -> None:
    pool = slices.build("n", "", node(), None, (), BOTH, 1)
    assert [s["spec"]["devices"] for s in pool.slices] == [[]]
    assert slices.check(pool.slices[0]) == []


@pytest.mark.parametrize(
    ("text", "version"),
    [("550.54.15", "550.54.15"), ("535.129.03", "535.129.3"), ("560.28", "560.28.0"), ("9.0", "9.0.0"), ("", "")],
)
def test_versions_become_semantic_versions(text: str, version: str) -> None:
    assert slices.semantic_version(text) == version


def test_an_overlapping_partition_table_keeps_the_first_and_says_so() -> None:
    table: partitions.PartitionTable = {"2": [{"minors": [0, 1]}, {"minors": [1, 2]}]}
    ids, problems = slices.partition_ids(table)
    assert ids[1] == {"nvlinkPartition2": "2-0"} and ids[2] == {"nvlinkPartition2": "2-1"}
    assert problems == ["GPU minor 1 is in several partitions of 2: kept 2-0"]


def test_too_many_partition_sizes_stay_within_the_attribute_limit() -> None:
    table: partitions.PartitionTable = {str(n): [{"minors": list(range(n))}] for n in range(1, 30)}
    found = node(*(gpu(i) for i in range(29)))
    pool = slices.build("n", "", found, table, (), BOTH, 1)
    d = devices(pool)["gpu-0"]
    assert len(d["attributes"]) + len(d["capacity"]) <= 32
    assert pool.problems and all(slices.check(s) == [] for s in pool.slices)


def test_check_finds_what_the_api_server_refuses() -> None:
    found, table = dgx()
    good = slices.build("n", "", found, table, (), BOTH, 1).slices[0]
    assert slices.check(good) == []
    bad = copy.deepcopy(good)
    spec = bad["spec"]
    spec["devices"][0]["attributes"]["driverVersion"] = {"version": "535.129.03"}
    spec["devices"][1]["attributes"] |= {f"extra{i}": {"int": i} for i in range(30)}
    spec["devices"][2]["capacity"]["cores"]["requestPolicy"]["default"] = "101"
    spec["devices"][3]["name"] = "GPU_3"
    spec["devices"][4]["taints"] = [{"key": "k", "effect": "PreferNoSchedule"}]
    del spec["devices"][5]["allowMultipleAllocations"]
    spec["devices"] += [copy.deepcopy(spec["devices"][6]) for _ in range(70)]
    found_problems = "\n".join(slices.check(bad))
    for expected in (
        "not a semantic version",
        "at most 32",
        "min <= default <= max <= value",
        "not a DNS label",
        "not NoSchedule",
        "needs allowMultipleAllocations",
        "at most 64",
        "device names repeat",
    ):
        assert expected in found_problems


@pytest.mark.parametrize("version", SUPPORTED)
@pytest.mark.parametrize("features", [slices.Features(), BOTH], ids=["plain", "consumable+taints"])
def test_slices_pass_kubernetes_strict_schemas(version: str, features: slices.Features) -> None:
    found = node(*(gpu(i, healthy=i != 3) for i in range(8)), gpu(8, mig_enabled=True))
    table = partitions.builtin_table(H100, list(range(8)), nvswitch=True)
    for s in slices.build("node-a", "uid-1", found, table, {2}, features, 4).slices:
        schema_valid(s, version)


def test_comparable_ignores_generation_and_taint_times() -> None:
    found = node(gpu(0, healthy=False), gpu(1))
    a = slices.build("n", "", found, None, (), BOTH, 1).slices[0]["spec"]
    b = copy.deepcopy(slices.build("n", "", found, None, (), BOTH, 2).slices[0]["spec"])
    b["devices"][0]["taints"][0]["timeAdded"] = "2026-01-01T00:00:00Z"
    assert slices.comparable(a) == slices.comparable(b)
    c = slices.build("n", "", found, None, {1}, BOTH, 1).slices[0]["spec"]
    assert slices.comparable(a) != slices.comparable(c)


_gpus = st.lists(
    st.builds(
        gpu,
        st.integers(min_value=0, max_value=300),
        healthy=st.booleans(),
        mig_enabled=st.booleans(),
        memory_total=st.integers(min_value=0, max_value=1 << 40),
        cuda_capability=st.sampled_from(["", "8.9", "10.0"]),
        name=st.text(min_size=1, max_size=100),
    ),
    max_size=300,
    unique_by=lambda g: g.minor,
)


@settings(max_examples=60, deadline=None)
@given(_gpus, st.frozensets(st.integers(min_value=0, max_value=300)), st.booleans(), st.booleans())
def test_every_pool_passes_the_check(gpus: list[GpuInfo], taken: frozenset[int], cc: bool, taints: bool) -> None:
    pool = slices.build("node-a", "", node(*gpus), None, taken, slices.Features(cc, taints), 1)
    for s in pool.slices:
        assert slices.check(s) == []
    published = devices(pool)
    assert len(published) + len(pool.left_out) == len(gpus)
    assert not any(d["attributes"]["minor"]["int"] in taken for d in published.values())


def _pod(name: str, annotation: str | None, phase: str = "Running") -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "ns"}
    if annotation is not None:
        meta["annotations"] = {"scheduling.koordinator.sh/device-allocated": annotation}
    return {"metadata": meta, "status": {"phase": phase}}


def test_taken_minors_are_the_live_pods_annotated_gpus() -> None:
    pods = [
        _pod("a", '{"gpu": [{"minor": 1, "resources": {"koordinator.sh/gpu-core": "100"}}]}'),
        _pod("b", '{"gpu": [{"minor": 2}, {"minor": 3}], "rdma": [{"minor": 9}]}'),
        _pod("done", '{"gpu": [{"minor": 4}]}', phase="Succeeded"),
        _pod("plain", None),
        _pod("bad", "{not json"),
    ]
    taken, problems = slices.taken_minors(pods)
    assert taken == {1, 2, 3}
    assert len(problems) == 1 and problems[0].startswith("pod ns/bad:")
