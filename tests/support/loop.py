"""The event loop's health while something else hangs: the stalled-file-system tests' one check."""

from __future__ import annotations

import asyncio
import time


async def assert_loop_keeps_ticking(ticks: int = 20, step: float = 0.005, limit: float = 0.25) -> None:
    """Sleep `step` `ticks` times; each must come back within `limit` seconds (a loop blocked by a
    read takes as long as the read)."""
    longest = 0.0
    for _ in range(ticks):
        t = time.perf_counter()
        await asyncio.sleep(step)
        longest = max(longest, time.perf_counter() - t)
    assert longest < limit, f"the event loop stalled {longest * 1000:.0f} ms"
