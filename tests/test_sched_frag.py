"""Fragmentation (FGD's measure) against a plain-Python reference, and the incremental forms the
scores use (one option per GPU slot, a set of slots) against recomputing the changed node."""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from crihook.scheduler.frag import Shape, Typical, frag_of, node_frag, option_stats, set_stats

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


def reference(typ: Typical, cpu: int, left: list[int], cpu_bound: bool = False) -> float:
    out = 0.0
    for c, p, n, w in zip(typ.cpu, typ.pct, typ.count, typ.weight, strict=True):
        room = sum(1 for x in left if x >= p)
        if p > 0 and room >= n and cpu >= c:
            unusable = sum(x for x in left if x < p)
            if cpu_bound and c > 0:  # only cpu // c more pods of this shape fit the CPU
                unusable = max(unusable, sum(left) - (cpu // c) * n * p)
            out += w * unusable
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
    for bound in (False, True):
        assert np.allclose(
            node_frag(typ, cpu_left, left)
            if not bound
            else frag_of(typ, option_stats(typ, cpu_left, left, 0, 0)[0], True),
            [reference(typ, int(c), list(lv), bound) for c, lv in zip(cpu_left, left, strict=True)],
        )
        _, a = option_stats(typ, cpu_left, left, cpu, pct)
        after = frag_of(typ, a, bound)
        for g in range(left.shape[1]):
            moved = left.copy()
            moved[:, g] -= pct
            want = [reference(typ, int(c), list(lv), bound) for c, lv in zip(cpu_left - cpu, moved, strict=True)]
            assert np.allclose(after[:, g], want)
        chosen = left >= pct
        after_set = frag_of(typ, set_stats(typ, cpu_left, left, cpu, pct, chosen)[1], bound)
        want = [
            reference(typ, int(c), list(lv), bound) for c, lv in zip(cpu_left - cpu, left - pct * chosen, strict=True)
        ]
        assert np.allclose(after_set, want)
