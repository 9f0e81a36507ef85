"""The store's two files in the state dir, so that a write costs what changed, not what is stored:
- `store.json`, the snapshot: written atomically (temporary file, fsync, rename) with a checksum over
  its body, which names its generation; a file cut short or damaged is set aside, never trusted.
- `store.journal`, what changed since: one line per write, `<sha256 of the rest> <JSON>`, the JSON
  holding the generation and each changed record as it now is (null: removed), appended and fsynced.
  Lines of another generation predate the snapshot (it holds them already) and are skipped; a torn
  last line (a crash mid-append) is dropped; a line failing its checksum ends what is applied, and
  the journal is set aside. Once the journal outgrows the snapshot `COMPACT_RATIO` times, the next
  write is a new snapshot (a new generation), which empties it.
Version 1 (a snapshot rewritten on every write, no generation, no journal) is still read, so an
upgraded node keeps its records; the first write after it is a version 2 snapshot.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
HASH_HEX = 64  # a journal line's checksum: sha256, hex


def row(rec: Any) -> bytes:
    """A record (node/records.py) as the files hold it: its fields in canonical JSON."""
    return _canonical({f.name: getattr(rec, f.name) for f in fields(rec)})


class StoreFileError(Exception):
    """A store file that is not what crihook writes: cut short, damaged or edited by hand."""


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _canonical(body: Any) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _checksum(body: dict[str, Any]) -> str:
    return "sha256:" + hashlib.sha256(_canonical(body)).hexdigest()


@dataclass(slots=True)
class Contents:
    """What the two files hold, verified: the snapshot with its journal applied."""

    body: dict[str, Any]  # "pods" and "containers": lists of records as JSON objects
    generation: int
    version: int
    dropped: str = ""  # why part of the journal was not applied; "" when all of it was
    damaged: bool = False  # the dropped part was more than a torn last append


def journal_path(path: Path) -> Path:
    return path.with_suffix(".journal")


def read_file(path: Path) -> dict[str, Any]:
    """The verified body of a store (the snapshot `path` and its journal beside it).
    Raises FileNotFoundError or StoreFileError."""
    return read_store(path).body


def read_store(path: Path) -> Contents:
    """The snapshot and its journal, verified. Raises FileNotFoundError (no snapshot: a journal
    without one is never used) or StoreFileError (the snapshot is damaged)."""
    raw = path.read_bytes()
    try:
        doc = json.loads(raw)
        body, version = doc["body"], doc.get("version")
        ok = version in READABLE_VERSIONS and doc.get("checksum") == _checksum(body)
    except (ValueError, KeyError, TypeError, AttributeError):
        raise StoreFileError(f"{path} is not a crihook store file (truncated or damaged)") from None
    if not ok:
        raise StoreFileError(f"{path} failed its checksum (half-written or edited by hand)")
    if not isinstance(body, dict):
        raise StoreFileError(f"{path} holds a {type(body).__name__}, not a store body (edited by hand)")
    generation = body.pop("generation", None) if version > 1 else 0
    if not isinstance(generation, int) or isinstance(generation, bool) or generation < 0:
        raise StoreFileError(f"{path}: generation {generation!r} (edited by hand)")
    contents = Contents(body, generation, version)
    if version > 1:
        kept = {kind: _by_id(body.get(kind, []), f"{path}: {kind}") for kind in ("pods", "containers")}
        _apply_journal(journal_path(path), contents, kept)
        body.update((kind, list(rows.values())) for kind, rows in kept.items())
    return contents


def _by_id(raw: Any, where: str) -> dict[str, Any]:
    if not isinstance(raw, list) or not all(isinstance(r, dict) and isinstance(r.get("id"), str) for r in raw):
        raise StoreFileError(f"{where}: expected a list of records with an id")
    return {r["id"]: r for r in raw}


def _journal_line(line: bytes) -> dict[str, Any] | None:
    """One verified journal line, or None: a checksum that fails, or a shape crihook never writes."""
    payload = line[HASH_HEX + 1 :]
    if line[HASH_HEX : HASH_HEX + 1] != b" " or hashlib.sha256(payload).hexdigest().encode() != line[:HASH_HEX]:
        return None
    try:
        batch = json.loads(payload)
    except ValueError:
        return None
    ok = isinstance(batch, dict) and isinstance(batch.get("generation"), int)
    for kind in ("pods", "containers"):
        rows = batch.get(kind) if ok else None
        ok = (
            ok
            and isinstance(rows, dict)
            and all(r is None or (isinstance(r, dict) and r.get("id") == i) for i, r in rows.items())
        )
    return batch if ok else None


def _apply_journal(path: Path, contents: Contents, kept: dict[str, dict[str, Any]]) -> None:
    """Apply the journal's lines of the snapshot's generation, in order, up to the first bad one."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return
    start = number = 0
    while start < len(raw):
        end = raw.find(b"\n", start)
        if end < 0:
            contents.dropped = f"a torn last append ({len(raw) - start} bytes) was dropped"
            return
        number += 1
        batch = _journal_line(raw[start:end])
        if batch is None:
            contents.dropped = (
                f"line {number} failed its checksum; it and the {len(raw) - end - 1} bytes after it were dropped"
            )
            contents.damaged = True
            return
        start = end + 1
        if batch["generation"] != contents.generation:
            continue  # written before the snapshot, which holds it
        for kind in ("pods", "containers"):
            rows = kept[kind]
            for rid, row in batch[kind].items():
                if row is None:
                    rows.pop(rid, None)
                else:
                    rows[rid] = row


