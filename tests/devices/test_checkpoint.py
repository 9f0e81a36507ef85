"""The kubelet device-manager checkpoint: both DeviceIDs layouts, AllocResp, damage, and reading a
file kubelet rewrites."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crihook.base.spec import Device, Mount
from crihook.devices.checkpoint import (
    NO_TOPOLOGY,
    AllocResp,
    Checkpoint,
    CheckpointError,
    CheckpointReader,
    PodDeviceEntry,
    parse_checkpoint,
)
from crihook.proto import deviceplugin_v1beta1_pb2 as dp
from tests.support.gpu_fixtures import Entry, alloc_resp, checkpoint_doc, write_checkpoint

# Byte-for-byte the shape kubelet 1.28 writes (one entry, NUMA layout, envvar-mode NVIDIA plugin).
KUBELET_128 = (
    b'{"Data":{"PodDeviceEntries":[{"PodUID":"0f4c3d1e-5a7b-4c2d-9e8f-1a2b3c4d5e6f","ContainerName":"cuda",'
    b'"ResourceName":"nvidia.com/gpu","DeviceIDs":{"0":["GPU-aaaa"],"1":["GPU-bbbb"]},'
    b'"AllocResp":"'
    + base64.b64encode(
        dp.ContainerAllocateResponse(envs={"NVIDIA_VISIBLE_DEVICES": "GPU-aaaa,GPU-bbbb"}).SerializeToString()
    )
    + b'"}],"RegisteredDevices":{"nvidia.com/gpu":["GPU-aaaa","GPU-bbbb"]}},"Checksum":3854436589}'
)


def test_kubelet_numa_layout() -> None:
    cp = parse_checkpoint(KUBELET_128)
    assert cp.registered == {"nvidia.com/gpu": ("GPU-aaaa", "GPU-bbbb")}
    (e,) = cp.entries
    assert e.pod_uid == "0f4c3d1e-5a7b-4c2d-9e8f-1a2b3c4d5e6f"
    assert e.container_name == "cuda"
    assert e.resource_name == "nvidia.com/gpu"
    assert e.devices_by_numa == {0: ("GPU-aaaa",), 1: ("GPU-bbbb",)}
    assert e.device_ids == ("GPU-aaaa", "GPU-bbbb")
    assert e.alloc_resp == AllocResp(envs={"NVIDIA_VISIBLE_DEVICES": "GPU-aaaa,GPU-bbbb"})
    assert e.alloc_error == ""


def test_old_list_layout() -> None:
    doc = checkpoint_doc([Entry("p", "c", ["GPU-1", "GPU-2"])], layout="list")
    (e,) = parse_checkpoint(json.dumps(doc).encode()).entries
    assert e.devices_by_numa == {NO_TOPOLOGY: ("GPU-1", "GPU-2")}
    assert e.device_ids == ("GPU-1", "GPU-2")


def test_alloc_resp_fields() -> None:
    resp = alloc_resp(
        envs={"A": "1"},
        devices=[("/dev/nvidia3", "/dev/nvidia3")],
        mounts=[("/usr/lib/libcuda.so", "/host/libcuda.so")],
        annotations={"cdi.k8s.io/plugin": "nvidia.com/gpu=3"},
        cdi=["nvidia.com/gpu=GPU-1"],
    )
    (e,) = parse_checkpoint(json.dumps(checkpoint_doc([Entry("p", "c", ["3"], resp=resp)])).encode()).entries
    assert e.alloc_resp == AllocResp(
        envs={"A": "1"},
        mounts=(Mount("/usr/lib/libcuda.so", "/host/libcuda.so", True),),
        devices=(Device("/dev/nvidia3", "/dev/nvidia3", "rw"),),
        annotations={"cdi.k8s.io/plugin": "nvidia.com/gpu=3"},
        cdi_devices=("nvidia.com/gpu=GPU-1",),
    )


def test_unknown_keys_and_go_nulls() -> None:
    doc = {
        "Data": {
            "PodDeviceEntries": [
                {
                    "PodUID": "p",
                    "ContainerName": "c",
                    "ResourceName": "r",
                    "DeviceIDs": None,
                    "AllocResp": None,
                    "Future": 1,
                },
            ],
            "RegisteredDevices": None,
            "NewInKubelet2": {"x": 1},
        },
        "Checksum": "not even a number",
        "Version": 2,
    }
    (e,) = parse_checkpoint(json.dumps(doc).encode()).entries
    assert e == PodDeviceEntry("p", "c", "r", {}, None, "")
    assert parse_checkpoint(b'{"Data":{"PodDeviceEntries":null}}') == Checkpoint()
    assert parse_checkpoint(b"{}") == Checkpoint()


def test_empty_alloc_resp_is_an_empty_response() -> None:
    doc = {"Data": {"PodDeviceEntries": [{"PodUID": "p", "ContainerName": "c", "AllocResp": ""}]}}
    (e,) = parse_checkpoint(json.dumps(doc).encode()).entries
    assert e.alloc_resp == AllocResp()


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("!!!not base64", "not a device-plugin ContainerAllocateResponse"),
        (base64.b64encode(b"\x0a\xff\xff\xff\xff\xff\xff").decode(), "not a device-plugin ContainerAllocateResponse"),
        # a string field that is not UTF-8: proto3 refuses it
        (base64.b64encode(b"\x1a\x03\x0a\x01\xff").decode(), "not a device-plugin ContainerAllocateResponse"),
    ],
)
def test_bad_alloc_resp_spoils_only_its_entry(value: str, reason: str) -> None:
    good = checkpoint_doc([Entry("other", "c", ["GPU-1"])])["Data"]["PodDeviceEntries"][0]
    doc = {"Data": {"PodDeviceEntries": [{"PodUID": "p", "ContainerName": "c", "AllocResp": value}, good]}}
    bad_entry, good_entry = parse_checkpoint(json.dumps(doc).encode()).entries
    assert bad_entry.alloc_resp is None
    assert bad_entry.alloc_error.startswith("Data.PodDeviceEntries[0].AllocResp: ")
    assert reason in bad_entry.alloc_error
    assert good_entry.alloc_resp == AllocResp()
    assert good_entry.alloc_error == ""


@pytest.mark.parametrize(
    ("data", "where", "reason"),
    [
        (b"", "", "not valid JSON"),
        (b'{"Data":', "", "not valid JSON"),
        (b"[]", "", "expected a JSON object"),
        (b'{"Data":[]}', "Data", "expected an object"),
        (b'{"Data":{"PodDeviceEntries":{}}}', "Data.PodDeviceEntries", "expected a list"),
        (b'{"Data":{"PodDeviceEntries":[1]}}', "Data.PodDeviceEntries[0]", "expected an object"),
        (b'{"Data":{"PodDeviceEntries":[{"PodUID":5}]}}', "Data.PodDeviceEntries[0].PodUID", "expected a string"),
        (
            b'{"Data":{"PodDeviceEntries":[{"ContainerName":[]}]}}',
            "Data.PodDeviceEntries[0].ContainerName",
            "expected a string",
        ),
        (
            b'{"Data":{"PodDeviceEntries":[{"ResourceName":true}]}}',
            "Data.PodDeviceEntries[0].ResourceName",
            "expected a string",
        ),
        (b'{"Data":{"PodDeviceEntries":[{"DeviceIDs":"GPU-1"}]}}', "Data.PodDeviceEntries[0].DeviceIDs", "list"),
        (b'{"Data":{"PodDeviceEntries":[{"DeviceIDs":[1]}]}}', "Data.PodDeviceEntries[0].DeviceIDs", "list"),
        (
            b'{"Data":{"PodDeviceEntries":[{"DeviceIDs":{"x":["a"]}}]}}',
            "Data.PodDeviceEntries[0].DeviceIDs",
            "NUMA node 'x' is not an integer",
        ),
        (
            b'{"Data":{"PodDeviceEntries":[{"DeviceIDs":{"-2":["a"]}}]}}',
            "Data.PodDeviceEntries[0].DeviceIDs",
            "out of range",
        ),
        (
            b'{"Data":{"PodDeviceEntries":[{"DeviceIDs":{"0":"a"}}]}}',
            "Data.PodDeviceEntries[0].DeviceIDs['0']",
            "list of strings",
        ),
        (b'{"Data":{"PodDeviceEntries":[{"AllocResp":7}]}}', "Data.PodDeviceEntries[0].AllocResp", "base64"),
        (b'{"Data":{"RegisteredDevices":[]}}', "Data.RegisteredDevices", "expected an object"),
        (b'{"Data":{"RegisteredDevices":{"r":[1]}}}', "Data.RegisteredDevices['r']", "list of strings"),
    ],
)
def test_rejections_name_the_field(data: bytes, where: str, reason: str) -> None:
    with pytest.raises(CheckpointError) as info:
        parse_checkpoint(data)
    assert info.value.where == where
    assert reason in info.value.reason
    assert str(info.value).startswith("kubelet checkpoint: ")


def test_for_container() -> None:
    cp = parse_checkpoint(
        json.dumps(
            checkpoint_doc([Entry("p1", "a", ["GPU-1"]), Entry("p1", "b", ["GPU-2"]), Entry("p2", "a", ["GPU-3"])])
        ).encode()
    )
    assert [e.device_ids for e in cp.for_container("p1", "a")] == [("GPU-1",)]
    assert [e.device_ids for e in cp.for_container("p2", "a")] == [("GPU-3",)]
    assert cp.for_container("p3", "a") == ()


def test_holders_by_device_and_replica() -> None:
    doc = checkpoint_doc(
        [
            Entry("p1", "a", ["GPU-1::0", "GPU-1::3"], resource="nvidia.com/gpu.shared"),
            Entry("p2", "b", ["GPU-1::1", "GPU-2"]),
            Entry("p3", "c", ["3"]),
            Entry("p4", "d", ["GPU-1x"]),
        ]
    )
    cp = parse_checkpoint(json.dumps(doc).encode())
    assert [(e.pod_uid, e.container_name) for e in cp.holders("GPU-1")] == [("p1", "a"), ("p2", "b")]
    assert [e.pod_uid for e in cp.holders("GPU-2")] == ["p2"]
    assert [e.pod_uid for e in cp.holders("3")] == ["p3"]
    assert cp.holders("GPU-1::0") == () and cp.holders("GPU-9") == ()
    assert Checkpoint().holders("GPU-1") == ()


# -- properties ------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=10), c, max_size=3),
    max_leaves=15,
)
entry_like = st.fixed_dictionaries(
    {},
    optional={
        "PodUID": json_values,
        "ContainerName": json_values,
        "ResourceName": json_values,
        "DeviceIDs": json_values | st.dictionaries(st.sampled_from(["-1", "0", "x", "99999"]), json_values),
        "AllocResp": json_values | st.binary(max_size=40).map(lambda b: base64.b64encode(b).decode()),
    },
)
checkpoint_like = st.fixed_dictionaries(
    {},
    optional={
        "Data": json_values
        | st.fixed_dictionaries(
            {}, optional={"PodDeviceEntries": st.lists(entry_like, max_size=3), "RegisteredDevices": json_values}
        ),
        "Checksum": json_values,
    },
)


def _parse_or_error(data: bytes) -> None:
    try:
        parse_checkpoint(data)
    except CheckpointError as e:
        assert str(e).startswith("kubelet checkpoint: ")
        assert e.reason


@given(st.binary(max_size=400))
def test_arbitrary_bytes_never_crash(data: bytes) -> None:
    _parse_or_error(data)


@given(checkpoint_like)
def test_arbitrary_json_never_crashes(doc: Any) -> None:
    _parse_or_error(json.dumps(doc).encode())


uids = st.text(alphabet="0123456789abcdef-", min_size=1, max_size=36)
ids = st.lists(st.text(min_size=1, max_size=12), max_size=4)
responses = st.builds(
    alloc_resp,
    envs=st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=2),
    devices=st.lists(st.tuples(st.text(max_size=12), st.text(max_size=12)), max_size=2),
    mounts=st.lists(st.tuples(st.text(max_size=12), st.text(max_size=12)), max_size=2),
    cdi=st.lists(st.text(max_size=12), max_size=2),
)
entries = st.lists(
    st.builds(
        Entry,
        pod_uid=uids,
        container=st.text(min_size=1, max_size=10),
        device_ids=ids,
        resource=st.sampled_from(["nvidia.com/gpu", "rdma/hca"]),
        resp=responses,
        numa=st.integers(min_value=-1, max_value=7),
    ),
    max_size=4,
)


@given(entries, st.sampled_from(["numa", "list"]))
def test_written_checkpoints_read_back(written: list[Entry], layout: str) -> None:
    cp = parse_checkpoint(json.dumps(checkpoint_doc(written, layout=layout)).encode())
    assert len(cp.entries) == len(written)
    for got, want in zip(cp.entries, written, strict=True):
        assert (got.pod_uid, got.container_name, got.resource_name) == (want.pod_uid, want.container, want.resource)
        assert got.device_ids == tuple(want.device_ids)
        assert got.devices_by_numa == {(want.numa if layout == "numa" else NO_TOPOLOGY): tuple(want.device_ids)}
        assert want.resp is not None and got.alloc_resp is not None
        assert dict(got.alloc_resp.envs) == dict(want.resp.envs)
        assert [d.container_path for d in got.alloc_resp.devices] == [d.container_path for d in want.resp.devices]
        assert [m.host_path for m in got.alloc_resp.mounts] == [m.host_path for m in want.resp.mounts]
        assert list(got.alloc_resp.cdi_devices) == [c.name for c in want.resp.cdi_devices]


# -- the reader ------------------------------------------------------------------------------------


def test_reader_missing_file_is_empty(tmp_path: Path) -> None:
    assert CheckpointReader(str(tmp_path / "absent")).read() == Checkpoint()


def test_reader_reparses_only_on_change(tmp_path: Path) -> None:
    path = tmp_path / "kubelet_internal_checkpoint"
    write_checkpoint(path, [Entry("p", "c", ["GPU-1"])])
    reader = CheckpointReader(str(path))
    first = reader.read()
    assert reader.read() is first
    write_checkpoint(path, [Entry("p", "c", ["GPU-1"]), Entry("q", "c", ["GPU-2"])])
    second = reader.read()
    assert len(second.entries) == 2
    path.unlink()
    assert reader.read() == Checkpoint()


def test_reader_retries_a_file_caught_mid_write(tmp_path: Path) -> None:
    path = tmp_path / "kubelet_internal_checkpoint"
    full = json.dumps(checkpoint_doc([Entry("p", "c", ["GPU-1"])])).encode()
    path.write_bytes(full[: len(full) // 2])
    sleeps: list[float] = []

    def writer_finishes(seconds: float) -> None:
        sleeps.append(seconds)
        path.write_bytes(full)

    cp = CheckpointReader(str(path), sleep=writer_finishes).read()
    assert [e.pod_uid for e in cp.entries] == ["p"]
    assert len(sleeps) == 1


def test_reader_reports_a_damaged_file(tmp_path: Path) -> None:
    path = tmp_path / "kubelet_internal_checkpoint"
    path.write_bytes(b'{"Data":[]}')
    with pytest.raises(CheckpointError, match="Data: expected an object"):
        CheckpointReader(str(path), sleep=lambda s: None).read()


def test_reader_reports_an_unreadable_path(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="Is a directory"):
        CheckpointReader(str(tmp_path)).read()


def test_reader_does_not_wait_again_for_a_known_bad_file(tmp_path: Path) -> None:
    path = tmp_path / "kubelet_internal_checkpoint"
    path.write_bytes(b"{")
    sleeps: list[float] = []
    reader = CheckpointReader(str(path), sleep=sleeps.append)
    for _ in range(3):
        with pytest.raises(CheckpointError, match="not valid JSON"):
            reader.read()
    assert len(sleeps) == 1
    write_checkpoint(path, [Entry("p", "c", ["GPU-1"])])
    assert [e.pod_uid for e in reader.read().entries] == ["p"]
