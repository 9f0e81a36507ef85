"""The CRI side of interception: which methods crihook decodes, how a request becomes the hooks'
view, and how the hooks' result goes back into the request.

Only fields a hook changed are written back; every message a hook left alone is reused as decoded,
so unknown fields (a newer kubelet's) reach containerd intact. A request no hook changed is
forwarded as the very bytes kubelet sent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from crihook.base.spec import Device, Mount
from crihook.hooks.base import ContainerInfo, HookContext, LinuxResources, PodInfo, Stage
from crihook.hooks.chain import HookChain, HookRecord
from crihook.proto import runtime_v1_pb2 as cri
from crihook.proxy.orphans import TaskJanitor
from crihook.proxy.relay import Rejected
from crihook.proxy.store import ContainerRecord, PodRecord, Store
from crihook.proxy.update import apply_update, changed_fields, changed_keys

log = logging.getLogger("crihook.proxy")

REMOVALS = frozenset({"RemoveContainer", "RemovePodSandbox"})  # refused ones may name an orphan task

# the scalar fields of runtime.v1.LinuxContainerResources that hooks see (same names as the proto's)
_RESOURCE_FIELDS = tuple(f.name for f in fields(LinuxResources) if f.name != "unified")


@dataclass(frozen=True, slots=True)
class Method:
    name: str
    request: type
    response: type
    pre: Stage | None = None
    post: Stage | None = None


_SERVICE = "/runtime.v1.RuntimeService/"
METHODS: dict[bytes, Method] = {
    (_SERVICE + m.name).encode(): m
    for m in (
        Method("RunPodSandbox", cri.RunPodSandboxRequest, cri.RunPodSandboxResponse, pre=Stage.PRE_RUN_POD_SANDBOX),
        Method(
            "CreateContainer", cri.CreateContainerRequest, cri.CreateContainerResponse, pre=Stage.PRE_CREATE_CONTAINER
        ),
        Method(
            "StartContainer",
            cri.StartContainerRequest,
            cri.StartContainerResponse,
            pre=Stage.PRE_START_CONTAINER,
            post=Stage.POST_START_CONTAINER,
        ),
        Method(
            "UpdateContainerResources",
            cri.UpdateContainerResourcesRequest,
            cri.UpdateContainerResourcesResponse,
            pre=Stage.PRE_UPDATE_CONTAINER_RESOURCES,
        ),
        Method("StopContainer", cri.StopContainerRequest, cri.StopContainerResponse, post=Stage.POST_STOP_CONTAINER),
        Method(
            "StopPodSandbox", cri.StopPodSandboxRequest, cri.StopPodSandboxResponse, post=Stage.POST_STOP_POD_SANDBOX
        ),
        Method(
            "RemoveContainer", cri.RemoveContainerRequest, cri.RemoveContainerResponse, post=Stage.POST_REMOVE_CONTAINER
        ),
        Method(
            "RemovePodSandbox",
            cri.RemovePodSandboxRequest,
            cri.RemovePodSandboxResponse,
            post=Stage.POST_REMOVE_POD_SANDBOX,
        ),
    )
}


@dataclass(slots=True)
class Call:
    """Per-call state the relay hands back from pre to post."""

    method: Method
    modifies: bool
    records: list[HookRecord] = field(default_factory=list)
    pod: PodInfo | None = None
    # what the hooks left (the views the forwarded request was written from): post() records a
    # CreateContainer from it instead of decoding the request a second time
    ctx: HookContext | None = None


# -- protobuf -> views ---------------------------------------------------------------------------


def _text(b: bytes) -> str:
    return b.decode("utf-8", "surrogateescape")


def _raw(s: str) -> bytes:
    return s.encode("utf-8", "surrogateescape")


def resources_view(msg: Any, present: bool) -> LinuxResources | None:
    if not present:
        return None
    return LinuxResources(
        **{f: getattr(msg, f) for f in _RESOURCE_FIELDS},
        unified=dict(msg.unified),
    )


def pod_view(cfg: Any, pod_id: str = "", runtime_handler: str = "") -> PodInfo:
    linux = cfg.linux
    return PodInfo(
        name=cfg.metadata.name,
        namespace=cfg.metadata.namespace,
        uid=cfg.metadata.uid,
        attempt=cfg.metadata.attempt,
        id=pod_id,
        labels=dict(cfg.labels),
        annotations=dict(cfg.annotations),
        cgroup_parent=linux.cgroup_parent,
        runtime_handler=runtime_handler,
        resources=resources_view(linux.resources, linux.HasField("resources")),
        overhead=resources_view(linux.overhead, linux.HasField("overhead")),
    )


def _mount_view(m: Any) -> Mount:
    return Mount(m.container_path, m.host_path, m.readonly, m.selinux_relabel, m.propagation)


def _device_view(d: Any) -> Device:
    return Device(d.container_path, d.host_path, d.permissions)


def container_view(cfg: Any, container_id: str = "") -> ContainerInfo:
    return ContainerInfo(
        name=cfg.metadata.name,
        attempt=cfg.metadata.attempt,
        id=container_id,
        image=cfg.image.image,
        labels=dict(cfg.labels),
        annotations=dict(cfg.annotations),
        envs=tuple((_text(kv.key), _text(kv.value)) for kv in cfg.envs),
        mounts=tuple(_mount_view(m) for m in cfg.mounts),
        devices=tuple(_device_view(d) for d in cfg.devices),
        cdi_devices=tuple(c.name for c in cfg.CDI_devices),
        resources=resources_view(cfg.linux.resources, cfg.linux.HasField("resources")),
    )


def resources_record(res: LinuxResources | None) -> dict[str, Any]:
    """Resources as the store keeps them: plain JSON, {} for none."""
    if res is None:
        return {}
    return {**{f: getattr(res, f) for f in _RESOURCE_FIELDS}, "unified": dict(res.unified)}


def resources_from_record(raw: dict[str, Any]) -> LinuxResources | None:
    """The stored resources, or None when absent or not what crihook writes (a hand-edited store)."""
    if not raw:
        return None
    try:
        res = LinuxResources(**{**raw, "unified": dict(raw.get("unified") or {})})
    except (TypeError, ValueError):
        return None
    defaults = LinuxResources()
    if any(type(getattr(res, f)) is not type(getattr(defaults, f)) for f in _RESOURCE_FIELDS):
        return None
    return res


def pod_from_record(rec: PodRecord) -> PodInfo:
    return PodInfo(
        name=rec.name,
        namespace=rec.namespace,
        uid=rec.uid,
        attempt=rec.attempt,
        id=rec.id,
        labels=rec.labels,
        annotations=rec.annotations,
        cgroup_parent=rec.cgroup_parent,
        runtime_handler=rec.runtime_handler,
        resources=resources_from_record(rec.resources),
        overhead=resources_from_record(rec.overhead),
    )


def container_from_record(rec: ContainerRecord) -> ContainerInfo:
    return ContainerInfo(
        name=rec.name,
        attempt=rec.attempt,
        id=rec.id,
        labels=rec.labels,
        annotations=rec.annotations,
        envs=tuple(rec.envs.items()),
        resources=resources_from_record(rec.resources),
    )


# -- views -> protobuf ---------------------------------------------------------------------------


def _rebuild(repeated: Any, before: Sequence[Any], after: Sequence[Any], make: Callable[[Any], Any]) -> None:
    """Set a repeated message field to `after`, reusing the decoded message of every item that did
    not change so its unknown fields survive."""
    if tuple(before) == tuple(after):
        return
    originals: dict[Any, deque[Any]] = defaultdict(deque)
    for view, msg in zip(before, repeated, strict=True):
        originals[view].append(msg)
    msgs = []
    for view in after:
        kept = originals.get(view)
        msgs.append(kept.popleft() if kept else make(view))
    copies = [type(m)() for m in msgs]
    for copy, msg in zip(copies, msgs, strict=True):
        copy.CopyFrom(msg)
    del repeated[:]
    repeated.extend(copies)


def _set_map(target: Any, before: dict[str, str] | Any, after: dict[str, str] | Any) -> None:
    if before == after:
        return
    for k in set(before) - set(after):
        del target[k]
    for k, v in after.items():
        if before.get(k) != v:
            target[k] = v


def write_resources(msg: Any, before: LinuxResources | None, after: LinuxResources | None) -> None:
    if after is None or before == after:
        return
    base = before or LinuxResources()
    for f in _RESOURCE_FIELDS:
        value = getattr(after, f)
        if getattr(base, f) != value:
            setattr(msg, f, value)
    _set_map(msg.unified, dict(base.unified), dict(after.unified))


def write_container(cfg: Any, before: ContainerInfo, after: ContainerInfo) -> None:
    _rebuild(cfg.envs, before.envs, after.envs, lambda kv: cri.KeyValue(key=_raw(kv[0]), value=_raw(kv[1])))
    _rebuild(
        cfg.mounts,
        before.mounts,
        after.mounts,
        lambda m: cri.Mount(
            container_path=m.container_path,
            host_path=m.host_path,
            readonly=m.readonly,
            selinux_relabel=m.selinux_relabel,
            propagation=m.propagation,
        ),
    )
    _rebuild(
        cfg.devices,
        before.devices,
        after.devices,
        lambda d: cri.Device(container_path=d.container_path, host_path=d.host_path, permissions=d.permissions),
    )
    _rebuild(cfg.CDI_devices, before.cdi_devices, after.cdi_devices, lambda n: cri.CDIDevice(name=n))
    _set_map(cfg.annotations, before.annotations, after.annotations)
    write_resources(cfg.linux.resources, before.resources, after.resources)


def write_pod(cfg: Any, before: PodInfo, after: PodInfo) -> None:
    _set_map(cfg.labels, before.labels, after.labels)
    _set_map(cfg.annotations, before.annotations, after.annotations)
    if after.cgroup_parent != before.cgroup_parent:
        cfg.linux.cgroup_parent = after.cgroup_parent
    write_resources(cfg.linux.resources, before.resources, after.resources)


# -- the interceptor -----------------------------------------------------------------------------


def _summary(records: Iterable[HookRecord]) -> str:
    return ",".join(f"{r.hook}:{r.result}" for r in records)


class Interceptor:
    def __init__(self, chain: HookChain, store: Store, janitor: TaskJanitor | None = None) -> None:
        self.chain = chain
        self.store = store
        self.janitor = janitor
        self._tasks: set[asyncio.Task[None]] = set()

    def classify(self, path: bytes) -> Call | None:
        method = METHODS.get(path)
        if method is None:
            return None
        return Call(method, method.pre is not None and self.chain.wants(method.pre))

    # pre ----------------------------------------------------------------------------------------

    async def pre(self, call: Call, request: bytes, deadline: float | None = None) -> bytes:
        """The request to forward. `deadline`: time.monotonic() by which kubelet wants the answer."""
        method = call.method
        try:
            msg = method.request.FromString(request)
        except DecodeError as e:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"crihook: malformed {method.name} request: {e}") from None
        ctx, write = self._context(method, msg, deadline)
        outcome = await self.chain.run(ctx)
        call.records = outcome.records
        call.pod = outcome.ctx.pod
        call.ctx = outcome.ctx
        subject = _log_fields(outcome.ctx)
        if outcome.error is not None:
            log.warning(
                f"{method.name} refused",
                extra={**subject, "hooks": _summary(outcome.records), "reason": outcome.error.reason},
            )
            raise Rejected(outcome.error.code, outcome.error.reason)
        if outcome.ctx == ctx:
            return request  # nothing changed: forward kubelet's own bytes
        write(outcome.ctx)
        return msg.SerializeToString()

    def _context(
        self, method: Method, msg: Any, deadline: float | None
    ) -> tuple[HookContext, Callable[[HookContext], None]]:
        stage = method.pre
        assert stage is not None
        if stage is Stage.PRE_RUN_POD_SANDBOX:
            ctx = HookContext(stage, pod_view(msg.config, runtime_handler=msg.runtime_handler), deadline=deadline)
            return ctx, lambda new: write_pod(msg.config, ctx.pod, new.pod)
        if stage is Stage.PRE_CREATE_CONTAINER:
            pod = pod_view(msg.sandbox_config, pod_id=msg.pod_sandbox_id)
            rec = self.store.pods.get(msg.pod_sandbox_id)
            if rec is not None:
                # kubelet sends its own copy of the sandbox config; what the hooks made of the pod at
                # RunPodSandbox (labels, annotations, cgroup parent) is in the store
                pod = replace(
                    pod,
                    labels=rec.labels,
                    annotations=rec.annotations,
                    cgroup_parent=rec.cgroup_parent or pod.cgroup_parent,
                )
            ctx = HookContext(stage, pod, container_view(msg.config), deadline)
            return ctx, lambda new: write_container(msg.config, ctx.container, new.container)  # type: ignore[arg-type]
        # StartContainer and UpdateContainerResources carry only an id: the rest comes from the store.
        rec = self.store.containers.get(msg.container_id)
        pod_rec = self.store.pods.get(rec.pod_id) if rec is not None else None
        if rec is None or pod_rec is None:
            # Created before crihook knew it, and not reconciled: hooks still see the id.
            pod = PodInfo(name="", namespace="", uid="")
            container = ContainerInfo(name="", id=msg.container_id)
        else:
            pod, container = pod_from_record(pod_rec), container_from_record(rec)
        if stage is Stage.PRE_UPDATE_CONTAINER_RESOURCES:
            # The hooks see the container as it will be once the update is in: what it was
            # created with (envs, annotations) and its resources with the update applied, the way
            # the runtime applies it. Only what kubelet asked plus what the hooks changed goes on.
            asked = resources_view(msg.linux, msg.HasField("linux"))
            container = replace(
                container,
                annotations={**container.annotations, **msg.annotations},
                resources=apply_update(container.resources, asked),
            )
            ctx = HookContext(stage, pod, container, deadline)

            def write(new: HookContext) -> None:
                assert new.container is not None and ctx.container is not None
                before, after = ctx.container, new.container
                msg.annotations.update(changed_keys(before.annotations, after.annotations))
                changed = changed_fields(before.resources, after.resources)
                unified = changed_keys(
                    before.resources.unified if before.resources else {},
                    after.resources.unified if after.resources else {},
                )
                for name, value in changed.items():
                    setattr(msg.linux, name, value)
                if unified:
                    msg.linux.unified.update(unified)

            return ctx, write
        # PreStartContainer: the request has nothing to rewrite; hooks may only refuse.
        return HookContext(stage, pod, container, deadline), lambda new: None

    # post ---------------------------------------------------------------------------------------

    def post(
        self, call: Call, request: bytes, response: bytes | None, status: grpc.StatusCode, message: bytes | None
    ) -> None:
        """Bookkeeping now, in call order; post hooks in the background (they never change or
        delay what kubelet sees)."""
        method = call.method
        if status is not grpc.StatusCode.OK:
            if status is grpc.StatusCode.FAILED_PRECONDITION and self.janitor is not None and method.name in REMOVALS:
                self.janitor.notice(message)  # a task CRI lost track of blocks the removal: see orphans.py
            return
        try:
            created = method.name == "CreateContainer" and call.ctx is not None
            req = None if created else method.request.FromString(request)
            resp = method.response.FromString(response or b"")
        except DecodeError as e:
            log.warning("undecodable lifecycle message", extra={"method": method.name, "error": str(e)})
            return
        ctx = self._record(method, req, resp, call)
        if ctx is not None and self.chain.wants(ctx.stage):
            task = asyncio.get_running_loop().create_task(self._post_hooks(ctx))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _record(self, method: Method, req: Any, resp: Any, call: Call) -> HookContext | None:
        store = self.store
        records = [r.as_dict() for r in call.records]
        now = time.time()
        name = method.name
        if name == "RunPodSandbox":
            pod = pod_view(req.config, pod_id=resp.pod_sandbox_id)
            store.put_pod(
                PodRecord(
                    id=pod.id,
                    name=pod.name,
                    namespace=pod.namespace,
                    uid=pod.uid,
                    attempt=pod.attempt,
                    labels=dict(pod.labels),
                    annotations=dict(pod.annotations),
                    cgroup_parent=pod.cgroup_parent,
                    hooks=records,
                    created=now,
                    runtime_handler=req.runtime_handler,
                    resources=resources_record(pod.resources),
                    overhead=resources_record(pod.overhead),
                )
            )
            _log_event("pod sandbox started", pod, None, call.records)
            return None
        if name == "CreateContainer":
            if req is None:  # decoded once, in pre: the hooks' final views are what was forwarded
                assert call.ctx is not None and call.ctx.container is not None
                pod, c = call.ctx.pod, replace(call.ctx.container, id=resp.container_id)
            else:
                pod = pod_view(req.sandbox_config, pod_id=req.pod_sandbox_id)
                c = container_view(req.config, resp.container_id)
            store.put_container(
                ContainerRecord(
                    id=c.id,
                    pod_id=pod.id,
                    name=c.name,
                    attempt=c.attempt,
                    labels=dict(c.labels),
                    annotations=dict(c.annotations),
                    hooks=records,
                    created=now,
                    envs=dict(c.envs),
                    resources=resources_record(c.resources),
                )
            )
            _log_event("container created", pod, c, call.records)
            return None
        if name == "StopPodSandbox" or name == "RemovePodSandbox":
            pod_id = req.pod_sandbox_id
            rec = store.set_pod_state(pod_id, "notready") if name == "StopPodSandbox" else store.remove_pod(pod_id)
            if rec is None:
                return None
            return HookContext(method.post, pod_from_record(rec))  # type: ignore[arg-type]
        cid = req.container_id
        if name == "UpdateContainerResources" or name == "StartContainer":
            store.add_hook_records(cid, records)
        if name == "UpdateContainerResources":
            # `req` is what reached the runtime; it merged it into the container, so does the store
            crec = store.containers.get(cid)
            if crec is not None and req.HasField("linux"):
                merged = apply_update(resources_from_record(crec.resources), resources_view(req.linux, True))
                store.set_container_resources(cid, resources_record(merged))
            return None
        if name == "RemoveContainer":
            crec = store.remove_container(cid)
        else:
            crec = store.set_container_state(cid, "running" if name == "StartContainer" else "exited")
        if crec is None:
            return None
        prec = store.pods.get(crec.pod_id)
        pod = pod_from_record(prec) if prec is not None else PodInfo(name="", namespace="", uid="", id=crec.pod_id)
        return HookContext(method.post, pod, container_from_record(crec))  # type: ignore[arg-type]

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


def _log_fields(ctx: HookContext) -> dict[str, str]:
    fields = {"pod": ctx.pod.ref}
    if ctx.container is not None:
        fields["container"] = ctx.container.name
    return fields


def _log_event(what: str, pod: PodInfo, container: ContainerInfo | None, records: list[HookRecord]) -> None:
    acted = [r for r in records if r.result != "noop"]
    level = logging.INFO if acted else logging.DEBUG
    if log.isEnabledFor(level):
        fields: dict[str, Any] = {"pod": pod.ref}
        if container is not None:
            fields["container"] = container.name
            fields["id"] = container.id[:13]
        else:
            fields["id"] = pod.id[:13]
        if records:
            fields["hooks"] = _summary(records)
            fields["ms"] = round(sum(r.ms for r in records), 3)
        log.log(level, what, extra=fields)
