"""README.md's configuration reference against crihook/base/config.py: every key documented, none
invented, each default as the code has it."""

from __future__ import annotations

import re
import tomllib
from dataclasses import fields
from pathlib import Path

from crihook.base.config import Config

README = Path(__file__).resolve().parents[2] / "README.md"


def documented() -> dict[str, dict[str, str]]:
    text = README.read_text()
    reference = text[text.index("## Configuration") :]
    reference = reference[: reference.index("\n## ", 1)]
    tables: dict[str, dict[str, str]] = {}
    section = ""
    for line in reference.splitlines():
        if m := re.match(r"^### \[(\w+)\]$", line):
            section = m.group(1)
            tables[section] = {}
        elif m := re.match(r"^\| `(\w+)` \| [^|]+ \| `(.*?)` \|", line):
            tables[section][m.group(1)] = m.group(2)
    return tables


def test_every_key_is_documented_with_its_default() -> None:
    defaults = Config()
    tables = documented()
    assert set(tables) == {f.name for f in fields(defaults)} - {"source"}
    for section, rows in tables.items():
        table = getattr(defaults, section)
        keys = {f.name for f in fields(table)} - {"options"}
        assert set(rows) == keys, section
        for key, default in rows.items():
            value = tomllib.loads(f"v = {default}")["v"]
            want = getattr(table, key)
            assert (list(want) if isinstance(want, tuple) else want) == value, f"[{section}] {key}"


def test_every_metric_is_documented() -> None:
    from crihook.base import metrics

    text = README.read_text()
    section = text[text.index("## Metrics") :]
    section = section[: section.index("\n## ", 1)]
    rows = dict(re.findall(r"^\| `(crihook_\w+)` \| (\w+) \|", section, re.M))
    exposed = {m.name: m.kind for m in metrics.REGISTRY}
    assert rows == exposed
