"""The hooks' part of each CRI lifecycle stage, whichever front door the call came in by (the CRI
proxy: proxy/intercept.py; the NRI plugin: nri/). A front door converts its messages to views, and
the decision back; everything between is here, the same for both: run the hook chain on the views,
keep the store's records, run post hooks.

A pre stage (`run_pod_sandbox`, `create_container`, `start_container`, `update_container`) answers
a `Decided`, or raises HookError when a hook with policy "fail" refused. Once the runtime has done
what was decided, the front door reports it with the id the runtime gave (`pod_started`,
`container_created`, `container_started`, `container_updated`), so the store keeps what was really
made. The CRI proxy reports after containerd's answer; in NRI mode CreateContainer already carries
the container's id, so the plugin reports right after its own answer, the runtime waiting for none
of it. Stops and removals (`container_stopped`, ...) only record, and run post hooks in the
background: they never delay or change a call.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from crihook.hooks.base import (
    ContainerInfo,
    ForgetsContainers,
    HookContext,
    LinuxResources,
    PodInfo,
    Stage,
    log_fields,
)
from crihook.hooks.chain import HookChain, HookRecord
from crihook.node.container import container_info, container_record, unknown_container
from crihook.node.pod import pod_info, pod_record, unknown_pod
from crihook.node.records import ContainerRecord, PodRecord
from crihook.node.resources import resources_from_record, resources_record
from crihook.node.store import Store
from crihook.node.update import apply_update

log = logging.getLogger("crihook.node")

POD_VIEWS = 512  # pods whose view is kept, more than a node runs (cleared when full)
Views = tuple[PodInfo, ContainerInfo | None]


@dataclass(frozen=True, slots=True)
class Decided:
    """What the hooks made of one pre stage: the views they were given, the views they left, and
    what each hook did."""

    before: HookContext
    after: HookContext
    records: list[HookRecord]

    @property
    def edited(self) -> bool:
        """Whether a hook changed the views: the call goes on written from `after`, else as it came."""
        return self.after is not self.before


class Lifecycle:
    """The hook chain and the store, behind one call per lifecycle stage."""

    def __init__(self, chain: HookChain, store: Store) -> None:
        self.chain = chain  # replaced on reload
        self.store = store
        self._tasks: set[asyncio.Task[None]] = set()
        # sandbox id -> its store record and the view made of it
        self._pod_views: dict[str, tuple[PodRecord, PodInfo]] = {}

    def wants(self, stage: Stage) -> bool:
        """Whether any hook takes the stage: a front door may skip what feeds only the hooks."""
        return self.chain.wants(stage)

    # -- pre stages: the hooks decide --------------------------------------------------------

    async def run_pod_sandbox(self, pod: PodInfo, deadline: float | None) -> Decided:
        return await self._decide(HookContext(Stage.PRE_RUN_POD_SANDBOX, pod, None, deadline))

    async def create_container(self, pod: PodInfo, container: ContainerInfo, deadline: float | None) -> Decided:
        """`pod`: as the store has it (`pod(id)`) when it does: what the hooks made of it."""
        return await self._decide(HookContext(Stage.PRE_CREATE_CONTAINER, pod, container, deadline))

    async def start_container(self, container_id: str, deadline: float | None) -> Decided:
        pod, container = self._stored(container_id)
        return await self._decide(HookContext(Stage.PRE_START_CONTAINER, pod, container, deadline))

    async def update_container(
        self,
        container_id: str,
        resources: LinuxResources | None,
        annotations: Mapping[str, str],
        deadline: float | None,
    ) -> Decided:
        """The hooks see the container as it will be once the update is in: what it was created with
        (envs, annotations) and its resources with the update applied, the way the runtime applies it."""
        pod, container = self._stored(container_id)
        container = replace(
            container,
            annotations={**container.annotations, **annotations},
            resources=apply_update(container.resources, resources),
        )
        return await self._decide(HookContext(Stage.PRE_UPDATE_CONTAINER_RESOURCES, pod, container, deadline))

    async def _decide(self, ctx: HookContext) -> Decided:
        out = await self.chain.run(ctx)
        if out.error is not None:
            log_refusal(out.ctx, out.records, out.error.reason)
            if ctx.stage is Stage.PRE_CREATE_CONTAINER and ctx.container is not None:
                self.create_failed(ctx.pod, ctx.container)  # a hook before the refusing one let it through
            raise out.error
        return Decided(ctx, out.ctx, out.records)

    # -- what the runtime did: the store, post hooks ----------------------------------------

    def pod_started(self, pod: PodInfo, records: list[HookRecord]) -> None:
        """`pod` as started, its id given; the hooks may get ready for its containers now."""
        self.store.put_pod(pod_record(pod, [r.as_dict() for r in records]))
        _log_event("pod sandbox started", pod, None, records)
        self.pod(pod.id)  # its view made now, off the CreateContainers' path
        self.chain.prepare_pod(pod)

    def container_created(self, pod: PodInfo, container: ContainerInfo, records: list[HookRecord]) -> None:
        """`container` as created (after its hooks), its id given."""
        self.store.put_container(container_record(pod.id, container, [r.as_dict() for r in records]))
        _log_event("container created", pod, container, records)

    def create_failed(self, pod: PodInfo, container: ContainerInfo) -> None:
        """The runtime did not create `container` after the hooks let it through (it failed, or the
        front door refused what the hooks decided): nothing the hooks kept of it stays."""
        self._forget(pod.uid, container.name)

    def _forget(self, pod_uid: str, container: str) -> None:
        for reg in self.chain.hooks:
            if isinstance(reg.hook, ForgetsContainers):
                reg.hook.forget(pod_uid, container)

    def container_started(self, container_id: str, records: list[HookRecord]) -> None:
        self.store.add_hook_records(container_id, [r.as_dict() for r in records])
        self._post(Stage.POST_START_CONTAINER, self.store.set_container_state(container_id, "running"))

    def container_updated(self, container_id: str, resources: LinuxResources | None, records: list[HookRecord]) -> None:
        """`resources`: the update as it reached the runtime, which merged it into the container;
        so does the store."""
        self.store.add_hook_records(container_id, [r.as_dict() for r in records])
        rec = self.store.containers.get(container_id)
        if rec is not None and resources is not None:
            merged = apply_update(resources_from_record(rec.resources), resources)
            self.store.set_container_resources(container_id, resources_record(merged))

    def container_stopped(self, container_id: str) -> None:
        self._post(Stage.POST_STOP_CONTAINER, self.store.set_container_state(container_id, "exited"))

    def container_removed(self, container_id: str) -> None:
        rec = self.store.remove_container(container_id)
        pod = self.store.pods.get(rec.pod_id) if rec is not None else None
        if rec is not None and pod is not None:
            self._forget(pod.uid, rec.name)
        self._post(Stage.POST_REMOVE_CONTAINER, rec)

    def pod_stopped(self, pod_id: str) -> None:
        self._post_pod(Stage.POST_STOP_POD_SANDBOX, self.store.set_pod_state(pod_id, "notready"))

    def pod_removed(self, pod_id: str) -> None:
        self._post_pod(Stage.POST_REMOVE_POD_SANDBOX, self.store.remove_pod(pod_id))

    # -- views from the store ------------------------------------------------------------------

    def pod(self, pod_id: str) -> PodInfo | None:
        """The pod as the store recorded it at RunPodSandbox (what the hooks made of it), made into
        a view once per record; None for a pod crihook has not seen start."""
        rec = self.store.pods.get(pod_id)
        if rec is None:
            return None
        kept = self._pod_views.get(pod_id)
        if kept is not None and kept[0] is rec:
            return kept[1]
        if len(self._pod_views) >= POD_VIEWS:
            self._pod_views.clear()
        view = pod_info(rec)
        self._pod_views[pod_id] = (rec, view)
        return view

    def _stored(self, container_id: str) -> tuple[PodInfo, ContainerInfo]:
        rec = self.store.containers.get(container_id)
        pod = self.pod(rec.pod_id) if rec is not None else None
        if rec is None or pod is None:
            # created before crihook knew it, and not reconciled: hooks still see the id
            return unknown_pod(), unknown_container(container_id)
        return pod, container_info(rec)

    # -- post hooks ----------------------------------------------------------------------------

    def _post(self, stage: Stage, rec: ContainerRecord | None) -> None:
        if rec is None or not self.chain.wants(stage):
            return
        pod = self.pod(rec.pod_id) or unknown_pod(rec.pod_id)
        self._spawn(HookContext(stage, pod, container_info(rec)))

    def _post_pod(self, stage: Stage, rec: PodRecord | None) -> None:
        if rec is not None and self.chain.wants(stage):
            self._spawn(HookContext(stage, pod_info(rec)))

    def _spawn(self, ctx: HookContext) -> None:
        task = asyncio.get_running_loop().create_task(self._post_hooks(ctx))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _post_hooks(self, ctx: HookContext) -> None:
        outcome = await self.chain.run(ctx)
        if ctx.container is not None and ctx.stage is not Stage.POST_REMOVE_CONTAINER:
            self.store.add_hook_records(ctx.container.id, [r.as_dict() for r in outcome.records])

    async def close(self) -> None:
        """Let running post hooks finish (each is bounded by its hook timeouts)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


# -- logs ----------------------------------------------------------------------------------------


def _summary(records: Iterable[HookRecord]) -> str:
    return ",".join(f"{r.hook}:{r.result}" for r in records)


def log_refusal(ctx: HookContext, records: Iterable[HookRecord], reason: str) -> None:
    """The line for a refused stage, whoever refused it: a hook, or the front door for what it can
    not carry out."""
    log.warning(f"{ctx.stage} refused", extra={**ctx.log_fields(), "hooks": _summary(records), "reason": reason})


def _log_event(what: str, pod: PodInfo, container: ContainerInfo | None, records: list[HookRecord]) -> None:
    acted = [r for r in records if r.result != "noop"]
    level = logging.INFO if acted else logging.DEBUG
    if log.isEnabledFor(level):
        fields: dict[str, Any] = log_fields(pod, container)
        fields["id"] = container.id[:13] if container is not None else pod.id[:13]
        if records:
            fields["hooks"] = _summary(records)
            fields["ms"] = round(sum(r.ms for r in records), 3)
        log.log(level, what, extra=fields)
