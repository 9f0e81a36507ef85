"""The committed generated code matches the .proto sources, and the CRI schema has the properties the
proxy relies on: unknown fields survive a decode/encode, env bytes need not be UTF-8, and every RPC
has the streaming shape kubelet and containerd use."""

from __future__ import annotations

import shutil
from pathlib import Path

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor

from crihook.proto import generate, wire
from crihook.proto import runtime_v1_pb2 as cri
from crihook.proto import runtime_v1_pb2_grpc as cri_grpc

# Server-streaming methods of runtime.v1 (GetContainerEvents and the KEP-5825 list streams); the
# rest are unary. No CRI method streams from the client.
SERVER_STREAMING = {
    "RuntimeService": {
        "GetContainerEvents",
        "StreamPodSandboxes",
        "StreamContainers",
        "StreamContainerStats",
        "StreamPodSandboxStats",
        "StreamPodSandboxMetrics",
    },
    "ImageService": {"StreamImages"},
}
UNARY = {
    "RuntimeService": {
        "Version",
        "RunPodSandbox",
        "StopPodSandbox",
        "RemovePodSandbox",
        "PodSandboxStatus",
        "ListPodSandbox",
        "CreateContainer",
        "StartContainer",
        "StopContainer",
        "RemoveContainer",
        "ListContainers",
        "ContainerStatus",
        "UpdateContainerResources",
        "ReopenContainerLog",
        "ExecSync",
        "Exec",
        "Attach",
        "PortForward",
        "ContainerStats",
        "ListContainerStats",
        "PodSandboxStats",
        "ListPodSandboxStats",
        "UpdateRuntimeConfig",
        "Status",
        "CheckpointContainer",
        "ListMetricDescriptors",
        "ListPodSandboxMetrics",
        "RuntimeConfig",
        "UpdatePodSandboxResources",
    },
    "ImageService": {"ListImages", "ImageStatus", "PullImage", "RemoveImage", "ImageFsInfo"},
}


def unknown_field(number: int, payload: bytes) -> bytes:
    """A length-delimited field the schema does not know, as a newer kubelet might send it."""
    return wire.length_delimited(number, payload)


# -- generated code in step with the sources ------------------------------------------------------


def test_committed_generated_code_matches_the_protos() -> None:
    stale = generate.stale()
    assert not stale, f"stale generated code: {', '.join(stale)}; run `python proto/generate.py`"


def test_every_proto_has_its_generated_modules() -> None:
    for proto in generate.sources():
        assert (generate.PROTO_DIR / f"{proto.stem}_pb2.py").is_file(), proto.name
        assert (generate.PROTO_DIR / f"{proto.stem}_pb2.pyi").is_file(), proto.name


@pytest.fixture
def proto_copy(tmp_path: Path) -> Path:
    """proto/ sources and generated files, copied so the check can be tried on altered sources."""
    for p in generate.PROTO_DIR.iterdir():
        if p.suffix == ".proto" or p.name.endswith(generate.SUFFIXES):
            shutil.copy(p, tmp_path / p.name)
    return tmp_path


def test_check_names_the_files_of_a_changed_proto(proto_copy: Path) -> None:
    assert generate.stale(proto_copy) == []
    src = proto_copy / "runtime_v1.proto"
    src.write_text(src.read_text().replace("message GetEventsRequest {}", "message GetEventsRequest { bool x = 1; }"))
    assert generate.stale(proto_copy) == ["runtime_v1_pb2.py", "runtime_v1_pb2.pyi"]


def test_check_names_missing_and_orphaned_files(proto_copy: Path) -> None:
    (proto_copy / "hookservice_v1alpha1_pb2_grpc.py").unlink()
    (proto_copy / "deviceplugin_v1beta1.proto").unlink()
    assert generate.stale(proto_copy) == [
        "deviceplugin_v1beta1_pb2.py",
        "deviceplugin_v1beta1_pb2.pyi",
        "hookservice_v1alpha1_pb2_grpc.py",
    ]


