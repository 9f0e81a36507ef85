"""DRA in the simulator: each driver's slices and claims, the allocator's first fit inside a node,
kube-scheduler's default scores, and Filter agreeing with the allocator on every node it passes."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from crihook.scheduler.devices import Gpu, NodeDevices
from crihook.scheduler.plugin import DeviceShare, PluginConfig
from crihook.scheduler.pod import Container, Pod
from crihook.scheduler.simulate import TracePod, to_pod
from crihook.scheduler.simulate_dra import (
    CRIHOOK,
    DRIVERS,
    HAMI,
    NVIDIA,
    VARIANTS,
    DraPolicy,
    claim_for,
    kube_default_scores,
    publish,
)

GIB = 1 << 30


def node(name: str = "n", gpus: int = 8, cpu: int = 64_000, memory: int = 256 * GIB) -> NodeDevices:
    return NodeDevices(
        name, tuple(Gpu(i, f"GPU-{name}-{i}", "V100", 16 * GIB) for i in range(gpus)), cpu_milli=cpu, memory=memory
    )


def pod(uid: str, gpus: int = 0, pct: int = 100, cpu: int = 1000, model: str = "") -> Pod:
    req = {"cpu": f"{cpu}m", "memory": "1Gi"}
    if gpus and pct == 100:
        req["nvidia.com/gpu"] = str(gpus)
    elif gpus:
        req.update(
            {
                "koordinator.sh/gpu-core": str(pct),
                "koordinator.sh/gpu-memory-ratio": str(pct),
                "koordinator.sh/gpu.shared": "1",
            }
        )
    ann = {"nvidia.com/use-gputype": model} if model else {}
    return Pod(uid=uid, namespace="t", name=uid, containers=(Container("main", req),), annotations=ann)


def test_each_driver_publishes_its_own_way() -> None:
    n = node(gpus=8)
    nv, hami, ours = (publish(v, n) for v in VARIANTS)
    assert (nv.driver, hami.driver, ours.driver) == tuple(DRIVERS[v] for v in VARIANTS)
    assert [d.name for d in nv.devices] == [f"gpu-{i}" for i in range(8)]
    assert not nv.devices[0].multiple and not nv.devices[0].capacity
    assert hami.devices[0].multiple and hami.devices[0].capacity["memory"].value == 16 * GIB
    d5 = ours.devices[5].attributes
    assert (d5["nvlinkPartition2"], d5["nvlinkPartition4"], d5["nvlinkPartition8"], d5["numaNode"]) == (
        "2",
        "1",
        "0",
        1,
    )
    assert "nvlinkPartition8" not in publish(CRIHOOK, node(gpus=4)).devices[0].attributes


def test_claims_as_each_drivers_users_write_them() -> None:
    ds = DeviceShare()
    half = ds.pre_filter(pod("h", 1, 50))
    assert claim_for(HAMI, half, 16 * GIB).requests[0].exactly.capacity == {"cores": 50, "memory": 8 * GIB}  # type: ignore[union-attr]
    assert claim_for(NVIDIA, half, 16 * GIB).requests[0].exactly.capacity == {}  # type: ignore[union-attr]
    pair = claim_for(CRIHOOK, ds.pre_filter(pod("p", 2)), 16 * GIB)
    assert [s.name for s in pair.requests[0].first_available] == ["nvlink", "numa", "any"]
    assert [c.attribute for c in pair.constraints] == ["gpu.crihook.io/nvlinkPartition2", "gpu.crihook.io/numaNode"]
    assert (
        claim_for(CRIHOOK, ds.pre_filter(pod("q", 3)), 16 * GIB).constraints[0].attribute.endswith("nvlinkPartition4")
    )


def reserve_all(variant: str, pods: list[Pod], n: NodeDevices) -> list[list[int]]:
    ds = DeviceShare(PluginConfig(policy=DraPolicy(variant)))
    ds.set_node(n)
    out = []
    for p in pods:
        req = ds.pre_filter(p)
        out.append([g.minor for g in ds.reserve(req, n.name).gpus])
    return out


def test_first_fit_inside_the_node() -> None:
    n = node(gpus=4)
    # NVIDIA's: a share is asked as a whole GPU (the simulator's to_pod(whole=True)), the next pod
    # gets the next GPU
    shares = [to_pod(TracePod(x, 1000, 1024, 1, 300), 0, whole=True) for x in "ab"]
    assert reserve_all(NVIDIA, [*shares, pod("c", 2)], n) == [[0], [1], [2, 3]]
    # HAMi's: shares pile onto the first GPU with room; whole GPUs take untouched ones
    assert reserve_all(HAMI, [pod("a", 1, 30), pod("b", 1, 60), pod("c", 1, 20), pod("d", 2)], n) == [
        [0],
        [0],
        [1],
        [2, 3],
    ]
    # crihook's: a pair inside one NVLink pair, even when a lower GPU is free
    assert reserve_all(CRIHOOK, [pod("a", 1), pod("b", 2), pod("c", 1)], n) == [[0], [2, 3], [1]]


def test_kube_default_scores_least_allocated_plus_balanced() -> None:
    ds = DeviceShare(PluginConfig(policy=DraPolicy(NVIDIA)))
    ds.set_node(node("a", cpu=10_000, memory=10 * GIB))
    ds.set_node(node("b", cpu=10_000, memory=10 * GIB))
    ds.reserve(ds.pre_filter(pod("busy", cpu=4000)), "b")
    req = ds.pre_filter(pod("p", 1, cpu=1000))
    got = kube_default_scores(ds.st, req, np.array([ds.st.rows["a"], ds.st.rows["b"]]))
    # a: cpu 90 %, memory 90 % free -> 90; shares 0.1, 0.1 -> 100.  b: cpu 50, memory 80 -> 65; |0.5 - 0.2| / 2
    assert got.tolist() == [190.0, 65.0 + 85.0]
    assert ds.score_nodes(req) == {"a": 190.0, "b": 150.0}


SHAPES = st.lists(
    st.tuples(
        st.sampled_from([1, 1, 1, 2, 4, 8]),
        st.sampled_from([100, 100, 50, 30, 70, 10]),
        st.sampled_from(["", "V100", "T4"]),
    ),
    max_size=30,
)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(VARIANTS), SHAPES)
def test_the_allocator_finds_devices_wherever_filter_passes(variant: str, shapes: list[tuple[int, int, str]]) -> None:
    ds = DeviceShare(PluginConfig(policy=DraPolicy(variant)))
    ds.set_node(node(gpus=8))
    for i, (gpus, pct, model) in enumerate(shapes):
        whole = gpus > 1 or variant == NVIDIA  # as the simulator asks NVIDIA's driver
        req = ds.pre_filter(pod(f"p{i}", gpus, 100 if whole else pct, model=model))
        if ds.filter(req, "n") is None:  # a ModelError from pick would fail the test here
            alloc = ds.reserve(req, "n")
            assert len({g.minor for g in alloc.gpus}) == req.count
        assert (ds.st.core_free >= 0).all() and (ds.st.mem_free >= 0).all()
