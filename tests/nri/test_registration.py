"""When the plugin gives a connection up because the runtime did not take it (nri/registration.py):
every outcome of the Synchronize answer, the proof a call gives, and a container created without one."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crihook.base.metrics import NRI_UNREGISTERED
from crihook.nri.registration import GRACE, Registration

NOW = 1_700_000_000_000_000_000


def registration() -> Registration:
    return Registration(request_timeout=2.0, clock=lambda: NOW)


def test_an_error_answer_gives_the_connection_up_at_once() -> None:
    before = NRI_UNREGISTERED.value("sync_failed")
    reg = registration()
    reg.synchronize_answered("DEADLINE_EXCEEDED: no answer within 1.80 s", 1.8)
    assert reg.gone.is_set() and reg.dropped is not None and "no answer within 1.80 s" in reg.dropped
    assert NRI_UNREGISTERED.value("sync_failed") == before + 1
    assert reg.unproven_since() is None


def test_a_late_answer_gives_the_connection_up_at_once() -> None:
    before = NRI_UNREGISTERED.value("sync_late")
    reg = registration()
    reg.synchronize_answered(None, 2.5)
    assert reg.gone.is_set() and reg.dropped is not None and "2.50 s, past the runtime's 2 s" in reg.dropped
    assert NRI_UNREGISTERED.value("sync_late") == before + 1


def test_an_answer_in_time_waits_for_proof_and_a_call_is_proof() -> None:
    reg = registration()
    reg.call_received()  # Configure, Synchronize: before the answer, no proof
    reg.synchronize_answered(None, 0.3)
    assert not reg.gone.is_set()
    assert reg.unproven_since() == NOW + int(GRACE * 1e9)
    reg.call_received()
    assert reg.proven and reg.unproven_since() is None
    reg.created_without_a_call(["abc"])  # too late to count: a call came
    assert not reg.gone.is_set()


def test_a_container_created_without_a_call_gives_the_connection_up() -> None:
    before = NRI_UNREGISTERED.value("unproven")
    reg = registration()
    reg.synchronize_answered(None, 0.3)
    reg.created_without_a_call([])
    assert not reg.gone.is_set()
    reg.created_without_a_call(["0123456789abcdef", "fedcba9876543210"])
    assert reg.gone.is_set() and reg.dropped is not None and "0123456789abc, fedcba9876543" in reg.dropped
    reg.created_without_a_call(["again"])  # counted once
    assert NRI_UNREGISTERED.value("unproven") == before + 1


def test_nothing_to_prove_before_the_synchronize() -> None:
    reg = registration()
    assert reg.unproven_since() is None
    reg.created_without_a_call(["abc"])
    assert not reg.gone.is_set()


@pytest.mark.parametrize("seconds", [0.0, 1.999, 2.0])
def test_an_answer_within_the_timeout_is_taken(seconds: float) -> None:
    reg = registration()
    reg.synchronize_answered(None, seconds)
    assert reg.dropped is None and reg.synchronized_at == NOW


@given(
    error=st.one_of(st.none(), st.text(min_size=1)),
    seconds=st.floats(min_value=0, max_value=10),
    calls=st.booleans(),
    created=st.lists(st.text(min_size=1), max_size=3),
)
def test_given_up_exactly_when_the_runtime_showed_it_does_not_hold_the_plugin(
    error: str | None, seconds: float, calls: bool, created: list[str]
) -> None:
    reg = registration()
    reg.synchronize_answered(error, seconds)
    if calls:
        reg.call_received()
    reg.created_without_a_call(created)
    shown = error is not None or seconds > 2.0 or (not calls and bool(created))
    assert reg.gone.is_set() == shown == (reg.dropped is not None)