def test_imports_between_protos_are_package_imports(tmp_path: Path) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    (src / "base.proto").write_text('syntax = "proto3";\npackage t;\nmessage A { string s = 1; }\n')
    (src / "user.proto").write_text(
        'syntax = "proto3";\npackage t;\nimport "base.proto";\nimport "google/protobuf/empty.proto";\n'
        "message B { A a = 1; }\nservice S { rpc Get(google.protobuf.Empty) returns (B) {} }\n"
    )
    written = sorted(p.name for p in generate.generate(out, src))
    # base.proto has no service: no _pb2_grpc.py for it
    assert written == ["base_pb2.py", "base_pb2.pyi", "user_pb2.py", "user_pb2.pyi", "user_pb2_grpc.py"]
    assert sorted(p.name for p in out.iterdir()) == written
    user_py = (out / "user_pb2.py").read_text()
    assert "from crihook.proto import base_pb2 as base__pb2" in user_py
    assert "from google.protobuf import empty_pb2" in user_py  # well-known types stay where they are
    assert "from crihook.proto import base_pb2 as _base_pb2" in (out / "user_pb2.pyi").read_text()
    assert "from crihook.proto import user_pb2 as user__pb2" in (out / "user_pb2_grpc.py").read_text()
    for path in out.iterdir():
        assert "\nimport base_pb2" not in path.read_text() and "\nimport user_pb2" not in path.read_text()


def test_a_ttrpc_service_gets_no_grpc_stubs(tmp_path: Path) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    (ttrpc_proto,) = generate.TTRPC
    service = 'syntax = "proto3";\npackage t;\nmessage A {}\nservice S { rpc Get(A) returns (A); }\n'
    (src / ttrpc_proto).write_text(service)
    (src / "grpc.proto").write_text(service.replace("package t;", "package g;"))
    written = sorted(p.name for p in generate.generate(out, src))
    stem = ttrpc_proto.removesuffix(".proto")
    assert written == ["grpc_pb2.py", "grpc_pb2.pyi", "grpc_pb2_grpc.py", f"{stem}_pb2.py", f"{stem}_pb2.pyi"]
    assert sorted(p.name for p in out.iterdir()) == written


def test_protoc_errors_name_the_file(tmp_path: Path) -> None:
    (tmp_path / "bad.proto").write_text('syntax = "proto3";\nmessage M { strin x = 1; }\n')
    with pytest.raises(generate.GenerateError, match=r"bad\.proto"):
        generate.generate(tmp_path / "out", tmp_path)


