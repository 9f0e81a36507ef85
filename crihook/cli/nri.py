"""`crihook nri`: crihook as an NRI plugin of the container runtime (crihook.nri). It dials the
runtime's NRI socket and stays registered, dialing again after every drop; started by the runtime
as a pre-registered plugin (`NRI_PLUGIN_SOCKET` set), it serves the socket it was given and exits
when that closes. The hook chain, config file and store are `crihook serve`'s (nri/handler.py);
systemd hears READY=1, and the GPU usage collector starts, once the first Synchronize rebuilt the
store."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

import grpc

from crihook.base import config as cfgmod
from crihook.base import log as logmod
from crihook.base import metrics
from crihook.base.config import ConfigError
from crihook.devices.collector import UsageCollector, start_usage
from crihook.hooks.registry import build_chain
from crihook.node.container import spec_container
from crihook.node.lifecycle import Lifecycle
from crihook.node.pod import listed_nri_pod
from crihook.node.store import Store
from crihook.nri.handler import HookHandler
from crihook.nri.stub import DEFAULT_SOCKET, ConnectionLost, Plugin, inherited_socket
from crihook.proto import nri_v1alpha1_pb2 as api
from crihook.proto import runtime_v1_pb2 as cri
from crihook.proto import runtime_v1_pb2_grpc as cri_grpc
from crihook.proxy import systemd
from crihook.proxy.serve import attach_store

log = logging.getLogger("crihook.nri")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=str(cfgmod.DEFAULT_CONFIG), help="TOML config file (default: %(default)s)")
    p.add_argument("--nri-socket", default=DEFAULT_SOCKET, help="the runtime's NRI socket (default: %(default)s)")
    p.add_argument("--plugin-name", default="crihook", help="name to register as (default: %(default)s)")
    p.add_argument(
        "--plugin-index",
        default="10",
        help="two digits: where crihook runs among the runtime's plugins, lowest first (default: %(default)s)",
    )
    p.add_argument("--state-dir", dest="state_dir", help="where the store lives")
    p.add_argument("--log-level", dest="log_level", choices=logmod.LEVELS)


def plugin_from(args: argparse.Namespace, handler: HookHandler) -> Plugin:
    """The plugin these flags and the environment describe; the runtime's NRI_PLUGIN_* win."""
    inherited = inherited_socket()
    if inherited is None:
        return Plugin(handler, args.plugin_name, args.plugin_index, socket_path=args.nri_socket)
    fd, name, index = inherited
    return Plugin(handler, name or args.plugin_name, index or args.plugin_index, fd=fd)


def handler_from(cfg: cfgmod.Config) -> HookHandler:
    """The hook chain and store of `crihook serve`, behind the NRI handler."""
    chain = build_chain(cfg.hooks, cfg.node)
    store = Store(cfg.proxy.state_dir)
    state = store.load()
    log.info("store loaded", extra={"file": state})
    attach_store(chain, store)
    inject = cfg.hooks.options.get("gpu", {}).get("inject")
    return HookHandler(Lifecycle(chain, store), synchronize_action=cfg.nri.synchronize, cdi_inject=inject == "cdi")


