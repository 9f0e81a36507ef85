"""Concurrent binds through the extender with the scheduler restarted in the middle: no GPU is ever
handed out twice, and a restart rebuilds exactly the state it had. The 1,000-bind run with its
figures is bench/scheduler_binds.py; this is the same run, smaller."""

from __future__ import annotations

import logging

import pytest

from tests.support.bindrun import run


@pytest.fixture(autouse=True)
def quiet_binds(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="crihook")  # refused binds are expected here


def test_concurrent_binds_with_a_restart_never_share_a_gpu() -> None:
    r = run(pods=300, nodes=12, workers=16)
    assert r.errors == []
    assert r.bound + r.refused + len(r.lost_races) == r.pods
    assert r.bound > 100 and r.refused > 0  # the cluster filled up: binds competed for the last GPUs
    assert r.state_before_restart > 0 and r.rebuilt_same
    assert r.gpus_checked == 12 * 8
    assert r.over_committed == [] and r.shared_whole == [] and r.unannotated_bound == []
    assert r.held_mismatch == 0  # the allocator's view equals what the pods' annotations say
