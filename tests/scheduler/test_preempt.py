"""The extender's preempt verb: kube-scheduler's ExtenderPreemptionArgs in both forms
(nodeCacheCapable: NodeNameToMetaVictims with pod UIDs; otherwise NodeNameToVictims with whole
pods), answered as ExtenderPreemptionResult {NodeNameToMetaVictims}, which kube-scheduler reads back
into pods of that node (pkg/scheduler/framework/extender.go, ProcessPreemption and
convertToVictims). And filter's split of failed nodes into ones preemption may help or not."""

from __future__ import annotations

import json
from itertools import combinations
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crihook.base.allocation import DEVICE_ALLOCATED, GPU_CORE, GPU_MEMORY_RATIO
from crihook.scheduler import preempt
from crihook.scheduler.extender import BadRequest, Extender
from crihook.scheduler.pod import pod_from_json
from tests.support.extender import cluster_plugin, fixture

NODE = "gpu-node-1"  # 8 GPUs


def pod(name: str, priority: int = 0, gpus: str = "") -> dict[str, Any]:
    spec: dict[str, Any] = {"priority": priority, "containers": [{"name": "main", "image": "x"}]}
    if gpus:
        spec["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": gpus}, "requests": {"nvidia.com/gpu": gpus}}
    return {"metadata": {"name": name, "namespace": "team", "uid": f"uid-{name}"}, "spec": spec}


def place(ext: Extender, name: str, priority: int, shares: list[tuple[int, int]], node: str = NODE) -> dict[str, Any]:
    """A running pod holding (minor, core %) on `node`, as the cache charges it."""
    p = pod(name, priority)
    entries = [{"minor": m, "resources": {GPU_CORE: c, GPU_MEMORY_RATIO: c}} for m, c in shares]
    p["metadata"]["annotations"] = {DEVICE_ALLOCATED: json.dumps({"gpu": entries})}
    p["spec"]["nodeName"] = node
    ext.plugin.add_pod(pod_from_json(p), node)
    ext.priorities = {**ext.priorities, p["metadata"]["uid"]: priority}  # type: ignore[dict-item]
    return p


def both_forms(ext: Extender, preemptor: dict[str, Any], victims: dict[str, list[dict[str, Any]]], pdb: int = 0):
    """The answer to the same question in the two forms kube-scheduler sends; they must agree."""
    meta = {
        "Pod": preemptor,
        "NodeNameToMetaVictims": {
            n: {"Pods": [{"UID": p["metadata"]["uid"]} for p in ps], "NumPDBViolations": pdb}
            for n, ps in victims.items()
        },
    }
    full = {
        "Pod": preemptor,
        "NodeNameToVictims": {n: {"Pods": ps, "NumPDBViolations": pdb} for n, ps in victims.items()},
    }
    a, b = ext.preempt(meta), ext.preempt(full)
    assert a == b
    assert set(a) == {"NodeNameToMetaVictims"}
    return {n: [p["UID"] for p in v["Pods"]] for n, v in a["NodeNameToMetaVictims"].items()}, a


@pytest.fixture
def ext() -> Extender:
    return Extender(cluster_plugin())


def test_two_whole_gpus_evict_the_two_lowest_priority_pods(ext: Extender) -> None:
    prios = [5, 1, 7, 2, 9, 3, 8, 4]
    pods = [place(ext, f"w{m}", p, [(m, 100)]) for m, p in enumerate(prios)]
    chosen, raw = both_forms(ext, pod("big", 1000, "2"), {NODE: pods}, pdb=3)
    assert chosen == {NODE: ["uid-w1", "uid-w3"]}  # priorities 1 and 2, in the order kube-scheduler gave
    assert raw["NodeNameToMetaVictims"][NODE]["NumPDBViolations"] == 2  # at most one per victim kept


def test_fewest_victims_come_before_lower_priority(ext: Extender) -> None:
    halves = [place(ext, f"h{i}", 1, [(0, 50)]) for i in range(2)]  # GPU 0: two halves, priority 1
    mid = place(ext, "mid", 5, [(1, 100)])  # GPU 1: one whole pod, priority 5
    rest = [place(ext, f"r{m}", 10, [(m, 100)]) for m in range(2, 8)]
    chosen, _ = both_forms(ext, pod("one", 1000, "1"), {NODE: [*halves, mid, *rest]})
    assert chosen == {NODE: ["uid-mid"]}  # one eviction frees a GPU; two would be needed on GPU 0


def test_a_node_where_no_allowed_victims_free_enough_is_dropped(ext: Extender) -> None:
    low = place(ext, "low", 1, [(0, 100)])
    for m in range(1, 8):
        place(ext, f"high{m}", 2000, [(m, 100)])  # above the preemptor: never a victim
    chosen, _ = both_forms(ext, pod("big", 1000, "2"), {NODE: [low]})
    assert chosen == {}


def test_a_placeholder_node_gets_the_lower_priority_gpu_holders_it_needs(ext: Extender) -> None:
    # kube-scheduler's in-tree dry run found the node fit for all it counts (GPUs are ignored by it)
    # and offers it with no victims: the extender names them, never a pod of equal or higher priority
    for m, p in enumerate([1000, 3, 2000, 1, 1000, 2, 5000, 4]):
        place(ext, f"w{m}", p, [(m, 100)])
    chosen, raw = both_forms(ext, pod("big", 1000, "2"), {NODE: []}, pdb=0)
    assert chosen == {NODE: ["uid-w3", "uid-w5"]}  # priorities 1 and 2
    assert raw["NodeNameToMetaVictims"][NODE]["NumPDBViolations"] == 0


