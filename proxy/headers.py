"""Header blocks (HEADERS and CONTINUATION frames) of one direction, assembled and read through
HPACK in step with the peer's dynamic table: a request's `:path` and `grpc-timeout`, an answer's
`grpc-status` and `grpc-message`. Nothing else in a block is decoded, and every block passes on as
it came."""

from __future__ import annotations

import time

from crihook.proxy.frames import (
    END_HEADERS,
    END_STREAM,
    HEADERS,
    PADDED,
    PRIORITY_FLAG,
    ProtocolViolation,
)
from crihook.proxy.hpack import Follower, HpackError

MAX_HEADER_BLOCK = 1 << 20  # a header block larger than this is an attack, not a CRI call


# a request's method, and its deadline for the calls the handler claims
REQUEST_HEADERS = frozenset((b":path", b"grpc-timeout"))


# grpc-timeout's units (gRPC over HTTP/2: at most 8 digits and one of these)
_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}


STATUS_HEADERS = frozenset((b"grpc-status", b"grpc-message"))


class HeaderBlocks:
    """One direction's header blocks (RFC 9113 §4.3): a HEADERS frame and its CONTINUATIONs
    assembled into one block, read through that direction's HPACK follower. Requests and responses
    are assembled alike; what the link reads from the headers differs."""

    __slots__ = ("_frag", "ends_stream", "hpack", "sid", "side")

    def __init__(self, wanted: frozenset[bytes], side: str) -> None:
        self.hpack = Follower(wanted)
        self.side = side  # "request" | "response", for protocol errors
        self._frag: bytearray | None = None  # a block waiting for its CONTINUATIONs
        # the block being assembled, or the one `feed` just returned: its stream, and whether its
        # HEADERS frame ended that stream
        self.sid = 0
        self.ends_stream = False

    def feed(self, buf: bytes, pos: int, end: int, ftype: int) -> dict[bytes, bytes] | None:
        """Take the HEADERS or CONTINUATION frame at buf[pos:end]. Returns the wanted headers once
        a block is complete (its stream in `sid`, `ends_stream` set), None while CONTINUATIONs are
        due. Raises ProtocolViolation. Nothing is allocated beyond what HPACK decoding needs: this
        runs for every call the relay carries."""
        flags = buf[pos + 4]
        sid = int.from_bytes(buf[pos + 5 : pos + 9], "big") & 0x7FFFFFFF
        if ftype == HEADERS:
            start = pos + 9
            stop = end
            if flags & PADDED:
                stop -= buf[start]
                start += 1
            if flags & PRIORITY_FLAG:
                start += 5
            self.sid = sid
            self.ends_stream = bool(flags & END_STREAM)
            if not flags & END_HEADERS:
                self._frag = bytearray(buf[start:stop])
                return None
            block = buf[start:stop]
        else:
            frag = self._frag
            if frag is None or sid != self.sid:
                raise ProtocolViolation(f"{self.side} headers: CONTINUATION without HEADERS")
            frag += buf[pos + 9 : end]
            if len(frag) > MAX_HEADER_BLOCK:
                raise ProtocolViolation(f"{self.side} header block too large")
            if not flags & END_HEADERS:
                return None
            block = bytes(frag)
            self._frag = None
        try:
            return self.hpack.decode(block)
        except HpackError as e:
            raise ProtocolViolation(f"{self.side} headers: {e}") from None


def deadline_of(timeout: bytes | None) -> float | None:
    """time.monotonic() at which a call whose grpc-timeout header is `timeout` runs out; None
    without one or with one that breaks the format (the runtime judges that, not crihook)."""
    if timeout is None or not 2 <= len(timeout) <= 9 or not timeout[:-1].isdigit():
        return None
    unit = _TIMEOUT_UNITS.get(timeout[-1:])
    return None if unit is None else time.monotonic() + int(timeout[:-1]) * unit
