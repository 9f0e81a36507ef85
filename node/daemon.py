"""The node daemon both front doors run on: start, serve, reload and stop, written once.

A front door (proxy mode's CRI relay, NRI mode's plugin) says how calls reach the hooks; the rest is
here and the same in both modes. Start order is the contract with systemd: the hook chain is built
(a configuration error stops the start), the front door makes its checks (proxy mode waits for the
runtime), the store is read and, where the front door does it at start, rebuilt from the runtime;
the metrics endpoint, the signals, the watchdog and the device reporter come up; the front door
serves, and READY=1 (with the usage collector) follows once it says the store matches the runtime
and calls are served. SIGTERM or SIGINT stops: STOPPING=1, the front door drains, then post hooks,
the chain, the reporter, the collector and the store are closed in that order. SIGHUP reloads the
configuration file: the hook chain is rebuilt off the event loop and swapped in under the same pid,
the running configuration serving meanwhile and kept when the new one is wrong.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import ssl
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from crihook.base import config as cfgmod
from crihook.base import metrics
from crihook.base.config import ConfigError
from crihook.base.kubeauth import KubeAuthorizer
from crihook.base.tls import Certificates, TlsFiles, self_signed_context
from crihook.devices.collector import UsageCollector, start_usage
from crihook.devices.nvml import GpuIndex
from crihook.hooks.base import NeedsStore, OwnsGpus
from crihook.hooks.chain import HookChain
from crihook.hooks.executor import DaemonThreads
from crihook.hooks.gpu_edit import GpuOptions
from crihook.hooks.registry import build_chain
from crihook.node import systemd
from crihook.node.lifecycle import Lifecycle
from crihook.node.store import Store

log = logging.getLogger("crihook.node")

Overrides = Mapping[str, Mapping[str, Any]]


class StartupError(Exception):
    """Serving is impossible with a configuration that is right: the node is not as it must be (the
    runtime does not answer, the socket's directory is unsafe, another process serves). Not a
    ConfigError: editing the file does not fix it. The message is one line for the operator."""


class FrontDoor(Protocol):
    """How the runtime's calls reach the hooks: proxy mode's relay (proxy/serve.py), NRI mode's
    plugin (nri/serve.py)."""

    name: str  # for the logs: "proxy", "nri"

    async def prepare(self) -> None:
        """What must hold before the store is read (the runtime answers, a safe socket directory);
        StartupError when it does not."""
        ...

    async def rebuild(self, store: Store) -> None:
        """Make the store match the runtime before serving, where this front door does it at start
        (NRI mode does it at each Synchronize instead)."""
        ...

    async def serve(self, lifecycle: Lifecycle, ready: Callable[[str], None]) -> int:
        """Serve the runtime's calls through `lifecycle` until `stop()`, or until serving ends by
        itself; the exit status. Calls `ready(status)` once calls are served on a store that matches
        the runtime. StartupError when serving can not begin."""
        ...

    def stop(self) -> None:
        """End `serve` (after draining what is in flight)."""
        ...

    def reconfigure(self, cfg: cfgmod.Config) -> None:
        """The front door's own settings of a reloaded configuration."""
        ...

    async def close(self) -> None:
        """After `serve` returned: let running post hooks finish, release what the front door holds."""
        ...


@dataclass
class NodeDaemon:
    cfg: cfgmod.Config
    door: FrontDoor
    config_path: str | None = None
    overrides: Overrides = field(default_factory=dict)  # the command line's, applied again at each reload
    store: Store | None = None
    lifecycle: Lifecycle | None = None
    reporter: Any = None
    usage: UsageCollector | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    # SIGHUP's reads (the file, the hooks' own directories) run here: a file system that stalls
    # holds this thread, never the event loop, and never crihook's exit
    _reload_thread: DaemonThreads = field(default_factory=lambda: DaemonThreads(1, "crihook-reload"))
    _reloading: asyncio.Lock = field(default_factory=asyncio.Lock)

    def chain(self, cfg: cfgmod.Config) -> HookChain:
        chain = build_chain(cfg.hooks, cfg.node)
        if self.store is not None:
            attach_store(chain, self.store)
        return chain

    async def main(self) -> int:
        """Start, serve until a stop signal (or until the front door ends), stop; the exit status."""
        cfg = self.cfg
        log_deprecations(cfg)
        chain = self.chain(cfg)
        await self.door.prepare()
        self.store = store = Store(cfg.proxy.state_dir)
        log.info("store loaded", extra={"file": store.load()})
        await self.door.rebuild(store)
        attach_store(chain, store)
        self.lifecycle = lifecycle = Lifecycle(chain, store)
        metrics_server = await serve_metrics(cfg)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.stop)
        loop.add_signal_handler(signal.SIGINT, self.stop)
        loop.add_signal_handler(signal.SIGHUP, self.reload)
        interval = systemd.watchdog_interval()
        if interval:
            self._spawn(systemd.watchdog(interval))
        self.reporter = start_reporter(cfg, chain)
        log.info(
            "starting",
            extra={"mode": self.door.name, "hooks": ",".join(h.hook.name for h in chain.hooks)},
        )
        serving = loop.create_task(self.door.serve(lifecycle, self._serving))
        stopping = loop.create_task(self._stop.wait())
        try:
            await asyncio.wait([serving, stopping], return_when=asyncio.FIRST_COMPLETED)
            systemd.notify("STOPPING=1")
            self.door.stop()
            return await serving
        finally:
            stopping.cancel()
            await self.door.close()
            await lifecycle.chain.close()
            if self.reporter is not None:
                await asyncio.to_thread(self.reporter.stop)
            if self.usage is not None:
                await asyncio.to_thread(self.usage.stop)
            await store.close()
            for t in list(self._tasks):
                t.cancel()
            if metrics_server is not None:
                metrics_server.close()
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
            log.info("stopped", extra={"mode": self.door.name})

    def _serving(self, status: str) -> None:
        """The front door serves on a store that matches the runtime: the usage collector, then READY=1.
        Called again after each reconnection in NRI mode; only the first starts anything."""
        if self.ready.is_set():
            return
        assert self.store is not None
        try:
            _, gpu = self.cfg.hooks.table("gpu", GpuOptions)  # checked when the chain was built
            self.usage = start_usage(self.cfg, self.store, self.cfg.proxy.state_dir, gpu.kubelet_pods_dir)
        except Exception as e:  # like the reporter, not on the runtime's path: serve all the same
            log.exception("usage collector not started", extra={"error": str(e)})
        systemd.notify(f"READY=1\nSTATUS={status}")
        self.ready.set()

    def stop(self) -> None:
        self._stop.set()

    def reload(self) -> None:
        """SIGHUP: the configuration read and the new chain built off the event loop, then swapped in
        on it. Reloads run one at a time; the running configuration serves meanwhile."""
        self._spawn(self._reload())

    async def _reload(self) -> None:
        loop = asyncio.get_running_loop()
        async with self._reloading:
            try:
                cfg = self.cfg
                if self.config_path:
                    cfg = await loop.run_in_executor(self._reload_thread, cfgmod.load, self.config_path, self.overrides)
                chain = await loop.run_in_executor(self._reload_thread, build_chain, cfg.hooks, cfg.node)
            except ConfigError as e:
                log.error("reload failed, keeping the running configuration", extra={"error": str(e)})
                return
            except Exception:  # a hook that can not be made: the operator's to fix, not a reason to stop
                log.exception("reload failed, keeping the running configuration")
                return
        log_deprecations(cfg)
        if self.store is not None:
            attach_store(chain, self.store)
        assert self.lifecycle is not None
        old, self.lifecycle.chain = self.lifecycle.chain, chain
        self.door.reconfigure(cfg)
        if self.reporter is not None:
            owner = gpu_owner(chain)
            self.reporter.index = owner.gpus if owner else None
            self.reporter.plugin_holds = owner.plugin_holds if owner else None
        # Calls already running keep the old chain's hooks until they finish: close it in the
        # background, once the longest a call can spend in it (every hook's budget) has passed.
        self._spawn(_close_later(old, sum(r.timeout for r in old.hooks) + 1.0))
        log.info("configuration reloaded", extra={"hooks": ",".join(h.hook.name for h in chain.hooks)})

    def _spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def run_daemon(daemon: NodeDaemon) -> int:
    """`daemon` on uvloop: its exit status; 1 when it could not start, 2 for a configuration error
    found while starting (a hook's table, a plugin index), each said in one line on stderr and in
    the log."""
    import uvloop

    try:
        return uvloop.run(daemon.main())
    except (StartupError, ConfigError, ValueError) as e:
        log.error("cannot start", extra={"error": str(e)})
        print(f"crihook: {e}", file=sys.stderr)
        return 1 if isinstance(e, StartupError) else 2


