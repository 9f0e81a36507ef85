"""The runtime's side of an NRI connection, for what a real containerd never sends: broken frames,
errors on demand, a connection cut at a chosen point. It follows containerd/nri's
pkg/adaptation/plugin.go: accept, wait for RegisterPlugin on conn 2, then call the plugin on conn 1
(Configure, Synchronize, events), one ttrpc client stream id (odd) per call. It reads each logical
connection as the runtime does (`GoReader`): a frame the runtime's reader would refuse ends the
connection here too."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from google.protobuf.message import Message

from crihook.nri import mux, ttrpc
from crihook.nri.ttrpc import Frame, MessageType
from crihook.proto import nri_v1alpha1_pb2 as api
from crihook.proto import ttrpc_pb2

PLUGIN_SERVICE = "nri.pkg.api.v1alpha1.Plugin"
M = TypeVar("M", bound=Message)


class Enomem(OSError):
    """What NRI's multiplexer answers a read whose buffer is shorter than the frame at hand."""


class GoReader:
    """ttrpc's `channel.recv` over one of NRI's multiplexed connections, frame by frame: a 10-byte
    header, then the payload, each read with `io.ReadFull` through a 4096-byte `bufio.Reader`
    (ttrpc channel.go). bufio reads the connection only when it holds nothing: straight into the
    caller's buffer when that is at least 4096 bytes long, else into its own 4096 bytes; the
    multiplexer's `conn.Read` hands over one whole frame, or fails with ENOMEM when it does not fit
    (pkg/net/multiplex/mux.go)."""

    BUFFER = 4096

    def __init__(self) -> None:
        self._need = ttrpc.HEADER_LEN
        self._got = bytearray()
        self._header: tuple[int, int, int] | None = None  # (stream, type, flags) of the payload being read

    def push(self, frame: bytes) -> list[Frame]:
        """One frame read from the connection: the messages it completes."""
        into = self._need - len(self._got)
        room = into if into >= self.BUFFER else self.BUFFER
        if len(frame) > room:
            raise Enomem(f"frame of {len(frame)} bytes read into a {room}-byte buffer")
        out: list[Frame] = []
        buffered = memoryview(frame)
        while True:
            take = min(self._need - len(self._got), len(buffered))
            self._got += buffered[:take]
            buffered = buffered[take:]
            if len(self._got) < self._need:
                return out
            if self._header is None:
                length, stream, kind, flags = ttrpc.HEADER.unpack(self._got)
                self._header, self._need = (stream, kind, flags), length
            else:
                stream, kind, flags = self._header
                out.append(Frame(stream, kind, bytes(self._got), flags))
                self._header, self._need = None, ttrpc.HEADER_LEN
            self._got = bytearray()
            if not buffered and self._header is None:
                return out


