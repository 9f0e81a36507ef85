"""Just enough HPACK (RFC 7541) for a relay that forwards header blocks verbatim.

The relay passes every header block through unchanged, so the peers' compression contexts stay in
step with each other; it only has to *follow* each direction's dynamic table to read a few headers
(`:path` of requests, `grpc-status` of responses). A general decoder that builds every header tuple
costs ~27 µs a block in Python; following the table and keeping only wanted names costs a fraction.
Headers crihook itself sends are literal and never indexed, so they leave both tables untouched.
"""

from __future__ import annotations

from collections import deque

from hpack.huffman_table import decode_huffman
from hpack.table import HeaderTable

_STATIC: tuple[tuple[bytes, bytes], ...] = HeaderTable.STATIC_TABLE
_STATIC_LEN = len(_STATIC)
_ENTRY_OVERHEAD = 32
KNOWN_BLOCKS = 64  # indexed-only blocks remembered per direction (a runtime sends a handful)


class HpackError(Exception):
    """A header block that breaks RFC 7541: a connection error (COMPRESSION_ERROR)."""


def _int(data: bytes, pos: int, prefix_bits: int) -> tuple[int, int]:
    mask = (1 << prefix_bits) - 1
    value = data[pos] & mask
    pos += 1
    if value < mask:
        return value, pos
    shift = 0
    while True:
        if pos >= len(data) or shift > 28:
            raise HpackError("truncated or oversized integer")
        b = data[pos]
        pos += 1
        value += (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, pos


def _string(data: bytes, pos: int) -> tuple[bytes, int]:
    if pos >= len(data):
        raise HpackError("truncated string")
    huffman = data[pos] & 0x80
    length, pos = _int(data, pos, 7)
    end = pos + length
    if end > len(data):
        raise HpackError("truncated string")
    raw = data[pos:end]
    if huffman:
        try:
            raw = decode_huffman(raw)
        except Exception as e:  # the library raises its own error types
            raise HpackError(f"bad huffman string: {e}") from None
    return raw, end


class Follower:
    """Tracks one direction's dynamic table and reports the values of `wanted` header names."""

    __slots__ = ("_dyn", "_known", "_size", "_version", "limit", "max_size", "wanted")

    def __init__(self, wanted: frozenset[bytes], limit: int = 4096) -> None:
        self.wanted = wanted
        self.limit = limit  # SETTINGS_HEADER_TABLE_SIZE announced by the decoding peer
        self.max_size = limit  # the table's size now: the encoder may set it anywhere up to `limit`
        self._dyn: deque[tuple[bytes, bytes]] = deque()
        self._size = 0
        # A block made only of indexed fields changes no table and reads the same while the table
        # does not change: a gRPC server's answers after the first (":status 200", the content type,
        # "grpc-status 0") are such blocks. block -> (table version, what it read)
        self._version = 0
        self._known: dict[bytes, tuple[int, dict[bytes, bytes]]] = {}

    def _entry(self, index: int) -> tuple[bytes, bytes]:
        if 0 < index <= _STATIC_LEN:
            return _STATIC[index - 1]
        i = index - _STATIC_LEN - 1
        if 0 <= i < len(self._dyn):
            return self._dyn[i]
        raise HpackError(f"header index {index} out of range")

    def _insert(self, name: bytes, value: bytes) -> None:
        size = len(name) + len(value) + _ENTRY_OVERHEAD
        dyn = self._dyn
        if size > self.max_size:
            self._version += 1
            dyn.clear()
            self._size = 0
            return
        self._version += 1
        dyn.appendleft((name, value))
        self._size += size
        while self._size > self.max_size:
            n, v = dyn.pop()
            self._size -= len(n) + len(v) + _ENTRY_OVERHEAD

    def _resize(self, size: int) -> None:
        if size > self.limit:
            raise HpackError(f"table size update {size} above the announced {self.limit}")
        self.max_size = size
        self._version += 1
        dyn = self._dyn
        while self._size > size:
            n, v = dyn.pop()
            self._size -= len(n) + len(v) + _ENTRY_OVERHEAD

    def decode(self, block: bytes) -> dict[bytes, bytes]:
        """The wanted headers of a block (the caller only reads the dict: it may be shared)."""
        known = self._known.get(block)
        if known is not None and known[0] == self._version:
            return known[1]
        found: dict[bytes, bytes] = {}
        wanted = self.wanted
        pos = 0
        end = len(block)
        indexed_only = True
        while pos < end:
            b = block[pos]
            if b & 0x80:  # indexed field
                index, pos = _int(block, pos, 7)
                if index == 0:
                    raise HpackError("header index 0")
                name, value = self._entry(index)
                if name in wanted:
                    found[name] = value
                continue
            indexed_only = False
            if b & 0xE0 == 0x20:  # dynamic table size update
                size, pos = _int(block, pos, 5)
                self._resize(size)
                continue
            indexing = b & 0x40
            index, pos = _int(block, pos, 6 if indexing else 4)
            if index:
                name = self._entry(index)[0]
            else:
                name, pos = _string(block, pos)
            value, pos = _string(block, pos)
            if indexing:
                self._insert(name, value)
            if name in wanted:
                found[name] = value
        if indexed_only:
            if len(self._known) >= KNOWN_BLOCKS:
                self._known.clear()
            self._known[block] = (self._version, found)
        return found


def _encode_int(value: int, prefix_bits: int, first: int) -> bytes:
    mask = (1 << prefix_bits) - 1
    if value < mask:
        return bytes((first | value,))
    out = bytearray((first | mask,))
    value -= mask
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_literal(headers: list[tuple[bytes, bytes]]) -> bytes:
    """A header block that never touches a dynamic table (literal without indexing, new names;
    ':status: 200' as its static index)."""
    out = bytearray()
    for name, value in headers:
        if name == b":status" and value == b"200":
            out.append(0x88)
            continue
        out += b"\x00" + _encode_int(len(name), 7, 0) + name + _encode_int(len(value), 7, 0) + value
    return bytes(out)
