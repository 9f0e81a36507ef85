"""Shipped code never imports the tests: every module of every package pyproject.toml declares, read
where the installed package really has it, is scanned for imports of `tests` (at any depth, inside
functions too, where a lazy import would hide)."""

from __future__ import annotations

import ast
import importlib
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def imported_modules(source: str) -> set[str]:
    """Every module an `import` or `from ... import` in this source names (relative ones as written)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            found.add(node.module)
    return found


def imports_tests(source: str) -> bool:
    return any(name == "tests" or name.startswith("tests.") for name in imported_modules(source))


def shipped_modules() -> list[Path]:
    """The .py files of the declared packages, found through the import system (an editable install
    maps crihook.proxy to proxy/, and so on)."""
    packages: list[str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    files: list[Path] = []
    for name in packages:
        for folder in importlib.import_module(name).__path__:
            files += sorted(Path(folder).glob("*.py"))
    return files


def test_the_scan_finds_an_import_of_tests_wherever_it_is() -> None:
    assert imports_tests("from tests.support.containerd import running_containerd\n")
    assert imports_tests("import tests.support.cri as cri\n")
    assert imports_tests("def f():\n    if True:\n        from tests import support\n")
    assert not imports_tests("from crihook.simnode import containerd\nimport testsuite\nfrom .tests import x\n")


def test_no_shipped_module_imports_tests() -> None:
    files = shipped_modules()
    assert any(f.name == "demo.py" for f in files) and any(f.parent.name == "scheduler" for f in files)
    offenders = [str(f) for f in files if imports_tests(f.read_text())]
    assert offenders == []
