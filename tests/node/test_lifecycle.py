"""The lifecycle core, called with views the way either front door calls it: the CRI proxy (a pre
stage, then what the runtime did once it answered) and the NRI plugin (CreateContainer already
carrying the container's id, reported at once)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from crihook.base.config import HooksConfig, NodeConfig
from crihook.hooks.base import ContainerInfo, Edit, HookContext, HookError, LinuxResources, PodInfo, Stage
from crihook.hooks.registry import build_chain
from crihook.node.lifecycle import Lifecycle
from crihook.node.store import Store

POD = PodInfo(name="train", namespace="ml", uid="u-1", annotations={"a": "1"}, runtime_handler="runc")


class Hook:
    """Adds an env at CreateContainer, refuses a container named "bad", remembers every view."""

    name = "h"
    priority = 1
    stages = frozenset(
        {Stage.PRE_RUN_POD_SANDBOX, Stage.PRE_CREATE_CONTAINER, Stage.PRE_UPDATE_CONTAINER_RESOURCES}
        | {s for s in Stage if s.is_post}
    )

    def __init__(self) -> None:
        self.seen: list[HookContext] = []

    async def handle(self, ctx: HookContext) -> Edit | None:
        self.seen.append(ctx)
        if ctx.container is not None and ctx.container.name == "bad":
            raise HookError(grpc.StatusCode.FAILED_PRECONDITION, "not this one")
        return Edit(env={"ADDED": "1"}) if ctx.stage is Stage.PRE_CREATE_CONTAINER else None


def core(tmp_path: Path, hook: Hook) -> Lifecycle:
    chain = build_chain(HooksConfig(), NodeConfig(), factories={"h": lambda options, node: hook})
    return Lifecycle(chain, Store(tmp_path))


async def test_a_pod_and_its_container_as_the_proxy_reports_them(tmp_path: Path) -> None:
    hook = Hook()
    c = core(tmp_path, hook)
    ran = await c.run_pod_sandbox(POD, deadline=None)
    assert not ran.edited and ran.after.pod == POD
    c.pod_started(replace(ran.after.pod, id="sb-1"), ran.records)
    pod = c.pod("sb-1")
    assert pod is not None and pod.annotations == {"a": "1"} and pod.runtime_handler == "runc"
    assert c.pod("sb-1") is pod  # made once per record

    decided = await c.create_container(pod, ContainerInfo(name="main", envs=(("A", "x"),)), deadline=12.5)
    assert decided.edited and decided.before.deadline == 12.5
    assert decided.after.container is not None and decided.after.container.env("ADDED") == "1"
    assert c.store.containers == {}  # nothing recorded before the runtime made it
    created = replace(decided.after.container, id="c-1")
    c.container_created(decided.after.pod, created, decided.records)
    rec = c.store.containers["c-1"]
    assert (rec.pod_id, rec.name, rec.envs) == ("sb-1", "main", {"A": "x", "ADDED": "1"})
    assert [h["result"] for h in rec.hooks] == ["ok"]
    await c.store.close()


async def test_nri_create_carries_the_id_and_is_reported_at_once(tmp_path: Path) -> None:
    hook = Hook()
    c = core(tmp_path, hook)
    pod = PodInfo(name="p", namespace="ns", uid="u", id="sb-9")  # a pod the store has not seen
    decided = await c.create_container(pod, ContainerInfo(name="main", id="c-9"), deadline=None)
    assert decided.after.container is not None
    c.container_created(decided.after.pod, decided.after.container, decided.records)
    assert c.store.containers["c-9"].envs == {"ADDED": "1"}
    await c.store.close()


class Keeper:
    """Lets every container through first and keeps it (as the gpu hook keeps the GPUs it let
    through) until told to forget it."""

    name = "keeper"
    priority = 0
    stages = frozenset({Stage.PRE_CREATE_CONTAINER})

    def __init__(self) -> None:
        self.forgotten: list[tuple[str, str]] = []

    async def handle(self, ctx: HookContext) -> Edit | None:
        return None

    def forget(self, pod_uid: str, container: str) -> None:
        self.forgotten.append((pod_uid, container))


async def test_a_refusal_raises_records_nothing_and_what_was_kept_is_forgotten(tmp_path: Path) -> None:
    keeper = Keeper()
    factories = {"h": lambda options, node: Hook(), "keeper": lambda options, node: keeper}
    c = Lifecycle(build_chain(HooksConfig(), NodeConfig(), factories=factories), Store(tmp_path))
    with pytest.raises(HookError) as refused:
        await c.create_container(POD, ContainerInfo(name="bad"), deadline=None)
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "pod ml/train container bad: not this one" in refused.value.reason
    assert c.store.containers == {}
    assert keeper.forgotten == [("u-1", "bad")]


async def test_stored_containers_are_shown_to_later_stages_and_post_hooks(tmp_path: Path) -> None:
    hook = Hook()
    c = core(tmp_path, hook)
    c.pod_started(PodInfo(name="p", namespace="ns", uid="u", id="sb-1"), [])
    resources = LinuxResources(cpu_shares=512, cpuset_cpus="0-3")
    c.container_created(c.pod("sb-1"), ContainerInfo(name="main", id="c-1", resources=resources), [])  # type: ignore[arg-type]
    decided = await c.update_container("c-1", LinuxResources(cpuset_cpus="1"), {"k": "v"}, deadline=None)
    assert decided.before.container is not None
    assert decided.before.container.resources == LinuxResources(cpu_shares=512, cpuset_cpus="1")
    assert decided.before.container.annotations == {"k": "v"}
    c.container_updated("c-1", LinuxResources(cpuset_cpus="1"), decided.records)
    assert c.store.containers["c-1"].resources["cpuset_cpus"] == "1"

    c.container_stopped("c-1")
    c.container_removed("c-1")
    c.pod_stopped("sb-1")
    c.pod_removed("sb-1")
    await c.close()
    posts = [(s.stage, s.container.name if s.container else None) for s in hook.seen if s.stage.is_post]
    assert posts == [
        (Stage.POST_STOP_CONTAINER, "main"),
        (Stage.POST_REMOVE_CONTAINER, "main"),
        (Stage.POST_STOP_POD_SANDBOX, None),
        (Stage.POST_REMOVE_POD_SANDBOX, None),
    ]
    assert c.store.pods == {} and c.store.containers == {}
    await asyncio.sleep(0)
    await c.store.close()
