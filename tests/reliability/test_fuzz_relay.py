"""Malformed HTTP/2 at crihook's socket, from a raw socket: the offending connection is closed and
the daemon goes on serving everyone else, without an exception escaping the relay.

Named cases cover what the relay must judge itself (preface, header blocks, CONTINUATION order,
HPACK, padding); the hypothesis test sends arbitrary frame sequences, most of which the relay
forwards for containerd to judge. The normal suite runs hypothesis' default count; bench/fuzz.py
runs 10,000.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from hpack import Decoder
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from crihook.proto import runtime_v1_pb2 as api
from crihook.proto import runtime_v1_pb2_grpc as api_grpc
from crihook.proxy.frames import (
    ACK,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    PADDED,
    PREFACE,
    PRIORITY_FLAG,
    RST_STREAM,
    SETTINGS,
    frame,
)
from crihook.proxy.headers import MAX_HEADER_BLOCK
from crihook.proxy.hpack import encode_literal
from tests.support.containerd import Containerd
from tests.support.daemon import Crihook, running_crihook

pytestmark = pytest.mark.containerd

CLOSE_WITHIN = 10.0  # seconds; a connection still open after this counts as a hang
SETTINGS_EMPTY = frame(SETTINGS, 0, 0)


def request_headers(path: bytes) -> bytes:
    return encode_literal(
        [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", path),
            (b":authority", b"localhost"),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        ]
    )


@pytest.fixture(scope="module")
def proxy(containerd: Containerd, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Crihook]:
    with running_crihook(containerd.address, tmp_path_factory.mktemp("relayfuzz")) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def stub(proxy: Crihook) -> Iterator[api_grpc.RuntimeServiceStub]:
    with grpc.insecure_channel(proxy.address) as channel:
        yield api_grpc.RuntimeServiceStub(channel)


def send(proxy: Crihook, data: bytes, half_close: bool) -> tuple[bool, bytes]:
    """Send `data` on a fresh connection; (closed by the far end within CLOSE_WITHIN, bytes read)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(CLOSE_WITHIN)
    got = b""
    try:
        s.connect(str(proxy.socket_path))
        try:
            s.sendall(data)
            if half_close:
                s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            return True, got
        deadline = time.monotonic() + CLOSE_WITHIN
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                return True, got
            except TimeoutError:
                break
            if not chunk:
                return True, got
            got += chunk
        return False, got
    finally:
        s.close()


def still_serving(proxy: Crihook, stub: api_grpc.RuntimeServiceStub, log_from: int) -> None:
    """Another client is answered, and no exception escaped the relay since `log_from`."""
    assert stub.Version(api.VersionRequest(), timeout=10).runtime_name == "containerd"
    log = proxy.log_text()[log_from:].splitlines()
    assert not [line for line in log if "Traceback" in line or "Fatal error" in line], log[:20]


VERSION = b"/runtime.v1.RuntimeService/Version"
CREATE = b"/runtime.v1.RuntimeService/CreateContainer"

