"""Facts about the node's kubelet read from outside: its command line and the directories it uses.

Shared by `crihook doctor` and the gpu hook. Kubelet keeps the device-plugin socket and checkpoint
in /var/lib/kubelet/device-plugins whatever its --root-dir (the path is a constant of the
device-plugin API, `DevicePluginPath` in k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1), while the
pods directory is `<root dir>/pods` (pkg/kubelet/kubelet_getters.go getPodsDir). --root-dir is a
flag only, not a KubeletConfiguration field (cmd/kubelet/app/options/options.go).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

DEFAULT_ROOT_DIR = "/var/lib/kubelet"
CHECKPOINT = "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint"


def flag_value(argv: Sequence[str], name: str) -> str | None:
    """The last value of `--name=value` or `--name value` (Go's flag package: the last one wins)."""
    value = None
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{name}="):
            value = arg.split("=", 1)[1]
        elif arg == f"--{name}" and i + 1 < len(argv):
            value = argv[i + 1]
    return value


def kubelet_argv(proc_root: str) -> list[str] | None:
    """The command line of the running kubelet, or None (also when `proc_root` can not be listed)."""
    try:
        entries = list(Path(proc_root).iterdir())
    except OSError:
        return None
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != "kubelet":
                continue
            raw = (entry / "cmdline").read_bytes()
        except OSError:  # the process ended while we looked
            continue
        return raw.rstrip(b"\0").decode(errors="replace").split("\0")
    return None


def pods_dir(argv: Sequence[str]) -> str:
    """Where kubelet keeps a directory per pod, for its command line."""
    return os.path.join(os.path.normpath(flag_value(argv, "root-dir") or DEFAULT_ROOT_DIR), "pods")
