"""`crihook nri`: the node daemon in NRI mode (crihook.nri.serve in front of the node daemon,
crihook.node.daemon): crihook as an NRI plugin of the container runtime."""

from __future__ import annotations

import argparse

from crihook.cli.serve import add_node_arguments, load_config
from crihook.node.daemon import NodeDaemon, run_daemon
from crihook.nri.serve import NriDoor, PluginName
from crihook.nri.stub import DEFAULT_SOCKET


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_node_arguments(p)
    p.add_argument("--nri-socket", default=DEFAULT_SOCKET, help="the runtime's NRI socket (default: %(default)s)")
    p.add_argument("--plugin-name", default="crihook", help="name to register as (default: %(default)s)")
    p.add_argument(
        "--plugin-index",
        default="10",
        help="two digits: where crihook runs among the runtime's plugins, lowest first (default: %(default)s)",
    )


def run(args: argparse.Namespace) -> int:
    loaded = load_config(args)
    if loaded is None:
        return 2
    cfg, flags = loaded
    door = NriDoor(cfg, PluginName(args.plugin_name, args.plugin_index, args.nri_socket))
    return run_daemon(NodeDaemon(cfg, door, args.config, flags))
