"""NRI's api.proto and ttrpc's envelope as crihook wrote them: the names and numbers that reach the
wire are those of containerd/nri (pkg/api/api.proto, v0.6.1 through v0.12) and containerd/ttrpc
(request.proto), checked here against bytes encoded by hand from the published field numbers."""

from __future__ import annotations

import pytest
from google.protobuf.descriptor import Descriptor

from crihook.proto import generate, ttrpc_pb2, wire
from crihook.proto import nri_v1alpha1_pb2 as nri

PACKAGE = "nri.pkg.api.v1alpha1"

# method -> (request, response) message names, per service
RUNTIME = {
    "RegisterPlugin": ("RegisterPluginRequest", "Empty"),
    "UpdateContainers": ("UpdateContainersRequest", "UpdateContainersResponse"),
}
PLUGIN = {
    "Configure": ("ConfigureRequest", "ConfigureResponse"),
    "Synchronize": ("SynchronizeRequest", "SynchronizeResponse"),
    "Shutdown": ("Empty", "Empty"),
    "StateChange": ("StateChangeEvent", "Empty"),
    "ValidateContainerAdjustment": ("ValidateContainerAdjustmentRequest", "ValidateContainerAdjustmentResponse"),
    **{
        m: (f"{m}Request", f"{m}Response")
        for m in (
            "RunPodSandbox",
            "UpdatePodSandbox",
            "PostUpdatePodSandbox",
            "StopPodSandbox",
            "RemovePodSandbox",
            "CreateContainer",
            "PostCreateContainer",
            "StartContainer",
            "PostStartContainer",
            "UpdateContainer",
            "PostUpdateContainer",
            "StopContainer",
            "RemoveContainer",
        )
    },
}

# message -> {field: number}, for every field crihook reads or writes
FIELDS = {
    "RegisterPluginRequest": {"plugin_name": 1, "plugin_idx": 2, "NRI_version": 3},
    "UpdateContainersRequest": {"update": 1, "evict": 2},
    "UpdateContainersResponse": {"failed": 1},
    "ConfigureRequest": {
        "config": 1,
        "runtime_name": 2,
        "runtime_version": 3,
        "registration_timeout": 4,
        "request_timeout": 5,
        "NRI_version": 6,
    },
    "ConfigureResponse": {"events": 2},
    "SynchronizeRequest": {"pods": 1, "containers": 2, "more": 3},
    "SynchronizeResponse": {"update": 1, "more": 2},
    "CreateContainerRequest": {"pod": 1, "container": 2},
    "CreateContainerResponse": {"adjust": 1, "update": 2, "evict": 3},
    "UpdateContainerRequest": {"pod": 1, "container": 2, "linux_resources": 3},
    "UpdateContainerResponse": {"update": 1, "evict": 2},
    "StopContainerRequest": {"pod": 1, "container": 2},
    "StopContainerResponse": {"update": 1},
    "StateChangeEvent": {"event": 1, "pod": 2, "container": 3},
    "PodSandbox": {
        "id": 1,
        "name": 2,
        "uid": 3,
        "namespace": 4,
        "labels": 5,
        "annotations": 6,
        "runtime_handler": 7,
        "linux": 8,
        "pid": 9,
        "ips": 10,
    },
    "Container": {
        "id": 1,
        "pod_sandbox_id": 2,
        "name": 3,
        "state": 4,
        "labels": 5,
        "annotations": 6,
        "args": 7,
        "env": 8,
        "mounts": 9,
        "hooks": 10,
        "linux": 11,
        "pid": 12,
        "rlimits": 13,
        "created_at": 14,
        "started_at": 15,
        "finished_at": 16,
        "exit_code": 17,
        "status_reason": 18,
        "status_message": 19,
        "CDI_devices": 20,
        "user": 21,
        "image": 22,
    },
    "LinuxContainer": {"namespaces": 1, "devices": 2, "resources": 3, "oom_score_adj": 4, "cgroups_path": 5},
    "ContainerAdjustment": {
        "annotations": 2,
        "mounts": 3,
        "env": 4,
        "hooks": 5,
        "linux": 6,
        "rlimits": 7,
        "CDI_devices": 8,
        "args": 9,
    },
    "LinuxContainerAdjustment": {"devices": 1, "resources": 2, "cgroups_path": 3, "oom_score_adj": 4},
    "Mount": {"destination": 1, "type": 2, "source": 3, "options": 4},
    "LinuxDevice": {"path": 1, "type": 2, "major": 3, "minor": 4, "file_mode": 5, "uid": 6, "gid": 7},
    "CDIDevice": {"name": 1},
    "KeyValue": {"key": 1, "value": 2},
    "ContainerUpdate": {"container_id": 1, "linux": 2, "ignore_failure": 3},
    "ContainerEviction": {"container_id": 1, "reason": 2},
}

