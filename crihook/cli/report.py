"""`crihook report`: publish this node's devices once (`--once`) or keep publishing them; the
publishing itself is crihook.devices.reporter."""

from __future__ import annotations

import argparse
import sys
import time

from crihook.base import config as cfg
from crihook.base import log as logsetup
from crihook.devices.reporter import Reporter, ReportError, api_client_from


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=str(cfg.DEFAULT_CONFIG), help="crihook configuration file")
    p.add_argument("--kubeconfig", help='overrides reporter.kubeconfig ("in-cluster" for a pod)')
    p.add_argument("--node-name", help="overrides node.name")
    p.add_argument("--once", action="store_true", help="one round, print what was written, exit")


def run(args: argparse.Namespace) -> int:
    try:
        conf = cfg.load(args.config, {"reporter": {"kubeconfig": args.kubeconfig}, "node": {"name": args.node_name}})
    except cfg.ConfigError as e:
        print(f"crihook report: {e}", file=sys.stderr)
        return 2
    logsetup.setup(conf.proxy.log_level)
    if not conf.reporter.kubeconfig:
        print("crihook report: no kubeconfig (set reporter.kubeconfig or --kubeconfig)", file=sys.stderr)
        return 2
    try:
        reporter = Reporter(conf, api_client_from(conf.reporter.kubeconfig))
    except Exception as e:  # unreadable kubeconfig, bad partition table
        print(f"crihook report: {e}", file=sys.stderr)
        return 2
    if not args.once:
        reporter.start()
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            reporter.stop()
            return 0
    try:
        done = reporter.run_once()
    except ReportError as e:
        print(f"crihook report: {e}", file=sys.stderr)
        return 1
    finally:
        reporter.nvml.close()
    gpus = f"{done.gpus} GPU(s)" + (f" (NVML: {done.reason})" if done.reason else "")
    wrote = ", ".join(done.writes) or "nothing (already up to date)"
    print(f"node {reporter.node_name}: {gpus}, {done.rdma} RDMA NIC(s); wrote {wrote}")
    return 0
