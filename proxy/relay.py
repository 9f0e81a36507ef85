"""The hot path: an HTTP/2 frame relay between kubelet and containerd.

Each kubelet connection is paired with one containerd connection and frames are copied across
as they are: the connection preface, SETTINGS, PING, GOAWAY, WINDOW_UPDATE and header blocks pass
verbatim, so both ends negotiate with each other and their HPACK contexts stay in step. The relay
reads only what it must: frame headers, and each header block through `Follower` to learn a new
stream's `:path` (and, for a call the call handler may rewrite, its `grpc-timeout`, the deadline hooks
get) and a finished stream's `grpc-status`. Deadlines, status codes, messages and error details are
bytes it never changes; unknown methods and streaming calls need no special case.

A method the call handler (`proxy/intercept.py`) claims is handled per stream:
- observed: forwarded as it goes, with copies of the request and response messages for the
  store and post hooks afterwards;
- modified: the request body is held (kubelet's window refunded as it arrives), pre hooks run,
  and the rewritten message goes to containerd under containerd's flow-control windows; a refusal
  answers kubelet with a trailers-only gRPC error and resets the stream towards containerd.

A rewritten message may be longer than the one kubelet sent, so kubelet's idea of containerd's
connection window can run ahead of the truth by that much (`skew`); the relay swallows that
amount from containerd's next connection WINDOW_UPDATEs and queues any DATA frame kubelet sends
beyond the real window until containerd opens it. Nothing else is buffered.

The parts: `Link` parses frames both ways and routes them; `HeaderBlocks` assembles and reads one
direction's header blocks; `RuntimeWindow` is the flow control towards containerd; `_Stream` is
one claimed stream's state and carries the handler's own per-call state (`call`). gRPC status codes
are `grpc.StatusCode` everywhere above the wire bytes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import struct
import time
from collections import deque
from collections.abc import Coroutine, Generator
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, cast

import grpc

from crihook.base.metrics import BACKEND_SECONDS, CRI_CALLS
from crihook.proxy.hpack import Follower, HpackError, encode_literal

log = logging.getLogger("crihook.proxy")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20
SETTINGS_HEADER_TABLE_SIZE = 1
SETTINGS_INITIAL_WINDOW_SIZE = 4
SETTINGS_MAX_FRAME_SIZE = 5
DEFAULT_WINDOW = 65535
DEFAULT_MAX_FRAME = 16384
CANCEL = 0x8
PROTOCOL_ERROR = 0x1
MAX_HEADER_BLOCK = 1 << 20  # a header block larger than this is an attack, not a CRI call

_FH = struct.Struct(">HBBBI")  # 24-bit length as 16+8 bits, type, flags, stream id
# a request's method, and its deadline for the calls the handler claims
_REQUEST = frozenset((b":path", b"grpc-timeout"))
# grpc-timeout's units (gRPC over HTTP/2: at most 8 digits and one of these)
_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
_STATUS = frozenset((b"grpc-status", b"grpc-message"))


def frame(ftype: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((ftype, flags)) + stream_id.to_bytes(4, "big") + payload


# gRPC status codes as the wire carries them (grpc-status is the decimal code)
_STATUS_CODES: dict[bytes, grpc.StatusCode] = {str(c.value[0]).encode(): c for c in grpc.StatusCode}


def _wire(code: grpc.StatusCode) -> bytes:
    return str(code.value[0]).encode()


_CANCELLED = _wire(grpc.StatusCode.CANCELLED)  # a stream reset by either end
_UNKNOWN = _wire(grpc.StatusCode.UNKNOWN)  # a stream that ended without grpc-status


def grpc_error_headers(code: grpc.StatusCode, message: str) -> bytes:
    """Header block of a trailers-only gRPC error response (grpc-message percent-encoded)."""
    encoded = "".join(
        c if 0x20 <= ord(c) < 0x7F and c != "%" else "".join(f"%{b:02X}" for b in c.encode()) for c in message
    ).encode()
    return encode_literal(
        [
            (b":status", b"200"),
            (b"content-type", b"application/grpc"),
            (b"grpc-status", _wire(code)),
            (b"grpc-message", encoded),
        ]
    )


class Rejected(Exception):
    """Raised by CallHandler.pre: the call is answered with this gRPC status, never forwarded."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class ProtocolViolation(Exception):
    """A peer broke the HTTP/2 framing the relay relies on: the connection goes, with a GOAWAY."""


