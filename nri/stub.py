"""The NRI plugin's side of the connection to the runtime: dial (or take the socket the runtime
passed), register, serve the runtime's calls through a `Handler`, call the runtime back, and dial
again with backoff when the connection drops.

One unix socket carries two ttrpc connections through the multiplexer (mux.py): on `PLUGIN_CONN`
the runtime calls the plugin (Configure, Synchronize, CreateContainer, ...), on `RUNTIME_CONN` the
plugin calls the runtime (RegisterPlugin, UpdateContainers). Calls are unary. A method this stub
does not serve is answered Unimplemented, which NRI v0.12+ runtimes take as "send it as a
StateChange". ttrpc messages of other types are ignored, as ttrpc does; bytes that are not ttrpc
end the connection, never the plugin.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from google.protobuf.message import DecodeError, Message

from crihook.nri import mux, ttrpc
from crihook.nri.registration import Registration
from crihook.nri.ttrpc import Frame, MessageType
from crihook.proto import nri_v1alpha1_pb2 as api
from crihook.proto import ttrpc_pb2

log = logging.getLogger("crihook.nri")
T = TypeVar("T")

PACKAGE = "nri.pkg.api.v1alpha1"
PLUGIN_SERVICE = f"{PACKAGE}.Plugin"
RUNTIME_SERVICE = f"{PACKAGE}.Runtime"
DEFAULT_SOCKET = "/var/run/nri/nri.sock"  # where containerd and CRI-O serve NRI unless told otherwise

# NRI's defaults (pkg/api/timeouts.go); a runtime from NRI v0.8 on sends its own in Configure.
REGISTRATION_TIMEOUT = 5.0
REQUEST_TIMEOUT = 2.0

READ_SIZE = 64 * 1024

# Asked of every runtime in Configure; NRI v0.12.4+ honours it, older runtimes drop the field. A
# request crihook did not answer in time (or lost with the connection) fails, where by default the
# runtime goes on without the plugin: the container would start unadjusted. After a timeout the
# plugin stays registered, where by default the runtime drops it and every container until the
# next registration starts unadjusted (pkg/adaptation/plugin.go, handleRequestError).
FAILURE_POLICY = api.FailurePolicy(fail_request=True, keep_connected=True)

# A call the handler has not answered within this share of the runtime's deadline (the request's
# timeout_nano) is answered DeadlineExceeded instead: an error fails that one container's creation,
# while a late answer makes the runtime drop the plugin and create the container unadjusted. A
# backstop: a handler that keeps its own, earlier deadline answers with its own message first.
ANSWER_WITHIN = 0.9


class Code(enum.IntEnum):
    """The gRPC status codes a ttrpc Response carries (google.rpc.Code)."""

    OK = 0
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    RESOURCE_EXHAUSTED = 8
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14


class RpcError(Exception):
    """A call that came back with a non-OK status, or that a handler fails on purpose."""

    def __init__(self, code: Code | int, message: str) -> None:
        super().__init__(f"{_code_name(code)}: {message}")
        self.code = int(code)
        self.message = message


class ConnectionLost(Exception):
    """The connection to the runtime is gone; the message says why."""


def _code_name(code: int) -> str:
    return Code(code).name if code in Code._value2member_map_ else str(code)


def event_mask(*events: int) -> int:
    """ConfigureResponse.events for these api.Event values: bit (1 << (event - 1)) each."""
    mask = 0
    for e in events:
        if not api.RUN_POD_SANDBOX <= e < api.LAST:
            raise ValueError(f"no NRI event {e}")
        mask |= 1 << (e - 1)
    return mask


class Handler(Protocol):
    """What the plugin does at each call of the runtime. A method that raises fails that call only:
    RpcError with its code, anything else as Unknown with the exception's text (the runtime then
    fails the container's creation, or drops the plugin if it was Configure or Synchronize)."""

    async def configure(self, request: api.ConfigureRequest) -> int:
        """The events to subscribe to (`event_mask`); never 0, which means every event."""
        ...

    async def synchronize(
        self, pods: Sequence[api.PodSandbox], containers: Sequence[api.Container]
    ) -> Sequence[api.ContainerUpdate]:
        """Every pod and container the runtime has, after each (re)connection."""
        ...

    async def create_container(self, request: api.CreateContainerRequest) -> api.CreateContainerResponse: ...

    async def update_container(self, request: api.UpdateContainerRequest) -> api.UpdateContainerResponse: ...

    async def stop_container(self, request: api.StopContainerRequest) -> api.StopContainerResponse: ...

    async def validate_adjustment(
        self, request: api.ValidateContainerAdjustmentRequest
    ) -> api.ValidateContainerAdjustmentResponse:
        """The adjustment of every plugin, merged, before the runtime applies it (NRI v0.10+, when
        subscribed to VALIDATE_CONTAINER_ADJUSTMENT); `reject` fails the container's creation."""
        ...

    async def state_change(self, event: api.StateChangeEvent) -> None:
        """The other subscribed events (pod run/stop/remove, container start/remove, post-events)."""
        ...

    async def shutdown(self) -> None:
        """The runtime is going down; the connection closes next."""
        ...