@dataclass
class Peer:
    """One accepted plugin connection."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    requests: asyncio.Queue[tuple[int, ttrpc_pb2.Request]] = field(default_factory=asyncio.Queue)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    closed_by: BaseException | None = None  # what made the runtime close the connection, if it did
    _pending: dict[int, asyncio.Future[ttrpc_pb2.Response]] = field(default_factory=dict)
    _next: int = 1
    _reading: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._reading = asyncio.create_task(self._read())

    async def _read(self) -> None:
        demux = mux.Decoder()
        decoders = {mux.PLUGIN_CONN: GoReader(), mux.RUNTIME_CONN: GoReader()}
        try:
            while data := await self.reader.read(65536):
                for conn, payload in demux.feed(data):
                    for frame in decoders[conn].push(payload):
                        if conn == mux.RUNTIME_CONN:
                            assert frame.type == MessageType.REQUEST
                            await self.requests.put((frame.stream_id, ttrpc_pb2.Request.FromString(frame.payload)))
                        else:
                            assert frame.type == MessageType.RESPONSE
                            waiter = self._pending.pop(frame.stream_id, None)
                            if waiter is not None:  # else an answer to a call the test sent raw
                                waiter.set_result(ttrpc_pb2.Response.FromString(frame.payload))
        except Enomem as e:  # ttrpc takes a read error as the connection's end; the runtime closes the plugin
            self.closed_by = e
            self.writer.close()
        except (ConnectionError, OSError):
            pass
        finally:
            self.closed.set()
            for waiter in self._pending.values():
                if not waiter.done():
                    waiter.set_exception(ConnectionResetError("plugin closed the connection"))

    def send_raw(self, data: bytes) -> None:
        self.writer.write(data)

    def send(self, conn: int, frame: Frame) -> None:
        self.send_raw(mux.encode(conn, ttrpc.encode(frame)))

    async def register(self) -> api.RegisterPluginRequest:
        """Take the plugin's RegisterPlugin and answer it."""
        stream, req = await asyncio.wait_for(self.requests.get(), 10)
        assert (req.service, req.method) == ("nri.pkg.api.v1alpha1.Runtime", "RegisterPlugin"), req
        self.reply(stream, api.Empty())
        return api.RegisterPluginRequest.FromString(req.payload)

    def reply(self, stream: int, message: Message | None = None, code: int = 0, text: str = "") -> None:
        response = ttrpc_pb2.Response(payload=message.SerializeToString() if message is not None else b"")
        if code:
            response.status.code, response.status.message = code, text
        self.send(mux.RUNTIME_CONN, Frame(stream, MessageType.RESPONSE, response.SerializeToString()))

    async def call_raw(
        self, method: str, payload: bytes, service: str = PLUGIN_SERVICE, timeout_nano: int = 0
    ) -> ttrpc_pb2.Response:
        stream, self._next = self._next, self._next + 2
        waiter: asyncio.Future[ttrpc_pb2.Response] = asyncio.get_running_loop().create_future()
        self._pending[stream] = waiter
        request = ttrpc_pb2.Request(service=service, method=method, payload=payload, timeout_nano=timeout_nano)
        self.send(mux.PLUGIN_CONN, Frame(stream, MessageType.REQUEST, request.SerializeToString()))
        return await asyncio.wait_for(waiter, 10)

    async def call(self, method: str, request: Message, reply: type[M]) -> M:
        response = await self.call_raw(method, request.SerializeToString())
        assert response.status.code == 0, response.status
        return reply.FromString(response.payload)

    async def handshake(
        self, *sync_chunks: api.SynchronizeRequest, runtime: tuple[str, str] = ("fake", "0.0")
    ) -> api.ConfigureResponse:
        """Register, Configure, Synchronize, as the runtime does for a new plugin; `runtime`: the
        name and version Configure reports."""
        await self.register()
        name, version = runtime
        configured = await self.call(
            "Configure", api.ConfigureRequest(runtime_name=name, runtime_version=version), api.ConfigureResponse
        )
        for chunk in sync_chunks or (api.SynchronizeRequest(),):
            await self.call("Synchronize", chunk, api.SynchronizeResponse)
        return configured

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()
        if self._reading is not None:
            await self._reading

    async def create_container(
        self, request: api.CreateContainerRequest, events: int, *later: api.ContainerAdjustment
    ) -> tuple[api.ContainerAdjustment, ttrpc_pb2.Response | None]:
        """CreateContainer as NRI v0.10+ runs it (pkg/adaptation/adaptation.go): the plugin's answer,
        then those of plugins with a higher index (`later`), merged; then, when the plugin subscribed
        to VALIDATE_CONTAINER_ADJUSTMENT (`events`, its Configure answer), the merged adjustment
        handed to it with the container as it was before any plugin. The merged adjustment, and the
        validation's raw response (None when not asked)."""
        original = api.Container()
        original.CopyFrom(request.container)
        answer = await self.call("CreateContainer", request, api.CreateContainerResponse)
        merged = merge(answer.adjust, *later)
        if not events & (1 << (api.VALIDATE_CONTAINER_ADJUSTMENT - 1)):
            return merged, None
        validate = api.ValidateContainerAdjustmentRequest(pod=request.pod, container=original, adjust=merged)
        validate.plugins.add(name="crihook", index="10")
        validate.plugins.add(name="later", index="90")
        return merged, await self.call_raw("ValidateContainerAdjustment", validate.SerializeToString())


