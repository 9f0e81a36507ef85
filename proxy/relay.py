"""The hot path: an HTTP/2 frame relay between kubelet and containerd.

Each kubelet connection is paired with one containerd connection and frames are copied across
as they are: the connection preface, SETTINGS, PING, GOAWAY, WINDOW_UPDATE and header blocks pass
verbatim, so both ends negotiate with each other and their HPACK contexts stay in step. The relay
reads only what it must: frame headers, and each header block through `Follower` to learn a new
stream's `:path` (and, for a call the interceptor may rewrite, its `grpc-timeout`, the deadline hooks
get) and a finished stream's `grpc-status`. Deadlines, status codes, messages and error details are
bytes it never changes; unknown methods and streaming calls need no special case.

A method the interceptor claims is handled per stream:
- observed: forwarded as it goes, with copies of the request and response messages for the
  store and post hooks afterwards;
- modified: the request body is held (kubelet's window refunded as it arrives), pre hooks run,
  and the rewritten message goes to containerd under containerd's flow-control windows; a refusal
  answers kubelet with a trailers-only gRPC error and resets the stream towards containerd.

A rewritten message may be longer than the one kubelet sent, so kubelet's idea of containerd's
connection window can run ahead of the truth by that much (`skew`); the relay swallows that
amount from containerd's next connection WINDOW_UPDATEs and queues any DATA frame kubelet sends
beyond the real window until containerd opens it. Nothing else is buffered.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Protocol

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
# a request's method, and its deadline for the calls the interceptor claims
_REQUEST = frozenset((b":path", b"grpc-timeout"))
# grpc-timeout's units (gRPC over HTTP/2: at most 8 digits and one of these)
_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
_STATUS = frozenset((b"grpc-status", b"grpc-message"))


def frame(ftype: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((ftype, flags)) + stream_id.to_bytes(4, "big") + payload


def grpc_error_headers(code: int, message: str) -> bytes:
    """Header block of a trailers-only gRPC error response (grpc-message percent-encoded)."""
    encoded = "".join(
        c if 0x20 <= ord(c) < 0x7F and c != "%" else "".join(f"%{b:02X}" for b in c.encode()) for c in message
    ).encode()
    return encode_literal(
        [
            (b":status", b"200"),
            (b"content-type", b"application/grpc"),
            (b"grpc-status", str(code).encode()),
            (b"grpc-message", encoded),
        ]
    )


class Rejected(Exception):
    """Raised by Interceptor.pre: the call is answered with this gRPC status, never forwarded."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class CallSpec(Protocol):
    modifies: bool  # True: pre hooks may rewrite or refuse the request


class Interceptor(Protocol):
    def classify(self, path: bytes) -> CallSpec | None: ...

    def pre(self, spec: Any, request: bytes, deadline: float | None) -> Awaitable[bytes]:
        """`deadline`: time.monotonic() by which the client wants its answer (grpc-timeout), if any."""

    def post(self, spec: Any, request: bytes, response: bytes | None, status: int, message: bytes | None) -> None:
        """After the call: `message` is the grpc-message trailer as sent (percent-encoded), if any."""


@dataclass(slots=True)
class _Call:
    spec: Any
    path: bytes
    modifies: bool
    request: bytearray
    response: bytearray
    request_done: bool = False
    out: memoryview | None = None  # rewritten request (with gRPC framing) not yet sent
    send_window: int = DEFAULT_WINDOW
    task: asyncio.Task[None] | None = None
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


_CODE_NAMES = {str(c.value[0]).encode(): c.name for c in grpc.StatusCode}
MAX_METHOD_LABELS = 512  # a client inventing method names must not grow the metrics without bound