async def _close_later(chain: HookChain, grace: float) -> None:
    await asyncio.sleep(grace)
    await chain.close()


def log_deprecations(cfg: cfgmod.Config) -> None:
    for line in cfg.deprecations:
        log.warning("deprecated configuration", extra={"detail": line})


async def serve_metrics(cfg: cfgmod.Config) -> Any:
    """The metrics endpoint, or None when `[proxy] metrics_listen` is empty or it can not serve there
    (the address taken, say by another crihook, or certificate files that do not load): like the
    reporter it is not on the runtime's path, and a node daemon that does not start stops every pod
    start (proxy mode) or, pre-registered on containerd 1.7, containerd's CRI service; so it serves
    without metrics and says why. An address that is not allowed (not loopback) is a ConfigError."""
    listen = cfg.proxy.metrics_listen
    if not listen:
        return None
    node = cfg.node.name or socket.gethostname()
    # every series names its node, so no two nodes' series collide whoever scrapes them
    metrics.REGISTRY.const_labels = {"node": node}
    authorize = None
    if cfg.proxy.metrics_auth_kubeconfig:
        from crihook.devices.reporter import api_client_from

        try:
            authorize = KubeAuthorizer(api_client_from(cfg.proxy.metrics_auth_kubeconfig)).check
        except Exception as e:  # no token mounted, an unreadable kubeconfig
            raise ConfigError(
                cfg.source, f"no API client for metrics authorization: {e}", "proxy", "metrics_auth_kubeconfig"
            ) from None
    try:
        tls = metrics_tls(cfg.proxy, authorize is not None, node)
        return await metrics.serve(listen, authorize=authorize, tls=tls)
    except ValueError as e:
        raise ConfigError(cfg.source, str(e), "proxy", "metrics_listen") from None
    except (OSError, ssl.SSLError) as e:
        log.error("metrics endpoint not started", extra={"listen": listen, "error": str(e)})
        return None