def _record(cls: type, raw: Any, where: str) -> Any:
    """A record from its JSON, with every field of the type the dataclass declares: a store file
    edited by hand must fail here, at load, not later inside a CRI call."""
    if not isinstance(raw, dict):
        raise StoreFileError(f"{where}: expected an object")
    try:
        rec = cls(**raw)
    except TypeError as e:
        raise StoreFileError(f"{where}: {e}") from None
    for f in fields(cls):
        value = getattr(rec, f.name)
        kind = str(f.type)
        if kind == "str":
            ok = isinstance(value, str)
        elif kind == "int":
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif kind == "float":
            ok = isinstance(value, int | float) and not isinstance(value, bool)
        elif kind.startswith("dict[str, str]"):
            ok = isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
        elif kind.startswith("dict[str, Any]"):
            ok = isinstance(value, dict) and all(isinstance(k, str) for k in value)
        else:  # the hook records: a list of objects
            ok = isinstance(value, list) and all(isinstance(h, dict) for h in value)
        if not ok:
            raise StoreFileError(f"{where}.{f.name}: expected {kind}, got {type(value).__name__}")
    return rec


def records(cls: type, raw: Any, where: str) -> dict[str, Any]:
    if not isinstance(raw, list):
        raise StoreFileError(f"{where}: expected a list")
    return {r.id: r for r in (_record(cls, item, f"{where}[{i}]") for i, item in enumerate(raw))}


def snapshot_pieces(generation: int, containers: Iterable[bytes], pods: Iterable[bytes]) -> list[bytes]:
    """A snapshot's body in canonical JSON (what the checksum covers: json.dumps of {"containers":
    [...], "generation": N, "pods": [...]} with sorted keys, compact), from the records' rows, as
    pieces that join into it byte for byte."""
    return [
        b'{"containers":[',
        b",".join(containers),
        b'],"generation":%d,"pods":[' % generation,
        b",".join(pods),
        b"]}",
    ]


def journal_pieces(
    generation: int, containers: Iterable[tuple[str, bytes | None]], pods: Iterable[tuple[str, bytes | None]]
) -> list[bytes]:
    """A journal line's JSON: each changed record by id as it is now, null for one removed."""
    pieces = [b'{"containers":{']
    for kind_rows, between in ((containers, b'},"generation":%d,"pods":{' % generation), (pods, b"}}")):
        comma = b""
        for rid, rec_row in kind_rows:
            pieces += (comma, _canonical(rid), b":", b"null" if rec_row is None else rec_row)
            comma = b","
        pieces.append(between)
    return pieces


def journal_line_size(pieces: list[bytes]) -> int:
    """What a journal line of these pieces adds to the file."""
    return sum(map(len, pieces)) + HASH_HEX + 2


def write_snapshot(path: Path, pieces: list[bytes]) -> None:
    """Atomically replace the snapshot, then empty the journal (its lines are in the snapshot now,
    and of an older generation: were the emptying lost, they would be skipped)."""
    canonical = b"".join(pieces)
    checksum = "sha256:" + hashlib.sha256(canonical).hexdigest()
    head = json.dumps({"version": FORMAT_VERSION, "checksum": checksum})[:-1] + ', "body": '
    data = [head.encode(), canonical, b"}"]
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.writev(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)  # the rename is on disk before the journal is emptied
    journal = journal_path(path)
    try:
        os.close(os.open(journal, os.O_WRONLY | os.O_TRUNC))
    except FileNotFoundError:
        os.close(os.open(journal, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        fsync_dir(path.parent)  # appends are fsynced to a file whose name is on disk


def append(journal: Path, lines: Iterable[list[bytes]]) -> None:
    """Append checksummed lines to the journal, one per line's pieces, in one write, and fsync it."""
    out = bytearray()
    for pieces in lines:
        payload = b"".join(pieces)
        out += hashlib.sha256(payload).hexdigest().encode() + b" " + payload + b"\n"
    fd = os.open(journal, os.O_WRONLY | os.O_APPEND)  # no O_CREAT: a journal gone means a snapshot
    try:
        if os.write(fd, out) != len(out):
            raise OSError(errno.EIO, "short write", str(journal))
        os.fsync(fd)
    finally:
        os.close(fd)
