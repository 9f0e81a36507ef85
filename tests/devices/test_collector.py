"""The usage collector on the simulated node: the fake NVML's process lists, a /proc tree with each
process's cgroup as containerd makes it, and store records as the daemon keeps them. Covers a host
process, a process that exits mid-collection, a container removed between collections, MIG devices,
a lost GPU, a bad annotation and a node without NVML."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from crihook.base import metrics
from crihook.base.allocation import DEVICE_ALLOCATED
from crihook.base.config import parse
from crihook.devices import usage
from crihook.devices.collector import UsageCollector, start_usage
from crihook.devices.drashares import SharesReader
from crihook.devices.nvml import Nvml
from crihook.dra.claims import Prepared, PreparedDevice
from crihook.dra.state import State

GiB = 1 << 30
CIDS = {"train": "1" * 64, "share": "2" * 64, "gone": "3" * 64}


@dataclass
class Pod:
    name: str
    namespace: str = "team"
    annotations: dict[str, str] = field(default_factory=dict)
    uid: str = ""


@dataclass
class Ctr:
    pod_id: str
    name: str = "main"
    state: str = "running"


@dataclass
class Store:
    pods: dict[str, Pod] = field(default_factory=dict)
    containers: dict[str, Ctr] = field(default_factory=dict)


def cgroup(cid: str, pod: str) -> str:
    """/proc/<pid>/cgroup of a container process with the systemd driver on cgroup v2."""
    return f"0::/kubepods.slice/kubepods-pod{pod}.slice/cri-containerd-{cid}.scope\n"


@pytest.fixture
def sim(fake_nvml, tmp_path: Path):
    fake = fake_nvml("dgx-h100")
    proc = tmp_path / "proc"
    gpus = fake.doc["gpus"]

    def procfile(pid: int, text: str) -> None:
        (proc / str(pid)).mkdir(parents=True, exist_ok=True)
        (proc / str(pid) / "cgroup").write_text(text)

    store = Store()
    whole = {"gpu": [{"minor": gpus[0]["minor"], "id": gpus[0]["uuid"], "resources": {"koordinator.sh/gpu-core": 100}}]}
    share = {
        "gpu": [
            {
                "minor": gpus[1]["minor"],
                "resources": {"koordinator.sh/gpu-core": 25, "koordinator.sh/gpu-memory": str(4 * GiB)},
            }
        ]
    }
    for name, alloc in (("train", whole), ("share", share), ("gone", whole)):
        store.pods[f"pod-{name}"] = Pod(name, annotations={DEVICE_ALLOCATED: json.dumps(alloc)})
        store.containers[CIDS[name]] = Ctr(f"pod-{name}")
    gpus[0]["processes"] = [{"pid": 10, "used_memory": 30 * GiB, "sm_util": 90}]
    gpus[1]["processes"] = [
        {"pid": 20, "used_memory": 5 * GiB, "sm_util": 20},  # above its 4 GiB
        {"pid": 21, "used_memory": GiB},  # a host process
        {"pid": 22, "used_memory": 2 * GiB},  # exits before /proc is read
    ]
    fake.write()
    procfile(10, cgroup(CIDS["train"], "a"))
    procfile(20, cgroup(CIDS["share"], "b"))
    procfile(21, "0::/system.slice/nvidia-persistenced.service\n")
    nvml = Nvml(str(fake.library), str(fake.sys_root))
    collector = UsageCollector(nvml, store, interval=10.0, proc_root=str(proc), state_dir=str(tmp_path))
    yield fake, collector, store, procfile, tmp_path
    nvml.close()


def series(metric: metrics.Gauge, pod: str, uuid: str) -> float | None:
    """The value of the container's series on the device with this UUID (whatever its gpu index)."""
    found = [v for k, v in dict(metric._values).items() if k[:3] == ("team", pod, "main") and k[4] == uuid]
    return found[0] if found else None


def others(uuid: str, owner: str) -> float:
    return sum(v for k, v in dict(metrics.USAGE_OTHERS._values).items() if k[1:] == (uuid, owner))


