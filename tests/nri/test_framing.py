"""ttrpc framing and NRI's multiplexer, byte for byte: a message survives any split of the stream
into reads, several frames per read, interleaved logical connections; headers no peer sends are a
FrameError or MuxError that names what was wrong, never a hang or a wrong message."""

from __future__ import annotations

import itertools
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crihook.nri import mux, ttrpc
from crihook.nri.ttrpc import Frame, MessageType
from tests.nri.fakeruntime import Enomem, GoReader

# What containerd/ttrpc and containerd/nri send, spelled out from their Go sources' constants: a
# 10-byte header with a 4 MiB payload limit, an 8-byte multiplexer header, conns 1 and 2.
TTRPC_HEADER = ">IIBB"
MUX_HEADER = ">II"

frames = st.builds(
    Frame,
    stream_id=st.integers(0, 2**32 - 1),
    type=st.sampled_from(MessageType) | st.integers(0, 255),
    payload=st.binary(max_size=300),
    flags=st.integers(0, 255),
)


def splits(data: bytes, cuts: list[int]) -> list[bytes]:
    """`data` cut at the given offsets (taken modulo its length), in order."""
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


# -- ttrpc -----------------------------------------------------------------------------------------


def test_header_layout_is_the_wire_format() -> None:
    raw = ttrpc.encode(Frame(7, MessageType.REQUEST, b"abc", flags=0))
    assert raw == struct.pack(TTRPC_HEADER, 3, 7, 1, 0) + b"abc"
    assert ttrpc.HEADER_LEN == 10 and ttrpc.MAX_PAYLOAD == 4 * 1024 * 1024


@given(st.lists(frames, max_size=8), st.lists(st.integers(0, 10_000), max_size=20))
def test_frames_survive_any_split(sent: list[Frame], cuts: list[int]) -> None:
    stream = b"".join(ttrpc.encode(f) for f in sent)
    dec = ttrpc.Decoder()
    got = [f for piece in splits(stream, cuts) for f in dec.feed(piece)]
    assert got == sent
    assert dec.buffered == 0


def test_every_single_byte_split_of_one_frame() -> None:
    raw = ttrpc.encode(Frame(1, MessageType.RESPONSE, b"payload bytes", 0))
    for cut in range(len(raw) + 1):
        dec = ttrpc.Decoder()
        assert dec.feed(raw[:cut]) == ([] if cut < len(raw) else [Frame(1, MessageType.RESPONSE, b"payload bytes")])
        rest = dec.feed(raw[cut:])
        assert rest == ([Frame(1, MessageType.RESPONSE, b"payload bytes")] if cut < len(raw) else [])


def test_byte_by_byte_feed_yields_each_frame_once_complete() -> None:
    sent = [Frame(1, MessageType.REQUEST, b""), Frame(3, MessageType.REQUEST, b"x" * 20)]
    dec = ttrpc.Decoder()
    out: list[tuple[int, Frame]] = []
    stream = b"".join(map(ttrpc.encode, sent))
    for i, byte in enumerate(stream):
        out += [(i, f) for f in dec.feed(bytes([byte]))]
    assert out == [(9, sent[0]), (len(stream) - 1, sent[1])]


def test_the_largest_payload_passes_and_one_byte_more_is_refused() -> None:
    big = b"\0" * ttrpc.MAX_PAYLOAD
    assert ttrpc.Decoder().feed(ttrpc.encode(Frame(1, MessageType.REQUEST, big))) == [
        Frame(1, MessageType.REQUEST, big)
    ]
    with pytest.raises(ttrpc.FrameError, match="over"):
        ttrpc.encode(Frame(1, MessageType.REQUEST, big + b"\0"))


@pytest.mark.parametrize("length", [ttrpc.MAX_PAYLOAD + 1, 2**32 - 1])
def test_an_oversize_header_is_refused_before_its_payload(length: int) -> None:
    dec = ttrpc.Decoder()
    with pytest.raises(ttrpc.FrameError, match=rf"{length} bytes on stream 5 is over the 4194304-byte limit"):
        dec.feed(struct.pack(TTRPC_HEADER, length, 5, 1, 0))
    with pytest.raises(ttrpc.FrameError):  # and stays failed: nothing after it can be framed
        dec.feed(ttrpc.encode(Frame(7, MessageType.REQUEST, b"")))


