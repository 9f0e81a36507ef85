"""GPU discovery through the real pynvml over the fake NVML library: the three shipped topologies,
health, MIG, a node without the driver, and the hot-path index."""

from __future__ import annotations

import logging
import os
from dataclasses import replace

import pynvml
import pytest
from hypothesis import given
from hypothesis import strategies as st

from crihook.devices import sysfs
from crihook.devices.nvml import GpuIndex, LinkEnd, Nvml, link_matrix
from crihook.simnode.fakenvml import TOPOLOGIES, root_port


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def node(fake_nvml):
    """`node("dgx-h100")` -> (fake, Nvml over it); every Nvml made is closed after the test."""
    made: list[Nvml] = []

    def make(name: str, **kwargs):
        fake = fake_nvml(name)
        nvml = Nvml(str(fake.library), str(fake.sys_root), **kwargs)
        made.append(nvml)
        return fake, nvml

    yield make
    for n in made:
        n.close()


def expected_links(doc: dict, i: int, j: int) -> int:
    """The pair's link count read straight off the topology file: direct links, or for switched
    fabrics the links both GPUs have into each shared switch."""
    gi, gj = doc["gpus"][i], doc["gpus"][j]
    direct = sum(x["count"] for x in gi.get("nvlinks", []) if x["type"] == "gpu" and x["remote"] == gj["pci_bus_id"])
    to_switch_i = {x["remote"]: x["count"] for x in gi.get("nvlinks", []) if x["type"] == "switch"}
    to_switch_j = {x["remote"]: x["count"] for x in gj.get("nvlinks", []) if x["type"] == "switch"}
    return direct + sum(min(c, to_switch_j[s]) for s, c in to_switch_i.items() if s in to_switch_j)


@pytest.mark.parametrize("name", TOPOLOGIES)
def test_discovery_matches_the_topology(node, name: str) -> None:
    fake, nvml = node(name)
    snap = nvml.snapshot()
    doc = fake.doc
    assert snap.reason == ""
    assert snap.driver_version == doc["driver_version"]
    assert [g.index for g in snap.gpus] == list(range(len(doc["gpus"])))
    for i, (g, want) in enumerate(zip(snap.gpus, doc["gpus"], strict=True)):
        assert (g.minor, g.uuid, g.name, g.memory_total) == (
            want["minor"],
            want["uuid"],
            want["name"],
            want["memory_total"],
        )
        assert g.pci_bus_id == want["pci_bus_id"].lower()
        assert g.numa_node == want["numa_node"]
        assert g.socket == want["numa_node"]  # make_sys_tree puts NUMA node N on socket N
        assert g.pcie_root == root_port(doc, fake.sys_root, i)
        assert g.pcie_root_complex.startswith("pci0000:") and g.pcie_root_complex in os.path.realpath(
            fake.sys_root / "bus" / "pci" / "devices" / g.pci_bus_id
        )
        assert g.cuda_capability == "{}.{}".format(*want["cuda_capability"])
        assert g.healthy and g.health_reason == ""
        assert g.mig_enabled is False
    topo = snap.topology
    assert topo is not None
    n = len(doc["gpus"])
    assert topo.minors == tuple(g["minor"] for g in doc["gpus"])
    assert [list(r) for r in topo.pcie] == doc["pcie_levels"]
    for i in range(n):
        for j in range(n):
            want = expected_links(doc, i, j) if i != j else 0
            assert topo.nvlinks[i][j] == want, (i, j)
            version = doc["gpus"][i].get("nvlink_version", 0) if want else 0
            assert topo.nvlink_versions[i][j] == version
    assert topo.nvswitch == any(x["type"] == "switch" for g in doc["gpus"] for x in g.get("nvlinks", []))


