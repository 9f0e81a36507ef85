"""One kubelet connection and its containerd twin (`Link`): frames parsed and routed both ways, a
claimed request held until it is whole and handed to the call handler (its rewrite `start`ed at once),
a refusal answered, a finished call reported."""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
import time
from collections.abc import Coroutine, Generator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import grpc

from crihook.proxy.flow import RuntimeWindow
from crihook.proxy.frames import (
    ACK,
    CANCEL,
    CANCELLED_STATUS,
    CONTINUATION,
    DATA,
    DEFAULT_MAX_FRAME,
    END_HEADERS,
    END_STREAM,
    FRAME_HEADER,
    GOAWAY,
    HEADERS,
    PADDED,
    PREFACE,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    RST_STREAM,
    SETTINGS,
    SETTINGS_HEADER_TABLE_SIZE,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_FRAME_SIZE,
    STATUS_CODES,
    UNKNOWN_STATUS,
    WINDOW_UPDATE,
    ProtocolViolation,
    bad_frame,
    frame,
    grpc_error_headers,
    grpc_message,
    payload,
    settings,
    wire_status,
)
from crihook.proxy.headers import REQUEST_HEADERS, STATUS_HEADERS, HeaderBlocks, deadline_of
from crihook.proxy.stream import C, Rejected, Stream

if TYPE_CHECKING:
    from crihook.proxy.relay import Relay

log = logging.getLogger("crihook.proxy")

T = TypeVar("T")


def start(coro: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
    """`coro` run at once up to its first wait: the future is done already when it never waited, else
    a task finishes it. Python 3.12 has this as an eager task, and needs it: from 3.12 on,
    `asyncio.wait_for` (a hook's timeout) refuses to run outside a task, and a frame callback is
    outside any. 3.11 has no eager tasks, so there the first step runs bare and a task drives the rest."""
    loop = asyncio.get_running_loop()
    if sys.version_info >= (3, 12):
        return asyncio.Task(coro, loop=loop, eager_start=True)
    try:
        waiting = coro.send(None)
    except StopIteration as done:
        finished: asyncio.Future[T] = loop.create_future()
        finished.set_result(done.value)
        return finished
    return loop.create_task(_Rest(coro, waiting).run())


class _Rest(Generic[T]):
    """A coroutine past its first step, waiting on `waiting`, driven on by a task: the task's sends
    (always None, asyncio's protocol) and throws (a cancellation) go to the coroutine."""

    def __init__(self, coro: Coroutine[Any, Any, T], waiting: Any) -> None:
        self.coro = coro
        self.waiting = waiting

    async def run(self) -> T:
        return await self

    def __await__(self) -> Generator[Any, None, T]:
        waiting = self.waiting
        while True:
            try:
                yield waiting
            except BaseException as e:
                step = functools.partial(self.coro.throw, e)
            else:
                step = functools.partial(self.coro.send, None)
            try:
                waiting = step()
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]


