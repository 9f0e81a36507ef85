"""crihook's configuration: one TOML file, command-line flags on top, checked once at load.

Every table is declared once, as a frozen dataclass: a field per key, its type and default, and in
its metadata any check beyond the type (`Check`). `check_table` holds a table against such a
declaration, for crihook's own sections at load and for each hook's `[hooks.<name>]` table, whose
declaration is the options type of the hook's factory, when the hook chain is built.
"""

from __future__ import annotations

import os
import tomllib
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

DEFAULT_CONFIG = Path("/etc/crihook/config.toml")
DEFAULT_LISTEN = "unix:///var/run/crihook/crihook.sock"
DEFAULT_RUNTIME = "unix:///run/containerd/containerd.sock"
MiB = 1 << 20

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_D = TypeVar("_D", bound="DataclassInstance")
Check = Callable[[Any], str | None]  # a checked value -> why it is refused, None when it is fine


class ConfigError(Exception):
    """The configuration is wrong: crihook's file, a hook's table in it, a hook-server file, the
    partition table. str() is one line for the operator naming the file, the table and the key,
    so they know what to fix; raised when a configuration is read (start, reload), never per call.
    """

    def __init__(self, file: str, reason: str, table: str = "", key: str = "") -> None:
        where = file or "config"
        if table:
            where += f" [{table}]"
        if key:
            where += f".{key}" if table else f" {key}"
        super().__init__(f"{where}: {reason}")
        self.file = file
        self.table = table
        self.key = key
        self.reason = reason


def absolute_path(value: Any) -> str | None:
    """A `Check`: an absolute, normalised host path."""
    if isinstance(value, str) and os.path.isabs(value) and os.path.normpath(value) == value.rstrip("/"):
        return None
    return f"must be an absolute, normalised path, not {value!r}"


def absolute_path_or_empty(value: Any) -> str | None:
    """A `Check`: an absolute, normalised host path, or empty for none."""
    return None if value == "" else absolute_path(value)


def not_empty(value: Any) -> str | None:
    """A `Check`: a string or list with something in it."""
    return None if value else f"must not be empty, not {value!r}"


def positive(value: Any) -> str | None:
    """A `Check`: a number above 0 (None, an optional key left out, passes)."""
    return None if value is None or value > 0 else f"must be positive, not {value!r}"


def not_negative(value: Any) -> str | None:
    """A `Check`: a number of 0 or more."""
    return None if value >= 0 else f"must be 0 or more, not {value!r}"


@dataclass(frozen=True)
class ProxyConfig:
    listen: str = DEFAULT_LISTEN
    runtime_endpoint: str = ""  # deprecated: [node] runtime_endpoint; used only when that is not given
    image_endpoint: str = ""  # empty: same as [node] runtime_endpoint
    state_dir: str = "/var/lib/crihook"
    max_message_bytes: int = 16 * MiB
    connect_timeout_seconds: float = 60.0
    drain_seconds: float = 10.0
    log_level: str = "info"
    metrics_listen: str = "127.0.0.1:9317"  # empty disables
    # empty: metrics on loopback only; "in-cluster" or a kubeconfig: any address, each scrape's bearer
    # token checked by TokenReview and SubjectAccessReview (get /metrics) with that identity
    metrics_auth_kubeconfig: str = ""
    # PEM files of the metrics endpoint's certificate and key, e.g. a mounted kubernetes.io/tls Secret
    # (reloaded when it changes): HTTPS. Empty: HTTPS with a self-signed certificate made at start
    # when metrics_auth_kubeconfig is set (bearer tokens never cross the network in the clear), else
    # plain HTTP on loopback. Both or neither.
    metrics_tls_cert: str = field(default="", metadata={"check": absolute_path_or_empty})
    metrics_tls_key: str = field(default="", metadata={"check": absolute_path_or_empty})
    clear_orphan_tasks: bool = True  # containerd only: see proxy/orphans.py
    runtime_namespace: str = "k8s.io"  # containerd's namespace for CRI's containers


