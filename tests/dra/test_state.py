"""The driver's checkpoint: a file per claim, round-tripped exactly; a damaged one set aside."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crihook.dra.claims import Prepared, PreparedDevice
from crihook.dra.state import State, StateError, decode, encode

_text = st.text(min_size=1, max_size=20)
_devices = st.lists(
    st.builds(
        PreparedDevice,
        st.lists(_text, min_size=1, max_size=3).map(tuple),
        _text,
        _text,
        st.integers(min_value=0, max_value=255),
        _text,
        st.integers(min_value=0, max_value=1 << 40),
        st.integers(min_value=0, max_value=100),
        _text,
    ),
    max_size=4,
).map(tuple)


@given(st.builds(Prepared, _text, _text, _text, _devices))
def test_a_claim_round_trips(p: Prepared) -> None:
    assert decode(encode(p), "x") == p


def test_damage_is_named() -> None:
    data = encode(Prepared("u", "ns", "c"))
    with pytest.raises(StateError, match="checksum mismatch"):
        decode(data.replace(b'\\"ns\\"', b'\\"nt\\"'), "f.json")
    with pytest.raises(StateError, match=r"f\.json: unreadable"):
        decode(data[:20], "f.json")


def test_a_damaged_file_is_set_aside_and_the_rest_read(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state = State(tmp_path)
    state.put(Prepared("a", "ns", "one"))
    state.put(Prepared("b", "ns", "two"))
    (tmp_path / "b.json").write_bytes(b"{}")
    again = State(tmp_path)
    with caplog.at_level(logging.WARNING):
        again.load()
    assert set(again.claims) == {"a"} and (tmp_path / "b.bad").exists()
    assert "set aside" in caplog.text
    again.drop("a")
    assert not (tmp_path / "a.json").exists() and again.claims == {}
