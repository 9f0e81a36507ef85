"""UpdateContainerResources applied the way containerd applies it (node/update.py): properties."""

from __future__ import annotations

from dataclasses import fields, replace

from hypothesis import given
from hypothesis import strategies as st

from crihook.hooks.base import LinuxResources
from crihook.node.update import UPDATED, apply_update, changed_fields, changed_keys

_INT = st.one_of(st.just(0), st.integers(min_value=-(2**40), max_value=2**40))
_TEXT = st.one_of(st.just(""), st.sampled_from(["0", "0-3", "1,3", "2"]))
_UNIFIED = st.dictionaries(st.sampled_from(["memory.high", "cpu.idle", "pids.max"]), st.sampled_from(["", "0", "max"]))
RESOURCES = st.builds(
    LinuxResources,
    **{f.name: (_TEXT if f.type == "str" else _INT) for f in fields(LinuxResources) if f.name != "unified"},
    unified=_UNIFIED,
)


@given(st.one_of(st.none(), RESOURCES), RESOURCES)
def test_set_fields_win_unset_fields_keep_oom_score_adj_stays(
    current: LinuxResources | None, update: LinuxResources
) -> None:
    after = apply_update(current, update)
    base = current or LinuxResources()
    assert after is not None
    for name in UPDATED:
        assert getattr(after, name) == (getattr(update, name) or getattr(base, name))
    assert after.oom_score_adj == base.oom_score_adj
    assert after.unified == {**base.unified, **update.unified}


@given(st.one_of(st.none(), RESOURCES), RESOURCES)
def test_an_update_applied_twice_is_applied_once(current: LinuxResources | None, update: LinuxResources) -> None:
    once = apply_update(current, update)
    assert apply_update(once, update) == once


@given(st.one_of(st.none(), RESOURCES))
def test_no_update_changes_nothing(current: LinuxResources | None) -> None:
    assert apply_update(current, None) == current


@given(RESOURCES, RESOURCES)
def test_the_changes_bring_the_view_to_what_the_hooks_left(before: LinuxResources, after: LinuxResources) -> None:
    """What the interceptor writes into an update, merged by the runtime onto the view the hooks
    were shown, gives what the hooks left (but for unified keys they dropped: an update can not
    delete one)."""
    fields_changed = changed_fields(before, after)
    sent = replace(LinuxResources(), **fields_changed, unified=changed_keys(before.unified, after.unified))
    merged = apply_update(before, sent)
    assert merged is not None
    for name in UPDATED:
        if getattr(after, name):  # a field set back to 0 or "" reads as unset in an update
            assert getattr(merged, name) == getattr(after, name)
    assert merged.unified == {**before.unified, **after.unified}
    assert changed_fields(before, before) == {} and changed_keys(before.unified, before.unified) == {}