@pytest.mark.parametrize("kind", [0, 4, 255])
def test_a_message_of_an_unknown_type_is_framed_and_delivered_with_its_type(kind: int) -> None:
    """ttrpc's server ignores a type it does not know (server.go), so it must be read past, not fail."""
    after = ttrpc.encode(Frame(11, MessageType.REQUEST, b"next"))
    got = ttrpc.Decoder().feed(struct.pack(TTRPC_HEADER, 3, 9, kind, 0) + b"abc" + after)
    assert got == [Frame(9, kind, b"abc"), Frame(11, MessageType.REQUEST, b"next")]
    assert type(got[0].type) is int and got[1].type is MessageType.REQUEST


def test_a_frame_read_before_a_bad_header_is_delivered() -> None:
    good = ttrpc.encode(Frame(1, MessageType.REQUEST, b"ok"))
    bad = struct.pack(TTRPC_HEADER, ttrpc.MAX_PAYLOAD + 1, 3, 1, 0)
    dec = ttrpc.Decoder()
    assert dec.feed(good + bad[:5]) == [Frame(1, MessageType.REQUEST, b"ok")]
    with pytest.raises(ttrpc.FrameError, match="on stream 3 is over"):
        dec.feed(bad[5:])


# -- the multiplexer --------------------------------------------------------------------------------


def test_mux_header_layout_is_the_wire_format() -> None:
    assert mux.encode(2, b"hello") == struct.pack(MUX_HEADER, 2, 5) + b"hello"
    assert mux.encode(1, b"") == b""  # an empty write sends nothing
    assert (mux.PLUGIN_CONN, mux.RUNTIME_CONN, mux.MAX_FRAME) == (1, 2, 10 + 4 * 1024 * 1024)
    assert mux.WRITE_FRAME == 4096  # ttrpc's bufio.NewReader(conn) on the runtime's side


@pytest.mark.parametrize("conn_id", [0, -1, 2**32])
def test_mux_refuses_to_write_on_a_conn_that_cannot_exist(conn_id: int) -> None:
    with pytest.raises(mux.MuxError, match=f"conn id {conn_id}"):
        mux.encode(conn_id, b"x")


def test_a_write_longer_than_the_runtimes_read_buffer_is_cut_into_frames_that_fit_it() -> None:
    data = bytes(range(256)) * 21  # 5,376 bytes: one frame would be refused with ENOMEM
    parts = mux.Decoder().feed(mux.encode(1, data))
    assert [len(p) for _, p in parts] == [4096, len(data) - 4096]
    assert b"".join(p for _, p in parts) == data and {c for c, _ in parts} == {1}
    whole = mux.encode(2, bytes(4096))
    assert len(whole) == 8 + 4096 and struct.unpack_from(MUX_HEADER, whole) == (2, 4096)


