"""DeviceShare: filter reasons, reserve/unreserve bookkeeping, topology, partitions, RDMA, annotations."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crihook.base.allocation import (
    CONTAINER_DEVICES,
    DEVICE_ALLOCATED,
    MIG_ENABLED,
    MIG_MODE_LABEL,
    parse_container_devices,
    parse_device_allocated,
)
from crihook.scheduler.devices import PCIE_LEVELS, DeviceError, Gpu, NodeDevices, node_from_device
from crihook.scheduler.plugin import DeviceShare, Unschedulable
from crihook.scheduler.pod import pod_from_json

GIB = 1 << 30
# DGX-1 (V100) hybrid cube-mesh: NVLink lanes between GPU pairs.
DGX1_NVLINK = {
    (0, 1): 1,
    (0, 2): 1,
    (0, 3): 2,
    (0, 4): 2,
    (1, 2): 2,
    (1, 3): 1,
    (1, 5): 2,
    (2, 3): 2,
    (2, 6): 1,
    (3, 7): 1,
    (4, 5): 1,
    (4, 6): 1,
    (4, 7): 2,
    (5, 6): 2,
    (5, 7): 1,
    (6, 7): 2,
}


def dgx1_pcie(a: int, b: int) -> str:
    if a // 2 == b // 2:
        return "single"
    return "node" if a // 4 == b // 4 else "system"


def device(
    name: str,
    n: int,
    minors: list[int] | None = None,
    annotations: dict | None = None,
    nics: list | None = None,
    model: str = "A100",
    unhealthy: tuple[int, ...] = (),
    pcie: dict | None = None,
) -> dict:
    minors = minors if minors is not None else list(range(n))
    devs = [
        {
            "type": "gpu",
            "id": f"GPU-{name}-{m}",
            "minor": m,
            "health": m not in unhealthy,
            "resources": {
                "koordinator.sh/gpu-core": "100",
                "koordinator.sh/gpu-memory": "16Gi",
                "koordinator.sh/gpu-memory-ratio": "100",
            },
            "topology": {"pcieID": (pcie or {}).get(m, f"pci{m // 2}"), "nodeID": 0},
        }
        for m in minors
    ]
    devs += nics or []
    return {
        "metadata": {
            "name": name,
            "annotations": annotations or {},
            "labels": {"node.koordinator.sh/gpu-model": model},
        },
        "spec": {"devices": devs},
    }


def pod(uid: str, requests: dict, annotations: dict | None = None, containers: list | None = None):
    spec = containers or [{"name": "main", "resources": {"requests": requests}}]
    return pod_from_json(
        {"metadata": {"name": uid, "uid": uid, "annotations": annotations or {}}, "spec": {"containers": spec}}
    )


def share(pct: int) -> dict:
    return {
        "koordinator.sh/gpu-core": str(pct),
        "koordinator.sh/gpu-memory-ratio": str(pct),
        "koordinator.sh/gpu.shared": "1",
    }


def cluster(*devs: dict) -> DeviceShare:
    ds = DeviceShare()
    for d in devs:
        ds.set_node(node_from_device(d))
    return ds


def snapshot(ds: DeviceShare) -> tuple:
    st = ds.st
    return (st.core_free.copy(), st.mem_free.copy(), st.cpu_free.copy(), [dict(x) for x in st.nic_free])


def test_filter_gives_reasons_per_node() -> None:
    ds = cluster(device("a", 2, unhealthy=(1,)), device("b", 4, model="T4"))
    r = ds.pre_filter(pod("p", {"nvidia.com/gpu": "2"}, {"nvidia.com/use-gputype": "a100"}))
    fit, failed = ds.filter_nodes(r, ["a", "b", "ghost"])
    assert fit == []
    assert "1 of 2 GPUs" in failed["a"] and "unhealthy" in failed["a"]
    assert "use-gputype" in failed["b"]
    assert "no Device" in failed["ghost"]
    assert ds.filter(r, "a") == failed["a"]


def test_shares_pack_onto_one_gpu_and_whole_gpus_stay_whole() -> None:
    ds = cluster(device("a", 2))
    for i in range(2):
        r = ds.pre_filter(pod(f"s{i}", share(50)))
        a = ds.reserve(r, "a")
        assert [g.minor for g in a.gpus] == [0] or i == 1
    whole = ds.pre_filter(pod("w", {"nvidia.com/gpu": "1"}))
    assert ds.filter(whole, "a") is None  # the two halves share one GPU: the other is still whole


def test_reserve_is_idempotent_and_unreserve_restores_exactly() -> None:
    ds = cluster(device("a", 4), device("b", 4))
    before = snapshot(ds)
    r = ds.pre_filter(pod("p", {"nvidia.com/gpu": "2", "cpu": "1"}))
    a1 = ds.reserve(r, "a")
    assert ds.reserve(r, "a") == a1
    with pytest.raises(Unschedulable, match="already holds"):
        ds.reserve(r, "b")
    ds.unreserve("p")
    ds.unreserve("p")
    after = snapshot(ds)
    assert all(np.array_equal(x, y) for x, y in zip(before[:3], after[:3], strict=True))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.booleans(), st.integers(0, 11), st.sampled_from([10, 30, 50, 70, 100, 200, 300])), max_size=40
    )
)
def test_no_gpu_is_ever_overcommitted_and_rollback_is_exact(ops: list[tuple[bool, int, int]]) -> None:
    ds = cluster(device("a", 4), device("b", 2, minors=[64, 70]))
    initial = snapshot(ds)
    live: dict[str, object] = {}
    for reserve, i, size in ops:
        uid = f"p{i}"
        if reserve and uid not in live:
            res = {"nvidia.com/gpu": str(size // 100)} if size >= 100 else share(size)
            r = ds.pre_filter(pod(uid, res))
            fit, _ = ds.filter_nodes(r)
            if fit:
                scores = ds.score_nodes(r, fit)
                assert all(0.0 <= s <= 100.0 for s in scores.values())
                live[uid] = ds.reserve(r, max(scores, key=scores.__getitem__))
        elif not reserve:
            ds.unreserve(uid)
            live.pop(uid, None)
        assert (ds.st.core_free >= 0).all() and (ds.st.mem_free >= 0).all()
        used: dict[tuple[str, int], int] = {}
        for a in live.values():
            for g in a.gpus:  # type: ignore[attr-defined]
                used[(a.node, g.minor)] = used.get((a.node, g.minor), 0) + g.resources["koordinator.sh/gpu-core"]  # type: ignore[attr-defined]
                assert g.minor in ((0, 1, 2, 3) if a.node == "a" else (64, 70))  # type: ignore[attr-defined]
        assert all(v <= 100 for v in used.values())
    for uid in list(live):
        ds.unreserve(uid)
    assert all(np.array_equal(x, y) for x, y in zip(initial[:3], snapshot(ds)[:3], strict=True))


def test_live_pods_are_charged_from_their_annotation_and_freed_on_removal() -> None:
    ds = cluster(device("a", 2, minors=[64, 65]))
    ann = {
        DEVICE_ALLOCATED: json.dumps(
            {
                "gpu": [
                    {"minor": 65, "resources": {"koordinator.sh/gpu-core": "100", "koordinator.sh/gpu-memory": "16Gi"}}
                ]
            }
        )
    }
    ds.add_pod(pod("live", {"nvidia.com/gpu": "1"}, ann), "a")
    r = ds.pre_filter(pod("new", {"nvidia.com/gpu": "1"}))
    assert [g.minor for g in ds.reserve(r, "a").gpus] == [64]
    ds.unreserve("new")
    two = ds.pre_filter(pod("two", {"nvidia.com/gpu": "2"}))
    assert ds.filter(two, "a") is not None
    ds.remove_pod("live")
    ds.remove_pod("live")
    assert ds.filter(two, "a") is None
    # a replaced Device keeps the charges of the pods on it
    ds.add_pod(pod("live", {"nvidia.com/gpu": "1"}, ann), "a")
    ds.set_node(node_from_device(device("a", 2, minors=[64, 65])))
    assert ds.filter(two, "a") is not None


def test_live_pods_new_to_the_plugin_teach_the_policy_the_workload() -> None:
    """After a restart the policy has seen no pod: the live ones it is rebuilt from are observed,
    once each, and pods it reserved itself are not counted again when their binding comes back."""
    ds = cluster(device("a", 4))
    ann = {DEVICE_ALLOCATED: json.dumps({"gpu": [{"minor": 0}]})}
    ds.add_pod(pod("live", {"nvidia.com/gpu": "1"}, ann), "a")
    ds.add_pod(pod("live", {"nvidia.com/gpu": "1"}, ann), "a")
    ds.add_pod(pod("cpu-only", {"cpu": "2"}), "a")
    assert ds.policy.outlook.seen == 1
    r = ds.pre_filter(pod("new", {"nvidia.com/gpu": "1"}))
    ds.reserve(r, "a")
    ds.add_pod(pod("new", {"nvidia.com/gpu": "1"}, ann), "a")
    assert ds.policy.outlook.seen == 2


def test_a_pod_filtered_again_is_learned_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """kube-scheduler sends one pod to filter and prioritize, and again at each retry."""
    from crihook.scheduler import plugin

    monkeypatch.setattr(plugin, "LEARNED_MAX", 2)
    ds = cluster(device("a", 1))
    for uid in ["p", "p", "q", "p", "q"]:
        ds.pre_filter(pod(uid, {"nvidia.com/gpu": "1"}))
    assert ds.policy.outlook.seen == 2
    ds.pre_filter(pod("r", {"nvidia.com/gpu": "1"}))  # "p" is forgotten: only the last 2 are kept
    ds.pre_filter(pod("p", {"nvidia.com/gpu": "1"}))
    assert ds.policy.outlook.seen == 4
    ds.pre_filter(pod("", {"nvidia.com/gpu": "1"}))  # no uid: nothing to know it by
    ds.pre_filter(pod("", {"nvidia.com/gpu": "1"}))
    assert ds.policy.outlook.seen == 6


def test_pre_bind_writes_koordinator_annotation_and_per_container_minors() -> None:
    ds = cluster(device("a", 4))
    containers = [
        {"name": "x", "resources": {"limits": {"nvidia.com/gpu": 1}}},
        {"name": "y", "resources": {"limits": {"nvidia.com/gpu": 2}}},
        {"name": "sidecar", "resources": {}},
    ]
    r = ds.pre_filter(pod("p", {}, containers=containers))
    ann = ds.pre_bind(r, ds.reserve(r, "a"))
    allocs = parse_device_allocated(ann[DEVICE_ALLOCATED])["gpu"]
    assert len(allocs) == 3 and all(a.id.startswith("GPU-a-") for a in allocs)
    per = parse_container_devices(ann[CONTAINER_DEVICES])
    assert len(per["x"]["gpu"]) == 1 and len(per["y"]["gpu"]) == 2
    assert set(per["x"]["gpu"]) | set(per["y"]["gpu"]) == {a.minor for a in allocs}
    assert "sidecar" not in per


def dgx1_device(name: str = "dgx") -> dict:
    minors = list(range(8))
    topo = {
        "minors": minors,
        "nvlinks": [[DGX1_NVLINK.get((min(a, b), max(a, b)), 0) for b in minors] for a in minors],
        "pcie": [[0 if a == b else PCIE_LEVELS[dgx1_pcie(a, b)] for b in minors] for a in minors],
    }
    return device(name, 8, annotations={"gpu.crihook.io/topology": json.dumps(topo)})


def link_key(gpus: tuple[int, ...]) -> tuple[int, int]:
    levels = {"single": 10, "node": 40, "system": 50}
    pairs = list(itertools.combinations(gpus, 2))
    return (sum(DGX1_NVLINK.get(p, 0) for p in pairs), -sum(levels[dgx1_pcie(*p)] for p in pairs))


@settings(max_examples=40, deadline=None)
@given(st.sets(st.integers(0, 7), max_size=5), st.integers(2, 8))
def test_multi_gpu_choice_is_optimal_on_the_dgx1_cube_mesh(busy: set[int], k: int) -> None:
    ds = cluster(dgx1_device())
    for m in sorted(busy):
        ds.add_pod(pod(f"busy{m}", {}, {DEVICE_ALLOCATED: json.dumps({"gpu": [{"minor": m}]})}), "dgx")
    free = [m for m in range(8) if m not in busy]
    r = ds.pre_filter(pod("p", {"nvidia.com/gpu": str(k)}))
    if len(free) < k:
        assert ds.filter(r, "dgx") is not None
        return
    chosen = tuple(g.minor for g in ds.reserve(r, "dgx").gpus)
    assert not set(chosen) & busy
    best = max(link_key(s) for s in itertools.combinations(free, k))
    assert link_key(chosen) == best


def test_pairs_do_not_strand_the_well_connected_rest() -> None:
    ds = cluster(dgx1_device())
    got = [
        tuple(g.minor for g in ds.reserve(ds.pre_filter(pod(f"p{i}", {"nvidia.com/gpu": "2"})), "dgx").gpus)
        for i in range(4)
    ]
    assert all(link_key(p)[0] == 2 for p in got)  # four double-NVLink pairs: a perfect matching exists


def test_shared_multi_gpu_balances_affinity_against_load() -> None:
    ds = cluster(dgx1_device())
    ds.add_pod(
        pod(
            "hot",
            {},
            {
                DEVICE_ALLOCATED: json.dumps(
                    {
                        "gpu": [
                            {
                                "minor": 3,
                                "resources": {"koordinator.sh/gpu-core": "90", "koordinator.sh/gpu-memory-ratio": "90"},
                            }
                        ]
                    }
                )
            },
        ),
        "dgx",
    )
    r = ds.pre_filter(
        pod(
            "s",
            {
                "koordinator.sh/gpu-core": "20",
                "koordinator.sh/gpu-memory-ratio": "20",
                "koordinator.sh/gpu.shared": "2",
            },
        )
    )
    chosen = tuple(g.minor for g in ds.reserve(r, "dgx").gpus)
    assert 3 not in chosen and link_key(chosen)[0] == 2


PARTITIONS = {
    "1": [{"minors": [m], "allocationScore": 1} for m in range(4)],
    "2": [
        {"minors": [0, 1], "ringBusBandwidth": "400Gi", "allocationScore": 2},
        {"minors": [2, 3], "ringBusBandwidth": "100Gi", "allocationScore": 1},
    ],
    "4": [{"minors": [0, 1, 2, 3], "ringBusBandwidth": "400Gi", "allocationScore": 1}],
}


def partition_node(policy: str) -> dict:
    d = device("p", 4, annotations={"scheduling.koordinator.sh/gpu-partitions": json.dumps(PARTITIONS)})
    d["metadata"]["labels"]["node.koordinator.sh/gpu-partition-policy"] = policy
    return d


def test_partitions_honor_restricted_besteffort_and_bandwidth() -> None:
    spec = "scheduling.koordinator.sh/gpu-partition-spec"
    ds = cluster(partition_node("Honor"))
    r = ds.pre_filter(pod("a", {"nvidia.com/gpu": "2"}))
    assert [g.minor for g in ds.reserve(r, "p").gpus] == [0, 1]  # best allocationScore first
    restricted = ds.pre_filter(pod("b", {"nvidia.com/gpu": "2"}, {spec: '{"allocatePolicy":"Restricted"}'}))
    assert "partition" in (ds.filter(restricted, "p") or "")
    besteffort = ds.pre_filter(pod("c", {"nvidia.com/gpu": "2"}, {spec: '{"allocatePolicy":"BestEffort"}'}))
    assert [g.minor for g in ds.reserve(besteffort, "p").gpus] == [2, 3]
    ds.unreserve("a")
    ds.unreserve("c")
    fast = ds.pre_filter(pod("d", {"nvidia.com/gpu": "2"}, {spec: '{"ringBusBandwidth":"200Gi"}'}))
    assert [g.minor for g in ds.reserve(fast, "p").gpus] == [0, 1]
    ds.unreserve("d")
    three = ds.pre_filter(pod("e", {"nvidia.com/gpu": "3"}))
    assert ds.filter(three, "p") is not None  # Honor: no partition of 3
    prefer = cluster(partition_node("Prefer"))
    assert prefer.filter(prefer.pre_filter(pod("e", {"nvidia.com/gpu": "3"})), "p") is None


def test_single_gpu_partition_is_least_fragmenting() -> None:
    ds = cluster(partition_node("Honor"))
    ds.add_pod(pod("x", {}, {DEVICE_ALLOCATED: json.dumps({"gpu": [{"minor": 2}]})}), "p")
    r = ds.pre_filter(pod("one", {"nvidia.com/gpu": "1"}))
    assert [g.minor for g in ds.reserve(r, "p").gpus] == [3]  # keeps the 0-1 pair whole


def nic(minor: int, pcie: str, bus: str) -> dict:
    return {
        "type": "rdma",
        "id": bus,
        "minor": minor,
        "health": True,
        "resources": {"koordinator.sh/rdma": "100"},
        "topology": {"pcieID": pcie},
    }


def test_joint_gpu_and_rdma_share_a_pcie_switch() -> None:
    nics = [nic(0, "sw1", "0000:81:00.0")]
    ds = cluster(device("a", 4, nics=nics, pcie={0: "sw0", 1: "sw0", 2: "sw1", 3: "sw1"}))
    joint = {"scheduling.koordinator.sh/device-joint-allocate": '{"deviceTypes":["gpu","rdma"]}'}
    r = ds.pre_filter(pod("j", {"nvidia.com/gpu": "1", "koordinator.sh/rdma": "100"}, joint))
    a = ds.reserve(r, "a")
    assert [g.minor for g in a.gpus] in ([2], [3]) and [n.id for n in a.nics] == ["0000:81:00.0"]
    ann = ds.pre_bind(r, a)
    assert parse_device_allocated(ann[DEVICE_ALLOCATED])["rdma"][0].minor == 0
    r2 = ds.pre_filter(pod("k", {"nvidia.com/gpu": "1", "koordinator.sh/rdma": "100"}, joint))
    assert "RDMA" in (ds.filter(r2, "a") or "")


def test_joint_pod_wanting_more_nics_than_the_node_has_is_refused() -> None:
    # the NIC beside the GPU, then none left for the second: a reason, not a TypeError
    ds = cluster(device("a", 4, nics=[nic(0, "sw1", "0000:81:00.0")], pcie={0: "sw0", 1: "sw0", 2: "sw1", 3: "sw1"}))
    joint = {"scheduling.koordinator.sh/device-joint-allocate": '{"deviceTypes":["gpu","rdma"]}'}
    r = ds.pre_filter(pod("j", {"nvidia.com/gpu": "1", "koordinator.sh/rdma": "200"}, joint))
    assert "RDMA" in (ds.filter(r, "a") or "")


def test_binpack_and_spread_strategies_order_nodes_oppositely() -> None:
    ds = cluster(device("a", 4), device("b", 4))
    ds.reserve(ds.pre_filter(pod("x", {"nvidia.com/gpu": "2"})), "a")
    s = "gpu.crihook.io/allocate-strategy"
    pack = ds.score_nodes(ds.pre_filter(pod("p", {"nvidia.com/gpu": "1"}, {s: "binpack"})))
    spread = ds.score_nodes(ds.pre_filter(pod("q", {"nvidia.com/gpu": "1"}, {s: "spread"})))
    assert pack["a"] > pack["b"] and spread["a"] < spread["b"]
    assert 0 <= ds.score(ds.pre_filter(pod("r", {"nvidia.com/gpu": "1"})), "a") <= 100


def test_bad_device_objects_name_the_field() -> None:
    bad = device("a", 1)
    bad["spec"]["devices"][0]["minor"] = -1
    with pytest.raises(DeviceError, match=r"spec.devices\[0\].minor"):
        node_from_device(bad)
    with pytest.raises(DeviceError, match="gpu-partitions"):
        node_from_device(
            device("a", 2, annotations={"scheduling.koordinator.sh/gpu-partitions": '{"2": [{"minors": [0]}]}'})
        )
    with pytest.raises(DeviceError, match="topology"):
        node_from_device(device("a", 2, annotations={"gpu.crihook.io/topology": '{"minors": [0, 5]}'}))


def test_filter_answer_is_not_reused_after_the_node_changes() -> None:
    ds = cluster(device("a", 1), device("b", 1))
    first = ds.pre_filter(pod("first", {"nvidia.com/gpu": "1"}))
    assert ds.filter_nodes(first)[0] == ["a", "b"]
    ds.reserve(ds.pre_filter(pod("other", {"nvidia.com/gpu": "1"})), "a")
    fit, failed = ds.filter_nodes(first)
    assert fit == ["b"] and "0 of 1 GPUs" in failed["a"]
    assert set(ds.score_nodes(first, ["a", "b"])) == {"b"}
    with pytest.raises(Unschedulable):
        ds.reserve(first, "a")


def test_reasons_name_each_node_and_count_each_cause() -> None:
    ds = cluster(device("a", 2), device("b", 2), device("c", 2, unhealthy=(0,)))
    for n in ("a", "b", "c"):
        ds.reserve(ds.pre_filter(pod(f"half-{n}", share(60))), n)
    r = ds.pre_filter(pod("p", {"nvidia.com/gpu": "2"}))
    fit, failed = ds.filter_nodes(r)
    assert fit == []
    assert failed["a"] == "node a: 1 of 2 GPUs can take a whole GPU, 2 needed (1 not enough free GPU core)"
    assert failed["b"] == failed["a"].replace("node a", "node b")
    assert failed["c"] == "node c: 0 of 2 GPUs can take a whole GPU, 2 needed (1 not enough free GPU core; 1 unhealthy)"


def test_a_gpu_in_mig_mode_is_never_given_and_the_reason_says_so() -> None:
    """The reporter labels a GPU in MIG mode (health false); a label alone, health true, is not
    enough to make it usable either. Filter counts those apart from unhealthy GPUs."""
    d = device("m", 4, unhealthy=(0, 1))
    for i in (1, 2):  # 1: MIG and not healthy, as the reporter publishes it; 2: labelled, health true
        d["spec"]["devices"][i]["labels"] = {MIG_MODE_LABEL: MIG_ENABLED, "team": "infra"}
    node = node_from_device(d)
    assert [(g.healthy, g.mig) for g in node.gpus] == [(False, False), (False, True), (False, True), (True, False)]
    ds = cluster(d)
    fit, failed = ds.filter_nodes(ds.pre_filter(pod("p", {"nvidia.com/gpu": "2"})))
    assert fit == []
    assert failed["m"] == (
        "node m: 1 of 4 GPUs can take a whole GPU, 2 needed (2 in MIG mode (given as nvidia.com/mig-*); 1 unhealthy)"
    )
    d["spec"]["devices"][2]["labels"] = {MIG_MODE_LABEL: "disabled"}  # MIG mode off again
    ds.set_node(node_from_device(d))
    assert ds.filter_nodes(ds.pre_filter(pod("p", {"nvidia.com/gpu": "2"})))[0] == ["m"]
    ds.remove_node("m")
    assert ds.st.nmig.sum() == 0
    d["spec"]["devices"][0]["labels"] = ["not", "an", "object"]
    with pytest.raises(DeviceError, match=r"spec.devices\[0\].labels: expected an object"):
        node_from_device(d)


def test_gpus_the_device_plugin_holds_are_not_handed_out() -> None:
    # the node reporter lists GPUs held through the device plugin (node.koordinator.sh/devices-checkpoints)
    held = [
        {"podUID": "plugin-pod", "containerName": "main", "resourceName": "nvidia.com/gpu", "minors": [1]},
        {"podUID": "placed", "containerName": "main", "resourceName": "nvidia.com/gpu", "minors": [2]},
        {"podUID": "unresolved", "containerName": "main", "resourceName": "nvidia.com/gpu", "minors": []},
    ]
    ds = cluster(device("a", 4, annotations={"node.koordinator.sh/devices-checkpoints": json.dumps(held)}))
    # "placed" was placed by this scheduler on minor 0: its plugin entry (minor 2) is a phantom
    ann = {DEVICE_ALLOCATED: json.dumps({"gpu": [{"minor": 0, "resources": {"koordinator.sh/gpu-core": "100"}}]})}
    ds.add_pod(pod("placed", {"nvidia.com/gpu": "1"}, ann), "a")
    ds.add_pod(pod("plugin-pod", {"nvidia.com/gpu": "1"}), "a")  # bound with spec.nodeName: no annotation
    got = []
    for i in range(2):
        r = ds.pre_filter(pod(f"new{i}", {"nvidia.com/gpu": "1"}))
        got += [g.minor for g in ds.reserve(r, "a").gpus]
    assert sorted(got) == [2, 3]
    full = ds.pre_filter(pod("one-more", {"nvidia.com/gpu": "1"}))
    assert ds.filter(full, "a") is not None  # minor 1 is the plugin pod's


def test_a_malformed_plugin_held_list_names_the_field() -> None:
    bad = device("a", 2, annotations={"node.koordinator.sh/devices-checkpoints": '[{"podUID": 3}]'})
    with pytest.raises(DeviceError, match=r"devices-checkpoints'\]\[0\]: expected an object with podUID"):
        node_from_device(bad)


def test_filter_reasons_count_refused_models_and_uuids_per_node() -> None:
    """A node mixing models: the slots each selector refuses are counted under its own reason (the
    type lists per model, the UUID lists per GPU), as Filter decided them."""
    models = ("A100", "T4", "T4", "A100", "T4")
    gpus = tuple(Gpu(minor=i, uuid=f"GPU-{i}", model=m, memory=16 << 30) for i, m in enumerate(models))
    ds = DeviceShare()
    ds.set_node(NodeDevices("m", gpus, cpu_milli=64_000, memory=1 << 40))
    ann = {"nvidia.com/use-gputype": "t4", "nvidia.com/nouse-gpuuuid": "GPU-2,GPU-3"}
    r = ds.pre_filter(pod("p", {"nvidia.com/gpu": "3"}, ann))
    _, failed = ds.filter_nodes(r, ["m"])
    assert failed["m"] == (
        "node m: 2 of 5 GPUs can take a whole GPU, 3 needed "
        "(1 GPU-2 is excluded by nvidia.com/nouse-gpuuuid; 2 model A100 is not in nvidia.com/use-gputype)"
    )


def test_gpus_dra_claims_hold_are_never_handed_out_and_kept_across_device_updates() -> None:
    ds = cluster(device("a", 2))
    ds.set_claimed("a", {0})
    whole = ds.pre_filter(pod("w", {"nvidia.com/gpu": "1"}))
    assert [g.minor for g in ds.reserve(whole, "a").gpus] == [1]
    ds.unreserve("w")
    two = ds.pre_filter(pod("t", {"nvidia.com/gpu": "2"}))
    assert ds.filter(two, "a") == "node a: 1 of 2 GPUs can take a whole GPU, 2 needed (1 held by a DRA claim)"
    half = ds.pre_filter(pod("h", share(50)))
    assert [g.minor for g in ds.reserve(half, "a").gpus] == [1]  # a share never lands on a claimed GPU
    ds.set_node(node_from_device(device("a", 2)))  # a new Device object: the claim still holds
    assert ds.st.claimed[ds.st.rows["a"], 0] and ds.filter(two, "a") is not None
    assert not ds.could_fit_empty(two, ["a"])  # evicting our pods does not free a claimed GPU
    ds.set_claimed("a", ())
    ds.unreserve("h")
    assert ds.filter(two, "a") is None
    ds.set_claimed("ghost", {1})  # a node without a Device: remembered until it comes
    ds.set_node(node_from_device(device("ghost", 2, unhealthy=(1,))))
    assert ds.filter(ds.pre_filter(pod("g", {"nvidia.com/gpu": "2"})), "ghost") == (
        "node ghost: 1 of 2 GPUs can take a whole GPU, 2 needed (1 unhealthy)"
    )
