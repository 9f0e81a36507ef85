"""The driver's checkpoint: every claim prepared on this node, so a restarted driver answers kubelet's
repeated NodePrepareResources from it (the claim may be gone from the API server by then, or another
by its name) and knows which CDI specs are its own to remove.

One JSON file, replaced atomically (temporary file, fsync, rename, fsync of the directory) on every
change, with a checksum over its body: a file cut short or edited is refused with the reason, never
half read. Each claim's CDI spec is written the same way before the checkpoint names the claim, and
removed after the checkpoint has let it go, so after a crash at any point a spec exists for every
claim in the checkpoint (a spec no claim names is removed at start).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from crihook.dra.claims import Prepared, PreparedDevice

FORMAT = 1
FILE_NAME = "dra-prepared.json"


class StateError(Exception):
    """The checkpoint can not be read; the message names the file and the cause."""


def write_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        return
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def encode(claims: Mapping[str, Prepared]) -> bytes:
    body = json.dumps({uid: _claim(p) for uid, p in sorted(claims.items())}, sort_keys=True, separators=(",", ":"))
    checksum = hashlib.sha256(body.encode()).hexdigest()
    return json.dumps({"format": FORMAT, "checksum": checksum, "claims": body}).encode()


def decode(data: bytes, where: str) -> dict[str, Prepared]:
    """Raises StateError naming `where`."""
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise StateError(f"{where}: not a checkpoint of format {FORMAT}")
        body = doc["claims"]
        if hashlib.sha256(body.encode()).hexdigest() != doc["checksum"]:
            raise StateError(f"{where}: checksum mismatch (cut short or edited)")
        return {uid: _prepared(uid, c) for uid, c in json.loads(body).items()}
    except StateError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise StateError(f"{where}: unreadable ({type(e).__name__}: {e})") from None


def _claim(p: Prepared) -> dict[str, Any]:
    return {
        "namespace": p.namespace,
        "name": p.name,
        "devices": [
            {
                "requests": list(d.requests),
                "pool": d.pool,
                "device": d.device,
                "minor": d.minor,
                "uuid": d.uuid,
                "memory": d.memory,
                "cores": d.cores,
                "shareID": d.share_id,
            }
            for d in p.devices
        ],
        "spec": p.spec,
    }


def _prepared(uid: str, c: Mapping[str, Any]) -> Prepared:
    devices = tuple(
        PreparedDevice(
            tuple(d["requests"]),
            d["pool"],
            d["device"],
            int(d["minor"]),
            d["uuid"],
            int(d["memory"]),
            int(d["cores"]),
            d.get("shareID", ""),
        )
        for d in c["devices"]
    )
    return Prepared(uid, c["namespace"], c["name"], devices, c.get("spec") or {})


class State:
    """The checkpoint file and what it holds; written whole on every change."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.claims: dict[str, Prepared] = {}

    def load(self) -> None:
        """Raises StateError; a missing file is an empty checkpoint."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            self.claims = {}
            return
        except OSError as e:
            raise StateError(f"{self.path}: {e.strerror or e}") from None
        self.claims = decode(data, str(self.path))

    def put(self, p: Prepared) -> None:
        self.claims[p.uid] = p
        write_atomic(self.path, encode(self.claims))

    def drop(self, uid: str) -> None:
        if self.claims.pop(uid, None) is not None:
            write_atomic(self.path, encode(self.claims))