@given(st.integers(1, 3), st.binary(max_size=20_000) | st.integers(0, 3).map(lambda k: bytes(4096 * k)))
def test_every_frame_written_fits_the_runtimes_read_buffer_and_they_reassemble(conn: int, data: bytes) -> None:
    raw = mux.encode(conn, data)
    offset, payloads = 0, []
    while offset < len(raw):  # the frames as NRI's multiplexer reads them, header by header
        conn_id, length = struct.unpack_from(MUX_HEADER, raw, offset)
        assert conn_id == conn and 0 < length <= 4096
        payloads.append(raw[offset + 8 : offset + 8 + length])
        offset += 8 + length
    assert b"".join(payloads) == data
    assert len(payloads) == -(-len(data) // 4096)


long_payloads = st.tuples(st.integers(4087, 13_000), st.binary(min_size=1, max_size=32)).map(
    lambda t: (t[1] * t[0])[: t[0]]
)


@given(st.lists(frames, min_size=1, max_size=4), long_payloads, st.data())
def test_ttrpc_messages_over_a_frame_reassemble_into_the_same_messages(
    small: list[Frame], big: bytes, data: st.DataObject
) -> None:
    """Both readers, ours and the runtime's (ttrpc's 4096-byte buffered reader over NRI's
    multiplexer, played by fakeruntime.GoReader), get back exactly the messages written."""
    sent = data.draw(st.permutations([*small, Frame(7, MessageType.RESPONSE, big)]), label="order")
    stream = b"".join(mux.encode(mux.PLUGIN_CONN, ttrpc.encode(f)) for f in sent)
    demux, ours, theirs = mux.Decoder(), ttrpc.Decoder(), GoReader()
    got: list[Frame] = []
    runtime_got: list[Frame] = []
    for piece in splits(stream, data.draw(st.lists(st.integers(0, 30_000), max_size=10), label="reads")):
        for conn, payload in demux.feed(piece):
            assert conn == mux.PLUGIN_CONN and len(payload) <= 4096
            got += ours.feed(payload)
            runtime_got += theirs.push(payload)
    assert got == sent == runtime_got


def test_the_runtimes_reader_refuses_a_frame_longer_than_its_buffer() -> None:
    """What made a long answer end the connection: one frame for a whole 5 KiB message."""
    message = ttrpc.encode(Frame(1, MessageType.RESPONSE, bytes(5120)))
    with pytest.raises(Enomem, match="frame of 5130 bytes read into a 4096-byte buffer"):
        GoReader().push(message)
    reader = GoReader()
    assert reader.push(message[:10]) == []  # the header alone; the payload then goes straight into its buffer
    assert reader.push(message[10:]) == [Frame(1, MessageType.RESPONSE, bytes(5120))]


@pytest.mark.parametrize("length", [mux.MAX_FRAME + 1, 2**32 - 1])
def test_an_oversize_mux_frame_is_refused(length: int) -> None:
    dec = mux.Decoder()
    with pytest.raises(mux.MuxError, match=rf"frame of {length} bytes for conn 1 is over"):
        dec.feed(struct.pack(MUX_HEADER, 1, length))
    with pytest.raises(mux.MuxError):
        dec.feed(mux.encode(1, b"later"))


writes = st.lists(st.tuples(st.integers(1, 4), st.binary(min_size=1, max_size=200)), max_size=12)


@given(writes, st.lists(st.integers(0, 5_000), max_size=20))
def test_interleaved_connections_keep_their_own_byte_streams(sent: list[tuple[int, bytes]], cuts: list[int]) -> None:
    stream = b"".join(mux.encode(c, d) for c, d in sent)
    dec = mux.Decoder()
    got = [part for piece in splits(stream, cuts) for part in dec.feed(piece)]
    assert got == sent
    assert dec.buffered == 0


@given(st.lists(frames, min_size=1, max_size=6), st.lists(frames, max_size=6), st.data())
def test_ttrpc_messages_cut_across_mux_frames_and_interleaved(
    server: list[Frame], client: list[Frame], data: st.DataObject
) -> None:
    """Each side writes its ttrpc messages in arbitrary pieces (Go's buffered writer flushes when
    full), the pieces of both logical connections interleave on the socket, the socket is read in
    arbitrary pieces: each connection's decoder still gets exactly its own messages."""
    streams = {
        mux.PLUGIN_CONN: b"".join(map(ttrpc.encode, server)),
        mux.RUNTIME_CONN: b"".join(map(ttrpc.encode, client)),
    }
    pieces = {
        c: splits(s, data.draw(st.lists(st.integers(0, 2_000), max_size=8), label=f"writes on {c}"))
        for c, s in streams.items()
    }
    order = data.draw(st.permutations([c for c, ps in pieces.items() for _ in ps]), label="interleaving")
    socket_bytes = b"".join(mux.encode(c, pieces[c].pop(0)) for c in order)
    demux, decoders = mux.Decoder(), {c: ttrpc.Decoder() for c in streams}
    got: dict[int, list[Frame]] = {c: [] for c in streams}
    for piece in splits(socket_bytes, data.draw(st.lists(st.integers(0, 5_000), max_size=10), label="reads")):
        for conn, payload in demux.feed(piece):
            got[conn] += decoders[conn].feed(payload)
    assert got == {mux.PLUGIN_CONN: server, mux.RUNTIME_CONN: client}
