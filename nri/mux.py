"""NRI's connection multiplexer, without I/O: one socket between runtime and plugin carries several
logical connections, each a byte stream of its own (containerd/nri pkg/net/multiplex).

Every write on a logical connection travels as one or more frames: an 8-byte big-endian header
`conn_id u32 | length u32`, then `length` bytes. Opening a logical connection sends nothing, and
conn 0 is reserved. NRI uses two: `PLUGIN_CONN`, where the plugin serves ttrpc and the runtime calls
it, and `RUNTIME_CONN`, where the plugin is the ttrpc client and the runtime serves. Each logical
connection is a byte stream: a ttrpc message may arrive cut over several frames.

Frames are written at most `WRITE_FRAME` (4096) bytes long. The runtime reads each logical connection
through ttrpc's 4096-byte buffered reader, and the multiplexer hands a frame whole to a read or fails
it with ENOMEM when the read's buffer is shorter (pkg/net/multiplex/mux.go, `conn.Read`); ttrpc takes
that error as the connection's end, and the runtime closes the plugin. A frame of at most 4096 bytes
always fits: the reader reads into its own 4096-byte buffer, or straight into the caller's when that
is longer. Frames of up to `MAX_FRAME`, one whole ttrpc message, are read.
"""

from __future__ import annotations

import struct

from crihook.nri import ttrpc

HEADER = struct.Struct(">II")
HEADER_LEN = HEADER.size  # 8
MAX_FRAME = ttrpc.HEADER_LEN + ttrpc.MAX_PAYLOAD  # the longest frame NRI's multiplexer writes or reads
WRITE_FRAME = 4096  # the longest frame written: the runtime's read buffer

RESERVED_CONN = 0
PLUGIN_CONN = 1  # the plugin's ttrpc server: Configure, Synchronize, CreateContainer, ...
RUNTIME_CONN = 2  # the runtime's ttrpc server: RegisterPlugin, UpdateContainers


class MuxError(ValueError):
    """Bytes that are not multiplexer frames: the socket they came on can not be read further."""


def encode(conn_id: int, data: bytes) -> bytes:
    """`data` written on logical connection `conn_id`, as frames of at most WRITE_FRAME bytes."""
    if conn_id == RESERVED_CONN or not 0 < conn_id <= 0xFFFFFFFF:
        raise MuxError(f"conn id {conn_id} can not be written to")
    if len(data) <= WRITE_FRAME:
        return HEADER.pack(conn_id, len(data)) + data if data else b""
    out = bytearray()
    view = memoryview(data)
    for start in range(0, len(data), WRITE_FRAME):
        piece = view[start : start + WRITE_FRAME]
        out += HEADER.pack(conn_id, len(piece))
        out += piece
    return bytes(out)


class Decoder:
    """Socket bytes in (`feed`, in whatever pieces they were read), `(conn_id, bytes)` out, in order.
    Fails for good on a frame longer than any peer writes, as its end can not be trusted."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._failed: MuxError | None = None

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        if self._failed is not None:
            raise self._failed
        self._buf += data
        out: list[tuple[int, bytes]] = []
        while len(self._buf) >= HEADER_LEN:
            conn_id, length = HEADER.unpack_from(self._buf)
            if length > MAX_FRAME:
                self._failed = MuxError(
                    f"multiplexer frame of {length} bytes for conn {conn_id} is over the {MAX_FRAME}-byte limit"
                )
                raise self._failed
            if len(self._buf) < HEADER_LEN + length:
                break
            out.append((conn_id, bytes(self._buf[HEADER_LEN : HEADER_LEN + length])))
            del self._buf[: HEADER_LEN + length]
        return out
