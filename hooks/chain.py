"""Runs the configured hooks for one CRI call: fixed order, a timeout each, a failure policy each,
the host-path allowlist enforced on every edit whoever made it, and each edit applied to the view
the next hook sees (`apply_edit`)."""

from __future__ import annotations

import asyncio
import fnmatch
import inspect
import logging
import os.path
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field, replace
from importlib.metadata import entry_points
from typing import Any, TypeVar

import grpc

from crihook.base.config import ConfigError, HooksConfig, NodeConfig
from crihook.base.metrics import HOOK_FAILURES, HOOK_SECONDS
from crihook.hooks.base import (
    Edit,
    Factory,
    Hook,
    HookContext,
    HookError,
    Miss,
    PodInfo,
    PreparesPods,
    Stage,
    options_type,
)

log = logging.getLogger("crihook.hooks")
_T = TypeVar("_T")

ENTRY_POINT_GROUP = "crihook.hooks"
# Blocking hooks run on the chain's own threads. A call still running past its timeout keeps its
# thread (Python can not stop it): the pool starts another in its place, and a hook with
# STUCK_PER_HOOK such calls is not called again (its calls fail at once) until one returns. So a
# hanging hook costs a bounded number of threads and never the threads every other hook needs.
STUCK_PER_HOOK = 2
SPARE_WORKERS = 4
ALLOWLIST_MEMO = 4096  # host paths whose verdict is kept (cleared when full: paths from a hook server vary)
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


class Allowlist:
    """Host paths hooks may expose to containers. Patterns are fnmatch globs on normalised paths,
    so `..` can not walk out of an allowed directory."""

    def __init__(self, patterns: Iterable[str]) -> None:
        self.patterns = tuple(os.path.normpath(p) for p in patterns)
        # host path -> allowed: a node's hooks add the same few device nodes and mounts to every
        # container, and matching each against every pattern was a tenth of a CreateContainer
        self._verdicts: dict[str, bool] = {}

    def allows(self, host: str) -> bool:
        verdict = self._verdicts.get(host)
        if verdict is None:
            norm = os.path.normpath(host)
            verdict = os.path.isabs(host) and any(fnmatch.fnmatchcase(norm, p) for p in self.patterns)
            if len(self._verdicts) >= ALLOWLIST_MEMO:
                self._verdicts.clear()
            self._verdicts[host] = verdict
        return verdict

    def check(self, edit: Edit) -> str | None:
        """The first host path the edit adds that is not allowed, or None."""
        for host in [d.host_path for d in edit.add_devices] + [m.host_path for m in edit.add_mounts]:
            if not self.allows(host):
                return host
        return None


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
        try:  # wait_for, not asyncio.timeout: a rewrite runs its first step outside any task (relay.start)
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


class DaemonThreads(Executor):
    """ThreadPoolExecutor's job, with two differences a hook pool needs. Its threads are daemons:
    Python joins a pool's threads at exit, and a hook (or a file system) that never returns must not
    keep crihook from stopping. And a thread stuck in a hook past its timeout can be written off (`write_off`): the pool
    may start another in its place, and the stuck one leaves when (if ever) its job returns."""

    def __init__(self, size: int, name: str = "crihook-hook") -> None:
        self._size = size
        self._name = name
        self._jobs: queue.SimpleQueue[
            tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]] | None
        ] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._threads = 0
        self._shut = False
        self._local = threading.local()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            if self._shut:
                raise RuntimeError("hook threads are shut down")
            self._jobs.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and self._threads < self._size:
                self._threads += 1
                threading.Thread(target=self._work, name=f"{self._name}-{self._threads}", daemon=True).start()
        return future

    def write_off(self) -> None:
        """Called from the event loop about a job that outlived its timeout: its thread no longer
        counts towards the pool's size."""
        with self._lock:
            self._size += 1

    def leave_after_job(self) -> None:
        """Called by a written-off job when it finally returns: its thread goes instead of idling."""
        self._local.leave = True

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args, kwargs = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as e:
                    future.set_exception(e)
            if getattr(self._local, "leave", False):
                with self._lock:
                    self._size -= 1
                    self._threads -= 1
                return
            self._idle.release()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._shut = True
            for _ in range(self._threads):
                self._jobs.put(None)


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


