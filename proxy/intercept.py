"""One intercepted CRI call, top to bottom: decode -> the hooks' view -> the chain -> write back ->
(the relay forwards) -> record. What differs from method to method is in one `Handler` each, in
`HANDLERS`; the orchestration below is the same for all of them.

A CreateContainer through the code (docs/proxy.md opens with the same path):

    relay.py      Link.down_data         HEADERS: HeaderBlocks.feed reads :path, Interceptor.classify
                                         claims the stream; DATA is held until END_STREAM, and once
                                         the frames read with it are queued, Link.request_complete
    intercept.py  Interceptor.pre        decode; _create_context builds the view (pod from the store)
    chain.py      HookChain.run_now      each hook's handle_cached -> _settle (allowlist, apply_edit);
                                         a hook that must wait: the rest in a task (HookChain._run)
    intercept.py  Interceptor._written   _write_create: container.write_container, only what changed
    relay.py      Link.forward           RuntimeWindow.pump: the rewritten request to containerd
                  Link.up_data           containerd's trailers -> Link.stream_done
    intercept.py  Interceptor.post       _record_create: the store's ContainerRecord, from the views

Before the view is built, CreateContainer tries its express lane (`_express_create`, docs/proxy.md):
hooks that answer partial views, with edits that only add, merged into the request without views;
anything else takes the path above.

The relay calls `pre` and `post` with the forwarding in between. When every hook answers from what it
has (the gpu hook from its file-system memo), `pre` returns the request to forward at once and the call
costs no task; only a hook that must wait (a read on a worker thread, a hook server) makes one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from crihook.hooks.base import ContainerInfo, Edit, HookContext, PodInfo, Stage, log_fields
from crihook.hooks.chain import HookChain, HookRecord, Outcome
from crihook.node.container import (
    Additions,
    brings_devices,
    container_info,
    container_record,
    container_view,
    kept_of,
    unknown_container,
    write_container,
)
from crihook.node.pod import pod_info, pod_record, pod_view, unknown_pod, write_pod
from crihook.node.records import ContainerRecord, PodRecord
from crihook.node.resources import resources_from_record, resources_record, resources_view
from crihook.node.store import Store
from crihook.proto import runtime_v1_pb2 as cri
from crihook.proxy.orphans import TaskJanitor
from crihook.proxy.relay import Rejected
from crihook.proxy.update import apply_update, changed_fields, changed_keys

log = logging.getLogger("crihook.proxy")

# a handler's parts; `Any` is the method's own request or response message
Views = tuple[PodInfo, ContainerInfo | None]
ContextBuilder = Callable[[Store, Any], Views]  # request -> the hooks' view of the call
WriteBack = Callable[[Any, HookContext, HookContext], None]  # (request, view before, view after)
Recorder = Callable[[Store, "Call", Any, Any], Views | None]  # (…, request, response) -> post hooks' view
# (…, request, deadline) -> what the hooks said, their edits written on the request; None: the full lane
ExpressLane = Callable[["Interceptor", Any, float | None], Outcome | None]
POD_VIEWS = 512  # pods whose express-lane view is kept, more than a node runs (cleared when full)


def _nothing_to_write(msg: Any, before: HookContext, after: HookContext) -> None:
    """StartContainer: the request carries nothing to rewrite; hooks may only refuse it."""


@dataclass(frozen=True, slots=True)
class Handler:
    """What one intercepted method needs: its messages, its stages, and its three steps."""

    name: str
    request: type[Message]
    response: type[Message]
    record: Recorder  # after a successful call: the store's bookkeeping
    pre: Stage | None = None
    context: ContextBuilder | None = None  # with `pre`
    write_back: WriteBack = _nothing_to_write
    post: Stage | None = None  # the recorder's view goes to post hooks
    # the recorder reads the hooks' final views (Call.ctx) instead of decoding the request again
    records_from_views: bool = False
    # refused with FAILED_PRECONDITION, its message may name a task CRI lost track of (orphans.py)
    may_name_orphan: bool = False
    # once recorded, the hooks may get ready for the pod's containers (HookChain.prepare_pod)
    prepares_pod: bool = False
    # tried before the views are built: hooks that answer partial views, edits that only add
    express: ExpressLane | None = None


@dataclass(slots=True)
class Call:
    """Per-call state the relay hands back from pre to post."""

    handler: Handler
    modifies: bool
    records: list[HookRecord] = field(default_factory=list)
    # what the hooks left (the views the forwarded request was written from); on the express lane
    # the partial view the hooks saw, with `sent`
    ctx: HookContext | None = None
    # the request as forwarded, decoded: the express lane's (post reads it instead of decoding again)
    sent: Message | None = None


# -- the orchestration ---------------------------------------------------------------------------


class Interceptor:
    """The relay's call handler for the CRI lifecycle methods in HANDLERS."""

    def __init__(self, chain: HookChain, store: Store, janitor: TaskJanitor | None = None) -> None:
        self.chain = chain
        self.store = store
        self.janitor = janitor
        self._tasks: set[asyncio.Task[None]] = set()
        # sandbox id -> its store record and the view made of it, for the express lane
        self._pod_views: dict[str, tuple[PodRecord, PodInfo]] = {}
        self.additions = Additions()  # the express lane's edits, each encoded once

    def classify(self, path: bytes) -> Call | None:
        handler = HANDLERS.get(path)
        if handler is None:
            return None
        return Call(handler, handler.pre is not None and self.chain.wants(handler.pre))

    def pre(self, call: Call, request: bytes, deadline: float | None = None) -> bytes | Awaitable[bytes]:
        """The request to forward, at once when no hook has to wait (then the relay needs no task),
        or an awaitable of it. Raises Rejected. `deadline`: time.monotonic() by which kubelet wants
        the answer."""
        handler = call.handler
        assert handler.pre is not None and handler.context is not None
        # 1. decode
        try:
            msg = handler.request.FromString(request)
        except DecodeError as e:
            raise Rejected(
                grpc.StatusCode.INVALID_ARGUMENT, f"crihook: malformed {handler.name} request: {e}"
            ) from None
        # 2. the express lane (CreateContainer): no views, the hooks' additions written as they are
        if handler.express is not None:
            express = handler.express(self, msg, deadline)
            if express is not None:
                call.records, call.ctx, call.sent = express.records, express.ctx, msg
                return msg.SerializeToString() if any(r.detail for r in express.records) else request
        # 3. the hooks' view of the call
        pod, container = handler.context(self.store, msg)
        ctx = HookContext(handler.pre, pod, container, deadline)
        # 4. the hooks, in order
        outcome = self.chain.run_now(ctx)
        if isinstance(outcome, Outcome):
            return self._written(call, request, msg, ctx, outcome)
        return self._written_later(call, request, msg, ctx, outcome)

    async def rewrite(self, call: Call, request: bytes, deadline: float | None = None) -> bytes:
        """`pre`, awaited (for callers other than the relay)."""
        result = self.pre(call, request, deadline)
        return result if isinstance(result, bytes) else await result

    async def _written_later(
        self, call: Call, request: bytes, msg: Message, ctx: HookContext, pending: Awaitable[Outcome]
    ) -> bytes:
        return self._written(call, request, msg, ctx, await pending)

    def _written(self, call: Call, request: bytes, msg: Message, ctx: HookContext, outcome: Outcome) -> bytes:
        """5. What the hooks changed, written back (the relay forwards it); a refusal raises Rejected."""
        handler = call.handler
        call.records = outcome.records
        call.ctx = outcome.ctx
        if outcome.error is not None:
            log.warning(
                f"{handler.name} refused",
                extra={**outcome.ctx.log_fields(), "hooks": _summary(outcome.records), "reason": outcome.error.reason},
            )
            raise Rejected(outcome.error.code, outcome.error.reason)
        if outcome.ctx is ctx:
            return request  # no hook edited the call: forward kubelet's own bytes
        handler.write_back(msg, ctx, outcome.ctx)
        return msg.SerializeToString()

    def pod_view(self, pod_id: str) -> PodInfo | None:
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

    def post(
        self, call: Call, request: bytes, response: bytes | None, status: grpc.StatusCode, message: bytes | None
    ) -> None:
        """6. After the runtime answered: bookkeeping now, in call order; post hooks in the
        background (they never change or delay what kubelet sees)."""
        handler = call.handler
        if call.sent is not None and call.ctx is not None:  # the express lane counts its hooks now
            self.chain.count(Outcome(call.ctx, call.records))
        if status is not grpc.StatusCode.OK:
            if status is grpc.StatusCode.FAILED_PRECONDITION and handler.may_name_orphan and self.janitor is not None:
                self.janitor.notice(message)
            return
        try:
            if call.sent is not None:
                req: Any = call.sent
            else:
                reuse = handler.records_from_views and call.ctx is not None
                req = None if reuse else handler.request.FromString(request)
            resp = handler.response.FromString(response or b"")
        except DecodeError as e:
            log.warning("undecodable lifecycle message", extra={"method": handler.name, "error": str(e)})
            return
        views = handler.record(self.store, call, req, resp)
        if views is None:
            return
        if handler.prepares_pod:
            self.pod_view(views[0].id)  # made now, off the CreateContainers' path
            self.chain.prepare_pod(views[0])
        if handler.post is None or not self.chain.wants(handler.post):
            return
        task = asyncio.get_running_loop().create_task(self._post_hooks(HookContext(handler.post, *views)))
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
        if self.janitor is not None:
            await self.janitor.close()


