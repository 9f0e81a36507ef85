"""NRI mode's front door of the node daemon (node/daemon.py): the plugin the runtime calls.

It dials the runtime's NRI socket and stays registered, dialing again after every drop; started by
the runtime as a pre-registered plugin (`NRI_PLUGIN_SOCKET` set) it serves the socket it was given
and ends when that closes. The store is rebuilt at each Synchronize (nri/handler.py), so the daemon
says READY=1 after the first one. Catch-up and eviction go over CRI to `[node] runtime_endpoint`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from crihook.base import config as cfgmod
from crihook.node import cri
from crihook.node.daemon import StartupError
from crihook.node.lifecycle import Lifecycle
from crihook.node.store import Store
from crihook.nri.handler import HookHandler
from crihook.nri.stub import DEFAULT_SOCKET, ConnectionLost, Plugin, inherited_socket
from crihook.proto import nri_v1alpha1_pb2 as api

log = logging.getLogger("crihook.nri")

# Seconds between looks at the runtime over CRI while no call has proven that it holds the plugin
# since the last Synchronize (nri/registration.py); none once one has.
PROOF_INTERVAL = 5.0


@dataclass
class PluginName:
    """Who the plugin registers as, and where: the command line's, or the runtime's NRI_PLUGIN_*."""

    name: str = "crihook"
    index: str = "10"
    socket_path: str = DEFAULT_SOCKET


@dataclass
class NriDoor:
    cfg: cfgmod.Config
    plugin_name: PluginName = field(default_factory=PluginName)
    name: str = "nri"
    handler: HookHandler | None = None
    plugin: Plugin | None = None
    _stopped: asyncio.Event = field(default_factory=asyncio.Event)

    async def prepare(self) -> None:
        """Nothing to wait for: the plugin dials the runtime until it answers."""

    async def rebuild(self, store: Store) -> None:
        """Nothing at start: every Synchronize rebuilds the store from the runtime's own list."""

    async def serve(self, lifecycle: Lifecycle, ready: Callable[[str], None]) -> int:
        cfg = self.cfg
        self.handler = handler = hook_handler(cfg, lifecycle)
        endpoint = cfg.node.runtime_endpoint

        async def evict(evictions: Sequence[api.ContainerEviction]) -> None:
            await cri.stop_containers(endpoint, [e.container_id for e in evictions])

        async def relist() -> tuple[list[api.PodSandbox], list[api.Container]]:
            return await cri.list_as_nri(endpoint)

        handler.evict, handler.relist = evict, relist
        self.plugin = plugin = plugin_from(self.plugin_name, handler)
        where = f"fd {plugin.fd}" if plugin.fd is not None else plugin.socket_path
        log.info("NRI plugin starting", extra={"plugin": f"{plugin.index}-{plugin.name}", "socket": where})
        runner = asyncio.create_task(plugin.run())
        # a pre-registered plugin can not dial again: giving its one connection up would end it
        watch = None if plugin.fd is not None else asyncio.create_task(self._watch_registration(plugin, endpoint))
        synced = asyncio.create_task(handler.synchronized.wait())
        stopped = asyncio.create_task(self._stopped.wait())
        waiting = {runner, synced, stopped}
        try:
            while not runner.done():
                # a refusal (the runtime can not be served) is found at Configure: looked for twice a second
                done, _ = await asyncio.wait(waiting, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
                if synced in done:
                    waiting.discard(synced)
                    ready("registered with the runtime")
                if stopped in done or handler.refused is not None:
                    waiting.discard(stopped)
                    plugin.stop()
            runner.result()
        except ConnectionLost as e:
            raise StartupError(f"cannot serve the runtime: {e}") from None
        finally:
            if watch is not None:
                watch.cancel()
            synced.cancel()
            stopped.cancel()
        if handler.refused is not None:
            log.error(
                "refusing to serve this runtime", extra={"runtime": handler.runtime.ref, "reason": str(handler.refused)}
            )
            return 1
        return 0

    def stop(self) -> None:
        self._stopped.set()

    async def _watch_registration(self, plugin: Plugin, endpoint: str) -> None:
        """While the runtime has not shown it holds the plugin since the last Synchronize, list its
        containers over CRI: one created since, with no call to crihook, shows it does not."""
        while True:
            await asyncio.sleep(PROOF_INTERVAL)
            reg = plugin.registration
            since = reg.unproven_since() if reg is not None else None
            if reg is None or since is None:
                continue
            try:
                created = await cri.created_since(endpoint, since)
            except Exception as e:  # the runtime busy or restarting: looked at again next time
                log.debug("listing the runtime over CRI failed", extra={"error": str(e)})
                continue
            if plugin.registration is reg:  # still the same connection
                reg.created_without_a_call(created)

    def reconfigure(self, cfg: cfgmod.Config) -> None:
        """[nri] synchronize takes effect at once; the gpu hook's inject mode at the next Configure."""
        self.cfg = cfg
        if self.handler is not None:
            self.handler.synchronize_action = cfg.nri.synchronize
            self.handler.cdi_inject = cfg.hooks.options.get("gpu", {}).get("inject") == "cdi"

    async def close(self) -> None:
        if self.handler is not None:
            await self.handler.close()


def hook_handler(cfg: cfgmod.Config, lifecycle: Lifecycle) -> HookHandler:
    """The handler `crihook nri` serves the runtime's calls with, as `cfg` sets it up (the runtime
    calls it back over CRI once `evict` and `relist` are set)."""
    inject = cfg.hooks.options.get("gpu", {}).get("inject")
    return HookHandler(lifecycle, synchronize_action=cfg.nri.synchronize, cdi_inject=inject == "cdi")


def plugin_from(names: PluginName, handler: HookHandler) -> Plugin:
    """The plugin `names` and the environment describe; the runtime's NRI_PLUGIN_* win."""
    inherited = inherited_socket()
    if inherited is None:
        return Plugin(handler, names.name, names.index, socket_path=names.socket_path)
    fd, name, index = inherited
    return Plugin(handler, name or names.name, index or names.index, fd=fd)