def test_collection_attributes_and_publishes(sim, caplog: pytest.LogCaptureFixture) -> None:
    fake, collector, _, _, state_dir = sim
    g0, g1 = (g["uuid"] for g in fake.doc["gpus"][:2])
    before, rounds = metrics.OVER_GRANT.value("team"), metrics.USAGE_SECONDS.count()
    with caplog.at_level(logging.WARNING, "crihook.usage"):
        collection = collector.collect_once()
    assert not collection.read.reason and len(collection.read.gpus) == 8
    assert series(metrics.USAGE_MEMORY, "train", g0) == 30 * GiB
    assert series(metrics.USAGE_SM, "train", g0) == 0.9
    # labelled as dcgm-exporter labels: gpu the NVML index, UUID the device's
    assert ("team", "train", "main", "0", g0) in dict(metrics.USAGE_MEMORY._values)
    assert ("team", "share", "main", "1", g1) in dict(metrics.GRANT_CORE._values)
    assert series(metrics.GRANT_CORE, "train", g0) == 1
    assert series(metrics.GRANT_MEMORY, "train", g0) == fake.doc["gpus"][0]["memory_total"]
    assert series(metrics.USAGE_MEMORY, "share", g1) == 5 * GiB
    assert series(metrics.GRANT_CORE, "share", g1) == 0.25
    assert series(metrics.GRANT_MEMORY, "share", g1) == 4 * GiB
    # granted, running nothing: used is 0, not absent, so used/granted is a query
    assert series(metrics.USAGE_MEMORY, "gone", g0) == 0
    assert series(metrics.USAGE_SM, "gone", g0) is None
    assert others(g1, usage.HOST) == GiB
    assert others(g1, usage.EXITED) == 2 * GiB
    # above its grant: counted and told once, naming pod, container, GPU, used and granted
    assert metrics.OVER_GRANT.value("team") == before + 1
    (told,) = [r for r in caplog.records if r.getMessage() == "container above its GPU memory grant"]
    assert (told.pod, told.container, told.gpu, told.used_bytes, told.granted_bytes) == (  # type: ignore[attr-defined]
        "team/share",
        "main",
        g1,
        5 * GiB,
        4 * GiB,
    )
    collector.collect_once()
    assert metrics.OVER_GRANT.value("team") == before + 1  # the same episode
    state = usage.decode(json.loads((state_dir / usage.STATE_FILE).read_text()))
    assert {(r.owner.pod, r.device) for r in state.rows if r.owner.kind == usage.CONTAINER} == {
        ("train", g0),
        ("share", g1),
        ("gone", g0),
    }
    assert metrics.USAGE_SECONDS.count() == rounds + 2
    assert "crihook_gpu_memory_used_bytes{" in metrics.REGISTRY.render().decode()


def test_a_container_removed_between_collections_leaves_no_series(sim) -> None:
    fake, collector, store, _, _ = sim
    g0 = fake.doc["gpus"][0]["uuid"]
    collector.collect_once()
    assert series(metrics.GRANT_CORE, "gone", g0) == 1
    del store.containers[CIDS["gone"]]
    del store.pods["pod-gone"]
    store.containers[CIDS["train"]].state = "exited"
    collector.collect_once()
    assert series(metrics.GRANT_CORE, "gone", g0) is None
    assert series(metrics.USAGE_MEMORY, "gone", g0) is None
    # an exited container's processes, should NVML still list them, are an unknown container's
    assert series(metrics.USAGE_MEMORY, "train", g0) is None
    assert others(g0, usage.UNKNOWN) == 30 * GiB


def test_processes_that_end_and_start_between_collections(sim) -> None:
    fake, collector, _, procfile, _ = sim
    g1 = fake.doc["gpus"][1]["uuid"]
    fake.doc["gpus"][1]["processes"] = [{"pid": 23, "used_memory": GiB}]
    fake.write()
    procfile(23, cgroup(CIDS["share"], "b"))
    collector.collect_once()
    assert series(metrics.USAGE_MEMORY, "share", g1) == GiB
    assert others(g1, usage.EXITED) == 0
    assert series(metrics.USAGE_SM, "share", g1) is None  # no samples for it


def test_mig_devices_and_a_lost_gpu(sim) -> None:
    fake, collector, _, procfile, _ = sim
    gpus = fake.doc["gpus"]
    gpus[3].update(mig_mode=1, mig_devices=["MIG-3a", "MIG-3b"])
    gpus[3]["processes"] = [{"pid": 30, "used_memory": 3 * GiB, "mig": 1, "sm_util": 50}]
    gpus[2].update(lost=True, processes=[{"pid": 31, "used_memory": GiB}])
    fake.write()
    procfile(30, cgroup(CIDS["train"], "a"))
    collection = collector.collect_once()
    assert gpus[2]["uuid"] not in {g.uuid for g in collection.read.gpus}  # left out, the others read
    assert len(collection.read.gpus) == 7
    assert series(metrics.USAGE_MEMORY, "train", "MIG-3b") == 3 * GiB
    assert series(metrics.USAGE_SM, "train", "MIG-3b") is None  # the driver samples none on MIG
    assert ("team", "train", "main", "3", "MIG-3b") in dict(metrics.USAGE_MEMORY._values)  # its GPU's index
    (row,) = [r for r in collection.rows if r.device == "MIG-3b"]
    assert row.gpu == gpus[3]["uuid"] and row.granted_memory is None


