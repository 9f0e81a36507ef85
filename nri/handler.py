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
from typing import Any

import grpc

from crihook.base.metrics import NRI_UNGRANTED
from crihook.hooks.base import ContainerInfo, HookContext, PodInfo, Stage
from crihook.hooks.chain import HookChain, HookRecord, Outcome
from crihook.hooks.gpu_edit import VISIBLE
from crihook.node.container import (
    DeviceNode,
    container_record,
    nri_adjustment,
    nri_allow_rules,
    nri_container_view,
    nri_every_device,
    nri_listed_container,
)
from crihook.node.nriruntime import NriRuntime, gpu_minor, nri_runtime, start_refusal, unapplied, ungranted_gpus
from crihook.node.pod import nri_listed_pod, nri_pod_view, pod_record
from crihook.node.store import Store
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
    """stub.Handler running `chain` and keeping `store`. `evict` (the plugin's update_containers,
    set once the plugin exists) asks the runtime to evict; None: report only."""

    chain: HookChain
    store: Store
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

    # -- registration --------------------------------------------------------------------------

    async def configure(self, request: api.ConfigureRequest) -> int:
        self.runtime = nri_runtime(request.runtime_name, request.runtime_version)
        if request.request_timeout > 0:
            self.request_timeout = request.request_timeout / 1000
        why = start_refusal(self.runtime, cdi_inject=self.cdi_inject)
        if why is not None:
            self.refused = StartRefused(why)
            raise RpcError(_code(grpc.StatusCode.FAILED_PRECONDITION), why)
        return EVENTS

    async def synchronize(
        self, pods: Sequence[api.PodSandbox], containers: Sequence[api.Container]
    ) -> Sequence[api.ContainerUpdate]:
        """The store made to match the runtime (records of known objects kept, others adopted or
        dropped: a reconnection neither loses nor doubles a pod), then the escape check."""
        stats = self.store.reconcile([nri_listed_pod(p) for p in pods], [nri_listed_container(c) for c in containers])
        listed = {c.id for c in containers}
        self._privileged &= listed
        self._barred = {cid: why for cid, why in self._barred.items() if cid in listed}
        log.info("store rebuilt", extra={"source": "synchronize", **stats})
        by_id = {p.id: nri_pod_view(p) for p in pods}
        for pod in by_id.values():
            self.chain.prepare_pod(pod)
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
        new_pods = [p for p in pods if p.id not in self.store.pods]
        new = [c for c in containers if c.id not in self.store.containers]
        for p in new_pods:
            self.store.put_pod(nri_listed_pod(p))
        for c in new:
            self.store.put_container(nri_listed_container(c))
        if new_pods or new:
            log.info("store caught up", extra={"pods": len(new_pods), "containers": len(new)})
            await self._check({p.id: nri_pod_view(p) for p in pods}, new)

    async def shutdown(self) -> None:
        log.info("the runtime is shutting down")

    # -- CreateContainer -----------------------------------------------------------------------

    async def create_container(self, request: api.CreateContainerRequest) -> api.CreateContainerResponse:
        pod, before = nri_pod_view(request.pod), nri_container_view(request.container)
        outcome = await self._run(HookContext(Stage.PRE_CREATE_CONTAINER, pod, before, self._deadline()))
        if outcome.error is not None:
            self._refuse(pod, before, outcome.records, outcome.error.code, outcome.error.reason)
        after = outcome.ctx.container
        assert after is not None
        every = nri_every_device(request.container)
        if every:
            self._note_privileged(pod, before.name, request.container.id)
        try:
            reasons = unapplied(before, after, self.runtime, every_device=every)
            ungranted = ungranted_gpus(nri_allow_rules(request.container), self._nodes(request.container, after))
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
            self._refuse(pod, before, outcome.records, grpc.StatusCode.FAILED_PRECONDITION, why)
        created = replace(after, id=request.container.id)
        self.store.put_container(container_record(pod.id, created, [r.as_dict() for r in outcome.records]))
        _log_event("container created", pod, created, outcome.records)
        return api.CreateContainerResponse(adjust=adjust)

    def _nodes(self, msg: api.Container, after: ContainerInfo) -> list[DeviceNode]:
        """(type, major, minor) of every device node `after` keeps or is given."""
        known = {d.path: (d.type, d.major, d.minor) for d in msg.linux.devices}
        before = {d.container_path: d for d in nri_container_view(msg).devices}
        return [
            known[d.container_path] if before.get(d.container_path) == d else self.node_of(d.host_path)[0]
            for d in after.devices
        ]

    # -- the other events: bookkeeping, refusals, post hooks -------------------------------------

    async def state_change(self, event: api.StateChangeEvent) -> None:
        pod = nri_pod_view(event.pod)
        if event.event == api.RUN_POD_SANDBOX:
            await self._pod_started(pod)
            return
        if event.event == api.STOP_POD_SANDBOX:
            self.store.set_pod_state(pod.id, "notready")
            self._post(Stage.POST_STOP_POD_SANDBOX, pod, None)
        elif event.event == api.REMOVE_POD_SANDBOX:
            self.store.remove_pod(pod.id)
            self._post(Stage.POST_REMOVE_POD_SANDBOX, pod, None)
        container = nri_container_view(event.container) if event.HasField("container") else None
        if container is None:
            return
        if event.event == api.START_CONTAINER and container.id in self._barred:
            reason = self._barred[container.id]
            self._refuse(pod, container, [], grpc.StatusCode.FAILED_PRECONDITION, reason, "StartContainer")
        if event.event == api.START_CONTAINER and self.chain.wants(Stage.PRE_START_CONTAINER):
            outcome = await self._run(HookContext(Stage.PRE_START_CONTAINER, pod, container, self._deadline()))
            if outcome.error is not None:
                why = outcome.error.reason
                self._refuse(pod, container, outcome.records, outcome.error.code, why, "StartContainer")
        elif event.event == api.POST_START_CONTAINER:
            self.store.set_container_state(container.id, "running")
            self._post(Stage.POST_START_CONTAINER, pod, container)
        elif event.event == api.REMOVE_CONTAINER:
            self._privileged.discard(container.id)
            self._barred.pop(container.id, None)
            self.store.remove_container(container.id)
            self._post(Stage.POST_REMOVE_CONTAINER, pod, container)

    async def _pod_started(self, pod: PodInfo) -> None:
        """RunPodSandbox: NRI takes no answer but an error, so a hook may refuse the pod, not change it."""
        records: list[HookRecord] = []
        if self.chain.wants(Stage.PRE_RUN_POD_SANDBOX):
            outcome = await self._run(HookContext(Stage.PRE_RUN_POD_SANDBOX, pod, None, self._deadline()))
            records = outcome.records
            if outcome.error is not None:
                self._refuse(pod, None, records, outcome.error.code, outcome.error.reason)
            if outcome.ctx.pod != pod:
                why = f"crihook: a hook changed pod {pod.ref} at RunPodSandbox, which NRI can not apply; use proxy mode"
                self._refuse(pod, None, records, grpc.StatusCode.FAILED_PRECONDITION, why)
        self.store.put_pod(pod_record(pod, [r.as_dict() for r in records]))
        self.chain.prepare_pod(pod)
        _log_event("pod sandbox started", pod, None, records)

    async def update_container(self, request: api.UpdateContainerRequest) -> api.UpdateContainerResponse:
        return api.UpdateContainerResponse()

    async def stop_container(self, request: api.StopContainerRequest) -> api.StopContainerResponse:
        container = nri_container_view(request.container)
        self.store.set_container_state(container.id, "exited")
        self._post(Stage.POST_STOP_CONTAINER, nri_pod_view(request.pod), container)
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
        nodes = {m for d in c.linux.devices if (m := gpu_minor(d.type, d.major, d.minor)) is not None}
        rules = {m for r in nri_allow_rules(c) if (m := gpu_minor(*r)) is not None}
        named = visible_gpus(before)
        if not (nodes or rules or named):
            return None
        outcome = await self._run(HookContext(Stage.PRE_CREATE_CONTAINER, pod, before, self._deadline()))
        granted_minors: set[int] = set()
        granted_named: frozenset[str] = frozenset()
        if outcome.error is None and outcome.ctx.container is not None:
            after = outcome.ctx.container
            try:
                granted_minors = {m for n in self._nodes(c, after) if (m := gpu_minor(*n)) is not None}
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

    async def _run(self, ctx: HookContext) -> Outcome:
        """The chain on `ctx`, answered by its deadline: a hook still working then makes a refusal,
        never a late answer (which the runtime would take as the plugin gone, and go on without it)."""
        assert ctx.deadline is not None
        try:
            return await asyncio.wait_for(self.chain.run(ctx), max(ctx.deadline - time.monotonic(), 0.0))
        except TimeoutError:
            why = f"crihook: the hooks did not answer within the runtime's {self.request_timeout:g} s request timeout"
            self._refuse(ctx.pod, ctx.container, [], grpc.StatusCode.DEADLINE_EXCEEDED, why)
            raise  # unreachable: _refuse raises

    def _refuse(
        self,
        pod: PodInfo,
        container: ContainerInfo | None,
        records: Sequence[HookRecord],
        code: grpc.StatusCode,
        reason: str,
        what: str = "",
    ) -> None:
        what = what or ("CreateContainer" if container is not None else "RunPodSandbox")
        fields: dict[str, Any] = {"pod": pod.ref, "hooks": _summary(records), "reason": reason}
        if container is not None:
            fields["container"] = container.name
        log.warning(f"{what} refused", extra=fields)
        raise RpcError(_code(code), reason)

    def _post(self, stage: Stage, pod: PodInfo, container: ContainerInfo | None) -> None:
        if self.chain.wants(stage):
            self._spawn(self._post_hooks(HookContext(stage, pod, container)))

    async def _post_hooks(self, ctx: HookContext) -> None:
        outcome = await self.chain.run(ctx)
        if ctx.container is not None and ctx.stage is not Stage.POST_REMOVE_CONTAINER:
            self.store.add_hook_records(ctx.container.id, [r.as_dict() for r in outcome.records])

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


def _summary(records: Sequence[HookRecord]) -> str:
    return ",".join(f"{r.hook}:{r.result}" for r in records)


def _log_event(what: str, pod: PodInfo, container: ContainerInfo | None, records: Sequence[HookRecord]) -> None:
    """The proxy's line for the same event: info when a hook acted, debug otherwise."""
    level = logging.INFO if any(r.result != "noop" for r in records) else logging.DEBUG
    if log.isEnabledFor(level):
        fields: dict[str, Any] = {"pod": pod.ref}
        if container is not None:
            fields["container"] = container.name
        fields["id"] = (container.id if container is not None else pod.id)[:13]
        if records:
            fields["hooks"] = _summary(records)
            fields["ms"] = round(sum(r.ms for r in records), 3)
        log.log(level, what, extra=fields)