class Link:
    """One kubelet connection and its containerd twin."""

    def __init__(self, relay: Relay, down: asyncio.Transport) -> None:
        self.relay = relay
        self.down = down
        self.up: asyncio.Transport | None = None
        self.dbuf = b""
        self.ubuf = b""
        self.preface = False
        self.req_hpack = Follower(_REQUEST)
        self.resp_hpack = Follower(_STATUS)
        self.req_frag: bytearray | None = None
        self.req_frag_sid = 0
        self.resp_frag: bytearray | None = None
        self.resp_frag_sid = 0
        self.resp_frag_end = False
        self.calls: dict[int, _Call] = {}
        self.active: dict[int, tuple[bytes, float]] = {}  # stream -> (path, start)
        self.up_window = DEFAULT_WINDOW
        self.up_initial = DEFAULT_WINDOW
        self.up_max_frame = DEFAULT_MAX_FRAME  # largest frame containerd accepts (what kubelet may send)
        self.down_max_frame = DEFAULT_MAX_FRAME  # largest frame kubelet accepts (what containerd may send)
        self.skew = 0
        self.queue: deque[bytes] = deque()
        self.dead: set[int] = set()  # refused streams whose remaining request DATA is dropped
        self.closed = False

    # -- lifecycle ---------------------------------------------------------------------------

    async def connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            self.up, _ = await asyncio.wait_for(
                loop.create_unix_connection(lambda: _UpProtocol(self), self.relay.backend_path),
                self.relay.connect_timeout,
            )
        except (OSError, TimeoutError) as e:
            # kubelet sees the connection drop and its call fails UNAVAILABLE at once.
            log.warning("runtime unreachable", extra={"backend": self.relay.backend_path, "error": str(e)})
            self.close()
            return
        if self.closed:
            self.up.close()
            return
        if self.dbuf:
            data, self.dbuf = self.dbuf, b""
            self.down_data(data)
        self.down.resume_reading()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for call in self.calls.values():
            if call.task is not None:
                call.task.cancel()
        self.calls.clear()
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
        if self.up is None:
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
        calls = self.calls
        while n - pos >= 9:
            hi, lo, ftype, flags, sid = _FH.unpack_from(buf, pos)
            length = (hi << 8) | lo
            end = pos + 9 + length
            if length > self.up_max_frame or (end <= n and flags & (PADDED | PRIORITY_FLAG)):
                bad = _bad_frame(buf, pos, length, ftype, flags, self.up_max_frame)
                if bad is not None:
                    self.protocol_error(bad)
                    return
            if end > n:
                break
            if ftype == DATA:
                sid &= 0x7FFFFFFF
                call = calls.get(sid) if calls else None
                if sid in self.dead or (call is not None and call.modifies):
                    if run < pos:
                        out.append(buf[run:pos])
                    run = end
                    refund += length
                    if call is None:  # rest of a refused request
                        if flags & END_STREAM:
                            self.dead.discard(sid)
                    else:
                        call.request += _payload(buf, pos + 9, end, flags)
                        if flags & END_STREAM:
                            self.request_complete(sid, call)
                        elif length:
                            stream_refunds.append(frame(WINDOW_UPDATE, 0, sid, length.to_bytes(4, "big")))
                        if len(call.request) > self.relay.max_message + 5:
                            self.reject(sid, 8, f"request larger than {self.relay.max_message} bytes")
                    pos = end
                    continue
                if call is not None:
                    call.request += _payload(buf, pos + 9, end, flags)
                if self.queue or self.up_window < length:
                    if run < pos:
                        out.append(buf[run:pos])
                    run = end
                    self.queue.append(buf[pos:end])
                else:
                    self.up_window -= length
            elif ftype in (HEADERS, CONTINUATION):
                if not self.request_headers(buf, pos, end, ftype):
                    return
            elif ftype == RST_STREAM:
                sid &= 0x7FFFFFFF
                self.dead.discard(sid)
                self.stream_done(sid, b"1", None)
            elif ftype == SETTINGS and not flags & ACK:
                for ident, value in _settings(buf, pos + 9, end):
                    if ident == SETTINGS_HEADER_TABLE_SIZE:
                        self.resp_hpack.max_size = value
                    elif ident == SETTINGS_MAX_FRAME_SIZE:
                        # never below what was allowed before: frames sent before the ACK stay legal
                        self.down_max_frame = max(self.down_max_frame, value)
            pos = end
        self.dbuf = buf[pos:]
        if run < pos:
            out.append(buf if run == 0 and pos == n else buf[run:pos])
        if out:
            self.up.write(out[0] if len(out) == 1 else b"".join(out))  # type: ignore[union-attr]
        if refund:
            stream_refunds.append(frame(WINDOW_UPDATE, 0, 0, refund.to_bytes(4, "big")))
        if stream_refunds:
            self.down.write(b"".join(stream_refunds))

    def request_headers(self, buf: bytes, pos: int, end: int, ftype: int) -> bool:
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
            if not flags & END_HEADERS:
                self.req_frag = bytearray(buf[start:stop])
                self.req_frag_sid = sid
                return True
            block = buf[start:stop]
        else:
            if self.req_frag is None or sid != self.req_frag_sid:
                self.protocol_error("CONTINUATION without HEADERS")
                return False
            self.req_frag += buf[pos + 9 : end]
            if len(self.req_frag) > MAX_HEADER_BLOCK:
                self.protocol_error("header block too large")
                return False
            if not flags & END_HEADERS:
                return True
            block = bytes(self.req_frag)
            self.req_frag = None
        try:
            found = self.req_hpack.decode(block)
        except HpackError as e:
            self.protocol_error(f"request headers: {e}")
            return False
        path = found.get(b":path")
        if path is None or sid in self.active:
            return True  # trailers from the client: nothing to learn
        self.active[sid] = (path, time.perf_counter())
        spec = self.relay.interceptor.classify(path)
        if spec is not None:
            call = _Call(spec, path, spec.modifies, bytearray(), bytearray(), send_window=self.up_initial)
            if spec.modifies:
                call.deadline = deadline_of(found.get(b"grpc-timeout"))
            self.calls[sid] = call
        return True

    def request_complete(self, sid: int, call: _Call) -> None:
        call.request_done = True
        body = bytes(call.request)
        call.task = asyncio.get_running_loop().create_task(self.run_pre(sid, call, body))

    async def run_pre(self, sid: int, call: _Call, body: bytes) -> None:
        message = _grpc_message(body)
        try:
            if message is None:
                raise Rejected(12, "crihook can not inspect a compressed or malformed request")
            rewritten = await self.relay.interceptor.pre(call.spec, message, call.deadline)
        except Rejected as r:
            if self.calls.get(sid) is call:
                self.reject(sid, r.code, r.message)
            return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the interceptor itself failed: refuse rather than forward unchecked
            log.exception("interceptor failed", extra={"method": call.path.decode()})
            if self.calls.get(sid) is call:
                self.reject(sid, 13, f"crihook: {type(e).__name__}: {e}")
            return
        if self.calls.get(sid) is not call or self.closed:
            return  # kubelet gave up meanwhile
        call.task = None
        call.request = bytearray(rewritten)
        call.out = memoryview(b"\x00" + len(rewritten).to_bytes(4, "big") + rewritten)
        self.pump(sid, call)

    def pump(self, sid: int, call: _Call) -> None:
        """Send what is left of a rewritten request within containerd's windows."""
        out = call.out
        assert out is not None and self.up is not None
        chunks = []
        while out:
            n = min(len(out), self.up_max_frame, self.up_window, call.send_window)
            if n <= 0 and len(out):
                break
            last = n == len(out)
            chunks.append(frame(DATA, END_STREAM if last else 0, sid, bytes(out[:n])))
            out = out[n:]
            self.up_window -= n
            call.send_window -= n
            self.skew += n
        call.out = out if out else None
        if chunks:
            self.up.write(b"".join(chunks))

    def reject(self, sid: int, code: int, message: str) -> None:
        call = self.calls.pop(sid, None)
        if call is not None and call.task is not None and call.task is not asyncio.current_task():
            call.task.cancel()
        entry = self.active.pop(sid, None)
        self.relay.count(entry[0] if entry else b"?", str(code).encode())
        if call is not None and not call.request_done:
            self.dead.add(sid)
        self.down.write(frame(HEADERS, END_STREAM | END_HEADERS, sid, grpc_error_headers(code, message)))
        if self.up is not None:
            self.up.write(frame(RST_STREAM, 0, sid, CANCEL.to_bytes(4, "big")))
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
        calls = self.calls
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
                if calls:
                    call = calls.get(sid & 0x7FFFFFFF)
                    if call is not None:
                        call.response += _payload(buf, pos + 9, end, flags)
            elif ftype in (HEADERS, CONTINUATION):
                if not self.response_headers(buf, pos, end, ftype):
                    return
            elif ftype == WINDOW_UPDATE:
                sid &= 0x7FFFFFFF
                inc = int.from_bytes(buf[pos + 9 : pos + 13], "big") & 0x7FFFFFFF
                if sid == 0:
                    self.up_window += inc
                    if self.skew > 0:
                        take = min(self.skew, inc)
                        self.skew -= take
                        if run < pos:
                            out.append(buf[run:pos])
                        run = end
                        if inc > take:
                            out.append(frame(WINDOW_UPDATE, 0, 0, (inc - take).to_bytes(4, "big")))
                    self.window_opened()
                else:
                    call = calls.get(sid)
                    if call is not None and call.modifies:
                        call.send_window += inc
                        if run < pos:
                            out.append(buf[run:pos])
                        run = end
                        if call.out is not None:
                            self.pump(sid, call)
            elif ftype == RST_STREAM:
                self.stream_done(sid & 0x7FFFFFFF, b"1", None)
            elif ftype == SETTINGS and not flags & ACK:
                self.up_settings(buf, pos + 9, end)
            pos = end
        self.ubuf = buf[pos:]
        if run < pos:
            out.append(buf if run == 0 and pos == n else buf[run:pos])
        if out:
            self.down.write(out[0] if len(out) == 1 else b"".join(out))

    def up_settings(self, buf: bytes, start: int, end: int) -> None:
        for ident, value in _settings(buf, start, end):
            if ident == SETTINGS_INITIAL_WINDOW_SIZE:
                delta = value - self.up_initial
                self.up_initial = value
                for call in self.calls.values():
                    call.send_window += delta
            elif ident == SETTINGS_MAX_FRAME_SIZE:
                self.up_max_frame = max(self.up_max_frame, value)
            elif ident == SETTINGS_HEADER_TABLE_SIZE:
                self.req_hpack.max_size = value

    def window_opened(self) -> None:
        queue = self.queue
        if queue:
            out = []
            while queue and len(queue[0]) - 9 <= self.up_window:
                f = queue.popleft()
                self.up_window -= len(f) - 9
                out.append(f)
            if out:
                self.up.write(b"".join(out))  # type: ignore[union-attr]
        for sid, call in list(self.calls.items()):
            if call.out is not None:
                self.pump(sid, call)

    def response_headers(self, buf: bytes, pos: int, end: int, ftype: int) -> bool:
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
            ends_stream = bool(flags & END_STREAM)
            if not flags & END_HEADERS:
                self.resp_frag = bytearray(buf[start:stop])
                self.resp_frag_sid = sid
                self.resp_frag_end = ends_stream
                return True
            block = buf[start:stop]
        else:
            if self.resp_frag is None or sid != self.resp_frag_sid:
                self.protocol_error("CONTINUATION without HEADERS from the runtime")
                return False
            self.resp_frag += buf[pos + 9 : end]
            if len(self.resp_frag) > MAX_HEADER_BLOCK:
                self.protocol_error("runtime header block too large")
                return False
            if not flags & END_HEADERS:
                return True
            block = bytes(self.resp_frag)
            self.resp_frag = None
            ends_stream = self.resp_frag_end
        try:
            found = self.resp_hpack.decode(block)
        except HpackError as e:
            self.protocol_error(f"response headers: {e}")
            return False
        if ends_stream:
            self.stream_done(sid, found.get(b"grpc-status", b"2"), found.get(b"grpc-message"))
        return True

    def stream_done(self, sid: int, status: bytes, message: bytes | None) -> None:
        entry = self.active.pop(sid, None)
        call = self.calls.pop(sid, None)
        if entry is not None:
            path, started = entry
            self.relay.count(path, status, time.perf_counter() - started)
        if call is not None:
            if call.task is not None:
                call.task.cancel()
            elif call.request_done or not call.modifies:
                code = int(status) if status.isdigit() else 2
                req = _grpc_message(call.request) if not call.modifies else bytes(call.request)
                # after the answer is on its way to kubelet (this frame batch is written first), and
                # still before any later request is read: bookkeeping stays in call order
                asyncio.get_running_loop().call_soon(
                    self.relay.interceptor.post, call.spec, req or b"", _grpc_message(call.response), code, message
                )
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

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.link: Link | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.pause_reading()
        self.link = Link(self.relay, transport)  # type: ignore[arg-type]
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

    def __init__(self, link: Link) -> None:
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


