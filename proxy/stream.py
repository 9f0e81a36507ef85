"""A call the relay hands to its call handler (proxy/intercept.py's `Interceptor`): the handler's
contract (`CallHandler`, the state it keeps per call, `Claim`, and its refusal, `Rejected`) and what
the relay keeps of one claimed stream (`Stream`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import grpc

from crihook.proxy.frames import DEFAULT_WINDOW


class Rejected(Exception):
    """Raised by CallHandler.rewrite: the call is answered with this gRPC status, never forwarded."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Claim(Protocol):
    """What a call handler keeps for one call it claimed; the relay reads only `modifies`."""

    @property
    def modifies(self) -> bool:
        """True: the request is held for `rewrite`, which may change or refuse it."""


C = TypeVar("C", bound=Claim)


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
class Stream(Generic[C]):
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
