"""Builds the installed package layout as a tree of symbolic links, for the tools that find modules by
walking directories (mypy, import-linter): an editable install maps `crihook.proxy` to proxy/ with an
import hook they do not see. The mapping is read from pyproject.toml's package-dir, the one place that
says which folder is which package.

    python tests/package_tree.py DIR    # then DIR/crihook is the package; put DIR on the path
"""

from __future__ import annotations

import shutil
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build(dest: Path) -> None:
    package_dir: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    shutil.rmtree(dest, ignore_errors=True)
    top = dest / "crihook"
    top.mkdir(parents=True)
    # the root package's own entries, then each mapped sub-package over its name
    for entry in (ROOT / package_dir["crihook"]).iterdir():
        if entry.name != "__pycache__":
            (top / entry.name).symlink_to(entry)
    for name, folder in package_dir.items():
        if name != "crihook":
            link = dest / Path(*name.split("."))
            link.unlink(missing_ok=True)
            link.symlink_to(ROOT / folder)


if __name__ == "__main__":
    build(Path(sys.argv[1]).resolve())