async def serve(cfg: cfgmod.Config, args: argparse.Namespace) -> int:
    handler = handler_from(cfg)
    plugin = plugin_from(args, handler)

    async def evict(evictions: Sequence[api.ContainerEviction]) -> None:
        await stop_containers(cfg.proxy.runtime_endpoint, [e.container_id for e in evictions])

    async def relist() -> tuple[list[api.PodSandbox], list[api.Container]]:
        return await list_runtime(cfg.proxy.runtime_endpoint)

    handler.evict, handler.relist = evict, relist
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, plugin.stop)
    usage: list[UsageCollector] = []
    tasks = [loop.create_task(_ready(handler, cfg, usage))]
    interval = systemd.watchdog_interval()
    if interval:
        tasks.append(loop.create_task(systemd.watchdog(interval)))
    metrics_server = await metrics.serve(cfg.proxy.metrics_listen) if cfg.proxy.metrics_listen else None
    where = f"fd {plugin.fd}" if plugin.fd is not None else plugin.socket_path
    log.info(
        "NRI plugin starting",
        extra={
            "plugin": f"{plugin.index}-{plugin.name}",
            "socket": where,
            "hooks": ",".join(h.hook.name for h in handler.lifecycle.chain.hooks),
        },
    )
    runner = loop.create_task(plugin.run())
    while not runner.done():
        await asyncio.wait([runner], timeout=0.5)
        if handler.refused is not None:
            plugin.stop()
    try:
        runner.result()
    finally:
        systemd.notify("STOPPING=1")
        for t in tasks:
            t.cancel()
        await handler.close()
        await handler.lifecycle.chain.close()
        if usage:
            await asyncio.to_thread(usage[0].stop)
        await handler.lifecycle.store.close()
        if metrics_server is not None:
            metrics_server.close()
    if handler.refused is not None:
        log.error(
            "refusing to serve this runtime", extra={"runtime": handler.runtime.ref, "reason": str(handler.refused)}
        )
        return 1
    return 0


async def stop_containers(endpoint: str, ids: Sequence[str]) -> None:
    """Evict: CRI StopContainer with no grace, on the runtime's own socket. NRI's UpdateContainers
    drops the evictions it carries (containerd applies evictions only from answers to CreateContainer
    and UpdateContainer; docs/nri.md), and this is what containerd's own eviction does."""
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = cri_grpc.RuntimeServiceStub(channel)
        for cid in ids:
            await stub.StopContainer(cri.StopContainerRequest(container_id=cid, timeout=0), timeout=30)


async def list_runtime(endpoint: str) -> tuple[list[api.PodSandbox], list[api.Container]]:
    """Every sandbox and container the runtime lists over CRI, in whatever state, as NRI would show
    them: the store holds what the runtime has (as proxy mode's rebuild does), and a container that
    was being created when containerd died is listed by CRI but by no Synchronize."""
    async with grpc.aio.insecure_channel(endpoint, options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
        stub = cri_grpc.RuntimeServiceStub(ch)
        sandboxes = await stub.ListPodSandbox(cri.ListPodSandboxRequest(), timeout=30)
        listed = await stub.ListContainers(cri.ListContainersRequest(), timeout=30)
        containers = []
        for c in listed.containers:
            try:
                request = cri.ContainerStatusRequest(container_id=c.id, verbose=True)
                status = await stub.ContainerStatus(request, timeout=30)
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.NOT_FOUND:
                    raise
                continue  # removed since it was listed
            containers.append(spec_container(c, status))
    return [listed_nri_pod(s) for s in sandboxes.items], containers


async def _ready(handler: HookHandler, cfg: cfgmod.Config, usage: list[UsageCollector]) -> None:
    """Once the store holds the runtime's containers: the usage collector (into `usage`), then READY=1."""
    await handler.synchronized.wait()
    collector = start_usage(cfg, handler.lifecycle.store, cfg.proxy.state_dir)
    if collector is not None:
        usage.append(collector)
    systemd.notify("READY=1\nSTATUS=registered with the runtime")


def run(args: argparse.Namespace) -> int:
    try:
        cfg = cfgmod.load(args.config, {"proxy": {"state_dir": args.state_dir, "log_level": args.log_level}})
        logmod.setup(cfg.proxy.log_level)
    except (ConfigError, ValueError) as e:
        print(f"crihook: {e}", file=sys.stderr)
        return 2
    try:
        import uvloop

        return uvloop.run(serve(cfg, args))
    except (ConfigError, ValueError) as e:
        print(f"crihook: {e}", file=sys.stderr)
        return 2
    except ConnectionLost as e:
        log.error("cannot serve the runtime", extra={"error": str(e)})
        return 1
