"""The store survives restarts, never trusts a damaged file, and reconciles against the runtime; a write
appends what changed to the journal, and a crash at any byte of it loses at most the write it cut."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import threading
from pathlib import Path

import pytest

from crihook.node import store as storemod
from crihook.node.container import container_info
from crihook.node.records import ContainerRecord, PodRecord
from crihook.node.store import Store
from crihook.node.storefile import StoreFileError, read_file, row


def pod(pid: str, **kw: object) -> PodRecord:
    return PodRecord(id=pid, name=f"name-{pid}", namespace="ns", uid=f"uid-{pid}", **kw)  # type: ignore[arg-type]


def ctr(cid: str, pid: str, **kw: object) -> ContainerRecord:
    return ContainerRecord(id=cid, pod_id=pid, name=f"c-{cid}", **kw)  # type: ignore[arg-type]


def test_round_trip(tmp_path: Path) -> None:
    s = Store(tmp_path)
    s.pods["p1"] = pod("p1", labels={"a": "b"}, hooks=[{"hook": "gpu", "result": "ok"}])
    s.containers["c1"] = ctr("c1", "p1", state="running")
    s.save()
    t = Store(tmp_path)
    assert t.load() == "ok"
    assert t.pods == s.pods and t.containers == s.containers
    assert (tmp_path / "store.json").stat().st_mode & 0o777 == 0o600


def every_file(directory: Path) -> bytes:
    return b"".join(p.read_bytes() for p in directory.iterdir() if p.is_file())


async def test_the_file_keeps_only_the_env_values_crihook_reads(tmp_path: Path) -> None:
    """A Secret's value in a container's environment never reaches the disk; the GPUs granted and
    HAMi-core's limits do."""
    s = Store(tmp_path)
    kept = {"NVIDIA_VISIBLE_DEVICES": "GPU-1", "CUDA_DEVICE_MEMORY_LIMIT_0": "1024m", "CUDA_DEVICE_SM_LIMIT": "50"}
    s.containers["c1"] = ctr("c1", "p1", envs={**kept, "DB_PASSWORD": "hunter2", "PATH": "/bin"})
    s.save()
    s.put_container(ctr("c2", "p1", envs={"API_TOKEN": "s3cret"}))  # a journal line
    await s.close()
    on_disk = every_file(tmp_path)
    assert b"hunter2" not in on_disk and b"s3cret" not in on_disk and b"DB_PASSWORD" not in on_disk
    assert s.containers["c1"].envs["DB_PASSWORD"] == "hunter2"  # memory keeps it for later stages' hooks
    t = Store(tmp_path)
    t.load()
    assert t.containers["c1"].envs == kept and t.containers["c2"].envs == {}


def test_missing_file_is_empty(tmp_path: Path) -> None:
    s = Store(tmp_path / "new")
    assert s.load() == "missing"
    assert s.pods == {} and s.containers == {}


@pytest.mark.parametrize("cut", [1, 10, 50, -1])
def test_truncated_file_is_detected_and_set_aside(tmp_path: Path, cut: int) -> None:
    s = Store(tmp_path)
    s.pods["p1"] = pod("p1")
    s.save()
    raw = (tmp_path / "store.json").read_bytes()
    (tmp_path / "store.json").write_bytes(raw[:cut])
    t = Store(tmp_path)
    assert t.load() == "corrupt"
    assert t.pods == {}
    assert not (tmp_path / "store.json").exists()
    assert list(tmp_path.glob("store.corrupt-*"))


def test_edited_body_fails_checksum(tmp_path: Path) -> None:
    s = Store(tmp_path)
    s.pods["p1"] = pod("p1")
    s.save()
    doc = json.loads((tmp_path / "store.json").read_text())
    doc["body"]["pods"][0]["name"] = "forged"
    (tmp_path / "store.json").write_text(json.dumps(doc))
    with pytest.raises(StoreFileError, match="checksum"):
        read_file(tmp_path / "store.json")
    assert Store(tmp_path).load() == "corrupt"