def test_hybrid_cube_mesh_is_not_uniform(node) -> None:
    """DGX-1: some pairs have two links, some one, some none (they cross the other quad)."""
    _, nvml = node("dgx1-v100")
    topo = nvml.snapshot().topology
    assert topo is not None
    counts = {topo.nvlinks[i][j] for i in range(8) for j in range(8) if i != j}
    assert counts == {0, 1, 2}
    assert not topo.nvswitch


def test_snapshot_without_topology_makes_no_link_calls(node) -> None:
    fake, nvml = node("dgx-h100")
    nvml.snapshot(topology=False)  # initialise first
    before = fake.call_count()
    snap = nvml.snapshot(topology=False)
    identity_calls = fake.call_count() - before
    assert snap.topology is None and len(snap.gpus) == 8
    before = fake.call_count()
    nvml.snapshot(topology=True)
    assert fake.call_count() - before > identity_calls + 8 * 18


def test_unhealthy_gpus_say_why(node) -> None:
    fake, nvml = node("dgx1-v100")
    fake.doc["gpus"][1]["retired_pages_pending"] = True
    fake.doc["gpus"][3]["lost"] = True
    fake.write()
    snap = nvml.snapshot()
    bad = {g.minor: g.health_reason for g in snap.gpus if not g.healthy}
    assert set(bad) == {1, 3}
    assert "retired pages" in bad[1]
    assert "lost" in bad[3].lower()
    lost = snap.gpus[3]
    assert lost.uuid == fake.doc["gpus"][3]["uuid"] and lost.memory_total == 0
    topo = snap.topology
    assert topo is not None
    assert all(topo.nvlinks[3][j] == 0 for j in range(8))  # a lost GPU's links are not counted


def test_row_remap_failure_and_mig(node) -> None:
    fake, nvml = node("dgx-h100")
    fake.doc["gpus"][0]["row_remap_failure"] = True
    fake.doc["gpus"][7]["mig_mode"] = 1
    fake.write()
    snap = nvml.snapshot()
    assert not snap.gpus[0].healthy and "row remapping" in snap.gpus[0].health_reason
    assert snap.gpus[7].mig_enabled and snap.gpus[7].healthy
    assert snap.gpus[7].mig_devices == () and snap.gpus[6].mig_devices == ()


def test_mig_devices_by_slot_as_the_device_plugin_names_them(node) -> None:
    """Empty slots are skipped, not renumbered: the plugin's index strategy names a MIG device
    `<GPU index>:<slot>`. A GPU not in MIG mode is not asked, whatever slots it had."""
    fake, nvml = node("dgx-h100")
    a, b = "MIG-0d3c9a5e-1111-5b1c-9c1e-000000000001", "MIG-0d3c9a5e-2222-5b1c-9c1e-000000000002"
    fake.doc["gpus"][5] |= {"mig_mode": 1, "mig_devices": [a, None, None, b]}
    fake.doc["gpus"][6] |= {"mig_mode": 0, "mig_devices": [a]}
    fake.write()
    snap = nvml.snapshot()
    assert snap.gpus[5].mig_devices == ((0, a), (3, b)) and snap.gpus[5].healthy
    assert snap.gpus[6].mig_devices == () and not snap.gpus[6].mig_enabled


def test_mig_devices_unreadable_is_said(node, monkeypatch: pytest.MonkeyPatch) -> None:
    fake, nvml = node("pcie-l40s")
    fake.doc["gpus"][1] |= {"mig_mode": 1, "mig_devices": ["MIG-x"]}
    fake.write()

    def fails(handle: object, index: int) -> object:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetMigDeviceHandleByIndex", fails)
    g = nvml.snapshot().gpus[1]
    assert g.mig_devices == () and not g.healthy and g.health_reason.startswith("MIG devices: ")


def test_health_change_seen_by_a_running_library(node) -> None:
    fake, nvml = node("pcie-l40s")
    assert all(g.healthy for g in nvml.snapshot().gpus)
    fake.doc["gpus"][2]["row_remap_failure"] = True
    fake.write()
    fake.reload()
    assert [g.healthy for g in nvml.snapshot().gpus] == [True, True, False, True]


