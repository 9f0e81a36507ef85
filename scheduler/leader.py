"""Leader election over a `coordination.k8s.io/v1` Lease, so several `crihook scheduler` replicas
run with one allocator in charge.

Our own small loop rather than the `kubernetes` client's `leaderelection` package, because the bind
path needs what that package does not give: `may_write()`, a monotonic-clock answer to "did my last
successful renewal start less than renew_deadline ago", which a bind asks right before it writes.
CLOCK_MONOTONIC keeps counting while a process is stopped (SIGSTOP, a frozen VM), so a leader that
wakes after its lease ran out knows it without talking to anyone. The rules are client-go's
(tools/leaderelection/leaderelection.go, `tryAcquireOrRenew`):
- a standby judges expiry by its own clock: the lease is free once the record it sees has not
  changed for `leaseDurationSeconds` since it first saw it (renewTime is written for people and
  other tools; clocks of two machines are never compared);
- every write carries the resourceVersion read just before, so of two replicas acquiring at once
  one gets 409 Conflict;
- a leader whose renewals have failed for `renew_deadline` stops leading (and stops writing: the
  standby may take over `duration - renew_deadline` later at the earliest);
- on shutdown the leader releases the lease (holder emptied, duration 1 s) so a standby takes over
  at its next look instead of after a full lease.

Takeover after the leader dies: at most duration + 2 x retry_period after its last renewal (the
standby sees a renewal up to one period late, and looks again one period after expiry), plus the
time to rebuild the state from the API server.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol
from urllib.parse import quote

from crihook.scheduler.apijson import ApiJson
from crihook.scheduler.extender import ApiFailure

log = logging.getLogger("crihook.scheduler")


@dataclass(frozen=True)
class LeaseTiming:
    """Seconds. Defaults give a takeover within 10 s of a leader's death, plus the state rebuild."""

    duration: int = 8  # leaseDurationSeconds: how long a record must stay unchanged before a standby takes it
    renew_deadline: float = 5.0  # a leader whose last good renewal started longer ago stops leading
    retry_period: float = 1.0  # between renewals (leader) and looks (standby)

    def __post_init__(self) -> None:
        if not self.duration > self.renew_deadline > self.retry_period > 0:
            raise ValueError(
                "lease timing must satisfy duration > renew deadline > retry period > 0, got "
                f"{self.duration} / {self.renew_deadline} / {self.retry_period}"
            )

    @property
    def worst_takeover(self) -> float:
        return self.duration + 2 * self.retry_period


def micro_time(when: datetime) -> str:
    """metav1.MicroTime's wire form: RFC 3339 with exactly six fractional digits."""
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseApi(Protocol):
    """Raw Lease JSON in and out; errors as ApiFailure (404 on get is None)."""

    def get(self) -> dict[str, Any] | None: ...

    def create(self, body: dict[str, Any]) -> dict[str, Any]: ...

    def replace(self, body: dict[str, Any]) -> dict[str, Any]: ...


