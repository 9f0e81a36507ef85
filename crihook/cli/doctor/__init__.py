"""`crihook doctor`: checks a node the way an operator would, one finding per check, each with a
fix in plain words. Exit status 1 when any check failed; warnings alone leave it 0.

The checks read everything through the configuration (sockets, node roots, checkpoint, state
dir), so tests point them at trees and daemons they made. This module is the command: which checks
run in which order (`diagnose`) and its flags. The checks live by subject (cri, gpu, files), their
parsing in parse (pure), the table and the JSON in output.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from crihook.base.config import DEFAULT_CONFIG
from crihook.cli.doctor.cri import check_kubelet, check_proxy, check_runtime
from crihook.cli.doctor.files import check_config, check_hook_servers, check_state_dir
from crihook.cli.doctor.finding import Finding, exit_status
from crihook.cli.doctor.gpu import CONTAINERD_CONFIG, check_cdi, check_checkpoint, check_nvml, node_gpus
from crihook.cli.doctor.nri import check_evictions, check_kubelet_nri, check_nri
from crihook.cli.doctor.output import render, render_json
from crihook.cli.mode import running
from crihook.devices.nvml import NodeGpus


def diagnose(
    config_path: str | None,
    timeout: float = 3.0,
    gpus: NodeGpus | None = None,
    containerd_config: str = CONTAINERD_CONFIG,
    mode: str = "auto",
) -> list[Finding]:
    """`mode`: "proxy" or "nri" checks the node for that mode; "auto" for the one crihook runs in
    (NRI when only `crihook nri` runs, proxy otherwise)."""
    config, finding = check_config(config_path)
    findings = [finding]
    runtime_finding, runtime = check_runtime(config.node, timeout)
    findings.append(runtime_finding)
    daemons = running(config.node.proc_root)
    nri = next((d for d in daemons if d.mode == "nri"), None)
    if mode == "nri" or (mode == "auto" and nri is not None and all(d.mode == "nri" for d in daemons)):
        findings.append(check_nri(config, runtime, nri))
        findings.append(check_kubelet_nri(config))
        findings.append(check_evictions(config))
    else:
        findings.append(check_proxy(config.proxy, runtime, timeout))
        findings.append(check_kubelet(config.proxy, config.node))
    gpus = gpus if gpus is not None else node_gpus(config.node)
    findings.append(check_nvml(config.node, gpus))
    findings.append(check_cdi(config.hooks.options.get("gpu"), runtime, gpus, containerd_config))
    findings.append(check_checkpoint(config.node, config.hooks.options.get("gpu")))
    findings.append(check_state_dir(config.proxy))
    findings.append(check_hook_servers(config))
    return findings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="crihook's config file (default %(default)s)")
    parser.add_argument(
        "--timeout", type=float, default=3.0, help="seconds to wait for each socket to answer (default %(default)s)"
    )
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    parser.add_argument(
        "--mode",
        choices=("auto", "proxy", "nri"),
        default="auto",
        help="check the node for this mode (default: the one crihook runs in; proxy when none runs)",
    )
    parser.add_argument(
        "--containerd-config",
        default=CONTAINERD_CONFIG,
        help="containerd's config file, read for its CDI settings (default %(default)s)",
    )


def run(args: argparse.Namespace) -> int:
    # Findings carry every reason; the layers below (NVML) would say the same again in log lines.
    logging.getLogger("crihook").addHandler(logging.NullHandler())
    findings = diagnose(args.config, args.timeout, containerd_config=args.containerd_config, mode=args.mode)
    if args.json:
        sys.stdout.write(render_json(findings))
    else:
        source = args.config if Path(args.config).exists() else f"the built-in defaults (no {args.config})"
        sys.stdout.write(render(findings, source))
    return exit_status(findings)