class _Service:
    """The Plugin service for one connection: decodes a Request, runs the handler, encodes the
    Response. Keeps the chunks of a Synchronize that comes in several (NRI v0.8+, `more`), and
    tells `registration` of every call and of how the Synchronize was answered."""

    def __init__(
        self,
        handler: Handler,
        on_configure: Callable[[api.ConfigureRequest], None],
        registration: Registration | None = None,
    ) -> None:
        self.handler = handler
        self.on_configure = on_configure
        self.registration = registration
        self._pods: list[api.PodSandbox] = []
        self._containers: list[api.Container] = []
        self._last_chunk = False  # the Synchronize's last chunk is being answered
        self.methods: dict[str, tuple[type[Message], Callable[[Message], Awaitable[Message]]]] = {
            "Configure": (api.ConfigureRequest, self._configure),
            "Synchronize": (api.SynchronizeRequest, self._synchronize),
            "Shutdown": (api.Empty, self._shutdown),
            "CreateContainer": (api.CreateContainerRequest, self._create),
            "UpdateContainer": (api.UpdateContainerRequest, self._update),
            "StopContainer": (api.StopContainerRequest, self._stop),
            "StateChange": (api.StateChangeEvent, self._state_change),
            "ValidateContainerAdjustment": (api.ValidateContainerAdjustmentRequest, self._validate),
        }

    async def _configure(self, req: Message) -> Message:
        assert isinstance(req, api.ConfigureRequest)
        self.on_configure(req)
        events = await self.handler.configure(req)
        log.info(
            "configured by the runtime",
            extra={
                "runtime": req.runtime_name,
                "version": req.runtime_version,
                "nri": req.NRI_version or "-",
                "events": hex(events),
            },
        )
        return api.ConfigureResponse(events=events, failure_policy=FAILURE_POLICY)

    async def _synchronize(self, req: Message) -> Message:
        assert isinstance(req, api.SynchronizeRequest)
        self._pods += req.pods
        self._containers += req.containers
        if req.more:
            return api.SynchronizeResponse(more=True)
        pods, containers = self._pods, self._containers
        self._pods, self._containers = [], []
        self._last_chunk = True
        updates = await self.handler.synchronize(pods, containers)
        log.info("synchronized with the runtime", extra={"pods": len(pods), "containers": len(containers)})
        return api.SynchronizeResponse(update=updates)

    async def _shutdown(self, req: Message) -> Message:
        await self.handler.shutdown()
        return api.Empty()

    async def _create(self, req: Message) -> Message:
        assert isinstance(req, api.CreateContainerRequest)
        return await self.handler.create_container(req)

    async def _update(self, req: Message) -> Message:
        assert isinstance(req, api.UpdateContainerRequest)
        return await self.handler.update_container(req)

    async def _stop(self, req: Message) -> Message:
        assert isinstance(req, api.StopContainerRequest)
        return await self.handler.stop_container(req)

    async def _validate(self, req: Message) -> Message:
        assert isinstance(req, api.ValidateContainerAdjustmentRequest)
        return await self.handler.validate_adjustment(req)

    async def _state_change(self, req: Message) -> Message:
        assert isinstance(req, api.StateChangeEvent)
        await self.handler.state_change(req)
        return api.Empty()

    async def respond(self, frame: Frame) -> Frame:
        """The Response frame for a Request frame."""
        received = time.monotonic()
        if self.registration is not None:
            self.registration.call_received()
        response = await self._answer(frame.payload)
        if self._last_chunk:  # the runtime calls nothing else while a Synchronize is unanswered
            self._last_chunk = False
            if self.registration is not None:
                status = response.status
                error = (status.message or f"code {status.code}") if status.code else None
                self.registration.synchronize_answered(error, time.monotonic() - received)
        return Frame(frame.stream_id, MessageType.RESPONSE, response.SerializeToString())

    async def _answer(self, payload: bytes) -> ttrpc_pb2.Response:
        try:
            req = ttrpc_pb2.Request.FromString(payload)
        except DecodeError as e:
            return _error(Code.INVALID_ARGUMENT, f"undecodable ttrpc request: {e}")
        if req.service != PLUGIN_SERVICE:
            return _error(Code.UNIMPLEMENTED, f"service {req.service!r} is not served by this plugin")
        if req.method not in self.methods:
            return _error(Code.UNIMPLEMENTED, f"method {req.method!r} of {req.service} is not served by this plugin")
        cls, run = self.methods[req.method]
        try:
            message = cls.FromString(req.payload)
        except DecodeError as e:
            return _error(Code.INVALID_ARGUMENT, f"undecodable {cls.DESCRIPTOR.name} for {req.method}: {e}")
        limit = req.timeout_nano / 1e9 * ANSWER_WITHIN if req.timeout_nano > 0 else None
        try:
            async with asyncio.timeout(limit) as scope:
                return ttrpc_pb2.Response(payload=(await run(message)).SerializeToString())
        except TimeoutError as e:
            if not scope.expired():
                log.error("handler failed", exc_info=e, extra={"method": req.method})
                return _error(Code.UNKNOWN, f"{req.method}: {e or 'timed out'}")
            log.error("handler too slow", extra={"method": req.method, "limit_s": round(limit or 0, 3)})
            return _error(
                Code.DEADLINE_EXCEEDED,
                f"{req.method}: no answer within {limit:.2f} s, refused before the runtime's deadline",
            )
        except RpcError as e:
            log.warning("call failed", extra={"method": req.method, "error": str(e)})
            return _error(e.code, e.message)
        except Exception as e:
            log.error("handler failed", exc_info=e, extra={"method": req.method})
            return _error(Code.UNKNOWN, f"{req.method}: {e}")


