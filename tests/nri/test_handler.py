"""NRI's events through the lifecycle core: the store, hook records, post hooks and refusals come
out as in proxy mode (tests/proxy/test_intercept.py drives the same core from CRI messages)."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import grpc
import pytest

from crihook.base.config import HooksConfig, NodeConfig
from crihook.base.metrics import NRI_EVICTIONS_PENDING
from crihook.base.spec import Device
from crihook.hooks.base import ContainerInfo, Edit, HookContext, HookError, PodInfo, ResourcesPatch, Stage
from crihook.hooks.reach import Gpu, Grants, Reach, Undecided, Verdict, judge
from crihook.hooks.registry import build_chain
from crihook.node.container import DeviceNumber, nri_listed_container, nri_reach
from crihook.node.lifecycle import Lifecycle
from crihook.node.pod import nri_listed_pod, nri_pod_view
from crihook.node.store import Store
from crihook.nri.handler import EVICTIONS_FILE, MARGIN, HookHandler, make_sources
from crihook.nri.stub import RpcError, event_mask
from crihook.proto import nri_v1alpha1_pb2 as api

T = TypeVar("T")
STAGES = {
    Stage.PRE_CREATE_CONTAINER,
    Stage.PRE_START_CONTAINER,
    Stage.POST_START_CONTAINER,
    Stage.POST_STOP_CONTAINER,
    Stage.POST_REMOVE_CONTAINER,
    Stage.POST_REMOVE_POD_SANDBOX,
}


class Recorder:
    """A hook that sets one env variable at CreateContainer (or refuses it) and notes every call."""

    name = "rec"
    priority = 10

    def __init__(self, refuse: bool = False) -> None:
        self.stages = frozenset(STAGES)
        self.refuse = refuse
        self.seen: list[HookContext] = []

    async def handle(self, ctx: HookContext) -> Edit | None:
        self.seen.append(ctx)
        if ctx.stage is Stage.PRE_CREATE_CONTAINER:
            if self.refuse:
                raise HookError(grpc.StatusCode.FAILED_PRECONDITION, f"rec: pod {ctx.pod.ref} refused")
            return Edit(env={"HOOKED": "1"})
        return None


async def handler(tmp_path: Path, hook: Recorder) -> HookHandler:
    chain = build_chain(HooksConfig(), NodeConfig(), factories={"rec": lambda options, node: hook})
    h = HookHandler(Lifecycle(chain, Store(tmp_path)))
    await h.configure(api.ConfigureRequest(runtime_name="containerd", runtime_version="2.1.9"))
    await h.synchronize([], [])
    return h


POD = api.PodSandbox(id="sb-1", name="train", namespace="ml", uid="u-1")
POD_VIEW = nri_pod_view(POD)


def container() -> api.Container:
    return api.Container(id="c-1", pod_sandbox_id=POD.id, name="main", env=["PATH=/bin"])


async def answered(work: Awaitable[T]) -> T:
    """A call of the runtime's, answered, and the loop let run on as the stub lets it once the
    answer is written: what the handler does after its answer (the store's records) is done."""
    result = await work
    await asyncio.sleep(0)
    return result


async def event(h: HookHandler, kind: int) -> None:
    await answered(h.state_change(api.StateChangeEvent(event=kind, pod=POD, container=container())))


async def test_events_keep_the_store_and_run_post_hooks(tmp_path: Path) -> None:
    hook = Recorder()
    h = await handler(tmp_path, hook)
    store = h.lifecycle.store
    await answered(h.state_change(api.StateChangeEvent(event=api.RUN_POD_SANDBOX, pod=POD)))
    assert store.pods["sb-1"].state == "ready"

    answer = await answered(h.create_container(api.CreateContainerRequest(pod=POD, container=container())))
    assert ("HOOKED", "1") in [(kv.key, kv.value) for kv in answer.adjust.env]
    rec = store.containers["c-1"]
    assert (rec.pod_id, rec.state, rec.envs.get("HOOKED")) == ("sb-1", "created", "1")

    await event(h, api.START_CONTAINER)
    await event(h, api.POST_START_CONTAINER)
    await h.close()
    assert store.containers["c-1"].state == "running"
    stages = [r["stage"] for r in store.containers["c-1"].hooks]
    assert stages == [Stage.PRE_CREATE_CONTAINER, Stage.PRE_START_CONTAINER, Stage.POST_START_CONTAINER]

    await h.stop_container(api.StopContainerRequest(pod=POD, container=container()))
    await h.close()
    assert store.containers["c-1"].state == "exited"
    await event(h, api.REMOVE_CONTAINER)
    await h.state_change(api.StateChangeEvent(event=api.REMOVE_POD_SANDBOX, pod=POD))
    await h.close()
    assert "c-1" not in store.containers and "sb-1" not in store.pods
    post = [c for c in hook.seen if c.stage.is_post]
    assert [c.stage for c in post] == [
        Stage.POST_START_CONTAINER,
        Stage.POST_STOP_CONTAINER,
        Stage.POST_REMOVE_CONTAINER,
        Stage.POST_REMOVE_POD_SANDBOX,
    ]
    # post hooks see the container as the store keeps it: after the hooks, as in proxy mode
    assert all(c.container is None or c.container.env("HOOKED") == "1" for c in post)


async def test_the_runtime_waits_for_no_bookkeeping(tmp_path: Path) -> None:
    """RunPodSandbox (no hook takes it), CreateContainer and StartContainer are answered before the
    store records them: the record is made once the answer is written, before the next call."""
    h = HookHandler(Lifecycle(build_chain(HooksConfig(), NodeConfig()), Store(tmp_path)))
    await h.configure(api.ConfigureRequest(runtime_name="containerd", runtime_version="2.1.9"))
    await h.synchronize([], [])
    store = h.lifecycle.store
    await h.state_change(api.StateChangeEvent(event=api.RUN_POD_SANDBOX, pod=POD))
    assert "sb-1" not in store.pods
    await asyncio.sleep(0)
    assert store.pods["sb-1"].state == "ready"
    await h.create_container(api.CreateContainerRequest(pod=POD, container=container()))
    assert "c-1" not in store.containers
    await asyncio.sleep(0)
    assert store.containers["c-1"].state == "created"
    await h.state_change(api.StateChangeEvent(event=api.START_CONTAINER, pod=POD, container=container()))
    assert store.containers["c-1"].state == "created"
    await asyncio.sleep(0)
    assert store.containers["c-1"].state == "running"
    await h.close()


async def test_a_failed_record_after_the_answer_is_logged_and_the_next_call_served(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    hook = Recorder()
    h = await handler(tmp_path, hook)

    def broken(*_: object) -> None:
        raise OSError("no space left on device")

    h.lifecycle.container_created = broken  # type: ignore[method-assign]
    answer = await answered(h.create_container(api.CreateContainerRequest(pod=POD, container=container())))
    assert ("HOOKED", "1") in [(kv.key, kv.value) for kv in answer.adjust.env]
    assert "bookkeeping after an answer failed" in caplog.text and "no space left" in caplog.text
    await event(h, api.START_CONTAINER)  # the next call of the runtime is served as ever
    await h.close()


async def test_a_pod_is_converted_once_while_the_runtime_describes_it_alike(tmp_path: Path) -> None:
    hook = Recorder()
    h = await handler(tmp_path, hook)

    async def create(pod: api.PodSandbox) -> PodInfo:
        """The pod as the CreateContainer hook saw it."""
        copy = api.PodSandbox()
        copy.CopyFrom(pod)  # the runtime's message is another each time
        await h.create_container(api.CreateContainerRequest(pod=copy, container=container()))
        return [c.pod for c in hook.seen if c.stage is Stage.PRE_CREATE_CONTAINER][-1]

    await h.state_change(api.StateChangeEvent(event=api.RUN_POD_SANDBOX, pod=POD))
    first = await create(POD)
    assert first == POD_VIEW and await create(POD) is first
    relabeled = api.PodSandbox()
    relabeled.CopyFrom(POD)
    relabeled.labels["tier"] = "gold"
    again = await create(relabeled)  # a message that differs is converted again
    assert again.labels == {"tier": "gold"} and await create(relabeled) is again
    await h.state_change(api.StateChangeEvent(event=api.REMOVE_POD_SANDBOX, pod=POD))
    after_removal = await create(relabeled)
    assert after_removal == again and after_removal is not again
    await h.close()


async def test_a_hook_refusal_fails_the_creation_once_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    h = await handler(tmp_path, Recorder(refuse=True))
    await h.state_change(api.StateChangeEvent(event=api.RUN_POD_SANDBOX, pod=POD))
    with caplog.at_level(logging.WARNING), pytest.raises(RpcError) as err:
        await h.create_container(api.CreateContainerRequest(pod=POD, container=container()))
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert err.value.message == "hook rec: pod ml/train container main: rec: pod ml/train refused"
    assert "c-1" not in h.lifecycle.store.containers
    refusals = [r for r in caplog.records if r.getMessage().endswith("refused")]
    assert [(r.name, r.getMessage()) for r in refusals] == [("crihook.node", f"{Stage.PRE_CREATE_CONTAINER} refused")]


async def test_configure_takes_the_nri_release_the_runtime_names(tmp_path: Path) -> None:
    """NRI v0.12+ runtimes say which NRI they run; before, it is read off containerd's version."""
    h = HookHandler(Lifecycle(build_chain(HooksConfig(), NodeConfig()), Store(tmp_path)))
    await h.configure(api.ConfigureRequest(runtime_name="containerd", runtime_version="2.1.9", NRI_version="v0.12.5"))
    assert (h.runtime.nri, h.runtime.device_rules) == ((0, 12, 5), True)
    await h.configure(api.ConfigureRequest(runtime_name="containerd", runtime_version="2.1.9"))
    assert (h.runtime.nri, h.runtime.device_rules) == ((0, 8, 0), False)


class Resizer:
    """A PreUpdateContainerResources hook, as a remote hook server (Koordinator's) is: it halves the
    CPU shares asked for and pins the cpuset; with `annotate` it also sets an annotation."""

    name = "resize"
    priority = 10

    def __init__(self, annotate: bool = False) -> None:
        self.stages = frozenset({Stage.PRE_UPDATE_CONTAINER_RESOURCES})
        self.annotate = annotate
        self.seen: list[HookContext] = []

    async def handle(self, ctx: HookContext) -> Edit | None:
        self.seen.append(ctx)
        assert ctx.container is not None and ctx.container.resources is not None
        shares = ctx.container.resources.cpu_shares // 2
        return Edit(
            resources=ResourcesPatch(cpu_shares=shares, cpuset_cpus="2-3"),
            annotations={"resized": "1"} if self.annotate else {},
        )


async def resizing(tmp_path: Path, hook: Resizer) -> HookHandler:
    chain = build_chain(HooksConfig(), NodeConfig(), factories={"resize": lambda options, node: hook})
    h = HookHandler(Lifecycle(chain, Store(tmp_path)))
    events = await h.configure(api.ConfigureRequest(runtime_name="containerd", runtime_version="2.1.9"))
    assert events & event_mask(api.UPDATE_CONTAINER)
    await h.synchronize([], [])
    await h.state_change(api.StateChangeEvent(event=api.RUN_POD_SANDBOX, pod=POD))
    await answered(h.create_container(api.CreateContainerRequest(pod=POD, container=container())))
    return h


def update_request(shares: int) -> api.UpdateContainerRequest:
    req = api.UpdateContainerRequest(pod=POD, container=container())
    req.linux_resources.cpu.shares.value = shares
    req.linux_resources.memory.limit.value = 1 << 30
    return req


async def test_pre_update_hooks_run_in_nri_mode_and_their_change_goes_back_as_an_update(tmp_path: Path) -> None:
    hook = Resizer()
    h = await resizing(tmp_path, hook)
    answer = await h.update_container(update_request(1024))
    (update,) = answer.update
    assert update.container_id == "c-1"
    assert (update.linux.resources.cpu.shares.value, update.linux.resources.cpu.cpus) == (512, "2-3")
    assert not update.linux.resources.memory.HasField("limit")  # only what the hooks changed
    (ctx,) = hook.seen
    assert ctx.container is not None and ctx.container.resources is not None
    assert (ctx.container.resources.cpu_shares, ctx.container.resources.memory_limit_in_bytes) == (1024, 1 << 30)
    await h.close()
    rec = h.lifecycle.store.containers["c-1"]
    assert (rec.resources["cpu_shares"], rec.resources["cpuset_cpus"]) == (512, "2-3")
    assert [r["stage"] for r in rec.hooks][-1] == Stage.PRE_UPDATE_CONTAINER_RESOURCES


async def test_an_update_change_nri_can_not_carry_is_refused(tmp_path: Path) -> None:
    h = await resizing(tmp_path, Resizer(annotate=True))
    with pytest.raises(RpcError, match=r"container main: changing annotations \(NRI's UpdateContainer"):
        await h.update_container(update_request(1024))


async def test_without_update_hooks_updates_are_not_subscribed(tmp_path: Path) -> None:
    h = HookHandler(Lifecycle(build_chain(HooksConfig(), NodeConfig()), Store(tmp_path)))
    events = await h.configure(api.ConfigureRequest(runtime_name="containerd", runtime_version="2.1.9"))
    assert not events & event_mask(api.UPDATE_CONTAINER)
    assert (await h.update_container(update_request(1024))).update == []


async def test_without_start_hooks_post_start_is_not_subscribed_and_start_records_the_state(tmp_path: Path) -> None:
    h = HookHandler(Lifecycle(build_chain(HooksConfig(), NodeConfig()), Store(tmp_path)))
    events = await h.configure(api.ConfigureRequest(runtime_name="containerd", runtime_version="2.1.9"))
    assert not events & event_mask(api.POST_START_CONTAINER)
    assert events & event_mask(api.START_CONTAINER)
    await h.synchronize([], [])
    await h.state_change(api.StateChangeEvent(event=api.RUN_POD_SANDBOX, pod=POD))
    await answered(h.create_container(api.CreateContainerRequest(pod=POD, container=container())))
    store = h.lifecycle.store
    assert store.containers["c-1"].state == "created"
    await event(h, api.START_CONTAINER)
    assert store.containers["c-1"].state == "running"
    assert "c-1" not in h._starting
    await h.close()


class PodGate(Recorder):
    """A hook that takes PreRunPodSandbox."""

    def __init__(self) -> None:
        super().__init__()
        self.stages = frozenset({*STAGES, Stage.PRE_RUN_POD_SANDBOX})


async def test_without_pod_hooks_run_pod_sandbox_is_not_subscribed_and_create_records_the_pod(tmp_path: Path) -> None:
    """The runtime waits for RunPodSandbox's answer inside every pod start: without a hook there it
    is not asked, and the pod's first CreateContainer records the pod before its container."""
    h = HookHandler(Lifecycle(build_chain(HooksConfig(), NodeConfig()), Store(tmp_path)))
    events = await h.configure(api.ConfigureRequest(runtime_name="containerd", runtime_version="2.1.9"))
    assert not events & event_mask(api.RUN_POD_SANDBOX)
    assert events & event_mask(api.STOP_POD_SANDBOX, api.REMOVE_POD_SANDBOX) == event_mask(
        api.STOP_POD_SANDBOX, api.REMOVE_POD_SANDBOX
    )
    await h.synchronize([], [])
    store = h.lifecycle.store
    await answered(h.create_container(api.CreateContainerRequest(pod=POD, container=container())))
    assert (store.pods["sb-1"].name, store.pods["sb-1"].namespace, store.pods["sb-1"].state) == ("train", "ml", "ready")
    assert store.containers["c-1"].pod_id == "sb-1"
    first = store.pods["sb-1"]
    second = api.Container(id="c-2", pod_sandbox_id="sb-1", name="side")
    await answered(h.create_container(api.CreateContainerRequest(pod=POD, container=second)))
    assert store.pods["sb-1"] is first  # recorded once
    await h.close()


async def test_with_a_pod_hook_run_pod_sandbox_is_subscribed(tmp_path: Path) -> None:
    h = await handler(tmp_path, PodGate())
    events = await h.configure(api.ConfigureRequest(runtime_name="containerd", runtime_version="2.1.9"))
    assert events & event_mask(api.RUN_POD_SANDBOX)
    await h.close()


async def test_with_a_start_hook_post_start_is_subscribed_and_records_the_state(tmp_path: Path) -> None:
    h = await handler(tmp_path, Recorder())
    events = await h.configure(api.ConfigureRequest(runtime_name="containerd", runtime_version="2.1.9"))
    assert events & event_mask(api.POST_START_CONTAINER)
    await h.state_change(api.StateChangeEvent(event=api.RUN_POD_SANDBOX, pod=POD))
    await answered(h.create_container(api.CreateContainerRequest(pod=POD, container=container())))
    await event(h, api.START_CONTAINER)
    assert h.lifecycle.store.containers["c-1"].state == "created"  # started only once PostStartContainer says so
    await event(h, api.POST_START_CONTAINER)
    assert h.lifecycle.store.containers["c-1"].state == "running"
    await h.close()


# -- containers made without the hooks: judged by the gpu hook's decision -------------------------


GPUS = (Gpu(minor=0, index=0, uuid="GPU-0"), Gpu(minor=1, index=1, uuid="GPU-1"))


class Judge:
    """A hook that judges GPUs as the gpu hook does (hooks.reach.judge), with grants the test sets,
    and refuses every CreateContainer: a refusal (a remote hook server down, a timeout) is no verdict."""

    name = "gpu"
    priority = 20
    stages = frozenset({Stage.PRE_CREATE_CONTAINER})

    def __init__(self, refuse: bool = True, grant: Edit | None = None) -> None:
        self.refuse = refuse
        self.grant = grant
        self.grants: dict[str, Grants] = {}
        self.undecided: str | None = None
        self.asked: list[str] = []
        self.block = threading.Event()
        self.block.set()
        self.thrice = threading.Event()

    async def handle(self, ctx: HookContext) -> Edit | None:
        if self.refuse:
            raise HookError(grpc.StatusCode.UNAVAILABLE, "remote hook server unreachable")
        return self.grant

    def verdict(self, pod: PodInfo, container: ContainerInfo, reach: Reach) -> Verdict:
        self.asked.append(container.id)
        if len(self.asked) >= 3:
            self.thrice.set()
        self.block.wait()
        if self.undecided is not None:
            raise Undecided(self.undecided)
        return judge(reach, self.grants.get(pod.uid, Grants()), GPUS)


class Evictions:
    def __init__(self, failures: int = 0) -> None:
        self.failures = failures
        self.calls: list[str] = []

    async def __call__(self, evictions: Sequence[api.ContainerEviction]) -> None:
        self.calls.extend(e.container_id for e in evictions)
        if self.failures:
            self.failures -= 1
            raise ConnectionError("CRI socket not reachable")


async def judged(tmp_path: Path, hook: Judge, evict: Evictions | None = None) -> HookHandler:
    chain = build_chain(HooksConfig(), NodeConfig(), factories={"gpu": lambda options, node: hook})
    h = HookHandler(Lifecycle(chain, Store(tmp_path)), evict=evict or Evictions(), sleep=no_wait, relist_every=0)
    await h.configure(api.ConfigureRequest(runtime_name="containerd", runtime_version="2.1.9"))
    return h


async def no_wait(seconds: float, then: Callable[[], object] = lambda: None) -> None:
    then()
    await asyncio.sleep(0)


def gpu_container(cid: str, *env: str, minor: int | None = None, privileged: bool = False) -> api.Container:
    c = api.Container(id=cid, pod_sandbox_id=POD.id, name=cid, env=list(env), state=api.CONTAINER_RUNNING)
    if privileged:
        c.linux.resources.devices.add(allow=True, access="rwm")
    else:
        c.linux.resources.devices.add(allow=False, access="rwm")
    if minor is not None:
        c.linux.devices.add(path=f"/dev/nvidia-fake{minor}", type="c", major=195, minor=minor)
        rule = c.linux.resources.devices.add(allow=True, type="c", access="rw")
        rule.major.value, rule.minor.value = 195, minor
    return c


async def settle(h: HookHandler) -> None:
    """Wait for the handler's background work, and the work it starts, to end."""
    while pending := [t for t in h._tasks if not t.done()]:
        await asyncio.wait(pending)


async def test_a_refusing_hook_at_reconnection_evicts_nobody(tmp_path: Path) -> None:
    """Every hook refuses (a remote hook server down, policy fail): that decides nothing about GPUs.
    Only the containers reaching a GPU no grant names are evicted, by number whatever the path."""
    hook = Judge()
    hook.grants[POD.uid] = Grants(scheduler=frozenset({1}))
    evict = Evictions()
    h = await judged(tmp_path, hook, evict)
    granted = gpu_container("granted", "NVIDIA_VISIBLE_DEVICES=GPU-1", minor=1)
    by_index = gpu_container("by-index", "NVIDIA_VISIBLE_DEVICES=1")
    plain = gpu_container("plain", "PATH=/bin")
    sneaky = gpu_container("sneaky", minor=0)  # /dev/nvidia-fake0, c 195:0
    greedy = gpu_container("greedy", "NVIDIA_VISIBLE_DEVICES=all")
    await h.synchronize([POD], [granted, by_index, plain, sneaky, greedy])
    await settle(h)
    assert sorted(evict.calls) == ["greedy", "sneaky"]
    assert NRI_EVICTIONS_PENDING.value() == 0


async def test_a_privileged_container_is_kept(tmp_path: Path) -> None:
    evict = Evictions()
    h = await judged(tmp_path, Judge(), evict)
    await h.synchronize([POD], [gpu_container("dcgm", "NVIDIA_VISIBLE_DEVICES=all", minor=0, privileged=True)])
    await settle(h)
    assert evict.calls == []


async def test_an_undecided_check_never_evicts_and_is_asked_again(tmp_path: Path) -> None:
    hook = Judge()
    hook.undecided = "NVML failed"
    evict = Evictions()
    h = await judged(tmp_path, hook, evict)
    greedy = gpu_container("greedy", "NVIDIA_VISIBLE_DEVICES=all")
    await h.synchronize([POD], [greedy])
    await asyncio.to_thread(hook.thrice.wait)
    assert evict.calls == []  # asked again and again, never evicted
    hook.undecided = None  # NVML answers again: now the finding acts
    await settle(h)
    assert evict.calls == ["greedy"]


async def test_a_slow_check_does_not_hold_up_synchronize(tmp_path: Path) -> None:
    """One deadline for the whole Synchronize: the answer comes in time, the check goes on after it."""
    hook = Judge()
    hook.block.clear()
    evict = Evictions()
    h = await judged(tmp_path, hook, evict)
    h.request_timeout = MARGIN + 0.05
    await asyncio.wait_for(h.synchronize([POD], [gpu_container("greedy", "NVIDIA_VISIBLE_DEVICES=all")]), 5)
    assert evict.calls == []
    hook.block.set()
    await settle(h)
    assert evict.calls == ["greedy"]


async def test_a_failed_eviction_is_retried_until_it_is_done(tmp_path: Path) -> None:
    """Each failure is counted and written for `crihook doctor`; the file goes once it is done."""
    evict = Evictions(failures=3)
    h = await judged(tmp_path, Judge(), evict)
    written: list[str] = []
    h.sleep = lambda s: no_wait(s, then=lambda: written.append((tmp_path / EVICTIONS_FILE).read_text()))
    await h.synchronize([POD], [gpu_container("greedy", "NVIDIA_VISIBLE_DEVICES=0")])
    await settle(h)
    assert evict.calls == ["greedy"] * 4 and h.pending_evictions() == []
    assert [json.loads(w)[0]["tries"] for w in written] == [1, 2, 3]
    assert json.loads(written[0])[0]["error"] == "CRI socket not reachable"
    assert not (tmp_path / EVICTIONS_FILE).exists()


async def test_an_eviction_stops_when_its_container_is_gone(tmp_path: Path) -> None:
    evict = Evictions(failures=100)
    h = await judged(tmp_path, Judge(), evict)
    greedy = gpu_container("greedy", "NVIDIA_VISIBLE_DEVICES=0")

    async def removed(seconds: float) -> None:
        await h.state_change(api.StateChangeEvent(event=api.REMOVE_CONTAINER, pod=POD, container=greedy))

    h.sleep = removed
    await h.synchronize([POD], [greedy])
    await settle(h)
    assert evict.calls == ["greedy"] and h.pending_evictions() == []
    assert NRI_EVICTIONS_PENDING.value() == 0 and not (tmp_path / EVICTIONS_FILE).exists()


async def test_a_container_crihook_never_saw_is_judged_at_its_start(tmp_path: Path) -> None:
    """Made while crihook was away, missing from Synchronize's list (containerd 1.7 lets the two
    race): its StartContainer carries the whole spec, and a GPU nobody granted refuses it."""
    h = await judged(tmp_path, Judge())
    await h.synchronize([POD], [])
    late = gpu_container("late", "NVIDIA_VISIBLE_DEVICES=GPU-0")
    late.state = api.CONTAINER_CREATED
    with pytest.raises(RpcError) as err:
        await h.state_change(api.StateChangeEvent(event=api.START_CONTAINER, pod=POD, container=late))
    assert "reaches GPU minor 0 (by NVIDIA_VISIBLE_DEVICES=GPU-0)" in err.value.message
    plain = gpu_container("plain", "PATH=/bin")
    await h.state_change(api.StateChangeEvent(event=api.START_CONTAINER, pod=POD, container=plain))


async def test_the_catch_up_does_not_bring_back_a_container_removed_while_it_listed(tmp_path: Path) -> None:
    h = await judged(tmp_path, Judge())
    gone = gpu_container("gone", "PATH=/bin")

    async def relist() -> tuple[list[api.PodSandbox], list[api.Container]]:
        # the listing was taken; the container is removed before it is answered
        await h.state_change(api.StateChangeEvent(event=api.REMOVE_CONTAINER, pod=POD, container=gone))
        return [POD], [gone]

    h.relist = relist
    await h.synchronize([POD], [])
    await settle(h)
    assert "gone" not in h.lifecycle.store.containers


async def test_records_of_containers_the_runtime_does_not_have_are_dropped(tmp_path: Path) -> None:
    """A creation that failed after crihook answered (or a removal whose event was missed): the
    listing drops its record once it is older than RECORD_GRACE; a younger one is being made."""
    h = await judged(tmp_path, Judge())
    await h.synchronize([POD], [])
    store = h.lifecycle.store
    store.put_pod(nri_listed_pod(POD))
    store.put_container(replace(nri_listed_container(gpu_container("failed")), created=time.time() - 60))
    store.put_container(replace(nri_listed_container(gpu_container("being-made")), created=time.time()))

    async def relist() -> tuple[list[api.PodSandbox], list[api.Container]]:
        return [POD], []

    await h._relist(relist)  # the listing after Synchronize's, and every RELIST_EVERY seconds
    assert set(store.containers) == {"being-made"}


async def test_containers_that_can_reach_no_gpu_are_not_asked_about(tmp_path: Path) -> None:
    """containerd's rules for every container (deny all, mknod for any char or block device, the
    standard nodes): nothing to judge, so a node whose NVML lists no GPU creates them all."""
    hook = Judge(refuse=False)
    hook.undecided = "NVML lists no GPU on this node"
    h = await judged(tmp_path, hook)
    c = api.Container(id="plain", pod_sandbox_id=POD.id, name="app", env=["NVIDIA_VISIBLE_DEVICES=void"])
    for kind, access in (("a", "rwm"), ("c", "m"), ("b", "m")):
        c.linux.resources.devices.add(allow=kind != "a", type=kind, access=access)
    rule = c.linux.resources.devices.add(allow=True, type="c", access="rwm")
    rule.major.value, rule.minor.value = 1, 3
    await h.state_change(api.StateChangeEvent(event=api.RUN_POD_SANDBOX, pod=POD))
    answer = await h.create_container(api.CreateContainerRequest(pod=POD, container=c))
    assert answer is not None and hook.asked == []


async def test_a_device_node_is_read_once_until_it_changes(tmp_path: Path) -> None:
    grant = Edit(env={"NVIDIA_VISIBLE_DEVICES": "GPU-1"}, add_devices=[Device("/dev/nvidia1", "/dev/nvidia1", "rw")])
    h = await judged(tmp_path, Judge(refuse=False, grant=grant))
    read: list[str] = []

    def node_of(path: str) -> tuple[DeviceNumber, int]:
        read.append(path)
        return ("c", 195, 1), 0o666

    h.node_of = node_of
    await h.state_change(api.StateChangeEvent(event=api.RUN_POD_SANDBOX, pod=POD))
    for cid in ("a", "b"):
        answer = await h.create_container(
            api.CreateContainerRequest(pod=POD, container=api.Container(id=cid, pod_sandbox_id=POD.id, name=cid))
        )
        assert [(d.path, d.minor, d.file_mode.value) for d in answer.adjust.linux.devices] == [
            ("/dev/nvidia1", 1, 0o666)
        ]
    assert read == ["/dev/nvidia1"]  # the memo's inotify watch drops it when /dev/nvidia1 changes
    await h.close()


async def test_what_the_hooks_granted_is_not_asked_about_again(tmp_path: Path) -> None:
    """A container the scheduler placed: the GPU node, its rule and NVIDIA_VISIBLE_DEVICES are the
    chain's own decision, so CreateContainer asks no verdict (none of it came from the runtime)."""
    grant = Edit(env={"NVIDIA_VISIBLE_DEVICES": "GPU-1"}, add_devices=[Device("/dev/nvidia1", "/dev/nvidia1", "rw")])
    hook = Judge(refuse=False, grant=grant)
    h = await judged(tmp_path, hook)
    h.node_of = lambda path: (("c", 195, 1), 0o666)
    c = api.Container(id="cuda", pod_sandbox_id=POD.id, name="cuda", env=["NVIDIA_VISIBLE_DEVICES=all"])
    c.linux.resources.devices.add(allow=False, access="rwm")
    await h.state_change(api.StateChangeEvent(event=api.RUN_POD_SANDBOX, pod=POD))
    answer = await h.create_container(api.CreateContainerRequest(pod=POD, container=c))
    assert [d.path for d in answer.adjust.linux.devices] == ["/dev/nvidia1"] and hook.asked == []
    leaky = api.Container(id="leaky", pod_sandbox_id=POD.id, name="leaky")
    leaky.linux.devices.add(path="/dev/nvidia0", type="c", major=195, minor=0)
    with pytest.raises(RpcError) as err:  # the runtime's GPU node: asked, and GPU 0 is nobody's grant
        await h.create_container(api.CreateContainerRequest(pod=POD, container=leaky))
    assert hook.asked == ["leaky"] and "GPU minor 0 (by device node /dev/nvidia0 (c 195:0))" in err.value.message


async def test_a_container_found_twice_is_acted_on_once(tmp_path: Path) -> None:
    """Synchronize's check still running when the container's StartContainer judges it too."""
    evict = Evictions()
    h = await judged(tmp_path, Judge(), evict)
    greedy = gpu_container("greedy", "NVIDIA_VISIBLE_DEVICES=0")
    verdict = judge(nri_reach(greedy), Grants(), GPUS)
    assert h._act(POD_VIEW, greedy, verdict) is not None
    assert h._act(POD_VIEW, greedy, verdict) is None
    await settle(h)
    assert evict.calls == ["greedy"]


def test_only_writable_mount_sources_are_made(tmp_path: Path) -> None:
    """A writable bind mount's missing source is made, as containerd's CRI makes it; a read-only
    one (HAMi-core's library, which the plugin's pod does not see) is left for runc to find on the
    host: making a directory there would fail in the pod's read-only root, or hide the file missing."""
    adjust = api.ContainerAdjustment()
    cache, library = tmp_path / "cache" / "pod_main", tmp_path / "vgpu" / "libvgpu.so"
    adjust.mounts.add(destination="/tmp/vgpu", type="bind", source=str(cache), options=["rbind", "rprivate", "rw"])
    adjust.mounts.add(destination=str(library), type="bind", source=str(library), options=["rbind", "rprivate", "ro"])
    adjust.mounts.add(destination="-/gone", type="bind", source=str(tmp_path / "gone"))
    make_sources(adjust)
    assert cache.is_dir()
    assert not (tmp_path / "vgpu").exists() and not (tmp_path / "gone").exists()