def test_a_bad_annotation_costs_only_that_containers_grant(sim, caplog: pytest.LogCaptureFixture) -> None:
    fake, collector, store, _, _ = sim
    g0 = fake.doc["gpus"][0]["uuid"]
    store.pods["pod-train"] = Pod("train", annotations={DEVICE_ALLOCATED: "{broken"})
    with caplog.at_level(logging.WARNING, "crihook.usage"):
        collector.collect_once()
        collector.collect_once()
    bad = [r for r in caplog.records if r.getMessage() == "GPU grant unreadable"]
    assert len(bad) == 1 and bad[0].pod == "team/train" and DEVICE_ALLOCATED in bad[0].error  # type: ignore[attr-defined]
    assert series(metrics.USAGE_MEMORY, "train", g0) == 30 * GiB
    assert series(metrics.GRANT_CORE, "train", g0) is None
    assert series(metrics.GRANT_CORE, "gone", g0) == 1
    del store.containers[CIDS["train"]]
    collector.collect_once()
    assert not collector._bad  # what it remembers of a container goes with the container


def test_a_node_without_nvml_reports_the_reason(tmp_path: Path) -> None:
    nvml = Nvml(str(tmp_path / "no-libnvidia-ml.so"))
    collector = UsageCollector(nvml, Store(), state_dir=str(tmp_path))
    collection = collector.collect_once()
    assert collection.rows == () and "can not be loaded" in collection.read.reason
    assert "can not be loaded" in usage.decode(json.loads((tmp_path / usage.STATE_FILE).read_text())).reason


def test_the_thread_collects_at_the_interval_and_stops(sim) -> None:
    fake, _, store, _, tmp_path = sim
    cfg = parse(
        {
            "node": {
                "nvml_library": str(fake.library),
                "sys_root": str(fake.sys_root),
                "proc_root": str(tmp_path / "proc"),
            },
            "usage": {"interval_seconds": 0.05},
        }
    )
    collector = start_usage(cfg, store, str(tmp_path))
    assert collector is not None
    try:
        deadline = 200
        while not (tmp_path / usage.STATE_FILE).exists() and deadline:
            deadline -= 1
            collector._stop.wait(0.05)
        assert (tmp_path / usage.STATE_FILE).exists()
    finally:
        collector.stop()
    # no kubelet in this /proc: its default root; the pods dir configured for the gpu hook wins
    assert collector.claims is not None and collector.claims.path == "/var/lib/kubelet/dra_manager_state"
    assert collector.shares is not None and collector.shares.directory == str(tmp_path / "dra")
    configured = start_usage(cfg, store, str(tmp_path), str(tmp_path / "kubelet" / "pods"))
    assert configured is not None
    configured.stop()
    assert configured.claims is not None and configured.claims.path == str(tmp_path / "kubelet/dra_manager_state")
    assert start_usage(parse({"usage": {"enabled": False}}), store, str(tmp_path)) is None


def dra_checkpoint(tmp: Path, gpu: dict[str, Any]) -> Path:
    """kubelet's DRA checkpoint: the pod `uid-dra` holds claim c-9 (team/dra-gpus), prepared by
    crihook's driver with the GPU."""
    state = {
        "kind": "DRACheckpoint",
        "apiVersion": "checkpoint.dra.kubelet.k8s.io/v1",
        "ClaimInfoStateList": [
            {
                "ClaimUID": "c-9",
                "ClaimName": "dra-gpus",
                "Namespace": "team",
                "PodUIDs": {"uid-dra": {}},
                "DriverState": {
                    "gpu.crihook.io": {
                        "Devices": [
                            {
                                "PoolName": "node",
                                "DeviceName": f"gpu-{gpu['minor']}",
                                "RequestNames": ["gpus"],
                                "CDIDeviceIDs": [f"gpu.crihook.io/claim=c-9-gpu-{gpu['minor']}"],
                            }
                        ]
                    }
                },
            }
        ],
    }
    checkpoint = tmp / "dra_manager_state"
    checkpoint.write_text(json.dumps({"Data": json.dumps(state), "Checksum": 1}))
    return checkpoint


