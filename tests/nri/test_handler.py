"""NRI's events through the lifecycle core: the store, hook records, post hooks and refusals come
out as in proxy mode (tests/proxy/test_intercept.py drives the same core from CRI messages)."""

from __future__ import annotations

import logging
from pathlib import Path

import grpc
import pytest

from crihook.base.config import HooksConfig, NodeConfig
from crihook.hooks.base import Edit, HookContext, HookError, ResourcesPatch, Stage
from crihook.hooks.registry import build_chain
from crihook.node.lifecycle import Lifecycle
from crihook.node.store import Store
from crihook.nri.handler import HookHandler
from crihook.nri.stub import RpcError, event_mask
from crihook.proto import nri_v1alpha1_pb2 as api

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


def container() -> api.Container:
    return api.Container(id="c-1", pod_sandbox_id=POD.id, name="main", env=["PATH=/bin"])


async def event(h: HookHandler, kind: int) -> None:
    await h.state_change(api.StateChangeEvent(event=kind, pod=POD, container=container()))


async def test_events_keep_the_store_and_run_post_hooks(tmp_path: Path) -> None:
    hook = Recorder()
    h = await handler(tmp_path, hook)
    store = h.lifecycle.store
    await h.state_change(api.StateChangeEvent(event=api.RUN_POD_SANDBOX, pod=POD))
    assert store.pods["sb-1"].state == "ready"

    answer = await h.create_container(api.CreateContainerRequest(pod=POD, container=container()))
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
    await h.create_container(api.CreateContainerRequest(pod=POD, container=container()))
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
