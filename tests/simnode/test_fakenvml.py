"""The fake NVML library through the real pynvml: the C signatures, struct layouts and return codes
the discovery relies on behave as the driver's library does."""

from __future__ import annotations

import pynvml
import pytest

from crihook.devices.nvml import load_library
from crihook.simnode.fakenvml import CONFIG_ENV, TOPOLOGIES, build, topology


@pytest.fixture
def nvml(fake_nvml):
    """Initialised pynvml over the fake H100 node; shut down after the test."""
    fake = fake_nvml("dgx-h100")
    load_library(str(fake.library))
    pynvml.nvmlInit()
    yield fake
    pynvml.nvmlShutdown()


def test_build_is_cached() -> None:
    first = build()
    assert build() == first
    assert first.name == "libnvidia-ml.so.1"


@pytest.mark.parametrize("name", TOPOLOGIES)
def test_identity_and_memory_match_the_topology(fake_nvml, name: str) -> None:
    fake = fake_nvml(name)
    load_library(str(fake.library))
    pynvml.nvmlInit()
    try:
        assert pynvml.nvmlSystemGetDriverVersion() == fake.doc["driver_version"]
        assert pynvml.nvmlDeviceGetCount() == len(fake.doc["gpus"])
        for i, want in enumerate(fake.doc["gpus"]):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            assert pynvml.nvmlDeviceGetIndex(h) == i
            assert pynvml.nvmlDeviceGetMinorNumber(h) == want["minor"]
            assert pynvml.nvmlDeviceGetUUID(h) == want["uuid"]
            assert pynvml.nvmlDeviceGetName(h) == want["name"]
            pci = pynvml.nvmlDeviceGetPciInfo(h)
            domain, bus, rest = want["pci_bus_id"].split(":")
            assert (pci.domain, pci.bus, pci.device) == (int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16))
            assert pci.busId.lower() == f"0000{want['pci_bus_id']}".lower()  # NVML's 8-digit domain
            assert pci.pciDeviceId == want["pci_device_id"]
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            assert (mem.total, mem.used, mem.free) == (
                want["memory_total"],
                want["memory_used"],
                want["memory_total"] - want["memory_used"],
            )
            assert pynvml.nvmlDeviceGetHandleByUUID(want["uuid"]).contents is not None
    finally:
        pynvml.nvmlShutdown()


def test_links_pcie_levels_and_unsupported_queries(nvml) -> None:
    h0 = pynvml.nvmlDeviceGetHandleByIndex(0)
    h5 = pynvml.nvmlDeviceGetHandleByIndex(5)
    assert pynvml.nvmlDeviceGetTopologyCommonAncestor(h0, h5) == nvml.doc["pcie_levels"][0][5]
    total = sum(entry["count"] for entry in nvml.doc["gpus"][0]["nvlinks"])
    for link in range(total):
        assert pynvml.nvmlDeviceGetNvLinkState(h0, link) == pynvml.NVML_FEATURE_ENABLED
        assert pynvml.nvmlDeviceGetNvLinkVersion(h0, link) == nvml.doc["gpus"][0]["nvlink_version"]
        assert pynvml.nvmlDeviceGetNvLinkRemoteDeviceType(h0, link) == pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
    assert pynvml.nvmlDeviceGetNvLinkRemotePciInfo(h0, 0).busId.lower() == "00000000:a5:00.0"
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetNvLinkState(h0, total)  # the GPU has no such link
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetNvLinkState(h0, pynvml.NVML_NVLINK_MAX_LINKS)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetRetiredPagesPendingStatus(h0)  # absent from the H100 entries
    assert pynvml.nvmlDeviceGetMigMode(h0) == [0, 0]
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetHandleByIndex(len(nvml.doc["gpus"]))
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000")


def test_lost_gpu_keeps_identity_but_not_live_state(nvml) -> None:
    nvml.doc["gpus"][2]["lost"] = True
    nvml.write()
    nvml.reload()
    h = pynvml.nvmlDeviceGetHandleByIndex(2)
    assert pynvml.nvmlDeviceGetUUID(h) == nvml.doc["gpus"][2]["uuid"]
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetMemoryInfo(h)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetNvLinkState(h, 0)


def test_call_count_counts_every_call(nvml) -> None:
    before = nvml.call_count()
    pynvml.nvmlDeviceGetCount()
    pynvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.call_count() - before == 2


