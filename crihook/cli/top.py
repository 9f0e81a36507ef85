"""`crihook top`: per pod what `nvidia-smi` shows per GPU: one row per container with its GPUs, its
grant (core and memory: the scheduler's, or the share of the DRA claim its GPUs came through, which
is named) and what its processes use (memory, SM utilisation), redrawn every second.

It reads the running daemon's last usage collection from the state dir (`usage.json`, written by
the usage collector every `[usage] interval_seconds`), so it needs no access to the GPUs or /proc
and no privilege beyond reading that directory.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from crihook.base.config import DEFAULT_CONFIG
from crihook.cli import state_dir as cli_state_dir
from crihook.devices import usage

GiB = 1 << 30
MiB = 1 << 20
STALE_INTERVALS = 3  # a file older than this many intervals: the daemon is not collecting


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="crihook's config file (default %(default)s)")
    parser.add_argument("--state-dir", help="read the usage from here instead of proxy.state_dir")
    parser.add_argument("--once", action="store_true", help="print once and exit")
    parser.add_argument("--json", action="store_true", help="the rows as JSON (one document per refresh)")
    parser.add_argument("--refresh", type=float, default=1.0, help="seconds between redraws (default %(default)s)")


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / GiB:.1f}Gi" if n >= GiB else f"{n / MiB:.0f}Mi"


def _gpu_names(state: usage.State) -> dict[str, str]:
    """GPU UUID -> its minor, as a row names it."""
    return {g.uuid: str(g.minor) for g in state.gpus}


def _device_name(names: dict[str, str], u: usage.Usage) -> str:
    gpu = names.get(u.gpu, u.gpu[:12])
    return gpu if u.device == u.gpu else f"{gpu}:{u.device[:12]}"


def _who(t: usage.ContainerTotals) -> tuple[str, str]:
    o = t.owner
    if o.kind == usage.CONTAINER:
        return f"{o.namespace}/{o.pod}", o.container
    if o.kind == usage.UNKNOWN:
        return "(unknown container)", o.container_id[:13]
    return f"({o.kind})", "-"


def rows_json(state: usage.State, now: float) -> dict[str, Any]:
    """What --json prints: the collection's time and one object per container."""
    names = _gpu_names(state)
    rows = []
    for t in usage.per_container(state):
        rows.append(
            {
                "kind": t.owner.kind,
                "namespace": t.owner.namespace,
                "pod": t.owner.pod,
                "container": t.owner.container,
                "container_id": t.owner.container_id,
                "gpus": [_device_name(names, u) for u in t.devices],
                "granted_core": t.granted_core,
                "granted_memory": t.granted_memory,
                "used_memory": t.used_memory,
                "sm_util": t.sm_util,
                "over_grant": t.over_grant,
                "claims": list(t.claims),
                "pids": sorted({p for u in t.devices for p in u.pids}),
            }
        )
    return {"taken_at": state.taken_at, "age_seconds": round(now - state.taken_at, 1), "rows": rows}


def render(state: usage.State, now: float) -> str:
    """The table: a line per GPU (memory used of total), then a row per container."""
    age = now - state.taken_at
    head = f"crihook top: {len(state.gpus)} GPUs, collected {age:.0f}s ago (every {state.interval:g}s)"
    if age > STALE_INTERVALS * state.interval:
        head += "  STALE: is crihook running?"
    lines = [head]
    if state.reason:
        lines.append(f"NVML: {state.reason}")
    for g in state.gpus:
        lines.append(f"  GPU {g.minor:<3} {_size(g.memory_used):>8} / {_size(g.memory_total):<8} {g.uuid}")
    names = _gpu_names(state)
    table = [("POD", "CONTAINER", "GPUS", "CORE", "GRANTED", "USED", "SM%", "PIDS", "CLAIM")]
    totals = usage.per_container(state)
    for t in totals:
        pod, container = _who(t)
        table.append(
            (
                pod,
                container,
                ",".join(_device_name(names, u) for u in t.devices),
                "-" if t.granted_core is None else f"{t.granted_core}%",
                _size(t.granted_memory),
                _size(t.used_memory) + ("!" if t.over_grant else ""),
                "-" if t.sm_util is None else f"{t.sm_util:.0f}",
                str(len({p for u in t.devices for p in u.pids})),
                ",".join(t.claims) or "-",
            )
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    lines.append("")
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table]
    if any(t.over_grant for t in totals):
        lines.append("! above its memory grant (reported only)")
    return "\n".join(lines) + "\n"


def read_state(state_dir: str) -> usage.State:
    """The daemon's last collection; OSError or usage.StateError when there is none to read."""
    path = Path(state_dir) / usage.STATE_FILE
    try:
        doc = json.loads(path.read_text())
    except ValueError as e:
        raise usage.StateError(f"{path}: {e}") from None
    return usage.decode(doc)


def run(args: argparse.Namespace) -> int:
    state_dir = cli_state_dir(args, "top")
    if state_dir is None:
        return 2
    while True:
        try:
            state = read_state(state_dir)
        except FileNotFoundError:
            print(
                f"crihook top: no usage at {Path(state_dir) / usage.STATE_FILE}: crihook is not running, or "
                "[usage] enabled is off",
                file=sys.stderr,
            )
            return 1
        except (OSError, usage.StateError) as e:
            print(f"crihook top: {e}", file=sys.stderr)
            return 1
        now = time.time()
        if args.json:
            text = json.dumps(rows_json(state, now), sort_keys=True) + "\n"
        else:
            text = render(state, now)
            if not args.once:
                text = "\x1b[H\x1b[2J" + text  # redraw in place, as top does
        sys.stdout.write(text)
        sys.stdout.flush()
        if args.once:
            return 0
        time.sleep(args.refresh)