def test_check_command_exit_status(proto_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert generate.main(["--check"], proto_copy) == 0
    (proto_copy / "runtime_v1_pb2.pyi").write_text("")
    assert generate.main(["--check"], proto_copy) == 1
    assert capsys.readouterr().out == f"stale: {proto_copy.name}/runtime_v1_pb2.pyi\n"


def test_generate_command_rewrites_stale_and_removes_orphaned_files(proto_copy: Path) -> None:
    (proto_copy / "runtime_v1_pb2.pyi").write_text("")
    (proto_copy / "gone_pb2.py").write_text("")  # its .proto was deleted
    assert generate.main([], proto_copy) == 0
    assert not (proto_copy / "gone_pb2.py").exists()
    assert generate.stale(proto_copy) == []


# -- wire behaviour the proxy relies on ------------------------------------------------------------


def test_unknown_fields_survive_decode_and_encode() -> None:
    req = cri.CreateContainerRequest(
        pod_sandbox_id="p-1",
        config=cri.ContainerConfig(metadata=cri.ContainerMetadata(name="main"), image=cri.ImageSpec(image="busybox")),
    )
    extra = unknown_field(99, b"from a newer kubelet")
    wire = req.SerializeToString() + extra

    decoded = cri.CreateContainerRequest.FromString(wire)
    assert decoded.pod_sandbox_id == "p-1" and decoded.config.metadata.name == "main"
    assert decoded.SerializeToString() == wire

    # a hook edits a known field: the unknown one still goes out
    decoded.config.envs.add(key=b"A", value=b"1")
    again = cri.CreateContainerRequest.FromString(decoded.SerializeToString())
    assert extra in again.SerializeToString()
    assert [(kv.key, kv.value) for kv in again.config.envs] == [(b"A", b"1")]


def test_unknown_fields_inside_nested_messages_survive() -> None:
    cfg = cri.ContainerConfig(metadata=cri.ContainerMetadata(name="main")).SerializeToString()
    nested_extra = unknown_field(1000, b"new container field")
    config_field = wire.length_delimited(2, cfg + nested_extra)
    raw = cri.CreateContainerRequest(pod_sandbox_id="p").SerializeToString() + config_field

    decoded = cri.CreateContainerRequest.FromString(raw)
    decoded.config.working_dir = "/w"
    assert nested_extra in decoded.config.SerializeToString()


def test_env_bytes_need_not_be_utf8() -> None:
    raw = b"\xff\xfe not utf-8"
    wire = cri.ContainerConfig(envs=[cri.KeyValue(key=b"K\xc3", value=raw)]).SerializeToString()
    (kv,) = cri.ContainerConfig.FromString(wire).envs
    assert (kv.key, kv.value) == (b"K\xc3", raw)


def test_key_value_is_wire_compatible_with_string_fields() -> None:
    """Upstream declares KeyValue's fields `string`; the bytes are identical either way."""
    kv = cri.KeyValue.DESCRIPTOR
    assert [(f.name, f.number, f.type) for f in kv.fields] == [
        ("key", 1, FieldDescriptor.TYPE_BYTES),
        ("value", 2, FieldDescriptor.TYPE_BYTES),
    ]
    as_bytes = cri.KeyValue(key=b"PATH", value=b"/bin").SerializeToString()
    # what a string-typed encoder writes: tag (1, LEN) "PATH", tag (2, LEN) "/bin"
    assert as_bytes == b"\x0a\x04PATH\x12\x04/bin"


# -- services --------------------------------------------------------------------------------------


@pytest.mark.parametrize("service", ["RuntimeService", "ImageService"])
def test_service_methods_and_streaming_flags(service: str) -> None:
    desc = cri.DESCRIPTOR.services_by_name[service]
    assert desc.full_name == f"runtime.v1.{service}"
    methods = {m.name: m for m in desc.methods}
    assert set(methods) == UNARY[service] | SERVER_STREAMING[service]
    for name, m in methods.items():
        assert not m.client_streaming, name
        assert m.server_streaming == (name in SERVER_STREAMING[service]), name


def test_list_streams_mirror_their_unary_list() -> None:
    """Each KEP-5825 stream takes the unary list's filter and returns repeated items of its type."""
    pairs = {
        "StreamPodSandboxes": "ListPodSandbox",
        "StreamContainers": "ListContainers",
        "StreamContainerStats": "ListContainerStats",
        "StreamPodSandboxStats": "ListPodSandboxStats",
        "StreamPodSandboxMetrics": "ListPodSandboxMetrics",
        "StreamImages": "ListImages",
    }
    methods = {m.name: m for s in cri.DESCRIPTOR.services_by_name.values() for m in s.methods}
    for stream, unary in pairs.items():
        s, u = methods[stream], methods[unary]
        assert [(f.name, f.message_type) for f in s.input_type.fields] == [
            (f.name, f.message_type) for f in u.input_type.fields
        ], stream
        (s_out,), (u_out,) = s.output_type.fields, u.output_type.fields
        assert s_out.is_repeated and u_out.is_repeated, stream
        assert s_out.message_type is u_out.message_type, stream


class _RecordingChannel:
    """Records which kind of call each stub method was built with."""

    def __init__(self) -> None:
        self.kinds: dict[str, str] = {}

    def _record(self, kind: str):
        def build(path: str, **_: object) -> None:
            self.kinds[path] = kind

        return build

    def __getattr__(self, name: str):
        if name in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            return self._record(name)
        raise AttributeError(name)


@pytest.mark.parametrize(
    ("service", "stub"), [("RuntimeService", cri_grpc.RuntimeServiceStub), ("ImageService", cri_grpc.ImageServiceStub)]
)
def test_grpc_stubs_agree_with_the_descriptors(service: str, stub: type) -> None:
    channel = _RecordingChannel()
    stub(channel)
    want = {f"/runtime.v1.{service}/{m}": "unary_unary" for m in UNARY[service]}
    want |= {f"/runtime.v1.{service}/{m}": "unary_stream" for m in SERVER_STREAMING[service]}
    assert channel.kinds == want


def test_servicers_register_every_method() -> None:
    registered: dict[str, dict[str, grpc.RpcMethodHandler]] = {}

    class Server:
        def add_generic_rpc_handlers(self, _: object) -> None:
            pass

        def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
            registered[service] = handlers

    cri_grpc.add_RuntimeServiceServicer_to_server(cri_grpc.RuntimeServiceServicer(), Server())
    cri_grpc.add_ImageServiceServicer_to_server(cri_grpc.ImageServiceServicer(), Server())
    assert set(registered) == {"runtime.v1.RuntimeService", "runtime.v1.ImageService"}
    for service in ("RuntimeService", "ImageService"):
        handlers = registered[f"runtime.v1.{service}"]
        assert set(handlers) == UNARY[service] | SERVER_STREAMING[service]
        for name, h in handlers.items():
            assert h.response_streaming == (name in SERVER_STREAMING[service]), name
            assert not h.request_streaming, name
