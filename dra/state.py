"""The driver's checkpoint: every claim prepared on this node, so a restarted driver answers kubelet's
repeated NodePrepareResources from it (the claim may be gone from the API server by then, or another
by its name) and knows which CDI specs are its own to remove.

One small JSON file per claim (`<state dir>/dra/<claim UID>.json`), so a prepare or unprepare costs
the same whatever the node holds: written atomically (temporary file, rename) with a checksum over its
body, in the envelope of devices/drashares.py, which the node daemon reads the claims' shares with. A
file cut short or edited is set aside with a warning and its claim prepared again at
kubelet's next call. The claim's CDI spec is written before its file and removed after it: after the
driver stops at any point a spec exists for every claim the checkpoint names (a spec none names is
removed at start). Nothing is fsynced: what a restarted driver needs is in the page cache, and a
node that crashes loses its containers and /var/run's specs with them, so kubelet prepares its pods'
claims again, which are then read from the API server as new ones (a checkpoint file lost or cut
short by the crash only means that read). An fsync was a third of a prepare's time.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from crihook.devices import drashares
from crihook.dra.claims import Prepared, PreparedDevice

log = logging.getLogger("crihook.dra")


class StateError(Exception):
    """The checkpoint can not be read; the message names the file and the cause."""


def write_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Replace `path` whole: a reader sees the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def remove(path: Path) -> None:
    path.unlink(missing_ok=True)


def encode(p: Prepared) -> bytes:
    return drashares.wrap(p.uid, _claim(p))


def decode(data: bytes, where: str) -> Prepared:
    """Raises StateError naming `where`."""
    try:
        uid, body = drashares.unwrap(data)
        return _prepared(uid, body)
    except drashares.CheckpointError as e:
        raise StateError(f"{where}: {e}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise StateError(f"{where}: unreadable ({type(e).__name__}: {e})") from None


def _claim(p: Prepared) -> dict[str, Any]:
    return {
        "namespace": p.namespace,
        "name": p.name,
        "group": list(p.group),
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
    return Prepared(uid, c["namespace"], c["name"], devices, group=tuple(c.get("group") or ()))


class State:
    """The checkpoint's directory and the claims it holds."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.claims: dict[str, Prepared] = {}

    def path(self, uid: str) -> Path:
        return self.directory / f"{uid}.json"

    def load(self) -> None:
        """Every claim file; one that can not be read is renamed to <name>.bad and logged. Raises
        StateError for a directory that can not be listed."""
        self.claims = {}
        try:
            files = sorted(self.directory.glob("*.json"))
        except OSError as e:
            raise StateError(f"{self.directory}: {e.strerror or e}") from None
        for path in files:
            try:
                p = decode(path.read_bytes(), str(path))
            except (OSError, StateError) as e:
                log.warning("prepared claim unreadable: set aside", extra={"file": str(path), "error": str(e)})
                path.replace(path.with_suffix(".bad"))
                continue
            self.claims[p.uid] = p

    def put(self, p: Prepared) -> None:
        write_atomic(self.path(p.uid), encode(p))
        self.claims[p.uid] = p

    def drop(self, uid: str) -> None:
        if self.claims.pop(uid, None) is not None:
            remove(self.path(uid))