def _error(code: Code | int, message: str) -> ttrpc_pb2.Response:
    return ttrpc_pb2.Response(status=ttrpc_pb2.Status(code=int(code), message=message))


class Connection:
    """One multiplexed socket to the runtime: serves its calls (`serve`), makes ours (`call`).

    `serve` raises ConnectionLost when the socket closes or carries bytes that are not ttrpc; every
    call still waiting then fails with ConnectionLost too."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, service: _Service) -> None:
        self.reader = reader
        self.writer = writer
        self.service = service
        self._demux = mux.Decoder()
        self._decoders = {mux.PLUGIN_CONN: ttrpc.Decoder(), mux.RUNTIME_CONN: ttrpc.Decoder()}
        self._next_stream = 1  # a ttrpc client's stream ids are odd and increasing
        self._pending: dict[int, asyncio.Future[ttrpc_pb2.Response]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._lost: ConnectionLost | None = None

    def _send(self, conn_id: int, frame: Frame) -> None:
        self.writer.write(mux.encode(conn_id, ttrpc.encode(frame)))

    async def call(self, method: str, request: Message, reply: type[Message], limit: float) -> Message:
        """Call `method` of the runtime's service, telling it the call's time `limit` in seconds;
        RpcError on a non-OK status, TimeoutError after `limit`, or ConnectionLost."""
        if self._lost is not None:
            raise self._lost
        stream_id, self._next_stream = self._next_stream, self._next_stream + 2
        envelope = ttrpc_pb2.Request(
            service=RUNTIME_SERVICE,
            method=method,
            payload=request.SerializeToString(),
            timeout_nano=int(limit * 1e9),
        )
        waiter: asyncio.Future[ttrpc_pb2.Response] = asyncio.get_running_loop().create_future()
        self._pending[stream_id] = waiter
        try:
            self._send(mux.RUNTIME_CONN, Frame(stream_id, MessageType.REQUEST, envelope.SerializeToString()))
            async with asyncio.timeout(limit):
                await self.writer.drain()
                response = await waiter
        except OSError as e:
            raise self._lose(f"connection error: {e}") from e
        finally:
            self._pending.pop(stream_id, None)
        if response.HasField("status") and response.status.code != Code.OK:
            raise RpcError(response.status.code, response.status.message)
        try:
            return reply.FromString(response.payload)
        except DecodeError as e:
            raise RpcError(Code.INTERNAL, f"undecodable {reply.DESCRIPTOR.name} from {method}: {e}") from e

    async def serve(self) -> None:
        """Read until the socket closes; raises ConnectionLost with the reason."""
        try:
            while True:
                data = await self.reader.read(READ_SIZE)
                if not data:
                    raise ConnectionLost("the runtime closed the connection")
                for conn_id, payload in self._demux.feed(data):
                    self._receive(conn_id, payload)
        except (mux.MuxError, ttrpc.FrameError) as e:
            raise self._lose(f"protocol error from the runtime: {e}") from e
        except ConnectionLost as e:
            raise self._lose(str(e)) from None
        except OSError as e:
            raise self._lose(f"connection error: {e}") from e

    def _receive(self, conn_id: int, payload: bytes) -> None:
        decoder = self._decoders.get(conn_id)
        if decoder is None:
            log.debug("dropped bytes for an unknown logical connection", extra={"conn": conn_id})
            return
        for frame in decoder.feed(payload):
            if conn_id == mux.RUNTIME_CONN:
                self._resolve(frame)
            elif frame.type == MessageType.REQUEST:
                task = asyncio.create_task(self._serve_one(frame))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            elif frame.type == MessageType.DATA:  # as ttrpc's server answers data for no open stream
                no_stream = _error(Code.INVALID_ARGUMENT, f"stream {frame.stream_id} is not open: unary calls only")
                self._send(mux.PLUGIN_CONN, Frame(frame.stream_id, MessageType.RESPONSE, no_stream.SerializeToString()))
            else:  # a response, or a type of a later ttrpc: ttrpc's server ignores both
                log.debug("ignored a ttrpc message", extra={"conn": conn_id, "type": frame.type})

    def _resolve(self, frame: Frame) -> None:
        """A message on our client's connection: the answer to a waiting call, or, as ttrpc's client
        has it, the failure of that call when it is something else; ignored on a stream no call waits on."""
        waiter = self._pending.get(frame.stream_id)
        if waiter is None or waiter.done():
            log.debug("ttrpc message for no waiting call", extra={"stream": frame.stream_id, "type": frame.type})
        elif frame.type != MessageType.RESPONSE:
            waiter.set_exception(
                RpcError(Code.INTERNAL, f"ttrpc message of type {frame.type} where a response was due")
            )
        else:
            try:
                waiter.set_result(ttrpc_pb2.Response.FromString(frame.payload))
            except DecodeError as e:
                waiter.set_exception(RpcError(Code.INTERNAL, f"undecodable ttrpc response: {e}"))

    async def _serve_one(self, frame: Frame) -> None:
        response = await self.service.respond(frame)
        if len(response.payload) > ttrpc.MAX_PAYLOAD:  # the runtime would refuse it: say why instead
            too_big = _error(Code.RESOURCE_EXHAUSTED, f"answer of {len(response.payload)} bytes is over 4 MiB")
            response = Frame(frame.stream_id, MessageType.RESPONSE, too_big.SerializeToString())
        if self._lost is None:
            self._send(mux.PLUGIN_CONN, response)
            with contextlib.suppress(OSError):  # the read side sees the same and says why
                await self.writer.drain()

    def _lose(self, why: str) -> ConnectionLost:
        if self._lost is None:
            self._lost = ConnectionLost(why)
            for waiter in self._pending.values():
                if not waiter.done():
                    waiter.set_exception(self._lost)
        return self._lost

    async def close(self) -> None:
        self._lose("closed by the plugin")
        for task in list(self._tasks):
            task.cancel()
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


@dataclass
class Plugin:
    """Keeps the plugin registered with the runtime: `run()` until `stop()`.

    With `fd` set (a pre-registered plugin, started by the runtime with its end of a socketpair) the
    plugin serves that one connection and `run()` returns when it closes: the runtime starts the
    plugin again when it starts again. Otherwise it dials `socket_path`, and dials again after every
    drop, waiting `backoff` seconds, doubled after each failure up to `max_backoff`, back to
    `backoff` once a connection registered."""

    handler: Handler
    name: str
    index: str
    socket_path: str = DEFAULT_SOCKET
    fd: int | None = None
    backoff: float = 0.1
    max_backoff: float = 2.0
    registration_timeout: float = REGISTRATION_TIMEOUT
    request_timeout: float = REQUEST_TIMEOUT
    connections: int = field(default=0, init=False)  # registrations so far
    registration: Registration | None = field(default=None, init=False)  # the connection's, while it lasts
    runtime: str = field(default="", init=False)  # "name version" from the last Configure
    _conn: Connection | None = field(default=None, init=False, repr=False)
    _stopping: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.index) != 2 or not self.index.isdigit():
            raise ValueError(f"plugin index {self.index!r} is not two digits")
        if not self.name or "/" in self.name:
            raise ValueError(f"plugin name {self.name!r} is empty or has a /")

    @property
    def connected(self) -> bool:
        return self._conn is not None

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        delay = self.backoff
        warned = False  # one warning per outage, not one per try
        while not self._stopping.is_set():
            try:
                reader, writer = await self._open()
            except OSError as e:
                if self.fd is not None:
                    raise ConnectionLost(f"the socket on fd {self.fd} is unusable: {e}") from e
                level = logging.DEBUG if warned else logging.WARNING
                log.log(level, "cannot reach the runtime", extra={"socket": self.socket_path, "error": str(e)})
                warned = True
            else:
                if await self._until_stopped(self._session(reader, writer)):
                    delay, warned = self.backoff, False
                if self.fd is not None:
                    return
            await self._until_stopped(asyncio.sleep(delay))
            delay = min(delay * 2, self.max_backoff)

    async def _until_stopped(self, work: Coroutine[Any, Any, T]) -> T | None:
        """`work`'s result, or None when `stop()` came first (`work` is then cancelled)."""
        task = asyncio.create_task(work)
        stopping = asyncio.create_task(self._stopping.wait())
        await asyncio.wait([task, stopping], return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.fd is not None:
            sock = socket.socket(fileno=self.fd)
            return await asyncio.open_unix_connection(sock=sock)
        return await asyncio.open_unix_connection(self.socket_path)

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Register and serve one connection until it drops, or until the runtime shows it did not
        take the plugin (nri/registration.py); whether it registered and was taken."""
        self.registration = reg = Registration(self.request_timeout)
        conn = Connection(reader, writer, _Service(self.handler, self._configured, reg))
        serving = asyncio.create_task(conn.serve())
        registered = False
        try:
            await conn.call(
                "RegisterPlugin",
                api.RegisterPluginRequest(plugin_name=self.name, plugin_idx=self.index),
                api.Empty,
                self.registration_timeout,
            )
            registered = True
            self.connections += 1
            self._conn = conn
            log.info("registered with the runtime", extra={"plugin": f"{self.index}-{self.name}"})
            given_up = asyncio.create_task(reg.gone.wait())
            try:
                await asyncio.wait([serving, given_up], return_when=asyncio.FIRST_COMPLETED)
            finally:
                given_up.cancel()
            if serving.done():
                serving.result()
        except (ConnectionLost, RpcError, TimeoutError) as e:
            why = "registration timed out" if isinstance(e, TimeoutError) else str(e)
            log.warning("connection to the runtime lost", extra={"plugin": f"{self.index}-{self.name}", "error": why})
        finally:
            self._conn = None
            self.registration = None
            serving.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionLost):
                await serving
            await conn.close()
        return registered and reg.dropped is None

    def _configured(self, req: api.ConfigureRequest) -> None:
        self.runtime = f"{req.runtime_name} {req.runtime_version}"
        if req.registration_timeout > 0:
            self.registration_timeout = req.registration_timeout / 1000
        if req.request_timeout > 0:
            self.request_timeout = req.request_timeout / 1000
        if self.registration is not None:
            self.registration.request_timeout = self.request_timeout

    async def update_containers(
        self, update: Sequence[api.ContainerUpdate] = (), evict: Sequence[api.ContainerEviction] = ()
    ) -> list[api.ContainerUpdate]:
        """Ask the runtime to update (or evict) containers outside of any event; the updates it
        could not apply. ConnectionLost when not connected."""
        conn = self._conn
        if conn is None:
            raise ConnectionLost("not connected to the runtime")
        reply = await conn.call(
            "UpdateContainers",
            api.UpdateContainersRequest(update=update, evict=evict),
            api.UpdateContainersResponse,
            self.request_timeout,
        )
        assert isinstance(reply, api.UpdateContainersResponse)
        return list(reply.failed)


def inherited_socket() -> tuple[int, str, str] | None:
    """(fd, name, index) when the runtime started this process as a pre-registered plugin."""
    fd = os.environ.get("NRI_PLUGIN_SOCKET")
    if fd is None:
        return None
    if not fd.isdigit():
        raise ValueError(f"NRI_PLUGIN_SOCKET={fd!r} is not a file descriptor number")
    return int(fd), os.environ.get("NRI_PLUGIN_NAME", ""), os.environ.get("NRI_PLUGIN_IDX", "")
