"""The floor of any Python proxy, kept as a yardstick: each connection paired with one to the backend
and bytes copied both ways as they arrive, on uvloop like crihook, nothing parsed, nothing decoded.

    python bench/byte_relay.py LISTEN_SOCKET BACKEND_SOCKET

`bench/proxy_bench.py` runs it beside crihook: what it adds over direct is what a Python process in
the path costs before it reads a single frame (the loop's wake-ups, the socket reads and writes),
so crihook's added time less this one's is what crihook's own work costs.
"""

from __future__ import annotations

import argparse
import asyncio

import uvloop


class Half(asyncio.Protocol):
    """One side of a pair: what it receives goes to its peer's transport, and back-pressure too."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: Half | None = None
        self.early = bytearray()  # the client's first bytes, while the backend connects

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is None or peer.transport is None:
            self.early += data
        else:
            peer.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()

    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()


async def main(listen: str, backend: str) -> None:
    loop = asyncio.get_running_loop()
    connecting: set[asyncio.Task[None]] = set()

    def accepted() -> Half:
        down = Half()

        async def connect() -> None:
            up = Half()
            try:
                await loop.create_unix_connection(lambda: up, backend)
            except OSError:
                if down.transport is not None:
                    down.transport.close()
                return
            up.peer, down.peer = down, up
            for side in (down, up):  # what either end sent before the pair was made
                if side.early:
                    side.data_received(bytes(side.early))
                    side.early.clear()

        task = loop.create_task(connect())
        connecting.add(task)
        task.add_done_callback(connecting.discard)
        return down

    server = await loop.create_unix_server(accepted, listen)
    print("ready", flush=True)
    await server.serve_forever()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("listen", help="unix socket to serve on")
    ap.add_argument("backend", help="unix socket to forward to")
    args = ap.parse_args()
    uvloop.run(main(args.listen, args.backend))
