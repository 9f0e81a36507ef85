"""The default score's pieces against plain-Python references (places per shape, the Poisson tail,
the soft CPU deficit), and what each of them changes in a placement where FGD's bucket ties."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crihook.scheduler.baselines import FGD
from crihook.scheduler.devices import Gpu, NodeDevices
from crihook.scheduler.drift import Drift
from crihook.scheduler.frag import Shape, Typical, stats
from crihook.scheduler.memo import RowMemo, States, distinct, fit_tag
from crihook.scheduler.outlook import node_shapes, poisson_tail, pools
from crihook.scheduler.placement import Nodes, host_cpu, share_options
from crihook.scheduler.places import BIG, Places, Reach, fixed
from crihook.scheduler.plugin import DeviceShare, PluginConfig
from crihook.scheduler.pod import Container, Pod
from crihook.scheduler.score import DefaultPolicy, soft_deficit

shape_rows = st.lists(
    st.tuples(
        st.sampled_from([0, 1000, 8000, 32000]),  # CPU
        st.sampled_from([0, 1 << 30, 64 << 30]),  # host memory
        st.sampled_from([0, 10, 25, 50, 81, 100]),  # GPU percent
        st.sampled_from([1, 1, 2, 4]),  # GPU count
        st.sampled_from([None, None, ("T4",), ("G2", "T4")]),  # GPU models accepted
    ).map(
        lambda s: (s[0], s[1], 0, 0, None) if not s[2] else s if s[2] == 100 else (*s[:3], 1, s[4])
    ),  # as requests are
    min_size=1,
    max_size=6,
)
MODELS = ["T4", "G2", "P100"]
node_states = st.lists(
    st.tuples(
        st.integers(0, 40000),
        st.integers(0, 100 << 30),
        st.lists(st.sampled_from([0, 5, 19, 50, 75, 100]), min_size=4, max_size=4),
        st.lists(st.integers(0, len(MODELS) - 1), min_size=4, max_size=4),
    ),
    min_size=1,
    max_size=4,
)


def places_reference(
    shape: tuple[int, int, int, int, tuple[str, ...] | None], cpu: int, mem: int, left: list[int], model: list[int]
) -> float:
    """Pods of one shape that fit together, counted the slow way: add them one by one, each on slots
    of a model the shape accepts."""
    c, m, pct, count, models = shape
    if not (c or m or pct):
        return math.inf
    left = [x if models is None or MODELS[g] in models else 0 for x, g in zip(left, model, strict=True)]
    n = 0
    while n < 1000:
        room = [i for i, x in enumerate(left) if x >= pct] if pct else []
        if c > cpu or m > mem or (pct and len(room) < count):
            return n
        cpu, mem = cpu - c, mem - m
        for i in room[:count]:
            left[i] -= pct
        n += 1
    return math.inf


@settings(max_examples=80, deadline=None)
@given(shape_rows, node_states, st.sampled_from([10, 25, 50, 100]))
def test_places_match_adding_pods_one_by_one(
    shapes: list[tuple[int, int, int, int, tuple[str, ...] | None]],
    nodes: list[tuple[int, int, list[int], list[int]]],
    pct: int,
) -> None:
    pl = Places.of(shapes, MODELS)
    cpu = np.array([c for c, _, _, _ in nodes], np.int64)
    mem = np.array([m for _, m, _, _ in nodes], np.int64)
    left = np.array([lv for _, _, lv, _ in nodes], np.int64)
    model = np.array([g for _, _, _, g in nodes], np.int64)

    def check(got: np.ndarray, c: np.ndarray, m: np.ndarray, lv: np.ndarray) -> None:
        for k in range(len(c)):
            for j, s in enumerate(shapes):
                want = places_reference(s, int(c[k]), int(m[k]), list(lv[k]), list(model[k]))
                assert got[k, j] == want or (want == math.inf and got[k, j] >= BIG)

    room = pl.room(left, model)
    check(pl.from_room(cpu, mem, room), cpu, mem, left)
    cpu_after = np.maximum(cpu - 500, 0)
    k, g = np.nonzero(np.ones_like(left, bool))  # every slot an option, as a one-GPU share's
    each = pl.after(cpu_after, mem, pl.lose(room[k], pct, left[k, g, None], model[k, g, None]), k)
    each = each.reshape(*left.shape, -1)
    for col in range(left.shape[1]):
        moved = left.copy()
        moved[:, col] = np.maximum(moved[:, col] - pct, 0)
        check(each[:, col, :], cpu_after, mem, moved)
    cols = np.array([[1, 3]] * len(nodes))  # a set of slots taken from each node
    both = pl.after(cpu_after, mem, pl.lose(room, pct, left[:, [1, 3]], model[:, [1, 3]]))
    moved = left.copy()
    np.put_along_axis(moved, cols, np.maximum(np.take_along_axis(left, cols, axis=1) - pct, 0), axis=1)
    check(both, cpu_after, mem, moved)


@settings(max_examples=80, deadline=None)
@given(shape_rows, node_states, st.lists(st.sampled_from([0.0, 0.001, 0.3, 1.0, 2.7]), min_size=6, max_size=6))
def test_reach_is_the_weight_of_the_shapes_with_a_place(
    shapes: list[tuple[int, int, int, int, tuple[str, ...] | None]],
    nodes: list[tuple[int, int, list[int], list[int]]],
    weights: list[float],
) -> None:
    """The table's answer is the weighed shapes with at least one place, counted one by one, to
    the last bit (the weights are fixed-point); for the options of a node as for nodes."""
    pl = Places.of(shapes, MODELS)
    weight = fixed(np.array(weights[: len(shapes)]))
    cpu = np.array([c for c, _, _, _ in nodes], np.int64)
    mem = np.array([m for _, m, _, _ in nodes], np.int64)
    left = np.array([lv for _, _, lv, _ in nodes], np.int64)
    model = np.array([g for _, _, _, g in nodes], np.int64)
    reach = Reach(pl, weight)
    got = reach(cpu, mem, pl.room(left, model))
    for k, (c, m, lv, g) in enumerate(nodes):
        want = sum(w for w, s in zip(weight, shapes, strict=True) if places_reference(s, c, m, lv, g) > 0)
        assert got[k] == want
    k = np.repeat(np.arange(len(nodes)), 2)  # two options on each node
    np.testing.assert_array_equal(reach(cpu, mem, pl.room(left, model)[k], k), got[k])


def test_fixed_point_sums_do_not_depend_on_the_rows_summed_together() -> None:
    """BLAS sums a row of a product differently with other rows; fixed-point weights make every
    order give the same sum, so a node scores the same alone or in a pass over the cluster."""
    rng = np.random.default_rng(14)
    lost = rng.integers(0, 1600, (1500, 512)).astype(np.int32)  # places lost, up to 16 GPUs of 1 % shares
    weight = fixed(rng.random(512) * 1600)
    whole = lost @ weight
    for i in range(0, 1500, 37):
        assert lost[i] @ weight == whole[i]  # a row alone: a dot product, not the matrix kernel
        assert (lost[i : i + 3] @ weight)[0] == whole[i]
    np.testing.assert_array_equal((lost[::-1] @ weight)[::-1], whole)
    np.testing.assert_array_equal(lost[:, ::-1] @ weight[::-1], whole)


Slots = list[tuple[list[int], list[int], list[bool]]]  # per node: idle percent, model id, fits


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 62), st.integers(0, 2**62), st.integers(1, 6))
def test_fit_tag_is_the_fitting_slots_as_bits(width: int, seed: int, nodes: int) -> None:
    """One bit per slot, slot g worth 2**g, exact however wide the node (a float product up to
    53 slots, an integer one beyond)."""
    fits = np.random.default_rng(seed).random((nodes, width)) < 0.5
    want = [sum(1 << g for g in range(width) if row[g]) for row in fits.tolist()]
    got = fit_tag(fits)
    assert got.dtype == np.int64
    assert got.tolist() == want


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.sampled_from([0, 25, 50, 100]), min_size=4, max_size=4),
            st.lists(st.integers(0, 2), min_size=4, max_size=4),
            st.lists(st.booleans(), min_size=4, max_size=4),
        ),
        min_size=1,
        max_size=5,
    )
)
def test_share_options_are_each_distinct_fitting_slot_once(nodes: Slots) -> None:
    """One option per fitting slot, the lowest of the slots of a node equal in idle and model."""
    left, model, fits = (np.array([n[i] for n in nodes]) for i in range(3))
    want = [
        (k, g)
        for k, (lv, md, ft) in enumerate(nodes)
        for g in range(4)
        if ft[g] and not any(ft[i] and lv[i] == lv[g] and md[i] == md[g] for i in range(g))
    ]
    got = share_options(left, fits.astype(bool), model)
    assert list(zip(*(a.tolist() for a in got), strict=True)) == want


@pytest.mark.parametrize("mean", [0.0, 0.3, 2.5, 40.0, 400.0])
def test_poisson_tail_against_the_sum(mean: float) -> None:
    def tail(k: int) -> float:
        if mean == 0:
            return 1.0 if k <= 0 else 0.0
        below = sum(math.exp(-mean + i * math.log(mean) - math.lgamma(i + 1)) for i in range(k))
        return max(0.0, 1.0 - below)

    got = [poisson_tail(mean, k) for k in range(0, int(mean * 2) + 30)]
    assert got[0] == 1.0
    assert all(a >= b for a, b in itertools.pairwise(got))  # fewer places left: likelier to run out
    assert got == pytest.approx([tail(k) for k in range(len(got))], abs=1e-9)
    assert poisson_tail(mean, 10**6) == 0.0


def test_soft_deficit_is_about_the_deficit_and_nothing_without_idle_gpu() -> None:
    rho = 120.0  # 12 cores per GPU: 8 idle GPUs need 96 cores
    gpu = np.full(4, 800.0)
    cpu = np.array([296_000.0, 96_000.0, 64_000.0, 32_000.0])
    d = soft_deficit(cpu, gpu, rho)
    assert d[0] == pytest.approx(0.0, abs=0.1)  # a large surplus
    assert d[2] == pytest.approx(32_000 / rho, rel=0.1)  # short of 32 cores: 2.7 GPUs stranded
    assert d[3] == pytest.approx(64_000 / rho, rel=0.05)
    assert all(np.diff(d) > 0)  # less CPU for the same GPUs: a larger deficit
    assert (soft_deficit(cpu, np.zeros(4), rho) == 0).all()  # nothing left to strand
    assert all(np.diff(soft_deficit(np.full(4, 64_000.0), np.array([0.0, 100.0, 400.0, 800.0]), rho)) > 0)


def _node(name: str, gpus: int, cpu: int, mem_gib: int = 1024) -> NodeDevices:
    gpu = tuple(Gpu(minor=g, memory=16 << 30) for g in range(gpus))
    return NodeDevices(name, gpu, cpu_milli=cpu, memory=mem_gib << 30)


def _pod(uid: str, cpu: int, gpus: int, mem_gib: int = 1) -> Pod:
    req = {"cpu": f"{cpu}m", "memory": f"{mem_gib}Gi", **({"nvidia.com/gpu": str(gpus)} if gpus else {})}
    return Pod(uid=uid, namespace="t", name=uid, containers=(Container("main", req),))


def _best(ds: DeviceShare, pod: Pod) -> str:
    scores = ds.score_nodes(ds.pre_filter(pod))
    return max(scores, key=scores.__getitem__)


TIGHT = ("tight", 8, 96_000)  # 12 cores per GPU
RICH = ("rich", 2, 104_000)  # 52 cores per GPU


@pytest.mark.parametrize(("cpu", "want"), [(24000, "rich"), (4000, "tight")])
@pytest.mark.parametrize("policy", ["default", "fgd"])
def test_heavy_pods_go_where_cpu_is_plentiful_light_ones_where_it_is_not(policy: str, cpu: int, want: str) -> None:
    """A 12-core-per-GPU mix: FGD's bucket ties the two nodes for a one-GPU pod and FGD takes the
    first; the default sends a 24-core pod to the rich node and a 4-core pod to the tight one, which
    it leaves with room, whichever node comes first."""
    typ = Typical.of(Counter({Shape(12000, 100, 1): 1}))
    for order in ((TIGHT, RICH), (RICH, TIGHT)):
        ds = DeviceShare(PluginConfig(policy=None if policy == "default" else FGD(typ)))
        for i, (name, gpus, node_cpu) in enumerate(order):
            ds.set_node(_node(f"{i}-{name}", gpus, node_cpu))
        for i in range(20):
            ds.pre_filter(_pod(f"learn{i}", 12000, 1))  # the default learns the mix from the pods it sees
        best = _best(ds, _pod("one", cpu, 1))
        assert best.endswith(want) if policy == "default" else best.startswith("0-")


@pytest.mark.parametrize("policy", ["default", "fgd"])
def test_the_only_host_of_a_rare_large_shape_is_kept_for_it(policy: str) -> None:
    """Two 8-GPU nodes alike but for memory; only the big one can take the 700 GiB 8-GPU pods, too
    rare to be one of FGD's typical shapes. FGD ties the nodes for a one-GPU pod and takes the first;
    the default keeps the big node whole."""
    typ = Typical.of(Counter({Shape(8000, 100, 1): 97, Shape(90000, 100, 8): 2}))
    ds = DeviceShare(PluginConfig(policy=None if policy == "default" else FGD(typ)))
    ds.set_node(_node("a-big", 8, 96_000, 768))
    ds.set_node(_node("b-small", 8, 96_000, 384))
    for i in range(97):
        ds.pre_filter(_pod(f"small{i}", 8000, 1))
    for i in range(2):
        ds.pre_filter(_pod(f"large{i}", 90000, 8, 700))
    assert _best(ds, _pod("one", 8000, 1)) == ("b-small" if policy == "default" else "a-big")


@pytest.mark.parametrize("names", [("a-big", "b-plain"), ("b-big", "a-plain")])
def test_before_any_large_pod_is_seen_the_most_capable_node_is_kept(names: tuple[str, str]) -> None:
    """A fresh scheduler has seen one small pod; the pods as large as each kind of node stand in for
    what may come. Only the big node could host one as large as itself, so the small pod goes to
    the plain node, whichever comes first."""
    big, plain = names
    ds = DeviceShare()
    ds.set_node(_node(big, 8, 128_000, 768))
    ds.set_node(_node(plain, 8, 96_000, 384))
    scores = ds.score_nodes(ds.pre_filter(_pod("first", 8000, 1)))
    assert scores[plain] > scores[big] + 1  # not a tie broken by chance: a point of FGD's bucket


def test_the_outlook_looks_at_the_most_frequent_shapes_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests in a real cluster vary without end; the outlook's cost stays bounded."""
    from crihook.scheduler import outlook

    monkeypatch.setattr(outlook, "MAX_SHAPES", 2)
    monkeypatch.setattr(outlook, "MIN_RARE", 0.0)
    monkeypatch.setattr(outlook, "PRIOR", 0.0)  # the node-sized stand-ins are not pods seen
    ds = DeviceShare()
    ds.set_node(_node("a", 2, 64_000))
    for i, cpu in enumerate([1000] * 5 + [2000] * 3 + [3000, 4000, 5000]):
        ds.pre_filter(_pod(f"p{i}", cpu, 1))
    policy = ds.policy
    assert isinstance(policy, DefaultPolicy)
    policy.outlook.update(ds.st)
    assert sorted(policy.outlook.places.table[0].tolist()) == [1000, 2000]


