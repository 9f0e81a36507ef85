"""The CRI proxy's intercepted calls: each one's protobuf decoded into the hooks' views, handed to the
lifecycle core (node/lifecycle.py), and what the hooks decided encoded back; after the runtime's
answer, what it did reported to the core. What differs from method to method is in one `Handler`
each, in `HANDLERS`; the steps around them are the same for all.

A CreateContainer through the code (docs/architecture.md draws the same path):

    link.py       Link.down_data         HEADERS: :path read, Interceptor.classify claims the stream;
                                         DATA held until END_STREAM, then Link.request_complete
    intercept.py  Interceptor.rewrite    decode; _create_views: the pod from the store, the container
                                         from the request (node/container.py's container_view)
    lifecycle.py  Lifecycle.create_container -> HookChain.run (hooks/chain.py): each hook, its edit
                                         checked and applied to the view the next hook sees
    intercept.py  _write_create          node/container.py's write_container: only what changed
    link.py       Link.forward           the request to containerd; its answer back to kubelet;
                                         its trailers end the call: Interceptor.post
    intercept.py  _record_create         Lifecycle.container_created: the store's record, from the views
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from crihook.hooks.base import ContainerInfo, HookError, PodInfo, Stage
from crihook.hooks.chain import HookChain
from crihook.node.container import container_view, write_container
from crihook.node.lifecycle import Decided, Lifecycle
from crihook.node.pod import pod_view, write_pod
from crihook.node.resources import resources_view
from crihook.node.store import Store
from crihook.node.update import changed_fields, changed_keys
from crihook.proto import runtime_v1_pb2 as cri
from crihook.proxy.orphans import TaskJanitor
from crihook.proxy.stream import Rejected

log = logging.getLogger("crihook.proxy")

# a handler's parts; `Any` is the method's own request or response message
Decide = Callable[[Lifecycle, Any, float | None], Awaitable[Decided]]  # (…, request, deadline)
WriteBack = Callable[[Any, Decided], None]  # the hooks' changes onto the decoded request
Record = Callable[[Lifecycle, "Call", Any, Any], None]  # (…, request as forwarded, response)
Failed = Callable[[Lifecycle, "Call"], None]


def _nothing_to_write(msg: Any, decided: Decided) -> None:
    """StartContainer: the request carries nothing to rewrite; hooks may only refuse it."""


@dataclass(frozen=True, slots=True)
class Handler:
    """What one intercepted method needs: its messages, its pre stage, and its three steps."""

    name: str
    request: type[Message]
    response: type[Message]
    record: Record  # after a successful call
    pre: Stage | None = None
    decide: Decide | None = None  # with `pre`: the views made of the request, the hooks run on them
    write_back: WriteBack = _nothing_to_write
    # refused with FAILED_PRECONDITION, its message may name a task CRI lost track of (orphans.py)
    may_name_orphan: bool = False
    failed: Failed | None = None  # after a failed call


@dataclass(slots=True)
class Call:
    """Per-call state the relay hands back from `rewrite` to `post`."""

    handler: Handler
    modifies: bool
    decided: Decided | None = None
    sent: Message | None = None  # the request as forwarded, decoded (when `rewrite` ran)


class Interceptor:
    """The relay's call handler for the CRI lifecycle methods in HANDLERS."""

    def __init__(self, lifecycle: Lifecycle, janitor: TaskJanitor | None = None) -> None:
        self.lifecycle = lifecycle
        self.janitor = janitor

    @property
    def chain(self) -> HookChain:
        return self.lifecycle.chain

    @property
    def store(self) -> Store:
        return self.lifecycle.store

    def classify(self, path: bytes) -> Call | None:
        handler = HANDLERS.get(path)
        if handler is None:
            return None
        return Call(handler, handler.pre is not None and self.lifecycle.wants(handler.pre))

    async def rewrite(self, call: Call, request: bytes, deadline: float | None = None) -> bytes:
        """The request to forward: kubelet's own bytes when no hook changed the call. Raises
        Rejected. `deadline`: time.monotonic() by which kubelet wants the answer."""
        handler = call.handler
        assert handler.decide is not None
        try:
            msg = handler.request.FromString(request)
        except DecodeError as e:
            raise Rejected(
                grpc.StatusCode.INVALID_ARGUMENT, f"crihook: malformed {handler.name} request: {e}"
            ) from None
        try:
            decided = await handler.decide(self.lifecycle, msg, deadline)
        except HookError as e:
            raise Rejected(e.code, e.reason) from None
        call.decided, call.sent = decided, msg
        if not decided.edited:
            return request
        handler.write_back(msg, decided)
        return msg.SerializeToString()

    def post(
        self, call: Call, request: bytes, response: bytes | None, status: grpc.StatusCode, message: bytes | None
    ) -> None:
        """After the runtime answered: what it did, reported to the lifecycle core."""
        handler = call.handler
        if status is not grpc.StatusCode.OK:
            if handler.failed is not None:
                handler.failed(self.lifecycle, call)
            if status is grpc.StatusCode.FAILED_PRECONDITION and handler.may_name_orphan and self.janitor is not None:
                self.janitor.notice(message)
            return
        try:
            req = call.sent if call.sent is not None else handler.request.FromString(request)
            resp = handler.response.FromString(response or b"")
        except DecodeError as e:
            log.warning("undecodable lifecycle message", extra={"method": handler.name, "error": str(e)})
            return
        handler.record(self.lifecycle, call, req, resp)

    async def close(self) -> None:
        """Let running post hooks finish (each is bounded by its hook timeouts)."""
        await self.lifecycle.close()
        if self.janitor is not None:
            await self.janitor.close()


