"""Kubelet's DRA manager checkpoint: the layout pkg/kubelet/cm/dra/state writes (the claim list as
JSON text inside `Data`), claims indexed by pod, every driver's CDI devices, and the file edge."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from crihook.devices.draclaims import ClaimsError, ClaimsReader, parse_claims

POD = "139cdb46-f989-4f17-9561-ca10cfb509a6"


def checkpoint(*claims: dict[str, object]) -> bytes:
    data = {"kind": "DRACheckpoint", "apiVersion": "checkpoint.dra.kubelet.k8s.io/v1", "ClaimInfoStateList": claims}
    return json.dumps({"Data": json.dumps(data), "Checksum": 1}).encode()


def claim(uid: str, pods: list[str], **drivers: list[list[str] | None]) -> dict[str, object]:
    return {
        "ClaimUID": uid,
        "ClaimName": f"claim-{uid}",
        "Namespace": "default",
        "PodUIDs": {p: {} for p in pods},
        "DriverState": {
            d: {
                "Devices": [
                    {"PoolName": "node", "DeviceName": f"gpu{i}", "CDIDeviceIDs": ids} for i, ids in enumerate(devs)
                ]
            }
            for d, devs in drivers.items()
        },
    }


def test_claims_by_pod() -> None:
    claims = parse_claims(
        checkpoint(
            claim("c1", [POD], **{"gpu.nvidia.com": [["k8s.gpu.nvidia.com/claim=c1-gpu0"], None]}),
            claim("c2", [POD, "other"], **{"net.example.com": [["example.com/net=eth1", "example.com/net=eth2"]]}),
        )
    )
    assert [c.name for c in claims.for_pod(POD)] == ["claim-c1", "claim-c2"]
    assert claims.cdi_devices(POD) == {
        "k8s.gpu.nvidia.com/claim=c1-gpu0",
        "example.com/net=eth1",
        "example.com/net=eth2",
    }
    assert claims.cdi_devices("other") == {"example.com/net=eth1", "example.com/net=eth2"}
    assert claims.cdi_devices("nobody") == frozenset()


@pytest.mark.parametrize(
    ("data", "where"),
    [
        (b"{", "Data"),
        (json.dumps({"Data": json.dumps({"ClaimInfoStateList": {}})}).encode(), "Data.ClaimInfoStateList"),
        (checkpoint({"ClaimUID": 7}), "Data.ClaimInfoStateList[0].ClaimUID"),
    ],
)
def test_a_bad_file_names_the_field(data: bytes, where: str) -> None:
    with pytest.raises(ClaimsError) as err:
        parse_claims(data)
    assert err.value.where == where


def test_reader(tmp_path: Path) -> None:
    path = tmp_path / "dra_manager_state"
    reader = ClaimsReader(str(path))
    assert reader.read().claims == ()  # kubelet has prepared nothing yet
    path.write_bytes(checkpoint(claim("c1", [POD], d=[["a.com/b=c"]])))
    assert reader.read().cdi_devices(POD) == {"a.com/b=c"}
    path.write_bytes(b"[]x")
    with pytest.raises(ClaimsError):
        reader.read()


def test_the_requests_each_device_serves() -> None:
    doc = claim("c1", [POD], d=[["a.com/b=c1-gpu-0"], ["a.com/b=c1-gpu-1"]])
    for i, dev in enumerate(doc["DriverState"]["d"]["Devices"]):  # type: ignore[index]
        dev["RequestNames"] = [f"r{i}"]
    (got,) = parse_claims(checkpoint(doc)).claims
    assert got.requests_of("a.com/b=c1-gpu-1") == ("r1",) and got.requests_of("x") == ()
    doc["DriverState"]["d"]["Devices"][0]["RequestNames"] = "r0"  # type: ignore[index]
    with pytest.raises(ClaimsError, match="RequestNames"):
        parse_claims(checkpoint(doc))
