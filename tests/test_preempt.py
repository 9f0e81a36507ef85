"""The extender's preempt verb: kube-scheduler's ExtenderPreemptionArgs in both forms
(nodeCacheCapable: NodeNameToMetaVictims with pod UIDs; otherwise NodeNameToVictims with whole
pods), answered as ExtenderPreemptionResult {NodeNameToMetaVictims}, which kube-scheduler reads back
into pods of that node (pkg/scheduler/framework/extender.go, ProcessPreemption and
convertToVictims). And filter's split of failed nodes into ones preemption may help or not."""

from __future__ import annotations

import json
from typing import Any

import pytest
from test_extender import cluster_plugin, fixture

from crihook.allocation import DEVICE_ALLOCATED, GPU_CORE, GPU_MEMORY_RATIO
from crihook.scheduler.extender import BadRequest, Extender
from crihook.scheduler.pod import pod_from_json

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


def test_a_node_where_the_victims_free_too_little_is_dropped(ext: Extender) -> None:
    pods = [place(ext, f"w{m}", 1, [(m, 100)]) for m in range(8)]
    chosen, _ = both_forms(ext, pod("big", 1000, "2"), {NODE: pods[:1]})  # kube-scheduler offers one GPU's pod
    assert chosen == {}


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
