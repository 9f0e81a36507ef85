"""sd_notify without libsystemd, for the node daemon in either mode: READY=1 once serving,
WATCHDOG=1 from the event loop itself, so a stalled loop stops the pings and systemd restarts the
daemon."""

from __future__ import annotations

import asyncio
import os
import socket


def notify(message: str) -> bool:
    """Send one notification; False when not started by systemd with Type=notify."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        s.connect(addr)
        s.sendall(message.encode())
    return True


def watchdog_interval() -> float | None:
    """Half of WatchdogSec when the watchdog is on for this process, else None."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2e6
    except ValueError:
        return None


async def watchdog(interval: float) -> None:
    while True:
        notify("WATCHDOG=1")
        await asyncio.sleep(interval)
