"""The HPACK follower against the `hpack` library's own encoder and decoder: whatever the encoder
indexes, evicts or repeats, the follower reads the wanted headers the decoder reads."""

from __future__ import annotations

from hpack import Decoder, Encoder
from hypothesis import given, settings
from hypothesis import strategies as st

from crihook.proxy.hpack import KNOWN_BLOCKS, Follower, encode_literal

WANTED = frozenset((b"grpc-status", b"grpc-message", b":path"))
NAMES = [b":path", b"grpc-status", b"grpc-message", b"content-type", b"x-a", b"x-b"]

header = st.tuples(st.sampled_from(NAMES), st.binary(min_size=0, max_size=40))
# a block, or a table size the encoder announces before its next block (not 0: the library's own
# encoder and decoder fall out of step going from 0 back up)
step = st.one_of(st.lists(header, min_size=1, max_size=5), st.sampled_from([64, 256, 4096]))


def wanted_of(headers: list[tuple[bytes, bytes]]) -> dict[bytes, bytes]:
    out = {}
    for name, value in headers:
        if name in WANTED:
            out[name] = value
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(step, min_size=1, max_size=30), st.integers(min_value=1, max_value=4))
def test_the_follower_reads_what_a_full_decoder_reads(
    steps: list[list[tuple[bytes, bytes]] | int], repeat: int
) -> None:
    encoder, decoder, follower = Encoder(), Decoder(), Follower(WANTED)
    for s in steps:
        if isinstance(s, int):
            if s != encoder.header_table_size:  # (the library's encoder mishandles a "change" to the same size)
                encoder.header_table_size = s
            continue
        for _ in range(repeat):  # a server answering the same way again: indexed-only blocks
            block = encoder.encode(s)
            reference = wanted_of([(bytes(n), bytes(v)) for n, v in decoder.decode(block, raw=True)])
            assert follower.decode(block) == reference


def test_an_indexed_block_is_read_again_from_memory_until_the_table_changes() -> None:
    encoder, follower = Encoder(), Follower(WANTED)
    first = encoder.encode([(b"grpc-status", b"0")])
    assert follower.decode(first) == {b"grpc-status": b"0"}
    again = encoder.encode([(b"grpc-status", b"0")])  # now the dynamic entry's index alone
    assert again != first and follower.decode(again) == {b"grpc-status": b"0"}
    assert follower.decode(again) is follower.decode(again)  # remembered
    follower.decode(encoder.encode([(b"grpc-status", b"5")]))  # a new entry shifts the indices
    assert follower.decode(again) == {b"grpc-status": b"5"}


def test_remembered_blocks_are_bounded() -> None:
    follower = Follower(WANTED)
    for i in range(KNOWN_BLOCKS * 3):
        follower.decode(bytes([0x80 | (1 + i % 61)]))  # static-table entries only
    assert 0 < len(follower._known) <= KNOWN_BLOCKS  # remembered, and no more than the bound


def test_literal_blocks_leave_both_tables_alone() -> None:
    follower = Follower(WANTED)
    block = encode_literal([(b":status", b"200"), (b"grpc-status", b"13"), (b"grpc-message", b"x%20y")])
    assert follower.decode(block) == {b"grpc-status": b"13", b"grpc-message": b"x%20y"}
    assert follower._size == 0
