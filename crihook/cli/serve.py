"""`crihook serve`: the node daemon's command line. The daemon itself (start order, reload, drain)
is crihook.proxy.serve."""

from __future__ import annotations

import argparse
import logging
import sys

from crihook.base import config as cfgmod
from crihook.base import log as logmod
from crihook.base.config import ConfigError
from crihook.proxy.serve import Daemon, StartupError

log = logging.getLogger("crihook.proxy")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=str(cfgmod.DEFAULT_CONFIG), help="TOML config file (default: %(default)s)")
    p.add_argument("--listen", "--koord-runtimeproxy-endpoint", dest="listen", help="unix:///path of crihook's socket")
    p.add_argument(
        "--runtime-endpoint",
        "--remote-runtime-service-endpoint",
        dest="runtime_endpoint",
        help="containerd's CRI socket (unix:///...)",
    )
    p.add_argument(
        "--image-endpoint",
        "--remote-image-service-endpoint",
        dest="image_endpoint",
        help="image service socket; default: the runtime endpoint",
    )
    p.add_argument("--state-dir", dest="state_dir", help="where the store lives")
    p.add_argument("--log-level", dest="log_level", choices=logmod.LEVELS)


def load_config(args: argparse.Namespace) -> cfgmod.Config:
    overrides = {
        "proxy": {
            k: getattr(args, k, None)
            for k in ("listen", "runtime_endpoint", "image_endpoint", "state_dir", "log_level")
        }
    }
    return cfgmod.load(args.config, overrides)


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args)
        logmod.setup(cfg.proxy.log_level)
    except (ConfigError, ValueError) as e:
        print(f"crihook: {e}", file=sys.stderr)
        return 2
    try:
        import uvloop

        uvloop.run(Daemon(cfg, args.config).main())
    except (StartupError, ConfigError) as e:
        log.error("cannot start", extra={"error": str(e)})
        print(f"crihook: {e}", file=sys.stderr)
        return 1
    return 0
