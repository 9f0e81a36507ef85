"""`crihook serve`: the node daemon in proxy mode (crihook.proxy.serve in front of the node daemon,
crihook.node.daemon)."""

from __future__ import annotations

import argparse
import sys

from crihook.base import config as cfgmod
from crihook.base import log as logmod
from crihook.base.config import ConfigError
from crihook.node.daemon import NodeDaemon, Overrides, run_daemon


def add_node_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of the node daemon in either mode."""
    p.add_argument("--config", default=str(cfgmod.DEFAULT_CONFIG), help="TOML config file (default: %(default)s)")
    p.add_argument(
        "--runtime-endpoint",
        "--remote-runtime-service-endpoint",
        dest="runtime_endpoint",
        help="the runtime's CRI socket (unix:///...); [node] runtime_endpoint",
    )
    p.add_argument("--state-dir", dest="state_dir", help="where the store lives")
    p.add_argument(
        "--node-name", dest="node_name", help="this node's Kubernetes name (the metrics' node label); [node] name"
    )
    p.add_argument("--log-level", dest="log_level", choices=logmod.LEVELS)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_node_arguments(p)
    p.add_argument("--listen", "--koord-runtimeproxy-endpoint", dest="listen", help="unix:///path of crihook's socket")
    p.add_argument(
        "--image-endpoint",
        "--remote-image-service-endpoint",
        dest="image_endpoint",
        help="image service socket; default: the runtime endpoint",
    )


def overrides(args: argparse.Namespace) -> Overrides:
    """The configuration the flags set, over the file's (a flag not given sets nothing)."""
    proxy = ("listen", "image_endpoint", "state_dir", "log_level")
    return {
        "proxy": {k: getattr(args, k, None) for k in proxy},
        "node": {"runtime_endpoint": args.runtime_endpoint, "name": args.node_name},
    }


def load_config(args: argparse.Namespace) -> tuple[cfgmod.Config, Overrides] | None:
    """The configuration with the flags on top, the log set up; None, with the reason printed, when
    it is wrong."""
    flags = overrides(args)
    try:
        cfg = cfgmod.load(args.config, flags)
        logmod.setup(cfg.proxy.log_level)
    except (ConfigError, ValueError) as e:
        print(f"crihook: {e}", file=sys.stderr)
        return None
    return cfg, flags


def run(args: argparse.Namespace) -> int:
    loaded = load_config(args)
    if loaded is None:
        return 2
    cfg, flags = loaded
    from crihook.proxy.serve import ProxyDoor  # here: `crihook nri` shares this module and needs no proxy

    try:
        door = ProxyDoor(cfg)
    except ConfigError as e:
        print(f"crihook: {e}", file=sys.stderr)
        return 2
    return run_daemon(NodeDaemon(cfg, door, args.config, flags))