def test_reconcile_keeps_hook_records_drops_gone_adopts_new(tmp_path: Path) -> None:
    s = Store(tmp_path)
    s.pods = {"p1": pod("p1", hooks=[{"hook": "gpu"}]), "gone": pod("gone")}
    s.containers = {"c1": ctr("c1", "p1", hooks=[{"hook": "gpu"}]), "cgone": ctr("cgone", "gone")}
    stats = s.reconcile([pod("p1", state="notready"), pod("p2")], [ctr("c1", "p1", state="exited"), ctr("c2", "p2")])
    assert stats == {"pods": 2, "containers": 2, "dropped": 2, "adopted": 2}
    assert s.pods["p1"].hooks == [{"hook": "gpu"}] and s.pods["p1"].state == "notready"
    assert s.containers["c1"].hooks == [{"hook": "gpu"}] and s.containers["c1"].state == "exited"
    assert set(s.pods) == {"p1", "p2"} and set(s.containers) == {"c1", "c2"}
    assert Store(tmp_path).load() == "ok"  # reconcile persisted at once


async def test_changes_coalesce_into_one_write(tmp_path: Path) -> None:
    s = Store(tmp_path)
    for i in range(50):
        s.put_pod(pod(f"p{i}"))
    assert not (tmp_path / "store.json").exists()
    await s.close()
    t = Store(tmp_path)
    assert t.load() == "ok" and len(t.pods) == 50


async def test_remove_pod_removes_its_containers(tmp_path: Path) -> None:
    s = Store(tmp_path)
    s.put_pod(pod("p1"))
    s.put_container(ctr("c1", "p1"))
    s.put_container(ctr("c2", "p2"))
    assert s.remove_pod("p1") is not None
    assert set(s.containers) == {"c2"}
    await s.close()


async def test_removing_a_pod_the_store_never_saw_removes_its_containers_on_disk_too(tmp_path: Path) -> None:
    """A container can outlive the record of its pod (adopted from the runtime without it): removing
    the pod must write the container's removal, not only forget it in memory."""
    s = Store(tmp_path)
    s.put_container(ctr("c1", "gone"))
    await s.close()
    s = Store(tmp_path)
    assert s.load() == "ok" and set(s.containers) == {"c1"}
    assert s.remove_pod("gone") is None
    await s.close()
    t = Store(tmp_path)
    assert t.load() == "ok" and not t.containers


async def test_what_a_container_was_created_with_survives_restart_and_reconcile(tmp_path: Path) -> None:
    from crihook.hooks.base import LinuxResources
    from crihook.node.resources import resources_record

    res = LinuxResources(cpu_quota=50000, memory_limit_in_bytes=1 << 28, cpuset_cpus="0-3", unified={"k": "v"})
    store = Store(tmp_path)
    store.put_container(
        ContainerRecord(
            id="c1",
            pod_id="p1",
            name="main",
            envs={"A": "1", "NVIDIA_VISIBLE_DEVICES": "\udcff"},
            resources=resources_record(res),
        )
    )
    store.save()
    again = Store(tmp_path)
    assert again.load() == "ok"
    again.reconcile(
        [PodRecord(id="p1", name="p", namespace="ns", uid="u")], [ContainerRecord(id="c1", pod_id="p1", name="main")]
    )
    view = container_info(again.containers["c1"])
    # of the env, the file keeps what crihook reads (test_the_file_keeps_only_the_env_values_crihook_reads)
    assert view.envs == (("NVIDIA_VISIBLE_DEVICES", "\udcff"),) and view.resources == res


@pytest.mark.parametrize("resources", [{"cpu_quota": "many"}, {"nope": 1}, {"unified": 5}])
def test_stored_resources_that_crihook_did_not_write_are_ignored(resources: dict) -> None:

    rec = ContainerRecord(id="c", pod_id="p", name="m", resources=resources)
    assert container_info(rec).resources is None


def test_reconcile_takes_the_cgroup_parent_from_the_runtime_else_keeps_its_own(tmp_path: Path) -> None:
    s = Store(tmp_path)
    s.pods = {
        "p1": pod("p1", cgroup_parent="/kubepods/podu-1", runtime_handler="runc"),
        "p2": pod("p2", cgroup_parent="/kubepods/podu-2"),
    }
    live = [pod("p1"), pod("p2", cgroup_parent="/kubepods/burstable/podu-2", runtime_handler="nvidia"),
            pod("p3", cgroup_parent="/kubepods/podu-3")]  # fmt: skip
    s.reconcile(live, [])
    assert (s.pods["p1"].cgroup_parent, s.pods["p1"].runtime_handler) == ("/kubepods/podu-1", "runc")
    assert (s.pods["p2"].cgroup_parent, s.pods["p2"].runtime_handler) == ("/kubepods/burstable/podu-2", "nvidia")
    assert s.pods["p3"].cgroup_parent == "/kubepods/podu-3"  # adopted: the runtime's word only


# -- the journal -------------------------------------------------------------------------------------