# -- RunPodSandbox -------------------------------------------------------------------------------


async def _decide_sandbox(core: Lifecycle, msg: cri.RunPodSandboxRequest, deadline: float | None) -> Decided:
    return await core.run_pod_sandbox(pod_view(msg.config, runtime_handler=msg.runtime_handler), deadline)


def _write_sandbox(msg: cri.RunPodSandboxRequest, decided: Decided) -> None:
    write_pod(msg.config, decided.before.pod, decided.after.pod)


def _record_sandbox(
    core: Lifecycle, call: Call, req: cri.RunPodSandboxRequest, resp: cri.RunPodSandboxResponse
) -> None:
    decided = call.decided
    pod = decided.after.pod if decided is not None else pod_view(req.config, runtime_handler=req.runtime_handler)
    core.pod_started(replace(pod, id=resp.pod_sandbox_id), decided.records if decided is not None else [])


# -- CreateContainer -----------------------------------------------------------------------------


async def _decide_create(core: Lifecycle, msg: cri.CreateContainerRequest, deadline: float | None) -> Decided:
    pod, container = _create_views(core, msg)
    return await core.create_container(pod, container, deadline)


def _create_views(core: Lifecycle, msg: cri.CreateContainerRequest) -> tuple[PodInfo, ContainerInfo]:
    """The pod as the store has it (what the hooks made of it at RunPodSandbox), else kubelet's copy
    of its config; the container as kubelet describes it."""
    pod = core.pod(msg.pod_sandbox_id) or pod_view(msg.sandbox_config, pod_id=msg.pod_sandbox_id)
    return pod, container_view(msg.config)


def _write_create(msg: cri.CreateContainerRequest, decided: Decided) -> None:
    assert decided.before.container is not None and decided.after.container is not None
    write_container(msg.config, decided.before.container, decided.after.container)


def _record_create(
    core: Lifecycle, call: Call, req: cri.CreateContainerRequest, resp: cri.CreateContainerResponse
) -> None:
    decided = call.decided
    if decided is not None:  # the views the forwarded request was written from
        pod, container, records = decided.after.pod, decided.after.container, decided.records
    else:
        (pod, container), records = _create_views(core, req), []
    assert container is not None
    core.container_created(pod, replace(container, id=resp.container_id), records)


def _create_failed(core: Lifecycle, call: Call) -> None:
    decided = call.decided
    if decided is not None and decided.after.container is not None:
        core.create_failed(decided.after.pod, decided.after.container)


