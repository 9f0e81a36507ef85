"""The CRI method table, read from the compiled descriptors rather than kept by hand, so it can never
drift from runtime_v1.proto: every full gRPC path of runtime.v1's two services, and which of them
stream their responses."""

from __future__ import annotations

from crihook.proto import runtime_v1_pb2

_SERVICES = ("RuntimeService", "ImageService")


def _paths(streaming: bool | None) -> tuple[str, ...]:
    out = []
    for name in _SERVICES:
        service = runtime_v1_pb2.DESCRIPTOR.services_by_name[name]
        for m in service.methods:
            if streaming is None or m.server_streaming == streaming:
                out.append(f"/{service.full_name}/{m.name}")
    return tuple(out)


METHODS: tuple[str, ...] = _paths(None)
SERVER_STREAMING: frozenset[str] = frozenset(_paths(True))
