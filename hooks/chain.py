"""Runs the hooks of one CRI call's stage: fixed order, a timeout each, a failure policy each, every
edit checked against the allowlist (hooks/allowlist.py) and applied to the view the next hook sees
(hooks/edit.py); blocking hooks on the worker threads of hooks/executor.py, unless they answer from
memory. hooks/registry.py builds the chain from the configuration."""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc

from crihook.base.metrics import HOOK_FAILURES, HOOK_SECONDS
from crihook.hooks.allowlist import Allowlist
from crihook.hooks.base import (
    Edit,
    Hook,
    HookContext,
    HookError,
    Miss,
    PodInfo,
    PreparesPods,
    Stage,
)
from crihook.hooks.edit import apply_edit
from crihook.hooks.executor import DaemonThreads

log = logging.getLogger("crihook.hooks")


# Blocking hooks run on the chain's own threads. A call still running past its timeout keeps its
# thread (Python can not stop it): the pool starts another in its place, and a hook with
# STUCK_PER_HOOK such calls is not called again (its calls fail at once) until one returns. So a
# hanging hook costs a bounded number of threads and never the threads every other hook needs.
STUCK_PER_HOOK = 2


SPARE_WORKERS = 4


# PreCreateContainer -> pre_create_container, the metrics label
_STAGE_LABELS = {s: "".join("_" + c.lower() if c.isupper() else c for c in s.value).lstrip("_") for s in Stage}


@dataclass(frozen=True, slots=True)
class Registered:
    hook: Hook
    policy: str  # "fail" | "ignore"
    timeout: float  # seconds
    is_async: bool
    # an async hook declaring `follows_call_deadline`, with no timeout_ms of its own: its limit is
    # what is left of the CRI call's deadline (a call without one gets `timeout`)
    follows_deadline: bool = False
    # a blocking hook with `handle_cached` (hooks.base.Recalls): tried on the event loop first
    cached: bool = False
    # the hook narrows its stages call by call (`wants(stage)`; see HookChain.wants)
    narrows: bool = False


@dataclass(slots=True)
class HookRecord:
    """What one hook did to one call; kept in the store for `crihook inspect`."""

    hook: str
    stage: str
    result: str  # "ok" | "noop" | "ignored-error" | "failed"
    ms: float
    # the reason of a failure; the edit of an "ok", summarised only when the record is kept (after the call)
    detail: Any = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"hook": self.hook, "stage": self.stage, "result": self.result}
        out["ms"] = round(self.ms, 3)
        if self.detail:
            out["detail"] = self.detail.summary() if isinstance(self.detail, Edit) else self.detail
        return out


@dataclass(slots=True)
class Outcome:
    ctx: HookContext
    records: list[HookRecord] = field(default_factory=list)
    error: HookError | None = None  # set when a `fail` hook refused: the call must not go on