class Claim(Protocol):
    """What a call handler keeps for one call it claimed; the relay reads only `modifies`."""

    @property
    def modifies(self) -> bool:
        """True: the request is held for `pre`, which may rewrite or refuse it."""


C = TypeVar("C", bound=Claim)
T = TypeVar("T")


class CallHandler(Protocol[C]):
    """What the relay asks about the calls it carries (proxy/intercept.py's `Interceptor`)."""

    def classify(self, path: bytes) -> C | None:
        """The handler's state for a new call to `path`, or None to pass it through untouched."""

    async def rewrite(self, call: C, request: bytes, deadline: float | None) -> bytes:
        """The request to forward, as it came or rewritten. Raises Rejected. `deadline`:
        time.monotonic() by which the client wants its answer (grpc-timeout), if any."""

    def post(
        self, call: C, request: bytes, response: bytes | None, status: grpc.StatusCode, message: bytes | None
    ) -> None:
        """After the call, once the client has its answer: `message` is the grpc-message trailer as
        sent (percent-encoded), if any."""


@dataclass(slots=True)
class _Stream(Generic[C]):
    """One claimed stream: its bodies as they pass, and the handler's state for the call."""

    call: C
    path: bytes
    modifies: bool
    request: bytearray | bytes  # as it arrives; the rewritten message once forwarded
    response: bytearray
    request_done: bool = False
    out: memoryview | None = None  # rewritten request (with gRPC framing) not yet sent
    send_window: int = DEFAULT_WINDOW  # containerd's window for this stream
    task: asyncio.Future[None] | None = None  # the rewrite, while it waits (see start)
    deadline: float | None = None  # time.monotonic(), from the request's grpc-timeout


def _bad_frame(buf: bytes, pos: int, length: int, ftype: int, flags: int, max_frame: int) -> str | None:
    """Why a frame breaks HTTP/2's framing rules the relay relies on (RFC 9113 §4.2, §6.1, §6.2), or
    None. The frame loops call it only for a frame over the size limit or one carrying a padding or
    priority flag (then whole in `buf`), so ordinary frames cost one comparison."""
    if length > max_frame:
        return f"frame of {length} bytes over the peer's SETTINGS_MAX_FRAME_SIZE {max_frame}"
    if ftype in (DATA, HEADERS):
        need = 5 if ftype == HEADERS and flags & PRIORITY_FLAG else 0
        if flags & PADDED:
            if length < 1 or buf[pos + 9] + 1 + need > length:
                return "padding longer than the frame"
        elif need > length:
            return "priority fields past the end of the frame"
    return None


def _payload(buf: bytes, start: int, end: int, flags: int) -> bytes:
    """DATA payload without padding."""
    if flags & PADDED:
        pad = buf[start]
        return buf[start + 1 : end - pad]
    return buf[start:end]


def _grpc_message(body: bytes | bytearray) -> bytes | None:
    """The single message of a unary gRPC body, or None if it is compressed or malformed."""
    if len(body) < 5 or body[0] != 0:
        return None
    n = int.from_bytes(body[1:5], "big")
    if len(body) != 5 + n:
        return None
    return bytes(body[5:])


class HeaderBlocks:
    """One direction's header blocks (RFC 9113 §4.3): a HEADERS frame and its CONTINUATIONs
    assembled into one block, read through that direction's HPACK follower. Requests and responses
    are assembled alike; what the link reads from the headers differs."""

    __slots__ = ("_frag", "ends_stream", "hpack", "sid", "side")

    def __init__(self, wanted: frozenset[bytes], side: str) -> None:
        self.hpack = Follower(wanted)
        self.side = side  # "request" | "response", for protocol errors
        self._frag: bytearray | None = None  # a block waiting for its CONTINUATIONs
        # the block being assembled, or the one `feed` just returned: its stream, and whether its
        # HEADERS frame ended that stream
        self.sid = 0
        self.ends_stream = False

    def feed(self, buf: bytes, pos: int, end: int, ftype: int) -> dict[bytes, bytes] | None:
        """Take the HEADERS or CONTINUATION frame at buf[pos:end]. Returns the wanted headers once
        a block is complete (its stream in `sid`, `ends_stream` set), None while CONTINUATIONs are
        due. Raises ProtocolViolation. Nothing is allocated beyond what HPACK decoding needs: this
        runs for every call the relay carries."""
        flags = buf[pos + 4]
        sid = int.from_bytes(buf[pos + 5 : pos + 9], "big") & 0x7FFFFFFF
        if ftype == HEADERS:
            start = pos + 9
            stop = end
            if flags & PADDED:
                stop -= buf[start]
                start += 1
            if flags & PRIORITY_FLAG:
                start += 5
            self.sid = sid
            self.ends_stream = bool(flags & END_STREAM)
            if not flags & END_HEADERS:
                self._frag = bytearray(buf[start:stop])
                return None
            block = buf[start:stop]
        else:
            frag = self._frag
            if frag is None or sid != self.sid:
                raise ProtocolViolation(f"{self.side} headers: CONTINUATION without HEADERS")
            frag += buf[pos + 9 : end]
            if len(frag) > MAX_HEADER_BLOCK:
                raise ProtocolViolation(f"{self.side} header block too large")
            if not flags & END_HEADERS:
                return None
            block = bytes(frag)
            self._frag = None
        try:
            return self.hpack.decode(block)
        except HpackError as e:
            raise ProtocolViolation(f"{self.side} headers: {e}") from None