async def settle(s: Store) -> None:
    """Wait for the store's pending write to be on disk."""
    await s.flushed()


async def journaled(tmp_path: Path) -> tuple[Store, list[bytes]]:
    """A store saved once, then changed in three writes: (the store, the journal after each write)."""
    s = Store(tmp_path)
    s.put_pod(pod("p1"))
    s.save()
    after = []
    for change in (
        lambda: s.put_container(ctr("c1", "p1", hooks=[{"hook": "gpu", "result": "ok"}])),
        lambda: (s.set_container_state("c1", "running"), s.put_pod(pod("p2"))),
        lambda: (s.remove_pod("p1"), s.put_container(ctr("c2", "p2"))),
    ):
        change()
        await settle(s)
        after.append(s.journal.read_bytes())
    return s, after


def aside(state_dir: Path) -> list[str]:
    return [name for name in os.listdir(state_dir) if name.startswith("store.journal.corrupt-")]


def state(s: Store) -> tuple[dict[str, PodRecord], dict[str, ContainerRecord]]:
    return s.pods, s.containers


async def test_a_write_appends_only_what_changed(tmp_path: Path) -> None:
    s = Store(tmp_path)
    for i in range(50):
        s.put_pod(pod(f"p{i}", annotations={"a": "x" * 200}))
    s.save()
    snapshot = s.path.read_bytes()
    s.set_pod_state("p7", "notready")
    await settle(s)
    assert s.path.read_bytes() == snapshot  # not rewritten
    line = s.journal.read_bytes()
    assert line.count(b"\n") == 1 and len(line) < len(snapshot) / 20
    t = Store(tmp_path)
    assert t.load() == "ok" and state(t) == state(s) and t.pods["p7"].state == "notready"
    assert read_file(s.path)["pods"][7]["state"] == "notready"  # what doctor and inspect read
    await s.close()


async def test_a_crash_at_any_byte_of_the_journal_loses_at_most_the_write_it_cut(tmp_path: Path) -> None:
    s, after = await journaled(tmp_path)
    journal = after[-1]
    lines = [0, *(len(j) for j in after)]  # the journal's length after each write
    states = []
    for n in range(len(after) + 1):  # the state after each write, as a reader sees it
        s.journal.write_bytes(journal[: lines[n]])
        t = Store(tmp_path)
        assert t.load() == "ok"
        states.append(state(t))
    assert states[-1] == state(s) and states[0] != states[1] != states[2] != states[3]
    for cut in range(len(journal) + 1):
        s.journal.write_bytes(journal[:cut])
        t = Store(tmp_path)
        assert t.load() == "ok", cut
        whole = sum(1 for end in lines[1:] if end <= cut)
        assert state(t) == states[whole], cut
        assert t._snapshot_due == (cut not in lines)  # never append after a torn line


async def test_a_damaged_journal_line_ends_what_is_applied_and_is_set_aside(tmp_path: Path) -> None:
    s, after = await journaled(tmp_path)
    journal = bytearray(after[-1])
    first = len(after[0])
    journal[first + 80] ^= 0x01  # inside the second line: its checksum fails
    s.journal.write_bytes(bytes(journal))
    t = Store(tmp_path)
    assert t.load() == "partial"
    assert set(t.pods) == {"p1"} and t.containers["c1"].state == "created"  # the first write only
    assert not t.journal.exists() and aside(tmp_path)
    t.save()  # start-up's reconcile writes a snapshot and a new journal
    assert t.journal.read_bytes() == b"" and Store(tmp_path).load() == "ok"


async def test_journal_lines_from_before_the_snapshot_are_skipped(tmp_path: Path) -> None:
    """A crash after a new snapshot's rename and before the journal was emptied leaves lines of the
    older generation beside it: the snapshot holds them already, and they must not undo a later change."""
    s, after = await journaled(tmp_path)
    s.remove_container("c2")
    s.save()
    s.journal.write_bytes(after[-1])
    t = Store(tmp_path)
    assert t.load() == "ok" and state(t) == state(s) and "c2" not in t.containers