def dra_container(sim: Any, used: int) -> tuple[str, dict[str, Any]]:
    """A container of the pod `uid-dra` using `used` bytes of the third GPU: its id and the GPU."""
    fake, _, store, procfile, _ = sim
    gpu = fake.doc["gpus"][2]
    cid = "4" * 64
    store.pods["pod-dra"] = Pod("dra", uid="uid-dra")
    store.containers[cid] = Ctr("pod-dra")
    gpu["processes"] = [{"pid": 30, "used_memory": used, "sm_util": 50}]
    fake.write()
    procfile(30, cgroup(cid, "d"))
    return cid, gpu


def test_gpus_that_came_through_a_dra_claim_are_shown_against_the_claim(sim, caplog: pytest.LogCaptureFixture) -> None:
    from crihook.devices.draclaims import ClaimsReader

    _, collector, _, _, tmp = sim
    cid, gpu = dra_container(sim, 6 * GiB)
    checkpoint = dra_checkpoint(tmp, gpu)
    collector.claims = ClaimsReader(str(checkpoint))
    rows = [u for u in collector.collect_once().rows if u.owner.container_id == cid]
    assert [(u.gpu, u.claim, u.used_memory, u.granted_core) for u in rows] == [
        (gpu["uuid"], "team/dra-gpus/gpus", 6 * GiB, None)
    ]
    assert dict(metrics.GRANT_CLAIM._values) == {("team", "dra", "main", "2", gpu["uuid"], "team/dra-gpus/gpus"): 1}
    written = usage.decode(json.loads((tmp / usage.STATE_FILE).read_text()))
    assert [u.claim for u in written.rows if u.owner.container_id == cid] == ["team/dra-gpus/gpus"]
    # an unreadable checkpoint: the claims are left out, said once, the rest goes on
    checkpoint.write_text("{")
    with caplog.at_level(logging.WARNING, logger="crihook.usage"):
        for _ in range(2):
            rows = [u for u in collector.collect_once().rows if u.owner.container_id == cid]
            assert [u.claim for u in rows] == [""]
    assert sum("DRA claims unreadable" in r.getMessage() for r in caplog.records) == 1


def test_a_claims_share_from_crihook_dras_checkpoint_is_its_grant(sim, caplog: pytest.LogCaptureFixture) -> None:
    """The driver's checkpoint file in the same state dir, as the driver writes it: the claim's
    share is the container's core and memory grant in the metrics and in `crihook top`'s file, and
    memory above it is counted; a file that can not be read leaves the claim without a share."""
    from crihook.devices.draclaims import ClaimsReader

    _, collector, _, _, tmp = sim
    cid, gpu = dra_container(sim, 9 * GiB)
    collector.claims = ClaimsReader(str(dra_checkpoint(tmp, gpu)))
    driver = State(tmp / "dra")
    device = PreparedDevice(("gpus",), "node", f"gpu-{gpu['minor']}", gpu["minor"], gpu["uuid"], 8 * GiB, 50)
    driver.put(Prepared("c-9", "team", "dra-gpus", (device,)))
    collector.shares = SharesReader(str(tmp / "dra"))
    with caplog.at_level(logging.WARNING, logger="crihook.usage"):
        (row,) = [u for u in collector.collect_once().rows if u.owner.container_id == cid]
    assert (row.claim, row.granted_core, row.granted_memory, row.over_grant) == (
        "team/dra-gpus/gpus",
        50,
        8 * GiB,
        True,
    )
    key = ("team", "dra", "main", "2", gpu["uuid"])
    assert metrics.GRANT_CORE._values[key] == 0.5 and metrics.GRANT_MEMORY._values[key] == 8 * GiB
    over = [r for r in caplog.records if r.getMessage() == "container above its GPU memory grant"]
    assert [r.pod for r in over if r.granted_bytes == 8 * GiB] == ["team/dra"]  # type: ignore[attr-defined]
    written = usage.decode(json.loads((tmp / usage.STATE_FILE).read_text()))
    (totals,) = [t for t in usage.per_container(written) if t.owner.container_id == cid]
    assert (totals.granted_core, totals.granted_memory, totals.claims) == (50, 8 * GiB, ("team/dra-gpus/gpus",))
    (tmp / "dra" / "c-9.json").write_text("{")
    with caplog.at_level(logging.WARNING, logger="crihook.usage"):
        for _ in range(2):
            (row,) = [u for u in collector.collect_once().rows if u.owner.container_id == cid]
            assert (row.claim, row.granted_core, row.granted_memory) == ("team/dra-gpus/gpus", None, None)
    assert sum("DRA claim shares unreadable" in r.getMessage() for r in caplog.records) == 1