class RuntimeWindow(Generic[C]):
    """Flow control towards containerd for the DATA the relay holds back or makes itself (RFC 9113
    §6.9). kubelet's DATA passes verbatim while it fits containerd's connection window as the relay
    has used it (`window`); beyond that it waits in `queue`. A rewritten request goes out in frames
    that fit both windows (`pump`). `skew`: how far kubelet's idea of that window runs ahead of the
    truth (a rewrite longer than kubelet's request), swallowed from containerd's next updates."""

    __slots__ = ("held", "initial", "max_frame", "queue", "skew", "up", "window")

    def __init__(self) -> None:
        self.up: asyncio.Transport | None = None
        self.window = DEFAULT_WINDOW
        self.initial = DEFAULT_WINDOW  # containerd's SETTINGS_INITIAL_WINDOW_SIZE: a new stream's window
        self.max_frame = DEFAULT_MAX_FRAME  # largest frame containerd accepts (what kubelet may send)
        self.skew = 0
        self.queue: deque[bytes] = deque()
        # while not None, what is written to containerd is gathered here, for one write (Link.down_data)
        self.held: list[bytes] | None = None

    def write(self, data: bytes) -> None:
        if self.held is not None:
            self.held.append(data)
        else:
            assert self.up is not None
            self.up.write(data)

    def pump(self, sid: int, stream: _Stream[C]) -> None:
        """Send what is left of a rewritten request within containerd's windows."""
        out = stream.out
        assert out is not None and self.up is not None
        chunks = []
        while out:
            n = min(len(out), self.max_frame, self.window, stream.send_window)
            if n <= 0 and len(out):
                break
            last = n == len(out)
            chunks.append(frame(DATA, END_STREAM if last else 0, sid, bytes(out[:n])))
            out = out[n:]
            self.window -= n
            stream.send_window -= n
            self.skew += n
        stream.out = out if out else None
        if chunks:
            self.write(b"".join(chunks))

    def connection_update(self, inc: int, streams: dict[int, _Stream[C]]) -> int | None:
        """containerd opened its connection window by `inc`: send what waited for it. Returns None
        to pass containerd's WINDOW_UPDATE to kubelet as it is, or the increment kubelet is told
        instead (0: none) while skew is being paid back."""
        self.window += inc
        passed = None
        if self.skew > 0:
            take = min(self.skew, inc)
            self.skew -= take
            passed = inc - take
        self.opened(streams)
        return passed

    def opened(self, streams: dict[int, _Stream[C]]) -> None:
        queue = self.queue
        if queue:
            out = []
            while queue and len(queue[0]) - 9 <= self.window:
                f = queue.popleft()
                self.window -= len(f) - 9
                out.append(f)
            if out:
                self.write(b"".join(out))
        for sid, stream in list(streams.items()):
            if stream.out is not None:
                self.pump(sid, stream)


MAX_METHOD_LABELS = 512  # a client inventing method names must not grow the metrics without bound


