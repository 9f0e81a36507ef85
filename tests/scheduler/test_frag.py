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

MODELS = ["T4", "G2", "V100M16"]
shapes = st.dictionaries(
    st.builds(
        Shape,
        cpu=st.sampled_from([0, 1000, 8000, 32000]),
        pct=st.sampled_from([0, 10, 25, 50, 80, 100]),
        count=st.sampled_from([1, 1, 2, 4]),
        models=st.sampled_from([None, None, ("T4",), ("G2", "V100M16"), ("V100M16",)]),
    ),
    st.integers(1, 9),
    min_size=1,
    max_size=6,
).map(lambda d: {(Shape(s.cpu, 0, 0) if s.pct == 0 else s): n for s, n in d.items()})
states = st.lists(
    st.tuples(
        st.integers(0, 40000),
        st.lists(st.sampled_from([0, 5, 20, 50, 75, 100]), min_size=4, max_size=4),
        st.lists(st.integers(0, len(MODELS) - 1), min_size=4, max_size=4),
    ),
    min_size=1,
    max_size=5,
)


def reference(typ: Typical, cpu: int, left: list[int], model: list[int]) -> float:
    """A node's fragmentation, shape by shape as the paper's simulator counts it (frag.go): a slot
    of a model the shape does not accept holds no room for it."""
    out = 0.0
    for c, p, n, w, ms in zip(typ.cpu, typ.pct, typ.count, typ.weight, typ.models, strict=True):
        ok = [x >= p and (ms is None or MODELS[m] in ms) for x, m in zip(left, model, strict=True)]
        if p > 0 and sum(ok) >= n and cpu >= c:
            out += w * sum(x for x, o in zip(left, ok, strict=True) if not o)
        else:
            out += w * sum(left)
    return out


@settings(max_examples=80, deadline=None)
@given(shapes, states, st.sampled_from([10, 25, 50, 100]), st.sampled_from([0, 2000]))
def test_incremental_fragmentation_matches_recomputing(
    mix: dict[Shape, int], nodes: list[tuple[int, list[int], list[int]]], pct: int, cpu: int
) -> None:
    typ = Typical.of(Counter(mix), coverage=1.0).bind(MODELS)
    cpu_left = np.array([c for c, _, _ in nodes], np.int64)
    left = np.array([lv for _, lv, _ in nodes], np.int64)
    model = np.array([m for _, _, m in nodes], np.int64)

    def ref(c: np.ndarray, lv: np.ndarray) -> list[float]:
        return [reference(typ, int(ck), list(lk), list(mk)) for ck, lk, mk in zip(c, lv, model, strict=True)]

    assert np.allclose(node_frag(typ, cpu_left, left, model), ref(cpu_left, left))
    k, g = np.nonzero(np.ones_like(left, bool))
    _, a = option_stats(typ, cpu_left, left, cpu, pct, (k, g), model)
    after = frag_of(typ, a).reshape(left.shape)
    for col in range(left.shape[1]):
        moved = left.copy()
        moved[:, col] -= pct
        assert np.allclose(after[:, col], ref(cpu_left - cpu, moved))
    cols = np.tile(np.arange(2), (left.shape[0], 1))  # the first two slots of each node
    after_set = frag_of(typ, set_stats(typ, cpu_left, left, cpu, pct, cols, model)[1])
    moved = left.copy()
    moved[:, :2] -= pct
    assert np.allclose(after_set, ref(cpu_left - cpu, moved))


def test_a_node_of_a_model_no_typical_pod_accepts_is_all_fragment() -> None:
    """Pinned typical pods find all of a node of another model idle and unusable (the paper's
    NoAccess): an empty G2 node is all fragment against T4-only pods, none against unpinned ones."""
    left = np.array([[100] * 8, [100] * 8], np.int64)
    cpu = np.array([96_000, 96_000], np.int64)
    model = np.array([[0] * 8, [1] * 8], np.int64)  # G2, T4
    names = ["G2", "T4"]
    pinned = Typical.of(Counter({Shape(8000, 100, 1, ("T4",)): 3, Shape(4000, 50, 1, ("T4",)): 1})).bind(names)
    assert node_frag(pinned, cpu, left, model).tolist() == [800.0, 0.0]
    plain = Typical.of(Counter({Shape(8000, 100, 1): 3, Shape(4000, 50, 1): 1})).bind(names)
    assert plain.acc is None
    assert node_frag(plain, cpu, left, model).tolist() == [0.0, 0.0]
    half = Typical.of(Counter({Shape(8000, 100, 1, ("T4",)): 1, Shape(8000, 100, 1): 1})).bind(names)
    assert node_frag(half, cpu, left, model).tolist() == [400.0, 0.0]  # half the mix can not use it


def test_a_model_set_counts_every_model_in_it() -> None:
    """A shape accepting V100M16 or V100M32 uses nodes of both; a node of a third model is all
    fragment for it, and a node mixing models offers it only the slots it accepts."""
    names = ["V100M16", "V100M32", "P100"]
    typ = Typical.of(Counter({Shape(0, 100, 2, ("V100M16", "V100M32")): 1})).bind(names)
    left = np.array([[100] * 4, [100] * 4, [100] * 4, [100] * 4], np.int64)
    model = np.array([[0] * 4, [1] * 4, [2] * 4, [2, 2, 2, 1]], np.int64)
    cpu = np.full(4, 32_000, np.int64)
    assert node_frag(typ, cpu, left, model).tolist() == [0.0, 0.0, 400.0, 400.0]  # one V100M32: 2 needed
    model[3] = [2, 2, 0, 1]
    assert node_frag(typ, cpu, left, model).tolist() == [0.0, 0.0, 400.0, 200.0]  # the two P100s are fragment


def test_fgd_keeps_a_model_for_the_pods_pinned_to_it() -> None:
    """FGD with T4-pinned typical pods puts an unpinned pod on the G2 node: on the T4 node it would
    leave a GPU the T4 pods can not fill, on the G2 node nothing they could use is lost."""
    typ = Typical.of(Counter({Shape(1000, 100, 2, ("T4",)): 1}))
    ds = DeviceShare(PluginConfig(policy=FGD(typ)))
    for name, model in (("a", "T4"), ("b", "G2")):
        gpus = tuple(Gpu(minor=g, memory=16 << 30, model=model) for g in range(2))
        ds.set_node(NodeDevices(name, gpus, cpu_milli=64_000, memory=1 << 40))
    req = ds.pre_filter(_pod("plain", "1", 1))
    scores = ds.score_nodes(req)
    assert scores["b"] > scores["a"]


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