async def test_a_version_1_file_is_read_and_rewritten_as_a_snapshot(tmp_path: Path) -> None:
    """What crihook before the journal wrote: an upgraded node keeps its records."""
    body = {
        "containers": [json.loads(row(ctr("c1", "p1", hooks=[{"hook": "gpu"}])))],
        "pods": [json.loads(row(pod("p1")))],
    }
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    checksum = "sha256:" + hashlib.sha256(canonical).hexdigest()
    (tmp_path / "store.json").write_bytes(
        b'{"version": 1, "checksum": "%s", "body": %s}' % (checksum.encode(), canonical)
    )
    s = Store(tmp_path)
    assert s.load() == "ok" and s.containers["c1"].hooks == [{"hook": "gpu"}]
    s.put_pod(pod("p2"))
    await settle(s)
    assert json.loads(s.path.read_bytes())["version"] == 2  # a snapshot, not a journal line beside version 1
    t = Store(tmp_path)
    assert t.load() == "ok" and state(t) == state(s)


async def test_the_journal_is_compacted_into_a_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(storemod, "COMPACT_FLOOR", 500)
    s = Store(tmp_path)
    s.save()
    sizes = []
    for i in range(60):
        s.put_pod(pod(f"p{i}"))
        await settle(s)
        sizes.append(s.journal.stat().st_size)
    assert max(sizes) <= storemod.COMPACT_RATIO * max(s.path.stat().st_size, 500) + 400
    assert s._generation >= 3 and sizes.count(0) == s._generation - 1  # each snapshot emptied it
    t = Store(tmp_path)
    assert t.load() == "ok" and state(t) == state(s)


async def test_a_failed_append_makes_the_next_write_a_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = Store(tmp_path)
    s.save()
    real_write = os.write

    def half(fd: int, data: bytes) -> int:
        real_write(fd, data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", half)
    s.put_pod(pod("p1"))
    await settle(s)
    assert s._dirty and s._snapshot_due
    monkeypatch.setattr(os, "write", real_write)
    s.put_pod(pod("p2"))
    await settle(s)
    assert s.journal.read_bytes() == b""  # the torn line went with the new snapshot
    t = Store(tmp_path)
    assert t.load() == "ok" and set(t.pods) == {"p1", "p2"}


async def test_a_writer_that_fails_unexpectedly_goes_on_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Not only an OSError: whatever fails a write is logged, and the writer thread lives on."""
    s = Store(tmp_path)
    s.save()
    real_append = storemod.storefile.append

    def broken(journal: Path, lines: object) -> None:
        raise ValueError("a bug")

    monkeypatch.setattr(storemod.storefile, "append", broken)
    s.put_pod(pod("p1"))
    await asyncio.wait_for(settle(s), 10)  # a dead writer would never answer
    assert s._snapshot_due and "store write failed" in caplog.text
    monkeypatch.setattr(storemod.storefile, "append", real_append)
    s.put_pod(pod("p2"))
    await settle(s)
    t = Store(tmp_path)
    assert t.load() == "ok" and set(t.pods) == {"p1", "p2"}
    await s.close()


async def test_a_damaged_snapshot_sets_its_journal_aside_too(tmp_path: Path) -> None:
    s, _ = await journaled(tmp_path)
    s.path.write_bytes(s.path.read_bytes()[:-5])
    t = Store(tmp_path)
    assert t.load() == "corrupt" and t.pods == {} and t.containers == {}
    assert not t.journal.exists() and aside(tmp_path)


async def test_a_journal_without_its_snapshot_is_never_applied(tmp_path: Path) -> None:
    s, _ = await journaled(tmp_path)
    s.path.unlink()
    t = Store(tmp_path)
    assert t.load() == "missing" and not t.journal.exists()
    t.save()  # generation 1 again: no line of the old journal may ever apply to it
    u = Store(tmp_path)
    assert u.load() == "ok" and u.pods == {} and u.containers == {}


async def test_changes_handed_over_while_a_write_is_under_way_go_in_one_append(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer thread takes every line queued during a write, and appends and fsyncs them once."""
    monkeypatch.setattr(storemod, "FLUSH_DELAY", 0.001)
    s = Store(tmp_path)
    s.save()
    release, syncs, real_fsync = threading.Event(), [], os.fsync

    def slow_fsync(fd: int) -> None:
        syncs.append(fd)
        release.wait(10)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    s.put_pod(pod("p1"))
    for _ in range(2000):  # the first line is being fsynced
        await asyncio.sleep(0.005)
        if syncs:
            break
    assert syncs
    for name in ("p2", "p3"):  # each handed over on its own: a line each
        s.put_pod(pod(name))
        await asyncio.sleep(0.02)
    release.set()
    await s.flushed()
    assert len(syncs) == 2
    assert len(s.journal.read_bytes().splitlines()) == 3
    t = Store(tmp_path)
    assert t.load() == "ok" and state(t) == state(s)
    await s.close()
