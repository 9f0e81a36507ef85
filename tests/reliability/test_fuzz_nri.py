"""NRI mode's wire under fuzzing: the ttrpc and multiplexer decoders fed arbitrary bytes, and the
plugin stub fed, after its handshake, any mix of well-formed calls with arbitrary contents, broken
frames and noise by a runtime played by the test (tests/nri/fakeruntime.py). The decoders yield
frames or their own error, nothing else; the plugin answers what it can, drops a connection that
stops making sense, dials again, and its run() never raises. The normal suite runs hypothesis'
default count; bench/fuzz.py runs 10,000."""

from __future__ import annotations

import asyncio
import struct
import tempfile
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from crihook.nri import mux, ttrpc
from crihook.nri.stub import Plugin
from crihook.nri.ttrpc import Frame, MessageType
from crihook.proto import ttrpc_pb2
from tests.nri.fakeruntime import FakeRuntime
from tests.nri.test_framing import splits
from tests.nri.test_stub import Recorder, running

cuts = st.lists(st.integers(0, 400), max_size=10)


@given(st.binary(max_size=200), cuts)
def test_fuzz_ttrpc_decoder(noise: bytes, pieces: list[int]) -> None:
    """Frames that re-encode to a prefix of the input, or FrameError; never more held than given."""
    dec = ttrpc.Decoder()
    got: list[Frame] = []
    try:
        for piece in splits(noise, pieces):
            got += dec.feed(piece)
    except ttrpc.FrameError:
        pass
    consumed = b"".join(map(ttrpc.encode, got))
    assert noise.startswith(consumed)
    assert dec.buffered <= len(noise) - len(consumed)


@given(st.binary(max_size=200), cuts)
def test_fuzz_mux_decoder(noise: bytes, pieces: list[int]) -> None:
    dec = mux.Decoder()
    got: list[tuple[int, bytes]] = []
    try:
        for piece in splits(noise, pieces):
            got += dec.feed(piece)
    except mux.MuxError:
        pass
    consumed = b"".join(struct.pack(">II", c, len(p)) + p for c, p in got)
    assert noise.startswith(consumed)
    assert dec.buffered <= len(noise) - len(consumed)


METHODS = [
    "Configure",
    "Synchronize",
    "CreateContainer",
    "UpdateContainer",
    "StopContainer",
    "StateChange",
    "Shutdown",
    "RunPodSandbox",
    "Bogus",
    "",
]
SERVICES = ["nri.pkg.api.v1alpha1.Plugin", "nri.pkg.api.v1alpha1.Runtime", ""]

calls = st.builds(
    lambda stream, service, method, payload: mux.encode(
        mux.PLUGIN_CONN,
        ttrpc.encode(
            Frame(
                stream,
                MessageType.REQUEST,
                ttrpc_pb2.Request(service=service, method=method, payload=payload).SerializeToString(),
            )
        ),
    ),
    st.integers(0, 2**32 - 1),
    st.sampled_from(SERVICES),
    st.sampled_from(METHODS),
    st.binary(max_size=64),
)
frames = st.builds(
    lambda conn, stream, kind, payload, flags: mux.encode(conn, ttrpc.encode(Frame(stream, kind, payload, flags))),
    st.sampled_from([mux.PLUGIN_CONN, mux.RUNTIME_CONN, 3]),
    st.integers(0, 2**32 - 1),
    st.sampled_from(list(MessageType)) | st.integers(0, 255),
    st.binary(max_size=64),
    st.integers(0, 255),
)
noise = st.binary(min_size=1, max_size=64)


@given(st.lists(st.one_of(calls, frames, noise), min_size=1, max_size=8))
def test_fuzz_the_plugin_survives_whatever_the_runtime_sends(writes: list[bytes]) -> None:
    async def scenario(sock: Path) -> None:
        p = Plugin(Recorder(), "fuzz", "10", str(sock), backoff=0.01, max_backoff=0.05)
        async with FakeRuntime(sock) as rt, running(p) as task:
            peer = await rt.accept()
            await peer.handshake()
            for data in writes:
                peer.send_raw(data)
                await asyncio.sleep(0)
            await peer.close()  # whatever the plugin made of it, the runtime goes away
            await (await rt.accept()).handshake()
            assert not task.done()

    with tempfile.TemporaryDirectory(prefix="crihook-nri-fuzz-") as tmp:
        asyncio.run(asyncio.wait_for(scenario(Path(tmp) / "nri.sock"), 30))
