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
import json
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, TypeVar

import grpc

from crihook.base.metrics import NRI_EVICTIONS_PENDING, NRI_UNGRANTED
from crihook.hooks.base import ContainerInfo, HookContext, HookError, JudgesGpus, PodInfo, Stage
from crihook.hooks.chain import HookChain, HookRecord
from crihook.hooks.fscache import FsMemo, NotCached
from crihook.hooks.reach import (
    GPU_MAJOR,
    VISIBLE,
    DeviceRule,
    Reach,
    Undecided,
    Verdict,
    every_device,
    gpu_cdi_name,
    gpu_minor,
    visible_names,
)
from crihook.node.container import (
    DeviceNumber,
    adjusted_rules,
    nri_adjustment,
    nri_container_view,
    nri_listed_container,
    nri_reach,
    nri_rules,
    reach_of,
)
from crihook.node.lifecycle import POD_VIEWS, Lifecycle, log_refusal
from crihook.node.nriruntime import (
    Answer,
    NriRuntime,
    answer,
    deniable,
    escapes,
    nri_runtime,
    start_refusal,
    unapplied,
    update_unapplied,
)
from crihook.node.pod import nri_listed_pod, nri_pod_view
from crihook.node.resources import nri_container_update, nri_resources_view
from crihook.nri.stub import RpcError, event_mask
from crihook.proto import nri_v1alpha1_pb2 as api

log = logging.getLogger("crihook.nri")

# RunPodSandbox only when a hook runs there: the runtime waits for its answer inside every pod
# start, and the pod is recorded at its first CreateContainer (or Synchronize) all the same
EVENTS = event_mask(
    api.STOP_POD_SANDBOX,
    api.REMOVE_POD_SANDBOX,
    api.CREATE_CONTAINER,
    api.START_CONTAINER,
    api.STOP_CONTAINER,
    api.REMOVE_CONTAINER,
)
SELINUX_ENFORCE = "/sys/fs/selinux/enforce"  # there when SELinux is on, enforcing or permissive
ANSWERS_KEPT = 1024  # answers to CreateContainer kept for their validation
MARGIN = 0.25  # seconds kept back from the runtime's request timeout for the answer's trip
CATCH_UP = 2.0  # seconds after a Synchronize before the runtime is listed again over CRI
RELIST_EVERY = 60.0  # seconds between later listings
RECORD_GRACE = 10.0  # seconds a record may precede its container in the runtime's list (it is being made)
RETRY_FIRST = 1.0  # seconds before an eviction or an undecided check is tried again, doubled each time
RETRY_MOST = 60.0  # ... up to this
EVICTIONS_FILE = "nri-evictions.json"  # in the state dir: the evictions still tried, for `crihook doctor`
T = TypeVar("T")


class StartRefused(Exception):
    """crihook must not serve this runtime at all (nriruntime.start_refusal); the message says why."""


def stat_node(path: str) -> tuple[DeviceNumber, int]:
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
    """Create the missing host directory of each writable bind mount added, as containerd's CRI
    does for the mounts of a request (WithMounts: MkdirAll 0755); a mount NRI adds reaches runc as
    it is, which fails on a missing source. A read-only mount's source is something another program
    put on the host (HAMi-core's library): crihook in a pod does not see it, and a directory made in
    its place would hide that it is missing, so runc is left to name it. OSError when one can not be
    made."""
    for m in adjust.mounts:
        if m.destination.startswith("-") or m.type != "bind" or "ro" in m.options:
            continue
        if not os.path.exists(m.source):
            os.makedirs(m.source, 0o755, exist_ok=True)


def may_reach_gpus(reach: Reach) -> bool:
    """Whether `reach` has anything that can name a GPU (most containers have nothing): a GPU's
    device node, an allow rule that can open one (containerd's `c *:* m` for every container opens
    nothing), a GPU-kind CDI device, NVIDIA_VISIBLE_DEVICES."""
    return bool(
        any(gpu_minor(n.kind, n.major, n.minor) is not None for n in reach.nodes)
        or any(r.major in (None, GPU_MAJOR) and r.kind in ("", "a", "c") and r.opens for r in reach.rules or ())
        or any(gpu_cdi_name(n) is not None for n in reach.cdi_devices)
        or visible_names(reach.visible)
    )


def _code(code: grpc.StatusCode) -> int:
    value: int = code.value[0]
    return value


