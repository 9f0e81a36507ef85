"""Hook-server configuration in Koordinator's format: one JSON file per server in a directory,

    {"remote-endpoint": "/var/run/koordlet/koordlet.sock",
     "failure-policy": "Fail",
     "runtime-hooks": ["PreRunPodSandbox", "PreCreateContainer"]}

re-read whenever a file is added, changed or removed. A file that can not be used is reported once
(per version of the file) and skipped; it never stops crihook or the other servers.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import stat
from dataclasses import dataclass, field
from typing import Any

from crihook.base.config import ConfigError
from crihook.base.endpoint import unix_socket_path
from crihook.base.metrics import HOOK_SERVER_FILES
from crihook.hooks.base import Stage
from crihook.hooks.remote_protocol import RPCS

log = logging.getLogger("crihook.hooks.remote")

DEFAULT_DIR = "/etc/runtime/hookserver.d"


class Policy(enum.StrEnum):
    FAIL = "Fail"
    IGNORE = "Ignore"


@dataclass(frozen=True, slots=True)
class ServerConfig:
    file: str  # the file's name: orders the servers and names one in logs and errors
    endpoint: str  # absolute path of the server's unix socket
    policy: Policy
    stages: frozenset[Stage]
    ignored_hooks: tuple[str, ...] = ()  # runtime-hooks entries with no RPC in the protocol

    def describe(self) -> dict[str, str]:
        """Log fields naming this server."""
        return {"server": self.file, "endpoint": self.endpoint, "policy": self.policy.value}


def parse_server_config(file: str, raw: bytes) -> ServerConfig:
    """One server file's content. Raises ConfigError naming the file and the field."""
    try:
        data = json.loads(raw)
    except UnicodeDecodeError:
        raise ConfigError(file, "not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise ConfigError(file, f"not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(file, f"must be a JSON object, not {_json_type(data)}")
    endpoint = data.get("remote-endpoint")
    if not isinstance(endpoint, str) or not endpoint:
        raise ConfigError(file, f"must be the path of a unix socket, not {endpoint!r}", key="remote-endpoint")
    path = unix_socket_path(endpoint)
    if path is None:
        reason = f"must be an absolute socket path or unix:///path, not {endpoint!r}"
        raise ConfigError(file, reason, key="remote-endpoint")
    policy_name = data.get("failure-policy") or ""
    if not isinstance(policy_name, str):
        reason = f"must be Fail or Ignore, not {_json_type(policy_name)}"
        raise ConfigError(file, reason, key="failure-policy")
    policy = _POLICIES.get(policy_name.lower())
    if policy is None:
        reason = f"must be Fail or Ignore (empty means Ignore), not {policy_name!r}"
        raise ConfigError(file, reason, key="failure-policy")
    hooks = data.get("runtime-hooks")
    if hooks is None:
        hooks = []
    if not isinstance(hooks, list) or not all(isinstance(h, str) for h in hooks):
        reason = f"must be a list of hook names such as {Stage.PRE_CREATE_CONTAINER.value!r}"
        raise ConfigError(file, reason, key="runtime-hooks")
    served = {s.value: s for s in RPCS}
    stages = frozenset(served[h] for h in hooks if h in served)
    ignored = tuple(h for h in hooks if h not in served)
    return ServerConfig(file, os.path.normpath(path), policy, stages, ignored)


_POLICIES = {"": Policy.IGNORE, "fail": Policy.FAIL, "ignore": Policy.IGNORE}


def is_server_file(name: str) -> bool:
    """`*.json`, not hidden: a Kubernetes ConfigMap mount's `..data` links and dot files are not servers."""
    return name.endswith(".json") and not name.startswith(".")


def read_server_file(directory: str, name: str) -> ServerConfig:
    """One server file, read and parsed. Raises ConfigError, an unreadable file included."""
    try:
        with open(os.path.join(directory, name), "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(name, f"can not be read: {e.strerror or e}") from None
    return parse_server_config(name, raw)


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


@dataclass(slots=True)
class _Known:
    signature: tuple[int, ...]
    config: ServerConfig | None  # None: the file is malformed


@dataclass
class ConfigDir:
    """The configuration directory as last read. `refresh` re-reads only files whose inode, size,
    change or modification time moved, so calling it often costs a directory listing and a stat
    per file."""

    path: str
    servers: tuple[ServerConfig, ...] = ()
    _known: dict[str, _Known] = field(default_factory=dict)
    _missing_reported: bool = False

    def refresh(self) -> bool:
        """Re-read the directory; True if the servers changed."""
        names = self._list()
        changed = False
        for gone in sorted(set(self._known) - set(names)):
            if self._known.pop(gone).config is not None:
                log.info("hook server removed", extra={"server": gone, "dir": self.path})
                changed = True
        for name in names:
            changed |= self._read(name)
        if changed:
            self.servers = tuple(k.config for _, k in sorted(self._known.items()) if k.config is not None)
        HOOK_SERVER_FILES.set(len(self.servers), "in_use")
        HOOK_SERVER_FILES.set(len(self._known) - len(self.servers), "skipped")
        return changed

    def _list(self) -> list[str]:
        try:
            entries = os.listdir(self.path)
        except FileNotFoundError:
            if not self._missing_reported:
                log.info("no hook server directory: no remote hooks", extra={"dir": self.path})
                self._missing_reported = True
            return []
        except OSError as e:
            log.error("cannot list the hook server directory", extra={"dir": self.path, "error": e.strerror})
            return list(self._known)  # keep what is known rather than drop every server
        self._missing_reported = False
        return sorted(n for n in entries if is_server_file(n))

    def _read(self, name: str) -> bool:
        full = os.path.join(self.path, name)
        before = self._known.get(name)
        error = ""
        try:
            st = os.stat(full)
        except FileNotFoundError:  # removed between listing and reading
            gone = self._known.pop(name, None)
            return gone is not None and gone.config is not None
        except OSError as e:
            st, error = None, e.strerror or str(e)
        if st is not None and not stat.S_ISREG(st.st_mode):  # a directory or device named *.json: no server
            gone = self._known.pop(name, None)
            return gone is not None and gone.config is not None
        signature = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) if st is not None else (-1,)
        if before is not None and before.signature == signature:
            return False  # unchanged, or the same failure as last time (reported then)
        config: ServerConfig | None = None
        if st is not None:
            try:
                config = read_server_file(self.path, name)
            except ConfigError as e:
                error = str(e)
        self._known[name] = _Known(signature, config)
        if config is None:
            log.error("hook server file skipped", extra={"server": name, "dir": self.path, "error": error})
            return before is not None and before.config is not None
        if config == (before.config if before else None):
            return False
        fields = {**config.describe(), "hooks": ",".join(sorted(s.value for s in config.stages))}
        log.info("hook server changed" if before and before.config else "hook server added", extra=fields)
        if config.ignored_hooks:
            log.warning(
                "runtime-hooks entries with no RPC ignored",
                extra={"server": name, "ignored": ",".join(config.ignored_hooks)},
            )
        return True
