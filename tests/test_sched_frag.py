"""FGD's fragmentation against a plain-Python reference, the incremental forms the scores use (one
option per GPU slot, a set of slots) against recomputing the changed node, and what the default
score's tie-break changes against FGD."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crihook.scheduler.baselines import FGD
from crihook.scheduler.devices import Gpu, NodeDevices
from crihook.scheduler.frag import Shape, Typical, frag_of, node_frag, option_stats, set_stats
from crihook.scheduler.plugin import DeviceShare, PluginConfig
from crihook.scheduler.pod import Container, Pod

shapes = st.dictionaries(
    st.builds(
        Shape,
        cpu=st.sampled_from([0, 1000, 8000, 32000]),
        pct=st.sampled_from([0, 10, 25, 50, 80, 100]),
        count=st.sampled_from([1, 1, 2, 4]),
    ),
    st.integers(1, 9),
    min_size=1,
    max_size=6,
).map(lambda d: {(Shape(s.cpu, 0, 0) if s.pct == 0 else s): n for s, n in d.items()})
states = st.lists(
    st.tuples(st.integers(0, 40000), st.lists(st.sampled_from([0, 5, 20, 50, 75, 100]), min_size=4, max_size=4)),
    min_size=1,
    max_size=5,
)


def reference(typ: Typical, cpu: int, left: list[int]) -> float:
    out = 0.0
    for c, p, n, w in zip(typ.cpu, typ.pct, typ.count, typ.weight, strict=True):
        room = sum(1 for x in left if x >= p)
        if p > 0 and room >= n and cpu >= c:
            out += w * sum(x for x in left if x < p)
        else:
            out += w * sum(left)
    return out


@settings(max_examples=60, deadline=None)
@given(shapes, states, st.sampled_from([10, 25, 50, 100]), st.sampled_from([0, 2000]))
def test_incremental_fragmentation_matches_recomputing(
    mix: dict[Shape, int], nodes: list[tuple[int, list[int]]], pct: int, cpu: int
) -> None:
    typ = Typical.of(Counter(mix), coverage=1.0)
    cpu_left = np.array([c for c, _ in nodes], np.int64)
    left = np.array([lv for _, lv in nodes], np.int64)
    before = node_frag(typ, cpu_left, left)
    assert np.allclose(before, [reference(typ, int(c), list(lv)) for c, lv in zip(cpu_left, left, strict=True)])
    _, a = option_stats(typ, cpu_left, left, cpu, pct)
    after = frag_of(typ, a)
    for g in range(left.shape[1]):
        moved = left.copy()
        moved[:, g] -= pct
        want = [reference(typ, int(c), list(lv)) for c, lv in zip(cpu_left - cpu, moved, strict=True)]
        assert np.allclose(after[:, g], want)
    chosen = left >= pct
    after_set = frag_of(typ, set_stats(typ, cpu_left, left, cpu, pct, chosen)[1])
    want = [reference(typ, int(c), list(lv)) for c, lv in zip(cpu_left - cpu, left - pct * chosen, strict=True)]
    assert np.allclose(after_set, want)


def _node(name: str, gpus: int, cpu: int) -> NodeDevices:
    return NodeDevices(name, tuple(Gpu(minor=g, memory=16 << 30) for g in range(gpus)), cpu_milli=cpu, memory=1 << 40)


def _pod(uid: str, cpu: str, gpus: int) -> Pod:
    req = {"cpu": cpu, **({"nvidia.com/gpu": str(gpus)} if gpus else {})}
    return Pod(uid=uid, namespace="t", name=uid, containers=(Container("main", req),))


@pytest.mark.parametrize("policy", ["default", "fgd"])
def test_cpu_only_pod_goes_where_it_strands_no_gpu(policy: str) -> None:
    """FGD ties the two nodes (the learned 1-GPU, 8-CPU pod still fits either) and takes the first;
    the default sends the pod to the node whose remaining GPUs keep enough CPU."""
    typ = Typical.of(Counter({Shape(8000, 100, 1): 9, Shape(8000, 0, 0): 1}))
    ds = DeviceShare(PluginConfig(policy=None if policy == "default" else FGD(typ)))
    ds.set_node(_node("a", 2, 16_000))
    ds.set_node(_node("b", 2, 64_000))
    for i in range(9):
        ds.pre_filter(_pod(f"learn{i}", "8", 1))  # the default learns the mix from the pods it sees
    req = ds.pre_filter(_pod("cpu-only", "8", 0))
    scores = ds.score_nodes(req)
    best = max(scores, key=scores.__getitem__)
    if policy == "fgd":
        assert scores["a"] == scores["b"]
    assert best == ("b" if policy == "default" else "a")