class Relay:
    """Accepts kubelet connections on a unix socket and pairs each with a runtime connection."""

    def __init__(
        self,
        backend_path: str,
        interceptor: Interceptor,
        max_message: int = 16 << 20,
        connect_timeout: float = 5.0,
    ) -> None:
        self.backend_path = backend_path
        self.interceptor = interceptor
        self.max_message = max_message
        self.connect_timeout = connect_timeout
        self.links: set[Link] = set()
        self._labels: dict[tuple[bytes, bytes], tuple[str, str]] = {}
        self._idle = asyncio.Event()
        self.server: asyncio.AbstractServer | None = None

    def count(self, path: bytes, status: bytes, seconds: float | None = None) -> None:
        """Metrics for one finished call; label strings are made once per (method, code)."""
        key = (path, status)
        labels = self._labels.get(key)
        if labels is None:
            method = path.decode("latin-1") if len(self._labels) < MAX_METHOD_LABELS else "other"
            labels = self._labels[key] = (method, _CODE_NAMES.get(status, "UNKNOWN"))
        CRI_CALLS.inc(*labels)
        if seconds is not None:
            BACKEND_SECONDS.observe(seconds, labels[0])

    def in_flight(self) -> int:
        return sum(len(link.active) for link in self.links)

    def check_idle(self) -> None:
        if self.in_flight() == 0:
            self._idle.set()

    async def start(self, listen_path: str) -> None:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_unix_server(lambda: _DownProtocol(self), listen_path)

    async def drain(self, grace: float) -> int:
        """Stop accepting, wait up to `grace` seconds for in-flight calls, close. Returns calls cut off."""
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
