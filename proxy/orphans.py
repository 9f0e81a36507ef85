"""Clearing a task containerd's CRI plugin no longer owns.

containerd 1.6 can leave one behind when a StartContainer is cancelled while the task is being
created (its caller, crihook included, died mid-call): CRI marks the container exited with reason
StartError (or still holds it as created) while its task runs on. StopContainer skips it, and every
RemoveContainer or RemovePodSandbox fails with FAILED_PRECONDITION "cannot delete running task
<id>". kubelet retries forever and the pod never goes. The proxy sees that answer go by; when CRI
confirms it runs nothing for that container (created or exited), it kills and deletes the task
through containerd's own task service, so kubelet's next retry succeeds. Only that answer starts
it, so runtimes other than containerd are never sent a call they do not know.
"""

from __future__ import annotations

import asyncio
import logging
import re
from urllib.parse import unquote_to_bytes

import grpc

from crihook.base.metrics import ORPHAN_TASKS
from crihook.proto import runtime_v1_pb2 as cri
from crihook.proto import runtime_v1_pb2_grpc as cri_grpc
from crihook.proto import wire

log = logging.getLogger("crihook.proxy")

NOT_RUNNING = frozenset({cri.CONTAINER_CREATED, cri.CONTAINER_EXITED})  # CRI's states with no process
MARK = re.compile(rb"cannot delete running task ([A-Za-z0-9][A-Za-z0-9_.-]*)")
TASKS = "/containerd.services.tasks.v1.Tasks/"
SIGKILL = 9
CALL_TIMEOUT = 10.0
DELETE_ATTEMPTS = 20  # a killed task takes a moment to exit before containerd will delete it
DELETE_PAUSE = 0.1


def orphan_of(message: bytes | None) -> str | None:
    """The container id named by containerd's "cannot delete running task" answer, else None."""
    found = MARK.search(unquote_to_bytes(message or b""))
    return found.group(1).decode() if found else None


def kill_request(container_id: str) -> bytes:
    """containerd.services.tasks.v1.KillRequest{container_id: 1, signal: 3, all: 4}: every process."""
    return wire.length_delimited(1, container_id.encode()) + wire.uint(3, SIGKILL) + wire.uint(4, 1)


def delete_request(container_id: str) -> bytes:
    """containerd.services.tasks.v1.DeleteTaskRequest{container_id: 1}."""
    return wire.length_delimited(1, container_id.encode())


class TaskJanitor:
    """One clearing per container at a time, in the background; kubelet's own retry does the rest."""

    def __init__(self, runtime_path: str, namespace: str) -> None:
        self.target = f"unix://{runtime_path}"
        self.metadata = (("containerd-namespace", namespace),)
        self.channel: grpc.aio.Channel | None = None
        self.clearing: dict[str, asyncio.Task[bool]] = {}  # by container id

    def notice(self, message: bytes | None) -> None:
        container_id = orphan_of(message)
        if container_id is None or container_id in self.clearing:
            return
        task = asyncio.get_running_loop().create_task(self.clear(container_id))
        self.clearing[container_id] = task
        task.add_done_callback(lambda _: self.clearing.pop(container_id, None))

    async def clear(self, container_id: str) -> bool:
        """Kill and delete the task of `container_id` if CRI holds the container as created or
        exited; True when the task is gone. A container CRI knows as running is never touched."""
        if self.channel is None:
            self.channel = grpc.aio.insecure_channel(self.target)
        try:
            status = await cri_grpc.RuntimeServiceStub(self.channel).ContainerStatus(
                cri.ContainerStatusRequest(container_id=container_id), timeout=CALL_TIMEOUT
            )
            state = status.status.state
            if state not in NOT_RUNNING:
                log.info(
                    "orphan task left alone",
                    extra={"container": container_id, "state": cri.ContainerState.Name(state)},
                )
                return False
            await self._call("Kill", kill_request(container_id))
            for _ in range(DELETE_ATTEMPTS):
                if await self._call("Delete", delete_request(container_id)):
                    log.warning("orphan task cleared", extra={"container": container_id})
                    ORPHAN_TASKS.inc("cleared")
                    return True
                await asyncio.sleep(DELETE_PAUSE)
            why = f"task still running {DELETE_ATTEMPTS * DELETE_PAUSE:.0f}s after SIGKILL"
        except grpc.aio.AioRpcError as e:
            why = e.details() or e.code().name
        log.warning("orphan task not cleared", extra={"container": container_id, "error": why})
        ORPHAN_TASKS.inc("failed")
        return False

    async def _call(self, method: str, request: bytes) -> bool:
        """One task-service call; False when the task has not exited yet, NOT_FOUND (gone) is done."""
        assert self.channel is not None
        try:
            # the requests are encoded by hand and only the status is read: bytes both ways
            call = self.channel.unary_unary(TASKS + method, request_serializer=None, response_deserializer=None)
            await call(request, timeout=CALL_TIMEOUT, metadata=self.metadata)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION or _still_running(e):
                return False
            if e.code() != grpc.StatusCode.NOT_FOUND:
                raise
        return True

    async def close(self) -> None:
        if self.clearing:
            await asyncio.gather(*self.clearing.values(), return_exceptions=True)
        if self.channel is not None:
            await self.channel.close(grace=None)


def _still_running(error: grpc.aio.AioRpcError) -> bool:
    """containerd 2.x answers a Delete of a task that has not exited yet with UNKNOWN "cannot delete
    a running process" (the shim's error, not mapped), where 1.6 says FAILED_PRECONDITION."""
    return error.code() == grpc.StatusCode.UNKNOWN and "cannot delete a running process" in (error.details() or "")
