"""The `crihook` command. Each subcommand is a module of this package exposing `add_arguments(parser)`
and `run(args) -> int`; it parses flags and wires the packages below, which hold the work. A module
loads only when its subcommand runs."""

from __future__ import annotations

import argparse
import importlib
import sys

from crihook import __version__

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("crihook.cli.serve", "run the CRI proxy in front of containerd"),
    "nri": ("crihook.cli.nri", "run as an NRI plugin of containerd (no kubelet change)"),
    "doctor": ("crihook.cli.doctor", "check this node's setup and say how to fix what is wrong"),
    "inspect": ("crihook.cli.inspect", "show what crihook decided and did for a pod or container"),
    "top": ("crihook.cli.top", "per-container GPU use beside the grant, like nvidia-smi per pod"),
    "dra": ("crihook.cli.dra", "run the DRA driver gpu.crihook.io: kubelet plugin and ResourceSlices"),
    "report": ("crihook.cli.report", "publish this node's GPUs and RDMA NICs as a Device and node resources"),
    "scheduler": ("crihook.cli.scheduler", "serve the kube-scheduler extender and the pod admission webhook"),
    "simulate": ("crihook.cli.simulate", "replay a cluster trace through the GPU allocator"),
    "demo": ("crihook.cli.demo", "run pods through crihook on a simulated GPU node (no GPU or kubelet needed)"),
}


def state_dir(args: argparse.Namespace, command: str) -> str | None:
    """The state dir a reading command (`inspect`, `top`) looks in: --state-dir, else the config's
    proxy.state_dir; None, with the reason printed, when the config can not be read."""
    from crihook.base.config import ConfigError, load

    try:
        return str(args.state_dir or load(args.config).proxy.state_dir)
    except ConfigError as e:
        print(f"crihook {command}: {e}", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="crihook", description="GPU and RDMA scheduling at the CRI boundary")
    parser.add_argument("--version", action="version", version=f"crihook {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
