"""The kubelet plugin protos (DRA v1, v1beta1, plugin registration) have the names and field numbers
kubelet sends and expects: a wrong package or number would fail only against a real kubelet."""

from __future__ import annotations

import pytest
from google.protobuf.descriptor import FileDescriptor

from crihook.proto import dra_v1_pb2, dra_v1beta1_pb2, pluginregistration_v1_pb2


@pytest.mark.parametrize(("module", "version"), [(dra_v1_pb2, "v1"), (dra_v1beta1_pb2, "v1beta1")])
def test_dra_service_and_fields(module: object, version: str) -> None:
    desc: FileDescriptor = module.DESCRIPTOR  # type: ignore[attr-defined]
    service = desc.services_by_name["DRAPlugin"]
    assert service.full_name == f"k8s.io.kubelet.pkg.apis.dra.{version}.DRAPlugin"
    assert {m.name for m in service.methods} == {"NodePrepareResources", "NodeUnprepareResources"}
    claim = desc.message_types_by_name["Claim"]
    assert {f.name: f.number for f in claim.fields} == {"namespace": 1, "uid": 2, "name": 3}
    device = {f.name: f.number for f in desc.message_types_by_name["Device"].fields}
    want = {"request_names": 1, "pool_name": 2, "device_name": 3, "cdi_device_ids": 4}
    assert device == (want | {"share_id": 5} if version == "v1" else want)
    prepared = desc.message_types_by_name["NodePrepareResourceResponse"]
    assert {f.name: f.number for f in prepared.fields} == {"devices": 1, "error": 2}


def test_registration_service_and_fields() -> None:
    desc = pluginregistration_v1_pb2.DESCRIPTOR
    service = desc.services_by_name["Registration"]
    assert service.full_name == "pluginregistration.Registration"
    assert {m.name for m in service.methods} == {"GetInfo", "NotifyRegistrationStatus"}
    info = desc.message_types_by_name["PluginInfo"]
    assert {f.name: f.number for f in info.fields} == {
        "type": 1,
        "name": 2,
        "endpoint": 3,
        "supported_versions": 4,
    }
    status = desc.message_types_by_name["RegistrationStatus"]
    assert {f.name: f.number for f in status.fields} == {"plugin_registered": 1, "error": 2}
