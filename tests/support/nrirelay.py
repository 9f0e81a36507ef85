"""A unix socket between an NRI plugin and the runtime's NRI socket that makes the first connection's
Synchronize answer late: the plugin's answer is held `hold` seconds on its way to the runtime, past
the runtime's request timeout, while the plugin believes it answered at once. That is what an event
loop held up during the Synchronize looks like from the runtime's side. Later connections, and every
other message, pass through untouched."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

from crihook.nri import mux, ttrpc
from crihook.nri.ttrpc import MessageType


class LateSynchronize:
    def __init__(self, listen: Path, runtime: Path, hold: float) -> None:
        self.listen = listen
        self.runtime = runtime
        self.hold = hold
        self.connections = 0
        self.held = threading.Event()  # set once the Synchronize answer was held and passed on
        self._loop = asyncio.new_event_loop()
        self._tasks: set[asyncio.Task[None]] = set()

    async def _accepted(self, down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_unix_connection(str(self.runtime))
        first = self.connections == 0
        self.connections += 1
        to_plugin = asyncio.create_task(self._copy(up_r, down_w))
        try:
            await (self._hold_sync(down_r, up_w) if first else self._copy(down_r, up_w))
        finally:
            to_plugin.cancel()
            for w in (up_w, down_w):
                w.close()

    async def _copy(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()

    async def _hold_sync(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The plugin's bytes to the runtime, re-framed; its second answer (Configure's is the first)
        is Synchronize's."""
        demux, answers, answered = mux.Decoder(), ttrpc.Decoder(), 0
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                for conn, payload in demux.feed(data):
                    if conn != mux.PLUGIN_CONN:
                        writer.write(mux.encode(conn, payload))
                        continue
                    for frame in answers.feed(payload):
                        if frame.type == MessageType.RESPONSE:
                            answered += 1
                            if answered == 2:
                                await asyncio.sleep(self.hold)
                                self.held.set()
                        writer.write(mux.encode(conn, ttrpc.encode(frame)))
                await writer.drain()

    @contextlib.contextmanager
    def running(self) -> Iterator[LateSynchronize]:
        ready = threading.Event()

        def serve() -> None:
            asyncio.set_event_loop(self._loop)

            async def start() -> None:
                await asyncio.start_unix_server(self._spawn, str(self.listen))
                ready.set()

            self._loop.run_until_complete(start())
            self._loop.run_forever()

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        assert ready.wait(10), "the relay did not start"
        try:
            yield self
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            thread.join(10)

    def _spawn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.ensure_future(self._accepted(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
