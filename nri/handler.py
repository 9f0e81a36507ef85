"""The hook chain as an NRI plugin: the runtime's calls become the stages `crihook serve` runs, on
the same PodInfo/ContainerInfo views, and the hooks' result becomes a ContainerAdjustment.

What the runtime at hand can not carry out (env and device removals, a GPU cgroup rule it put in the
spec, CDI devices before containerd 2.1) is refused: the runtime then does not create the container
(docs/nri.md). Every answer comes within the runtime's request timeout, refusals included: a late
answer makes the runtime drop the plugin and create the container without crihook.

At each (re)connection `synchronize` rebuilds the store from the runtime's list and finds the
containers that reach a GPU nobody granted (created while crihook was away); `[nri] synchronize`
says whether they are evicted or only reported.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import grpc

from crihook.base.metrics import NRI_UNGRANTED
from crihook.hooks.base import ContainerInfo, HookContext, HookError, PodInfo, Stage
from crihook.hooks.chain import HookRecord
from crihook.hooks.grant import VISIBLE
from crihook.node.container import (
    DeviceNode,
    nri_adjustment,
    nri_allow_rules,
    nri_container_view,
    nri_device_nodes,
    nri_every_device,
    nri_listed_container,
)
from crihook.node.lifecycle import Lifecycle, log_refusal
from crihook.node.nriruntime import (
    NriRuntime,
    gpu_minor,
    nri_runtime,
    start_refusal,
    unapplied,
    ungranted_gpus,
    update_unapplied,
)
from crihook.node.pod import nri_listed_pod, nri_pod_view
from crihook.node.resources import nri_container_update, nri_resources_view
from crihook.nri.stub import RpcError, event_mask
from crihook.proto import nri_v1alpha1_pb2 as api

log = logging.getLogger("crihook.nri")

EVENTS = event_mask(
    api.RUN_POD_SANDBOX,
    api.STOP_POD_SANDBOX,
    api.REMOVE_POD_SANDBOX,
    api.CREATE_CONTAINER,
    api.START_CONTAINER,
    api.POST_START_CONTAINER,
    api.STOP_CONTAINER,
    api.REMOVE_CONTAINER,
)
MARGIN = 0.25  # seconds kept back from the runtime's request timeout for the answer's trip
CATCH_UP = 2.0  # seconds after a Synchronize before the runtime is listed again over CRI
_NO_GPU = frozenset({"", "void", "none"})  # NVIDIA_VISIBLE_DEVICES values that name no GPU
T = TypeVar("T")


class StartRefused(Exception):
    """crihook must not serve this runtime at all (nriruntime.start_refusal); the message says why."""


def stat_node(path: str) -> tuple[DeviceNode, int]:
    """The device node at `path` on the host: ((type, major, minor), permission bits). OSError when
    it is not one."""
    st = os.stat(path)
    if stat.S_ISCHR(st.st_mode):
        kind = "c"
    elif stat.S_ISBLK(st.st_mode):
        kind = "b"
    else:
        raise OSError(f"{path} is not a device node")
    return (kind, os.major(st.st_rdev), os.minor(st.st_rdev)), stat.S_IMODE(st.st_mode)


def make_sources(adjust: api.ContainerAdjustment) -> None:
    """Create the missing host directory of each bind mount added, as containerd's CRI does for
    the mounts of a request (WithMounts: MkdirAll 0755); a mount NRI adds reaches runc as it is,
    which fails on a missing source. OSError when one can not be made."""
    for m in adjust.mounts:
        if not m.destination.startswith("-") and m.type == "bind" and not os.path.exists(m.source):
            os.makedirs(m.source, 0o755, exist_ok=True)


def visible_gpus(c: ContainerInfo) -> frozenset[str]:
    """The GPUs NVIDIA_VISIBLE_DEVICES names (the NVIDIA runtime hook gives them at start whatever
    the spec's device list says): UUIDs or indices as written, or "all"."""
    value = (c.env(VISIBLE) or "").strip()
    return frozenset() if value in _NO_GPU else frozenset(v.strip() for v in value.split(","))


def _code(code: grpc.StatusCode) -> int:
    value: int = code.value[0]
    return value


@dataclass
class Ungranted:
    """A container found at Synchronize reaching GPUs nobody granted it."""

    container_id: str
    pod: str  # namespace/name
    container: str
    what: str  # the GPUs, in words

    @property
    def reason(self) -> str:
        return (
            f"crihook: container {self.container} of pod {self.pod} reaches {self.what}, which neither the scheduler's"
            " allocation nor kubelet's device-plugin checkpoint granted (it was created while crihook was away)"
        )


@dataclass
class HookHandler:
    """stub.Handler on the lifecycle core `crihook serve` uses: the core runs the hooks, keeps the
    store and runs post hooks; what is NRI's own (adjustments, what the runtime can not apply,
    request deadlines, Synchronize's escape check) is here. `evict` (the plugin's
    update_containers, set once the plugin exists) asks the runtime to evict; None: report only."""

    lifecycle: Lifecycle
    synchronize_action: str = "evict"  # "evict" | "report"
    cdi_inject: bool = False  # gpu.inject = "cdi": refused on runtimes that drop CDI adjustments
    node_of: Callable[[str], tuple[DeviceNode, int]] = stat_node
    evict: Callable[[Sequence[api.ContainerEviction]], Awaitable[Any]] | None = None
    # the runtime's pods and containers as NRI would show them, listed over CRI: Synchronize's list
    # can miss a creation that raced it (containerd 1.7), which this catches up with
    relist: Callable[[], Awaitable[tuple[list[api.PodSandbox], list[api.Container]]]] | None = None
    request_timeout: float = 2.0
    runtime: NriRuntime = field(default_factory=lambda: nri_runtime("", ""))
    refused: StartRefused | None = None
    synchronized: asyncio.Event = field(default_factory=asyncio.Event)  # set after the first Synchronize
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _privileged: set[str] = field(default_factory=set)  # ids of the privileged containers logged
    # containers Synchronize found reaching ungranted GPUs, with the reason, when evicting: the
    # eviction (CRI StopContainer) does nothing to one created and not yet started, so its start is refused
    _barred: dict[str, str] = field(default_factory=dict)
    # container id -> the records of its PreStartContainer hooks, kept until PostStartContainer
    _starting: dict[str, list[HookRecord]] = field(default_factory=dict)

    # -- registration --------------------------------------------------------------------------

    async def configure(self, request: api.ConfigureRequest) -> int:
        self.runtime = nri_runtime(request.runtime_name, request.runtime_version, request.NRI_version)
        if request.request_timeout > 0:
            self.request_timeout = request.request_timeout / 1000
        why = start_refusal(self.runtime, cdi_inject=self.cdi_inject)
        if why is not None:
            self.refused = StartRefused(why)
            raise RpcError(_code(grpc.StatusCode.FAILED_PRECONDITION), why)
        if self.lifecycle.wants(Stage.PRE_UPDATE_CONTAINER_RESOURCES):  # else each update's trip saved
            return EVENTS | event_mask(api.UPDATE_CONTAINER)
        return EVENTS

    async def synchronize(
        self, pods: Sequence[api.PodSandbox], containers: Sequence[api.Container]
    ) -> Sequence[api.ContainerUpdate]:
        """The store made to match the runtime (records of known objects kept, others adopted or
        dropped: a reconnection neither loses nor doubles a pod), then the escape check."""
        stats = self.lifecycle.store.reconcile(
            [nri_listed_pod(p) for p in pods], [nri_listed_container(c) for c in containers]
        )
        listed = {c.id for c in containers}
        self._privileged &= listed
        self._barred = {cid: why for cid, why in self._barred.items() if cid in listed}
        self._starting = {cid: r for cid, r in self._starting.items() if cid in listed}
        log.info("store rebuilt", extra={"source": "synchronize", **stats})
        by_id = {p.id: nri_pod_view(p) for p in pods}
        for pod in by_id.values():
            self.lifecycle.chain.prepare_pod(pod)
        await self._check(by_id, containers)
        if self.relist is not None:
            self._spawn(self._catch_up())
        self.synchronized.set()
        return []

    async def _check(self, pods: dict[str, PodInfo], containers: Sequence[api.Container]) -> None:
        """The escape check on live containers; what it finds is acted on in the background."""
        found = []
        for c in containers:
            owner = pods.get(c.pod_sandbox_id)
            if owner is not None and c.state in (api.CONTAINER_CREATED, api.CONTAINER_RUNNING, api.CONTAINER_PAUSED):
                hit = await self._ungranted(owner, c)
                if hit is not None:
                    found.append(hit)
        if self.synchronize_action == "evict":
            self._barred.update((h.container_id, h.reason) for h in found)
        if found:
            self._spawn(self._act_on(found))

    async def _catch_up(self) -> None:
        """A while after a Synchronize: pods and containers the runtime has that neither its list nor
        an event since told crihook of are adopted into the store and checked like the others."""
        assert self.relist is not None
        await asyncio.sleep(CATCH_UP)
        try:
            pods, containers = await self.relist()
        except Exception as e:  # the next Synchronize lists them
            log.warning("listing the runtime over CRI failed", extra={"error": str(e)})
            return
        new_pods = [p for p in pods if p.id not in self.lifecycle.store.pods]
        new = [c for c in containers if c.id not in self.lifecycle.store.containers]
        for p in new_pods:
            self.lifecycle.store.put_pod(nri_listed_pod(p))
        for c in new:
            self.lifecycle.store.put_container(nri_listed_container(c))
        if new_pods or new:
            log.info("store caught up", extra={"pods": len(new_pods), "containers": len(new)})
            await self._check({p.id: nri_pod_view(p) for p in pods}, new)

    async def shutdown(self) -> None:
        log.info("the runtime is shutting down")

    # -- CreateContainer -----------------------------------------------------------------------

    async def create_container(self, request: api.CreateContainerRequest) -> api.CreateContainerResponse:
        pod, before = nri_pod_view(request.pod), nri_container_view(request.container)
        ctx = HookContext(Stage.PRE_CREATE_CONTAINER, pod, before, self._deadline())
        decided = await self._in_time(ctx, self.lifecycle.create_container(pod, before, ctx.deadline))
        after = decided.after.container
        assert after is not None
        every = nri_every_device(request.container)
        if every:
            self._note_privileged(pod, before.name, request.container.id)
        try:
            reasons = unapplied(before, after, self.runtime, every_device=every)
            nodes = self._nodes(request.container, before, after)
            ungranted = ungranted_gpus(nri_allow_rules(request.container), nodes)
            if ungranted:
                rules = ", ".join(f"c 195:{m}" for m in ungranted)
                reasons.append(
                    f"GPU minor {', '.join(map(str, ungranted))} stays reachable through the device-cgroup rule"
                    f" {rules} the runtime put in the spec (a CDI device or the device plugin's), and no NRI"
                    " adjustment can take a rule away"
                )
            adjust = nri_adjustment(before, after, self.node_of) if not reasons else None
            if adjust is not None:
                make_sources(adjust)
        except OSError as e:
            reasons, adjust = [f"a device node or mount source to add can not be had ({e})"], None
        if adjust is None:
            why = (
                f"{self.runtime.ref or 'this runtime'} can not carry out what crihook decided for container"
                f" {before.name} of pod {pod.ref}: {'; '.join(reasons)}. crihook's proxy mode can (docs/nri.md)"
            )
            self._refuse(ctx, decided.records, grpc.StatusCode.FAILED_PRECONDITION, why)
        self.lifecycle.container_created(pod, replace(after, id=request.container.id), decided.records)
        return api.CreateContainerResponse(adjust=adjust)

    def _nodes(self, msg: api.Container, before: ContainerInfo, after: ContainerInfo) -> list[DeviceNode]:
        """(type, major, minor) of every device node `after` keeps from `before` (the view of `msg`) or
        is given."""
        known = dict(zip((d.path for d in msg.linux.devices), nri_device_nodes(msg), strict=True))
        kept = {d.container_path: d for d in before.devices}
        return [
            known[d.container_path] if kept.get(d.container_path) == d else self.node_of(d.host_path)[0]
            for d in after.devices
        ]

    # -- the other events: bookkeeping, refusals, post hooks -------------------------------------

    async def state_change(self, event: api.StateChangeEvent) -> None:
        """Views are made only for the events whose hooks see them; the others need the ids alone."""
        kind, cid = event.event, event.container.id
        if kind == api.RUN_POD_SANDBOX:
            await self._pod_started(nri_pod_view(event.pod))
        elif kind == api.STOP_POD_SANDBOX:
            self.lifecycle.pod_stopped(event.pod.id)
        elif kind == api.REMOVE_POD_SANDBOX:
            self.lifecycle.pod_removed(event.pod.id)
        elif kind == api.START_CONTAINER and event.HasField("container"):
            pod, container = nri_pod_view(event.pod), nri_container_view(event.container)
            ctx = HookContext(Stage.PRE_START_CONTAINER, pod, container, self._deadline())
            if cid in self._barred:
                self._refuse(ctx, [], grpc.StatusCode.FAILED_PRECONDITION, self._barred[cid])
            if self.lifecycle.wants(Stage.PRE_START_CONTAINER):
                decided = await self._in_time(ctx, self.lifecycle.start_container(cid, ctx.deadline))
                self._starting[cid] = decided.records
        elif kind == api.POST_START_CONTAINER and event.HasField("container"):
            self.lifecycle.container_started(cid, self._starting.pop(cid, []))
        elif kind == api.REMOVE_CONTAINER and event.HasField("container"):
            self._privileged.discard(cid)
            self._barred.pop(cid, None)
            self._starting.pop(cid, None)
            self.lifecycle.container_removed(cid)

    async def _pod_started(self, pod: PodInfo) -> None:
        """RunPodSandbox: NRI takes no answer but an error, so a hook may refuse the pod, not change it."""
        records: list[HookRecord] = []
        if self.lifecycle.wants(Stage.PRE_RUN_POD_SANDBOX):
            ctx = HookContext(Stage.PRE_RUN_POD_SANDBOX, pod, None, self._deadline())
            decided = await self._in_time(ctx, self.lifecycle.run_pod_sandbox(pod, ctx.deadline))
            records = decided.records
            if decided.after.pod != pod:
                why = f"crihook: a hook changed pod {pod.ref} at RunPodSandbox, which NRI can not apply; use proxy mode"
                self._refuse(ctx, records, grpc.StatusCode.FAILED_PRECONDITION, why)
        self.lifecycle.pod_started(pod, records)

    async def update_container(self, request: api.UpdateContainerRequest) -> api.UpdateContainerResponse:
        """UpdateContainerResources through the core as in proxy mode; what the hooks change of the
        resources goes back as an update of this container, merged by the runtime into its request."""
        cid = request.container.id
        if not self.lifecycle.wants(Stage.PRE_UPDATE_CONTAINER_RESOURCES):
            return api.UpdateContainerResponse()
        asked = nri_resources_view(request.linux_resources, request.HasField("linux_resources"))
        ctx = HookContext(
            Stage.PRE_UPDATE_CONTAINER_RESOURCES,
            nri_pod_view(request.pod),
            nri_container_view(request.container),
            self._deadline(),
        )
        decided = await self._in_time(ctx, self.lifecycle.update_container(cid, asked, {}, ctx.deadline))
        before, after = decided.before.container, decided.after.container
        assert before is not None and after is not None
        reasons = update_unapplied(before, after)
        if reasons:
            why = f"NRI can not carry out what crihook decided for the update of container {before.name}: "
            self._refuse(ctx, decided.records, grpc.StatusCode.FAILED_PRECONDITION, why + "; ".join(reasons))
        update = nri_container_update(cid, before.resources, after.resources)
        self.lifecycle.container_updated(cid, after.resources, decided.records)
        return api.UpdateContainerResponse(update=[update] if update is not None else [])

    async def stop_container(self, request: api.StopContainerRequest) -> api.StopContainerResponse:
        self.lifecycle.container_stopped(request.container.id)
        return api.StopContainerResponse()

    # -- Synchronize's escape check ------------------------------------------------------------

    async def _ungranted(self, pod: PodInfo, c: api.Container) -> Ungranted | None:
        """The container as it runs against what the hooks would have made of it: GPU nodes and
        cgroup rules it has beyond the nodes they give it, and GPUs its NVIDIA_VISIBLE_DEVICES names
        beyond theirs. A container the hooks refuse outright is granted nothing. A privileged one is
        passed over: it reaches every device by its privilege, in either mode (docs/nri.md)."""
        before = nri_container_view(c)
        if nri_every_device(c):
            self._note_privileged(pod, before.name, c.id)
            return None
        nodes = {m for n in nri_device_nodes(c) if (m := gpu_minor(*n)) is not None}
        rules = {m for r in nri_allow_rules(c) if (m := gpu_minor(*r)) is not None}
        named = visible_gpus(before)
        if not (nodes or rules or named):
            return None
        ctx = HookContext(Stage.PRE_CREATE_CONTAINER, pod, before, self._deadline())
        after = await self._in_time(ctx, self.lifecycle.trial_create(pod, before, ctx.deadline))
        granted_minors: set[int] = set()
        granted_named: frozenset[str] = frozenset()
        if after is not None:
            try:
                granted_minors = {m for n in self._nodes(c, before, after) if (m := gpu_minor(*n)) is not None}
            except OSError:
                granted_minors = set()
            granted_named = visible_gpus(after)
        extra_minors = sorted((nodes | rules) - granted_minors)
        extra_named = sorted(named - granted_named)
        if not (extra_minors or extra_named):
            return None
        what = []
        if extra_minors:
            what.append(f"GPU minor {', '.join(map(str, extra_minors))}")
        if extra_named:
            what.append(f"NVIDIA_VISIBLE_DEVICES={','.join(extra_named)}")
        return Ungranted(c.id, pod.ref, before.name, " and ".join(what))

    async def _act_on(self, found: Sequence[Ungranted]) -> None:
        """Evict (after Synchronize was answered: the runtime serves no update before) or report."""
        for hit in found:
            log.warning(
                "container reaches an ungranted GPU",
                extra={"pod": hit.pod, "container": hit.container, "id": hit.container_id[:13], "gpus": hit.what},
            )
        if self.synchronize_action != "evict" or self.evict is None:
            NRI_UNGRANTED.inc("reported", amount=len(found))
            return
        try:
            await self.evict([api.ContainerEviction(container_id=h.container_id, reason=h.reason) for h in found])
        except Exception as e:  # the next connection's Synchronize finds them again
            log.error("eviction failed", extra={"containers": len(found), "error": str(e)})
            NRI_UNGRANTED.inc("evict_failed", amount=len(found))
            return
        for hit in found:
            log.warning("container evicted", extra={"pod": hit.pod, "container": hit.container, "reason": hit.reason})
        NRI_UNGRANTED.inc("evicted", amount=len(found))

    # -- helpers -------------------------------------------------------------------------------

    def _note_privileged(self, pod: PodInfo, name: str, container_id: str) -> None:
        """Once per container: it keeps every host device, crihook's grant or not."""
        if container_id in self._privileged:
            return
        self._privileged.add(container_id)
        log.info(
            "privileged container: it reaches every device, GPUs included, whatever crihook grants",
            extra={"pod": pod.ref, "container": name, "id": container_id[:13]},
        )

    def _deadline(self) -> float:
        return time.monotonic() + max(self.request_timeout - MARGIN, 0.1)

    async def _in_time(self, ctx: HookContext, work: Awaitable[T]) -> T:
        """`work` (the core's stage on `ctx`) answered by the deadline: a hook still working then
        makes a refusal, never a late answer (which the runtime would take as the plugin gone, and
        go on without it). A hook's refusal becomes the runtime's error; the core logged it."""
        assert ctx.deadline is not None
        try:
            return await asyncio.wait_for(work, max(ctx.deadline - time.monotonic(), 0.0))
        except HookError as e:
            raise RpcError(_code(e.code), e.reason) from None
        except TimeoutError:
            why = f"crihook: the hooks did not answer within the runtime's {self.request_timeout:g} s request timeout"
            self._refuse(ctx, [], grpc.StatusCode.DEADLINE_EXCEEDED, why)
            raise  # unreachable: _refuse raises

    def _refuse(self, ctx: HookContext, records: Sequence[HookRecord], code: grpc.StatusCode, reason: str) -> None:
        """Refuse what `ctx` is about for a reason of NRI's own, logged as the core logs a hook's."""
        log_refusal(ctx, records, reason)
        raise RpcError(_code(code), reason)

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.lifecycle.close()