def apply_edit(ctx: HookContext, edit: Edit) -> HookContext:
    """The view after `edit`; the chain feeds it to the next hook. Raises ValueError for an edit
    that does not fit the stage (a hook bug, handled by its failure policy)."""
    pod = ctx.pod
    if edit.labels or edit.cgroup_parent is not None:
        if ctx.stage is not Stage.PRE_RUN_POD_SANDBOX:
            raise ValueError(f"labels and cgroup_parent can only change at {Stage.PRE_RUN_POD_SANDBOX}")
        pod = replace(
            pod,
            labels={**pod.labels, **edit.labels},
            cgroup_parent=edit.cgroup_parent if edit.cgroup_parent is not None else pod.cgroup_parent,
        )
    if ctx.container is None:
        container_only = (
            edit.env,
            edit.remove_env,
            edit.add_mounts,
            edit.remove_mounts,
            edit.add_devices,
            edit.remove_devices,
            edit.add_cdi_devices,
            edit.remove_cdi_devices,
        )
        if any(container_only):
            raise ValueError(f"envs, mounts and devices can not change at {ctx.stage}")
        if edit.annotations or edit.remove_annotations:
            pod = replace(pod, annotations=_edit_map(pod.annotations, edit))
        if edit.resources is not None:
            pod = replace(pod, resources=edit.resources.apply(pod.resources))
        return replace(ctx, pod=pod)

    c = ctx.container
    envs = [(k, v) for k, v in c.envs if k not in edit.remove_env and k not in edit.env]
    envs.extend(edit.env.items())
    mounts = _replace_keyed(c.mounts, edit.remove_mounts, edit.add_mounts, lambda m: m.container_path)
    devices = _replace_keyed(c.devices, edit.remove_devices, edit.add_devices, lambda d: d.container_path)
    cdi = _replace_keyed(c.cdi_devices, edit.remove_cdi_devices, edit.add_cdi_devices, lambda n: n)
    container = replace(
        c,
        envs=tuple(envs),
        mounts=mounts,
        devices=devices,
        cdi_devices=cdi,
        annotations=_edit_map(c.annotations, edit) if edit.annotations or edit.remove_annotations else c.annotations,
        resources=edit.resources.apply(c.resources) if edit.resources is not None else c.resources,
    )
    return replace(ctx, pod=pod, container=container)


def _edit_map(annotations: Mapping[str, str], edit: Edit) -> dict[str, str]:
    kept = {k: v for k, v in annotations.items() if k not in edit.remove_annotations}
    return {**kept, **edit.annotations}


def _replace_keyed(items: tuple[_T, ...], remove: set[str], add: list[_T], key: Any) -> tuple[_T, ...]:
    if not items or not (remove or add):  # most containers bring no devices of their own: no keys needed
        return (*items, *add)
    added = {key(a) for a in add}
    kept = [i for i in items if key(i) not in remove and key(i) not in added]
    return (*kept, *add)


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


def discover_factories() -> dict[str, Factory]:
    """Hook factories from installed entry points, by entry-point name."""
    return {ep.name: ep.load() for ep in entry_points(group=ENTRY_POINT_GROUP)}


def build_chain(
    hooks_cfg: HooksConfig,
    node: NodeConfig,
    factories: Mapping[str, Factory] | None = None,
) -> HookChain:
    """Instantiate every enabled hook with its `[hooks.<name>]` table, checked against the options its
    factory declares. Raises ConfigError naming the file, the table and the key."""
    factories = discover_factories() if factories is None else factories
    unknown = [n for n in (*hooks_cfg.order, *hooks_cfg.options) if n not in factories]
    if unknown:
        installed = ", ".join(sorted(factories))
        names = ", ".join(sorted(set(unknown)))
        raise ConfigError(hooks_cfg.source, f"no hook named {names} (installed: {installed})", "hooks")
    regs: list[Registered] = []
    for name, factory in factories.items():
        if name in hooks_cfg.disabled:
            continue
        common, options = hooks_cfg.table(name, options_type(factory))
        hook = factory(options, node)
        timeout_ms = hooks_cfg.default_timeout_ms if common.timeout_ms is None else common.timeout_ms
        is_async = inspect.iscoroutinefunction(hook.handle)
        follows = is_async and common.timeout_ms is None and getattr(hook, "follows_call_deadline", False) is True
        cached = not is_async and callable(getattr(hook, "handle_cached", None))
        narrows = callable(getattr(hook, "wants", None))
        regs.append(Registered(hook, common.failure_policy, timeout_ms / 1000, is_async, follows, cached, narrows))
    explicit = {n: i for i, n in enumerate(hooks_cfg.order)}
    regs.sort(key=lambda r: (explicit.get(r.hook.name, len(explicit)), r.hook.priority, r.hook.name))
    patterns = [p.replace("{dev_root}", node.dev_root.rstrip("/") or "/") for p in hooks_cfg.allowed_host_paths]
    return HookChain(regs, Allowlist(patterns))
