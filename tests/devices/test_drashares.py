"""crihook dra's checkpoint files as the node daemon reads the claims' shares from them: the envelope
(format, checksum) both sides use, the shares of a body, and the reader that reads a file again only
when it changed."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crihook.devices import drashares
from crihook.devices.drashares import CheckpointError, ClaimShare, SharesReader, SharesUnreadable

GiB = 1 << 30


def body(*devices: tuple[int, int, int]) -> dict[str, Any]:
    """A claim's body as the driver writes it: (minor, cores, memory) per device."""
    return {
        "namespace": "ml",
        "name": "c",
        "group": [],
        "devices": [
            {"requests": ["gpu"], "pool": "n", "device": f"gpu-{m}", "minor": m, "uuid": f"GPU-{m}", "cores": c,
             "memory": b, "shareID": ""}
            for m, c, b in devices
        ],
    }  # fmt: skip


@given(
    st.text(min_size=1, max_size=40),
    st.lists(st.tuples(st.integers(0, 255), st.integers(1, 100), st.integers(1, 1 << 40)), max_size=8),
)
def test_a_body_wrapped_unwraps_to_itself_and_its_shares(uid: str, devices: list[tuple[int, int, int]]) -> None:
    doc = body(*devices)
    assert drashares.unwrap(drashares.wrap(uid, doc)) == (uid, doc)
    assert drashares.shares(doc) == {m: ClaimShare(c, b) for m, c, b in devices}


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"{", "unreadable (JSONDecodeError"),
        (b"[]", "not a checkpoint of format 1"),
        (json.dumps({"format": 2}).encode(), "not a checkpoint of format 1"),
        (json.dumps({"format": 1, "uid": "u"}).encode(), "unreadable (KeyError"),
        (json.dumps({"format": 1, "uid": "u", "claim": "{}", "checksum": "0"}).encode(), "checksum mismatch"),
        (drashares.wrap("u", {})[:-9], "unreadable"),
    ],
)
def test_an_envelope_that_is_not_the_drivers_is_refused(data: bytes, error: str) -> None:
    with pytest.raises(CheckpointError, match=error.replace("(", r"\(")):
        drashares.unwrap(data)


def test_a_body_that_is_not_an_object_is_refused() -> None:
    text = "[1]"
    doc = {"format": 1, "uid": "u", "claim": text, "checksum": hashlib.sha256(text.encode()).hexdigest()}
    with pytest.raises(CheckpointError, match="the claim is not an object"):
        drashares.unwrap(json.dumps(doc).encode())


@pytest.mark.parametrize(
    ("doc", "error"),
    [
        ({}, "devices is None, not a list"),
        ({"devices": [3]}, "a device is 3, not an object"),
        (body((-1, 50, GiB)), "devices\\[\\].minor is -1, not a whole number of 0 or more"),
        (body((1, 0, GiB)), "devices\\[\\].cores is 0, not a whole number from 1 to 100"),
        (body((1, 101, GiB)), "cores is 101"),
        (body((1, 50, 0)), "devices\\[\\].memory is 0"),
        ({"devices": [{"minor": 1, "cores": True, "memory": 1}]}, "cores is True"),
        ({"devices": [{"minor": "1", "cores": 50, "memory": 1}]}, "minor is '1'"),
    ],
)
def test_a_share_out_of_range_is_refused_naming_the_field(doc: dict[str, Any], error: str) -> None:
    with pytest.raises(CheckpointError, match=error):
        drashares.shares(doc)


def test_the_reader_reads_a_file_again_only_when_it_changed(tmp_path: Path) -> None:
    reader = SharesReader(str(tmp_path))
    path = tmp_path / "c-1.json"
    path.write_bytes(drashares.wrap("c-1", body((2, 50, 8 * GiB))))
    assert reader.read(["c-1", "c-2"]) == {"c-1": {2: ClaimShare(50, 8 * GiB)}}  # c-2: no file, no share
    before = path.stat()  # rewritten in place to the same size and time: taken as unchanged
    path.write_bytes(drashares.wrap("c-1", body((2, 25, 4 * GiB))))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_size == before.st_size
    assert reader.read(["c-1"]) == {"c-1": {2: ClaimShare(50, 8 * GiB)}}
    tmp = tmp_path / ".c-1.json.tmp"  # replaced as the driver replaces it: another inode
    tmp.write_bytes(drashares.wrap("c-1", body((2, 25, 4 * GiB))))
    os.replace(tmp, path)
    assert reader.read(["c-1"]) == {"c-1": {2: ClaimShare(25, 4 * GiB)}}
    path.unlink()  # unprepared
    assert reader.read(["c-1"]) == {}


def test_an_unreadable_file_leaves_its_claim_out_and_the_others_in(tmp_path: Path) -> None:
    reader = SharesReader(str(tmp_path))
    (tmp_path / "c-1.json").write_bytes(drashares.wrap("c-1", body((0, 100, GiB))))
    (tmp_path / "c-2.json").write_bytes(b"{")
    (tmp_path / "c-3.json").write_bytes(drashares.wrap("c-1", body((1, 100, GiB))))  # another claim's file
    with pytest.raises(SharesUnreadable) as e:
        reader.read(["c-1", "c-2", "c-3"])
    assert e.value.found == {"c-1": {0: ClaimShare(100, GiB)}}
    assert "c-2.json: unreadable" in str(e.value) and "c-3.json: holds claim c-1" in str(e.value)
    big = tmp_path / "c-4.json"
    with big.open("wb") as f:
        f.truncate(drashares.MAX_BYTES + 1)
    with pytest.raises(SharesUnreadable, match="more than"):
        reader.read(["c-4"])
