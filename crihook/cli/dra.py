"""`crihook dra`: the DRA driver gpu.crihook.io on this node (docs/dra.md): the kubelet plugin
(crihook.dra.driver) and the ResourceSlice publisher (crihook.dra.publisher), in one process apart
from the node daemon."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from pathlib import Path

from crihook.base import config as cfg
from crihook.base import log as logsetup
from crihook.devices.nvml import GpuIndex, Nvml
from crihook.devices.reporter import api_client_from, load_partition_table
from crihook.dra.driver import Driver, Paths, Plugin, api_fetch
from crihook.dra.publisher import Publisher
from crihook.dra.state import StateError
from crihook.hooks.gpu_edit import GpuOptions
from crihook.node import systemd

log = logging.getLogger("crihook.dra")
SWITCH = {"on": True, "off": False, "auto": None}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=str(cfg.DEFAULT_CONFIG), help="crihook configuration file")
    p.add_argument("--kubeconfig", help='overrides reporter.kubeconfig ("in-cluster" for a pod)')
    p.add_argument("--node-name", help="overrides node.name")
    p.add_argument("--kubelet-root", default="/var/lib/kubelet", help="kubelet's --root-dir")
    p.add_argument("--state-dir", default="/var/lib/crihook", help="where the prepared claims are kept")
    p.add_argument("--cdi-dir", default="/var/run/cdi", help="where the runtime reads CDI specs")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between ResourceSlice rounds")
    for name, what in (("consumable-capacity", "GPUs shared by capacity"), ("device-taints", "unhealthy GPUs tainted")):
        p.add_argument(
            f"--{name}", choices=tuple(SWITCH), default="auto", help=f"{what}; auto: from Kubernetes 1.36 on"
        )
    p.add_argument("--no-publish", action="store_true", help="serve the kubelet plugin only; publish no slices")


def run(args: argparse.Namespace) -> int:
    try:
        conf = cfg.load(args.config, {"reporter": {"kubeconfig": args.kubeconfig}, "node": {"name": args.node_name}})
        logsetup.setup(conf.proxy.log_level)
        _, gpu = conf.hooks.table("gpu", GpuOptions)
        table = load_partition_table(conf.reporter.partition_table)
    except cfg.ConfigError as e:
        print(f"crihook dra: {e}", file=sys.stderr)
        return 2
    if not conf.reporter.kubeconfig:
        print("crihook dra: no kubeconfig (set reporter.kubeconfig or --kubeconfig)", file=sys.stderr)
        return 2
    node = conf.node.name or socket.gethostname()
    try:
        api_client = api_client_from(conf.reporter.kubeconfig)
    except Exception as e:  # unreadable kubeconfig
        print(f"crihook dra: {e}", file=sys.stderr)
        return 2
    nvml = Nvml(conf.node.nvml_library, conf.node.sys_root)
    index = GpuIndex(nvml)
    paths = Paths(Path(args.kubelet_root), Path(args.state_dir), Path(args.cdi_dir), conf.node.dev_root.rstrip("/"))
    publisher = None
    if not args.no_publish:
        chosen = {"consumable_capacity": SWITCH[args.consumable_capacity], "device_taints": SWITCH[args.device_taints]}
        force = {k: v for k, v in chosen.items() if v is not None}
        publisher = Publisher(node, api_client, nvml, index, table, None, args.interval, force)
    driver = Driver(
        node,
        index,
        api_fetch(api_client),
        paths,
        gpu.hami_core,
        fetch_pod=api_fetch(api_client, "pod"),
        taken=publisher.given_out if publisher is not None else frozenset,
    )
    try:
        driver.start()
    except StateError as e:
        print(f"crihook dra: {e}", file=sys.stderr)
        return 1
    if publisher is not None:
        publisher.start()
    try:
        asyncio.run(_serve(Plugin(driver)))
    finally:
        if publisher is not None:
            publisher.stop()
        nvml.close()
    return 0


async def _serve(plugin: Plugin) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await plugin.start()
    log.info("DRA driver serving", extra={"node": plugin.driver.node})
    # systemd (crihook-dra.service, Type=notify): started once both sockets serve; the watchdog's
    # pings come from this loop, so a stalled loop gets the driver restarted
    systemd.notify("READY=1")
    interval = systemd.watchdog_interval()
    pings = asyncio.create_task(systemd.watchdog(interval)) if interval else None
    await stop.wait()
    if pings is not None:
        pings.cancel()
    await plugin.stop()
