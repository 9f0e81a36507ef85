"""Flow control towards containerd (RFC 9113 §6.9) for the DATA the relay holds back or makes
itself: `RuntimeWindow`."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic

from crihook.proxy.frames import (
    DATA,
    DEFAULT_MAX_FRAME,
    DEFAULT_WINDOW,
    END_STREAM,
    frame,
)
from crihook.proxy.stream import C, Stream


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

    def pump(self, sid: int, stream: Stream[C]) -> None:
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

    def connection_update(self, inc: int, streams: dict[int, Stream[C]]) -> int | None:
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

    def opened(self, streams: dict[int, Stream[C]]) -> None:
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