# -- StartContainer, UpdateContainerResources: an id, the rest from the store --------------------


async def _decide_start(core: Lifecycle, msg: cri.StartContainerRequest, deadline: float | None) -> Decided:
    return await core.start_container(msg.container_id, deadline)


def _record_start(core: Lifecycle, call: Call, req: cri.StartContainerRequest, resp: Any) -> None:
    core.container_started(req.container_id, call.decided.records if call.decided is not None else [])


async def _decide_update(core: Lifecycle, msg: cri.UpdateContainerResourcesRequest, deadline: float | None) -> Decided:
    asked = resources_view(msg.linux, msg.HasField("linux"))
    return await core.update_container(msg.container_id, asked, msg.annotations, deadline)


def _write_update(msg: cri.UpdateContainerResourcesRequest, decided: Decided) -> None:
    """Only what kubelet asked plus what the hooks changed goes on (the runtime merges it in)."""
    before, after = decided.before.container, decided.after.container
    assert before is not None and after is not None
    msg.annotations.update(changed_keys(before.annotations, after.annotations))
    unified = changed_keys(
        before.resources.unified if before.resources else {}, after.resources.unified if after.resources else {}
    )
    for name, value in changed_fields(before.resources, after.resources).items():
        setattr(msg.linux, name, value)
    if unified:
        msg.linux.unified.update(unified)


def _record_update(core: Lifecycle, call: Call, req: cri.UpdateContainerResourcesRequest, resp: Any) -> None:
    # `req` is what reached the runtime
    asked = resources_view(req.linux, req.HasField("linux"))
    core.container_updated(req.container_id, asked, call.decided.records if call.decided is not None else [])


# -- Stop and Remove: the store's state, and post hooks ------------------------------------------


def _record_stop(core: Lifecycle, call: Call, req: cri.StopContainerRequest, resp: Any) -> None:
    core.container_stopped(req.container_id)


def _record_remove(core: Lifecycle, call: Call, req: cri.RemoveContainerRequest, resp: Any) -> None:
    core.container_removed(req.container_id)


def _record_stop_sandbox(core: Lifecycle, call: Call, req: cri.StopPodSandboxRequest, resp: Any) -> None:
    core.pod_stopped(req.pod_sandbox_id)


def _record_remove_sandbox(core: Lifecycle, call: Call, req: cri.RemovePodSandboxRequest, resp: Any) -> None:
    core.pod_removed(req.pod_sandbox_id)


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
            Stage.PRE_RUN_POD_SANDBOX,
            _decide_sandbox,
            _write_sandbox,
        ),
        Handler(
            "CreateContainer",
            cri.CreateContainerRequest,
            cri.CreateContainerResponse,
            _record_create,
            Stage.PRE_CREATE_CONTAINER,
            _decide_create,
            _write_create,
            failed=_create_failed,
        ),
        Handler(
            "StartContainer",
            cri.StartContainerRequest,
            cri.StartContainerResponse,
            _record_start,
            Stage.PRE_START_CONTAINER,
            _decide_start,
        ),
        Handler(
            "UpdateContainerResources",
            cri.UpdateContainerResourcesRequest,
            cri.UpdateContainerResourcesResponse,
            _record_update,
            Stage.PRE_UPDATE_CONTAINER_RESOURCES,
            _decide_update,
            _write_update,
        ),
        Handler("StopContainer", cri.StopContainerRequest, cri.StopContainerResponse, _record_stop),
        Handler("StopPodSandbox", cri.StopPodSandboxRequest, cri.StopPodSandboxResponse, _record_stop_sandbox),
        Handler(
            "RemoveContainer",
            cri.RemoveContainerRequest,
            cri.RemoveContainerResponse,
            _record_remove,
            may_name_orphan=True,
        ),
        Handler(
            "RemovePodSandbox",
            cri.RemovePodSandboxRequest,
            cri.RemovePodSandboxResponse,
            _record_remove_sandbox,
            may_name_orphan=True,
        ),
    )
}