@dataclass
class Ungranted:
    """A container found reaching GPUs nobody granted it, created without crihook's hooks."""

    container_id: str
    pod: str  # namespace/name
    container: str
    what: str  # the GPUs, in words (Verdict.describe)
    error: str = ""  # why the last eviction try failed
    tries: int = 0

    @property
    def reason(self) -> str:
        return (
            f"crihook: container {self.container} of pod {self.pod} reaches {self.what}, which neither the"
            " scheduler's allocation, kubelet's device-plugin checkpoint nor a DRA claim granted (it was created"
            " while crihook was away)"
        )


@dataclass
class HookHandler:
    """stub.Handler on the lifecycle core `crihook serve` uses: the core runs the hooks, keeps the
    store and runs post hooks; what is NRI's own (adjustments, what the runtime can not apply,
    request deadlines, the check of containers made without the hooks) is here. `evict` (the
    plugin's update_containers, set once the plugin exists) asks the runtime to evict; None: report
    only.

    Containers made without the hooks (while crihook was away, or before it first ran) are judged
    by the gpu hook's decision (hooks.reach, through hooks.base.JudgesGpus) at Synchronize, at the
    CRI catch-up and at StartContainer. Only a verdict naming an ungranted GPU acts: a check that
    can not decide (a checkpoint unreadable, NVML failing, out of time) is tried again later, and
    never counts against the container."""

    lifecycle: Lifecycle
    synchronize_action: str = "evict"  # "evict" | "report"
    cdi_inject: bool = False  # gpu.inject = "cdi": refused on runtimes that drop CDI adjustments
    node_of: Callable[[str], tuple[DeviceNumber, int]] = stat_node
    # node_of's answers, each kept until inotify reports its node made, removed or changed (`_node`)
    nodes: FsMemo = field(default_factory=FsMemo)
    evict: Callable[[Sequence[api.ContainerEviction]], Awaitable[Any]] | None = None
    # the runtime's pods and containers as NRI would show them, listed over CRI: Synchronize's list
    # can miss a creation that raced it (containerd 1.7), which this catches up with
    relist: Callable[[], Awaitable[tuple[list[api.PodSandbox], list[api.Container]]]] | None = None
    request_timeout: float = 2.0
    selinux: bool = field(default_factory=lambda: os.path.exists(SELINUX_ENFORCE))  # the node labels mounts
    runtime: NriRuntime = field(default_factory=lambda: nri_runtime("", ""))
    refused: StartRefused | None = None
    synchronized: asyncio.Event = field(default_factory=asyncio.Event)  # set after the first Synchronize
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep  # between retries
    relist_every: float = RELIST_EVERY
    _relister: asyncio.Future[None] | None = None
    _tasks: set[asyncio.Future[None]] = field(default_factory=set)
    _privileged: set[str] = field(default_factory=set)  # ids of the privileged containers logged
    # containers found reaching ungranted GPUs, with the reason, when evicting: the eviction (CRI
    # StopContainer) does nothing to one created and not yet started, so its start is refused
    _barred: dict[str, str] = field(default_factory=dict)
    # containers judged (clean, or created through the hooks): StartContainer checks the others
    _cleared: set[str] = field(default_factory=set)
    # container id -> what crihook's answer to its CreateContainer left it, until the runtime asks to
    # validate the final adjustment (NRI v0.10+: right after, in the same CreateContainer)
    _answers: dict[str, Answer] = field(default_factory=dict)
    _judge_of: tuple[HookChain, JudgesGpus | None] | None = None
    # evictions not done yet (container id -> the finding), retried until done or the container is gone
    _evicting: dict[str, Ungranted] = field(default_factory=dict)
    # container ids removed since the last CRI listing began: the listing may still show them
    _removed: set[str] = field(default_factory=set)
    _removed_pods: set[str] = field(default_factory=set)
    # container id -> the records of its PreStartContainer hooks, kept until PostStartContainer
    _starting: dict[str, list[HookRecord]] = field(default_factory=dict)
    # PostStartContainer subscribed (a hook runs at a start stage): else a start is recorded at StartContainer
    _post_start: bool = False
    # sandbox id -> the runtime's message of the pod and the view made of it: a pod's every event
    # carries the same message, converted once (at RunPodSandbox, or Synchronize)
    _pod_views: dict[str, tuple[api.PodSandbox, PodInfo]] = field(default_factory=dict)

    # -- registration --------------------------------------------------------------------------

    async def configure(self, request: api.ConfigureRequest) -> int:
        self.runtime = nri_runtime(request.runtime_name, request.runtime_version, request.NRI_version)
        if request.request_timeout > 0:
            self.request_timeout = request.request_timeout / 1000
        why = start_refusal(self.runtime, cdi_inject=self.cdi_inject)
        if why is not None:
            self.refused = StartRefused(why)
            raise RpcError(_code(grpc.StatusCode.FAILED_PRECONDITION), why)
        events = EVENTS
        if self.lifecycle.wants(Stage.PRE_RUN_POD_SANDBOX):
            events |= event_mask(api.RUN_POD_SANDBOX)
        if self.lifecycle.wants(Stage.PRE_UPDATE_CONTAINER_RESOURCES):  # else each update's trip saved
            events |= event_mask(api.UPDATE_CONTAINER)
        # the runtime waits for PostStartContainer within StartContainer: a trip on every pod start
        self._post_start = self.lifecycle.wants(Stage.PRE_START_CONTAINER) or self.lifecycle.wants(
            Stage.POST_START_CONTAINER
        )
        if self._post_start:
            events |= event_mask(api.POST_START_CONTAINER)
        if self.runtime.device_rules:  # NRI v0.10+ knows the event and asks validators
            events |= event_mask(api.VALIDATE_CONTAINER_ADJUSTMENT)
        return events

    async def synchronize(
        self, pods: Sequence[api.PodSandbox], containers: Sequence[api.Container]
    ) -> Sequence[api.ContainerUpdate]:
        """The store made to match the runtime (records of known objects kept, others adopted or
        dropped: a reconnection neither loses nor doubles a pod), then the check of live containers,
        all within one deadline: what is not done by then goes on after the answer. A problem with
        one container, or with the store's file, never fails the Synchronize: the runtime would
        drop the plugin (or, on NRI v0.6, keep it unregistered and silent)."""
        deadline = self._deadline()
        try:
            stats = self.lifecycle.store.reconcile(
                [nri_listed_pod(p) for p in pods], [nri_listed_container(c) for c in containers]
            )
            log.info("store rebuilt", extra={"source": "synchronize", **stats})
        except Exception as e:  # the store's file: memory holds the records, the next write retries
            log.error("store not saved at Synchronize", extra={"error": str(e)})
        listed = {c.id for c in containers}
        self._privileged &= listed
        self._barred = {cid: why for cid, why in self._barred.items() if cid in listed}
        self._cleared &= listed
        self._starting = {cid: r for cid, r in self._starting.items() if cid in listed}
        self._pod_views = {}
        by_id = {p.id: self._pod_view(p) for p in pods}
        for pod in by_id.values():
            self.lifecycle.chain.prepare_pod(pod)
        check = asyncio.ensure_future(self._check(by_id, containers))
        self._keep(check)
        try:
            await asyncio.wait_for(asyncio.shield(check), max(deadline - time.monotonic(), 0.0))
        except TimeoutError:
            log.info("checking containers goes on after Synchronize's answer", extra={"containers": len(containers)})
        except Exception:
            log.exception("checking containers failed")
        if self.relist is not None:
            if self._relister is not None:
                self._relister.cancel()  # one listing loop, from the last Synchronize
            self._relister = asyncio.ensure_future(self._catch_up())
            self._keep(self._relister)
        self.synchronized.set()
        return []

    async def _check(self, pods: Mapping[str, PodInfo], containers: Sequence[api.Container]) -> None:
        """Judge each live container; what is found is acted on at once, each container on its own."""
        live = [
            c
            for c in containers
            if c.pod_sandbox_id in pods
            and c.state in (api.CONTAINER_CREATED, api.CONTAINER_RUNNING, api.CONTAINER_PAUSED)
        ]
        for c in live:
            try:
                await self._judge_listed(pods[c.pod_sandbox_id], c, attempt=0)
            except Exception:  # one container's problem is that container's: the others are judged
                log.exception("checking a container failed", extra={"id": c.id[:13]})
        barred = sum(1 for c in live if c.id in self._barred)
        log.info("containers checked", extra={"containers": len(live), "barred": barred})

    async def _judge_listed(self, pod: PodInfo, c: api.Container, attempt: int) -> None:
        """One container made without the hooks: cleared, found (barred and evicted or reported), or
        undecided (asked again after a back-off, while the container is there)."""
        try:
            verdict = await self._verdict(pod, c, deadline=None)
        except Undecided as e:
            if c.id in self._known_ids():
                delay = min(RETRY_FIRST * 2**attempt, RETRY_MOST)
                log.log(
                    logging.WARNING if attempt == 0 else logging.DEBUG,  # said once, asked until decided
                    "can not tell which GPUs a container may reach; asking again",
                    extra={"pod": pod.ref, "container": c.name, "id": c.id[:13], "why": str(e), "retry_s": delay},
                )
                self._spawn(self._judge_later(pod, c, attempt + 1, delay))
            return
        self._act(pod, c, verdict)

    async def _judge_later(self, pod: PodInfo, c: api.Container, attempt: int, delay: float) -> None:
        await self.sleep(delay)
        if c.id in self._known_ids() and c.id not in self._cleared and c.id not in self._barred:
            await self._judge_listed(pod, c, attempt)

    def _known_ids(self) -> Mapping[str, Any]:
        return self.lifecycle.store.containers

    def _act(self, pod: PodInfo, c: api.Container, verdict: Verdict | None) -> Ungranted | None:
        """What a verdict on a container made without the hooks leads to; None: cleared."""
        if verdict is not None and verdict.privileged:
            self._note_privileged(pod, c.name, c.id)
        if verdict is None or not verdict.ungranted:
            self._cleared.add(c.id)
            return None
        if c.id in self._barred or c.id in self._cleared:
            return None  # found by a check that ran at the same time (Synchronize's and StartContainer's)
        hit = Ungranted(c.id, pod.ref, c.name, verdict.describe())
        log.warning(
            "container reaches an ungranted GPU",
            extra={"pod": hit.pod, "container": hit.container, "id": hit.container_id[:13], "gpus": hit.what},
        )
        if self.synchronize_action != "evict" or self.evict is None:
            NRI_UNGRANTED.inc("reported")
            self._cleared.add(c.id)  # reported once, not at every start
            return hit
        self._barred[c.id] = hit.reason
        if c.state != api.CONTAINER_CREATED:  # a created one is stopped by refusing its start
            self._evicting[c.id] = hit
            NRI_EVICTIONS_PENDING.set(len(self._evicting))
            self._spawn(self._evict(hit))
        return hit

    async def _verdict(self, pod: PodInfo, c: api.Container, deadline: float | None) -> Verdict | None:
        """The gpu hook's verdict on `c` as the runtime holds it, on a worker thread; None when no
        hook judges GPUs or `c` has nothing that could reach one. Raises Undecided (out of time too)."""
        reach = nri_reach(c)
        judge = self._judge()
        if judge is None or not may_reach_gpus(reach):
            return None
        return await self._ask(judge, pod, nri_container_view(c), reach, deadline)

    async def _ask(
        self, judge: JudgesGpus, pod: PodInfo, view: ContainerInfo, reach: Reach, deadline: float | None
    ) -> Verdict:
        work = asyncio.to_thread(judge.verdict, pod, view, reach)
        try:
            if deadline is None:
                return await work
            return await asyncio.wait_for(work, max(deadline - time.monotonic(), 0.0))
        except Undecided:
            raise
        except TimeoutError:
            raise Undecided("no verdict within the runtime's request timeout") from None
        except Exception as e:  # NVML, a file: no verdict is no finding
            raise Undecided(f"{type(e).__name__}: {e}") from None

    def _judge(self) -> JudgesGpus | None:
        """The chain's hook that judges GPUs; found once per chain (a Protocol check is slow)."""
        chain = self.lifecycle.chain
        if self._judge_of is None or self._judge_of[0] is not chain:
            found = next((reg.hook for reg in chain.hooks if isinstance(reg.hook, JudgesGpus)), None)
            self._judge_of = (chain, found)
        return self._judge_of[1]

    async def _evict(self, hit: Ungranted) -> None:
        """Evict until it is done or the container is gone, backing off between tries."""
        attempt = 0
        assert self.evict is not None
        while hit.container_id in self._evicting:
            try:
                await self.evict([api.ContainerEviction(container_id=hit.container_id, reason=hit.reason)])
            except Exception as e:
                NRI_UNGRANTED.inc("evict_failed")
                if hit.container_id not in self._known_ids():
                    break  # removed meanwhile: nothing left to evict
                hit.error, hit.tries = str(e) or type(e).__name__, hit.tries + 1
                self._write_pending()
                delay = min(RETRY_FIRST * 2**attempt, RETRY_MOST)
                log.error(
                    "eviction failed; trying again",
                    extra={"pod": hit.pod, "container": hit.container, "error": str(e), "retry_s": delay},
                )
                attempt += 1
                await self.sleep(delay)
                continue
            log.warning("container evicted", extra={"pod": hit.pod, "container": hit.container, "reason": hit.reason})
            NRI_UNGRANTED.inc("evicted")
            break
        self._evicting.pop(hit.container_id, None)
        NRI_EVICTIONS_PENDING.set(len(self._evicting))
        self._write_pending()

    def pending_evictions(self) -> list[Ungranted]:
        """The evictions still being retried."""
        return list(self._evicting.values())

    def _write_pending(self) -> None:
        """The evictions that failed and are still tried, for `crihook doctor` (EVICTIONS_FILE; no
        file when there are none)."""
        path = self.lifecycle.store.path.parent / EVICTIONS_FILE
        failing = [asdict(h) for h in self._evicting.values() if h.tries]
        try:
            if not failing:
                path.unlink(missing_ok=True)
                return
            temp = path.with_suffix(".tmp")
            temp.write_text(json.dumps(failing, indent=1))
            temp.replace(path)
        except OSError as e:
            log.error("can not write the pending evictions", extra={"path": str(path), "error": str(e)})

    async def _catch_up(self) -> None:
        """A while after a Synchronize, then every `relist_every` seconds (0: once) while connected:
        the store made to match the runtime as CRI lists it (see _relist)."""
        assert self.relist is not None
        await self.sleep(CATCH_UP)
        while True:
            await self._relist(self.relist)
            if self.relist_every <= 0:
                return
            await self.sleep(self.relist_every)

    async def _relist(self, relist: Callable[[], Awaitable[tuple[list[api.PodSandbox], list[api.Container]]]]) -> None:
        """Pods and containers the runtime has that neither Synchronize's list nor an event told
        crihook of are adopted into the store and checked like the others (one removed while the
        listing ran is not brought back); records of ones the runtime does not have, older than
        RECORD_GRACE (a creation that failed after crihook answered, a removal whose event was
        missed), are dropped."""
        self._removed.clear()
        self._removed_pods.clear()
        began = time.time()
        try:
            pods, containers = await relist()
        except Exception as e:  # the next listing or Synchronize finds them
            log.warning("listing the runtime over CRI failed", extra={"error": str(e)})
            return
        store = self.lifecycle.store
        new_pods = [p for p in pods if p.id not in store.pods and p.id not in self._removed_pods]
        new = [c for c in containers if c.id not in store.containers and c.id not in self._removed]
        for p in new_pods:
            store.put_pod(nri_listed_pod(p))
        for c in new:
            store.put_container(nri_listed_container(c))
        listed, listed_pods = {c.id for c in containers}, {p.id for p in pods}
        old = began - RECORD_GRACE
        gone = [cid for cid, r in store.containers.items() if cid not in listed and r.created < old]
        gone_pods = [pid for pid, r in store.pods.items() if pid not in listed_pods and r.created < old]
        for cid in gone:
            store.remove_container(cid)
            self._forget(cid)
        for pid in gone_pods:
            store.remove_pod(pid)
        if new_pods or new or gone or gone_pods:
            log.info(
                "store caught up",
                extra={"pods": len(new_pods), "containers": len(new), "gone_pods": len(gone_pods), "gone": len(gone)},
            )
        if new:
            await self._check({p.id: nri_pod_view(p) for p in pods}, new)

    def _forget(self, cid: str) -> None:
        """A container gone: nothing kept about it."""
        self._privileged.discard(cid)
        self._barred.pop(cid, None)
        self._cleared.discard(cid)
        self._starting.pop(cid, None)
        if self._evicting.pop(cid, None) is not None:
            NRI_EVICTIONS_PENDING.set(len(self._evicting))
            self._write_pending()

    async def shutdown(self) -> None:
        log.info("the runtime is shutting down")

    # -- CreateContainer -----------------------------------------------------------------------

    async def create_container(self, request: api.CreateContainerRequest) -> api.CreateContainerResponse:
        pod, before = self._pod_view(request.pod), nri_container_view(request.container)
        ctx = HookContext(Stage.PRE_CREATE_CONTAINER, pod, before, self._deadline())
        decided = await self._in_time(ctx, self.lifecycle.create_container(pod, before, ctx.deadline))
        after = decided.after.container
        assert after is not None
        rules = nri_rules(request.container)
        every = every_device(rules)
        if every:
            self._note_privileged(pod, before.name, request.container.id)
        try:
            reasons = unapplied(before, after, self.runtime, every_device=every, selinux=self.selinux)
            device_rules = self.runtime.device_rules
            self.nodes.sync()
            node_of = self._node
            adjust = nri_adjustment(before, after, node_of, device_rules=device_rules)
            left, deny = await self._left(
                pod, before, after, rules, adjust, lambda path: node_of(path)[0], ctx.deadline
            )
            if left:
                reasons.append(left)
            if deny:  # NRI v0.10+: the runtime applies deny rules, so the GPU is taken away
                adjust = nri_adjustment(before, after, node_of, device_rules=device_rules, deny_gpus=deny)
            if not reasons:
                make_sources(adjust)
        except OSError as e:
            reasons = [f"a device node or mount source to add can not be had ({e})"]
        if reasons:
            why = (
                f"{self.runtime.ref or 'this runtime'} can not carry out what crihook decided for container"
                f" {before.name} of pod {pod.ref}: {'; '.join(reasons)}. crihook's proxy mode can (docs/nri.md)"
            )
            self.lifecycle.create_failed(pod, after)
            self._refuse(ctx, decided.records, grpc.StatusCode.FAILED_PRECONDITION, why)
        # its id is NRI's, kept from `before`
        self._after_answer(self._created, pod, after, decided.records)
        self._cleared.add(request.container.id)
        if self.runtime.device_rules:
            if len(self._answers) >= ANSWERS_KEPT:  # a creation another plugin failed is never validated
                del self._answers[next(iter(self._answers))]
            own = (*rules, *adjusted_rules(adjust))
            self._answers[request.container.id] = answer(own, after.env(VISIBLE), after.cdi_devices)
        return api.CreateContainerResponse(adjust=adjust)

    def _created(self, pod: PodInfo, container: ContainerInfo, records: list[HookRecord]) -> None:
        """The container recorded, and its pod first when this is the pod's first container crihook
        sees (RunPodSandbox is subscribed only when a hook runs there)."""
        if pod.id not in self.lifecycle.store.pods:
            self.lifecycle.pod_started(pod, [])
        self.lifecycle.container_created(pod, container, records)

    async def validate_adjustment(
        self, request: api.ValidateContainerAdjustmentRequest
    ) -> api.ValidateContainerAdjustmentResponse:
        """The adjustment of every plugin, merged, once more before the runtime applies it (NRI
        v0.10+): a plugin called after crihook (a higher index) must not give the container a GPU
        crihook's answer did not leave it."""
        cid, adjust = request.container.id, request.adjust
        own = self._answers.pop(cid, None)
        original = nri_container_view(request.container)
        visible = next((kv.value for kv in reversed(adjust.env) if kv.key == VISIBLE), original.env(VISIBLE))
        final = answer(
            (*nri_rules(request.container), *adjusted_rules(adjust)),
            visible,
            (*original.cdi_devices, *(d.name for d in adjust.CDI_devices)),
        )
        pod = f"{request.pod.namespace}/{request.pod.name}"
        if own is None:
            why = f"crihook: no answer of crihook's to CreateContainer of container {original.name} of pod {pod}"
        else:
            found = escapes(own, final)
            if not found:
                return api.ValidateContainerAdjustmentResponse()
            why = (
                f"crihook: the final adjustment of container {original.name} of pod {pod} gives it {'; '.join(found)},"
                f" beyond what crihook granted (plugins: {', '.join(f'{p.index}-{p.name}' for p in request.plugins)})"
            )
        log.warning("adjustment refused", extra={"pod": pod, "container": original.name, "reason": why})
        return api.ValidateContainerAdjustmentResponse(reject=True, reason=why)

    async def _left(
        self,
        pod: PodInfo,
        before: ContainerInfo,
        after: ContainerInfo,
        rules: tuple[DeviceRule, ...],
        adjust: api.ContainerAdjustment,
        number_of: Callable[[str], DeviceNumber],
        deadline: float | None,
    ) -> tuple[str, tuple[int, ...]]:
        """What ungranted GPU the container would still reach once adjusted (the runtime's spec with
        what NRI applies: device nodes and CDI devices added, env set, `rules` the spec's followed by
        the adjustment's; nodes it put in stay), in words, empty when none; and the GPU minors to
        deny instead, where the runtime applies deny rules (NRI v0.10+) and no name reaches them. A
        privileged container reaches every GPU by its privilege."""
        judge = self._judge()
        if judge is None:
            return "", ()
        added = {d.container_path for d in after.devices} - {d.container_path for d in before.devices}
        if not may_reach_gpus(self._beyond_hooks(before, after, rules, adjust, added, number_of)):
            return "", ()
        kept = replace(after, devices=(*before.devices, *(d for d in after.devices if d.container_path in added)))
        reach = reach_of(kept, (*rules, *adjusted_rules(adjust)), number_of)
        try:
            verdict = await self._ask(judge, pod, after, reach, deadline)
        except Undecided as e:
            return f"can not tell which GPUs it would reach ({e})", ()
        if not verdict.ungranted:
            return "", ()
        if self.runtime.device_rules and deniable(verdict):
            return "", verdict.ungranted
        return (
            f"it would still reach {verdict.describe()}, which the runtime put in the spec (a CDI device or the"
            " device plugin's) and no NRI adjustment before containerd 2.2 can take away",
            (),
        )

    def _beyond_hooks(
        self,
        before: ContainerInfo,
        after: ContainerInfo,
        rules: tuple[DeviceRule, ...],
        adjust: api.ContainerAdjustment,
        added: set[str],
        number_of: Callable[[str], DeviceNumber],
    ) -> Reach:
        """The part of what the adjusted container reaches that the hook chain did not decide: the
        runtime's nodes, its `rules` and the adjustment's (not the allow rules of the nodes the chain
        added), CDI devices, and NVIDIA_VISIBLE_DEVICES unless a hook set it. When it can name no GPU
        (a container the scheduler placed, a plain one) there is nothing for the verdict to judge,
        and CreateContainer asks nothing."""
        given = {number_of(d.host_path) for d in after.devices if d.container_path in added}
        every = (*rules, *adjusted_rules(adjust, unless=given))
        own = tuple(r for r in every if not (r.allow and (r.kind, r.major, r.minor) in given))
        reach = reach_of(replace(after, devices=before.devices), own, number_of)
        visible = None if after.env(VISIBLE) != before.env(VISIBLE) else reach.visible
        return Reach(reach.nodes, own, reach.cdi_devices, visible)

    # -- the other events: bookkeeping, refusals, post hooks -------------------------------------

    async def state_change(self, event: api.StateChangeEvent) -> None:
        """Views are made only for the events whose hooks see them; the others need the ids alone."""
        kind, cid = event.event, event.container.id
        if kind == api.RUN_POD_SANDBOX:
            await self._pod_started(event.pod)
        elif kind == api.STOP_POD_SANDBOX:
            self.lifecycle.pod_stopped(event.pod.id)
        elif kind == api.REMOVE_POD_SANDBOX:
            self._removed_pods.add(event.pod.id)
            self._pod_views.pop(event.pod.id, None)
            self.lifecycle.pod_removed(event.pod.id)
        elif kind == api.START_CONTAINER and event.HasField("container"):
            await self._starts(event.pod, event.container)
        elif kind == api.POST_START_CONTAINER and event.HasField("container"):
            self._after_answer(self.lifecycle.container_started, cid, self._starting.pop(cid, []))
        elif kind == api.REMOVE_CONTAINER and event.HasField("container"):
            self._removed.add(cid)
            self._forget(cid)
            self.lifecycle.container_removed(cid)

    async def _starts(self, msg_pod: api.PodSandbox, msg: api.Container) -> None:
        """StartContainer: a container found reaching an ungranted GPU does not start; one crihook
        never judged (made while it was away, and not in a Synchronize list yet) is judged now from
        the spec NRI hands over. A check that can not decide in time lets it start and goes on.
        Without PostStartContainer subscribed the start is recorded here, once it is let through."""
        cid = msg.id
        if cid in self._cleared and cid not in self._barred and not self.lifecycle.wants(Stage.PRE_START_CONTAINER):
            self._started(cid, [])  # judged at its CreateContainer and no start hook: nothing to decode
            return
        pod, container = self._pod_view(msg_pod), nri_container_view(msg)
        ctx = HookContext(Stage.PRE_START_CONTAINER, pod, container, self._deadline())
        if cid not in self._cleared and cid not in self._barred:
            try:
                self._act(pod, msg, await self._verdict(pod, msg, ctx.deadline))
            except Undecided as e:
                log.warning(
                    "can not tell which GPUs a starting container may reach; it starts, asking again",
                    extra={"pod": pod.ref, "container": container.name, "id": cid[:13], "why": str(e)},
                )
                self._spawn(self._judge_later(pod, msg, 1, RETRY_FIRST))
        if cid in self._barred:
            self._refuse(ctx, [], grpc.StatusCode.FAILED_PRECONDITION, self._barred[cid])
        records: list[HookRecord] = []
        if self.lifecycle.wants(Stage.PRE_START_CONTAINER):
            records = (await self._in_time(ctx, self.lifecycle.start_container(cid, ctx.deadline))).records
        self._started(cid, records)

    def _started(self, cid: str, records: list[HookRecord]) -> None:
        """The start let through: recorded at PostStartContainer when subscribed, else once the
        answer is written."""
        if self._post_start:
            self._starting[cid] = records
        else:
            self._after_answer(self.lifecycle.container_started, cid, records)

    async def _pod_started(self, msg: api.PodSandbox) -> None:
        """RunPodSandbox: NRI takes no answer but an error, so a hook may refuse the pod, not change
        it. Without such a hook the runtime waits for nothing: the pod is recorded, and the hooks
        prepare for its containers, once the answer is written."""
        if not self.lifecycle.wants(Stage.PRE_RUN_POD_SANDBOX):
            self._after_answer(self._pod_recorded, msg)
            return
        pod = self._pod_view(msg)
        ctx = HookContext(Stage.PRE_RUN_POD_SANDBOX, pod, None, self._deadline())
        decided = await self._in_time(ctx, self.lifecycle.run_pod_sandbox(pod, ctx.deadline))
        if decided.after.pod != pod:
            why = f"crihook: a hook changed pod {pod.ref} at RunPodSandbox, which NRI can not apply; use proxy mode"
            self._refuse(ctx, decided.records, grpc.StatusCode.FAILED_PRECONDITION, why)
        self._after_answer(self.lifecycle.pod_started, pod, decided.records)

    def _pod_recorded(self, msg: api.PodSandbox) -> None:
        self.lifecycle.pod_started(self._pod_view(msg), [])

    async def update_container(self, request: api.UpdateContainerRequest) -> api.UpdateContainerResponse:
        """UpdateContainerResources through the core as in proxy mode; what the hooks change of the
        resources goes back as an update of this container, merged by the runtime into its request."""
        cid = request.container.id
        if not self.lifecycle.wants(Stage.PRE_UPDATE_CONTAINER_RESOURCES):
            return api.UpdateContainerResponse()
        asked = nri_resources_view(request.linux_resources, request.HasField("linux_resources"))
        ctx = HookContext(
            Stage.PRE_UPDATE_CONTAINER_RESOURCES,
            self._pod_view(request.pod),
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

    def _node(self, path: str) -> tuple[DeviceNumber, int]:
        """`node_of(path)`, read once until the node changes: a GPU container's dozen device nodes are
        the same ones creation after creation. Read on the event loop, as /dev never stalls."""
        try:
            found: tuple[DeviceNumber, int] = self.nodes.recall(path)
            return found
        except NotCached:
            return self.nodes.answer(path, lambda: self.node_of(path), inode=True)

    def _pod_view(self, msg: api.PodSandbox) -> PodInfo:
        """The view of the pod `msg` describes: the one made before while the runtime's message is
        the same (hooks never change a view in place), else made now and kept."""
        kept = self._pod_views.get(msg.id)
        if kept is not None and kept[0] == msg:
            return kept[1]
        if len(self._pod_views) >= POD_VIEWS:  # more than a node runs: removals were missed
            self._pod_views.clear()
        copy = api.PodSandbox()
        copy.CopyFrom(msg)  # not `msg` itself, which would keep the whole request it came in alive
        view = nri_pod_view(msg)
        self._pod_views[msg.id] = (copy, view)
        return view

    def _after_answer(self, fn: Callable[..., None], *args: Any) -> None:
        """`fn(*args)` right after the answer being made is written, before any later call of the
        runtime is read: bookkeeping (the store's record, the hooks' per-pod work) the runtime need
        not wait for."""
        asyncio.get_running_loop().call_soon(self._bookkeep, fn, args)

    @staticmethod
    def _bookkeep(fn: Callable[..., None], args: tuple[Any, ...]) -> None:
        """A failure is logged: the call was answered already."""
        try:
            fn(*args)
        except Exception:
            log.exception("bookkeeping after an answer failed", extra={"what": fn.__name__})

    def _deadline(self) -> float:
        return time.monotonic() + max(self.request_timeout - MARGIN, 0.1)

    async def _in_time(self, ctx: HookContext, work: Awaitable[T]) -> T:
        """`work` (the core's stage on `ctx`) answered by the deadline: a hook still working then
        makes a refusal, never a late answer (which the runtime would take as the plugin gone, and
        go on without it). A hook's refusal becomes the runtime's error; the core logged it."""
        assert ctx.deadline is not None
        try:
            async with asyncio.timeout(max(ctx.deadline - time.monotonic(), 0.0)):  # no task made, as wait_for does
                return await work
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

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        self._keep(asyncio.ensure_future(work))

    def _keep(self, task: asyncio.Future[None]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Background work (retries wait for a container to go, or back off) is cancelled; the
        next connection's Synchronize finds what is left."""
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self.nodes.close()
        await self.lifecycle.close()
