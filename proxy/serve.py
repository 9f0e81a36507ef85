"""Proxy mode's front door of the node daemon (node/daemon.py): the CRI relay kubelet talks to.

Before the store is read the runtime must answer (retry with back-off); the store is rebuilt from
its list, then the socket is bound and the daemon says READY=1: kubelet never reaches a crihook that
does not know the node's pods yet. Stopping drains the calls in flight for `drain_seconds`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from crihook.base import config as cfgmod
from crihook.base.config import ConfigError
from crihook.base.endpoint import unix_socket_path
from crihook.node.cri import RuntimeUnreachable, list_records, wait_for_runtime
from crihook.node.daemon import StartupError
from crihook.node.lifecycle import Lifecycle
from crihook.node.store import Store
from crihook.proxy.intercept import Call, Interceptor
from crihook.proxy.orphans import TaskJanitor
from crihook.proxy.relay import Relay

log = logging.getLogger("crihook.proxy")


def unix_path(cfg: cfgmod.Config, table: str, key: str) -> str:
    """The socket file of the endpoint `key` of `table`. Raises ConfigError."""
    endpoint = getattr(getattr(cfg, table), key)
    path = unix_socket_path(endpoint)
    if path is None:
        reason = f"{endpoint!r} is not a unix socket endpoint with an absolute path (unix:///path)"
        raise ConfigError(cfg.source, reason, table, key)
    return path


@dataclass
class ProxyDoor:
    """kubelet's calls through the relay: the lifecycle methods to the hooks, the rest byte for byte."""

    cfg: cfgmod.Config
    name: str = "proxy"
    relay: Relay[Call] | None = None
    interceptor: Interceptor | None = None
    _stopped: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        cfg = self.cfg
        self.listen = unix_path(cfg, "proxy", "listen")
        self.backend = unix_path(cfg, "node", "runtime_endpoint")
        if cfg.proxy.image_endpoint and cfg.proxy.image_endpoint != cfg.node.runtime_endpoint:
            # One connection pairs with one backend; see docs/proxy.md.
            reason = "a separate image endpoint is not supported yet: leave it empty"
            raise ConfigError(cfg.source, reason, "proxy", "image_endpoint")

    async def prepare(self) -> None:
        check_socket_dir(self.listen)
        try:
            await wait_for_runtime(f"unix://{self.backend}", self.cfg.proxy.connect_timeout_seconds)
        except RuntimeUnreachable as e:
            raise StartupError(str(e)) from None

    async def rebuild(self, store: Store) -> None:
        stats = store.reconcile(*await list_records(f"unix://{self.backend}", store.containers.keys()))
        log.info("store rebuilt", extra={"source": "runtime", **stats})

    async def serve(self, lifecycle: Lifecycle, ready: Callable[[str], None]) -> int:
        cfg = self.cfg
        janitor = TaskJanitor(self.backend, cfg.proxy.runtime_namespace) if cfg.proxy.clear_orphan_tasks else None
        self.interceptor = Interceptor(lifecycle, janitor)
        self.relay = Relay(self.backend, self.interceptor, cfg.proxy.max_message_bytes)
        await bind(self.relay, self.listen)
        log.info("serving", extra={"listen": self.listen, "runtime": self.backend})
        ready("serving")
        await self._stopped.wait()
        cut = await self.relay.drain(cfg.proxy.drain_seconds)
        log.info("drained", extra={"calls_cut_off": cut})
        return 0

    def stop(self) -> None:
        self._stopped.set()

    def reconfigure(self, cfg: cfgmod.Config) -> None:
        """Nothing of [proxy] changes without a restart: the socket and the runtime stay as bound."""

    async def close(self) -> None:
        if self.interceptor is not None:
            await self.interceptor.close()
        if self.relay is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.listen)


def check_socket_dir(listen: str) -> None:
    """The socket's directory must not let anyone else replace the socket under kubelet."""
    d = Path(listen).parent
    try:
        d.mkdir(parents=True, exist_ok=True, mode=0o755)
        st = d.stat()
    except OSError as e:
        raise StartupError(f"cannot create socket directory {d}: {e.strerror}") from None
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or st.st_uid not in (0, os.geteuid()):
        raise StartupError(
            f"socket directory {d} is writable by others (mode {stat.filemode(st.st_mode)}, uid {st.st_uid}); "
            "make it owned by root and not group/world-writable"
        )


def claim_socket_path(listen: str) -> None:
    """Remove a stale socket; refuse if a live process still answers on it."""
    if os.path.exists(listen):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(listen)
        except OSError:
            os.unlink(listen)  # stale socket from a previous run
        else:
            raise StartupError(f"another process is already serving on {listen}")
        finally:
            probe.close()


async def bind(relay: Relay[Call], listen: str) -> None:
    claim_socket_path(listen)
    old = os.umask(0o177)  # the socket exists as 0600 from its first instant
    try:
        await relay.start(listen)
    except OSError as e:
        raise StartupError(f"cannot listen on {listen}: {e.strerror}") from None
    finally:
        os.umask(old)
    os.chmod(listen, 0o600)