def _error_reason(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


class HookChain:
    def __init__(self, hooks: Iterable[Registered], allowlist: Allowlist) -> None:
        self.hooks = tuple(hooks)
        self.allowlist = allowlist
        self._by_stage: dict[Stage, tuple[Registered, ...]] = {
            s: tuple(r for r in self.hooks if s in r.hook.stages) for s in Stage
        }
        self._narrowed = {s: any(r.narrows for r in regs) for s, regs in self._by_stage.items()}
        self._preparing = tuple(r.hook for r in self.hooks if isinstance(r.hook, PreparesPods))
        blocking = sum(1 for r in self.hooks if not r.is_async)
        self._executor = DaemonThreads(SPARE_WORKERS + STUCK_PER_HOOK * blocking) if blocking else None
        self._stuck_lock = threading.Lock()
        self._stuck: dict[str, int] = {}  # hook name -> its calls still running past their timeout

    def _stuck_change(self, name: str, delta: int) -> None:
        with self._stuck_lock:
            self._stuck[name] = self._stuck.get(name, 0) + delta

    def wants(self, stage: Stage) -> bool:
        """False lets the proxy forward a call untouched without decoding it. A hook may narrow its
        `stages` call by call with `wants(stage)` (a remote hook with no server for the stage)."""
        return any(not r.narrows or r.hook.wants(stage) for r in self._by_stage[stage])  # type: ignore[attr-defined]

    def prepare_pod(self, pod: PodInfo) -> None:
        """Once a pod's sandbox has started: each hook's per-pod work that needs no I/O (see
        PreparesPods). A hook that fails here fails again, with its policy, at CreateContainer."""
        for hook in self._preparing:
            try:
                hook.prepare_pod(pod)
            except Exception:
                log.exception("hook prepare_pod failed", extra={"hook": hook.name, "pod": pod.ref})

    async def close(self) -> None:
        """Release what hooks hold (a remote hook's channels) once this chain is replaced or the
        daemon stops; a hook that has no `close` holds nothing."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)  # jobs already queued belong to calls still running
        for reg in self.hooks:
            close = getattr(reg.hook, "close", None)
            if close is None:
                continue
            try:
                result = close()
                if inspect.isawaitable(result):
                    await result
            except Exception:
                log.exception("hook close failed", extra={"hook": reg.hook.name})

    async def run(self, ctx: HookContext) -> Outcome:
        """Every hook of the stage that wants the call, in order, each edit applied to the view the
        next one sees, until the end or a refusal. Async hooks run on the event loop; blocking ones
        that answer from memory too (`_run_cached`), the rest on a worker thread. A call whose hooks
        all answer at once never leaves this coroutine."""
        out = Outcome(ctx)
        regs = self._by_stage[ctx.stage]
        if self._narrowed[ctx.stage]:  # a hook that does not want this call is not called
            regs = tuple(r for r in regs if not r.narrows or r.hook.wants(ctx.stage))  # type: ignore[attr-defined]
        i = 0
        try:
            while i < len(regs) and out.error is None:
                if regs[i].is_async:
                    await self._run_async(regs[i], out)
                    i += 1
                    continue
                end = _blocking_end(regs, i)
                i = self._run_cached(regs, i, end, out)
                if i < end and out.error is None:
                    i += await self._run_blocking(regs[i:end], out)
        finally:
            self._count(out)
        return out

    def _count(self, out: Outcome) -> None:
        """The outcome's records in the hook metrics."""
        stage = _STAGE_LABELS[out.ctx.stage]
        for r in out.records:
            HOOK_SECONDS.observe(r.ms / 1000, r.hook, stage)
            if r.result in ("failed", "ignored-error"):
                HOOK_FAILURES.inc(r.hook)

    async def _run_async(self, reg: Registered, out: Outcome) -> None:
        start = time.perf_counter()
        limit = reg.timeout
        if reg.follows_deadline and out.ctx.deadline is not None:
            limit = max(out.ctx.deadline - time.monotonic(), 0.0)
        try:  # wait_for, not asyncio.timeout: on 3.11 a rewrite runs its first step outside any task (link.start)
            result: Any = await asyncio.wait_for(reg.hook.handle(out.ctx), limit)  # type: ignore[arg-type]
        except Exception as exc:
            self._settle(reg, out, start, exc=exc, limit=limit)
        else:
            self._settle(reg, out, start, result=result, limit=limit)

    def _run_cached(self, regs: tuple[Registered, ...], i: int, j: int, out: Outcome) -> int:
        """Run blocking hooks i..j-1 on the event loop for as long as each answers from what it
        remembers (`handle_cached`, which never reads a file); the first that answers MISS, and all
        after it, go to a worker thread. Returns the first not run. The hand-off, not the hooks, is
        most of what a warm hook costs: this is the common case."""
        while i < j and out.error is None and regs[i].cached:
            reg = regs[i]
            start = time.perf_counter()
            try:
                result = reg.hook.handle_cached(out.ctx)  # type: ignore[attr-defined]
            except Exception as exc:
                self._settle(reg, out, start, exc=exc)
            else:
                if isinstance(result, Miss):
                    return i
                self._settle(reg, out, start, result=result)
            i += 1
        return i

    async def _run_blocking(self, regs: tuple[Registered, ...], out: Outcome) -> int:
        """Run consecutive blocking hooks in one worker-thread hand-off (the hand-off, not the hooks,
        is most of what they cost) while the event loop enforces each hook's own timeout. Returns how
        many of `regs` are settled; a hook still running past its timeout is settled as timed out and
        abandoned, and the caller goes on with the rest."""
        run = _BlockingRun(regs, Outcome(out.ctx), self, started=time.perf_counter())
        future = asyncio.get_running_loop().run_in_executor(self._executor, run.work)
        while True:
            with run.lock:
                k, started = run.settled, run.started
            if k >= len(regs) or run.work_out.error is not None:
                break
            remaining = regs[k].timeout - (time.perf_counter() - started)
            try:
                await asyncio.wait_for(asyncio.shield(future), max(remaining, 0.0))
                break
            except TimeoutError:
                with run.lock:
                    if run.settled != k or time.perf_counter() - run.started < regs[k].timeout:
                        continue  # it moved on meanwhile
                    run.abandoned = True
                    if run.running:  # the worker is inside regs[k].handle and keeps its thread
                        run.counted = True
                        self._stuck_change(regs[k].hook.name, +1)
                        assert self._executor is not None
                        self._executor.write_off()
                    k = run.settled
                break
        with run.lock:
            run.abandoned = True
            out.ctx = run.work_out.ctx
            out.records.extend(run.work_out.records)
            out.error = run.work_out.error
            k = run.settled
        if k < len(regs) and out.error is None:
            self._settle(regs[k], out, run.started, exc=TimeoutError())
            return k + 1
        return k

    def _settle(
        self,
        reg: Registered,
        out: Outcome,
        start: float,
        result: Any = None,
        exc: BaseException | None = None,
        limit: float | None = None,
    ) -> None:
        """Account for one hook's answer: check it, apply it to the view, record it, apply its policy.
        `limit`: the seconds it had, when not its configured timeout."""
        name = reg.hook.name
        stage = out.ctx.stage
        limit = reg.timeout if limit is None else limit
        try:
            if exc is not None:
                raise exc
            if time.perf_counter() - start > limit:
                raise TimeoutError
            if result is not None and not isinstance(result, Edit):
                raise TypeError(f"returned {type(result).__name__}, not an Edit or None")
            edit = result
            if edit is not None and not edit.is_empty():
                if stage.is_post:
                    raise ValueError("post hooks can not change the call")
                bad = self.allowlist.check(edit)
                if bad is not None:
                    raise HookError(
                        grpc.StatusCode.PERMISSION_DENIED,
                        f"host path {bad!r} is outside the allowed device and mount paths",
                    )
                out.ctx = apply_edit(out.ctx, edit)
                out.records.append(HookRecord(name, stage, "ok", _ms(start), edit))
            else:
                out.records.append(HookRecord(name, stage, "noop", _ms(start)))
        except Exception as e:  # a hook must never take the daemon down
            err = _as_hook_error(e, limit)
            ctx = out.ctx
            if reg.policy == "fail" and not stage.is_post:
                out.records.append(HookRecord(name, stage, "failed", _ms(start), err.reason))
                out.error = HookError(err.code, f"hook {name}: {_subject(ctx)}: {err.reason}")
                log.warning(
                    "hook failed", extra={"hook": name, "stage": stage.value, **ctx.log_fields(), "reason": err.reason}
                )
                return
            out.records.append(HookRecord(name, stage, "ignored-error", _ms(start), err.reason))
            log.warning(
                "hook error ignored",
                extra={"hook": name, "stage": stage.value, **ctx.log_fields(), "reason": err.reason},
            )


@dataclass
class _BlockingRun:
    """The worker-thread side of `HookChain._run_blocking`. Everything shared with the event loop
    is read and written under `lock`; once the loop sets `abandoned`, the worker changes nothing."""

    regs: tuple[Registered, ...]
    work_out: Outcome
    chain: HookChain
    lock: threading.Lock = field(default_factory=threading.Lock)
    settled: int = 0  # hooks of `regs` accounted for in work_out
    # perf_counter since when regs[settled] is due (its timeout counts from then, queueing included)
    started: float = 0.0
    running: bool = False  # inside regs[settled].handle
    abandoned: bool = False
    counted: bool = False  # the loop counted this run's hanging call against its hook

    def _abandoned(self) -> bool:
        """`abandoned` read afresh: the event loop sets it while the worker is in a hook (a plain
        read after the check above would look, to a type checker, as if it could not change)."""
        return self.abandoned

    def work(self) -> None:
        for reg in self.regs:
            with self.lock:
                if self.abandoned or self.work_out.error is not None:
                    return
                ctx = self.work_out.ctx
                self.running = True
            start = time.perf_counter()
            result: Any = None
            exc: BaseException | None = None
            stuck = self.chain._stuck.get(reg.hook.name, 0)
            try:
                if stuck >= STUCK_PER_HOOK:
                    raise HookError(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"not called: {stuck} earlier calls of this hook are still running past their timeout",
                    )
                result = reg.hook.handle(ctx)
            except Exception as e:
                exc = e
            with self.lock:
                self.running = False
                if self._abandoned():  # the event loop may have set it meanwhile
                    if self.counted:
                        self.chain._stuck_change(reg.hook.name, -1)
                        assert self.chain._executor is not None
                        self.chain._executor.leave_after_job()
                    return
                self.chain._settle(reg, self.work_out, start, result=result, exc=exc)
                self.settled += 1
                self.started = time.perf_counter()


def _blocking_end(regs: tuple[Registered, ...], i: int) -> int:
    """The end of the run of blocking hooks starting at regs[i] (i itself when regs[i] is async)."""
    while i < len(regs) and not regs[i].is_async:
        i += 1
    return i


def _as_hook_error(exc: BaseException, limit: float) -> HookError:
    if isinstance(exc, HookError):
        return exc
    if isinstance(exc, TimeoutError):
        return HookError(grpc.StatusCode.DEADLINE_EXCEEDED, f"timed out after {limit * 1000:.0f} ms")
    return HookError(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {_error_reason(exc)}")


def _subject(ctx: HookContext) -> str:
    s = f"pod {ctx.pod.ref}"
    if ctx.container is not None:
        s += f" container {ctx.container.name}"
    return s


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000
