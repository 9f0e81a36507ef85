"""`crihook nri`: crihook as an NRI plugin of the container runtime (crihook.nri). It dials the
runtime's NRI socket and stays registered, dialing again after every drop; started by the runtime
as a pre-registered plugin (`NRI_PLUGIN_SOCKET` set), it serves the socket it was given and exits
when that closes. For now it runs the pass-through handler: registered, nothing adjusted."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from crihook.base import config as cfgmod
from crihook.base import log as logmod
from crihook.base.config import ConfigError
from crihook.nri.stub import ConnectionLost, PassThrough, Plugin, inherited_socket

log = logging.getLogger("crihook.nri")

DEFAULT_SOCKET = "/var/run/nri/nri.sock"


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


def plugin_from(args: argparse.Namespace) -> Plugin:
    """The plugin these flags and the environment describe; the runtime's NRI_PLUGIN_* win."""
    inherited = inherited_socket()
    if inherited is None:
        return Plugin(PassThrough(), args.plugin_name, args.plugin_index, socket_path=args.nri_socket)
    fd, name, index = inherited
    return Plugin(PassThrough(), name or args.plugin_name, index or args.plugin_index, fd=fd)


async def serve(plugin: Plugin) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, plugin.stop)
    where = f"fd {plugin.fd}" if plugin.fd is not None else plugin.socket_path
    log.info("NRI plugin starting", extra={"plugin": f"{plugin.index}-{plugin.name}", "socket": where})
    await plugin.run()


def run(args: argparse.Namespace) -> int:
    try:
        cfg = cfgmod.load(args.config, {"proxy": {"state_dir": args.state_dir, "log_level": args.log_level}})
        logmod.setup(cfg.proxy.log_level)
        plugin = plugin_from(args)
    except (ConfigError, ValueError) as e:
        print(f"crihook: {e}", file=sys.stderr)
        return 2
    try:
        import uvloop

        uvloop.run(serve(plugin))
    except ConnectionLost as e:
        log.error("cannot serve the runtime", extra={"error": str(e)})
        return 1
    return 0
