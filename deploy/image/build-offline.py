"""Build the crihook image offline, without a registry or a container builder:  python3 deploy/image/build-offline.py

The same image as the Containerfile beside it, made from what these machines can reach: a Debian
bookworm root file system from Debian's packages (mmdebstrap), crihook's wheel built from this
checkout and its dependencies' wheels from PyPI installed into a virtual environment in it at
/opt/crihook, user 65532, written as a one-layer OCI archive that `ctr images import` takes.

The archive is cached under `$XDG_CACHE_HOME/crihook/image` (else ~/.cache/crihook/image) by a
hash of its inputs (the files the wheel is built from, pyproject.toml, this script and the OCI
writer), so a second build is a lookup. Prints the archive's path; `--ref` the reference it tags.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

REGISTRY = "ghcr.io/crihook/crihook"
SUITE = "bookworm"  # its python3 is 3.11, which the dependency wheels are chosen for
PYTHON_TAG = ("3.11", "cp311")
# python3-venv brings ensurepip's pip, which installs the wheels; passwd has useradd
PACKAGES = ("python3", "python3-venv", "passwd")
VENV = "/opt/crihook"
UID = 65532
IMAGE_CONFIG = {
    "User": f"{UID}:{UID}",
    "Entrypoint": [f"{VENV}/bin/crihook"],
    "Cmd": ["scheduler"],
    "Env": [f"PATH={VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "PYTHONUNBUFFERED=1"],
    "WorkingDir": "/",
}


def version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def ref() -> str:
    """The reference the archive carries, which deploy/scheduler/deployment.yaml runs."""
    return f"{REGISTRY}:{version()}"


def sources() -> list[Path]:
    """The checkout's files as git sees them (tracked, plus new ones not ignored), relative to ROOT:
    what a clone would hold, without .venv, caches or build leftovers."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    return sorted(p for p in map(Path, listed.decode().split("\0")) if str(p) and (ROOT / p).is_file())


def build_wheel(out: Path) -> Path:
    """crihook's wheel, built from a copy of the checkout's files (an in-tree build would reuse a
    stale build/ directory)."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="crihook-wheel-") as tmp:
        src = Path(tmp) / "src"
        for rel in sources():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(src)],
            check=True,
            stdin=subprocess.DEVNULL,
        )
    (wheel,) = out.glob(f"crihook-{version()}-*.whl")
    return wheel
