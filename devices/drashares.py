"""The shares of the claims crihook's DRA driver prepared on this node, as its checkpoint records them:
one file per claim, `<state dir>/dra/<claim UID>.json` (dra/state.py writes it), giving for each GPU
of the claim its minor, the cores (percent of the SMs) and the memory (bytes) the claim may use. That
is the allocation's `consumedCapacity`, or the whole GPU when the allocation names none. kubelet's
own DRA checkpoint does not record it. The node daemon's usage collector shows it as the claim's
grant.

`wrap` and `unwrap` are the file's envelope (its format and a checksum over the body); dra/state.py
uses them for every read and write, so the format is decided here once. `shares` reads a body. These
are pure. `SharesReader` is the file edge: it reads a claim's file again only when the file changed.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

FORMAT = 1
DIR = "dra"  # below the driver's state dir
MAX_BYTES = 1 << 20  # a claim holds a node's GPUs at most: a few KiB


class CheckpointError(ValueError):
    """A claim's file is not one the driver writes; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class ClaimShare:
    """What one claim may use of one GPU."""

    cores: int  # percent of the SMs, 1 to 100
    memory: int  # bytes


def wrap(uid: str, body: Mapping[str, Any]) -> bytes:
    """The file of claim `uid` holding `body`."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    checksum = hashlib.sha256(text.encode()).hexdigest()
    return json.dumps({"format": FORMAT, "uid": uid, "checksum": checksum, "claim": text}).encode()


def unwrap(data: bytes) -> tuple[str, dict[str, Any]]:
    """The claim's UID and body. Raises CheckpointError."""
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise CheckpointError(f"not a checkpoint of format {FORMAT}")
        text = doc["claim"]
        if hashlib.sha256(text.encode()).hexdigest() != doc["checksum"]:
            raise CheckpointError("checksum mismatch (cut short or edited)")
        body = json.loads(text)
        if not isinstance(body, dict):
            raise CheckpointError("the claim is not an object")
        return str(doc["uid"]), body
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"unreadable ({type(e).__name__}: {e})") from None


def _whole(value: Any, field: str, low: int, high: int | None = None) -> int:
    if type(value) is not int or value < low or (high is not None and value > high):
        wanted = f"from {low} to {high}" if high is not None else f"of {low} or more"
        raise CheckpointError(f"devices[].{field} is {value!r}, not a whole number {wanted}")
    return value


def shares(body: Mapping[str, Any]) -> dict[int, ClaimShare]:
    """The claim's share of each of its GPUs, by minor. Raises CheckpointError."""
    devices = body.get("devices")
    if not isinstance(devices, list):
        raise CheckpointError(f"devices is {devices!r}, not a list")
    out = {}
    for d in devices:
        if not isinstance(d, dict):
            raise CheckpointError(f"a device is {d!r}, not an object")
        minor = _whole(d.get("minor"), "minor", 0)
        out[minor] = ClaimShare(_whole(d.get("cores"), "cores", 1, 100), _whole(d.get("memory"), "memory", 1))
    return out


class SharesReader:
    """The shares of claims by UID, from the driver's checkpoint directory. A claim with no file (not
    prepared by crihook's driver, or by one with another state dir) has none."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._cache: dict[str, tuple[tuple[int, int, int], Mapping[int, ClaimShare]]] = {}

    def read(self, uids: Iterable[str]) -> dict[str, Mapping[int, ClaimShare]]:
        """The shares of each of `uids` that has a readable file; the other claims are left out, and
        those whose file can not be read are named in the CheckpointError raised after the rest is read
        (the caller keeps what it got: the exception's `found`)."""
        found: dict[str, Mapping[int, ClaimShare]] = {}
        cache: dict[str, tuple[tuple[int, int, int], Mapping[int, ClaimShare]]] = {}
        bad = []
        for uid in dict.fromkeys(uids):
            path = os.path.join(self.directory, f"{uid}.json")
            try:
                st = os.stat(path)
                key = (st.st_ino, st.st_mtime_ns, st.st_size)
                cached = self._cache.get(uid)
                if cached is not None and cached[0] == key:
                    got = cached[1]
                else:
                    if st.st_size > MAX_BYTES:
                        raise CheckpointError(f"{st.st_size} bytes, more than {MAX_BYTES}")
                    with open(path, "rb") as f:
                        owner, body = unwrap(f.read(MAX_BYTES + 1))
                    if owner != uid:
                        raise CheckpointError(f"holds claim {owner}")
                    got = shares(body)
            except FileNotFoundError:
                continue
            except (OSError, CheckpointError) as e:
                bad.append(f"{path}: {e}")
                continue
            cache[uid] = (key, got)
            found[uid] = got
        self._cache = cache
        if bad:
            raise SharesUnreadable("; ".join(bad), found)
        return found


class SharesUnreadable(CheckpointError):
    """Some claims' files could not be read; `found` holds the shares of the others."""

    def __init__(self, message: str, found: dict[str, Mapping[int, ClaimShare]]) -> None:
        super().__init__(message)
        self.found = found
