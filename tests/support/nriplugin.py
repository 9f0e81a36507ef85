"""An NRI plugin (crihook.nri.stub.Plugin) running in a thread of the test process, so that a
synchronous test can drive CRI calls while the plugin answers the runtime:

    with plugin_thread(handler, containerd.nri_socket) as plugin:
        plugin.wait_synchronized()
        ...  # CRI calls; the handler sees the runtime's NRI calls

`kill()` cuts the connection and stops the plugin at once, as a killed process would (the runtime
sees the socket close); a new `plugin_thread` then plays the restarted plugin.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from crihook.nri.stub import Handler, Plugin, event_mask
from crihook.proto import nri_v1alpha1_pb2 as api
from tests.support.hookserver import wait_for


class Synchronizing:
    """Wraps a handler to count the Synchronize calls that completed, for `wait_synchronized`."""

    def __init__(self, inner: Handler) -> None:
        self.inner = inner
        self.synchronized = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def synchronize(
        self, pods: Sequence[api.PodSandbox], containers: Sequence[api.Container]
    ) -> Sequence[api.ContainerUpdate]:
        updates = await self.inner.synchronize(pods, containers)
        self.synchronized += 1
        return updates


class PluginThread:
    def __init__(self, handler: Handler, socket: Path, name: str = "crihook-test", index: str = "10") -> None:
        self.handler = Synchronizing(handler)
        self.plugin = Plugin(self.handler, name, index, str(socket), backoff=0.05, max_backoff=0.5)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=f"nri-{name}", daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            self.loop.run_until_complete(self.plugin.run())
        except BaseException as e:  # reported by stop(): a test must see the plugin fail
            self.error = e
        finally:
            self.loop.close()

    def start(self) -> PluginThread:
        self._thread.start()
        return self

    def wait_synchronized(self, times: int = 1) -> None:
        """Until the runtime has synchronized the plugin `times` times (once per connection)."""
        wait_for(lambda: self.handler.synchronized >= times, timeout=15.0, what=f"synchronized {times} time(s)")

    def run(self, coro: Any, timeout: float = 15.0) -> Any:
        """Run a coroutine (a call to the runtime, say) on the plugin's loop and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def kill(self) -> None:
        """Stop at once, the connection cut without a goodbye."""

        def cut() -> None:
            self.plugin.stop()
            conn = self.plugin._conn
            if conn is not None:
                conn.writer.transport.abort()

        self.loop.call_soon_threadsafe(cut)
        self._join()

    def stop(self) -> None:
        if self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop closed already
                self.loop.call_soon_threadsafe(self.plugin.stop)
            self._join()
        if self.error is not None:
            raise AssertionError(f"the plugin failed: {self.error!r}") from self.error

    def _join(self) -> None:
        self._thread.join(15)
        if self._thread.is_alive():
            raise AssertionError("the plugin did not stop within 15 s")


@contextlib.contextmanager
def plugin_thread(
    handler: Handler, socket: Path, name: str = "crihook-test", index: str = "10"
) -> Iterator[PluginThread]:
    thread = PluginThread(handler, socket, name, index).start()
    try:
        yield thread
    finally:
        thread.stop()


class NoChange:
    """A Handler that changes nothing: registered, subscribed to the pod and container lifecycle,
    every call answered without an adjustment. The baseline for tests and benchmarks."""

    EVENTS = event_mask(
        api.RUN_POD_SANDBOX,
        api.STOP_POD_SANDBOX,
        api.REMOVE_POD_SANDBOX,
        api.CREATE_CONTAINER,
        api.START_CONTAINER,
        api.UPDATE_CONTAINER,
        api.STOP_CONTAINER,
        api.REMOVE_CONTAINER,
    )

    async def configure(self, request: api.ConfigureRequest) -> int:
        return self.EVENTS

    async def synchronize(
        self, pods: Sequence[api.PodSandbox], containers: Sequence[api.Container]
    ) -> Sequence[api.ContainerUpdate]:
        return []

    async def create_container(self, request: api.CreateContainerRequest) -> api.CreateContainerResponse:
        return api.CreateContainerResponse()

    async def update_container(self, request: api.UpdateContainerRequest) -> api.UpdateContainerResponse:
        return api.UpdateContainerResponse()

    async def stop_container(self, request: api.StopContainerRequest) -> api.StopContainerResponse:
        return api.StopContainerResponse()

    async def validate_adjustment(
        self, request: api.ValidateContainerAdjustmentRequest
    ) -> api.ValidateContainerAdjustmentResponse:
        return api.ValidateContainerAdjustmentResponse()

    async def state_change(self, event: api.StateChangeEvent) -> None:
        return None

    async def shutdown(self) -> None:
        return None
