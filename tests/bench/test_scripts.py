"""Every bench script that takes options still starts: its imports resolve and its options parse.

The benchmarks run by hand, so nothing else notices when a rename in the packages breaks one (a
bench once imported an entry point by its old name for a whole round)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if "argparse" in p.read_text())


def test_the_scripts_are_found() -> None:
    assert len(SCRIPTS) >= 10


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_answers_help(script: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
    )
    assert run.returncode == 0, f"{script.name} --help failed:\n{run.stderr[-2000:]}"
    assert "usage:" in run.stdout
