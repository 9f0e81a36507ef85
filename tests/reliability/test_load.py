"""crihook under load and faults, against the session's real containerd: no call fails that containerd
would have answered, no container leaks or is lost, and crashes on either side are survived.

The driver is bench/load_cri.py (the long 64-caller runs use it too, figures in docs/reliability.md);
here it runs for a few seconds with fewer callers.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from crihook.node.storefile import read_file
from tests.support.containerd import Containerd
from tests.support.cri import Cri, container_config, pod_config
from tests.support.daemon import Crihook

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from load_cri import (  # bench/ is not a package: found through sys.path
    CALL_TIMEOUT,
    CallRecord,
    Load,
    Report,
    kill_containerd,
    kill_crihook,
    loaded_crihook,
    probe_version,
    rss_sampler,
    store_settled,
)

pytestmark = pytest.mark.containerd

# containerd's socket answers before its CRI plugin is ready again: until then every CRI call fails
# with a plain Go error, which gRPC sends as UNKNOWN (`checkInitialized` in containerd's
# pkg/cri/server/instrumented_service.go on 1.6, pkg/cri/instrument/instrumented_service.go on 1.7,
# internal/cri/instrument/instrumented_service.go on 2.x); crihook forwards it as it is.
NOT_INITIALIZED = ("UNKNOWN", "server is not initialized yet")
# A kill between the overlay snapshotter's rename of its "new-" directory to snapshots/<id> and the
# commit of the metadata transaction that allotted <id> leaves that directory behind; the restarted
# containerd allots the same id, and the rename fails "file exists" until its garbage collector
# removes the orphan (createSnapshot and Cleanup in containerd's snapshots/overlay/overlay.go).
ORPHAN_SNAPSHOT = re.compile(r"snapshots/\d+: file exists$")
RECONNECT_SLACK = 8.0  # gRPC clients back off up to a few seconds before dialling again
ORPHAN_CLEARED_WITHIN = 5.0  # seconds from the first refused removal to the last: the task is cleared


@pytest.fixture
def proxy(containerd: Containerd, tmp_path: Path) -> Iterator[Crihook]:
    with loaded_crihook(containerd, tmp_path) as daemon:
        yield daemon


def assert_accounted(report: Report) -> None:
    a = report.account
    assert a is not None
    assert a.pods_listed > 0 and a.containers_listed > 0  # the kept pods: the comparison is not vacuous
    assert a.leaked == [] and a.lost == [] and a.duplicated == []
    assert a.unstamped == []  # the hook ran on every container that exists
    assert a.store_mismatch == []  # crihook's store knows exactly what the runtime has


def test_concurrent_lifecycles_lose_nothing(proxy: Crihook, containerd_cri: Cri) -> None:
    # at least 6 s and 101 calls: a loaded machine may need longer for the calls than for the time
    load = Load(proxy.address, callers=16, seconds=6, min_calls=101)
    report = load.run(sample=rss_sampler(proxy))
    report.account = load.account(containerd_cri, store_settled(proxy))
    print("\n".join(report.lines()))
    assert len(report.calls) > 100
    assert report.errors() == []
    assert_accounted(report)
    first, last, _ = report.rss_figures()
    assert len(report.rss) > 10
    assert last - first < 16 << 20, "crihook memory grew under a steady load"


def containerd_restart_answer(c: CallRecord) -> bool:
    """An error containerd itself gives while it is killed and started again."""
    return (
        c.code == "UNAVAILABLE"
        or (c.code, c.detail) == NOT_INITIALIZED
        or (c.code == "UNKNOWN" and c.op == "RunPodSandbox" and bool(ORPHAN_SNAPSHOT.search(c.detail)))
    )


def test_containerd_killed_mid_load(proxy: Crihook, containerd: Containerd, containerd_cri: Cri) -> None:
    load = Load(proxy.address, callers=8, seconds=8)
    report = load.run([kill_containerd(containerd, proxy, at=2.0, down=2.0)], rss_sampler(proxy))
    report.account = load.account(containerd_cri, store_settled(proxy))
    print("\n".join(report.lines()))
    (window,) = report.windows
    assert str(window.notes["Version while down"]).startswith("UNAVAILABLE")  # not a hang to the deadline
    # gone (UNAVAILABLE), starting again (NOT_INITIALIZED), then tripping over what the kill left
    # (ORPHAN_SNAPSHOT): what containerd itself answers
    assert [c for c in report.errors() if not containerd_restart_answer(c)] == []
    assert [c for c in report.errors() if not report.in_windows(c, RECONNECT_SLACK)] == []
    assert all(c.seconds < CALL_TIMEOUT for c in report.errors())
    assert report.recovered(window) is not None  # crihook reconnected by itself
    assert_accounted(report)


def test_crihook_killed_mid_load(proxy: Crihook, containerd_cri: Cri) -> None:
    load = Load(proxy.address, callers=8, seconds=8)
    report = load.run([kill_crihook(proxy, at=2.0)], rss_sampler(proxy))
    report.account = load.account(containerd_cri, store_settled(proxy))
    print("\n".join(report.lines()))
    (window,) = report.windows
    assert str(window.notes["Version while down"]).startswith("UNAVAILABLE")
    # A start the kill cut off can leave containerd 1.6 with a task CRI lost track of; removals of
    # that pod are refused until crihook clears the task (docs/reliability.md), then succeed.
    orphaned = [c for c in report.errors() if "cannot delete running task" in c.detail]
    others = [c for c in report.errors() if c not in orphaned]
    assert {c.code for c in others} <= {"UNAVAILABLE"}
    assert [c for c in others if not report.in_windows(c, RECONNECT_SLACK)] == []
    assert {c.code for c in orphaned} <= {"FAILED_PRECONDITION"}
    if orphaned:
        assert max(c.started for c in orphaned) - min(c.started for c in orphaned) < ORPHAN_CLEARED_WITHIN
    assert report.recovered(window) is not None
    assert_accounted(report)  # the restarted daemon's store matches the runtime


def _truncated(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _bit_flipped(data: bytes) -> bytes:
    i = data.index(b'"name"') + 9  # inside a pod name: still JSON, checksum wrong
    return data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1 :]


def _edited_by_hand(data: bytes) -> bytes:
    doc = json.loads(data)
    doc["body"]["pods"] = []
    return json.dumps(doc).encode()


def _empty(data: bytes) -> bytes:
    return b""


def _zeros(data: bytes) -> bytes:
    return b"\0" * len(data)  # what a crash can leave after a metadata-only journal replay


@pytest.mark.parametrize("damage", [_truncated, _bit_flipped, _edited_by_hand, _empty, _zeros])
def test_damaged_state_file_is_ignored(proxy: Crihook, containerd_cri: Cri, damage: object) -> None:
    """A crash that leaves the store file damaged: crihook says so, sets it aside, rebuilds from the
    runtime, and serves; nothing from the damaged file is trusted."""
    with Cri(proxy.address) as client:
        pod = pod_config("survivor")
        pod_id = client.run_pod(pod)
        cid = client.create_container(pod_id, container_config("main", pod), pod)
    proxy.restart()  # its start-up writes what the journal held into the snapshot, the file damaged here
    store = store_settled(proxy)
    assert json.loads(store.read_text())["body"]["containers"][0]["hooks"], "the hook's record is in the file"
    proxy.stop(kill=True)
    store.write_bytes(damage(store.read_bytes()))  # type: ignore[operator]
    proxy.start()
    assert "store file ignored" in proxy.log_text()
    assert list(proxy.state_dir.glob("store.corrupt-*")), "the damaged file is kept aside for a post-mortem"
    body = read_file(store)
    assert [p["id"] for p in body["pods"]] == [pod_id]
    assert [c["id"] for c in body["containers"]] == [cid]
    assert body["containers"][0]["hooks"] == []  # adopted from the runtime, nothing taken from the file
    with Cri(proxy.address) as client:
        assert [c.id for c in client.list_containers(pod_id)] == [cid]
        client.start_container(cid)
    code, _ = probe_version(proxy.address)
    assert code == "OK"
