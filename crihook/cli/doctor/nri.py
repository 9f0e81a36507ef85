"""The checks of a node in NRI mode: containerd has NRI and serves its socket, `crihook nri` runs,
the runtime applies what the configuration needs, and kubelet talks to containerd directly."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

from crihook.base.config import Config
from crihook.cli.doctor.finding import Finding, Level
from crihook.cli.doctor.parse import kubelet_runtime_endpoint, parse_version, same_endpoint
from crihook.cli.mode import Running
from crihook.devices.kubelet import kubelet_argv
from crihook.node.nriruntime import nri_runtime, start_refusal
from crihook.nri.handler import EVICTIONS_FILE
from crihook.nri.stub import DEFAULT_SOCKET

ENABLE_17 = '[plugins."io.containerd.nri.v1.nri"] disable = false in /etc/containerd/config.toml'


def check_nri(config: Config, runtime: Any, daemon: Running | None) -> Finding:
    name = "NRI"
    socket = daemon.nri_socket if daemon is not None else DEFAULT_SOCKET
    if runtime is not None and runtime.runtime_name == "containerd":
        rt = nri_runtime(runtime.runtime_name, runtime.runtime_version)
        if parse_version(runtime.runtime_version)[:2] < (1, 7):
            return Finding(
                name, Level.FAIL, f"containerd {rt.version} has no NRI", "upgrade containerd, or run proxy mode"
            )
        why = start_refusal(rt, cdi_inject=config.hooks.options.get("gpu", {}).get("inject") == "cdi")
        if why is not None:
            return Finding(name, Level.FAIL, why, "change the configuration, upgrade containerd, or run proxy mode")
    try:
        is_socket = stat.S_ISSOCK(Path(socket).stat().st_mode)
    except OSError:
        is_socket = False
    if not is_socket:
        return Finding(
            name,
            Level.FAIL,
            f"no NRI socket at {socket}: containerd's NRI is off",
            f"containerd 1.7: {ENABLE_17}, then systemctl restart containerd; 2.x: remove what disables it",
        )
    if daemon is None:
        return Finding(
            name,
            Level.FAIL,
            f"containerd serves NRI at {socket}, but crihook nri is not running",
            "systemctl start crihook-nri; journalctl -u crihook-nri -n 50 says why it stopped",
        )
    return Finding(name, Level.OK, f"{daemon.describe()} at {socket}")


def check_kubelet_nri(config: Config) -> Finding:
    """In NRI mode kubelet talks to containerd itself; pointed at crihook's proxy socket, it reaches
    nothing."""
    name = "kubelet"
    argv = kubelet_argv(config.node.proc_root)
    if argv is None:
        return Finding(name, Level.WARN, "kubelet is not running on this node", "systemctl status kubelet")
    try:
        endpoint, source = kubelet_runtime_endpoint(argv, lambda p: Path(p).read_text())
    except ValueError as e:
        return Finding(name, Level.FAIL, str(e), "fix kubelet's --config file, then systemctl restart kubelet")
    if same_endpoint(endpoint, config.proxy.listen):
        return Finding(
            name,
            Level.FAIL,
            f"kubelet uses crihook's proxy socket {endpoint} ({source}), but this node runs NRI mode",
            "install.sh --uninstall, then install.sh --mode nri (takes kubelet's drop-in away)",
        )
    return Finding(name, Level.OK, f"kubelet talks to the runtime at {endpoint} ({source}); crihook is its NRI plugin")


def check_evictions(config: Config) -> Finding:
    """Containers `crihook nri` found reaching an ungranted GPU whose eviction keeps failing (it
    retries with back-off until done or the container is gone, and lists them in EVICTIONS_FILE)."""
    name = "evictions"
    path = Path(config.proxy.state_dir) / EVICTIONS_FILE
    try:
        pending = json.loads(path.read_text())
    except FileNotFoundError:
        return Finding(name, Level.OK, "no eviction pending")
    except (OSError, ValueError) as e:
        return Finding(name, Level.WARN, f"{path} can not be read ({e})", "crihook nri rewrites it at its next try")
    if not isinstance(pending, list) or not pending:
        return Finding(name, Level.OK, "no eviction pending")
    first = pending[0] if isinstance(pending[0], dict) else {}
    return Finding(
        name,
        Level.FAIL,
        f"{len(pending)} container(s) reaching an ungranted GPU not evicted yet, e.g. container"
        f" {first.get('container')} of pod {first.get('pod')} ({first.get('what')}): {first.get('tries')} tries,"
        f" last error: {first.get('error')}",
        "crihook nri stops them through the CRI socket ([proxy] runtime_endpoint): make it reachable, or stop"
        " them yourself (crictl stop <id>)",
    )