def test_kube_schedulers_victims_are_preferred_over_extra_ones_of_a_set_size(ext: Extender) -> None:
    pods = [place(ext, f"w{m}", 1 if m == 0 else 5, [(m, 100)]) for m in range(8)]
    chosen, _ = both_forms(ext, pod("one", 1000, "1"), {NODE: [pods[3]]})
    assert chosen == {NODE: ["uid-w3"]}  # not w0, of lower priority but not offered by kube-scheduler


def test_victims_without_gpus_stay_and_only_needed_gpu_victims_are_added(ext: Extender) -> None:
    pods = [place(ext, f"w{m}", m, [(m, 100)]) for m in range(8)]
    sidecar = pod("cpu-only", 0)  # holds no GPU we know of: kube-scheduler chose it for CPU or memory
    ext.priorities = {**ext.priorities, "uid-cpu-only": 0}
    chosen, _ = both_forms(ext, pod("one", 1000, "1"), {NODE: [sidecar, *pods]})
    assert chosen == {NODE: ["uid-cpu-only", "uid-w0"]}


def test_nodes_are_answered_each_on_its_own(ext: Extender) -> None:
    a = [place(ext, f"a{m}", 3, [(m, 100)]) for m in range(8)]
    b = [place(ext, f"b{m}", 1, [(m, 100)], node="gpu-node-2") for m in range(4)]
    chosen, _ = both_forms(ext, pod("big", 1000, "4"), {NODE: a, "gpu-node-2": b})
    assert len(chosen[NODE]) == 4 and len(chosen["gpu-node-2"]) == 4


def test_a_pod_without_gpus_keeps_kube_schedulers_victims(ext: Extender) -> None:
    pods = [place(ext, f"w{m}", 1, [(m, 100)]) for m in range(2)]
    chosen, _ = both_forms(ext, pod("cpu", 1000), {NODE: pods})
    assert chosen == {NODE: ["uid-w0", "uid-w1"]}


def test_not_ready_answers_no_preemption_and_bad_bodies_are_400() -> None:
    e = Extender(cluster_plugin(), ready=lambda: False)
    assert e.preempt({"Pod": pod("x", 1, "1"), "NodeNameToMetaVictims": {NODE: {"Pods": [{"UID": "u"}]}}}) == {
        "NodeNameToMetaVictims": {}
    }
    with pytest.raises(BadRequest, match=r"NodeNameToMetaVictims\[gpu-node-1\].Pods\[0\] has no UID"):
        e.preempt({"Pod": pod("x"), "NodeNameToMetaVictims": {NODE: {"Pods": [{}]}}})
    with pytest.raises(BadRequest, match="NumPDBViolations"):
        e.preempt({"Pod": pod("x"), "NodeNameToVictims": {NODE: {"Pods": [], "NumPDBViolations": "2"}}})


def test_filter_says_where_preemption_could_help(ext: Extender) -> None:
    for m in range(8):
        place(ext, f"w{m}", 1, [(m, 100)])
    args = fixture("filter_node_names.json")
    args["Pod"] = pod("two", 1000, "2")
    out = ext.filter(args)
    assert out["NodeNames"] == ["gpu-node-2"]
    assert list(out["FailedNodes"]) == [NODE]  # busy: evicting could free two GPUs
    assert list(out["FailedAndUnresolvableNodes"]) == ["cpu-node-1"]  # no GPUs at all
    args["Pod"] = pod("sixteen", 1000, "16")
    out = ext.filter(args)
    assert out["FailedNodes"] == {} and set(out["FailedAndUnresolvableNodes"]) == set(args["NodeNames"])


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 7), st.sampled_from([25, 50, 100]), st.integers(0, 3)), min_size=1, max_size=9),
    st.sampled_from(["1", "2", "half"]),
    st.data(),
)
def test_the_choice_is_a_smallest_set_that_makes_room(
    placed: list[tuple[int, int, int]], want: str, data: st.DataObject
) -> None:
    ext = Extender(cluster_plugin())
    used: dict[int, int] = {}
    pods = []
    for i, (minor, core, prio) in enumerate(placed):
        if used.get(minor, 0) + core <= 100:
            used[minor] = used.get(minor, 0) + core
            pods.append(place(ext, f"v{i}", prio, [(minor, core)]))
    preemptor = pod("p", 2) if want == "half" else pod("p", 2, want)
    if want == "half":
        half = {
            "koordinator.sh/gpu-core": "50",
            "koordinator.sh/gpu-memory-ratio": "50",
            "koordinator.sh/gpu.shared": "1",
        }
        preemptor["spec"]["containers"][0]["resources"] = {"limits": half, "requests": half}
    offered = data.draw(st.lists(st.sampled_from(pods), unique_by=lambda p: p["metadata"]["uid"])) if pods else []
    chosen, _ = both_forms(ext, preemptor, {NODE: offered})
    req = ext.plugin.pre_filter(pod_from_json(preemptor))
    allowed = {p["metadata"]["uid"] for p in offered} | {
        p["metadata"]["uid"] for p in pods if p["spec"]["priority"] < 2
    }
    fits = ext.plugin.fits_without
    smallest = next(
        (k for k in range(len(allowed) + 1) if any(fits(req, NODE, c) for c in combinations(sorted(allowed), k))), None
    )
    if smallest is None:
        assert chosen == {}
        return
    got = chosen[NODE]
    assert set(got) <= allowed and fits(req, NODE, got)
    if smallest == 0:  # room without evictions: kube-scheduler's own victims stand
        assert got == [p["metadata"]["uid"] for p in offered]
    elif 2 ** len(allowed) <= preempt.EXACT_CHECKS:  # within the exact search's budget: the fewest
        assert len(got) == smallest
