"""What every check returns: one finding (ok, warning or failure) with what is the case and how to
fix it, and the exit status a list of them gives."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class Level(enum.StrEnum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"


@dataclass(frozen=True)
class Finding:
    check: str
    level: Level
    found: str  # what is the case, in plain words
    fix: str = ""  # what to do about it; empty when nothing needs doing


def exit_status(findings: Sequence[Finding]) -> int:
    return 1 if any(f.level is Level.FAIL for f in findings) else 0