# -- RunPodSandbox -------------------------------------------------------------------------------


def _sandbox_context(store: Store, msg: cri.RunPodSandboxRequest) -> Views:
    return pod_view(msg.config, runtime_handler=msg.runtime_handler), None


def _write_sandbox(msg: cri.RunPodSandboxRequest, before: HookContext, after: HookContext) -> None:
    write_pod(msg.config, before.pod, after.pod)


def _record_sandbox(store: Store, call: Call, req: cri.RunPodSandboxRequest, resp: cri.RunPodSandboxResponse) -> Views:
    pod = pod_view(req.config, pod_id=resp.pod_sandbox_id, runtime_handler=req.runtime_handler)
    store.put_pod(pod_record(pod, [r.as_dict() for r in call.records]))
    _log_event("pod sandbox started", pod, None, call.records)
    return pod, None


# -- CreateContainer -----------------------------------------------------------------------------


def _create_context(store: Store, msg: cri.CreateContainerRequest) -> Views:
    # kubelet sends its own copy of the sandbox config; what the hooks made of the pod at
    # RunPodSandbox (labels, annotations, cgroup parent) is in the store
    pod = pod_view(msg.sandbox_config, pod_id=msg.pod_sandbox_id, stored=store.pods.get(msg.pod_sandbox_id))
    return pod, container_view(msg.config)