def start(coro: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
    """`coro` run at once up to its first wait, as Python 3.12's eager tasks run: the future is done
    already when it never waited (and no task was made), else a task finishes it."""
    loop = asyncio.get_running_loop()
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
        self.requests = HeaderBlocks(_REQUEST, "request")
        self.responses = HeaderBlocks(_STATUS, "response")
        self.streams: dict[int, _Stream[C]] = {}  # the claimed ones
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
        complete: list[tuple[int, _Stream[C]]] | None = None  # held requests now whole: pre runs once the batch is out
        streams = self.streams
        flow = self.flow
        while n - pos >= 9:
            hi, lo, ftype, flags, sid = _FH.unpack_from(buf, pos)
            length = (hi << 8) | lo
            end = pos + 9 + length
            if length > flow.max_frame or (end <= n and flags & (PADDED | PRIORITY_FLAG)):
                bad = _bad_frame(buf, pos, length, ftype, flags, flow.max_frame)
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
                        stream.request += _payload(buf, pos + 9, end, flags)
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
                    stream.request += _payload(buf, pos + 9, end, flags)
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
                self.stream_done(sid, _CANCELLED, None)
            elif ftype == SETTINGS and not flags & ACK:
                for ident, value in _settings(buf, pos + 9, end):
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
        stream = _Stream(call, path, call.modifies, bytearray(), bytearray(), send_window=self.flow.initial)
        if stream.modifies:
            stream.deadline = deadline_of(headers.get(b"grpc-timeout"))
        self.streams[sid] = stream

    def request_complete(self, sid: int, stream: _Stream[C]) -> None:
        """A held request is whole, and the frames read before it are on their way to containerd
        (its HEADERS among them). The handler's rewrite starts at once: when no hook has to wait
        (the common case) the rewritten request joins those frames in one write, with no task and no
        loop turn; otherwise the rest runs as a task."""
        message = _grpc_message(stream.request)
        if message is None:
            refusal = Rejected(
                grpc.StatusCode.UNIMPLEMENTED, "crihook can not inspect a compressed or malformed request"
            )
            self.pre_failed(sid, stream, refusal)
            return
        running = start(self.run_pre(sid, stream, message))
        if not running.done():
            stream.task = running

    async def run_pre(self, sid: int, stream: _Stream[C], message: bytes) -> None:
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

    def pre_failed(self, sid: int, stream: _Stream[C], e: Exception) -> None:
        """A refusal answers kubelet with its status; a failure of the handler itself refuses the call
        rather than forward it unchecked."""
        if isinstance(e, Rejected):
            refusal = e
        else:
            log.error("interceptor failed", exc_info=e, extra={"method": stream.path.decode()})
            refusal = Rejected(grpc.StatusCode.INTERNAL, f"crihook: {type(e).__name__}: {e}")
        if self.streams.get(sid) is stream:
            self.reject(sid, refusal.code, refusal.message)

    def forward(self, sid: int, stream: _Stream[C], rewritten: bytes) -> None:
        stream.request = rewritten
        stream.out = memoryview(b"\x00" + len(rewritten).to_bytes(4, "big") + rewritten)
        self.flow.pump(sid, stream)

    def reject(self, sid: int, code: grpc.StatusCode, message: str) -> None:
        stream = self.streams.pop(sid, None)
        if stream is not None and stream.task is not None and stream.task is not asyncio.current_task():
            stream.task.cancel()
        entry = self.active.pop(sid, None)
        self.relay.count(entry[0] if entry else b"?", _wire(code))
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
            hi, lo, ftype, flags, sid = _FH.unpack_from(buf, pos)
            length = (hi << 8) | lo
            end = pos + 9 + length
            if length > self.down_max_frame or (end <= n and flags & (PADDED | PRIORITY_FLAG)):
                bad = _bad_frame(buf, pos, length, ftype, flags, self.down_max_frame)
                if bad is not None:
                    self.protocol_error(f"from the runtime: {bad}")
                    return
            if end > n:
                break
            if ftype == DATA:
                if streams:
                    stream = streams.get(sid & 0x7FFFFFFF)
                    if stream is not None:
                        stream.response += _payload(buf, pos + 9, end, flags)
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
                self.stream_done(int.from_bytes(buf[pos + 5 : pos + 9], "big") & 0x7FFFFFFF, _CANCELLED, None)
                continue
            try:
                found = responses.feed(buf, pos, end, ftype)
            except ProtocolViolation as e:
                self.protocol_error(f"from the runtime: {e}")
                return False
            if found is not None and responses.ends_stream:  # trailers: the call is over
                self.stream_done(responses.sid, found.get(b"grpc-status", _UNKNOWN), found.get(b"grpc-message"))
        return True

    def up_settings(self, buf: bytes, start: int, end: int) -> None:
        flow = self.flow
        for ident, value in _settings(buf, start, end):
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
                code = _STATUS_CODES.get(status, grpc.StatusCode.UNKNOWN)
                req = _grpc_message(stream.request) if not stream.modifies else bytes(stream.request)
                self.relay.post(stream.call, req or b"", _grpc_message(stream.response), code, message)
        if not self.active:
            self.relay.check_idle()


def deadline_of(timeout: bytes | None) -> float | None:
    """time.monotonic() at which a call whose grpc-timeout header is `timeout` runs out; None
    without one or with one that breaks the format (the runtime judges that, not crihook)."""
    if timeout is None or not 2 <= len(timeout) <= 9 or not timeout[:-1].isdigit():
        return None
    unit = _TIMEOUT_UNITS.get(timeout[-1:])
    return None if unit is None else time.monotonic() + int(timeout[:-1]) * unit


def _settings(buf: bytes, start: int, end: int) -> list[tuple[int, int]]:
    return [
        (int.from_bytes(buf[i : i + 2], "big"), int.from_bytes(buf[i + 2 : i + 6], "big"))
        for i in range(start, end - 5, 6)
    ]


class _DownProtocol(asyncio.Protocol):
    __slots__ = ("link", "relay")

    def __init__(self, relay: Relay[Any]) -> None:
        self.relay = relay
        self.link: Link[Any] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        down = cast(asyncio.Transport, transport)
        down.pause_reading()
        self.link = Link(self.relay, down)
        self.relay.links.add(self.link)
        asyncio.get_running_loop().create_task(self.link.connect())

    def data_received(self, data: bytes) -> None:
        self.link.down_data(data)  # type: ignore[union-attr]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.link is not None:
            self.link.close()

    def pause_writing(self) -> None:
        if self.link is not None and self.link.up is not None:
            self.link.up.pause_reading()

    def resume_writing(self) -> None:
        if self.link is not None and self.link.up is not None:
            self.link.up.resume_reading()


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


class Relay(Generic[C]):
    """Accepts kubelet connections on a unix socket and pairs each with a runtime connection."""

    def __init__(
        self,
        backend_path: str,
        handler: CallHandler[C],
        max_message: int = 16 << 20,
        connect_timeout: float = 5.0,
    ) -> None:
        self.backend_path = backend_path
        self.handler = handler
        self.max_message = max_message
        self.connect_timeout = connect_timeout
        self.links: set[Link[C]] = set()
        self._labels: dict[tuple[bytes, bytes], tuple[str, str]] = {}
        self._idle = asyncio.Event()
        self._draining = False
        self.server: asyncio.AbstractServer | None = None

    def post(
        self, call: C, request: bytes, response: bytes | None, status: grpc.StatusCode, message: bytes | None
    ) -> None:
        """The handler's `post` for a finished call; one call's bookkeeping failing must not cost the
        link or the other calls theirs."""
        try:
            self.handler.post(call, request, response, status, message)
        except Exception:
            log.exception("call handler's post failed")

    def count(self, path: bytes, status: bytes, seconds: float | None = None) -> None:
        """Metrics for one finished call; label strings are made once per (method, code)."""
        key = (path, status)
        labels = self._labels.get(key)
        if labels is None:
            method = path.decode("latin-1") if len(self._labels) < MAX_METHOD_LABELS else "other"
            code = _STATUS_CODES.get(status)
            labels = self._labels[key] = (method, code.name if code is not None else "UNKNOWN")
        CRI_CALLS.inc(*labels)
        if seconds is not None:
            BACKEND_SECONDS.observe(seconds, labels[0])

    def in_flight(self) -> int:
        return sum(len(link.active) for link in self.links)

    def check_idle(self) -> None:
        """Wake `drain` once no call is in flight. Only `drain` waits, so until it runs the sum over
        every link is not made after each call."""
        if self._draining and self.in_flight() == 0:
            self._idle.set()

    async def start(self, listen_path: str) -> None:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_unix_server(lambda: _DownProtocol(self), listen_path)

    async def drain(self, grace: float) -> int:
        """Stop accepting, wait up to `grace` seconds for in-flight calls, close. Returns calls cut off."""
        self._draining = True
        if self.server is not None:
            self.server.close()
        deadline = asyncio.get_running_loop().time() + grace
        while self.in_flight():
            self._idle.clear()
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                break
            try:
                await asyncio.wait_for(self._idle.wait(), remaining)
            except TimeoutError:
                break
        cut = self.in_flight()
        for link in list(self.links):
            link.close()
        return cut
