"""ttrpc's message framing, without I/O: what goes on a connection and how bytes read from one become
messages again, however the reads split them.

Each message is a 10-byte big-endian header, `length u32 | stream_id u32 | type u8 | flags u8`, then
`length` bytes of payload (containerd/ttrpc channel.go, PROTOCOL.md). A payload over 4 MiB is refused
on both sides; the first header byte is therefore always zero. Clients number their streams with odd
ids; a unary call is one request and one response on the same stream. NRI uses unary calls only.
A message of a type this module does not know is framed like any other and delivered with its type
as a plain int: ttrpc's server ignores such messages, for compatibility with later versions
(server.go), and so does the plugin.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

HEADER = struct.Struct(">IIBB")
HEADER_LEN = HEADER.size  # 10
MAX_PAYLOAD = 4 << 20


class FrameError(ValueError):
    """Bytes that are not ttrpc: the connection they came on can not be read further."""


class MessageType(enum.IntEnum):
    REQUEST = 1
    RESPONSE = 2
    DATA = 3  # stream data: never sent on a unary call


@dataclass(frozen=True, slots=True)
class Frame:
    stream_id: int
    type: int  # a MessageType, or a type of a later ttrpc version as an int
    payload: bytes
    flags: int = 0


def encode(frame: Frame) -> bytes:
    """The frame's bytes; FrameError if the payload is over the limit the peer would refuse."""
    if len(frame.payload) > MAX_PAYLOAD:
        raise FrameError(f"message of {len(frame.payload)} bytes on stream {frame.stream_id} is over {MAX_PAYLOAD}")
    return HEADER.pack(len(frame.payload), frame.stream_id, frame.type, frame.flags) + frame.payload


class Decoder:
    """Bytes in (`feed`, in whatever pieces they were read), whole frames out. After a FrameError the
    decoder stays failed: the bytes after a bad header have no known frame boundary."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._failed: FrameError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received that do not yet make a whole frame."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[Frame]:
        if self._failed is not None:
            raise self._failed
        self._buf += data
        frames: list[Frame] = []
        while len(self._buf) >= HEADER_LEN:
            length, stream_id, kind, flags = HEADER.unpack_from(self._buf)
            try:
                check_header(length, stream_id)
            except FrameError as e:
                self._failed = e
                raise
            if len(self._buf) < HEADER_LEN + length:
                break
            payload = bytes(self._buf[HEADER_LEN : HEADER_LEN + length])
            del self._buf[: HEADER_LEN + length]
            frames.append(Frame(stream_id, MessageType(kind) if kind in _TYPES else kind, payload, flags))
        return frames


def check_header(length: int, stream_id: int) -> None:
    """Refuse a header no ttrpc peer sends, before waiting for its payload."""
    if length > MAX_PAYLOAD:
        raise FrameError(f"ttrpc message of {length} bytes on stream {stream_id} is over the {MAX_PAYLOAD}-byte limit")


_TYPES = frozenset(MessageType)