def _express_create(icpt: Interceptor, msg: cri.CreateContainerRequest, deadline: float | None) -> Outcome | None:
    """For a container that brings no devices of its own, of a pod the store saw start: the pod from
    the store's record, the container by its name; the additions written only when none replaces
    what the container has (container.Additions)."""
    cfg = msg.config
    pod = icpt.pod_view(msg.pod_sandbox_id)
    if pod is None or brings_devices(cfg):
        return None
    meta = cfg.metadata
    container = ContainerInfo(meta.name, meta.attempt)
    outcome = icpt.chain.run_express(HookContext(Stage.PRE_CREATE_CONTAINER, pod, container, deadline, partial=True))
    if outcome is None:
        return None
    edits = [r.detail for r in outcome.records if isinstance(r.detail, Edit)]
    return outcome if not edits or icpt.additions.write(cfg, edits) else None


def _write_create(msg: cri.CreateContainerRequest, before: HookContext, after: HookContext) -> None:
    assert before.container is not None and after.container is not None
    write_container(msg.config, before.container, after.container)


def _record_create(
    store: Store, call: Call, req: cri.CreateContainerRequest | None, resp: cri.CreateContainerResponse
) -> None:
    if req is None:  # decoded once, in pre: the hooks' final views are what was forwarded
        assert call.ctx is not None and call.ctx.container is not None
        pod, c = call.ctx.pod, replace(call.ctx.container, id=resp.container_id)
        kept = None
    else:  # the express lane's request as sent, with the views its hooks saw, or one decoded again
        pod = call.ctx.pod if call.ctx is not None else pod_view(req.sandbox_config, pod_id=req.pod_sandbox_id)
        seen = call.ctx.container if call.ctx is not None else None
        c = replace(seen, id=resp.container_id) if seen else container_view(req.config, resp.container_id)
        kept = kept_of(req.config)
    store.put_container(container_record(pod.id, c, [r.as_dict() for r in call.records], kept))
    _log_event("container created", pod, c, call.records)


# -- StartContainer, UpdateContainerResources: an id, the rest from the store --------------------


def _stored_context(store: Store, msg: cri.StartContainerRequest | cri.UpdateContainerResourcesRequest) -> Views:
    rec = store.containers.get(msg.container_id)
    pod_rec = store.pods.get(rec.pod_id) if rec is not None else None
    if rec is None or pod_rec is None:
        # Created before crihook knew it, and not reconciled: hooks still see the id.
        return unknown_pod(), unknown_container(msg.container_id)
    return pod_info(pod_rec), container_info(rec)


def _update_context(store: Store, msg: cri.UpdateContainerResourcesRequest) -> Views:
    """The container as it will be once the update is in: what it was created with (envs,
    annotations) and its resources with the update applied, the way the runtime applies it."""
    pod, container = _stored_context(store, msg)
    assert container is not None
    asked = resources_view(msg.linux, msg.HasField("linux"))
    container = replace(
        container,
        annotations={**container.annotations, **msg.annotations},
        resources=apply_update(container.resources, asked),
    )
    return pod, container


def _write_update(msg: cri.UpdateContainerResourcesRequest, before_ctx: HookContext, after_ctx: HookContext) -> None:
    """Only what kubelet asked plus what the hooks changed goes on (the runtime merges it in)."""
    before, after = before_ctx.container, after_ctx.container
    assert before is not None and after is not None
    msg.annotations.update(changed_keys(before.annotations, after.annotations))
    unified = changed_keys(
        before.resources.unified if before.resources else {}, after.resources.unified if after.resources else {}
    )
    for name, value in changed_fields(before.resources, after.resources).items():
        setattr(msg.linux, name, value)
    if unified:
        msg.linux.unified.update(unified)


