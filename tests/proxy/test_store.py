"""The store survives restarts, never trusts a damaged file, and reconciles against the runtime."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from crihook.proxy.store import ContainerRecord, PodRecord, Store, StoreFileError, read_file, sandbox_cgroup_parent


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


async def test_what_a_container_was_created_with_survives_restart_and_reconcile(tmp_path: Path) -> None:
    from crihook.hooks.base import LinuxResources
    from crihook.hooks.criview import resources_record

    res = LinuxResources(cpu_quota=50000, memory_limit_in_bytes=1 << 28, cpuset_cpus="0-3", unified={"k": "v"})
    store = Store(tmp_path)
    store.put_container(
        ContainerRecord(
            id="c1", pod_id="p1", name="main", envs={"A": "1", "RAW": "\udcff"}, resources=resources_record(res)
        )
    )
    store.save()
    again = Store(tmp_path)
    assert again.load() == "ok"
    again.reconcile(
        [PodRecord(id="p1", name="p", namespace="ns", uid="u")], [ContainerRecord(id="c1", pod_id="p1", name="main")]
    )
    view = again.containers["c1"].view()
    assert view.envs == (("A", "1"), ("RAW", "\udcff")) and view.resources == res


@pytest.mark.parametrize("resources", [{"cpu_quota": "many"}, {"nope": 1}, {"unified": 5}])
def test_stored_resources_that_crihook_did_not_write_are_ignored(resources: dict) -> None:

    rec = ContainerRecord(id="c", pod_id="p", name="m", resources=resources)
    assert rec.view().resources is None


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


@pytest.mark.parametrize(
    ("info", "parent"),
    [
        # containerd 1.6/1.7 and 2.x: SandboxInfo as JSON, the PodSandboxConfig under "config"
        ({"info": json.dumps({"pid": 7, "config": {"linux": {"cgroup_parent": "/kubepods/podu"}}})}, "/kubepods/podu"),
        ({"info": json.dumps({"config": {"metadata": {"name": "x"}}})}, ""),
        ({"info": json.dumps({"config": {"linux": {"cgroup_parent": 5}}})}, ""),
        ({"info": "not json"}, ""),
        ({"info": "[1]"}, ""),
        ({}, ""),
    ],
)
def test_sandbox_cgroup_parent(info: dict[str, str], parent: str) -> None:
    assert sandbox_cgroup_parent(info) == parent
