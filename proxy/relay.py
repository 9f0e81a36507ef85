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

The parts, one module each: `Relay` (here) serves the socket, pairs connections, counts calls and
drains; `Link` (proxy/link.py) parses frames both ways and routes them; proxy/frames.py is the
framing; `HeaderBlocks` (proxy/headers.py) assembles and reads one direction's header blocks;
`RuntimeWindow` (proxy/flow.py) is the flow control towards containerd; proxy/stream.py holds the
call handler's contract and one claimed stream's state (`Stream`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Generic, cast

import grpc

from crihook.base.metrics import BACKEND_SECONDS, CRI_CALLS
from crihook.proxy.frames import STATUS_CODES
from crihook.proxy.link import Link
from crihook.proxy.stream import C, CallHandler

log = logging.getLogger("crihook.proxy")


MAX_METHOD_LABELS = 512  # a client inventing method names must not grow the metrics without bound


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
            code = STATUS_CODES.get(status)
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