class Link(Generic[C]):
    """One kubelet connection and its containerd twin: frames parsed and routed both ways."""

    def __init__(self, relay: Relay[C], down: asyncio.Transport) -> None:
        self.relay = relay
        self.down = down
        self.up: asyncio.Transport | None = None
        self.dbuf = b""
        self.ubuf = b""
        self.preface = False
        self.requests = HeaderBlocks(REQUEST_HEADERS, "request")
        self.responses = HeaderBlocks(STATUS_HEADERS, "response")
        self.streams: dict[int, Stream[C]] = {}  # the claimed ones
        self.active: dict[int, tuple[bytes, float]] = {}  # stream -> (path, start)
        self.flow: RuntimeWindow[C] = RuntimeWindow()
        self.down_max_frame = DEFAULT_MAX_FRAME  # largest frame kubelet accepts (what containerd may send)
        self.dead: set[int] = set()  # refused streams whose remaining request DATA is dropped
        self.closed = False

    # -- lifecycle ---------------------------------------------------------------------------

    async def connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            up, _ = await asyncio.wait_for(
                loop.create_unix_connection(lambda: _UpProtocol(self), self.relay.backend_path),
                self.relay.connect_timeout,
            )
        except (OSError, TimeoutError) as e:
            # kubelet sees the connection drop and its call fails UNAVAILABLE at once.
            log.warning("runtime unreachable", extra={"backend": self.relay.backend_path, "error": str(e)})
            self.close()
            return
        if self.closed:
            up.close()
            return
        self.up = self.flow.up = up
        if self.dbuf:
            data, self.dbuf = self.dbuf, b""
            self.down_data(data)
        self.down.resume_reading()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for stream in self.streams.values():
            if stream.task is not None:
                stream.task.cancel()
        self.streams.clear()
        self.active.clear()
        self.down.close()
        if self.up is not None:
            self.up.close()
        self.relay.links.discard(self)
        self.relay.check_idle()

    def protocol_error(self, why: str) -> None:
        log.warning("closing connection on protocol error", extra={"error": why})
        if self.up is not None and not self.closed:
            self.down.write(frame(GOAWAY, 0, 0, (0).to_bytes(4, "big") + PROTOCOL_ERROR.to_bytes(4, "big")))
        self.close()

    # -- kubelet -> containerd ---------------------------------------------------------------

    def down_data(self, data: bytes) -> None:
        if self.closed:
            return
        up = self.up
        if up is None:
            self.dbuf += data
            return
        buf = self.dbuf + data if self.dbuf else data
        pos = 0
        if not self.preface:
            if len(buf) < 24:
                self.dbuf = buf
                return
            if buf[:24] != PREFACE:
                self.protocol_error("not an HTTP/2 client (bad preface)")
                return
            self.preface = True
            pos = 24  # forwarded with the frames after it
        n = len(buf)
        out: list[bytes] = []
        run = 0  # start of frames copied verbatim, not yet emitted
        refund = 0
        stream_refunds: list[bytes] = []
        complete: list[tuple[int, Stream[C]]] | None = None  # held requests now whole: pre runs once the batch is out
        streams = self.streams
        flow = self.flow
        while n - pos >= 9:
            hi, lo, ftype, flags, sid = FRAME_HEADER.unpack_from(buf, pos)
            length = (hi << 8) | lo
            end = pos + 9 + length
            if length > flow.max_frame or (end <= n and flags & (PADDED | PRIORITY_FLAG)):
                bad = bad_frame(buf, pos, length, ftype, flags, flow.max_frame)
                if bad is not None:
                    self.protocol_error(bad)
                    return
            if end > n:
                break
            if ftype == DATA:
                sid &= 0x7FFFFFFF
                stream = streams.get(sid) if streams else None
                if sid in self.dead or (stream is not None and stream.modifies):
                    if run < pos:
                        out.append(buf[run:pos])
                    run = end
                    refund += length
                    if stream is None:  # rest of a refused request
                        if flags & END_STREAM:
                            self.dead.discard(sid)
                    else:
                        stream.request += payload(buf, pos + 9, end, flags)
                        if len(stream.request) > self.relay.max_message + 5:
                            stream.request_done = bool(flags & END_STREAM)  # else the rest is dropped
                            self.reject(
                                sid,
                                grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"request larger than {self.relay.max_message} bytes",
                            )
                        elif flags & END_STREAM:
                            stream.request_done = True
                            if complete is None:  # a pass-through read makes no list
                                complete = []
                            complete.append((sid, stream))
                        elif length:
                            stream_refunds.append(frame(WINDOW_UPDATE, 0, sid, length.to_bytes(4, "big")))
                    pos = end
                    continue
                if stream is not None:
                    stream.request += payload(buf, pos + 9, end, flags)
                if flow.queue or flow.window < length:
                    if run < pos:
                        out.append(buf[run:pos])
                    run = end
                    flow.queue.append(buf[pos:end])
                else:
                    flow.window -= length
            elif ftype in (HEADERS, CONTINUATION):
                requests = self.requests
                try:
                    found = requests.feed(buf, pos, end, ftype)
                except ProtocolViolation as e:
                    self.protocol_error(str(e))
                    return
                if found is not None:
                    sid = requests.sid
                    path = found.get(b":path")
                    # without a :path, or on a stream already open: trailers, nothing to learn
                    if path is not None and sid not in self.active:
                        self.active[sid] = (path, time.perf_counter())
                        call = self.relay.handler.classify(path)
                        if call is not None:
                            self.claim(sid, path, call, found)
            elif ftype == RST_STREAM:
                sid &= 0x7FFFFFFF
                self.dead.discard(sid)
                self.stream_done(sid, CANCELLED_STATUS, None)
            elif ftype == SETTINGS and not flags & ACK:
                for ident, value in settings(buf, pos + 9, end):
                    if ident == SETTINGS_HEADER_TABLE_SIZE:
                        self.responses.hpack.limit = value
                    elif ident == SETTINGS_MAX_FRAME_SIZE:
                        # never below what was allowed before: frames sent before the ACK stay legal
                        self.down_max_frame = max(self.down_max_frame, value)
            pos = end
        self.dbuf = buf[pos:]
        if run < pos:
            out.append(buf if run == 0 and pos == n else buf[run:pos])
        if complete:
            # a request answered at once goes out behind the frames read before it (its HEADERS among
            # them) in the same write: one send, and containerd reads the call whole
            flow.held = out
            try:
                for sid, stream in complete:
                    if self.streams.get(sid) is stream:  # not reset by a later frame of the batch
                        self.request_complete(sid, stream)
            finally:
                flow.held = None
        if out:
            up.write(out[0] if len(out) == 1 else b"".join(out))
        # kubelet's windows back for what was held: after the forward, which nothing here waits for
        if refund:
            stream_refunds.append(frame(WINDOW_UPDATE, 0, 0, refund.to_bytes(4, "big")))
        if stream_refunds and not self.closed:
            self.down.write(b"".join(stream_refunds))

    def claim(self, sid: int, path: bytes, call: C, headers: dict[bytes, bytes]) -> None:
        """A new stream the handler claimed: its bodies are copied (and held, when it modifies)."""
        stream = Stream(call, path, call.modifies, bytearray(), bytearray(), send_window=self.flow.initial)
        if stream.modifies:
            stream.deadline = deadline_of(headers.get(b"grpc-timeout"))
        self.streams[sid] = stream

    def request_complete(self, sid: int, stream: Stream[C]) -> None:
        """A held request is whole, and the frames read before it are on their way to containerd
        (its HEADERS among them). The handler's rewrite starts at once: when no hook has to wait
        (the common case) the rewritten request joins those frames in one write, with no task and no
        loop turn; otherwise the rest runs as a task."""
        message = grpc_message(stream.request)
        if message is None:
            refusal = Rejected(
                grpc.StatusCode.UNIMPLEMENTED, "crihook can not inspect a compressed or malformed request"
            )
            self.pre_failed(sid, stream, refusal)
            return
        running = start(self.run_pre(sid, stream, message))
        if not running.done():
            stream.task = running

    async def run_pre(self, sid: int, stream: Stream[C], message: bytes) -> None:
        try:
            rewritten = await self.relay.handler.rewrite(stream.call, message, stream.deadline)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.pre_failed(sid, stream, e)
            return
        if self.streams.get(sid) is not stream or self.closed:
            return  # kubelet gave up meanwhile
        stream.task = None
        self.forward(sid, stream, rewritten)

    def pre_failed(self, sid: int, stream: Stream[C], e: Exception) -> None:
        """A refusal answers kubelet with its status; a failure of the handler itself refuses the call
        rather than forward it unchecked."""
        if isinstance(e, Rejected):
            refusal = e
        else:
            log.error("interceptor failed", exc_info=e, extra={"method": stream.path.decode()})
            refusal = Rejected(grpc.StatusCode.INTERNAL, f"crihook: {type(e).__name__}: {e}")
        if self.streams.get(sid) is stream:
            self.reject(sid, refusal.code, refusal.message)

    def forward(self, sid: int, stream: Stream[C], rewritten: bytes) -> None:
        stream.request = rewritten
        stream.out = memoryview(b"\x00" + len(rewritten).to_bytes(4, "big") + rewritten)
        self.flow.pump(sid, stream)

    def reject(self, sid: int, code: grpc.StatusCode, message: str) -> None:
        stream = self.streams.pop(sid, None)
        if stream is not None and stream.task is not None and stream.task is not asyncio.current_task():
            stream.task.cancel()
        entry = self.active.pop(sid, None)
        self.relay.count(entry[0] if entry else b"?", wire_status(code))
        if stream is not None and not stream.request_done:
            self.dead.add(sid)
        self.down.write(frame(HEADERS, END_STREAM | END_HEADERS, sid, grpc_error_headers(code, message)))
        if self.up is not None:
            self.flow.write(frame(RST_STREAM, 0, sid, CANCEL.to_bytes(4, "big")))
        self.relay.check_idle()

    # -- containerd -> kubelet ---------------------------------------------------------------

    def up_data(self, data: bytes) -> None:
        if self.closed or self.down.is_closing():
            self.close()  # kubelet is gone: what the runtime still sends has nowhere to go
            return
        buf = self.ubuf + data if self.ubuf else data
        n = len(buf)
        pos = 0
        out: list[bytes] = []
        run = 0
        streams = self.streams
        # header blocks and resets, read once kubelet has the batch: what the relay learns from them
        # (a call's status, its end) is bookkeeping no answer should wait for
        learn: list[tuple[int, int, int]] = []
        while n - pos >= 9:
            hi, lo, ftype, flags, sid = FRAME_HEADER.unpack_from(buf, pos)
            length = (hi << 8) | lo
            end = pos + 9 + length
            if length > self.down_max_frame or (end <= n and flags & (PADDED | PRIORITY_FLAG)):
                bad = bad_frame(buf, pos, length, ftype, flags, self.down_max_frame)
                if bad is not None:
                    self.protocol_error(f"from the runtime: {bad}")
                    return
            if end > n:
                break
            if ftype == DATA:
                if streams:
                    stream = streams.get(sid & 0x7FFFFFFF)
                    if stream is not None:
                        stream.response += payload(buf, pos + 9, end, flags)
            elif ftype in (HEADERS, CONTINUATION, RST_STREAM):
                learn.append((pos, end, ftype))
            elif ftype == WINDOW_UPDATE:
                if learn:  # an update may send held DATA: the calls ended before it must be over first
                    if not self.learn(buf, learn):
                        return
                    learn.clear()
                sid &= 0x7FFFFFFF
                inc = int.from_bytes(buf[pos + 9 : pos + 13], "big") & 0x7FFFFFFF
                if sid == 0:
                    passed = self.flow.connection_update(inc, streams)
                    if passed is not None:  # kubelet is told less: the rest paid back skew
                        if run < pos:
                            out.append(buf[run:pos])
                        run = end
                        if passed:
                            out.append(frame(WINDOW_UPDATE, 0, 0, passed.to_bytes(4, "big")))
                else:
                    stream = streams.get(sid)
                    if stream is not None and stream.modifies:
                        stream.send_window += inc
                        if run < pos:
                            out.append(buf[run:pos])
                        run = end
                        if stream.out is not None:
                            self.flow.pump(sid, stream)
            elif ftype == SETTINGS and not flags & ACK:
                self.up_settings(buf, pos + 9, end)
            pos = end
        self.ubuf = buf[pos:]
        if run < pos:
            out.append(buf if run == 0 and pos == n else buf[run:pos])
        if out:
            self.down.write(out[0] if len(out) == 1 else b"".join(out))
        if learn:
            self.learn(buf, learn)

    def learn(self, buf: bytes, frames: list[tuple[int, int, int]]) -> bool:
        """The runtime's header blocks (through HPACK, in order) and resets of a batch already
        forwarded: trailers and resets end their calls. False: a block broke HPACK and the link is
        closed."""
        responses = self.responses
        for pos, end, ftype in frames:
            if ftype == RST_STREAM:
                self.stream_done(int.from_bytes(buf[pos + 5 : pos + 9], "big") & 0x7FFFFFFF, CANCELLED_STATUS, None)
                continue
            try:
                found = responses.feed(buf, pos, end, ftype)
            except ProtocolViolation as e:
                self.protocol_error(f"from the runtime: {e}")
                return False
            if found is not None and responses.ends_stream:  # trailers: the call is over
                self.stream_done(responses.sid, found.get(b"grpc-status", UNKNOWN_STATUS), found.get(b"grpc-message"))
        return True

    def up_settings(self, buf: bytes, start: int, end: int) -> None:
        flow = self.flow
        for ident, value in settings(buf, start, end):
            if ident == SETTINGS_INITIAL_WINDOW_SIZE:
                delta = value - flow.initial
                flow.initial = value
                for stream in self.streams.values():
                    stream.send_window += delta
            elif ident == SETTINGS_MAX_FRAME_SIZE:
                flow.max_frame = max(flow.max_frame, value)
            elif ident == SETTINGS_HEADER_TABLE_SIZE:
                self.requests.hpack.limit = value

    def stream_done(self, sid: int, status: bytes, message: bytes | None) -> None:
        entry = self.active.pop(sid, None)
        stream = self.streams.pop(sid, None)
        if entry is not None:
            path, started = entry
            self.relay.count(path, status, time.perf_counter() - started)
        if stream is not None:
            if stream.task is not None:
                stream.task.cancel()
            elif stream.request_done or not stream.modifies:
                code = STATUS_CODES.get(status, grpc.StatusCode.UNKNOWN)
                req = grpc_message(stream.request) if not stream.modifies else bytes(stream.request)
                self.relay.post(stream.call, req or b"", grpc_message(stream.response), code, message)
        if not self.active:
            self.relay.check_idle()


class _UpProtocol(asyncio.Protocol):
    __slots__ = ("link",)

    def __init__(self, link: Link[Any]) -> None:
        self.link = link

    def data_received(self, data: bytes) -> None:
        self.link.up_data(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.link.close()

    def pause_writing(self) -> None:
        self.link.down.pause_reading()

    def resume_writing(self) -> None:
        if not self.link.closed:
            self.link.down.resume_reading()
