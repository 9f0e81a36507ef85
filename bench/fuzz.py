"""The long fuzz run: every fuzz target with hypothesis' "fuzz" profile (10,000 examples each).

    python bench/fuzz.py [pytest -k expression]

Runs tests/reliability/test_fuzz_*.py (annotation, checkpoint and store-file mutation, the CRI request decoder,
malformed HTTP/2 at the daemon's socket, which needs root and containerd; NRI's ttrpc and multiplexer
decoders and the NRI plugin fed arbitrary calls and bytes by a runtime the test plays) with
CRIHOOK_HYPOTHESIS_PROFILE=fuzz and prints, per target, the cases run and the failing cases
(crashes) as hypothesis counted them. Exits non-zero when any target failed.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = re.compile(r"^(tests/\S+::\S+):\s*$")
COUNTS = re.compile(r"(\d+) passing, (\d+) failing, and (\d+) invalid")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("select", nargs="?", help="a pytest -k expression: only the targets it selects")
    args = ap.parse_args()
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "reliability").glob("test_fuzz_*.py"))
    cmd = [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider", "--hypothesis-show-statistics"]
    if args.select:
        cmd += ["-k", args.select]
    env = {**os.environ, "CRIHOOK_HYPOTHESIS_PROFILE": "fuzz"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    totals: dict[str, list[int]] = {}
    target = None
    for line in done.stdout.splitlines():
        if m := TARGET.match(line):
            target = m.group(1)
        elif target and (m := COUNTS.search(line)):
            passing, failing, _ = (int(x) for x in m.groups())
            counts = totals.setdefault(target, [0, 0])
            counts[0] += passing + failing
            counts[1] += failing
    print(f"{'target':<78}{'cases':>8}{'crashes':>9}")
    for name, (cases, failing) in totals.items():
        print(f"{name:<78}{cases:>8}{failing:>9}")
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-2000:]
    print(f"pytest: {summary}")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
