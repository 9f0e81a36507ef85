"""Cost of crihook's metrics on the proxy's hot path: one counter increment and one histogram
observation per CRI call, and one scrape of a registry the size of a busy node's.

    .venv/bin/python bench/metrics_hot_path.py

Prints nanoseconds per update and milliseconds per scrape (best of 5 runs).
"""

from __future__ import annotations

import argparse
import timeit

from crihook.base.metrics import Counter, Histogram, Registry

METHODS = [f"/runtime.v1.RuntimeService/Method{i}" for i in range(30)]


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    reg = Registry()
    calls = Counter("bench_calls_total", "calls", ("method", "code"), registry=reg)
    backend = Histogram("bench_backend_seconds", "backend", ("method",), registry=reg)
    method = METHODS[0]
    calls.inc(method, "OK")
    backend.observe(0.001, method)
    n = 200_000
    inc = min(timeit.repeat(lambda: calls.inc(method, "OK"), number=n, repeat=5)) / n
    obs = min(timeit.repeat(lambda: backend.observe(0.00042, method), number=n, repeat=5)) / n
    for m in METHODS:  # every method seen with a few codes, as after days of uptime
        for code in ("OK", "NOT_FOUND", "DEADLINE_EXCEEDED", "UNAVAILABLE"):
            calls.inc(m, code)
        backend.observe(0.002, m)
    scrape = min(timeit.repeat(reg.render, number=50, repeat=5)) / 50
    size = len(reg.render())
    print(f"counter inc (existing series):      {inc * 1e9:7.0f} ns")
    print(f"histogram observe (existing series): {obs * 1e9:7.0f} ns")
    print(f"scrape, {len(METHODS) * 4} counter + {len(METHODS)} histogram series: {scrape * 1e3:.2f} ms ({size} bytes)")


if __name__ == "__main__":
    main()
