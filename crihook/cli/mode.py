"""Which mode this node runs crihook in, read from the processes running: `crihook serve` (proxy
mode) or `crihook nri` (NRI mode). `crihook doctor` checks the node for that mode, `crihook inspect`
says it."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from crihook.devices.kubelet import flag_value
from crihook.nri.stub import DEFAULT_SOCKET

MODES = {"serve": "proxy", "nri": "nri"}


@dataclass(frozen=True)
class Running:
    mode: str  # "proxy" | "nri"
    pid: int
    argv: tuple[str, ...]

    @property
    def nri_socket(self) -> str:
        return flag_value(self.argv, "nri-socket") or DEFAULT_SOCKET

    def describe(self) -> str:
        command = "nri" if self.mode == "nri" else "serve"
        return f"{'NRI' if self.mode == 'nri' else 'proxy'} mode (crihook {command}, pid {self.pid})"


def crihook_command(argv: Sequence[str]) -> str | None:
    """The mode a command line runs crihook in: `…/crihook serve …`, `python -m crihook.cli nri …`;
    None for anything else."""
    python = bool(argv) and os.path.basename(argv[0]).startswith("python")
    for i, arg in enumerate(argv[:3]):
        script = os.path.basename(arg) == "crihook" and (i == 0 or (i == 1 and python))
        module = python and i == 2 and arg in ("crihook", "crihook.cli") and argv[1] == "-m"
        if (script or module) and i + 1 < len(argv):
            return MODES.get(argv[i + 1])
    return None


def running(proc_root: str) -> list[Running]:
    """Every crihook daemon running on the node, in pid order."""
    found = []
    for entry in Path(proc_root).iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "cmdline").read_bytes()
        except OSError:  # ended while we looked
            continue
        argv = tuple(raw.rstrip(b"\0").decode(errors="replace").split("\0"))
        mode = crihook_command(argv)
        if mode is not None:
            found.append(Running(mode, int(entry.name), argv))
    return sorted(found, key=lambda r: r.pid)


def node_mode(proc_root: str) -> str:
    """In words, for a report's first line."""
    daemons = running(proc_root)
    if not daemons:
        return "crihook is not running on this node"
    return ", ".join(d.describe() for d in daemons)
