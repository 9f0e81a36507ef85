"""The device reporter through the real `kubernetes` client against the fake API server, over the
fake NVML library: what it writes, that it writes nothing when nothing changed, conflicts, an API
server that is away, the CRD schema, and `crihook report --once`."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from crihook import cli
from crihook.base import config as cfg
from crihook.base.allocation import MIG_ENABLED, MIG_MODE_LABEL
from crihook.devices import partitions, report
from crihook.devices import reporter as reporter_module
from crihook.devices.nvml import GpuIndex, Nvml
from crihook.devices.reporter import Reporter, ReportError
from tests.support.fakekube import FakeKube
from tests.support.gpu_fixtures import Entry, write_checkpoint

ROOT = Path(__file__).resolve().parents[2]
NODE = "gpu-node-1"
GPU_CORE, GPU_MEM, GPU_RATIO, GPU_SHARED = (
    "koordinator.sh/gpu-core",
    "koordinator.sh/gpu-memory",
    "koordinator.sh/gpu-memory-ratio",
    "koordinator.sh/gpu.shared",
)


def crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load((ROOT / "deploy" / "crd" / "devices.yaml").read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def pruned(obj: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Fields the API server would drop when storing `obj` under `schema` (structural pruning)."""
    if schema.get("x-kubernetes-preserve-unknown-fields") and not schema.get("properties"):
        return []
    out = []
    if isinstance(obj, dict) and path != ".metadata":
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for k, v in obj.items():
            if props is not None and k in props:
                out += pruned(v, props[k], f"{path}.{k}")
            elif isinstance(extra, dict):
                out += pruned(v, extra, f"{path}.{k}")
            elif not schema.get("x-kubernetes-preserve-unknown-fields"):
                out.append(f"{path}.{k}")
    elif isinstance(obj, list) and "items" in schema:
        for i, v in enumerate(obj):
            out += pruned(v, schema["items"], f"{path}[{i}]")
    return out


def check_against_crd(obj: dict[str, Any]) -> None:
    schema = crd_schema()
    jsonschema.validate(obj, schema)
    assert pruned(obj, schema) == []


@pytest.fixture
def kube():
    with FakeKube() as k:
        k.create(
            "nodes",
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": NODE, "labels": {"kubernetes.io/hostname": NODE}},
                "status": {"capacity": {"cpu": "64"}, "allocatable": {"cpu": "63"}},
            },
        )
        yield k


@pytest.fixture
def setup(fake_nvml, kube: FakeKube, tmp_path: Path):
    """`setup("dgx-h100", **reporter_options)` -> (fake, reporter); NVML closed afterwards."""
    made: list[Reporter] = []

    def make(topology: str, partition_table: str = "", library: str | None = None, interval: float = 60.0):
        fake = fake_nvml(topology)
        conf = cfg.Config(
            node=cfg.NodeConfig(
                name=NODE,
                sys_root=str(fake.sys_root),
                kubelet_checkpoint=str(tmp_path / "kubelet_internal_checkpoint"),
                nvml_library=str(fake.library) if library is None else library,
            ),
            reporter=cfg.ReporterConfig(
                kubeconfig="unused", interval_seconds=interval, partition_table=partition_table
            ),
        )
        r = Reporter(conf, kube.api_client(), rdma_links=dict)
        made.append(r)
        return fake, r

    yield make
    for r in made:
        r.stop()
        r.nvml.close()


def writes(kube: FakeKube, since: int) -> list[str]:
    return [f"{r.method} {r.path}" for r in kube.requests[since:] if r.method != "GET"]


