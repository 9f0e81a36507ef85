"""`crihook serve` for the tests (crihook.simnode.daemon), and in-process hooks installed the way a
plugin package installs them."""

from __future__ import annotations

import os
from pathlib import Path

from crihook.simnode.daemon import Crihook, CrihookError, running_crihook  # noqa: F401  (what tests import)


def install_hook_package(site: Path, name: str, source: str) -> dict[str, str]:
    """Register an in-process hook the way a real plugin package does: a module plus a dist-info
    with a `crihook.hooks` entry point, in `site`. Returns the env that puts `site` on the daemon's
    path (PYTHONPATH); pass it to `running_crihook(env=...)`."""
    module = f"crihook_test_{name}"
    site.mkdir(parents=True, exist_ok=True)
    (site / f"{module}.py").write_text(source)
    dist = site / f"{module}-0.1.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[crihook.hooks]\n{name} = {module}:factory\n")
    path = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": f"{site}{os.pathsep}{path}" if path else str(site)}
