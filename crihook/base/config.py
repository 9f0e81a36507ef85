"""crihook's configuration: one TOML file, command-line flags on top, checked once at load.

Sections that belong to one component are typed here; each hook's `[hooks.<name>]` table stays a
mapping and is handed to that hook's factory, which validates its own options.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

DEFAULT_CONFIG = Path("/etc/crihook/config.toml")
DEFAULT_LISTEN = "unix:///var/run/crihook/crihook.sock"
DEFAULT_RUNTIME = "unix:///run/containerd/containerd.sock"
MiB = 1 << 20


class ConfigFileError(Exception):
    """The configuration can not be used; the message is one line meant for the operator."""


@dataclass(frozen=True)
class ProxyConfig:
    listen: str = DEFAULT_LISTEN
    runtime_endpoint: str = DEFAULT_RUNTIME
    image_endpoint: str = ""  # empty: same as runtime_endpoint
    state_dir: str = "/var/lib/crihook"
    max_message_bytes: int = 16 * MiB
    connect_timeout_seconds: float = 60.0
    drain_seconds: float = 10.0
    log_level: str = "info"
    metrics_listen: str = "127.0.0.1:9317"  # empty disables
    clear_orphan_tasks: bool = True  # containerd only: see proxy/orphans.py
    runtime_namespace: str = "k8s.io"  # containerd's namespace for CRI's containers

    @property
    def image_backend(self) -> str:
        return self.image_endpoint or self.runtime_endpoint


@dataclass(frozen=True)
class NodeConfig:
    """Where this node's facts live; tests and the demo point these into a temporary tree."""

    name: str = ""  # empty: the host name
    dev_root: str = "/dev"
    sys_root: str = "/sys"
    proc_root: str = "/proc"
    kubelet_checkpoint: str = "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint"
    nvml_library: str = ""  # empty: the driver's libnvidia-ml.so.1 from the loader path


@dataclass(frozen=True)
class HooksConfig:
    order: tuple[str, ...] = ()  # explicit order; hooks not listed follow by priority, then name
    disabled: tuple[str, ...] = ()
    default_timeout_ms: int = 2000
    # Host paths a hook may hand to a container as a device or mount. "{dev_root}" expands.
    allowed_host_paths: tuple[str, ...] = (
        "{dev_root}/nvidia*",
        "{dev_root}/nvidia-caps/*",
        "{dev_root}/infiniband/*",
    )
    options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # [hooks.<name>] tables


@dataclass(frozen=True)
class ReporterConfig:
    kubeconfig: str = ""  # empty: no reporting from `crihook serve`; "in-cluster" for a pod
    interval_seconds: float = 60.0
    partition_table: str = ""  # path to a JSON partition table overriding the built-in ones


@dataclass(frozen=True)
class Config:
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    node: NodeConfig = field(default_factory=NodeConfig)
    hooks: HooksConfig = field(default_factory=HooksConfig)
    reporter: ReporterConfig = field(default_factory=ReporterConfig)
    source: str = ""  # the file it came from, for messages


def _section(cls: type, table: Mapping[str, Any], where: str) -> Any:
    known = {f.name: f for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in table.items():
        f = known.get(key)
        if f is None or key == "options":
            raise ConfigFileError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(known))})")
        default = getattr(cls(), key)
        if isinstance(default, tuple):
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ConfigFileError(f"{where}.{key}: expected a list of strings, got {value!r}")
            value = tuple(value)
        elif isinstance(value, bool) != isinstance(default, bool) or not isinstance(value, type(default)):
            # bool is an int to Python, not to an operator: true for a number (or 1 for a flag) is refused
            if not (isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool)):
                raise ConfigFileError(
                    f"{where}.{key}: expected {type(default).__name__}, got {type(value).__name__} {value!r}"
                )
            value = float(value)
        kwargs[key] = value
    return cls(**kwargs)


def parse(data: Mapping[str, Any], source: str = "") -> Config:
    where = source or "config"
    unknown = set(data) - {"proxy", "node", "hooks", "reporter"}
    if unknown:
        raise ConfigFileError(f"{where}: unknown section(s) {', '.join(sorted(unknown))}")
    hooks_table = dict(data.get("hooks", {}))
    options = {k: v for k, v in hooks_table.items() if isinstance(v, dict)}
    for k in options:
        del hooks_table[k]
    hooks = replace(_section(HooksConfig, hooks_table, f"{where} [hooks]"), options=options)
    return Config(
        proxy=_section(ProxyConfig, data.get("proxy", {}), f"{where} [proxy]"),
        node=_section(NodeConfig, data.get("node", {}), f"{where} [node]"),
        hooks=hooks,
        reporter=_section(ReporterConfig, data.get("reporter", {}), f"{where} [reporter]"),
        source=source,
    )


def load(path: str | Path | None, overrides: Mapping[str, Mapping[str, Any]] | None = None) -> Config:
    """Read `path` (a missing default file means all defaults) and apply `overrides`
    ({"proxy": {"listen": ...}}) on top."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            if p != DEFAULT_CONFIG:
                raise ConfigFileError(f"config file {p} does not exist") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigFileError(f"config file {p}: {e}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigFileError(f"config file {p} is not valid TOML: {e}") from None
    for section, values in (overrides or {}).items():
        data.setdefault(section, {}).update({k: v for k, v in values.items() if v is not None})
    return parse(data, str(path) if path else "")
