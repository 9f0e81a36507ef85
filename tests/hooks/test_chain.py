"""The hook chain's contract: order, edits seen by later hooks, one worker-thread hand-off for a run of
blocking hooks, each hook's own timeout, failure policies, and an event loop that never waits on a hook."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from crihook.base.config import HooksConfig, NodeConfig
from crihook.base.spec import Device
from crihook.hooks.base import MISS, ContainerInfo, Edit, HookContext, HookError, PodInfo, Stage
from crihook.hooks.chain import STUCK_PER_HOOK, HookChain
from crihook.hooks.registry import build_chain

STAGE = Stage.PRE_CREATE_CONTAINER


def ctx() -> HookContext:
    return HookContext(STAGE, PodInfo(name="p", namespace="ns", uid="u"), ContainerInfo(name="c"))


class Blocking:
    """A plain (blocking) hook running `body`; records the thread it ran on."""

    stages = frozenset({STAGE})

    def __init__(self, name: str, priority: int, body: Callable[[HookContext], Any]) -> None:
        self.name, self.priority, self.body = name, priority, body
        self.threads: list[int] = []

    def handle(self, c: HookContext) -> Any:
        self.threads.append(threading.get_ident())
        return self.body(c)


class Async:
    stages = frozenset({STAGE})

    def __init__(self, name: str, priority: int, body: Callable[[HookContext], Any]) -> None:
        self.name, self.priority, self.body = name, priority, body

    async def handle(self, c: HookContext) -> Any:
        return self.body(c)


def chain(*hooks: Any, policy: str = "fail", timeout_ms: int = 300, **extra: Any) -> HookChain:
    options = {h.name: {"failure_policy": policy, "timeout_ms": timeout_ms} for h in hooks}
    cfg = HooksConfig(options=options, **extra)
    return build_chain(cfg, NodeConfig(), factories={h.name: (lambda options, node, h=h: h) for h in hooks})


def env(c: HookContext) -> dict[str, str]:
    assert c.container is not None
    return dict(c.container.envs)


def setter(key: str, seen: list[dict[str, str]] | None = None) -> Callable[[HookContext], Edit]:
    def body(c: HookContext) -> Edit:
        if seen is not None:
            seen.append(env(c))
        return Edit(env={key: "1"})

    return body


async def test_blocking_run_shares_one_handoff_and_sees_earlier_edits() -> None:
    seen: list[dict[str, str]] = []
    a, b = Blocking("a", 1, setter("A", seen)), Blocking("b", 2, setter("B", seen))
    out = await chain(a, b).run(ctx())
    assert out.error is None and env(out.ctx) == {"A": "1", "B": "1"}
    assert seen == [{}, {"A": "1"}]
    assert a.threads == b.threads and a.threads[0] != threading.get_ident()
    assert [(r.hook, r.result) for r in out.records] == [("a", "ok"), ("b", "ok")]


async def test_async_hooks_keep_their_place_between_blocking_ones() -> None:
    seen: list[dict[str, str]] = []
    hooks = (Blocking("a", 1, setter("A")), Async("m", 2, setter("M", seen)), Blocking("z", 3, setter("Z", seen)))
    out = await chain(*hooks).run(ctx())
    assert [r.hook for r in out.records] == ["a", "m", "z"]
    assert seen == [{"A": "1"}, {"A": "1", "M": "1"}]


@pytest.mark.parametrize("policy", ["fail", "ignore"])
async def test_a_hanging_hook_times_out_on_its_own_budget(policy: str) -> None:
    release = threading.Event()
    hang = Blocking("a-hang", 1, lambda c: release.wait(10))
    after = Blocking("b-after", 2, setter("B"))
    started = time.monotonic()
    try:
        out = await chain(hang, after, policy=policy, timeout_ms=200).run(ctx())
    finally:
        release.set()
    elapsed = time.monotonic() - started
    assert 0.2 <= elapsed < 2.0
    first = out.records[0]
    assert (first.hook, first.detail) == ("a-hang", "timed out after 200 ms")
    if policy == "fail":
        assert out.error is not None and out.error.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert out.error.reason == "hook a-hang: pod ns/p container c: timed out after 200 ms"
        assert len(out.records) == 1 and after.threads == []
    else:
        assert out.error is None and first.result == "ignored-error"
        assert env(out.ctx) == {"B": "1"} and [r.result for r in out.records] == ["ignored-error", "ok"]


async def test_a_slow_hook_that_returns_late_is_not_applied() -> None:
    slow = Blocking("slow", 1, lambda c: (time.sleep(0.3), Edit(env={"LATE": "1"}))[1])
    out = await chain(slow, policy="ignore", timeout_ms=100).run(ctx())
    assert env(out.ctx) == {} and out.records[0].result == "ignored-error"
    await asyncio.sleep(0.4)  # the worker finishes afterwards and must change nothing
    assert env(out.ctx) == {} and len(out.records) == 1


async def test_the_event_loop_keeps_serving_while_a_hook_hangs() -> None:
    release = threading.Event()
    hang = Blocking("hang", 1, lambda c: (release.wait(10), None)[1])
    task = asyncio.create_task(chain(hang, policy="ignore", timeout_ms=1000).run(ctx()))
    await asyncio.sleep(0.05)
    t = time.perf_counter()
    await asyncio.sleep(0.01)
    assert time.perf_counter() - t < 0.5
    assert not task.done()
    release.set()
    out = await task
    assert out.records[0].result == "noop"


async def test_a_hanging_hook_can_not_take_the_threads_other_hooks_need() -> None:
    """Each hung call keeps its thread, and the pool starts another in its place. Past
    STUCK_PER_HOOK hung calls the hook is not called (it fails at once) until one returns, and the
    other hooks are served all along."""
    release = threading.Event()
    calls = []

    def hang(c: HookContext) -> None:
        calls.append(1)
        release.wait(10)

    hooks = (Blocking("hang", 1, hang), Blocking("good", 2, setter("G")))
    ch = chain(*hooks, policy="ignore", timeout_ms=100)
    try:
        # a burst larger than the pool: every call is served, the good hook on fresh threads
        burst = await asyncio.gather(*(ch.run(ctx()) for _ in range(20)))
        assert all(out.error is None and env(out.ctx) == {"G": "1"} for out in burst)
        hung = len(calls)
        assert STUCK_PER_HOOK <= hung < 20
        started = time.monotonic()
        later = await asyncio.gather(*(ch.run(ctx()) for _ in range(20)))
        assert time.monotonic() - started < 1.0  # nobody waited for the hung hook's timeout
        assert len(calls) == hung
        for out in later:
            assert env(out.ctx) == {"G": "1"}
            assert str(out.records[0].detail).startswith(f"not called: {hung} earlier calls")
    finally:
        release.set()
    await asyncio.sleep(0.2)  # the hung calls return; the hook is called again
    again = await ch.run(ctx())
    assert again.records[0].result == "noop" and len(calls) == hung + 1
    await ch.close()


@pytest.mark.parametrize(
    ("body", "code", "reason"),
    [
        (lambda c: 42, grpc.StatusCode.INTERNAL, "TypeError: returned int, not an Edit or None"),
        (lambda c: 1 / 0, grpc.StatusCode.INTERNAL, "ZeroDivisionError: division by zero"),
        (
            lambda c: (_ for _ in ()).throw(HookError(grpc.StatusCode.FAILED_PRECONDITION, "no GPU 3")),
            grpc.StatusCode.FAILED_PRECONDITION,
            "no GPU 3",
        ),
        (
            lambda c: Edit(add_devices=[Device("/dev/sda", "/dev/sda")]),
            grpc.StatusCode.PERMISSION_DENIED,
            "host path '/dev/sda' is outside the allowed device and mount paths",
        ),
    ],
)
async def test_bad_answers_fail_with_a_named_reason(body: Any, code: grpc.StatusCode, reason: str) -> None:
    for hook in (Blocking("h", 1, body), Async("h", 1, body)):
        out = await chain(hook, allowed_host_paths=("/dev/nvidia*",)).run(ctx())
        assert out.error is not None and (out.error.code, out.error.reason) == (
            code,
            f"hook h: pod ns/p container c: {reason}",
        )
        ignored = await chain(hook, policy="ignore", allowed_host_paths=("/dev/nvidia*",)).run(ctx())
        assert ignored.error is None and ignored.records[0].result == "ignored-error" and env(ignored.ctx) == {}


class Cached(Blocking):
    """A blocking hook that answers on the loop (`handle_cached`) until told it must read."""

    def __init__(self, name: str, priority: int, body: Callable[[HookContext], Any]) -> None:
        super().__init__(name, priority, body)
        self.must_read = False
        self.cached_calls = 0

    def handle_cached(self, c: HookContext) -> Any:
        self.cached_calls += 1
        if self.must_read:
            return MISS
        return self.body(c)


def test_hooks_answering_from_their_caches_finish_without_waiting() -> None:
    a, b = Cached("a", 1, setter("A")), Cached("b", 2, setter("B"))
    run = chain(a, b).run(ctx())
    with pytest.raises(StopIteration) as done:  # the coroutine ends at its first step: no wait at all
        run.send(None)
    out = done.value.value
    assert env(out.ctx) == {"A": "1", "B": "1"} and a.threads == b.threads == []


async def test_the_first_hook_that_must_wait_takes_the_rest_off_the_loop_once() -> None:
    a, b, c = Cached("a", 1, setter("A")), Cached("b", 2, setter("B")), Cached("c", 3, setter("C"))
    b.must_read = True
    out = await chain(a, b, c).run(ctx())
    assert env(out.ctx) == {"A": "1", "B": "1", "C": "1"}
    assert [r.hook for r in out.records] == ["a", "b", "c"]
    assert a.cached_calls == 1 and a.threads == []  # not run again
    assert len(b.threads) == len(c.threads) == 1 and b.threads == c.threads  # one hand-off for both


async def test_an_async_hook_is_awaited_where_it_stands() -> None:
    seen: list[dict[str, str]] = []
    hooks = (Cached("a", 1, setter("A")), Async("m", 2, setter("M", seen)), Cached("z", 3, setter("Z", seen)))
    await chain(*hooks).run(ctx())
    assert seen == [{"A": "1"}, {"A": "1", "M": "1"}] and hooks[2].threads == []  # z from its cache


async def test_a_hook_that_narrows_its_stages_away_is_not_called() -> None:
    class Narrowing(Cached):
        def __init__(self) -> None:
            super().__init__("n", 0, setter("N"))
            self.asked: list[Stage] = []

        def wants(self, stage: Stage) -> bool:
            self.asked.append(stage)
            return False

    narrowing = Narrowing()
    out = await chain(narrowing, Cached("a", 1, setter("A"))).run(ctx())
    assert [r.hook for r in out.records] == ["a"]
    assert narrowing.asked == [STAGE] and narrowing.cached_calls == 0 and narrowing.threads == []


def test_prepare_pod_reaches_the_hooks_that_have_it_and_survives_their_failure() -> None:
    class Preparing(Blocking):
        def __init__(self, name: str, fail: bool) -> None:
            super().__init__(name, 1, setter(name))
            self.fail = fail
            self.pods: list[str] = []

        def prepare_pod(self, pod: PodInfo) -> None:
            self.pods.append(pod.uid)
            if self.fail:
                raise RuntimeError("boom")

    bad, good, plain = Preparing("bad", True), Preparing("good", False), Blocking("plain", 3, setter("P"))
    chain(bad, good, plain).prepare_pod(PodInfo(name="p", namespace="ns", uid="u1"))
    assert bad.pods == good.pods == ["u1"]