FLEET = ("T4", "G2", "V100M16", "V100M32")
pinned_pods = st.lists(
    st.tuples(
        st.sampled_from([1000, 4000, 12000]),  # CPU
        st.sampled_from([(1, 100), (1, 30), (1, 50), (2, 100), (4, 100)]),  # GPUs, percent
        st.sampled_from(["", "", "T4", "G2", "V100", "V100M16,G2", "t4,v100m32"]),  # use-gputype
        st.sampled_from(["", "", "", "M32", "G2"]),  # nouse-gputype
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=40, deadline=None)
@given(pinned_pods, st.lists(st.sampled_from(FLEET), min_size=2, max_size=6), st.booleans())
def test_the_default_never_places_a_pinned_pod_on_a_model_it_refused(
    pods: list[tuple[int, tuple[int, int], str, str]], models: list[str], mixed: bool
) -> None:
    """Whatever the fleet and the pins, every GPU a pod gets is of a model its type lists accept
    (substrings, case-insensitive; nouse wins), however the outlook weighs the pinned shapes."""
    ds = DeviceShare()
    for i, model in enumerate(models):
        slot_models = [FLEET[(i + g) % len(FLEET)] if mixed else model for g in range(4)]
        gpus = tuple(Gpu(minor=g, memory=16 << 30, model=m, uuid=f"n{i}-{g}") for g, m in enumerate(slot_models))
        ds.set_node(NodeDevices(f"n{i}", gpus, cpu_milli=64_000, memory=1 << 40))
    model_of = {(f"n{i}", g.minor): g.model for i in range(len(models)) for g in ds.st.nodes[ds.st.rows[f"n{i}"]].gpus}
    for j, (cpu, (count, pct), use, nouse) in enumerate(pods):
        res = {"cpu": f"{cpu}m"}
        if pct == 100:
            res["nvidia.com/gpu"] = str(count)
        else:
            res |= {"koordinator.sh/gpu-core": str(pct), "koordinator.sh/gpu-memory-ratio": str(pct)}
            res["koordinator.sh/gpu.shared"] = "1"
        ann = {k: v for k, v in (("nvidia.com/use-gputype", use), ("nvidia.com/nouse-gputype", nouse)) if v}
        req = ds.pre_filter(
            Pod(uid=f"p{j}", namespace="t", name=f"p{j}", containers=(Container("m", res),), annotations=ann)
        )
        fit, _ = ds.filter_nodes(req, reasons=False)
        if not fit:
            continue
        scores = ds.score_nodes(req, fit)
        node = max(scores, key=scores.__getitem__)
        alloc = ds.reserve(req, node)
        for g in alloc.gpus:
            model = model_of[(node, g.minor)]
            assert not use or any(t.upper() in model for t in use.split(",")), (use, model)
            assert not nouse or nouse.upper() not in model, (nouse, model)


@pytest.mark.parametrize("shared", [True, False])
def test_requests_of_one_size_share_kept_rows_and_score_as_counted_afresh(shared: bool) -> None:
    """Requests that differ only in their selectors share the kept scores and growths; a node
    whose fitting GPUs differ between them (one of two models) is scored again, so every answer is
    what a pass with nothing kept gives, to the last bit."""
    ds = DeviceShare()
    for i in range(6):  # T4 nodes, G2 nodes and nodes of both
        slot_models = [("T4", "G2")[(i + g * (i // 4)) % 2] for g in range(4)]
        gpus = tuple(Gpu(minor=g, memory=16 << 30, model=m, uuid=f"n{i}-{g}") for g, m in enumerate(slot_models))
        ds.set_node(NodeDevices(f"n{i}", gpus, cpu_milli=64_000, memory=1 << 40))
    res = (
        {"koordinator.sh/gpu-core": "30", "koordinator.sh/gpu-memory-ratio": "30", "koordinator.sh/gpu.shared": "1"}
        if shared
        else {"nvidia.com/gpu": "1"}
    ) | {"cpu": "4000m"}
    pol = ds.policy
    assert isinstance(pol, DefaultPolicy)
    for j, use in enumerate(["", "T4", "G2", "", "T4", "G2,T4"] * 4):
        ann = {"nvidia.com/use-gputype": use} if use else {}
        req = ds.pre_filter(
            Pod(uid=f"p{j}", namespace="t", name=f"p{j}", containers=(Container("m", res),), annotations=ann)
        )
        kept = ds.score_nodes(req)
        pol.cache.clear()
        pol.growths.clear()
        assert ds.score_nodes(req) == kept
        if kept and j % 2:
            ds.reserve(req, max(kept, key=kept.__getitem__))


def test_a_pinned_pool_about_to_run_out_costs_its_gpu_and_a_roomy_one_does_not() -> None:
    """Pods pinned to T4 outnumber the T4 GPUs left: taking a T4 GPU costs about all of it; pods
    pinned to G2 have room to spare: a G2 GPU costs nothing; a model in two short sets adds both."""
    ds = DeviceShare()
    for i, model in enumerate(("T4", "G2", "G2", "V100")):
        gpus = tuple(Gpu(minor=g, memory=16 << 30, model=model) for g in range(2))
        ds.set_node(NodeDevices(f"n{i}", gpus, cpu_milli=64_000, memory=1 << 40))
    st_ = ds.st
    rows = np.flatnonzero(st_.live)
    seen = {(1000, 0, 100, 1, ("T4",)): 30, (1000, 0, 100, 1, ("G2",)): 1, (1000, 0, 100, 1, None): 69}
    rate = pools(seen, 100, future=20.0, st=st_, rows=rows)
    assert rate is not None
    by = dict(zip(st_.model_names, rate, strict=True))
    assert by["T4"] > 0.95  # 6 T4 pods expected, 2 places
    assert by["G2"] < 0.01 and by["V100"] == 0.0
    both = pools({**seen, (1000, 0, 100, 1, ("T4", "V100")): 30}, 130, future=20.0, st=st_, rows=rows)
    assert both is not None  # 4.6 pods expected of each, 2 places on T4, 4 on T4 or V100
    assert both[st_.model_ids["T4"]] > 1.4 and 0.5 < both[st_.model_ids["V100"]] < 0.9
    assert pools({(1000, 0, 100, 1, None): 5}, 5, future=8.0, st=st_, rows=rows) is None


def test_scores_stay_right_when_a_node_with_more_gpus_joins() -> None:
    """The per-node memos are laid out by GPU slot: a node wider than all before re-lays them, and a
    one-GPU share is then scored on the new node's slots too."""
    ds = DeviceShare()
    ds.set_node(_node("a", 2, 64_000))
    share = {"koordinator.sh/gpu-core": "25", "koordinator.sh/gpu-memory-ratio": "25", "koordinator.sh/gpu.shared": "1"}

    def pod(uid: str) -> Pod:
        return Pod(uid=uid, namespace="t", name=uid, containers=(Container("m", share),))

    for i in range(4):  # the fifth pod seen re-derives nothing: the memos from before must serve
        node = _best(ds, pod(f"s{i}"))
        ds.reserve(ds.pre_filter(pod(f"s{i}")), node)
    ds.set_node(_node("b", 8, 64_000))
    req = ds.pre_filter(pod("late"))
    scores = ds.score_nodes(req)
    assert set(scores) == {"a", "b"} and all(0 <= v <= 100 for v in scores.values())
    assert len(ds.reserve(req, "b").gpus) == 1


def _share(uid: str, pct: int) -> Pod:
    res = {
        "koordinator.sh/gpu-core": f"{pct}",
        "koordinator.sh/gpu-memory-ratio": f"{pct}",
        "koordinator.sh/gpu.shared": "1",
    }
    return Pod(uid=uid, namespace="t", name=uid, containers=(Container("m", res),))


@pytest.mark.parametrize("policy", ["default", "fgd"])
def test_reserve_takes_the_slot_score_chose_unless_the_node_changed_since(policy: str) -> None:
    """Reserve reuses the GPU Score chose for the pod's shape while the node is as it was; once
    another pod changed the node, the choice is made again on the node as it is."""
    typ = Typical.of(Counter({Shape(1000, 30, 1): 1}))
    ds = DeviceShare(PluginConfig(policy=None if policy == "default" else FGD(typ)))
    ds.set_node(_node("a", 2, 64_000))
    req = ds.pre_filter(_share("p", 30))
    assert set(ds.score_nodes(req)) == {"a"}  # both GPUs empty: GPU 0, the first of equals
    ds.reserve(ds.pre_filter(_share("q", 80)), "a")  # takes GPU 0, which can no longer take 30 %
    assert [g.minor for g in ds.reserve(req, "a").gpus] == [1]
    same = ds.pre_filter(_share("r", 30))
    ds.score_nodes(same)
    assert [g.minor for g in ds.reserve(same, "a").gpus] == [1]  # unchanged since Score: its choice


def test_node_kinds_follow_nodes_that_change_join_and_go() -> None:
    """The pseudo-pods' node sizes are kept per node while it is unchanged, and follow a replaced
    Device, a new node and a removed one."""
    ds = DeviceShare()
    ds.set_node(_node("a", 8, 96_000, 768))
    ds.set_node(_node("b", 2, 32_000, 128))
    memo = RowMemo(3, np.int64)

    def kinds() -> set[tuple[int, int, int, int, None]]:
        return node_shapes(ds.st, np.flatnonzero(ds.st.live), memo)

    assert kinds() == {(96_000, 768 << 30, 100, 8, None), (32_000, 128 << 30, 100, 2, None)}
    ds.reserve(ds.pre_filter(_pod("p", 8000, 1)), "a")  # a pod changes what is free, not the size
    assert kinds() == {(96_000, 768 << 30, 100, 8, None), (32_000, 128 << 30, 100, 2, None)}
    ds.set_node(_node("b", 4, 64_000, 256))
    assert kinds() == {(96_000, 768 << 30, 100, 8, None), (64_000, 256 << 30, 100, 4, None)}
    ds.remove_node("a")
    ds.set_node(_node("c", 2, 32_000, 128))  # takes the row a left
    assert kinds() == {(64_000, 256 << 30, 100, 4, None), (32_000, 128 << 30, 100, 2, None)}


def test_kept_node_stats_and_places_are_what_a_fresh_count_gives() -> None:
    """FGD's stats of each node are kept for all request shapes, and the places each node holds are
    kept from the outlook's update: after pods of several shapes, past an update, both are what
    counting the nodes afresh gives."""
    ds = DeviceShare()
    for i, (gpus, cpu) in enumerate([(8, 96_000), (2, 104_000), (4, 64_000)] * 3):
        ds.set_node(_node(f"n{i}", gpus, cpu))
    for j in range(70):  # the outlook is re-derived at 64 pods
        pod = _share(f"s{j}", 25 * (1 + j % 3)) if j % 2 else _pod(f"w{j}", 4000 + 1000 * (j % 5), 1 + j % 2)
        scores = ds.score_nodes(ds.pre_filter(pod))
        if scores:
            ds.reserve(ds.pre_filter(pod), max(scores, key=scores.__getitem__))
    pol, cl = ds.policy, ds.st
    assert isinstance(pol, DefaultPolicy)
    rows = np.flatnonzero(cl.live)
    cpu, left, model = host_cpu(cl, rows), cl.left(rows), cl.model[rows]
    kept = pol._stats(cl, Nodes.of(cl, rows))
    fresh = stats(pol.typ, cpu, left, model if pol.typ.acc is not None else None)
    assert kept is not None and pol.typ.weight.size
    for field in ("nfit", "small", "total", "cpu"):
        np.testing.assert_array_equal(getattr(kept, field), getattr(fresh, field))
    out = pol.outlook
    room = out.places.room(left, model)
    count = out.hot.from_room(cpu, cl.hmem_free[rows], out.hot.room(left, model))  # the scarce shapes' places
    # then shares per GPU part, then the weight with a place
    fresh_room = np.concatenate((count, room, out.reach(cpu, cl.hmem_free[rows], room)[:, None]), axis=1)
    np.testing.assert_array_equal(out.before.get(cl, rows, lambda at: fresh_room[at]), fresh_room)


def test_an_outlook_derived_off_the_request_path_scores_as_one_derived_in_line() -> None:
    """The extender re-derives the outlook on a thread (DefaultPolicy.outlook_job): derived from
    copies of the same state and installed before the evaluation, it scores exactly as the
    simulator's in-line update does; evaluations in between do not derive it themselves."""
    rng = np.random.default_rng(7)
    inline, background = DeviceShare(), DeviceShare(PluginConfig(background_outlook=True))
    for ds in (inline, background):
        for i in range(24):
            ds.set_node(_node(f"n{i:02d}", (2, 4, 8)[i % 3], (32_000, 64_000, 96_000)[i % 3]))
    jobs, placed = 0, []
    policy = background.policy
    assert isinstance(policy, DefaultPolicy)
    for i in range(420):
        pod = _pod(f"p{i}", int(rng.choice([2000, 8000, 16000])), int(rng.choice([0, 1, 1, 2, 4])))
        want = inline.score_nodes(inline.pre_filter(pod))
        req = background.pre_filter(pod)  # the pod is observed here: the outlook may be due now
        if policy.due:
            before = policy.outlook, policy.typ
            background.score_nodes(req)
            assert (policy.outlook, policy.typ) == before and policy.due  # left to the job
        job = background.outlook_job()
        if job is not None:
            jobs += 1
            job()()
            assert background.outlook_job() is None  # taken: not due again until another pod makes it so
        assert background.score_nodes(req) == want
        if want:
            node = max(want, key=want.__getitem__)
            inline.reserve(inline.pre_filter(pod), node)
            background.reserve(req, node)
            placed.append(pod.uid)
        if len(placed) > 30:  # pods end: the cluster never fills, every pod is placed and seen
            gone = placed.pop(0)
            inline.unreserve(gone)
            background.unreserve(gone)
    seen = policy.outlook.seen  # the GPU pods: the others are not observed
    assert seen > 320 and jobs == sum(1 for n in range(1, seen + 1) if n & (n - 1) == 0 or n % 64 == 0)


def test_pods_seen_while_an_outlook_job_runs_are_kept() -> None:
    ds = DeviceShare(PluginConfig(background_outlook=True))
    ds.set_node(_node("a", 8, 96_000))
    for i in range(192):  # the 192nd pod makes the outlook due
        req = ds.pre_filter(_pod(f"p{i}", 1000, 1 + i % 2))
        ds.score_nodes(req)
        ds.reserve(req, "a")
        ds.unreserve(req.uid)  # the pods come and go: the node has room for all
        if i < 191:
            job = ds.outlook_job()
            if job is not None:
                job()()
    job = ds.outlook_job()
    assert job is not None and isinstance(ds.policy, DefaultPolicy)
    install = job()  # derived from the 192 pods seen when it was taken
    late = ds.pre_filter(_pod("late", 3000, 2))
    ds.reserve(late, "a")  # observed by the outlook still in use
    install()
    outlook = ds.policy.outlook
    assert outlook.seen == 193 and [n for (cpu, *_), n in outlook.shapes.items() if cpu == 3000] == [1]


def test_without_background_there_is_no_outlook_job() -> None:
    """The simulator's policy re-derives in line: an extender's refresh must not take the work from
    its evaluations (their timing would then decide its placements)."""
    ds = DeviceShare()
    ds.set_node(_node("a", 8, 96_000))
    ds.pre_filter(_pod("p0", 1000, 1))  # the first pod seen: the outlook is due
    assert isinstance(ds.policy, DefaultPolicy) and ds.policy.due
    assert ds.outlook_job() is None and ds.policy.due


pool_idle = st.lists(st.integers(0, 10**6), min_size=1, max_size=4)


@given(
    st.integers(1, 128),
    st.sampled_from([0.0, 0.0625, 0.125, 0.5]),
    st.sampled_from([0.0, 0.0625, 0.125, 1.0]),
    st.integers(0, 10**5),
    pool_idle,
    st.integers(0, 10**4),
    st.data(),
)
def test_the_outlook_drifts_when_a_pool_or_the_mix_moved_enough(
    every: int, fill: float, grow: float, seen: int, then: list[int], since: int, data: st.DataObject
) -> None:
    """Never before `every` pods since the last derivation; then as soon as a pool's idle GPU has
    moved by more than `fill` of what it was, either way, or the pods since reach `grow` of those
    before. A pool that was empty and stays so never drifts; fill = grow = 0 is every `every` pods."""
    now = data.draw(st.lists(st.integers(0, 10**6), min_size=len(then), max_size=len(then)))
    drift = Drift(every, fill, grow)
    drift.mark(seen, then)
    due = drift.due(seen + since, now)
    assert drift.waited(seen + since) == (since >= every and since % drift.look == 0)
    if since < every:
        assert not due
        return
    moved = [abs(a - b) for a, b in zip(now, then, strict=True)]
    assert due == (any(m > fill * b for m, b in zip(moved, then, strict=True)) or since >= grow * seen)
    assert drift.due(seen + since, then) == (since >= grow * seen)  # nothing moved: the mix alone
    assert drift.due(seen + since + 1, now) or not due  # more pods since: still due
    if fill == grow == 0:
        assert due
    if grow * seen > since and all(b == 0 for b in then):
        assert due == any(a > 0 for a in now)


def test_a_steadily_filling_cluster_drifts_early_and_near_full() -> None:
    """A cluster of 100,000 GPU percent filled by pods of 10: the outlook follows every 64 pods
    while the mix is young and once the cluster is nearly full, rarely in between, and never once
    it is full and nothing moves."""
    drift = Drift(64, 0.125, 0.125)
    drift.mark(64, [100_000 - 640])
    at = []
    for n in range(65, 12_001):
        idle = max(100_000 - 10 * n, 0)
        if drift.due(n, [idle]):
            drift.mark(n, [idle])
            at.append(n)
    gaps = np.diff([64, *at])
    assert at[:7] == [128, 192, 256, 320, 384, 448, 512]  # the mix: every 64 up to 8 x 64 pods
    assert max(gaps) > 600 and len(at) < 60  # against 155 every 64 pods
    assert all(gap == 64 for gap in gaps[-6:-1]) and at[-1] < 10_000 + 12_000 // 8 + 64  # near full, then full


def test_each_distinct_node_state_is_evaluated_once_and_answers_every_node_in_it() -> None:
    """Nodes are grouped by their state (CPU, memory, idle and model per slot, and the slots that
    fit), kept per node version: one evaluation per group, every node answered as if alone, and
    a node that changes leaves its group."""
    ds = DeviceShare()
    for i in range(90):
        model = ("T4", "G2")[i % 2]
        devs = tuple(Gpu(minor=g, memory=16 << 30, model=model, uuid=f"n{i}-{g}") for g in range(4))
        ds.set_node(NodeDevices(f"n{i:02d}", devs, cpu_milli=(32_000, 64_000)[i % 3 == 0], memory=1 << 40))
    states = States()
    cl = ds.st
    rows = np.flatnonzero(cl.live)
    asked: list[int] = []

    def evaluate(at: np.ndarray, fits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        asked.append(at.size)
        state = np.concatenate((host_cpu(cl, at)[:, None], cl.hmem_free[at, None], cl.left(at), cl.model[at], fits), 1)
        return (state * np.arange(1, state.shape[1] + 1)).sum(axis=1).astype(np.float64), at % 4

    for j in range(12):
        req = ds.pre_filter(_share(f"s{j}", 25 + 25 * (j % 3)))
        fits = ds.gpu_fits(req, rows)
        fits[: j * 3, 0] = False  # some nodes with a slot that does not fit, as a pin would
        asked.clear()
        value, _ = distinct(cl, rows, fits, evaluate, states)
        want, _ = evaluate(rows, fits)
        np.testing.assert_array_equal(value, want)
        key = np.concatenate((host_cpu(cl, rows)[:, None], cl.hmem_free[rows, None], cl.left(rows), cl.model[rows]), 1)
        key = np.concatenate((key, fits), axis=1)
        assert asked[0] == len({tuple(r) for r in key.tolist()})
        ds.reserve(req, f"n{(7 * j) % 90:02d}")


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 12), st.data())
def test_a_row_memo_answers_what_computing_afresh_gives_and_computes_only_stale_rows(
    nodes: int, data: st.DataObject
) -> None:
    """Over calls on any rows (in any order, picking positions or not) and nodes changing between
    them, the memo answers each row with its value for the node's version and tag now, and asks
    `compute` only for the rows changed since, or under another tag. A memo is tagged by all its
    callers or by none (the default policy drops its growths when it starts tagging)."""
    from types import SimpleNamespace

    cluster = SimpleNamespace(epoch=0, version=np.zeros(nodes, np.int64))
    memo = RowMemo(2)
    seen: dict[int, tuple[int, int]] = {}  # row -> (version, tag) the memo last computed it under
    tagged = data.draw(st.booleans())

    def value(rows: np.ndarray, tags: np.ndarray) -> np.ndarray:
        v = cluster.version[rows]
        return np.stack((rows * 1000.0 + v, tags * 1.0), axis=1)

    for _ in range(data.draw(st.integers(1, 8))):
        changed = data.draw(st.lists(st.integers(0, nodes - 1), max_size=nodes))
        cluster.version[changed] += 1
        rows = np.array(data.draw(st.permutations(range(nodes)))[: data.draw(st.integers(1, nodes))], np.int64)
        tags = np.array(data.draw(st.lists(st.integers(0, 3), min_size=rows.size, max_size=rows.size)), np.int64)
        use = tags if tagged else np.zeros(rows.size, np.int64)
        pick = np.array(data.draw(st.lists(st.integers(0, rows.size - 1), max_size=6)), np.int64)
        asked: list[int] = []

        def compute(
            at: np.ndarray, rows: np.ndarray = rows, use: np.ndarray = use, asked: list[int] = asked
        ) -> np.ndarray:
            asked.extend(rows[at].tolist())
            return value(rows[at], use[at])

        chosen = data.draw(st.booleans())
        got = memo.get(cluster, rows, compute, tags if tagged else None, pick if chosen else None)  # type: ignore[arg-type]
        want = value(rows, use)
        np.testing.assert_array_equal(got, want[pick] if chosen else want)
        stale = {
            int(r)
            for r, t in zip(rows.tolist(), use.tolist(), strict=True)
            if seen.get(r, (-1, -1))[0] != cluster.version[r] or (tagged and seen[r][1] != t)
        }
        assert sorted(asked) == sorted(stale)
        for r, t in zip(rows.tolist(), use.tolist(), strict=True):
            if r in stale:
                seen[r] = (int(cluster.version[r]), t)