class Elector:
    """One replica's side of the election. `step()` is one round (read, then renew, acquire or
    wait); `run()` repeats it every retry period on a thread and calls `on_start` / `on_stop` when
    leadership begins and ends (on that thread)."""

    def __init__(
        self,
        api: LeaseApi,
        identity: str,
        timing: LeaseTiming,
        name: str,
        namespace: str,
        on_start: Callable[[], None] = lambda: None,
        on_stop: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.api = api
        self.identity = identity
        self.timing = timing
        self.name = name
        self.namespace = namespace
        self.on_start = on_start
        self.on_stop = on_stop
        self.clock = clock
        self.wall = wall
        self._leading = False
        self._renewed_at = float("-inf")  # monotonic start of the last successful write as holder
        self._seen: tuple[str, float] = ("", float("-inf"))  # (resourceVersion, first seen at)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- what the rest of the scheduler asks ---

    def may_write(self) -> bool:
        """True while this replica leads and its last good renewal started under renew_deadline ago."""
        return self._leading and self.clock() - self._renewed_at < self.timing.renew_deadline

    @property
    def leading(self) -> bool:
        return self.may_write()

    # --- one round ---

    def _body(self, current: dict[str, Any] | None, now: str) -> dict[str, Any]:
        spec = dict((current or {}).get("spec") or {})
        meta = {"name": self.name, "namespace": self.namespace}
        if current is not None:
            meta["resourceVersion"] = (current.get("metadata") or {}).get("resourceVersion", "")
        if spec.get("holderIdentity") != self.identity:
            # client-go counts every change of holder of an existing lease, a release included
            spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + (current is not None)
            spec["acquireTime"] = now
        spec.update(holderIdentity=self.identity, leaseDurationSeconds=self.timing.duration, renewTime=now)
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}

    def step(self) -> bool:
        """One try to acquire or renew; returns whether this replica may write afterwards."""
        started = self.clock()
        try:
            current = self.api.get()
            if current is not None and not self._ours_or_free(current, started):
                self._leading = False
                return False
            body = self._body(current, micro_time(self.wall()))
            written = self.api.create(body) if current is None else self.api.replace(body)
        except ApiFailure as e:
            if e.code != 409:  # a 409 is another replica's write winning: nothing to report
                log.warning("lease renewal failed", extra={"lease": self.name, "error": str(e)})
            return self.may_write()
        self._renewed_at = started
        self._seen = (str((written.get("metadata") or {}).get("resourceVersion") or ""), started)
        self._leading = True
        return True

    def _ours_or_free(self, lease: dict[str, Any], now: float) -> bool:
        spec = lease.get("spec") or {}
        rv = str((lease.get("metadata") or {}).get("resourceVersion") or "")
        if rv != self._seen[0]:
            self._seen = (rv, now)
        holder = spec.get("holderIdentity") or ""
        if holder == self.identity:
            return True
        duration = spec.get("leaseDurationSeconds") or self.timing.duration
        return not holder or now - self._seen[1] >= duration

    # --- the loop ---

    def run(self) -> None:
        was = False
        while not self._stop.is_set():
            try:
                self.step()
            except Exception:  # an unexpected answer must not end the election thread
                log.exception("lease round failed", extra={"lease": self.name})
            now = self.may_write()
            if now != was:
                log.info("leadership " + ("acquired" if now else "lost"), extra={"identity": self.identity})
                (self.on_start if now else self.on_stop)()
                was = now
            self._stop.wait(self.timing.retry_period)
        if was:
            self.on_stop()

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="leader-election", daemon=True)
        self._thread.start()

    def stop(self, release: bool = True) -> None:
        """End the loop; a leader then hands the lease back so a standby need not wait it out.

        Released even past the renew deadline (the term's end, its watches and label, can take that
        long on a busy node): the write carries the resourceVersion of a record that still names this
        replica, so it fails if another replica has taken the lease meanwhile."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timing.retry_period + 10)
        if release and self._leading:
            self._leading = False
            try:
                current = self.api.get()
                if current is not None and (current.get("spec") or {}).get("holderIdentity") == self.identity:
                    body = self._body(current, micro_time(self.wall()))
                    body["spec"].update(holderIdentity="", leaseDurationSeconds=1)
                    self.api.replace(body)
                    log.info("lease released", extra={"lease": self.name})
            except ApiFailure as e:
                log.warning("lease release failed", extra={"lease": self.name, "error": str(e)})


class KubeLeaseApi:
    """LeaseApi through ApiJson (scheduler/apijson.py): bodies as JSON (the generated models parse
    MicroTime into datetimes we would only format back)."""

    def __init__(self, api_client: Any, name: str, namespace: str, timeout: float = 5.0) -> None:
        self.api = ApiJson(api_client, timeout)
        self.name = name
        self.namespace = namespace
        self.path = f"/apis/coordination.k8s.io/v1/namespaces/{quote(namespace, safe='')}/leases"

    def get(self) -> dict[str, Any] | None:
        try:
            return self.api.call("GET", f"{self.path}/{quote(self.name, safe='')}")
        except ApiFailure as e:
            if e.code == 404:
                return None
            raise

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.api.call("POST", self.path, body)

    def replace(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.api.call("PUT", f"{self.path}/{quote(self.name, safe='')}", body)
