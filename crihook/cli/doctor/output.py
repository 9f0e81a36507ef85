"""The findings as an operator reads them (a table with the fixes under their findings) or as JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict

from crihook.cli.doctor.finding import Finding, Level


def render(findings: Sequence[Finding], source: str) -> str:
    width = max(len(f.check) for f in findings)
    lines = [f"crihook doctor: checking this node with {source}", ""]
    for f in findings:
        label = {Level.OK: "ok", Level.WARN: "WARN", Level.FAIL: "FAIL"}[f.level]
        lines.append(f"  {label:<4}  {f.check:<{width}}  {f.found}")
        if f.fix:
            lines.append(f"        {'':<{width}}  fix: {f.fix}")
    fails = sum(f.level is Level.FAIL for f in findings)
    warns = sum(f.level is Level.WARN for f in findings)
    lines.append("")
    if fails or warns:
        lines.append(f"{fails} problem(s), {warns} warning(s).")
    else:
        lines.append("Everything crihook needs on this node is in order.")
    return "\n".join(lines) + "\n"


def render_json(findings: Sequence[Finding]) -> str:
    return json.dumps([asdict(f) for f in findings], indent=2) + "\n"