@dataclass(frozen=True)
class NodeConfig:
    """Where this node's facts live; tests and the demo point these into a temporary tree."""

    name: str = ""  # empty: the host name
    # the runtime's CRI socket: proxy mode forwards to it; both modes list the runtime's pods and
    # containers and stop containers on it (NRI mode's catch-up and eviction)
    runtime_endpoint: str = DEFAULT_RUNTIME
    dev_root: str = "/dev"
    sys_root: str = "/sys"
    proc_root: str = "/proc"
    kubelet_checkpoint: str = "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint"
    nvml_library: str = ""  # empty: the driver's libnvidia-ml.so.1 from the loader path


_NOT_A_KEY = {"key": False}  # a field that is no key of its table


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
    # the [hooks.<name>] tables as written, and the file they came from: each is checked against its
    # hook's declared options when the hook chain is built (`HooksConfig.table`)
    options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, metadata=_NOT_A_KEY)
    source: str = field(default="", metadata=_NOT_A_KEY)

    def table(self, name: str, options: type[_D]) -> tuple[HookPolicy, _D]:
        """The `[hooks.<name>]` table checked against the keys every hook has (`HookPolicy`) and the
        hook's own `options` declaration. Raises ConfigError naming the file, the table and the key."""
        values = self.options.get(name, {})
        common = {f.name for f in fields(HookPolicy)}
        table = f"hooks.{name}"
        policy = check_table(HookPolicy, {k: v for k, v in values.items() if k in common}, self.source, table)
        own = check_table(options, {k: v for k, v in values.items() if k not in common}, self.source, table)
        return policy, own


@dataclass(frozen=True)
class HookPolicy:
    """The keys every `[hooks.<name>]` table may have besides the hook's own options."""

    failure_policy: Literal["fail", "ignore"] = field(default="fail", metadata={"any_case": True})
    """fail: the CRI call fails with an error naming the hook; ignore: logged, the call goes on"""
    timeout_ms: float | None = field(default=None, metadata={"check": positive})
    """time limit of each call of this hook; None: [hooks] default_timeout_ms"""


@dataclass(frozen=True)
class NoOptions:
    """The options of a hook that has none of its own (rdma): its table takes only `HookPolicy`'s keys."""


@dataclass(frozen=True)
class ReporterConfig:
    kubeconfig: str = ""  # empty: no reporting from `crihook serve`; "in-cluster" for a pod
    interval_seconds: float = 60.0
    partition_table: str = ""  # path to a JSON partition table overriding the built-in ones


@dataclass(frozen=True)
class UsageConfig:
    """Per-container GPU usage (devices/collector.py): NVML's processes attributed to containers."""

    enabled: bool = True
    interval_seconds: float = field(default=10.0, metadata={"check": positive})


@dataclass(frozen=True)
class NriConfig:
    """`crihook nri` (docs/nri.md). At every (re)connection the runtime lists every container; one
    that reaches a GPU nobody granted it (created while crihook was away) is evicted, so kubelet
    makes it again through crihook, or with "report" only logged and counted."""

    synchronize: Literal["evict", "report"] = "evict"


@dataclass(frozen=True)
class Config:
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    node: NodeConfig = field(default_factory=NodeConfig)
    hooks: HooksConfig = field(default_factory=HooksConfig)
    reporter: ReporterConfig = field(default_factory=ReporterConfig)
    usage: UsageConfig = field(default_factory=UsageConfig)
    nri: NriConfig = field(default_factory=NriConfig)
    source: str = ""  # the file it came from, for messages
    # what the file says in a way crihook still reads but will not forever: logged once the log is set up
    deprecations: tuple[str, ...] = ()


def check_table(cls: type[_D], values: Mapping[str, Any], file: str, table: str) -> _D:
    """`values`, one TOML table, held against `cls`, its declaration: a frozen dataclass whose fields
    are the keys, typed (bool, int, float, str, a Literal of strings, tuple[str, ...] for a list,
    another such dataclass for a sub-table, X | None for a key without a default), with any further
    `Check` in the field's metadata ("check" for the value, "each" for each item of a list;
    "any_case" folds a Literal's case). Raises ConfigError naming the file, the table and the key."""
    declared = {f.name: f for f in fields(cls) if f.metadata.get("key", True)}
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        f = declared.get(key)
        if f is None:
            raise ConfigError(file, f"unknown key (known: {', '.join(sorted(declared)) or 'none'})", table, key)
        kwargs[key] = _checked(hints[key], f.metadata, value, file, table, key)
    return cls(**kwargs)