class Conflict(Exception):
    """Two plugins set the same env variable, device path or CDI device: NRI fails the creation."""


def merge(*adjusts: api.ContainerAdjustment) -> api.ContainerAdjustment:
    """Plugins' adjustments merged in call order as NRI v0.10's result.go merges the fields crihook
    uses: env, device nodes and CDI devices claimed by key (owners.go: a second plugin setting one
    fails the creation), device-cgroup rules appended."""
    out = api.ContainerAdjustment()
    env: dict[str, str] = {}
    devices: dict[str, api.LinuxDevice] = {}
    owner: dict[tuple[str, str], int] = {}

    def claim(field: str, key: str, plugin: int) -> None:
        if owner.setdefault((field, key), plugin) != plugin:
            raise Conflict(f"plugin {plugin} set {field} {key}, owned by plugin {owner[field, key]}")

    for plugin, adj in enumerate(adjusts):
        for kv in adj.env:
            claim("env", kv.key, plugin)
            env[kv.key] = kv.value
        for d in adj.linux.devices:
            claim("device", d.path, plugin)
            devices[d.path] = d
        for c in adj.CDI_devices:
            claim("CDI device", c.name, plugin)
            out.CDI_devices.append(c)
        out.linux.resources.devices.extend(adj.linux.resources.devices)
        out.annotations.update(adj.annotations)
        out.mounts.extend(adj.mounts)
    out.env.extend(api.KeyValue(key=k, value=v) for k, v in env.items())
    out.linux.devices.extend(devices.values())
    return out


def spec_rules(container: api.Container, adjust: api.ContainerAdjustment) -> list[api.LinuxDeviceCgroup]:
    """The device-cgroup rules of the spec NRI v0.10+ hands runc (pkg/runtime-tools/generate,
    Adjust): the container's, an allow rule per device node added (LinuxDevice.AccessString: rw, rwm
    for a block device), then the adjustment's own rules, in order."""
    rules = list(container.linux.resources.devices)
    for d in adjust.linux.devices:
        rule = api.LinuxDeviceCgroup(allow=True, type=d.type, access="rwm" if d.type == "b" else "rw")
        rule.major.value, rule.minor.value = d.major, d.minor
        rules.append(rule)
    return [*rules, *adjust.linux.resources.devices]


def opens(rules: list[api.LinuxDeviceCgroup], kind: str, major: int, minor: int) -> bool:
    """Whether runc's device cgroup lets the device be read or written: the last rule matching it
    decides (runc's devices emulator), none matching denies."""
    for r in reversed(rules):
        if (
            r.type in ("", "a", kind)
            and (not r.HasField("major") or r.major.value == major)
            and (not r.HasField("minor") or r.minor.value == minor)
        ):
            return r.allow and bool({"r", "w"} & set(r.access or "rwm"))
    return False


class FakeRuntime:
    """A unix socket the plugin dials; `accept()` gives each connection as a Peer."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.peers: asyncio.Queue[Peer] = asyncio.Queue()
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> FakeRuntime:
        self._server = await asyncio.start_unix_server(self._accepted, str(self.path))
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        while not self.peers.empty():
            await self.peers.get_nowait().close()

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = Peer(reader, writer)
        peer.start()
        await self.peers.put(peer)

    async def accept(self) -> Peer:
        """The next connection; a plugin that does not dial within 10 s fails the test."""
        return await asyncio.wait_for(self.peers.get(), 10)
