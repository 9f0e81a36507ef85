"""A scripted runtime.v1alpha1.RuntimeHookService server for tests, over a unix socket (grpc aio).

By default it answers like koordlet: the request's state echoed back. A test scripts, per RPC, a
change to that echo, a whole answer of its own, a delay, or an error status; every request received
is kept in `calls`. The method table is built from the proto descriptor, not from the generated
servicer, so the client side is checked against the schema itself.

Helpers write hook-server config files the way an operator (or koordlet) would: atomically.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from crihook.proto import hookservice_v1alpha1_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["RuntimeHookService"]
POD_RPCS = ("PreRunPodSandboxHook", "PostStopPodSandboxHook")


def short_dir(prefix: str = "crihook-hs-") -> Path:
    """A directory whose socket paths stay under the 108-byte unix socket limit (pytest's
    tmp_path may not)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def echo(rpc: str, request: Any) -> Any:
    """The answer a server that changes nothing gives: the request's state, as koordlet sends it."""
    if rpc in POD_RPCS:
        answer = pb.PodSandboxHookResponse(
            labels=request.labels, annotations=request.annotations, cgroup_parent=request.cgroup_parent
        )
        if request.HasField("resources"):
            answer.resources.CopyFrom(request.resources)
        return answer
    answer = pb.ContainerResourceHookResponse(
        container_annotations=request.container_annotations,
        pod_cgroup_parent=request.pod_cgroup_parent,
        container_envs=request.container_envs,
    )
    if request.HasField("container_resources"):
        answer.container_resources.CopyFrom(request.container_resources)
    return answer


@dataclass
class Script:
    """What the server does on one RPC. `change` edits the echoed answer; `answer` replaces it."""

    change: Callable[[Any], None] | None = None
    answer: Any = None
    delay: float = 0.0
    error: tuple[grpc.StatusCode, str] | None = None


@dataclass
class HookServer:
    socket: Path
    scripts: dict[str, Script] = field(default_factory=dict)
    calls: list[tuple[str, Any]] = field(default_factory=list)
    _server: grpc.aio.Server | None = None

    @property
    def endpoint(self) -> str:
        return str(self.socket)

    def on(self, rpc: str, **script: Any) -> None:
        if rpc not in SERVICE.methods_by_name:
            raise ValueError(f"no RPC {rpc} in {SERVICE.full_name}")
        self.scripts[rpc] = Script(**script)

    def requests(self, rpc: str) -> list[Any]:
        return [req for name, req in self.calls if name == rpc]

    async def start(self) -> HookServer:
        server = grpc.aio.server()
        handlers = {}
        for method in SERVICE.methods:
            request_cls = getattr(pb, method.input_type.name)
            response_cls = getattr(pb, method.output_type.name)
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                self._handler(method.name),
                request_deserializer=request_cls.FromString,
                response_serializer=response_cls.SerializeToString,
            )
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
        server.add_insecure_port(f"unix:{self.socket}")
        await server.start()
        self._server = server
        return self

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=None)
            self._server = None
        self.socket.unlink(missing_ok=True)

    def _handler(self, rpc: str) -> Callable[[Any, grpc.aio.ServicerContext], Any]:
        async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
            self.calls.append((rpc, request))
            script = self.scripts.get(rpc, Script())
            if script.delay:
                await asyncio.sleep(script.delay)
            if script.error is not None:
                await context.abort(*script.error)
            if script.answer is not None:
                return script.answer
            answer = echo(rpc, request)
            if script.change is not None:
                script.change(answer)
            return answer

        return handle


class ServerThread:
    """Hook servers on an event loop of their own thread, for tests that block on CRI calls while
    the servers answer crihook. Scripts set with `on` from the test thread apply to the next call."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.servers: list[HookServer] = []
        self._thread = threading.Thread(target=self.loop.run_forever, name="hook-servers", daemon=True)
        self._thread.start()

    def start(self, socket: Path) -> HookServer:
        server = self._run(HookServer(socket).start())
        self.servers.append(server)
        return server

    def stop(self, server: HookServer) -> None:
        self._run(server.stop())
        self.servers.remove(server)

    def close(self) -> None:
        for server in list(self.servers):
            self.stop(server)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    def _run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)


@contextmanager
def server_thread() -> Iterator[ServerThread]:
    thread = ServerThread()
    try:
        yield thread
    finally:
        thread.close()


def wait_for(condition: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll until `condition()` is truthy (post hooks run after kubelet's call has returned)."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout}s")
        time.sleep(0.05)
    return value


def write_config(
    directory: Path,
    name: str,
    endpoint: str,
    policy: str = "",
    hooks: Iterable[str] = (),
) -> Path:
    """Koordinator's file format, written with a rename so a reader never sees half a file."""
    return write_raw(
        directory,
        name,
        json.dumps({"remote-endpoint": endpoint, "failure-policy": policy, "runtime-hooks": list(hooks)}).encode(),
    )


def write_raw(directory: Path, name: str, content: bytes) -> Path:
    path = directory / name
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    with os.fdopen(fd, "wb") as f:
        f.write(content)
    os.replace(tmp, path)
    return path
