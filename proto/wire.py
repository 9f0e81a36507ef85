"""Protobuf wire encoding by hand, for the few messages sent without generated code (containerd's
task service, which crihook does not vendor) and for tests that add fields a schema does not know."""

from __future__ import annotations

VARINT = 0
LENGTH_DELIMITED = 2


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def tag(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def length_delimited(number: int, payload: bytes) -> bytes:
    """A field of wire type 2 (string, bytes, message): tag, varint length, payload."""
    return tag(number, LENGTH_DELIMITED) + varint(len(payload)) + payload


def uint(number: int, value: int) -> bytes:
    """A field of wire type 0 (uint32, uint64, bool, enum), value >= 0."""
    return tag(number, VARINT) + varint(value)
