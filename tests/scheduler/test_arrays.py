"""same_rows: rows grouped as np.unique(axis=0) groups them, by one-column sorts."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from crihook.scheduler.arrays import same_rows


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 40), min_size=6, max_size=6), max_size=30), st.integers(1, 8))
def test_same_rows_groups_rows_as_unique_does(rows: list[list[int]], width: int) -> None:
    a = np.array(rows, np.int64).reshape(-1, 6)[:, :width]
    first, inverse = same_rows(a)
    assert (a[first][inverse] == a).all()  # each row is the row it is grouped with
    assert len(first) == len(np.unique(a, axis=0))  # and as many groups as distinct rows


@given(
    st.lists(
        st.tuples(st.sampled_from([1, 64_000, 96_000]), st.sampled_from([1, 1 << 40, 3 << 38]), st.integers(0, 16)),
        max_size=40,
    )
)
def test_first_is_where_each_row_first_shows(rows: list[tuple[int, int, int]]) -> None:
    """node_shapes meets the kinds of node in the order their first rows show, from `first`; values
    as large as a node's memory in bytes make the code renumber before it overflows."""
    a = np.array(rows, np.int64).reshape(-1, 3)
    assert sorted(same_rows(a)[0].tolist()) == sorted(np.unique(a, axis=0, return_index=True)[1].tolist())
