"""The model of Kubernetes' structured allocator: search order, backtracking over matchAttribute,
firstAvailable, pools, consumable capacity; and, for random nodes, the first solution in the
allocator's order against a brute force over every ordered choice of devices."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from crihook.scheduler.structured import (
    Capacity,
    Claim,
    Device,
    InUse,
    MatchAttribute,
    Request,
    RequestPolicy,
    Slice,
    Sub,
    allocate,
    commit,
    consumption,
    gather_pools,
    lookup,
)

D = "gpu.example.com"


def gpus(n: int, part: list[int] | None = None) -> Slice:
    return Slice(
        D, "node", tuple(Device(f"gpu-{i}", {"index": i, "partition2": (part or [i // 2] * n)[i]}) for i in range(n))
    )


def exactly(count: int, name: str = "gpu", **kw: object) -> Claim:
    return Claim((Request(name, exactly=Sub(name, count, **kw)),))  # type: ignore[arg-type]


def devices(res: list[list[object]] | None) -> list[str]:
    assert res is not None
    return [r.device[2] for claim in res for r in claim]  # type: ignore[attr-defined]


def test_first_fit_in_published_order_skipping_devices_in_use() -> None:
    s = gpus(4)
    assert devices(allocate([s], [exactly(2)])) == ["gpu-0", "gpu-1"]
    held = InUse({(D, "node", "gpu-0"), (D, "node", "gpu-2")})
    assert devices(allocate([s], [exactly(2)], held)) == ["gpu-1", "gpu-3"]
    assert allocate([s], [exactly(3)], held) is None
    # claims in order, each taking what the ones before left
    assert devices(allocate([s], [exactly(1), exactly(2)])) == ["gpu-0", "gpu-1", "gpu-2"]


def test_match_attribute_backtracks_to_a_device_whose_peers_are_free() -> None:
    s = Slice(D, "node", tuple(Device(f"gpu-{i}", {"partition2": p}) for i, p in enumerate([0, 1, 2, 1])))
    claim = Claim((Request("gpu", exactly=Sub("gpu", 2)),), (MatchAttribute(f"{D}/partition2"),))
    res = allocate([s], [claim])
    assert devices(res) == ["gpu-1", "gpu-3"]
    # a device without the attribute never joins; one with it fixes the value for the rest
    bare = Slice(D, "node", (Device("gpu-x"), *s.devices))
    assert devices(allocate([bare], [claim])) == ["gpu-1", "gpu-3"]
    # another driver's attribute of that name is not this one
    other = Claim(claim.requests, (MatchAttribute("other.io/partition2"),))
    assert allocate([s], [other]) is None


def test_first_available_keeps_the_first_subrequest_that_completes() -> None:
    s = gpus(4)
    held = InUse({(D, "node", "gpu-1"), (D, "node", "gpu-2")})
    pair = Claim(
        (Request("gpus", first_available=(Sub("nvlink", 2), Sub("any", 2))),),
        (MatchAttribute(f"{D}/partition2", ("gpus/nvlink",)),),
    )
    res = allocate([s], [pair], held)
    assert res is not None and [r.request for r in res[0]] == ["gpus/any", "gpus/any"]
    assert devices(res) == ["gpu-0", "gpu-3"]
    res = allocate([s], [pair])
    assert res is not None and [r.request for r in res[0]] == ["gpus/nvlink", "gpus/nvlink"]
    # a constraint naming the parent request binds every subrequest
    strict = Claim(pair.requests, (MatchAttribute(f"{D}/partition2", ("gpus",)),))
    assert allocate([s], [strict], held) is None
    # a later request that cannot be met makes an earlier subrequest's choice go
    two = Claim(
        (
            Request("a", first_available=(Sub("big", 3), Sub("small", 1))),
            Request("b", exactly=Sub("b", 2)),
        )
    )
    res = allocate([gpus(3)], [two])
    assert res is not None and [r.request for r in res[0]] == ["a/small", "b", "b"]


def test_selectors_stand_in_for_cel() -> None:
    s = Slice(D, "node", (Device("t4", {"model": "T4"}), Device("a100", {"model": "A100"})))
    a100 = exactly(1, selector=lambda driver, d: lookup(d, driver, f"{D}/model") == "A100")
    assert devices(allocate([s], [a100])) == ["a100"]


def test_pools_newest_generation_complete_and_valid_only() -> None:
    old = Slice(D, "p", (Device("gpu-0"),), generation=1)
    new = Slice(D, "p", (Device("gpu-9"),), generation=2)
    assert gather_pools([old, new]) == [(new,)] and gather_pools([new, old]) == [(new,)]
    half = Slice(D, "q", (Device("gpu-0"),), count=2)
    assert gather_pools([half]) == []
    twice = Slice(D, "r", (Device("gpu-0"), Device("gpu-0")))
    assert gather_pools([twice]) == []
    b, a = Slice("b.io", "p", (Device("x"),)), Slice("a.io", "p", (Device("y"),))
    assert devices(allocate([b, a], [exactly(2)])) == ["y", "x"]


def shared(n: int, policy: RequestPolicy | None = None) -> Slice:
    caps = {"cores": Capacity(100, policy), "memory": Capacity(16 << 30)}
    return Slice(D, "node", tuple(Device(f"gpu-{i}", capacity=caps, multiple=True) for i in range(n)))


def test_consumable_capacity_shares_a_device_until_a_capacity_runs_out() -> None:
    s = shared(2)
    held = InUse()
    half = exactly(1, capacity={"cores": 50, "memory": 4 << 30})
    for want in ("gpu-0", "gpu-0", "gpu-1"):
        res = allocate([s], [half], held)
        assert devices(res) == [want]
        assert res is not None and res[0][0].shared and res[0][0].consumed == {f"{D}/cores": 50, f"{D}/memory": 4 << 30}
        commit(held, res)
    assert held.consumed[(D, "node", "gpu-0")] == {f"{D}/cores": 100, f"{D}/memory": 8 << 30}
    # no amount asked: all of each capacity (no policy), so only an untouched device fits
    assert allocate([s], [exactly(1)], held) is None
    # one claim may take the same multi-allocatable device twice
    res = allocate([shared(1)], [exactly(2, capacity={"cores": 30, "memory": 1 << 30})])
    assert devices(res) == ["gpu-0", "gpu-0"]


def test_request_policies_round_up_and_refuse() -> None:
    dev = Device(
        "g", capacity={"cores": Capacity(100, RequestPolicy(default=100, min=10, max=100, step=10))}, multiple=True
    )
    assert consumption(dev, D, {"cores": 25}) == {f"{D}/cores": 30}
    assert consumption(dev, D, {"cores": 1}) == {f"{D}/cores": 10}
    assert consumption(dev, D, {f"{D}/cores": 100}) == {f"{D}/cores": 100}
    assert consumption(dev, D, {"cores": 101}) is None
    assert consumption(dev, D, {}) == {f"{D}/cores": 100}
    assert consumption(dev, D, {"memory": 1}) is None
    valued = Device("g", capacity={"memory": Capacity(80, RequestPolicy(values=(10, 40, 80)))}, multiple=True)
    assert consumption(valued, D, {"memory": 11}) == {f"{D}/memory": 40}
    assert consumption(valued, D, {"memory": 81}) is None


NODE = st.lists(st.tuples(st.integers(0, 2), st.booleans()), min_size=1, max_size=7)


@settings(max_examples=300, deadline=None)
@given(NODE, st.integers(1, 4), st.booleans(), st.booleans())
def test_the_first_solution_is_the_first_valid_choice_in_device_order(
    node: list[tuple[int, bool]], count: int, constrained: bool, fallback: bool
) -> None:
    s = Slice(D, "n", tuple(Device(f"d{i}", {"p": p} if p else {}) for i, (p, _) in enumerate(node)))
    held = InUse({(D, "n", f"d{i}") for i, (_, busy) in enumerate(node) if busy})
    subs = (Sub("same", count), Sub("any", count)) if fallback else (Sub("same", count),)
    claim = Claim(
        (Request("r", first_available=subs),), (MatchAttribute(f"{D}/p", ("r/same",)),) if constrained else ()
    )

    def valid(choice: tuple[int, ...], sub: str) -> bool:
        if any(node[i][1] for i in choice):
            return False
        values = {node[i][0] for i in choice}
        return not (constrained and sub == "same") or (0 not in values and len(values) == 1)

    expected = None
    for sub in [x.name for x in subs]:
        expected = next((c for c in itertools.permutations(range(len(node)), count) if valid(c, sub)), None)
        if expected is not None:
            expected_sub = sub
            break
    res = allocate([s], [claim], held)
    if expected is None:
        assert res is None
    else:
        assert res is not None
        assert [r.device[2] for r in res[0]] == [f"d{i}" for i in expected]
        assert {r.request for r in res[0]} == {f"r/{expected_sub}"}
