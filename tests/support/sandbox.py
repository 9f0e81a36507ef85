"""The shipped units' file-system sandbox for a test's daemon, where no systemd runs as PID 1 to
apply it: `ProtectSystem=strict` (every mount read-only, /dev, /proc and /sys aside, which systemd
leaves to other options) and `ReadWritePaths=` (each path bound back writable), in a private mount
namespace, by the kernel operations systemd's own namespace code uses (a read-only bind remount of
each mount point, a bind of each writable path onto itself remounted read-write). The chart's
DaemonSet has the same shape: a read-only root file system and the host paths it mounts writable.

`sandboxed(paths)` is the prefix that goes before the daemon's command, which it then execs."""

from __future__ import annotations

import configparser
import os
import subprocess
import sys
from pathlib import Path

_API = ("/dev", "/proc", "/sys")  # left as they are by ProtectSystem=


def unit_service(unit: Path) -> dict[str, str]:
    """The [Service] section of a unit file (a key given twice: its last value)."""
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(unit.read_text())
    return dict(parser["Service"])


def sandboxed(writable: list[Path]) -> tuple[str, ...]:
    return (
        "unshare",
        "--mount",
        "--propagation",
        "private",
        sys.executable,
        str(Path(__file__).resolve()),
        *(f"--rw={p}" for p in writable),
        "--",
    )


def _mount_points() -> list[str]:
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")  # \040 for a space
        if not any(point == a or point.startswith(a + "/") for a in _API):
            points.append(point)
    return sorted(set(points), key=len)


def main(argv: list[str]) -> None:
    split = argv.index("--")
    writable = [a.removeprefix("--rw=") for a in argv[:split]]
    command = argv[split + 1 :]
    for point in _mount_points():
        done = subprocess.run(["mount", "-o", "remount,bind,ro", point], capture_output=True, text=True)
        if done.returncode != 0 and point in _mount_points():  # else unmounted meanwhile (another test's)
            raise RuntimeError(f"{point} can not be made read-only: {done.stderr.strip()}")
    for path in writable:
        subprocess.run(["mount", "--bind", path, path], check=True)
        subprocess.run(["mount", "-o", "remount,bind,rw", path], check=True)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