CASES = {
    "http/1.1 instead of the preface": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"x" * 64,
    "garbage preface": bytes(range(24)) * 2,
    "garbage frames": PREFACE + bytes(range(256)) * 8,
    "CONTINUATION without HEADERS": PREFACE + SETTINGS_EMPTY + frame(CONTINUATION, END_HEADERS, 1, b"\x82"),
    "CONTINUATION on another stream": PREFACE
    + frame(HEADERS, 0, 1, request_headers(VERSION)[:10])
    + frame(CONTINUATION, END_HEADERS, 3, b"\x82"),
    "header block over 1 MiB": PREFACE
    + frame(HEADERS, 0, 1, b"\x00" * 16000)
    + b"".join(frame(CONTINUATION, 0, 1, b"\x00" * 16000) for _ in range(MAX_HEADER_BLOCK // 16000 + 2)),
    "HPACK index out of range": PREFACE + SETTINGS_EMPTY + frame(HEADERS, END_HEADERS, 1, b"\xff\xff\xff\x7f"),
    "HPACK truncated string": PREFACE + SETTINGS_EMPTY + frame(HEADERS, END_HEADERS, 1, b"\x00\x7f"),
    "padding longer than the frame": PREFACE + SETTINGS_EMPTY + frame(HEADERS, END_HEADERS | PADDED, 1, b"\xff\x82"),
    "padded HEADERS with no payload": PREFACE + SETTINGS_EMPTY + frame(HEADERS, END_HEADERS | PADDED, 1),
    "priority flag on a short HEADERS": PREFACE
    + SETTINGS_EMPTY
    + frame(HEADERS, END_HEADERS | PRIORITY_FLAG, 1, b"\x00"),
    "frame length past 16 MiB": PREFACE + SETTINGS_EMPTY + b"\xff\xff\xff\x00\x00\x00\x00\x00\x01" + b"\x00" * 1024,
}


@pytest.mark.parametrize(
    "case",
    sorted(CASES),
)
def test_malformed_connection_is_closed(containerd: Containerd, tmp_path: Path, case: str) -> None:
    with running_crihook(containerd.address, tmp_path) as proxy, grpc.insecure_channel(proxy.address) as channel:
        closed, _ = send(proxy, CASES[case], half_close=False)
        assert closed, f"{case}: connection left open"
        still_serving(proxy, api_grpc.RuntimeServiceStub(channel), 0)


@dataclass
class Answer:
    """What came back on one stream: its header blocks (response headers and trailers) merged."""

    headers: dict[bytes, bytes] = field(default_factory=dict)
    body: bytes = b""
    ended: bool = False
    reset: int | None = None  # RST_STREAM's error code


def grpc_body(message: Any) -> bytes:
    """A gRPC message as it travels in DATA: not compressed, its length, its bytes."""
    raw = message.SerializeToString()
    return b"\x00" + len(raw).to_bytes(4, "big") + raw


def answers(s: socket.socket, streams: tuple[int, ...]) -> tuple[dict[int, Answer], bool]:
    """Read the connection until each of `streams` has ended (END_STREAM or RST_STREAM), acknowledging
    the far end's SETTINGS (RFC 9113 §6.5.3); header blocks are decoded with the hpack library, not
    the relay's follower. Returns the answers and whether the far end closed or sent GOAWAY first."""
    decoder = Decoder()
    out = {sid: Answer() for sid in streams}
    buf, block = b"", b""
    deadline = time.monotonic() + CLOSE_WITHIN
    while True:
        while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
            length, ftype, flags = int.from_bytes(buf[:3], "big"), buf[3], buf[4]
            sid = int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF
            payload, buf = buf[9 : 9 + length], buf[9 + length :]
            answer = out.get(sid)
            if ftype == GOAWAY:
                return out, True
            if ftype == SETTINGS and not flags & ACK:
                s.sendall(frame(SETTINGS, ACK, 0))
            elif ftype in (HEADERS, CONTINUATION):
                if ftype == HEADERS and flags & PADDED:
                    payload = payload[1 : len(payload) - payload[0]]
                if ftype == HEADERS and flags & PRIORITY_FLAG:
                    payload = payload[5:]
                block += payload
                if flags & END_HEADERS:
                    headers = dict(decoder.decode(block, raw=True))
                    block = b""
                    if answer is not None:
                        answer.headers.update(headers)
            elif ftype == DATA and answer is not None:
                answer.body += payload
            elif ftype == RST_STREAM and answer is not None:
                answer.reset, answer.ended = int.from_bytes(payload, "big"), True
            if answer is not None and ftype in (HEADERS, DATA) and flags & END_STREAM:
                answer.ended = True
        if all(a.ended for a in out.values()):
            return out, False
        s.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            chunk = s.recv(65536)
        except (ConnectionResetError, TimeoutError):
            return out, True
        if not chunk:
            return out, True
        buf += chunk


def test_intercepted_call_with_broken_grpc_framing_fails_only_that_stream(
    proxy: Crihook, stub: api_grpc.RuntimeServiceStub
) -> None:
    """A CreateContainer body whose gRPC length prefix lies, between two Version calls and beside a
    well-formed CreateContainer on the same connection: that stream alone is refused with its
    grpc-status, the others get containerd's answers, and the connection and the daemon stay up."""
    version = grpc_body(api.VersionRequest(version="v1"))
    create = grpc_body(
        api.CreateContainerRequest(
            pod_sandbox_id="no-such-sandbox",
            config=api.ContainerConfig(metadata=api.ContainerMetadata(name="c"), image=api.ImageSpec(image="x")),
            sandbox_config=api.PodSandboxConfig(metadata=api.PodSandboxMetadata(name="p", namespace="ns", uid="u")),
        )
    )
    calls = {
        1: (VERSION, version),
        3: (CREATE, b"\x00\x00\x00\x00\x10" + b"\x0a\x01x"),
        5: (CREATE, create),
        7: (VERSION, version),
    }
    data = PREFACE + SETTINGS_EMPTY
    for sid, (path, body) in calls.items():
        data += frame(HEADERS, END_HEADERS, sid, request_headers(path)) + frame(DATA, END_STREAM, sid, body)
    log_from = len(proxy.log_text())
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(proxy.socket_path))
        s.sendall(data)
        got, closed = answers(s, tuple(calls))
    assert not closed, f"the connection went before every stream ended: {got}"
    bad = got[3]
    assert bad.headers.get(b"grpc-status") == b"%d" % grpc.StatusCode.UNIMPLEMENTED.value[0], bad
    assert b"malformed" in bad.headers.get(b"grpc-message", b""), bad
    for sid in (1, 7):
        assert got[sid].headers.get(b"grpc-status") == b"0", got[sid]
        assert api.VersionResponse.FromString(got[sid].body[5:]).runtime_name == "containerd"
    # containerd's own refusal of the well-formed call: the sandbox does not exist
    assert got[5].reset is None and got[5].headers.get(b"grpc-status") == b"%d" % grpc.StatusCode.NOT_FOUND.value[0], (
        got[5]
    )
    still_serving(proxy, stub, log_from)


frames = st.builds(
    frame,
    st.integers(0, 12),  # the ten HTTP/2 frame types and a few unknown ones
    st.integers(0, 255),
    st.sampled_from([0, 1, 3, 5]) | st.integers(0, 2**31 - 1),
    st.binary(max_size=64) | st.builds(request_headers, st.sampled_from([VERSION, CREATE, b"/x"])),
)
connections = st.tuples(
    st.sampled_from([PREFACE, PREFACE + SETTINGS_EMPTY, b""]) | st.binary(max_size=30),
    st.lists(frames, max_size=8),
    st.binary(max_size=12),  # a trailing partial frame
).map(lambda t: t[0] + b"".join(t[1]) + t[2])


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(connections)
def test_arbitrary_frames(proxy: Crihook, stub: api_grpc.RuntimeServiceStub, data: bytes) -> None:
    log_from = len(proxy.log_text())
    closed, got = send(proxy, data, half_close=True)
    event("answered before closing" if got else "closed without an answer")
    assert closed, "connection left open after the client finished sending"
    still_serving(proxy, stub, log_from)