EVENTS = {
    "UNKNOWN": 0,
    "RUN_POD_SANDBOX": 1,
    "STOP_POD_SANDBOX": 2,
    "REMOVE_POD_SANDBOX": 3,
    "CREATE_CONTAINER": 4,
    "POST_CREATE_CONTAINER": 5,
    "START_CONTAINER": 6,
    "POST_START_CONTAINER": 7,
    "UPDATE_CONTAINER": 8,
    "POST_UPDATE_CONTAINER": 9,
    "STOP_CONTAINER": 10,
    "REMOVE_CONTAINER": 11,
    "UPDATE_POD_SANDBOX": 12,
    "POST_UPDATE_POD_SANDBOX": 13,
    "VALIDATE_CONTAINER_ADJUSTMENT": 14,
    "LAST": 15,
}


def message(name: str) -> Descriptor:
    return nri.DESCRIPTOR.message_types_by_name[name]


@pytest.mark.parametrize(("service", "methods"), [("Runtime", RUNTIME), ("Plugin", PLUGIN)])
def test_services_and_their_methods(service: str, methods: dict[str, tuple[str, str]]) -> None:
    desc = nri.DESCRIPTOR.services_by_name[service]
    assert desc.full_name == f"{PACKAGE}.{service}"
    got = {m.name: (m.input_type.name, m.output_type.name) for m in desc.methods}
    assert got == methods
    assert not any(m.client_streaming or m.server_streaming for m in desc.methods)


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_field_numbers(name: str) -> None:
    fields = {f.name: f.number for f in message(name).fields}
    assert {k: fields.get(k) for k in FIELDS[name]} == FIELDS[name]


def test_event_numbers() -> None:
    assert {v.name: v.number for v in nri.Event.DESCRIPTOR.values} == EVENTS


def test_no_grpc_stubs_for_a_ttrpc_service() -> None:
    assert "nri_v1alpha1.proto" in generate.TTRPC
    assert not (generate.PROTO_DIR / "nri_v1alpha1_pb2_grpc.py").exists()


def test_a_create_container_request_as_the_runtime_encodes_it() -> None:
    pod = wire.length_delimited(1, b"pod-id") + wire.length_delimited(4, b"default")
    pod += wire.length_delimited(6, wire.length_delimited(1, b"k") + wire.length_delimited(2, b"v"))  # a map entry
    ctr = wire.length_delimited(1, b"ctr-id") + wire.uint(4, 1) + wire.length_delimited(8, b"A=1")
    raw = wire.length_delimited(1, pod) + wire.length_delimited(2, ctr)
    req = nri.CreateContainerRequest.FromString(raw)
    assert (req.pod.id, req.pod.namespace, dict(req.pod.annotations)) == ("pod-id", "default", {"k": "v"})
    assert (req.container.id, req.container.state, list(req.container.env)) == (
        "ctr-id",
        nri.CONTAINER_CREATED,
        ["A=1"],
    )


def test_an_adjustment_encodes_as_the_runtime_reads_it() -> None:
    adjust = nri.ContainerAdjustment(env=[nri.KeyValue(key="-NVIDIA_VISIBLE_DEVICES")])
    adjust.CDI_devices.add(name="nvidia.com/gpu=0")
    want = wire.length_delimited(4, wire.length_delimited(1, b"-NVIDIA_VISIBLE_DEVICES"))
    want += wire.length_delimited(8, wire.length_delimited(1, b"nvidia.com/gpu=0"))
    assert nri.CreateContainerResponse(adjust=adjust).SerializeToString() == wire.length_delimited(1, want)


def test_ttrpc_envelope_numbers() -> None:
    req = ttrpc_pb2.Request(service=f"{PACKAGE}.Plugin", method="Configure", payload=b"\x01", timeout_nano=5)
    req.metadata.add(key="k", value="v")
    want = wire.length_delimited(1, f"{PACKAGE}.Plugin".encode()) + wire.length_delimited(2, b"Configure")
    want += wire.length_delimited(3, b"\x01") + wire.uint(4, 5)
    want += wire.length_delimited(5, wire.length_delimited(1, b"k") + wire.length_delimited(2, b"v"))
    assert req.SerializeToString() == want


def test_status_has_google_rpc_status_bytes() -> None:
    """ttrpc.Status stands in for google.rpc.Status {int32 code = 1; string message = 2; ...}."""
    resp = ttrpc_pb2.Response(status=ttrpc_pb2.Status(code=12, message="no"), payload=b"p")
    status = wire.uint(1, 12) + wire.length_delimited(2, b"no")
    assert resp.SerializeToString() == wire.length_delimited(1, status) + wire.length_delimited(2, b"p")