def test_first_round_publishes_device_labels_and_resources(setup, kube: FakeKube) -> None:
    fake, r = setup("dgx-h100")
    done = r.run_once()
    assert done.writes == ["Device create", "Device status", "Node labels", "Node status"]
    dev = kube.get("devices", NODE)
    node = kube.get("nodes", NODE)
    check_against_crd(dev)
    doc = fake.doc
    gpus = [d for d in dev["spec"]["devices"] if d["type"] == "gpu"]
    assert [(d["id"], d["minor"]) for d in gpus] == [(g["uuid"], g["minor"]) for g in doc["gpus"]]
    for d, g in zip(gpus, doc["gpus"], strict=True):
        assert d["health"] is True
        assert d["resources"][GPU_CORE] == "100" and d["resources"][GPU_RATIO] == "100"
        assert report.quantity.to_int(d["resources"][GPU_MEM]) == g["memory_total"]
        assert d["topology"]["busID"] == g["pci_bus_id"]
        assert d["topology"]["nodeID"] == g["numa_node"] == d["topology"]["socketID"]
        assert d["topology"]["pcieID"].startswith("0000:")
    meta = dev["metadata"]
    assert meta["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": node["metadata"]["uid"]}
    ]
    labels = {report.LABEL_VENDOR: "nvidia", report.LABEL_MODEL: "H100-80GB-HBM3", report.LABEL_DRIVER: "550.54.15"}
    assert {k: meta["labels"][k] for k in labels} == labels
    assert {k: node["metadata"]["labels"][k] for k in labels} == labels
    table = json.loads(meta["annotations"][partitions.ANNOTATION])
    assert sorted(table, key=int) == ["1", "2", "4", "8"]
    assert [p["minors"] for p in table["4"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    topo = json.loads(meta["annotations"][report.TOPOLOGY_ANNOTATION])
    assert topo["minors"] == list(range(8)) and topo["nvswitch"] is True
    assert topo["nvlinks"][0] == [0] + [18] * 7
    assert topo["pcie"] == doc["pcie_levels"]
    assert report.CHECKPOINT_ANNOTATION not in meta["annotations"]
    assert dev["status"] == {
        "gpuCount": 8,
        "healthyGPUCount": 8,
        "migGPUCount": 0,
        "gpuModel": "NVIDIA H100 80GB HBM3",
        "rdmaCount": 0,
    }
    memory = sum(g["memory_total"] for g in doc["gpus"])
    for section in ("capacity", "allocatable"):
        res = node["status"][section]
        assert (res[GPU_CORE], res[GPU_RATIO], res[GPU_SHARED]) == ("800", "800", "800")
        assert int(res[GPU_MEM]) == memory
        assert res["nvidia.com/gpu"] == "8"  # no device plugin: whole GPUs are ours to publish
        assert "koordinator.sh/rdma" not in res  # zero and never listed: left out
    assert node["status"]["capacity"]["cpu"] == "64"  # kubelet's resources untouched


def test_no_change_means_no_writes(setup, kube: FakeKube) -> None:
    _, r = setup("dgx1-v100")
    r.run_once()
    since = len(kube.requests)
    for _ in range(3):
        assert r.run_once().writes == []
    assert writes(kube, since) == []
    assert {q.method for q in kube.requests[since:]} == {"GET"}


def test_health_change_updates_device_status_and_capacity_only(setup, kube: FakeKube) -> None:
    fake, r = setup("pcie-l40s")
    r.run_once()
    fake.doc["gpus"][1]["row_remap_failure"] = True
    fake.write()
    fake.reload()
    since = len(kube.requests)
    assert r.run_once().writes == ["Device", "Device status", "Node status"]
    assert [w.split()[0] for w in writes(kube, since)] == ["PUT", "PUT", "PATCH"]
    dev = kube.get("devices", NODE)
    bad = [d["minor"] for d in dev["spec"]["devices"] if not d["health"]]
    assert bad == [fake.doc["gpus"][1]["minor"]]
    assert dev["status"]["healthyGPUCount"] == 3
    node = kube.get("nodes", NODE)
    assert node["status"]["allocatable"][GPU_CORE] == "300"
    assert int(node["status"]["allocatable"][GPU_MEM]) == 3 * fake.doc["gpus"][0]["memory_total"]
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "3"
    assert report.partitions.ANNOTATION not in dev["metadata"]["annotations"]  # PCIe L40S: no table


def test_conflict_is_retried_with_a_fresh_read(setup, kube: FakeKube) -> None:
    fake, r = setup("dgx-h100")
    r.run_once()
    fake.doc["gpus"][0]["lost"] = True
    fake.write()
    fake.reload()
    kube.fail_next(2, 409, method="PUT", path="/devices/")
    since = len(kube.requests)
    assert "Device" in r.run_once().writes
    puts = [w for w in writes(kube, since) if w.startswith("PUT") and w.endswith(f"/devices/{NODE}")]
    assert len(puts) == 3  # two conflicts, then the write
    assert not kube.get("devices", NODE)["spec"]["devices"][0]["health"]


def test_real_conflict_with_another_writer(setup, kube: FakeKube, monkeypatch: pytest.MonkeyPatch) -> None:
    """Someone edits the Device between our read and our write: the write is refused on the stale
    resourceVersion, we read again and write over their version, keeping their label."""
    fake, r = setup("pcie-l40s")
    r.run_once()
    fake.doc["gpus"][0]["lost"] = True
    fake.write()
    fake.reload()
    real = r._get_device
    calls = []

    def racing_get():
        got = real()
        if not calls:
            other = kube.get("devices", NODE)
            other["metadata"].setdefault("labels", {})["team"] = "ml"
            kube.put("devices", other)
        calls.append(got)
        return got

    monkeypatch.setattr(r, "_get_device", racing_get)
    r.run_once()
    dev = kube.get("devices", NODE)
    assert len(calls) == 2
    assert dev["metadata"]["labels"]["team"] == "ml"
    health = {d["id"]: d["health"] for d in dev["spec"]["devices"]}
    assert health[fake.doc["gpus"][0]["uuid"]] is False


def test_endless_conflicts_end_the_round(setup, kube: FakeKube) -> None:
    fake, r = setup("pcie-l40s")
    r.run_once()
    fake.doc["gpus"][0]["lost"] = True
    fake.write()
    fake.reload()
    kube.fail_next(10, 409, method="PUT")
    with pytest.raises(ReportError, match="conflicting"):
        r.run_once()


def test_api_errors_end_the_round_with_the_reason(setup, kube: FakeKube) -> None:
    _, r = setup("pcie-l40s")
    kube.fail_next(1, 500, method="GET", path="/nodes/")
    with pytest.raises(ReportError, match=r"read Node.*HTTP 500"):
        r.run_once()
    kube.fail_next(1, 403, method="POST")
    with pytest.raises(ReportError, match=r"create Device.*403"):
        r.run_once()
    assert r.run_once().writes  # then it goes through


def test_api_server_away(setup, kube: FakeKube) -> None:
    _, r = setup("pcie-l40s")
    kube.stop()
    t0 = time.monotonic()
    with pytest.raises(ReportError, match="read Node"):
        r.run_once()
    assert time.monotonic() - t0 < 30


def test_api_server_away_is_said_once_not_with_urllib3_retries(
    kube: FakeKube, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The client the reporter builds from its kubeconfig fails the round at once; the loop's line is
    the only one (urllib3 retried three times by default, with a "Retrying" warning each)."""
    from kubernetes import client

    api = client.CoreV1Api(reporter_module.api_client_from(str(kube.write_kubeconfig(tmp_path / "kubeconfig"))))
    kube.stop()
    caplog.set_level("DEBUG")
    with pytest.raises(Exception, match="Connection refused"):
        api.read_node(NODE)
    assert [r.getMessage() for r in caplog.records if "Retrying" in r.getMessage()] == []


def test_loop_backs_off_and_recovers(setup, kube: FakeKube) -> None:
    _, r = setup("pcie-l40s", interval=0.2)
    kube.fail_next(3, 503)
    r.start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            kube.get("devices", NODE)
            break
        except Exception:
            time.sleep(0.05)
    r.stop()
    assert kube.get("devices", NODE)["status"]["gpuCount"] == 4
    assert r.failures == 0
    assert r._thread is None


def test_stop_returns_promptly_while_waiting(setup) -> None:
    _, r = setup("pcie-l40s")
    r.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    r.stop()
    assert time.monotonic() - t0 < 5


def test_plugin_pods_are_reported_with_minors(setup, kube: FakeKube, tmp_path: Path) -> None:
    fake, r = setup("pcie-l40s")
    gpus = fake.doc["gpus"]
    write_checkpoint(
        Path(r.config.node.kubelet_checkpoint),
        [
            Entry("pod-b", "main", [gpus[0]["uuid"], gpus[3]["uuid"] + "::2"]),
            Entry("pod-a", "train", ["1"]),  # a plugin using NVML indices
            Entry("pod-c", "nic", ["0000:09:00.0"], resource="rdma/hca"),  # not a GPU
        ],
    )
    r.run_once()
    held = json.loads(kube.get("devices", NODE)["metadata"]["annotations"][report.CHECKPOINT_ANNOTATION])
    assert [(h["podUID"], h["minors"]) for h in held] == [
        ("pod-a", [gpus[1]["minor"]]),
        ("pod-b", sorted([gpus[0]["minor"], gpus[3]["minor"]])),
    ]
    assert held[1]["deviceIDs"] == [gpus[0]["uuid"], gpus[3]["uuid"] + "::2"]
    # the pods went; the plugin stays registered (so nvidia.com/gpu stays kubelet's)
    write_checkpoint(Path(r.config.node.kubelet_checkpoint), [], registered={"nvidia.com/gpu": ["0", "1", "2", "3"]})
    assert r.run_once().writes == ["Device"]
    assert report.CHECKPOINT_ANNOTATION not in kube.get("devices", NODE)["metadata"]["annotations"]


def test_mig_gpus_are_not_given_whole_and_their_holders_are_counted(
    setup, kube: FakeKube, caplog: pytest.LogCaptureFixture
) -> None:
    """A GPU in MIG mode is published as not healthy (CUDA runs only in its MIG devices, which are
    the device plugin's), and pods holding its MIG devices, named by MIG UUID or by `<GPU>:<slot>`,
    are listed against its minor."""
    fake, r = setup("pcie-l40s")
    gpus = fake.doc["gpus"]
    mig = "MIG-5d2f0c3e-7a41-5b6e-9f0a-3c1d2e4f5a6b"
    gpus[2] |= {"mig_mode": 1, "mig_devices": [None, mig]}
    fake.write()
    write_checkpoint(
        Path(r.config.node.kubelet_checkpoint),
        [
            Entry("pod-m", "main", [mig], resource="nvidia.com/mig-1g.10gb"),
            Entry("pod-i", "main", ["2:1::3"], resource="nvidia.com/mig-1g.10gb"),  # index strategy, a replica
            Entry("pod-x", "main", ["MIG-not-on-this-node"], resource="nvidia.com/mig-1g.10gb"),
        ],
    )
    with caplog.at_level("WARNING", logger="crihook.devices.reporter"):
        r.run_once()
        r.run_once()
    dev = kube.get("devices", NODE)
    check_against_crd(dev)
    assert [d["minor"] for d in dev["spec"]["devices"] if not d["health"]] == [gpus[2]["minor"]]
    # the reason, for the extender's message
    assert [d["minor"] for d in dev["spec"]["devices"] if d.get("labels") == {MIG_MODE_LABEL: MIG_ENABLED}] == [
        gpus[2]["minor"]
    ]
    assert (dev["status"]["healthyGPUCount"], dev["status"]["migGPUCount"]) == (3, 1)
    res = kube.get("nodes", NODE)["status"]["allocatable"]
    assert (res[GPU_CORE], res["nvidia.com/gpu"]) == ("300", "3")
    held = json.loads(dev["metadata"]["annotations"][report.CHECKPOINT_ANNOTATION])
    minor = gpus[2]["minor"]
    assert [(h["podUID"], h["minors"]) for h in held] == [("pod-i", [minor]), ("pod-m", [minor]), ("pod-x", [])]
    said = [m.getMessage() for m in caplog.records if "MIG mode" in m.getMessage()]
    assert len(said) == 1 and gpus[2]["uuid"] in said[0]
    # MIG mode off again (the MIG devices go with it): the GPU is whole again
    gpus[2] |= {"mig_mode": 0}
    fake.write()
    fake.reload()
    r.run_once()
    dev = kube.get("devices", NODE)
    assert all(d["health"] for d in dev["spec"]["devices"]) and dev["status"]["migGPUCount"] == 0
    assert not any("labels" in d for d in dev["spec"]["devices"])


def test_what_others_wrote_into_device_entries_is_kept(setup, kube: FakeKube) -> None:
    """Fields of a device entry the reporter does not write (Koordinator's conditions) and labels
    that are not ours stay, on the entry of the same device; ours come and go with what they say."""
    fake, r = setup("pcie-l40s")
    gpu = fake.doc["gpus"][1]

    def entry_of(dev: dict[str, Any]) -> dict[str, Any]:
        return next(d for d in dev["spec"]["devices"] if d["minor"] == gpu["minor"])

    r.run_once()
    dev = kube.get("devices", NODE)
    condition = {"type": "Healthy", "status": "True", "reason": "Checked", "lastTransitionTime": "2026-11-01T00:00:00Z"}
    entry_of(dev).update(conditions=[condition], labels={"team": "ml"}, moduleID=7)
    ours = next(d for d in dev["spec"]["devices"] if d["minor"] != gpu["minor"])
    ours["vfGroups"] = [{"vfs": [{"minor": 0}]}]  # a field of ours, not written for a GPU: not kept
    kube.put("devices", dev)
    assert r.run_once().writes == ["Device"]
    dev = kube.get("devices", NODE)
    assert not any("vfGroups" in d for d in dev["spec"]["devices"] if d["type"] == "gpu")
    kept = entry_of(dev)
    assert (kept["conditions"], kept["labels"], kept["moduleID"]) == ([condition], {"team": "ml"}, 7)
    assert r.run_once().writes == []  # kept, so nothing to write again
    gpu |= {"mig_mode": 1, "mig_devices": []}
    fake.write()
    fake.reload()
    r.run_once()
    dev = kube.get("devices", NODE)
    check_against_crd(dev)
    assert entry_of(dev)["labels"] == {"team": "ml", MIG_MODE_LABEL: MIG_ENABLED}
    gpu |= {"mig_mode": 0}
    fake.write()
    fake.reload()
    r.run_once()
    assert entry_of(kube.get("devices", NODE))["labels"] == {"team": "ml"}  # ours went, theirs stayed
    gpu["uuid"] = "GPU-00000000" + gpu["uuid"][12:]  # another GPU at that minor: it starts bare
    fake.write()
    fake.reload()
    r.run_once()
    entry = entry_of(kube.get("devices", NODE))
    assert entry["id"] == gpu["uuid"] and not {"conditions", "labels", "moduleID"} & set(entry)


def test_unreadable_checkpoint_keeps_the_published_entries(setup, kube: FakeKube) -> None:
    fake, r = setup("pcie-l40s")
    path = Path(r.config.node.kubelet_checkpoint)
    write_checkpoint(path, [Entry("pod-a", "main", [fake.doc["gpus"][0]["uuid"]])])
    r.run_once()
    path.write_text("{broken")
    assert r.run_once().writes == []
    assert report.CHECKPOINT_ANNOTATION in kube.get("devices", NODE)["metadata"]["annotations"]


def test_configured_partition_table(setup, kube: FakeKube, tmp_path: Path) -> None:
    table = {"2": [{"minors": [2, 3], "gpuLinkType": "PCIe", "ringBusBandwidth": "32Gi", "allocationScore": 1}]}
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table))
    _, r = setup("pcie-l40s", partition_table=str(path))
    r.run_once()
    got = json.loads(kube.get("devices", NODE)["metadata"]["annotations"][partitions.ANNOTATION])
    assert got == table


def test_partition_table_naming_a_missing_gpu_is_not_published(setup, kube: FakeKube, tmp_path: Path, caplog) -> None:
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"1": [{"minors": [9]}]}))
    _, r = setup("pcie-l40s", partition_table=str(path))
    r.run_once()
    assert partitions.ANNOTATION not in kube.get("devices", NODE)["metadata"]["annotations"]
    assert any("no GPU minor [9]" in rec.getMessage() for rec in caplog.records)


def test_bad_partition_table_is_a_config_error(setup, tmp_path: Path) -> None:
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"2": [{"minors": [0]}]}))
    with pytest.raises(cfg.ConfigError, match=r"\['2'\]\[0\].minors: 1 GPUs under the key for 2"):
        setup("pcie-l40s", partition_table=str(path))


def test_node_without_driver(setup, kube: FakeKube, tmp_path: Path) -> None:
    _, r = setup("pcie-l40s", library=str(tmp_path / "missing" / "libnvidia-ml.so.1"))
    done = r.run_once()
    assert done.gpus == 0 and "can not be loaded" in done.reason
    assert done.writes == ["Device create", "Device status"]
    dev = kube.get("devices", NODE)
    check_against_crd(dev)
    assert dev["spec"]["devices"] == [] and "can not be loaded" in dev["status"]["message"]
    node = kube.get("nodes", NODE)
    assert GPU_CORE not in node["status"]["capacity"] and report.LABEL_VENDOR not in node["metadata"]["labels"]
    assert r.run_once().writes == []


def test_gpus_gone_zero_the_node_and_drop_the_labels(setup, kube: FakeKube) -> None:
    fake, r = setup("pcie-l40s")
    r.run_once()
    fake.doc["init_error"] = 9  # driver unloaded
    fake.write()
    r.nvml.close()
    r.run_once()
    node = kube.get("nodes", NODE)
    assert node["status"]["allocatable"][GPU_CORE] == "0"
    assert not any(k in node["metadata"]["labels"] for k in report.GPU_LABELS)
    dev = kube.get("devices", NODE)
    assert not any(k in dev["metadata"].get("labels", {}) for k in report.GPU_LABELS)
    assert report.TOPOLOGY_ANNOTATION not in dev["metadata"].get("annotations", {})


def test_koordlet_written_device_is_taken_over_keeping_foreign_fields(setup, kube: FakeKube) -> None:
    kube.create(
        "devices",
        {
            "apiVersion": "scheduling.koordinator.sh/v1alpha1",
            "kind": "Device",
            "metadata": {"name": NODE, "labels": {"owner": "ops"}, "annotations": {"note": "keep"}},
            "spec": {"devices": [{"type": "gpu", "id": "GPU-old", "minor": 0, "health": True, "futureField": 1}]},
        },
    )
    _, r = setup("pcie-l40s")
    assert r.run_once().writes[0] == "Device"
    dev = kube.get("devices", NODE)
    assert dev["metadata"]["labels"]["owner"] == "ops" and dev["metadata"]["annotations"]["note"] == "keep"
    assert "GPU-old" not in [d["id"] for d in dev["spec"]["devices"]]


def test_node_recreated_gets_a_new_owner_reference(setup, kube: FakeKube) -> None:
    _, r = setup("pcie-l40s")
    r.run_once()
    node = kube.get("nodes", NODE)
    kube.delete("nodes", NODE)
    kube.create("nodes", {"metadata": {"name": NODE, "labels": node["metadata"]["labels"]}, "status": node["status"]})
    assert r.run_once().writes == ["Device"]
    refs = kube.get("devices", NODE)["metadata"]["ownerReferences"]
    assert refs == [report.owner_reference(NODE, kube.get("nodes", NODE)["metadata"]["uid"])]


def test_rounds_feed_the_hot_path_index(setup, kube: FakeKube) -> None:
    fake, r = setup("dgx-h100")
    r.index = GpuIndex(r.nvml)
    r.run_once()
    calls = fake.call_count()
    assert r.index.by_minor(5).uuid == fake.doc["gpus"][5]["uuid"]
    assert fake.call_count() == calls and r.index.refreshes == 0


def test_rdma_nics_are_devices_with_vfs(setup, kube: FakeKube) -> None:
    fake, r = setup("pcie-l40s")
    sys = fake.sys_root
    pf = sys / "devices" / "pci0000:00" / "0000:00:09.0" / "0000:09:00.0"
    vf = pf.parent / "0000:09:00.2"
    for fn in (pf, vf):
        (fn / "infiniband_verbs" / ("uverbs0" if fn == pf else "uverbs1")).mkdir(parents=True)
        (fn / "numa_node").write_text("0\n")
        (sys / "bus" / "pci" / "devices" / fn.name).symlink_to(fn)
    (pf / "virtfn0").symlink_to(vf)
    (vf / "physfn").symlink_to(pf)
    (pf / "infiniband" / "mlx5_0" / "ports" / "1").mkdir(parents=True)
    (pf / "infiniband" / "mlx5_0" / "ports" / "1" / "state").write_text("4: ACTIVE\n")
    (pf / "infiniband" / "mlx5_0" / "device").symlink_to(pf)
    (sys / "class" / "infiniband").mkdir(parents=True)
    (sys / "class" / "infiniband" / "mlx5_0").symlink_to(pf / "infiniband" / "mlx5_0")
    r.run_once()
    dev = kube.get("devices", NODE)
    check_against_crd(dev)
    nic = [d for d in dev["spec"]["devices"] if d["type"] == "rdma"]
    assert nic == [
        {
            "type": "rdma",
            "id": "0000:09:00.0",
            "minor": 0,
            "health": True,
            "resources": {"koordinator.sh/rdma": "100"},
            "topology": {"socketID": 0, "nodeID": 0, "pcieID": "0000:00:09.0", "busID": "0000:09:00.0"},
            "vfGroups": [{"vfs": [{"minor": 0, "busID": "0000:09:00.2"}]}],
        }
    ]
    assert kube.get("nodes", NODE)["status"]["allocatable"]["koordinator.sh/rdma"] == "100"
    assert dev["status"]["rdmaCount"] == 1


def test_crd_accepts_koordinators_example_and_rejects_nonsense() -> None:
    example = {
        "apiVersion": "scheduling.koordinator.sh/v1alpha1",
        "kind": "Device",
        "metadata": {"name": "node-1"},
        "spec": {
            "devices": [
                {
                    "health": True,
                    "id": "GPU-98583a5c-c155-9cf6-f955-03c189d3dbfb",
                    "minor": 0,
                    "resources": {
                        "koordinator.sh/gpu-core": "100",
                        "koordinator.sh/gpu-memory": "15472384Ki",
                        "koordinator.sh/gpu-memory-ratio": 100,
                    },
                    "type": "gpu",
                    "topology": {"socketID": 0, "nodeID": 0, "pcieID": "pci0000:3a", "busID": "0000:3b:00.0"},
                }
            ]
        },
        "status": {},
    }
    check_against_crd(example)
    bad = json.loads(json.dumps(example))
    bad["spec"]["devices"][0]["resources"]["koordinator.sh/gpu-core"] = "lots"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, crd_schema())
    bad["spec"]["devices"][0]["resources"]["koordinator.sh/gpu-core"] = "100"
    bad["spec"]["devices"][0]["minor"] = -1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, crd_schema())


def test_nvidia_gpu_is_published_only_while_no_device_plugin_registered_it(setup, kube: FakeKube) -> None:
    """kubelet sets a device plugin's resource at every node status update (and zero once the plugin
    goes) and leaves other extended resources alone, so nvidia.com/gpu is ours exactly while no plugin
    has registered it (the checkpoint's RegisteredDevices) and kubelet's after."""
    fake, r = setup("pcie-l40s")
    checkpoint = Path(r.config.node.kubelet_checkpoint)
    uuids = [g["uuid"] for g in fake.doc["gpus"]]

    def kubelet_sets(count: str) -> None:  # as kubelet's node status update does for a plugin's resource
        body = {"status": {s: {"nvidia.com/gpu": count} for s in ("capacity", "allocatable")}}
        kube.patch("nodes", NODE, body, subresource="status")

    def gpus() -> tuple[str | None, str | None]:
        status = kube.get("nodes", NODE)["status"]
        return status["capacity"].get("nvidia.com/gpu"), status["allocatable"].get("nvidia.com/gpu")

    r.run_once()  # no checkpoint: kubelet without device plugins never writes one
    assert gpus() == ("4", "4")
    write_checkpoint(checkpoint, [], registered={"nvidia.com/gpu": uuids})
    kubelet_sets("8")
    assert r.run_once().writes == []  # the plugin's count (time-sliced, say) is kubelet's to keep
    assert gpus() == ("8", "8")
    checkpoint.write_text("{not json")
    assert r.run_once().writes == []  # cannot tell who owns it: left as it is
    write_checkpoint(checkpoint, [], registered={"example.com/fpga": ["f0"]})
    kubelet_sets("0")
    assert r.run_once().writes == ["Node status"]  # the plugin went (kubelet zeroed it): ours again
    assert gpus() == ("4", "4")


def test_node_status_patch_compares_quantities_as_numbers() -> None:
    want = report.Desired(
        spec={},
        status={},
        labels={},
        annotations={},
        node_resources={GPU_CORE: 100, GPU_MEM: 85520809984, "koordinator.sh/rdma": 0},
    )
    same = {"status": {s: {GPU_CORE: "100", GPU_MEM: "83516416Ki"} for s in ("capacity", "allocatable")}}
    assert report.node_status_patch(same, want) is None
    other = {"status": {s: {GPU_CORE: "1", GPU_MEM: "83516416Ki", "koordinator.sh/rdma": "100"} for s in ("capacity",)}}
    assert report.node_status_patch(other, want) == {
        "status": {
            "capacity": {GPU_CORE: "100", "koordinator.sh/rdma": "0"},
            "allocatable": {GPU_CORE: "100", GPU_MEM: "85520809984"},
        }
    }


@pytest.mark.parametrize(
    ("name", "label"),
    [
        ("NVIDIA H100 80GB HBM3", "H100-80GB-HBM3"),
        ("Tesla V100-SXM2-32GB", "Tesla-V100-SXM2-32GB"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA A100-SXM4-80GB (rev 2)", "A100-SXM4-80GB-rev-2"),
        ("x" * 80, "x" * 63),
    ],
)
def test_model_label_values(name: str, label: str) -> None:
    assert report.label_value(name) == label


def test_builtin_partition_tables_by_model() -> None:
    minors = [7, 6, 5, 4, 3, 2, 1, 0]
    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA H800", "NVIDIA H20", "NVIDIA A100-SXM4-80GB"):
        table = partitions.builtin_table(name, minors, nvswitch=True)
        assert table is not None, name
        assert [len(table[k]) for k in ("1", "2", "4", "8")] == [8, 4, 2, 1]
        assert table["2"][0]["minors"] == [7, 6]  # positions are NVML indices, named by minor
        for size, parts in table.items():
            assert all(len(p["minors"]) == int(size) for p in parts)
            assert sorted(m for p in parts for m in p["minors"]) == sorted(minors)  # each size covers every GPU once
    assert partitions.builtin_table("NVIDIA H200", minors, nvswitch=True) is None  # H200 is not H20
    assert partitions.builtin_table("NVIDIA H100 80GB HBM3", minors, nvswitch=False) is None
    assert partitions.builtin_table("NVIDIA H100 80GB HBM3", minors[:4], nvswitch=True) is None


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("[1]", "non-empty object"),
        ('{"x": []}', "not a positive GPU count"),
        ('{"1": []}', "non-empty list"),
        ('{"1": [{"minors": [0], "bogus": 1}]}', "unknown field"),
        ('{"2": [{"minors": [0, 0]}]}', "distinct"),
        ('{"1": [{"minors": [0], "ringBusBandwidth": "fast"}]}', "ringBusBandwidth"),
        ('{"1": [{"minors": [0], "allocationScore": "1"}]}', "allocationScore"),
    ],
)
def test_partition_table_errors_name_the_field(text: str, error: str) -> None:
    with pytest.raises(partitions.PartitionTableError, match=error):
        partitions.parse_table(text, "t.json")


def test_report_once_command(fake_nvml, kube: FakeKube, tmp_path: Path, capsys) -> None:
    fake = fake_nvml("dgx-h100")
    kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig")
    conf = tmp_path / "config.toml"
    conf.write_text(
        f'[node]\nname = "{NODE}"\nsys_root = "{fake.sys_root}"\nnvml_library = "{fake.library}"\n'
        f'kubelet_checkpoint = "{tmp_path / "none"}"\n'
    )
    argv = ["report", "--once", "--config", str(conf), "--kubeconfig", str(kubeconfig)]
    assert cli.main(argv) == 0
    assert "8 GPU(s)" in capsys.readouterr().out
    assert kube.get("devices", NODE)["status"]["gpuCount"] == 8
    assert cli.main(argv) == 0
    assert "nothing (already up to date)" in capsys.readouterr().out
    assert cli.main(["report", "--once", "--config", str(conf)]) == 2
    assert "no kubeconfig" in capsys.readouterr().err
    Nvml(str(fake.library)).close()


def test_device_without_status_subresource_gets_its_status_with_the_object(
    fake_nvml, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Koordinator's Device CRD declares no status subresource: /status is 404, and the round must
    still write the status (through the object) and go on to the node's labels and resources."""
    with FakeKube(no_status=frozenset({"devices"})) as kube:
        kube.create("nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}, "status": {}})
        fake = fake_nvml("pcie-l40s")
        conf = cfg.Config(
            node=cfg.NodeConfig(
                name=NODE,
                sys_root=str(fake.sys_root),
                kubelet_checkpoint=str(tmp_path / "kubelet_internal_checkpoint"),
                nvml_library=str(fake.library),
            ),
            reporter=cfg.ReporterConfig(kubeconfig="unused"),
        )
        r = Reporter(conf, kube.api_client(), rdma_links=dict)
        try:
            with caplog.at_level(logging.WARNING, "crihook.devices.reporter"):
                assert r.run_once().writes == ["Device create", "Device status", "Node labels", "Node status"]
            assert kube.get("devices", NODE)["status"]["gpuCount"] == 4
            assert kube.get("nodes", NODE)["status"]["allocatable"][GPU_CORE] == "400"
            assert sum("no status subresource" in m for m in caplog.messages) == 1
            fake.doc["gpus"][1]["row_remap_failure"] = True
            fake.write()
            fake.reload()
            since = len(kube.requests)
            assert r.run_once().writes == ["Device", "Device status", "Node status"]
            assert [q.path.endswith("/status") for q in kube.requests[since:] if q.method == "PUT"] == [False, False]
            assert kube.get("devices", NODE)["status"]["healthyGPUCount"] == 3
            assert sum("no status subresource" in m for m in caplog.messages) == 1
        finally:
            r.nvml.close()


def test_status_404_from_a_vanished_device_does_not_stop_status_writes(setup, kube: FakeKube) -> None:
    """A 404 on /status that was the object going away, on a resource that has the subresource: the
    fallback write loses the status, which says the subresource exists; the next round uses it."""
    _, r = setup("pcie-l40s")
    kube.fail_next(1, 404, method="PUT", path="/status")
    with pytest.raises(ReportError, match="status not written"):
        r.run_once()
    assert r.status_subresource is True
    assert r.run_once().writes == ["Device status", "Node labels", "Node status"]
    assert kube.get("devices", NODE)["status"]["gpuCount"] == 4
