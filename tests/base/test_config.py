"""README.md's configuration reference against the declarations: crihook/base/config.py's sections
and the options each installed hook's factory declares. Every key documented, none invented, each
default as the code has it."""

from __future__ import annotations

import re
import tomllib
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from crihook.base.config import Config, HookPolicy, parse
from crihook.hooks.base import options_type
from crihook.hooks.registry import discover_factories

README = Path(__file__).resolve().parents[2] / "README.md"


def documented() -> dict[str, dict[str, str]]:
    text = README.read_text()
    reference = text[text.index("## Configuration") :]
    reference = reference[: reference.index("\n## ", 1)]
    tables: dict[str, dict[str, str]] = {}
    section = ""
    for line in reference.splitlines():
        if m := re.match(r"^### \[([\w.<>]+)\]$", line):
            section = m.group(1)
            tables[section] = {}
        elif m := re.match(r"^\| `(\w+)` \| [^|]+ \| (`.*?`|none) \|", line):
            tables[section][m.group(1)] = m.group(2)
    return tables


def declared() -> dict[str, Any]:
    """Table name -> its declaration's defaults: crihook's sections, the keys every hook table has,
    and each installed hook's options with their sub-tables."""
    out: dict[str, Any] = {f.name: v for f in fields(Config) if is_dataclass(v := getattr(Config(), f.name))}
    out["hooks.<name>"] = HookPolicy()
    pending = [(f"hooks.{name}", options_type(factory)()) for name, factory in discover_factories().items()]
    while pending:
        name, table = pending.pop()
        if fields(table):
            out[name] = table
        pending += [(f"{name}.{f.name}", v) for f in fields(table) if is_dataclass(v := getattr(table, f.name))]
    return out


def test_every_key_is_documented_with_its_default() -> None:
    tables = documented()
    defaults = declared()
    assert set(tables) == set(defaults)
    for section, rows in tables.items():
        table = defaults[section]
        keys = {
            f.name for f in fields(table) if f.metadata.get("key", True) and not is_dataclass(getattr(table, f.name))
        }
        assert set(rows) == keys, section
        for key, default in rows.items():
            value = None if default == "none" else tomllib.loads(f"v = {default.strip('`')}")["v"]
            want = getattr(table, key)
            assert (list(want) if isinstance(want, tuple) else want) == value, f"[{section}] {key}"


def test_the_runtime_endpoint_is_a_node_key_and_the_proxy_key_still_read() -> None:
    assert parse({}).node.runtime_endpoint == "unix:///run/containerd/containerd.sock"
    new = parse({"node": {"runtime_endpoint": "unix:///run/k3s/containerd.sock"}})
    assert (new.node.runtime_endpoint, new.deprecations) == ("unix:///run/k3s/containerd.sock", ())
    old = parse({"proxy": {"runtime_endpoint": "unix:///old.sock"}}, "/etc/crihook/config.toml")
    assert old.node.runtime_endpoint == "unix:///old.sock"
    assert old.deprecations == (
        "/etc/crihook/config.toml [proxy].runtime_endpoint is deprecated: move it to [node].runtime_endpoint",
    )
    both = parse({"proxy": {"runtime_endpoint": "unix:///old.sock"}, "node": {"runtime_endpoint": "unix:///new.sock"}})
    assert both.node.runtime_endpoint == "unix:///new.sock"
    assert both.deprecations == (
        "config [proxy].runtime_endpoint is ignored: [node].runtime_endpoint is set; remove the [proxy] key",
    )
