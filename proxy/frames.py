"""HTTP/2 framing as the relay reads and writes it (RFC 9113 §4, §6): frame types, flags, settings
and error codes, a frame built, the checks a frame must pass, a DATA frame's payload and the gRPC
message in a body, and a gRPC status as the relay writes it (a trailers-only error). gRPC status codes
are `grpc.StatusCode` everywhere above these wire bytes."""

from __future__ import annotations

import struct

import grpc

from crihook.proxy.hpack import encode_literal

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)


END_STREAM = 0x1


ACK = 0x1


END_HEADERS = 0x4


PADDED = 0x8


PRIORITY_FLAG = 0x20


SETTINGS_HEADER_TABLE_SIZE = 1


SETTINGS_INITIAL_WINDOW_SIZE = 4


SETTINGS_MAX_FRAME_SIZE = 5


DEFAULT_WINDOW = 65535


DEFAULT_MAX_FRAME = 16384


CANCEL = 0x8


PROTOCOL_ERROR = 0x1


FRAME_HEADER = struct.Struct(">HBBBI")  # 24-bit length as 16+8 bits, type, flags, stream id


def frame(ftype: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((ftype, flags)) + stream_id.to_bytes(4, "big") + payload


# gRPC status codes as the wire carries them (grpc-status is the decimal code)
STATUS_CODES: dict[bytes, grpc.StatusCode] = {str(c.value[0]).encode(): c for c in grpc.StatusCode}


def wire_status(code: grpc.StatusCode) -> bytes:
    return str(code.value[0]).encode()


CANCELLED_STATUS = wire_status(grpc.StatusCode.CANCELLED)  # a stream reset by either end


UNKNOWN_STATUS = wire_status(grpc.StatusCode.UNKNOWN)  # a stream that ended without grpc-status


def grpc_error_headers(code: grpc.StatusCode, message: str) -> bytes:
    """Header block of a trailers-only gRPC error response (grpc-message percent-encoded)."""
    encoded = "".join(
        c if 0x20 <= ord(c) < 0x7F and c != "%" else "".join(f"%{b:02X}" for b in c.encode()) for c in message
    ).encode()
    return encode_literal(
        [
            (b":status", b"200"),
            (b"content-type", b"application/grpc"),
            (b"grpc-status", wire_status(code)),
            (b"grpc-message", encoded),
        ]
    )


class ProtocolViolation(Exception):
    """A peer broke the HTTP/2 framing the relay relies on: the connection goes, with a GOAWAY."""


def bad_frame(buf: bytes, pos: int, length: int, ftype: int, flags: int, max_frame: int) -> str | None:
    """Why a frame breaks HTTP/2's framing rules the relay relies on (RFC 9113 §4.2, §6.1, §6.2), or
    None. The frame loops call it only for a frame over the size limit or one carrying a padding or
    priority flag (then whole in `buf`), so ordinary frames cost one comparison."""
    if length > max_frame:
        return f"frame of {length} bytes over the peer's SETTINGS_MAX_FRAME_SIZE {max_frame}"
    if ftype in (DATA, HEADERS):
        need = 5 if ftype == HEADERS and flags & PRIORITY_FLAG else 0
        if flags & PADDED:
            if length < 1 or buf[pos + 9] + 1 + need > length:
                return "padding longer than the frame"
        elif need > length:
            return "priority fields past the end of the frame"
    return None


def payload(buf: bytes, start: int, end: int, flags: int) -> bytes:
    """DATA payload without padding."""
    if flags & PADDED:
        pad = buf[start]
        return buf[start + 1 : end - pad]
    return buf[start:end]


def grpc_message(body: bytes | bytearray) -> bytes | None:
    """The single message of a unary gRPC body, or None if it is compressed or malformed."""
    if len(body) < 5 or body[0] != 0:
        return None
    n = int.from_bytes(body[1:5], "big")
    if len(body) != 5 + n:
        return None
    return bytes(body[5:])


def settings(buf: bytes, start: int, end: int) -> list[tuple[int, int]]:
    return [
        (int.from_bytes(buf[i : i + 2], "big"), int.from_bytes(buf[i + 2 : i + 6], "big"))
        for i in range(start, end - 5, 6)
    ]