def test_missing_library_reports_zero_gpus_once(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    nvml = Nvml(str(tmp_path / "libnvidia-ml.so.1"), str(tmp_path), retry_seconds=60, clock=clock)
    with caplog.at_level(logging.WARNING, logger="crihook.devices.nvml"):
        first = nvml.snapshot()
        for _ in range(5):
            assert nvml.snapshot() == first
        clock.now += 61
        assert nvml.snapshot().reason == first.reason  # retried, same reason: not said again
    assert first.gpus == () and "can not be loaded" in first.reason
    assert len([r for r in caplog.records if "not usable" in r.getMessage()]) == 1


def test_library_found_in_one_of_several_directories(fake_nvml, tmp_path) -> None:
    """A driver root's library directory differs by distribution (usr/lib64, usr/lib/x86_64-linux-gnu,
    usr/lib/aarch64-linux-gnu): the first path of the list that exists is loaded; none: no driver."""
    fake = fake_nvml("pcie-l40s")
    paths = [str(tmp_path / d / "libnvidia-ml.so.1") for d in ("usr/lib64", "usr/lib/x86_64-linux-gnu")]
    nvml = Nvml(":".join([*paths, str(fake.library)]), str(fake.sys_root))
    try:
        assert len(nvml.snapshot().gpus) == 4
    finally:
        nvml.close()
    missing = Nvml(":".join(paths), str(tmp_path))
    snap = missing.snapshot()
    assert snap.gpus == () and "not found in" in snap.reason and "not installed" in snap.reason


def test_driver_not_loaded_is_retried_only_after_the_interval(node) -> None:
    clock = Clock()
    fake, nvml = node("dgx-h100", retry_seconds=30, clock=clock)
    fake.doc["init_error"] = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    fake.write()
    snap = nvml.snapshot()
    assert snap.gpus == () and "not loaded" in snap.reason
    calls = fake.call_count()
    nvml.snapshot()
    assert fake.call_count() == calls  # no spin: no NVML call inside the interval
    del fake.doc["init_error"]
    fake.write()
    clock.now += 31
    assert len(nvml.snapshot().gpus) == 8


def test_index_serves_hits_from_memory_and_rate_limits_misses(node) -> None:
    clock = Clock()
    fake, nvml = node("pcie-l40s")
    index = GpuIndex(nvml, min_refresh_seconds=5, clock=clock)
    g = index.by_minor(0)
    assert g is not None and g.uuid == fake.doc["gpus"][2]["uuid"] and g.index == 2
    calls = fake.call_count()
    assert index.by_uuid(fake.doc["gpus"][0]["uuid"]).minor == 2
    assert index.by_minor(3).index == 1
    assert fake.call_count() == calls  # hits cost no NVML call
    assert index.by_minor(9) is None
    assert index.by_uuid("GPU-nope") is None
    assert index.refreshes == 1 and fake.call_count() == calls  # misses inside the interval: no refresh
    clock.now += 6
    assert index.by_minor(9) is None
    assert index.refreshes == 2 and fake.call_count() > calls
    assert [x.minor for x in index.all()] == [2, 3, 0, 1]


def test_index_picks_up_a_new_gpu_on_a_miss(node) -> None:
    clock = Clock()
    fake, nvml = node("pcie-l40s")
    index = GpuIndex(nvml, min_refresh_seconds=5, clock=clock)
    assert len(index.all()) == 4
    extra = dict(
        fake.doc["gpus"][0], minor=7, uuid="GPU-7f6410b9-bdf7-f9a5-de09-aa5ec31a7124", pci_bus_id="0000:e1:00.0"
    )
    fake.doc["gpus"].append(extra)
    fake.doc["pcie_levels"] = [[*row, 50] for row in fake.doc["pcie_levels"]] + [[50, 50, 50, 50, 0]]
    fake.write()
    fake.reload()
    clock.now += 5
    assert index.by_minor(7).uuid == extra["uuid"]


def test_index_takes_the_reporters_snapshot(node) -> None:
    fake, nvml = node("dgx-h100")
    index = GpuIndex(nvml, min_refresh_seconds=5)
    index.update(nvml.snapshot())
    calls = fake.call_count()
    assert index.by_minor(4).uuid == fake.doc["gpus"][4]["uuid"]
    assert fake.call_count() == calls and index.refreshes == 0


def test_index_generation_moves_only_when_the_gpus_change(node) -> None:
    """What was worked out from the index (the gpu hook's placements) is remade when it moves; the
    reporter's rounds, which mostly find the same GPUs, leave it."""
    _, nvml = node("dgx-h100")
    index = GpuIndex(nvml, min_refresh_seconds=5)
    index.update(nvml.snapshot())
    seen = index.generation
    index.update(nvml.snapshot())
    assert index.generation == seen
    snap = nvml.snapshot()
    index.update(replace(snap, gpus=snap.gpus[1:]))
    assert index.generation == seen + 1 and index.by_minor(snap.gpus[0].minor) is None


# -- pure pieces -----------------------------------------------------------------------------------

PCIS = [f"0000:{0x10 * (i + 1):02x}:00.0" for i in range(6)]
SWITCHES = ["0000:a0:00.0", "0000:a1:00.0"]


@st.composite
def fabrics(draw):
    n = draw(st.integers(1, 6))
    links: list[list[LinkEnd]] = [[] for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            k = draw(st.integers(0, 3))
            v = draw(st.integers(1, 4))
            links[i] += [LinkEnd(PCIS[j], False, v)] * k
            links[j] += [LinkEnd(PCIS[i], False, v)] * k
        for s in SWITCHES:
            links[i] += [LinkEnd(s, True, 4)] * draw(st.integers(0, 3))
    return PCIS[:n], links


@given(fabrics())
def test_link_matrix_is_symmetric_and_counts_links(fabric) -> None:
    pcis, links = fabric
    counts, versions = link_matrix(pcis, links)
    n = len(pcis)
    for i in range(n):
        assert counts[i][i] == 0 and versions[i][i] == 0
        for j in range(n):
            assert counts[i][j] == counts[j][i] and versions[i][j] == versions[j][i]
            assert (counts[i][j] == 0) == (versions[i][j] == 0)
            if i != j:
                direct = sum(1 for e in links[i] if e.remote_pci == pcis[j])
                assert counts[i][j] >= direct


def test_link_matrix_takes_the_side_that_sees_fewer_links() -> None:
    a, b = PCIS[:2]
    counts, _ = link_matrix([a, b], [[LinkEnd(b, False, 3)] * 2, [LinkEnd(a, False, 3)]])
    assert counts[0][1] == 1


@pytest.mark.parametrize(
    ("raw", "want"),
    [("00000000:1B:00.0", "0000:1b:00.0"), ("0000:1b:00.0", "0000:1b:00.0"), ("0001:AF:1f.7", "0001:af:1f.7")],
)
def test_pci_address_spelling(raw: str, want: str) -> None:
    assert sysfs.pci_address(raw) == want


@pytest.mark.parametrize("raw", ["", "1b:00.0", "0000:1b:00.8", "../../etc", "0000:1b:00.0/x"])
def test_pci_address_rejects_what_is_not_one(raw: str) -> None:
    with pytest.raises(ValueError, match="not a PCI address"):
        sysfs.pci_address(raw)


def test_sysfs_unknowns(tmp_path) -> None:
    assert sysfs.numa_node(str(tmp_path), "0000:01:00.0") == -1
    assert sysfs.socket_of_node(str(tmp_path), 0) == -1
    assert sysfs.root_port(str(tmp_path), "0000:01:00.0") == ""
    assert sysfs.first_cpu("8-11,0-3") == 0
    assert sysfs.first_cpu("") == -1
