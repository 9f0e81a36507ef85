"""`crihook serve`: the node daemon.

Start order is the contract with systemd and kubelet: the runtime answers (retry with back-off),
the store is rebuilt from it, then the socket is bound and READY=1 sent. kubelet therefore never
reaches a crihook that does not know the node's pods yet. SIGTERM drains in-flight calls and exits
0; SIGHUP reloads the hook configuration without dropping a connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import stat
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import Message

from crihook.base import config as cfgmod
from crihook.base import metrics
from crihook.base.config import ConfigError
from crihook.base.endpoint import unix_socket_path
from crihook.devices.collector import UsageCollector, start_usage
from crihook.devices.nvml import GpuIndex
from crihook.hooks.base import NeedsStore, OwnsGpus
from crihook.hooks.chain import HookChain
from crihook.hooks.executor import DaemonThreads
from crihook.hooks.registry import build_chain
from crihook.node.container import listed_container
from crihook.node.pod import listed_pod
from crihook.node.records import ContainerRecord, PodRecord
from crihook.node.store import Store
from crihook.proto import runtime_v1_pb2 as cri
from crihook.proto import runtime_v1_pb2_grpc as cri_grpc
from crihook.proxy import systemd
from crihook.proxy.intercept import Call, Interceptor
from crihook.proxy.orphans import TaskJanitor
from crihook.proxy.relay import Relay

log = logging.getLogger("crihook.proxy")


class StartupError(Exception):
    """Serving is impossible with a configuration that is right: the node is not as it must be (the
    runtime does not answer, the socket's directory is unsafe, another process serves). Not a
    ConfigError: editing the file does not fix it. The message is one line for the operator."""


def unix_path(cfg: cfgmod.Config, key: str) -> str:
    """The socket file of the [proxy] endpoint `key`. Raises ConfigError."""
    endpoint = getattr(cfg.proxy, key)
    path = unix_socket_path(endpoint)
    if path is None:
        reason = f"{endpoint!r} is not a unix socket endpoint with an absolute path (unix:///path)"
        raise ConfigError(cfg.source, reason, "proxy", key)
    return path


@dataclass
class Daemon:
    cfg: cfgmod.Config
    config_path: str | None = None
    relay: Relay[Call] | None = None
    store: Store | None = None
    interceptor: Interceptor | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    reporter: Any = None
    usage: UsageCollector | None = None
    _closing: set[asyncio.Task[None]] = field(default_factory=set)
    # SIGHUP's reads (the file, the hooks' own directories) run here: a file system that stalls
    # holds this thread, never the event loop, and never crihook's exit
    _reload_thread: DaemonThreads = field(default_factory=lambda: DaemonThreads(1, "crihook-reload"))
    _reloading: asyncio.Lock = field(default_factory=asyncio.Lock)

    def chain(self, cfg: cfgmod.Config) -> HookChain:
        chain = build_chain(cfg.hooks, cfg.node)
        if self.store is not None:
            attach_store(chain, self.store)
        return chain

    async def main(self) -> None:
        cfg = self.cfg
        listen = unix_path(cfg, "listen")
        backend = unix_path(cfg, "runtime_endpoint")
        if cfg.proxy.image_backend != cfg.proxy.runtime_endpoint:
            # One connection pairs with one backend; see docs/proxy.md.
            reason = "a separate image endpoint is not supported yet: leave it empty"
            raise ConfigError(cfg.source, reason, "proxy", "image_endpoint")
        chain = self.chain(cfg)
        check_socket_dir(listen)
        await wait_for_backend(backend, cfg.proxy.connect_timeout_seconds)
        self.store = Store(cfg.proxy.state_dir)
        state = self.store.load()
        stats = self.store.reconcile(*await list_runtime(backend, self.store.containers.keys()))
        log.info("store rebuilt", extra={"file": state, **stats})
        attach_store(chain, self.store)
        janitor = TaskJanitor(backend, cfg.proxy.runtime_namespace) if cfg.proxy.clear_orphan_tasks else None
        self.interceptor = Interceptor(chain, self.store, janitor)
        self.relay = Relay(backend, self.interceptor, cfg.proxy.max_message_bytes)
        await bind(self.relay, listen)
        metrics_server = None
        if cfg.proxy.metrics_listen:
            try:
                metrics_server = await metrics.serve(cfg.proxy.metrics_listen)
            except (OSError, ValueError) as e:
                raise StartupError(f"metrics endpoint {cfg.proxy.metrics_listen}: {e}") from None
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._stop.set)
        loop.add_signal_handler(signal.SIGINT, self._stop.set)
        loop.add_signal_handler(signal.SIGHUP, self.reload)
        tasks = []
        interval = systemd.watchdog_interval()
        if interval:
            tasks.append(loop.create_task(systemd.watchdog(interval)))
        self.reporter = reporter = start_reporter(cfg, chain)
        self.usage = start_usage(cfg, self.store, cfg.proxy.state_dir)
        systemd.notify("READY=1\nSTATUS=serving")
        log.info(
            "serving", extra={"listen": listen, "runtime": backend, "hooks": ",".join(h.hook.name for h in chain.hooks)}
        )
        self.ready.set()
        await self._stop.wait()
        systemd.notify("STOPPING=1")
        cut = await self.relay.drain(cfg.proxy.drain_seconds)
        await self.interceptor.close()
        await self.interceptor.chain.close()
        if reporter is not None:
            await asyncio.to_thread(reporter.stop)
        if self.usage is not None:
            await asyncio.to_thread(self.usage.stop)
        await self.store.close()
        for t in tasks:
            t.cancel()
        if metrics_server is not None:
            metrics_server.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(listen)
        log.info("stopped", extra={"calls_cut_off": cut})

    def stop(self) -> None:
        self._stop.set()

    def reload(self) -> None:
        """SIGHUP: the configuration read and the new chain built off the event loop, then swapped in
        on it. Reloads run one at a time; the running configuration serves meanwhile."""
        task = asyncio.get_running_loop().create_task(self._reload())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _reload(self) -> None:
        async with self._reloading:
            try:
                cfg = self.cfg
                if self.config_path:
                    cfg = await asyncio.get_running_loop().run_in_executor(
                        self._reload_thread, cfgmod.load, self.config_path, {"proxy": {}}
                    )
                chain = await asyncio.get_running_loop().run_in_executor(
                    self._reload_thread, build_chain, cfg.hooks, cfg.node
                )
            except ConfigError as e:
                log.error("reload failed, keeping the running configuration", extra={"error": str(e)})
                return
            except Exception:  # a hook that can not be made: the operator's to fix, not a reason to stop
                log.exception("reload failed, keeping the running configuration")
                return
        if self.store is not None:
            attach_store(chain, self.store)
        assert self.interceptor is not None
        core = self.interceptor.lifecycle
        old, core.chain = core.chain, chain
        if self.reporter is not None:
            owner = gpu_owner(chain)
            self.reporter.index = owner.gpus if owner else None
            self.reporter.plugin_holds = owner.plugin_holds if owner else None
        # Calls already running keep the old chain's hooks until they finish: close it in the
        # background, once the longest a call can spend in it (every hook's budget) has passed.
        grace = sum(r.timeout for r in old.hooks) + 1.0
        task = asyncio.get_running_loop().create_task(_close_later(old, grace))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        log.info("configuration reloaded", extra={"hooks": ",".join(h.hook.name for h in chain.hooks)})


async def _close_later(chain: HookChain, grace: float) -> None:
    await asyncio.sleep(grace)
    await chain.close()


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
    """The device reporter on its own thread when a kubeconfig is configured. It is not on the CRI
    path: if it can not start, crihook serves all the same and says why."""
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


async def wait_for_backend(path: str, patience: float) -> None:
    """Call Version until the runtime answers, backing off from 0.1 s to 5 s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + patience
    delay = 0.1
    last = ""
    while True:
        async with grpc.aio.insecure_channel(f"unix://{path}") as ch:
            try:
                v = await cri_grpc.RuntimeServiceStub(ch).Version(cri.VersionRequest(version="v1"), timeout=5)
                log.info(
                    "runtime reachable",
                    extra={"runtime": v.runtime_name, "version": v.runtime_version, "api": v.runtime_api_version},
                )
                return
            except grpc.aio.AioRpcError as e:
                last = e.details() or e.code().name
        if loop.time() + delay > deadline:
            raise StartupError(f"runtime at {path} did not answer within {patience:.0f}s: {last}")
        log.warning("waiting for runtime", extra={"runtime": path, "error": last, "retry_in": delay})
        await asyncio.sleep(delay)
        delay = min(delay * 2, 5.0)


async def _statuses(
    call: Callable[..., Awaitable[Any]], ids: list[str], make: Callable[[str], Message], what: str, parallel: int = 8
) -> dict[str, Any]:
    """The verbose status of each object (what the runtime's lists leave out: a sandbox's cgroup
    parent and runtime handler, a container's envs and resources); one whose status can not be had
    is left out, and logged."""
    gate = asyncio.Semaphore(parallel)

    async def one(object_id: str) -> Any:
        async with gate:
            try:
                return await call(make(object_id), timeout=10)
            except grpc.aio.AioRpcError as e:
                log.warning(f"{what} status unavailable", extra={"id": object_id[:13], "error": e.details()})
                return None

    found = await asyncio.gather(*(one(i) for i in ids))
    return {i: status for i, status in zip(ids, found, strict=True) if status is not None}


async def list_runtime(path: str, known: Collection[str] = ()) -> tuple[list[PodRecord], list[ContainerRecord]]:
    """The runtime's sandboxes and containers as store records; `known`: the containers the store
    has, whose envs and resources are its own (the runtime is asked only about the others)."""
    opts: list[tuple[str, Any]] = [("grpc.max_receive_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(f"unix://{path}", options=opts) as ch:
        stub = cri_grpc.RuntimeServiceStub(ch)
        sandboxes = await stub.ListPodSandbox(cri.ListPodSandboxRequest(), timeout=30)
        containers = await stub.ListContainers(cri.ListContainersRequest(), timeout=30)
        statuses = await _statuses(
            stub.PodSandboxStatus,
            [s.id for s in sandboxes.items],
            lambda i: cri.PodSandboxStatusRequest(pod_sandbox_id=i, verbose=True),
            "sandbox",
        )
        # only for containers the store does not know (created while crihook was away)
        unknown = [c.id for c in containers.containers if c.id not in known]
        cstatuses = await _statuses(
            stub.ContainerStatus,
            unknown,
            lambda i: cri.ContainerStatusRequest(container_id=i, verbose=True),
            "container",
        )
    pods = [listed_pod(s, statuses.get(s.id)) for s in sandboxes.items]
    ctrs = [listed_container(c, cstatuses.get(c.id)) for c in containers.containers]
    return pods, ctrs
