"""The two ways a newcomer first meets crihook, done the way they do them: `bash demo.sh` in a fresh
clone with nothing run before it, and `crihook demo` from the wheel installed into a new virtual
environment, run from a directory with no checkout in it. Both reach PyPI through pip (its cache
makes a second run quick)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from crihook.simnode.containerd import missing_requirements
from tests.cli.test_demo import check, run_demo
from tests.support.image_build import offline

ROOT = Path(__file__).resolve().parents[2]
INSTALL_TIMEOUT = 600  # a cold pip cache downloads about 60 MB of wheels

pytestmark = pytest.mark.slow


def test_wheel_demo_in_a_new_venv(tmp_path: Path) -> None:
    wheel = offline.build_wheel(tmp_path / "dist")
    venv = tmp_path / "venv"
    python = shutil.which("python3") or "python3"  # the one a user types (tests/run.sh checks its venv)
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [venv / "bin" / "python", "-m", "pip", "install", "-q", str(wheel)],
        check=True,
        timeout=INSTALL_TIMEOUT,
        stdin=subprocess.DEVNULL,
    )
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    where = subprocess.run(
        [venv / "bin" / "python", "-c", "import crihook.simnode, sys; print(crihook.simnode.__file__)"],
        cwd=outside,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert where.startswith(str(venv)), where  # the installed package, not this checkout
    crihook = [str(venv / "bin" / "crihook"), "demo"]
    check(run_demo("--runtime", "embedded", command=crihook, cwd=outside))
    # the wheel carries its private containerd (pause image source included); where the machine
    # cannot run one, the demo says why plainly, not with a traceback
    why = missing_requirements()
    if why is None:
        check(run_demo("--runtime", "containerd", command=crihook, cwd=outside))
    else:
        refused = subprocess.run([*crihook, "--runtime", "containerd"], cwd=outside, capture_output=True, text=True)
        assert refused.returncode != 0 and why in refused.stderr, refused.stderr


def fresh_clone(dest: Path) -> Path:
    """`git clone` of this repository, with the working tree's uncommitted edits and new files laid
    over it, so the test checks what is checked out here (in CI the two are the same)."""
    subprocess.run(["git", "clone", "-q", str(ROOT), str(dest)], check=True)
    for rel in offline.sources():
        if not (dest / rel).exists() or (dest / rel).read_bytes() != (ROOT / rel).read_bytes():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=dest, capture_output=True, check=True).stdout.decode()
    for rel in filter(None, tracked.split("\0")):  # deleted here but not yet committed
        if not (ROOT / rel).exists():
            (dest / rel).unlink()
    return dest


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_demo_sh_in_a_fresh_clone(tmp_path: Path) -> None:
    clone = fresh_clone(tmp_path / "crihook")
    assert not (clone / ".venv").exists() and not (clone / "tests" / ".cache").exists()
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}  # nothing of ours
    check(run_demo(command=["bash", str(clone / "demo.sh")], cwd=tmp_path, env=env))
