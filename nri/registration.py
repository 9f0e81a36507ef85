"""Whether the runtime holds the plugin after a connection's Synchronize, and when to give the
connection up.

The runtime adds a plugin to those it calls only once its Synchronize succeeded
(`acceptPluginConnections` in NRI's pkg/adaptation/adaptation.go, every release). From NRI v0.8 a
failed or late Synchronize also closes the connection, so the plugin dials again; NRI v0.6.1
(containerd 1.7.16 to 1.7.25) closes nothing (`plugin.synchronize` in pkg/adaptation/plugin.go): the
connection stays open, no call ever comes, and every container starts without crihook. So:

- a Synchronize answered with an error, or later than the runtime's request timeout (an event loop
  held up, for one), gives the connection up at once;
- after a Synchronize answered in time, the first call of the runtime proves it holds the plugin.
  Until then the runtime is looked at over CRI (`unproven_since`); a container it created after the
  Synchronize (and a grace for a creation that raced it) without calling crihook proves it does not,
  and the connection is given up.

Each giving-up is logged as an error and counted in `crihook_nri_unregistered_total`; the plugin then
dials again (nri/stub.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from crihook.base.metrics import NRI_UNREGISTERED

log = logging.getLogger("crihook.nri")

# Seconds after a Synchronize answer before a container the runtime created without calling crihook
# counts against the registration: containerd 1.7 lets a creation race the Synchronize (its NRI call
# made before the plugin was added, the container listed after), and a creation under load takes a
# while between the two. NRI's own registration timeout, as a bound on that while.
GRACE = 5.0


@dataclass
class Registration:
    """One connection's standing with the runtime, from RegisterPlugin to its end."""

    request_timeout: float  # the runtime's, which a Synchronize answer must beat
    clock: Callable[[], int] = time.time_ns  # wall clock: CRI's created_at is one
    synchronized_at: int | None = None  # when the Synchronize answer went out, in time and not an error
    proven: bool = False  # a call came after that answer: the runtime holds the plugin
    dropped: str | None = None  # why the connection is given up
    gone: asyncio.Event = field(default_factory=asyncio.Event)  # set with `dropped`

    def call_received(self) -> None:
        """Any call of the runtime on the plugin's connection."""
        if self.synchronized_at is not None:
            self.proven = True

    def synchronize_answered(self, error: str | None, seconds: float) -> None:
        """The last (or only) Synchronize chunk answered: `error` the answer's status message when it
        was one, `seconds` from its request's arrival to the answer."""
        if error is not None:
            self.drop("sync_failed", f"crihook answered the Synchronize with an error ({error})")
        elif seconds > self.request_timeout:
            late = f"{seconds:.2f} s, past the runtime's {self.request_timeout:g} s request timeout"
            self.drop("sync_late", f"crihook answered the Synchronize after {late}")
        else:
            self.synchronized_at = self.clock()

    def unproven_since(self) -> int | None:
        """Wall-clock nanoseconds after which a container the runtime created proves it does not hold
        the plugin; None while there is nothing to prove (not synchronized yet, proven, given up)."""
        if self.synchronized_at is None or self.proven or self.dropped is not None:
            return None
        return self.synchronized_at + int(GRACE * 1e9)

    def created_without_a_call(self, container_ids: Sequence[str]) -> None:
        """Containers the runtime created after `unproven_since()`, while still no call came."""
        if container_ids and self.unproven_since() is not None:
            ids = ", ".join(c[:13] for c in container_ids[:3])
            why = f"the runtime created container(s) {ids} since the Synchronize without calling crihook"
            self.drop("unproven", why)

    def drop(self, reason: str, why: str) -> None:
        """Give the connection up (`reason` labels the metric); only the first reason counts."""
        if self.dropped is not None:
            return
        self.dropped = why
        NRI_UNREGISTERED.inc(reason)
        log.error(
            "the runtime did not take crihook as its plugin: containers start without crihook until it"
            " registers again; reconnecting",
            extra={"reason": reason, "detail": why},
        )
        self.gone.set()