def metrics_tls(proxy: cfgmod.ProxyConfig, authorized: bool, node: str) -> ssl.SSLContext | None:
    """How the metrics endpoint speaks: HTTPS with the operator's certificate files (reloaded when a
    mounted Secret changes); else, where it takes bearer tokens, HTTPS with a self-signed certificate
    made now, as kubelet and kube-rbac-proxy serve; else plain HTTP (loopback only, no token to keep)."""
    if proxy.metrics_tls_cert:
        return Certificates(TlsFiles(proxy.metrics_tls_cert, proxy.metrics_tls_key)).server_context()
    if authorized:
        return self_signed_context(list(dict.fromkeys([node, socket.gethostname(), "localhost"])))
    return None


def attach_store(chain: HookChain, store: Store) -> None:
    for reg in chain.hooks:
        if isinstance(reg.hook, NeedsStore):
            reg.hook.attach_store(store)


def gpu_owner(chain: HookChain) -> OwnsGpus | None:
    """The hook keeping the GPU index, which the reporter's rounds keep fresh (None without one:
    the reporter then reads NVML itself and publishes every checkpoint entry)."""
    for reg in chain.hooks:
        if isinstance(reg.hook, OwnsGpus) and isinstance(reg.hook.gpus, GpuIndex):
            return reg.hook
    return None


def start_reporter(cfg: cfgmod.Config, chain: HookChain) -> Any:
    """The device reporter on its own thread when a kubeconfig is configured. It is not on the
    runtime's path: if it can not start, crihook serves all the same and says why."""
    if not cfg.reporter.kubeconfig:
        return None
    from crihook.devices.reporter import Reporter, api_client_from

    owner = gpu_owner(chain)
    try:
        reporter = Reporter(
            cfg,
            api_client_from(cfg.reporter.kubeconfig),
            nvml=owner.gpus.nvml if owner else None,
            index=owner.gpus if owner else None,
            plugin_holds=owner.plugin_holds if owner else None,
        )
    except Exception as e:  # unreadable kubeconfig or partition table: the operator's to fix
        log.error("device reporter not started", extra={"kubeconfig": cfg.reporter.kubeconfig, "error": str(e)})
        return None
    reporter.start()  # it logs that it started
    return reporter