def test_init_errors_and_bad_files(fake_nvml, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = fake_nvml("pcie-l40s")
    load_library(str(fake.library))
    for _ in range(100):  # an earlier test in this process may have left NVML initialised
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError_Uninitialized:
            break
    fake.doc["init_error"] = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    fake.write()
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        pynvml.nvmlInit()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()
    fake.config.write_text('{"driver_version": "1", "gpus": [{"minor": 0}], "pcie_levels": [[0]]}')
    with pytest.raises(pynvml.NVMLError_Unknown):
        pynvml.nvmlInit()
    fake.config.write_text("{not json")
    with pytest.raises(pynvml.NVMLError_Unknown):
        pynvml.nvmlInit()
    monkeypatch.delenv(CONFIG_ENV)
    with pytest.raises(pynvml.NVMLError_Unknown):
        pynvml.nvmlInit()


def test_topology_files_are_consistent() -> None:
    for name in TOPOLOGIES:
        doc = topology(name)
        n = len(doc["gpus"])
        levels = doc["pcie_levels"]
        assert all(levels[i][j] == levels[j][i] for i in range(n) for j in range(n)), name
        assert all(levels[i][i] == 0 for i in range(n)), name
        assert len({g["minor"] for g in doc["gpus"]}) == n, name
        pcis = {g["pci_bus_id"] for g in doc["gpus"]}
        for g in doc["gpus"]:  # a GPU-to-GPU link is seen from both ends, as often
            for link in g.get("nvlinks", []):
                if link["type"] == "gpu":
                    assert link["remote"] in pcis, name
                    peer = next(p for p in doc["gpus"] if p["pci_bus_id"] == link["remote"])
                    back = [x for x in peer["nvlinks"] if x["remote"] == g["pci_bus_id"]]
                    assert back and back[0]["count"] == link["count"], (name, g["pci_bus_id"], link)


# -- processes: nvmlProcessInfo_t v1 (unversioned entry points) and v2/v3 (pynvml's), the samples --


def _processes(nvml, index: int, procs: list[dict]) -> None:
    nvml.doc["gpus"][index]["processes"] = procs
    nvml.write()  # the process queries see the change themselves: no reload


def test_process_lists_through_pynvml(nvml) -> None:
    _processes(
        nvml,
        0,
        [
            {"pid": 100, "used_memory": 5 << 30, "sm_util": 40, "mem_util": 7},
            {"pid": 101, "used_memory": None, "type": "graphics"},
            {"pid": 102, "used_memory": 1 << 20, "type": "both"},
        ],
    )
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    compute = pynvml.nvmlDeviceGetComputeRunningProcesses(h)  # the _v3 entry point
    assert [(p.pid, p.usedGpuMemory) for p in compute] == [(100, 5 << 30), (102, 1 << 20)]
    assert {(p.gpuInstanceId, p.computeInstanceId) for p in compute} == {(0xFFFFFFFF, 0xFFFFFFFF)}  # not MIG
    assert [(p.pid, p.usedGpuMemory) for p in pynvml.nvmlDeviceGetComputeRunningProcesses_v2(h)] == [
        (100, 5 << 30),
        (102, 1 << 20),
    ]
    graphics = pynvml.nvmlDeviceGetGraphicsRunningProcesses(h)
    assert [(p.pid, p.usedGpuMemory) for p in graphics] == [(101, None), (102, 1 << 20)]  # None: not available
    samples = pynvml.nvmlDeviceGetProcessUtilization(h, 0)
    assert [(s.pid, s.smUtil, s.memUtil) for s in samples] == [(100, 40, 7)]
    with pytest.raises(pynvml.NVMLError_NotFound):  # nothing newer than the last sample
        pynvml.nvmlDeviceGetProcessUtilization(h, samples[0].timeStamp + 10**9)
    other = pynvml.nvmlDeviceGetHandleByIndex(1)
    assert pynvml.nvmlDeviceGetComputeRunningProcesses(other) == []
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetProcessUtilization(other, 0)


def test_v1_entry_point_fills_the_16_byte_struct(nvml) -> None:
    """The unversioned symbol, as drivers before the instance ids were added lay it out."""
    import ctypes

    class ProcessInfoV1(ctypes.Structure):
        _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]

    assert ctypes.sizeof(ProcessInfoV1) == 16 and ctypes.sizeof(pynvml.c_nvmlProcessInfo_t) == 24
    _processes(nvml, 0, [{"pid": 7, "used_memory": 3}, {"pid": 8, "used_memory": 4}])
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    fn = ctypes.CDLL(str(nvml.library)).nvmlDeviceGetComputeRunningProcesses
    count = ctypes.c_uint(1)
    buf = (ProcessInfoV1 * 2)()
    assert fn(h, ctypes.byref(count), buf) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE and count.value == 2
    assert fn(h, ctypes.byref(count), buf) == pynvml.NVML_SUCCESS
    assert [(p.pid, p.usedGpuMemory) for p in buf] == [(7, 3), (8, 4)]


def test_mig_processes_by_device_and_no_samples(nvml) -> None:
    nvml.doc["gpus"][3].update(mig_mode=1, mig_devices=["MIG-aaaa", None, "MIG-cccc"])
    nvml.doc["gpus"][3]["processes"] = [
        {"pid": 1, "used_memory": 10, "mig": 0, "sm_util": 5},
        {"pid": 2, "used_memory": 20, "mig": 2},
    ]
    nvml.write()
    nvml.reload()
    h = pynvml.nvmlDeviceGetHandleByIndex(3)
    parent = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
    assert [(p.pid, p.gpuInstanceId, p.computeInstanceId) for p in parent] == [(1, 0, 0), (2, 2, 0)]
    m2 = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 2)
    assert [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(m2)] == [2]
    for handle in (h, m2):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetProcessUtilization(handle, 0)
    nvml.doc["gpus"][3]["processes"] = [{"pid": 9, "used_memory": 1, "mig": 1}]  # an empty slot
    nvml.write()
    with pytest.raises(pynvml.NVMLError_Unknown):
        pynvml.nvmlDeviceGetComputeRunningProcesses(h)  # the file is refused, as at init