def _record_start(store: Store, call: Call, req: cri.StartContainerRequest, resp: Any) -> Views | None:
    store.add_hook_records(req.container_id, [r.as_dict() for r in call.records])
    return _container_views(store, store.set_container_state(req.container_id, "running"))


def _record_update(store: Store, call: Call, req: cri.UpdateContainerResourcesRequest, resp: Any) -> None:
    cid = req.container_id
    store.add_hook_records(cid, [r.as_dict() for r in call.records])
    # `req` is what reached the runtime; it merged it into the container, so does the store
    crec = store.containers.get(cid)
    if crec is not None and req.HasField("linux"):
        merged = apply_update(resources_from_record(crec.resources), resources_view(req.linux, True))
        store.set_container_resources(cid, resources_record(merged))


# -- Stop and Remove: the store's state, and the view post hooks get -----------------------------


def _record_stop(store: Store, call: Call, req: cri.StopContainerRequest, resp: Any) -> Views | None:
    return _container_views(store, store.set_container_state(req.container_id, "exited"))


def _record_remove(store: Store, call: Call, req: cri.RemoveContainerRequest, resp: Any) -> Views | None:
    return _container_views(store, store.remove_container(req.container_id))


def _record_stop_sandbox(store: Store, call: Call, req: cri.StopPodSandboxRequest, resp: Any) -> Views | None:
    rec = store.set_pod_state(req.pod_sandbox_id, "notready")
    return None if rec is None else (pod_info(rec), None)


def _record_remove_sandbox(store: Store, call: Call, req: cri.RemovePodSandboxRequest, resp: Any) -> Views | None:
    rec = store.remove_pod(req.pod_sandbox_id)
    return None if rec is None else (pod_info(rec), None)


def _container_views(store: Store, crec: ContainerRecord | None) -> Views | None:
    if crec is None:
        return None
    prec = store.pods.get(crec.pod_id)
    pod = pod_info(prec) if prec is not None else unknown_pod(crec.pod_id)
    return pod, container_info(crec)


# -- the table -----------------------------------------------------------------------------------

_SERVICE = "/runtime.v1.RuntimeService/"
HANDLERS: dict[bytes, Handler] = {
    (_SERVICE + h.name).encode(): h
    for h in (
        Handler(
            "RunPodSandbox",
            cri.RunPodSandboxRequest,
            cri.RunPodSandboxResponse,
            _record_sandbox,
            pre=Stage.PRE_RUN_POD_SANDBOX,
            context=_sandbox_context,
            write_back=_write_sandbox,
            prepares_pod=True,
        ),
        Handler(
            "CreateContainer",
            cri.CreateContainerRequest,
            cri.CreateContainerResponse,
            _record_create,
            pre=Stage.PRE_CREATE_CONTAINER,
            context=_create_context,
            write_back=_write_create,
            records_from_views=True,
            express=_express_create,
        ),
        Handler(
            "StartContainer",
            cri.StartContainerRequest,
            cri.StartContainerResponse,
            _record_start,
            pre=Stage.PRE_START_CONTAINER,
            context=_stored_context,
            post=Stage.POST_START_CONTAINER,
        ),
        Handler(
            "UpdateContainerResources",
            cri.UpdateContainerResourcesRequest,
            cri.UpdateContainerResourcesResponse,
            _record_update,
            pre=Stage.PRE_UPDATE_CONTAINER_RESOURCES,
            context=_update_context,
            write_back=_write_update,
        ),
        Handler(
            "StopContainer",
            cri.StopContainerRequest,
            cri.StopContainerResponse,
            _record_stop,
            post=Stage.POST_STOP_CONTAINER,
        ),
        Handler(
            "StopPodSandbox",
            cri.StopPodSandboxRequest,
            cri.StopPodSandboxResponse,
            _record_stop_sandbox,
            post=Stage.POST_STOP_POD_SANDBOX,
        ),
        Handler(
            "RemoveContainer",
            cri.RemoveContainerRequest,
            cri.RemoveContainerResponse,
            _record_remove,
            post=Stage.POST_REMOVE_CONTAINER,
            may_name_orphan=True,
        ),
        Handler(
            "RemovePodSandbox",
            cri.RemovePodSandboxRequest,
            cri.RemovePodSandboxResponse,
            _record_remove_sandbox,
            post=Stage.POST_REMOVE_POD_SANDBOX,
            may_name_orphan=True,
        ),
    )
}


# -- logs ----------------------------------------------------------------------------------------


def _summary(records: Iterable[HookRecord]) -> str:
    return ",".join(f"{r.hook}:{r.result}" for r in records)


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