def _checked(tp: Any, meta: Mapping[str, Any], value: Any, file: str, table: str, key: str) -> Any:
    """One value of `values` in check_table, converted to the declared type and checked."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):  # X | None: TOML has no null
        (tp,) = (a for a in typing.get_args(tp) if a is not type(None))
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(file, f"expected a table ([{table}.{key}]), got {_kind(value)} {value!r}", table, key)
        value = check_table(tp, value, file, f"{table}.{key}")
    elif origin is Literal:
        choices = typing.get_args(tp)
        if meta.get("any_case") and isinstance(value, str):
            value = value.lower()
        if value not in choices:
            raise ConfigError(file, f"must be one of {', '.join(map(repr, choices))}, not {value!r}", table, key)
    elif origin is tuple:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(file, f"expected a list of strings, got {value!r}", table, key)
        value = tuple(value)
        for i, item in enumerate(value):
            if (reason := _reason(meta.get("each"), item)) is not None:
                raise ConfigError(file, reason, table, f"{key}[{i}]")
    # bool is an int to Python, not to an operator: true for a number (or 1 for a flag) is refused
    elif tp is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    elif isinstance(value, bool) != (tp is bool) or not isinstance(value, tp):
        raise ConfigError(file, f"expected {tp.__name__}, got {_kind(value)} {value!r}", table, key)
    if (reason := _reason(meta.get("check"), value)) is not None:
        raise ConfigError(file, reason, table, key)
    return value


def _reason(check: Check | None, value: Any) -> str | None:
    return None if check is None else check(value)


def _kind(value: Any) -> str:
    return type(value).__name__


def parse(data: Mapping[str, Any], source: str = "") -> Config:
    unknown = set(data) - {"proxy", "node", "hooks", "reporter", "usage", "nri"}
    if unknown:
        raise ConfigError(source, f"unknown section(s) {', '.join(sorted(unknown))}")
    hooks_table = dict(data.get("hooks", {}))
    options = {k: v for k, v in hooks_table.items() if isinstance(v, dict)}
    for k in options:
        del hooks_table[k]
    hooks = replace(check_table(HooksConfig, hooks_table, source, "hooks"), options=options, source=source)
    proxy = check_table(ProxyConfig, data.get("proxy", {}), source, "proxy")
    if bool(proxy.metrics_tls_cert) != bool(proxy.metrics_tls_key):
        missing = "metrics_tls_key" if proxy.metrics_tls_cert else "metrics_tls_cert"
        raise ConfigError(source, "give the certificate and its key, or neither", "proxy", missing)
    node = check_table(NodeConfig, data.get("node", {}), source, "node")
    deprecations = []
    if proxy.runtime_endpoint:
        where = f"{source or 'config'} [proxy].runtime_endpoint"
        if "runtime_endpoint" in data.get("node", {}):
            deprecations.append(f"{where} is ignored: [node].runtime_endpoint is set; remove the [proxy] key")
        else:
            node = replace(node, runtime_endpoint=proxy.runtime_endpoint)
            deprecations.append(f"{where} is deprecated: move it to [node].runtime_endpoint")
    return Config(
        proxy=proxy,
        node=node,
        hooks=hooks,
        reporter=check_table(ReporterConfig, data.get("reporter", {}), source, "reporter"),
        usage=check_table(UsageConfig, data.get("usage", {}), source, "usage"),
        nri=check_table(NriConfig, data.get("nri", {}), source, "nri"),
        source=source,
        deprecations=tuple(deprecations),
    )


def load(path: str | Path | None, overrides: Mapping[str, Mapping[str, Any]] | None = None) -> Config:
    """Read `path` (a missing default file means all defaults) and apply `overrides`
    ({"proxy": {"listen": ...}}; a None value is no override) on top."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            if p != DEFAULT_CONFIG:
                raise ConfigError(str(p), "the file does not exist") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(str(p), str(e)) from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(str(p), f"not valid TOML: {e}") from None
    for section, values in (overrides or {}).items():
        data.setdefault(section, {}).update({k: v for k, v in values.items() if v is not None})
    return parse(data, str(path) if path else "")
